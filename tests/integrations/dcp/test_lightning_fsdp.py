"""Lightning ``S4ModelParallelStrategy``: FSDP2 over 2 gloo processes, checkpoints as a run's delta
steps, top-k removal deletes run steps, resume bit-exact against a run that never stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def test_model_parallel_strategy_saves_a_run_and_resumes_bit_exact(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests/integrations/dcp/lightning_fsdp_worker.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path, stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    # top-1: the step-2 checkpoint was removed, and its run step with it
    assert res["folders"] == [".s4w_dcp", "epoch=1-step=4.ckpt"], res
    assert res["committed"] == [4], res
    assert res["resume_bit_exact"] and res["global_step"] == 6, res
    ptr = json.loads((tmp_path / "ckpts" / "epoch=1-step=4.ckpt" / "s4w_dcp.json").read_text())
    assert ptr["step"] == 4 and ptr["root"] == os.path.join("..", ".s4w_dcp")

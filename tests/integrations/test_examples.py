"""The examples run end to end (small step counts) and report bit-exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = [
    ("lightning", "examples/lightning_char_lm.py", ["--steps", "200"]),
    ("transformers", "examples/hf_tiny_gpt2.py", ["--steps", "100"]),
    ("accelerate", "examples/accelerate_mlp.py", []),
    ("torch", "examples/dcp_fsdp.py", []),
]


@pytest.mark.slow
@pytest.mark.parametrize("pkg,script,args", EXAMPLES, ids=[e[1].split("/")[-1] for e in EXAMPLES])
def test_example(pkg, script, args, tmp_path):
    pytest.importorskip(pkg)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), "--out", str(tmp_path), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    assert last["bit_exact_vs_uninterrupted"] is True
    assert "savings" in r.stdout or "stored" in r.stdout

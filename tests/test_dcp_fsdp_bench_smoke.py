"""benchmarks/dcp_fsdp.py --cpu-smoke: both writers on a tiny FSDP2 model over gloo (2 processes),
so the 2-GPU benchmark cannot rot. Checks what the table is made of, not speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dcp_fsdp_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", S4W_DISABLE_GPU="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "integrations"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "dcp_fsdp.py"), "--cpu-smoke", "--out", str(tmp_path),
         "--work", str(tmp_path / "work")],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads((tmp_path / "dcp_fsdp_smoke.json").read_text())
    runs = {r["writer"]: r for r in doc["runs"]}
    assert set(runs) == {"fs", "s4w"}
    for kind, r in runs.items():
        assert [s["step"] for s in r["saves"]] == [2, 4, 6], kind
        assert all(s["blocked_s"] > 0 and s["save_wall_s"] > 0 for s in r["saves"]), kind
        assert r["loaded_bit_exact"] and r["resume_bit_exact"] and r["reshard_2_to_1"]["bit_exact"], (kind, r)
        assert len(r["bytes_per_step"]) == 3 and r["total_bytes"] > 0
    assert runs["s4w"]["total_bytes"] < runs["fs"]["total_bytes"]
    assert set(doc["targets"]) >= {"later_step_bytes_vs_first", "blocked_vs_fs", "load_speedup"}
    assert "| s4w |" in (tmp_path / "dcp_fsdp_smoke.md").read_text()

"""benchmarks/frameworks.py --smoke: every framework's runs (none, default, s4weights) on a tiny
model on the CPU, so the GPU benchmark cannot rot. Checks what the table is made of, not speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_frameworks_smoke(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "integrations"), env.get("PYTHONPATH", "")])
    env["S4W_DISABLE_GPU"] = "1"
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "frameworks.py"), "--smoke", "--out", str(tmp_path),
         "--work", str(tmp_path / "work"), "--no-fsync-runs", "--throwaway-run", "--keep-runs"],
        env=env, capture_output=True, text=True, timeout=170,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads((tmp_path / "frameworks_smoke.json").read_text())
    runs = {(r["framework"], r["run"]): r for r in doc["runs"]}
    # the throwaway first run ran (a process of its own) and is not among the reported runs
    assert doc["meta"]["throwaway_run"]["framework"] == "lightning" and doc["meta"]["throwaway_run"]["error"] is None
    assert set(runs) == {(fw, run) for fw in ("lightning", "hf", "accelerate", "dcp") for run in ("none", "default", "s4w-cold")} | {
        (fw, "s4w-nofsync-warm") for fw in ("lightning", "hf", "accelerate")}
    for (fw, run), r in runs.items():
        assert "error" not in r, (fw, run, r.get("error"), r.get("log_tail"))
        assert r["wall_s"] > 0 and r["cpu_s"] > 0 and r["process_s"] > 0
        assert r["peak_rss_bytes"] > 0 and r["state_bytes"] > 0
        assert r["profile"]["samples"] > 0
        ph = r["phases"]  # the wall time in parts that add up to it, every step's end seen
        assert ph["steps"] == 6 and min(ph["setup_s"], ph["span_s"], ph["end_s"]) >= 0
        assert ph["setup_s"] + ph["span_s"] + ph["end_s"] == pytest.approx(r["wall_s"], abs=1e-6)
        assert 0 <= ph["blocked_in_span_s"] <= sum(r["blocked_s"])
        if run != "none":  # the overhead's parts add up to it
            assert sum(r["overhead_parts_s"].values()) == pytest.approx(r["overhead_s"], abs=1e-6)
        if run == "none":
            assert r["saves"] == 0 and r["disk_bytes"] == 0, (fw, r["disk_bytes"])
            continue
        assert r["saves"] == 3, (fw, run, r["blocked_s"])
        assert r["disk_bytes"] > 0 and r["wchar"] > 0
        assert r["resume"]["bit_identical"], (fw, run, r["resume"])
        assert r["resume"]["tensors"] > 10
        assert len(r["resume_each_s"]) == 3 and r["resume_s"] == sorted(r["resume_each_s"])[1]  # the median of 3
    # --keep-runs: every run's files stay, a store among them (what `s4w stats` inspects)
    assert {p.name for p in (tmp_path / "work").iterdir()} >= {f"{fw}_{run}" for fw, run in runs}
    assert (tmp_path / "work" / "accelerate_s4w-cold" / ".s4w" / "commits").is_dir()
    for fw in ("lightning", "hf", "accelerate", "dcp"):
        s4w = runs[(fw, "s4w-cold")]
        assert s4w["fsync_calls"] > 0  # the store commits durably; the table reports it
        assert "vs_default" in s4w and s4w["vs_default"]["disk_ratio"] > 0
        assert any(k.startswith(("s4w_core/", "integrations/")) for k, _ in
                   s4w["profile"]["main_s4w_s"] + s4w["profile"]["other_s4w_s"]), (fw, s4w["profile"])
    for fw in ("lightning", "hf", "accelerate"):  # the default's durability: the store fsyncs nothing
        r = runs[(fw, "s4w-nofsync-warm")]
        assert r["fsync_calls"] == 0 and r["durability"].startswith("no fsync"), (fw, r["fsync_calls"])
    md = (tmp_path / "frameworks_smoke.md").read_text()
    assert "## Targets (issue #23)" in md and "lightning s4w-cold: resumed state bit-identical" in md
    assert "## Where the overhead lands" in md and "| hf | s4w-cold |" in md

    # two calls' results (one framework each) merge into one table with the same rows
    for fw in ("lightning", "hf"):
        part = {"meta": doc["meta"], "runs": [r for r in doc["runs"] if r["framework"] == fw]}
        (tmp_path / fw).mkdir()
        (tmp_path / fw / "frameworks_smoke.json").write_text(json.dumps(part))
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "frameworks.py"), "--merge",
         str(tmp_path / "lightning" / "frameworks_smoke.json"), str(tmp_path / "hf" / "frameworks_smoke.json"),
         "--out", str(tmp_path / "merged")],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    merged = (tmp_path / "merged" / "frameworks_smoke.md").read_text()
    for line in md.splitlines():
        if line.startswith(("| lightning |", "| hf |")):
            assert line in merged
    assert "| accelerate |" not in merged


def test_repeated_runs_report_the_median_repeat():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import frameworks
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    rows = []
    for none, s4w in ((5.0, 4.0), (3.0, 1.0), (4.0, 6.0)):  # round-robin: (none, s4w) per repeat
        rows += [{"framework": "hf", "run": "none", "wall_s": none}, {"framework": "hf", "run": "s4w", "wall_s": s4w}]
    rows[-1] = {"framework": "hf", "run": "s4w", "error": "skipped: over --budget-s"}
    rows.append({"framework": "dcp", "run": "none", "error": "failed"})
    got = frameworks.median_repeats(rows)
    assert [(r["framework"], r["run"]) for r in got] == [("hf", "none"), ("hf", "s4w"), ("dcp", "none")]
    assert got[0]["wall_s"] == 4.0 and got[0]["walls_s"] == [5.0, 3.0, 4.0]  # the median, walls in run order
    assert got[1]["wall_s"] == 1.0 and got[1]["walls_s"] == [4.0, 1.0]  # two measured (one skipped): the lower
    assert got[2]["error"] == "failed" and "walls_s" not in got[2]
    assert frameworks._spread(got[1]) == " [1.00-4.00]" and frameworks._spread({"wall_s": 1.0}) == ""

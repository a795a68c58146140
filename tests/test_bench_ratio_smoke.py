"""Smoke tests of benchmarks/bench_ratio.py's ``gpt`` series (the ratio table made on any machine).

* :func:`_train_gpt.ratio_series`: snapshots at the asked steps, every parameter in every group,
  real AdamW moments; :func:`cached_ratio_series` gives back the same tensors from its files.
* :func:`bench_ratio.measure`: a peer's chain size is the smaller of its plain and delta frames,
  per tensor; a second run on the memo codes only s4weights' sizes (the peer is not called).
* ``--series gpt`` end to end on a tiny model in a subprocess, with worker processes and no GPU:
  exit 0, s4weights' columns (no GPU ones) and those of every installed peer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_ratio.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import _train_gpt  # noqa: E402
import bench_ratio  # noqa: E402

TINY = {"model": "tiny", "first": 3, "every": 2, "snapshots": 2}


@pytest.fixture(scope="module")
def series() -> list[tuple[int, dict[str, dict[str, torch.Tensor]]]]:
    return list(_train_gpt.ratio_series("bf16", **TINY))  # type: ignore[arg-type]


def test_ratio_series_snapshots(series: list[tuple[int, dict[str, dict[str, torch.Tensor]]]]) -> None:
    assert [s for s, _ in series] == [3, 5]
    names = [n for n, _ in _train_gpt.GPT(layers=2, d=64, heads=1, ctx=32).named_parameters()]
    for _step, groups in series:
        assert set(groups) == set(_train_gpt.RATIO_GROUPS)
        for g, ts in groups.items():
            assert list(ts) == names, g
            assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts.values())
        sq = torch.cat([t.float().reshape(-1) for t in groups["exp_avg_sq"].values()])
        assert (sq >= 0).all() and (sq > 0).float().mean() > 0.5  # squared gradients, most of them nonzero
    w0, w1 = (torch.cat([t.float().reshape(-1) for t in g["weights"].values()]) for _s, g in series)
    assert not torch.equal(w0, w1)  # the weights moved between the snapshots
    with pytest.raises(ValueError):
        next(_train_gpt.ratio_series("bf16", model="tiny", first=0))


def test_cached_ratio_series_reloads(tmp_path: Path) -> None:
    a = _train_gpt.cached_ratio_series("fp32", str(tmp_path), **TINY)  # type: ignore[arg-type]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(f"gpt-tiny_fp32_cpu_f3_e2_s2_step{s}.pt" for s in (3, 5))
    b = _train_gpt.cached_ratio_series("fp32", str(tmp_path), **TINY)  # type: ignore[arg-type]
    for (sa, ga), (sb, gb) in zip(a, b):
        assert sa == sb
        for g in ga:
            for n, t in ga[g].items():
                assert t.dtype == torch.float32 and torch.equal(t, gb[g][n])


def test_measure_peer_chain_is_best_of_plain_and_delta(
    series: list[tuple[int, dict[str, dict[str, torch.Tensor]]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []

    def fake(t: torch.Tensor, base: torch.Tensor | None) -> int:
        calls.append(base is None)
        nb = t.numel() * t.element_size()
        # plain: half the bytes; delta: a quarter for 2-D tensors, twice the bytes for the others
        return nb // 2 if base is None else (nb // 4 if t.dim() == 2 else 2 * nb)

    monkeypatch.setitem(bench_ratio.CODERS, "fake", fake)
    monkeypatch.setitem(bench_ratio._LABEL, "fake", "fake")
    memo: dict[str, Any] = {}
    res = bench_ratio.measure(series, lambda s: None, memo, "t", peers=("fake",))
    assert calls and not all(calls)
    step1 = series[1][1]
    for g in bench_ratio.GROUPS:
        ts = step1[g].values()
        want = sum(min(t.numel() * t.element_size() // 2, fake(t, t)) for t in ts)
        assert res[g]["fake"]["stored"]["chain"] == want
        assert res[g]["fake"]["plain"] == pytest.approx(2.0, rel=1e-2)
        assert res[g]["s4w"]["plain"] > 1.0 and res[g]["raw"]["chain"] == sum(t.numel() * 2 for t in ts)
    # the second run reads the peer's sizes from the memo and codes only s4weights' again
    monkeypatch.setitem(bench_ratio.CODERS, "fake", lambda t, b: pytest.fail("peer coded twice"))
    again = bench_ratio.measure(series, lambda s: None, memo, "t", peers=("fake",))
    assert again == res
    table = bench_ratio.table({"bf16": res})
    assert "| bf16 exp_avg_sq |" in table and "fake chain" in table and "GPU" not in table


def test_bench_ratio_gpt_tiny_cli(tmp_path: Path) -> None:
    env = dict(os.environ, S4W_DISABLE_GPU="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = tmp_path / "r"
    cmd = [sys.executable, str(SCRIPT), "--series", "gpt", "--gpt-model", "tiny", "--first", "2", "--every", "1"]
    cmd += ["--snapshots", "2", "--precision", "bf16", "--workers", "2", "--cache", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(out.with_suffix(".json").read_text())["results"]["bf16"]
    peers = [p for p in bench_ratio.PEERS if importlib.util.find_spec(p) is not None]
    for g in bench_ratio.GROUPS:
        assert set(res[g]) == {"s4w", "raw", *peers}
        assert all(res[g][c]["plain"] > 1.0 and res[g][c]["chain"] > 1.0 for c in ("s4w", *peers))
    md = out.with_suffix(".md").read_text()
    assert "2 worker processes" in md and "| bf16 weights |" in md and "s4w CPU chain" in md


def test_measure_gpu_failure_keeps_the_cpu_columns(
    series: list[tuple[int, dict[str, dict[str, torch.Tensor]]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ts: dict[str, torch.Tensor], bases: Any, nonzero: bool = True) -> int:
        raise RuntimeError("no GPU writer here")

    monkeypatch.setattr(bench_ratio, "s4w_gpu_size", broken)
    res = bench_ratio.measure(series[:1], lambda s: None, {}, "t", gpu=True, peers=())
    assert res["gpu_error"] == "RuntimeError: no GPU writer here"
    for g in bench_ratio.GROUPS:
        assert set(res[g]) == {"s4w", "raw"} and res[g]["s4w"]["plain"] > 1.0
    assert "GPU" not in bench_ratio.table({"bf16": res})

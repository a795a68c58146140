"""The GPU writer's copy plan to the host (``_Encoded.host_layout``): numpy only, no GPU needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from s4w_core.gpu._coder import Encoded as _Encoded  # noqa: E402


def _enc(off: list[int], ln: list[int]) -> _Encoded:
    n = len(off)
    z = np.zeros(n, dtype=np.int64)
    return _Encoded(torch.empty(0), np.array(off, np.int64), np.array(ln, np.int64), z.astype(bool), "x", z, z, 0)


def test_host_layout_skips_dead_slots_and_keeps_every_chunk() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        ln = rng.integers(1, 300_000, size=n)
        gaps = np.where(rng.random(n) < 0.3, rng.integers(0, 500_000, size=n), rng.integers(0, 64, size=n))
        off = np.cumsum(ln + gaps) - ln
        perm = rng.permutation(n)  # chunks in manifest order need not lie in address order
        off, ln = off[perm], ln[perm]
        e = _enc(off.tolist(), ln.tolist())
        runs, hoff = e.host_layout(gap=1 << 16)
        src = rng.integers(0, 256, size=int((off + ln).max()) + 1, dtype=np.uint8)
        host = np.zeros(sum(b - a for a, b, _h in runs), dtype=np.uint8)
        for a, b, h in runs:
            assert h + b - a <= host.size
            host[h : h + b - a] = src[a:b]
        for i in range(n):  # every chunk's bytes where the layout says
            assert (host[hoff[i] : hoff[i] + ln[i]] == src[off[i] : off[i] + ln[i]]).all()
        # no run spans a gap wider than the limit, runs do not overlap
        for (a1, b1, h1), (a2, _b2, h2) in zip(runs, runs[1:]):
            assert a2 > b1 + (1 << 16) and h2 == h1 + b1 - a1
        assert host.size <= int(ln.sum()) + (1 << 16) * n


def test_host_layout_one_run_for_adjacent_chunks() -> None:
    runs, hoff = _enc([256, 0, 1000], [700, 256, 24]).host_layout()
    assert runs == [(0, 1024, 0)] and hoff.tolist() == [256, 0, 1000]


def test_probe_min_gain_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """``S4W_PROBE_MIN_GAIN`` sets the probe's gate for later planes (1: every sampled later-plane
    chunk stays raw); anything but a number from 0 to 1 is refused, naming the variable."""
    from s4w_core.gpu._coder import PROBE_MIN_GAIN, PROBE_MIN_GAIN_DELTA, probe_min_gain

    monkeypatch.delenv("S4W_PROBE_MIN_GAIN", raising=False)
    assert probe_min_gain() == PROBE_MIN_GAIN
    assert probe_min_gain(delta=True) == PROBE_MIN_GAIN_DELTA < PROBE_MIN_GAIN
    for value, want, want_delta in (("1", 1.0, 1.0), ("0.05", 0.05, 0.05), ("0", 0.0, 0.0),
                                    ("", PROBE_MIN_GAIN, PROBE_MIN_GAIN_DELTA)):
        monkeypatch.setenv("S4W_PROBE_MIN_GAIN", value)  # set, it overrides both defaults
        assert probe_min_gain() == want and probe_min_gain(delta=True) == want_delta
    for bad in ("x", "-0.1", "1.5", "nan"):
        monkeypatch.setenv("S4W_PROBE_MIN_GAIN", bad)
        with pytest.raises(ValueError, match="S4W_PROBE_MIN_GAIN"):
            probe_min_gain()

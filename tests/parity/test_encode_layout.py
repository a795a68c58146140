"""The GPU writer's copy plan to the host (``Encoded.packed_layout``): numpy only, no GPU needed."""

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


def test_packed_layout_puts_every_chunk_back_to_back_in_chunk_order() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        ln = rng.integers(0, 300_000, size=n)
        gaps = np.where(rng.random(n) < 0.5, rng.integers(0, 500, size=n), 0)
        off = np.cumsum(ln + gaps) - ln
        perm = rng.permutation(n) if rng.random() < 0.5 else np.arange(n)  # device order need not be chunk order
        off, ln = off[perm], ln[perm]
        e = _enc(off.tolist(), ln.tolist())
        runs, hoff = e.packed_layout()
        src = rng.integers(0, 256, size=int((off + ln).max()) + 1, dtype=np.uint8)
        host = np.zeros(int(ln.sum()), dtype=np.uint8)
        covered = 0
        for a, b, h in runs:
            assert h + b - a <= host.size
            host[h : h + b - a] = src[a:b]
            covered += b - a
        assert covered == host.size  # the copies fill the buffer exactly: no dead bytes copied
        assert hoff.tolist() == (np.cumsum(ln) - ln).tolist()  # back to back, in chunk order
        for i in range(n):  # every chunk's bytes where the layout says
            assert (host[hoff[i] : hoff[i] + ln[i]] == src[off[i] : off[i] + ln[i]]).all()


def test_packed_layout_one_copy_for_chunks_back_to_back_on_the_device() -> None:
    runs, hoff = _enc([0, 256, 956], [256, 700, 24]).packed_layout()
    assert runs == [(0, 980, 0)] and hoff.tolist() == [0, 256, 956]
    runs, hoff = _enc([256, 0, 1000], [700, 256, 24]).packed_layout()  # out of device order: a copy each
    assert runs == [(256, 956, 0), (0, 256, 700), (1000, 1024, 956)] and hoff.tolist() == [0, 700, 956]


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


def test_the_sink_hands_a_batch_lying_back_to_back_to_the_container_in_one_call() -> None:
    """The I/O thread's sink joins chunks that lie back to back in one host buffer (a batch copied
    in file order) into one ``add_chunks``; chunks elsewhere go one by one. Same file either way."""
    import io

    from s4w_core.format.container import ContainerWriter
    from s4w_core.gpu._encode import _ChunkSink  # noqa: PLC2701 - the GPU writer's own sink

    host = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8)
    mv = memoryview(host)
    other = memoryview(np.arange(10, dtype=np.uint8))
    # chunks 0-2 back to back; then one from another buffer; then two with a hole between them
    items = [(0, 0, "a", mv[0:100]), (0, 1, "a", mv[100:1100]), (1, 0, "b", mv[1100:1500]), (1, 1, "b", other),
             (2, 0, "c", mv[1600:2000]), (2, 1, "c", mv[2100:3000])]
    calls: list[int] = []

    class Counting(ContainerWriter):
        def add_chunks(self, data, lengths):  # type: ignore[no-untyped-def]
            calls.append(len(lengths))
            return super().add_chunks(data, lengths)

    outs = []
    for cls in (ContainerWriter, Counting):
        f = io.BytesIO()
        sink = _ChunkSink(cls(f))
        for n in (2, 2, 2):
            sink.add_job({}, n)
        if cls is ContainerWriter:
            for ji, ci, cid, d in items:
                sink.entries[ji]["chunks"][ci] = [cid, *sink.writer.add_chunk(d)]
        else:
            sink.write(items)
        assert sink.done()
        sink.writer.finish({"e": sink.entries})
        outs.append((f.getvalue(), sink.entries))
    assert calls == [3]
    assert outs[0] == outs[1]

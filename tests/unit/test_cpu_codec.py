"""The CPU path's plane transform (numba kernels against the numpy oracle) and its zstd planes.

The numpy functions of ``s4w_core.planes.reference`` are the oracle; the numba kernels of
``s4w_core.planes._jit`` must give the same bytes for every width, length and base. CI installs
numba (the ``dev`` extra) and sets ``S4W_REQUIRE_NUMBA=1``, so a broken install fails here instead
of skipping.
"""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import s4w_core
from s4w_core import engine
from s4w_core.codecs import ZSTD, zstd_encode_plane
from s4w_core.errors import ChecksumMismatchError, DecodeError
from s4w_core.planes import _jit
from s4w_core.planes import reference as ref
from tests.unit.helpers import assert_same_tensor, chunk_ranges, rebuild, split

if os.environ.get("S4W_REQUIRE_NUMBA") == "1":
    import numba  # noqa: F401 - CI: must be installed
numba_only = pytest.mark.skipif(not _jit.enabled(), reason="numba is not installed (pip install s4weights[numba])")


def _numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S4W_NUMBA", "0")


def _special_words(w: int, n: int, seed: int) -> np.ndarray:
    """Random bit patterns with NaN payloads, +-Inf, denormals and -0.0 mixed in."""
    rng = np.random.default_rng(seed)
    u = np.uint16 if w == 2 else np.uint32
    x = rng.integers(0, 1 << (8 * w), n, dtype=np.uint64).astype(u)
    special = [0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001] if w == 2 else [0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x00000001]
    if n:
        idx = rng.integers(0, n, max(1, n // 8))
        x[idx] = np.array(special, dtype=u)[rng.integers(0, len(special), idx.size)]
    return x.view(np.uint8)


@numba_only
@settings(max_examples=60, deadline=None)
@given(w=st.sampled_from([2, 4]), n=st.integers(0, 5000), seed=st.integers(0, 2**31), with_base=st.booleans())
def test_jit_split_and_merge_equal_numpy(w: int, n: int, seed: int, with_base: bool) -> None:
    raw = _special_words(w, n, seed)
    base = _special_words(w, n, seed + 1) if with_base else None
    planes = np.empty((w, n), dtype=np.uint8)
    assert _jit.split_into(raw, w, base, planes)
    os.environ["S4W_NUMBA"] = "0"
    try:
        oracle = ref._split_np(raw, w, base)
        merged_np = np.empty(n * w, dtype=np.uint8)
        ref.merge_into([oracle[j] for j in range(w)], w, merged_np, base)
    finally:
        del os.environ["S4W_NUMBA"]
    assert np.array_equal(planes, oracle)
    merged = np.empty(n * w, dtype=np.uint8)
    assert _jit.merge_into([planes[j] for j in range(w)], w, merged, base)
    assert np.array_equal(merged, raw) and np.array_equal(merged_np, raw)


@numba_only
@settings(max_examples=60, deadline=None)
@given(
    w=st.sampled_from([2, 4]), rows=st.integers(1, 40), cols=st.integers(1, 300), seed=st.integers(0, 2**31),
    rot=st.booleans(), scaled=st.booleans(),
)
def test_jit_rowcol_probe_and_offsets_equal_numpy(w: int, rows: int, cols: int, seed: int, rot: bool, scaled: bool) -> None:
    """The row/column probe's compiled histograms (plane 0, and plane 0 less its offsets) and the
    writer's compiled offsets are the numpy oracle's (plane0_np, offsets_np, tile_np), for random and for row/column-scaled
    words (offsets far from 0 and 255, where the rounding and the modulo matter)."""
    from s4w_core.planes import rowcol

    words = _special_words(w, rows * cols, seed).view(np.uint16 if w == 2 else np.uint32)
    if scaled:
        g = torch.Generator().manual_seed(seed % (1 << 31))
        x = torch.exp(3 * torch.randn(rows, 1, generator=g)) * torch.exp(3 * torch.randn(1, cols, generator=g))
        x = x * torch.randn(rows, cols, generator=g)
        words = (x.to(torch.bfloat16) if w == 2 else x).reshape(-1).view(torch.uint16 if w == 2 else torch.uint32).numpy()
    got = _jit.rowcol_hists(words, 8 * w - (9 if rot else 8), cols)
    assert got is not None
    p0 = rowcol.plane0_np(words, w, rot)
    row, col = rowcol.offsets_np(p0, cols)
    q = p0 - rowcol.tile_np(row, col, 0, p0.size)
    assert np.array_equal(got[0], np.bincount(p0, minlength=256))
    assert np.array_equal(got[1], np.bincount(q, minlength=256))
    offsets = _jit.rowcol_offsets(words, 8 * w - (9 if rot else 8), cols)  # the writer's offsets, from the words
    assert offsets is not None
    assert np.array_equal(offsets[0], row) and np.array_equal(offsets[1], col)
    assert offsets[0].dtype == row.dtype and offsets[1].dtype == col.dtype
    os.environ["S4W_NUMBA"] = "0"
    try:  # the public entries' numpy paths: the same counts and offsets
        np_path = rowcol.probe_hists(words, w, rot, cols)
        np_offsets = rowcol.offsets_of_words(words, w, rot, cols)
    finally:
        del os.environ["S4W_NUMBA"]
    assert np.array_equal(np_path[0], got[0]) and np.array_equal(np_path[1], got[1])
    assert np.array_equal(np_offsets[0], row) and np.array_equal(np_offsets[1], col)


@numba_only
def test_jit_refuses_mismatched_lengths() -> None:
    """The kernels run without bounds checks: every length is checked before they are called."""
    raw = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError):
        _jit.split_into(raw, 2, None, np.empty((2, 31), dtype=np.uint8))
    with pytest.raises(ValueError):
        _jit.split_into(raw, 2, np.zeros(62, dtype=np.uint8), np.empty((2, 32), dtype=np.uint8))
    with pytest.raises(ValueError):
        _jit.merge_into([np.zeros(32, np.uint8), np.zeros(31, np.uint8)], 2, np.empty(64, np.uint8), None)
    with pytest.raises(ValueError):
        _jit.merge_into([np.zeros(16, np.uint8)] * 4, 4, np.empty(64, np.uint8), np.zeros(60, np.uint8))
    with pytest.raises(ValueError):
        _jit.rowcol_hists(np.zeros(10, np.uint16), 7, 3)  # not whole rows
    with pytest.raises(ValueError):
        _jit.rowcol_hists(np.zeros(10, np.uint16), 9, 5)  # past the word
    with pytest.raises(ValueError):
        _jit.rowcol_offsets(np.zeros(10, np.uint32), 7, 4)  # not whole rows


def test_numba_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    _numpy_only(monkeypatch)
    assert not _jit.enabled()
    assert not _jit.split_into(np.zeros(8, np.uint8), 2, None, np.empty((2, 4), np.uint8))


@pytest.mark.parametrize("numba_on", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_round_trip_both_transforms(monkeypatch: pytest.MonkeyPatch, numba_on: bool, threads: int) -> None:
    """Written with either transform, read with either, on one thread (inline) or a pool."""
    if not numba_on:
        _numpy_only(monkeypatch)
    g = torch.Generator().manual_seed(3)
    state = {
        "bf16": torch.randn(70_000, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(3, 333, generator=g).to(torch.float16),
        "fp32": torch.randn(50_001, generator=g),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 0.0]),
        "ints": torch.arange(1000) % 7,
    }
    old = engine.SEGMENT_ELEMS
    engine.SEGMENT_ELEMS = 1 << 14  # several segments per storage
    try:
        buf = io.BytesIO()
        s4w_core.save(state, buf, profile="portable", threads=threads)
    finally:
        engine.SEGMENT_ELEMS = old
    blob = buf.getvalue()
    monkeypatch.setenv("S4W_NUMBA", "1" if numba_on else "0")
    for env in ("0", "1"):
        monkeypatch.setenv("S4W_NUMBA", env)
        back = s4w_core.load(blob, threads=threads)
        for k, v in state.items():
            assert_same_tensor(v, back[k])
    codecs = {c[0] for s in split(blob)[2]["storages"] for c in s["chunks"]}
    assert "zstd" in codecs and codecs <= {"zstd", "raw", "deflate"}, codecs


def test_small_exponent_planes_keep_the_smaller_code() -> None:
    """Under 64 KiB deflate's header beats zstd's on an exponent plane; the writer keeps the
    smaller of the two there, and zstd above."""
    g = torch.Generator().manual_seed(1)
    small = (0.02 * torch.randn(2048, generator=g)).to(torch.bfloat16)
    big = (0.02 * torch.randn(1 << 18, generator=g)).to(torch.bfloat16)
    buf = io.BytesIO()
    s4w_core.save({"small": small, "big": big}, buf, profile="portable")
    m = split(buf.getvalue())[2]
    by = {s["path"]: s["chunks"] for s in m["storages"]}
    assert by["small"][0][0] == "deflate" and by["big"][0][0] == "zstd", {k: [c[0] for c in v] for k, v in by.items()}
    back = s4w_core.load(buf.getvalue(), threads=1)
    assert torch.equal(back["small"].view(torch.int16), small.view(torch.int16))


@pytest.mark.parametrize("op", ["xor", "sub"])
def test_delta_round_trip_one_thread(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deltas through a store on one thread (the inline executor): ``xor`` is undone inside the
    merge, ``sub`` after it."""
    import tempfile

    from s4w_core.store import CheckpointStore

    monkeypatch.setattr(engine, "choose_delta_op", lambda job, transform: op)
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(200_000, generator=g).to(torch.bfloat16)
    w1 = (w0.float() + 1e-3 * torch.randn(200_000, generator=g)).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as d:
        st_ = CheckpointStore(d, threads=1)
        st_.save({"w": w1}, step=1)
        st_.save({"w": w0}, step=2)
        st_.wait()  # step 1 becomes a delta against step 2 behind the save
        rec = st_.info(1)
        assert rec.kind == "delta" and rec.delta_ops == {op: 1}, rec
        assert torch.equal(st_.load(step=1, threads=1)["w"].view(torch.int16), w1.view(torch.int16))
        st_.close()


def test_one_thread_corrupt_chunk_raises() -> None:
    """The inline executor delivers a chunk's error like the pool does."""
    buf = io.BytesIO()
    s4w_core.save({"w": torch.randn(100_000).to(torch.bfloat16)}, buf, profile="portable")
    blob = bytearray(buf.getvalue())
    off, length = chunk_ranges(bytes(blob))[0]
    blob[off + length // 2] ^= 0x10
    with pytest.raises(ChecksumMismatchError):
        s4w_core.load(bytes(blob), threads=1)


# ----------------------------------------------------------------------------- zstd planes
def test_plane_frames_declare_their_size() -> None:
    data = _special_words(2, 4096, 0)
    frame = zstd_encode_plane(memoryview(data))
    assert zstandard.frame_content_size(frame) == data.size
    assert ZSTD.decode(frame, data.size) == data.tobytes()


def test_zstd_declared_size_must_match() -> None:
    """A frame declaring another size than the manifest's is refused before anything is allocated
    at the declared size."""
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 1000)
    with pytest.raises(DecodeError, match="declares 1000 bytes, expected 999"):
        ZSTD.decode(frame, 999)
    huge = bytearray(frame)
    with pytest.raises(DecodeError):
        ZSTD.decode(bytes(huge[:4]) + b"\xff" * 12, 1000)  # magic, then a garbage header


def test_zstd_frame_without_declared_size() -> None:
    """Frames of other writers may omit the size: streamed, never past the expected length."""
    c = zstandard.ZstdCompressor(write_content_size=False)
    frame = c.compress(b"y" * 5000)
    assert zstandard.frame_content_size(frame) == -1
    assert ZSTD.decode(frame, 5000) == b"y" * 5000
    with pytest.raises(DecodeError):
        ZSTD.decode(frame, 4000)  # decodes more than recorded


def test_zstd_planes_compress_like_huffman_only_deflate() -> None:
    """Exponent planes of trained-like weights: zstd with the plane parameters within 1% of
    deflate's Huffman-only size (the code it replaced), and far below zstd's level 1 defaults'
    loss there (matches in a float plane cost more than they save)."""
    from s4w_core.codecs import DEFLATE

    g = torch.Generator().manual_seed(0)
    w = (0.02 * torch.randn(1 << 20, generator=g)).to(torch.bfloat16)
    plane0 = ref._split_np(w.view(torch.uint8).numpy(), 2, None)[0].copy()
    assert DEFLATE.encode_cpu is not None
    z = len(zstd_encode_plane(memoryview(plane0)))
    d = len(DEFLATE.encode_cpu(memoryview(plane0)))
    assert z <= 1.01 * d, (z, d)


def test_forged_zstd_size_in_file() -> None:
    """End to end: a chunk replaced by a frame that declares another size (padded to the chunk's
    length), its checksum forged to match: a DecodeError naming the size, no wrong bytes."""
    import xxhash

    buf = io.BytesIO()
    s4w_core.save({"w": torch.randn(1 << 16).to(torch.bfloat16)}, buf, profile="portable")  # zstd above 64 KiB
    prefix, _t, m = split(buf.getvalue())
    c = m["storages"][0]["chunks"][0]
    assert c[0] == "zstd" and c[2] > 32
    forged = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * 65535).ljust(c[2], b"\0")
    p = bytearray(prefix)
    p[c[1] : c[1] + c[2]] = forged
    c[3] = xxhash.xxh3_64_hexdigest(forged)
    with pytest.raises(DecodeError, match="declares 65535 bytes, expected 65536"):
        s4w_core.load(rebuild(bytes(p), m))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_loading_does_not_hang() -> None:
    """A child forked while the kernels load (a DataLoader worker, say) gets a working CPU path."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import io, os, sys, torch, s4w_core
        from s4w_core.planes import _jit
        _jit._get(nbytes=_jit.START_AFTER_BYTES)  # starts loading in the background (no-op without numba)
        pid = os.fork()
        if pid == 0:
            x = torch.randn(100_000).to(torch.bfloat16)
            b = io.BytesIO(); s4w_core.save({"x": x}, b, profile="portable")
            ok = torch.equal(s4w_core.load(b.getvalue())["x"].view(torch.int16), x.view(torch.int16))
            _jit.enabled()  # waits for the child's own loader: must return
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@numba_only
def test_small_work_does_not_load_numba() -> None:
    """A process that only codes small tensors never imports numba; one that codes 64 MiB does."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import io, sys, torch, s4w_core
        from s4w_core.planes import _jit
        b = io.BytesIO(); s4w_core.save({"x": torch.randn(1000).to(torch.bfloat16)}, b, profile="portable")
        s4w_core.load(b.getvalue())
        assert "numba" not in sys.modules and not _jit._started, "loaded for a small file"
        b = io.BytesIO(); s4w_core.save({"x": torch.randn(33 << 20).to(torch.bfloat16)}, b, profile="portable")
        assert _jit._started
        assert _jit.enabled()
        """
    )
    r = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@numba_only
def test_exit_while_loading_is_clean(tmp_path: Path) -> None:
    """A process that exits while the kernels load (a short script that saved 64 MiB) exits 0 and
    quietly. With the loader on a daemon thread, CI once saw the interpreter abort at exit
    ("terminate called without an active exception", LLVM still compiling); the loader is now a
    non-daemon thread that exit joins. Cold numba cache, exits at several points of the load."""
    import subprocess
    import sys

    for delay in (0.0, 0.4, 0.8):
        code = (
            "import time\n"
            "from s4w_core.planes import _jit\n"
            "_jit._get(nbytes=_jit.START_AFTER_BYTES)  # what the CPU path does after 64 MiB of work\n"
            "assert _jit._started and not _jit._ready.is_set()\n"
            f"time.sleep({delay})\n"
        )
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / f"cache{delay}"))
        r = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "terminate called" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]


def test_probe_sized_calls_do_not_load_numba() -> None:
    """The encoder's probes transform samples of at most 512 KiB per storage, in GPU runs too: any
    number of them never starts loading numba (1.5-2 s of CPU, mostly holding the GIL); calls of a
    whole large storage do, once they add up to START_AFTER_BYTES."""
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from s4w_core.planes import _jit\n"
        "for _ in range(2 * _jit.START_AFTER_BYTES // (512 << 10)):\n"
        "    _jit._get(nbytes=512 << 10)\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
        "_jit._get(nbytes=_jit.START_AFTER_BYTES)\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    env = dict(os.environ)
    env.pop("S4W_NUMBA", None)
    r = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after = r.stdout.strip().splitlines()[-2:]
    assert "s4w-numba" not in before
    if importlib.util.find_spec("numba") is not None:  # a whole large storage starts the loader (import: > 0.2 s)
        assert "s4w-numba" in after

"""Durable local writes: the early-writeback wrapper changes no byte and starts writeback of each
window as it is written."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from s4w_core import _fsutil
from s4w_core._fsutil import EarlyWriteback, atomic_write


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/POSIX only")
def test_early_writeback_starts_each_window_and_keeps_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, off: int, n: int, advice: int) -> None:
        calls.append((off, n, advice))
        real(fd, off, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    data = os.urandom(10_000)
    p = tmp_path / "f"
    with open(p, "wb") as raw:
        f = EarlyWriteback(raw, window=3000)
        for i in range(0, len(data), 700):
            assert f.write(data[i : i + 700]) == len(data[i : i + 700])
        f.write(memoryview(b"tail"))
    assert p.read_bytes() == data + b"tail"
    # contiguous windows of >= 3000 bytes from 0, each advised DONTNEED (starts writeback)
    assert [c[2] for c in calls] == [os.POSIX_FADV_DONTNEED] * len(calls) and len(calls) == 3
    assert calls[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(calls, calls[1:]))
    assert all(c[1] >= 3000 for c in calls)


def test_early_writeback_passes_through_files_without_descriptor() -> None:
    buf = io.BytesIO()
    f = EarlyWriteback(buf, window=4)
    f.write(b"abcdefgh")
    f.write(bytearray(b"ij"))
    assert buf.getvalue() == b"abcdefghij" and f.tell() == 10  # other methods are the file's


def test_atomic_write_uses_it_and_is_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fsutil, "WRITEBACK_BYTES", 1024)
    dest = tmp_path / "out.bin"
    data = os.urandom(5000)
    with atomic_write(dest) as f:
        assert isinstance(f, EarlyWriteback)
        f.write(data)
    assert dest.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]  # no temporary left


def _groups(seed: int) -> list[list[bytes]]:
    """Chunk groups as a writer hands them over: small ones, one over POSITIONAL_MIN, one over the
    split into threads (4 MiB), with empty and odd-sized chunks."""
    import random

    r = random.Random(seed)
    sizes = [[5, 0, 300], [1 << 19, 3, (1 << 19) + 7, 100_000], [r.randrange(1, 1 << 20) for _ in range(9)], [17]]
    return [[r.randbytes(n) for n in g] for g in sizes]


@pytest.mark.skipif(not hasattr(os, "pwritev"), reason="pwritev is POSIX only")
def test_positional_chunk_groups_write_the_same_bytes_as_a_stream(tmp_path: Path) -> None:
    """ContainerWriter.add_chunks into a local file (positional writes on several threads, the
    stream skipping each region) gives the bytes, offsets and checksums of the plain stream."""
    from s4w_core.format.container import ContainerReader, ContainerWriter

    def write(fp: object) -> list[list[tuple[int, int, str]]]:
        w = ContainerWriter(fp)  # type: ignore[arg-type]
        placed = [w.add_chunks(g) for g in _groups(1)]
        w.finish({"format": "s4weights", "storages": [], "tensors": [], "tree": None, "placed": placed})
        return placed

    buf = io.BytesIO()
    streamed = write(buf)
    p = tmp_path / "c"
    with open(p, "wb") as raw:
        f = EarlyWriteback(raw, window=1 << 20)
        assert f.positional() is not None
        positioned = write(f)
    assert p.read_bytes() == buf.getvalue() and positioned == streamed
    reader = ContainerReader.from_bytes(p.read_bytes())
    for g, offs in zip(_groups(1), positioned):
        for chunk, (off, n, _h) in zip(g, offs):
            assert bytes(reader.read_chunk(off, n)) == chunk


@pytest.mark.skipif(not hasattr(os, "pwritev"), reason="pwritev is POSIX only")
def test_positional_writes_continue_after_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev

    def short(fd: int, bufs: list[memoryview], off: int) -> int:  # at most 1000 bytes a call
        first = memoryview(bufs[0]).cast("B")[:1000]
        return real(fd, [first], off)

    monkeypatch.setattr(os, "pwritev", short)
    data = [os.urandom(n) for n in (2500, 0, 1, 999, 1000, 3001)]
    p = tmp_path / "f"
    with open(p, "wb") as raw:
        f = EarlyWriteback(raw)
        f.write(b"head")
        pw = f.positional()
        assert pw is not None
        start = pw.reserve(sum(map(len, data)))
        pw.pwritev(data, start)
        f.write(b"tail")
    assert start == 4 and p.read_bytes() == b"head" + b"".join(data) + b"tail"


def test_a_failed_positional_write_is_a_store_error_naming_the_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from s4w_core.errors import StoreError
    from s4w_core.store.writes import CountingWriter

    class _Progress:
        def update(self, n: int) -> None:
            pass

    def full(fd: int, bufs: list[memoryview], off: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full, raising=False)
    with open(tmp_path / "f", "wb") as raw:
        cw = CountingWriter(EarlyWriteback(raw), _Progress(), "data/step_1")  # type: ignore[arg-type]
        pw = cw.positional()
        assert pw is not None
        start = pw.reserve(10)
        with pytest.raises(StoreError, match="cannot write data/step_1: .*No space left"):
            pw.pwritev([b"0123456789"], start)
    assert cw.n == 10

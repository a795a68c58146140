"""Durable local writes: the early-writeback wrapper changes no byte and starts writeback of each
window as it is written."""

from __future__ import annotations

import io
import os
import random
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


def test_writev_writes_views_in_order_where_they_lie(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # more views than one writev call takes, empty ones among them, and short writes: every byte once, in order
    monkeypatch.setattr(_fsutil, "IOV_MAX", 16)
    real = os.writev
    calls: list[int] = []

    def short(fd: int, bufs: list[memoryview]) -> int:
        calls.append(len(bufs))
        assert len(bufs) <= 16
        total = sum(b.nbytes for b in bufs)
        if len(calls) % 3 == 1 and total > 1:  # a short write ending inside a buffer
            first = memoryview(b"".join(bytes(b) for b in bufs))[: total // 2 + 1]
            return real(fd, [first])
        return real(fd, bufs)

    monkeypatch.setattr(os, "writev", short)
    rng = random.Random(3)
    parts = [os.urandom(rng.choice((0, 1, 7, 100, 4096))) for _ in range(100)]
    p = tmp_path / "v"
    with open(p, "wb") as raw:
        f = EarlyWriteback(raw, window=0)
        f.write(b"head")  # buffered by the file object: flushed before the vector write
        assert f.writev([memoryview(x) for x in parts]) == sum(map(len, parts))
        f.write(b"tail")
    assert p.read_bytes() == b"head" + b"".join(parts) + b"tail"
    assert len(calls) > 100 // 16


def test_writev_without_a_descriptor_writes_each_view() -> None:
    buf = io.BytesIO()
    f = EarlyWriteback(buf, window=4)
    assert f.writev([memoryview(b"ab"), memoryview(b""), memoryview(b"cde")]) == 5
    assert buf.getvalue() == b"abcde"


def test_write_vectors_refuses_a_write_that_makes_no_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "writev", lambda fd, bufs: 0)
    with open(tmp_path / "z", "wb") as raw, pytest.raises(OSError, match="wrote 0"):
        _fsutil.write_vectors(raw.fileno(), [memoryview(b"abc")])

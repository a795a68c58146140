"""The S3 backend's streamed whole-object download (``_s3.Download``), against an in-memory
``get``: the real GETs are covered end to end against SeaweedFS in tests/store/test_s3_errors.py."""

from __future__ import annotations

import mmap
import threading
import time

import pytest

from s4w_core.errors import StoreError
from s4w_core.store._s3 import Download

DATA = bytes(range(256)) * 41 + b"tail"  # 10500 bytes
EDGES = (100, 1000)  # first part 100 bytes, last part 1000, parts of 1000 between
STARTS = [0, *range(100, 9500, 1000), 9500]


def _getter(data: bytes, calls: list[tuple[int, int]] | None = None):  # type: ignore[no-untyped-def]
    lock = threading.Lock()

    def get(off: int, into: memoryview) -> int:
        if calls is not None:
            with lock:
                calls.append((off, into.nbytes))
        n = max(0, min(into.nbytes, len(data) - off))
        into[:n] = data[off : off + n]
        return n

    return get


def _settle(calls: list[tuple[int, int]], n: int) -> None:
    deadline = time.monotonic() + 10
    while len(calls) < n and time.monotonic() < deadline:
        time.sleep(0.005)


def test_reassembles_the_object_tail_and_head_first() -> None:
    calls: list[tuple[int, int]] = []
    dl = Download(_getter(DATA, calls), len(DATA), "s3://b/k", 1000, 1, EDGES)
    _settle(calls, len(STARTS))
    # the trailer and manifest first, then the header, then from the front
    assert [o for o, _ in calls] == [9500, *STARTS[:-1]]
    assert sorted(calls) == [(o, e - o) for o, e in zip(STARTS, [*STARTS[1:], len(DATA)])]
    assert dl.read(0, len(DATA)) == DATA
    a, b = bytearray(7), bytearray(5000)
    assert dl.readinto(len(DATA) - 7, [memoryview(a), memoryview(b)]) == 7 and bytes(a) == DATA[-7:]
    mid = bytearray(2500)
    assert dl.readinto(999, [memoryview(mid)]) == 2500 and bytes(mid) == DATA[999:3499]
    assert dl.read(len(DATA), 10) == b""


def test_a_reader_fetches_a_part_no_thread_has_started() -> None:
    gate = threading.Event()
    calls: list[tuple[int, int]] = []
    inner = _getter(DATA, calls)

    def get(off: int, into: memoryview) -> int:
        if off == 9500:  # the one download thread is stuck on the tail part
            assert gate.wait(10)
        return inner(off, into)

    dl = Download(get, len(DATA), "s3://b/k", 1000, 1, EDGES)
    assert dl.read(4200, 1000) == DATA[4200:5200]  # fetched by this thread, behind nobody
    assert sorted(calls) == [(4100, 1000), (5100, 1000)]  # the tail part has not come back yet
    gate.set()
    assert dl.read(0, len(DATA)) == DATA
    assert len(calls) == len(STARTS)  # no part fetched twice


def test_a_read_waits_for_a_part_in_flight() -> None:
    gate = threading.Event()
    started = threading.Event()
    inner = _getter(DATA)

    def get(off: int, into: memoryview) -> int:
        if off == 5100:
            started.set()
            assert gate.wait(10)
        return inner(off, into)

    dl = Download(get, len(DATA), "s3://b/k", 1000, 4, EDGES)
    assert started.wait(10)
    assert dl.read(0, 1000) == DATA[:1000]  # while part 5100.. is held back
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(dl.read(5000, 1000)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # it needs the part in flight
    gate.set()
    t.join(10)
    assert got == [DATA[5000:6000]]


def test_a_failed_part_fails_only_the_reads_that_need_it() -> None:
    inner = _getter(DATA)

    def get(off: int, into: memoryview) -> int:
        if off == 3100:
            raise ConnectionResetError("peer went away")
        return inner(off, into)

    dl = Download(get, len(DATA), "s3://b/run/data/x.s4w", 1000, 3, EDGES)
    assert dl.read(0, 3100) == DATA[:3100]
    for _ in range(2):  # every reader gets its own exception
        with pytest.raises(StoreError, match=r"cannot read s3://b/run/data/x.s4w: peer went away"):
            dl.read(3000, 1000)
    with pytest.raises(StoreError):
        dl.readinto(4099, [memoryview(bytearray(2))])
    assert dl.read(4100, 100) == DATA[4100:4200]


def test_a_short_part_is_an_error_not_zeros() -> None:
    dl = Download(_getter(DATA[:9700]), len(DATA), "s3://b/k", 1000, 2, EDGES)  # the object shrank
    assert dl.read(0, 9500) == DATA[:9500]
    with pytest.raises(StoreError, match=r"got 200 of 1000 bytes at offset 9500 \(object changed\?\)"):
        dl.read(9400, 200)


def test_close_drops_the_parts_not_started() -> None:
    gate = threading.Event()
    calls: list[tuple[int, int]] = []
    inner = _getter(DATA, calls)

    def get(off: int, into: memoryview) -> int:
        assert gate.wait(10)
        return inner(off, into)

    dl = Download(get, len(DATA), "s3://b/k", 1000, 1, EDGES)
    dl.close()
    gate.set()
    with pytest.raises(StoreError, match="closed"):
        dl.read(0, 10)
    time.sleep(0.1)
    assert len(calls) <= 1  # at most the part that had started


@pytest.mark.parametrize("size", [1, 99, 100, 101, 1099, 1100, 1101, 3000, 10500])
def test_parts_cover_the_object_once(size: int) -> None:
    calls: list[tuple[int, int]] = []
    data = DATA[:size]
    dl = Download(_getter(data, calls), size, "s3://b/k", 1000, 3, EDGES)
    assert dl.read(0, size) == data
    _settle(calls, 1)
    parts = sorted(calls)
    assert parts[0][0] == 0 and parts[0][1] <= 100  # the header part
    assert all(o + n == o2 for (o, n), (o2, _) in zip(parts, parts[1:]))  # no gap, no overlap
    assert parts[-1][0] + parts[-1][1] == size and parts[-1][1] <= 1000
    for off in range(0, size, 97):  # every read sees exactly its bytes
        assert dl.read(off, 150) == data[off : off + 150]


def test_empty_object() -> None:
    dl = Download(_getter(b""), 0, "s3://b/k", 1000, 8, EDGES)
    assert dl.read(0, 0) == b"" and dl.readinto(0, [memoryview(bytearray(4))]) == 0


def _wait_closed(mm: mmap.mmap) -> bool:
    deadline = time.monotonic() + 10
    while not mm.closed and time.monotonic() < deadline:
        time.sleep(0.005)
    return mm.closed


def test_close_unmaps_the_buffer_on_a_thread_of_its_own() -> None:
    """A finished load closes its download: the buffer (as large as the object) is unmapped in
    the background, and reads after close fail instead of reading freed memory."""
    calls: list[tuple[int, int]] = []
    dl = Download(_getter(DATA, calls), len(DATA), "s3://b/k", 1000, 2, EDGES)
    assert dl.read(0, len(DATA)) == DATA
    mm = dl._view.obj  # noqa: SLF001
    assert isinstance(mm, mmap.mmap)
    dl.close()
    assert _wait_closed(mm)
    assert dl.read(0, 10) == b""  # the caller's reader turns a short read into a TruncatedError


def test_close_while_a_part_is_fetched_unmaps_when_it_ends() -> None:
    """A part still being written when the download is closed keeps the buffer mapped until it
    ends: closing neither fails nor pulls the memory from under it."""
    gate, entered = threading.Event(), threading.Event()
    inner = _getter(DATA)

    def get(off: int, into: memoryview) -> int:
        if off == 9500:
            entered.set()
            assert gate.wait(10)
            into[:10] = b"x" * 10  # writes into the mapping after close()
        return inner(off, into)

    dl = Download(get, len(DATA), "s3://b/k", 1000, 1, EDGES)
    assert entered.wait(10)
    mm = dl._view.obj  # noqa: SLF001
    assert isinstance(mm, mmap.mmap)
    dl.close()
    time.sleep(0.05)
    assert not mm.closed, "still mapped while the part is written"
    gate.set()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("s4w-s3-get") for t in threading.enumerate()):  # the part ends
        assert time.monotonic() < deadline
        time.sleep(0.005)

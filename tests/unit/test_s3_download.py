"""The S3 backend's streamed whole-object download (``_s3.Download``), against an in-memory
``get``: the real GETs are covered end to end against SeaweedFS in tests/store/test_s3_errors.py."""

from __future__ import annotations

import threading

import pytest

from s4w_core.errors import StoreError
from s4w_core.store._s3 import Download

DATA = bytes(range(256)) * 41 + b"tail"  # 10500 bytes: parts of 1000, the last one short


def _getter(data: bytes, calls: list[int] | None = None):  # type: ignore[no-untyped-def]
    lock = threading.Lock()

    def get(off: int, into: memoryview) -> int:
        if calls is not None:
            with lock:
                calls.append(off)
        n = min(into.nbytes, len(data) - off)
        into[:n] = data[off : off + n]
        return n

    return get


def test_reassembles_the_object_last_part_first() -> None:
    calls: list[int] = []
    dl = Download(_getter(DATA, calls), len(DATA), "s3://b/k", 1000, 1)
    assert dl.read(0, len(DATA)) == DATA
    # the last 1000 bytes first (trailer and manifest), then from the front (a short part before it)
    assert calls == [9500, *range(0, 9500, 1000)]
    a, b = bytearray(7), bytearray(5000)
    assert dl.readinto(len(DATA) - 7, [memoryview(a), memoryview(b)]) == 7 and bytes(a) == DATA[-7:]
    mid = bytearray(2500)
    assert dl.readinto(999, [memoryview(mid)]) == 2500 and bytes(mid) == DATA[999:3499]
    assert dl.read(len(DATA), 10) == b""


def test_a_read_waits_only_for_the_parts_it_covers() -> None:
    gate = threading.Event()
    inner = _getter(DATA)

    def get(off: int, into: memoryview) -> int:
        if off == 5000:
            assert gate.wait(10)
        return inner(off, into)

    dl = Download(get, len(DATA), "s3://b/k", 1000, 4)
    assert dl.read(0, 1000) == DATA[:1000]  # while part 5 is held back
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(dl.read(4500, 1000)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # it needs part 5
    gate.set()
    t.join(10)
    assert got == [DATA[4500:5500]]


def test_a_failed_part_fails_only_the_reads_that_need_it() -> None:
    inner = _getter(DATA)

    def get(off: int, into: memoryview) -> int:
        if off == 3000:
            raise ConnectionResetError("peer went away")
        return inner(off, into)

    dl = Download(get, len(DATA), "s3://b/run/data/x.s4w", 1000, 3)
    assert dl.read(0, 3000) == DATA[:3000]
    for _ in range(2):  # every reader gets its own exception
        with pytest.raises(StoreError, match=r"cannot read s3://b/run/data/x.s4w: peer went away"):
            dl.read(2500, 1000)
    with pytest.raises(StoreError):
        dl.readinto(3999, [memoryview(bytearray(2))])
    assert dl.read(4000, 100) == DATA[4000:4100]


def test_a_short_part_is_an_error_not_zeros() -> None:
    dl = Download(_getter(DATA[:9700]), len(DATA), "s3://b/k", 1000, 2)  # the object shrank
    assert dl.read(0, 9500) == DATA[:9500]
    with pytest.raises(StoreError, match=r"got 200 of 1000 bytes at offset 9500 \(object changed\?\)"):
        dl.read(9400, 200)


@pytest.mark.parametrize("size", [1, 999, 1000, 1001, 3000])
def test_part_boundaries(size: int) -> None:
    calls: list[int] = []
    data = DATA[:size]
    dl = Download(_getter(data, calls), size, "s3://b/k", 1000, 3)
    assert dl.read(0, size) == data
    assert sorted(calls) == sorted({*range(0, max(0, size - 1000), 1000), max(0, size - 1000)})
    for off in range(0, size, 97):  # every read sees exactly its bytes
        assert dl.read(off, 150) == data[off : off + 150]


def test_close_drops_the_parts_not_started() -> None:
    gate = threading.Event()
    calls: list[int] = []
    inner = _getter(DATA, calls)

    def get(off: int, into: memoryview) -> int:
        assert gate.wait(10)
        return inner(off, into)

    dl = Download(get, len(DATA), "s3://b/k", 1000, 1)
    dl.close()
    gate.set()
    with pytest.raises(StoreError, match="closed"):
        dl.read(0, 10)
    assert len(calls) <= 1  # at most the part that had started


def test_empty_object() -> None:
    dl = Download(_getter(b""), 0, "s3://b/k", 1000, 8)
    assert dl.read(0, 0) == b"" and dl.readinto(0, [memoryview(bytearray(4))]) == 0

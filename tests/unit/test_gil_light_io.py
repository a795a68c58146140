"""The host work a background save does per chunk gives the GIL up rarely: chunk checksums hold it
(``checksum.xxh3_hex_holding_gil``) and a container's chunks reach its file object in writes of up to 16 MiB
(``ContainerWriter``). Bytes and checksums are what plain xxhash and one write per chunk give."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import xxhash
import zstandard

from s4w_core import checksum as ck
from s4w_core._fsutil import EarlyWriteback
from s4w_core.format import container as ct
from s4w_core.format.container import ContainerReader, ContainerWriter


@pytest.mark.parametrize("n", [0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 4096, 65537, 512 << 10, (1 << 20) - 1, 1 << 20, 3 << 20])
def test_xxh3_hex_holding_gil_is_xxhash_for_every_size_and_buffer_kind(n: int) -> None:
    data = os.urandom(n)
    want = xxhash.xxh3_64_hexdigest(data)
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    for buf in (data, bytearray(data), memoryview(data), memoryview(arr), arr):
        assert ck.xxh3_hex_holding_gil(buf) == want and ck.xxh3_hex(buf) == want
    if n % 4 == 0 and n:
        assert ck.xxh3_hex_holding_gil(memoryview(arr).cast("I")) == want  # a typed view: its bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the GIL-holding path is checked where CI runs")
def test_the_gil_holding_path_is_active() -> None:
    assert ck._HELD is not None  # noqa: SLF001 - the optimization must not vanish silently


class _Recording(io.BytesIO):
    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.fail_after = fail_after

    def write(self, b) -> int:  # type: ignore[no-untyped-def, override]
        if self.fail_after is not None and len(self.sizes) >= self.fail_after:
            raise OSError(28, "No space left on device")
        self.sizes.append(memoryview(b).nbytes)
        return super().write(b)


def _unbuffered(chunks: list[bytes], manifest: dict, compressed: bool) -> bytes:  # type: ignore[type-arg]
    out = io.BytesIO()
    out.write(ct._HEADER.pack(ct.MAGIC, ct.FORMAT_VERSION, ct.FLAG_MANIFEST_ZSTD if compressed else 0, 0))  # noqa: SLF001
    entries = []
    for c in chunks:
        entries.append((out.tell(), len(c), xxhash.xxh3_64_hexdigest(c)))
        out.write(c)
    body = ct.json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()
    if compressed:
        body = zstandard.ZstdCompressor(level=ct.MANIFEST_ZSTD_LEVEL, write_content_size=True).compress(body)
    off = out.tell()
    out.write(body)
    out.write(ct._TRAILER.pack(off, len(body), xxhash.xxh3_64_intdigest(body), ct.TRAILER_MAGIC))  # noqa: SLF001
    return out.getvalue()


def test_chunks_are_written_in_blocks_with_the_same_bytes() -> None:
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, 512 << 10, dtype=np.uint8).tobytes() for _ in range(70)]
    chunks.insert(40, rng.integers(0, 256, 20 << 20, dtype=np.uint8).tobytes())  # larger than a block
    fp = _Recording()
    w = ContainerWriter(fp)
    reuse = bytearray(512 << 10)
    got = []
    for c in chunks:
        reuse[:] = c  # the caller's buffer, reused for every chunk
        got.append(w.add_chunk(memoryview(reuse)))
        reuse[:16] = b"\xff" * 16  # changed right after: the container keeps what was added
    manifest = {"format": "test", "n": len(chunks)}
    size = w.finish(manifest)
    data = fp.getvalue()
    # the header left with the first 16 MiB block, before the manifest was known: the writer set
    # the manifest flag then and compressed the (tiny) manifest at the end
    assert data == _unbuffered(chunks, manifest, compressed=True) and size == len(data)
    assert [(o, n, h) for o, n, h in got] == [
        (o, n, h) for o, n, h in _offsets(chunks)
    ]
    assert max(fp.sizes) == 20 << 20 and sum(s < (16 << 20) for s in fp.sizes) <= 4  # ~16 MiB writes, not 71
    assert len(fp.sizes) <= 6
    r = ContainerReader.from_bytes(data)
    assert r.read_chunk(*got[3][:2]) == chunks[3]


def test_chunks_handed_over_together_go_to_a_local_file_in_one_vector_write(tmp_path, monkeypatch) -> None:
    # add_chunks on a file with writev (a local store's object): the same file and placements as
    # add_chunk one at a time, with no copy of a chunk and one writev per hand-over
    rng = np.random.default_rng(1)
    sizes = [[int(n) for n in rng.integers(0, 600 << 10, 9)] + [ct._DIRECT_BYTES] for _ in range(3)]  # noqa: SLF001
    sizes.insert(1, [0, 100, 4000])  # a small storage's chunks: gathered into the block, no write of their own
    groups = [[rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in g] for g in sizes]
    chunks = [c for g in groups for c in g]
    calls: list[int] = []
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: calls.append(len(bufs)) or real(fd, bufs))
    manifest = {"format": "test", "n": len(chunks)}
    p = tmp_path / "c.s4w"
    with open(p, "wb") as raw:
        w = ContainerWriter(EarlyWriteback(raw, window=0))
        got = []
        for g in groups:
            got += w.add_chunks([memoryview(c) for c in g])
        size = w.finish(manifest)
    data = p.read_bytes()
    assert data == _unbuffered(chunks, manifest, compressed=True) and size == len(data)
    assert got == _offsets(chunks)
    # one writev per large hand-over, of its chunks; what was gathered between them (the small
    # storage's two non-empty chunks; at the end the manifest and the trailer) in one writev each
    direct = [sum(1 for c in g if c) for g in groups if sum(map(len, g)) >= ct._DIRECT_BYTES]  # noqa: SLF001
    assert calls == [direct[0], 2, direct[1], direct[2], 2]
    # a file object without writev (an S3 stream, a buffer): add_chunk's route, the same chunks
    # where they were (the header's manifest flag may differ: this one kept its header to the end)
    fp = _Recording()
    w = ContainerWriter(fp)
    assert [x for g in groups for x in w.add_chunks(g)] == got
    w.finish(manifest)
    other = fp.getvalue()
    end = ct.HEADER_SIZE + sum(map(len, chunks))
    assert other[ct.HEADER_SIZE : end] == data[ct.HEADER_SIZE : end]
    assert ContainerReader.from_bytes(other).manifest == ContainerReader.from_bytes(data).manifest == manifest


def _offsets(chunks: list[bytes]) -> list[tuple[int, int, str]]:
    pos = ct.HEADER_SIZE
    out = []
    for c in chunks:
        out.append((pos, len(c), xxhash.xxh3_64_hexdigest(c)))
        pos += len(c)
    return out


def test_a_write_error_is_raised_by_the_call_that_flushes() -> None:
    fp = _Recording(fail_after=0)
    w = ContainerWriter(fp)
    with pytest.raises(OSError, match="No space left"):
        for _ in range(40):
            w.add_chunk(b"x" * (1 << 20))
    fp = _Recording(fail_after=0)
    w = ContainerWriter(fp)
    w.add_chunk(b"small")
    with pytest.raises(OSError, match="No space left"):
        w.finish({})


def test_a_saved_file_takes_gathered_chunks_in_vector_writes(tmp_path, monkeypatch) -> None:
    # s4w_core.save to a path: its timed writer offers the local file's writev, so the gathered
    # chunks (coded ``bytes``, held where they lie) reach the file in vector writes, not joined
    import torch

    import s4w_core

    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(6)}
    calls: list[int] = []
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: calls.append(len(bufs)) or real(fd, bufs))
    p = tmp_path / "s.s4w"
    s4w_core.save(state, p, threads=1)
    assert calls and max(calls) > 1
    back = s4w_core.load(p)
    assert all(torch.equal(back[k].view(torch.uint16), v.view(torch.uint16)) for k, v in state.items())


@pytest.mark.parametrize("prefix", [0, 5])
def test_an_in_memory_file_takes_each_chunk_and_its_header_in_place(prefix: int) -> None:
    # a plain BytesIO (where the container may start after other bytes) gets each chunk as it comes
    # and the header's manifest flag fixed in place: the same bytes as the gathered route
    rng = np.random.default_rng(3)
    chunks = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(0, 300 << 10, 40)]
    manifest = {"format": "test", "n": len(chunks)}
    mem = io.BytesIO(b"x" * prefix)
    mem.seek(prefix)
    w = ContainerWriter(mem)
    got = [w.add_chunk(c) for c in chunks]
    w.finish(manifest)
    gathered = _Recording()  # a BytesIO subclass with its own write: the gathered route
    w2 = ContainerWriter(gathered)
    assert [w2.add_chunk(memoryview(bytearray(c))) for c in chunks] == got == _offsets(chunks)
    w2.finish(manifest)
    data = mem.getvalue()
    assert data[:prefix] == b"x" * prefix and data[prefix:] == gathered.getvalue()
    assert ContainerReader.from_bytes(data[prefix:]).manifest == manifest


def test_a_local_file_gets_reused_buffers_copied_and_bytes_where_they_lie(tmp_path) -> None:
    # a file with writev: a chunk in a buffer its owner reuses at once (the GPU writer's pinned
    # read-back) is copied into the writer's block, a ``bytes`` chunk is held; both land as added
    rng = np.random.default_rng(2)
    chunks = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 700 << 10, 60)]
    manifest = {"format": "test", "n": len(chunks)}
    p = tmp_path / "c.s4w"
    reuse = bytearray(700 << 10)
    with open(p, "wb") as raw:
        w = ContainerWriter(EarlyWriteback(raw, window=0))
        got = []
        for k, c in enumerate(chunks):
            if k % 2:
                got.append(w.add_chunk(c))
            else:
                reuse[: len(c)] = c
                got.append(w.add_chunk(memoryview(reuse)[: len(c)]))
                reuse[:16] = b"\xff" * 16  # changed right after: the container keeps what was added
        size = w.finish(manifest)
    data = p.read_bytes()
    assert data == _unbuffered(chunks, manifest, compressed=True) and size == len(data)
    assert got == _offsets(chunks)

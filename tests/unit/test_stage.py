"""The GPU reader's host half, without a GPU.

* scatter reads: ``ContainerReader.read_into`` over a file (``os.preadv``), over a plain
  ``read_range`` (the fallback) and over the local backend's ``RangeReader.readinto``;
* ``s4w_core.gpu._decode.stage`` over containers written by the CPU path (pinned memory replaced by
  ordinary memory): every chunk's bytes (or its CPU-decoded bytes) at its aligned slot, batches
  with holes, the read plan, and corrupt, truncated and forged input;
* the batch pipeline of ``decode_storages`` (stage and device decode replaced by stand-ins): the
  next batch is staged while one decodes, errors surface in batch order, no thread outlives a call.

The device half runs on the CPU in tests/parity (``pipeline_*`` checks, Triton's interpreter).
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

import s4w_core
from s4w_core import config, engine
from s4w_core.codecs import get_codec
from s4w_core.errors import ChecksumMismatchError, DecodeError, ManifestError, StoreError, TruncatedError
from s4w_core.format.container import ContainerReader
from s4w_core.store._local import LocalBackend
from tests.unit.helpers import deflate_plane0

pytest.importorskip("triton")  # s4w_core.gpu's kernels module imports it

from s4w_core.gpu import _decode, _nvcomp  # noqa: E402

ALIGN = _nvcomp.ALIGN


def _state() -> dict[str, torch.Tensor]:
    """deflate, raw and zstd chunks; ``gap1`` (small) and ``gap2`` (large) make holes when left out."""
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(1_500_000, generator=g).to(torch.bfloat16),
        "gap1": torch.randint(0, 256, (20_000,), dtype=torch.uint8, generator=g),
        "b": torch.arange(300_000),
        "gap2": torch.randint(0, 256, (700_000,), dtype=torch.uint8, generator=g),
        "c": torch.randn(200_000, generator=g),
        "small": torch.ones(3),
        "empty": torch.empty(0),
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stage") / "ckpt.s4w"
    with deflate_plane0():  # as the GPU's portable profile writes
        s4w_core.save(_state(), path, profile="portable")
    return path


@pytest.fixture(autouse=True)
def _unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned memory needs CUDA: ordinary memory stands in for it (as in tests/parity)."""
    monkeypatch.setattr(_nvcomp, "host_empty", lambda n: torch.empty(max(n, 1), dtype=torch.uint8))


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as p:
        yield p


@contextlib.contextmanager
def _open(path: Path, how: str) -> Iterator[ContainerReader]:
    """A reader over ``path``: ``file`` (from_file: preadv), ``plain`` (read_range only: the
    fallback) or ``local`` (the local backend's RangeReader, readinto passed on)."""
    if how == "file":
        with ContainerReader.from_file(open(path, "rb")) as r:
            yield r
        return
    if how == "plain":
        with open(path, "rb") as f:
            yield ContainerReader(lambda o, n: os.pread(f.fileno(), n, o), os.path.getsize(path), str(path))
        return
    rr = LocalBackend(str(path.parent), create=False).open_range(path.name)
    assert rr.readinto is not None
    try:
        yield ContainerReader(rr.read, rr.size, rr.name, readinto=rr.readinto)
    finally:
        rr.close()


READERS = ["file", "plain", "local"]


@pytest.fixture(params=READERS)
def reader(request: pytest.FixtureRequest, ckpt: Path) -> Iterator[ContainerReader]:
    with _open(ckpt, request.param) as r:
        yield r


def _by_path(reader: ContainerReader) -> dict[str, dict[str, Any]]:
    return {e["path"]: e for e in s4w_core.api.open_reader(reader).manifest["storages"]}


# ----------------------------------------------------------------------------- read_into
def test_read_into_one_buffer_and_scatter(reader: ContainerReader, ckpt: Path) -> None:
    raw = ckpt.read_bytes()
    lo, n = reader.data_start + 5, 100_003
    one = bytearray(n)
    reader.read_into(lo, memoryview(one))
    assert one == raw[lo : lo + n]
    parts = [bytearray(k) for k in (1, 0, 40_000, 17, 0, n - 40_018)]
    reader.read_into(lo, [memoryview(p) for p in parts])
    assert b"".join(parts) == raw[lo : lo + n]
    reader.read_into(lo, [])  # nothing to read


def test_read_into_refuses_ranges_outside_the_data_section(reader: ContainerReader) -> None:
    with pytest.raises(ManifestError, match="lies outside the data section"):
        reader.read_into(reader.data_end - 3, memoryview(bytearray(4)))
    with pytest.raises(ManifestError, match="lies outside the data section"):
        reader.read_into(reader.data_start - 1, [memoryview(bytearray(2))])


@pytest.mark.parametrize("how", READERS)
def test_read_into_truncated_file(tmp_path: Path, ckpt: Path, how: str) -> None:
    path = tmp_path / "t.s4w"
    path.write_bytes(ckpt.read_bytes())
    with _open(path, how) as r:
        cut = r.data_start + 1000
        os.truncate(path, cut)  # shrinks after the reader checked header, trailer and manifest
        with pytest.raises(TruncatedError, match=rf"wanted 5000 bytes at offset {cut - 10}, got 10: truncated"):
            r.read_into(cut - 10, [memoryview(bytearray(10)), memoryview(bytearray(4990))])


def test_pread_into_resumes_short_reads_and_splits_at_iov_max(
    monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    real = os.preadv
    calls: list[int] = []

    def stingy(fd: int, bufs: list[memoryview], off: int) -> int:  # at most 7 bytes a call
        assert len(bufs) <= 1024
        calls.append(len(bufs))
        return real(fd, [bufs[0][:7]], off)

    monkeypatch.setattr(os, "preadv", stingy)
    raw = ckpt.read_bytes()
    parts = [bytearray(1 + i % 11) for i in range(3000)]
    with ContainerReader.from_file(open(ckpt, "rb")) as r:
        r.read_into(r.data_start, [memoryview(p) for p in parts])
    n = sum(len(p) for p in parts)
    assert b"".join(parts) == raw[r.data_start : r.data_start + n]
    assert max(calls) == 1024 and len(calls) > n // 7


def test_local_readinto_reports_store_errors(ckpt: Path) -> None:
    rr = LocalBackend(str(ckpt.parent), create=False).open_range(ckpt.name)
    assert rr.readinto is not None
    buf = bytearray(10)
    assert rr.readinto(rr.size - 4, [memoryview(buf)]) == 4  # end of the object: a short count
    rr.close()
    with pytest.raises(StoreError, match="cannot read"):
        rr.readinto(0, [memoryview(buf)])


# ----------------------------------------------------------------------------- stage
def _check_staged(st: _decode.Staged, reader: ContainerReader, entries: list[dict[str, Any]], inflate: bool) -> None:
    """Each chunk at its aligned slot: its stored bytes (nvCOMP kinds, raw) or its CPU-decoded bytes."""
    host = st.host.numpy()
    c = 0
    for k, e in enumerate(entries):
        for i, (s0, s1, j) in enumerate(engine.chunk_layout(e)):
            codec, off, length, _h = e["chunks"][i]
            data = reader.read_chunk(off, length)
            if codec == "raw" or (codec == "deflate" and inflate):
                kind, want = ("copy" if codec == "raw" else "inflate"), data
            else:
                kind, want = "copy", get_codec(codec).decode(data, s1 - s0)
            assert tuple(st.recs[c].tolist()) == (k, j, s0, s1 - s0)
            assert (str(st.kinds[c]), int(st.stored[c])) == (kind, len(want)), (e["path"], i)
            assert st.slot[c] % ALIGN == 0
            assert host[int(st.slot[c]) : int(st.slot[c]) + len(want)].tobytes() == want, (e["path"], i)
            c += 1
    assert len(st.slot) == c
    spans = sorted((o, o + -(-n // ALIGN) * ALIGN) for o, n in zip(st.slot.tolist(), st.stored.tolist()))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "slots overlap"
    assert not spans or spans[-1][1] <= st.host.numel()


@pytest.mark.parametrize("inflate", [True, False])
@pytest.mark.parametrize("block", [None, "4096"])
def test_stage_every_storage(
    monkeypatch: pytest.MonkeyPatch, reader: ContainerReader, pool: ThreadPoolExecutor, inflate: bool, block: str | None
) -> None:
    monkeypatch.setenv("S4W_GPU_INFLATE", "1" if inflate else "0")
    if block:
        monkeypatch.setenv("S4W_READ_BLOCK", block)
    entries = list(_by_path(reader).values())
    st = _decode.stage(reader, entries, pool)
    _check_staged(st, reader, entries, inflate)
    assert {"inflate", "copy"} <= set(st.kinds.tolist()) if inflate else set(st.kinds.tolist()) == {"copy"}


def test_stage_batch_with_holes(monkeypatch: pytest.MonkeyPatch, reader: ContainerReader, pool: ThreadPoolExecutor) -> None:
    by = _by_path(reader)
    entries = [by[p] for p in ("c", "a", "b", "small", "empty")]  # not in file order; gap1, gap2 left out
    reads: list[tuple[int, int]] = []
    orig = reader.read_into

    def spy(offset: int, bufs: Any) -> None:
        reads.append((offset, sum(b.nbytes for b in bufs)))
        orig(offset, bufs)

    monkeypatch.setattr(reader, "read_into", spy)
    st = _decode.stage(reader, entries, pool)
    _check_staged(st, reader, entries, True)

    def extent(*paths: str) -> tuple[int, int]:
        cs = [c for p in paths for c in by[p]["chunks"]]
        return min(c[1] for c in cs), max(c[1] + c[2] for c in cs)

    read: list[list[int]] = []  # the reads' union, as disjoint ranges
    for off, n in sorted(reads):
        if read and read[-1][1] == off:
            read[-1][1] = off + n
        else:
            read.append([off, off + n])
    # gap1 (20 kB) is read with its neighbours, gap2 (700 kB) is not read
    assert read == [list(extent("a", "b")), list(extent("c", "small"))]


def _chunks(spec: list[tuple[int, int]]) -> list[_decode._Chunk]:
    return [_decode._Chunk("t", i, "raw", off, n, "", n, "copy") for i, (off, n) in enumerate(spec)]


def _plan(spec: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    cs = _chunks(spec)
    return _decode._plan_reads(cs, sorted(range(len(cs)), key=lambda c: cs[c].off))


def test_plan_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    M, K = 1 << 20, 200_000
    # back to back, and gaps of at most 64 KiB, share a read; a larger gap starts a new one
    assert _plan([(16, K), (16 + K, K), (16 + 2 * K + 65536, K), (16 + 3 * K + 2 * 65536 + 1, K)]) == [
        (16, [0, 1, 2]),
        (16 + 3 * K + 2 * 65536 + 1, [3]),
    ]
    # gaps that would add more than a quarter of the chunks' bytes: only back-to-back chunks join
    small = [(0, 1000), (1000, 1000), (62_000, 1000), (63_000, 1000)]
    assert _plan(small) == [(0, [0, 1]), (62_000, [2, 3])]
    # overlapping (forged) and empty chunks never share a read with what they overlap
    assert _plan([(0, 100), (50, 100), (150, 0), (150, 10)]) == [(0, [0]), (50, [1, 2, 3])]
    # reads are cut at S4W_READ_BLOCK (a larger chunk alone)
    monkeypatch.setenv("S4W_READ_BLOCK", str(3000))
    assert _plan([(0, 1000), (1000, 1000), (2000, 1000), (3000, 5000), (8000, 10)]) == [
        (0, [0, 1, 2]),
        (3000, [3]),
        (8000, [4]),
    ]
    monkeypatch.delenv("S4W_READ_BLOCK")
    plan = _plan([(i * M, M) for i in range(40)])  # 40 MiB: a 32 MiB read and the rest
    assert [len(m) for _, m in plan] == [32, 8]
    plan = _plan([(i * M, M) for i in range(20)])
    assert [len(m) for _, m in plan] == [20]
    plan = _plan([(i * M, M) for i in range(200)])
    assert [len(m) for _, m in plan] == [32] * 6 + [8]


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("codec", ["deflate", "zstd", "raw"])
def test_stage_refuses_a_corrupt_chunk(tmp_path: Path, ckpt: Path, pool: ThreadPoolExecutor, codec: str) -> None:
    path = tmp_path / "bad.s4w"
    path.write_bytes(ckpt.read_bytes())
    with _open(path, "file") as clean:
        entries = list(_by_path(clean).values())
    e = next(e for e in entries if any(c[0] == codec for c in e["chunks"]))
    i = next(i for i, c in enumerate(e["chunks"]) if c[0] == codec)
    _, off, length, _ = e["chunks"][i]
    _flip(path, off + length // 2)
    with _open(path, "file") as r:
        msg = (
            f"chunk {i} of tensor {e['path']!r} (bytes {off}..{off + length}) is corrupt: checksum mismatch "
            "(found before any GPU decoder saw it)"
        )
        with pytest.raises(ChecksumMismatchError) as ei:
            _decode.stage(r, entries, pool)
        assert msg in str(ei.value)


def test_stage_truncated_file(tmp_path: Path, ckpt: Path, pool: ThreadPoolExecutor) -> None:
    path = tmp_path / "t.s4w"
    path.write_bytes(ckpt.read_bytes())
    with _open(path, "file") as r:
        entries = list(_by_path(r).values())
        os.truncate(path, r.data_end // 2)
        with pytest.raises(TruncatedError, match="truncated"):
            _decode.stage(r, entries, pool)


def test_stage_refuses_chunks_outside_the_data_section(reader: ContainerReader, pool: ThreadPoolExecutor) -> None:
    entries = copy.deepcopy(list(_by_path(reader).values()))
    codec, off, length, h = entries[1]["chunks"][0]
    entries[1]["chunks"][0] = [codec, reader.data_end - 1, length, h]
    with pytest.raises(ManifestError, match=rf"chunk \[{reader.data_end - 1}, \+{length}\) lies outside the data section"):
        _decode.stage(reader, entries, pool)


# ----------------------------------------------------------------------------- decode plan
def test_stage_builds_the_decode_plan(reader: ContainerReader, pool: ThreadPoolExecutor) -> None:
    """stage() leaves the device decode's tables in ``Staged.plan``: every plane-transformed
    segment and plane once in the merge's chunk table, each chunk found where the merge will read
    it (raw chunks in the staged buffer, decoded ones in the planes buffer)."""
    entries = list(_by_path(reader).values())
    st = _decode.stage(reader, entries, pool)
    plan = st.plan
    assert plan is not None and plan.entries is entries and st.plan_for(entries) is plan
    assert plan.in_place and plan.chunk_staged is not None and plan.chunk_off is not None
    assert plan.staged_end == int((st.slot + st.stored).max()) <= st.host.numel()
    ps = (plan.n_el + ALIGN - 1) // ALIGN * ALIGN
    segs = np.array([e["segment_elems"] for e in entries])
    nch = np.where(plan.rot, -(-plan.n_el // segs) * plan.width, 0)
    first = np.cumsum(nch) - nch  # each entry's first chunk in the merge's chunk table
    for g in plan.merge_groups:  # what the merge launches read (their first column)
        assert g.cols[:, 0].tolist() == first[g.idx].tolist()
    seen = 0
    for c, (k, j, s0, _n) in enumerate(st.recs.tolist()):
        if not plan.rot[k]:
            continue
        seg = int(entries[k]["segment_elems"])
        at = int(first[k]) + (s0 // seg) * int(plan.width[k]) + j
        if st.kinds[c] == "copy":
            assert plan.chunk_staged[at] and plan.chunk_off[at] == st.slot[c]
        else:
            assert not plan.chunk_staged[at] and plan.chunk_off[at] == plan.region[k] + j * ps[k] + s0
        seen += 1
    assert seen == len(plan.chunk_off) > 0
    # every nvCOMP-decoded chunk is in exactly one call, each call's places aligned or scratched
    n_dec = int((st.kinds != "copy").sum())
    assert sum(len(c.src) for c in plan.calls) == n_dec
    for call in plan.calls:
        assert (call.dst % ALIGN == 0).all()
        assert (call.place is None) == (call.scratch == 0)


def test_decode_plan_launch_tables(reader: ContainerReader, pool: ThreadPoolExecutor) -> None:
    """The merge and fold64 launches' tables made ahead: every plane-transformed entry with elements
    in exactly one merge group of its width and delta op, every fold64 entry in one fold group, and
    each group's program map sending ceil(items' work / block) programs to each row, in order."""
    from s4w_core.gpu.kernels import fold64_programs
    from s4w_core.planes.triton_kernels import merge_block

    st = _decode.stage(reader, list(_by_path(reader).values()), pool)
    entries = copy.deepcopy(st.plan.entries if st.plan else [])
    for e in entries:  # as the GPU writer records them (the CPU path writes xxh3)
        e["checksum"] = "fold64:" + "0" * 16
    plan = st.plan_for(entries)  # another entries list: a plan of its own
    assert len(plan.fold_idx) == sum(1 for e in entries if e["nbytes"])
    merged = np.concatenate([g.idx for g in plan.merge_groups])
    assert sorted(merged.tolist()) == np.nonzero(plan.rot & (plan.n_el > 0))[0].tolist()
    for g in plan.merge_groups:
        assert (plan.width[g.idx] == g.w).all() and (plan.op[g.idx] == g.op).all()
        programs = -(-plan.n_el[g.idx] // merge_block())
        assert g.pmap.dtype == np.int32 and g.pmap.tolist() == np.repeat(np.arange(len(g.idx)), programs).tolist()
        assert g.cols[:, -1].tolist() == (np.cumsum(programs) - programs).tolist() and g.programs == programs.sum()
    folded = np.concatenate([g.idx for g in plan.fold_groups]) if plan.fold_groups else np.zeros(0, dtype=np.int64)
    assert sorted(folded.tolist()) == plan.fold_idx.tolist()
    for g in plan.fold_groups:
        assert ((plan.nbytes[g.idx] % 4 == 0) == bool(g.w)).all()
        assert g.programs == fold64_programs(plan.nbytes[g.idx]).sum() == len(g.pmap)
    for n, g in enumerate(plan.merge_groups + plan.fold_groups):  # the maps as the decode uploads them
        at = plan.map_at[n]
        assert plan.maps_host[at : at + len(g.pmap)].numpy().tolist() == g.pmap.tolist()


def test_decode_plan_refuses_a_delta_op_that_does_not_apply(reader: ContainerReader, pool: ThreadPoolExecutor) -> None:
    entries = copy.deepcopy(list(_by_path(reader).values()))
    st = _decode.stage(reader, entries, pool)
    assert st.plan is not None
    i = int(np.nonzero(st.plan.rot)[0][0])
    entries[i]["delta"] = {"base": {"step": 1}, "op": "add"}
    with pytest.raises(DecodeError, match="delta op 'add' does not apply"):
        _decode.DecodePlan.build(st, entries, "x.s4w")


@pytest.mark.parametrize("tamper", ["duplicate", "missing", "negative"])
def test_decode_plan_refuses_a_bad_chunk_table(reader: ContainerReader, pool: ThreadPoolExecutor, tamper: str) -> None:
    """A chunk table that does not cover each segment and plane exactly once is a DecodeError
    before any kernel runs (the merge reads one address per chunk)."""
    entries = list(_by_path(reader).values())
    st = _decode.stage(reader, entries, pool)
    assert st.plan is not None
    rot = [c for c, (k, *_r) in enumerate(st.recs.tolist()) if st.plan.rot[k]]
    recs = st.recs.copy()
    if tamper == "duplicate":
        recs[rot[1]] = recs[rot[0]]
    elif tamper == "missing":
        recs[rot[0], 2] += 10 * int(entries[recs[rot[0], 0]]["segment_elems"])  # a segment past the end
    else:
        recs[rot[0], 2] = -int(entries[recs[rot[0], 0]]["segment_elems"])
    bad = _decode.Staged(st.host, st.slot, st.kinds, st.stored, recs)
    with pytest.raises(DecodeError, match="exactly once"):
        bad.plan_for(entries, "x.s4w")


# ----------------------------------------------------------------------------- pipeline
class _Pipeline:
    """Stand-ins for stage() and _decode_group(): one batch per entry, hooks per batch index."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.on_stage: dict[int, Callable[[], None]] = {}
        self.on_decode: dict[int, Callable[[], None]] = {}
        self.stage_threads: set[str] = set()
        monkeypatch.setattr(_nvcomp, "batch_bytes", lambda dev, work=None: 10)
        monkeypatch.setattr(_decode, "stage", self.stage)
        monkeypatch.setattr(_decode, "_decode_group", self.decode)

    def _note(self, what: str, i: int) -> None:
        with self.lock:
            self.log.append((what, i))

    def stage(self, reader: Any, group: list[dict[str, Any]], pool: ThreadPoolExecutor) -> int:
        i = group[0]["i"]
        self.stage_threads.add(threading.current_thread().name)
        self._note("stage", i)
        self.on_stage.get(i, lambda: None)()
        self._note("staged", i)
        return i

    def decode(self, reader: Any, group: list[dict[str, Any]], st: Any, dev: Any, resolve: Any) -> list[torch.Tensor]:
        i = group[0]["i"]
        assert st == i
        self._note("decode", i)
        self.on_decode.get(i, lambda: None)()
        return [torch.tensor(i)]

    def run(self, n: int) -> list[torch.Tensor]:
        entries = [{"i": i, "nbytes": 10} for i in range(n)]
        return _decode.decode_storages(None, entries, torch.device("cpu"), None)  # type: ignore[arg-type]


def _stagers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("s4w-stage")]


@pytest.fixture(params=[1, 2, 4], ids=["ahead1", "ahead2", "ahead4"])
def depth(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Batches staged ahead of the decode (``S4W_STAGE_AHEAD``; 4 by default)."""
    monkeypatch.setenv("S4W_STAGE_AHEAD", str(request.param))
    return int(request.param)


def test_pipeline_stages_ahead_by_default_four() -> None:
    assert config.KNOBS["S4W_STAGE_AHEAD"].default == 4


def test_pipeline_stages_the_next_batch_during_a_decode(monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    p = _Pipeline(monkeypatch)
    next_staged = threading.Event()
    p.on_stage[depth] = next_staged.set

    def decode0() -> None:
        assert next_staged.wait(10), f"batch {depth} was not staged while batch 0 decoded"

    p.on_decode[0] = decode0
    n = depth + 2
    assert [int(t) for t in p.run(n)] == list(range(n))
    assert [x for x in p.log if x[0] == "decode"] == [("decode", i) for i in range(n)]
    assert p.log.index(("stage", depth + 1)) > p.log.index(("decode", 0))  # `depth` batches ahead, no more
    assert all(t.startswith("s4w-stage") for t in p.stage_threads)
    assert not _stagers()
    assert p.run(0) == []


def test_pipeline_decode_error_waits_for_the_batch_staged_ahead(monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    p = _Pipeline(monkeypatch)
    started, release = threading.Event(), threading.Event()

    def stage_last() -> None:
        started.set()
        release.wait(10)

    def decode0() -> None:
        assert started.wait(10)
        threading.Timer(0.3, release.set).start()  # the last batch staged ahead still stages when this raises
        raise ChecksumMismatchError("batch 0 decoded wrong")

    p.on_stage[depth] = stage_last

    p.on_decode[0] = decode0
    with pytest.raises(ChecksumMismatchError, match="batch 0"):
        p.run(depth + 2)
    assert ("staged", depth) in p.log, f"returned while batch {depth} was still staging"
    assert ("stage", depth + 1) not in p.log and ("decode", 1) not in p.log
    assert not _stagers()


def test_pipeline_stage_error_surfaces_in_batch_order(monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    p = _Pipeline(monkeypatch)

    def bad() -> None:
        raise TruncatedError("batch 1 is short")

    p.on_stage[1] = bad
    decoded0 = threading.Event()
    p.on_decode[0] = decoded0.set
    with pytest.raises(TruncatedError, match="batch 1"):
        p.run(depth + 2)
    assert decoded0.is_set() and ("decode", 1) not in p.log and ("stage", depth + 1) not in p.log
    assert not _stagers()

"""GPU reader: verify on the host, stage, decode in one nvCOMP call per batch, merge planes (Triton).

Order of work for a batch of storage entries:

1. host, thread pool: read the batch's chunks by a few large scatter reads (chunks back to back in
   the file, or nearly, share a read; each chunk lands straight in its own 16-byte aligned slot of
   one pinned buffer: the container packs chunks without padding, and nvCOMP's batched decoders
   want aligned buffers, ANS up to 16 bytes), then check each chunk's xxh3 against the manifest
   (a mismatch raises :class:`ChecksumMismatchError` before any byte reaches a GPU decoder: FACTS,
   nvCOMP can crash or hang on corrupt input); zstd chunks are decoded right there (and deflate
   chunks too when ``S4W_GPU_INFLATE=0``) into slots after the others; then the batch's
   :class:`DecodePlan` (every table of steps 3-4 that does not depend on buffer addresses, checked);
2. one host-to-device copy of the pinned buffer;
3. one nvCOMP call per codec (ANS for ``nvcomp-ans``, Deflate for ``deflate``: nvCOMP's inflater
   reads zlib's Huffman-only streams and its own, checked on the device) decodes every chunk
   straight into its place in a planes buffer (``planes[j * plane_stride + s0]``; chunks whose
   place is not 16-byte aligned, which only a writer with an odd ``segment_elems`` produces, go
   through a scratch slot); one gather-copy launch places raw and CPU-decoded chunks;
4. merge planes into each output tensor (the delta op, ``xor`` or ``sub``, undone against the base
   in the same kernel; launch tables in one upload), then check each storage's raw
   checksum: ``fold64`` on the GPU (one read-back for the batch, which also carries the count of
   chunks nvCOMP failed on), ``xxh3-64`` on the host.

Batches are pipelined: stager threads read and check batches ``i + 1`` and ``i + 2`` (step 1,
``S4W_STAGE_AHEAD`` batches ahead) while batch ``i`` runs steps 2-4.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from s4w_core import checksum as ck
from s4w_core import config, engine
from s4w_core.codecs import DEFLATE, NVCOMP_ANS, RAW, get_codec
from s4w_core.errors import ChecksumMismatchError, DecodeError
from s4w_core.format.container import ContainerReader
from s4w_core.format.manifest import NZ_TRANSFORMS, rowcol_offsets
from s4w_core.gpu import _nvcomp
from s4w_core.gpu._coder import TRACE_MARKS, mark
from s4w_core.gpu._decplan import Call, DecodePlan, plan_key
from s4w_core.gpu._nonzero import decode_nonzero_device
from s4w_core.gpu._prove import prove_claims
from s4w_core.gpu.kernels import fold64_finish, fold64_launch, fold64_rows, gather_copy
from s4w_core.planes import rowcol
from s4w_core.planes.triton_kernels import (
    MERGE,
    MERGE_CHUNKS,
    Tables,
    launch_items,
    launch_rows,
)
from s4w_core.workers import Pool

__all__ = ["decode_storages", "stage", "decode_device", "Staged"]

_A = _nvcomp.ALIGN

#: a file gap (bytes of chunks outside the batch) up to this size between two chunks is read and
#: dropped, so that both chunks come in one read ...
_MAX_GAP = 64 << 10
#: ... unless the gaps so read would add more than this fraction of the chunks' own bytes: then
#: only chunks that lie back to back share a read
_MAX_OVERREAD = 0.25
#: a read is at most ``S4W_READ_BLOCK`` bytes (32 MiB); batches are staged (read and checked)
#: ``S4W_STAGE_AHEAD`` (4) ahead of the one being decoded, so that about that many reads are in
#: flight. (On an H100's local disk, a 2.3 GB bf16 state cold: 4 ahead with one read per batch
#: loaded in 0.77-0.79 s, 2 ahead with each batch cut into 4 parallel reads 0.96-0.97 s in the same
#: sweep, 0.91-1.01 s in four other runs.)


def _round(x: int, a: int) -> int:
    return -(-x // a) * a


def decode_storages(
    reader: ContainerReader,
    entries: list[dict[str, Any]],
    device: torch.device,
    resolve_base: engine.BaseResolver | None,
    pool: Pool | None = None,
    on_batch: Callable[[int, list[torch.Tensor]], None] | None = None,
) -> list[torch.Tensor]:
    """See :func:`s4w_core.gpu.decode_storages`."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    prove_claims(reader, entries, device)  # implausible GPU-only claims decoded first (gpu/_prove.py)
    own = pool is None
    if pool is None:
        pool = Pool(min(8, os.cpu_count() or 1))
    # stager threads run stage() (which waits on reads it submits to `pool`) up to `depth` batches
    # ahead, so the reads of the next batch are queued while this one's last reads finish (one
    # batch ahead, the disk idled at every batch boundary); stage() itself never runs in `pool`,
    # where it could wait on tasks queued behind it
    depth = config.get_int("S4W_STAGE_AHEAD")
    stager = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="s4w-stage")
    ahead: deque[Future[Staged | None]] = deque()
    try:
        groups = _groups(entries, _nvcomp.batch_bytes(device))
        outs: list[torch.Tensor] = []
        todo = iter(groups)
        for group in itertools.islice(todo, depth):
            ahead.append(stager.submit(_stage_gpu, reader, group, pool))
        for group in groups:
            st = ahead.popleft().result()  # a failed read or check of this batch raises here, in batch order
            for later in itertools.islice(todo, 1):
                ahead.append(stager.submit(_stage_gpu, reader, later, pool))
            if st is None:  # a nonzero or row/column-transform storage: decoded on its own
                done = [_decode_alone(reader, e, device, resolve_base, pool) for e in group]
            else:
                done = _decode_group(reader, group, st, device, resolve_base)
            if on_batch is not None:  # checked and complete: the next batch is being read meanwhile
                on_batch(len(outs), done)
            outs.extend(done)
        return outs
    finally:
        for f in ahead:  # an earlier batch failed: drop the batches staged ahead
            f.cancel()
        stager.shutdown(wait=True)  # before `pool`: a running stage() still submits reads to it
        if own:
            pool.shutdown(wait=True)


def _alone(e: dict[str, Any]) -> bool:
    """Whether a storage entry is decoded on its own (a batch of its own), not by the batched
    plane merge: the nonzero (``nz-*``) transforms."""
    return e.get("transform") in NZ_TRANSFORMS


def _decode_alone(
    reader: ContainerReader,
    e: dict[str, Any],
    device: torch.device,
    resolve_base: engine.BaseResolver | None,
    pool: Pool,
) -> torch.Tensor:
    """One ``nz-`` storage on the device; one whose size claim is implausible for its
    stored bytes (:func:`engine.claims_plausible`) and that the CPU can decode goes through the CPU
    reader, which decodes its chunks before allocating its output, and is then copied over."""
    if not engine.claims_plausible(e) and all(get_codec(c[0]).cpu_decodable for c in e["chunks"]):
        return engine.decode_storage_cpu(reader, e, pool, resolve_base, reader.name).to(device)
    base = engine.resolve_base_bytes(e, resolve_base, reader.name, device)
    return decode_nonzero_device(reader, e, device, base, _gpu_inflate())


def _stage_gpu(reader: ContainerReader, entries: list[dict[str, Any]], pool: ThreadPoolExecutor) -> Staged | None:
    """:func:`stage`, or None for a batch of a storage decoded on its own (:func:`_alone`: by
    :func:`~s4w_core.gpu._nonzero.decode_nonzero_device`)."""
    if _alone(entries[0]):
        return None
    return stage(reader, entries, pool)


def _groups(entries: list[dict[str, Any]], budget: int) -> list[list[dict[str, Any]]]:
    """``entries`` cut into batches of at most ``budget`` raw bytes (a larger entry alone); a
    storage decoded on its own (:func:`_alone`) is a batch of its own."""
    groups: list[list[dict[str, Any]]] = []
    size = 0
    nz_last = False
    for e in entries:
        nz = _alone(e)
        if not groups or size + e["nbytes"] > budget or nz or nz_last:
            nz_last = nz
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e["nbytes"]
    return groups


def _gpu_inflate() -> bool:
    """Inflate deflate chunks with nvCOMP (verified on the device to read zlib's and nvCOMP's raw
    deflate streams); ``S4W_GPU_INFLATE=0`` keeps them on the CPU. zstd chunks always decode on
    the CPU: nvCOMP's Zstd decoder can hang on malformed input (FACTS) and an xxh3 match is no
    protection against a deliberately forged file."""
    return config.get_bool("S4W_GPU_INFLATE")



@dataclass
class Staged:
    """A batch of chunks checked and packed on the host, ready for one host-to-device copy.

    The chunk table is held as numpy arrays (lists given to the constructor are converted once),
    so the device decode works on it without a Python step per chunk; :func:`stage` builds it on
    the stager thread, while the GPU decodes the batch before."""

    host: torch.Tensor  # pinned uint8
    slot: Any  # offset of each chunk in ``host`` (a multiple of _nvcomp.ALIGN); int64 array
    kinds: Any  # "ans"/"inflate" (decoded by nvCOMP) or "copy" (raw or CPU-decoded bytes); str array
    stored: Any  # bytes of each chunk in ``host``; int64 array
    recs: Any  # (entry, plane, s0, raw_len) per chunk; int64 array of shape (chunks, 4)
    plan: DecodePlan | None = None  # built by plan_for() (stage() does, on the stager thread)

    def __post_init__(self) -> None:
        self.slot = np.asarray(self.slot, dtype=np.int64)
        self.kinds = np.asarray(self.kinds, dtype=str)
        self.stored = np.asarray(self.stored, dtype=np.int64)
        self.recs = np.asarray(self.recs, dtype=np.int64).reshape(-1, 4)

    def plan_for(self, entries: list[dict[str, Any]], name: str = "<checkpoint>") -> DecodePlan:
        """The device decode's tables for this batch of ``entries`` (built once, then cached)."""
        if self.plan is None or self.plan.entries is not entries or self.plan.key != plan_key():
            self.plan = DecodePlan.build(self, entries, name)
        return self.plan


class _Chunk(NamedTuple):
    """One chunk of a batch, as stage() reads it."""

    path: str  # its tensor's path (for messages)
    nth: int  # its index among its entry's chunks
    codec: str
    off: int
    length: int
    xxh3: str
    raw_len: int
    kind: str  # "ans", "inflate", "copy" (read into its slot) or "host" (read aside, decoded into it)


def _kind(codec_id: str, inflate: bool) -> str:
    if codec_id == NVCOMP_ANS.id:
        return "ans"
    if codec_id == RAW.id:
        return "copy"
    if codec_id == DEFLATE.id and inflate:
        return "inflate"
    return "host"


def stage(reader: ContainerReader, entries: list[dict[str, Any]], pool: ThreadPoolExecutor) -> Staged:
    """Read and verify every chunk of ``entries`` (reads in parallel on ``pool``), CPU-decode
    zstd (and deflate when ``S4W_GPU_INFLATE=0``), all into one pinned buffer.

    Layout of :attr:`Staged.host`: the chunks read in place, in file order, each in a slot rounded
    up to :data:`_nvcomp.ALIGN`; then the decoded bytes of the host-decoded chunks (whose stored
    bytes are read into ordinary memory). Every check passed when this returns. Storages decoded on
    their own (:func:`_alone`: ``nz-``) have no place in a staged batch: ValueError
    (:func:`decode_storages` routes them).
    """
    alone = [e["path"] for e in entries if _alone(e)]
    if alone:
        raise ValueError(f"stage: {alone[:3]} are decoded on their own (nz- transforms), not in a batch")
    inflate = _gpu_inflate()
    recs: list[tuple[int, int, int, int]] = []
    chunks: list[_Chunk] = []
    for k, e in enumerate(entries):
        for i, (s0, s1, j) in enumerate(engine.chunk_layout(e)):
            codec_id, off, length, h = e["chunks"][i]
            reader.check_range(off, length)
            recs.append((k, j, s0, s1 - s0))
            chunks.append(_Chunk(e["path"], i, codec_id, off, length, h, s1 - s0, _kind(codec_id, inflate)))
    order = sorted(range(len(chunks)), key=lambda c: chunks[c].off)
    slot = [0] * len(chunks)
    pos = 0
    for c in order:
        if chunks[c].kind != "host":
            slot[c], pos = pos, pos + _round(chunks[c].length, _A)
    for c in order:
        if chunks[c].kind == "host":
            slot[c], pos = pos, pos + _round(chunks[c].raw_len, _A)
    host = _nvcomp.host_empty(pos)
    mv = memoryview(host.numpy())
    futs = [
        pool.submit(_read_and_check, reader, chunks, slot, mv, offset, members)
        for offset, members in _plan_reads(chunks, order)
    ]
    _wait_in_order(futs)
    kinds = ["copy" if ch.kind == "host" else ch.kind for ch in chunks]
    stored = [ch.raw_len if ch.kind == "host" else ch.length for ch in chunks]
    st = Staged(host, slot, kinds, stored, recs)
    st.plan_for(entries, reader.name)  # here, on the stager thread, while the GPU decodes the batch before
    return st


def _read_block() -> int:
    """Bytes per read at most (``S4W_READ_BLOCK``)."""
    return max(1, config.get_int("S4W_READ_BLOCK"))


def _plan_reads(chunks: list[_Chunk], order: list[int]) -> list[tuple[int, list[int]]]:
    """The reads of a batch: ``(file offset, chunks)``, the chunks taken from ``order`` (by file
    offset) while each starts where the one before ends, or at most :data:`_MAX_GAP` bytes after
    it (see :data:`_MAX_OVERREAD`), and the read stays within :func:`_read_block` bytes (a longer
    chunk is a read of its own)."""
    ends = [chunks[c].off + chunks[c].length for c in order]
    gaps = [chunks[c].off - end for c, end in zip(order[1:], ends)]
    data = sum(chunks[c].length for c in order)
    over = sum(g for g in gaps if 0 < g <= _MAX_GAP)
    max_gap = _MAX_GAP if over <= _MAX_OVERREAD * data else 0
    block = _read_block()
    reads: list[tuple[int, list[int]]] = []
    for n, c in enumerate(order):
        if n and 0 <= gaps[n - 1] <= max_gap and ends[n] - reads[-1][0] <= block:
            reads[-1][1].append(c)
        else:
            reads.append((chunks[c].off, [c]))
    return reads


def _read_and_check(
    reader: ContainerReader, chunks: list[_Chunk], slot: list[int], mv: memoryview, offset: int, members: list[int]
) -> None:
    """One scatter read of ``members`` from ``offset`` on: each chunk into its slot of ``mv`` (a
    host-decoded one into a buffer of its own, a gap into a dropped one); then each chunk's xxh3 is
    checked and host-decoded chunks are decoded into their slots."""
    views: list[memoryview] = []
    aside: dict[int, memoryview] = {}
    pos = offset
    for c in members:
        ch = chunks[c]
        if ch.off > pos:
            views.append(memoryview(bytearray(ch.off - pos)))
        if ch.kind == "host":
            aside[c] = memoryview(bytearray(ch.length))
            views.append(aside[c])
        else:
            views.append(mv[slot[c] : slot[c] + ch.length])
        pos = ch.off + ch.length
    reader.read_into(offset, views)
    for c in members:
        ch = chunks[c]
        data = aside[c] if c in aside else mv[slot[c] : slot[c] + ch.length]
        if ck.xxh3_hex(data) != ch.xxh3:
            raise ChecksumMismatchError(
                f"{reader.name}: chunk {ch.nth} of tensor {ch.path!r} (bytes {ch.off}..{ch.off + ch.length}) is "
                "corrupt: checksum mismatch (found before any GPU decoder saw it)"
            )
        if c in aside:
            mv[slot[c] : slot[c] + ch.raw_len] = get_codec(ch.codec).decode(data, ch.raw_len)


def _wait_in_order(futs: list[Future[None]]) -> None:
    """Wait for ``futs``; the first failure in their order is raised once none of them runs any
    more (those not started yet are cancelled)."""
    for f in futs:
        try:
            f.result()
        except BaseException:
            for g in futs:
                g.cancel()
            wait(futs)
            raise


def _decode_group(
    reader: ContainerReader,
    entries: list[dict[str, Any]],
    st: Staged,
    dev: torch.device,
    resolve_base: engine.BaseResolver | None,
) -> list[torch.Tensor]:
    """Steps 2-4 for one batch, staged (step 1) in ``st``."""
    name = reader.name
    # bases and outputs first, on the caller's stream (they outlive our stream's work); the bases
    # before the outputs: a delta's size is proven by its base before it is allocated (docs/SECURITY.md)
    bases = [engine.resolve_base_bytes(e, resolve_base, name, dev) for e in entries]
    outs = [torch.empty(e["nbytes"], dtype=torch.uint8, device=dev) for e in entries]
    with _nvcomp.on_stream(dev):
        staged = st.host.to(dev, non_blocking=True)
        sums = decode_device(staged, st, entries, outs, bases, dev, name)
        del staged
    for k, e in enumerate(entries):
        algo = e["checksum"].split(":", 1)[0]
        if algo == "fold64":
            got = f"fold64:{fold64_finish(int(sums[k]), e['nbytes']):016x}"
        else:
            got = ck.compute_checksum(algo, outs[k])
        if got != e["checksum"]:
            raise ChecksumMismatchError(
                f"{name}: tensor {e['path']!r} decoded to bytes that do not match its recorded "
                f"checksum {e['checksum']}" + (" (is the delta base the right one?)" if bases[k] is not None else "")
            )
    return outs




def _add_rowcol_offsets(
    plan: DecodePlan, entries: list[dict[str, Any]], staged: torch.Tensor, planes: torch.Tensor, dev: torch.device,
    name: str,
) -> None:
    """Plane 0 of each row/column-transform entry's segments, where the merge will read it, plus
    its row and column offsets (mod 256; docs/FORMAT.md 4.5d): the merge then takes it as plane 0
    of ``planes-rotl1`` / ``planes``."""
    offsets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for k, s0, n, in_staged, off in plan.rc_fix:
        if k not in offsets:
            e = entries[k]
            _c, row_b, col_b = rowcol_offsets(e, int(plan.n_el[k]), f"{name}: tensor {e['path']!r}")
            offsets[k] = (
                torch.frombuffer(bytearray(row_b), dtype=torch.uint8).to(dev),
                torch.frombuffer(bytearray(col_b), dtype=torch.uint8).to(dev),
            )
        row, col = offsets[k]
        buf = staged if in_staged else planes
        if off + n > buf.numel():
            raise DecodeError(f"{name}: a row/column chunk lies outside its buffer")
        buf[off : off + n].add_(rowcol.tile_torch(row, col, s0, s0 + n))


def decode_device(
    staged: torch.Tensor,
    st: Staged,
    entries: list[dict[str, Any]],
    outs: list[torch.Tensor],
    bases: list[torch.Tensor | None],
    dev: torch.device,
    name: str = "<checkpoint>",
) -> list[int]:
    """Device part of decoding (call under ``_nvcomp.on_stream``): chunks already on the device in
    ``staged`` to ``outs``. Returns the fold64 word sums per entry (0 for xxh3 entries).

    The entropy decoders are enqueued before anything else (their tables come from the batch's
    :class:`DecodePlan`, built on the stager thread), so the GPU decodes while the host fills in
    the merge's addresses; every other table goes to the device in one copy. The one
    synchronization is one read-back at the end: the fold64 sums and, counted on the device, the
    chunks nvCOMP failed on or decoded to another length (those are read back in full, for the
    message, only when there are any)."""
    TRACE_MARKS.clear()
    mark("start", dev)
    plan = st.plan_for(entries, name)
    mark("plan", dev)
    if plan.staged_end > staged.numel():
        raise DecodeError(f"{name}: a staged chunk lies outside the staged buffer")
    planes = torch.empty(max(plan.planes_bytes, 1), dtype=torch.uint8, device=dev)
    pending = [_gpu_decode(call, dev, staged, planes, name) for call in plan.calls]
    mark("nvcomp_decode", dev)
    gather_copy(staged, planes, *plan.place, pad_ok=True)
    if plan.rc_fix:
        _add_rowcol_offsets(plan, entries, staged, planes, dev, name)
    mark("place", dev)
    k_n = plan.k
    out_addr = np.fromiter((o.data_ptr() for o in outs), dtype=np.int64, count=k_n)
    has = np.fromiter((b is not None for b in bases), dtype=bool, count=k_n)
    is_delta = (plan.op & 3) != 0
    if (has != is_delta).any():
        i = int(np.nonzero(has != is_delta)[0][0])
        raise DecodeError(f"{name}: tensor {entries[i]['path']!r}: a delta base was {'' if has[i] else 'not '}given "
                          f"but the entry is {'' if is_delta[i] else 'not '}a delta")
    base_addr = np.zeros(k_n, dtype=np.int64)
    for i in np.nonzero(has)[0].tolist():
        base = bases[i]
        assert base is not None
        if base.numel() != int(plan.nbytes[i]):
            raise DecodeError(f"{name}: the delta base of tensor {entries[i]['path']!r} has the wrong size")
        base_addr[i] = base.data_ptr()
    rot = plan.rot
    tables = Tables()
    if plan.in_place:
        assert plan.chunk_staged is not None and plan.chunk_off is not None
        t_chunks = tables.add(np.where(plan.chunk_staged, staged.data_ptr(), planes.data_ptr()) + plan.chunk_off)
        aligned = (
            plan.chunk_aligned
            and staged.data_ptr() % 16 == 0
            and planes.data_ptr() % 16 == 0
            and not ((out_addr[rot] | base_addr[rot]) % 16).any()
        )
        merges = [
            (g, tables.add(np.column_stack([out_addr[g.idx], base_addr[g.idx], g.cols])), plan.map_at[n])
            for n, g in enumerate(plan.merge_groups)
        ]
    fold_words_ok = not (out_addr[plan.fold_idx] % 4).any()
    if fold_words_ok:
        folds = [
            (g, tables.add(np.column_stack([out_addr[g.idx], g.cols])), plan.map_at[len(plan.merge_groups) + n])
            for n, g in enumerate(plan.fold_groups)
        ]
    dev_tables = tables.upload(dev)
    maps = plan.maps_host.to(dev, non_blocking=True) if dev.type == "cuda" else plan.maps_host
    mark("merge_tables", dev)
    if plan.in_place:
        for g, t_rows, t_map in merges:
            launch_items(MERGE_CHUNKS, g.w, g.op, dev_tables[t_rows], maps[t_map:], g.programs,
                         dev_tables[t_chunks], aligned)
    else:
        assert plan.merge_cols is not None
        rows = np.column_stack([out_addr, base_addr, plan.merge_cols])
        for w_ in plan.rot_widths:
            sel = rot & (plan.width == w_)
            launch_rows(MERGE, int(w_), planes, rows[sel], plan.op[sel])
    for i in plan.byte_entries:  # storages coded as bytes
        off = int(plan.region[i])
        src = planes[off : off + int(plan.n_el[i])]
        base = bases[i]
        if base is None:
            outs[i].copy_(src)
        else:
            torch.bitwise_xor(src, base, out=outs[i])
    mark("merge", dev)
    # one read-back: the fold64 sums, then per nvCOMP call the chunks that failed on the device
    acc = torch.zeros(k_n + len(pending), dtype=torch.int64, device=dev)
    if fold_words_ok:
        for g, t_rows, t_map in folds:
            fold64_launch(dev_tables[t_rows], maps[t_map:], g.programs, acc, bool(g.w))
    elif len(plan.fold_idx):
        idx = plan.fold_idx
        fold64_rows(out_addr[idx], plan.nbytes[idx], idx, acc)
    counted = []
    for m, pd in enumerate(pending):
        f = pd.failures()
        if f is not None:
            acc[k_n + m : k_n + m + 1].copy_(f)
        counted.append(f is not None)
    mark("fold64", dev)
    vals = acc.cpu().tolist()
    mark("readback", dev)
    for m, pd in enumerate(pending):
        if not counted[m] or vals[k_n + m]:
            pd.check()
    mark("checks", dev)
    return vals[:k_n]  # ints already (tolist)


class _Pending:
    """One enqueued nvCOMP decode call: its decoded sizes (and statuses) to check."""

    __slots__ = ("call", "got", "name")

    def __init__(self, call: Call, got: Any, name: str) -> None:
        self.call, self.got, self.name = call, got, name

    def failures(self) -> torch.Tensor | None:
        """The number of failed chunks, counted on the device, or None where only a read-back tells."""
        f: torch.Tensor | None = self.got.failures() if hasattr(self.got, "failures") else None
        return f

    def check(self) -> None:
        """Read the sizes back and raise DecodeError naming the first bad chunk."""
        algorithm, raw = self.call.algorithm, self.call.raw
        try:
            sizes = np.asarray(list(self.got), dtype=np.int64)
        except (RuntimeError, ValueError) as e:
            raise DecodeError(
                f"{self.name}: nvCOMP {algorithm} failed to decode a chunk whose checksum matched: {e}"
            ) from e
        bad = np.nonzero(sizes != raw)[0]
        if len(bad):
            raise DecodeError(
                f"{self.name}: nvCOMP {algorithm} decoded {len(bad)} chunk(s) to a different length than recorded "
                f"(first: {int(sizes[bad[0]])} bytes, expected {int(raw[bad[0]])})"
            )


def _gpu_decode(call: Call, dev: torch.device, staged: torch.Tensor, planes: torch.Tensor, name: str) -> _Pending:
    """Enqueue one nvCOMP decode call (and, for a scratch call, the copy of its chunks into
    place); its sizes are checked once the rest of the batch is enqueued."""
    dst = planes if not call.scratch else torch.empty(call.scratch, dtype=torch.uint8, device=dev)
    c = _nvcomp.codec(call.algorithm, dev, call.chunk_bytes, **call.opts)
    try:
        if call.ans is not None and isinstance(c, _nvcomp.AnsC):
            got: Any = c.decode_table(call.ans, staged, dst)
        else:
            got = _nvcomp.decode_batch(c, staged, call.src, call.lengths, dst, call.dst, call.raw)
    except (RuntimeError, ValueError) as e:
        raise DecodeError(f"{name}: nvCOMP {call.algorithm} failed to decode a chunk whose checksum matched: {e}") from e
    if call.place is not None:
        gather_copy(dst, planes, call.dst, call.place, call.raw)
    return _Pending(call, got, name)

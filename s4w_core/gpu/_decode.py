"""GPU reader: verify on the host, stage, decode in one nvCOMP call per batch, merge planes (Triton).

Order of work for a batch of storage entries:

1. host, thread pool: read the batch's chunks by a few large scatter reads (chunks back to back in
   the file, or nearly, share a read; each chunk lands straight in its own 16-byte aligned slot of
   one pinned buffer: the container packs chunks without padding, and nvCOMP's batched decoders
   want aligned buffers, ANS up to 16 bytes), then check each chunk's xxh3 against the manifest
   (a mismatch raises :class:`ChecksumMismatchError` before any byte reaches a GPU decoder: FACTS,
   nvCOMP can crash or hang on corrupt input); zstd chunks are decoded right there (and deflate
   chunks too when ``S4W_GPU_INFLATE=0``) into slots after the others;
2. one host-to-device copy of the pinned buffer;
3. one nvCOMP call per codec (ANS for ``nvcomp-ans``, Deflate for ``deflate``: nvCOMP's inflater
   reads zlib's Huffman-only streams and its own, checked on the device) decodes every chunk
   straight into its place in a planes buffer (``planes[j * plane_stride + s0]``; chunks whose
   place is not 16-byte aligned, which only a writer with an odd ``segment_elems`` produces, go
   through a scratch slot); one gather-copy launch places raw and CPU-decoded chunks;
4. merge planes into each output tensor (the delta op, ``xor`` or ``sub``, undone against the base
   in the same kernel), then check each storage's raw
   checksum: ``fold64`` on the GPU (one read-back for the batch), ``xxh3-64`` on the host.

Batches are pipelined: a stager thread reads and checks batch ``i + 1`` (step 1) while batch ``i``
runs steps 2-4.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from s4w_core import checksum as ck
from s4w_core import engine
from s4w_core.codecs import DEFLATE, NVCOMP_ANS, RAW, get_codec
from s4w_core.errors import ChecksumMismatchError, DecodeError
from s4w_core.format.container import ContainerReader
from s4w_core.gpu import _nvcomp
from s4w_core.gpu._encode import TRACE_MARKS, _mark
from s4w_core.gpu.kernels import fold64_finish, fold64_rows, gather_copy
from s4w_core.planes.triton_kernels import MERGE, OPS, launch_rows, merge_block, merge_chunks, upload

__all__ = ["decode_storages", "stage", "decode_device", "Staged"]

_A = _nvcomp.ALIGN
_ROTL1 = "planes-rotl1"

#: a file gap (bytes of chunks outside the batch) up to this size between two chunks is read and
#: dropped, so that both chunks come in one read ...
_MAX_GAP = 64 << 10
#: ... unless the gaps so read would add more than this fraction of the chunks' own bytes: then
#: only chunks that lie back to back share a read
_MAX_OVERREAD = 0.25
#: default bytes per read (``S4W_READ_BLOCK``); a smaller batch is cut into :data:`_MIN_READS`
#: reads of at least :data:`_MIN_READ` bytes, so that its reads still run in parallel
_READ_BLOCK = 32 << 20
_MIN_READS = 4
_MIN_READ = 1 << 20


def _round(x: int, a: int) -> int:
    return -(-x // a) * a


def decode_storages(
    reader: ContainerReader,
    entries: list[dict[str, Any]],
    device: torch.device,
    resolve_base: engine.BaseResolver | None,
    pool: ThreadPoolExecutor | None = None,
) -> list[torch.Tensor]:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    own = pool is None
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
    # the stager thread runs stage() (which waits on reads it submits to `pool`) one batch ahead;
    # stage() itself never runs in `pool`, where it could wait on tasks queued behind it
    stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s4w-stage")
    ahead: Future[Staged] | None = None
    try:
        groups = _groups(entries, _nvcomp.batch_bytes(device))
        outs: list[torch.Tensor] = []
        if groups:
            ahead = stager.submit(stage, reader, groups[0], pool)
        for i, group in enumerate(groups):
            assert ahead is not None
            st = ahead.result()  # a failed read or check of this batch raises here, in batch order
            ahead = stager.submit(stage, reader, groups[i + 1], pool) if i + 1 < len(groups) else None
            outs.extend(_decode_group(reader, group, st, device, resolve_base))
        return outs
    finally:
        if ahead is not None:  # an earlier batch failed: drop the batch staged ahead
            ahead.cancel()
        stager.shutdown(wait=True)  # before `pool`: a running stage() still submits reads to it
        if own:
            pool.shutdown(wait=True)


def _groups(entries: list[dict[str, Any]], budget: int) -> list[list[dict[str, Any]]]:
    """``entries`` cut into batches of at most ``budget`` raw bytes (a larger entry alone)."""
    groups: list[list[dict[str, Any]]] = []
    size = 0
    for e in entries:
        if not groups or size + e["nbytes"] > budget:
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
    return os.environ.get("S4W_GPU_INFLATE", "1") != "0"


#: nvCOMP decoder per staged kind: (algorithm, codec options)
_GPU_DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ans": ("ANS", {"data_type": "|u1"}),
    "inflate": ("Deflate", {}),
}


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

    def __post_init__(self) -> None:
        self.slot = np.asarray(self.slot, dtype=np.int64)
        self.kinds = np.asarray(self.kinds, dtype=str)
        self.stored = np.asarray(self.stored, dtype=np.int64)
        self.recs = np.asarray(self.recs, dtype=np.int64).reshape(-1, 4)


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
    bytes are read into ordinary memory). Every check passed when this returns.
    """
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
    return Staged(host, slot, kinds, stored, recs)


def _read_block(data: int) -> int:
    """Bytes per read for a batch of ``data`` chunk bytes (see :data:`_READ_BLOCK`)."""
    block = int(os.environ.get("S4W_READ_BLOCK", _READ_BLOCK))
    return max(1, min(block, max(_MIN_READ, -(-data // _MIN_READS))))


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
    block = _read_block(data)
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
    # outputs and bases first, on the caller's stream (they outlive our stream's work)
    outs = [torch.empty(e["nbytes"], dtype=torch.uint8, device=dev) for e in entries]
    bases = [engine.resolve_base_bytes(e, resolve_base, name, dev) for e in entries]
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
    ``staged`` to ``outs``. Returns the fold64 word sums per entry (0 for xxh3 entries); reading
    them back, with nvCOMP's decoded sizes, is the one synchronization: every launch is enqueued
    first. Host work is numpy over the chunk and entry tables, no Python step per chunk."""
    TRACE_MARKS.clear()
    _mark("start", dev)
    k_n = len(entries)
    meta = np.array(
        [(e["_width"], e["nbytes"], e["transform"] == _ROTL1, e["segment_elems"], e["checksum"].startswith("fold64:"))
         for e in entries],
        dtype=np.int64,
    ).reshape(k_n, 5)
    width, rot, seg = meta[:, 0], meta[:, 2].astype(bool), meta[:, 3]
    n_el = meta[:, 1] // width
    ps = (n_el + _A - 1) // _A * _A
    size = (width * ps + 255) // 256 * 256
    region = np.cumsum(size) - size
    planes = torch.empty(max(int(size.sum()), 1), dtype=torch.uint8, device=dev)
    rec = st.recs
    k, j, s0, raw_len = rec[:, 0], rec[:, 1], rec[:, 2], rec[:, 3]
    dst = region[k] + j * ps[k] + s0
    slot, stored, kinds = st.slot, st.stored, st.kinds
    cp = kinds == "copy"
    if cp.any() and int((slot[cp] + raw_len[cp]).max()) > staged.numel():
        raise DecodeError(f"{name}: a staged chunk lies outside the staged buffer")
    # plane-transformed storages merge their raw chunks where they lie in ``staged`` (no placement
    # copy) when every segment is a whole number of merge blocks (``S4W_MERGE_IN_PLACE=0``: never);
    # other raw chunks are placed into ``planes`` first
    in_place = bool(rot.any()) and not (seg[rot] % merge_block()).any() and os.environ.get("S4W_MERGE_IN_PLACE", "1") != "0"
    place = cp & ~rot[k] if in_place else cp
    gather_copy(staged, planes, slot[place], dst[place], raw_len[place], pad_ok=True)
    _mark("tables+place_raw", dev)
    checks = []
    for kind, (algorithm, opts) in _GPU_DECODERS.items():
        sel = kinds == kind
        if not sel.any():
            continue
        # one nvCOMP call for every chunk of this codec (two if some places are not 16-byte aligned)
        direct = sel & (dst % _A == 0)
        via = sel & (dst % _A != 0)
        checks.append(
            _gpu_decode(algorithm, opts, dev, staged, planes, slot[direct], stored[direct], dst[direct], raw_len[direct], name)
        )
        if via.any():
            rl = raw_len[via]
            sz = (rl + _A - 1) // _A * _A
            soff = np.cumsum(sz) - sz
            scratch = torch.empty(int(sz.sum()), dtype=torch.uint8, device=dev)
            checks.append(_gpu_decode(algorithm, opts, dev, staged, scratch, slot[via], stored[via], soff, rl, name))
            gather_copy(scratch, planes, soff, dst[via], rl)
    _mark("nvcomp_decode", dev)
    # merge (one launch per element width and delta op: the op is undone in the same pass),
    # then raw checksums (one launch)
    out_addr = np.fromiter((o.data_ptr() for o in outs), dtype=np.int64, count=k_n)
    base_addr = np.zeros(k_n, dtype=np.int64)
    op_code = np.zeros(k_n, dtype=np.int64)
    for i in [i for i, b in enumerate(bases) if b is not None]:
        e = entries[i]
        op = (e.get("delta") or {}).get("op", "xor")
        if rot[i]:
            base = bases[i]
            assert base is not None
            if op not in ("xor", "sub") or base.numel() != e["nbytes"]:
                raise DecodeError(f"{name}: delta op {op!r} or its base does not apply to tensor {e['path']!r}")
            base_addr[i], op_code[i] = base.data_ptr(), OPS[op]
        elif op != "xor":
            raise DecodeError(f"{name}: delta op {op!r} does not apply to tensor {e['path']!r} (transform bytes)")
    if in_place:
        _merge_in_place(staged, planes, st, entries, rec, dst, cp, rot, width, n_el, seg, out_addr, base_addr, op_code, name)
    else:
        rows = np.column_stack([out_addr, base_addr, region, n_el, ps])
        for w_ in np.unique(width[rot]).tolist():
            sel = rot & (width == w_)
            launch_rows(MERGE, int(w_), planes, rows[sel], op_code[sel])
    for i in np.nonzero(~rot)[0].tolist():  # storages coded as bytes
        off = int(region[i])
        src = planes[off : off + int(n_el[i])]
        base = bases[i]
        if base is None:
            outs[i].copy_(src)
        else:
            torch.bitwise_xor(src, base, out=outs[i])
    _mark("merge", dev)
    fold = meta[:, 4].astype(bool)
    acc = torch.zeros(max(1, k_n), dtype=torch.int64, device=dev)
    if fold.any():
        idx = np.nonzero(fold)[0]
        fold64_rows(out_addr[idx], meta[idx, 1], idx, acc)
    sums = [int(x) for x in acc.cpu().tolist()]
    for check in checks:
        check()
    _mark("fold64+readback", dev)
    return sums


def _merge_in_place(
    staged: torch.Tensor,
    planes: torch.Tensor,
    st: Staged,
    entries: list[dict[str, Any]],
    rec: np.ndarray,
    dst: np.ndarray,
    cp: np.ndarray,
    rot: np.ndarray,
    width: np.ndarray,
    n_el: np.ndarray,
    seg: np.ndarray,
    out_addr: np.ndarray,
    base_addr: np.ndarray,
    op_code: np.ndarray,
    name: str,
) -> None:
    """Merge the plane-transformed storages from a table of chunk addresses: raw chunks where they
    lie in ``staged``, decoded ones in ``planes`` (:func:`merge_chunks`; one small upload)."""
    k, j, s0 = rec[:, 0], rec[:, 1], rec[:, 2]
    nch = np.where(rot, -(-n_el // np.maximum(seg, 1)) * width, 0)
    first = np.cumsum(nch) - nch
    mine = rot[k]
    idx = first[k[mine]] + (s0[mine] // seg[k[mine]]) * width[k[mine]] + j[mine]
    total = int(nch.sum())
    have = np.bincount(idx, minlength=total) if total else np.zeros(0, dtype=np.int64)
    if len(have) != total or (have != 1).any():
        raise DecodeError(f"{name}: the chunk table does not cover every segment and plane exactly once")
    addr = np.zeros(total, dtype=np.int64)
    addr[idx] = np.where(cp[mine], staged.data_ptr() + st.slot[mine], planes.data_ptr() + dst[mine])
    chunks = upload(addr, planes.device)
    aligned = not ((addr % 16).any() or (out_addr[rot] % 16).any() or (base_addr[rot] % 16).any())
    rows = np.column_stack([out_addr, base_addr, first, n_el, seg])
    for w_ in np.unique(width[rot]).tolist():
        sel = rot & (width == w_)
        merge_chunks(int(w_), chunks, rows[sel], op_code[sel], aligned)


def _gpu_decode(
    algorithm: str,
    opts: dict[str, Any],
    dev: torch.device,
    src: torch.Tensor,
    dst: torch.Tensor,
    src_off: np.ndarray,
    lengths: np.ndarray,
    dst_off: np.ndarray,
    raw: np.ndarray,
    name: str,
) -> Callable[[], None]:
    """Enqueue one nvCOMP decode call; returns the check of its decoded sizes, to be called once
    the rest of the batch is enqueued (reading the sizes back synchronizes)."""
    if not len(src_off):
        return lambda: None
    c = _nvcomp.codec(algorithm, dev, _round(int(raw.max()), 1 << 16), **opts)
    try:
        got = _nvcomp.decode_batch(c, src, src_off, lengths, dst, dst_off, raw)
    except (RuntimeError, ValueError) as e:
        raise DecodeError(f"{name}: nvCOMP {algorithm} failed to decode a chunk whose checksum matched: {e}") from e

    def check() -> None:
        try:
            sizes = np.asarray(list(got), dtype=np.int64)
        except (RuntimeError, ValueError) as e:
            raise DecodeError(f"{name}: nvCOMP {algorithm} failed to decode a chunk whose checksum matched: {e}") from e
        bad = np.nonzero(sizes != raw)[0]
        if len(bad):
            raise DecodeError(
                f"{name}: nvCOMP {algorithm} decoded {len(bad)} chunk(s) to a different length than recorded "
                f"(first: {int(sizes[bad[0]])} bytes, expected {int(raw[bad[0]])})"
            )

    return check

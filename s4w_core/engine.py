"""Encoding and decoding of storages on the CPU (the reference path).

Unit of compression: one *storage* (the memory behind one or more tensor views, as in
``torch.save``), cut into *segments* of ``segment_elems`` elements; each segment is split into
``w`` byte planes (or one plane of bytes) and every plane of every segment is one *chunk*, coded
with the codec that measured best for it (never larger than raw: raw is always a candidate).

The storages and their transforms are in :mod:`s4w_core.jobs`, the chunk coder in
:mod:`s4w_core.codecs.chunk`, the delta-op and nonzero choices in :mod:`s4w_core.choice`, the pool
in :mod:`s4w_core.workers`; their public names are also reachable here, as the writers and readers
of the package use them.
"""

from __future__ import annotations

import collections
import errno
import mmap
import sys
from typing import Any, Callable, Iterator

import numpy as np
import torch
import xxhash
from xxhash import xxh3_64_hexdigest as xxh3_hexdigest

from s4w_core import checksum as ck
from s4w_core import delta
from s4w_core.choice import (
    DELTA_MIN_GAIN,
    DELTA_SAMPLE_ELEMS,
    choose_delta_op,
    choose_delta_op_sampled,
    choose_delta_ops,
    delta_pays,
    delta_sample_ranges,
    nonzero_pays,
    nonzero_trial,
    rowcol_choice,
    rowcol_pays,
)
from s4w_core.codecs import get_codec
from s4w_core.codecs.chunk import BITMAP, encode_chunk
from s4w_core.errors import BaseMismatchError, ChecksumMismatchError, DecodeError
from s4w_core.format.container import ContainerReader, ContainerWriter
from s4w_core.format.manifest import NZ_TRANSFORMS, PLANE_TRANSFORMS, RC_TRANSFORMS, rowcol_offsets
from s4w_core.jobs import (
    DTYPES,
    BaseLookup,
    BaseResolver,
    Collector,
    StorageJob,
    check_views,
    dtype_from_name,
    dtype_name,
    plane_rot,
    planes_of,
    transform_for,
)
from s4w_core.planes import merge_planes, rowcol
from s4w_core.planes import nonzero as nzt
from s4w_core.planes.reference import merge_hash_into, merge_into
from s4w_core.workers import Pool, executor, ordered, ordered_window, segments

__all__ = [
    "SEGMENT_ELEMS",
    "MADV_POPULATE_WRITE",
    "PLANE_TRANSFORMS",
    "plane_rot",
    "transform_for",
    "StorageJob",
    "Collector",
    "encode_storage_cpu",
    "decode_storage_cpu",
    "delta_pays",
    "choose_delta_op",
    "choose_delta_ops",
    "encode_storages_cpu",
    "nonzero_pays",
    "rowcol_choice",
    "rowcol_pays",
    "nonzero_chunk_lengths",
    "dtype_from_name",
    "dtype_name",
    "DTYPES",
    "check_views",
    "PLAUSIBLE_RATIO",
    "claims_plausible",
    "chunk_layout",
    "resolve_base_bytes",
    # re-exported from the modules that define them (see the module docstring)
    "BaseLookup",
    "BaseResolver",
    "DELTA_MIN_GAIN",
    "DELTA_SAMPLE_ELEMS",
    "choose_delta_op_sampled",
    "delta_sample_ranges",
    "executor",
    "planes_of",
]
#: elements per segment written by the CPU path (1 MiB per plane chunk).
SEGMENT_ELEMS = 1 << 20

#: storages of at most this many bytes are coded on the calling thread: handing their few small
#: chunks to the pool and waiting for them costs more than coding them (a training state's many
#: biases and norms: 0.25 -> 0.1 ms per tensor, benchmarks/bench_tensor_cost.py; the 74 KB MLP
#: weights of the CPU framework run's GPT-2: a whole save of its state 24 -> 20 ms of CPU)
INLINE_ENCODE_BYTES = 128 << 10
#: storages of at most this many bytes are decoded on the calling thread (decoding is faster than
#: coding, so the pool pays later): a small training state's load then starts no pool thread and
#: waits for none (a CPU resume in benchmarks/frameworks.py --device cpu; a warm DCP load of 400
#: bf16 storages of 8 KiB, benchmarks/bench_dcp_warm.py --small 400)
INLINE_DECODE_BYTES = 256 << 10


def encode_storage_cpu(
    job: StorageJob,
    writer: ContainerWriter,
    pool: Pool,
    segment_elems: int | None = None,
    *,
    transform: str | None = None,
) -> dict[str, Any]:
    """Encode one storage on the CPU and append its chunks; returns its manifest entry.

    ``transform``: None for the default choice (:func:`transform_for`: ``planes-rotl1`` for
    bf16/fp16/fp32, else ``bytes``; a byte-plane transform becomes its row/column variant
    ``rc-...`` where :func:`rowcol_choice` says so for the job's row length ``job.cols`` (which may
    also drop the delta, where the variant alone codes smaller), else its nonzero
    variant ``nz-...`` where :func:`nonzero_trial` says it pays: where its trial coded the whole
    storage, its chunks are written as they are), or the transform to write (``"planes"``,
    ``"planes-rotl1"``, ``"bytes"``); ValueError if it does not apply to the storage's dtype and size."""
    segment_elems = segment_elems or SEGMENT_ELEMS
    raw = job.raw.cpu() if job.raw.device.type != "cpu" else job.raw
    nbytes = raw.numel()
    chosen = transform is None  # a transform named by the caller is written as it is (no nz variant)
    transform, w = transform_for(job.dtype, nbytes, transform=transform)
    n = nbytes // w
    entry: dict[str, Any] = {
        "path": job.path,
        "device": job.device,
        "dtype": dtype_name(job.dtype),
        "nbytes": nbytes,
        "transform": transform,
        "segment_elems": segment_elems,
        "checksum": ck.tensor_checksum(raw),
        "delta": None,
        "chunks": [],
    }
    base = None
    op = choose_delta_op(job, transform) if job.base is not None else None
    if op is not None:
        base = job.base.cpu()  # type: ignore[union-attr]
    rc = False
    if chosen and transform in PLANE_TRANSFORMS and job.cols is not None:
        rc, op = rowcol_choice(raw, base, job.dtype, transform, op, job.cols)  # may drop the delta
        base = base if op is not None else None
    if op is not None:
        entry["delta"] = {"op": op, "base": job.base_ref}
    offsets = None
    if rc:  # the row/column variant of the transform (docs/FORMAT.md 4.5d)
        assert job.cols is not None
        offsets = rowcol.offsets_of_words(nzt.residual_words(raw, job.dtype, base, op), w, plane_rot(transform), job.cols)
        entry["transform"] = next(k for k, v in RC_TRANSFORMS.items() if v == transform)
        entry["rowcol"] = rowcol.key(job.cols, *offsets)
    trial = None
    if not rc and chosen and transform in PLANE_TRANSFORMS:
        trial = nonzero_trial(raw, base, job.dtype, transform, op, one_segment=n <= segment_elems)
    nz = trial is not None and trial.pays
    if nz:  # the nonzero-element variant of the transform (docs/FORMAT.md 4.5c)
        entry["transform"] = next(k for k, v in NZ_TRANSFORMS.items() if v == transform)
        entry["nnz"] = []
    if trial is not None and trial.chunks is not None:  # the trial coded all of it, the way chosen
        if nz:
            entry["nnz"].append(trial.nnz)
        for codec_id, data in trial.chunks:
            off, length, h = writer.add_chunk(data)
            entry["chunks"].append([codec_id, off, length, h])
        return entry

    # encode segments in windows so memory stays bounded while all threads are busy
    window = max(2, pool.workers)  # sized to the pool
    segs = list(segments(n, segment_elems))
    for i in range(0, len(segs), window):
        calls: list[tuple[Any, ...]] = []
        for s0, s1 in segs[i : i + window]:
            b = base[s0 * w : s1 * w] if base is not None else None
            if nz:
                words = nzt.residual_words(raw[s0 * w : s1 * w], job.dtype, b, op)
                bitmap, planes = nzt.split_nonzero(words, w, rot=plane_rot(transform))
                entry["nnz"].append(planes.shape[1])
                calls.append((transform, BITMAP, bitmap))
            else:
                planes = planes_of(raw[s0 * w : s1 * w], job.dtype, transform, b, op).numpy()
                if offsets is not None:
                    np.subtract(planes[0], rowcol.tile_np(*offsets, s0, s1), out=planes[0])
            calls.extend((entry["transform"] if rc else transform, j, planes[j]) for j in range(planes.shape[0]))
        coded = (
            (encode_chunk(*c) for c in calls) if nbytes <= INLINE_ENCODE_BYTES else ordered(pool, encode_chunk, calls)
        )
        for codec_id, data in coded:
            off, length, h = writer.add_chunk(data)
            entry["chunks"].append([codec_id, off, length, h])
    return entry


def encode_storages_cpu(jobs: list[StorageJob], writer: ContainerWriter, pool: Pool) -> list[dict[str, Any]]:
    """:func:`encode_storage_cpu` for each of ``jobs`` in order (the default transforms), the
    delta ops of all of them chosen first in one pass (:func:`choose_delta_ops`, small storages
    estimated on a sample)."""
    choose_delta_ops(jobs, estimate_small=True)
    return [encode_storage_cpu(job, writer, pool) for job in jobs]


# ----------------------------------------------------------------------------- CPU decode
#: outputs of at least this many bytes are pre-faulted before decoding (see :func:`_prefault`)
PREFAULT_MIN_BYTES = 1 << 16
#: madvise advice that faults a range in (Linux >= 5.14)
MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - no libc symbol
        return None
    return fn  # type: ignore[no-any-return]


_madvise = _load_madvise()


def _prefault(t: torch.Tensor) -> None:
    """Populate the pages of a fresh output buffer in one ``madvise(MADV_POPULATE_WRITE)`` call
    instead of one page fault per 4 KiB as the merge first writes them: a load's outputs are new
    memory (a checkpoint is loaded to be kept: ~10k page faults for 40 MB of fp32 state). Measured
    on a 2-core VM: 40 MiB of fresh 4 MiB tensors first written in 25-27 ms, in 16-19 ms after
    this call; a whole one-thread load of that fp32 state into fresh memory 1-2 ms (3%) faster.
    Memory already mapped is left as it is (the call then only walks its page table); kernels
    without the advice (< 5.14) and other systems skip it."""
    global _madvise
    fn = _madvise
    if fn is None:
        return
    p = t.data_ptr()
    start = (p + _PAGE - 1) & ~(_PAGE - 1)
    end = (p + t.numel() * t.element_size()) & ~(_PAGE - 1)
    if end > start and fn(start, end - start, MADV_POPULATE_WRITE) != 0:
        import ctypes

        if ctypes.get_errno() == errno.EINVAL:  # the kernel does not know the advice: stop asking
            _madvise = None


#: a storage whose raw size is at most this many times its stored bytes (plus
#: :data:`PLAUSIBLE_SLACK`) is allocated before its chunks are decoded; one that claims more is
#: decoded first (real data compresses far less: a claim that large is constant data or forged)
PLAUSIBLE_RATIO = 16
PLAUSIBLE_SLACK = 1 << 20


def claims_plausible(entry: dict[str, Any]) -> bool:
    """Whether a (validated) storage entry's raw size is at most :data:`PLAUSIBLE_RATIO` times its
    stored bytes plus :data:`PLAUSIBLE_SLACK`: then its output may be allocated before its chunks
    are decoded. Otherwise the CPU reader decodes the chunks first, and the GPU reader leaves such
    a storage to the CPU reader when it can and otherwise decodes its chunks first itself (what a
    claim makes either allocate follows what the chunks actually yield)."""
    return bool(entry["nbytes"] <= PLAUSIBLE_RATIO * sum(c[2] for c in entry["chunks"]) + PLAUSIBLE_SLACK)


def _drain(q: "collections.deque[Any]") -> Iterator[Any]:
    """Yield and drop the items of ``q`` in order (each decoded chunk is freed once merged)."""
    while q:
        yield q.popleft()


#: plane storages of at least this many bytes with an xxh3 checksum are hashed as they are merged
#: (:func:`~s4w_core.planes.reference.merge_hash_into`: each block while it is still in the
#: cache) rather than in a second pass over the whole output; smaller ones are still in the cache
#: after the merge, and one call costs less than a streaming hasher's
FUSED_HASH_MIN_BYTES = 1 << 20


def nonzero_chunk_lengths(entry: dict[str, Any]) -> list[int]:
    """The decoded length of each chunk of a (validated) nonzero-transform entry, in manifest
    order: per segment its bitmap's bytes, then ``nnz`` for each of its ``w`` planes."""
    w = entry["_width"]
    out: list[int] = []
    for (s0, s1), c in zip(segments(entry["nbytes"] // w, entry["segment_elems"]), entry["nnz"]):
        out.append(nzt.bitmap_bytes(s1 - s0))
        out.extend([c] * w)
    return out


def chunk_layout(entry: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(segment_start_elem, segment_end_elem, plane)`` for each chunk, in manifest order."""
    w = entry["_width"]
    n = entry["nbytes"] // w
    return [(s0, s1, j) for s0, s1 in segments(n, entry["segment_elems"]) for j in range(w)]


def decode_storage_cpu(
    reader: ContainerReader,
    entry: dict[str, Any],
    pool: Pool,
    resolve_base: BaseResolver | None,
    name: str,
) -> torch.Tensor:
    """Decode one (validated) storage entry to a 1-D uint8 CPU tensor, verifying every checksum:
    each coded chunk's xxh3 before it is decoded, the storage's raw checksum at the end (for a
    large plane storage with an xxh3 checksum, computed block by block as the planes are merged).
    Raw chunks, which no decoder reads, are covered by the storage's checksum; when it fails, they
    are hashed to name the corrupt one.

    Per chunk and per storage this does only what the bytes need (a load of a training state is
    mostly small tensors, where Python around the codecs cost as much as they did): no per-chunk
    layout list, the codec's decoder looked up once per codec id, planes merged straight into the
    output."""
    nbytes = entry["nbytes"]
    w = entry["_width"]
    transform = entry["transform"]
    dtype = dtype_from_name(entry["dtype"])
    chunks = entry["chunks"]
    # a storage that claims far more than its stored bytes (constant data, or a forged claim) is
    # decoded before its output is allocated: memory follows what the chunks actually yield
    proven = claims_plausible(entry)
    base = resolve_base_bytes(entry, resolve_base, name)
    op = (entry.get("delta") or {}).get("op", "xor")
    seg = entry["segment_elems"]
    n = nbytes // w
    nz_lens = nonzero_chunk_lengths(entry) if transform in NZ_TRANSFORMS else None
    read_chunk = reader.read_chunk
    decoders: dict[str, Callable[[Any, int], Any]] = {}

    def corrupt(i: int) -> ChecksumMismatchError:
        _c, off, length, _h = chunks[i]
        return ChecksumMismatchError(
            f"{name}: chunk {i} of tensor {entry['path']!r} (bytes {off}..{off + length}) is corrupt: checksum mismatch"
        )

    def check_raw_chunks() -> None:
        for i, c in enumerate(chunks):  # name the corrupt chunk if it is a raw one (not checked above)
            if c[0] == "raw" and xxh3_hexdigest(read_chunk(c[1], c[2])) != c[3]:
                raise corrupt(i)

    def fetch_decode(i: int) -> Any:
        codec_id, off, length, h = chunks[i]
        data = read_chunk(off, length)
        # a raw chunk goes to no decoder, and the storage's checksum below covers its bytes: it is
        # hashed only if that check fails (to name it)
        if codec_id != "raw" and xxh3_hexdigest(data) != h:
            raise corrupt(i)
        dec = decoders.get(codec_id)
        if dec is None:
            dec = decoders[codec_id] = get_codec(codec_id).decode
        if nz_lens is not None:
            return dec(data, nz_lens[i])
        s0 = (i // w) * seg
        try:
            return dec(data, min(n, s0 + seg) - s0)
        except DecodeError as e:  # name the file, tensor and chunk (the codec knows none of them)
            raise DecodeError(
                f"{name}: chunk {i} of tensor {entry['path']!r} (bytes {off}..{off + length}, {codec_id}): {e}"
            ) from e

    # an implausible storage is decoded on this thread: a forged frame costs one output buffer
    # (at most a segment) at a time, not one per thread
    threaded = proven and nbytes > INLINE_DECODE_BYTES
    decoded: Iterator[Any] = ordered_window(pool if threaded else None, fetch_decode, len(chunks))
    if not proven:
        decoded = _drain(collections.deque(decoded))
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= PREFAULT_MIN_BYTES:
        _prefault(out)
    out_np = out.numpy()
    offsets = None
    if transform in RC_TRANSFORMS:  # plane 0 is stored less its row/column offsets (FORMAT.md 4.5d)
        _cols, row_b, col_b = rowcol_offsets(entry, n, "storage")
        offsets = np.frombuffer(row_b, dtype=np.uint8), np.frombuffer(col_b, dtype=np.uint8)
    is_planes = transform in PLANE_TRANSFORMS or offsets is not None
    rot = is_planes and plane_rot(transform)
    merge_fast = is_planes and (base is None or op == "xor")
    base_np = None if base is None else base.numpy()
    expected = entry["checksum"]
    # every segment goes through merge_hash_into, which passes each byte of it to the hasher once,
    # in order: the digest is the one-shot xxh3 of ``out`` (the count is checked at the end as well)
    hasher = (
        xxhash.xxh3_64()
        if merge_fast and w > 1 and nbytes >= FUSED_HASH_MIN_BYTES and expected[:8] == ck.XXH3
        else None
    )
    hashed = 0
    for s0 in range(0, n, seg):
        s1 = min(n, s0 + seg)
        if w == 1 and base is None:  # bytes transform: the chunk is the output
            out_np[s0:s1] = np.frombuffer(next(decoded), dtype=np.uint8)
            continue
        if nz_lens is not None:  # bitmap and planes of the nonzero (residual) elements
            bitmap = np.frombuffer(next(decoded), dtype=np.uint8)
            parts = [np.frombuffer(next(decoded), dtype=np.uint8) for _j in range(w)]
            where = f"{name}: tensor {entry['path']!r} segment {s0 // seg}"
            rot_nz = plane_rot(NZ_TRANSFORMS[transform])
            try:
                nzt.merge_nonzero(bitmap, parts, s1 - s0, w, out_np[s0 * w : s1 * w], rot=rot_nz, where=where)
            except DecodeError:
                check_raw_chunks()  # a corrupt raw chunk is named as such
                raise
            if base is not None:
                out[s0 * w : s1 * w] = delta.inverse(op, out[s0 * w : s1 * w], base[s0 * w : s1 * w], dtype)
            continue
        parts = [np.frombuffer(next(decoded), dtype=np.uint8) for _j in range(w)]
        if offsets is not None:
            parts[0] = parts[0] + rowcol.tile_np(*offsets, s0, s1)  # uint8: modulo 256
        a, z = s0 * w, s1 * w
        if merge_fast:
            if hasher is None:
                merge_into(parts, w, out_np[a:z], None if base_np is None else base_np[a:z], rot=rot)
            else:
                merge_hash_into(
                    parts, w, out_np[a:z], None if base_np is None else base_np[a:z], hasher.update, rot=rot
                )
                hashed += z - a
            continue
        b = base[a:z] if base is not None else None
        planes = torch.from_numpy(np.stack(parts)) if parts[0].size else torch.empty((w, 0), dtype=torch.uint8)
        if b is not None and op != "xor":  # residual planes, then the inverse delta op
            seg_t = merge_planes(planes, dtype, None, rot=rot) if is_planes else planes.view(-1)
            seg_t = delta.inverse(op, seg_t, b, dtype)
        elif is_planes:
            seg_t = merge_planes(planes, dtype, b, rot=rot)
        else:
            seg_t = planes.view(-1) if b is None else planes.view(-1) ^ b
        out[a:z] = seg_t
    if hasher is not None and hashed == nbytes:
        ok = ck.XXH3 + hasher.hexdigest() == expected
    else:
        ok = ck.verify_tensor_checksum(expected, out)
    if not ok:
        check_raw_chunks()
        raise ChecksumMismatchError(
            f"{name}: tensor {entry['path']!r} decoded to bytes that do not match its recorded "
            f"checksum {expected}" + (" (is the delta base the right one?)" if base is not None else "")
        )
    return out


def resolve_base_bytes(
    entry: dict[str, Any], resolve_base: BaseResolver | None, name: str, device: torch.device | None = None
) -> torch.Tensor | None:
    """The delta base of a storage entry as 1-D uint8 bytes on ``device`` (CPU by default), or None
    for a plain entry. Shared by the CPU and GPU readers. Raises BaseMismatchError."""
    delta = entry.get("delta")
    if not delta:
        return None
    if resolve_base is None:
        raise BaseMismatchError(
            f"{name}: tensor {entry['path']!r} is stored as a delta against {delta.get('base')!r}; load it "
            "through its CheckpointStore so the base can be found"
        )
    base = resolve_base(delta.get("base") or {}, entry["nbytes"])
    if base.dtype != torch.uint8 or base.numel() != entry["nbytes"]:
        raise BaseMismatchError(f"{name}: base for {entry['path']!r} has the wrong size")
    return base.reshape(-1).to(device or torch.device("cpu")).contiguous()

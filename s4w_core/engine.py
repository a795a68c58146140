"""Encoding and decoding of storages: the CPU reference path and the dispatch to the GPU path.

Unit of compression: one *storage* (the memory behind one or more tensor views, as in
``torch.save``), cut into *segments* of ``segment_elems`` elements; each segment is split into
``w`` byte planes (or one plane of bytes) and every plane of every segment is one *chunk*, coded
with the codec that measured best for it (never larger than raw: raw is always a candidate).
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import xxhash
from xxhash import xxh3_64_hexdigest as xxh3_hexdigest

from s4w_core import checksum as ck
from s4w_core import delta
from s4w_core.codecs import DEFLATE, RAW, ZSTD, get_codec, zstd_encode_plane
from s4w_core.errors import (
    BaseMismatchError,
    ChecksumMismatchError,
    DecodeError,
    UnsupportedTypeError,
)
from s4w_core.format.container import ContainerReader, ContainerWriter
from s4w_core.format.manifest import NZ_TRANSFORMS, PLAIN, PLANE_TRANSFORMS, ROTL1
from s4w_core.planes import PLANE_DTYPES, merge_planes, plane_width, split_planes
from s4w_core.planes import nonzero as nzt
from s4w_core.planes.reference import merge_hash_into, merge_into

__all__ = [
    "SEGMENT_ELEMS",
    "PLANE_TRANSFORMS",
    "plane_rot",
    "transform_for",
    "StorageJob",
    "Collector",
    "encode_storage_cpu",
    "decode_storage_cpu",
    "delta_pays",
    "choose_delta_op",
    "nonzero_pays",
    "nonzero_chunk_lengths",
    "dtype_from_name",
    "dtype_name",
]

#: elements per segment written by the CPU path (1 MiB per plane chunk).
SEGMENT_ELEMS = 1 << 20
_SAMPLE = 1 << 16
#: a plane chunk this many times smaller than its plane is also tried at zstd's level 3 (smaller wins).
LOW_ENTROPY_RATIO = 4
#: exponent-plane chunks smaller than this are also tried with Huffman-only deflate (smaller wins).
SMALL_PLANE = 1 << 16

BaseLookup = Callable[[str, int, str], "tuple[torch.Tensor, dict[str, Any]] | None"]
BaseResolver = Callable[[dict[str, Any], int], torch.Tensor]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (as written by :func:`dtype_name`); ManifestError otherwise.
    Cached per name (a load asks once per tensor); an unknown name raises every time."""
    from s4w_core.errors import ManifestError

    if not isinstance(name, str):
        raise ManifestError(f"manifest names unknown dtype {name!r}")
    return _dtype_from_str(name)


@functools.cache
def _dtype_from_str(name: str) -> torch.dtype:
    from s4w_core.errors import ManifestError

    ok = not name.startswith(("_", "q"))  # no quantized dtypes (qint8, ...)
    dt = getattr(torch, name, None) if ok else None
    if not isinstance(dt, torch.dtype):
        raise ManifestError(f"manifest names unknown dtype {name!r}")
    try:
        torch.empty((), dtype=dt)
    except (RuntimeError, TypeError):
        raise ManifestError(f"manifest names dtype {name!r}, which has no dense tensors") from None
    return dt


@dataclass
class StorageJob:
    """One storage to encode: its bytes as a 1-D uint8 tensor and how to interpret them."""

    raw: torch.Tensor  # 1-D uint8, contiguous, on its device
    dtype: torch.dtype
    path: str
    device: str
    base: torch.Tensor | None = None  # same shape as raw, same device
    base_ref: dict[str, Any] | None = None


@dataclass
class Collector:
    """Gathers tensors while the tree is encoded; shares storages the way torch.save does."""

    tensors: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[StorageJob] = field(default_factory=list)
    _by_id: dict[int, int] = field(default_factory=dict)
    _storage_idx: dict[tuple[str, int], int] = field(default_factory=dict)
    _keep: list[Any] = field(default_factory=list)

    def add(self, t: torch.Tensor, path: str) -> int:
        if id(t) in self._by_id:
            return self._by_id[id(t)]
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedTypeError(
                f"{path}: tensor subclass {type(t).__qualname__} is not supported by s4w_core.save "
                "(for DTensor/sharded state use the torch.distributed.checkpoint integration)"
            )
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise UnsupportedTypeError(
                f"{path}: {t.layout} / quantized / meta tensors are not supported; only dense tensors"
            )
        src = t
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        st = t.untyped_storage()
        nbytes = st.nbytes()
        key = (str(t.device), st.data_ptr()) if nbytes else ("empty", id(st))
        sidx = self._storage_idx.get(key)
        if sidx is None:
            sidx = len(self.jobs)
            self._storage_idx[key] = sidx
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (nbytes,), (1,))
            self.jobs.append(StorageJob(raw, t.dtype, path, str(t.device)))
            self._keep.append(st)
        entry = {
            "path": path,
            "storage": sidx,
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "requires_grad": bool(src.requires_grad),
            "param": isinstance(src, torch.nn.Parameter),
        }
        self._by_id[id(src)] = len(self.tensors)
        self._keep.append(src)
        self.tensors.append(entry)
        return len(self.tensors) - 1


# ----------------------------------------------------------------------------- helpers
#: every transform (:data:`PLANE_TRANSFORMS`, defined with the format, apply to the dtypes of
#: :data:`~s4w_core.planes.PLANE_DTYPES`, with the same widths, segments, chunks and delta ops)
_TRANSFORMS = (*PLANE_TRANSFORMS, "bytes")


def plane_rot(transform: str) -> bool:
    """Whether the byte-plane ``transform`` rotates each element left by one bit before the split:
    True for ``planes-rotl1``, False for ``planes`` (the ``rot`` argument of
    :func:`~s4w_core.planes.split_planes` and :func:`~s4w_core.planes.merge_planes`). Raises
    ValueError for any other transform.

    Example:
        >>> plane_rot("planes-rotl1"), plane_rot("planes")
        (True, False)
    """
    if transform == ROTL1:
        return True
    if transform == PLAIN:
        return False
    raise ValueError(f"{transform!r} is not a byte-plane transform (one of {PLANE_TRANSFORMS})")


def transform_for(dtype: torch.dtype, nbytes: int, *, transform: str | None = None) -> tuple[str, int]:
    """The transform and plane width to store ``nbytes`` bytes of ``dtype`` with.

    ``transform=None``: the default choice, ``planes-rotl1`` for the plane dtypes (when ``nbytes``
    is a whole number of elements), else ``bytes``. A transform named here is checked instead:
    a byte-plane transform (:data:`PLANE_TRANSFORMS`) needs a plane dtype and whole elements,
    ``bytes`` applies to anything; otherwise ValueError.

    Example:
        >>> transform_for(torch.bfloat16, 6), transform_for(torch.float32, 8, transform="planes")
        (('planes-rotl1', 2), ('planes', 4))
    """
    if transform is None:
        if dtype in PLANE_DTYPES:
            w = plane_width(dtype)
            if nbytes % w == 0:
                return "planes-rotl1", w
        return "bytes", 1
    if transform == "bytes":
        return "bytes", 1
    if transform not in PLANE_TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}; one of {_TRANSFORMS}")
    if dtype not in PLANE_DTYPES or nbytes % plane_width(dtype):
        raise ValueError(f"transform {transform!r} does not apply to {dtype_name(dtype)} x {nbytes} bytes")
    return transform, plane_width(dtype)


def _entropy_ratio(plane: np.ndarray) -> float:
    """Estimated order-0 compression ratio of a uint8 array, from a strided sample."""
    n = plane.size
    if n == 0:
        return 1.0
    sample = plane[:: max(1, n // _SAMPLE)]
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / sample.size
    h = float(-(p * np.log2(p)).sum())
    return 8.0 / max(h, 1e-3)


def _estimate_bytes(planes: torch.Tensor) -> float:
    arr = planes.numpy()
    return sum(arr.shape[1] / _entropy_ratio(arr[j]) for j in range(arr.shape[0]))


#: marker for "zstd frame coded with the plane parameters" (codec id ``zstd``).
ZSTD_PLANE = object()


def _choose_codec(transform: str, j: int, plane: np.ndarray) -> Any:
    """The codec of one chunk: zstd at level 3 for ``bytes`` storages, else :data:`ZSTD_PLANE`
    (zstd stores an incompressible block as it is, at memcpy speed). Tests replace it to write
    other codecs' chunks (``tests/unit/helpers.deflate_plane0``)."""
    return ZSTD if transform == "bytes" else ZSTD_PLANE


def _encode_chunk(transform: str, j: int, plane: np.ndarray) -> tuple[str, bytes]:
    codec = _choose_codec(transform, j, plane)
    data = memoryview(plane)
    if codec is ZSTD_PLANE:
        cid, out = ZSTD.id, zstd_encode_plane(data)
        if len(out) * LOW_ENTROPY_RATIO < plane.size:
            # near-constant planes (delta residuals of unchanged or barely changed values) go far
            # below a Huffman code's 1 bit a byte with zstd's matches at its default level.
            assert ZSTD.encode_cpu is not None
            z = ZSTD.encode_cpu(data)
            if len(z) < len(out):
                out = z
        elif j == 0 and plane.size < SMALL_PLANE:
            # deflate's Huffman header is smaller than zstd's: 6-16% smaller exponent chunks under
            # 64 KiB (biases, norms, small models); mantissa planes gain < 1% there
            assert DEFLATE.encode_cpu is not None
            d = DEFLATE.encode_cpu(data)
            if len(d) < len(out):
                cid, out = DEFLATE.id, d
    else:  # a codec with a CPU encoder
        assert codec.encode_cpu is not None
        cid, out = codec.id, codec.encode_cpu(data)
    if len(out) < plane.size:
        return cid, out
    return RAW.id, bytes(data)


def _segments(n: int, seg: int) -> Iterator[tuple[int, int]]:
    for s in range(0, n, seg):
        yield s, min(n, s + seg)


def _executor(threads: int | None) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1))


def _ordered(pool: ThreadPoolExecutor, fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]]) -> Iterator[Any]:
    """``fn(*args)`` for each of ``calls``, results in order: all submitted to ``pool`` at once,
    except that a one-thread pool runs each call right here when its result is wanted (handing
    every chunk to a single worker and waiting for it only adds two thread switches per chunk,
    with small tensors more than the coding itself). An exception is raised where its result is
    taken, as ``Future.result`` raises it."""
    if pool._max_workers > 1:  # noqa: SLF001
        futs = [pool.submit(fn, *args) for args in calls]
        return (f.result() for f in futs)
    return (fn(*args) for args in calls)


# ----------------------------------------------------------------------------- CPU encode
def encode_storage_cpu(
    job: StorageJob,
    writer: ContainerWriter,
    pool: ThreadPoolExecutor,
    segment_elems: int | None = None,
    *,
    transform: str | None = None,
) -> dict[str, Any]:
    """Encode one storage on the CPU and append its chunks; returns its manifest entry.

    ``transform``: None for the default choice (:func:`transform_for`: ``planes-rotl1`` for
    bf16/fp16/fp32, else ``bytes``; a byte-plane transform becomes its nonzero variant
    ``nz-...`` where :func:`nonzero_pays`), or the transform to write (``"planes"``,
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
        entry["delta"] = {"op": op, "base": job.base_ref}
    nz = chosen and transform in PLANE_TRANSFORMS and nonzero_pays(raw, base, job.dtype, transform, op)
    if nz:  # the nonzero-element variant of the transform (docs/FORMAT.md 4.5c)
        entry["transform"] = next(k for k, v in NZ_TRANSFORMS.items() if v == transform)
        entry["nnz"] = []

    # encode segments in windows so memory stays bounded while all threads are busy
    window = max(2, pool._max_workers)  # noqa: SLF001 - sized to the pool
    segs = list(_segments(n, segment_elems))
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
                planes = _planes(raw[s0 * w : s1 * w], job.dtype, transform, b, op).numpy()
            calls.extend((transform, j, planes[j]) for j in range(planes.shape[0]))
        for codec_id, data in _ordered(pool, _encode_chunk, calls):
            off, length, h = writer.add_chunk(data)
            entry["chunks"].append([codec_id, off, length, h])
    return entry


#: the plane index :func:`_encode_chunk` is given for the bitmap chunk of a nonzero transform
BITMAP = -1
#: the nonzero transform is tried only where at least this fraction of the sampled elements is zero
NZ_MIN_ZERO_FRAC = 1 / 64
#: ... and used only if it codes the sample at least this fraction smaller than the plain transform
NZ_MIN_GAIN = 0.02


def nonzero_pays(
    raw: torch.Tensor, base: torch.Tensor | None, dtype: torch.dtype, transform: str, op: str | None
) -> bool:
    """Whether the nonzero variant of the byte-plane ``transform`` (docs/FORMAT.md 4.5c) pays for
    the CPU bytes ``raw`` (with ``base`` and delta ``op``, or plain): measured by coding the
    sample of :func:`delta_sample_ranges` both ways with the chunk coder itself (its zstd finds
    zero runs that an entropy estimate does not see), after a cheap check that the sample has
    zeros at all (:data:`NZ_MIN_ZERO_FRAC`)."""
    w = plane_width(dtype)
    ranges = delta_sample_ranges(raw.numel() // w)
    if not ranges:
        return False
    r = torch.cat([raw[a * w : z * w] for a, z in ranges]) if len(ranges) > 1 else raw
    b = None
    if base is not None and op is not None:
        b = torch.cat([base[a * w : z * w] for a, z in ranges]) if len(ranges) > 1 else base
    words = nzt.residual_words(r, dtype, b, op)
    zeros = words.size - int(np.count_nonzero(words))
    if zeros < NZ_MIN_ZERO_FRAC * words.size:
        return False
    rot = plane_rot(transform)
    plain = split_planes(torch.from_numpy(words.view(np.uint8)), dtype, rot=rot).numpy()
    plain_cost = sum(len(_encode_chunk(transform, j, plain[j])[1]) for j in range(w))
    bitmap, planes = nzt.split_nonzero(words, w, rot=rot)
    nz_cost = len(_encode_chunk(transform, BITMAP, bitmap)[1])
    nz_cost += sum(len(_encode_chunk(transform, j, planes[j])[1]) for j in range(w))
    return nz_cost < (1.0 - NZ_MIN_GAIN) * plain_cost


#: elements sampled (in runs spread over a storage) to choose plain vs. a delta op.
DELTA_SAMPLE_ELEMS = 1 << 18
#: a delta op is used only if the sample says it saves at least this fraction over plain coding.
DELTA_MIN_GAIN = 0.03
_DELTA_RUNS = 16
_DELTA_MIN_SAMPLE = 1 << 16  # storages above 8x this are sampled at 1/8 (up to DELTA_SAMPLE_ELEMS)


def delta_sample_ranges(n: int) -> list[tuple[int, int]]:
    """Element ranges ``(start, stop)`` that :func:`choose_delta_op` samples from a storage of
    ``n`` elements: all of it when small, else 16 runs spread over it, together an eighth of it,
    at least 2**16 and at most :data:`DELTA_SAMPLE_ELEMS` elements."""
    if n <= _DELTA_MIN_SAMPLE:
        return [(0, n)] if n else []
    run = max(1, min(n, DELTA_SAMPLE_ELEMS, max(_DELTA_MIN_SAMPLE, n // 8)) // _DELTA_RUNS)
    starts = sorted({(n - run) * k // (_DELTA_RUNS - 1) for k in range(_DELTA_RUNS)})
    return [(s0, s0 + run) for s0 in starts]


def choose_delta_op_sampled(
    raw: torch.Tensor, base: torch.Tensor, dtype: torch.dtype, transform: str, ops: tuple[str, ...] | None = None
) -> str | None:
    """:func:`choose_delta_op` on samples already gathered (CPU uint8 tensors of equal length,
    the ranges of :func:`delta_sample_ranges` back to back). The GPU writer gathers the samples
    of every storage of a batch on the device and copies them to the host once."""
    if raw.numel() == 0:
        return None
    best: str | None = None
    best_cost = _estimate_bytes(_planes(raw, dtype, transform, None))
    limit = (1.0 - DELTA_MIN_GAIN) * best_cost
    for op in ops if ops is not None else delta.ops_for(dtype, transform):
        if op not in delta.ops_for(dtype, transform):
            continue
        c = _estimate_bytes(_planes(raw, dtype, transform, base, op))
        if c < limit and c < best_cost:
            best, best_cost = op, c
    return best


def choose_delta_op(job: StorageJob, transform: str, ops: tuple[str, ...] | None = None) -> str | None:
    """The delta op (:mod:`s4w_core.delta`) to store ``job`` with against ``job.base``, or None
    for plain coding.  Shared by the CPU and GPU writers.

    Every candidate op (default: all that apply to the dtype, see :func:`delta.ops_for`) is
    estimated on the same sample (:func:`delta_sample_ranges`), so a storage whose first rows are
    atypical is judged on all of it.  An op wins if it beats plain by :data:`DELTA_MIN_GAIN`; the
    smallest estimate wins.
    Raises BaseMismatchError if the base has a different size.
    """
    assert job.base is not None
    nbytes = job.raw.numel()
    if job.base.numel() != nbytes:
        raise BaseMismatchError(f"{job.path}: base has {job.base.numel()} bytes, tensor {nbytes}")
    w = 1 if transform == "bytes" else plane_width(job.dtype)
    ranges = delta_sample_ranges(nbytes // w)
    if not ranges:
        return None
    if len(ranges) == 1:
        raw, base = job.raw.cpu(), job.base.cpu()
    else:
        raw = torch.cat([job.raw[a * w : b * w].cpu() for a, b in ranges])
        base = torch.cat([job.base[a * w : b * w].cpu() for a, b in ranges])
    return choose_delta_op_sampled(raw, base, job.dtype, transform, ops)


def delta_pays(job: StorageJob, transform: str) -> bool:
    """Whether an XOR delta pays for ``job`` (kept for writers that implement only ``xor``)."""
    return choose_delta_op(job, transform, ("xor",)) is not None


def _planes(
    raw: torch.Tensor, dtype: torch.dtype, transform: str, base: torch.Tensor | None, op: str | None = "xor"
) -> torch.Tensor:
    if base is not None and op not in (None, "xor"):
        raw, base = delta.forward(op, raw, base, dtype), None
    if transform in PLANE_TRANSFORMS:
        return split_planes(raw, dtype, base, rot=plane_rot(transform))
    x = raw if base is None else raw ^ base
    return x.view(1, -1)


# ----------------------------------------------------------------------------- CPU decode
#: outputs of at least this many bytes are pre-faulted before decoding (see :func:`_prefault`)
PREFAULT_MIN_BYTES = 1 << 16
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
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
    if end > start and fn(start, end - start, _MADV_POPULATE_WRITE) != 0:
        import ctypes

        if ctypes.get_errno() == errno.EINVAL:  # the kernel does not know the advice: stop asking
            _madvise = None


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
    for (s0, s1), c in zip(_segments(entry["nbytes"] // w, entry["segment_elems"]), entry["nnz"]):
        out.append(nzt.bitmap_bytes(s1 - s0))
        out.extend([c] * w)
    return out


def chunk_layout(entry: dict[str, Any]) -> list[tuple[int, int, int]]:
    """``(segment_start_elem, segment_end_elem, plane)`` for each chunk, in manifest order."""
    w = entry["_width"]
    n = entry["nbytes"] // w
    return [(s0, s1, j) for s0, s1 in _segments(n, entry["segment_elems"]) for j in range(w)]


def decode_storage_cpu(
    reader: ContainerReader,
    entry: dict[str, Any],
    pool: ThreadPoolExecutor,
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
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= PREFAULT_MIN_BYTES:
        _prefault(out)
    base = resolve_base_bytes(entry, resolve_base, name)
    op = (entry.get("delta") or {}).get("op", "xor")
    chunks = entry["chunks"]
    seg = entry["segment_elems"]
    n = nbytes // w
    nz_lens = nonzero_chunk_lengths(entry) if transform in NZ_TRANSFORMS else None
    read_chunk = reader.read_chunk
    decoders: dict[str, Callable[[Any, int], Any]] = {}

    def corrupt(i: int) -> ChecksumMismatchError:
        _c, off, length, _h = chunks[i]
        return ChecksumMismatchError(
            f"{name}: chunk {i} of tensor {entry['path']!r} (bytes {off}..{off + length}) is corrupt: "
            "checksum mismatch"
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
        return dec(data, min(n, s0 + seg) - s0)

    decoded = _ordered(pool, fetch_decode, [(i,) for i in range(len(chunks))])
    out_np = out.numpy()
    is_planes = transform in PLANE_TRANSFORMS
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

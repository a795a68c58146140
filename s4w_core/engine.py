"""Encoding and decoding of storages: the CPU reference path and the dispatch to the GPU path.

Unit of compression: one *storage* (the memory behind one or more tensor views, as in
``torch.save``), cut into *segments* of ``segment_elems`` elements; each segment is split into
``w`` byte planes (or one plane of bytes) and every plane of every segment is one *chunk*, coded
with the codec that measured best for it (never larger than raw: raw is always a candidate).
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import sys
import warnings
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
    ManifestError,
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
    "choose_delta_ops",
    "encode_storages_cpu",
    "nonzero_pays",
    "nonzero_chunk_lengths",
    "dtype_from_name",
    "dtype_name",
    "DTYPES",
    "check_views",
    "PLAUSIBLE_RATIO",
    "claims_plausible",
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


#: every dtype a manifest may name, by the name :func:`dtype_name` writes: the ``torch.dtype``
#: attributes of the ``torch`` module itself (read from its namespace: a name is never looked up
#: with ``getattr``, which imports lazy submodules such as ``torch.onnx`` by name), less quantized
#: ones and those without dense tensors
DTYPES: dict[str, torch.dtype] = {}
for _n, _v in sorted(vars(torch).items()):
    if isinstance(_v, torch.dtype) and not _n.startswith(("_", "q")) and dtype_name(_v) == _n:
        try:
            with warnings.catch_warnings():  # complex32: "experimental"
                warnings.simplefilter("ignore")
                torch.empty((), dtype=_v)
        except (RuntimeError, TypeError):
            continue
        DTYPES[_n] = _v


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (as written by :func:`dtype_name`), from the allow-list
    :data:`DTYPES`; ManifestError otherwise."""
    dt = DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise ManifestError(f"manifest names unknown dtype {name!r}")
    return dt


def check_views(m: dict[str, Any], name: str) -> None:
    """Check every tensor view of a validated manifest against its storage before anything is
    decoded: a known dtype, and the view's last element inside the storage (docs/FORMAT.md 3.2).
    Raises ManifestError naming the tensor."""
    storages = m["storages"]
    for k, s in enumerate(storages):  # a storage's dtype too (the GPU reader trusts it for its planes)
        if not isinstance(s.get("dtype"), str) or s["dtype"] not in DTYPES:
            raise ManifestError(f"{name}: manifest: storage {k} names unknown dtype {s.get('dtype')!r}")
    for i, t in enumerate(m["tensors"]):
        dt = dtype_from_name(t["dtype"])
        nbytes = storages[t["storage"]]["nbytes"]
        if t["_extent"] * dt.itemsize > nbytes:
            raise ManifestError(
                f"{name}: manifest: tensor {i} ({t['path']!r}) reaches past the end of its storage "
                f"({t['_extent']} elements of {dt} in {nbytes} bytes)"
            )
        if t.get("requires_grad") and not (dt.is_floating_point or dt.is_complex):
            raise ManifestError(f"{name}: manifest: tensor {i} ({t['path']!r}) of dtype {dt} cannot require grad")


@dataclass
class StorageJob:
    """One storage to encode: its bytes as a 1-D uint8 tensor and how to interpret them."""

    raw: torch.Tensor  # 1-D uint8, contiguous, on its device
    dtype: torch.dtype
    path: str
    device: str
    base: torch.Tensor | None = None  # same shape as raw, same device
    base_ref: dict[str, Any] | None = None
    #: ``(transform, op)`` once :func:`choose_delta_ops` chose the delta op for this base
    delta_choice: tuple[str, str | None] | None = None


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


#: calls :func:`_ordered_window` keeps in flight per worker thread
DECODE_WINDOW_PER_THREAD = 4


def _ordered_window(pool: ThreadPoolExecutor | None, fn: Callable[..., Any], n: int) -> Iterator[Any]:
    """``fn(i)`` for ``i in range(n)``, results in order, with at most
    :data:`DECODE_WINDOW_PER_THREAD` calls per worker submitted ahead of the one being taken (a
    one-thread pool, or none, runs each call here). What a storage's decode holds and queues is
    bounded by the window, never by the chunk count a file claims; when a call fails, the calls
    not yet started are cancelled."""
    workers = 1 if pool is None else pool._max_workers  # noqa: SLF001
    if pool is None or workers <= 1:
        for i in range(n):
            yield fn(i)
        return
    window = workers * DECODE_WINDOW_PER_THREAD
    futs: collections.deque[Any] = collections.deque()
    nxt = 0
    try:
        while nxt < n or futs:
            while nxt < n and len(futs) < window:
                futs.append(pool.submit(fn, nxt))
                nxt += 1
            yield futs.popleft().result()
    finally:
        for f in futs:
            f.cancel()


# ----------------------------------------------------------------------------- CPU encode
#: storages of at most this many bytes are coded on the calling thread: handing their few small
#: chunks to the pool and waiting for them costs more than coding them (a training state's many
#: biases and norms: 0.25 -> 0.1 ms per tensor, benchmarks/bench_tensor_cost.py)
INLINE_ENCODE_BYTES = 64 << 10
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
        coded = (_encode_chunk(*c) for c in calls) if nbytes <= INLINE_ENCODE_BYTES else _ordered(pool, _encode_chunk, calls)
        for codec_id, data in coded:
            off, length, h = writer.add_chunk(data)
            entry["chunks"].append([codec_id, off, length, h])
    return entry


def encode_storages_cpu(jobs: list[StorageJob], writer: ContainerWriter, pool: ThreadPoolExecutor) -> list[dict[str, Any]]:
    """:func:`encode_storage_cpu` for each of ``jobs`` in order (the default transforms), the
    delta ops of all of them chosen first in one pass (:func:`choose_delta_ops`)."""
    choose_delta_ops(jobs)
    return [encode_storage_cpu(job, writer, pool) for job in jobs]


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
    w = 1 if transform == "bytes" else plane_width(dtype)
    return _choose_batch([(raw.numpy(), base.numpy(), dtype, transform, ops)], w, _rot_of(transform))[0]


def _rot_of(transform: str) -> bool | None:
    """The rotation of a transform's planes: True/False for the byte-plane transforms, None for ``bytes``."""
    return None if transform == "bytes" else plane_rot(transform)


_WORD: dict[int, type[np.unsignedinteger[Any]]] = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_SWORD: dict[int, type[np.signedinteger[Any]]] = {2: np.int16, 4: np.int32}
#: storages whose sample (after the stride) has at most this many elements are estimated together
#: (:func:`_choose_batch`); larger ones one by one: a histogram per storage then stays in the cache
_BATCH_MAX_ELEMS = 1 << 13
#: at most this many storages share one pass (bounds the histogram: 1.5 KiB of bins each for bf16)
_BATCH_ITEMS = 64


def _choose_batch(
    items: list[tuple[np.ndarray, np.ndarray, torch.dtype, str, tuple[str, ...] | None]], w: int, rot: bool | None
) -> list[str | None]:
    """The rule of :func:`choose_delta_op` for many samples of the same plane width and rotation:
    per sample, the order-0 entropy of every plane of plain coding and of each delta op's residual
    (each plane estimated on at most :data:`_SAMPLE` elements taken with a stride, as
    ``_entropy_ratio`` does), all histograms of a pass in one ``bincount``. Small samples share a
    pass (a few numpy calls for up to :data:`_BATCH_ITEMS` storages instead of ~30 per storage: a
    training state's many biases and norms cost microseconds); large ones get a pass each."""
    out: list[str | None] = [None] * len(items)
    small: list[int] = []
    for i, it in enumerate(items):
        m = it[0].size // w
        if m // max(1, m // _SAMPLE) <= _BATCH_MAX_ELEMS:
            small.append(i)
        else:
            out[i] = _choose_one(*it)
    for a in range(0, len(small), _BATCH_ITEMS):
        idx = small[a : a + _BATCH_ITEMS]
        for i, op in zip(idx, _choose_pass([items[i] for i in idx], w, rot)):
            out[i] = op
    return out


def _choose_one(
    raw: np.ndarray, base: np.ndarray, dtype: torch.dtype, transform: str, ops: tuple[str, ...] | None
) -> str | None:
    """:func:`_choose_batch` for one large sample: each candidate's planes split by
    :func:`~s4w_core.planes.split_planes` (one compiled pass where numba is loaded) and each plane's
    entropy estimated by :func:`_entropy_ratio`."""
    r, b = torch.from_numpy(raw), torch.from_numpy(base)
    best: str | None = None
    best_cost = _estimate_bytes(_planes(r, dtype, transform, None))
    limit = (1.0 - DELTA_MIN_GAIN) * best_cost
    for op in delta.ops_for(dtype, transform):
        if ops is not None and op not in ops:
            continue
        c = _estimate_bytes(_planes(r, dtype, transform, b, op))
        if c < limit and c < best_cost:
            best, best_cost = op, c
    return best


def _choose_pass(
    items: list[tuple[np.ndarray, np.ndarray, torch.dtype, str, tuple[str, ...] | None]], w: int, rot: bool | None
) -> list[str | None]:
    word = _WORD[w]
    bits = 8 * w
    xs: list[np.ndarray] = []
    bs: list[np.ndarray] = []
    full: list[int] = []  # elements per sample (the cost's scale)
    for raw, base, _dt, _tr, _ops in items:
        m = raw.size // w
        step = max(1, m // _SAMPLE)  # _entropy_ratio's stride
        xs.append(raw.view(word)[::step])
        bs.append(base.view(word)[::step])
        full.append(m)
    lens = np.fromiter((x.size for x in xs), dtype=np.int64, count=len(xs))
    x = np.concatenate(xs) if len(xs) > 1 else xs[0]
    b = np.concatenate(bs) if len(bs) > 1 else bs[0]
    cands: list[np.ndarray] = [x, x ^ b]
    if w > 1:  # sub (s4w_core.delta), on the signed words: wrap-around arithmetic as torch's
        sw = _SWORD[w]
        mask = sw((1 << (bits - 1)) - 1)
        xi, bi = x.view(sw), b.view(sw)
        d = (xi ^ ((xi >> (bits - 1)) & mask)) - (bi ^ ((bi >> (bits - 1)) & mask))
        cands.append(((d << 1) ^ (d >> (bits - 1))).view(word))
    k_n = len(cands)
    per = k_n * w * 256  # histogram bins per sample
    total = x.size
    seg = np.repeat(np.arange(len(items), dtype=np.int64) * per, lens)
    idx = np.empty(total * k_n * w, dtype=np.int64)
    pos = 0
    for k, v in enumerate(cands):
        r = (v << word(1)) | (v >> word(bits - 1)) if rot else v
        for j in range(w):
            plane = (r >> word(8 * (w - 1 - j))) & word(0xFF) if w > 1 else r
            np.add(seg, plane, out=idx[pos : pos + total])
            if k or j:
                idx[pos : pos + total] += (k * w + j) * 256
            pos += total
    counts = np.bincount(idx, minlength=per * len(items)).reshape(len(items), k_n, w, 256)
    p = counts / np.maximum(lens, 1)[:, None, None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(counts > 0, p * np.log2(np.where(counts > 0, p, 1.0)), 0.0).sum(axis=3)
    cost = (np.maximum(h, 1e-3) / 8.0).sum(axis=2) * np.asarray(full, dtype=np.float64)[:, None]  # (items, cands)
    names = (None, "xor", "sub")
    out: list[str | None] = []
    for i, (_raw, _base, dtype, transform, ops) in enumerate(items):
        allowed = delta.ops_for(dtype, transform)
        best: str | None = None
        best_cost = float(cost[i, 0])
        limit = (1.0 - DELTA_MIN_GAIN) * best_cost
        for k in range(1, k_n):
            op = names[k]
            if op not in allowed or (ops is not None and op not in ops):
                continue
            c = float(cost[i, k])
            if c < limit and c < best_cost:
                best, best_cost = op, c
        out.append(best)
    return out


def _gather_sample(job: StorageJob, transform: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The sample of :func:`delta_sample_ranges` of ``job`` and of its base, as host bytes."""
    assert job.base is not None
    nbytes = job.raw.numel()
    if job.base.numel() != nbytes:
        raise BaseMismatchError(f"{job.path}: base has {job.base.numel()} bytes, tensor {nbytes}")
    w = 1 if transform == "bytes" else plane_width(job.dtype)
    ranges = delta_sample_ranges(nbytes // w)
    if not ranges:
        return None
    if job.raw.device.type == "cpu" and job.base.device.type == "cpu":
        rn, bn = job.raw.numpy(), job.base.numpy()
        if len(ranges) == 1:
            a, z = ranges[0]
            return rn[a * w : z * w], bn[a * w : z * w]
        return (np.concatenate([rn[a * w : z * w] for a, z in ranges]),
                np.concatenate([bn[a * w : z * w] for a, z in ranges]))
    raw = torch.cat([job.raw[a * w : z * w].cpu() for a, z in ranges])
    base = torch.cat([job.base[a * w : z * w].cpu() for a, z in ranges])
    return raw.numpy(), base.numpy()


def choose_delta_ops(jobs: Iterable[StorageJob], transforms: Iterable[str | None] | None = None) -> list[str | None]:
    """:func:`choose_delta_op` for many storages at once (those without a base give None), each
    choice also recorded on its job, where :func:`choose_delta_op` returns it when asked again for
    the same transform: writers call this once before coding a checkpoint's storages one by one.
    ``transforms``: per job, the transform it will be coded with (None: :func:`transform_for`'s default).
    Raises BaseMismatchError if a base has a different size."""
    jobs = list(jobs)
    trs = list(transforms) if transforms is not None else [None] * len(jobs)
    out: list[str | None] = [None] * len(jobs)
    groups: dict[tuple[int, bool | None], list[tuple[int, str, np.ndarray, np.ndarray]]] = {}
    for i, (job, tr) in enumerate(zip(jobs, trs)):
        if job.base is None:
            continue
        transform = transform_for(job.dtype, job.raw.numel(), transform=tr)[0]
        sample = _gather_sample(job, transform)
        if sample is None:
            job.delta_choice = (transform, None)
            continue
        w = 1 if transform == "bytes" else plane_width(job.dtype)
        groups.setdefault((w, _rot_of(transform)), []).append((i, transform, *sample))
    for (w, rot), members in groups.items():
        chosen = _choose_batch([(r, b, jobs[i].dtype, tr, None) for i, tr, r, b in members], w, rot)
        for (i, tr, _r, _b), op in zip(members, chosen):
            out[i] = op
            jobs[i].delta_choice = (tr, op)
    return out


def choose_delta_op(job: StorageJob, transform: str, ops: tuple[str, ...] | None = None) -> str | None:
    """The delta op (:mod:`s4w_core.delta`) to store ``job`` with against ``job.base``, or None
    for plain coding.  Shared by the CPU and GPU writers.

    Every candidate op (default: all that apply to the dtype, see :func:`delta.ops_for`) is
    estimated on the same sample (:func:`delta_sample_ranges`), so a storage whose first rows are
    atypical is judged on all of it.  An op wins if it beats plain by :data:`DELTA_MIN_GAIN`; the
    smallest estimate wins.  A choice :func:`choose_delta_ops` recorded on the job for the same
    transform (and all ops) is returned as it is.
    Raises BaseMismatchError if the base has a different size.
    """
    assert job.base is not None
    if ops is None and job.delta_choice is not None and job.delta_choice[0] == transform:
        return job.delta_choice[1]
    sample = _gather_sample(job, transform)
    if sample is None:
        return None
    w = 1 if transform == "bytes" else plane_width(job.dtype)
    return _choose_batch([(sample[0], sample[1], job.dtype, transform, ops)], w, _rot_of(transform))[0]


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


#: a storage whose raw size is at most this many times its stored bytes (plus
#: :data:`PLAUSIBLE_SLACK`) is allocated before its chunks are decoded; one that claims more is
#: decoded first (real data compresses far less: a claim that large is constant data or forged)
PLAUSIBLE_RATIO = 16
PLAUSIBLE_SLACK = 1 << 20


def claims_plausible(entry: dict[str, Any]) -> bool:
    """Whether a (validated) storage entry's raw size is at most :data:`PLAUSIBLE_RATIO` times its
    stored bytes plus :data:`PLAUSIBLE_SLACK`: then its output may be allocated before its chunks
    are decoded. Otherwise the CPU reader decodes the chunks first, and the GPU reader leaves such
    a storage to the CPU reader when it can (what a claim makes either allocate follows what the
    chunks actually yield)."""
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
        try:
            return dec(data, min(n, s0 + seg) - s0)
        except DecodeError as e:  # name the file, tensor and chunk (the codec knows none of them)
            raise DecodeError(
                f"{name}: chunk {i} of tensor {entry['path']!r} (bytes {off}..{off + length}, {codec_id}): {e}"
            ) from e

    # an implausible storage is decoded on this thread: a forged frame costs one output buffer
    # (at most a segment) at a time, not one per thread
    decoded: Iterator[Any] = _ordered_window(pool if proven else None, fetch_decode, len(chunks))
    if not proven:
        decoded = _drain(collections.deque(decoded))
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= PREFAULT_MIN_BYTES:
        _prefault(out)
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

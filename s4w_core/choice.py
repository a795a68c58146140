"""Which delta op (:mod:`s4w_core.delta`) and which transform variant a storage is coded with:
the sampled estimates shared by the CPU and GPU writers."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from s4w_core import delta
from s4w_core.codecs.chunk import (
    BITMAP,
    SAMPLE,
    encode_chunk,
    estimate_bytes,
    order0_bytes,
    order0_counts_bytes,
)
from s4w_core.errors import BaseMismatchError
from s4w_core.jobs import StorageJob, plane_rot, planes_of, transform_for
from s4w_core.planes import nonzero as nzt
from s4w_core.planes import plane_width, rowcol, split_planes

__all__ = [
    "DELTA_MIN_GAIN",
    "DELTA_RUNS",
    "DELTA_SAMPLE_ELEMS",
    "ESTIMATE_MAX_BYTES",
    "ESTIMATE_SAMPLE_ELEMS",
    "NZ_MIN_GAIN",
    "estimate_ranges",
    "nonzero_estimates",
    "NZ_MIN_ZERO_FRAC",
    "choose_delta_op",
    "choose_delta_op_sampled",
    "choose_delta_ops",
    "delta_pays",
    "delta_sample_ranges",
    "nonzero_pays",
    "nonzero_trial",
    "NonzeroTrial",
    "RC_MIN_ELEMS",
    "RC_MIN_GAIN",
    "RC_SAMPLE_ELEMS",
    "rowcol_choice",
    "RowcolCosts",
    "rowcol_costs",
    "rowcol_pays",
    "rowcol_sample_rows",
]

#: the nonzero transform is tried only where at least this fraction of the sampled elements is zero
NZ_MIN_ZERO_FRAC = 1 / 64
#: ... and used only if it codes the sample at least this fraction smaller than the plain transform
NZ_MIN_GAIN = 0.02


@dataclass(frozen=True)
class NonzeroTrial:
    """What :func:`nonzero_trial` found: whether the nonzero variant pays and, where its trial
    coded the whole storage as one segment, the chunks of the way chosen -- ``(codec id, bytes)``
    in the container's order (the nonzero way: its bitmap first) -- with the count of nonzero
    elements (the nonzero way), so that the writer does not code the storage again."""

    pays: bool
    chunks: tuple[tuple[str, bytes], ...] | None = None
    nnz: int = 0


def nonzero_pays(
    raw: torch.Tensor, base: torch.Tensor | None, dtype: torch.dtype, transform: str, op: str | None
) -> bool:
    """Whether the nonzero variant of the byte-plane ``transform`` (docs/FORMAT.md 4.5c) pays for
    the CPU bytes ``raw`` (with ``base`` and delta ``op``, or plain): :func:`nonzero_trial`."""
    return nonzero_trial(raw, base, dtype, transform, op).pays


def nonzero_trial(
    raw: torch.Tensor, base: torch.Tensor | None, dtype: torch.dtype, transform: str, op: str | None,
    *, one_segment: bool = False,
) -> NonzeroTrial:
    """Whether the nonzero variant of the byte-plane ``transform`` (docs/FORMAT.md 4.5c) pays for
    the CPU bytes ``raw`` (with ``base`` and delta ``op``, or plain): measured by coding the
    sample of :func:`delta_sample_ranges` both ways with the chunk coder itself (its zstd finds
    zero runs that an entropy estimate does not see), after a cheap check that the sample has
    zeros at all (:data:`NZ_MIN_ZERO_FRAC`). A storage of at most :data:`ESTIMATE_MAX_BYTES` and
    more than :data:`ESTIMATE_SAMPLE_ELEMS` elements is coded so only where the order-0 estimates
    of both ways on a sample of its elements (:func:`nonzero_estimates`) say the variant saves
    :data:`NZ_MIN_GAIN` as well (a delta's residual with a few unchanged elements: the estimates a
    few bytes apart, no trial coding); a smaller one is its own sample, as cheap to code as to
    estimate (and zstd sees the runs of a bias a step left mostly unchanged). ``one_segment``:
    the writer codes ``raw`` as one segment; where the sample is then all of it, the trial's
    chunks of the way chosen are returned (the same bytes the writer would code)."""
    w = plane_width(dtype)
    if ESTIMATE_SAMPLE_ELEMS * w < raw.numel() <= ESTIMATE_MAX_BYTES:
        est = nonzero_estimates(raw, base, dtype, transform, op)
        if est is None or est[1] >= (1.0 - NZ_MIN_GAIN) * est[0]:
            return NonzeroTrial(False)
    ranges = delta_sample_ranges(raw.numel() // w)
    if not ranges:
        return NonzeroTrial(False)
    r = torch.cat([raw[a * w : z * w] for a, z in ranges]) if len(ranges) > 1 else raw
    b = None
    if base is not None and op is not None:
        b = torch.cat([base[a * w : z * w] for a, z in ranges]) if len(ranges) > 1 else base
    words = nzt.residual_words(r, dtype, b, op)
    zeros = words.size - int(np.count_nonzero(words))
    if zeros < NZ_MIN_ZERO_FRAC * words.size:
        return NonzeroTrial(False)
    rot = plane_rot(transform)
    plain = split_planes(torch.from_numpy(words.view(np.uint8)), dtype, rot=rot).numpy()
    plain_chunks = [encode_chunk(transform, j, plain[j]) for j in range(w)]
    bitmap, planes = nzt.split_nonzero(words, w, rot=rot)
    nz_chunks = [encode_chunk(transform, BITMAP, bitmap)] + [encode_chunk(transform, j, planes[j]) for j in range(w)]
    pays = sum(len(c[1]) for c in nz_chunks) < (1.0 - NZ_MIN_GAIN) * sum(len(c[1]) for c in plain_chunks)
    if not (one_segment and ranges == [(0, raw.numel() // w)]):
        return NonzeroTrial(pays)
    return NonzeroTrial(pays, tuple(nz_chunks if pays else plain_chunks), int(planes.shape[1]) if pays else 0)


def estimate_ranges(n: int) -> list[tuple[int, int]]:
    """Element ranges ``(start, stop)`` the estimates of a storage of ``n`` elements sample: all of
    it up to :data:`ESTIMATE_SAMPLE_ELEMS`, else 8 runs spread over it making about that many
    (runs, not a stride: the nonzero bitmap's runs of zeros are part of what is estimated)."""
    if n <= ESTIMATE_SAMPLE_ELEMS:
        return [(0, n)] if n else []
    run = ESTIMATE_SAMPLE_ELEMS // 8
    return [((n - run) * k // 7, (n - run) * k // 7 + run) for k in range(8)]


def nonzero_estimates(
    raw: torch.Tensor, base: torch.Tensor | None, dtype: torch.dtype, transform: str, op: str | None
) -> tuple[float, float] | None:
    """``(planes, nonzero)``: order-0 estimates of the bytes of a sample (:func:`estimate_ranges`)
    of ``raw`` (with ``base`` and delta ``op``, or plain) under the byte-plane ``transform`` and
    under its nonzero variant (bitmap and planes of the nonzero elements); None where fewer than
    :data:`NZ_MIN_ZERO_FRAC` of the sampled elements are zero."""
    w = plane_width(dtype)
    ranges = estimate_ranges(raw.numel() // w)
    if not ranges:
        return None
    r, b = raw, base if op is not None else None
    if len(ranges) > 1:  # numpy's concatenation of the runs (torch.cat costs ~10 us a call)
        r = torch.from_numpy(np.concatenate([raw.numpy()[a * w : z * w] for a, z in ranges]))
        if b is not None:
            b = torch.from_numpy(np.concatenate([b.numpy()[a * w : z * w] for a, z in ranges]))
    words = nzt.residual_words(r, dtype, b, op)
    zeros = words.size - int(np.count_nonzero(words))
    if zeros < NZ_MIN_ZERO_FRAC * words.size:
        return None
    plain = split_planes(torch.from_numpy(words.view(np.uint8)), dtype, rot=plane_rot(transform)).numpy()
    counts = [np.bincount(plain[j], minlength=256) for j in range(w)]
    plain_cost = sum(order0_counts_bytes(c) for c in counts)
    # a zero element is a zero byte in every plane: the nonzero elements' planes have the same
    # histograms less ``zeros`` zero bytes
    for c in counts:
        c[0] -= zeros
    bitmap = np.packbits(words != 0, bitorder="little")  # nzt.split_nonzero's bitmap
    return plain_cost, order0_bytes(bitmap) + sum(order0_counts_bytes(c) for c in counts)


#: storages of at most this many bytes (a small model's weights and moments, and every bias and
#: norm) make their choices -- the delta op on the CPU writer (:func:`choose_delta_ops`), the
#: row/column and nonzero variants -- by order-0 estimates on a sample of about
#: :data:`ESTIMATE_SAMPLE_ELEMS` elements instead of coding samples of up to 2**16 elements with the
#: chunk coder: those trial codings cost several times the storage's own coding (a save and its
#: re-encoding of a 0.5 M-parameter GPT's state, benchmarks/bench_tensor_cost.py), for choices
#: whose bytes at stake are few
ESTIMATE_MAX_BYTES = 128 << 10
#: elements the estimates of a storage of at most :data:`ESTIMATE_MAX_BYTES` sample
ESTIMATE_SAMPLE_ELEMS = 1 << 12

#: storages of fewer elements never take the row/column transform (docs/FORMAT.md 4.5d)
RC_MIN_ELEMS = 1 << 12
#: ... which is used only where it makes plane 0 (the only plane it changes; estimated with the
#: offsets' ``R + C`` bytes) at least this fraction smaller. (Weighed against all planes, the bar
#: would be 4x higher for fp32 than for bf16: it missed the variant on most fp32 ``exp_avg``
#: storages, which it makes 1-2 % smaller, 0.9 % of that group on the gpt ratio series.)
RC_MIN_GAIN = 0.02
#: about this many elements (whole rows, spread over the storage) are sampled for that choice
RC_SAMPLE_ELEMS = 1 << 15


def rowcol_sample_rows(rows: int, cols: int, elems: int = RC_SAMPLE_ELEMS) -> list[int]:
    """The rows (indices, in order) that the row/column probe samples from an ``rows x cols``
    storage: all of them up to ``elems`` elements (:data:`RC_SAMPLE_ELEMS`), else evenly spread
    rows making about that many (at least 2)."""
    return _sample_rows(rows, cols, elems).tolist()  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1024)
def _sample_rows(rows: int, cols: int, elems: int) -> np.ndarray:
    """:func:`rowcol_sample_rows` as a read-only index array, kept per shape (a training state's
    matrices have few shapes, and every save probes them all)."""
    k = max(2, min(rows, elems // cols))
    if k >= rows:
        out = np.arange(rows, dtype=np.int64)
    else:
        out = np.unique((rows - 1) * np.arange(k, dtype=np.int64) // (k - 1))
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class RowcolCosts:
    """What :func:`rowcol_costs` estimates of a storage, in stored bytes: its plane 0 as the
    byte-plane transform codes it (``plane0``), plane 0 less its row/column offsets with the
    offsets' ``R + C`` bytes (``rowcol0``: the row/column variant, docs/FORMAT.md 4.5d), and its
    other planes, the same both ways (``others``; 0 where not asked for)."""

    plane0: float
    rowcol0: float
    others: float = 0.0

    @property
    def pays(self) -> bool:
        """Whether the variant makes plane 0 :data:`RC_MIN_GAIN` smaller."""
        return self.rowcol0 < (1.0 - RC_MIN_GAIN) * self.plane0


def rowcol_costs(
    raw: torch.Tensor,
    base: torch.Tensor | None,
    dtype: torch.dtype,
    transform: str,
    op: str | None,
    cols: int | None,
    *,
    others: bool = False,
) -> RowcolCosts | None:
    """:class:`RowcolCosts` of the CPU bytes ``raw`` (with ``base`` and delta ``op``, or plain)
    under the byte-plane ``transform`` with rows of ``cols`` elements (the other planes estimated
    where ``others``); or None where the variant does not apply (no row length, fewer than
    :data:`RC_MIN_ELEMS` elements). Order-0 estimates (histograms) on the rows of
    :func:`rowcol_sample_rows` -- about :data:`RC_SAMPLE_ELEMS` elements, or
    :data:`ESTIMATE_SAMPLE_ELEMS` for a storage of at most :data:`ESTIMATE_MAX_BYTES` -- scaled to
    the storage. (The writer codes plane 0 in chunks of up to 1 MiB with Huffman tables: an
    estimate free of a small sample's coding overheads: coding the sample with the chunk coder
    cost a third of a CPU save and chose no better on the gpt ratio series.)"""
    w = plane_width(dtype)
    n = raw.numel() // w
    if not cols or n < RC_MIN_ELEMS or n % cols or n // cols < 2 or cols < 2:
        return None
    rows = n // cols
    small = raw.numel() <= ESTIMATE_MAX_BYTES
    pick = _sample_rows(rows, cols, ESTIMATE_SAMPLE_ELEMS if small else RC_SAMPLE_ELEMS)
    if base is None or op is None:
        base, op = None, None
    if len(pick) == rows:
        r, b = raw, base
    else:
        # numpy's row gather (torch's index of uint8 rows is ~100x slower on a CPU)
        r = torch.from_numpy(raw.numpy().reshape(rows, cols * w)[pick].reshape(-1))
        b = None if base is None else torch.from_numpy(base.numpy().reshape(rows, cols * w)[pick].reshape(-1))
    words = nzt.residual_words(r, dtype, b, op)
    rot = plane_rot(transform)
    rest = 0.0
    if others:
        planes = split_planes(torch.from_numpy(words.view(np.uint8)), dtype, rot=rot).numpy()
        rest = sum(order0_bytes(planes[j]) for j in range(1, w))
    hp, hq = rowcol.probe_hists(words, w, rot, cols)
    scale = n / words.size
    return RowcolCosts(order0_counts_bytes(hp) * scale, order0_counts_bytes(hq) * scale + rows + cols, rest * scale)


def rowcol_pays(
    raw: torch.Tensor, base: torch.Tensor | None, dtype: torch.dtype, transform: str, op: str | None, cols: int | None
) -> bool:
    """Whether the row/column variant of the byte-plane ``transform`` (docs/FORMAT.md 4.5d) pays for
    the CPU bytes ``raw`` viewed as rows of ``cols`` elements (with ``base`` and delta ``op``, or
    plain): :func:`rowcol_costs` says it makes plane 0 :data:`RC_MIN_GAIN` smaller."""
    c = rowcol_costs(raw, base, dtype, transform, op, cols)
    return c is not None and c.pays


def rowcol_choice(
    raw: torch.Tensor, base: torch.Tensor | None, dtype: torch.dtype, transform: str, op: str | None, cols: int | None
) -> tuple[bool, str | None]:
    """``(rowcol, op)``: whether to code ``raw`` with the row/column variant of ``transform``, and the
    delta op to keep (``op``, or None). Without a delta: :func:`rowcol_pays`. With one, the variant
    is never applied to the residual (a ``sub`` residual has its scales removed already; on the
    MiniLM chain the sample's estimate picked it for storages it made 1-2 % larger), but ``raw``
    alone under the variant, where it pays, is weighed against the residual (:func:`rowcol_costs`,
    the same rows, every plane): the delta is dropped where ``raw`` alone is :data:`RC_MIN_GAIN`
    smaller (an ``exp_avg`` step, whose signs and exponents move more than its row and column scales)."""
    if op is None or base is None:
        return rowcol_pays(raw, None, dtype, transform, None, cols), None
    alone = rowcol_costs(raw, None, dtype, transform, None, cols, others=True)
    if alone is None or not alone.pays:
        return False, op
    resid = rowcol_costs(raw, base, dtype, transform, op, cols, others=True)
    if resid is not None and alone.rowcol0 + alone.others < (1.0 - RC_MIN_GAIN) * (resid.plane0 + resid.others):
        return True, None
    return False, op


#: elements sampled (in runs spread over a storage) to choose plain vs. a delta op.
DELTA_SAMPLE_ELEMS = 1 << 18
#: a delta op is used only if the sample says it saves at least this fraction over plain coding.
DELTA_MIN_GAIN = 0.03
#: runs the sample of :func:`delta_sample_ranges` is taken in
DELTA_RUNS = 16
_DELTA_MIN_SAMPLE = 1 << 16  # storages above 8x this are sampled at 1/8 (up to DELTA_SAMPLE_ELEMS)


def delta_sample_ranges(n: int) -> list[tuple[int, int]]:
    """Element ranges ``(start, stop)`` that :func:`choose_delta_op` samples from a storage of
    ``n`` elements: all of it when small, else 16 runs spread over it, together an eighth of it,
    at least 2**16 and at most :data:`DELTA_SAMPLE_ELEMS` elements."""
    if n <= _DELTA_MIN_SAMPLE:
        return [(0, n)] if n else []
    run = max(1, min(n, DELTA_SAMPLE_ELEMS, max(_DELTA_MIN_SAMPLE, n // 8)) // DELTA_RUNS)
    starts = sorted({(n - run) * k // (DELTA_RUNS - 1) for k in range(DELTA_RUNS)})
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
#: ... and samples of at most this many elements together (bounds the pass's index array: 1.5 MiB
#: for bf16; a pass over 64 samples of 4096 elements took ~2x as long, in fresh pages)
_BATCH_PASS_ELEMS = 1 << 15


def _choose_batch(
    items: list[tuple[np.ndarray, np.ndarray, torch.dtype, str, tuple[str, ...] | None]],
    w: int,
    rot: bool | None,
    estimated: list[bool] | None = None,
) -> list[str | None]:
    """The rule of :func:`choose_delta_op` for many samples of the same plane width and rotation:
    per sample, the order-0 entropy of every plane of plain coding and of each delta op's residual
    (each plane estimated on at most :data:`SAMPLE` elements taken with a stride, as
    ``entropy_ratio`` does), all histograms of a pass in one ``bincount``. Small samples share a
    pass (a few numpy calls for up to :data:`_BATCH_ITEMS` storages instead of ~30 per storage: a
    training state's many biases and norms cost microseconds); large ones get a pass each.
    ``estimated``: per item, whether it is a sample of a storage of at most
    :data:`ESTIMATE_MAX_BYTES` (then the whole storage), estimated on about
    :data:`ESTIMATE_SAMPLE_ELEMS` elements (the same stride rule) in shared passes."""
    out: list[str | None] = [None] * len(items)
    passes: list[list[tuple[int, int]]] = [[]]  # (item, its sample size) per pass
    elems = 0
    for i, it in enumerate(items):
        m = it[0].size // w
        sample = ESTIMATE_SAMPLE_ELEMS if estimated is not None and estimated[i] else SAMPLE
        taken = m // max(1, m // sample)
        if taken > _BATCH_MAX_ELEMS:
            out[i] = _choose_one(*it)
            continue
        if len(passes[-1]) >= _BATCH_ITEMS or (passes[-1] and elems + taken > _BATCH_PASS_ELEMS):
            passes.append([])
            elems = 0
        passes[-1].append((i, sample))
        elems += taken
    for group in passes:
        if group:
            chosen = _choose_pass([items[i] for i, _ in group], w, rot, [k for _, k in group])
            for (i, _), op in zip(group, chosen):
                out[i] = op
    return out


def _choose_one(
    raw: np.ndarray, base: np.ndarray, dtype: torch.dtype, transform: str, ops: tuple[str, ...] | None
) -> str | None:
    """:func:`_choose_batch` for one large sample: each candidate's planes split by
    :func:`~s4w_core.planes.split_planes` (one compiled pass where numba is loaded) and each plane's
    entropy estimated by :func:`entropy_ratio`."""
    r, b = torch.from_numpy(raw), torch.from_numpy(base)
    best: str | None = None
    best_cost = estimate_bytes(planes_of(r, dtype, transform, None))
    limit = (1.0 - DELTA_MIN_GAIN) * best_cost
    for op in delta.ops_for(dtype, transform):
        if ops is not None and op not in ops:
            continue
        c = estimate_bytes(planes_of(r, dtype, transform, b, op))
        if c < limit and c < best_cost:
            best, best_cost = op, c
    return best


def _choose_pass(
    items: list[tuple[np.ndarray, np.ndarray, torch.dtype, str, tuple[str, ...] | None]],
    w: int,
    rot: bool | None,
    samples: list[int],
) -> list[str | None]:
    word = _WORD[w]
    bits = 8 * w
    xs: list[np.ndarray] = []
    bs: list[np.ndarray] = []
    full: list[int] = []  # elements per sample (the cost's scale)
    for (raw, base, _dt, _tr, _ops), sample in zip(items, samples):
        m = raw.size // w
        step = max(1, m // sample)  # entropy_ratio's stride
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
    # each byte of a (rotated) word, little-endian, is a byte of plane ``w - 1 - t`` (t: its place
    # in the word): its bin is the byte plus the bins before its sample, candidate and plane
    off = np.repeat(np.arange(len(items), dtype=np.intp) * per, lens * w)
    off += np.tile(np.arange(w - 1, -1, -1, dtype=np.intp) * 256, total)
    n_b = total * w
    idx = np.empty(n_b * k_n, dtype=np.intp)
    for k, v in enumerate(cands):
        r = (v << word(1)) | (v >> word(bits - 1)) if rot else v
        dst = idx[k * n_b : (k + 1) * n_b]
        np.add(off, np.ascontiguousarray(r).view(np.uint8), out=dst)
        if k:
            dst += k * w * 256
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
        return (
            np.concatenate([rn[a * w : z * w] for a, z in ranges]),
            np.concatenate([bn[a * w : z * w] for a, z in ranges]),
        )
    raw = torch.cat([job.raw[a * w : z * w].cpu() for a, z in ranges])
    base = torch.cat([job.base[a * w : z * w].cpu() for a, z in ranges])
    return raw.numpy(), base.numpy()


def choose_delta_ops(
    jobs: Iterable[StorageJob], transforms: Iterable[str | None] | None = None, *, estimate_small: bool = False
) -> list[str | None]:
    """:func:`choose_delta_op` for many storages at once (those without a base give None), each
    choice also recorded on its job, where :func:`choose_delta_op` returns it when asked again for
    the same transform: writers call this once before coding a checkpoint's storages one by one.
    ``transforms``: per job, the transform it will be coded with (None: :func:`transform_for`'s default).
    ``estimate_small``: storages of at most :data:`ESTIMATE_MAX_BYTES` are estimated on about
    :data:`ESTIMATE_SAMPLE_ELEMS` elements (the CPU writer: the choice among plain, ``xor`` and
    ``sub`` is rarely close, and where it is the bytes at stake are few).
    Raises BaseMismatchError if a base has a different size."""
    jobs = list(jobs)
    trs = list(transforms) if transforms is not None else [None] * len(jobs)
    out: list[str | None] = [None] * len(jobs)
    groups: dict[tuple[int, bool | None], list[tuple[int, str, np.ndarray, np.ndarray]]] = {}
    small = [estimate_small and job.raw.numel() <= ESTIMATE_MAX_BYTES for job in jobs]
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
        items: list[tuple[np.ndarray, np.ndarray, torch.dtype, str, tuple[str, ...] | None]]
        items = [(r, b, jobs[i].dtype, tr, None) for i, tr, r, b in members]
        chosen = _choose_batch(items, w, rot, [small[i] for i, _tr, _r, _b in members])
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

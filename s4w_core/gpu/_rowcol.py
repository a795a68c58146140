"""The row/column transforms (``rc-planes-rotl1``, docs/FORMAT.md 4.5d) on the GPU: the writer's
choice and coding of a storage.

Writer, per storage the GPU codes that a tensor views whole as rows of ``C`` elements
(:attr:`~s4w_core.jobs.StorageJob.cols`): on a sample of whole rows
(:func:`~s4w_core.choice.rowcol_sample_rows`), the order-0 entropy of plane 0 as it is and less
its row/column offsets (what the GPU's order-0 coders get), scaled to the storage: the CPU writer's
rule (:class:`~s4w_core.choice.RowcolCosts`), the variant used where it makes plane 0
:data:`~s4w_core.choice.RC_MIN_GAIN` smaller with the offsets' ``R + C`` bytes counted. Every
candidate's estimate is computed on the device and read back once for all of them. A chosen
storage is split on the device, its offsets taken by two reductions over plane 0
(:func:`~s4w_core.planes.rowcol.offsets_torch`), plane 0 stored less them, and its chunks coded
with those of the other row/column storages of its group (a batch budget of them) in one nvCOMP
call and one read-back (:func:`encode_rowcol_many`), each kept coded only if smaller.

Reader: ``rc-`` storages are decoded in the GPU reader's batches like ``planes-rotl1`` /
``planes`` (gpu/_decode.py): the offsets are added to each segment's plane 0 before the merge.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from s4w_core import choice
from s4w_core.format.manifest import RC_TRANSFORMS, ROTL1
from s4w_core.gpu import _nvcomp
from s4w_core.gpu._nonzero import code_parts_device, plane_bytes, residual_words
from s4w_core.gpu._samples import gather_samples, runs_of
from s4w_core.planes import rowcol
from s4w_core.workers import segments

__all__ = ["RC_TRANSFORM", "encode_rowcol_many", "rowcol_choices_device", "rowcol_estimates_device"]

#: the row/column transform the GPU writer writes
RC_TRANSFORM = next(k for k, v in RC_TRANSFORMS.items() if v == ROTL1)
_ITYPE = {2: torch.int16, 4: torch.int32}
#: sample elements estimated together by :func:`rowcol_estimates_device`: its temporaries take about
#: 110 bytes per element (int64 indices and histogram keys), so a group bounds a save's extra device
#: memory to ~115 MB (all of a GPT-2 151M state's samples at once, ~4.7 M elements: ~520 MB)
_RC_GROUP_ELEMS = 1 << 20
#: ... and with a ``work`` bound (:func:`rowcol_estimates_device`), ``work // _RC_BYTES_PER_ELEM`` of them
_RC_BYTES_PER_ELEM = 128


def rowcol_choices_device(
    items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype, int | None]],
    dev: torch.device,
    *,
    work: int | None = None,
) -> list[bool]:
    """Per storage ``(raw bytes, base, delta op, dtype, row length)``: whether the GPU writer codes
    it with :data:`RC_TRANSFORM` -- where :func:`rowcol_estimates_device` says it saves
    :data:`~s4w_core.choice.RC_MIN_GAIN` on plane 0."""
    return [e is not None and e.pays for e in rowcol_estimates_device(items, dev, work=work)]


def rowcol_estimates_device(
    items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype, int | None]],
    dev: torch.device,
    *,
    work: int | None = None,
) -> list[choice.RowcolCosts | None]:
    """Per storage ``(raw bytes, base, delta op, dtype, row length)``: its
    :class:`~s4w_core.choice.RowcolCosts` (plane 0 and plane 0 less its offsets plus their bytes;
    no other planes), order-0 estimates on a sample of rows (module docstring), or None where it is
    no candidate (no row length, too small). The samples are taken, moved to the device (host
    samples in one copy per group, not a synchronizing copy per storage) and estimated a group at a
    time: at most ``_RC_GROUP_ELEMS`` sample elements, or what ``work`` bytes of device memory hold
    (:func:`~s4w_core.gpu._nvcomp.work_bytes`); one read-back per group."""
    out: list[choice.RowcolCosts | None] = [None] * len(items)
    limit = _RC_GROUP_ELEMS if work is None else max(1 << 16, min(_RC_GROUP_ELEMS, work // _RC_BYTES_PER_ELEM))
    cands: list[tuple[int, int, int, int, list[int]]] = []
    sizes: list[int] = []
    for i, (raw, _base, _op, dtype, cols) in enumerate(items):
        w = dtype.itemsize
        n = raw.numel() // w
        if not cols or w not in _ITYPE or n < choice.RC_MIN_ELEMS or n % cols or cols < 2 or n // cols < 2:
            continue
        rows = n // cols
        pick = choice.rowcol_sample_rows(rows, cols)
        cands.append((i, w, cols, n, pick))
        sizes.append(len(pick) * cols)
    for group in runs_of(cands, sizes, limit):
        taken: list[tuple[int, torch.Tensor, torch.Tensor | None, str | None, torch.dtype, int, int]] = []
        for i, w, cols, n, pick in group:
            raw, base, op, dtype, _cols = items[i]
            rows = n // cols
            r = _rows(raw, rows, cols * w, pick)
            b = _rows(base, rows, cols * w, pick) if base is not None and op is not None else None
            taken.append((i, r, b, op, dtype, cols, n))
        host = [t for _i, r, b, *_ in taken for t in (r, b) if t is not None and t.device != dev]
        moved = iter(gather_samples([(t, [(0, t.numel())], 1) for t in host], dev))
        by_width: dict[int, list[tuple[int, torch.Tensor, int, int]]] = {}
        for i, r, b, op, dtype, cols, n in taken:
            r = next(moved) if r.device != dev else r
            if b is not None and b.device != dev:
                b = next(moved)
            by_width.setdefault(dtype.itemsize, []).append((i, residual_words(r, b, op, dtype), cols, n))
        del taken, host, moved
        for w, run in by_width.items():
            plain, rc = _estimate_group(run, w, dev)
            for (i, words, cols, n), pb, rb in zip(run, plain, rc):
                scale = n / words.numel() / 8.0  # sample bits -> storage bytes
                out[i] = choice.RowcolCosts(pb * scale, rb * scale + n // cols + cols)  # with the offsets' bytes
    return out


def _rows(raw: torch.Tensor, rows: int, row_bytes: int, pick: list[int]) -> torch.Tensor:
    """The rows ``pick`` of ``raw`` (bytes, ``rows`` x ``row_bytes``), back to back: one gather on a
    device, numpy's on the host (torch's index of uint8 rows is ~100x slower on a CPU)."""
    if len(pick) == rows:
        return raw
    if raw.device.type == "cpu":
        return torch.from_numpy(raw.numpy().reshape(rows, row_bytes)[pick].reshape(-1))
    # the same rows computed on the device (no upload, no wait): (rows - 1) * i // (k - 1), i < k
    k = len(pick)
    idx = torch.div((rows - 1) * torch.arange(k, dtype=torch.int64, device=raw.device), k - 1, rounding_mode="floor")
    return raw.view(rows, row_bytes).index_select(0, idx).reshape(-1)


def _estimate_group(
    group: list[tuple[int, torch.Tensor, int, int]], w: int, dev: torch.device
) -> tuple[list[float], list[float]]:
    """For samples of one width ``(item, words, cols, n)``: the order-0 bits of plane 0 of each, as
    it is and less its row/column offsets -- every sample at once (a fixed number of
    kernels, whatever the number of storages: sums by ``index_add_``, histograms by one
    ``bincount``), one read-back; the caller bounds the group (:data:`_RC_GROUP_ELEMS`)."""
    sizes = [int(words.numel()) for _i, words, _c, _n in group]
    cols = [c for _i, _w, c, _n in group]
    krows = [m // c for m, c in zip(sizes, cols)]
    ns = len(group)
    words = torch.cat([wd for _i, wd, _c, _n in group]) if ns > 1 else group[0][1]
    p0 = plane_bytes(words, w)[0].to(torch.int64)
    total = p0.numel()
    # per element: its sample (sid), global row (rid) and global column (cid); per row / column its sample
    sizes_t = torch.tensor(sizes, dtype=torch.int64).to(dev)
    cols_t = torch.tensor(cols, dtype=torch.int64).to(dev)
    krows_t = torch.tensor(krows, dtype=torch.int64).to(dev)
    ar = torch.arange(ns, dtype=torch.int64, device=dev)
    sid = torch.repeat_interleave(ar, sizes_t, output_size=total)
    start = torch.cumsum(sizes_t, 0) - sizes_t
    col_base = torch.cumsum(cols_t, 0) - cols_t
    row_base = torch.cumsum(krows_t, 0) - krows_t
    local = torch.arange(total, dtype=torch.int64, device=dev) - start[sid]
    cl = cols_t[sid]
    rid = row_base[sid] + torch.div(local, cl, rounding_mode="floor")
    cid = col_base[sid] + local % cl
    nrows, ncols = sum(krows), sum(cols)
    row_sid = torch.repeat_interleave(ar, krows_t, output_size=nrows)
    col_sid = torch.repeat_interleave(ar, cols_t, output_size=ncols)
    # rowcol.offsets_torch for every sample: integer means, the same bytes
    rsum = torch.zeros(nrows, dtype=torch.int64, device=dev).index_add_(0, rid, p0)
    row = torch.div(rsum + cols_t[row_sid] // 2, cols_t[row_sid], rounding_mode="floor")
    row_total = torch.zeros(ns, dtype=torch.int64, device=dev).index_add_(0, row_sid, row)
    csum = torch.zeros(ncols, dtype=torch.int64, device=dev).index_add_(0, cid, p0)
    kr = krows_t[col_sid]
    col = torch.div(csum - row_total[col_sid] + kr // 2, kr, rounding_mode="floor")
    q = (p0 - row[rid] - col[cid]) & 0xFF
    keys = torch.cat([sid * 512 + p0, sid * 512 + 256 + q])
    hist = torch.bincount(keys, minlength=ns * 512).view(ns, 2, 256).to(torch.float64)
    p = hist / sizes_t.to(torch.float64)[:, None, None]
    h = (-(p * torch.log2(torch.where(p > 0, p, torch.ones_like(p))))).sum(2).clamp_min(1e-3)  # bits per byte
    bits = (h * sizes_t.to(torch.float64)[:, None]).cpu().numpy()  # (ns, 2): one read-back
    return bits[:, 0].tolist(), bits[:, 1].tolist()


def encode_rowcol_many(
    items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype, int]],
    seg: int,
    algorithm: str,
    codec_id: str,
    opts: dict[str, Any],
    dev: torch.device,
) -> tuple[list[dict[str, Any]], list[tuple[list[str], list[memoryview]]], torch.Tensor]:
    """Code storages ``(raw bytes on dev, base, delta op, dtype, row length)`` with
    :data:`RC_TRANSFORM` in segments of ``seg`` elements, all their chunks in one nvCOMP call and
    one read-back (a storage at a time, a training state's few hundred moment matrices cost a
    call and a synchronization each): per storage its entry's ``rowcol`` value and per chunk, in
    manifest order, its codec id and bytes (views into the returned pinned host buffer, which must
    outlive them). A chunk is coded (``algorithm`` with ``opts``, written as ``codec_id``) only
    where that is smaller."""
    parts: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    offsets: list[tuple[torch.Tensor, torch.Tensor]] = []
    for raw, base, op, dtype, cols in items:
        w = dtype.itemsize
        n = raw.numel() // w
        words = residual_words(raw, None if base is None else _nvcomp.to_device(base, dev), op, dtype)
        planes = plane_bytes(words, w)  # the whole storage at once: a few kernels, not a few per segment
        row, col = rowcol.offsets_torch(planes[0], cols)
        planes[0] = planes[0] - rowcol.tile_torch(row, col, 0, n)  # uint8: modulo 256
        mine = [planes[j][s0:s1] for s0, s1 in segments(n, seg) for j in range(w)]
        spans.append((len(parts), len(mine)))
        parts += mine
        offsets.append((row, col))
    ids, views, host = code_parts_device(parts, algorithm, codec_id, opts, dev)  # synchronizes once
    # every storage's offsets to the host in one copy
    flat = torch.cat([t for pair in offsets for t in pair]).cpu().numpy() if offsets else np.zeros(0, np.uint8)
    keys: list[dict[str, Any]] = []
    at = 0
    for (_raw, _base, _op, _dtype, cols), (row, col) in zip(items, offsets):
        nr, nc = row.numel(), col.numel()
        keys.append(rowcol.key(cols, flat[at : at + nr], flat[at + nr : at + nr + nc]))
        at += nr + nc
    return keys, [(ids[a : a + m], views[a : a + m]) for a, m in spans], host

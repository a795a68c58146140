"""The row/column transforms (``rc-planes-rotl1``, docs/FORMAT.md 4.5d) on the GPU: the writer's
choice and coding of a storage, and the reader's decode of any ``rc-`` storage (GPU- or CPU-written).

Writer, per storage the GPU codes that a tensor views whole as rows of ``C`` elements
(:attr:`~s4w_core.jobs.StorageJob.cols`): on a sample of whole rows
(:func:`~s4w_core.choice.rowcol_sample_rows`), the order-0 entropy of every plane, and of plane 0
less its row/column offsets (what the GPU's order-0 coders get), scaled to the storage; the
row/column variant is used where it saves :data:`~s4w_core.choice.RC_MIN_GAIN` with the offsets'
``R + C`` bytes counted. Every candidate's estimate is computed on the device and read back once
for all of them. A chosen storage is split on the device, its offsets taken by two reductions over
plane 0 (:func:`~s4w_core.planes.rowcol.offsets_torch`), plane 0 stored less them, and its chunks
coded in one nvCOMP call, each kept coded only if smaller.

Reader: every chunk's xxh3 checked on the host before any decoder sees it; chunks of the GPU's
codecs decoded in one nvCOMP call, the others on the host; per segment, the offsets added to plane
0 and the planes merged on the device; the delta undone; the raw checksum checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from s4w_core import checksum as ck
from s4w_core import choice, delta
from s4w_core.engine import chunk_layout
from s4w_core.errors import ChecksumMismatchError, DecodeError
from s4w_core.format.container import ContainerReader
from s4w_core.format.manifest import RC_TRANSFORMS, ROTL1, rowcol_offsets
from s4w_core.gpu import _nvcomp
from s4w_core.gpu._nonzero import bits_order0, code_parts_device, fetch_chunks_device, plane_bytes, residual_words
from s4w_core.jobs import dtype_from_name, plane_rot
from s4w_core.planes import merge_planes, rowcol
from s4w_core.workers import segments

__all__ = ["RC_TRANSFORM", "decode_rowcol_device", "encode_rowcol_device", "rowcol_choices_device",
           "rowcol_estimates_device"]

#: the row/column transform the GPU writer writes
RC_TRANSFORM = next(k for k, v in RC_TRANSFORMS.items() if v == ROTL1)
_ITYPE = {2: torch.int16, 4: torch.int32}


def rowcol_choices_device(
    items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype, int | None]], dev: torch.device
) -> list[bool]:
    """Per storage ``(raw bytes, base, delta op, dtype, row length)``: whether the GPU writer codes
    it with :data:`RC_TRANSFORM` -- where :func:`rowcol_estimates_device` says it saves
    :data:`~s4w_core.choice.RC_MIN_GAIN`."""
    return [e is not None and e[1] < (1.0 - choice.RC_MIN_GAIN) * e[0] for e in rowcol_estimates_device(items, dev)]


def rowcol_estimates_device(
    items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype, int | None]], dev: torch.device
) -> list[tuple[float, float] | None]:
    """Per storage ``(raw bytes, base, delta op, dtype, row length)``: ``(plain, rowcol)``, the
    order-0 estimates in bytes of its planes and of its :data:`RC_TRANSFORM` chunks plus offsets, on
    a sample of rows (module docstring), or None where it is no candidate (no row length, too
    small). Every storage's estimate is computed on the device, one read-back for all of them."""
    out: list[tuple[float, float] | None] = [None] * len(items)
    stats: list[torch.Tensor] = []
    idx: list[tuple[int, int, int]] = []
    for i, (raw, base, op, dtype, cols) in enumerate(items):
        w = dtype.itemsize
        n = raw.numel() // w
        if not cols or w not in _ITYPE or n < choice.RC_MIN_ELEMS or n % cols or cols < 2 or n // cols < 2:
            continue
        rows = n // cols
        pick = torch.tensor(choice.rowcol_sample_rows(rows, cols), dtype=torch.int64, device=raw.device)
        r = raw.view(rows, cols * w).index_select(0, pick).reshape(-1).to(dev)
        b = None
        if base is not None and op is not None:
            b = base.view(rows, cols * w).index_select(0, pick.to(base.device)).reshape(-1).to(dev)
        words = residual_words(r, b, op, dtype)
        planes = plane_bytes(words, w)
        p0 = planes[0]
        row, col = rowcol.offsets_torch(p0, cols)
        q = p0 - rowcol.tile_torch(row, col, 0, p0.numel())
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        plain = sum((bits_order0(p) for p in planes), zero)
        stats.append(torch.stack([plain, plain - bits_order0(p0) + bits_order0(q)]))
        idx.append((i, n, words.numel()))
    if stats:
        for (i, n, m), (plain_bits, rc_bits) in zip(idx, torch.stack(stats).cpu().tolist()):
            cols = items[i][4]
            assert cols
            scale = n / m / 8.0  # sample bits -> storage bytes
            out[i] = (plain_bits * scale, rc_bits * scale + n // cols + cols)  # with the offsets' bytes
    return out


def encode_rowcol_device(
    raw: torch.Tensor,
    base: torch.Tensor | None,
    op: str | None,
    dtype: torch.dtype,
    seg: int,
    cols: int,
    algorithm: str,
    codec_id: str,
    opts: dict[str, Any],
    dev: torch.device,
) -> tuple[dict[str, Any], list[str], list[memoryview], torch.Tensor]:
    """Code the storage bytes ``raw`` (on ``dev``) with :data:`RC_TRANSFORM`, rows of ``cols``
    elements, in segments of ``seg`` elements: returns the entry's ``rowcol`` value, then per chunk
    in manifest order its codec id and its bytes (views into the returned pinned host buffer, which
    must outlive them). A chunk is coded (``algorithm`` with ``opts``, written as ``codec_id``)
    only where that is smaller."""
    w = dtype.itemsize
    n = raw.numel() // w
    words = residual_words(raw, None if base is None else base.to(dev), op, dtype)
    row, col = rowcol.offsets_torch(rowcol.plane0_torch(words, w, True), cols)
    parts: list[torch.Tensor] = []
    for s0, s1 in segments(n, seg):
        planes = plane_bytes(words[s0:s1], w)
        planes[0] = planes[0] - rowcol.tile_torch(row, col, s0, s1)  # uint8: modulo 256
        parts.extend(planes)
    ids, views, host = code_parts_device(parts, algorithm, codec_id, opts, dev)
    return rowcol.key(cols, row, col), ids, views, host


def decode_rowcol_device(
    reader: ContainerReader,
    entry: dict[str, Any],
    dev: torch.device,
    base: torch.Tensor | None,
    inflate: bool = True,
) -> torch.Tensor:
    """Decode one (validated) ``rc-`` storage entry to a 1-D uint8 tensor on ``dev``, verifying every
    checksum (module docstring). ``base``: its delta base on ``dev`` (None for a plain entry);
    ``inflate``: deflate chunks are decoded by nvCOMP (else on the host). Raises
    ChecksumMismatchError or DecodeError naming the tensor."""
    name = reader.name
    w = entry["_width"]
    nbytes = entry["nbytes"]
    n = nbytes // w
    dtype = dtype_from_name(entry["dtype"])
    rot = plane_rot(entry["transform"])
    where = f"{name}: tensor {entry['path']!r}"
    _cols, row_b, col_b = rowcol_offsets(entry, n, where)
    layout = chunk_layout(entry)
    lens = np.asarray([s1 - s0 for s0, s1, _j in layout], dtype=np.int64)
    out = torch.empty(nbytes, dtype=torch.uint8, device=dev)  # on the caller's stream: it outlives ours
    with _nvcomp.on_stream(dev):
        row = torch.frombuffer(bytearray(row_b), dtype=torch.uint8).to(dev)
        col = torch.frombuffer(bytearray(col_b), dtype=torch.uint8).to(dev)
        dec, dst_off = fetch_chunks_device(reader, entry, lens, dev, inflate, where)
        for k, (s0, s1) in enumerate(segments(n, entry["segment_elems"])):
            m = s1 - s0
            planes = torch.stack([dec[int(dst_off[k * w + j]) : int(dst_off[k * w + j]) + m] for j in range(w)])
            planes[0] += rowcol.tile_torch(row, col, s0, s1)
            out[s0 * w : s1 * w].copy_(merge_planes(planes, dtype, None, rot=rot))
        if base is not None:
            op = (entry.get("delta") or {}).get("op", "xor")
            if op not in delta.ops_for(dtype, RC_TRANSFORMS[entry["transform"]]):
                raise DecodeError(f"{where}: delta op {op!r} does not apply")
            out.copy_(delta.inverse(op, out, base, dtype))
        _nvcomp.synchronize(dev)
    algo = entry["checksum"].split(":", 1)[0]
    if ck.compute_checksum(algo, out) != entry["checksum"]:
        raise ChecksumMismatchError(
            f"{where} decoded to bytes that do not match its recorded checksum {entry['checksum']}"
            + (" (is the delta base the right one?)" if base is not None else "")
        )
    return out

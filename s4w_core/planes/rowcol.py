"""The row/column exponent model of the ``rc-planes-rotl1`` and ``rc-planes`` transforms
(docs/FORMAT.md 4.5d).

A storage viewed as ``R x C`` elements (``C`` its row length, ``R = n / C``) keeps its byte planes,
except that plane 0 of element ``i`` (the exponent byte of bf16/fp32, of the delta residual where
there is one) is stored as ``(p0[i] - row[i // C] - col[i % C]) mod 256``. Squared gradients
(Adam's ``exp_avg_sq``) are close to a product of a row scale and a column scale, so their
exponents are close to a sum of a row and a column offset: the stored plane 0 then holds small
numbers around 0, which an order-0 coder codes in fewer bits (docs/RATIO.md). The reader adds the
offsets back before it merges the planes: one add per element, with no dependence between elements.

The offsets a writer picks do not matter to a reader (any bytes decode exactly): s4weights takes
the rounded mean of each row's ``p0``, then the rounded mean of each column's ``p0 - row``, both in
integer arithmetic (:func:`offsets_np`, :func:`offsets_torch` give the same bytes).

numpy (the CPU writer and reader, the oracle) and torch (any device: the GPU writer and reader)
implementations of the same functions; tests check they agree.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from s4w_core.planes import _jit

__all__ = [
    "key",
    "offsets_of_words",
    "probe_hists",
    "offsets_np",
    "offsets_torch",
    "SUM_BLOCK_ELEMS",
    "plane0_np",
    "plane0_torch",
    "tile_np",
    "tile_torch",
]


def plane0_np(words: np.ndarray, w: int, rot: bool) -> np.ndarray:
    """Plane 0 (uint8) of the unsigned ``w``-byte ``words`` under ``planes-rotl1`` (``rot``) or
    ``planes``: the top byte of the word rotated left by one bit, or of the word itself."""
    bits = 8 * w
    shift = bits - 9 if rot else bits - 8
    out = np.empty(words.size, dtype=np.uint8)
    np.right_shift(words, shift, out=out, casting="unsafe")  # keeps the low byte
    return out


def offsets_of_words(words: np.ndarray, w: int, rot: bool, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`offsets_np` of plane 0 of the unsigned ``w``-byte ``words`` (whole rows of ``cols``):
    one compiled pass where numba is loaded (:func:`s4w_core.planes._jit.rowcol_offsets`, plane 0
    never made), else numpy (:func:`plane0_np`, then :func:`offsets_np`): the same bytes."""
    words = np.ascontiguousarray(words)
    got = _jit.rowcol_offsets(words, 8 * w - (9 if rot else 8), cols)
    if got is not None:
        return got
    return offsets_np(plane0_np(words, w, rot), cols)


def probe_hists(words: np.ndarray, w: int, rot: bool, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The histograms (256 counts each) of plane 0 of the unsigned ``w``-byte ``words`` (whole rows
    of ``cols``) and of plane 0 less its row/column offsets (:func:`offsets_np`): what the writers'
    row/column probe estimates. One compiled pass where numba is loaded
    (:func:`s4w_core.planes._jit.rowcol_hists`), else numpy (:func:`plane0_np`, :func:`offsets_np`,
    :func:`tile_np`): the same counts."""
    words = np.ascontiguousarray(words)
    got = _jit.rowcol_hists(words, 8 * w - (9 if rot else 8), cols)
    if got is not None:
        return got
    p0 = plane0_np(words, w, rot)
    row, col = offsets_np(p0, cols)
    q = p0 - tile_np(row, col, 0, p0.size)
    return np.bincount(p0, minlength=256), np.bincount(q, minlength=256)


def plane0_torch(words: torch.Tensor, w: int, rot: bool) -> torch.Tensor:
    """:func:`plane0_np` for signed ``int16``/``int32`` words on any device (arithmetic shifts:
    the byte kept is the same)."""
    bits = 8 * w
    shift = bits - 9 if rot else bits - 8
    return ((words >> shift) & 0xFF).to(torch.uint8)


def offsets_np(p0: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The row and column offsets (uint8, ``R`` and ``cols`` of them) s4weights writes for plane 0
    ``p0`` (uint8, ``R * cols`` elements): ``row[r]`` the mean of row ``r`` rounded half up, then
    ``col[c]`` the mean of ``p0[:, c] - row`` rounded half up, modulo 256."""
    rows = p0.size // cols
    m = p0.reshape(rows, cols)
    # sums of bytes in uint32 where they fit (about 2x faster than int64), exact either way
    acc = np.uint32 if max(rows, cols) < (1 << 24) else np.int64
    row = (m.sum(axis=1, dtype=acc).astype(np.int64) + cols // 2) // cols
    col = (m.sum(axis=0, dtype=acc).astype(np.int64) - int(row.sum()) + rows // 2) // rows
    return row.astype(np.uint8), (col & 0xFF).astype(np.uint8)


#: elements of plane 0 summed at a time by :func:`offsets_torch` (its int64 copy of them is the
#: temporary: 8 MiB, where a whole plane at once took 8 bytes an element: 96 MB at a background save's peak)
SUM_BLOCK_ELEMS = 1 << 20


def offsets_torch(p0: torch.Tensor, cols: int, block_elems: int = SUM_BLOCK_ELEMS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`offsets_np` on any device (the same bytes): row and column sums over plane 0, a block
    of whole rows (about ``block_elems`` elements) at a time."""
    rows = p0.numel() // cols
    m = p0.view(rows, cols)
    step = max(1, block_elems // max(cols, 1))
    rsum = torch.empty(rows, dtype=torch.int64, device=p0.device)
    csum = torch.zeros(cols, dtype=torch.int64, device=p0.device)
    for r0 in range(0, rows, step):
        blk = m[r0 : r0 + step].to(torch.int64)
        rsum[r0 : r0 + step] = blk.sum(dim=1)
        csum += blk.sum(dim=0)
    row = torch.div(rsum + cols // 2, cols, rounding_mode="floor")
    col = torch.div(csum - row.sum() + rows // 2, rows, rounding_mode="floor")
    return row.to(torch.uint8), (col & 0xFF).to(torch.uint8)


def tile_np(row: np.ndarray, col: np.ndarray, s0: int, s1: int) -> np.ndarray:
    """``(row[i // C] + col[i % C]) mod 256`` for the elements ``i`` in ``[s0, s1)`` (uint8),
    ``C = col.size``: what plane 0 of those elements is stored less."""
    c = col.size
    m = s1 - s0
    if c > m:  # rows longer than the range: index each element
        idx = np.arange(s0, s1, dtype=np.int64)
        return row[idx // c] + col[idx % c]
    r0, r1 = s0 // c, -(-s1 // c)
    t = (row[r0:r1, None] + col[None, :]).reshape(-1)  # uint8: wraps modulo 256
    return t[s0 - r0 * c : s1 - r0 * c]


def tile_torch(row: torch.Tensor, col: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    """:func:`tile_np` on any device (the same bytes)."""
    c = col.numel()
    m = s1 - s0
    if c > m:
        idx = torch.arange(s0, s1, dtype=torch.int64, device=col.device)
        return row[idx // c] + col[idx % c]
    r0, r1 = s0 // c, -(-s1 // c)
    t = (row[r0:r1, None] + col[None, :]).reshape(-1)
    return t[s0 - r0 * c : s1 - r0 * c]


def key(cols: int, row: Any, col: Any) -> dict[str, Any]:
    """The storage entry's ``rowcol`` value: ``cols`` and the offsets (uint8 arrays or tensors) as
    base64 text."""
    def b64(a: Any) -> str:
        arr = a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
        return base64.b64encode(arr.astype(np.uint8).tobytes()).decode("ascii")

    return {"cols": int(cols), "row": b64(row), "col": b64(col)}

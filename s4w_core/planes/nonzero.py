"""The nonzero-element transforms ``nz-planes-rotl1`` and ``nz-planes`` (docs/FORMAT.md 4.5c).

A segment's elements (after any delta: its residual elements) are split into a *bitmap* with one
bit per element (set where the element's bit pattern is not all zeros; bit ``i`` of the segment is
bit ``i % 8`` of byte ``i // 8``, least significant first; padding bits zero) and the nonzero
elements in order, which go through the byte-plane transform named after the prefix
(``planes-rotl1`` or ``planes``) as a segment of ``nnz`` elements would. Zero elements then cost
nothing in the planes, and the bitmap of a run of zeros (untouched embedding rows of Adam moments,
unchanged elements of a delta) codes to almost nothing, with order-0 coders as well (the GPU's
ANS) as with zstd.

Everything here is element-wise, a popcount and a prefix sum: a GPU implementation (compaction by
an exclusive scan of the mask, scatter on decode) gives the same bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from s4w_core import delta
from s4w_core.errors import DecodeError
from s4w_core.planes.reference import merge_into

__all__ = [
    "split_nonzero_torch",
    "merge_nonzero_torch",
    "WORD",
    "residual_words",
    "split_nonzero",
    "merge_nonzero",
    "bitmap_bytes",
]

#: the unsigned numpy word of each plane width
WORD: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32}


def bitmap_bytes(m: int) -> int:
    """Bytes of the bitmap of a segment of ``m`` elements."""
    return (m + 7) // 8


def residual_words(raw_u8: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None, op: str | None) -> np.ndarray:
    """The elements to code, as unsigned words (a numpy view or copy of CPU bytes): the raw
    elements, or with a base their residual under ``op`` (:func:`s4w_core.delta.forward`)."""
    w = dtype.itemsize
    u = WORD[w]
    raw = raw_u8.numpy()
    if base_u8 is None or op is None:
        return raw.view(u)
    if op == "xor":
        return raw.view(u) ^ base_u8.numpy().view(u)
    return delta.forward(op, raw_u8, base_u8, dtype).numpy().view(u)


def split_nonzero(words: np.ndarray, w: int, *, rot: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(bitmap, planes)`` of one segment of ``words``: the packed nonzero mask (uint8,
    :func:`bitmap_bytes` long) and the ``(w, nnz)`` uint8 byte planes of the nonzero words
    (``rot``: rotated left by one bit first, as ``planes-rotl1``; else as ``planes``)."""
    mask = words != 0
    bitmap = np.packbits(mask, bitorder="little")
    nz = words[mask]
    if rot:
        bits = 8 * w
        u = WORD[w]
        nz = (nz << u(1)) | (nz >> u(bits - 1))
    planes = np.empty((w, nz.size), dtype=np.uint8)
    for j in range(w):
        np.right_shift(nz, 8 * (w - 1 - j), out=planes[j], casting="unsafe")
    return bitmap, planes


_ITYPE = {2: torch.int16, 4: torch.int32}
_BIT: dict[torch.device, torch.Tensor] = {}  # device -> the weights 1, 2, 4, ..., 128 of a bitmap byte's bits


def _bit_weights(device: torch.device) -> torch.Tensor:
    """The weights 1, 2, 4, ..., 128 of a bitmap byte's bits (uint8, on ``device``; cached)."""
    t = _BIT.get(device)
    if t is None:
        t = _BIT[device] = (1 << torch.arange(8, device=device, dtype=torch.int32)).to(torch.uint8)
    return t


def split_nonzero_torch(words: torch.Tensor, w: int, *, rot: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_nonzero` with torch's element-wise kernels, on any device (the GPU writer's
    path: compaction by the mask, bits packed by a weighted sum; bytes identical to the numpy
    reference). ``words``: 1-D int16 (w=2) or int32 (w=4) tensor of the elements' bit patterns."""
    m = words.numel()
    mask = words != 0
    pad = (-m) % 8
    mb = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    bitmap = (mb * _bit_weights(words.device)).sum(1, dtype=torch.int32).to(torch.uint8)
    nz = words[mask]
    bits = 8 * w
    r = (nz << 1) | ((nz >> (bits - 1)) & 1) if rot else nz
    planes = torch.empty((w, nz.numel()), dtype=torch.uint8, device=words.device)
    for j in range(w):
        planes[j].copy_((r >> (8 * (w - 1 - j))) & 0xFF)
    return bitmap, planes


def merge_nonzero_torch(bitmap: torch.Tensor, planes: torch.Tensor, m: int, w: int, *, rot: bool) -> torch.Tensor:
    """Inverse of :func:`split_nonzero_torch` on any device: the ``m`` words (int16/int32) of a
    segment from its bitmap and ``(w, nnz)`` planes. The caller checks the bitmap's count and
    padding (:func:`merge_nonzero` does, on the CPU)."""
    it = _ITYPE[w]
    mask = ((bitmap.view(-1, 1) & _bit_weights(bitmap.device)) != 0).view(-1)[:m]
    r = planes[0].to(it) << (8 * (w - 1))
    for j in range(1, w):
        r |= planes[j].to(it) << (8 * (w - 1 - j))
    bits = 8 * w
    x = ((r >> 1) & ((1 << (bits - 1)) - 1)) | (r << (bits - 1)) if rot else r
    out = torch.zeros(m, dtype=it, device=bitmap.device)
    out[mask] = x
    return out


def merge_nonzero(
    bitmap: np.ndarray, parts: list[np.ndarray], m: int, w: int, out: np.ndarray, *, rot: bool, where: str = "segment"
) -> None:
    """Inverse of :func:`split_nonzero` into ``out`` (uint8, ``m * w`` bytes): the words of the
    planes ``parts`` (``nnz`` bytes each) where the bitmap's bits are set, zeros elsewhere.
    Raises DecodeError if the bitmap's length, set-bit count (against the planes) or padding bits
    are wrong."""
    if bitmap.size != bitmap_bytes(m):
        raise DecodeError(f"{where}: bitmap of {bitmap.size} bytes, expected {bitmap_bytes(m)}")
    if m % 8 and bitmap[-1] >> (m % 8):
        raise DecodeError(f"{where}: bitmap padding bits are not zero")
    mask = np.unpackbits(bitmap, count=m, bitorder="little").view(bool)
    nnz = parts[0].size if parts else 0
    if int(np.count_nonzero(mask)) != nnz:
        raise DecodeError(f"{where}: bitmap marks {int(np.count_nonzero(mask))} nonzero elements, planes hold {nnz}")
    nzb = np.empty(nnz * w, dtype=np.uint8)
    merge_into(parts, w, nzb, None, rot=rot)
    u = WORD[w]
    nzw = nzb.view(u)
    if nnz and not nzw.all():
        raise DecodeError(f"{where}: a nonzero element decodes to zero")
    words = out.view(u)
    words[:] = 0
    words[mask] = nzw

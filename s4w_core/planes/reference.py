"""Reference (torch, any device, CPU is the oracle) implementation of the ``planes-rotl1`` transform."""

from __future__ import annotations

import torch

__all__ = ["PLANE_DTYPES", "plane_width", "split_planes", "merge_planes"]

#: dtypes the plane transform applies to, with the signed integer dtype of the same width used
#: to read their bit patterns.
PLANE_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
}

_SIGN_MASK = {2: 0x7FFF, 4: 0x7FFFFFFF}


def plane_width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def split_planes(
    raw_u8: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None = None
) -> torch.Tensor:
    """Split the raw bytes of ``n`` elements of ``dtype`` into a ``(w, n)`` uint8 tensor of planes.

    Args:
        raw_u8: 1-D contiguous uint8 tensor, ``n * w`` bytes (little-endian element bytes).
        dtype: one of :data:`PLANE_DTYPES`.
        base_u8: optional tensor like ``raw_u8``; if given, the planes are of ``raw XOR base``.
    Returns:
        ``(w, n)`` uint8 tensor on the same device; row ``j`` is plane ``j``.
    """
    w = plane_width(dtype)
    itype = PLANE_DTYPES[dtype]
    x = raw_u8.view(itype)
    if base_u8 is not None:
        x = x ^ base_u8.view(itype)
    bits = 8 * w
    r = (x << 1) | ((x >> (bits - 1)) & 1)
    # little-endian bytes of r: column k is byte k; plane j is byte w-1-j
    return r.view(torch.uint8).view(-1, w).flip(1).t().contiguous()


def merge_planes(
    planes: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`split_planes`: ``(w, n)`` uint8 planes to ``n * w`` raw bytes (1-D uint8)."""
    w = plane_width(dtype)
    itype = PLANE_DTYPES[dtype]
    r = planes.t().flip(1).contiguous().view(-1).view(itype)
    bits = 8 * w
    x = ((r >> 1) & _SIGN_MASK[w]) | (r << (bits - 1))
    if base_u8 is not None:
        x = x ^ base_u8.view(itype)
    return x.view(torch.uint8)

"""Reference (torch, any device, CPU is the oracle) implementation of the byte-plane transforms:
``planes-rotl1`` (``rot=True``, the default) and ``planes`` (``rot=False``: no rotation)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from s4w_core.planes import _jit

__all__ = ["PLANE_DTYPES", "plane_width", "split_planes", "merge_planes", "merge_into", "merge_hash_into", "HASH_BLOCK"]

#: dtypes the plane transform applies to, with the signed integer dtype of the same width used
#: to read their bit patterns.
PLANE_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
}

_SIGN_MASK = {2: 0x7FFF, 4: 0x7FFFFFFF}


def plane_width(dtype: torch.dtype) -> int:
    return dtype.itemsize


_UINT: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32}


def _split_np(raw: np.ndarray, w: int, base: np.ndarray | None, *, rot: bool = True) -> np.ndarray:
    """:func:`split_planes` on the CPU with numpy's unsigned arithmetic (logical shifts, wrap-around;
    about 3x faster than torch's signed int16 kernels on one core), or with numba in one compiled
    pass (:mod:`s4w_core.planes._jit`) where it is installed (``rot=True`` only: without the
    rotation numpy needs no temporaries beyond the XOR)."""
    u = _UINT[w]
    out = np.empty((w, raw.size // w), dtype=np.uint8)
    if rot and _jit.split_into(raw, w, base, out):
        return out
    v = raw.view(u)
    if base is not None:
        v = v ^ base.view(u)
    bits = 8 * w
    r = (v << u(1)) | (v >> u(bits - 1)) if rot else v
    for j in range(w):
        np.right_shift(r, np.asarray(8 * (w - 1 - j), dtype=u), out=out[j], casting="unsafe")  # keeps the low byte
    return out


def merge_into(
    parts: Sequence[np.ndarray], w: int, out: np.ndarray, base: np.ndarray | None = None, *, rot: bool = True
) -> None:
    """Inverse of :func:`_split_np` into ``out`` (uint8, ``n * w`` bytes): ``parts[j]`` is plane
    ``j`` (``n`` bytes each, any buffers). Each plane is copied once into its byte column of ``out``,
    then the rotation (``rot=True``, ``planes-rotl1``; none for ``planes``) and the XOR with
    ``base`` are undone in place: about 1.5x (bf16) and 2x (fp32) faster than shifting each plane
    into a word array on one core. With numba and ``rot=True``, one compiled pass
    (:mod:`s4w_core.planes._jit`)."""
    if rot and _jit.merge_into(parts, w, out, base):
        return
    u = _UINT[w]
    n = out.size // w
    cols = out.reshape(n, w)
    for j in range(w):
        cols[:, w - 1 - j] = parts[j]  # little-endian: plane 0 (the top byte) is byte w-1
    r = out.view(u)
    if rot:
        low = r >> u(1)
        r <<= u(8 * w - 1)
        r |= low
    if base is not None:
        r ^= base.view(u)


#: bytes of output merged per step of :func:`merge_hash_into` (then hashed while still in L2)
HASH_BLOCK = 256 << 10


def merge_hash_into(
    parts: Sequence[np.ndarray],
    w: int,
    out: np.ndarray,
    base: np.ndarray | None,
    update: Callable[[np.ndarray], Any],
    block: int = HASH_BLOCK,
    *,
    rot: bool = True,
) -> None:
    """:func:`merge_into` fused with a streaming checksum: ``out`` is merged ``block`` bytes at a
    time (whole elements) and each block is passed to ``update`` right after it is merged, while it
    is still in the cache, instead of a second pass over the whole output from memory. Every byte
    of ``out`` goes to ``update`` exactly once, in order (a streaming xxh3 then gives the one-shot
    digest of ``out``). ``rot``: as for :func:`merge_into`."""
    n = out.size // w
    if n * w != out.size:
        raise ValueError(f"merge_hash_into: out {out.size} bytes is not a whole number of {w}-byte elements")
    merge = _jit.merge_range(parts, w, out, base) if rot else None
    if merge is None:  # numpy: merge_into on each block's slices

        def merge(a: int, z: int) -> None:
            merge_into(
                [p[a:z] for p in parts], w, out[a * w : z * w], None if base is None else base[a * w : z * w], rot=rot
            )

    step = max(1, block // w)
    for a in range(0, n, step):
        z = min(n, a + step)
        merge(a, z)
        update(out[a * w : z * w])


def _merge_np(planes: np.ndarray, w: int, base: np.ndarray | None, *, rot: bool = True) -> np.ndarray:
    out = np.empty(planes.shape[1] * w, dtype=np.uint8)
    merge_into([planes[j] for j in range(w)], w, out, base, rot=rot)
    return out


def split_planes(
    raw_u8: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None = None, *, rot: bool = True
) -> torch.Tensor:
    """Split the raw bytes of ``n`` elements of ``dtype`` into a ``(w, n)`` uint8 tensor of planes.

    Args:
        raw_u8: 1-D contiguous uint8 tensor, ``n * w`` bytes (little-endian element bytes).
        dtype: one of :data:`PLANE_DTYPES`.
        base_u8: optional tensor like ``raw_u8``; if given, the planes are of ``raw XOR base``.
        rot: rotate each element left by one bit first (``planes-rotl1``, the default); False
            gives the ``planes`` transform (plane ``j`` is big-endian byte ``j`` of the element).
    Returns:
        ``(w, n)`` uint8 tensor on the same device; row ``j`` is plane ``j``.
    """
    w = plane_width(dtype)
    if raw_u8.device.type == "cpu" and (base_u8 is None or base_u8.device.type == "cpu"):
        return torch.from_numpy(_split_np(raw_u8.numpy(), w, None if base_u8 is None else base_u8.numpy(), rot=rot))
    return _split_torch(raw_u8, dtype, base_u8, rot=rot)


def _split_torch(
    raw_u8: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None, *, rot: bool = True
) -> torch.Tensor:
    """:func:`split_planes` with torch's element-wise kernels (any device; off the CPU)."""
    w = plane_width(dtype)
    itype = PLANE_DTYPES[dtype]
    x = raw_u8.view(itype)
    if base_u8 is not None:
        x = x ^ base_u8.view(itype)
    bits = 8 * w
    r = (x << 1) | ((x >> (bits - 1)) & 1) if rot else x
    # plane j is byte w-1-j of the little-endian r: bits 8(w-1-j) .. 8(w-j)-1 (element-wise
    # shifts and masks: no strided transpose, ~5x faster on a CPU than viewing r as (n, w) bytes)
    out = torch.empty((w, x.numel()), dtype=torch.uint8, device=raw_u8.device)
    for j in range(w):
        out[j].copy_((r >> (8 * (w - 1 - j))) & 0xFF)
    return out


def merge_planes(
    planes: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None = None, *, rot: bool = True
) -> torch.Tensor:
    """Inverse of :func:`split_planes` (with the same ``rot``): ``(w, n)`` uint8 planes to ``n * w``
    raw bytes (1-D uint8)."""
    w = plane_width(dtype)
    if planes.device.type == "cpu" and (base_u8 is None or base_u8.device.type == "cpu"):
        return torch.from_numpy(
            _merge_np(planes.contiguous().numpy(), w, None if base_u8 is None else base_u8.numpy(), rot=rot)
        )
    return _merge_torch(planes, dtype, base_u8, rot=rot)


def _merge_torch(
    planes: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None, *, rot: bool = True
) -> torch.Tensor:
    """:func:`merge_planes` with torch's element-wise kernels (any device; off the CPU)."""
    w = plane_width(dtype)
    itype = PLANE_DTYPES[dtype]
    bits = 8 * w
    r = planes[0].to(itype) << (8 * (w - 1))  # wraps into the sign bit, like the transform's bits
    for j in range(1, w):
        r |= planes[j].to(itype) << (8 * (w - 1 - j))
    x = ((r >> 1) & _SIGN_MASK[w]) | (r << (bits - 1)) if rot else r
    if base_u8 is not None:
        x = x ^ base_u8.view(itype)
    return x.view(torch.uint8)

"""Triton kernels for the ``planes-rotl1`` transform, bit-identical to :mod:`.reference`.

Imported only by the GPU backend (:mod:`s4w_core.gpu`) and the parity tests; ``import s4w_core``
never imports this module (it needs ``triton``).  With ``TRITON_INTERPRET=1`` set before triton is
imported, the same kernels run on CPU tensors through Triton's interpreter: that is how CI, which
has no GPU, checks them against the reference.

Layout.  ``split_planes_into`` writes the ``w`` planes of ``n`` elements into one flat uint8 buffer
at ``out[j * plane_stride + i]`` (``plane_stride >= n``; the GPU writer rounds it up so that every
chunk starts 256-byte aligned, which nvCOMP and 16-byte vector stores want).  ``merge_planes_from``
reads the same layout.  The plane functions :func:`split_planes` / :func:`merge_planes` mirror the
reference signatures (``(w, n)`` tensors) for tests.

Arithmetic.  bf16/fp16 elements are widened to int32 and masked to 16 bits before rotating, so
neither sign extension nor 16-bit shift semantics can differ between the GPU and the interpreter;
fp32 elements are rotated as uint32 (logical shifts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from s4w_core.planes.reference import PLANE_DTYPES, plane_width

__all__ = [
    "split_planes_into",
    "merge_planes_from",
    "split_planes",
    "merge_planes",
    "split_planes_batched",
    "merge_planes_batched",
    "BLOCK",
]

#: elements per program. 4096 x 2 B = 8 KiB in, 8 KiB out per program: enough bytes in flight per SM.
BLOCK = 4096
_NUM_WARPS = 4


@triton.jit
def _split_kernel(
    x_ptr,
    b_ptr,
    out_ptr,
    n,
    plane_stride,
    W: tl.constexpr,
    HAS_BASE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    if HAS_BASE:
        x = x ^ tl.load(b_ptr + offs, mask=mask, other=0)
    if W == 2:
        u = x.to(tl.int32) & 0xFFFF
        r = ((u << 1) | (u >> 15)) & 0xFFFF
        tl.store(out_ptr + offs, (r >> 8).to(tl.uint8), mask=mask)
        tl.store(out_ptr + plane_stride + offs, (r & 0xFF).to(tl.uint8), mask=mask)
    else:
        u = x.to(tl.uint32, bitcast=True)
        r = (u << 1) | (u >> 31)
        tl.store(out_ptr + offs, ((r >> 24) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(out_ptr + plane_stride + offs, ((r >> 16) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(out_ptr + 2 * plane_stride + offs, ((r >> 8) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(out_ptr + 3 * plane_stride + offs, (r & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _merge_kernel(
    p_ptr,
    b_ptr,
    out_ptr,
    n,
    plane_stride,
    W: tl.constexpr,
    HAS_BASE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if W == 2:
        p0 = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFF
        p1 = tl.load(p_ptr + plane_stride + offs, mask=mask, other=0).to(tl.int32) & 0xFF
        r = (p0 << 8) | p1
        x = (((r >> 1) | (r << 15)) & 0xFFFF).to(tl.int16)
    else:
        p0 = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.uint32) & 0xFF
        p1 = tl.load(p_ptr + plane_stride + offs, mask=mask, other=0).to(tl.uint32) & 0xFF
        p2 = tl.load(p_ptr + 2 * plane_stride + offs, mask=mask, other=0).to(tl.uint32) & 0xFF
        p3 = tl.load(p_ptr + 3 * plane_stride + offs, mask=mask, other=0).to(tl.uint32) & 0xFF
        r = (p0 << 24) | (p1 << 16) | (p2 << 8) | p3
        x = ((r >> 1) | (r << 31)).to(tl.int32, bitcast=True)
    if HAS_BASE:
        x = x ^ tl.load(b_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, x, mask=mask)


def _ints(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError("expected a 1-D contiguous uint8 tensor")
    return t.view(PLANE_DTYPES[dtype])


def split_planes_into(
    raw_u8: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor,
    plane_stride: int,
    base_u8: torch.Tensor | None = None,
) -> None:
    """Write the planes of ``raw_u8`` (``n * w`` bytes of ``dtype``) to ``out[j*plane_stride + i]``.

    ``out`` is a 1-D uint8 tensor (a view into a larger buffer is fine) of at least
    ``(w-1)*plane_stride + n`` bytes on the same device. ``base_u8``: optional XOR base like ``raw_u8``.
    Enqueued on the current stream; no host synchronization.
    """
    w = plane_width(dtype)
    x = _ints(raw_u8, dtype)
    n = x.numel()
    if plane_stride < n or out.numel() < (w - 1) * plane_stride + n:
        raise ValueError("output buffer too small for the planes")
    if n == 0:
        return
    b = _ints(base_u8, dtype) if base_u8 is not None else x
    if base_u8 is not None and b.numel() != n:
        raise ValueError("base has a different size")
    grid = (triton.cdiv(n, BLOCK),)
    _split_kernel[grid](
        x, b, out, n, plane_stride, W=w, HAS_BASE=base_u8 is not None, BLOCK=BLOCK, num_warps=_NUM_WARPS
    )


def merge_planes_from(
    planes: torch.Tensor,
    dtype: torch.dtype,
    out_u8: torch.Tensor,
    plane_stride: int,
    base_u8: torch.Tensor | None = None,
) -> None:
    """Inverse of :func:`split_planes_into`: planes at ``planes[j*plane_stride + i]`` to ``out_u8``
    (1-D contiguous uint8, ``n * w`` bytes), XORed with ``base_u8`` if given."""
    w = plane_width(dtype)
    x = _ints(out_u8, dtype)
    n = x.numel()
    if plane_stride < n or planes.numel() < (w - 1) * plane_stride + n:
        raise ValueError("planes buffer too small")
    if n == 0:
        return
    b = _ints(base_u8, dtype) if base_u8 is not None else x
    if base_u8 is not None and b.numel() != n:
        raise ValueError("base has a different size")
    grid = (triton.cdiv(n, BLOCK),)
    _merge_kernel[grid](
        planes, b, x, n, plane_stride, W=w, HAS_BASE=base_u8 is not None, BLOCK=BLOCK, num_warps=_NUM_WARPS
    )


def split_planes(raw_u8: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`s4w_core.planes.reference.split_planes` (a ``(w, n)`` tensor)."""
    w = plane_width(dtype)
    n = raw_u8.numel() // w
    out = torch.empty(w * n, dtype=torch.uint8, device=raw_u8.device)
    split_planes_into(raw_u8, dtype, out, n, base_u8)
    return out.view(w, n)


def merge_planes(planes: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`s4w_core.planes.reference.merge_planes`."""
    w, n = planes.shape
    out = torch.empty(w * n, dtype=torch.uint8, device=planes.device)
    merge_planes_from(planes.contiguous().view(-1), dtype, out, n, base_u8)
    return out


# ----------------------------------------------------------------------------- batched launches
# One launch over many storages: a table row per item (addresses are passed as int64 and cast to
# pointers in the kernel), a row per program (item, first element). Launch overhead then does not
# grow with the number of tensors in a checkpoint.


@triton.jit
def _split_batched_kernel(
    items_ptr,
    blocks_ptr,
    out_ptr,
    W: tl.constexpr,
    HAS_BASE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    item = tl.load(blocks_ptr + 2 * b)
    start = tl.multiple_of(tl.load(blocks_ptr + 2 * b + 1), BLOCK)  # lets Triton vectorize
    row = items_ptr + 5 * item
    src_addr = tl.load(row)
    base_addr = tl.load(row + 1)
    out_off = tl.load(row + 2)
    n = tl.load(row + 3)
    ps = tl.load(row + 4)
    if ALIGNED:
        out_off = tl.multiple_of(out_off, 16)
        ps = tl.multiple_of(ps, 16)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    o = out_ptr + out_off + offs
    if W == 2:
        xp = src_addr.to(tl.pointer_type(tl.int16))
        if ALIGNED:
            xp = tl.multiple_of(xp, 16)
        x = tl.load(xp + offs, mask=mask, other=0)
        if HAS_BASE:
            bp = base_addr.to(tl.pointer_type(tl.int16))
            if ALIGNED:
                bp = tl.multiple_of(bp, 16)
            x = x ^ tl.load(bp + offs, mask=mask, other=0)
        u = x.to(tl.int32) & 0xFFFF
        r = ((u << 1) | (u >> 15)) & 0xFFFF
        tl.store(o, (r >> 8).to(tl.uint8), mask=mask)
        tl.store(o + ps, (r & 0xFF).to(tl.uint8), mask=mask)
    else:
        xp = src_addr.to(tl.pointer_type(tl.int32))
        if ALIGNED:
            xp = tl.multiple_of(xp, 16)
        x = tl.load(xp + offs, mask=mask, other=0)
        if HAS_BASE:
            bp = base_addr.to(tl.pointer_type(tl.int32))
            if ALIGNED:
                bp = tl.multiple_of(bp, 16)
            x = x ^ tl.load(bp + offs, mask=mask, other=0)
        u = x.to(tl.uint32, bitcast=True)
        r = (u << 1) | (u >> 31)
        tl.store(o, ((r >> 24) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(o + ps, ((r >> 16) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(o + 2 * ps, ((r >> 8) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(o + 3 * ps, (r & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _merge_batched_kernel(
    items_ptr,
    blocks_ptr,
    planes_ptr,
    W: tl.constexpr,
    HAS_BASE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    item = tl.load(blocks_ptr + 2 * b)
    start = tl.multiple_of(tl.load(blocks_ptr + 2 * b + 1), BLOCK)  # lets Triton vectorize
    row = items_ptr + 5 * item
    out_addr = tl.load(row)
    base_addr = tl.load(row + 1)
    p_off = tl.load(row + 2)
    n = tl.load(row + 3)
    ps = tl.load(row + 4)
    if ALIGNED:
        p_off = tl.multiple_of(p_off, 16)
        ps = tl.multiple_of(ps, 16)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    p = planes_ptr + p_off + offs
    if W == 2:
        p0 = tl.load(p, mask=mask, other=0).to(tl.int32) & 0xFF
        p1 = tl.load(p + ps, mask=mask, other=0).to(tl.int32) & 0xFF
        r = (p0 << 8) | p1
        x = (((r >> 1) | (r << 15)) & 0xFFFF).to(tl.int16)
        op = out_addr.to(tl.pointer_type(tl.int16))
        if HAS_BASE:
            bp = base_addr.to(tl.pointer_type(tl.int16))
            if ALIGNED:
                bp = tl.multiple_of(bp, 16)
            x = x ^ tl.load(bp + offs, mask=mask, other=0)
    else:
        p0 = tl.load(p, mask=mask, other=0).to(tl.uint32) & 0xFF
        p1 = tl.load(p + ps, mask=mask, other=0).to(tl.uint32) & 0xFF
        p2 = tl.load(p + 2 * ps, mask=mask, other=0).to(tl.uint32) & 0xFF
        p3 = tl.load(p + 3 * ps, mask=mask, other=0).to(tl.uint32) & 0xFF
        r = (p0 << 24) | (p1 << 16) | (p2 << 8) | p3
        x = ((r >> 1) | (r << 31)).to(tl.int32, bitcast=True)
        op = out_addr.to(tl.pointer_type(tl.int32))
        if HAS_BASE:
            bp = base_addr.to(tl.pointer_type(tl.int32))
            if ALIGNED:
                bp = tl.multiple_of(bp, 16)
            x = x ^ tl.load(bp + offs, mask=mask, other=0)
    if ALIGNED:
        op = tl.multiple_of(op, 16)
    tl.store(op + offs, x, mask=mask)


def _tables(rows: list[tuple[int, int, int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Item table (int64 x 5 per row) and block table ((item, start) per program) on ``device``."""
    import numpy as np

    items = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    nb = (items[:, 3] + BLOCK - 1) // BLOCK
    total = int(nb.sum())
    item_of = np.repeat(np.arange(len(items), dtype=np.int64), nb)
    first = np.repeat(np.cumsum(nb) - nb, nb)
    start = (np.arange(total, dtype=np.int64) - first) * BLOCK
    both = np.concatenate([items.reshape(-1), np.stack([item_of, start], axis=1).reshape(-1)])
    t = torch.from_numpy(both)
    if device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    return t[: items.size], t[items.size :], total


def split_planes_batched(
    pieces: list[tuple[torch.Tensor, torch.Tensor | None, int, int]],
    w: int,
    out: torch.Tensor,
) -> None:
    """Split many inputs of one element width in at most two launches (with and without a base).

    ``pieces``: ``(raw_u8, base_u8 or None, out_offset, plane_stride)``; planes of each go to
    ``out[out_offset + j * plane_stride + i]``. ``w``: 2 (bf16/fp16) or 4 (fp32). Byte-identical to
    :func:`split_planes_into` per piece.
    """
    for has_base in (False, True):
        rows = []
        aligned = True
        for raw, base, off, ps in pieces:
            if (base is not None) != has_base or raw.numel() == 0:
                continue
            n = raw.numel() // w
            if ps < n or off < 0 or off + (w - 1) * ps + n > out.numel() or raw.numel() != n * w:
                raise ValueError("split_planes_batched: a piece does not fit its output")
            if base is not None and base.numel() != raw.numel():
                raise ValueError("base has a different size")
            ba = base.data_ptr() if base is not None else 0
            rows.append((raw.data_ptr(), ba, off, n, ps))
            aligned &= raw.data_ptr() % 16 == 0 and ba % 16 == 0 and off % 16 == 0 and ps % 16 == 0
        if not rows:
            continue
        aligned &= out.data_ptr() % 16 == 0
        items, blocks, total = _tables(rows, out.device)
        _split_batched_kernel[(total,)](
            items, blocks, out, W=w, HAS_BASE=has_base, ALIGNED=aligned, BLOCK=BLOCK, num_warps=_NUM_WARPS
        )


def merge_planes_batched(
    pieces: list[tuple[torch.Tensor, torch.Tensor | None, int, int]],
    w: int,
    planes: torch.Tensor,
) -> None:
    """Inverse of :func:`split_planes_batched`: ``(out_u8, base_u8 or None, planes_offset, plane_stride)``."""
    for has_base in (False, True):
        rows = []
        aligned = True
        for out, base, off, ps in pieces:
            if (base is not None) != has_base or out.numel() == 0:
                continue
            n = out.numel() // w
            if ps < n or off < 0 or off + (w - 1) * ps + n > planes.numel() or out.numel() != n * w:
                raise ValueError("merge_planes_batched: a piece does not fit its planes")
            if base is not None and base.numel() != out.numel():
                raise ValueError("base has a different size")
            ba = base.data_ptr() if base is not None else 0
            rows.append((out.data_ptr(), ba, off, n, ps))
            aligned &= out.data_ptr() % 16 == 0 and ba % 16 == 0 and off % 16 == 0 and ps % 16 == 0
        if not rows:
            continue
        aligned &= planes.data_ptr() % 16 == 0
        items, blocks, total = _tables(rows, planes.device)
        _merge_batched_kernel[(total,)](
            items, blocks, planes, W=w, HAS_BASE=has_base, ALIGNED=aligned, BLOCK=BLOCK, num_warps=_NUM_WARPS
        )

"""Triton kernels for the ``planes-rotl1`` transform, bit-identical to :mod:`.reference`.

Imported only by the GPU backend (:mod:`s4w_core.gpu`) and the parity tests; ``import s4w_core``
never imports this module (it needs ``triton``).  With ``TRITON_INTERPRET=1`` set before triton is
imported, the same kernels run on CPU tensors through Triton's interpreter: that is how CI, which
has no GPU, checks them against the reference.

One kernel per direction does all the work of a batch in one pass over each tensor:

* ``split``: read the raw elements (and the delta base), apply the delta op (``xor`` or ``sub`` of
  :mod:`s4w_core.delta`), rotate, and write the ``w`` byte planes;
* ``merge``: read the planes, un-rotate, undo the delta op against the base, write the elements.

Layout.  The planes of an item of ``n`` elements go to ``out[off + j * plane_stride + i]``
(``plane_stride >= n``; the GPU writer rounds offsets and strides to 256 bytes, so chunks start
aligned for nvCOMP and for 16-byte vector accesses).  A launch covers many items: a small item table
(addresses as int64, cast to pointers in the kernel) goes to the device in one copy, and the
program-to-item map is built on the device, so no host work grows with the number of elements.

Arithmetic.  bf16/fp16 patterns are widened to int32 and masked to 16 bits, fp32 patterns to int64
and masked to 32 bits, so neither sign extension nor narrow-shift semantics can differ between the
GPU and the interpreter.

The table and map arguments are not specialized on alignment (see the note in
:mod:`s4w_core.gpu.kernels`): one compiled variant per set of constexprs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from s4w_core import config
from s4w_core.planes.reference import PLANE_DTYPES, plane_width

__all__ = [
    "split_planes_into",
    "merge_planes_from",
    "split_planes",
    "merge_planes",
    "split_planes_batched",
    "merge_planes_batched",
    "OPS",
    "OP_PLAIN",
    "block_config",
    "launch_rows",
    "upload",
    "item_table",
    "merge_chunks",
    "merge_block",
    "program_map",
    "Tables",
    "launch_items",
    "compile_split_variants",
    "SPLIT",
    "MERGE",
    "MERGE_CHUNKS",
]

#: delta ops the kernels apply (0: none): codes of the ``OP`` constexpr (its low two bits).
OPS = {None: 0, "xor": 1, "sub": 2}
#: added to an :data:`OPS` code: the ``planes`` transform (no rotation; docs/FORMAT.md 4.5b) instead
#: of ``planes-rotl1``. The split also takes the choice per item at run time (``FLAGS``).
OP_PLAIN = 4
_ROW = 6  # item table row: src, base, planes offset, n, plane stride, first program


def block_config(kernel: Any = None) -> tuple[int, int]:
    """(elements per program, warps) of ``kernel``'s launches: ``S4W_PLANES_BLOCK`` /
    ``S4W_PLANES_WARPS`` (benchmarks sweep them) or the defaults measured on an H200
    (benchmarks/results/README.md); the split (:data:`SPLIT`) has its own, ``S4W_SPLIT_BLOCK`` /
    ``S4W_SPLIT_WARPS``, default 2048 / 4 (1.21 against 1.32 ms at 4096 for a 1.82 GB bf16 state on
    an H100, docs/PERFORMANCE.md)."""
    if kernel is _split_kernel:
        return config.get_int("S4W_SPLIT_BLOCK"), config.get_int("S4W_SPLIT_WARPS")
    return config.get_int("S4W_PLANES_BLOCK"), config.get_int("S4W_PLANES_WARPS")


@triton.jit
def _item_of(items_ptr, map_ptr, pid, BLOCK: tl.constexpr):
    item = tl.load(map_ptr + pid)
    row = items_ptr + 6 * item
    start = (pid - tl.load(row + 5)) * BLOCK
    return row, start


@triton.jit
def fwd16(u, v, OP: tl.constexpr, plain):
    """Delta residual of 16-bit patterns ``u`` against ``v`` (int32 holding 0..65535), rotated left by 1
    unless ``OP`` has the :data:`OP_PLAIN` bit or ``plain`` (a run-time scalar) is non-zero."""
    if (OP & 3) == 1:
        u = u ^ v
    elif (OP & 3) == 2:
        ou = tl.where(u >= 0x8000, u ^ 0xFFFF, u ^ 0x8000)
        ov = tl.where(v >= 0x8000, v ^ 0xFFFF, v ^ 0x8000)
        d = (ou - ov) & 0xFFFF
        s = tl.where(d >= 0x8000, d - 0x10000, d)
        u = ((s << 1) ^ (s >> 15)) & 0xFFFF
    r = ((u << 1) | (u >> 15)) & 0xFFFF
    if (OP & 4) != 0:
        r = u
    return tl.where(plain != 0, u, r)


@triton.jit
def _inv16(r, v, OP: tl.constexpr):
    """Inverse of :func:`fwd16` (the transform given by ``OP`` alone)."""
    u = r
    if (OP & 4) == 0:
        u = ((r >> 1) | (r << 15)) & 0xFFFF
    if (OP & 3) == 1:
        u = u ^ v
    elif (OP & 3) == 2:
        s = (u >> 1) ^ -(u & 1)
        ov = tl.where(v >= 0x8000, v ^ 0xFFFF, v ^ 0x8000)
        o = (ov + s) & 0xFFFF
        u = tl.where(o >= 0x8000, o ^ 0x8000, o ^ 0xFFFF)
    return u


@triton.jit
def fwd32(u, v, OP: tl.constexpr, plain):
    """As :func:`fwd16` for 32-bit patterns held in int64 (0 .. 2**32-1)."""
    if (OP & 3) == 1:
        u = u ^ v
    elif (OP & 3) == 2:
        ou = tl.where(u >= 0x80000000, u ^ 0xFFFFFFFF, u ^ 0x80000000)
        ov = tl.where(v >= 0x80000000, v ^ 0xFFFFFFFF, v ^ 0x80000000)
        d = (ou - ov) & 0xFFFFFFFF
        s = tl.where(d >= 0x80000000, d - 0x100000000, d)
        u = ((s << 1) ^ (s >> 31)) & 0xFFFFFFFF
    r = ((u << 1) | (u >> 31)) & 0xFFFFFFFF
    if (OP & 4) != 0:
        r = u
    return tl.where(plain != 0, u, r)


@triton.jit
def _inv32(r, v, OP: tl.constexpr):
    u = r
    if (OP & 4) == 0:
        u = ((r >> 1) | (r << 31)) & 0xFFFFFFFF
    if (OP & 3) == 1:
        u = u ^ v
    elif (OP & 3) == 2:
        s = (u >> 1) ^ -(u & 1)
        ov = tl.where(v >= 0x80000000, v ^ 0xFFFFFFFF, v ^ 0x80000000)
        o = (ov + s) & 0xFFFFFFFF
        u = tl.where(o >= 0x80000000, o ^ 0x80000000, o ^ 0xFFFFFFFF)
    return u


@triton.jit
def _split_elems(src_addr, base_addr, out_ptr, out_off, ps, offs, mask, W: tl.constexpr, OP: tl.constexpr, plain):
    """Element-wise split of the elements at ``offs`` (any alignment)."""
    o = out_ptr + out_off + offs
    if W == 2:
        u = tl.load(src_addr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        v = u
        if (OP & 3) != 0:
            v = tl.load(base_addr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        r = fwd16(u, v, OP, plain)
        tl.store(o, (r >> 8).to(tl.uint8), mask=mask)
        tl.store(o + ps, (r & 0xFF).to(tl.uint8), mask=mask)
    else:
        u = tl.load(src_addr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
        v = u
        if (OP & 3) != 0:
            v = tl.load(base_addr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
        r = fwd32(u, v, OP, plain)
        tl.store(o, ((r >> 24) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(o + ps, ((r >> 16) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(o + 2 * ps, ((r >> 8) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(o + 3 * ps, (r & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _merge_elems(out_addr, base_addr, planes_ptr, p_off, ps, offs, mask, W: tl.constexpr, OP: tl.constexpr):
    """Element-wise merge of the elements at ``offs`` (any alignment)."""
    p = planes_ptr + p_off
    _merge_elems_at(out_addr, base_addr, p, p + ps, p + 2 * ps, p + 3 * ps, offs, mask, W, OP)


@triton.jit
def _lanes(xp, q, m, W: tl.constexpr):
    """The 4 element patterns of quads ``q`` (elements 4q..4q+3) read as 64-bit words: int32
    lanes 0..65535 for W=2, int64 lanes 0..2**32-1 for W=4."""
    if W == 2:
        x = tl.load(xp + q, mask=m, other=0)
        return ((x & 0xFFFF).to(tl.int32), ((x >> 16) & 0xFFFF).to(tl.int32),
                ((x >> 32) & 0xFFFF).to(tl.int32), ((x >> 48) & 0xFFFF).to(tl.int32))
    else:
        xa = tl.load(xp + 2 * q, mask=m, other=0)
        xb = tl.load(xp + 2 * q + 1, mask=m, other=0)
        return xa & 0xFFFFFFFF, (xa >> 32) & 0xFFFFFFFF, xb & 0xFFFFFFFF, (xb >> 32) & 0xFFFFFFFF


@triton.jit
def _byte(r, shift):
    return (r >> shift).to(tl.int64) & 0xFF


@triton.jit
def _pack4(a, b, c, d):
    """Four bytes (int64 0..255) as the bits of an int32 word, ``a`` lowest."""
    return (a | (b << 8) | (c << 16) | (d << 24)).to(tl.int32)


@triton.jit(do_not_specialize_on_alignment=['items_ptr', 'map_ptr', 'flags_ptr'])
def _split_kernel(items_ptr, map_ptr, out_ptr, flags_ptr, W: tl.constexpr, OP: tl.constexpr, FLAGS: tl.constexpr,
                  ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """The split of the items of ``items_ptr`` (rows: see :func:`launch_rows`); with ``FLAGS``, item
    ``i`` takes the ``planes`` transform where ``flags_ptr[i] == 2`` (the encoder's layout probe,
    :func:`s4w_core.gpu.kernels.layout_probe`, wrote it on the device), else ``OP`` says which."""
    row, start = _item_of(items_ptr, map_ptr, tl.program_id(0), BLOCK)
    plain = tl.zeros((), tl.int32)
    if FLAGS:
        plain = (tl.load(flags_ptr + tl.load(map_ptr + tl.program_id(0))) == 2).to(tl.int32)
    src_addr = tl.load(row)
    base_addr = tl.load(row + 1)
    out_off = tl.load(row + 2)
    n = tl.load(row + 3)
    ps = tl.load(row + 4)
    if ALIGNED:
        # every address 16-byte aligned: four elements per lane, 64-bit loads, 32-bit plane stores
        out_off = tl.multiple_of(out_off, 16)
        ps = tl.multiple_of(ps, 16)
        q = start // 4 + tl.arange(0, BLOCK // 4)
        m = q < n // 4
        xp = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int64)), 16)
        u0, u1, u2, u3 = _lanes(xp, q, m, W)
        v0, v1, v2, v3 = u0, u1, u2, u3
        if (OP & 3) != 0:
            bp = tl.multiple_of(base_addr.to(tl.pointer_type(tl.int64)), 16)
            v0, v1, v2, v3 = _lanes(bp, q, m, W)
        o = (out_ptr + out_off).to(tl.pointer_type(tl.int32)) + q
        ps4 = ps // 4
        if W == 2:
            r0, r1 = fwd16(u0, v0, OP, plain), fwd16(u1, v1, OP, plain)
            r2, r3 = fwd16(u2, v2, OP, plain), fwd16(u3, v3, OP, plain)
            tl.store(o, _pack4(_byte(r0, 8), _byte(r1, 8), _byte(r2, 8), _byte(r3, 8)), mask=m)
            tl.store(o + ps4, _pack4(_byte(r0, 0), _byte(r1, 0), _byte(r2, 0), _byte(r3, 0)), mask=m)
        else:
            r0, r1 = fwd32(u0, v0, OP, plain), fwd32(u1, v1, OP, plain)
            r2, r3 = fwd32(u2, v2, OP, plain), fwd32(u3, v3, OP, plain)
            for j in tl.static_range(4):
                sh = 24 - 8 * j
                tl.store(o + j * ps4, _pack4(_byte(r0, sh), _byte(r1, sh), _byte(r2, sh), _byte(r3, sh)), mask=m)
        if start + BLOCK >= n:  # the item's last program: the 0-3 elements after the last whole quad
            e = (n // 4) * 4 + tl.arange(0, 4)
            _split_elems(src_addr, base_addr, out_ptr, out_off, ps, e, e < n, W, OP, plain)
    else:
        offs = start + tl.arange(0, BLOCK)
        _split_elems(src_addr, base_addr, out_ptr, out_off, ps, offs, offs < n, W, OP, plain)


@triton.jit
def _merge_quads(a, b, c, d, out_addr, base_addr, q, m, W: tl.constexpr, OP: tl.constexpr):
    """The merge's vector step: ``a``..``d`` are the planes' int32 words (as int64) holding quads
    ``q`` (``c``/``d`` unused for W=2); rebuild the elements, undo the delta op against the base,
    store them as 64-bit words."""
    op = tl.multiple_of(out_addr.to(tl.pointer_type(tl.int64)), 16)
    if W == 2:
        r0 = ((_byte(a, 0) << 8) | _byte(b, 0)).to(tl.int32)
        r1 = ((_byte(a, 8) << 8) | _byte(b, 8)).to(tl.int32)
        r2 = ((_byte(a, 16) << 8) | _byte(b, 16)).to(tl.int32)
        r3 = ((_byte(a, 24) << 8) | _byte(b, 24)).to(tl.int32)
    else:
        r0 = (_byte(a, 0) << 24) | (_byte(b, 0) << 16) | (_byte(c, 0) << 8) | _byte(d, 0)
        r1 = (_byte(a, 8) << 24) | (_byte(b, 8) << 16) | (_byte(c, 8) << 8) | _byte(d, 8)
        r2 = (_byte(a, 16) << 24) | (_byte(b, 16) << 16) | (_byte(c, 16) << 8) | _byte(d, 16)
        r3 = (_byte(a, 24) << 24) | (_byte(b, 24) << 16) | (_byte(c, 24) << 8) | _byte(d, 24)
    v0, v1, v2, v3 = r0, r1, r2, r3
    if (OP & 3) != 0:
        bp = tl.multiple_of(base_addr.to(tl.pointer_type(tl.int64)), 16)
        v0, v1, v2, v3 = _lanes(bp, q, m, W)
    if W == 2:
        x = (_inv16(r0, v0, OP).to(tl.int64) | (_inv16(r1, v1, OP).to(tl.int64) << 16)
             | (_inv16(r2, v2, OP).to(tl.int64) << 32) | (_inv16(r3, v3, OP).to(tl.int64) << 48))
        tl.store(op + q, x, mask=m)
    else:
        xa = _inv32(r0, v0, OP) | (_inv32(r1, v1, OP) << 32)
        xb = _inv32(r2, v2, OP) | (_inv32(r3, v3, OP) << 32)
        tl.store(op + 2 * q, xa, mask=m)
        tl.store(op + 2 * q + 1, xb, mask=m)


@triton.jit(do_not_specialize_on_alignment=['items_ptr', 'map_ptr'])
def _merge_kernel(items_ptr, map_ptr, planes_ptr, W: tl.constexpr, OP: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    row, start = _item_of(items_ptr, map_ptr, tl.program_id(0), BLOCK)
    out_addr = tl.load(row)
    base_addr = tl.load(row + 1)
    p_off = tl.load(row + 2)
    n = tl.load(row + 3)
    ps = tl.load(row + 4)
    if ALIGNED:
        p_off = tl.multiple_of(p_off, 16)
        ps = tl.multiple_of(ps, 16)
        q = start // 4 + tl.arange(0, BLOCK // 4)
        m = q < n // 4
        p = (planes_ptr + p_off).to(tl.pointer_type(tl.int32)) + q
        ps4 = ps // 4
        a = tl.load(p, mask=m, other=0).to(tl.int64)
        b = tl.load(p + ps4, mask=m, other=0).to(tl.int64)
        c = a
        d = a
        if W == 4:
            c = tl.load(p + 2 * ps4, mask=m, other=0).to(tl.int64)
            d = tl.load(p + 3 * ps4, mask=m, other=0).to(tl.int64)
        _merge_quads(a, b, c, d, out_addr, base_addr, q, m, W, OP)
        if start + BLOCK >= n:
            e = (n // 4) * 4 + tl.arange(0, 4)
            _merge_elems(out_addr, base_addr, planes_ptr, p_off, ps, e, e < n, W, OP)
    else:
        offs = start + tl.arange(0, BLOCK)
        _merge_elems(out_addr, base_addr, planes_ptr, p_off, ps, offs, offs < n, W, OP)


@triton.jit
def _merge_elems_at(out_addr, base_addr, q0, q1, q2, q3, offs, mask, W: tl.constexpr, OP: tl.constexpr):
    """Element-wise merge of the elements at ``offs`` (any alignment): plane ``j``'s byte of element
    ``i`` is at ``qj + i`` (uint8 pointers; ``q2``/``q3`` unused for W=2)."""
    if W == 2:
        p0 = tl.load(q0 + offs, mask=mask, other=0).to(tl.int32) & 0xFF
        p1 = tl.load(q1 + offs, mask=mask, other=0).to(tl.int32) & 0xFF
        v = p0
        if (OP & 3) != 0:
            v = tl.load(base_addr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        x = _inv16((p0 << 8) | p1, v, OP)
        tl.store(out_addr.to(tl.pointer_type(tl.int16)) + offs, x.to(tl.int16), mask=mask)
    else:
        p0 = tl.load(q0 + offs, mask=mask, other=0).to(tl.int64) & 0xFF
        p1 = tl.load(q1 + offs, mask=mask, other=0).to(tl.int64) & 0xFF
        p2 = tl.load(q2 + offs, mask=mask, other=0).to(tl.int64) & 0xFF
        p3 = tl.load(q3 + offs, mask=mask, other=0).to(tl.int64) & 0xFF
        v = p0
        if (OP & 3) != 0:
            v = tl.load(base_addr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
        x = _inv32((p0 << 24) | (p1 << 16) | (p2 << 8) | p3, v, OP)
        tl.store(out_addr.to(tl.pointer_type(tl.int32)) + offs, x.to(tl.int32), mask=mask)


@triton.jit(do_not_specialize_on_alignment=['items_ptr', 'map_ptr', 'chunks_ptr'])
def _merge_chunks_kernel(items_ptr, map_ptr, chunks_ptr, W: tl.constexpr, OP: tl.constexpr, ALIGNED: tl.constexpr,
                         BLOCK: tl.constexpr):
    """:func:`_merge_kernel` reading every chunk where it lies: item row = (out, base, index of the
    item's first chunk in ``chunks_ptr``, n, segment elements, first program); the chunk of plane
    ``j`` of segment ``s`` starts at address ``chunks_ptr[first + s * W + j]``. ``BLOCK`` divides
    the segment length, so a program reads one segment of each plane."""
    row, start = _item_of(items_ptr, map_ptr, tl.program_id(0), BLOCK)
    out_addr = tl.load(row)
    base_addr = tl.load(row + 1)
    c0 = tl.load(row + 2)
    n = tl.load(row + 3)
    seg = tl.load(row + 4)
    s = start // seg
    cp = chunks_ptr + c0 + s * W
    # plane j's byte of element i (of this segment) is at a_j + i
    a0 = tl.load(cp) - s * seg
    a1 = tl.load(cp + 1) - s * seg
    a2 = a0
    a3 = a0
    if W == 4:
        a2 = tl.load(cp + 2) - s * seg
        a3 = tl.load(cp + 3) - s * seg
    if ALIGNED:
        q = start // 4 + tl.arange(0, BLOCK // 4)
        m = q < n // 4
        # each plane's bytes of this block as int32 words (the block starts 16-byte aligned in its chunk)
        a = tl.load(tl.multiple_of((a0 + start).to(tl.pointer_type(tl.int32)), 16) + (q - start // 4), mask=m, other=0)
        b = tl.load(tl.multiple_of((a1 + start).to(tl.pointer_type(tl.int32)), 16) + (q - start // 4), mask=m, other=0)
        c = a
        d = a
        if W == 4:
            c = tl.load(tl.multiple_of((a2 + start).to(tl.pointer_type(tl.int32)), 16) + (q - start // 4), mask=m, other=0)
            d = tl.load(tl.multiple_of((a3 + start).to(tl.pointer_type(tl.int32)), 16) + (q - start // 4), mask=m, other=0)
        _merge_quads(a.to(tl.int64), b.to(tl.int64), c.to(tl.int64), d.to(tl.int64), out_addr, base_addr, q, m, W, OP)
        if start + BLOCK >= n:
            e = (n // 4) * 4 + tl.arange(0, 4)
            _merge_elems_at(out_addr, base_addr, a0.to(tl.pointer_type(tl.uint8)), a1.to(tl.pointer_type(tl.uint8)),
                            a2.to(tl.pointer_type(tl.uint8)), a3.to(tl.pointer_type(tl.uint8)), e, e < n, W, OP)
    else:
        offs = start + tl.arange(0, BLOCK)
        _merge_elems_at(out_addr, base_addr, a0.to(tl.pointer_type(tl.uint8)), a1.to(tl.pointer_type(tl.uint8)),
                        a2.to(tl.pointer_type(tl.uint8)), a3.to(tl.pointer_type(tl.uint8)), offs, offs < n, W, OP)


#: tables up to this size go to the device straight from pageable memory (the driver copies them
#: into its own staging memory before the call returns; CUDA does not promise that it will not
#: wait for the stream first); larger ones through pinned memory
_PAGEABLE_TABLE_BYTES = 64 << 10


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 host table on ``device``: one copy, through pinned memory when it is large (a
    sampling profile of a re-encoding put ~0.3 ms on each small table's pinned block, a hundred
    checksum launches per re-encoding); a view of the array itself on the CPU, where the
    interpreter runs the kernels."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type != "cuda":
        return t
    return (t if t.numel() * 8 <= _PAGEABLE_TABLE_BYTES else t.pin_memory()).to(device, non_blocking=True)


def item_table(rows: np.ndarray, programs: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The tables of a batched launch, on ``device`` in one upload: ``rows`` (int64, one row per
    item) with each item's first program appended as its last column, and the program-to-item map
    (built on the device, so no host work grows with the programs). Returns ``(table, map, programs)``."""
    first = np.cumsum(programs) - programs
    total = int(programs.sum())
    k, cols = len(rows), rows.shape[1] + 1
    both = upload(np.concatenate([np.column_stack([rows, first]).reshape(-1), programs]), device)
    prog_map = torch.repeat_interleave(
        torch.arange(k, dtype=torch.int32, device=device), both[cols * k :], output_size=total
    )
    return both[: cols * k], prog_map, total


def program_map(programs: np.ndarray) -> np.ndarray:
    """The program-to-item map of a batched launch built on the host (int32), for tables made ahead
    of their launch (a load's decode plan, on the stager thread); :func:`item_table` builds it on
    the device instead."""
    return np.repeat(np.arange(len(programs), dtype=np.int32), programs)


class Tables:
    """The int64 item tables and int32 program maps of several launches, gathered on the host and
    sent to the device in one pinned copy (one host-to-device copy per batch instead of one or two
    per launch, and no device work to build maps)."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._lens: list[int] = []  # int64 words of each part before its padding
        self._int32: list[bool] = []

    def add(self, a: np.ndarray) -> int:
        """Queue ``a`` (int64, or int32 for a program map); returns its index in :meth:`upload`'s list.
        Every part starts 16-byte aligned in the upload (parts are padded to whole 16-byte words):
        Triton specializes a kernel on whether each pointer argument is 16-byte aligned, so an
        alignment that followed the sizes of the tables before a part would compile variants that
        depend on the data (which no warm-up can know)."""
        a = np.ascontiguousarray(a).reshape(-1)
        is32 = a.dtype == np.int32
        if is32:
            a = (np.concatenate([a, np.zeros(1, np.int32)]) if len(a) % 2 else a).view(np.int64)
        else:
            a = a.astype(np.int64, copy=False)
        self._lens.append(len(a))
        if len(a) % 2:
            a = np.concatenate([a, np.zeros(1, np.int64)])
        self._parts.append(a)
        self._int32.append(is32)
        return len(self._parts) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        """Every queued array on ``device``, as views of one tensor (int32 views for maps), each
        16-byte aligned."""
        total = sum(len(a) for a in self._parts)
        if device.type == "cuda":
            host = torch.empty(max(total, 2), dtype=torch.int64, pin_memory=True)
            if total:
                np.concatenate(self._parts, out=host.numpy()[:total])
            buf = host.to(device, non_blocking=True)
        else:  # the interpreter runs kernels on CPU tensors
            buf = torch.from_numpy(np.concatenate(self._parts)) if total else torch.zeros(2, dtype=torch.int64)
        views, pos = [], 0
        for a, n, is32 in zip(self._parts, self._lens, self._int32):
            v = buf[pos : pos + n]
            views.append(v.view(torch.int32) if is32 else v)
            pos += len(a)
        return views


def launch_items(kernel: Any, w: int, op: int, table: torch.Tensor, prog_map: torch.Tensor, programs: int,
                 arg: torch.Tensor, aligned: bool, flags: torch.Tensor | None = None) -> None:
    """One launch of a batched plane kernel over a table uploaded ahead (see :class:`Tables`): the
    caller built ``table`` (rows ending in each item's first program) and ``prog_map`` for
    :func:`block_config`'s block and checked the addresses in them. ``flags`` (the split only): one
    int64 per item, ``2`` where the item takes the ``planes`` transform (see :data:`OP_PLAIN`)."""
    block, warps = block_config(kernel)
    if kernel is _split_kernel:
        kernel[(programs,)](table, prog_map, arg, table if flags is None else flags, W=w, OP=op, FLAGS=flags is not None,
                            ALIGNED=aligned and _wide(), BLOCK=block, num_warps=warps)
    else:
        kernel[(programs,)](table, prog_map, arg, W=w, OP=op, ALIGNED=aligned and _wide(), BLOCK=block, num_warps=warps)


def compile_split_variants(w: int, device: torch.device) -> None:
    """Compile, without launching, every variant of the split that the GPU writer's batches launch
    for element width ``w`` (:func:`launch_items` with flags): each delta op, with and without the
    aligned path. Which of them a save needs follows its data (the delta op the writer chooses per
    storage, whether a launch's storages are whole 16-byte words); the warm-up compiles them all so
    that no save compiles one. The pointer arguments are 16-byte aligned, as every launch's are
    (:class:`Tables`)."""
    block, warps = block_config(_split_kernel)
    table = torch.zeros(2 * _ROW, dtype=torch.int64, device=device)
    pmap = torch.zeros(4, dtype=torch.int32, device=device)
    out = torch.zeros(64, dtype=torch.uint8, device=device)
    flags = torch.zeros(2, dtype=torch.int64, device=device)
    for op in sorted(set(OPS.values())):
        for aligned in sorted({_wide(), False}):
            _split_kernel.warmup(table, pmap, out, flags, W=w, OP=op, FLAGS=True, ALIGNED=aligned, BLOCK=block,
                                 num_warps=warps, grid=(1,))


def _launch_by_op(kernel: Any, w: int, arg: torch.Tensor, rows: np.ndarray, ops: np.ndarray, aligned: Any) -> None:
    """One launch of ``kernel(table, map, arg, ...)`` per delta op in ``ops`` over the items
    ``rows`` (element count in column 3); ``aligned(rows)``: whether they may take the vector path."""
    block, _warps = block_config(kernel)
    for code in np.unique(ops).tolist():
        r = rows[ops == code]
        table, prog_map, total = item_table(r, -(-r[:, 3] // block), arg.device)
        launch_items(kernel, w, int(code), table, prog_map, total, arg, aligned(r))


def _wide() -> bool:
    return config.get_bool("S4W_PLANES_WIDE")


def merge_chunks(w: int, chunks: torch.Tensor, rows: np.ndarray, ops: np.ndarray, aligned: bool) -> None:
    """Merge planes read in place from their chunks (no placement copy), one launch per delta op,
    through the launch path of the GPU reader's decode plan (:class:`Tables`, :func:`program_map`,
    :func:`launch_items`), which builds these tables ahead of the call.

    ``chunks``: int64 device tensor of chunk addresses. ``rows``: int64 ``(k, 5)``: output address,
    base address (0: none), index of the item's first chunk in ``chunks`` (plane ``j`` of segment
    ``s`` is ``chunks[first + s * w + j]``), element count, segment elements -- which
    :func:`merge_block` must divide. ``aligned``: every output, base and chunk address (and so every
    block start) is 16-byte aligned, for the vectorized path. The caller owns the addresses: its
    chunks hold ``min(seg, n - s * seg)`` bytes each."""
    if w not in (2, 4):
        raise ValueError(f"element width must be 2 or 4, got {w}")
    live = rows[:, 3] > 0
    rows, ops = rows[live], ops[live]
    if not len(rows):
        return
    if (rows[:, 4] % merge_block()).any():
        raise ValueError("merge_chunks: the segment length must be a multiple of the block")
    block = merge_block()
    tables = Tables()
    launches = []
    for code in np.unique(ops).tolist():  # the decode's launch path: host-built maps, one upload
        r = rows[ops == code]
        programs = -(-r[:, 3] // block)
        launches.append((int(code), tables.add(np.column_stack([r, np.cumsum(programs) - programs])),
                         tables.add(program_map(programs)), int(programs.sum())))
    dev = tables.upload(chunks.device)
    for code, t_rows, t_map, total in launches:
        launch_items(_merge_chunks_kernel, w, code, dev[t_rows], dev[t_map], total, chunks, aligned)


def merge_block() -> int:
    """Elements per program of the merge kernels (a segment length must be a multiple of it for
    :func:`merge_chunks`)."""
    return block_config()[0]


# ----------------------------------------------------------------------------- launches
Piece = tuple  # (tensor_u8, base_u8 | None, offset, plane_stride[, op])


def _norm(piece: Piece) -> tuple[torch.Tensor, torch.Tensor | None, int, int, str | None]:
    t, base, off, ps = piece[:4]
    op = piece[4] if len(piece) > 4 else "xor"
    if base is None:
        op = None
    elif op not in ("xor", "sub"):
        raise ValueError(f"unknown delta op {op!r}")
    return t, base, int(off), int(ps), op


def _launch(kernel: object, pieces: list[Piece], w: int, buf: torch.Tensor, what: str) -> None:
    """Check ``pieces`` (tensors) and launch through :func:`launch_rows`."""
    if w not in (2, 4):
        raise ValueError(f"element width must be 2 or 4, got {w}")
    rows: list[tuple[int, int, int, int, int]] = []
    ops: list[int] = []
    for piece in pieces:
        t, base, off, ps, op = _norm(piece)
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{what}: expected 1-D contiguous uint8 tensors")
        if t.numel() == 0:
            continue
        n = t.numel() // w
        if t.numel() != n * w or ps < n or off < 0 or off + (w - 1) * ps + n > buf.numel():
            raise ValueError(f"{what}: a piece does not fit its planes buffer")
        if base is not None and (base.numel() != t.numel() or not base.is_contiguous()):
            raise ValueError(f"{what}: base has a different size")
        rows.append((t.data_ptr(), base.data_ptr() if base is not None else 0, off, n, ps))
        ops.append(OPS[op])
    if rows:
        launch_rows(kernel, w, buf, np.asarray(rows, dtype=np.int64), np.asarray(ops, dtype=np.int64))


def launch_rows(kernel: object, w: int, buf: torch.Tensor, rows: np.ndarray, ops: np.ndarray) -> None:
    """One launch of ``kernel`` (:data:`SPLIT` or :data:`MERGE`) per delta op present in ``ops``.

    ``rows``: int64 ``(k, 5)`` array, one row per item: element address (raw input for a split,
    output for a merge), delta-base address (0: none), planes offset in ``buf``, element count,
    plane stride; ``ops``: the items' :data:`OPS` codes (0 where the base address is 0). The planes
    ranges are checked against ``buf`` here; the element and base addresses must be the caller's
    own tensors of ``n * w`` bytes (the GPU writer and reader derive them from tensors they sized).
    Host work is a few numpy operations and one small upload, whatever the number of items.
    """
    if w not in (2, 4):
        raise ValueError(f"element width must be 2 or 4, got {w}")
    live = rows[:, 3] > 0
    rows, ops = rows[live], ops[live]
    if not len(rows):
        return
    off, n, ps = rows[:, 2], rows[:, 3], rows[:, 4]
    if (ps < n).any() or (off < 0).any() or int((off + (w - 1) * ps + n).max()) > buf.numel():
        raise ValueError("launch_rows: an item does not fit its planes buffer")
    wide = _wide() and buf.data_ptr() % 16 == 0
    _launch_by_op(kernel, w, buf, rows, ops, lambda r: wide and not ((r[:, 0] | r[:, 1] | r[:, 2] | r[:, 4]) % 16).any())


#: the kernels :func:`launch_rows` takes
SPLIT = _split_kernel
MERGE = _merge_kernel
#: the in-place merge, for :func:`launch_items` (``arg``: the chunk address table)
MERGE_CHUNKS = _merge_chunks_kernel


def split_planes_batched(pieces: list[Piece], w: int, out: torch.Tensor) -> None:
    """Split many inputs of one element width, one launch per delta op present.

    ``pieces``: ``(raw_u8, base_u8 or None, out_offset, plane_stride[, op])`` with ``op`` ``"xor"``
    (the default) or ``"sub"``; planes of each go to ``out[out_offset + j * plane_stride + i]``.
    ``w``: 2 (bf16/fp16) or 4 (fp32). Enqueued on the current stream; no host synchronization.
    """
    _launch(_split_kernel, pieces, w, out, "split_planes_batched")


def merge_planes_batched(pieces: list[Piece], w: int, planes: torch.Tensor) -> None:
    """Inverse of :func:`split_planes_batched`: ``(out_u8, base_u8 or None, planes_offset, plane_stride[, op])``."""
    _launch(_merge_kernel, pieces, w, planes, "merge_planes_batched")


def _check_dtype(t: torch.Tensor, dtype: torch.dtype) -> int:
    if dtype not in PLANE_DTYPES:
        raise ValueError(f"no plane transform for {dtype}")
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError("expected a 1-D contiguous uint8 tensor")
    return plane_width(dtype)


def split_planes_into(
    raw_u8: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor,
    plane_stride: int,
    base_u8: torch.Tensor | None = None,
    op: str = "xor",
) -> None:
    """Write the planes of ``raw_u8`` (``n * w`` bytes of ``dtype``) to ``out[j*plane_stride + i]``.

    ``out``: 1-D uint8 (a view into a larger buffer is fine) on the same device. ``base_u8``:
    optional delta base like ``raw_u8``, applied with ``op``. No host synchronization.
    """
    w = _check_dtype(raw_u8, dtype)
    off = out.storage_offset()
    whole = torch.empty(0, dtype=torch.uint8, device=out.device).set_(out.untyped_storage())
    n = raw_u8.numel() // w
    if plane_stride < n or out.numel() < (w - 1) * plane_stride + n:
        raise ValueError("output buffer too small for the planes")
    split_planes_batched([(raw_u8, base_u8, off, plane_stride, op)], w, whole)


def merge_planes_from(
    planes: torch.Tensor,
    dtype: torch.dtype,
    out_u8: torch.Tensor,
    plane_stride: int,
    base_u8: torch.Tensor | None = None,
    op: str = "xor",
) -> None:
    """Inverse of :func:`split_planes_into`."""
    w = _check_dtype(out_u8, dtype)
    off = planes.storage_offset()
    whole = torch.empty(0, dtype=torch.uint8, device=planes.device).set_(planes.untyped_storage())
    n = out_u8.numel() // w
    if plane_stride < n or planes.numel() < (w - 1) * plane_stride + n:
        raise ValueError("planes buffer too small")
    merge_planes_batched([(out_u8, base_u8, off, plane_stride, op)], w, whole)


def split_planes(
    raw_u8: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None = None, op: str = "xor"
) -> torch.Tensor:
    """Same contract as :func:`s4w_core.planes.reference.split_planes` (a ``(w, n)`` tensor)."""
    w = plane_width(dtype)
    n = raw_u8.numel() // w
    out = torch.empty(w * n, dtype=torch.uint8, device=raw_u8.device)
    split_planes_into(raw_u8, dtype, out, n, base_u8, op)
    return out.view(w, n)


def merge_planes(
    planes: torch.Tensor, dtype: torch.dtype, base_u8: torch.Tensor | None = None, op: str = "xor"
) -> torch.Tensor:
    """Same contract as :func:`s4w_core.planes.reference.merge_planes`."""
    w, n = planes.shape
    out = torch.empty(w * n, dtype=torch.uint8, device=planes.device)
    merge_planes_from(planes.contiguous().view(-1), dtype, out, n, base_u8, op)
    return out

"""Delta transforms: a tensor's bytes coded against the same tensor of an earlier checkpoint.

A delta op maps ``(raw, base)`` to a residual of the same length that the byte-plane transform
and the codecs then code; ``inverse(op, residual, base)`` gives ``raw`` back bit for bit.  Both
are element-wise integer operations (no floating point), so every device computes the same bits.

Ops (recorded as ``storage["delta"]["op"]`` in the manifest; docs/FORMAT.md):

``xor``
    ``r = x XOR b`` on the bytes.  Any dtype.

``sub``
    Arithmetic difference of order-preserving bit patterns, zigzag-coded.  Only for the byte-plane
    transforms (``planes-rotl1``, ``planes``), i.e. their dtypes (bfloat16, float16: ``W = 16``;
    float32: ``W = 32``).  With ``x``, ``b`` the unsigned ``W``-bit patterns of an element
    (little-endian) and all arithmetic modulo ``2**W``::

        ord(u)  = u XOR (2**W - 1)   if the top bit of u is set   (negative floats: all bits flipped)
                  u XOR 2**(W-1)     otherwise                     (non-negative: sign bit set)
        d       = ord(x) - ord(b)                     (mod 2**W), read as signed W-bit s
        r       = (s << 1) XOR (s >> (W-1))           (zigzag; >> arithmetic; mod 2**W)

    Inverse: ``s = (r >> 1) XOR -(r AND 1)`` (logical shift), ``o = ord(b) + s``, then
    ``x = o XOR 2**(W-1)`` if the top bit of ``o`` is set, else ``o XOR (2**W - 1)``.
    ``ord`` orders patterns like the floats they encode (``-0.0`` next to ``+0.0``; NaN/Inf are
    just patterns), so a value that moved by ``k`` ulps gives a residual near ``2k``: small
    updates leave the high planes zero even where XOR flips many bits (a carry across a mantissa
    boundary, a sign change near zero).  Measured on real training snapshots (benchmarks/
    bench_chain.py), ``sub`` beats ``xor`` for weights and exp_avg_sq in both bf16 and fp32.
"""

from __future__ import annotations

import numpy as np
import torch

from s4w_core.format.manifest import PLANE_TRANSFORMS

__all__ = ["OPS", "ops_for", "forward", "inverse"]

OPS = ("xor", "sub")
_SUB_DTYPES = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


def ops_for(dtype: torch.dtype, transform: str) -> tuple[str, ...]:
    """The delta ops that apply to a storage of ``dtype`` coded with ``transform``: both for the
    byte-plane transforms (``planes-rotl1``, ``planes``), ``xor`` only for ``bytes``."""
    if transform in PLANE_TRANSFORMS and dtype in _SUB_DTYPES:
        return OPS
    return ("xor",)


def _signed_ord(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``ord`` of the docstring minus ``2**(W-1)``, in the signed W-bit dtype: flips the
    magnitude bits of negative patterns.  Offsets cancel in differences, so the residuals equal
    those of the definition (tests/store/test_delta_ops.py checks against a widened oracle)."""
    return v ^ ((v >> (bits - 1)) & ((1 << (bits - 1)) - 1))


# Implementation note: the arithmetic runs in the W-bit signed dtype itself (int16 / int32) and
# relies on two's-complement wrap-around of + and -, which torch's CPU and CUDA kernels do (and
# numpy's, for arrays); that is ~10x faster than widening to int32/int64 and gives the same bits.
# Host tensors of up to _NUMPY_BYTES run through numpy: the same operations, at ~1 us a call
# instead of torch's ~8 (a small model's storages, and the choosers' samples, are mostly small).

#: host tensors of at most this many bytes are computed with numpy (the same bits)
_NUMPY_BYTES = 1 << 18
_NP_INT = {16: np.int16, 32: np.int32}


def _host_small(*ts: torch.Tensor) -> bool:
    return all(
        t.device.type == "cpu" and t.numel() <= _NUMPY_BYTES and t.is_contiguous() for t in ts
    )


def _signed_ord_np(v: np.ndarray, bits: int) -> np.ndarray:
    return v ^ ((v >> (bits - 1)) & ((1 << (bits - 1)) - 1))


def forward(op: str, raw_u8: torch.Tensor, base_u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Residual bytes of ``raw_u8`` against ``base_u8`` (1-D uint8 tensors of equal length)."""
    if op == "xor":
        return raw_u8 ^ base_u8
    if op == "sub":
        bits = _SUB_DTYPES[dtype]
        if _host_small(raw_u8, base_u8):
            nt = _NP_INT[bits]
            dn = _signed_ord_np(raw_u8.numpy().view(nt), bits) - _signed_ord_np(base_u8.numpy().view(nt), bits)
            return torch.from_numpy(((dn << 1) ^ (dn >> (bits - 1))).view(np.uint8))
        it = torch.int16 if bits == 16 else torch.int32
        d = _signed_ord(raw_u8.view(it), bits) - _signed_ord(base_u8.view(it), bits)
        return ((d << 1) ^ (d >> (bits - 1))).view(torch.uint8)
    raise ValueError(f"unknown delta op {op!r}")


def inverse(op: str, resid_u8: torch.Tensor, base_u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw_u8`` from the residual of :func:`forward` and the same base."""
    if op == "xor":
        return resid_u8 ^ base_u8
    if op == "sub":
        bits = _SUB_DTYPES[dtype]
        if _host_small(resid_u8, base_u8):
            nt = _NP_INT[bits]
            zn = resid_u8.numpy().view(nt)
            sn = ((zn >> 1) & ((1 << (bits - 1)) - 1)) ^ -(zn & 1)
            on = _signed_ord_np(base_u8.numpy().view(nt), bits) + sn
            return torch.from_numpy(_signed_ord_np(on, bits).view(np.uint8))
        it = torch.int16 if bits == 16 else torch.int32
        z = resid_u8.view(it)
        s = ((z >> 1) & ((1 << (bits - 1)) - 1)) ^ -(z & 1)
        o = _signed_ord(base_u8.view(it), bits) + s
        return _signed_ord(o, bits).view(torch.uint8)
    raise ValueError(f"unknown delta op {op!r}")

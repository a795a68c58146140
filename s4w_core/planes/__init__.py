"""The byte-plane transforms (``planes-rotl1`` and ``planes``), defined bit-exactly in docs/FORMAT.md.

For a float element of width ``w`` bytes (bf16/fp16: 2, fp32: 4) with bit pattern ``x``:

    r = rotl(x, 1)               # sign moves from the top bit to bit 0
    plane[j] = byte (w-1-j) of r # plane 0 is the most significant byte

For bf16 and fp32, plane 0 is exactly the 8-bit exponent field; the following planes hold the
mantissa bytes, the last one ending in the sign bit.  For fp16, plane 0 holds the 5-bit exponent
and the top 3 mantissa bits.  Keeping the sign beside the lowest mantissa bits costs nothing (they
are equally random) and means every plane is a whole byte per element: no bit-packing pass.

With a delta base, ``x`` is replaced by ``x XOR base`` before the rotation (see s4w_core.delta).

The ``planes`` transform (``rot=False`` in :func:`split_planes` / :func:`merge_planes`) is the same
without the rotation: ``plane[j] = byte (w-1-j) of x``, so plane 0 starts with the sign bit. It
pays where the sign is (nearly) constant, e.g. non-negative tensors: the sign then costs nothing
inside plane 0, which is always entropy-coded (docs/FORMAT.md, section 4.5b).

:mod:`s4w_core.planes.reference` is the CPU implementation and the oracle;
:mod:`s4w_core.planes.triton_kernels` (GPU) must give identical planes.
"""

from s4w_core.planes.reference import (
    PLANE_DTYPES,
    merge_planes,
    plane_width,
    split_planes,
)

__all__ = ["PLANE_DTYPES", "merge_planes", "plane_width", "split_planes"]

"""Coding one chunk (one plane of one segment) on the CPU: the codec measured best for it, never
larger than raw; and the order-0 estimates the writers' choices use."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from s4w_core.codecs import DEFLATE, RAW, ZSTD, zstd_encode_plane

__all__ = [
    "BITMAP",
    "ZSTD_PLANE",
    "choose_codec",
    "encode_chunk",
    "entropy_ratio",
    "estimate_bytes",
    "order0_bytes",
    "order0_counts_bytes",
]

#: elements of a plane sampled (with a stride) by :func:`entropy_ratio`
SAMPLE = 1 << 16
#: a plane chunk this many times smaller than its plane is also tried at zstd's level 3 (smaller wins).
LOW_ENTROPY_RATIO = 4
#: exponent-plane chunks smaller than this are also tried with Huffman-only deflate (smaller wins).
SMALL_PLANE = 1 << 16
#: ... and those of at least this many bytes are tried at level 3 only when
#: :data:`LOW_ENTROPY_RATIO_SMALL` times smaller (below 1 bit a byte, where only matches go):
#: between 4x and 8x, level 3 took 17 bytes off 35 such chunks (~1 MB of planes) of a small GPT's
#: delta residuals for ~3 ms of CPU (benchmarks/bench_tensor_cost.py's state); smaller chunks (biases and
#: norms) still try it at 4x, for a few microseconds each
TINY_PLANE = 1 << 12
LOW_ENTROPY_RATIO_SMALL = 8
#: the plane index :func:`encode_chunk` is given for the bitmap chunk of a nonzero transform
BITMAP = -1


def entropy_ratio(plane: np.ndarray) -> float:
    """Estimated order-0 compression ratio of a uint8 array, from a strided sample."""
    n = plane.size
    if n == 0:
        return 1.0
    sample = plane[:: max(1, n // SAMPLE)]
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / sample.size
    h = float(-(p * np.log2(p)).sum())
    return 8.0 / max(h, 1e-3)


#: ``c * log2(c)`` for ``c`` up to this: the entropy of a histogram of at most this many bytes is
#: one lookup per bin (:func:`order0_bytes`)
_CLOGC_MAX = 1 << 13
_CLOGC = np.arange(_CLOGC_MAX + 1, dtype=np.float64)
_CLOGC[1:] *= np.log2(_CLOGC[1:])


def order0_bytes(a: np.ndarray) -> float:
    """Order-0 estimate of the coded bytes of the uint8 array ``a``, all of it (no stride: meant
    for the small samples of the writers' cheap choices): its size times its entropy in bytes, at
    least 1e-3 bits a byte (as :func:`entropy_ratio`)."""
    if not a.size:
        return 0.0
    if a.flags.writeable:  # torch's count of bytes: ~2x numpy's (which widens them to intp first)
        return order0_counts_bytes(torch.bincount(torch.from_numpy(a), minlength=256).numpy())
    return order0_counts_bytes(np.bincount(a, minlength=256))


def order0_counts_bytes(counts: np.ndarray) -> float:
    """:func:`order0_bytes` of the bytes whose histogram is ``counts`` (256 bins)."""
    n = int(counts.sum())
    if n == 0:
        return 0.0
    if n <= _CLOGC_MAX:
        s = float(_CLOGC[counts].sum())
    else:
        c = counts[counts > 0]
        s = float((c * np.log2(c)).sum())
    return n * max(math.log2(n) - s / n, 1e-3) / 8.0


def estimate_bytes(planes: torch.Tensor) -> float:
    arr = planes.numpy()
    return sum(arr.shape[1] / entropy_ratio(arr[j]) for j in range(arr.shape[0]))


#: marker for "zstd frame coded with the plane parameters" (codec id ``zstd``).
ZSTD_PLANE = object()


def choose_codec(transform: str, j: int, plane: np.ndarray) -> Any:
    """The codec of one chunk: zstd at level 3 for ``bytes`` storages, else :data:`ZSTD_PLANE`
    (zstd stores an incompressible block as it is, at memcpy speed). Tests replace it to write
    other codecs' chunks (``tests/unit/helpers.deflate_plane0``)."""
    return ZSTD if transform == "bytes" else ZSTD_PLANE


def encode_chunk(transform: str, j: int, plane: np.ndarray) -> tuple[str, bytes]:
    codec = choose_codec(transform, j, plane)
    data = memoryview(plane)
    if codec is ZSTD_PLANE:
        cid, out = ZSTD.id, zstd_encode_plane(data)
        if len(out) * LOW_ENTROPY_RATIO < plane.size and not (j == 0 and transform.startswith("rc-")):
            # near-constant planes (delta residuals of unchanged or barely changed values) go far
            # below a Huffman code's 1 bit a byte with zstd's matches at its default level. (Not
            # the plane 0 of a row/column transform, FORMAT.md 4.5d: ~2 bits a byte of noise around
            # its offsets, where level 3 took 0.1 % off at 1.6x the time.)
            if not TINY_PLANE <= plane.size < SMALL_PLANE or len(out) * LOW_ENTROPY_RATIO_SMALL < plane.size:
                assert ZSTD.encode_cpu is not None
                z = ZSTD.encode_cpu(data)
                if len(z) < len(out):
                    out = z
        elif j == 0 and plane.size < SMALL_PLANE:
            # deflate's Huffman header is smaller than zstd's: 6-16% smaller exponent chunks under
            # 64 KiB (biases, norms, small models); mantissa planes gain < 1% there
            assert DEFLATE.encode_cpu is not None
            d = DEFLATE.encode_cpu(data)
            if len(d) < len(out):
                cid, out = DEFLATE.id, d
    else:  # a codec with a CPU encoder
        assert codec.encode_cpu is not None
        cid, out = codec.id, codec.encode_cpu(data)
    if len(out) < plane.size:
        return cid, out
    return RAW.id, bytes(data)

"""Checksums.

* ``xxh3-64`` (xxHash XXH3, 64 bit, seed 0) over stored chunk bytes, the manifest and, on the CPU
  path, the raw bytes of each tensor.  Computed on the host.
* ``fold64`` over the raw bytes of a tensor, defined with element-wise integer operations so that it
  is computed where the tensor lives (on the GPU, without copying it to the host).  Definition
  (also in docs/FORMAT.md): pad the bytes with zeros to a multiple of 4, read them as little-endian
  uint32 words ``w[i]``, ``i = 0..n-1``; with all arithmetic modulo 2**64::

      x = w[i] + (i + 1) * 0x9E3779B97F4A7C15
      x ^= x >> 33; x *= 0xFF51AFD7ED558CCD
      x ^= x >> 33; x *= 0xC4CEB9FE1A85EC53
      x ^= x >> 33
      fold64 = (sum_i x + nbytes * 0x94D049BB133111EB) mod 2**64

  (``>>`` is a logical shift.)  Every word, its position and the length all feed the sum, so a
  change to any byte, a swap of two words or a truncation changes the value with probability
  about 1 - 2**-64 for random corruption.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xxhash

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Buffer

__all__ = ["xxh3_hex", "tensor_checksum", "verify_tensor_checksum", "fold64"]

_K1 = 0x9E3779B97F4A7C15
_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53
_KLEN = 0x94D049BB133111EB
_MASK31 = (1 << 31) - 1
_BLOCK = 1 << 22  # words per pass; bounds temporary memory to ~32 MiB per temp


def _s64(v: int) -> int:
    """Two's-complement int64 with the same low 64 bits as ``v``."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def xxh3_hex(data: Buffer) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _lsr33(x: torch.Tensor) -> torch.Tensor:
    return (x >> 33) & _MASK31


def fold64(flat_u8: torch.Tensor) -> int:
    """``fold64`` of a 1-D contiguous uint8 tensor on any device; returns an unsigned int."""
    n = flat_u8.numel()
    pad = (-n) % 4
    if pad:
        flat_u8 = torch.cat([flat_u8, flat_u8.new_zeros(pad)])
    elif flat_u8.storage_offset() % 4:  # an int32 view needs 4-byte alignment
        flat_u8 = flat_u8.clone()
    words = flat_u8.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=flat_u8.device)
    k1, m1, m2 = _s64(_K1), _s64(_M1), _s64(_M2)
    for start in range(0, words.numel(), _BLOCK):
        w = words[start : start + _BLOCK].to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=w.device)
        x = w + idx * k1
        x ^= _lsr33(x)
        x *= m1
        x ^= _lsr33(x)
        x *= m2
        x ^= _lsr33(x)
        total += x.sum()
    return (int(total.item()) + n * _KLEN) & ((1 << 64) - 1)


def tensor_checksum(flat_u8: torch.Tensor) -> str:
    """Checksum string ``"algo:hex"`` of raw tensor bytes, using the algorithm cheapest where they live."""
    if flat_u8.device.type == "cpu":
        return "xxh3-64:" + xxh3_hex(flat_u8.numpy())
    return f"fold64:{fold64(flat_u8):016x}"


def compute_checksum(algo: str, flat_u8: torch.Tensor) -> str:
    if algo == "xxh3-64":
        return "xxh3-64:" + xxh3_hex(flat_u8.cpu().numpy())
    if algo == "fold64":
        return f"fold64:{fold64(flat_u8):016x}"
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def verify_tensor_checksum(expected: str, flat_u8: torch.Tensor) -> bool:
    algo = expected.split(":", 1)[0]
    return compute_checksum(algo, flat_u8) == expected

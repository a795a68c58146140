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

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import xxhash

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Buffer

__all__ = ["XXH3", "xxh3_hex", "xxh3_hex_holding_gil", "tensor_checksum", "verify_tensor_checksum", "fold64"]

#: prefix of a storage checksum that is the xxh3-64 of its bytes (``"xxh3-64:" + 16 hex digits``)
XXH3 = "xxh3-64:"

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


#: buffers below this size are hashed without releasing the GIL (see :func:`xxh3_hex_holding_gil`)
_HOLD_GIL_BELOW = 1 << 20


def _xxh3_holding_gil() -> Callable[[int, int], int] | None:
    """``XXH3_64bits(address, length)`` of the xxhash extension itself, called through
    ``ctypes.PyDLL`` (which keeps the GIL); None where the extension does not export it or gives
    another value than ``xxhash.xxh3_64_intdigest`` on a probe."""
    try:
        import ctypes

        import xxhash._xxhash as ext

        fn = ctypes.PyDLL(ext.__file__).XXH3_64bits
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint64
        for probe in (bytes(range(256)) * 7 + b"s4w", b"x" * 100_003):
            arr = np.frombuffer(probe, dtype=np.uint8)
            if fn(arr.ctypes.data, arr.nbytes) != xxhash.xxh3_64_intdigest(probe):
                return None
    except Exception:  # noqa: BLE001 - any failure: the plain xxhash call
        return None
    return fn  # type: ignore[no-any-return]  # c_uint64 results come back as int


_HELD = _xxh3_holding_gil()


def xxh3_hex(data: Buffer) -> str:
    """xxh3-64 of ``data`` as 16 hex digits (``xxhash.xxh3_64_hexdigest``, which releases the GIL:
    a load's reader threads hash their chunks in parallel)."""
    return xxhash.xxh3_64_hexdigest(data)


def xxh3_hex_holding_gil(data: Buffer) -> str:
    """:func:`xxh3_hex`, computed without releasing the GIL for buffers under 1 MiB (a chunk).

    For a save's background thread: python-xxhash releases the GIL on every call, and a thread that
    gives it up waits up to the interpreter's switch interval (5 ms) to get it back while another
    thread runs Python -- a save hashing 512 KiB chunks beside a training loop that never left
    Python spent ~5 ms per chunk waiting (``benchmarks/bench_gil.py``: 10.6 s against 0.32 s for
    1 GB). Larger buffers release it (hashing them takes longer than the wait). Not for threads
    that hash in parallel with each other (a load's readers): they would take turns."""
    if _HELD is not None:
        if type(data) is bytes:  # a coded chunk: ctypes passes its buffer as it is (~4x faster)
            if 0 < len(data) < _HOLD_GIL_BELOW:
                return f"{_HELD(data, len(data)):016x}"  # type: ignore[arg-type]
            return xxhash.xxh3_64_hexdigest(data)
        try:
            arr = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]
        except (TypeError, ValueError, BufferError):  # not a contiguous byte buffer
            arr = None
        if arr is not None and 0 < arr.nbytes < _HOLD_GIL_BELOW:
            return f"{_HELD(arr.ctypes.data, arr.nbytes):016x}"
    return xxhash.xxh3_64_hexdigest(data)


def _lsr33(x: torch.Tensor) -> torch.Tensor:
    return (x >> 33) & _MASK31


def fold64(flat_u8: torch.Tensor, device: torch.device | None = None) -> int:
    """``fold64`` of a 1-D contiguous uint8 tensor on any device; returns an unsigned int.
    ``device``: compute there, moving one block of words at a time (a host tensor summed on a
    GPU without a device copy of the whole)."""
    n = flat_u8.numel()
    pad = (-n) % 4
    if pad:
        flat_u8 = torch.cat([flat_u8, flat_u8.new_zeros(pad)])
    elif flat_u8.storage_offset() % 4:  # an int32 view needs 4-byte alignment
        flat_u8 = flat_u8.clone()
    words = flat_u8.view(torch.int32)
    dev = flat_u8.device if device is None else device
    total = torch.zeros((), dtype=torch.int64, device=dev)
    k1, m1, m2 = _s64(_K1), _s64(_M1), _s64(_M2)
    for start in range(0, words.numel(), _BLOCK):
        w = words[start : start + _BLOCK].to(dev).to(torch.int64) & 0xFFFFFFFF
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
        return XXH3 + xxh3_hex(flat_u8.numpy())
    return f"fold64:{fold64(flat_u8):016x}"


def compute_checksum(algo: str, flat_u8: torch.Tensor) -> str:
    if algo == "xxh3-64":
        return XXH3 + xxh3_hex(flat_u8.cpu().numpy())
    if algo == "fold64":
        return f"fold64:{fold64(flat_u8):016x}"
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def verify_tensor_checksum(expected: str, flat_u8: torch.Tensor, device: torch.device | None = None) -> bool:
    """Is ``expected`` (``"algo:hex"``) the checksum of ``flat_u8``?  ``device``: where a
    ``fold64`` is computed (see :func:`fold64`)."""
    if expected[:8] == XXH3 and flat_u8.device.type == "cpu":  # the CPU path's case, once per storage
        return XXH3 + xxhash.xxh3_64_hexdigest(flat_u8.numpy()) == expected
    algo = expected.split(":", 1)[0]
    if algo == "fold64" and device is not None:
        return f"fold64:{fold64(flat_u8, device):016x}" == expected
    return compute_checksum(algo, flat_u8) == expected

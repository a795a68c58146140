"""Host memory for GPU checkpoints: page-locked (pinned) buffers that device-to-host copies
fill at full speed, reused across saves.

* :func:`pinned_slab` / :func:`pinned_buffers`: pinned memory as private anonymous mappings
  (not inherited by forks, huge pages), faulted in by several threads and registered with CUDA
  in one call; unregistered and unmapped when the last tensor on them is gone.
* :class:`PinnedPool`: buffers reused across saves when the storage sizes repeat, the next
  generation allocated in the background.
* :func:`host_copies`: host copies of a state's storages (CUDA ones into a pool's buffers).
* :class:`HostFill`: the same, made batch by batch while a step loads onto a GPU.

Used by the checkpoint store (:mod:`s4w_core.store`) and by DCP (:mod:`s4w_core.dcp`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from s4w_core import config

__all__ = ["PinnedPool", "HostFill", "pinned_slab", "pinned_buffers", "host_copies", "pooled_sizes", "copy_parallel", "pools_host_copies", "POOLED_HOST_COPY_BYTES"]

log = logging.getLogger("s4w_core.hostmem")


_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _release(mm: mmap.mmap, ptr: int, on_free: Callable[[int], None] | None) -> None:
    """The last tensor on a slab is gone: unregister it while ``mm`` still maps it (this
    reference is the mapping's last; it is unmapped when the finalizer lets go of it)."""
    _unregister(ptr)
    if on_free is not None:
        on_free(ptr)
    del mm


def _anonymous(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` for a pinned slab, advised before any page is
    faulted in:

    * ``MADV_DONTFORK``: a child forked later (a DataLoader worker) does not inherit it.  Pages
      pinned for DMA must not become copy-on-write: after a fork, the parent's first write would
      move it to a copy while the device went on writing the old page.
    * ``MADV_HUGEPAGE`` (unless ``S4W_PINNED_THP=0``): where the kernel's transparent huge pages
      are in its ``madvise`` mode (the usual default), the slab faults in as 2 MiB pages: 512x
      fewer faults, fewer pages for ``cudaHostRegister`` to pin.  Private, because THP does not
      apply to shared anonymous memory (shmem) by default.  1.82 GB as eight slabs on an H100
      host: 0.10 s against 0.17 s, and the device-to-host copy into it 0.036 s against 0.046 s
      (``benchmarks/results/gpu_2026-11-23c/host_io_populate.log``).

    Platforms without these flags get the default mapping, unadvised."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    anon = getattr(mmap, "MAP_ANONYMOUS", None)
    if flags is None or anon is None:
        return mmap.mmap(-1, nbytes)
    mm = mmap.mmap(-1, nbytes, flags=flags | anon)
    advice = [getattr(mmap, "MADV_DONTFORK", None)]
    if config.get_bool("S4W_PINNED_THP"):
        advice.append(getattr(mmap, "MADV_HUGEPAGE", None))
    for a in advice:
        if a is not None:
            with contextlib.suppress(OSError, ValueError):  # e.g. a kernel without THP: small pages
                mm.madvise(a)
    return mm


def _fault_in(slab: torch.Tensor, threads: int) -> None:
    """Touch every page of ``slab`` (``threads`` threads on disjoint page ranges)."""
    n = slab.numel()
    threads = max(1, min(threads, -(-n // (4 << 20))))
    if threads == 1:
        slab.fill_(0)
        return
    per = -(-n // threads)
    step = -(-per // mmap.PAGESIZE) * mmap.PAGESIZE
    with ThreadPoolExecutor(threads, thread_name_prefix="s4w-pin") as ex:
        list(ex.map(lambda i: slab[i * step : (i + 1) * step].fill_(0), range(threads)))


def pinned_slab(
    nbytes: int,
    device: torch.device | None = None,
    on_free: Callable[[int], None] | None = None,
    *,
    threads: int = 8,
) -> tuple[torch.Tensor, bool]:
    """``nbytes`` of page-locked host memory as one uint8 tensor, and whether it is a registered
    slab (False: torch's pinned allocator gave it, after registration failed).

    A slab is a private anonymous mapping (:func:`_anonymous`: not inherited by forks, huge
    pages) whose pages ``threads`` threads fault in, registered with CUDA in one
    ``cudaHostRegister`` call.  It is unregistered, then unmapped, when the last tensor on its
    storage is gone (views, detached ones included: the storage holds the memoryview the
    finalizer watches); ``on_free(address)`` is called then.  ``device``: the CUDA device whose
    context registers the memory (a background thread must not create a context on device 0 of a
    multi-GPU node)."""
    nbytes = max(nbytes, 1)
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        mm = _anonymous(nbytes)
        mv = memoryview(mm)
        slab = torch.frombuffer(mv, dtype=torch.uint8)  # the storage holds ``mv``, ``mv`` the mapping
        _fault_in(slab, threads)
        ptr = slab.data_ptr()
        rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE)
        if int(rc) != 0:
            log.warning("s4weights: cudaHostRegister of %d bytes failed (%s): using torch's pinned allocator", nbytes, rc)
            del slab, mv, mm
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
    weakref.finalize(mv, _release, mm, ptr, on_free).atexit = False
    return slab, True


#: slabs one allocation is split into, each faulted in and registered on its own thread: page
#: faults on separate mappings scale where threads faulting one mapping contend (1.82 GB on an
#: H100 host: 0.16-0.19 s as 8 slabs against 0.40-0.50 s as one, ``host_io_parallel_slabs.log``)
_SLABS = 8


def pinned_buffers(
    sizes: list[int], device: torch.device | None = None, on_free: Callable[[int], None] | None = None
) -> tuple[list[torch.Tensor], set[int]]:
    """Pinned buffers of ``sizes`` bytes (each 512-byte aligned), cut from up to
    :data:`_SLABS` slabs of about equal bytes (consecutive buffers share a slab), allocated in
    parallel.  Returns the buffers and the addresses of the slabs that are registered (see
    :func:`pinned_slab`; ``on_free`` is called with a slab's address when it is released)."""
    slots = [-(-max(n, 1) // 512) * 512 for n in sizes]
    total = sum(slots)
    k = max(1, min(_SLABS, os.cpu_count() or 1, len(sizes), -(-total // (64 << 20))))
    groups: list[list[int]] = [[]]
    acc = 0
    for i, n in enumerate(slots):  # consecutive buffers, cut when a group passes its share
        if groups[-1] and acc >= total * len(groups) / k and len(groups) < k:
            groups.append([])
        groups[-1].append(i)
        acc += n
    cpus = min(_SLABS, os.cpu_count() or 1)

    def one(group: list[int]) -> tuple[torch.Tensor, bool]:
        n = sum(slots[i] for i in group)  # a slab larger than its share (one big tensor) gets more threads
        return pinned_slab(n, device, on_free, threads=max(1, round(cpus * n / total)))

    if len(groups) == 1:
        made = [one(groups[0])]
    else:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="s4w-slab") as ex:
            made = list(ex.map(one, groups))
    out: list[torch.Tensor | None] = [None] * len(sizes)
    registered: set[int] = set()
    for group, (slab, reg) in zip(groups, made):
        if reg:
            registered.add(slab.data_ptr())
        pos = 0
        for i in group:
            out[i] = slab[pos : pos + sizes[i]]
            pos += slots[i]
    return out, registered  # type: ignore[return-value]


class _Live:
    """The registered slabs a pool allocated that are still alive: storage address -> bytes
    (shared with the slabs' finalizers, which do not keep the pool alive)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slabs: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        with self.lock:
            return sum(self.slabs.values())

    def add(self, ptr: int, n: int) -> None:
        with self.lock:
            self.slabs[ptr] = self.slabs.get(ptr, 0) + n

    def drop(self, ptr: int) -> None:
        with self.lock:
            self.slabs.pop(ptr, None)


class PinnedPool:
    """Pinned host buffers for the base cache of GPU saves, reused across saves when the storage
    sizes repeat.  Two generations live at most: the cache in use (the base of the save being
    encoded) and the one being filled.

    Buffers come from :func:`pinned_buffers` (up to eight slabs per allocation).  Once a save has
    filled the generation it took and fewer than two are alive, :meth:`ahead` allocates the next
    one on a background thread (the second save would otherwise wait for it), and
    :meth:`reserve` starts the first one before any save."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._live = _Live()
        self._ahead: threading.Thread | None = None
        #: slabs allocated so far (tests and diagnostics)
        self.allocations = 0

    @property
    def live_bytes(self) -> int:
        """Bytes of the registered slabs this pool allocated that are still alive (in use or free)."""
        return self._live.bytes

    def _alloc(self, sizes: list[int], device: torch.device | None) -> list[torch.Tensor]:
        bufs, registered = pinned_buffers(sizes, device, self._live.drop)
        with self._lock:
            self.allocations += 1
        for b in bufs:
            ptr = b.untyped_storage().data_ptr()
            if ptr in registered:
                self._live.add(ptr, b.numel())
        return bufs

    def owns(self, t: torch.Tensor) -> bool:
        """Is ``t`` a view of a slab this pool allocated (and that is still alive)?"""
        with self._live.lock:
            return t.untyped_storage().data_ptr() in self._live.slabs

    def reserve(self, sizes: list[int], device: torch.device | None = None, *, wait: bool = False) -> None:
        """Allocate buffers of ``sizes`` on a background thread (no-op when one is running);
        :meth:`take` waits for it, and so does this call with ``wait=True``."""
        if not sizes or (self._ahead is not None and self._ahead.is_alive()):
            if wait and self._ahead is not None:
                self._ahead.join()
            return

        def run() -> None:
            try:
                bufs = self._alloc(list(sizes), device)
            except Exception as e:  # noqa: BLE001 - the next take() allocates in the caller instead
                log.debug("s4weights: background pinned allocation failed: %s", e)
                return
            self.give(bufs)

        self._ahead = threading.Thread(target=run, name="s4w-pin-ahead", daemon=True)
        self._ahead.start()
        if wait:
            self._ahead.join()

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers given back and not taken since (what :meth:`take` can reuse)."""
        with self._lock:
            return sum(b.numel() for lst in self._free.values() for b in lst)

    def ready(self) -> bool:
        """Is no background allocation running (:meth:`take` would not wait for one)?"""
        return self._ahead is None or not self._ahead.is_alive()

    def take(self, sizes: list[int], device: torch.device | None = None) -> list[torch.Tensor]:
        """Buffers of ``sizes`` bytes: reused ones where the sizes match, the rest allocated now;
        free buffers not reused are dropped."""
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None
        with self._lock:
            free, self._free = self._free, {}  # buffers not reused now are dropped
        out: list[torch.Tensor | None] = []
        missing: list[int] = []
        for i, n in enumerate(sizes):
            lst = free.get(n)
            if lst:
                out.append(lst.pop())
            else:
                out.append(None)
                missing.append(i)
        del free
        if missing:
            for i, b in zip(missing, self._alloc([sizes[i] for i in missing], device)):
                out[i] = b
        return out  # type: ignore[return-value]

    def ahead(self, sizes: list[int], device: torch.device | None = None) -> None:
        """Start allocating the next generation of ``sizes`` in the background, unless the pool
        already holds two.  Call it once the buffers just taken are filled: faulting in and
        registering a generation while the device copies into the last one slows those copies
        down."""
        need = sum(sizes)
        if need and self._live.bytes < 2 * need:
            self.reserve(list(sizes), device)

    def give(self, bufs: list[torch.Tensor]) -> None:
        """Buffers free for the next :meth:`take`; tensors the pool did not hand out are ignored."""
        mine = [b for b in bufs if self.owns(b)]
        with self._lock:
            for b in mine:
                self._free.setdefault(b.numel(), []).append(b)


#: host storages of at least this many bytes in all are copied into the pool's buffers by
#: :func:`copy_parallel` (where CUDA is in use) instead of cloned one by one: a DCP rank's
#: staged 2.3 GiB cloned on one thread (``torchrun`` sets ``OMP_NUM_THREADS=1``) took 1.5 s, most
#: of it faulting in fresh pages
POOLED_HOST_COPY_BYTES = 64 << 20
#: bytes one :func:`copy_parallel` task copies
_COPY_PIECE = 32 << 20


def copy_parallel(dsts: list[torch.Tensor], srcs: list[torch.Tensor], threads: int = 8) -> None:
    """``dst.copy_(src)`` for host tensors pairwise (1-D uint8, equal sizes), cut into pieces of
    :data:`_COPY_PIECE` bytes copied on up to ``threads`` threads (torch releases the GIL in a
    copy, and a copy runs on one thread where ``OMP_NUM_THREADS=1``)."""
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, s in zip(dsts, srcs):
        n = s.numel()
        if d.numel() != n:
            raise ValueError(f"copy_parallel: {d.numel()} bytes to fill from {n}")
        for a in range(0, n, _COPY_PIECE):
            pieces.append((d[a : a + _COPY_PIECE], s[a : a + _COPY_PIECE]))
    k = max(1, min(threads, os.cpu_count() or 1, len(pieces)))
    if k == 1:
        for d, s in pieces:
            d.copy_(s)
        return
    with ThreadPoolExecutor(k, thread_name_prefix="s4w-copy") as ex:
        for _ in ex.map(lambda ds: ds[0].copy_(ds[1]), pieces):
            pass


def pools_host_copies(raws: list[torch.Tensor]) -> bool:
    """Do :func:`host_copies` put the CPU ones of ``raws`` into the pool's buffers: at least
    :data:`POOLED_HOST_COPY_BYTES` of them, in a process that uses CUDA already (no context is
    created for them)."""
    cpu_bytes = sum(r.numel() for r in raws if r.device.type == "cpu")
    return cpu_bytes >= POOLED_HOST_COPY_BYTES and torch.cuda.is_initialized()


def pooled_sizes(raws: list[torch.Tensor]) -> list[int]:
    """The sizes of the pool's buffers :func:`host_copies` of ``raws`` takes, in order: one per
    CUDA storage, and one per CPU storage where :func:`pools_host_copies`."""
    pooled_cpu = pools_host_copies(raws)
    return [r.numel() for r in raws if r.device.type == "cuda" or (pooled_cpu and r.device.type == "cpu")]


def host_copies(raws: list[torch.Tensor], pool: PinnedPool, *, ahead: bool = True) -> list[torch.Tensor]:
    """Host copies of ``raws`` (1-D uint8): CUDA ones into pinned buffers from ``pool`` with
    ``non_blocking=True`` and one synchronize per device; CPU ones into the pool's buffers too
    where :func:`pools_host_copies` (by :func:`copy_parallel`; buffers reused from save to save are
    faulted in already), else cloned.  ``ahead``: then start allocating the pool's next generation
    (:meth:`PinnedPool.ahead`)."""
    pooled_cpu = pools_host_copies(raws)
    sizes = pooled_sizes(raws)
    cuda = [r for r in raws if r.device.type == "cuda"]
    device = cuda[0].device if cuda else None
    bufs = iter(pool.take(sizes, device))
    out = []
    devices = set()
    host_dst: list[torch.Tensor] = []
    host_src: list[torch.Tensor] = []
    for r in raws:
        if r.device.type == "cuda":
            b = next(bufs)
            b.copy_(r, non_blocking=True)
            devices.add(r.device)
            out.append(b)
        elif pooled_cpu and r.device.type == "cpu":
            b = next(bufs)
            host_dst.append(b)
            host_src.append(r.detach().reshape(-1))
            out.append(b)
        else:
            out.append(r.detach().clone())
    if host_dst:
        copy_parallel(host_dst, host_src)
    for d in devices:
        torch.cuda.synchronize(d)
    if ahead:
        pool.ahead(sizes, device)
    return out


class HostFill:
    """:func:`host_copies` of a step being loaded onto a GPU, made batch by batch while it loads.

    Called (as ``on_batch`` of :func:`s4w_core.api._decode_storages`) with each decoded batch's
    storages, it copies them into pinned buffers from ``pool`` on a stream of its own, while the
    next batch is read and decoded: a load is bound by its reads, so the copies cost it nothing
    but the last batch's.  The buffers are taken once the pool's background allocation
    (:meth:`PinnedPool.reserve`, started when the load read the manifest) is done; batches
    decoded before that are copied then.  :meth:`finish` returns the copies (the load's end);
    :meth:`close` gives unused buffers back, after the copies in flight."""

    def __init__(self, pool: PinnedPool, sizes: dict[int, int], device: torch.device) -> None:
        self._pool = pool
        self._sizes = sizes  # manifest index -> bytes, of the storages that load onto ``device``
        self._device = device
        self._bufs: dict[int, torch.Tensor] | None = None
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._done: set[int] = set()
        self._stream: torch.cuda.Stream | None = None
        self._given = False

    def __call__(self, idx: list[int], raws: list[torch.Tensor]) -> None:
        for i, r in zip(idx, raws):
            if r.device == self._device and self._sizes.get(i) == r.numel():
                self._pending.append((i, r))
        if self._pending and (self._bufs is not None or self._pool.ready()):
            self._flush()

    def _flush(self) -> None:
        if self._bufs is None:
            order = sorted(self._sizes)
            self._bufs = dict(zip(order, self._pool.take([self._sizes[i] for i in order], self._device)))
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # after the decode
        with torch.cuda.stream(self._stream):
            for i, r in self._pending:
                self._bufs[i].copy_(r, non_blocking=True)
                self._done.add(i)
        self._pending.clear()

    def finish(self, raws: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Host copies of ``raws`` (every storage of the step, in manifest order): the pinned
        copies, complete (CPU storages cloned); None if a CUDA storage is not one this fill was
        made for (then nothing is kept: :meth:`close` gives the buffers back)."""
        cuda = [i for i, r in enumerate(raws) if r.device.type == "cuda"]
        if set(cuda) != set(self._sizes) or any(raws[i].device != self._device or raws[i].numel() != self._sizes[i] for i in cuda):
            return None
        self._pending.extend((i, raws[i]) for i in cuda if i not in self._done)
        if self._pending:
            self._flush()
        assert self._stream is not None and self._bufs is not None
        self._stream.synchronize()
        out = [self._bufs[i] if r.device.type == "cuda" else r.detach().clone() for i, r in enumerate(raws)]
        self._given = True
        return out

    def close(self) -> None:
        """Wait for the copies in flight and give the buffers back, unless :meth:`finish` handed them out."""
        if self._stream is not None:
            self._stream.synchronize()
        if self._bufs is not None and not self._given:
            self._pool.give(list(self._bufs.values()))
        self._bufs = None
        self._pending.clear()

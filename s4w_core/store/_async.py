"""Non-blocking saves for :class:`~s4w_core.store.CheckpointStore` (docs/STORE.md, "Non-blocking
saves").

The caller's thread does only what makes the state safe to modify, then one background worker per
store does the rest, in order:

* ``async-pinned``: the state holds CUDA tensors and the profile is ``fast``: every storage is
  copied to pinned host buffers (reused across saves; one synchronize): the caller is blocked for
  the device-to-host copy only; the GPU codes the copies in the background (host-to-device per
  batch), and they become the next save's delta base without another copy;
* ``async-gpu``: the state holds CUDA tensors, the GPU backend is usable, the profile ``portable``: the whole container
  is encoded in the caller's thread into host memory (:class:`HostBuffer`); the worker writes the
  bytes and commits.
* ``async-snapshot``: otherwise: every storage is copied (:func:`snapshot`: a ``clone`` per
  storage, same device, views and sharing kept); the worker encodes the copy, writes and commits.
* ``blocking``: the save alone needs more than ``max_pending_bytes``: it runs in the caller's
  thread, as :meth:`~s4w_core.store.CheckpointStore.save` does (a warning says so).

At most one save is in flight per store: the next one waits for it (``on_busy="wait"``) or raises
:class:`~s4w_core.errors.SaveInProgressError` (``on_busy="error"``).  Behind a save the worker may
run a *tail* (:meth:`Pipeline.defer`: the re-encoding of the step below the newest as a delta
against it), which the next save and :meth:`Pipeline.wait` wait for (a tail that sets
``handle._cancel`` is cancelled by the next save instead).  A background failure is kept
and raised, wrapped in :class:`~s4w_core.errors.AsyncSaveError`, by the store's next call; at
interpreter exit every store's in-flight save is waited for and a failure is logged at ERROR.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import contextlib
import copy
import functools
import logging
import mmap
import os
import queue
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import torch

from s4w_core import api, engine
from s4w_core.errors import AsyncSaveError, SaveInProgressError

if TYPE_CHECKING:
    from s4w_core.store.records import StepInfo

__all__ = ["SaveHandle", "Cancelled", "CancellableWriter", "MODES", "ON_BUSY", "choose_mode", "snapshot", "HostBuffer", "PinnedPool", "HostFill", "pinned_slab", "pinned_buffers"]

log = logging.getLogger("s4w_core.store")

#: how a save ran (``SaveHandle.mode``).
MODES = ("blocking", "async-pinned", "async-gpu", "async-snapshot")
ON_BUSY = ("wait", "error")


class SaveHandle:
    """A save handed to the background (from :meth:`CheckpointStore.save_async`).

    Attributes:
        step: the step being saved.
        mode: ``"async-pinned"``, ``"async-gpu"``, ``"async-snapshot"`` or ``"blocking"`` (it ran in the caller's
            thread because it alone needs more host memory than ``max_pending_bytes``).
        blocked_s: seconds the caller was blocked (including ``waited_s``).
        waited_s: of those, seconds spent waiting for the previous save.
        host_bytes: host memory this save held while in flight (snapshot or encoded bytes).
        device_bytes: device memory it held (a device-side snapshot; 0 otherwise).
        total_s: seconds from the call until durable (None while running).
        stages: seconds per stage (``wait``, ``snapshot``, ``encode``, ``write``, ``commit``,
            ``retention``, ``upload``).
    """

    def __init__(self, step: int, mode: str, url: str, what: str = "save") -> None:
        self.step = step
        self.mode = mode
        self.url = url
        self.what = what
        self.hint = ""
        self.blocked_s = 0.0
        self.waited_s = 0.0
        self.total_s: float | None = None
        self.host_bytes = 0
        self.device_bytes = 0
        self.stages: dict[str, float] = {}
        self._t0 = time.perf_counter()
        self._event = threading.Event()
        self._info: StepInfo | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._cancel: threading.Event | None = None  # set: a tail job that the next save cancels

    def done(self) -> bool:
        """True once the save is durable or has failed."""
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> StepInfo:
        """Wait until the save is durable and return its :class:`StepInfo`.

        Args:
            timeout: seconds to wait; ``None`` waits as long as it takes.
        Returns:
            The committed step's :class:`StepInfo`.
        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            Exception: the error the background save failed with (then the store does not raise
                it again on its next call).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"the save of step {self.step} to {self.url} is still running after {timeout} s")
        if self._error is not None:
            self._observed = True
            raise self._error
        assert self._info is not None
        return self._info

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the save failed with, or None (waits like :meth:`result`)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"the save of step {self.step} to {self.url} is still running after {timeout} s")
        if self._error is not None:
            self._observed = True
        return self._error

    def _finish(self, info: StepInfo | None, error: BaseException | None) -> None:
        self._info, self._error = info, error
        self.total_s = time.perf_counter() - self._t0
        self._event.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error is not None else "done")
        return (
            f"SaveHandle(step={self.step}, mode={self.mode!r}, {state}, blocked_s={self.blocked_s:.3f}, "
            f"host_bytes={self.host_bytes})"
        )


# ----------------------------------------------------------------------------- the worker
class Cancelled(Exception):
    """A tail job was cancelled by the next save (never leaves the store)."""


class CancellableWriter:
    """A write-only file object that raises :class:`Cancelled` once ``cancel`` is set, so that a
    container being streamed out stops at its next write (the backend's writer then drops it)."""

    def __init__(self, f: Any, cancel: threading.Event) -> None:
        self._f = f
        self._cancel = cancel

    def write(self, data: Any) -> int:
        if self._cancel.is_set():
            raise Cancelled
        return int(self._f.write(data))

    def flush(self) -> None:
        self._f.flush()


def _run(q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while True:
        fn = q.get()
        if fn is None:
            return
        try:
            fn()
        except BaseException:  # noqa: BLE001 - jobs report their own errors; never let the thread die
            log.exception("s4weights: background save job raised")
        del fn


class Pipeline:
    """The background side of one store: its worker thread, the save in flight, the first
    failure nobody has seen yet, and the host memory held."""

    def __init__(self, url: str, max_pending_bytes: int | None, on_busy: str) -> None:
        if max_pending_bytes is not None and (type(max_pending_bytes) is not int or max_pending_bytes < 0):
            raise ValueError(f"max_pending_bytes must be a non-negative integer or None, got {max_pending_bytes!r}")
        if on_busy not in ON_BUSY:
            raise ValueError(f"on_busy must be one of {ON_BUSY}, got {on_busy!r}")
        self.url = url
        self.max_pending_bytes = max_pending_bytes
        self.on_busy = on_busy
        self.front = threading.RLock()  # one save call at a time enters the foreground part
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.inflight: SaveHandle | None = None
        self.tail: SaveHandle | None = None  # a job behind the saves (the re-encoding)
        self.failed: SaveHandle | None = None
        self.pending_bytes = 0
        self.peak_pending_bytes = 0
        _PIPELINES.add(self)

    # -- foreground
    def begin(self) -> float:
        """Before a save: wait for the one in flight (or raise SaveInProgressError), then raise a
        failure not yet reported.  Returns the seconds waited."""
        h = self.inflight
        if h is not None and not h.done() and self.on_busy == "error":
            raise SaveInProgressError(
                f"{self.url}: the {h.what} of step {h.step} is still running in the background; "
                "call store.wait() first, or open the store with on_busy='wait'"
            )
        t = time.perf_counter()
        busy = False
        while True:  # the save in flight may queue a tail before it ends: look again after it
            h = self.inflight
            tail = self.cancel_tail()
            if h is not None and not h.done():
                busy = True
                h._event.wait()  # noqa: SLF001
            elif tail is not None:
                busy = True
                tail._event.wait()  # noqa: SLF001
            else:
                break
        waited = time.perf_counter() - t if busy else 0.0
        self.raise_failed()
        return waited

    def cancel_tail(self) -> SaveHandle | None:
        """Ask the tail job to stop (it ends at its next write); returns it if it has not ended."""
        t = self.tail
        if t is None or t.done():
            return None
        if t._cancel is not None:  # noqa: SLF001
            t._cancel.set()  # noqa: SLF001
        return t

    def settle(self) -> None:
        """Wait for the save in flight and the tail behind it, without raising a failure (that
        stays for the next save or :meth:`wait`); a no-op on the worker thread itself."""
        if threading.current_thread() is not self._thread:
            self._wait_both(None)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight and then for the tail behind it."""
        self._wait_both(timeout)
        self.raise_failed()

    def _wait_both(self, timeout: float | None) -> None:
        for which in ("inflight", "tail"):  # read the tail after the save: it queues the tail
            h = getattr(self, which)
            if h is not None and not h._event.wait(timeout):  # noqa: SLF001
                raise TimeoutError(f"{self.url}: the {h.what} of step {h.step} is still running after {timeout} s")

    def raise_failed(self) -> None:
        with self._lock:
            h, self.failed = self.failed, None
        if h is not None and not h._observed:  # noqa: SLF001
            h._observed = True  # noqa: SLF001
            e = h._error  # noqa: SLF001
            raise AsyncSaveError(
                f"{self.url}: the background {h.what} of step {h.step} failed ({type(e).__name__}: {e}); "
                + (f"{h.hint}; " if h.hint else "")
                + "steps committed before it are intact"
            ) from e

    def forget_failure(self, what_prefix: str) -> None:
        """Drop an unreported failure whose ``what`` starts with ``what_prefix`` (it was retried)."""
        with self._lock:
            if self.failed is not None and self.failed.what.startswith(what_prefix):
                self.failed = None

    def submit(self, handle: SaveHandle, job: Callable[[], StepInfo], hold_bytes: int) -> None:
        """Run ``job`` on the worker; ``hold_bytes`` of host/device memory stay counted until it ends."""
        with self._lock:
            self.pending_bytes += hold_bytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
            self.inflight = handle
            self._ensure_worker()
        self._q.put(functools.partial(self._execute, handle, job, hold_bytes))

    def _ensure_worker(self) -> None:
        """Start the worker thread if none runs (caller holds ``self._lock``)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=_run, args=(self._q,), name=f"s4w-save {self.url}", daemon=True)
            self._thread.start()

    def defer(self, handle: SaveHandle, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker behind everything queued, as the tail: the next save cancels
        it (``handle._cancel``), :meth:`wait` waits for it.  ``job`` reports its own errors."""
        with self._lock:
            self.tail = handle
            self._ensure_worker()
        self._q.put(functools.partial(self._execute_tail, handle, job))

    def _execute_tail(self, handle: SaveHandle, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException:  # noqa: BLE001 - a tail never fails the store's next call
            log.exception("s4weights: background %s of step %d to %s raised", handle.what, handle.step, self.url)
        del job
        handle._finish(None, None)  # noqa: SLF001

    def _execute(self, handle: SaveHandle, job: Callable[[], StepInfo], hold_bytes: int) -> None:
        info: StepInfo | None = None
        error: BaseException | None = None
        try:
            info = job()
        except BaseException as e:  # noqa: BLE001 - kept and raised by the store's next call
            error = _detached(e)
        # a kept error's frames lead back here (f_back): hold nothing here that holds the store
        del job
        with self._lock:
            self.pending_bytes -= hold_bytes
            if error is not None:
                if self.failed is None or self.failed._observed:  # noqa: SLF001
                    self.failed = handle
                else:  # pragma: no cover - one save in flight at a time: cannot happen today
                    log.error("s4weights: %s of step %d to %s failed: %r", handle.what, handle.step, self.url, error)
        handle._finish(info, error)  # noqa: SLF001

    def stop(self) -> None:
        """End the worker thread once its queue is empty (a later submit starts a new one), and
        wait for it to end: a thread that ran torch code and is still ending while the
        interpreter shuts down can abort the process."""
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._q.put(None)
            if t is not threading.current_thread():
                t.join(timeout=30)

    # -- exit and garbage collection
    def drain_quietly(self, why: str) -> None:
        """Wait for the save in flight; log (ERROR) a failure nobody has seen.  Never raises."""
        try:
            h = self.inflight
            if h is not None and not h.done():
                log.info("s4weights: %s: waiting for the background %s of step %d to %s", why, h.what, h.step, self.url)
                h._event.wait()  # noqa: SLF001
            tail = self.cancel_tail()  # at exit or in a finalizer: stop it rather than wait it out
            if tail is not None:
                tail._event.wait()  # noqa: SLF001
            with self._lock:
                f, self.failed = self.failed, None
            if f is not None and not f._observed:  # noqa: SLF001
                e = f._error  # noqa: SLF001
                log.error(
                    "s4weights: the background %s of step %d to %s failed (%s: %s); it was never reported "
                    "to the program (%s)",
                    f.what, f.step, self.url, type(e).__name__, e, why,
                    exc_info=(type(e), e, e.__traceback__) if e is not None else None,
                )
        except Exception:  # noqa: BLE001 - at exit or in a finalizer nothing may raise
            pass
        self.stop()


def _detached(e: BaseException) -> BaseException:
    """``e`` with the locals of its traceback's finished frames cleared (files and lines stay):
    a kept error must not keep the store (a job's ``self``) alive."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if x.__traceback__ is not None:
            traceback.clear_frames(x.__traceback__)
        todo += [y for y in (x.__cause__, x.__context__) if y is not None]
    return e


_PIPELINES: weakref.WeakSet[Pipeline] = weakref.WeakSet()


def _drain_all_at_exit() -> None:
    for p in list(_PIPELINES):
        p.drain_quietly("at interpreter exit")


# The saves in flight must finish before concurrent.futures refuses new work at exit (the CPU
# encoder runs on a ThreadPoolExecutor): threading's own exit hooks run before atexit's, newest
# first, so this one, registered after concurrent.futures.thread's, runs before it.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_drain_all_at_exit)
else:  # pragma: no cover - every CPython we support has it
    atexit.register(_drain_all_at_exit)


# ----------------------------------------------------------------------------- strategy
def choose_mode(jobs: list[engine.StorageJob], profile: str) -> str:
    """``async-gpu`` when the state holds CUDA tensors and the GPU backend is usable (the
    container is then encoded on the GPU in the caller's thread, which is fast), else
    ``async-snapshot``.  Raises BackendUnavailableError for ``profile="fast"`` without a GPU."""
    prof = api._resolve_profile(profile, jobs)  # noqa: SLF001
    on_cuda = any(j.raw.device.type == "cuda" for j in jobs)
    if on_cuda and prof in ("fast", "portable") and api._gpu() is not None:  # noqa: SLF001
        return "async-gpu"
    return "async-snapshot"


def snapshot(state: Any, col: engine.Collector) -> tuple[Any, int, int]:
    """A copy of ``state`` (collected into ``col``) that the caller may no longer change: every
    storage cloned once on its own device, every tensor rebuilt as the same view (dtype, shape,
    stride, offset, Parameter, requires_grad) of its storage's clone, so sharing is kept; the
    containers around them deep-copied with their types.  Encoding it gives the container
    encoding ``state`` would have given at this moment.  Returns (copy, host bytes, device bytes)."""
    clones = [j.raw.clone() for j in col.jobs]
    host = sum(c.numel() for c in clones if c.device.type == "cpu")
    dev = sum(c.numel() for c in clones) - host
    memo: dict[int, Any] = {}
    for tid, idx in col._by_id.items():  # noqa: SLF001
        e = col.tensors[idx]
        src = clones[e["storage"]]
        dt = engine.dtype_from_name(e["dtype"])
        x = torch.empty(0, dtype=dt, device=src.device).set_(src.untyped_storage(), e["offset"], e["shape"], e["stride"])
        if e["param"]:
            x = torch.nn.Parameter(x, requires_grad=bool(e["requires_grad"]))
        elif e["requires_grad"]:
            x.requires_grad_(True)
        memo[tid] = x
    return copy.deepcopy(state, memo), host, dev


class HostBuffer:
    """A write-only in-memory file the encoder writes a whole container into (each write is
    copied: the GPU writer reuses its staging buffers)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.nbytes = 0

    def write(self, data: Any) -> int:
        b = bytes(data)
        self.chunks.append(b)
        self.nbytes += len(b)
        return len(b)

    def write_to(self, f: Any) -> None:
        for c in self.chunks:
            f.write(c)


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
    if os.environ.get("S4W_PINNED_THP", "1") != "0":
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


def host_copies(raws: list[torch.Tensor], pool: PinnedPool, *, ahead: bool = True) -> list[torch.Tensor]:
    """Host copies of ``raws`` (1-D uint8): CUDA ones into pinned buffers from ``pool`` with
    ``non_blocking=True`` and one synchronize per device; CPU ones cloned.  ``ahead``: then start
    allocating the pool's next generation (:meth:`PinnedPool.ahead`)."""
    cuda = [r for r in raws if r.device.type == "cuda"]
    sizes = [r.numel() for r in cuda]
    device = cuda[0].device if cuda else None
    bufs = iter(pool.take(sizes, device))
    out = []
    devices = set()
    for r in raws:
        if r.device.type == "cuda":
            b = next(bufs)
            b.copy_(r, non_blocking=True)
            devices.add(r.device)
            out.append(b)
        else:
            out.append(r.detach().clone())
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

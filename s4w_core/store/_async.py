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
import queue
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from s4w_core import engine, pipeline
from s4w_core._fsutil import WriteThrough
from s4w_core.errors import AsyncSaveError, SaveInProgressError
from s4w_core.hostmem import HostFill, PinnedPool, host_copies, pinned_buffers, pinned_slab
from s4w_core.skeleton import encode_tree

if TYPE_CHECKING:
    from s4w_core.store.records import StepInfo

__all__ = [
    "SaveHandle",
    "Cancelled",
    "CancellableWriter",
    "MODES",
    "ON_BUSY",
    "Pipeline",
    "choose_mode",
    "snapshot",
    "HostBuffer",
    # host memory lives in s4w_core.hostmem; re-exported here for callers that import it from here
    "PinnedPool",
    "HostFill",
    "pinned_slab",
    "pinned_buffers",
    "host_copies",
]

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
        #: a tail job that only some saves cancel: called with the step a save is about to write,
        #: True when that save makes the job's result useless (see :meth:`cancel_before`)
        self._drop_before: Callable[[int], bool] | None = None

    def cancel_before(self, drop_before: Callable[[int], bool]) -> threading.Event:
        """Make this tail job cancellable by a save of a step ``s`` for which ``drop_before(s)``
        is true (the re-encoding of a step that the save's retention deletes); returns the event
        the job watches (set: stop at the next write)."""
        self._cancel = threading.Event()
        self._drop_before = drop_before
        return self._cancel

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

    def elapsed(self) -> float:
        """Seconds since the save was called."""
        return time.perf_counter() - self._t0

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until the save is durable or failed, without raising; False after ``timeout``."""
        return self._event.wait(timeout)

    def finish(self, info: StepInfo | None, error: BaseException | None, *, observed: bool = False) -> None:
        """End the save with its record or its error (``observed``: the error was raised to the
        caller already, so the store does not raise it again)."""
        self._info, self._error = info, error
        if observed:
            self._observed = True
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


class CancellableWriter(WriteThrough):
    """A write-only file object that raises :class:`Cancelled` once ``cancel`` is set, so that a
    container being streamed out stops at its next write (the backend's writer then drops it)."""

    def __init__(self, f: Any, cancel: threading.Event) -> None:
        super().__init__(f)
        self._cancel = cancel

    def through(self, fn: Callable[[Any], Any], data: Any) -> int:
        if self._cancel.is_set():
            raise Cancelled
        return super().through(fn, data)

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
        # the tail job when it is held (:meth:`defer` with ``hold``): queued by :meth:`release`
        self._held: tuple[SaveHandle, Callable[[], None]] | None = None
        self.failed: SaveHandle | None = None
        # clean-up behind the worker (deletes of objects no record names): its own thread, so a
        # slow delete (a large local file's unlink: ~0.2 s a GB) does not hold up the next save
        self._side_q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._side_thread: threading.Thread | None = None
        self._side_idle = threading.Condition(self._lock)
        self._side_pending = 0
        self.pending_bytes = 0
        self.peak_pending_bytes = 0
        self._waiters = 0  # callers blocked in begin() / wait() for the background work
        _PIPELINES.add(self)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        with self._lock:
            self._waiters += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1

    def waited(self) -> bool:
        """Whether a caller is blocked waiting for this store's background work (a save behind
        it, :meth:`wait`): a job that starts now is the caller's critical path."""
        return self._waiters > 0

    # -- foreground
    def begin(self, step: int | None = None) -> float:
        """Before a save (of ``step``): wait for the one in flight (or raise SaveInProgressError),
        and for the tail behind it unless the save cancels it, then raise a failure not yet
        reported.  Returns the seconds waited."""
        h = self.inflight
        if h is not None and not h.done() and self.on_busy == "error":
            raise SaveInProgressError(
                f"{self.url}: the {h.what} of step {h.step} is still running in the background; "
                "call store.wait() first, or open the store with on_busy='wait'"
            )
        t = time.perf_counter()
        busy = False
        with self._waiting():
            while True:  # the save in flight may queue a tail before it ends: look again after it
                h = self.inflight
                tail = self.cancel_tail(step)
                self.release()  # a held tail runs now: to its end, or (cancelled) only to free what it holds
                if h is not None and not h.done():
                    busy = True
                    h.wait_done()
                elif tail is not None:
                    busy = True
                    tail.wait_done()
                else:
                    break
        waited = time.perf_counter() - t if busy else 0.0
        self.raise_failed()
        return waited

    def land(self, step: int) -> None:
        """Wait for the save in flight if it is a save of ``step`` (raising its failure): a call
        that names a step just handed to :meth:`submit` finds it committed.  A no-op on the worker
        thread (that save's own retention deleting the step it saved)."""
        if threading.current_thread() is self._thread:
            return
        h = self.inflight
        if h is not None and h.step == step and h.what == "save" and not h.done():
            h.wait_done()
            self.raise_failed()

    def cancel_tail(self, step: int | None = None) -> SaveHandle | None:
        """Ask the tail job to stop (it ends at its next write) if it is cancellable by the next
        save, or by a save of ``step`` (:meth:`SaveHandle.cancel_before`); returns it if it has
        not ended."""
        t = self.tail
        if t is None or t.done():
            return None
        if t._cancel is not None and (  # noqa: SLF001
            t._drop_before is None or (step is not None and t._drop_before(step))  # noqa: SLF001
        ):
            t._cancel.set()  # noqa: SLF001
            self.release()
        return t

    def cancel_tail_of(self, what: str, step: int) -> None:
        """Stop the tail job if it is the ``what`` of ``step`` and cancellable (a delete of the
        step it re-encodes: its result would be dropped)."""
        t = self.tail
        if t is not None and not t.done() and t.what == what and t.step == step and t._cancel is not None:  # noqa: SLF001
            t._cancel.set()  # noqa: SLF001
            self.release()  # held: it ends at once, freeing what it holds

    def settle(self) -> None:
        """Wait for the save in flight and the tail behind it (a held one run first), without
        raising a failure (that stays for the next save or :meth:`wait`); a no-op on the worker
        thread itself."""
        if threading.current_thread() is not self._thread:
            self._wait_both(None)

    def wait(self, timeout: float | None = None, *, held: bool = True) -> None:
        """Wait for the save in flight and then for the tail behind it; ``held=False``: a held
        tail stays held (a read that needs the saves durable, not the layout settled)."""
        self._wait_both(timeout, held)
        self.raise_failed()

    def _wait_both(self, timeout: float | None, held: bool = True) -> None:
        with self._waiting():
            for which in ("inflight", "tail"):  # read the tail after the save: it queues the tail
                h = getattr(self, which)
                if which == "tail" and h is not None and self.holds(h):
                    if not held:
                        continue
                    self.release()
                if h is not None and not h.wait_done(timeout):
                    raise TimeoutError(f"{self.url}: the {h.what} of step {h.step} is still running after {timeout} s")
        if not self.wait_side(timeout):
            raise TimeoutError(f"{self.url}: deletes of unreferenced objects still running after {timeout} s")

    # -- clean-up behind the worker
    def later(self, job: Callable[[], None]) -> None:
        """Run ``job`` (a clean-up that reports its own errors) on the side thread; :meth:`wait`,
        :meth:`settle` and the exit drain wait for it."""
        with self._lock:
            self._side_pending += 1
            if self._side_thread is None or not self._side_thread.is_alive():
                self._side_thread = threading.Thread(
                    target=_run, args=(self._side_q,), name=f"s4w-clean {self.url}", daemon=True
                )
                self._side_thread.start()
        self._side_q.put(functools.partial(self._execute_side, job))

    def _execute_side(self, job: Callable[[], None]) -> None:
        try:
            job()
        finally:
            with self._side_idle:
                self._side_pending -= 1
                self._side_idle.notify_all()

    def wait_side(self, timeout: float | None = None) -> bool:
        """Wait until no clean-up is queued or running (False: still some after ``timeout`` s)."""
        if threading.current_thread() is self._side_thread:
            return True
        with self._side_idle:
            return self._side_idle.wait_for(lambda: self._side_pending == 0, timeout)

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

    def defer(self, handle: SaveHandle, job: Callable[[], None], *, hold: bool = False) -> None:
        """Run ``job`` on the worker behind everything queued, as the tail: the next save cancels
        it (``handle._cancel``), :meth:`wait` waits for it.  ``job`` reports its own errors.
        ``hold``: queue it only once something waits for it (:meth:`release`: the next save, unless
        that save cancels it, which then runs it only to its cancelled end; :meth:`wait`,
        :meth:`settle`, the exit drain), so that work the next save would discard is not done."""
        self.release()  # (a tail still held when the next one comes: it runs first)
        with self._lock:
            self.tail = handle
            if hold:
                self._held = (handle, job)
                return
            self._ensure_worker()
        self._q.put(functools.partial(self._execute_tail, handle, job))

    def holds(self, handle: SaveHandle) -> bool:
        """Is ``handle``'s job the held tail (not queued yet)?"""
        with self._lock:
            return self._held is not None and self._held[0] is handle

    def release(self) -> None:
        """Queue the held tail job, if there is one."""
        with self._lock:
            held, self._held = self._held, None
            if held is None:
                return
            self._ensure_worker()
        self._q.put(functools.partial(self._execute_tail, *held))

    def _execute_tail(self, handle: SaveHandle, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException:  # noqa: BLE001 - a tail never fails the store's next call
            log.exception("s4weights: background %s of step %d to %s raised", handle.what, handle.step, self.url)
        del job
        handle.finish(None, None)

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
        handle.finish(info, error)

    def stop(self) -> None:
        """End the worker thread once its queue is empty (a later submit starts a new one), and
        wait for it to end: a thread that ran torch code and is still ending while the
        interpreter shuts down can abort the process."""
        with self._lock:
            t, self._thread = self._thread, None
            side, self._side_thread = self._side_thread, None
        for thread, q in ((t, self._q), (side, self._side_q)):
            if thread is not None:
                q.put(None)
                if thread is not threading.current_thread():
                    thread.join(timeout=30)

    # -- exit and garbage collection
    def drain_quietly(self, why: str) -> None:
        """Wait for the save in flight; log (ERROR) a failure nobody has seen.  Never raises."""
        try:
            h = self.inflight
            if h is not None and not h.done():
                log.info("s4weights: %s: waiting for the background %s of step %d to %s", why, h.what, h.step, self.url)
                h.wait_done()
            tail = self.cancel_tail()  # at exit or in a finalizer: stop it rather than wait it out
            self.release()  # (a held one, not cancellable: it runs)
            if tail is not None:
                tail.wait_done()
            self.wait_side(None)
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
    prof = pipeline.resolve_profile(profile, jobs)
    on_cuda = any(j.raw.device.type == "cuda" for j in jobs)
    if on_cuda and prof in ("fast", "portable") and pipeline.gpu_backend() is not None:
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
    index: dict[int, int] = {}  # id of each tensor of ``state`` -> its entry (``col.add`` knows them all)
    encode_tree(state, lambda t, path: index.setdefault(id(t), col.add(t, path)))
    memo: dict[int, Any] = {}
    for tid, idx in index.items():
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

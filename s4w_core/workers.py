"""The CPU path's thread pool and its ordered maps: segments coded or decoded by a pool, results
taken in order, with bounded memory; and whether a thread's work is waited for."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "DECODE_WINDOW_PER_THREAD", "Pool", "executor", "foreground", "in_foreground", "ordered", "ordered_window", "segments",
]

_FOREGROUND: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("s4w_foreground", default=None)


@contextlib.contextmanager
def foreground(when: Callable[[], bool]) -> Iterator[None]:
    """Within it (on this thread), background work is one that a caller waits for whenever
    ``when()`` says so: a store's re-encoding while the training thread blocks in ``wait()`` or in
    the next save. A GPU save of host copies then codes in a blocking save's batches instead of
    keeping within the device-memory bound of work that runs beside training steps
    (``s4w_core.gpu``: ``host_work``, asked again as the save goes)."""
    token = _FOREGROUND.set(when)
    try:
        yield
    finally:
        _FOREGROUND.reset(token)


def in_foreground() -> bool:
    """Whether this thread's current work is waited for now (:func:`foreground`)."""
    when = _FOREGROUND.get()
    return when is not None and when()


class Pool(ThreadPoolExecutor):
    """A thread pool that says how many workers it has (:attr:`workers`): the ordered maps below
    size their windows by it, and run a one-thread pool's calls on the caller's thread."""

    def __init__(self, workers: int, thread_name_prefix: str = "") -> None:
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, not {workers}")
        super().__init__(max_workers=workers, thread_name_prefix=thread_name_prefix)
        self.workers = workers


def segments(n: int, seg: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each segment of ``seg`` elements of ``n`` elements (the last one shorter)."""
    for s in range(0, n, seg):
        yield s, min(n, s + seg)


def executor(threads: int | None) -> Pool:
    """The CPU path's pool: ``threads`` workers, or one per core up to 8."""
    return Pool(threads or min(8, os.cpu_count() or 1))


def ordered(pool: Pool, fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]]) -> Iterator[Any]:
    """``fn(*args)`` for each of ``calls``, results in order: all submitted to ``pool`` at once,
    except that a one-thread pool runs each call right here when its result is wanted (handing
    every chunk to a single worker and waiting for it only adds two thread switches per chunk,
    with small tensors more than the coding itself). An exception is raised where its result is
    taken, as ``Future.result`` raises it."""
    if pool.workers > 1:
        futs = [pool.submit(fn, *args) for args in calls]
        return (f.result() for f in futs)
    return (fn(*args) for args in calls)


#: calls :func:`ordered_window` keeps in flight per worker thread
DECODE_WINDOW_PER_THREAD = 4


def ordered_window(pool: Pool | None, fn: Callable[..., Any], n: int) -> Iterator[Any]:
    """``fn(i)`` for ``i in range(n)``, results in order, with at most
    :data:`DECODE_WINDOW_PER_THREAD` calls per worker submitted ahead of the one being taken (a
    one-thread pool, or none, runs each call here). What a storage's decode holds and queues is
    bounded by the window, never by the chunk count a file claims; when a call fails, the calls
    not yet started are cancelled."""
    if pool is None or pool.workers <= 1:
        for i in range(n):
            yield fn(i)
        return
    window = pool.workers * DECODE_WINDOW_PER_THREAD
    futs: collections.deque[Any] = collections.deque()
    nxt = 0
    try:
        while nxt < n or futs:
            while nxt < n and len(futs) < window:
                futs.append(pool.submit(fn, nxt))
                nxt += 1
            yield futs.popleft().result()
    finally:
        for f in futs:
            f.cancel()



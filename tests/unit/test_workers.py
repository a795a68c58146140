"""The CPU path's pool (``s4w_core.workers.Pool``) and its ordered maps: the worker count they size
by is the pool's own public ``workers``, results come in order, a one-thread pool runs its calls on
the caller's thread, and a windowed map never has more than its window submitted."""

from __future__ import annotations

import os
import threading

import pytest

from s4w_core import engine
from s4w_core.workers import DECODE_WINDOW_PER_THREAD, Pool, executor, ordered, ordered_window


def test_pool_says_its_worker_count() -> None:
    with Pool(3, "s4w-test") as pool:
        assert pool.workers == 3
        assert pool.submit(threading.current_thread).result().name.startswith("s4w-test")
    with executor(None) as pool:
        assert isinstance(pool, Pool) and pool.workers == min(8, os.cpu_count() or 1)
    with engine.executor(2) as pool:  # the engine's pool is the same kind
        assert pool.workers == 2


def test_pool_refuses_no_workers() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        Pool(0)


@pytest.mark.parametrize("workers", [1, 3])
def test_ordered_keeps_order_and_runs_a_one_thread_pool_here(workers: int) -> None:
    here = threading.get_ident()
    with Pool(workers) as pool:
        out = list(ordered(pool, lambda i: (i * i, threading.get_ident()), [(i,) for i in range(20)]))
    assert [v for v, _ in out] == [i * i for i in range(20)]
    assert all((t == here) == (workers == 1) for _, t in out)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_ordered_window_bounds_what_is_submitted(workers: int) -> None:
    lock = threading.Lock()
    started: list[int] = []
    taken = 0

    def fn(i: int) -> int:
        with lock:
            started.append(i)
        return -i

    with Pool(workers) as pool:
        out = []
        for v in ordered_window(pool, fn, 50):
            # nothing beyond the window ahead of the result just taken was ever submitted
            with lock:
                assert max(started) < taken + (1 if workers == 1 else workers * DECODE_WINDOW_PER_THREAD)
            out.append(v)
            taken += 1
    assert out == [-i for i in range(50)]


def test_ordered_window_raises_in_order_and_cancels_the_rest() -> None:
    ran: list[int] = []
    gate = threading.Event()

    def fn(i: int) -> int:
        if i == 0:
            raise OSError("chunk 0")
        ran.append(i)
        gate.wait(5)  # the workers stay busy until the failure was taken
        return i

    with Pool(2) as pool:
        with pytest.raises(OSError, match="chunk 0"):
            next(ordered_window(pool, fn, 1000))
        gate.set()
    # the two workers had started at most one call each; the window's other calls were cancelled
    assert len(ran) <= 2, ran

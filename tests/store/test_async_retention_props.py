"""Property tests (hypothesis): random sequences of non-blocking saves, saves under the store's
own ``keep_last``, a framework's rotation (``drop_pending`` before a save, the delete after it,
``expect_drop`` of what the next rotation deletes),
loads that keep the newest step's bytes, overwrites, deletes and pins, with the background work
(saves, re-encodings, their cancellation) left running between operations, never lose or change
a kept step and never leave data no kept step needs."""

from __future__ import annotations

import os
import uuid
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from s4w_core.errors import AsyncSaveError
from s4w_core.store import CheckpointStore, SaveHandle
from s4w_core.store.records import DATA, needed_hidden

from .helpers import Crash, FaultyBackend, memory_urls, scratch_dir
from .test_retention_props import _equal, _state

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.integers(1, 3)),  # a blocking save, step gap
        st.tuples(st.just("save_async"), st.integers(1, 3)),  # a non-blocking save, step gap
        # a non-blocking (odd) or blocking (even) save of a step below the newest that is not
        # committed (a deleted one, or a gap); keep_last may delete it at once
        st.tuples(st.just("save_below"), st.integers(1, 8)),
        st.tuples(st.just("keep"), st.integers(0, 3)),  # the store's keep_last (0: None)
        st.tuples(st.just("rotate"), st.integers(1, 3)),  # a save, then delete all but the newest k (+ pinned)
        st.tuples(st.just("delete"), st.integers(0, 50)),  # which (mod len)
        st.tuples(st.just("drop"), st.integers(0, 50)),  # drop_pending of a step, not deleted
        st.tuples(st.just("expect"), st.integers(0, 50)),  # expect_drop of a step, not (yet) deleted
        st.tuples(st.just("pin"), st.integers(0, 50)),  # pin / unpin (toggle)
        st.tuples(st.just("overwrite"), st.integers(0, 50)),
        st.tuples(st.just("load"), st.integers(0, 50)),  # a load (the newest: remembered)
        st.tuples(st.just("reopen"), st.integers(0, 1)),  # a new store object (1: load the newest first)
        st.tuples(st.just("wait"), st.just(0)),
        # a process that dies at the k-th write of a non-blocking save and the re-encoding
        # behind it (a store object of its own; nothing more is written after that)
        st.tuples(st.just("crash"), st.integers(0, 8)),
    ),
    min_size=1,
    max_size=24,
)


def _retain(expected: dict[int, dict], pinned: set[int], keep: int) -> None:
    """The model of ``keep_last``: the newest ``keep`` steps and the pinned ones stay."""
    stay = set(sorted(expected)[-keep:]) | pinned
    for s in [s for s in expected if s not in stay]:
        del expected[s]


def _check(store: CheckpointStore, expected: dict[int, dict]) -> None:
    store.wait(timeout=60)  # (a hang fails, not blocks the run)
    assert store.steps() == sorted(expected)
    fresh = CheckpointStore(store.url, base_cache_bytes=0, _backend=store.backend)  # the (slow) store alone
    for s, state in expected.items():
        assert _equal(fresh.load(s), state), f"step {s}"
    every = store._read_records()  # noqa: SLF001 - the hidden records too
    assert {s for s, r in every.items() if r.hidden} == needed_hidden(every)
    slow = every if store.tiers is None else store.tier_views()[1]
    live = {o for r in slow.values() for o in r.live_objects}
    data = {o.key for o in store.backend.list(DATA)}
    assert data == live, f"unreclaimed: {sorted(data - live)}; missing: {sorted(live - data)}"
    if store.tiers is not None:  # the fast tier: its newest steps, what their chains need, nothing else
        fast = store.tier_views()[0]
        assert set(fast) <= set(every)
        fast_live = {o for r in fast.values() for o in r.live_objects}
        fast_data = {o.key for o in store.tiers.fast.list(DATA)}
        assert fast_data == fast_live, f"fast tier unreclaimed: {sorted(fast_data - fast_live)}; missing: {sorted(fast_live - fast_data)}"
        for s, state in expected.items():
            assert _equal(store.load(s), state), f"step {s} through the tiers"
    for r in every.values():
        assert r.depth < store.keyframe_every
        if r.kind == "delta":
            assert r.reverse and r.base_step in every


def _run(url: str, ops: list, keyframe_every: int, fast: tuple[str, int] | None = None) -> None:
    def open_store() -> CheckpointStore:
        if fast is None:
            return CheckpointStore(url, keyframe_every=keyframe_every, profile="portable")
        return CheckpointStore(
            url, keyframe_every=keyframe_every, profile="portable", fast_tier=fast[0], fast_keep_last=fast[1]
        )

    store = open_store()
    expected: dict[int, dict] = {}
    pinned: set[int] = set()
    keep: int | None = None
    pending: SaveHandle | None = None  # the non-blocking save in flight
    step = 0
    try:
        for i, (op, a) in enumerate(ops):
            if pending is not None and (pending.done() or op in ("keep", "delete", "pin", "overwrite")):
                # a save in flight applies its retention when it commits: these wait for it (a
                # re-encoding behind it still runs), so that the model knows the order
                pending.result(timeout=60)  # (a hang fails, not blocks the run)
                pending = None
            nth = sorted(expected)[a % len(expected)] if expected else None
            if op in ("save", "save_async", "rotate"):
                step += a if op != "rotate" else 1
                state = _state(step)
                doomed: list[int] = []
                if op == "rotate":  # a framework: the steps its rotation deletes after this save
                    doomed = [s for s in sorted(expected)[: max(0, len(expected) + 1 - a)] if s not in pinned]
                    for s in doomed:
                        store.drop_pending(s)
                if op == "save_async":
                    pending = store.save_async(state, step)
                else:
                    store.save(state, step)
                expected[step] = state
                if keep is not None:
                    _retain(expected, pinned, keep)
                for s in doomed:  # the framework deletes once the save is durable
                    if s in expected:
                        store.delete(s)
                        del expected[s]
                if op == "rotate":  # ... and knows which steps the next rotation deletes
                    for s in sorted(expected)[: max(0, len(expected) + 1 - a)]:
                        if s not in pinned:
                            store.expect_drop(s)
            elif op == "save_below" and expected and max(expected) - (a + 1) // 2 >= 1:
                s = max(expected) - (a + 1) // 2
                if s not in expected:
                    expected[s] = _state(s, version=i + 1)
                    if a % 2:
                        pending = store.save_async(expected[s], s)
                    else:
                        store.save(expected[s], s)
                    if keep is not None:
                        _retain(expected, pinned, keep)
            elif op == "keep":
                keep = a or None
                store.keep_last = keep
            elif op == "delete" and nth is not None:
                store.delete(nth)
                del expected[nth]
                pinned.discard(nth)
            elif op == "drop" and nth is not None:
                store.drop_pending(nth)
            elif op == "expect" and nth is not None:
                store.expect_drop(nth)
            elif op == "pin" and nth is not None:
                if nth in pinned:
                    store.unpin(nth)
                    pinned.discard(nth)
                else:
                    store.pin(nth)
                    pinned.add(nth)
            elif op == "overwrite" and nth is not None:
                expected[nth] = _state(nth, version=i + 1)
                store.save(expected[nth], nth, overwrite=True)
                if keep is not None:
                    _retain(expected, pinned, keep)
            elif op == "load" and nth is not None:
                assert _equal(store.load(nth), expected[nth]), f"step {nth}"
            elif op == "reopen":
                store.close()
                pending = None
                store = open_store()
                store.keep_last = keep
                if a and expected:
                    assert _equal(store.load(), expected[max(expected)])
            elif op == "wait":
                store.wait()
            elif op == "crash":
                step += 1
                state = _state(step)
                if _crashed_save(store, state, step, a):
                    expected[step] = state
            if op not in ("save", "save_async", "save_below", "drop"):  # background work runs into the next op
                _check(store, expected)
        _check(store, expected)
    finally:
        store.close()


def _crashed_save(store: CheckpointStore, state: dict, step: int, k: int) -> bool:
    """``save_async(state, step)`` through a backend that dies at its k-th write, on a store
    object that is then abandoned (a killed process); then ``gc()`` on ``store``.  True if
    the step was committed."""
    store.wait()
    calls = [0]

    def fail(verb: str, key: str) -> bool:
        if verb in ("writer", "put", "delete"):
            calls[0] += 1
        return calls[0] > k

    tiers: dict[str, Any] = {}
    if store.tiers is not None:  # the same process configuration: its fast tier dies with it
        tiers = {"_fast_backend": FaultyBackend(store.tiers.fast, fail), "fast_keep_last": store.tiers.keep_last}
    crashing = CheckpointStore(
        store.url,
        keyframe_every=store.keyframe_every,
        profile="portable",
        _backend=FaultyBackend(store.backend, fail),
        **tiers,
    )
    try:
        crashing.save_async(state, step)
        crashing.wait(timeout=60)  # a re-encoding that dies is logged, never raised
    except (Crash, AsyncSaveError):
        pass
    finally:
        crashing._pipe.stop()  # noqa: SLF001 - abandoned, like a killed process
    if store.tiers is not None:
        store.sync()  # a step committed on the fast tier whose upload died: uploaded now
    store.gc(grace_seconds=0)
    return step in store.steps()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, keyframe_every=st.integers(1, 4))
# a non-blocking save of a step its own keep_last deletes: the delete, on the worker, must not
# wait for the save it runs in (f5342a0's Pipeline.land hung there)
@example(ops=[("save", 1), ("save", 2), ("keep", 1), ("save_below", 1)], keyframe_every=2)
def test_async_sequences_memory(ops: list, keyframe_every: int) -> None:
    with memory_urls("aprop") as (url,):
        _run(url, ops, keyframe_every)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, keyframe_every=st.integers(2, 4))
def test_async_sequences_local(ops: list, keyframe_every: int) -> None:
    with scratch_dir("s4w-aprop-") as d:
        _run(d, ops, keyframe_every)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, keyframe_every=st.integers(1, 4), fast_keep_last=st.integers(1, 3))
def test_async_sequences_tiered(ops: list, keyframe_every: int, fast_keep_last: int) -> None:
    """A memory store with a fast tier (memory too): saves commit there and upload behind."""
    with memory_urls("slow", "fast") as (slow, fast):
        _run(slow, ops, keyframe_every, (fast, fast_keep_last))


@pytest.mark.s3
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, keyframe_every=st.integers(2, 4))
def test_async_sequences_s3(seaweedfs: Any, ops: list, keyframe_every: int) -> None:
    """The same on a real S3 server (SeaweedFS): conditional commits, ranged reads, listings."""
    # the S3 client's environment for this example (hypothesis reruns the body, not the fixtures)
    with mock.patch.dict(os.environ, seaweedfs.env()):
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
            os.environ.pop(k, None)
        _run(f"s3://{seaweedfs.bucket}/aprop-{uuid.uuid4().hex[:12]}", ops, keyframe_every)

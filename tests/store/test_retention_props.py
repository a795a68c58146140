"""Property tests (hypothesis): random save / delete / pin / retention / crash sequences never
break a kept step, and never leave data that no kept step needs (storage is reclaimed; after a
crash, once ``gc()`` ran)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from s4w_core.errors import CheckpointNotFoundError
from s4w_core.store import CheckpointStore
from s4w_core.store.records import DATA, needed_hidden

from .helpers import Crash, FaultyBackend, memory_urls, scratch_dir

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.integers(1, 3), st.booleans()),  # step gap, force keyframe
        st.tuples(st.just("delete"), st.integers(0, 50), st.booleans()),  # which (mod len), rebase
        st.tuples(st.just("pin"), st.integers(0, 50), st.booleans()),  # which, pin/unpin
        st.tuples(st.just("retain"), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("overwrite"), st.integers(0, 50), st.booleans()),
        # a crash at the k-th write of a save (and the re-encoding behind it) or of a delete:
        # from there on nothing more is written, as if the process had been killed
        st.tuples(st.just("crash"), st.integers(0, 8), st.booleans()),
    ),
    min_size=1,
    max_size=18,
)


def _state(step: int, version: int = 0) -> dict:
    g = torch.Generator().manual_seed(step * 7 + version)
    base = torch.linspace(-1, 1, 512)
    return {
        "w": (base + 1e-3 * step + 1e-4 * torch.randn(512, generator=g)).to(torch.bfloat16),
        "m": torch.randn(256, generator=g),
        "v": (base.abs() * (1 + 1e-3 * step)),
        "step": step,
        "v_": version,
    }


def _equal(a: dict, b: dict) -> bool:
    return all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        for k in a
    ) and a.keys() == b.keys()


def _check(store: CheckpointStore, expected: dict[int, dict]) -> None:
    store.wait()  # the step below the newest is re-encoded behind the save
    assert store.steps() == sorted(expected)
    fresh = CheckpointStore(store.url, base_cache_bytes=0, _backend=store.backend)
    for s, state in expected.items():
        assert _equal(fresh.load(s), state), f"step {s}"
    every = store._read_records()  # noqa: SLF001 - the hidden records too
    hidden = {s for s, r in every.items() if r.hidden}
    assert hidden == needed_hidden(every), "a deleted step is kept only while a kept step's chain reaches it"
    live = {o for r in every.values() for o in r.live_objects}
    data = {o.key for o in store.backend.list(DATA)}
    assert data == live, f"unreclaimed: {sorted(data - live)}; missing: {sorted(live - data)}"
    recs = store.list()
    for r in every.values():
        assert r.depth < store.keyframe_every
        assert r.objects == (r.object,) and r.copy is None, "one data object per step"
        if r.kind == "delta":  # against a newer step that is committed, or hidden and kept for it
            assert r.reverse and r.base_step in every
    assert not recs or recs[-1].kind == "keyframe", "the newest step is whole"


def _crash(store: CheckpointStore, expected: dict[int, dict], pinned: set[int], k: int, save: bool, step: int) -> int:
    """Save a new step (or delete one) through a backend that dies at its k-th write; then
    reconcile ``expected`` with what is committed and reclaim the leftovers.  Returns the step."""
    calls = [0]

    def fail(verb: str, key: str) -> bool:
        if verb in ("writer", "put", "delete"):
            calls[0] += 1
        return calls[0] > k

    crashing = CheckpointStore(
        store.url, keyframe_every=store.keyframe_every, profile="portable", _backend=FaultyBackend(store.backend, fail)
    )
    try:
        if save:
            step += 1
            state = _state(step)
            try:
                crashing.save(state, step)
                crashing.wait()  # a re-encoding that dies is logged, never raised
            except Crash:
                pass
            if step in store.steps():
                expected[step] = state
        elif expected:
            s = sorted(expected)[k % len(expected)]
            try:
                crashing.delete(s)
            except Crash:
                pass
            if s not in store.steps():
                del expected[s]
                pinned.discard(s)
    finally:
        crashing._pipe.stop()  # noqa: SLF001 - abandoned, like a killed process
    store.gc(grace_seconds=0)
    return step


def _run(url: str, ops: list, keyframe_every: int) -> None:
    store = CheckpointStore(url, keyframe_every=keyframe_every, profile="portable")
    expected: dict[int, dict] = {}
    pinned: set[int] = set()
    step = 0
    for op, a, b in ops:
        if op == "save":
            step += a
            expected[step] = _state(step)
            store.save(expected[step], step, keyframe=b and a == 3)
        elif op == "overwrite" and expected:
            s = sorted(expected)[a % len(expected)]
            expected[s] = _state(s, version=a + 1)
            store.save(expected[s], s, overwrite=True)
        elif op == "delete" and expected:
            s = sorted(expected)[a % len(expected)]
            store.delete(s, rebase=b)
            del expected[s]
            pinned.discard(s)
        elif op == "pin" and expected:
            s = sorted(expected)[a % len(expected)]
            if b:
                store.pin(s)
                pinned.add(s)
            else:
                store.unpin(s)
                pinned.discard(s)
        elif op == "crash":
            step = _crash(store, expected, pinned, a, b, step)
        elif op == "retain":
            store.keep_last = a
            deleted = store.apply_retention()
            store.keep_last = None
            keep = set(sorted(expected)[-a:]) | pinned
            assert set(deleted) == set(expected) - keep
            for s in deleted:
                del expected[s]
        _check(store, expected)
    # a step that is gone stays gone
    if step:
        gone = [s for s in range(1, step + 1) if s not in expected]
        for s in gone[:2]:
            try:
                store.load(s)
            except CheckpointNotFoundError:
                pass
            else:  # pragma: no cover
                raise AssertionError(f"deleted step {s} still loads")


_SAVE = ("save", 1, False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, keyframe_every=st.integers(1, 4))
# an overwrite re-codes the delta below against the step above the replaced one; that step's
# own re-encoding then lengthens the chain through it (depth 2 with keyframe_every=2)
@example(ops=[_SAVE, _SAVE, _SAVE, ("overwrite", 1, False), _SAVE], keyframe_every=2)
# overwriting the only step whose chain reached a deleted step lets that step go
@example(ops=[_SAVE, _SAVE, _SAVE, ("delete", 1, False), ("overwrite", 0, False)], keyframe_every=2)
def test_random_sequences_memory(ops: list, keyframe_every: int) -> None:
    with memory_urls("prop") as (url,):
        _run(url, ops, keyframe_every)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, keyframe_every=st.integers(2, 4))
def test_random_sequences_local(ops: list, keyframe_every: int) -> None:
    with scratch_dir("s4w-prop-") as d:
        _run(d, ops, keyframe_every)

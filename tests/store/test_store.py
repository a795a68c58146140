"""The store test suite: every test runs on a local directory, on real S3 (SeaweedFS) and in memory."""

from __future__ import annotations

import threading

import pytest
import torch

import s4w_core
from s4w_core.errors import CheckpointNotFoundError, ConflictError
from s4w_core.store import CheckpointStore, load_checkpoint, save_checkpoint
from s4w_core.store.records import DATA

from .helpers import bits_equal, make_run


def data_keys(st: CheckpointStore) -> set[str]:
    return {o.key for o in st.backend.list(DATA)}


def test_chain_roundtrip_bit_exact_with_bounded_chain(store_url: str) -> None:
    run = make_run(11)
    st = CheckpointStore(store_url, keyframe_every=4, profile="portable")
    infos = [st.save(s, step=10 * i) for i, s in enumerate(run)]
    assert all(i.kind == "keyframe" for i in infos), "every save writes its step whole"
    st.wait()  # the step below the newest becomes a delta against it behind the save
    assert st.steps() == [10 * i for i in range(11)]
    recs = st.list()
    assert recs[-1].kind == "keyframe"
    assert max(r.depth for r in recs) <= 3, "keyframe_every=4 bounds the chain at 3 deltas"
    assert [r.kind for r in recs] == (["delta"] * 3 + ["keyframe"]) * 2 + ["delta", "delta", "keyframe"]
    for r in recs:
        if r.kind == "delta":  # against the next step, found through its commit record
            assert r.base_step == r.step + 10 and r.objects == (r.object,)
    # a fresh store object (no cache) reads every step back bit for bit
    st2 = CheckpointStore(store_url)
    for i, s in enumerate(run):
        assert bits_equal(st2.load(10 * i), s), f"step {10 * i}"
    assert bits_equal(st2.load(), run[-1])  # default: latest
    loaded = st2.load(20)
    assert loaded["model"]["emb_view"].untyped_storage().data_ptr() == loaded["model"]["emb"].untyped_storage().data_ptr()


def test_delta_is_smaller_than_keyframe_and_sizes_add_up(store_url: str) -> None:
    run = make_run(3, n=20000)
    st = CheckpointStore(store_url, profile="portable")
    for i, s in enumerate(run):
        st.save(s, step=i)
    st.wait()
    a, b, c = st.list()
    assert b.kind == "delta" and b.object_bytes < c.object_bytes and c.kind == "keyframe"
    sz = st.sizes()
    assert sz["steps"] == 3 and sz["keyframes"] == 1
    assert sz["raw_bytes"] == a.raw_bytes + b.raw_bytes + c.raw_bytes
    assert sz["stored_bytes"] == sz["physical_bytes"] == a.object_bytes + b.object_bytes + c.object_bytes
    assert sz["base_only_bytes"] == sz["copy_bytes"] == sz["unreferenced_bytes"] == 0
    assert set(sz["kinds"]) >= {"weights", "exp_avg", "exp_avg_sq"}
    assert (a.base_step, b.base_step, c.base_step) == (1, 2, None)


def test_delta_ops_recorded(store_url: str) -> None:
    run = make_run(2, n=50000)
    st = CheckpointStore(store_url, profile="portable")
    st.save(run[0], 0)
    st.save(run[1], 1)
    st.wait()
    m = st.container_info(0)
    assert m["delta_storages"] >= 2
    import json

    rec = json.loads(st.backend.get("commits/step_000000000000.json"))
    assert rec["kind"] == "delta" and rec["base_step"] == 1 and rec["version"] == 2


def test_existing_step_conflict_and_overwrite(store_url: str) -> None:
    run = make_run(4)
    st = CheckpointStore(store_url, profile="portable")
    for i in range(3):
        st.save(run[i], i)
    with pytest.raises(ConflictError, match="already committed"):
        st.save(run[3], 1)
    st.save(run[3], 1, overwrite=True)
    assert bits_equal(st.load(1), run[3])
    assert bits_equal(st.load(2), run[2]), "a delta on the overwritten step keeps its own base"
    st.delete(2)
    st.gc(grace_seconds=0)
    assert bits_equal(st.load(1), run[3]) and bits_equal(st.load(0), run[0])


def test_missing_step_and_empty_store(store_url: str) -> None:
    st = CheckpointStore(store_url)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        st.load()
    st.save({"x": torch.ones(3)}, 5)
    with pytest.raises(CheckpointNotFoundError, match="no committed step 6"):
        st.load(6)
    with pytest.raises(CheckpointNotFoundError):
        st.delete(7)
    assert st.latest() == 5


def test_delete_hides_a_middle_step_writes_nothing_and_reclaims(store_url: str) -> None:
    run = make_run(6)
    st = CheckpointStore(store_url, keyframe_every=10, profile="portable")
    for i, s in enumerate(run):
        st.save(s, i)
    st.wait()
    before = {r.step: r for r in st.list()}
    assert [before[i].base_step for i in range(6)] == [1, 2, 3, 4, 5, None]
    st.delete(0)  # the oldest: nothing depends on it, nothing is re-coded
    assert st.steps() == [1, 2, 3, 4, 5]
    st.wait()  # its data goes behind the call
    assert {r.step: r.object for r in st.list()} == {i: before[i].object for i in range(1, 6)}
    assert before[0].object not in data_keys(st) and st.sizes()["base_only_bytes"] == 0
    keys = data_keys(st)
    st.delete(3)  # a middle step: step 2 is a delta against it: hidden, nothing re-coded
    assert st.steps() == [1, 2, 4, 5] and data_keys(st) == keys
    assert {r.step: r.object for r in st.list()} == {i: before[i].object for i in (1, 2, 4, 5)}
    assert st.info(2).base_step == 3 and st.sizes()["hidden_bytes"] == before[3].object_bytes
    with pytest.raises(CheckpointNotFoundError):
        st.load(3)
    st.delete(5)  # the newest: step 4, a delta against it, becomes whole
    assert st.info(4).kind == "keyframe" and st.info(4).base_step is None
    for i in (1, 2, 4):
        assert bits_equal(st.load(i), run[i])
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])
    sizes = st.sizes()
    assert sizes["unreferenced_bytes"] == 0 and sizes["hidden_bytes"] == before[3].object_bytes
    st.delete(2)  # step 1 is a delta against it: hidden too; step 3 still needed through it
    assert st.steps() == [1, 4] and bits_equal(st.load(1), run[1])
    st.delete(1)  # nothing needs the hidden steps any more: collected, records and data
    st.wait()
    assert st.steps() == [4] and data_keys(st) == {st.info(4).object}
    assert st.sizes()["hidden_bytes"] == 0
    st.save(run[3], 3)  # a step number that was hidden can be saved again
    assert bits_equal(st.load(3), run[3])
    for s in list(st.steps()):
        st.delete(s)
    st.wait()
    assert st.steps() == [] and data_keys(st) == set(), "all data reclaimed once nothing needs it"


def test_delete_with_rebase_reclaims_now(store_url: str) -> None:
    run = make_run(5)
    st = CheckpointStore(store_url, profile="portable")
    for i, s in enumerate(run):
        st.save(s, i)
    old0 = st.info(0).object
    st.delete(0, rebase=True)
    assert old0 not in data_keys(st), "the deleted step's data is gone at once"
    for i in range(1, 5):
        assert bits_equal(st.load(i), run[i])
    assert data_keys(st) == {o for r in st.list() for o in r.live_objects}
    st.delete(2, rebase=True)
    assert st.info(1).base_step == 3
    for i in (1, 3, 4):
        assert bits_equal(st.load(i), run[i])
    assert data_keys(st) == {o for r in st.list() for o in r.live_objects}


def test_retention_keep_last_and_pins(store_url: str) -> None:
    run = make_run(8)
    st = CheckpointStore(store_url, keep_last=2, keyframe_every=3, profile="portable")
    st.save(run[0], 0)
    st.pin(0)
    for i in range(1, 8):
        st.save(run[i], i)
    st.wait()
    assert st.steps() == [0, 6, 7]
    assert st.info(0).pinned and st.info(0).kind == "keyframe", "a pinned step stays whole"
    assert st.info(6).base_step == 7 and st.info(7).kind == "keyframe"
    for i in (0, 6, 7):
        assert bits_equal(st.load(i), run[i])
    live = {o for r in st.list() for o in r.live_objects}
    assert data_keys(st) == live, "nothing but what kept steps need"
    assert len(live) == 3, "one data object per kept step"
    st.unpin(0)
    st.apply_retention()
    assert st.steps() == [6, 7]


def test_base_reread_equals_cached(store_url: str) -> None:
    run = make_run(4)
    a = CheckpointStore(store_url + "-a" if "://" in store_url else store_url + "_a", profile="portable")
    b = CheckpointStore(store_url + "-b" if "://" in store_url else store_url + "_b", profile="portable", base_cache_bytes=0)
    for i, s in enumerate(run):
        ia, ib = a.save(s, i), b.save(s, i)
        # the coded chunks (stored_bytes): the object's size also counts its compressed manifest,
        # whose size follows the creation time and the store's URL (the base refs) by a byte or two
        assert (ia.kind, ia.stored_bytes) == (ib.kind, ib.stored_bytes), "same bytes whether the base is cached or re-read"
    for i, s in enumerate(run):
        assert bits_equal(b.load(i), s)


def test_resume_in_new_process_continues_chain(store_url: str) -> None:
    run = make_run(4)
    st = CheckpointStore(store_url, profile="portable")
    st.save(run[0], 0)
    st.save(run[1], 1)
    st2 = CheckpointStore(store_url, profile="portable")
    assert bits_equal(st2.load(), run[1])  # the load leaves the base cached
    assert st2._cache is not None and st2._cache.step == 1
    info = st2.save(run[2], 2)
    assert info.kind == "keyframe"
    st2.wait()
    assert st2.info(1).kind == "delta" and st2.info(1).base_step == 2
    fresh = CheckpointStore(store_url)
    for i in range(3):
        assert bits_equal(fresh.load(i), run[i])


def test_module_functions(store_url: str) -> None:
    run = make_run(3)
    for i, s in enumerate(run):
        info = save_checkpoint(s, i * 100, store_url, profile="portable")
    assert info.kind == "keyframe"
    assert bits_equal(load_checkpoint(store_url), run[-1])
    assert bits_equal(s4w_core.load_checkpoint(store_url, step=100), run[1])


def test_concurrent_reader_never_sees_partial(store_url: str) -> None:
    run = make_run(8)
    st = CheckpointStore(store_url, profile="portable", keep_last=3)
    st.save(run[0], 0)
    errors: list[BaseException] = []
    seen: set[int] = set()
    stop = threading.Event()

    def reader() -> None:
        rd = CheckpointStore(store_url, base_cache_bytes=0)
        while not stop.is_set():
            try:
                steps = rd.steps()
                s = steps[-1]
                got = rd.load(s)
                if not bits_equal(got, run[s]):
                    errors.append(AssertionError(f"step {s} differs"))
                seen.add(s)
            except CheckpointNotFoundError:
                pass  # retention deleted the step between listing and loading: allowed
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(1, 8):
            st.save(run[i], i)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert seen


def test_delete_returns_before_its_data_is_removed(store_url: str) -> None:
    """Deleting a step hides it at once and removes its data object behind the call, on the store's
    clean-up thread (a large object's unlink takes ~0.1-0.2 s a GB; a framework's rotation deletes a
    step per save): the deleting thread does not wait for the backend's delete, and
    :meth:`~CheckpointStore.sizes` and :meth:`~CheckpointStore.wait` do."""
    from s4w_core.store import open_backend

    from .helpers import FaultyBackend

    run = make_run(3)
    release = threading.Event()
    entered = threading.Event()
    held: list[str] = []  # the data object whose delete is held

    def hold(verb: str, key: str) -> bool:
        if verb == "delete" and held and key == held[0]:
            entered.set()
            assert release.wait(30), "the test never released the delete"
        return False

    st = CheckpointStore(store_url, profile="portable", _backend=FaultyBackend(open_backend(store_url), hold))
    for i, s in enumerate(run):
        st.save(s, i)
    st.wait()
    old0 = st.info(0).object
    held.append(old0)
    st.delete(0)  # the oldest: its data only it needs
    assert st.steps() == [1, 2]
    assert entered.wait(30), "the data delete was never started"
    assert old0 in data_keys(st), "the deleting thread did not wait for the backend's delete"
    sizes: list[dict[str, object]] = []
    t = threading.Thread(target=lambda: sizes.append(st.sizes()))
    t.start()
    t.join(0.3)
    assert t.is_alive(), "sizes() waits for the decided deletes"
    release.set()
    t.join(30)
    assert sizes and sizes[0]["unreferenced_bytes"] == 0
    st.wait()
    assert old0 not in data_keys(st)
    for i in (1, 2):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])

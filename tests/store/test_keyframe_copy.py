"""The newest delta step's keyframe copy (docs/STORE.md, "Keyframe copies"): written behind the
save, read by a load instead of the chain, cancelled by the next save, removed once stale, and
never trusted blindly: a missing, corrupt or foreign copy falls back to the chain."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import IO, Any, Iterator

import pytest

from s4w_core import obs
from s4w_core.errors import ManifestError
from s4w_core.store import CheckpointStore, open_backend
from s4w_core.store.store import _DATA

from .helpers import FaultyBackend, bits_equal, make_run


def _filled(url: str, saves: int, runs: int | None = None, **opts: Any) -> tuple[CheckpointStore, list[dict[str, Any]]]:
    """A portable store with steps ``0..saves-1`` of a fake run of ``runs`` states, idle."""
    run = make_run(runs if runs is not None else saves)
    st = CheckpointStore(url, profile="portable", **opts)
    for i in range(saves):
        st.save(run[i], i)
    st.wait()
    return st, run


def _data(st: CheckpointStore) -> set[str]:
    return {o.key for o in st.backend.list(_DATA)}


def _live(st: CheckpointStore) -> set[str]:
    return {o for r in st.list() for o in r.live_objects}


@contextlib.contextmanager
def _events() -> Iterator[list[obs.OpEvent]]:
    got: list[obs.OpEvent] = []
    obs.subscribe(got.append)
    try:
        yield got
    finally:
        obs.unsubscribe(got.append)


class _Reads(FaultyBackend):
    """Records the data objects a load reads whole (``reads``) and those it opens for ranged
    reads (``ranged``: a manifest)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, lambda verb, key: False)
        self.reads: list[str] = []
        self.ranged: list[str] = []

    def fetch(self, key: str) -> Any:
        self.reads.append(key)
        return super().fetch(key)

    def open_range(self, key: str) -> Any:
        self.ranged.append(key)
        return super().open_range(key)


def test_the_newest_delta_step_loads_from_one_object(store_url: str) -> None:
    run = make_run(4)
    st = CheckpointStore(store_url, profile="portable")
    with _events() as ev:
        for i in range(4):
            st.save(run[i], i)
        st.wait()
    recs = {r.step: r for r in st.list()}
    assert [recs[s].kind for s in range(4)] == ["keyframe", "delta", "delta", "delta"]
    assert [s for s in range(4) if recs[s].copy] == [3], "only the newest step keeps a copy"
    assert recs[3].copy_bytes > recs[3].object_bytes, "a keyframe holds what the delta's bases held"
    assert _data(st) == _live(st), "copies of earlier steps were cancelled or removed"
    copies = [e for e in ev if e.op == "keyframe_copy"]
    assert copies and copies[-1].extra["outcome"] == "written" and copies[-1].step == 3
    assert all(e.extra["outcome"] in ("written", "cancelled") for e in copies)
    # the record carries the copy; older readers ignore the field
    rec = json.loads(st.backend.get("commits/step_000000000003.json"))
    assert rec["keyframe_copy"] == {"object": recs[3].copy, "bytes": recs[3].copy_bytes}
    assert rec["objects"][0] == rec["object"] != recs[3].copy

    spy = _Reads(open_backend(store_url))
    reader = CheckpointStore(store_url, _backend=spy)
    with _events() as ev:
        assert bits_equal(reader.load(3), run[3])
    assert spy.reads == [recs[3].copy], "one object read"
    # the newest step is kept as the next save's base: under its own container's manifest
    assert spy.ranged == [recs[3].object]
    assert [(e.extra["from"], e.stored_bytes) for e in ev if e.op == "load"] == [("copy", recs[3].copy_bytes)]
    spy.reads.clear()
    assert bits_equal(reader.load(3, from_copy=False), run[3])
    assert set(spy.reads) == set(recs[3].objects) and len(recs[3].objects) == 4
    assert reader.verify(3).ok
    sizes = reader.sizes()
    assert sizes["copy_bytes"] == recs[3].copy_bytes
    assert sizes["physical_bytes"] == sum(r.object_bytes for r in recs.values()) + recs[3].copy_bytes
    # the next save continues the chain from the step, whichever way it was loaded
    nxt = reader.save(make_run(5)[4], 4)
    assert nxt.kind == "delta" and nxt.base_step == 3


def test_resumed_store_codes_the_next_delta_against_the_copy_s_bytes(store_url: str) -> None:
    st, run = _filled(store_url, 3, 4)
    st.close()
    st2 = CheckpointStore(store_url, profile="portable")
    assert bits_equal(st2.load(), run[2])  # from the copy; cached as the next base
    info = st2.save(run[3], 3)
    assert info.kind == "delta" and info.base_step == 2
    st2.wait()
    fresh = CheckpointStore(store_url)
    assert bits_equal(fresh.load(3, from_copy=False), run[3]), "its delta names step 2's own container"
    assert bits_equal(fresh.load(2), run[2])
    assert fresh.info(2).copy is None and fresh.info(3).copy is not None


def test_delete_and_overwrite_reclaim_the_copy(store_url: str) -> None:
    st, run = _filled(store_url, 3, 4)
    copy = st.info(2).copy
    assert copy is not None
    st.delete(2)
    assert copy not in _data(st) and _data(st) == _live(st)
    assert st.info(1).copy is None, "a copy is made after a save, not after a delete"
    st.save(run[3], 1, overwrite=True)
    st.wait()
    assert st.info(1).copy is not None and bits_equal(st.load(1), run[3])
    assert _data(st) == _live(st)
    st.save(run[0], 5, keyframe=True)
    assert st.info(1).copy is None and st.info(5).copy is None, "a keyframe needs no copy; older ones go"
    assert _data(st) == _live(st)


def test_a_rebase_keeps_the_copy(store_url: str) -> None:
    """delete(rebase=True) re-codes the newest step (same bytes): its committed copy stays."""
    st, run = _filled(store_url, 4)
    before = st.info(3)
    assert before.copy is not None and before.objects[-1] == st.info(0).object
    st.delete(0, rebase=True)
    after = st.info(3)
    assert after.object != before.object and st.info(0 + 1).kind == "keyframe", "step 3 was re-coded"
    assert after.copy == before.copy and after.copy_bytes == before.copy_bytes
    assert _data(st) == _live(st)
    fresh = CheckpointStore(store_url)
    assert bits_equal(fresh.load(3), run[3]) and bits_equal(fresh.load(3, from_copy=False), run[3])
    assert fresh.verify(3).ok


def test_keyframe_copy_off(store_url: str) -> None:
    st, run = _filled(store_url, 3, keyframe_copy=False)
    assert all(r.copy is None for r in st.list())
    assert bits_equal(st.load(2), run[2])


def test_async_saves_get_a_copy_too(store_url: str) -> None:
    run = make_run(3)
    st = CheckpointStore(store_url, profile="portable")
    for i in range(3):
        st.save_async(run[i], i)
    st.wait()
    assert st.info(2).copy is not None and bits_equal(CheckpointStore(store_url).load(2), run[2])
    assert _data(st) == _live(st)
    st.close()


class _Gated(FaultyBackend):
    """The second data object written for ``prefix`` (the copy; the first is the save's own)
    blocks in its first write until ``gate`` opens; ``entered`` says it got there."""

    def __init__(self, inner: Any, prefix: str) -> None:
        super().__init__(inner, lambda verb, key: False)
        self.prefix = prefix
        self.n = 0
        self.entered = threading.Event()
        self.gate = threading.Event()

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        if key.startswith(self.prefix):
            self.n += 1
        gated = key.startswith(self.prefix) and self.n == 2
        with self.inner.writer(key) as f:
            if not gated:
                yield f
                return
            outer = self

            class _W:
                def write(self, data: Any) -> int:
                    outer.entered.set()
                    assert outer.gate.wait(60), "gate never opened"
                    return int(f.write(data))

            yield _W()  # type: ignore[misc]


@pytest.mark.parametrize("profile", ["portable", pytest.param("fast", marks=pytest.mark.gpu)])
def test_the_next_save_cancels_a_copy_in_flight(store_url: str, profile: str) -> None:
    if profile == "fast":
        from s4w_core import api

        if api._gpu() is None:  # noqa: SLF001
            pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    run = make_run(3, n=300_000 if profile == "fast" else 3000)  # the GPU writer: several batches
    gated = _Gated(open_backend(store_url), "data/step_000000000001.")
    st = CheckpointStore(store_url, profile=profile, _backend=gated)
    st.save(run[0], 0)
    with _events() as ev:
        st.save(run[1], 1)
        assert gated.entered.wait(30), "the copy of step 1 started"
        saver = threading.Thread(target=st.save, args=(run[2], 2))
        saver.start()
        tail = st._pipe.tail  # noqa: SLF001
        deadline = time.monotonic() + 30
        while not (tail is not None and tail._cancel is not None and tail._cancel.is_set()):  # noqa: SLF001
            assert time.monotonic() < deadline, "the save did not cancel the copy"
            time.sleep(0.01)
            tail = st._pipe.tail  # noqa: SLF001
        assert st.steps() == [0, 1], "the save waits for the copy to stop before it starts"
        gated.gate.set()
        saver.join(60)
        st.wait()
    assert [e.extra["outcome"] for e in ev if e.op == "keyframe_copy"] == ["cancelled", "written"]
    recs = {r.step: r for r in st.list()}
    assert recs[1].copy is None and recs[2].copy is not None
    assert _data(st) == _live(st), "the cancelled copy left nothing behind"
    for i in range(3):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])


def test_a_rebase_waits_for_the_copy_in_flight(store_url: str) -> None:
    """delete(rebase=True) re-codes the newest step: it first lets its copy land (then keeps it)
    instead of making it stale."""
    run = make_run(4)
    gated = _Gated(open_backend(store_url), "data/step_000000000003.")
    st = CheckpointStore(store_url, profile="portable", _backend=gated)
    for i in range(4):
        st.save(run[i], i)
    assert gated.entered.wait(30), "the copy of step 3 started"
    deleter = threading.Thread(target=st.delete, args=(0,), kwargs={"rebase": True})
    deleter.start()
    deleter.join(0.3)
    assert deleter.is_alive() and st.steps() == [0, 1, 2, 3], "the rebase waits for the copy"
    gated.gate.set()
    deleter.join(60)
    assert st.steps() == [1, 2, 3] and st.info(3).copy is not None
    assert _data(st) == _live(st)
    assert bits_equal(CheckpointStore(store_url).load(3), run[3])


def test_gc_waits_for_the_copy_in_flight(store_url: str) -> None:
    """gc(grace_seconds=0) must not take the copy being written for an unreferenced leftover."""
    run = make_run(2)
    gated = _Gated(open_backend(store_url), "data/step_000000000001.")
    st = CheckpointStore(store_url, profile="portable", _backend=gated)
    st.save(run[0], 0)
    st.save(run[1], 1)
    assert gated.entered.wait(30), "the copy of step 1 started"
    collector = threading.Thread(target=st.gc, kwargs={"grace_seconds": 0})
    collector.start()
    collector.join(0.3)
    assert collector.is_alive(), "gc waits for the store's own background work"
    gated.gate.set()
    collector.join(60)
    assert st.info(1).copy is not None and _data(st) == _live(st)
    assert bits_equal(CheckpointStore(store_url).load(1), run[1])


def test_a_failed_copy_is_logged_and_the_step_stays(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    run = make_run(4)
    n = {"data": 0}

    def fail(verb: str, key: str) -> bool:
        if verb == "writer" and key.startswith("data/step_000000000001."):
            n["data"] += 1
            return n["data"] == 2  # the copy, not the save's own object
        return False

    st = CheckpointStore(store_url, profile="portable", _backend=FaultyBackend(open_backend(store_url), fail, 10))
    st.save(run[0], 0)
    with caplog.at_level(logging.WARNING, logger="s4w_core.store"), _events() as ev:
        st.save(run[1], 1)
        st.wait()  # no AsyncSaveError: the step is committed and loads from its chain
    assert "the keyframe copy of step 1" in caplog.text and "Crash" in caplog.text
    bad = [e for e in ev if e.op == "keyframe_copy"]
    assert len(bad) == 1 and not bad[0].ok and bad[0].extra["outcome"] == "failed"
    assert st.info(1).copy is None and bits_equal(st.load(1), run[1])
    assert _data(st) == _live(st), "the failed copy's object is gone"
    st.save(run[2], 2)
    st.wait()
    assert st.info(2).copy is not None


def test_a_missing_or_corrupt_copy_falls_back_to_the_chain(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    st, run = _filled(store_url, 3)
    copy = st.info(2).copy
    assert copy is not None
    good = st.backend.get(copy)

    bad = bytearray(good)
    bad[100] ^= 0xFF  # inside the chunk data
    st.backend.put(copy, bytes(bad))
    with caplog.at_level(logging.WARNING, logger="s4w_core.store"):
        assert bits_equal(CheckpointStore(store_url).load(2), run[2])
    assert "keyframe copy" in caplog.text and "reading its chain" in caplog.text
    rep = CheckpointStore(store_url).verify(2)
    assert not rep.ok and len(rep.problems) == 1 and rep.problems[0].startswith("keyframe copy: ")

    st.backend.put(copy, good[: len(good) // 2])  # truncated
    assert bits_equal(CheckpointStore(store_url).load(2), run[2])

    # another step's keyframe under the copy's name: a valid container that is not this step
    st.backend.put(copy, st.backend.get(st.info(0).object))
    fresh = CheckpointStore(store_url)
    rec = json.loads(st.backend.get("commits/step_000000000002.json"))
    rec["keyframe_copy"]["bytes"] = st.info(0).object_bytes
    st.backend.put("commits/step_000000000002.json", json.dumps(rec).encode())
    assert bits_equal(fresh.load(2), run[2])
    with pytest.raises(ManifestError, match="not a keyframe copy of step 2"):
        fresh._load_record(fresh.info(2), None, None, source="copy")  # noqa: SLF001

    st.backend.delete(copy)  # gone (e.g. removed by a newer save between listing and loading)
    assert bits_equal(CheckpointStore(store_url).load(2), run[2])
    assert CheckpointStore(store_url).verify(2).problems[0].startswith("keyframe copy: CheckpointNotFoundError")


@pytest.mark.parametrize(
    "field",
    [
        {"object": "elsewhere/x.s4w", "bytes": 10},
        {"object": "data/../x.s4w", "bytes": 10},
        {"object": "data/x.s4w", "bytes": -1},
        {"object": "data/x.s4w"},
        "data/x.s4w",
    ],
)
def test_a_malformed_copy_field_is_a_manifest_error(tmp_path: Any, field: Any) -> None:
    st = CheckpointStore(str(tmp_path / "s"), profile="portable")
    st.save(make_run(1)[0], 0)
    rec = json.loads(st.backend.get("commits/step_000000000000.json"))
    rec["keyframe_copy"] = field
    st.backend.put("commits/step_000000000000.json", json.dumps(rec).encode())
    with pytest.raises(ManifestError, match="keyframe_copy"):
        CheckpointStore(str(tmp_path / "s")).steps()
    rec["keyframe_copy"] = {"object": rec["object"], "bytes": 10}  # its own container is no copy
    st.backend.put("commits/step_000000000000.json", json.dumps(rec).encode())
    with pytest.raises(ManifestError, match="keyframe_copy"):
        CheckpointStore(str(tmp_path / "s")).steps()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize(("profile", "blocking"), [("auto", True), ("auto", False), ("portable", False)])
def test_gpu_saves_copy_from_the_pinned_base(tmp_path: Any, profile: str, blocking: bool) -> None:
    """CUDA state: the copy is encoded from the host copy the store keeps as the next base (the
    pinned buffers), with the step's own profile, while the caller changes the state."""
    import torch

    from s4w_core import api

    if api._gpu() is None:  # noqa: SLF001
        pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    run = [
        {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in s["model"].items()} | {"step": s["step"]}
        for s in make_run(4, n=200_000)
    ]
    st = CheckpointStore(str(tmp_path / "s"), profile=profile)
    expected = []
    for i, s in enumerate(run):
        expected.append({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in s.items()})
        st.save(s, i, blocking=blocking)
        for v in s.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)  # the caller goes on; the copy must not see it
    st.wait()
    rec = st.info(3)
    assert rec.kind == "delta" and rec.copy is not None
    fresh = CheckpointStore(str(tmp_path / "s"))
    reader = fresh._open(rec.copy, whole=False)  # noqa: SLF001
    info = reader.manifest
    reader.close()
    assert info["profile"] == rec.profile and not any(e.get("delta") for e in info["storages"])
    # coded on the GPU from the host copy, whatever the profile (portable: nvCOMP Deflate planes)
    assert "nvcomp" in info["writer"], info["writer"]
    assert bits_equal(fresh.load(3, map_location="cpu"), expected[3])
    assert bits_equal(fresh.load(3, map_location="cpu", from_copy=False), expected[3])
    on_gpu = fresh.load(3)  # from the copy; kept as the next base under the step's own checksums
    assert all(v.device.type == "cuda" for v in on_gpu.values() if isinstance(v, torch.Tensor))
    assert fresh.verify(3).ok
    nxt = {k: (v + 1 if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in on_gpu.items()}
    want = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in nxt.items()}
    info = fresh.save(nxt, 4)
    assert info.kind == "delta" and info.base_step == 3
    fresh.wait()
    assert bits_equal(CheckpointStore(str(tmp_path / "s")).load(4, map_location="cpu", from_copy=False), want)


def test_checksums_of_other_algorithms_are_checked_on_the_bytes() -> None:
    """The GPU writer sums device data with fold64 and hashes host data with xxh3: a copy coded
    from the host stands for a step coded on the device when the step's checksum holds for the
    host bytes the copy came from."""
    import torch

    from s4w_core import checksum as ck
    from s4w_core.store.store import _same_storages

    raw = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    entry = {"path": "w", "dtype": "int32", "nbytes": raw.numel()}
    own = {"storages": [{**entry, "checksum": ck.compute_checksum("fold64", raw)}], "tree": 0, "tensors": []}
    copy = {"storages": [{**entry, "checksum": ck.tensor_checksum(raw)}], "tree": 0, "tensors": []}
    assert own["storages"][0]["checksum"] != copy["storages"][0]["checksum"]
    assert _same_storages(copy, own, [raw], ["cpu"]) is None
    assert "other bytes" in str(_same_storages(copy, own)), "without the bytes: not the same"
    other = raw.clone()
    other[5] ^= 1
    assert "not the step's bytes" in str(_same_storages(copy, own, [other], ["cpu"]))
    same_algo = {"storages": [{**entry, "checksum": ck.compute_checksum("fold64", other)}], "tree": 0, "tensors": []}
    assert "other bytes" in str(_same_storages(same_algo, own, [raw], ["cpu"]))
    assert "tree" in str(_same_storages({**copy, "tree": 1}, own, [raw], ["cpu"]))

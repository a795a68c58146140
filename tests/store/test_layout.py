"""The store's layout (docs/STORE.md): each save writes its step whole; behind it the step below
becomes a delta against it (re-encoded, checked, committed by rewriting its record, its whole
object removed).  The newest step loads from one object, an older one reads only its chain;
bytes written per save are one whole step and one delta.  Stores of the first layout (keyframe
copies) are still read."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import time
import uuid
import weakref
from typing import IO, Any, Iterator

import pytest

from s4w_core import obs
from s4w_core.errors import BaseMismatchError, CheckpointNotFoundError, ManifestError
from s4w_core.store import CheckpointStore, open_backend
from s4w_core.store._memory import MemoryBackend
from s4w_core.store.records import DATA, commit_key
from tests.compat.make_golden import describe
from tests.compat.make_golden_store import STORE as GOLDEN_STORE

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
    return {o.key for o in st.backend.list(DATA)}


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
    reads (``ranged``: a manifest); not a look-up of an object that is not there."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, lambda verb, key: False)
        self.reads: list[str] = []
        self.ranged: list[str] = []

    def fetch(self, key: str) -> Any:
        got = super().fetch(key)
        self.reads.append(key)
        return got

    def open_range(self, key: str) -> Any:
        got = super().open_range(key)
        self.ranged.append(key)
        return got


class _Writes(FaultyBackend):
    """Counts what is written: data objects (key, bytes), records put, objects deleted."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, lambda verb, key: False)
        self.data: list[tuple[str, int]] = []
        self.puts: list[str] = []
        self.deletes: list[str] = []

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        with self.inner.writer(key) as f:
            outer, n = self, [0]

            class _W:
                def write(self, data: Any) -> int:
                    n[0] += len(data)
                    return int(f.write(data))

            yield _W()  # type: ignore[misc]
        outer.data.append((key, n[0]))

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.puts.append(key)
        super().put(key, data, if_absent=if_absent)

    def delete(self, key: str) -> None:
        self.deletes.append(key)
        self.inner.delete(key)


def test_the_newest_step_loads_from_one_object_an_older_one_from_its_chain(store_url: str) -> None:
    run = make_run(4)
    st = CheckpointStore(store_url, profile="portable")
    with _events() as ev:
        for i in range(4):
            assert st.save(run[i], i).kind == "keyframe"
        st.wait()
    recs = {r.step: r for r in st.list()}
    assert [(recs[s].kind, recs[s].base_step, recs[s].depth) for s in range(4)] == [
        ("delta", 1, 3), ("delta", 2, 2), ("delta", 3, 1), ("keyframe", None, 0)]
    assert _data(st) == _live(st) == {r.object for r in recs.values()}, "one object per step, nothing else"
    re = [e for e in ev if e.op == "reencode" and e.url == st.backend.url]  # not other tests' background work
    assert [(e.step, e.extra["outcome"], e.extra["base_step"]) for e in re] == [(0, "written", 1), (1, "written", 2), (2, "written", 3)]
    rec = json.loads(st.backend.get("commits/step_000000000001.json"))
    assert rec["version"] == 2 and rec["base_step"] == 2 and rec["objects"] == [rec["object"]]

    spy = _Reads(open_backend(store_url))
    reader = CheckpointStore(store_url, _backend=spy)
    with _events() as ev:
        assert bits_equal(reader.load(3), run[3])
    assert spy.reads == [recs[3].object] and spy.ranged == [], "one object read, no chain walk"
    assert [(e.extra["from"], e.stored_bytes) for e in ev if e.op == "load" and e.url == reader.backend.url] == [
        ("chain", recs[3].object_bytes)]
    spy.reads.clear()
    assert bits_equal(reader.load(2), run[2])
    assert sorted(spy.reads) == sorted([recs[2].object, recs[3].object]), "a delta reads its chain only"
    spy.reads.clear()
    assert bits_equal(reader.load(0), run[0])
    assert sorted(spy.reads) == sorted(r.object for r in recs.values())
    for s in range(4):
        assert reader.verify(s).ok
    sizes = reader.sizes()
    assert sizes["physical_bytes"] == sizes["stored_bytes"] == sum(r.object_bytes for r in recs.values())


def test_bytes_written_per_save_are_one_whole_step_and_one_delta(store_url: str) -> None:
    run = make_run(5, n=20000)
    spy = _Writes(open_backend(store_url))
    st = CheckpointStore(store_url, profile="portable", _backend=spy)
    st.save(run[0], 0)
    for i in range(1, 5):
        spy.data.clear(), spy.puts.clear(), spy.deletes.clear()
        before = {r.step: r for r in st.list()}
        new = st.save(run[i], i)
        st.wait()
        prev = st.info(i - 1)
        assert [k for k, _ in spy.data] == [new.object, prev.object], "the new step whole, then one delta"
        assert dict(spy.data) == {new.object: new.object_bytes, prev.object: prev.object_bytes}
        assert prev.kind == "delta" and prev.object_bytes < new.object_bytes
        assert spy.puts == [f"commits/step_{i:012d}.json", f"commits/step_{i - 1:012d}.json"]
        assert spy.deletes == [before[i - 1].object], "the old whole object, nothing else"
        assert {s: r.object for s, r in {r.step: r for r in st.list()}.items() if s < i - 1} == {
            s: r.object for s, r in before.items() if s < i - 1}, "older steps untouched"


def test_lightning_like_top_k_removals_write_no_data_objects(store_url: str) -> None:
    """Lightning's ModelCheckpoint(save_top_k=2, monitor="loss", save_last=True): every step is
    saved (the last), the previous last is removed unless it is in the top 2, and a step that
    falls out of the top 2 is removed.  Removals write no data object (a middle step is hidden
    while the step below is a delta against it), each save writes its step whole and one delta,
    every kept step loads bit-exactly, and once nothing needs a removed step its data is gone."""
    run = make_run(10, n=20000)
    loss = [5.0, 4.0, 4.5, 3.0, 3.5, 3.2, 2.0, 2.8, 2.9, 1.0]
    spy = _Writes(open_backend(store_url))
    st = CheckpointStore(store_url, profile="portable", _backend=spy)
    top: list[int] = []
    last: int | None = None
    for i in range(10):
        spy.data.clear()
        st.save(run[i], i)
        st.wait()
        assert len(spy.data) <= 2, "the new step whole and at most one delta"
        spy.data.clear()
        top = sorted([*top, i], key=lambda s: loss[s])
        gone = [s for s in top[2:]]
        top = top[:2]
        if last is not None and last not in top:
            gone.append(last)
        last = i
        for s in sorted(set(gone) - {i}):
            st.delete(s)
        assert spy.data == [], f"removing {gone} wrote data objects"
        kept = sorted({*top, i})
        assert st.steps() == kept
        for s in kept:
            assert bits_equal(CheckpointStore(store_url).load(s), run[s]), s
        sizes = st.sizes()
        assert sizes["unreferenced_bytes"] == 0
    assert st.steps() == [6, 9]
    for s in (6,):
        st.delete(s)  # the oldest kept: the hidden steps its chain ran through go with it
    st.wait()  # their data goes behind the call
    assert st.sizes()["hidden_bytes"] == 0 and _data(st) == {st.info(9).object}


def test_a_delta_that_does_not_pay_writes_nothing_and_the_step_stays_whole(store_url: str) -> None:
    """Two unrelated states (a far-apart save): the step below would be a delta no smaller than its
    whole object, so it stays whole and no data object is written for it."""
    import torch

    g = torch.Generator().manual_seed(7)
    a = {"w": torch.randn(20000, generator=g).to(torch.bfloat16), "m": torch.randn(20000, generator=g)}
    b = {"w": torch.randn(20000, generator=g).to(torch.bfloat16), "m": torch.randn(20000, generator=g)}
    spy = _Writes(open_backend(store_url))
    st = CheckpointStore(store_url, profile="portable", _backend=spy)
    first = st.save(a, 0)
    spy.data.clear(), spy.puts.clear(), spy.deletes.clear()
    new = st.save(b, 1)
    st.wait()
    assert [k for k, _ in spy.data] == [new.object], "only the new step"
    assert spy.deletes == [] and st.info(0).kind == "keyframe" and st.info(0).object == first.object
    assert _data(st) == {first.object, new.object}
    for step, want in ((0, a), (1, b)):
        got = st.load(step)
        assert all(bits_equal(got[k], want[k]) for k in want)
    st.close()


def test_a_resumed_run_reencodes_the_loaded_step_from_memory(store_url: str) -> None:
    """A fresh store that loaded the newest step keeps its bytes (and what it needs to re-encode
    them, rebuilt from the manifest): the first save re-encodes it without reading it again."""
    _st, run = _filled(store_url, 2, 3)
    spy = _Reads(open_backend(store_url))
    st = CheckpointStore(store_url, profile="portable", _backend=spy)
    assert bits_equal(st.load(), run[1])
    one = st.info(1).object
    st.save(run[2], 2)
    st.wait()
    assert spy.reads.count(one) == 1, "read by the load only"
    assert st.info(1).kind == "delta" and st.info(1).base_step == 2
    fresh = CheckpointStore(store_url)
    for i in range(3):
        assert bits_equal(fresh.load(i), run[i])


def test_the_reencoding_reads_nothing_of_the_step_it_kept(store_url: str) -> None:
    """A store that saved a step keeps its bytes and the manifest it committed: the next save
    re-encodes it as a delta, checked against that manifest, without reading its object."""
    run = make_run(2)
    spy = _Reads(open_backend(store_url))
    st = CheckpointStore(store_url, profile="portable", _backend=spy)
    st.save(run[0], 0)
    st.wait()
    zero = st.info(0).object
    st.save(run[1], 1)
    st.wait()
    assert st.info(0).kind == "delta" and st.info(0).base_step == 1
    assert zero not in spy.reads and zero not in spy.ranged, (spy.reads, spy.ranged)
    fresh = CheckpointStore(store_url)
    assert bits_equal(fresh.load(0), run[0]) and bits_equal(fresh.load(1), run[1])


def test_keyframe_every_bounds_the_chains(store_url: str) -> None:
    run = make_run(9)
    st = CheckpointStore(store_url, profile="portable", keyframe_every=3)
    for i in range(9):
        st.save(run[i], i)
    st.wait()
    assert [r.kind[0] for r in st.list()] == list("ddkddkddk")
    assert max(r.depth for r in st.list()) == 2
    fresh = CheckpointStore(store_url)
    for i in range(9):
        assert bits_equal(fresh.load(i), run[i])


def test_async_saves_reencode_too(store_url: str) -> None:
    run = make_run(3)
    st = CheckpointStore(store_url, profile="portable")
    for i in range(3):
        st.save_async(run[i], i)
    st.wait()
    assert [r.kind for r in st.list()] == ["delta", "delta", "keyframe"]
    for i in range(3):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])
    assert _data(st) == _live(st)
    st.close()


class _Gated(FaultyBackend):
    """The second data object written for ``prefix`` (the re-encoded step; the first is the
    save's own) blocks in its first write until ``gate`` opens; ``entered`` says it got there."""

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




def test_the_next_save_waits_for_the_reencoding_in_flight(store_url: str) -> None:
    run = make_run(3)
    gated = _Gated(open_backend(store_url), "data/step_000000000000.")
    st = CheckpointStore(store_url, profile="portable", _backend=gated)
    st.save(run[0], 0)
    st.save(run[1], 1)
    assert gated.entered.wait(30), "the re-encoding of step 0 started"
    saver = threading.Thread(target=st.save, args=(run[2], 2))
    saver.start()
    saver.join(0.3)
    assert saver.is_alive() and st.steps() == [0, 1], "the save waits for the re-encoding"
    gated.gate.set()
    saver.join(60)
    st.wait()
    assert [r.kind for r in st.list()] == ["delta", "delta", "keyframe"]
    assert _data(st) == _live(st)
    for i in range(3):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])


def test_gc_waits_for_the_reencoding_in_flight(store_url: str) -> None:
    """gc(grace_seconds=0) must not take the object being written for an unreferenced leftover."""
    run = make_run(2)
    gated = _Gated(open_backend(store_url), "data/step_000000000000.")
    st = CheckpointStore(store_url, profile="portable", _backend=gated)
    st.save(run[0], 0)
    st.save(run[1], 1)
    assert gated.entered.wait(30), "the re-encoding of step 0 started"
    collector = threading.Thread(target=st.gc, kwargs={"grace_seconds": 0})
    collector.start()
    collector.join(0.3)
    assert collector.is_alive(), "gc waits for the store's own background work"
    gated.gate.set()
    collector.join(60)
    assert st.info(0).kind == "delta" and _data(st) == _live(st)
    assert bits_equal(CheckpointStore(store_url).load(0), run[0])


def test_a_failed_reencoding_is_logged_and_the_step_stays_whole(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    run = make_run(4)
    n = {"data": 0}

    def fail(verb: str, key: str) -> bool:
        if verb == "writer" and key.startswith("data/step_000000000000."):
            n["data"] += 1
            return n["data"] == 2  # the re-encoded object, not the save's own
        return False

    st = CheckpointStore(store_url, profile="portable", _backend=FaultyBackend(open_backend(store_url), fail, 10))
    st.save(run[0], 0)
    with caplog.at_level(logging.WARNING, logger="s4w_core.store"), _events() as ev:
        st.save(run[1], 1)
        st.wait()  # no AsyncSaveError: the step is committed and whole
    assert "re-encoding step 0" in caplog.text and "Crash" in caplog.text
    bad = [e for e in ev if e.op == "reencode" and e.url == st.backend.url]
    assert len(bad) == 1 and not bad[0].ok and bad[0].extra["outcome"] == "failed"
    assert st.info(0).kind == "keyframe" and bits_equal(st.load(0), run[0])
    assert _data(st) == _live(st), "the failed object is gone"
    st.save(run[2], 2)
    st.wait()
    assert [r.kind for r in st.list()] == ["keyframe", "delta", "keyframe"]


def test_overwrite_of_a_base_step_merges_the_step_below(store_url: str) -> None:
    st, run = _filled(store_url, 3, 4)
    assert st.info(0).base_step == 1 and st.info(1).base_step == 2
    st.save(run[3], 1, overwrite=True)
    st.wait()
    assert st.info(0).base_step == 2, "step 0 was re-coded against step 1's own base"
    fresh = CheckpointStore(store_url)
    for s, want in ((0, run[0]), (1, run[3]), (2, run[2])):
        assert bits_equal(fresh.load(s), want)
    assert _data(st) == _live(st)


def test_overwrite_of_the_newest_step_reencodes_the_step_below_again(store_url: str) -> None:
    st, run = _filled(store_url, 3, 4)
    st.save(run[3], 2, overwrite=True)
    st.wait()
    assert [(r.kind, r.base_step) for r in st.list()] == [("delta", 1), ("delta", 2), ("keyframe", None)]
    fresh = CheckpointStore(store_url)
    for s, want in ((0, run[0]), (1, run[1]), (2, run[3])):
        assert bits_equal(fresh.load(s), want)
    assert _data(st) == _live(st)


def test_deprecated_keyframe_copy_argument_warns() -> None:
    with pytest.warns(DeprecationWarning, match="keyframe_copy"):
        CheckpointStore("memory://deprecated-kc", keyframe_copy=False)


# ----------------------------------------------------------------------------- first layout
def _golden(tmp_path: Any) -> str:
    import shutil

    dst = tmp_path / "store_v1"
    shutil.copytree(GOLDEN_STORE, dst)
    return str(dst)


def test_a_missing_or_corrupt_copy_of_a_first_layout_store_falls_back_to_the_chain(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url = _golden(tmp_path)
    st = CheckpointStore(url)
    want = describe(st.load(50, from_copy=False))
    copy = st.info(50).copy
    assert copy is not None
    good = st.backend.get(copy)

    bad = bytearray(good)
    bad[100] ^= 0xFF  # inside the chunk data
    st.backend.put(copy, bytes(bad))
    with caplog.at_level(logging.WARNING, logger="s4w_core.store"):
        assert describe(CheckpointStore(url).load(50)) == want
    assert "keyframe copy" in caplog.text and "reading its chain" in caplog.text
    rep = CheckpointStore(url).verify(50)
    assert not rep.ok and len(rep.problems) == 1 and rep.problems[0].startswith("keyframe copy: ")

    st.backend.put(copy, good[: len(good) // 2])  # truncated
    assert describe(CheckpointStore(url).load(50)) == want

    # another step's keyframe under the copy's name: a valid container that is not this step
    st.backend.put(copy, st.backend.get(st.info(40).object))
    fresh = CheckpointStore(url)
    rec = json.loads(st.backend.get("commits/step_000000000050.json"))
    rec["keyframe_copy"]["bytes"] = st.info(40).object_bytes
    st.backend.put("commits/step_000000000050.json", json.dumps(rec).encode())
    assert describe(fresh.load(50)) == want
    with pytest.raises(ManifestError, match="not a keyframe copy of step 50"):
        fresh._load_record(fresh.info(50), None, None, source="copy")  # noqa: SLF001

    st.backend.delete(copy)  # gone
    assert describe(CheckpointStore(url).load(50)) == want
    assert CheckpointStore(url).verify(50).problems[0].startswith("keyframe copy: CheckpointNotFoundError")


def test_the_first_save_into_a_first_layout_store_drops_its_copy(tmp_path: Any) -> None:
    url = _golden(tmp_path)
    st = CheckpointStore(url)
    old = st.info(50)
    assert old.copy is not None
    st.save({"w": make_run(1)[0]["model"]["emb"]}, 60)
    st.wait()
    assert st.info(50).copy is None and old.copy not in _data(st) and _data(st) == _live(st)
    assert st.info(50).object == old.object and st.info(50).base_step == 40, "a forward delta stays as it is"


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
def test_gpu_saves_reencode_from_the_pinned_copies(tmp_path: Any, profile: str, blocking: bool) -> None:
    """CUDA state: the step below is re-encoded from the host copies the store keeps (pinned
    buffers), against the new step's, while the caller changes the state."""
    import torch

    from s4w_core import pipeline

    if pipeline.gpu_backend() is None:
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
                v.add_(1)  # the caller goes on; the re-encoding must not see it
    st.wait()
    assert [r.kind for r in st.list()] == ["delta", "delta", "delta", "keyframe"]
    fresh = CheckpointStore(str(tmp_path / "s"))
    for i in range(4):
        assert bits_equal(fresh.load(i, map_location="cpu"), expected[i])
        assert fresh.verify(i).ok
    on_gpu = fresh.load(3)  # kept as the bytes the next save re-encodes
    assert all(v.device.type == "cuda" for v in on_gpu.values() if isinstance(v, torch.Tensor))
    def step(v: torch.Tensor) -> torch.Tensor:  # a training step: a few values move (a delta pays)
        v = v.clone()
        v.view(-1)[: v.numel() // 50] += 1
        return v

    nxt = {k: (step(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in on_gpu.items()}
    want = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in nxt.items()}
    assert fresh.save(nxt, 4).kind == "keyframe"
    fresh.wait()
    assert fresh.info(3).kind == "delta" and fresh.info(3).base_step == 4
    again = CheckpointStore(str(tmp_path / "s"))
    assert bits_equal(again.load(4, map_location="cpu"), want)
    assert bits_equal(again.load(3, map_location="cpu"), expected[3])


@pytest.mark.gpu
def test_gpu_blocking_saves_allocate_their_pinned_copies_while_encoding(tmp_path: Any) -> None:
    """The pinned buffers a blocking save's host copy takes are allocated on a background thread
    while the save encodes -- the first save's, and the second's (the first copy stays, the base
    of the re-encoding) -- not in the caller after the encode; the third reuses the first's."""
    import torch

    from s4w_core import pipeline

    if pipeline.gpu_backend() is None:
        pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    run = [
        {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in s["model"].items()} | {"step": s["step"]}
        for s in make_run(3, n=200_000)
    ]
    st = CheckpointStore(str(tmp_path / "s"), profile="fast")
    pool = st._pinned_pool  # noqa: SLF001 - the store's own pool, observed
    where: list[str] = []
    alloc = pool._alloc  # noqa: SLF001

    def spy(sizes: list[int], device: Any) -> Any:
        where.append(threading.current_thread().name)
        return alloc(sizes, device)

    pool._alloc = spy  # type: ignore[method-assign] # noqa: SLF001
    for i, s in enumerate(run):
        st.save(s, i)
        st.wait()
        assert len(where) == min(i + 1, 2), where
    assert where == ["s4w-pin-ahead"] * 2
    assert [r.kind for r in st.list()] == ["delta", "delta", "keyframe"]
    fresh = CheckpointStore(str(tmp_path / "s"))
    for i, s in enumerate(run):
        assert bits_equal(fresh.load(i, map_location="cpu"), {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in s.items()})


def test_checksums_of_other_algorithms_are_checked_on_the_bytes() -> None:
    """The GPU writer sums device data with fold64 and hashes host data with xxh3: a copy coded
    from the host stands for a step coded on the device when the step's checksum holds for the
    host bytes the copy came from."""
    import torch

    from s4w_core import checksum as ck
    from s4w_core.store.reencode_check import same_storages

    raw = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    entry = {"path": "w", "dtype": "int32", "nbytes": raw.numel()}
    own = {"storages": [{**entry, "checksum": ck.compute_checksum("fold64", raw)}], "tree": 0, "tensors": []}
    copy = {"storages": [{**entry, "checksum": ck.tensor_checksum(raw)}], "tree": 0, "tensors": []}
    assert own["storages"][0]["checksum"] != copy["storages"][0]["checksum"]
    assert same_storages(copy, own, [raw], ["cpu"]) is None
    assert "other bytes" in str(same_storages(copy, own)), "without the bytes: not the same"
    other = raw.clone()
    other[5] ^= 1
    assert "not the step's bytes" in str(same_storages(copy, own, [other], ["cpu"]))
    same_algo = {"storages": [{**entry, "checksum": ck.compute_checksum("fold64", other)}], "tree": 0, "tensors": []}
    assert "other bytes" in str(same_storages(same_algo, own, [raw], ["cpu"]))
    assert "tree" in str(same_storages({**copy, "tree": 1}, own, [raw], ["cpu"]))


def test_a_save_whose_retention_deletes_the_step_being_reencoded_cancels_it(store_url: str) -> None:
    """keep_last=3 when step 1 is saved (step 0 stays: its re-encoding runs behind the save),
    then 2: the save of step 2 deletes step 0, so that re-encoding is cancelled, not waited for
    and committed; nothing of it is left behind."""
    run = make_run(3)
    gated = _Gated(open_backend(store_url), "data/step_000000000000.")
    st = CheckpointStore(store_url, profile="portable", keep_last=3, _backend=gated)
    with _events() as ev:
        st.save(run[0], 0)
        st.save(run[1], 1)
        assert gated.entered.wait(30), "the re-encoding of step 0 started"
        st.keep_last = 2
        saver = threading.Thread(target=st.save, args=(run[2], 2))
        saver.start()
        saver.join(1.0)  # in its begin: the re-encoding is cancelled (it is waited for only to stop)
        gated.gate.set()  # the write in progress ends; the re-encoding stops before it commits
        saver.join(60)
        st.wait()
    re = [(e.step, e.extra["outcome"]) for e in ev if e.op == "reencode" and e.url == st.backend.url]
    assert re == [(0, "cancelled"), (1, "written")]
    assert st.steps() == [1, 2] and [r.kind for r in st.list()] == ["delta", "keyframe"]
    assert _data(st) == _live(st), "the cancelled re-encoding left no object"
    for i in (1, 2):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])


def _reencodes(ev: list[obs.OpEvent], st: CheckpointStore) -> list[tuple[int, str, bool]]:
    """(step, outcome, whether it started: read the step's bytes) of each re-encoding of ``st``."""
    return [(e.step, e.extra["outcome"], "read" in e.stages) for e in ev if e.op == "reencode" and e.url == st.backend.url]


def test_keep_last_holds_the_reencoding_of_the_step_the_next_save_deletes(store_url: str) -> None:
    """keep_last=2: the save of step 1 makes step 0 the one the next save deletes, so step 0's
    re-encoding is held, not run behind the save (reads and listings leave it held); the save of
    step 2 deletes step 0 and the held job ends without reading it; wait() runs the one of
    step 1 (the end of training: it stays)."""
    run = make_run(3)
    st = CheckpointStore(store_url, profile="portable", keep_last=2)
    with _events() as ev:
        st.save(run[0], 0)
        st.save(run[1], 1)
        assert [r.kind for r in st.list()] == ["keyframe", "keyframe"] and st.steps() == [0, 1]
        assert bits_equal(st.load(0), run[0])
        assert _reencodes(ev, st) == []  # held
        st.save(run[2], 2)
        assert _reencodes(ev, st) == [(0, "cancelled", False)]
        assert [r.kind for r in st.list()] == ["keyframe", "keyframe"]
        st.wait()
    assert _reencodes(ev, st) == [(0, "cancelled", False), (1, "written", True)]
    assert [(r.step, r.kind) for r in st.list()] == [(1, "delta"), (2, "keyframe")]
    assert _data(st) == _live(st)
    for i in (1, 2):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])


@pytest.mark.parametrize("end", ["close", "save_async", "delete_newest"])
def test_a_held_reencoding_runs_when_its_step_stays(store_url: str, end: str) -> None:
    """A held re-encoding runs when the step turns out to stay: at close(), and before a save that
    does not delete it (here keep_last was raised meanwhile); a delete of the newest step (which
    re-codes the step below it whole) settles it first."""
    run = make_run(3)
    st = CheckpointStore(store_url, profile="portable", keep_last=2)
    with _events() as ev:
        st.save(run[0], 0)
        st.save(run[1], 1)
        assert _reencodes(ev, st) == []
        if end == "close":
            st.close()
            assert _reencodes(ev, st) == [(0, "written", True)]
            kinds = [(0, "delta"), (1, "keyframe")]
        elif end == "save_async":
            st.keep_last = 3
            st.save_async(run[2], 2).result(timeout=60)
            st.wait()
            assert _reencodes(ev, st) == [(0, "written", True), (1, "written", True)]
            kinds = [(0, "delta"), (1, "delta"), (2, "keyframe")]
        else:
            st.delete(1)
            st.wait()
            kinds = [(0, "keyframe")]
    st = CheckpointStore(store_url)
    assert [(r.step, r.kind) for r in st.list()] == kinds
    assert _data(st) == _live(st)
    for i, _ in kinds:
        assert bits_equal(st.load(i), run[i])


@pytest.mark.parametrize("keep_last", [2, None])
def test_a_store_dropped_after_a_reencoding_is_collected(store_url: str, keep_last: int | None) -> None:
    """Neither a held re-encoding (keep_last=2) nor the handle a finished one leaves behind keeps
    its store (and the host copies it caches) alive: a store dropped without close() is collected;
    the held step stays whole, the other one is a delta."""
    run = make_run(2)
    st = CheckpointStore(store_url, profile="portable", keep_last=keep_last)
    st.save(run[0], 0)
    st.save(run[1], 1)
    if keep_last is None:
        st.wait()
    ref = weakref.ref(st)
    del st
    gc.collect()
    assert ref() is None
    fresh = CheckpointStore(store_url)
    first = "keyframe" if keep_last else "delta"
    assert [(r.step, r.kind) for r in fresh.list()] == [(0, first), (1, "keyframe")]
    for i in (0, 1):
        assert bits_equal(fresh.load(i), run[i])


def test_expect_drop_holds_the_reencoding_until_the_step_goes_or_stays(store_url: str) -> None:
    """expect_drop (a framework's rotation known a save ahead, no keep_last): the re-encoding of
    the step is held; drop_pending or a delete ends it before it reads the step, a later save that
    keeps the step runs it first, and saving the step again forgets the expectation."""
    run = make_run(5)
    st = CheckpointStore(store_url, profile="portable")
    with _events() as ev:
        st.save(run[0], 0)
        st.expect_drop(0)
        st.save(run[1], 1)
        time.sleep(0.5)  # (a re-encoding run behind the save would be done by now)
        assert _reencodes(ev, st) == []
        st.delete(0)
        st.wait()  # (the cancelled job ends on the worker)
        assert _reencodes(ev, st) == [(0, "cancelled", False)]
        st.expect_drop(1)
        st.save(run[2], 2)  # step 1 held
        st.save(run[3], 3)  # it stays after all: run before this save
        assert _reencodes(ev, st)[1] == (1, "written", True)
        st.expect_drop(3)
        st.save(run[3], 3, overwrite=True)  # saved again: the expectation is gone
        st.save(run[4], 4)
        st.wait()
    assert [o for o in _reencodes(ev, st) if o[0] == 3] == [(3, "written", True)]
    assert [(r.step, r.kind) for r in st.list()] == [(1, "delta"), (2, "delta"), (3, "delta"), (4, "keyframe")]
    assert _data(st) == _live(st)
    for i in (1, 2, 3, 4):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])


def test_an_adapters_rotation_holds_the_reencoding_it_would_discard(store_url: str) -> None:
    """HF's save_total_limit=2 / Accelerate's total_limit=2 mirrored by AdapterSteps
    (drop_rotated before each save, retain after): no re-encoding runs between saves; only the
    step that stays below the last one is re-encoded, when the run waits at its end."""
    from s4w_core.framework_steps import AdapterSteps

    run = make_run(4)
    steps = AdapterSteps("test", profile="portable")
    st = steps.store(store_url)
    with _events() as ev:
        for i, s in enumerate((10, 20, 30, 40)):
            steps.drop_rotated(st, s, 2)
            steps.save(st, run[i], s, {}, then=lambda: steps.retain(st, 2))
        steps.finish()
        assert all(not coded for _, _, coded in _reencodes(ev, st))
        steps.wait()
    assert _reencodes(ev, st) == [(10, "cancelled", False), (20, "cancelled", False), (30, "written", True)]
    assert [(r.step, r.kind) for r in st.list()] == [(30, "delta"), (40, "keyframe")]
    assert _data(st) == _live(st)
    for i, s in ((2, 30), (3, 40)):
        assert bits_equal(CheckpointStore(store_url).load(s), run[i])


class _Meanwhile(FaultyBackend):
    """Runs ``then`` once, just before the first read of a data object of step ``step`` (another
    process changing the store while this one loads)."""

    def __init__(self, inner: Any, step: int, then: Any) -> None:
        super().__init__(inner, lambda verb, key: False)
        self.prefix, self.then = f"data/step_{step:012d}.", then

    def _maybe(self, key: str) -> None:
        if self.then is not None and key.startswith(self.prefix):
            then, self.then = self.then, None
            then()

    def get(self, key: str) -> bytes:
        self._maybe(key)
        return super().get(key)

    def open_range(self, key: str) -> Any:
        self._maybe(key)
        return super().open_range(key)

    def fetch(self, key: str) -> Any:
        self._maybe(key)
        return super().fetch(key)


@pytest.mark.parametrize("load", [1, 3])
def test_a_load_racing_a_reencoding_elsewhere_reads_the_new_chain(store_url: str, load: int) -> None:
    """A reader reads the records, then another store object saves step 4, which re-encodes step
    3 and deletes its whole object before the reader gets to it (as the base of step 2, the chain
    of step 1; or as step 3's own object): the load reads the records again and loads the new
    chain, bit for bit. With the chain unchanged, a missing object stays an error."""
    run = make_run(5)
    writer = CheckpointStore(store_url, profile="portable")
    for i in (1, 2, 3):
        writer.save(run[i], i)
    writer.wait()
    old3 = writer.info(3).object

    def meanwhile() -> None:
        writer.save(run[4], 4)
        writer.wait()
        assert writer.info(3).object != old3 and old3 not in _data(writer)

    spy = _Meanwhile(open_backend(store_url), 3, meanwhile)
    reader = CheckpointStore(store_url, _backend=spy)
    assert bits_equal(reader.load(load), run[load])
    assert spy.then is None and writer.info(3).kind == "delta"
    # the chain unchanged and an object gone: a clear error, no retry loop
    writer.backend.delete(writer.info(2).object)
    with pytest.raises((CheckpointNotFoundError, BaseMismatchError), match="missing"):
        CheckpointStore(store_url).load(1)


def test_drop_pending_keeps_a_step_whole_until_its_delete(store_url: str) -> None:
    """A step the caller says it deletes soon is not re-encoded (the save above it does not wait
    for that); it loads whole until deleted, and after the delete the next re-encodings run."""
    run = make_run(4)
    st = CheckpointStore(store_url, profile="portable")
    with _events() as ev:
        st.save(run[0], 0)
        st.drop_pending(0)
        st.save(run[1], 1)
        st.wait()
        assert [r.kind for r in st.list()] == ["keyframe", "keyframe"]
        assert bits_equal(st.load(0), run[0])
        st.delete(0)
        st.save(run[2], 2)
        st.save(run[3], 3)
        st.wait()
    re = [(e.step, e.extra["outcome"]) for e in ev if e.op == "reencode" and e.url == st.backend.url]
    assert re == [(0, "cancelled"), (1, "written"), (2, "written")]
    assert [(r.step, r.kind) for r in st.list()] == [(1, "delta"), (2, "delta"), (3, "keyframe")]
    assert _data(st) == _live(st)
    for i in (1, 2, 3):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])


def test_an_adapters_rotation_cancels_the_reencoding_of_the_step_it_deletes(store_url: str) -> None:
    """HF's save_total_limit / Accelerate's total_limit mirrored by AdapterSteps: before the save
    that rotates a step out, that step's re-encoding in flight is stopped (the save would wait
    for it, and the delete after the save drop it)."""
    from s4w_core.framework_steps import AdapterSteps

    run = make_run(3)
    gated = _Gated(open_backend(store_url), "data/step_000000000010.")
    steps = AdapterSteps("test", profile="portable", _backend=gated)
    st = steps.store(store_url)
    with _events() as ev:
        for i, s in enumerate((10, 20)):
            steps.save(st, run[i], s, {}, then=lambda: steps.retain(st, 2))
        assert gated.entered.wait(30), "the re-encoding of step 10 started"
        steps.drop_rotated(st, 30, 2)
        gated.gate.set()
        steps.save(st, run[2], 30, {}, then=lambda: steps.retain(st, 2))
        steps.finish()
        st.wait()
    re = [(e.step, e.extra["outcome"]) for e in ev if e.op == "reencode" and e.url == st.backend.url]
    assert re == [(10, "cancelled"), (20, "written")]
    assert st.steps() == [20, 30] and _data(st) == _live(st)
    assert bits_equal(CheckpointStore(store_url).load(20), run[1])



def test_a_delta_loads_from_its_base_object_after_another_writer_commits_that_step_over_it(store_url: str) -> None:
    """Two writers on one store (a restarted job while the old one still runs): on S3 the commit
    record's create-if-absent is a HEAD then a PUT, so both may commit step 10, the later PUT
    winning -- after the first writer re-encoded its step 9 against its own step 10.  Step 9 still
    loads bit for bit, from the object its delta was made against; step 10 loads as the other
    writer saved it.  Once that object is gone too, step 9 is a clear error."""
    run = make_run(3)
    st = CheckpointStore(store_url, profile="portable")
    st.save(run[0], 9)
    st.save(run[1], 10)
    st.wait()
    assert st.info(9).kind == "delta" and st.info(9).base_step == 10
    mine = st.info(10).object
    other_url = f"memory://t-{uuid.uuid4().hex[:12]}"
    try:
        other = CheckpointStore(other_url, profile="portable")
        other.save(run[2], 10)
        other.wait()
        theirs = other.info(10).object
        st.backend.put(theirs, other.backend.get(theirs))
        st.backend.put(commit_key(10), other.backend.get(commit_key(10)))  # the later PUT wins
        other.close()
    finally:
        MemoryBackend.drop(other_url[len("memory://") :])
    reader = CheckpointStore(store_url)
    assert reader.info(10).object == theirs != mine
    assert bits_equal(reader.load(9), run[0])
    assert bits_equal(reader.load(10), run[2])
    st.backend.delete(mine)
    with pytest.raises(BaseMismatchError, match="step 9.*replaced"):
        CheckpointStore(store_url).load(9)


def test_a_reencoding_a_caller_waits_for_runs_in_the_foreground(store_url: str) -> None:
    """The re-encoding behind a save runs beside training: not in the foreground (the GPU writer
    keeps its device-memory bound) until a caller blocks on it -- wait() at the end of training, or
    the next save -- from which point it is (the GPU writer then codes in a blocking save's batches)."""
    from s4w_core.workers import in_foreground

    run = make_run(3)
    gated = _Gated(open_backend(store_url), "data/step_000000000000.")
    st = CheckpointStore(store_url, profile="portable", _backend=gated)
    seen: list[tuple[int, bool]] = []
    real = st._encode_into  # noqa: SLF001 - the re-encoding's coding call, observed

    def observed(state: Any, out: Any, provider: Any, step: int, extra: Any) -> Any:
        seen.append((step, in_foreground()))
        return real(state, out, provider, step, extra)

    st._encode_into = observed  # type: ignore[method-assign]  # noqa: SLF001
    st.save(run[0], 0)
    st.save(run[1], 1)
    assert gated.entered.wait(30), "the re-encoding of step 0 started"
    assert (0, False) in seen and not in_foreground()  # nobody waits: beside training
    waiter = threading.Thread(target=st.wait)
    waiter.start()
    flag = None
    for _ in range(300):  # the job, blocked in its write, now has a caller waiting for it
        flag = st._pipe.waited()  # noqa: SLF001
        if flag:
            break
        time.sleep(0.01)
    assert flag, "wait() counts as a caller blocked on the store"
    gated.gate.set()
    waiter.join(60)
    assert not st._pipe.waited()  # noqa: SLF001 - the count falls back once the wait returns
    st.save(run[2], 2)
    st.wait()
    assert [r.kind for r in st.list()] == ["delta", "delta", "keyframe"]
    for i in range(3):
        assert bits_equal(CheckpointStore(store_url).load(i), run[i])


def test_foreground_is_asked_again_and_ends_with_its_block() -> None:
    from s4w_core.workers import foreground, in_foreground

    waiting = [False]
    assert not in_foreground()
    with foreground(lambda: waiting[0]):
        assert not in_foreground()
        waiting[0] = True
        assert in_foreground()
        box: list[bool] = []
        t = threading.Thread(target=lambda: box.append(in_foreground()))
        t.start()
        t.join()
        assert box == [False]  # another thread's work is not this one's
    assert not in_foreground()

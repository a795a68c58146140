"""Crashes and bad input: every failure leaves earlier checkpoints loadable, lists no partial
checkpoint, and names what is wrong."""

from __future__ import annotations

import gc
import json

import pytest

from s4w_core.errors import (
    BaseMismatchError,
    CheckpointNotFoundError,
    FormatError,
    ManifestError,
    StoreError,
    TruncatedError,
)
from s4w_core.store import CheckpointStore, open_backend
from s4w_core.store._backend import Backend
from s4w_core.store.records import DATA

from .helpers import Crash, FaultyBackend, bits_equal, make_run


def _filled(url: str, n: int = 3) -> tuple[CheckpointStore, list]:
    run = make_run(n + 1)
    st = CheckpointStore(url, profile="portable")
    for i in range(n):
        st.save(run[i], i)
    st.wait()  # the step below the newest is re-encoded behind the save: let it land
    return st, run


@pytest.mark.parametrize("where", ["data-stream", "commit", "data-open"])
def test_crash_during_save_leaves_earlier_steps(store_url: str, where: str) -> None:
    st, run = _filled(store_url)
    before = {o.key for o in st.backend.list("")}

    def fail(verb: str, key: str) -> bool:
        if where == "data-stream":
            return verb == "writer" and key.startswith("data/")
        if where == "commit":
            return verb == "put" and key.startswith("commits/")
        return False

    inner = open_backend(store_url)
    faulty = FaultyBackend(inner, fail, after_bytes=1000)
    if where == "data-open":
        class Boom(Exception):
            pass

        bad = make_run(4)[3]
        bad["oops"] = object()  # unsupported type: the encoder raises mid-save
        crashing = CheckpointStore(store_url, profile="portable", _backend=inner)
        with pytest.raises(Exception):
            crashing.save(bad, 3)
    else:
        crashing = CheckpointStore(store_url, profile="portable", _backend=faulty)
        with pytest.raises(Crash):
            crashing.save(run[3], 3)
    gc.collect()
    reader = CheckpointStore(store_url)
    assert reader.steps() == [0, 1, 2], "no partial checkpoint is listed"
    for i in range(3):
        assert bits_equal(reader.load(i), run[i])
    after = {o.key for o in reader.backend.list("")}
    assert after == before, f"a failed save leaves no object behind: {sorted(after - before)}"
    # and the store goes on: the same step saves fine afterwards
    reader.save(run[3], 3)
    assert bits_equal(CheckpointStore(store_url).load(3), run[3])


def test_crash_during_delete_keeps_everything_loadable(store_url: str) -> None:
    st, run = _filled(store_url, 4)
    inner = open_backend(store_url)
    faulty = FaultyBackend(inner, lambda verb, key: verb == "delete" and key.startswith("data/"))
    with pytest.raises(Crash):
        CheckpointStore(store_url, _backend=faulty).delete(0, rebase=True)
    rd = CheckpointStore(store_url)
    assert rd.steps() == [1, 2, 3]
    for i in (1, 2, 3):
        assert bits_equal(rd.load(i), run[i])
    rd.gc(grace_seconds=0)
    assert {o.key for o in rd.backend.list(DATA)} == {o for r in rd.list() for o in r.live_objects}


def test_truncated_data_object(store_url: str) -> None:
    st, run = _filled(store_url)
    obj = st.info(1).object
    data = st.backend.get(obj)
    st.backend.put(obj, data[: len(data) // 2])
    with pytest.raises(TruncatedError, match=obj.split("/")[-1]):
        CheckpointStore(store_url).load(1)
    assert bits_equal(CheckpointStore(store_url).load(2), run[2]), "other steps unaffected"
    rep = CheckpointStore(store_url).verify(1)
    assert not rep.ok and "TruncatedError" in rep.problems[0] and len(rep.problems) == 1


def test_missing_base(store_url: str) -> None:
    st, run = _filled(store_url)
    assert [(r.kind, r.base_step) for r in st.list()] == [("delta", 1), ("delta", 2), ("keyframe", None)]
    base_obj = st.info(1).object
    st.backend.delete(base_obj)
    with pytest.raises(BaseMismatchError, match=r"step 0: its delta base object .* is missing"):
        CheckpointStore(store_url).load(0)
    assert bits_equal(CheckpointStore(store_url).load(2), run[2]), "the newest step needs no base"


def test_base_step_no_longer_committed(store_url: str) -> None:
    """A delta whose base step's commit record is gone (removed behind the store's back) is a
    BaseMismatchError naming that step, even once its old data object is gone too."""
    st, run = _filled(store_url)
    old = st.info(1).object
    st.backend.delete("commits/step_000000000001.json")
    st.backend.delete(old)
    with pytest.raises(BaseMismatchError, match="base object .* is missing|step 1, is no longer committed"):
        CheckpointStore(store_url).load(0)
    assert bits_equal(CheckpointStore(store_url).load(2), run[2])


def test_corrupt_base(store_url: str) -> None:
    st, run = _filled(store_url)
    base_obj = st.info(1).object
    data = bytearray(st.backend.get(base_obj))
    data[100] ^= 0xFF  # inside the chunk data
    st.backend.put(base_obj, bytes(data))
    with pytest.raises(BaseMismatchError, match="corrupt"):
        CheckpointStore(store_url).load(0)
    with pytest.raises(FormatError):
        CheckpointStore(store_url).load(1)
    rep = CheckpointStore(store_url).verify(0)
    assert not rep.ok and "BaseMismatchError" in rep.problems[0]
    assert bits_equal(CheckpointStore(store_url).load(2), run[2])


@pytest.mark.parametrize("damage", ["missing", "corrupt", "truncated"])
def test_a_save_over_an_unreadable_newest_step_succeeds(
    store_url: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The next save of a store whose newest step cannot be read (its object missing, corrupt or
    cut short; the store holds no copy of it in memory) does not fail: the new step is whole,
    and re-encoding the damaged step against it fails with a WARNING and leaves it as it was."""
    st, run = _filled(store_url)
    newest = st.info(2)
    assert newest.kind == "keyframe"
    data = st.backend.get(newest.object)
    if damage == "missing":
        st.backend.delete(newest.object)
    elif damage == "corrupt":
        buf = bytearray(data)
        buf[100] ^= 0xFF  # inside the first storage's chunks
        st.backend.put(newest.object, bytes(buf))
    else:
        st.backend.put(newest.object, data[: len(data) // 2])
    fresh = CheckpointStore(store_url, profile="portable")  # no copy in memory: it reads step 2
    with caplog.at_level("WARNING", logger="s4w_core.store"):
        info = fresh.save(run[3], 3)
        fresh.wait()
    assert info.kind == "keyframe" and info.depth == 0
    assert "re-encoding step 2" in caplog.text and "it stays whole" in caplog.text
    assert fresh.info(2) == newest, "the damaged step is left as it was"
    assert bits_equal(CheckpointStore(store_url).load(3), run[3])
    assert CheckpointStore(store_url).verify(3).ok


def test_a_save_over_an_unreadable_newest_step_reads_it_once(store_url: str) -> None:
    """A data object that cannot be opened is tried once per save, not once per storage."""
    st, run = _filled(store_url)
    st.backend.delete(st.info(2).object)
    opened: list[str] = []
    fresh = CheckpointStore(store_url, profile="portable")
    real = fresh._open  # noqa: SLF001

    def spy(key: str, *a: object, **k: object):  # type: ignore[no-untyped-def]
        opened.append(key)
        return real(key, *a, **k)  # type: ignore[arg-type]

    fresh._open = spy  # type: ignore[method-assign]  # noqa: SLF001
    assert fresh.save(run[3], 3).kind == "keyframe"
    fresh.wait()
    assert opened.count(st.info(2).object) == 1


def test_replaced_base_is_detected(store_url: str) -> None:
    """A base object swapped for another valid container is caught by the recorded checksum."""
    st, run = _filled(store_url)
    st.backend.put(st.info(1).object, st.backend.get(st.info(2).object))
    with pytest.raises((BaseMismatchError, TruncatedError)):
        CheckpointStore(store_url).load(0)


def test_base_step_pointing_at_other_bytes_is_detected(store_url: str) -> None:
    """A base found through its step's commit record (its first data object is gone) must decode
    to the bytes the delta was made against: a record pointing elsewhere is a BaseMismatchError."""
    st, run = _filled(store_url)
    key = "commits/step_000000000001.json"
    one, two = st.info(1), st.info(2)
    rec = json.loads(st.backend.get(key))
    rec.update(object=two.object, objects=[two.object], object_bytes=two.object_bytes, kind="keyframe", base_step=None)
    st.backend.put(key, json.dumps(rec).encode())
    st.backend.delete(one.object)
    with pytest.raises(BaseMismatchError, match="other bytes|not the one the delta was made against"):
        CheckpointStore(store_url).load(0)


def test_commit_naming_missing_object(store_url: str) -> None:
    st, run = _filled(store_url)
    key = "commits/step_000000000001.json"
    rec = json.loads(st.backend.get(key))
    rec["object"] = rec["objects"][0] = "data/step_000000000001.nothere.s4w"
    st.backend.put(key, json.dumps(rec).encode())
    with pytest.raises(CheckpointNotFoundError, match="step 1: its data object data/step_000000000001.nothere.s4w is missing"):
        CheckpointStore(store_url).load(1)
    assert bits_equal(CheckpointStore(store_url).load(2), run[2])


def test_corrupt_commit_record(store_url: str) -> None:
    st, _ = _filled(store_url)
    st.backend.put("commits/step_000000000001.json", b'{"format": "s4weights-store", "vers')
    with pytest.raises(ManifestError, match="commits/step_000000000001.json is invalid"):
        CheckpointStore(store_url).steps()
    st.backend.put("commits/step_000000000001.json", json.dumps({"format": "s4weights-store", "version": 1, "step": 7}).encode())
    with pytest.raises(ManifestError, match="names step 7"):
        CheckpointStore(store_url).steps()


def test_bad_arguments(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        CheckpointStore(str(tmp_path), keep_last=0)
    with pytest.raises(ValueError):
        CheckpointStore(str(tmp_path), keyframe_every=0)
    with pytest.raises(ValueError, match="step must be"):
        CheckpointStore(str(tmp_path)).save({}, -1)
    with pytest.raises(ValueError, match="unsupported store URL"):
        CheckpointStore("gs://bucket/x")
    with pytest.raises(ValueError, match="apply only to s3"):
        CheckpointStore(str(tmp_path), endpoint="http://127.0.0.1:1")
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(StoreError, match="not a directory"):
        CheckpointStore(str(f))


class _LostAnswer(FaultyBackend):
    """A commit record's put whose answer never comes back (a reset connection, a timeout on an S3
    PUT): ``lose(key, n)`` says whether the ``n``-th put of ``key`` (from 1) does that. ``applied``:
    the backend applied it all the same (else it did not, and reading that record back fails
    too: whether it landed cannot be told)."""

    def __init__(self, inner, lose, applied: bool = True) -> None:  # type: ignore[no-untyped-def]
        super().__init__(inner, lambda verb, key: False)
        self.lose, self.applied, self.puts = lose, applied, {}
        self.lost: set[str] = set()

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        n = self.puts[key] = self.puts.get(key, 0) + 1
        if not self.lose(key, n):
            self.inner.put(key, data, if_absent=if_absent)
            return
        if self.applied:
            self.inner.put(key, data, if_absent=if_absent)
        self.lost.add(key)
        raise StoreError(f"injected: the answer to the put of {key} was lost")

    def get(self, key: str) -> bytes:
        if not self.applied and key in self.lost:
            raise StoreError(f"injected: cannot read {key}")
        return self.inner.get(key)


def test_a_commit_whose_answer_was_lost_is_a_commit(store_url: str) -> None:
    run = make_run(2)
    inner = open_backend(store_url)
    st = CheckpointStore(store_url, profile="portable", _backend=_LostAnswer(inner, lambda k, n: k == "commits/step_000000000001.json"))
    info = st.save(run[0], 1)  # the record landed: the save succeeded, its object kept
    assert CheckpointStore(store_url).steps() == [1]
    assert bits_equal(CheckpointStore(store_url).load(1), run[0])
    assert info.object in {o.key for o in inner.list(DATA)}


def test_a_reencoding_whose_commit_answer_was_lost_keeps_the_step(store_url: str) -> None:
    # the step below a save is re-encoded as a delta and its record replaced (its second put): that
    # put lands and its answer is lost -- the new object must stay (it is the step now), the old
    # whole one go; before, the new one was deleted and the step pointed at nothing
    run = make_run(3)
    inner = open_backend(store_url)
    st = CheckpointStore(store_url, profile="portable",
                         _backend=_LostAnswer(inner, lambda k, n: k == "commits/step_000000000000.json" and n == 2))
    st.save(run[0], 0)
    st.save(run[1], 1)
    st.wait()
    rd = CheckpointStore(store_url)
    assert rd.info(0).kind == "delta"  # the re-encoding's record landed
    for i in (0, 1):
        assert bits_equal(rd.load(i), run[i])
    assert {o.key for o in inner.list(DATA)} == {r.object for r in rd.list()}  # nothing lost, nothing left


def _step_zero(store_url: str) -> tuple[list, Backend]:
    """A store holding step 0 of a run (its states) and the store's own backend."""
    run = make_run(2)
    CheckpointStore(store_url, profile="portable").save(run[0], 0)
    return run, open_backend(store_url)


def test_a_commit_that_cannot_be_told_leaves_its_object_to_gc(store_url: str) -> None:
    # the put failed and its record cannot be read back: the save fails, its object stays (it might
    # be named); the store loads, and gc() removes the object once it is known unreferenced
    run, inner = _step_zero(store_url)
    unknown = _LostAnswer(inner, lambda k, n: k == "commits/step_000000000001.json", applied=False)
    with pytest.raises(StoreError, match="lost"):
        CheckpointStore(store_url, profile="portable", _backend=unknown).save(run[1], 1)
    rd = CheckpointStore(store_url)
    assert rd.steps() == [0] and bits_equal(rd.load(0), run[0])
    left = {o.key for o in inner.list(DATA)} - {r.object for r in rd.list()}
    assert len(left) == 1  # the failed save's object, not deleted blindly
    rd.gc(grace_seconds=0)
    assert {o.key for o in inner.list(DATA)} == {r.object for r in rd.list()}


def test_a_commit_known_not_to_have_landed_removes_its_object(store_url: str) -> None:
    run, inner = _step_zero(store_url)
    before = {o.key for o in inner.list("")}
    failing = FaultyBackend(inner, lambda verb, key: verb == "put" and key == "commits/step_000000000001.json")
    with pytest.raises(Crash):
        CheckpointStore(store_url, profile="portable", _backend=failing).save(run[1], 1)
    assert {o.key for o in inner.list("")} == before  # read back: no record, so the object went

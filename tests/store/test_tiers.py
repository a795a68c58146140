"""Tiers (``CheckpointStore(url, fast_tier=..., fast_keep_last=N)``): a save commits to the fast
tier first and is copied to the slow tier (the store's URL: a local directory or a real S3
server) behind it; a load reads the fast tier's copy when there is one and the slow tier
otherwise; the fast tier keeps its newest steps and never one the slow tier lacks; a failed
upload surfaces like any background error and is retried by the next save or ``sync()``."""

from __future__ import annotations

import copy
import json
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from s4w_core.errors import AsyncSaveError
from s4w_core.store import CheckpointStore, open_backend
from s4w_core.store._backend import Backend, RangeReader
from s4w_core.store._memory import MemoryBackend

from .helpers import Crash, FaultyBackend, bits_equal, make_run


class Spy(FaultyBackend):
    """Counts reads of data objects; data writes wait for ``gate``; fails writes while ``broken``."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner, lambda verb, key: self.broken and verb == "writer" and key.startswith("data/"), 10)
        self.broken = False
        self.reads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def writer(self, key: str) -> Any:
        if key.startswith("data/"):
            assert self.gate.wait(60), "gate never opened"
        return super().writer(key)

    def fetch(self, key: str) -> RangeReader:
        self.reads.append(key)
        return super().fetch(key)

    def open_range(self, key: str) -> RangeReader:
        self.reads.append(key)
        return super().open_range(key)


@pytest.fixture(
    params=[
        ("local", "memory"),
        pytest.param(("s3", "local"), marks=pytest.mark.s3),
        pytest.param(("s3", "memory"), marks=pytest.mark.s3),
    ],
    ids=lambda p: f"{p[0]}-behind-{p[1]}",
)
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    slow, fast = request.param
    slow_url = request.getfixturevalue("s3_url") if slow == "s3" else str(tmp_path / "slow")
    if fast == "memory":
        name = f"fast-{uuid.uuid4().hex[:12]}"
        request.addfinalizer(lambda: MemoryBackend.drop(name))
        return slow_url, f"memory://{name}"
    return slow_url, str(tmp_path / "fast")


def _keys(b: Backend, prefix: str) -> set[str]:
    return {o.key for o in b.list(prefix)}


def _commits(b: Backend) -> list[int]:
    return sorted(int(k[len("commits/step_") :][:12]) for k in _keys(b, "commits/"))


def _wipe(b: Backend) -> None:
    for k in _keys(b, ""):
        b.delete(k)


def test_save_commits_on_fast_then_uploads_and_loads_read_fast(tiers: tuple[str, str]) -> None:
    slow_url, fast_url = tiers
    slow = Spy(open_backend(slow_url))
    st = CheckpointStore(slow_url, fast_tier=fast_url, fast_keep_last=2, keyframe_every=4, profile="portable", _backend=slow)
    fast = open_backend(fast_url)
    run = make_run(6)
    expected = []
    slow.gate.clear()
    info = st.save(run[0], 0)  # blocking: returns once committed on the fast tier
    assert _commits(fast) == [0] and _commits(slow) == [] and st.info(0).tiers == ("fast",)
    assert st.in_flight is not None and info.kind == "keyframe"
    slow.gate.set()
    st.wait()
    assert _commits(slow) == [0] and st.info(0).tiers == ("fast", "slow")
    expected.append(copy.deepcopy(run[0]))
    for i in range(1, 6):
        expected.append(copy.deepcopy(run[i]))
        h = st.save_async(run[i], i)
        run[i]["model"]["w32"].add_(1)  # the caller goes on at once
        run[i]["optimizer"]["state"][0]["exp_avg"].zero_()
    st.wait()
    assert "upload" in h.stages and h.mode == "async-snapshot"
    assert _commits(slow) == list(range(6)) and _commits(fast) == [4, 5]
    # the fast tier holds exactly what its steps' chains need; the record format is unchanged
    recs = {r.step: r for r in st.list()}
    assert _keys(fast, "data/") == set(recs[4].live_objects) | set(recs[5].live_objects)
    # the newest step is whole; the step below it, re-encoded on the fast tier, was uploaded too
    assert recs[5].kind == "keyframe" and recs[4].base_step == 5
    assert json.loads(slow.get("commits/step_000000000004.json"))["object"] == recs[4].object
    assert _keys(slow, "data/") == {r.object for r in recs.values()}
    assert [recs[s].tiers for s in range(6)] == [("slow",)] * 4 + [("fast", "slow")] * 2
    assert "tiers" not in json.loads(slow.get("commits/step_000000000005.json"))
    assert recs[5].as_dict()["tiers"] == ["fast", "slow"]
    slow.reads.clear()
    for s in (4, 5):
        assert bits_equal(st.load(s), expected[s])
    assert slow.reads == []  # served by the fast tier
    for s in range(4):
        assert bits_equal(st.load(s), expected[s])
    assert slow.reads  # the older steps came from the slow tier
    st.close()


def test_load_falls_back_to_slow_and_a_fresh_fast_tier_resumes(tiers: tuple[str, str], tmp_path: Path) -> None:
    slow_url, fast_url = tiers
    run = make_run(5)
    st = CheckpointStore(slow_url, fast_tier=fast_url, fast_keep_last=3, profile="portable")
    for i in range(3):
        st.save(run[i], i)
    st.wait()
    fast = open_backend(fast_url)
    _wipe(fast)  # the node's local disk is gone
    assert [r.tiers for r in st.list()] == [("slow",)] * 3
    for i in range(3):
        assert bits_equal(st.load(i), run[i])
    st.close()
    # a new process on a new node: empty fast tier, the chain's base only on the slow tier
    fresh = str(tmp_path / "fresh-fast")
    st2 = CheckpointStore(slow_url, fast_tier=fresh, fast_keep_last=3, profile="portable")
    st2.save(run[3], 3)
    st2.wait()  # step 2, only on the slow tier, becomes a delta against step 3 there
    assert st2.info(3).kind == "keyframe" and st2.info(2).base_step == 3 and st2.info(2).tiers == ("slow",)
    assert bits_equal(st2.load(3), run[3])
    assert bits_equal(st2.load(2), run[2])  # its own object from the slow tier, its base from either
    st2.save_async(run[4], 4).result(timeout=120)
    _wipe(open_backend(fresh))
    for i in range(5):
        assert bits_equal(st2.load(i), run[i])
    st2.close()


def test_upload_failure_keeps_the_step_and_is_retried(tmp_path: Path) -> None:
    slow_url, fast_url = str(tmp_path / "slow"), str(tmp_path / "fast")
    slow = Spy(open_backend(slow_url))
    st = CheckpointStore(slow_url, fast_tier=fast_url, fast_keep_last=1, profile="portable", _backend=slow)
    fast = open_backend(fast_url)
    run = make_run(4)
    st.save(run[0], 0)
    st.wait()
    slow.broken = True
    st.save(run[1], 1)  # committed on the fast tier; its upload fails behind
    with pytest.raises(AsyncSaveError, match="upload") as ei:
        st.wait()
    assert "step 1" in str(ei.value) and "sync()" in str(ei.value) and ei.value.__cause__ is not None
    assert _commits(slow) == [0] and _commits(fast) == [1] and st.steps() == [0, 1]
    assert not [k for k in _keys(slow, "data/") if "step_000000000001" in k]  # no half object
    slow.broken = False
    st.save(run[2], 2)  # the next save's upload takes step 1 along
    st.wait()
    assert _commits(slow) == [0, 1, 2] and _commits(fast) == [2]
    slow.broken = True
    h = st.save_async(run[3], 3)
    with pytest.raises(Crash):  # the handle re-raises the original error...
        h.result(timeout=60)
    st.wait()  # ...and the store then does not raise it again
    assert _commits(fast) == [3] and _commits(slow) == [0, 1, 2]  # 2 may go, 3 may not: slow lacks it
    slow.broken = False
    assert st.sync() == [3]
    assert _commits(slow) == [0, 1, 2, 3] and _commits(fast) == [3]
    st.wait()  # the retried failure is not reported again
    _wipe(fast)
    for i in range(4):
        assert bits_equal(st.load(i), run[i])
    st.close()


def test_retention_delete_and_gc_cover_both_tiers(tmp_path: Path) -> None:
    slow_url = str(tmp_path / "slow")
    fast_url = f"memory://fast-{uuid.uuid4().hex[:12]}"
    try:
        st = CheckpointStore(slow_url, fast_tier=fast_url, fast_keep_last=2, keep_last=3, keyframe_every=10, profile="portable")
        run = make_run(6)
        for i in range(5):
            st.save(run[i], i)
        st.wait()
        slow, fast = st.backend, open_backend(fast_url)
        assert st.steps() == [2, 3, 4] and _commits(slow) == [2, 3, 4] and _commits(fast) == [3, 4]
        st.delete(3)  # step 2 is a delta against it: hidden on both tiers, nothing re-coded
        assert st.steps() == [2, 4]
        for b in (slow, fast):
            assert json.loads(b.get("commits/step_000000000003.json"))["hidden"] is True
        assert st.gc(grace_seconds=0) == 0  # nothing unreferenced was left on either tier
        for s in (2, 4):
            assert bits_equal(st.load(s), run[s])
        st.delete(2, rebase=True)  # nothing needs step 3 any more: collected from both tiers
        st.wait()
        assert st.steps() == [4] and _commits(slow) == [4] and 3 not in _commits(fast)
        live = set(st.info(4).objects)
        assert _keys(slow, "data/") == live and _keys(fast, "data/") <= live
        assert bits_equal(st.load(4), run[4])
        st.close()
        with pytest.raises(ValueError, match="own location"):
            CheckpointStore(slow_url, fast_tier=slow_url)
        with pytest.raises(ValueError, match="fast_keep_last"):
            CheckpointStore(slow_url, fast_tier=fast_url, fast_keep_last=0)
    finally:
        MemoryBackend.drop(fast_url[len("memory://") :])

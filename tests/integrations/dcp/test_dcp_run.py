"""The run-level DCP API: ``S4StorageWriter(root, step=N)`` / ``S4StorageReader(root, step=...)``.

Per-rank delta chains over gloo process groups (DTensors on a CPU mesh), resharding N->M loads,
older-step loads, a rank killed mid-save, ranged reads, S3 on SeaweedFS.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s4w_core import CheckpointStore
from s4w_core.dcp import S4StorageReader, S4StorageWriter, close_rank_stores, committed_steps, wait_rank_stores
from s4w_core.dcp.run import RunRoot, rank_store, rank_store_name, run_bytes

from .run_worker import diff, full_state

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
WORKER = os.path.join(ROOT, "tests/integrations/dcp/run_worker.py")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _worker(tmp: Path, *args: str, expect_ok: bool = True) -> dict[str, Any]:
    out = tmp / f"result_{len(list(tmp.glob('result_*')))}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, WORKER, "--out", str(out), *args], env=env, capture_output=True, text=True, timeout=240
    )
    if expect_ok:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()) if out.exists() else {"returncode": r.returncode, "stderr": r.stderr[-3000:]}


def _plain_zeros(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _plain_zeros(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def _load_plain(root: Any, step: int | None) -> Any:
    target = _plain_zeros(full_state(0))
    dcp.load(target, storage_reader=S4StorageReader(root, step=step), no_dist=True)
    return target


@pytest.fixture(autouse=True)
def _close_stores() -> Any:
    """The store objects a test's loads and saves opened in this process go with the test."""
    yield
    close_rank_stores()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """3 steps saved by 2 gloo ranks (Shard(0)), each then loaded by the same 2 ranks as Shard(1)
    (the newest) and Replicate (the oldest) -- done once for the module."""
    tmp = tmp_path_factory.mktemp("run2")
    root = tmp / "run"
    res = _worker(tmp, "--root", str(root), "--nproc", "2", "--phase", "save", "--steps", "10,20,30",
                  "--placement", "shard0", "--load", "none:shard1,10:replicate")
    return root, res


def test_two_ranks_chain_later_steps_smaller_and_placement_changes_bit_exact(two_rank_run: Any) -> None:
    root, res = two_rank_run
    assert res["committed"] == [10, 20, 30]
    assert res["loads"] == {"none:shard1": [], "10:replicate": []}, res
    grew = {int(k): v for k, v in res["grew"].items()}
    # each later step adds a delta (the step below re-coded against it), not a whole step
    assert grew[20] <= 0.6 * grew[10] and grew[30] <= 0.6 * grew[10], grew
    # one store per rank, each with the three steps: newest whole, the others reverse deltas
    for r in (0, 1):
        st = RunRoot(root).store_url(rank_store_name(r))
        infos = {i.step: i for i in CheckpointStore(st).list()}
        assert sorted(infos) == [10, 20, 30]
        assert infos[30].kind == "keyframe" and infos[20].kind == "delta" and infos[20].base_step == 30


def test_two_ranks_to_one_process_newest_and_older_steps(two_rank_run: Any) -> None:
    root, _ = two_rank_run
    for step in (None, 20, 10):
        got = _load_plain(root, step)
        assert diff(got, full_state(step or 30)) == [], step


def test_two_ranks_to_three_ranks_then_three_ranks_save_on(two_rank_run: Any, tmp_path: Path) -> None:
    """3 ranks load the 2-rank run's steps (Shard(1), Replicate), save step 40 as Shard(1) -- every
    shard's placement changed, so nothing is a delta across 30 -> 40 -- and load it back."""
    src, _ = two_rank_run
    root = tmp_path / "run"
    shutil.copytree(src, root)
    res = _worker(tmp_path, "--root", str(root), "--nproc", "3", "--phase", "save", "--steps", "40",
                  "--placement", "shard1", "--load", "20:shard1,30:replicate,none:shard0")
    assert res["loads"] == {"20:shard1": [], "30:replicate": [], "none:shard0": []} and res["world"] == 3, res
    assert res["committed"] == [10, 20, 30, 40]
    stores = [CheckpointStore(RunRoot(root).store_url(rank_store_name(r))) for r in range(3)]
    assert stores[2].steps() == [40]
    for st in stores[:2]:
        kinds = {i.step: i.kind for i in st.list()}
        # 30 stays whole: no storage of 40 has its placement; 20 and 10 stay deltas
        assert kinds == {10: "delta", 20: "delta", 30: "keyframe", 40: "keyframe"}, kinds
    assert diff(_load_plain(root, 30), full_state(30)) == []


def test_rank_killed_mid_save_leaves_nothing_visible_and_the_run_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "run"
    res = _worker(tmp_path, "--root", str(root), "--nproc", "2", "--phase", "kill", "--steps", "1,2,3",
                  "--timeout", "10", expect_ok=False)
    assert res.get("returncode", 0) != 0, res
    assert committed_steps(root) == [1, 2]  # step 3 never committed: rank 1 died inside its write
    got = _load_plain(root, None)
    assert diff(got, full_state(2)) == []
    # the run resumes in one process: step 3 again (what rank 0 left of it is overwritten), then 4
    try:
        for s in (3, 4):
            dcp.save(full_state(s), storage_writer=S4StorageWriter(root, step=s), no_dist=True)
        wait_rank_stores(root)
        assert committed_steps(root) == [1, 2, 3, 4]
        for s in (1, 2, 3, 4):
            assert diff(_load_plain(root, s), full_state(s)) == [], s
    finally:
        close_rank_stores(root)


def _counting(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes read from ``store``'s objects through ranged reads, counted."""
    got: list[int] = []
    backend = store.backend
    real = backend.open_range

    def open_range(key: str) -> Any:
        rr = real(key)
        read, readinto = rr.read, rr.readinto

        def counted_read(o: int, n: int) -> bytes:
            b = read(o, n)
            got.append(len(b))
            return b

        rr.read = counted_read
        if readinto is not None:

            def counted_into(o: int, bufs: Any) -> int:
                n = readinto(o, bufs)
                got.append(n)
                return n

            rr.readinto = counted_into
        return rr

    monkeypatch.setattr(backend, "open_range", open_range)
    return got


def test_a_partial_load_reads_only_the_storages_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "run"
    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(256, 256, generator=g), "b": torch.randn(256, 256, generator=g)}
    try:
        dcp.save(sd, storage_writer=S4StorageWriter(root, step=5), no_dist=True)
        store = rank_store(RunRoot(root), rank_store_name(0))
        obj = store.info(5).object_bytes
        got = _counting(store, monkeypatch)
        out = {"b": torch.zeros(256, 256)}
        dcp.load(out, storage_reader=S4StorageReader(root), no_dist=True)
        assert torch.equal(out["b"].view(torch.int32), sd["b"].view(torch.int32))
        assert 0 < sum(got) < 0.6 * obj, (sum(got), obj)  # "a" was not read
    finally:
        close_rank_stores(root)


def test_run_errors_name_what_is_wrong(tmp_path: Path) -> None:
    root = tmp_path / "run"
    # DCP wraps a rank's exception in its CheckpointException (a BaseException), whose text carries ours
    with pytest.raises(BaseException, match="no committed s4weights DCP"):
        _load_plain(root, None)
    try:
        dcp.save(full_state(1), storage_writer=S4StorageWriter(root, step=1), no_dist=True)
        with pytest.raises(BaseException, match=r"step 7 is not committed .*\(committed: \[1\]\)"):
            _load_plain(root, 7)
        with pytest.raises(BaseException, match="step 1 is committed under .* and overwrite=False"):
            dcp.save(full_state(1), storage_writer=S4StorageWriter(root, step=1, overwrite=False), no_dist=True)
        with pytest.raises(ValueError):
            S4StorageWriter(root, step=-1)
    finally:
        close_rank_stores(root)


@pytest.mark.s3
def test_s3_chain_older_steps_and_partial_loads(s3_url: str) -> None:
    root = f"{s3_url}/run"
    try:
        sizes = []
        for s in (10, 20, 30):
            dcp.save(full_state(s), storage_writer=S4StorageWriter(root, step=s), no_dist=True)
            wait_rank_stores(root)
            sizes.append(run_bytes(root))
        grew = [sizes[0], sizes[1] - sizes[0], sizes[2] - sizes[1]]
        assert grew[1] <= 0.6 * grew[0] and grew[2] <= 0.6 * grew[0], grew
        assert committed_steps(root) == [10, 20, 30]
        for s in (None, 10):
            assert diff(_load_plain(root, s), full_state(s or 30)) == [], s
        part = {"model": {"w": torch.zeros_like(full_state(0)["model"]["w"])}}
        dcp.load(part, storage_reader=S4StorageReader(root, step=20), no_dist=True)
        assert diff(part["model"]["w"], full_state(20)["model"]["w"]) == []
    finally:
        close_rank_stores(root)


def test_async_saves_of_a_run_then_resume_and_save_on(tmp_path: Path) -> None:
    """``dcp.async_save`` into a run (the state may change once it returns), three steps; a fresh
    store object (a restarted process) loads the newest and saves the next step against it."""
    root = tmp_path / "run"
    try:
        for s in (1, 2, 3):
            state = full_state(s)
            fut = dcp.async_save(state, storage_writer=S4StorageWriter(root, step=s), no_dist=True)
            state["model"]["w"].zero_()  # training goes on: the save has its own copy
            fut.result()
        close_rank_stores(root)  # as after a restart: no delta base in memory
        assert committed_steps(root) == [1, 2, 3]
        assert diff(_load_plain(root, None), full_state(3)) == []
        dcp.save(full_state(4), storage_writer=S4StorageWriter(root, step=4), no_dist=True)
        wait_rank_stores(root)
        for s in (1, 2, 3, 4):
            assert diff(_load_plain(root, s), full_state(s)) == [], s
        kinds = {i.step: i.kind for i in rank_store(RunRoot(root), rank_store_name(0)).list()}
        assert kinds == {1: "delta", 2: "delta", 3: "delta", 4: "keyframe"}, kinds
    finally:
        close_rank_stores(root)


def _cuda(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _cuda(v) for k, v in obj.items()}
    return obj.cuda() if isinstance(obj, torch.Tensor) else obj


@pytest.mark.gpu
def test_gpu_async_saves_of_a_run_code_on_the_gpu_and_load_onto_it(tmp_path: Path) -> None:
    """CUDA state: ``dcp.async_save`` stages into pinned host buffers and the rank store codes on
    the GPU; the newest and an older step load onto the GPU bit-exact; later steps are deltas."""
    root = tmp_path / "run"
    try:
        infos = []
        for s in (10, 20, 30):
            w = S4StorageWriter(root, step=s)
            dcp.async_save(_cuda(full_state(s)), storage_writer=w, no_dist=True).result()
            infos += w.last_steps
        wait_rank_stores(root)
        assert [i.profile for i in infos] == ["fast"] * 3, infos
        for s in (None, 10):
            target = _cuda(_plain_zeros(full_state(0)))
            dcp.load(target, storage_reader=S4StorageReader(root, step=s), no_dist=True)
            assert target["model"]["w"].is_cuda
            assert diff(target, _cuda(full_state(s or 30))) == [], s
        kinds = {i.step: i.kind for i in rank_store(RunRoot(root), rank_store_name(0)).list()}
        assert kinds == {10: "delta", 20: "delta", 30: "keyframe"}, kinds
    finally:
        close_rank_stores(root)


def test_keep_last_lists_the_newest_steps_and_reclaims_the_others_at_the_next_save(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for s in (1, 2, 3, 4):
        dcp.save(full_state(s), storage_writer=S4StorageWriter(root, step=s, keep_last=2), no_dist=True)
    wait_rank_stores(root)
    assert committed_steps(root) == [3, 4]
    # rank 0's store dropped step 1 at the save of 4; step 2 goes at the next save
    assert rank_store(RunRoot(root), rank_store_name(0)).steps() == [2, 3, 4]
    for s in (3, 4):
        assert diff(_load_plain(root, s), full_state(s)) == [], s
    with pytest.raises(BaseException, match="step 2 is not committed"):
        _load_plain(root, 2)
    dcp.save(full_state(5), storage_writer=S4StorageWriter(root, step=5, keep_last=2), no_dist=True)
    assert rank_store(RunRoot(root), rank_store_name(0)).steps() == [3, 4, 5]
    with pytest.raises(ValueError, match="keep_last"):
        S4StorageWriter(root, keep_last=2)


@pytest.mark.s3
def test_s3_two_ranks_save_a_chain_and_reshard(s3_url: str, tmp_path: Path) -> None:
    """2 gloo ranks save two steps to S3 and load the newest as Shard(1); one process loads both."""
    root = f"{s3_url}/run2"
    res = _worker(tmp_path, "--root", root, "--nproc", "2", "--phase", "save", "--steps", "10,20",
                  "--placement", "shard0", "--load", "none:shard1,10:replicate")
    assert res["loads"] == {"none:shard1": [], "10:replicate": []} and res["committed"] == [10, 20], res
    assert res["grew"]["20"] <= 0.6 * res["grew"]["10"], res["grew"]
    for s in (None, 10):
        assert diff(_load_plain(root, s), full_state(s or 20)) == [], s

"""Retention in a run-level DCP root: a step kept while a newer one it is a delta against is
deleted (``save_total_limit`` keeping the newest and the best) still loads bit-exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from s4w_core.dcp import S4StorageReader, S4StorageWriter, close_rank_stores, committed_steps, wait_rank_stores
from s4w_core.dcp.run import RunRoot, delete_step, rank_store, rank_store_name

from .run_worker import diff, full_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _load(root: Path, step: int) -> Any:
    target = full_state(0)
    dcp.load(target, storage_reader=S4StorageReader(root, step=step), no_dist=True)
    return target


@pytest.mark.parametrize("restart", [False, True])
def test_a_kept_step_whose_delta_base_was_deleted_loads(tmp_path: Path, restart: bool) -> None:
    root = tmp_path / "run"
    try:
        for s in (2, 4, 6, 8):
            dcp.save(full_state(s), storage_writer=S4StorageWriter(root, step=s), no_dist=True)
            wait_rank_stores(root)
            if s >= 6:  # keep the newest and step 4 (the best): delete 2, then 6
                delete_step(root, {6: 2, 8: 6}[s])
        if restart:
            close_rank_stores(root)
        assert committed_steps(root) == [4, 8]
        recs = {i.step: i for i in rank_store(RunRoot(root), rank_store_name(0)).list()}
        assert recs[4].kind == "delta" and recs[4].base_step == 6, recs  # its base, deleted, stays hidden
        for s in (4, 8):
            assert diff(_load(root, s), full_state(s)) == [], s
    finally:
        close_rank_stores(root)

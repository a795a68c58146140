"""S4CheckpointIO frees what it holds when dropped: no reference cycle through its pointer
callbacks keeps its stores (and their host copy of the newest step) alive until the cyclic GC."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
from s4w_lightning import S4CheckpointIO  # noqa: E402
from tests.store.test_small_state_costs import cyclic_garbage  # noqa: E402


def _checkpoint(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "state_dict": {f"w{i}": torch.randn(64, 32, generator=g) for i in range(8)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(64, generator=g)}}, "param_groups": [{"lr": 0.1}]}],
        "global_step": step,
        "epoch": 0,
    }


def test_a_dropped_plugin_leaves_no_cycle(tmp_path: Any) -> None:
    d = tmp_path / "ckpts"

    def train_like() -> None:  # a top-k name and last.ckpt per save, the oldest top-k removed
        io = S4CheckpointIO()
        for step in (10, 20, 30):
            io.save_checkpoint(_checkpoint(step), d / f"step={step}.ckpt")
            io.save_checkpoint(_checkpoint(step), d / "last.ckpt")
            if step == 30:
                io.remove_checkpoint(d / "step=10.ckpt")
        io.teardown()

    def resume() -> None:  # a fresh plugin, as a new process has
        ck = S4CheckpointIO().load_checkpoint(d / "last.ckpt")
        assert ck["global_step"] == 30
        assert torch.equal(ck["state_dict"]["w3"], _checkpoint(30)["state_dict"]["w3"])

    assert cyclic_garbage(train_like) == []
    assert cyclic_garbage(resume) == []

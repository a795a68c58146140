"""s4w_accelerate under Accelerate's FSDP2 with sharded state dicts, 2 CPU processes (gloo) through
torchrun: models and optimizers go into the run-level DCP root as each rank's delta chain, the rest
into the store; total_limit rotates both; load_state resumes bit-exactly (fsdp_worker.py)."""

from __future__ import annotations

import os

import pytest

from tests.integrations._util import torchrun_json

pytest.importorskip("accelerate")


def _check(tmp_path, gpu: bool) -> None:
    worker = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
    got = torchrun_json(worker, str(tmp_path), 300, S4W_FSDP_WORKER_GPU="1" if gpu else "0")
    # total_limit=2: the store and the run both keep steps 1 and 2; the folders hold no payload
    assert got["steps"] == got["committed"] == [1, 2], got
    assert got["checkpoints"] == ["checkpoint_1", "checkpoint_2"] and got["files"] == [], got
    # models and optimizers live in the run, not in the store step
    assert got["sharded"] and got["models"] == got["optimizers"] == 0, got
    assert got["lr"] == pytest.approx([1e-2 * 0.7**6]), got  # the scheduler resumed (2 processes: 2 steps each)
    assert got["same"] == [True, True], got  # every rank's shards of weights and optimizer state, bit for bit
    assert "step 2: the stored shards do not fit" in got["mismatch"], got  # other shapes: nothing loaded


def test_fsdp2_sharded_state_goes_through_the_run_and_resumes_bit_exact(tmp_path):
    _check(tmp_path, gpu=False)


@pytest.mark.gpu
def test_fsdp2_on_two_gpus(tmp_path):
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check(tmp_path, gpu=True)

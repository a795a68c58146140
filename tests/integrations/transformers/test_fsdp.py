"""S4Callback under the HF Trainer's FSDP2 on 2 processes through torchrun (fsdp_worker.py): the
model's and optimizer's shards go into the run-level DCP root as each rank's delta chain, the rest
into the store, no Trainer checkpoint folder or payload file at any moment; save_total_limit rotates
both; resume_from_checkpoint=True resumes bit-exactly on every rank; load_best_model_at_end loads
the best step's shards.  On the CPU (gloo), and on 2
GPUs (NCCL, marker ``gpu``)."""

from __future__ import annotations

import os

import pytest

from tests.integrations._util import torchrun_json

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _check(tmp_path, gpu: bool) -> None:
    worker = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
    got = torchrun_json(worker, str(tmp_path), 400, S4W_FSDP_WORKER_GPU="1" if gpu else "0")
    # the Trainer's FSDP writers never ran; nothing but the store and the run in the output dir, at
    # every on_save (fired for the other callbacks at 2, 4, 6 and, resumed, 8) and at the end
    assert got["native_saves"] == [] and got["probe_files"] == [] and got["files"] == [], got
    assert got["probe_saves"] == [2, 4, 6, 8], got
    # save_total_limit=2 mirrored in the store and the run
    assert got["first_steps"] == [4, 6] and got["steps"] == got["committed"] == [6, 8], got
    # the store step holds no weights or optimizer state, only the pointer to the run's step
    assert got["keys"] == ["config", "rng", "scheduler", "sharded", "trainer_state"] and got["sharded"], got
    for kinds in got["kinds"]:  # each rank: the older step a delta against the newest, and smaller
        assert kinds["4"][0] == "delta" and kinds["6"][0] == "keyframe" and kinds["4"][1] < kinds["6"][1], got
    # every rank's weights, optimizer state and LR, bit for bit: resume_from_checkpoint=True, and the
    # folder restore_checkpoint wrote (no weights or optimizer in it: the pointer to the run's step)
    assert got["same"] == [[True, True], [True, True]], got
    want = [
        "config.json",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "s4w_sharded.json",
        "scheduler.pt",
        "trainer_state.json",
    ]
    assert got["restored"] == want, got
    # load_best_model_at_end: every rank ends with its shards of the best step (4), not of the last (8);
    # save_total_limit=2 keeps the newest and the best, in the store and the run
    assert got["best"] == [[4, True, False], [4, True, False]], got
    assert got["best_steps"] == got["best_committed"] == [4, 8], got
    for m in got["mismatch"]:  # other shapes: a clear error on every rank, naming the step and the key
        assert "step 8: the stored shards do not fit" in m and "transformer.wte.weight" in m, got


def test_fsdp2_trainer_saves_through_the_run_and_resumes_bit_exact(tmp_path):
    _check(tmp_path, gpu=False)


@pytest.mark.gpu
def test_fsdp2_trainer_on_two_gpus(tmp_path):
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check(tmp_path, gpu=True)

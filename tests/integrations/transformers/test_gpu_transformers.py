"""S4Callback on one GPU (marker ``gpu``; skipped without CUDA). Run on the device:

    PYTHONPATH=.:integrations S4W_GPU_RESULTS=runs/integrations python -m pytest -q -m gpu \\
        tests/integrations/transformers/test_gpu_transformers.py

A bf16 GPT-2 on the GPU (full_determinism), the same run three ways: the Trainer's own checkpoints,
S4Callback (blocking or ``async_save``), and an interrupted S4Callback run resumed with
``resume_from_checkpoint=True``; the resumed run must equal the Trainer's bit for bit. Writes the
train times and the bytes on disk to ``$S4W_GPU_RESULTS/hf_gpu_{blocking,async}.json``.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.integrations._util import diff

pytest.importorskip("transformers")
import transformers  # noqa: E402

from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_transformers import S4Callback  # noqa: E402

pytestmark = pytest.mark.gpu


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(0, 512, (512, 64), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class StopAt(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= 30:
            control.should_training_stop = True
            control.should_save = True


def _trainer(out, callbacks):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=60, per_device_train_batch_size=16, learning_rate=1e-3, save_steps=10,
        save_total_limit=3, logging_steps=1000, report_to=[], disable_tqdm=True, seed=0, full_determinism=True,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def _du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_gpu_bf16_saves_and_resume(tmp_path, async_save):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref = _trainer(tmp_path / "ref", [])
    t0 = time.perf_counter()
    ref.train()
    t_ref = time.perf_counter() - t0
    run = _trainer(tmp_path / "run", [S4Callback(async_save=async_save)])
    t0 = time.perf_counter()
    run.train()
    t_run = time.perf_counter() - t0
    assert os.listdir(tmp_path / "run") == [".s4w"]
    st = CheckpointStore(str(tmp_path / "run" / ".s4w"))
    assert st.steps() == [40, 50, 60]
    assert not diff(run.model.state_dict(), ref.model.state_dict())  # saving changed nothing
    _trainer(tmp_path / "int", [StopAt(), S4Callback(async_save=async_save)]).train()
    resumed = _trainer(tmp_path / "int", [S4Callback(async_save=async_save)])
    resumed.train(resume_from_checkpoint=True)
    same = not diff(resumed.model.state_dict(), ref.model.state_dict())
    result = {
        "async_save": async_save,
        "device": torch.cuda.get_device_name(0),
        "train_s_trainer_own_saves": round(t_ref, 3),
        "train_s_s4callback": round(t_run, 3),
        "bytes_trainer_own": _du(tmp_path / "ref"),
        "bytes_store": _du(tmp_path / "run"),
        "bit_exact_resume": same,
        "kinds": [i.kind for i in st.list()],
    }
    d = os.environ.get("S4W_GPU_RESULTS")
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"hf_gpu_{'async' if async_save else 'blocking'}.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    assert same

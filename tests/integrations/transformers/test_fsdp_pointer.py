"""A folder restored from a step saved under FSDP2 holds ``s4w_sharded.json`` (the run's step with
the model's and optimizer's shards) instead of weights: a Trainer without FSDP2 refuses it with
StateMismatchError before training, and a malformed pointer is one too (one CPU process)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
import transformers  # noqa: E402

from s4w_transformers import S4Callback, StateMismatchError  # noqa: E402

POINTER = "s4w_sharded.json"


def _trainer(out):
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=2, report_to=[], use_cpu=True)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, callbacks=[S4Callback()])


def _folder(tmp_path, pointer: str):
    folder = tmp_path / "checkpoint-6"
    folder.mkdir()
    (folder / POINTER).write_text(pointer)
    (folder / "trainer_state.json").write_text("{}")
    return str(folder)


def test_a_sharded_step_into_a_trainer_without_fsdp2_is_refused(tmp_path):
    folder = _folder(tmp_path, json.dumps({"root": str(tmp_path / "run"), "step": 6, "optimizer": True}))
    tr = _trainer(tmp_path / "out")
    with pytest.raises(StateMismatchError, match=r"checkpoint-6 holds a step saved under FSDP2.*fsdp_version"):
        tr.train(resume_from_checkpoint=folder)
    assert tr.state.global_step == 0


@pytest.mark.parametrize("text", ["not json", '{"root": 3, "step": 6, "optimizer": true}', '{"root": "r", "step": 6}'])
def test_a_malformed_pointer_is_named(tmp_path, text):
    tr = _trainer(tmp_path / "out")
    with pytest.raises(StateMismatchError, match=POINTER):
        tr.train(resume_from_checkpoint=_folder(tmp_path, text))

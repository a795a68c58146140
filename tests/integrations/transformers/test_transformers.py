"""S4Callback with a real HF Trainer (tiny GPT-2 built from a config, generated tokens) on the CPU."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.integrations._util import diff

pytest.importorskip("transformers")
import transformers  # noqa: E402

import s4w_core  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_transformers import MARKER_NAME, S4Callback, restore_checkpoint  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg)


class StopAt(transformers.TrainerCallback):
    """Interrupt a 9-step run (same LR schedule as the reference) after ``step`` steps."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True
            control.should_save = True


def _trainer(out, steps, callbacks=(), **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=kw.pop("save_steps", 3),
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **kw,
    )
    return transformers.Trainer(model=_model(), args=args, train_dataset=Tokens(), callbacks=list(callbacks))


def _state(tr):
    return {"model": tr.model.state_dict(), "optim": tr.optimizer.state_dict(), "sched": tr.lr_scheduler.state_dict()}


def _sha(p):
    return hashlib.sha256(open(p, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tr = _trainer(tmp_path_factory.mktemp("ref"), 9, save_steps=100)
    tr.train()
    return _state(tr)


def test_save_restore_resume_bit_exact(tmp_path, reference, monkeypatch):
    # restore_checkpoint's default folder is a new temporary directory: made under tmp_path here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cb = S4Callback()
    _trainer(tmp_path / "out", 9, [cb, StopAt(6)]).train()
    st = CheckpointStore(str(tmp_path / "out" / ".s4w"))
    assert st.steps() == [3, 6] and st.info(6).kind == "keyframe" and st.info(3).base_step == 6
    # the restored folder is byte-identical to the Trainer's
    dest = restore_checkpoint(tmp_path / "out" / ".s4w", step=3, dest=tmp_path / "restored")
    orig = tmp_path / "out" / "checkpoint-3"
    assert sorted(os.listdir(dest)) == sorted(os.listdir(orig))
    for n in os.listdir(orig):
        assert _sha(os.path.join(dest, n)) == _sha(orig / n), n
    # resume from the store alone: the raw folders are gone
    shutil.rmtree(tmp_path / "out" / "checkpoint-3")
    shutil.rmtree(tmp_path / "out" / "checkpoint-6")
    tr = _trainer(tmp_path / "resumed", 9, save_steps=100)
    restored = restore_checkpoint(tmp_path / "out" / ".s4w", step=3)
    assert os.path.dirname(os.path.dirname(restored)) == str(tmp_path)  # the default: a new temporary folder
    tr.train(resume_from_checkpoint=restored)
    assert tr.state.global_step == 9
    assert not diff(_state(tr), reference)


@pytest.mark.parametrize(("rebase", "async_save"), [(True, False), (False, False), (True, True)])
def test_keep_local_false_and_rotation_mirror(tmp_path, reference, rebase, async_save):
    cb = S4Callback(keep_local=False, rebase_on_delete=rebase, async_save=async_save)
    _trainer(tmp_path / "out", 9, [cb, StopAt(8)], save_total_limit=2).train()
    assert cb._pending is None and cb.last_info.step == 8  # noqa: SLF001  # on_train_end finished the last one
    folders = sorted(n for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint-"))
    assert folders == ["checkpoint-6", "checkpoint-8"]
    for f in folders:  # raw tensor files dropped, the marker and trainer_state.json stay
        left = sorted(os.listdir(tmp_path / "out" / f))
        assert MARKER_NAME in left and "trainer_state.json" in left and "optimizer.pt" not in left
    st = CheckpointStore(str(tmp_path / "out" / ".s4w"))
    assert st.steps() == [6, 8]  # step 3 rotated away in the store too
    assert st.verify(6).ok and st.verify(8).ok and st.info(8).kind == "keyframe"
    # on_train_end waited for step 6 to become a delta against step 8; deleting the oldest step
    # re-coded nothing and left nothing behind, with or without rebase
    assert st.info(6).kind == "delta" and st.info(6).base_step == 8
    live = {o for r in st.list() for o in r.live_objects}
    assert {o.key for o in st.backend.list("data/")} == live
    assert st.sizes()["base_only_bytes"] == 0
    tr = _trainer(tmp_path / "resumed", 9, save_steps=100)
    # resuming at step 6 and training to 9 equals the uninterrupted run
    tr.train(resume_from_checkpoint=restore_checkpoint(tmp_path / "out" / ".s4w", step=6, dest=tmp_path / "r6"))
    assert not diff(_state(tr), reference)


def test_async_save_failure_surfaces_and_keeps_the_raw_files(tmp_path):
    """A background save that fails is raised at the end of training (the next on_save would
    too); the raw files of that checkpoint stay, those of the saved one are dropped."""
    from s4w_core.store import open_backend
    from tests.store.helpers import Crash, FaultyBackend

    inner = open_backend(str(tmp_path / "store"))
    bad = FaultyBackend(inner, lambda verb, key: verb == "writer" and "step_000000000006" in key)
    cb = S4Callback(keep_local=False, async_save=True, store_options={"_backend": bad})
    with pytest.raises(Crash, match="injected crash"):
        _trainer(tmp_path / "out", 9, [cb, StopAt(6)]).train()
    assert CheckpointStore(str(tmp_path / "store")).steps() == [3]
    assert "optimizer.pt" not in os.listdir(tmp_path / "out" / "checkpoint-3")
    assert "optimizer.pt" in os.listdir(tmp_path / "out" / "checkpoint-6")
    assert MARKER_NAME not in os.listdir(tmp_path / "out" / "checkpoint-6")


def test_restore_refuses_a_checkpoint_without_optimizer(tmp_path):
    st = CheckpointStore(str(tmp_path / "s"))
    d = tmp_path / "ck"
    d.mkdir()
    (d / "trainer_state.json").write_text("{}")
    torch.save({"w": torch.ones(2)}, d / "pytorch_model.bin")
    st.save(s4w_core.pack_folder(d), 5, extra={"files": ["pytorch_model.bin", "trainer_state.json"]})
    with pytest.raises(s4w_core.CheckpointNotFoundError, match="optimizer.pt"):
        restore_checkpoint(tmp_path / "s", 5, tmp_path / "x")
    out = restore_checkpoint(tmp_path / "s", 5, tmp_path / "y", require_optimizer=False)
    assert sorted(os.listdir(out)) == ["pytorch_model.bin", "trainer_state.json"]


def test_missing_extra_fails_with_install_hint():
    code = "import sys; sys.modules['transformers'] = None\ntry:\n    import s4w_transformers\nexcept ImportError as e:\n    print(e)\n"
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "integrations")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "pip install 's4weights[transformers]'" in out.stdout, out.stdout + out.stderr


@pytest.mark.s3
def test_s3_store_resume_bit_exact(tmp_path, s3_url, reference):
    _trainer(tmp_path / "out", 9, [S4Callback(store=s3_url, keep_local=False), StopAt(6)]).train()
    assert CheckpointStore(s3_url).steps() == [3, 6]
    shutil.rmtree(tmp_path / "out")
    tr = _trainer(tmp_path / "resumed", 9, save_steps=100)
    tr.train(resume_from_checkpoint=restore_checkpoint(s3_url, dest=tmp_path / "r"))
    assert not diff(_state(tr), reference)

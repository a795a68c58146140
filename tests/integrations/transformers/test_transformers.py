"""S4Callback with a real HF Trainer (tiny GPT-2 built from a config, generated tokens) on the CPU.

Every run here is compared with the Trainer's own behaviour: the same run without the callback
(its folders, its trainer_state.json, its best model), or the uninterrupted run (bit-exact resume).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.integrations._util import diff

pytest.importorskip("transformers")
import safetensors.torch  # noqa: E402
import transformers  # noqa: E402

import s4w_core  # noqa: E402
import s4w_transformers._callback  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_transformers import (  # noqa: E402
    S4Callback,
    StateMismatchError,
    UnsupportedSetupError,
    cleanup_restored,
    restore_checkpoint,
)

PAYLOAD = {"model.safetensors", "pytorch_model.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "training_args.bin"}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2(n_embd=32):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=n_embd,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.0,
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


class Probe(transformers.TrainerCallback):
    """Records every on_save and the checkpoint folders present at that moment."""

    def __init__(self):
        self.saves, self.folders = [], []

    def on_save(self, args, state, control, **kw):
        self.saves.append(state.global_step)
        self.folders += [n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-")]


class Scores:
    """compute_metrics with a fixed score per evaluation: 1, 3, 2 -> the best is the 2nd."""

    def __init__(self):
        self.n = 0

    def __call__(self, pred):
        self.n += 1
        return {"score": [1.0, 3.0, 2.0, 0.0][min(self.n - 1, 3)]}


def make_trainer(out, steps, callbacks=(), model=None, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        save_strategy=kw.pop("save_strategy", "steps"),
        save_steps=kw.pop("save_steps", 3),
        logging_steps=kw.pop("logging_steps", 100),
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **kw,
    )
    extra = {}
    if args.eval_strategy != "no":
        extra = {"eval_dataset": Tokens(16, seed=1), "compute_metrics": Scores()}
    return transformers.Trainer(
        model=model or tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=list(callbacks), **extra
    )


def _state(tr):
    return {"model": tr.model.state_dict(), "optim": tr.optimizer.state_dict(), "sched": tr.lr_scheduler.state_dict()}


@pytest.fixture()
def no_payload_writes(monkeypatch):
    """Every torch.save / safetensors save_file call (the Trainer's payload writers)."""
    calls = []
    real_save, real_sf = torch.save, safetensors.torch.save_file
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (calls.append(str(f)), real_save(obj, f, *a, **k))[1])
    monkeypatch.setattr(
        safetensors.torch, "save_file", lambda t, f, *a, **k: (calls.append(str(f)), real_sf(t, f, *a, **k))[1]
    )
    return calls


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tr = make_trainer(tmp_path_factory.mktemp("ref"), 9, save_steps=100)
    tr.train()
    return _state(tr)


BEST = dict(
    eval_strategy="steps", eval_steps=3, save_total_limit=2, load_best_model_at_end=True,
    metric_for_best_model="score", greater_is_better=True,
)  # fmt: skip


def _no_timing(d):
    return {k: v for k, v in d.items() if not k.endswith(("runtime", "per_second"))}


def test_saves_from_memory_like_the_trainer(tmp_path, no_payload_writes):
    """save_steps + eval + save_total_limit=2 + load_best_model_at_end, against the same run
    without the callback: same on_save events, same kept steps, same trainer state, same best model,
    and no payload file written at any moment."""
    probe_ref = Probe()
    ref = make_trainer(tmp_path / "ref", 9, [probe_ref], **BEST)
    ref.train()
    ref_folders = sorted(n for n in os.listdir(tmp_path / "ref") if n.startswith("checkpoint-"))
    no_payload_writes.clear()

    probe, cb = Probe(), S4Callback()
    tr = make_trainer(tmp_path / "out", 9, [probe, cb], **BEST)
    tr.train()
    assert no_payload_writes == [], no_payload_writes
    assert probe.saves == probe_ref.saves == [3, 6, 9]
    assert probe.folders == [] and [n for n in os.listdir(tmp_path / "out") if n != ".s4w"] == []
    st = CheckpointStore(str(tmp_path / "out" / ".s4w"))
    assert ref_folders == ["checkpoint-6", "checkpoint-9"]
    assert st.steps() == [6, 9]  # rotation mirrored: the newest and the best (6) kept
    assert tr.state.best_global_step == ref.state.best_global_step == 6 and cb.best_step == 6
    # the best model was loaded at the end, as the Trainer does from its folder
    assert not diff(tr.model.state_dict(), ref.model.state_dict())
    assert not diff(tr.model.state_dict(), st.load(6)["model"])
    # trainer_state.json as the Trainer wrote it (its best_model_checkpoint names a folder; no folder here)
    ours = json.loads(st.load(9)["trainer_state"])
    theirs = json.loads((tmp_path / "ref" / "checkpoint-9" / "trainer_state.json").read_text())
    assert theirs.pop("best_model_checkpoint").endswith("checkpoint-6") and ours.pop("best_model_checkpoint") is None
    assert [_no_timing(e) for e in ours.pop("log_history")] == [_no_timing(e) for e in theirs.pop("log_history")]
    assert ours == theirs
    # the stored RNG, optimizer and scheduler are what the Trainer's files hold
    ck = tmp_path / "ref" / "checkpoint-9"
    step9 = st.load(9)
    assert not diff(step9["optimizer"], torch.load(ck / "optimizer.pt", weights_only=True))
    assert not diff(step9["scheduler"], torch.load(ck / "scheduler.pt", weights_only=True))
    _same_rng(step9["rng"][0], torch.load(ck / "rng_state.pth", weights_only=False))


def _same_rng(a, b):
    assert sorted(a) == sorted(b)
    assert a["python"] == b["python"] and torch.equal(a["cpu"], b["cpu"])
    (n1, k1, *r1), (n2, k2, *r2) = a["numpy"], b["numpy"]
    assert n1 == n2 and (k1 == k2).all() and r1 == r2


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_true_is_bit_exact_and_cleans_up(tmp_path, reference, monkeypatch, async_save, no_payload_writes):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    make_trainer(tmp_path / "out", 9, [StopAt(5), S4Callback(async_save=async_save)]).train()
    assert no_payload_writes == []
    assert CheckpointStore(str(tmp_path / "out" / ".s4w")).steps() == [3, 5]
    tr = make_trainer(tmp_path / "out", 9, [S4Callback(async_save=async_save)])
    tr.train(resume_from_checkpoint=True)  # from the store's newest step (5), mid-epoch
    # optimizer and scheduler went from the store into the Trainer's objects, not through files
    assert sorted(os.path.basename(f) for f in no_payload_writes) == ["model.safetensors", "rng_state.pth"]
    assert tr.state.global_step == 9
    assert not diff(_state(tr), reference)
    assert os.listdir(tmp_path / "tmp") == []  # the restored folder is gone
    assert CheckpointStore(str(tmp_path / "out" / ".s4w")).steps() == [3, 5, 6, 9]


def test_attach_binds_without_looking_up_the_stack(tmp_path, reference, monkeypatch):
    """S4Callback().attach(trainer): the explicit route (transformers hands callbacks no Trainer).
    With the stack lookup of the ``callbacks=[...]`` form disabled, the attached callback still
    fires on_save for the others, writes no folder and resumes with resume_from_checkpoint=True."""
    monkeypatch.setattr(s4w_transformers._callback, "caller_instance", lambda cls: None)
    with pytest.raises(UnsupportedSetupError, match="attach"):
        make_trainer(tmp_path / "x", 3, [S4Callback()])  # the list form, with no Trainer to be found
    probe, cb = Probe(), S4Callback()
    tr = make_trainer(tmp_path / "out", 9, [probe, StopAt(6)])
    assert cb.attach(tr) is tr and cb.attach(tr) is tr  # twice: bound once
    assert sum(c is cb for c in tr.callback_handler.callbacks) == 1
    tr.train()
    assert probe.saves == [3, 6] and probe.folders == []
    assert CheckpointStore(str(tmp_path / "out" / ".s4w")).steps() == [3, 6]
    resumed = S4Callback().attach(make_trainer(tmp_path / "out", 9))
    resumed.train(resume_from_checkpoint=True)
    assert not diff(_state(resumed), reference)


def test_one_callback_for_two_trainers(tmp_path, reference):
    """A callback handed to a second Trainer saves that Trainer's model, not the first one's."""
    cb = S4Callback()
    make_trainer(tmp_path / "a", 3, [cb], model=tiny_gpt2(n_embd=64)).train()
    tr = make_trainer(tmp_path / "b", 9, [StopAt(6), cb])
    tr.train()
    st = CheckpointStore(str(tmp_path / "b" / ".s4w"))
    assert not diff(st.load(6)["model"], tr.model.state_dict())


def test_restore_checkpoint_route(tmp_path, reference, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    make_trainer(tmp_path / "out", 9, [StopAt(6), S4Callback()]).train()
    tr = make_trainer(tmp_path / "resumed", 9, save_steps=100)  # a Trainer without the callback
    path = restore_checkpoint(tmp_path / "out" / ".s4w", step=3)
    assert sorted(os.listdir(path)) == sorted(
        ["config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"]
    )
    tr.train(resume_from_checkpoint=path)
    assert not diff(_state(tr), reference)
    assert os.path.isdir(path)  # no callback to remove it: it goes at exit, or now
    cleanup_restored()
    assert os.listdir(tmp_path / "tmp") == []


def test_save_only_model_and_epoch_strategy(tmp_path, no_payload_writes):
    make_trainer(tmp_path / "out", 12, [S4Callback()], save_strategy="epoch", save_only_model=True).train()
    st = CheckpointStore(str(tmp_path / "out" / ".s4w"))
    assert st.steps() == [8, 12]  # 8 steps per epoch; training ends mid-epoch 2 and saves at its end
    assert sorted(st.load(8)) == ["config", "model", "trainer_state"]
    assert no_payload_writes == []


def test_save_strategy_best(tmp_path, no_payload_writes):
    """save_strategy="best": the Trainer saves when the metric improves (scores 1, 3, 2: steps 3, 6)."""
    kw = dict(eval_strategy="steps", eval_steps=3, save_strategy="best", metric_for_best_model="score")
    probe_ref = Probe()
    make_trainer(tmp_path / "ref", 9, [probe_ref], greater_is_better=True, **kw).train()
    no_payload_writes.clear()
    probe = Probe()
    tr = make_trainer(tmp_path / "out", 9, [probe, S4Callback()], greater_is_better=True, **kw)
    tr.train()
    assert probe.saves == probe_ref.saves == [3, 6] and probe.folders == []
    assert sorted(os.listdir(tmp_path / "ref")) == ["checkpoint-3", "checkpoint-6"]
    assert CheckpointStore(str(tmp_path / "out" / ".s4w")).steps() == [3, 6]
    assert tr.state.best_global_step == 6 and tr.state.best_metric == 3.0
    assert no_payload_writes == []


def test_callback_listed_after_it_is_warned_and_stored(tmp_path):
    with pytest.warns(UserWarning, match="list S4Callback last"):
        make_trainer(tmp_path / "out", 9, [S4Callback(), StopAt(5)]).train()
    assert "checkpoint-5" in os.listdir(tmp_path / "out")  # the Trainer's own save, as asked after us
    assert CheckpointStore(str(tmp_path / "out" / ".s4w")).steps() == [3, 5]


def test_async_save_failure_surfaces(tmp_path):
    """A background save that fails is raised at the end of training; nothing half-written shows."""
    from s4w_core.store import open_backend
    from tests.store.helpers import Crash, FaultyBackend

    inner = open_backend(str(tmp_path / "store"))
    bad = FaultyBackend(inner, lambda verb, key: verb == "writer" and "step_000000000006" in key)
    cb = S4Callback(str(tmp_path / "store"), async_save=True, store_options={"_backend": bad})
    with pytest.raises(Crash, match="injected crash"):
        make_trainer(tmp_path / "out", 9, [StopAt(6), cb]).train()
    assert CheckpointStore(str(tmp_path / "store")).steps() == [3]


def test_sharded_engine_falls_back_to_packing_the_folder(tmp_path, reference, monkeypatch):
    """Under FSDP/DeepSpeed (simulated: the detection says so) one warning, the Trainer's folders,
    a packed copy of each in the store, and restore_checkpoint gives the folder back."""
    monkeypatch.setattr(s4w_transformers._callback, "sharded_engine", lambda tr: "FSDP")
    with pytest.warns(UserWarning, match="FSDP saves through its own sharded writer"):
        make_trainer(tmp_path / "out", 9, [StopAt(6), S4Callback()]).train()
    assert sorted(n for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint-")) == [
        "checkpoint-3",
        "checkpoint-6",
    ]
    assert CheckpointStore(str(tmp_path / "out" / ".s4w")).steps() == [3, 6]
    path = restore_checkpoint(tmp_path / "out" / ".s4w", step=3, dest=tmp_path / "r3")
    assert "model.safetensors" in os.listdir(path) and "optimizer.pt" in os.listdir(path)
    tr = make_trainer(tmp_path / "resumed", 9, save_steps=100)
    tr.train(resume_from_checkpoint=path)
    assert not diff(_state(tr), reference)


def test_bad_input(tmp_path):
    make_trainer(tmp_path / "out", 3, [S4Callback()]).train()
    store = tmp_path / "out" / ".s4w"
    with pytest.raises(s4w_core.CheckpointNotFoundError, match="no committed step 7"):
        restore_checkpoint(store, step=7)
    with pytest.raises(StateMismatchError, match=r"step 3: key 'transformer.wte.weight' is \(64, 32\)"):
        restore_checkpoint(store, dest=tmp_path / "d", model=tiny_gpt2(n_embd=64))
    assert not (tmp_path / "d").exists()
    # a new run from step 0 into the same store: refused, nothing overwritten
    before = CheckpointStore(str(store)).info(3).object
    with pytest.raises(s4w_core.ConflictError, match="already holds steps"):
        make_trainer(tmp_path / "out", 3, [S4Callback()]).train()
    assert CheckpointStore(str(store)).info(3).object == before
    # a store another writer filled
    other = CheckpointStore(str(tmp_path / "other"))
    other.save({"w": torch.ones(2)}, 4)
    with pytest.raises(StateMismatchError, match="step 4 was written by"):
        restore_checkpoint(tmp_path / "other")
    # resume=True with an empty store names it
    with pytest.raises(s4w_core.CheckpointNotFoundError, match="no committed step in the store"):
        make_trainer(tmp_path / "empty", 3, [S4Callback()]).train(resume_from_checkpoint=True)
    # push_to_hub: refused clearly (there is no folder to push)
    tr = make_trainer(tmp_path / "hub", 3, [S4Callback()])
    tr.args.push_to_hub = True
    with pytest.raises(UnsupportedSetupError, match="push_to_hub"):
        tr.train()


def test_missing_extra_fails_with_install_hint():
    code = "import sys; sys.modules['transformers'] = None\ntry:\n    import s4w_transformers\nexcept ImportError as e:\n    print(e)\n"
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "integrations")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "pip install 's4weights[transformers]'" in out.stdout, out.stdout + out.stderr


@pytest.mark.s3
def test_s3_store_resume_bit_exact(tmp_path, s3_url, reference):
    make_trainer(tmp_path / "out", 9, [StopAt(6), S4Callback(store=s3_url)]).train()
    assert CheckpointStore(s3_url).steps() == [3, 6]
    assert os.listdir(tmp_path / "out") == []
    tr = make_trainer(tmp_path / "resumed", 9, save_steps=100)
    tr.train(resume_from_checkpoint=restore_checkpoint(s3_url, dest=tmp_path / "r"))
    assert not diff(_state(tr), reference)

"""s4w_accelerate: Accelerator.save_state/load_state from memory into the store, on the CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.integrations._util import diff

pytest.importorskip("accelerate")
import accelerate  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import s4w_accelerate  # noqa: E402
import s4w_accelerate._hook  # noqa: E402
import s4w_core  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture(autouse=True)
def _fresh():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    s4w_accelerate.disable()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture()
def torch_saves(monkeypatch):
    """Every torch.save call (Accelerate's optimizer/scheduler/RNG/custom-object writer)."""
    calls = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (calls.append(str(f)), real(obj, f, *a, **k))[1])
    return calls


class Counter:
    """A registered object (``accelerator.register_for_checkpointing``)."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x.sum(1, keepdim=True))


def _setup(project_dir, width=32, **pc):
    AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project_dir), **pc))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(width, 1)
    )  # dropout: the resumed run matches only if the RNG states are restored
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.7)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, counter


def _train(acc, model, opt, sched, counter, steps):
    for s in steps:
        x, y = _batch(s)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1


def _state(model, opt, sched, counter):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "n": counter.n}


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_state_bit_exact_with_rotation(tmp_path, async_save, torch_saves):
    objs = _setup(tmp_path / "ref")
    _train(*objs, range(10))
    reference = _state(*objs[1:])

    s4w_accelerate.enable(async_save=async_save)
    objs = _setup(tmp_path / "run", automatic_checkpoint_naming=True, total_limit=2)
    for k in range(3):  # checkpoints after steps 2, 4, 6
        _train(*objs, range(2 * k, 2 * k + 2))
        loc = objs[0].save_state()
        assert os.listdir(loc) == []  # the folder exists, as Accelerate's would, but holds no payload
    s4w_accelerate.finish_pending()
    assert torch_saves == []
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(ck)) == ["checkpoint_1", "checkpoint_2"]  # total_limit=2
    assert all(f.startswith(".s4w" + os.sep) for f in _files(tmp_path / "run")), _files(tmp_path / "run")
    st = CheckpointStore(str(tmp_path / "run" / ".s4w"))
    # step 0 rotated away in the store too (nothing depended on it); the newest step is whole
    assert st.steps() == [1, 2] and st.info(2).kind == "keyframe" and st.verify(1).ok
    # a fresh Accelerator resumes from the store (load_state() picks the newest) and trains on
    objs = _setup(tmp_path / "run", automatic_checkpoint_naming=True, total_limit=2)
    objs[0].load_state()
    assert objs[4].n == 6 and objs[0].step == 0
    _train(*objs, range(6, 10))
    assert not diff(_state(*objs[1:]), reference)


def test_explicit_folder_and_bad_input(tmp_path, torch_saves):
    s4w_accelerate.enable(store=str(tmp_path / "store"))
    objs = _setup(tmp_path)
    _train(*objs, range(3))
    saved = _state(*objs[1:])
    saved = {"model": {k: v.clone() for k, v in saved["model"].items()}, "rest": (objs[2].state_dict(), objs[4].n)}
    objs[0].save_state(str(tmp_path / "ckpt" / "step_3"))
    assert os.listdir(tmp_path / "ckpt" / "step_3") == [] and torch_saves == []
    assert CheckpointStore(str(tmp_path / "store")).steps() == [3]
    objs = _setup(tmp_path)
    objs[0].load_state(str(tmp_path / "ckpt" / "step_3"))
    assert not diff(objs[1].state_dict(), saved["model"]) and objs[4].n == 3
    # a folder Accelerate wrote itself (before the hook was on) still loads, through Accelerate
    s4w_accelerate.disable()
    objs[0].save_state(str(tmp_path / "native"))
    s4w_accelerate.enable(store=str(tmp_path / "store"))
    objs = _setup(tmp_path)
    objs[0].load_state(str(tmp_path / "native"))
    assert not diff(objs[1].state_dict(), saved["model"]) and objs[4].n == 3
    # bad input: no such checkpoint; other shapes (nothing loaded); another run's automatic step 0
    with pytest.raises(s4w_core.CheckpointNotFoundError, match="has no step with folder='step_9'"):
        objs[0].load_state(str(tmp_path / "ckpt" / "step_9"))
    objs = _setup(tmp_path, width=16)
    before = {k: v.clone() for k, v in objs[1].state_dict().items()}
    with pytest.raises(s4w_accelerate.StateMismatchError, match=r"step 3 \(step_3\) model 0: key '0.weight'"):
        objs[0].load_state(str(tmp_path / "ckpt" / "step_3"))
    assert not diff(objs[1].state_dict(), before) and objs[4].n == 0
    s4w_accelerate.enable()
    objs = _setup(tmp_path / "a", automatic_checkpoint_naming=True)
    objs[0].save_state()
    objs = _setup(tmp_path / "a", automatic_checkpoint_naming=True)
    os.rmdir(tmp_path / "a" / "checkpoints" / "checkpoint_0")
    with pytest.raises(s4w_core.ConflictError, match="already holds step 0"):
        objs[0].save_state()


def test_sharded_engine_falls_back_to_packing_the_folder(tmp_path, monkeypatch):
    """Under FSDP/DeepSpeed (simulated: the detection says so) one warning, Accelerate's own folder,
    a packed copy in the store; a folder gone is rebuilt from the store by load_state."""
    objs = _setup(tmp_path / "ref")
    _train(*objs, range(6))
    reference = _state(*objs[1:])
    monkeypatch.setattr(s4w_accelerate._hook, "sharded_engine", lambda acc: "FSDP")
    s4w_accelerate.enable(store=str(tmp_path / "store"))
    objs = _setup(tmp_path)
    _train(*objs, range(3))
    with pytest.warns(UserWarning, match="FSDP saves through its own sharded writer"):
        objs[0].save_state(str(tmp_path / "ckpt" / "step_3"))
    assert "model.safetensors" in os.listdir(tmp_path / "ckpt" / "step_3")
    assert CheckpointStore(str(tmp_path / "store")).steps() == [3]
    shutil.rmtree(tmp_path / "ckpt")
    objs = _setup(tmp_path)
    objs[0].load_state(str(tmp_path / "ckpt" / "step_3"))
    _train(*objs, range(3, 6))
    assert not diff(_state(*objs[1:]), reference)


def test_env_flag_enables_on_import(tmp_path):
    code = "import s4w_accelerate; c = s4w_accelerate.config(); print(s4w_accelerate.enabled(), c.store, c.async_save)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]))
    env.update(S4W_ACCELERATE=str(tmp_path / "s"), S4W_ACCELERATE_ASYNC="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["True", str(tmp_path / "s"), "True"], out.stderr
    env.pop("S4W_ACCELERATE")
    out = subprocess.run(
        [sys.executable, "-c", "import s4w_accelerate; print(s4w_accelerate.enabled())"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.stdout.strip() == "False", out.stderr


def test_missing_extra_fails_with_install_hint():
    code = "import sys; sys.modules['accelerate'] = None\ntry:\n    import s4w_accelerate\nexcept ImportError as e:\n    print(e)\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "pip install 's4weights[accelerate]'" in out.stdout, out.stdout + out.stderr


@pytest.mark.s3
def test_s3_store(tmp_path, s3_url):
    objs = _setup(tmp_path / "ref")
    _train(*objs, range(6))
    reference = _state(*objs[1:])
    s4w_accelerate.enable(store=s3_url)
    objs = _setup(tmp_path)
    _train(*objs, range(3))
    objs[0].save_state(str(tmp_path / "ckpt" / "step_3"))
    objs = _setup(tmp_path)
    objs[0].load_state(str(tmp_path / "ckpt" / "step_3"))
    _train(*objs, range(3, 6))
    assert not diff(_state(*objs[1:]), reference)
    assert CheckpointStore(s3_url).steps() == [3]


def test_private_accelerator_attributes_are_checked(tmp_path):
    """The adapter reads Accelerator attributes that have no public getter (s4w_accelerate.registered):
    each is there in the installed Accelerate, and one gone fails loudly before anything is written."""
    s4w_accelerate.enable(store=str(tmp_path / "store"))
    acc, model, opt, sched, counter = _setup(tmp_path)
    reg = s4w_accelerate.registered(acc)
    assert reg["models"] == [model] and reg["optimizers"] == [opt] and reg["schedulers"] == [sched]
    assert reg["custom_objects"] == [counter] and isinstance(reg["save_model_state_pre_hook"], dict)
    del acc._custom_objects  # as a future Accelerate might rename it
    with pytest.raises(s4w_accelerate.UnsupportedAccelerateError, match="Accelerator._custom_objects"):
        acc.save_state(str(tmp_path / "ckpt" / "step_0"))
    with pytest.raises(s4w_accelerate.UnsupportedAccelerateError, match="accelerate .* does not have .checked against 1.15.0"):
        acc.load_state(str(tmp_path / "ckpt" / "step_0"))
    assert not os.path.exists(tmp_path / "ckpt") and not os.path.exists(tmp_path / "store")

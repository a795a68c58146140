"""s4w_accelerate: Accelerator.save_state/load_state through the store, on the CPU."""

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


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x.sum(1, keepdim=True))


def _setup(project_dir, **pc):
    acc = accelerate.Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project_dir), **pc))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.7)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _train(acc, model, opt, sched, steps):
    for s in steps:
        x, y = _batch(s)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()


def _state(model, opt, sched):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_state_bit_exact_with_rotation_and_dropped_files(tmp_path, async_save):
    acc, *objs = _setup(tmp_path / "ref")
    _train(acc, *objs, range(10))
    reference = _state(*objs)
    AcceleratorState._reset_state(True)

    s4w_accelerate.enable(keep_local=False, async_save=async_save)
    acc, *objs = _setup(tmp_path / "run", automatic_checkpoint_naming=True, total_limit=2)
    for k in range(3):  # checkpoints after steps 2, 4, 6
        _train(acc, *objs, range(2 * k, 2 * k + 2))
        acc.save_state()
    if async_save:  # the last save's raw files go once it is durable
        assert "model.safetensors" in os.listdir(tmp_path / "run" / "checkpoints" / "checkpoint_2")
        s4w_accelerate.finish_pending()
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(ck)) == ["checkpoint_1", "checkpoint_2"]  # total_limit=2
    assert os.listdir(ck / "checkpoint_2") == [s4w_accelerate.MARKER_NAME]  # raw files dropped
    st = CheckpointStore(str(tmp_path / "run" / ".s4w"))
    # step 0 rotated away (nothing depended on it); the newest step is whole
    assert st.steps() == [1, 2] and st.info(2).kind == "keyframe" and st.verify(1).ok
    # a fresh Accelerator resumes from the store (load_state() picks the newest folder) and trains on
    AcceleratorState._reset_state(True)
    acc, *objs = _setup(tmp_path / "run", automatic_checkpoint_naming=True, total_limit=2)
    acc.load_state()
    _train(acc, *objs, range(6, 10))
    assert not diff(_state(*objs), reference)


def test_load_state_from_a_missing_folder(tmp_path):
    s4w_accelerate.enable(store=str(tmp_path / "store"))
    acc, *objs = _setup(tmp_path)
    _train(acc, *objs, range(3))
    acc.save_state(str(tmp_path / "ckpt" / "step_3"))
    saved = {k: v for k, v in _state(*objs).items()}
    saved = {
        "model": {k: v.clone() for k, v in saved["model"].items()},
        "optim": objs[1].state_dict(),
        "sched": dict(saved["sched"]),
    }
    shutil.rmtree(tmp_path / "ckpt")
    AcceleratorState._reset_state(True)
    acc, *objs = _setup(tmp_path)
    torch.nn.init.zeros_(objs[0][0].weight)
    acc.load_state(str(tmp_path / "ckpt" / "step_3"))
    assert not diff(_state(*objs)["model"], saved["model"])
    assert CheckpointStore(str(tmp_path / "store")).steps() == [3]


def test_env_flag_enables_on_import(tmp_path):
    code = (
        "import s4w_accelerate; c = s4w_accelerate.config(); "
        "print(s4w_accelerate.enabled(), c.store, c.keep_local, c.async_save)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]))
    env.update(S4W_ACCELERATE=str(tmp_path / "s"), S4W_ACCELERATE_KEEP_LOCAL="0", S4W_ACCELERATE_ASYNC="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["True", str(tmp_path / "s"), "False", "True"], out.stderr
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
    acc, *objs = _setup(tmp_path / "ref")
    _train(acc, *objs, range(6))
    reference = _state(*objs)
    AcceleratorState._reset_state(True)
    s4w_accelerate.enable(store=s3_url, keep_local=False)
    acc, *objs = _setup(tmp_path)
    _train(acc, *objs, range(3))
    acc.save_state(str(tmp_path / "ckpt" / "step_3"))
    shutil.rmtree(tmp_path / "ckpt")
    AcceleratorState._reset_state(True)
    acc, *objs = _setup(tmp_path)
    acc.load_state(str(tmp_path / "ckpt" / "step_3"))
    _train(acc, *objs, range(3, 6))
    assert not diff(_state(*objs), reference)
    assert CheckpointStore(s3_url).steps() == [3]

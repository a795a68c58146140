"""s4w_accelerate on one GPU (marker ``gpu``; skipped without CUDA). Run on the device:

    PYTHONPATH=.:integrations S4W_GPU_RESULTS=runs/integrations python -m pytest -q -m gpu \\
        tests/integrations/accelerate/test_gpu_accelerate.py

A bf16 MLP on the GPU: Accelerate's own save_state every 10 steps (total_limit=3), then the same
through the store (blocking or async), then a resume from the store's second-newest checkpoint;
the resumed run must equal the uninterrupted one bit for bit. Writes the loop times and the bytes
on disk to ``$S4W_GPU_RESULTS/accelerate_gpu_{blocking,async}.json``.
"""

from __future__ import annotations

import json
import os
import time

import pytest

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts
import torch  # noqa: E402

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import s4w_accelerate  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402

pytestmark = pytest.mark.gpu


def _setup(project):
    AcceleratorState._reset_state(True)
    acc = Accelerator(
        project_config=ProjectConfiguration(str(project), automatic_checkpoint_naming=True, total_limit=3)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(4096, 1024)
    ).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 20, 0.5)
    return acc, *acc.prepare(model, opt, sched)


def _train(acc, model, opt, sched, steps, save_every=0):
    for s in steps:
        x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(s)).to(acc.device, torch.bfloat16)
        acc.backward((model(x).float() - x.float()).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
        if save_every and (s + 1) % save_every == 0:
            acc.save_state()
    torch.cuda.synchronize()


def _du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_gpu_bf16_save_load_state(tmp_path, async_save):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.use_deterministic_algorithms(True)
    request_cleanup = torch.use_deterministic_algorithms
    s4w_accelerate.disable()
    objs = _setup(tmp_path / "own")
    t0 = time.perf_counter()
    _train(*objs, range(50), save_every=10)
    t_own = time.perf_counter() - t0
    final = {k: v.clone() for k, v in objs[1].state_dict().items()}
    s4w_accelerate.enable(async_save=async_save)
    try:
        objs = _setup(tmp_path / "run")
        t0 = time.perf_counter()
        _train(*objs, range(50), save_every=10)
        s4w_accelerate.finish_pending()
        t_run = time.perf_counter() - t0
        st = CheckpointStore(str(tmp_path / "run" / ".s4w"))
        assert st.steps() == [2, 3, 4]
        objs = _setup(tmp_path / "run")
        objs[0].load_state(str(tmp_path / "run" / "checkpoints" / "checkpoint_3"))  # after step 40
        _train(*objs, range(40, 50))
        same = all(torch.equal(final[k], v) for k, v in objs[1].state_dict().items())
    finally:
        s4w_accelerate.disable()
        request_cleanup(False)
    result = {
        "async_save": async_save,
        "device": torch.cuda.get_device_name(0),
        "loop_s_accelerate_own_saves": round(t_own, 3),
        "loop_s_store": round(t_run, 3),
        "bytes_accelerate_own": _du(tmp_path / "own"),
        "bytes_store": _du(tmp_path / "run"),
        "bit_exact_resume": same,
    }
    d = os.environ.get("S4W_GPU_RESULTS")
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"accelerate_gpu_{'async' if async_save else 'blocking'}.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    assert same

"""GPU runs of the integrations (marker ``gpu``; skipped without CUDA). Run on the device:

    PYTHONPATH=.:integrations S4W_GPU_RESULTS=runs/integrations python -m pytest -q -m gpu tests/integrations/test_gpu.py

* Lightning end to end on one GPU: the model and optimizer live on the GPU, ``profile="auto"``
  picks the GPU codecs where the backend is usable, saves through ModelCheckpoint, resumes
  bit-exactly.
* DCP on two GPUs: 2 processes (torchrun, NCCL + gloo for async_save) run
  tests/integrations/dcp/dcp_worker.py: FSDP2 + AdamW, dcp.save and dcp.async_save through
  S4StorageWriter, dcp.load, resume == never stopped.

Each test writes its result JSON under ``$S4W_GPU_RESULTS`` (when set) so it can be committed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.integrations._util import diff

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
pytestmark = pytest.mark.gpu


def _record(name: str, result: dict) -> None:
    d = os.environ.get("S4W_GPU_RESULTS")
    if d:
        os.makedirs(d, exist_ok=True)
        result = {**result, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
        with open(os.path.join(d, f"{name}.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def test_lightning_one_gpu_end_to_end(tmp_path):
    pytest.importorskip("lightning")
    import lightning as L

    from s4w_core.store import CheckpointStore
    from s4w_lightning import S4CheckpointIO

    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).to(
                torch.bfloat16
            )

        def training_step(self, batch, i):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.sin(x.float())), batch_size=32)

    def fit(root, steps, plugin, ckpt=None):
        L.seed_everything(0)
        m = Net()
        cb = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=os.path.join(root, "ck"), every_n_train_steps=8, save_top_k=-1, save_last=True
        )
        t = L.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            callbacks=[cb],
            plugins=[plugin] if plugin else None,
        )
        t.fit(m, data, ckpt_path=ckpt)
        return t, m

    ref_t, ref_m = fit(tmp_path / "ref", 24, None)
    io_ = S4CheckpointIO()
    fit(tmp_path / "a", 16, io_)
    profile = io_.last_info.profile
    t, m = fit(tmp_path / "b", 24, S4CheckpointIO(), str(tmp_path / "a" / "ck" / "epoch=0-step=8.ckpt"))
    bad = diff(
        {"m": m.state_dict(), "o": t.optimizers[0].state_dict()},
        {"m": ref_m.state_dict(), "o": ref_t.optimizers[0].state_dict()},
    )
    sizes = CheckpointStore(str(tmp_path / "a" / "ck" / ".s4w")).sizes()
    _record(
        "lightning_1gpu",
        {
            "bit_exact_vs_uninterrupted": not bad,
            "mismatches": bad[:10],
            "profile": profile,
            "store": {k: sizes[k] for k in ("steps", "raw_bytes", "physical_bytes", "ratio")},
        },
    )
    assert not bad


def test_dcp_two_gpus_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (device kind nvidia-h200-x2)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, os.path.join(ROOT, "integrations")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(ROOT, "tests/integrations/dcp/dcp_worker.py"),
        "--backend",
        "nccl",
        "--root",
        str(tmp_path),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    _record("dcp_2gpu_nccl", res)
    assert res["ok"], res
    # dcp.async_save's default staging put the FSDP2 shards (DTensors) into pinned pool buffers,
    # coded on the GPU ("fast"), not per-tensor copies nor a device clone
    assert res["save"]["pinned_pool_allocations"] == 0 and res["async_save"]["pinned_pool_allocations"] >= 1, res
    assert res["async_save"]["profile"] == "fast", res

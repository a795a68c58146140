"""Lightning ``S4ModelParallelStrategy`` on 2 CPU processes (gloo, FSDP2): train with
``ModelCheckpoint`` every 2 steps (top-1 kept: removals delete run steps), resume from the step-4
checkpoint, and compare with a run that never stopped.  Run as a script (Lightning re-launches
it for rank 1); rank 0 writes ``<root>/result.json``.

    python tests/integrations/dcp/lightning_fsdp_worker.py /tmp/lit
"""

from __future__ import annotations

import json
import os
import sys

import torch

if __package__ in (None, ""):
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    sys.path[:0] = [here, os.path.join(here, "integrations")]

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from s4w_core.dcp import committed_steps  # noqa: E402
from s4w_lightning import S4ModelParallelStrategy  # noqa: E402


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        ds = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
        return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False)  # 2 steps an epoch per rank


def _trainer(root: str, max_steps: int, ckpt: bool) -> L.Trainer:
    cbs = [ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=2, save_top_k=1,
                           monitor="step", mode="max")] if ckpt else []
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=S4ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps, callbacks=cbs, enable_checkpointing=ckpt, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )


def _bits(m: Net) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().reshape(-1).view(torch.uint8).clone() for k, v in m.net.state_dict().items()}


def main() -> None:
    root = sys.argv[1]
    # the run that never stops
    ref = Net()
    t = _trainer(root, 6, ckpt=False)
    t.fit(ref)
    want = _bits(ref)
    # checkpoints every 2 steps (top-1 by step: each new one removes the previous), stop at 4
    m = Net()
    t = _trainer(root, 4, ckpt=True)
    t.fit(m)
    folders = sorted(os.listdir(os.path.join(root, "ckpts")))
    steps_after_first = committed_steps(os.path.join(root, "ckpts", ".s4w_dcp"))
    # resume from the step-4 checkpoint and train on to 6
    m2 = Net()
    t = _trainer(root, 6, ckpt=False)
    t.fit(m2, ckpt_path=os.path.join(root, "ckpts", [f for f in folders if f.endswith(".ckpt")][-1]))
    got = _bits(m2)
    ok = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    if t.global_rank == 0:
        res = {"folders": folders, "committed": steps_after_first, "resume_bit_exact": ok, "global_step": t.global_step}
        with open(os.path.join(root, "result.json"), "w") as f:
            json.dump(res, f)
        print(json.dumps(res))


if __name__ == "__main__":
    main()

"""Lightning + s4weights: a tiny byte-level language model on real text, compressed delta
checkpoints, resume.

The text is the source of a few Python standard-library modules (it ships with every Python).
Trains 300 steps on the CPU with ``Trainer(plugins=[S4CheckpointIO()])`` and a ModelCheckpoint
every 50 steps (top-3 by loss + last); then a new Trainer resumes from the middle checkpoint if
top-3 kept it, else from the oldest one it kept: in the default run that is the step-200 checkpoint
(an epoch boundary, so a plain DataLoader replays exactly). It trains to 300, and the result is
compared bit for bit with the run that never stopped. Prints its run folder first (a new
``/tmp/s4w-lightning-*`` unless ``--out``), then what the store holds and the savings.

    PYTHONPATH=.:integrations python examples/lightning_char_lm.py [--out DIR] [--steps 300]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from s4w_core.store import CheckpointStore
from s4w_lightning import S4CheckpointIO

CTX, BATCH, BATCHES_PER_EPOCH = 8, 64, 50


def text_bytes() -> torch.Tensor:
    import collections
    import json as j

    src = "".join(inspect.getsource(m) for m in (j.decoder, j.encoder, collections, argparse))
    return torch.tensor(list(src.encode()), dtype=torch.long)


class ByteLM(L.LightningModule):
    """Predict the next byte from the previous CTX bytes (embedding + MLP)."""

    def __init__(self, dim: int = 32, hidden: int = 256, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.emb = torch.nn.Embedding(256, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(CTX * dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 256)
        )

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.mlp(self.emb(x).flatten(1)), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 100, 0.5)}


def loader() -> torch.utils.data.DataLoader:
    data = text_bytes()
    n = BATCH * BATCHES_PER_EPOCH
    idx = torch.linspace(0, len(data) - CTX - 2, n).long()
    x = torch.stack([data[i : i + CTX] for i in idx.tolist()])
    y = data[idx + CTX]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def run(out: str, steps: int, ckpt_path: str | None = None) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    cb = ModelCheckpoint(
        dirpath=os.path.join(out, "ckpts"), every_n_train_steps=50, save_top_k=3, monitor="loss", save_last=True
    )
    trainer = L.Trainer(
        max_steps=steps,
        default_root_dir=out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        plugins=[S4CheckpointIO()],
    )
    trainer.fit(ByteLM(), loader(), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="s4w-lightning-")
    print(f"run folder: {out}")
    full = run(os.path.join(out, "full"), a.steps)
    ckpts = os.path.join(out, "full", "ckpts")
    print("checkpoint files:", sorted(n for n in os.listdir(ckpts) if n.endswith(".ckpt")))
    st = CheckpointStore(os.path.join(ckpts, ".s4w"))
    for i in st.list():
        name = i.extra["path"].rsplit("/", 1)[-1]
        print(f"  store step {i.step:>3} {i.kind:<8} {name:<24} raw {i.raw_bytes:>9,} B -> {i.object_bytes:>9,} B")
    sz = st.sizes()
    # physical: everything on disk, incl. bases kept only for deltas and the newest step's keyframe
    # copy (a load of that step reads the copy alone; CheckpointStore(keyframe_copy=False) skips it)
    raw, stored, copy = sz["raw_bytes"], sz["physical_bytes"], sz.get("copy_bytes", 0)
    print(
        f"savings: {sz['steps']} checkpoints, {raw:,} B raw, {stored:,} B on disk ({raw / max(stored, 1):.2f}x; "
        f"of it {copy:,} B the newest step's keyframe copy, {raw / max(stored - copy, 1):.2f}x without it)"
    )
    mid = os.path.join(ckpts, f"epoch={a.steps // 2 // BATCHES_PER_EPOCH - 1}-step={a.steps // 2}.ckpt")
    if not os.path.exists(mid):  # top-3 may have rotated it away: resume from the oldest kept one
        mid = os.path.join(ckpts, sorted(n for n in os.listdir(ckpts) if n.startswith("epoch"))[0])
    resumed = run(os.path.join(out, "resumed"), a.steps, ckpt_path=mid)
    same = all(
        torch.equal(x, y) for x, y in zip(full.model.state_dict().values(), resumed.model.state_dict().values())
    ) and all(
        torch.equal(x, y)
        for s1, s2 in zip(full.optimizers[0].state.values(), resumed.optimizers[0].state.values())
        for x, y in zip(s1.values(), s2.values())
    )
    print(f"resumed from {os.path.basename(mid)} and trained to step {resumed.global_step}")
    print(json.dumps({
        "bit_exact_vs_uninterrupted": same,
        "ratio": round(raw / max(stored, 1), 3),
        "ratio_without_keyframe_copy": round(raw / max(stored - copy, 1), 3),
    }))
    if not same:
        raise SystemExit("resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()

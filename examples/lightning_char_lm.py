"""Lightning + s4weights: a tiny byte-level language model on real text, bf16, compressed delta
checkpoints, resume.

The text is the source of a few Python standard-library modules (it ships with every Python).
Trains 300 steps (``--steps``) on the CPU in bf16 (``precision="bf16-true"``) with
``Trainer(plugins=[S4CheckpointIO()])`` and a ``ModelCheckpoint`` every 50 steps (one epoch), top-3
by loss + ``last.ckpt``. The store's steps are the trainer's global steps; when a save enters the
top 3, ``last.ckpt`` names the same store step (stored once, ``last.ckpt`` is then a small pointer).
Then a new Trainer resumes from the oldest checkpoint top-3 kept (an epoch boundary, so a plain
DataLoader replays exactly; the script prints which), trains to the end, and the result is
compared bit for bit with the run that never stopped. Writes under ``--out`` (default: a new
``/tmp/s4w-lightning-*`` folder, printed first). Prints the store's steps, the bytes on disk (store and pointer
files) against what Lightning's own ``torch.save`` files for the same checkpoints take, and
``{"bit_exact_vs_uninterrupted": ...}``.

    PYTHONPATH=.:integrations python examples/lightning_char_lm.py [--out DIR] [--steps 300]
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import tempfile

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from s4w_core.store import CheckpointStore
from s4w_lightning import S4CheckpointIO, load_checkpoint

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
        precision="bf16-true",
        plugins=[S4CheckpointIO()],
    )
    trainer.fit(ByteLM(), loader(), ckpt_path=ckpt_path)
    return trainer


def disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="s4w-lightning-")
    print(f"writing under {out} (full/ and resumed/ runs; --out DIR to choose)")
    full = run(os.path.join(out, "full"), a.steps)
    ckpts = os.path.join(out, "full", "ckpts")
    names = sorted(n for n in os.listdir(ckpts) if n.endswith(".ckpt"))
    print("checkpoint files:", names)
    st = CheckpointStore(os.path.join(ckpts, ".s4w"))
    for i in st.list():
        print(f"  store step {i.step:>3} {i.kind:<8} raw {i.raw_bytes:>9,} B -> {i.object_bytes:>9,} B")
    # what Lightning's own TorchCheckpointIO would have written for the same files: torch.save of
    # the very dicts (each file loads back to exactly what Lightning handed over)
    plain = 0
    for n in names:
        buf = io.BytesIO()
        torch.save(load_checkpoint(os.path.join(ckpts, n)), buf)
        plain += len(buf.getvalue())
    ours = disk_bytes(os.path.join(ckpts, ".s4w")) + sum(disk_bytes(os.path.join(ckpts, n)) for n in names)
    print(
        f"savings: {len(names)} checkpoint files for {len(st.steps())} store steps; Lightning's own files "
        f"{plain:,} B, s4weights on disk {ours:,} B (store + pointer files) = {ours / plain:.2f}x "
        f"({plain / ours:.2f}x smaller)"
    )
    oldest = min((n for n in names if n.startswith("epoch")), key=lambda n: int(n.rsplit("step=", 1)[1][:-5]))
    mid = os.path.join(ckpts, oldest)
    resumed = run(os.path.join(out, "resumed"), a.steps, ckpt_path=mid)
    same = all(
        torch.equal(x, y) for x, y in zip(full.model.state_dict().values(), resumed.model.state_dict().values())
    ) and all(
        torch.equal(x, y)
        for s1, s2 in zip(full.optimizers[0].state.values(), resumed.optimizers[0].state.values())
        for x, y in zip(s1.values(), s2.values())
    )
    print(f"resumed from {oldest} (the oldest kept) and trained to step {resumed.global_step}")
    print(json.dumps({
        "bit_exact_vs_uninterrupted": same,
        "resumed_from": oldest,
        "disk_vs_lightning_files": round(ours / plain, 3),
    }))
    if not same:
        raise SystemExit("resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()

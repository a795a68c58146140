"""Hugging Face Trainer + s4weights: tiny GPT-2 on real text, compressed delta checkpoints, resume.

A 2-layer GPT-2 (built from a config, no download) learns bytes of Python standard-library source
(ships with every Python). ``Trainer(callbacks=[S4Callback()])`` stores each ``checkpoint-N``
folder in ``<output_dir>/.s4w`` as deltas; then the raw folders are deleted, the step-100
checkpoint is restored from the store with ``restore_checkpoint``, training resumes to the end and
is compared bit for bit with the run that never stopped.

    PYTHONPATH=.:integrations python examples/hf_tiny_gpt2.py [--out DIR] [--steps 200]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import tempfile

import torch
import transformers

from s4w_core.store import CheckpointStore
from s4w_transformers import S4Callback, restore_checkpoint

SEQ = 32


class StdlibText(torch.utils.data.Dataset):
    def __init__(self) -> None:
        import collections
        import json as j

        src = "".join(inspect.getsource(m) for m in (j.decoder, j.encoder, collections)).encode()
        data = torch.tensor(list(src), dtype=torch.long)
        n = len(data) // SEQ
        self.x = data[: n * SEQ].view(n, SEQ)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def trainer(out: str, steps: int, callbacks: list) -> transformers.Trainer:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=2e-3,
        save_steps=50,
        save_total_limit=3,
        logging_steps=50,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return transformers.Trainer(
        model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=StdlibText(), callbacks=callbacks
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="s4w-hf-")
    full = trainer(os.path.join(out, "full"), a.steps, [S4Callback()])
    full.train()
    store = os.path.join(out, "full", ".s4w")
    st = CheckpointStore(store)
    for i in st.list():
        print(f"  store step {i.step:>4} {i.kind:<8} raw {i.raw_bytes:>10,} B -> {i.object_bytes:>10,} B")
    sz = st.sizes()
    print(
        f"savings: {sz['steps']} checkpoints, {sz['raw_bytes']:,} B raw, {sz['physical_bytes']:,} B on disk "
        f"({sz['raw_bytes'] / max(sz['physical_bytes'], 1):.2f}x)"
    )
    for n in os.listdir(os.path.join(out, "full")):
        if n.startswith("checkpoint-"):
            shutil.rmtree(os.path.join(out, "full", n))  # only the store is left
    mid = st.steps()[0]
    resumed = trainer(os.path.join(out, "resumed"), a.steps, [])
    resumed.train(resume_from_checkpoint=restore_checkpoint(store, step=mid, dest=os.path.join(out, "restored")))
    same = all(torch.equal(x, y) for x, y in zip(full.model.state_dict().values(), resumed.model.state_dict().values()))
    print(f"resumed from step {mid} (restored from the store) to step {resumed.state.global_step}")
    print(
        json.dumps(
            {"bit_exact_vs_uninterrupted": same, "ratio": round(sz["raw_bytes"] / max(sz["physical_bytes"], 1), 3)}
        )
    )
    if not same:
        raise SystemExit("resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()

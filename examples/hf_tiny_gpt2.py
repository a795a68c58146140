"""Hugging Face Trainer + s4weights: tiny GPT-2 on real text, checkpoints from memory into a store.

A 2-layer GPT-2 (built from a config, no download) learns bytes of Python standard-library source
(ships with every Python). The same run goes three ways:

1. the Trainer's own checkpoints (``save_steps=50``, ``save_total_limit=3``): its folders' bytes;
2. with ``callbacks=[S4Callback()]``: no folder, the store ``<output_dir>/.s4w`` under the same
   retention; its bytes against the Trainer's;
3. the step-150 checkpoint is restored from the store with ``restore_checkpoint`` (the store's
   second-newest step; 150 in the default run), training resumes to the end and is compared bit for
   bit with run 1, which never stopped.

    PYTHONPATH=.:integrations python examples/hf_tiny_gpt2.py [--out DIR] [--steps 200] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile

import torch
import transformers

from s4w_core.store import CheckpointStore
from s4w_transformers import S4Callback, restore_checkpoint

SEQ = 32
TARGET = {"fp32": 0.85, "bf16": 0.6}  # store bytes / the framework's own, with the same retention


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


def trainer(out: str, steps: int, callbacks: list, dtype: str) -> transformers.Trainer:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)  # bf16 weights and AdamW moments: a bf16 checkpoint
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
    return transformers.Trainer(model=model, args=args, train_dataset=StdlibText(), callbacks=callbacks)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dtype", choices=sorted(TARGET), default="fp32")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="s4w-hf-")

    # 1. the Trainer's own checkpoint folders
    own = trainer(os.path.join(out, "hf"), a.steps, [], a.dtype)
    own.train()
    folders = sorted(n for n in os.listdir(os.path.join(out, "hf")) if n.startswith("checkpoint-"))
    own_bytes = du(os.path.join(out, "hf"))

    # 2. the same run with S4Callback: no folder, the store only
    run = os.path.join(out, "s4w")
    trainer(run, a.steps, [S4Callback()], a.dtype).train()
    store = os.path.join(run, ".s4w")
    st = CheckpointStore(store)
    for i in st.list():
        print(f"  store step {i.step:>4} {i.kind:<8} raw {i.raw_bytes:>10,} B -> {i.object_bytes:>10,} B")
    left = sorted(os.listdir(run))
    store_bytes = du(store)
    ratio = store_bytes / own_bytes
    print(f"the Trainer's own checkpoints: {folders}, {own_bytes:,} B on disk")
    print(f"S4Callback: {left} in the output dir, steps {st.steps()}, {store_bytes:,} B on disk")
    print(
        f"savings ({a.dtype}): the store takes {ratio:.3f}x the disk of the Trainer's own files "
        f"(target <= {TARGET[a.dtype]}: {'met' if ratio <= TARGET[a.dtype] else 'NOT met'})"
    )

    own_objects = sum(i.object_bytes for i in st.list())
    print(
        f"the kept steps' own containers: {own_objects:,} B ({own_objects / own_bytes:.3f}x the Trainer's own files); the store "
        f"holds {store_bytes - own_objects:,} B more (commit records, and data its layout keeps beyond the steps)"
    )

    # 3. resume from the store's second-newest step, compare with run 1
    mid = st.steps()[-2]
    resumed = trainer(os.path.join(out, "resumed"), a.steps, [], a.dtype)
    resumed.args.save_strategy = "no"
    resumed.train(resume_from_checkpoint=restore_checkpoint(store, step=mid))
    same = all(torch.equal(x, y) for x, y in zip(own.model.state_dict().values(), resumed.model.state_dict().values()))
    print(f"resumed from step {mid} (restored from the store) to step {resumed.state.global_step}")
    print(
        json.dumps(
            {
                "bit_exact_vs_uninterrupted": same,
                "dtype": a.dtype,
                "store_bytes": store_bytes,
                "framework_bytes": own_bytes,
                "disk_ratio": round(ratio, 3),
                "kept_steps_ratio": round(own_objects / own_bytes, 3),
                "target_met": ratio <= TARGET[a.dtype],
            }
        )
    )
    if not same:
        raise SystemExit("resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()

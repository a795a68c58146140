"""Accelerate + s4weights: ``save_state``/``load_state`` from memory into a store.

Switched on by the environment, with one import line in the script (``accelerate launch`` passes
the environment to every worker)::

    S4W_ACCELERATE=1 PYTHONPATH=.:integrations python examples/accelerate_mlp.py [--dtype bf16]

(this script sets the variable itself when it is unset). A byte-level MLP on Python
standard-library source trains 200 steps, ``save_state()`` every 50 (automatic naming,
total_limit=2), three ways:

1. Accelerate's own ``save_state`` (the hook switched off): its folders' bytes;
2. with the hook: the folders stay empty, the store ``<project_dir>/.s4w`` holds the checkpoints
   under the same retention; its bytes against Accelerate's;
3. a fresh Accelerator ``load_state()``s the step-150 checkpoint (``checkpoints/checkpoint_2``) from
   the store, trains on to 200, and is compared bit for bit with run 1, which never stopped.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile

os.environ.setdefault("S4W_ACCELERATE", "1")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import s4w_accelerate  # noqa: E402  <- the one line that switches save_state/load_state over
from s4w_core.store import CheckpointStore  # noqa: E402

CTX = 8
TARGET = {"fp32": 0.85, "bf16": 0.6}  # store bytes / the framework's own, with the same retention


def data() -> tuple[torch.Tensor, torch.Tensor]:
    import json as j

    src = torch.tensor(list("".join(inspect.getsource(m) for m in (j.decoder, j.encoder)).encode()), dtype=torch.long)
    idx = torch.arange(0, len(src) - CTX - 1)
    return torch.stack([src[i : i + CTX] for i in idx.tolist()]), src[idx + CTX]


def setup(project: str, dtype: str):
    AcceleratorState._reset_state(True)
    acc = Accelerator(
        cpu=True, project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=2)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(256, 32),
        torch.nn.Flatten(),
        torch.nn.Linear(CTX * 32, 256),
        torch.nn.GELU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 256),
    )
    if dtype == "bf16":
        model = model.to(torch.bfloat16)  # bf16 weights and AdamW moments: a bf16 checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100, 0.5)
    return acc, *acc.prepare(model, opt, sched)


def train(acc, model, opt, sched, x, y, steps, save_every=0) -> None:
    for s in steps:
        i = torch.arange(s * 64, s * 64 + 64) % len(x)
        loss = torch.nn.functional.cross_entropy(model(x[i]).float(), y[i])
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if save_every and (s + 1) % save_every == 0:
            acc.save_state()


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dtype", choices=sorted(TARGET), default="fp32")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="s4w-accelerate-")
    x, y = data()

    # 1. Accelerate's own save_state
    cfg = s4w_accelerate.config()
    s4w_accelerate.disable()
    acc, model, opt, sched = setup(os.path.join(out, "own"), a.dtype)
    train(acc, model, opt, sched, x, y, range(a.steps), save_every=50)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    own_bytes = du(os.path.join(out, "own"))
    if cfg is None:  # S4W_ACCELERATE=0 given: this example is about the hook
        s4w_accelerate.enable()
    else:
        s4w_accelerate.enable(
            cfg.store, profile=cfg.profile, store_options=cfg.store_options, async_save=cfg.async_save
        )

    # 2. the same run through the store
    run = os.path.join(out, "s4w")
    acc, model, opt, sched = setup(run, a.dtype)
    train(acc, model, opt, sched, x, y, range(a.steps), save_every=50)
    s4w_accelerate.finish_pending()
    st = CheckpointStore(os.path.join(run, ".s4w"))
    ck = os.path.join(run, "checkpoints")
    print("checkpoint folders:", {n: os.listdir(os.path.join(ck, n)) for n in sorted(os.listdir(ck))})
    for i in st.list():
        print(
            f"  store step {i.step} ({i.extra['folder']}) {i.kind:<8} raw {i.raw_bytes:>9,} B -> {i.object_bytes:>9,} B"
        )
    store_bytes = du(run)
    ratio = store_bytes / own_bytes
    print(f"Accelerate's own checkpoints: {own_bytes:,} B on disk; the store: {store_bytes:,} B")
    print(
        f"savings ({a.dtype}): the store takes {ratio:.3f}x the disk of Accelerate's own files "
        f"(target <= {TARGET[a.dtype]}: {'met' if ratio <= TARGET[a.dtype] else 'NOT met'})"
    )

    own_objects = sum(i.object_bytes for i in st.list())
    print(
        f"the kept steps' own containers: {own_objects:,} B ({own_objects / own_bytes:.3f}x Accelerate's own files); the store "
        f"holds {store_bytes - own_objects:,} B more (commit records, and data its layout keeps beyond the steps)"
    )

    # 3. a fresh Accelerator resumes from checkpoint_2 (after step 150), read from the store
    acc, model, opt, sched = setup(run, a.dtype)
    acc.load_state(os.path.join(ck, "checkpoint_2"))
    train(acc, model, opt, sched, x, y, range(150, a.steps))
    same = all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    print(f"resumed from checkpoint_2 (step 150, restored from the store) to step {a.steps}")
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

"""Accelerate + s4weights: ``save_state``/``load_state`` through compressed delta checkpoints.

Switched on by the environment, with one import line in the script (``accelerate launch`` passes
the environment to every worker)::

    S4W_ACCELERATE=1 S4W_ACCELERATE_KEEP_LOCAL=0 PYTHONPATH=.:integrations python examples/accelerate_mlp.py

(this script sets those two variables itself when they are unset). A byte-level MLP on Python
standard-library source trains 200 steps, ``save_state()`` every 50 (automatic naming,
total_limit=2, raw files dropped); a fresh Accelerator then ``load_state()``s the step-150
checkpoint (``checkpoints/checkpoint_2``), rebuilt from the store, trains on to 200, and is compared
with the run that never stopped.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile

os.environ.setdefault("S4W_ACCELERATE", "1")
os.environ.setdefault("S4W_ACCELERATE_KEEP_LOCAL", "0")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import s4w_accelerate  # noqa: E402, F401  <- the one line that switches save_state/load_state over
from s4w_core.store import CheckpointStore  # noqa: E402

CTX = 8


def data() -> tuple[torch.Tensor, torch.Tensor]:
    import json as j

    src = torch.tensor(list("".join(inspect.getsource(m) for m in (j.decoder, j.encoder)).encode()), dtype=torch.long)
    idx = torch.arange(0, len(src) - CTX - 1)
    return torch.stack([src[i : i + CTX] for i in idx.tolist()]), src[idx + CTX]


def setup(project: str):
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
        torch.nn.Linear(256, 256),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100, 0.5)
    return acc, *acc.prepare(model, opt, sched)


def train(acc, model, opt, sched, x, y, steps, save_every=0) -> None:
    for s in steps:
        i = torch.arange(s * 64, s * 64 + 64) % len(x)
        loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if save_every and (s + 1) % save_every == 0:
            acc.save_state()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="s4w-accelerate-")
    x, y = data()
    acc, model, opt, sched = setup(out)
    train(acc, model, opt, sched, x, y, range(a.steps), save_every=50)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    st = CheckpointStore(os.path.join(out, ".s4w"))
    print(
        "checkpoint folders:",
        {
            n: os.listdir(os.path.join(out, "checkpoints", n))
            for n in sorted(os.listdir(os.path.join(out, "checkpoints")))
        },
    )
    for i in st.list():
        print(
            f"  store step {i.step} ({i.extra['folder']}) {i.kind:<8} raw {i.raw_bytes:>9,} B -> {i.object_bytes:>9,} B"
        )
    sz = st.sizes()
    print(
        f"savings: {sz['raw_bytes']:,} B raw, {sz['physical_bytes']:,} B on disk ({sz['raw_bytes'] / max(sz['physical_bytes'], 1):.2f}x)"
    )
    # a fresh Accelerator resumes from checkpoint_2 (after step 150), rebuilt from the store
    acc, model, opt, sched = setup(out)
    acc.load_state(os.path.join(out, "checkpoints", "checkpoint_2"))
    train(acc, model, opt, sched, x, y, range(150, a.steps))
    same = all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    print(f"resumed from checkpoint_2 (step 150, restored from the store) to step {a.steps}")
    print(
        json.dumps(
            {"bit_exact_vs_uninterrupted": same, "ratio": round(sz["raw_bytes"] / max(sz["physical_bytes"], 1), 3)}
        )
    )
    if not same:
        raise SystemExit("resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()

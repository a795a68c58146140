"""Store bytes of an HF Trainer run with S4Callback under recipe variants (frameworks.py's HF run).

frameworks.py's HF run leaves more store bytes than its Accelerate run for the same model and
schedule. Both keep the same two steps (the older a delta against the newer); the HF Trainer's
recipe differs from that Accelerate loop's: gradients clipped to norm 1 (``max_grad_norm``) and a
linear LR decay, where the loop has neither. This runs the HF arguments of frameworks.py with
S4Callback for each variant and prints, per variant: the kept steps (kind, object MB), their total,
and the delta of the older step coded per part (weights, Adam's exp_avg, exp_avg_sq) in a store of
its own, with how much exp_avg_sq grew between the two steps (median ratio) and the fraction of
bf16 elements whose sign and exponent did not change.

    python benchmarks/hf_recipe_bytes.py                        # on the GPU: the bf16 model of frameworks.py
    python benchmarks/hf_recipe_bytes.py --device cpu --model smoke
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from frameworks import SIZES, SaveTimer, TextDataset, gpt2, run_accelerate  # noqa: E402

VARIANTS: dict[str, dict[str, Any] | None] = {  # name -> TrainingArguments overrides
    "hf": {},  # the Trainer's defaults, as frameworks.py runs it: max_grad_norm=1.0, linear decay
    "noclip": {"max_grad_norm": 0.0},
    "const": {"lr_scheduler_type": "constant"},
    "noclip_const": {"max_grad_norm": 0.0, "lr_scheduler_type": "constant"},  # the Accelerate loop's recipe
    "accelerate": None,  # frameworks.py's Accelerate loop itself, with s4w_accelerate
}


def parts(tree: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Weights, exp_avg, exp_avg_sq of a step S4Callback (or s4w_accelerate: ``accelerate``) stored."""
    model, opt = (tree["model"], tree["optimizer"]) if "model" in tree else (tree["models"][0], tree["optimizers"][0])
    s = opt["state"]
    return {
        "weights": dict(model),
        "exp_avg": {str(k): s[k]["exp_avg"] for k in s},
        "exp_avg_sq": {str(k): s[k]["exp_avg_sq"] for k in s},
    }


def same_exponent(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    n = eq = 0
    for k, x in a.items():
        if x.dtype != torch.bfloat16:
            return None
        xi, yi = x.view(torch.int16), b[k].view(torch.int16)
        n += x.numel()
        eq += int(((xi >> 7) == (yi >> 7)).sum())
    return eq / n if n else None


def train_hf(a: Any, size: dict[str, int], ds: Any, device: Any, out: str, overrides: dict[str, Any]) -> None:
    """frameworks.py's HF run (its TrainingArguments, ``overrides`` on top) with S4Callback."""
    from transformers import Trainer, TrainingArguments

    from s4w_transformers import S4Callback

    args = TrainingArguments(
        output_dir=out, max_steps=a.steps, per_device_train_batch_size=size["batch"], learning_rate=3e-4,
        weight_decay=0.1, save_strategy="steps", save_steps=a.every, save_total_limit=2,
        logging_strategy="no", report_to=[], dataloader_num_workers=0, bf16=a.precision == "fp32master",
        use_cpu=device.type != "cuda", seed=0, disable_tqdm=True, optim="adamw_torch", **overrides,
    )  # fmt: skip
    Trainer(model=gpt2(size, a.precision, device), args=args, train_dataset=ds, callbacks=[S4Callback()]).train()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="bf16", choices=sorted(SIZES))
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32master"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()

    from s4w_core.store import CheckpointStore

    device = torch.device(a.device)
    size = SIZES[a.model]
    ds = TextDataset(a.steps * size["batch"], size["ctx"])
    work = tempfile.mkdtemp(prefix="s4w_hf_recipe_")
    mb = 1e-6
    try:
        for name in a.variants.split(","):
            out = os.path.join(work, name)
            if VARIANTS[name] is None:
                spec = {"mode": "s4w", "precision": a.precision, "size": size, "steps": a.steps, "every": a.every,
                        "keep": 2, "run_dir": out}  # fmt: skip
                os.makedirs(out)
                run = run_accelerate(spec, ds, device, SaveTimer())
                run["finish"]()
            else:
                train_hf(a, size, ds, device, out, VARIANTS[name])
            st = CheckpointStore(os.path.join(out, ".s4w"), base_cache_bytes=0)
            infos = [st.info(s) for s in st.steps()]
            total = sum(i.object_bytes for i in infos)
            steps = ", ".join(f"{i.step} {i.kind} {i.object_bytes * mb:.2f}" for i in infos)
            print(f"{name}: steps [{steps}] MB, total {total * mb:.2f} MB ({total / (2 * infos[-1].raw_bytes):.3f}x "
                  f"two whole steps' raw bytes)", flush=True)  # fmt: skip
            old, new = (parts(st.load(i.step, map_location=device)) for i in infos[-2:])
            st.close()
            for part in old:
                ps = CheckpointStore(os.path.join(work, f"{name}_{part}"))
                ps.save(old[part], 1)
                ps.save(new[part], 2)
                ps.wait()
                d, k = ps.info(1), ps.info(2)
                ps.close()
                line = f"  {part}: older step {d.kind} {d.object_bytes * mb:.2f} MB, newer {k.object_bytes * mb:.2f} MB"
                se = same_exponent(old[part], new[part])
                if se is not None:
                    line += f", sign+exponent unchanged {se:.3f}"
                if part == "exp_avg_sq":
                    r = torch.cat(
                        [(new[part][p].float() / old[part][p].float().clamp_min(1e-30)).flatten() for p in old[part]]
                    )
                    line += f", newer/older median {r.median().item():.3f}"
                print(line, flush=True)
            del old, new
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

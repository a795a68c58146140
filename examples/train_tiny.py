#!/usr/bin/env python3
"""Train a tiny GPT-style byte-level language model on real text, on the CPU, saving compressed
s4weights checkpoints as it goes, then resume from the last one and check it bit for bit.

The corpus is the Python standard library's own source files (found offline, on every machine
with Python). Checkpoints hold the model, the AdamW state, the LR scheduler and the RNG states.

    python examples/train_tiny.py                         # a few minutes on 2 CPU cores
    python examples/train_tiny.py --steps 40 --save-every 10 --out /tmp/ckpts
    python examples/train_tiny.py --dtype bf16            # all-bf16 weights and optimizer state

Where ``s4w_core.CheckpointStore`` exists (the default), checkpoints go into a store: step N is
saved as an XOR delta against step N-k where that pays, with atomic commits; ``--plain-files``
writes one self-contained ``step_N.s4w`` per save with :func:`s4w_core.save` instead.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import s4w_core


# ----------------------------------------------------------------------------- data
def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the stdlib's .py files (sorted, so the same on every run), as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts:
            continue
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    if total < 10_000:
        raise SystemExit(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def batch(data: torch.Tensor, n: int, ctx: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(0, data.numel() - ctx - 1, (n,), generator=g)
    x = torch.stack([data[i : i + ctx + 1] for i in ix.tolist()]).long()
    return x[:, :-1], x[:, 1:]


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4, heads: int = 4, ctx: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings: stored once, restored tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# ----------------------------------------------------------------------------- checkpoints
class Checkpoints:
    """Where checkpoints go. The store and the plain-file variant have the same three verbs."""

    def __init__(self, out: Path, plain_files: bool) -> None:
        store_cls = getattr(s4w_core, "CheckpointStore", None)
        self.plain = plain_files or store_cls is None
        self.out = out
        self.store = None if self.plain else store_cls(out)  # type: ignore[misc]

    def save(self, state: dict[str, Any], step: int) -> str:
        if self.store is not None:
            info = self.store.save(state, step)
            return (f"{info.kind:<8} {info.raw_bytes / 2**20:7.2f} MiB -> {info.object_bytes / 2**20:6.2f} MiB "
                    f"({info.ratio:.2f}x)  {self.out}/{info.object}")
        rep = s4w_core.save(state, self.out / f"step_{step:06d}.s4w")
        return f"file     {rep.raw_bytes / 2**20:7.2f} MiB -> {rep.file_bytes / 2**20:6.2f} MiB ({rep.raw_bytes / rep.file_bytes:.2f}x)  {rep.path}"

    def latest(self) -> int | None:
        if self.store is not None:
            return self.store.latest()
        steps = sorted(int(p.stem.split("_")[1]) for p in self.out.glob("step_*.s4w"))
        return steps[-1] if steps else None

    def load(self, step: int) -> Any:
        if self.store is not None:
            return self.store.load(step)
        return s4w_core.load(self.out / f"step_{step:06d}.s4w")

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.out.rglob("*") if p.is_file())

    def count(self) -> int:
        """How many checkpoints are kept."""
        if self.store is not None:
            return len(self.store.steps())
        return len(list(self.out.glob("step_*.s4w")))


def capture(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, g: torch.Generator, step: int, loss: float) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "data": g.get_state()},
        "step": step,
        "loss": loss,
    }


def same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                                b.reshape(-1).view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return bool(a == b)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("runs/train_tiny"))
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--corpus-bytes", type=int, default=4 << 20)
    ap.add_argument("--plain-files", action="store_true", help="one s4w_core.save file per step, no store")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    data = load_corpus(args.corpus_bytes)
    g = torch.Generator().manual_seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = TinyGPT(d=args.d_model, layers=args.layers, ctx=args.ctx).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
    args.out.mkdir(parents=True, exist_ok=True)
    ckpts = Checkpoints(args.out, args.plain_files)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"corpus: {data.numel() / 2**20:.1f} MiB of stdlib source | model: {nparams / 1e6:.2f} M params, {args.dtype} | "
          f"checkpoints: {'plain files' if ckpts.plain else 'CheckpointStore'} in {args.out}")

    start = ckpts.latest()
    first = 1
    if start is not None:
        st = ckpts.load(start)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        torch.set_rng_state(st["rng"]["torch"])
        g.set_state(st["rng"]["data"])
        first = start + 1
        print(f"resumed from step {start} (loss {st['loss']:.3f})")

    t0 = time.perf_counter()
    last_state, loss_v = None, float("nan")
    for step in range(first, args.steps + 1):
        x, y = batch(data, args.batch, args.ctx, g)
        loss = F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = loss.item()
        if step % args.save_every == 0 or step == args.steps:
            last_state = capture(model, opt, sched, g, step, loss_v)
            ts = time.perf_counter()
            desc = ckpts.save(last_state, step)
            print(f"step {step:5d}  loss {loss_v:.3f}  saved in {time.perf_counter() - ts:5.2f}s  {desc}", flush=True)
    train_s = time.perf_counter() - t0

    if last_state is not None:  # the last checkpoint restores bit for bit, and training continues from it
        back = ckpts.load(args.steps)
        ok = same_bits(last_state, back)
        print(f"reloaded step {args.steps}: {'bit-exact' if ok else 'MISMATCH'}")
        if not ok:
            return 1
    raw = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in opt.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor))
    kept = ckpts.count()
    print(f"done: {args.steps - first + 1} steps in {train_s:.1f}s, final loss {loss_v:.3f}; "
          f"{args.out} holds {ckpts.total_bytes() / 2**20:.2f} MiB (one raw checkpoint: {raw / 2**20:.2f} MiB; "
          f"{ckpts.total_bytes() / max(kept * raw, 1):.2f}x the {kept} raw checkpoints it keeps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

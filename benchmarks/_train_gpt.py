"""A small GPT-style byte-level language model trained on real text, for checkpoint-chain benchmarks.

Text: the Python standard library's source files of the running interpreter (real text, offline).
Two precision variants, as in docs/STORE.md and FACTS.md:

* ``bf16``: weights and AdamW state in bfloat16 (the optimizer keeps state in the parameter dtype).
* ``fp32``: fp32 master weights and fp32 AdamW state (on CUDA the forward/backward runs under
  bf16 autocast, as in mixed-precision training; on CPU it runs in fp32).

``train(...)`` yields ``(step, state)`` every ``every`` steps, where ``state`` is a CPU copy of
``{"model": ..., "optimizer": ..., "step": ...}`` in the shape ``torch.save`` users save.

:class:`Trainer` is the same loop one step at a time, with the live state (tensors where training
keeps them, no copies) and an in-place snapshot/restore, for benchmarks that run several savers on
the same states (benchmarks/bench_peers.py).  :data:`MODELS` names GPT-2-like shapes (byte vocabulary,
so fewer parameters than GPT-2's 50k-token embedding gives): ``small`` 12x768 (85 M parameters),
``medium`` 24x1024 (303 M), ``large`` 36x1280 (710 M), ``ratio`` 8x512 (25.6 M: the ratio
benchmark's series); ``tiny`` and ``mini`` are for CPU runs.

:func:`ratio_series` / :func:`cached_ratio_series` are the series of benchmarks/bench_ratio.py: one
training run's weights, ``exp_avg`` and ``exp_avg_sq`` every few steps after a warm-up, per tensor
group, in the format of benchmarks/_train_minilm.py's series.
"""

from __future__ import annotations

import copy
import functools
import glob
import math
import os
import sys
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPT",
    "MODELS",
    "RATIO_GROUPS",
    "Trainer",
    "cached_ratio_series",
    "corpus",
    "ratio_series",
    "ratio_series_tag",
    "train",
]

#: model shapes (layers, width, context, batch) by name; heads = width // 64.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "d": 64, "ctx": 32, "batch": 4},
    "mini": {"layers": 4, "d": 256, "ctx": 128, "batch": 8},
    "small": {"layers": 12, "d": 768, "ctx": 512, "batch": 16},
    "medium": {"layers": 24, "d": 1024, "ctx": 512, "batch": 16},
    "large": {"layers": 36, "d": 1280, "ctx": 512, "batch": 8},
    "ratio": {"layers": 8, "d": 512, "ctx": 256, "batch": 16},
}


@functools.lru_cache(maxsize=1)
def _stdlib_files(root: str) -> tuple[str, ...]:
    return tuple(sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)))


def corpus(max_bytes: int = 32 << 20) -> torch.Tensor:
    """Bytes of the stdlib's .py files (sorted, deterministic) as a uint8 tensor."""
    root = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}")
    files = _stdlib_files(root)
    out = bytearray()
    for f in files:
        if "site-packages" in f:
            continue
        try:
            with open(f, "rb") as fh:
                out += fh.read()
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    if len(out) < 1 << 20:
        raise RuntimeError(f"found only {len(out)} bytes of text under {root}")
    return torch.frombuffer(bytearray(out[:max_bytes]), dtype=torch.uint8).clone()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int = 4, d: int = 256, heads: int = 4, ctx: int = 256, vocab: int = 256) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def _cpu_copy(obj):  # type: ignore[no-untyped-def]
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


class Trainer:
    """One training run, a step at a time (the loop of :func:`train`, same random sequence).

    ``state()`` returns the live ``{"model", "optimizer"}`` state dicts (tensors on ``device``, not
    copies); ``snapshot()``/``restore()`` copy every parameter and optimizer tensor, the scheduler,
    the learning rates and the batch generator, in place, so several savers can be run on exactly
    the same sequence of states.
    """

    def __init__(
        self,
        variant: str,
        steps: int,
        *,
        device: str = "cpu",
        layers: int = 4,
        d: int = 256,
        ctx: int = 128,
        batch: int = 8,
        lr: float = 1e-3,
        seed: int = 0,
        corpus_bytes: int = 32 << 20,
    ) -> None:
        if variant not in ("bf16", "fp32"):
            raise ValueError(variant)
        self.variant = variant
        self.steps = steps
        self.ctx = ctx
        self.batch = batch
        torch.manual_seed(seed)
        self.data = corpus(corpus_bytes).to(device)
        self.dev = dev = torch.device(device)
        model = GPT(layers=layers, d=d, heads=max(1, d // 64), ctx=ctx).to(dev)
        if variant == "bf16":
            model = model.to(torch.bfloat16)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
        warm = max(1, steps // 10)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))),
        )
        self.g = torch.Generator(device="cpu").manual_seed(seed)
        self.use_autocast = variant == "fp32" and dev.type == "cuda"
        self.step_count = 0

    def step(self) -> torch.Tensor:
        """One optimizer step; returns the loss (a detached tensor: no host sync)."""
        ctx, dev, data = self.ctx, self.dev, self.data
        ix = torch.randint(0, data.numel() - ctx - 1, (self.batch,), generator=self.g).to(dev)
        x = torch.stack([data[i : i + ctx] for i in ix]).long()
        y = torch.stack([data[i + 1 : i + 1 + ctx] for i in ix]).long()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.use_autocast):
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.step_count += 1
        return loss.detach()

    def state(self) -> dict:
        """The live state: ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def _live(self) -> list[torch.Tensor]:
        out = [p.data for p in self.model.parameters()]
        for p in self.model.parameters():
            st = self.opt.state.get(p, {})
            out.extend(v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor))
        return out

    def labels(self) -> list[str]:
        """A group name per tensor of :meth:`_live`, in its order: ``weights``, then each
        optimizer-state key (``exp_avg``, ``exp_avg_sq``, ...)."""
        params = list(self.model.parameters())
        out = ["weights"] * len(params)
        for p in params:
            out.extend(k for k, v in sorted(self.opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor))
        return out

    def snapshot(self) -> dict:
        """Copies of everything :meth:`step` changes (on the tensors' own devices)."""
        return {
            "tensors": [t.detach().clone() for t in self._live()],
            "sched": copy.deepcopy(self.sched.state_dict()),
            "lrs": [g["lr"] for g in self.opt.param_groups],
            "g": self.g.get_state(),
            "step": self.step_count,
        }

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        """Put the run back to ``snap`` in place (the same tensor objects, so no aliasing)."""
        live = self._live()
        if len(live) != len(snap["tensors"]):
            raise RuntimeError("optimizer state changed shape since the snapshot")
        for t, s in zip(live, snap["tensors"]):
            t.copy_(s)
        self.sched.load_state_dict(copy.deepcopy(snap["sched"]))
        for g, lr in zip(self.opt.param_groups, snap["lrs"]):
            g["lr"] = lr
        self.g.set_state(snap["g"])
        self.step_count = snap["step"]


def train(
    variant: str,
    steps: int,
    every: int,
    *,
    device: str = "cpu",
    layers: int = 4,
    d: int = 256,
    ctx: int = 128,
    batch: int = 8,
    lr: float = 1e-3,
    seed: int = 0,
    log_every: int = 50,
) -> Iterator[tuple[int, dict]]:
    """Train and yield a CPU copy of the state every ``every`` steps (steps every, 2*every, ...)."""
    tr = Trainer(variant, steps, device=device, layers=layers, d=d, ctx=ctx, batch=batch, lr=lr, seed=seed)
    for step in range(1, steps + 1):
        loss = tr.step()
        if log_every and step % log_every == 0:
            print(f"  [{variant}] step {step} loss {loss.item():.3f}", file=sys.stderr, flush=True)
        if step % every == 0:
            yield step, _cpu_copy({**tr.state(), "step": step})


#: the tensor groups of a ratio series snapshot
RATIO_GROUPS = ("weights", "exp_avg", "exp_avg_sq")


def ratio_series(
    precision: str,
    *,
    model: str = "ratio",
    device: str = "cpu",
    first: int = 50,
    every: int = 5,
    snapshots: int = 5,
    seed: int = 0,
) -> Iterator[tuple[int, dict[str, dict[str, torch.Tensor]]]]:
    """Train the GPT of shape ``MODELS[model]`` in ``precision`` (``bf16`` or ``fp32``, as
    :class:`Trainer`) with AdamW on ``device`` and yield ``(step, groups)`` at steps ``first``,
    ``first + every``, ... (``snapshots`` of them; the run's schedule ends at the last one), where
    ``groups`` maps ``weights``, ``exp_avg`` and ``exp_avg_sq`` to ``{parameter name: CPU copy}``."""
    if first < 1 or every < 1 or snapshots < 1:
        raise ValueError(f"first, every and snapshots must be >= 1 (got {first}, {every}, {snapshots})")
    last = first + (snapshots - 1) * every
    tr = Trainer(precision, last, device=device, seed=seed, **MODELS[model])
    names = list(tr.model.named_parameters())
    for step in range(1, last + 1):
        loss = tr.step()
        if step >= first and (step - first) % every == 0:
            print(f"  [{precision}] step {step} loss {loss.item():.3f}", file=sys.stderr, flush=True)
            groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in RATIO_GROUPS}
            for n, p in names:
                groups["weights"][n] = _cpu_copy(p.data).contiguous()
                st = tr.opt.state.get(p, {})
                for g in RATIO_GROUPS[1:]:
                    if g in st:
                        groups[g][n] = _cpu_copy(st[g]).contiguous()
            yield step, groups


def ratio_series_tag(precision: str, *, model: str, device: str, first: int, every: int, snapshots: int) -> str:
    """The file-name prefix of a cached :func:`ratio_series` (the device type is part of it: a
    CUDA run's states are not a CPU run's)."""
    return f"gpt-{model}_{precision}_{torch.device(device).type}_f{first}_e{every}_s{snapshots}"


def cached_ratio_series(
    precision: str,
    cache: str,
    *,
    model: str = "ratio",
    device: str = "cpu",
    first: int = 50,
    every: int = 5,
    snapshots: int = 5,
) -> list[tuple[int, dict[str, dict[str, torch.Tensor]]]]:
    """:func:`ratio_series` as a list, kept under ``cache`` (one ``torch.save`` file per snapshot,
    ``<tag>_step<N>.pt``) so that a second run measures the same states without training again."""
    tag = os.path.join(
        cache, ratio_series_tag(precision, model=model, device=device, first=first, every=every, snapshots=snapshots)
    )
    steps = [first + i * every for i in range(snapshots)]
    files = [f"{tag}_step{s}.pt" for s in steps]
    if all(os.path.exists(f) for f in files):
        return [(s, torch.load(f, weights_only=True)) for s, f in zip(steps, files)]
    os.makedirs(cache, exist_ok=True)
    out = []
    it = ratio_series(precision, model=model, device=device, first=first, every=every, snapshots=snapshots)
    for (step, groups), f in zip(it, files):
        torch.save(groups, f + ".tmp")
        os.replace(f + ".tmp", f)
        out.append((step, groups))
    return out

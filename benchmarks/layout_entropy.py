"""Which byte layout leaves the least for the coder: ``planes-rotl1`` against plain big-endian planes.

Under ``planes-rotl1`` (docs/FORMAT.md 4.5) plane 0 is the exponent byte and the sign bit ends the
last plane; with plain planes (no rotation) plane 0 is the sign and the top 7 exponent bits, and the
exponent's lowest bit starts plane 1. The encoder codes plane 0 always and the later planes only
where a sample promises a saving (nvCOMP ANS over 512 KiB chunks): so a sign bit that is constant
(non-negative tensors such as Adam's ``exp_avg_sq``, or the ``xor`` residual of a tensor whose signs
did not flip) is free in plane 0 but costs an ANS pass over a whole mantissa plane under rotl1.

For a real state (``_train_gpt``: ``--model``, ``--steps`` optimizer steps, weights and AdamW
moments) this prints, per tensor group and layout, order-0 entropy estimates in bits per element over
``--segment``-element segments (the coder's chunks): plane 0's, the later planes' (each coded where
it saves at least 1%, else 8 bits), and the total with the later planes all raw (the speed knob's
mode). With ``--delta`` it also does the same for the ``xor`` and ``sub`` residuals against the state
``--delta`` steps earlier. Entropies are estimates of what ANS reaches, not coded sizes.

    python benchmarks/layout_entropy.py --model mini --steps 30 --delta 10 --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import _train_gpt  # noqa: E402

from s4w_core import delta  # noqa: E402

_INT = {2: torch.int16, 4: torch.int32}


def _entropy_rows(planes: torch.Tensor) -> torch.Tensor:
    """Order-0 entropy in bits of each row of a (rows, n) uint8 tensor."""
    rows, n = planes.shape
    idx = planes.to(torch.int64) + 256 * torch.arange(rows, device=planes.device)[:, None]
    hist = torch.bincount(idx.reshape(-1), minlength=256 * rows).reshape(rows, 256).to(torch.float64)
    p = hist / n
    return -(p * torch.log2(torch.where(p > 0, p, torch.ones_like(p)))).sum(1)


def _planes(x: torch.Tensor, w: int, rot: bool) -> torch.Tensor:
    """(w, n) big-endian byte planes of the W-bit patterns ``x`` (int64 holding unsigned values)."""
    bits = 8 * w
    if rot:
        x = ((x << 1) | (x >> (bits - 1))) & ((1 << bits) - 1)
    return torch.stack([((x >> (8 * (w - 1 - j))) & 0xFF).to(torch.uint8) for j in range(w)])


def _costs(x: torch.Tensor, w: int, seg: int) -> dict[str, list[float]]:
    """Summed bits over segments, per layout: [plane 0, later planes coded where it pays, later raw]."""
    out: dict[str, list[float]] = {}
    for name, rot in (("rotl1", True), ("plain", False)):
        tot = [0.0, 0.0, 0.0]
        for s in range(0, x.numel(), seg):
            xs = x[s : s + seg]
            h = _entropy_rows(_planes(xs, w, rot))
            m = xs.numel()
            tot[0] += float(h[0]) * m
            tot[1] += sum(float(v) if v <= 8 * 0.99 else 8.0 for v in h[1:].tolist()) * m
            tot[2] += 8.0 * (w - 1) * m
        out[name] = tot
    return out


def _bits(t: torch.Tensor, w: int) -> torch.Tensor:
    """A float tensor's W-bit patterns as non-negative int64."""
    return t.contiguous().view(_INT[w]).to(torch.int64) & ((1 << (8 * w)) - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--variants", default="bf16,fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--delta", type=int, default=0, help="also the residuals against the state this many steps earlier")
    ap.add_argument("--segment", type=int, default=1 << 19)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res: dict[str, Any] = {"model": a.model, "steps": a.steps, "delta": a.delta, "variants": {}}
    for variant in a.variants.split(","):
        tr = _train_gpt.Trainer(variant, max(a.steps, 1), device=a.device, **_train_gpt.MODELS[a.model])
        snap = None
        for i in range(a.steps):
            if a.delta and i == a.steps - a.delta:
                snap = [t.detach().clone() for t in tr._live()]
            tr.step()
        labels = tr.labels()
        live = tr._live()
        kinds = [("none", None)] + ([("xor", snap), ("sub", snap)] if snap is not None else [])
        table: dict[str, Any] = {}
        for kind, base in kinds:
            for i, (t, lab) in enumerate(zip(live, labels)):
                if not t.is_floating_point() or t.numel() == 0 or t.dtype not in (torch.bfloat16, torch.float32):
                    continue
                w = t.element_size()
                if kind == "none":
                    x = _bits(t, w)
                else:
                    assert base is not None
                    r = delta.forward(kind, t.contiguous().reshape(-1).view(torch.uint8),
                                      base[i].contiguous().reshape(-1).view(torch.uint8), t.dtype)
                    x = _bits(r.view(t.dtype), w)
                row = table.setdefault(f"{kind}/{lab}", {"elements": 0, "w": w, "rotl1": [0.0] * 3, "plain": [0.0] * 3})
                row["elements"] += t.numel()
                for name, v in _costs(x.reshape(-1), w, a.segment).items():
                    row[name] = [p + q for p, q in zip(row[name], v)]
        print(f"[{variant}] bits per element (order-0 entropy estimates; plane 0 | later planes coded where it pays "
              f"| total | total with later planes raw)", flush=True)
        for key, row in table.items():
            n = row["elements"]
            line = [f"{key:>18}"]
            for name in ("rotl1", "plain"):
                p0, later, raw = (v / n for v in row[name])
                row[name + "_bits"] = {"plane0": p0, "later": later, "total": p0 + later, "later_raw_total": p0 + raw}
                line.append(f"{name}: {p0:5.2f} | {later:5.2f} | {p0 + later:6.2f} | {p0 + raw:6.2f}")
            print("  ".join(line), flush=True)
        res["variants"][variant] = table
        del tr, live, snap
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""CPU numbers for docs/PERFORMANCE.md: ratio and save/load speed of s4weights' portable profile on this
machine, against torch.save and zstd-3 over the raw bytes.

Inputs: (1) the checkpoint of examples/train_tiny.py after --steps steps (model + AdamW + scheduler),
in fp32 and in bf16; (2) synthetic N(0, 0.02) weights, 8 Mi elements, bf16 and fp32.

    python benchmarks/bench_cpu.py                    # writes benchmarks/results/cpu.{md,json}
    python benchmarks/bench_cpu.py --steps 50 --repeat 3

Speeds are medians of --repeat runs, wall clock, files in a temporary directory (page cache warm).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import zstandard

import s4w_core

ROOT = Path(__file__).resolve().parents[1]


def _train_tiny() -> Any:
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def trained_checkpoint(steps: int, dtype: torch.dtype) -> dict[str, Any]:
    tt = _train_tiny()
    torch.manual_seed(0)
    data = tt.load_corpus(2 << 20)
    g = torch.Generator().manual_seed(0)
    model = tt.TinyGPT(d=128, layers=4, ctx=64).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(steps):
        x, y = tt.batch(data, 16, 64, g)
        loss = torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def raw_bytes(obj: Any) -> bytes:
    out = []
    seen: set[int] = set()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                out.append(bytes(st))
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return b"".join(out)


def timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times, res = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), res


def measure(name: str, obj: Any, repeat: int, tmp: Path) -> dict[str, Any]:
    raw = raw_bytes(obj)
    p = tmp / f"{name}.s4w"
    t_save, rep = timed(lambda: s4w_core.save(obj, p, profile="portable"), repeat)
    t_load, _ = timed(lambda: s4w_core.load(p), repeat)
    buf = io.BytesIO()
    t_tsave, _ = timed(lambda: (buf.seek(0), buf.truncate(), torch.save(obj, buf)), repeat)
    t_zstd, z = timed(lambda: zstandard.ZstdCompressor(level=3).compress(raw), repeat)
    mib = len(raw) / 2**20
    return {
        "input": name,
        "raw_MiB": round(mib, 2),
        "s4w_file_bytes": rep.file_bytes,
        "s4w_ratio": round(len(raw) / rep.file_bytes, 3),
        "zstd3_ratio": round(len(raw) / len(z), 3),
        "torch_save_bytes": len(buf.getvalue()),
        "s4w_save_MiB_s": round(mib / t_save, 1),
        "s4w_load_MiB_s": round(mib / t_load, 1),
        "torch_save_s": round(t_tsave, 3),
        "s4w_save_s": round(t_save, 3),
        "s4w_load_s": round(t_load, 3),
        "zstd3_MiB_s": round(mib / t_zstd, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default="", help="suffix of the result files' names (cpu<TAG>.md, .json)")
    args = ap.parse_args()
    from s4w_core.planes import _jit

    jit = _jit.enabled()  # the compiled plane transform (s4weights[numba]), loaded once per process
    g = torch.Generator().manual_seed(0)
    inputs = {
        f"train_tiny fp32, step {args.steps} (model+AdamW)": trained_checkpoint(args.steps, torch.float32),
        f"train_tiny bf16, step {args.steps} (model+AdamW)": trained_checkpoint(args.steps, torch.bfloat16),
        "synthetic N(0,0.02) bf16, 8 Mi elems": {"w": (torch.randn(1 << 23, generator=g) * 0.02).to(torch.bfloat16)},
        "synthetic N(0,0.02) fp32, 8 Mi elems": {"w": torch.randn(1 << 23, generator=g) * 0.02},
    }
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, obj in inputs.items():
            rows.append(measure(name, obj, args.repeat, Path(d)))
            print(json.dumps(rows[-1]), flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    meta = {
        "date": dt.date.today().isoformat(),
        "device": f"{cpu}, {os.cpu_count()} cores (CPU only)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "s4weights": s4w_core.__version__,
        "threads": torch.get_num_threads(),
        "numba_transform": jit,
        "repeat": args.repeat,
        "command": "python benchmarks/bench_cpu.py " + " ".join(sys.argv[1:]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cpu{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# CPU benchmark, {meta['date']}",
        "",
        f"Device: {meta['device']}; Python {meta['python']}, torch {meta['torch']}, s4weights {meta['s4weights']}; "
        f"plane transform: {'numba' if jit else 'numpy'}.",
        f"Command: `{meta['command']}`; medians of {args.repeat} runs; ratio = raw tensor bytes / file bytes.",
        "",
        "| input | raw MiB | s4w ratio | zstd-3 ratio | s4w save MiB/s | s4w load MiB/s | torch.save s | s4w save s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['input']} | {r['raw_MiB']} | {r['s4w_ratio']} | {r['zstd3_ratio']} | {r['s4w_save_MiB_s']} | "
            f"{r['s4w_load_MiB_s']} | {r['torch_save_s']} | {r['s4w_save_s']} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.md / .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bytes on disk of a CheckpointStore with default options on a real fine-tune series, against
the XOR + zstd byte-planes baseline and z4ai's XOR chain on the same snapshots.

Data: the MiniLM fine-tune series of :mod:`bench_ratio` (``_train_minilm.cached_series``: 5
snapshots of weights, ``exp_avg`` and ``exp_avg_sq``, bf16 and fp32; cached under ``--cache``).

* ``store``: ``CheckpointStore(dir)`` with default options (the portable profile on a CPU
  machine), each snapshot saved as one step; bytes = every file the store leaves in ``dir``
  (data objects, commit records), after its background re-encodings finished; every step is
  loaded back and compared bit for bit.
* ``xor+zstd planes``: per tensor, the first snapshot's byte planes each zstd-compressed (level 3,
  one frame per plane); each later snapshot XORed with the one before, then the same.
* ``z4ai chain``: per tensor, the first snapshot ``z4ai.compress``; each later one the smaller of
  ``z4ai.compress`` and ``z4ai.compress_delta`` against the one before (as :mod:`bench_ratio`).

Ratio = raw bytes of all snapshots / stored bytes.  Usage::

    python benchmarks/bench_store_series.py [--precision bf16,fp32] [--cache /tmp/s4w_ratio_series]
        [--out benchmarks/results/store_series]   # writes store_series.md and .json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from importlib import metadata
from typing import Any

import torch
import zstandard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import _train_minilm  # noqa: E402
from bench_ratio import z4ai_size  # noqa: E402

from s4w_core import CheckpointStore  # noqa: E402
from s4w_core.planes import split_planes  # noqa: E402

GROUPS = ("weights", "exp_avg", "exp_avg_sq")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def xor_zstd_size(t: torch.Tensor, base: torch.Tensor | None, cctx: zstandard.ZstdCompressor) -> int:
    x = _u8(t) if base is None else _u8(t) ^ _u8(base)
    planes = split_planes(x, t.dtype, rot=False)  # (width, n): byte k of every element in row k
    return sum(len(cctx.compress(p.numpy().tobytes())) for p in planes)


def _tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def measure(precision: str, cache: str, model_dir: str | None) -> dict[str, Any]:
    snaps = _train_minilm.cached_series(precision, cache, path=model_dir)
    raw = sum(t.numel() * t.element_size() for _, g in snaps for k in GROUPS for t in g[k].values())
    cctx = zstandard.ZstdCompressor(level=3)
    xz = z4 = 0
    prev: dict[str, dict[str, torch.Tensor]] | None = None
    t0 = time.perf_counter()
    for _, g in snaps:
        for k in GROUPS:
            for name, t in g[k].items():
                b = prev[k].get(name) if prev is not None else None
                xz += xor_zstd_size(t, b, cctx)
                plain = z4ai_size(t, None)
                z4 += plain if b is None else min(plain, z4ai_size(t, b))
        prev = g
    peers_s = time.perf_counter() - t0
    work = tempfile.mkdtemp(prefix=f"s4w-store-series-{precision}-")
    try:
        root = os.path.join(work, "store")
        st = CheckpointStore(root)
        t0 = time.perf_counter()
        for step, g in snaps:
            st.save({k: g[k] for k in GROUPS}, step=step)
        st.wait()
        save_s = time.perf_counter() - t0
        kinds = {r.step: r.kind for r in st.list()}
        st.close()
        disk = _tree_bytes(root)
        check = CheckpointStore(root)
        exact = True
        for step, g in snaps:
            got = check.load(step)
            exact = exact and all(torch.equal(_u8(got[k][n]), _u8(t)) for k in GROUPS for n, t in g[k].items())
        check.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "precision": precision,
        "snapshots": len(snaps),
        "raw_bytes": raw,
        "store_bytes": disk,
        "store_kinds": kinds,
        "store_bit_exact": exact,
        "store_save_s": round(save_s, 2),
        "xor_zstd_planes_bytes": xz,
        "z4ai_chain_bytes": z4,
        "peers_s": round(peers_s, 2),
        "ratio": {
            "store": round(raw / disk, 4),
            "xor+zstd planes": round(raw / xz, 4),
            "z4ai chain": round(raw / z4, 4),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="bf16,fp32")
    ap.add_argument("--cache", default="/tmp/s4w_ratio_series")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    res = [measure(p, a.cache, a.model_dir) for p in a.precision.split(",")]
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "z4ai": metadata.version("z4ai"),
        "zstandard": zstandard.__version__,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    lines = [
        "# Store bytes on disk vs. XOR + zstd planes and z4ai's XOR chain (MiniLM fine-tune series)",
        "",
        "Made by `python benchmarks/bench_store_series.py --out benchmarks/results/store_series` (see its docstring).",
        "Ratio = raw bytes of the 5 snapshots / bytes stored; the store's bytes are every file it leaves.",
        "",
        *[f"- {k}: {v}" for k, v in meta.items()],
        "",
        "| precision | store (default options) | XOR + zstd planes | z4ai XOR chain | store kinds by step | store bit-exact |",
        "|---|---|---|---|---|---|",
    ]
    for r in res:
        q = r["ratio"]
        kinds = ", ".join(f"{s}: {k}" for s, k in sorted(r["store_kinds"].items()))
        lines.append(
            f"| {r['precision']} | **{q['store']:.3f}** | {q['xor+zstd planes']:.3f} | {q['z4ai chain']:.3f} | {kinds} | {r['store_bit_exact']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".md", "w") as f:
            f.write(text)
        with open(a.out + ".json", "w") as f:
            json.dump({"meta": meta, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()

"""Warm load of a run's newest step on the CPU: ``dcp.load`` through ``S4StorageReader(root)`` vs
DCP's ``FileSystemReader`` over the same state, both with the files in the page cache (each load
done once before it is timed).  One process (``no_dist``); the fixed costs per storage (pools,
manifest, records, copies) show with many small tensors.

    python benchmarks/bench_dcp_warm.py                       # a GPT-like training state
    python benchmarks/bench_dcp_warm.py --small 400           # 400 tensors of 8 KiB (bf16)
    python benchmarks/bench_dcp_warm.py --profile             # cProfile of one S4StorageReader load

Prints one line per reader: the best and median of ``--reps`` loads, and the speed-up.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from s4w_core.dcp import S4StorageReader, S4StorageWriter, close_rank_stores, wait_rank_stores


def shapes(a: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    if a.small:
        return {f"t{i}": (4096,) for i in range(a.small)}
    d, out = a.d, {}
    for i in range(a.layers):
        for name, shape in (("ln1", (d,)), ("qkv", (3 * d, d)), ("qkv_b", (3 * d,)), ("proj", (d, d)),
                            ("ln2", (d,)), ("fc", (4 * d, d)), ("fc_b", (4 * d,)), ("out", (d, 4 * d))):  # fmt: skip
            out[f"h{i}.{name}"] = shape
    return out


def state(a: argparse.Namespace, step: int) -> dict[str, Any]:
    """bf16 weights and fp32 AdamW moments; ``step`` moves every value a little (as training does)."""
    g = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    for k, s in shapes(a).items():
        w = torch.randn(s, generator=g) * 0.02
        m = torch.randn(s, generator=g) * 1e-4
        move = torch.randn(s, generator=torch.Generator().manual_seed(step)) * 1e-4 * step
        model[k] = (w + move).bfloat16()
        optim[f"{k}.exp_avg"] = m + move * 0.1
        optim[f"{k}.exp_avg_sq"] = m * m + move * move
    return {"model": model} if a.small else {"model": model, "optim": optim}


def empty_like(st: Any) -> Any:
    if isinstance(st, dict):
        return {k: empty_like(v) for k, v in st.items()}
    return torch.empty_like(st)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--small", type=int, default=0, help="this many 8 KiB bf16 tensors instead")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="s4w-dcp-warm-")
    root, folder = f"{work}/run", f"{work}/fs"
    try:
        for s in (1, 2):
            dcp.save(state(a, s), storage_writer=S4StorageWriter(root, step=s), no_dist=True)
        newest = state(a, 2)
        dcp.save(newest, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
        wait_rank_stores(root)
        close_rank_stores(root)  # a load as after a restart: no store object kept from the saves

        def s4() -> Any:
            t = empty_like(newest)
            dcp.load(t, storage_reader=S4StorageReader(root), no_dist=True)
            return t

        def fs() -> Any:
            t = empty_like(newest)
            dcp.load(t, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
            return t

        got = s4()
        assert all(torch.equal(got[g][k], newest[g][k]) for g in newest for k in newest[g]), "not bit-exact"
        fs()
        times: dict[str, list[float]] = {"S4StorageReader": [], "FileSystemReader": []}
        for _ in range(a.reps):
            for name, fn in (("S4StorageReader", s4), ("FileSystemReader", fs)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        n = sum(t.numel() * t.element_size() for g in newest.values() for t in g.values())
        print(f"{len(shapes(a))} tensors per group, {n / 1e6:.1f} MB, warm, best / median of {a.reps}:")
        for name, ts in times.items():
            print(f"  {name:17s} {min(ts):.4f} / {statistics.median(ts):.4f} s")
        print(f"  speed-up (FileSystemReader / S4StorageReader, medians): "
              f"{statistics.median(times['FileSystemReader']) / statistics.median(times['S4StorageReader']):.2f}x")  # fmt: skip
        if a.profile:
            pr = cProfile.Profile()
            pr.enable()
            s4()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    finally:
        close_rank_stores(root)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The fixed cost per tensor of a save on the CPU: the delta-op choice, before and after batching.

Three figures, in CPU seconds of the calling thread (``time.thread_time``: steady on a shared machine;
the best of ``--repeats``):

1. ``choose``: :func:`s4w_core.engine.choose_delta_op` per storage by size (bf16 and fp32, a weight
   after a small update), against the estimator it replaced (kept below as ``old_choose``: planes
   split per candidate op, one numpy entropy per plane), and :func:`engine.choose_delta_ops`
   (the whole batch at once, what the writers call) per storage.
2. ``state``: the same on every storage of a real training state (a 0.5 M-parameter GPT trained a
   few steps, bf16 weights + AdamW state, as in the Lightning run of issue #23): ms per storage
   for one-by-one old, one-by-one new, batched new; and whether every choice agrees.
3. ``save``: saves of that state into a :class:`~s4w_core.CheckpointStore`, alternating between two
   states a few training steps apart, CPU ms per tensor (all threads, ``time.process_time``): the
   save itself (the new step coded whole: what the caller waits for), and the save with the
   re-encoding it starts behind it (the step below re-coded as a delta against the new one, on
   the store's worker: :meth:`~s4w_core.CheckpointStore.wait`), the whole cost of a save; and
   the stored bytes of the two steps left (the choices' quality).
4. ``fixed``: the same for 1000 tensors of 64 bf16 elements each: the fixed cost per tensor of a
   save, everything included (target of issue #23: <= 0.2 ms on a CPU).

    python benchmarks/bench_tensor_cost.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from s4w_core import CheckpointStore, engine  # noqa: E402
from s4w_core.codecs.chunk import entropy_ratio  # noqa: E402


def old_choose(job: engine.StorageJob, transform: str) -> str | None:
    """The estimator before batching (engine.choose_delta_op one storage at a time), for the comparison."""
    w = 1 if transform == "bytes" else job.dtype.itemsize
    ranges = engine.delta_sample_ranges(job.raw.numel() // w)
    if not ranges:
        return None
    raw = torch.cat([job.raw[a * w : b * w] for a, b in ranges])
    base = torch.cat([job.base[a * w : b * w] for a, b in ranges])  # type: ignore[index]

    def est(planes: torch.Tensor) -> float:
        arr = planes.numpy()
        return sum(arr.shape[1] / entropy_ratio(arr[j]) for j in range(arr.shape[0]))

    best: str | None = None
    best_cost = est(engine.planes_of(raw, job.dtype, transform, None))
    limit = (1.0 - engine.DELTA_MIN_GAIN) * best_cost
    for op in engine.delta.ops_for(job.dtype, transform):
        c = est(engine.planes_of(raw, job.dtype, transform, base, op))
        if c < limit and c < best_cost:
            best, best_cost = op, c
    return best


def best_of(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.thread_time() - t) / inner)
    return best


def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}/{k}"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    res: dict[str, Any] = {"choose": [], "state": {}, "save": {}}

    print("1. choose_delta_op per storage (ms): old one-by-one | new one-by-one | new batched (per storage)")
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        for n in (64, 1024, 16384, 65536, 262144, 1 << 20):
            x = torch.randn(n, generator=g).to(dt)
            b = (x.float() + 1e-3 * torch.randn(n, generator=g)).to(dt)
            jobs = [engine.StorageJob(x.view(torch.uint8), dt, "p", "cpu", b.view(torch.uint8), {}) for _ in range(16)]
            j0 = jobs[0]
            t_old = best_of(lambda j0=j0: old_choose(j0, "planes-rotl1"), a.repeats, 4)  # type: ignore[misc]
            t_new = best_of(lambda j0=j0: engine.choose_delta_op(j0, "planes-rotl1"), a.repeats, 4)  # type: ignore[misc]

            def batched(jobs: list[engine.StorageJob] = jobs) -> None:
                for j in jobs:
                    j.delta_choice = None
                engine.choose_delta_ops(jobs)

            t_bat = best_of(batched, a.repeats) / len(jobs)
            row = {
                "dtype": str(dt).removeprefix("torch."),
                "elems": n,
                "old_ms": t_old * 1e3,
                "new_ms": t_new * 1e3,
                "batched_ms": t_bat * 1e3,
            }
            res["choose"].append(row)
            print(f"  {row['dtype']:>8} {n:>8}: {row['old_ms']:8.3f} | {row['new_ms']:8.3f} | {row['batched_ms']:8.3f}")

    from _train_gpt import Trainer

    tr = Trainer("bf16", 20, layers=4, d=96, ctx=64, batch=4)
    for _ in range(3):
        tr.step()
    s0 = {k: v.detach().clone() for k, v in flat(tr.state()).items()}
    for _ in range(3):
        tr.step()
    s1 = {k: v.detach().clone() for k, v in flat(tr.state()).items()}
    nparams = sum(p.numel() for p in tr.model.parameters())
    jobs = [
        engine.StorageJob(v.reshape(-1).view(torch.uint8), v.dtype, k, "cpu", s0[k].reshape(-1).view(torch.uint8), {})
        for k, v in s1.items()
        if v.numel() and v.dtype.is_floating_point
    ]
    trs = [engine.transform_for(j.dtype, j.raw.numel())[0] for j in jobs]
    old = [old_choose(j, t) for j, t in zip(jobs, trs)]
    t_old = best_of(lambda: [old_choose(j, t) for j, t in zip(jobs, trs)], a.repeats)
    t_new = best_of(lambda: [engine.choose_delta_op(j, t, engine.delta.OPS) for j, t in zip(jobs, trs)], a.repeats)

    def batched_state() -> list[str | None]:
        for j in jobs:
            j.delta_choice = None
        return engine.choose_delta_ops(jobs)

    t_bat = best_of(batched_state, a.repeats)
    new = batched_state()
    res["state"] = {
        "params": nparams,
        "storages": len(jobs),
        "old_ms_per_storage": t_old / len(jobs) * 1e3,
        "new_ms_per_storage": t_new / len(jobs) * 1e3,
        "batched_ms_per_storage": t_bat / len(jobs) * 1e3,
        "same_choices": old == new,
        "choices": {str(k): new.count(k) for k in set(new)},
    }
    st = res["state"]
    print(
        f"2. a {nparams / 1e6:.2f} M-parameter bf16 GPT + AdamW, {len(jobs)} float storages: ms per storage "
        f"old {st['old_ms_per_storage']:.3f}, new one-by-one {st['new_ms_per_storage']:.3f}, batched "
        f"{st['batched_ms_per_storage']:.3f}; same choices: {st['same_choices']} {st['choices']}"
    )

    tiny0 = {f"t{i}": torch.randn(64, generator=g).to(torch.bfloat16) for i in range(1000)}
    tiny1 = {k: (v.float() * (1 + 1e-3 * torch.randn(64, generator=g))).to(torch.bfloat16) for k, v in tiny0.items()}
    res["save"] = save_costs(s0, s1, a.repeats)
    res["fixed"] = save_costs(tiny0, tiny1, a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def save_costs(s0: dict[str, torch.Tensor], s1: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, chooser in (("old", old_choose), ("new", None)):
        with tempfile.TemporaryDirectory() as d:
            orig_ops, orig_one = engine.choose_delta_ops, engine.choose_delta_op
            if chooser is not None:  # every storage estimated one by one, the old way
                engine.choose_delta_ops = lambda jobs, transforms=None, **kw: [None] * len(list(jobs))  # type: ignore[assignment]
                engine.choose_delta_op = lambda job, transform, ops=None: old_choose(job, transform)  # type: ignore[assignment]
            try:
                store = CheckpointStore(d, keep_last=2)
                store.save(s0, step=0)
                store.wait()
                saves, totals, walls = [], [], []
                for k in range(repeats):
                    state = s1 if k % 2 == 0 else s0  # each step differs from the one below it
                    t, w = time.process_time(), time.perf_counter()  # CPU: every thread's
                    store.save(state, step=k + 1)
                    saves.append(time.process_time() - t)
                    walls.append(time.perf_counter() - w)
                    store.wait()  # the step below re-encoded against this one
                    totals.append(time.process_time() - t)
                store.close()
                size = sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(d) for f in fs)
            finally:
                engine.choose_delta_ops, engine.choose_delta_op = orig_ops, orig_one
        n = len(s1)
        out[label] = {
            "ms_per_tensor": min(totals) / n * 1e3,
            "save_ms_per_tensor": min(saves) / n * 1e3,
            "wall_ms_per_tensor": min(walls) / n * 1e3,
            "store_bytes": size,
            "tensors": n,
        }
        print(
            f"{'3' if n < 1000 else '4'}. [{label} chooser] save of {n} tensors: {min(totals) * 1e3:.1f} ms CPU with "
            f"its re-encoding, {min(totals) / n * 1e3:.3f} ms per tensor (the save alone {min(saves) / n * 1e3:.3f} CPU, "
            f"{min(walls) / n * 1e3:.3f} wall); store {size:,} bytes"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())

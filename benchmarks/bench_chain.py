"""Checkpoint-chain benchmark: stored vs raw bytes of a real training run's checkpoint chain.

A GPT-style byte-level model (benchmarks/_train_gpt.py) is trained on real text (the Python
standard library's sources) with AdamW, and a checkpoint ``{"model", "optimizer", "step"}`` is
saved every ``--every`` steps, in two precision variants:

* ``bf16``: weights and AdamW state in bfloat16;
* ``fp32``: fp32 master weights + fp32 AdamW state (bf16 autocast on CUDA).

Each checkpoint is written, as training produces it, to several stores side by side:

* ``chain``     : CheckpointStore with its default layout: each save writes its step whole and
  the step below becomes a delta against it (a reverse delta; every op: xor, sub), a whole step
  at least every ``-K`` steps;
* ``chain_xor`` : the same with XOR deltas only (the baseline of issue 3 / FACTS.md);
* ``plain``     : CheckpointStore without deltas (each checkpoint coded alone);
* ``zipnn``     : ZipNN (bytearray_dtype per tensor) on each tensor of each checkpoint.

Reported per variant and per tensor group (weights / exp_avg / exp_avg_sq): raw bytes / stored
bytes over the whole chain as the store holds it once its re-encodings are done (its commit
records, summed); per step, the kind and size the step ends with and the save seconds; restore
seconds by chain depth; a bit-exact check of every step read back (xxh3 of each tensor); and the
load of the newest step (one object) and of the step ``--back`` saves before it, against
``torch.load`` of the newest state from the same disk, each with the files' pages dropped from
the page cache first (``posix_fadvise(DONTNEED)`` after a ``sync``: ``_pagecache.evict``; ``--no-drop`` keeps them).

Usage (CPU, small)::

    PYTHONPATH=. python benchmarks/bench_chain.py --steps 300 --every 10 --out benchmarks/results/chain_cpu.json

On a GPU (the issue's benchmark)::

    PYTHONPATH=. python benchmarks/bench_chain.py --device cuda --profile fast --layers 12 --d 768 \\
        --ctx 512 --batch 16 --steps 400 --every 10 --out benchmarks/results/chain_h100.json

``--snapshots DIR`` reads ``DIR/{bf16,fp32}/step_*.pt`` (torch.save'd states) instead of
training, e.g. to re-run the coding part on the same checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import glob
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Iterator

import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _pagecache import evict  # noqa: E402

import s4w_core  # noqa: E402
from s4w_core import delta as delta_mod  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402

GROUPS = ("weights", "exp_avg", "exp_avg_sq")


def _group(path: str) -> str:
    last = path.split("/")[-1]
    if last in ("exp_avg", "exp_avg_sq"):
        return last
    if path.startswith("model/"):
        return "weights"
    return "other"


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def _digest(state: Any) -> dict[str, str]:
    return {p: xxhash.xxh3_64_hexdigest(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()) for p, t in _tensors(state)}


@contextlib.contextmanager
def _xor_only() -> Iterator[None]:
    orig = delta_mod.ops_for
    delta_mod.ops_for = lambda dtype, transform: ("xor",)  # type: ignore[assignment]
    try:
        yield
    finally:
        delta_mod.ops_for = orig  # type: ignore[assignment]


def _zipnn_sizes(state: Any) -> dict[str, list[int]]:
    import zipnn

    out: dict[str, list[int]] = {}
    coders: dict[str, Any] = {}
    for p, t in _tensors(state):
        g = _group(p)
        b = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}.get(t.dtype)
        if name is None or len(b) < 64:
            stored = len(b)
        else:
            z = coders.setdefault(name, zipnn.ZipNN(input_format="byte", bytearray_dtype=name))
            stored = len(z.compress(b))
        r = out.setdefault(g, [0, 0])
        r[0] += len(b)
        r[1] += stored
    return out


def _snapshots(variant: str, args: argparse.Namespace) -> Iterator[tuple[int, Any]]:
    if args.snapshots:
        files = sorted(glob.glob(os.path.join(args.snapshots, variant, "step_*.pt")))
        if not files:
            raise SystemExit(f"no snapshots under {args.snapshots}/{variant}")
        for f in files[: args.max_saves or None]:
            st = torch.load(f, weights_only=False)
            yield int(st["step"]), st
        return
    from _train_gpt import train

    n = 0
    for step, st in train(
        variant, args.steps, args.every, device=args.device, layers=args.layers, d=args.d, ctx=args.ctx,
        batch=args.batch, lr=args.lr, log_every=args.log_every,
    ):
        if args.profile == "fast":  # the GPU codec codes device tensors
            st = _to(st, args.device)
        yield step, st
        n += 1
        if args.max_saves and n >= args.max_saves:
            return


def _to(obj: Any, dev: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, dict):
        return {k: _to(v, dev) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, dev) for v in obj)
    return obj


def _ratio(raw: int, stored: int) -> float:
    return round(raw / stored, 4) if stored else 0.0


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"s4w-chain-{variant}-", dir=args.workdir)
    names = ["chain"] + [n for n in ("chain_xor", "plain") if n in args.compare]
    stores = {
        "chain": CheckpointStore(os.path.join(work, "chain"), keyframe_every=args.keyframe_every, profile=args.profile),
        "chain_xor": CheckpointStore(os.path.join(work, "xor"), keyframe_every=args.keyframe_every, profile=args.profile),
        "plain": CheckpointStore(os.path.join(work, "plain"), delta=False, profile=args.profile),
    }
    rows: list[dict[str, Any]] = []
    digests: dict[int, dict[str, str]] = {}
    totals: dict[str, dict[str, list[int]]] = {n: {} for n in [*names, "zipnn"]}
    t_train = time.perf_counter()
    t_code = 0.0
    last_state: Any = None
    try:
        for step, state in _snapshots(variant, args):
            t0 = time.perf_counter()
            row: dict[str, Any] = {"step": step}
            digests[step] = _digest(state)
            for name in names:
                cm = _xor_only() if name == "chain_xor" else contextlib.nullcontext()
                with cm:
                    t = time.perf_counter()
                    info = stores[name].save(state, step)
                    secs = time.perf_counter() - t
                    # the re-encoding of the step below, behind the save: under the same delta ops,
                    # and not beside the next store's save
                    stores[name].wait()
                row[name] = {
                    "written": info.kind,
                    "raw_bytes": info.raw_bytes,
                    "written_bytes": info.object_bytes,
                    "save_s": round(secs, 3),
                }
            if "zipnn" in args.compare:
                zs = _zipnn_sizes(state)
                row["zipnn"] = {k: {"raw": v[0], "stored": v[1]} for k, v in zs.items()}
                for k, v in zs.items():
                    acc = totals["zipnn"].setdefault(k, [0, 0])
                    acc[0] += v[0]
                    acc[1] += v[1]
                    a = totals["zipnn"].setdefault("_all", [0, 0])
                    a[0] += v[0]
                    a[1] += v[1]
            rows.append(row)
            t_code += time.perf_counter() - t0
            c = row["chain"]
            print(
                f"  [{variant}] step {step:>6}: chain {c['written']:<8} {_ratio(c['raw_bytes'], c['written_bytes']):.3f}x "
                f"written ({c['save_s']:.2f}s)",
                file=sys.stderr,
                flush=True,
            )
            last_state = state
            del state
        # what the stores hold once the re-encodings behind the saves are done
        for name in names:
            stores[name].wait()
            for r in stores[name].list():
                row = next(x for x in rows if x["step"] == r.step)
                row[name].update(
                    kind=r.kind, depth=r.depth, stored_bytes=r.object_bytes, ratio=_ratio(r.raw_bytes, r.object_bytes),
                    delta_ops=r.delta_ops,
                    groups={k: {"raw": g["raw_bytes"], "stored": g["stored_bytes"]} for k, g in r.kinds.items()},
                )
                for k, g in r.kinds.items():
                    acc = totals[name].setdefault(_group_kind(k), [0, 0])
                    acc[0] += g["raw_bytes"]
                    acc[1] += g["stored_bytes"]
                tot = totals[name].setdefault("_all", [0, 0])
                tot[0] += r.raw_bytes
                tot[1] += r.object_bytes
            physical = stores[name].sizes()["physical_bytes"]
            totals[name]["_physical"] = [physical, physical]
            stores[name].close()
        wall = time.perf_counter() - t_train
        loads = _load_times(os.path.join(work, "chain"), last_state, work, args)
        del last_state
        # read every step back from the chain (a fresh store: no cached base) and compare bits
        reader = CheckpointStore(os.path.join(work, "chain"), base_cache_bytes=0)
        mismatches = []
        restore: dict[str, Any] = {}
        recs = {r.step: r for r in reader.list()}
        for step, want in digests.items():
            t = time.perf_counter()
            got = _digest(reader.load(step, map_location="cpu"))
            secs = time.perf_counter() - t
            if got != want:
                mismatches.append(step)
            r = recs[step]
            key = f"depth_{r.depth}"
            restore.setdefault(key, []).append(round(secs, 3))
        restore_summary = {k: {"n": len(v), "mean_s": round(sum(v) / len(v), 3), "max_s": max(v)} for k, v in sorted(restore.items())}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    def summary(name: str) -> dict[str, Any]:
        t = totals[name]
        d = {"all": {"raw_bytes": t.get("_all", [0, 0])[0], "stored_bytes": t.get("_all", [0, 0])[1],
                     "ratio": _ratio(*t.get("_all", [0, 1]))}}
        if "_physical" in t:  # every data object on disk (the records' objects and any leftover)
            d["all"]["physical_bytes"] = t["_physical"][0]
        for g in (*GROUPS, "other"):
            if g in t:
                d[g] = {"raw_bytes": t[g][0], "stored_bytes": t[g][1], "ratio": _ratio(*t[g])}
        return d

    return {
        "variant": variant,
        "saves": len(rows),
        "bit_exact": not mismatches,
        "mismatched_steps": mismatches,
        "seconds_total": round(wall, 1),
        "seconds_coding_and_compare": round(t_code, 1),
        "summary": {n: summary(n) for n in [*names, *(["zipnn"] if "zipnn" in args.compare else [])]},
        "restore_s_by_depth": restore_summary,
        "loads": loads,
        "steps": rows,
    }


def _timed(fn: Any, device: str) -> tuple[Any, float]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def _load_times(root: str, state: Any, work: str, args: argparse.Namespace) -> dict[str, Any]:
    """The newest step's load (a fresh store: one object) and the load of the step ``args.back``
    saves before it, against ``torch.load`` of the same state written to the same disk; each
    after dropping the files it reads from the page cache (unless ``--no-drop``)."""
    if state is None:
        return {}
    dev = args.device if args.profile == "fast" else "cpu"
    pt = os.path.join(work, "newest.pt")
    torch.save(state, pt)
    drop = not args.no_drop
    dropped = drop and evict(pt)
    _, torch_s = _timed(lambda: torch.load(pt, map_location=dev, weights_only=False), dev)
    store = CheckpointStore(root, base_cache_bytes=0)  # keeps no host copy: the load alone is timed
    recs = store.list()
    newest = recs[-1]
    back = recs[max(0, len(recs) - 1 - args.back)]
    if drop:
        evict(root)
    got, newest_s = _timed(lambda: store.load(newest.step, map_location=dev), dev)
    same = _digest(got) == _digest(state)
    del got
    if drop:
        evict(root)
    _, back_s = _timed(lambda: store.load(back.step, map_location=dev), dev)
    store.close()
    return {
        "device": dev,
        "raw_bytes": newest.raw_bytes,
        "torch_file_bytes": os.path.getsize(pt),
        "torch_load_s": round(torch_s, 4),
        "newest_s": round(newest_s, 4),
        "newest_bytes": newest.object_bytes,
        "newest_bit_exact": same,
        "newest_vs_torch": round(torch_s / newest_s, 3) if newest_s else None,
        "back": len(recs) - 1 - recs.index(back),
        "back_step": back.step,
        "back_depth": back.depth,
        "back_s": round(back_s, 4),
        "back_over_newest": round(back_s / newest_s, 3) if newest_s else None,
        "cache_dropped": bool(dropped),
    }


def _group_kind(k: str) -> str:
    return k if k in GROUPS else "other"


def _print_table(res: dict[str, Any]) -> None:
    print(f"\n== {res['variant']}: {res['saves']} saves, bit-exact: {res['bit_exact']} ==")
    cols = list(res["summary"])
    print(f"{'group':<12}" + "".join(f"{c:>12}" for c in cols))
    for g in ("all", *GROUPS):
        cells = []
        for c in cols:
            v = res["summary"][c].get(g)
            cells.append(f"{v['ratio']:>11.3f}x" if v else f"{'-':>12}")
        print(f"{g:<12}" + "".join(cells))
    print("restore seconds by chain depth: " + ", ".join(f"{k}: {v['mean_s']}s (max {v['max_s']}s, n={v['n']})" for k, v in res["restore_s_by_depth"].items()))
    ld = res["loads"]
    if ld:
        print(
            f"newest step load {ld['newest_s']} s vs torch.load {ld['torch_load_s']} s ({ld['newest_vs_torch']}x); "
            f"{ld['back']} saves back (depth {ld['back_depth']}) {ld['back_s']} s ({ld['back_over_newest']}x the newest); "
            f"page cache {'dropped' if ld['cache_dropped'] else 'kept'}"
        )
    ops: dict[str, int] = {}
    for r in res["steps"]:
        for k, n in r["chain"].get("delta_ops", {}).items():
            ops[k] = ops.get(k, 0) + n
    print(f"delta storages by op over the chain: {ops}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", default="portable", choices=["portable", "fast", "auto"])
    p.add_argument("--variants", default="bf16,fp32")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--max-saves", type=int, default=0, help="stop after this many saves (0: all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("-K", "--keyframe-every", type=int, default=10)
    p.add_argument("--compare", default="chain_xor,plain,zipnn", help="comma list of chain_xor, plain, zipnn")
    p.add_argument("--snapshots", default=None, help="read DIR/{variant}/step_*.pt instead of training")
    p.add_argument("--workdir", default=None, help="where the stores are written (default: $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the stores")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--back", type=int, default=5, help="also time the load of the step this many saves back")
    p.add_argument("--no-drop", action="store_true", help="do not drop the files from the page cache before loads")
    args = p.parse_args(argv)
    args.compare = [c for c in args.compare.split(",") if c]
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "s4weights": s4w_core.__version__,
        "python": platform.python_version(),
        "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
    }
    results = []
    for v in args.variants.split(","):
        res = run_variant(v, args)
        _print_table(res)
        results.append(res)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"\nresults written to {args.out}")
    return 0 if all(r["bit_exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

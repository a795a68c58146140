"""What keeping the loaded step as the next save's base costs a ``CheckpointStore`` load.

A load of the newest step also copies it to pinned host memory (the next save's delta base); the
pinned buffers are allocated on background threads while the step is read and decoded
(``_reserve_base``).  This diagnostic trains the GPT of ``_train_gpt.py`` a few steps, saves it
four times (keyframe + three deltas; the newest gets its keyframe copy), then loads the newest
step with the page cache dropped, interleaving:

* ``default``: the store as shipped;
* ``slabs2``: the background allocation cut into 2 slabs (2 threads) instead of 8;
* ``after``: no background allocation: the pinned buffers are allocated after the decode;
* ``no-base``: ``base_cache_bytes=0``: nothing is kept (the lower bound; the next save would then
  read its base back from the store).

Usage: python benchmarks/diag_load_base.py [--model medium] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _train_gpt import MODELS, Trainer  # noqa: E402
from bench_peers import evict  # noqa: E402

import s4w_core  # noqa: E402
from s4w_core import obs  # noqa: E402
from s4w_core.store import _async  # noqa: E402
from s4w_core.store import store as store_mod  # noqa: E402


def _load(root: str, variant: str, dev: torch.device, events: list[obs.OpEvent]) -> tuple[float, dict[str, float]]:
    slabs, reserve = _async._SLABS, store_mod.CheckpointStore._reserve_base  # noqa: SLF001
    opts: dict[str, Any] = {}
    if variant == "slabs2":
        _async._SLABS = 2  # noqa: SLF001
    elif variant == "after":
        store_mod.CheckpointStore._reserve_base = lambda self, m, loc: None  # type: ignore[method-assign]  # noqa: SLF001
    elif variant == "no-base":
        opts["base_cache_bytes"] = 0
    try:
        evict(root)
        events.clear()
        st = s4w_core.CheckpointStore(root, **opts)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = st.load(map_location=dev)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        del got
        st.close()  # untimed: frees the pinned base copy
    finally:
        _async._SLABS = slabs  # noqa: SLF001
        store_mod.CheckpointStore._reserve_base = reserve  # type: ignore[method-assign]  # noqa: SLF001
    ev = [e for e in events if e.op == "load"]
    return t, ({k: round(v, 4) for k, v in ev[-1].stages.items()} if ev else {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    tr = Trainer("bf16", args.steps, device="cuda", corpus_bytes=8 << 20, **MODELS[args.model])
    for _ in range(args.steps):
        tr.step()
    work = tempfile.mkdtemp(prefix="s4w-diag-load-", dir=args.dir)
    events: list[obs.OpEvent] = []
    obs.subscribe(events.append)
    try:
        root = os.path.join(work, "store")
        st = s4w_core.CheckpointStore(root)
        for i in range(4):
            if i:
                tr.step()
            st.save(tr.state(), step=i)
        st.close()
        rec = s4w_core.CheckpointStore(root).info()
        print(f"{torch.cuda.get_device_name()}: newest step {rec.step} ({rec.kind}, depth {rec.depth}), "
              f"keyframe copy {rec.copy_bytes / 1e9:.3f} GB", flush=True)
        variants = ["default", "slabs2", "after", "no-base"]
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.repeats):
            for v in variants:
                t, stages = _load(root, v, dev, events)
                times[v].append(t)
                print(f"  run {r} {v:<8} {t:.3f} s  stages {stages}", flush=True)
        for v in variants:
            print(f"{v:<8} median {statistics.median(times[v]):.3f} s  (all {[round(x, 3) for x in times[v]]})")
    finally:
        obs.unsubscribe(events.append)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

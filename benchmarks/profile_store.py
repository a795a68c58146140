"""Where the time of a ``CheckpointStore`` save, ``save_async`` and load goes, stage by stage.

Trains the GPT of ``_train_gpt.py`` a few steps (real text), then saves its live state with a
blocking store and an async store (one optimizer step between saves) and loads the newest step and
the keyframe back from a fresh store with the page cache dropped. It prints, per call, the stages
the store reports through :mod:`s4w_core.obs` and, for loads, wall seconds inside the internal
functions a load passes through (summed over threads, so they may exceed the call's time).

This is a diagnostic, not a peer comparison: ``bench_peers.py`` is the side-by-side table.

Usage: python benchmarks/profile_store.py [--model medium] [--variant bf16] [--saves 4] [--dir /tmp]
       [--json OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _train_gpt import MODELS, Trainer  # noqa: E402
from bench_peers import S3Server, evict  # noqa: E402

import s4w_core  # noqa: E402
from s4w_core import obs  # noqa: E402


class Timers:
    """Wall seconds and calls per wrapped function (thread-safe sums)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}

    def wrap(self, owner: Any, attr: str, label: str) -> Callable[[], None]:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                with self.lock:
                    self.s[label] = self.s.get(label, 0.0) + dt
                    self.n[label] = self.n.get(label, 0) + 1

        setattr(owner, attr, timed)
        return lambda: setattr(owner, attr, fn)

    @contextlib.contextmanager
    def active(self, targets: list[tuple[Any, str, str]]) -> Iterator[None]:
        undo = [self.wrap(o, a, lbl) for o, a, lbl in targets]
        try:
            yield
        finally:
            for u in reversed(undo):
                u()

    def report(self) -> dict[str, Any]:
        return {k: {"s": round(v, 4), "calls": self.n[k]} for k, v in sorted(self.s.items(), key=lambda kv: -kv[1])}


def _load_targets() -> list[tuple[Any, str, str]]:
    from s4w_core import api, checksum
    from s4w_core.format import container
    from s4w_core.store import chain, store

    out: list[tuple[Any, str, str]] = [
        (store.CheckpointStore, "_open", "store._open (container header+manifest)"),
        (chain.Chain, "open_all", "chain.open_all"),
        (chain.Chain, "prefetch", "chain.prefetch (bases)"),
        (store.CheckpointStore, "_remember", "store._remember (base cache copy)"),
        (api, "_decode_storages", "api._decode_storages (the step itself)"),
        (api, "_build_tensors", "api._build_tensors"),
        (container.ContainerReader, "read_chunk", "reader.read_chunk (I/O, all threads)"),
        (container.ContainerReader, "read_into", "reader.read_into (I/O, all threads)"),
        (checksum, "xxh3_hex", "xxh3 of chunks (all threads)"),
    ]
    try:
        from s4w_core.store import _s3

        out += [
            (_s3.S3Backend, "fetch", "S3Backend.fetch (HEAD, download started)"),
            (_s3.Download, "_wait", "S3 Download._wait (reads waiting for parts, all threads)"),
            (_s3.Download, "_one", "S3 Download._one (ranged GETs, all threads)"),
        ]
    except ImportError:
        pass
    try:
        from s4w_core.gpu import _decode

        out += [
            (_decode, "stage", "gpu.stage (read+check+pack, host)"),
            (_decode, "decode_device", "gpu.decode_device"),
            (_decode, "_decode_group", "gpu._decode_group (all)"),
        ]
    except ImportError:
        pass
    return out


def _save_targets() -> list[tuple[Any, str, str]]:
    from s4w_core.store import _async, store

    return [
        (store.CheckpointStore, "_make_cache", "store._make_cache (next base to host)"),
        (_async, "host_copies", "_async.host_copies (D2H to pinned)"),
        (_async.PinnedPool, "take", "PinnedPool.take (pinned allocation)"),
        (store.CheckpointStore, "_encode_into", "store._encode_into (encode+write)"),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", choices=sorted(MODELS))
    ap.add_argument("--variant", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--steps", type=int, default=20, help="training steps before the first save")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default=None)
    ap.add_argument("--s3", action="store_true", help="stores on SeaweedFS S3 (needs `weed`: S4W_WEED or PATH)")
    ap.add_argument("--modes", default="save,save_async", help="comma list of save, save_async")
    ap.add_argument("--profile", default="auto", choices=("auto", "fast", "portable"), help="the saving store's profile")
    ap.add_argument("--reserve", type=float, default=0.0,
                    help="call store.reserve(state) before the async saves, then sleep this many seconds")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tr = Trainer(args.variant, args.steps, device=str(dev), corpus_bytes=8 << 20, **MODELS[args.model])
    for _ in range(args.steps):
        tr.step()
    sd = tr.state()
    raw = sum(t.numel() * t.element_size() for t in _tensors(sd))
    print(f"device {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}), "
          f"{args.model}/{args.variant}, state {raw / 1e9:.3f} GB", flush=True)
    events: list[obs.OpEvent] = []
    obs.subscribe(events.append)
    result: dict[str, Any] = {"model": args.model, "variant": args.variant, "state_bytes": raw, "runs": {}}
    work = tempfile.mkdtemp(prefix="s4w-profile-", dir=args.dir)
    s3: S3Server | None = None
    if args.s3:
        weed = S3Server.find_weed()
        if weed is None:
            print("no `weed` (set S4W_WEED)")
            return 2
        s3 = S3Server(weed, work)
        s3.start()
    try:
        for mode in args.modes.split(","):
            root = s3.url(mode) if s3 is not None else os.path.join(work, mode)
            st = s4w_core.CheckpointStore(root, profile=args.profile)
            if args.reserve and mode == "save_async":
                st.reserve(tr.state())
                time.sleep(args.reserve)  # setup time before the first save
            rows = []
            for i in range(args.saves):
                if i:
                    tr.step()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                events.clear()
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                    base_mem = torch.cuda.memory_allocated(dev)
                timers = Timers()
                with timers.active(_save_targets()):
                    t0 = time.perf_counter()
                    if mode == "save":
                        st.save(tr.state(), step=i)
                        blocked = time.perf_counter() - t0
                    else:
                        h = st.save_async(tr.state(), i)
                        blocked = time.perf_counter() - t0
                        h.result()
                    total = time.perf_counter() - t0
                if mode == "save_async":
                    st.wait()
                extra_gpu = torch.cuda.max_memory_allocated(dev) - base_mem if dev.type == "cuda" else 0
                ev = [e for e in events if e.op == "save"]
                row = {
                    "extra_gpu_MiB": round(extra_gpu / 2**20, 1),
                    "i": i, "blocked_s": round(blocked, 4), "total_s": round(total, 4),
                    "stored_bytes": ev[-1].stored_bytes if ev else None,
                    "mode": ev[-1].mode if ev else None,
                    "stages": {k: round(v, 4) for k, v in (ev[-1].stages if ev else {}).items()},
                    "inside": timers.report(),
                }
                rows.append(row)
                print(f"[{mode}] save {i}: blocked {blocked:.3f}s total {total:.3f}s "
                      f"stored {row['stored_bytes']} extra GPU {row['extra_gpu_MiB']} MiB stages {row['stages']}",
                      flush=True)
                for k, v in row["inside"].items():
                    print(f"      {v['s']:8.3f}s {v['calls']:6d}x  {k}", flush=True)
            t0 = time.perf_counter()
            st.close()  # waits for the newest step's keyframe copy, written behind its save
            copies = [e for e in events if e.op == "keyframe_copy"]
            for e in copies:
                print(f"[{mode}] keyframe copy of step {e.step}: {e.extra.get('outcome')} in {e.total_s:.3f}s, "
                      f"{e.stored_bytes} bytes, stages {({k: round(v, 4) for k, v in e.stages.items()})} "
                      f"(close waited {time.perf_counter() - t0:.3f}s)", flush=True)
            loads = {}
            for which, step, from_copy in (
                ("newest", args.saves - 1, True),  # its keyframe copy when it has one
                ("newest-chain", args.saves - 1, False),  # the same step from its delta chain
                ("keyframe", 0, True),
            ):
                if s3 is not None:
                    s3.evict()
                else:
                    evict(root)
                timers = Timers()
                events.clear()
                with timers.active(_load_targets()):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    got = s4w_core.CheckpointStore(root).load(step, map_location=dev, from_copy=from_copy)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter() - t0
                del got
                ev = [e for e in events if e.op == "load"]
                loads[which] = {
                    "step": step, "s": round(t, 4),
                    "depth": ev[-1].extra.get("depth") if ev else None,
                    "from": ev[-1].extra.get("from") if ev else None,
                    "stages": {k: round(v, 4) for k, v in (ev[-1].stages if ev else {}).items()},
                    "inside": timers.report(),
                }
                print(f"[{mode}] load {which} (step {step}, depth {loads[which]['depth']}, "
                      f"from {loads[which]['from']}): {t:.3f}s "
                      f"stages {loads[which]['stages']}", flush=True)
                for k, v in loads[which]["inside"].items():
                    print(f"      {v['s']:8.3f}s {v['calls']:6d}x  {k}", flush=True)
            result["runs"][mode] = {"saves": rows, "loads": loads}
    finally:
        obs.unsubscribe(events.append)
        if s3 is not None:
            s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


if __name__ == "__main__":
    raise SystemExit(main())

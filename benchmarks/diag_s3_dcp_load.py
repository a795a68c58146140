"""Where a DCP load from S3 spends its time: ``S4StorageReader("s3://...")`` against
s3torchconnector's ``S3StorageReader``, with SeaweedFS on 127.0.0.1 (as ``bench_peers.py``).

Trains the GPT of ``_train_gpt.py`` a few steps, saves its state once with each writer (DCP +
``S4StorageWriter`` and DCP + ``S3StorageWriter``), then loads it back onto the GPU, SeaweedFS's
data dropped from the page cache before each load, interleaving:

* ``raw``: DCP + ``S3StorageReader`` (the raw framework path);
* ``s4w``: DCP + ``S4StorageReader`` as shipped (``S4W_S3_FETCH_THREADS`` / ``_PART`` defaults);
* ``s4w-tN-pM``: the same with N download threads of M MiB parts;
* ``s4w-client``: as shipped, its S3 client made before the timer (as the raw peer's is);

and prints each load's seconds and the stages of s4w's load event (``s4w_core.obs``).

Usage: python benchmarks/diag_s3_dcp_load.py [--model medium] [--repeats 3]
       [--variants raw,s4w,s4w-client,s4w-t16-p32,s4w-t8-p64,s4w-t4-p32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _train_gpt import MODELS, Trainer  # noqa: E402
from bench_peers import DCPS3, S4DCPS3, S3Server, _template  # noqa: E402

from s4w_core import obs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--profile", action="store_true", help="then one s4w load under cProfile (top 30 by cumulative time)")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run)")
    ap.add_argument("--variants", default="raw,s4w,s4w-client,s4w-t16-p32,s4w-t8-p64,s4w-t4-p32")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    weed = S3Server.find_weed()
    if weed is None:
        print("needs SeaweedFS's `weed` (S4W_WEED)")
        return 2
    import torch.distributed.checkpoint as dcp

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    tr = Trainer("bf16", args.steps, device=args.device, corpus_bytes=8 << 20, **MODELS[args.model])
    for _ in range(args.steps):
        tr.step()
    sd = tr.state()
    raw_bytes = sum(t.untyped_storage().nbytes() for t in tr._live())  # noqa: SLF001
    work = tempfile.mkdtemp(prefix="s4w-diag-s3-", dir=args.dir)
    srv = S3Server(weed, work)
    srv.start()
    ctx = types.SimpleNamespace(
        s3=srv, dev=dev, variant="bf16", workdir=work, raw_bytes=raw_bytes,
        args=types.SimpleNamespace(saves=1, no_evict=False),
    )
    events: list[obs.OpEvent] = []
    obs.subscribe(events.append)
    try:
        peers = {"raw": DCPS3(ctx, "dcp_s3"), "s4w": S4DCPS3(ctx, "s4w_dcp_s3")}  # type: ignore[arg-type]
        for name, p in peers.items():
            dcp.save(sd, storage_writer=p.writer(0), no_dist=True)
            print(f"{name}: saved {srv.prefix_bytes(p.loc(0)) / 1e9:.3f} GB", flush=True)
        variants = [v for v in args.variants.split(",") if v]
        times: dict[str, list[float]] = {v: [] for v in variants}
        env0 = {k: os.environ.get(k) for k in ("S4W_S3_FETCH_THREADS", "S4W_S3_FETCH_PART")}
        for r in range(args.repeats):
            for v in variants:
                p = peers["raw" if v == "raw" else "s4w"]
                if v.startswith("s4w-t"):
                    _, t, m = v.split("-")
                    os.environ["S4W_S3_FETCH_THREADS"] = t[1:]
                    os.environ["S4W_S3_FETCH_PART"] = str(int(m[1:]) << 20)
                target = _template(sd)
                rd = p.reader(0)
                if v == "s4w-client":
                    rd.folder._s3()  # noqa: SLF001
                srv.evict()
                events.clear()
                sync()
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=rd, no_dist=True)
                sync()
                took = time.perf_counter() - t0
                for k, x in env0.items():
                    if x is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = x
                times[v].append(took)
                ev = [e for e in events if e.op == "load"]
                stages = {k: round(x, 3) for k, x in ev[-1].stages.items()} if ev else {}
                print(f"  run {r} {v:<12} {took:.3f} s  {stages}", flush=True)
                del target, rd
        for v in variants:
            print(f"{v:<12} median {statistics.median(times[v]):.3f} s  (all {[round(x, 3) for x in times[v]]})")
        if args.profile:
            import cProfile
            import pstats

            target, rd = _template(sd), peers["s4w"].reader(0)
            srv.evict()
            prof = cProfile.Profile()
            prof.enable()
            dcp.load(target, storage_reader=rd, no_dist=True)
            sync()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        if "raw" in times:
            ref = statistics.median(times["raw"])
            print("raw / variant: " + "  ".join(
                f"{v} {ref / statistics.median(times[v]):.3f}x" for v in variants if v != "raw"
            ))
    finally:
        obs.unsubscribe(events.append)
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Plane-split / merge kernel throughput on the device, against a device-to-device copy ceiling.

Times (CUDA events, median of ``--repeats``) the batched split and merge kernels of
:mod:`s4w_core.planes.triton_kernels` over ~1 GB of bf16 and of fp32 in ``--tensors`` tensors,
without a delta and with each delta op, for every ``BLOCK x warps`` configuration of ``--configs``;
and a plain ``copy_`` of the same bytes (the memory-bandwidth ceiling: the kernels read and write
each byte once, like a copy; with a delta base they read it too).  Checks every configuration's
planes against the torch reference on a slice first.

    python benchmarks/bench_kernels.py --gb 1 --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from s4w_core import delta  # noqa: E402
from s4w_core.planes import reference as ref  # noqa: E402
from s4w_core.planes import triton_kernels as tk  # noqa: E402

GB = 1e9


def events(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def tensors(dtype: torch.dtype, total: float, count: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    el = torch.empty((), dtype=dtype).element_size()
    per = int(total / count / el) // 256 * 256 + 37  # not multiples of the block
    xs = [(torch.randn(per, device="cuda", generator=g) * 0.02).to(dtype) for _ in range(count)]
    bs = [(x.float() + torch.randn(per, device="cuda", generator=g) * 1e-4).to(dtype) for x in xs]
    return [x.view(torch.uint8).view(-1) for x in xs], [b.view(torch.uint8).view(-1) for b in bs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--configs",
        default="4096x4e,4096x4,4096x8,8192x4,8192x8,16384x8",
        help="BLOCKxWARPS[e]: elements per program x warps; a trailing 'e' forces the element-wise path",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "gb": a.gb,
        "tensors": a.tensors,
        "rows": [],
    }
    big = torch.empty(int(a.gb * GB), dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(big)
    t = events(lambda d=dst, b=big: d.copy_(b), a.repeats)
    res["copy_GBps"] = big.numel() / t / GB  # bytes of input per second (the kernels' unit)
    res["copy_rw_GBps"] = 2 * big.numel() / t / GB
    print(f"device-to-device copy: {res['copy_GBps']:.0f} GB/s of input ({res['copy_rw_GBps']:.0f} GB/s read+write)")
    # gather_copy: many 512 KiB chunks into one buffer, 16-byte slots (the reader places raw chunks with it;
    # the writer compacted with it until 93bcc27)
    from s4w_core.gpu.kernels import gather_copy

    nch, ln = int(a.gb * GB) // 2 // (1 << 19), 1 << 19
    so = [i * ln for i in range(nch)]
    do = [i * (ln + 16) for i in range(nch)]
    out = torch.empty(nch * (ln + 16), dtype=torch.uint8, device=dev)
    gather_copy(big, out, so, do, [ln] * nch, pad_ok=True)
    assert torch.equal(out[do[-1] : do[-1] + ln], big[so[-1] : so[-1] + ln])
    for cfg in ("1024x1x4", "2048x4x8", "4096x4x8", "2048x8x8", "8192x2x16"):
        wb, it, nwp = cfg.split("x")
        os.environ["S4W_GATHER_WORDS"], os.environ["S4W_GATHER_ITERS"], os.environ["S4W_GATHER_WARPS"] = wb, it, nwp
        out.zero_()
        gather_copy(big, out, so, do, [ln] * nch, pad_ok=True)
        assert torch.equal(out[do[-1] : do[-1] + ln], big[so[-1] : so[-1] + ln]), cfg
        tg = events(lambda b=big, o=out: gather_copy(b, o, so, do, [ln] * nch, pad_ok=True), a.repeats)
        res[f"gather_copy_GBps_{cfg}"] = nch * ln / tg / GB
        print(f"gather_copy {nch} x 512 KiB words x iters x warps {cfg}: {nch * ln / tg / GB:.0f} GB/s ({tg * 1e3:.3f} ms)")
    for k in ("S4W_GATHER_WORDS", "S4W_GATHER_ITERS", "S4W_GATHER_WARPS"):
        os.environ.pop(k)
    del big, dst, out
    for dtype in (torch.bfloat16, torch.float32):
        w = ref.plane_width(dtype)
        xs, bs = tensors(dtype, a.gb * GB, a.tensors, 1)
        raw = sum(x.numel() for x in xs)
        layout, off = [], 0
        for x in xs:
            n = x.numel() // w
            ps = -(-n // 256) * 256
            layout.append((off, ps))
            off += w * ps
        planes = torch.empty(off, dtype=torch.uint8, device=dev)
        outs = [torch.empty_like(x) for x in xs]
        for cfg in a.configs.split(","):
            blk, warps = cfg.rstrip("e").split("x")
            os.environ["S4W_PLANES_BLOCK"], os.environ["S4W_PLANES_WARPS"] = blk, warps
            os.environ["S4W_PLANES_WIDE"] = "0" if cfg.endswith("e") else "1"
            for op in (None, "xor", "sub"):
                pieces = [(x, b if op else None, o, ps, op or "xor") for x, b, (o, ps) in zip(xs, bs, layout)]
                tk.split_planes_batched(pieces, w, planes)
                # correctness on the first tensor (all of it) and the last one
                for k in (0, len(xs) - 1):
                    resid = delta.forward(op, xs[k], bs[k], dtype) if op else xs[k]
                    exp = ref.split_planes(resid.cpu(), dtype)
                    n = xs[k].numel() // w
                    o, ps = layout[k]
                    got = torch.stack([planes[o + j * ps : o + j * ps + n] for j in range(w)]).cpu()
                    assert torch.equal(got, exp), (cfg, op, k)
                ts = events(lambda p=pieces, w=w, b=planes: tk.split_planes_batched(p, w, b), a.repeats)
                mpieces = [(y, b if op else None, o, ps, op or "xor") for y, b, (o, ps) in zip(outs, bs, layout)]
                tk.merge_planes_batched(mpieces, w, planes)
                assert all(torch.equal(y, x) for y, x in zip(outs[:3], xs[:3])), (cfg, op, "merge")
                tm = events(lambda p=mpieces, w=w, b=planes: tk.merge_planes_batched(p, w, b), a.repeats)
                row = {
                    "dtype": str(dtype).split(".")[-1],
                    "config": cfg,
                    "op": op or "none",
                    "split_GBps": raw / ts / GB,
                    "merge_GBps": raw / tm / GB,
                    "split_ms": ts * 1e3,
                    "merge_ms": tm * 1e3,
                }
                res["rows"].append(row)
                print(
                    f"{row['dtype']:9s} {cfg:9s} {row['op']:4s} split {row['split_GBps']:7.0f} GB/s "
                    f"({row['split_ms']:.3f} ms)  merge {row['merge_GBps']:7.0f} GB/s ({row['merge_ms']:.3f} ms)",
                    flush=True,
                )
        del xs, bs, planes, outs
        torch.cuda.empty_cache()
    best: dict[str, Any] = {}
    for r in res["rows"]:
        k = f"{r['dtype']}/{r['op']}"
        score = r["split_GBps"] + r["merge_GBps"]
        if k not in best or score > best[k]["score"]:
            best[k] = {"config": r["config"], "score": score, "split_GBps": r["split_GBps"], "merge_GBps": r["merge_GBps"]}
    res["best"] = best
    for k, v in best.items():
        print(f"best {k}: {v['config']} split {v['split_GBps']:.0f} GB/s merge {v['merge_GBps']:.0f} GB/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

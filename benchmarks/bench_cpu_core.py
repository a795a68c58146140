"""CPU path per core: s4weights (portable profile) against ZipNN and zstd, one thread each.

Issue 5's CPU target: compression and decompression throughput *per core* at least ZipNN's on the
same machine and data, at a ratio at least ZipNN's.  Both run on one thread (``torch`` intra-op
threads 1, s4w ``threads=1``, ZipNN ``threads=1``, zstd single-threaded) on the tensors of a real
training state: a GPT (benchmarks/_train_gpt.py, "mini": 4 layers, d=256) trained ``--steps`` on
real text with AdamW, weights + exp_avg + exp_avg_sq, bf16 and fp32.  Every codec's output is
decoded and compared bit for bit; the peers run interleaved, one round after another, and times are
medians over ``--repeats`` rounds (after one warm-up round).

    python benchmarks/bench_cpu_core.py --planes --out benchmarks/results/cpu_core.json

``--planes`` adds a breakdown: where one thread's save and load spend their time, and per byte
plane the CPU writer's zstd frames against Huffman-only deflate (what it wrote before), and the
plane transform with numpy against numba. The s4w row
waits for the numba transform first (``s4weights[numba]``; loaded once per process), so it
measures the steady state; ``S4W_NUMBA=0`` measures numpy's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _train_gpt import MODELS, Trainer  # noqa: E402

import s4w_core  # noqa: E402

MB = 1e6


def med(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, st in state["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"opt.{pid}.{k}"] = st[k]
    return {k: v.detach().cpu().contiguous() for k, v in out.items() if v.is_floating_point() and v.numel() > 1}


def planes_breakdown(ts: dict[str, torch.Tensor], w: int, repeats: int) -> dict[str, Any]:
    """Per plane: the CPU writer's zstd frames (``PLANE_PARAMS``) against Huffman-only deflate (what
    it wrote before: zlib-ng encode, ISA-L decode); and the plane transform, numpy against numba."""
    from s4w_core.codecs import DEFLATE, ZSTD, zstd_encode_plane
    from s4w_core.planes import _jit
    from s4w_core.planes import reference as ref

    raws = [t.reshape(-1).view(torch.uint8).numpy() for t in ts.values() if t.numel() * t.element_size() % w == 0]
    total = sum(r.size for r in raws)
    out: dict[str, Any] = {}
    jit_state = os.environ.get("S4W_NUMBA")
    try:
        for name, env in (("numpy", "0"), ("numba", "1")):
            os.environ["S4W_NUMBA"] = env
            if env == "1" and not _jit.enabled():
                continue
            planes = [ref._split_np(r, w, None) for r in raws]
            dst = [np.empty(r.size, np.uint8) for r in raws]
            out[f"split_{name}_MBps"] = total / med(lambda: [ref._split_np(r, w, None) for r in raws], repeats) / MB
            out[f"merge_{name}_MBps"] = total / med(
                lambda planes=planes, dst=dst: [ref.merge_into(list(p), w, d) for p, d in zip(planes, dst)], repeats
            ) / MB
    finally:
        if jit_state is None:
            os.environ.pop("S4W_NUMBA", None)
        else:
            os.environ["S4W_NUMBA"] = jit_state
    assert DEFLATE.encode_cpu is not None
    for j in range(w):
        pj = [np.ascontiguousarray(p[j]) for p in planes]
        n = sum(x.size for x in pj)
        row: dict[str, Any] = {}
        for cname, enc, codec in (
            ("deflate_huffman_only", DEFLATE.encode_cpu, DEFLATE),
            ("zstd_plane_params", zstd_encode_plane, ZSTD),
        ):
            coded = [enc(memoryview(x)) for x in pj]
            te = med(lambda enc=enc, pj=pj: [enc(memoryview(x)) for x in pj], repeats)
            td = med(lambda codec=codec, coded=coded, pj=pj: [codec.decode(c, x.size) for c, x in zip(coded, pj)], repeats)
            row[cname] = {"ratio": n / sum(map(len, coded)), "enc_MBps": n / te / MB, "dec_MBps": n / td / MB}
        out[f"plane{j}"] = row
    return out


def stages(ts: dict[str, torch.Tensor], repeats: int) -> dict[str, dict[str, float]]:
    """Where one thread's save and load of ``ts`` spend their time (ms, the fastest of ``repeats``
    runs): the functions of the CPU path timed by wrapping them; "rest" is Python around them, the
    container writer and the output's memory."""
    import collections
    import functools

    from s4w_core import codecs, engine, jobs, pipeline

    acc: collections.Counter[str] = collections.Counter()
    undo: list[Callable[[], None]] = []

    def wrap(owner: Any, name: str, key: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def g(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0

        setattr(owner, name, g)
        undo.append(lambda: setattr(owner, name, f))

    wrap(engine, "encode_chunk", "chunk coder (zstd, deflate)")
    wrap(engine, "rowcol_choice", "row/column probe")
    wrap(engine, "nonzero_trial", "nonzero trial")
    wrap(jobs, "split_planes", "split")
    wrap(engine, "merge_into", "merge")
    wrap(engine, "merge_hash_into", "merge+xxh3 (fused, storages >= 1 MiB)")
    wrap(engine.ck, "tensor_checksum", "xxh3 tensor")
    wrap(engine.ck, "verify_tensor_checksum", "xxh3 tensor")
    wrap(pipeline, "validate_manifest", "validate manifest")
    for c in (codecs.ZSTD, codecs.RAW):
        dec = c.decode_cpu
        key = f"{c.id} decode"

        def timed_dec(d: Any, n: int, dec: Any = dec, key: str = key) -> Any:
            t0 = time.perf_counter()
            try:
                return dec(d, n)
            finally:
                acc[key] += time.perf_counter() - t0

        object.__setattr__(c, "decode_cpu", timed_dec)
        undo.append(lambda c=c, dec=dec: object.__setattr__(c, "decode_cpu", dec))
    buf = io.BytesIO()
    s4w_core.save(ts, buf, profile="portable", threads=1)
    data = buf.getvalue()
    out: dict[str, dict[str, float]] = {}
    try:
        for name, fn in (
            ("save", lambda: s4w_core.save(ts, io.BytesIO(), profile="portable", threads=1)),
            ("load", lambda: s4w_core.load(data, threads=1)),
        ):
            best: tuple[float, dict[str, float]] | None = None
            for _ in range(repeats):
                acc.clear()
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
                if best is None or t < best[0]:
                    best = (t, dict(acc))
            assert best is not None
            t, parts = best
            out[name] = {"total": t * 1e3, **{k: v * 1e3 for k, v in parts.items()}, "rest": (t - sum(parts.values())) * 1e3}
    finally:
        for u in reversed(undo):
            u()
    return out


def run(ts: dict[str, torch.Tensor], dtype: str, repeats: int) -> dict[str, Any]:
    """Every peer's encode and decode, interleaved: each round times s4w, ZipNN and zstd back to
    back, so that a slow spell of a shared machine hits all of them; speeds are medians over the
    rounds and the s4w/ZipNN ratios medians of the per-round ratios (the first round warms up)."""
    import zstandard

    raw = sum(t.numel() * t.element_size() for t in ts.values())
    res: dict[str, Any] = {"tensors": len(ts), "raw_bytes": raw}
    # name -> (prepare() -> encode callable, decode callable, stored bytes, bit-exact)
    peers: dict[str, tuple[Callable[[], Callable[[], Any]], Callable[[], Any], int, bool]] = {}

    buf = io.BytesIO()
    s4w_core.save(ts, buf, profile="portable", threads=1)
    data = buf.getvalue()
    back = s4w_core.load(data, threads=1)
    peers["s4w_portable"] = (
        lambda: lambda: s4w_core.save(ts, io.BytesIO(), profile="portable", threads=1),
        lambda: s4w_core.load(data, threads=1),
        len(data),
        all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in ts.items()),
    )
    try:
        import zipnn

        name = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
        z = zipnn.ZipNN(bytearray_dtype=name, input_format="torch", threads=1)
        zcomp = [z.compress(t.clone()) for t in ts.values()]  # ZipNN reorders its input in place

        def zprep() -> Callable[[], Any]:
            clones = [t.clone() for t in ts.values()]  # fresh inputs each round, cloned untimed
            return lambda: [z.compress(t) for t in clones]

        peers["zipnn"] = (
            zprep,
            lambda: [z.decompress(c) for c in zcomp],
            sum(map(len, zcomp)),
            all(
                torch.equal(z.decompress(c).contiguous().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
                for c, t in zip(zcomp, ts.values())
            ),
        )
        res["zipnn_version"] = getattr(zipnn, "__version__", None)
    except ImportError:
        res["zipnn"] = {"skipped": "zipnn not installed"}
    blobs = [t.view(torch.uint8).numpy().tobytes() for t in ts.values()]
    cz, dz = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    comp = [cz.compress(b) for b in blobs]
    peers["zstd3"] = (
        lambda: lambda: [cz.compress(b) for b in blobs],
        lambda: [dz.decompress(c) for c in comp],
        sum(map(len, comp)),
        all(dz.decompress(c) == b for c, b in zip(comp, blobs)),
    )
    times: dict[str, dict[str, list[float]]] = {k: {"enc": [], "dec": []} for k in peers}
    for _ in range(repeats + 1):
        for k, (prep, dec, _n, _ok) in peers.items():
            enc = prep()
            t0 = time.perf_counter()
            enc()
            t1 = time.perf_counter()
            dec()
            t2 = time.perf_counter()
            times[k]["enc"].append(t1 - t0)
            times[k]["dec"].append(t2 - t1)
    for k, (_p, _d, n, ok) in peers.items():
        res[k] = {
            "ratio": raw / n,
            "enc_MBps": raw / statistics.median(times[k]["enc"][1:]) / MB,
            "dec_MBps": raw / statistics.median(times[k]["dec"][1:]) / MB,
            "exact": ok,
        }
    if "zipnn" in peers:
        s, zz = times["s4w_portable"], times["zipnn"]
        res["vs_zipnn"] = {
            "enc": statistics.median(b / a for a, b in zip(s["enc"][1:], zz["enc"][1:])),
            "dec": statistics.median(b / a for a, b in zip(s["dec"][1:], zz["dec"][1:])),
            "ratio": res["s4w_portable"]["ratio"] / res["zipnn"]["ratio"],
        }
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mini", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="bf16,fp32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--planes", action="store_true", help="also break the CPU codec down per plane and transform")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from s4w_core.planes import _jit

    jit = _jit.enabled()  # wait for the compiled transform (loaded once per process, ~1.5 s): steady state
    result: dict[str, Any] = {
        "meta": {
            "date": dt.date.today().isoformat(),
            "host": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "s4weights": s4w_core.__version__,
            "model": a.model,
            "steps": a.steps,
            "threads": 1,
            "numba_transform": jit,
            "zstandard": __import__("zstandard").__version__,
        },
        "variants": {},
    }
    m = MODELS[a.model]
    for v in a.variants.split(","):
        tr = Trainer(v, a.steps, layers=m["layers"], d=m["d"], ctx=m["ctx"], batch=m["batch"])
        for _ in range(a.steps):
            tr.step()
        result["variants"][v] = r = run(tensors_of(tr.state()), v, a.repeats)
        print(f"== {v}: {r['tensors']} tensors, {r['raw_bytes'] / MB:.1f} MB, one thread each ==")
        for k in ("s4w_portable", "zipnn", "zstd3"):
            x = r.get(k, {})
            if "enc_MBps" in x:
                print(
                    f"  {k:13s} ratio {x['ratio']:.4f}  enc {x['enc_MBps']:7.1f} MB/s  dec {x['dec_MBps']:7.1f} MB/s"
                    f"  exact {x['exact']}"
                )
        if "vs_zipnn" in r:
            q = r["vs_zipnn"]
            print(
                f"  s4w / ZipNN per core (median of per-round ratios): encode {q['enc']:.2f}x  decode {q['dec']:.2f}x"
                f"  ratio {q['ratio']:.4f}x"
            )
        if a.planes:
            r["stages_ms"] = sg = stages(tensors_of(tr.state()), a.repeats)
            for name, parts in sg.items():
                print(f"  {name} stages, ms: " + ", ".join(f"{k} {x:.1f}" for k, x in parts.items()))
            w = 2 if v == "bf16" else 4
            r["planes"] = pb = planes_breakdown(tensors_of(tr.state()), w, a.repeats)
            print("  transform MB/s of raw: " + "  ".join(f"{k[:-5]} {x:.0f}" for k, x in pb.items() if k.endswith("_MBps")))
            for j in range(w):
                for cname, x in pb[f"plane{j}"].items():
                    print(
                        f"  plane {j} {cname:21s} ratio {x['ratio']:.3f}  enc {x['enc_MBps']:7.1f}  dec {x['dec_MBps']:7.1f} MB/s of plane"
                    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""s4weights vs. ZipNN, zstd and nvCOMP ANS on the same tensors: ratio, and throughput.

One process, one set of tensors (the float tensors of a checkpoint, as bf16 and/or fp32), every
codec side by side:

* ratio = raw tensor bytes / stored bytes (codec output only; s4weights' manifest is reported
  separately as ``file_ratio``), per tensor group;
* CPU (``--cpu``): s4weights portable save/load, ZipNN (torch input mode), zstd levels 3 and 19 on
  the raw bytes of each tensor; throughput in GB/s of raw bytes, median of ``--repeats`` wall times;
* GPU (``--gpu``): nvCOMP ANS alone (``'<f2'``/``'<f4'``, NATIVE bitstream, 64 KiB chunks, one batched
  call over all tensors), s4weights ``fast`` (nvCOMP ANS on byte planes) and ``portable`` written on
  the GPU; device throughput (tensors on the GPU to coded chunks on the GPU and back; what the
  later 500/700 GB/s goal is about) and end to end (``save`` to memory / ``load`` from memory incl.
  host copies, hashing and the manifest), median of ``--repeats`` after warm-up, CUDA events or
  synchronized wall clock as noted; ``--segs`` sweeps the fast profile's segment size.
  ``--weights synthetic:MB:N`` makes N weight-like tensors (throughput at scale; their ratio means nothing).

Usage::

    python benchmarks/bench_codec.py --weights model.safetensors --dtype bf16,fp32 --cpu --out r.json
    python benchmarks/bench_codec.py --weights minilm_bf16.s4w --dtype bf16 --gpu --segs 128,256,512 --out r.json
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that defines them)
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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import s4w_core  # noqa: E402

GB = 1e9


def load_tensors(path: str, dtype: str, subset: str | None) -> dict[str, torch.Tensor]:
    if path.startswith("synthetic:"):
        # synthetic:TOTAL_MB:NTENSORS -- weight-like N(0, 0.02) tensors (for throughput at scale only:
        # the ratio of synthetic data says nothing about real checkpoints)
        _, mb, nt = path.split(":")
        g = torch.Generator().manual_seed(0)
        elem = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
        per = int(mb) * 10**6 // int(nt) // elem
        return {
            f"t{i}": (torch.randn(per + 97 * (i % 7), generator=g) * 0.02).to(
                {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
            )
            for i in range(int(nt))
        }
    if path.endswith(".s4w"):
        sd = s4w_core.load(path, map_location="cpu")
    else:
        from safetensors.torch import load_file

        sd = load_file(path)
    out = {}
    for k, v in sd.items():
        if not v.is_floating_point() or (subset and not any(s in k for s in subset.split(","))):
            continue
        out[k] = v.to({"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]).contiguous()
    return out


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def cuda_time(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` with a device sync before and after each run (wall clock: the
    functions timed here synchronize internally when they read sizes back, so events between
    launches would not bracket them better)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def raw_bytes_of(ts: dict[str, torch.Tensor]) -> list[bytes]:
    return [t.view(-1).view(torch.uint8).numpy().tobytes() for t in ts.values()]


# ----------------------------------------------------------------------------- CPU
def bench_cpu(ts: dict[str, torch.Tensor], dtype: str, repeats: int, zstd19: bool) -> dict[str, Any]:
    raw = sum(t.numel() * t.element_size() for t in ts.values())
    res: dict[str, Any] = {}
    # s4weights portable, CPU writer and reader
    buf = io.BytesIO()
    rep = s4w_core.save(ts, buf, profile="portable")
    data = buf.getvalue()
    back = s4w_core.load(data)
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in ts.items())
    t_enc = median_time(lambda: s4w_core.save(ts, io.BytesIO(), profile="portable"), repeats, 1)
    t_dec = median_time(lambda: s4w_core.load(data), repeats, 1)
    res["s4w_portable_cpu"] = {
        "ratio": rep.ratio,
        "file_ratio": raw / len(data),
        "stored": rep.stored_bytes,
        "enc_GBps": raw / t_enc / GB,
        "dec_GBps": raw / t_dec / GB,
        "threads": min(8, os.cpu_count() or 1),
    }
    # ZipNN (torch input mode: its byte mode did not round-trip here, see results notes)
    try:
        import zipnn

        name = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[dtype]
        # ZipNN 0.5.4 compresses torch tensors in place (it reorders the input's bytes): give it clones.
        z = zipnn.ZipNN(bytearray_dtype=name, input_format="torch")
        comp = [z.compress(t.clone()) for t in ts.values()]
        for c, (k, t) in zip(comp, ts.items()):
            back = z.decompress(c)
            assert torch.equal(back.contiguous().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k

        def enc_only() -> float:
            clones = [t.clone() for t in ts.values()]
            t0 = time.perf_counter()
            for c in clones:
                z.compress(c)
            return time.perf_counter() - t0

        t_enc = statistics.median(enc_only() for _ in range(repeats))
        t_dec = median_time(lambda: [z.decompress(c) for c in comp], repeats, 1)
        res["zipnn"] = {
            "ratio": raw / sum(map(len, comp)),
            "stored": sum(map(len, comp)),
            "enc_GBps": raw / t_enc / GB,
            "dec_GBps": raw / t_dec / GB,
            "version": getattr(zipnn, "__version__", None) or _dist_version("zipnn"),
        }
    except ImportError:
        res["zipnn"] = {"skipped": "zipnn not installed"}
    # zstd on raw bytes
    try:
        import zstandard

        blobs = raw_bytes_of(ts)
        for level in (3, 19) if zstd19 else (3,):
            cz = zstandard.ZstdCompressor(level=level)
            comp = [cz.compress(b) for b in blobs]
            t_enc = median_time(lambda: [cz.compress(b) for b in blobs], 1 if level > 9 else repeats, 0)
            d = zstandard.ZstdDecompressor()
            t_dec = median_time(lambda: [d.decompress(c) for c in comp], repeats, 1)
            res[f"zstd{level}"] = {
                "ratio": raw / sum(map(len, comp)),
                "stored": sum(map(len, comp)),
                "enc_GBps": raw / t_enc / GB,
                "dec_GBps": raw / t_dec / GB,
                "version": zstandard.__version__,
            }
    except ImportError:
        res["zstd3"] = {"skipped": "zstandard not installed"}
    return res


def _dist_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- GPU
def bench_nvcomp_ans(ts_gpu: list[torch.Tensor], dtype: str, repeats: int) -> dict[str, Any]:
    from nvidia import nvcomp

    dt_str = {"bf16": "<f2", "fp16": "<f2", "fp32": "<f4"}[dtype]
    s = torch.cuda.Stream()
    raw = sum(t.numel() * t.element_size() for t in ts_gpu)
    # one aligned buffer holding every tensor (uint8 view: FACTS pitfall)
    offs, pos = [], 0
    for t in ts_gpu:
        offs.append(pos)
        pos += -(-t.numel() * t.element_size() // 256) * 256
    buf = torch.zeros(pos, dtype=torch.uint8, device="cuda")
    for o, t in zip(offs, ts_gpu):
        buf[o : o + t.numel() * t.element_size()] = t.view(-1).view(torch.uint8)
    sizes = [t.numel() * t.element_size() for t in ts_gpu]
    with torch.cuda.stream(s):
        codec = nvcomp.Codec(algorithm="ANS", data_type=dt_str, cuda_stream=s.cuda_stream)
        srcs = nvcomp.as_arrays(buf, offs, sizes, s.cuda_stream)
        cc = codec.compression_config(sizes)
        enc = codec.encode(srcs, compression_config=cc)
        stored = sum(int(x) for x in enc.buffer_sizes)
        dc = codec.decompression_config(cc)
        out = torch.empty(pos, dtype=torch.uint8, device="cuda")
        outs = nvcomp.as_arrays(out, offs, sizes, s.cuda_stream)
        codec.decode(enc, out=outs, decompression_config=dc)
        s.synchronize()
        assert torch.equal(out, buf), "nvCOMP ANS round trip"

        def e() -> None:
            codec.encode(srcs, compression_config=cc)

        def d() -> None:
            codec.decode(enc, out=outs, decompression_config=dc)

        t_e = event_time(e, s, repeats)
        t_d = event_time(d, s, repeats)
    return {
        "ratio": raw / stored,
        "stored": stored,
        "enc_GBps": raw / t_e / GB,
        "dec_GBps": raw / t_d / GB,
        "timing": "CUDA events around one batched call over all tensors (NATIVE, 64 KiB chunks)",
        "data_type": dt_str,
    }


def event_time(fn: Callable[[], Any], s: torch.cuda.Stream, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` between two CUDA events recorded on stream ``s``."""
    for _ in range(warmup):
        fn()
    s.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(s)
        fn()
        b.record(s)
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


class Budget:
    """Wall-clock budget for a run on the lent GPU: measurements past it are skipped, not lost."""

    def __init__(self, seconds: float, flush: Callable[[], None]) -> None:
        self.deadline = time.perf_counter() + seconds
        self.flush = flush

    def ok(self) -> bool:
        return time.perf_counter() < self.deadline


def bench_s4w_gpu(
    ts: dict[str, torch.Tensor], repeats: int, segs: list[int], e2e: bool, budget: Budget, res: dict[str, Any]
) -> None:
    import dataclasses

    import s4w_core.gpu as gpu
    from s4w_core.gpu import _coder, _decode, _encode, _nvcomp
    from s4w_core.workers import executor

    assert gpu.available(), gpu.unavailable_reason()
    dev = torch.device("cuda", torch.cuda.current_device())
    ts_gpu = {k: v.cuda() for k, v in ts.items()}
    tl = list(ts_gpu.values())
    raw = sum(t.numel() * t.element_size() for t in tl)
    pool = executor(None)  # one thread per core, up to 8
    default_fast = _encode.PROFILES["fast"]
    e2e_reps = max(2, repeats // 5)
    configs = [("fast", seg) for seg in segs] + [("portable", _encode.PROFILES["portable"].segment_elems)]
    for profile, seg in configs:
        if not budget.ok():
            res[f"s4w_{profile}_gpu_seg{seg >> 10}k"] = {"skipped": "time budget"}
            continue
        key = f"s4w_{profile}_gpu" + (f"_seg{seg >> 10}k" if profile == "fast" and len(segs) > 1 else "")
        _encode.PROFILES["fast"] = dataclasses.replace(default_fast, segment_elems=seg)
        r: dict[str, Any] = {"segment_elems": seg}
        res[key] = r
        try:
            # device-only encode: planes + nvCOMP + choice + compaction, ends on the device
            encd = _encode.encode_tensors_device(tl, profile)
            r["ratio_chunks"] = raw / encd.stored_bytes
            r["codec_chunks"] = {c: encd.codec_ids.count(c) for c in set(encd.codec_ids)}
            _coder.TRACE = True
            _encode.encode_tensors_device(tl, profile)
            _coder.TRACE = False
            marks = _coder.TRACE_MARKS
            r["enc_device_stages_ms"] = {b[0]: round(1e3 * (b[1] - a[1]), 3) for a, b in zip(marks, marks[1:])}
            r["enc_device_GBps"] = raw / cuda_time(lambda: _encode.encode_tensors_device(tl, profile), repeats) / GB
            budget.flush()
            # save into memory (the container: D2H, xxh3 of chunks, manifest)
            buf = io.BytesIO()
            t0 = time.perf_counter()
            rep = s4w_core.save(ts_gpu, buf, profile=profile)
            r["save_first_s"] = time.perf_counter() - t0
            data = buf.getvalue()
            r["ratio"] = rep.ratio
            r["file_ratio"] = raw / len(data)
            if e2e and budget.ok():
                r["save_e2e_GBps"] = (
                    raw / cuda_time(lambda: s4w_core.save(ts_gpu, io.BytesIO(), profile=profile), e2e_reps, 0) / GB
                )
            # device-only decode of the saved file: chunks staged on the device once
            reader = s4w_core.api.open_reader(data)
            entries = reader.manifest["storages"]
            st = _decode.stage(reader, entries, pool)
            with _nvcomp.on_stream(dev):
                staged = st.host.to(dev, non_blocking=True)
            outs = [torch.empty(e["nbytes"], dtype=torch.uint8, device=dev) for e in entries]
            bases = [None] * len(entries)

            def dec() -> None:
                with _nvcomp.on_stream(dev):
                    _decode.decode_device(staged, st, entries, outs, bases, dev)

            dec()
            for e, o, t in zip(entries, outs, ts_gpu.values()):
                assert torch.equal(o, t.view(-1).view(torch.uint8)), e["path"]
            r["dec_device_GBps"] = raw / cuda_time(dec, repeats) / GB
            _coder.TRACE = True
            dec()
            _coder.TRACE = False
            m = _coder.TRACE_MARKS
            r["dec_device_stages_ms"] = {b[0]: round((b[1] - a[1]) * 1e3, 3) for a, b in zip(m, m[1:])}
            staged = outs = None  # free device memory before the end-to-end runs
            budget.flush()
            if e2e and budget.ok():
                r["load_batched_e2e_GBps"] = (
                    raw
                    / cuda_time(
                        lambda: gpu.decode_storages(s4w_core.api.open_reader(data), entries, dev, None, pool),
                        e2e_reps,
                        0,
                    )
                    / GB
                )
            if e2e and budget.ok():
                t0 = time.perf_counter()
                back = s4w_core.load(data)
                torch.cuda.synchronize()
                r["load_api_e2e_GBps"] = raw / (time.perf_counter() - t0) / GB
                assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in ts_gpu.items())
                del back
        except Exception as e:  # report, keep measuring the rest
            import traceback

            r["error"] = f"{type(e).__name__}: {e}"
            r["trace"] = traceback.format_exc()[-2000:]
        finally:
            _encode.PROFILES["fast"] = default_fast
            print(key, json.dumps({k: v for k, v in r.items() if k != "trace"}, default=str), flush=True)
            budget.flush()
    pool.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--dtype", default="bf16,fp32")
    ap.add_argument("--subset", default=None, help="comma-separated name fragments: keep matching tensors")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--zstd19", action="store_true")
    ap.add_argument("--segs", default="", help="fast-profile segment sizes to sweep, in Ki elements, e.g. 128,512")
    ap.add_argument("--no-e2e", action="store_true", help="GPU: device-only timings (skip save/load end to end)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip measurements after this many seconds")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    meta: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "label": a.label,
        "weights": os.path.basename(a.weights),
        "subset": a.subset,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "s4weights": s4w_core.__version__,
    }
    if a.gpu:
        import s4w_core.gpu as gpu

        meta["device"] = torch.cuda.get_device_name()
        meta.update(gpu.versions())
    result: dict[str, Any] = {"meta": meta, "groups": {}}

    def flush() -> None:
        if a.out:
            with open(a.out, "w") as f:
                f.write(json.dumps(result, indent=2, default=str) + "\n")

    budget = Budget(a.budget_s, flush)
    for dtype in a.dtype.split(","):
        ts = load_tensors(a.weights, dtype, a.subset)
        raw = sum(t.numel() * t.element_size() for t in ts.values())
        g: dict[str, Any] = {"tensors": len(ts), "raw_bytes": raw}
        result["groups"][dtype] = g
        print(f"{dtype}: {len(ts)} tensors, {raw / 1e6:.1f} MB", flush=True)
        if a.cpu:
            g.update(bench_cpu(ts, dtype, a.repeats, a.zstd19))
            flush()
        if a.gpu:
            try:
                g["nvcomp_ans_alone"] = bench_nvcomp_ans([t.cuda() for t in ts.values()], dtype, a.repeats)
            except Exception as e:  # keep measuring the rest
                g["nvcomp_ans_alone"] = {"error": f"{type(e).__name__}: {e}"}
            print("nvcomp_ans_alone", json.dumps(g["nvcomp_ans_alone"]), flush=True)
            flush()
            segs = [int(x) << 10 for x in a.segs.split(",") if x] or [0]
            if segs == [0]:
                from s4w_core.gpu import _encode

                segs = [_encode.PROFILES["fast"].segment_elems]
            bench_s4w_gpu(ts, a.repeats, segs, not a.no_e2e, budget, g)
        del ts
    flush()
    # table last (the device reply carries the end of the output)
    print(f"\n{meta.get('device', 'CPU')}  {a.weights} {a.subset or ''}")
    cols = [
        "ratio",
        "file_ratio",
        "enc_GBps",
        "dec_GBps",
        "enc_device_GBps",
        "dec_device_GBps",
        "save_e2e_GBps",
        "load_batched_e2e_GBps",
        "load_api_e2e_GBps",
    ]
    print(f"{'group/codec':<34}" + "".join(f"{c[:14]:>15}" for c in cols))
    for dtype, g in result["groups"].items():
        print(f"{dtype}: {g['tensors']} tensors, {g['raw_bytes'] / 1e6:.1f} MB")
        for k, v in g.items():
            if not isinstance(v, dict):
                continue
            if "error" in v or "skipped" in v:
                print(f"  {k:<32} {v.get('error') or v.get('skipped')}")
                continue
            print(
                f"  {k:<32}" + "".join(f"{v[c]:>15.4f}" if isinstance(v.get(c), float) else f"{'':>15}" for c in cols)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the GPU codec's time goes, on a real model state: host work, GPU kernels, nvCOMP.

Builds the state of ``bench_peers.py``'s model (``--model``, ``--steps`` optimizer steps on real
text; weights + AdamW moments on the GPU), then for the ``fast`` profile at each ``--segments``
size (elements per segment = bytes per ANS chunk):

* ratio, encode and decode GB/s (synchronized wall clock, median of ``--repeats``; the same rule as
  ``bench_peers.py``'s codec rows), and the decode again with ``S4W_MERGE_IN_PLACE=0`` (raw chunks
  placed into the planes buffer before the merge: the A/B of the in-place merge);
* stage marks (each stage synchronized, so their sum exceeds the pipelined time), and a timeline of
  one unsynchronized call: when the host enqueued each stage and when the GPU reached it;
* one ``torch.profiler`` pass per direction: GPU time per kernel name, the sum of GPU time, and the
  wall time of the profiled call -- the gap between the two is host work the GPU waits for;

and nvCOMP ANS alone (``'<f2'``/``'<f4'``, one batched call) on the same tensors, for reference.

    python benchmarks/profile_codec.py --model medium --steps 20 --segments 524288,131072
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import _train_gpt  # noqa: E402
import bench_peers  # noqa: E402

from s4w_core.gpu import _coder, _encode  # noqa: E402

GB = 1e9


def wall(fn: Callable[[], Any], repeats: int, dev: torch.device) -> float:
    fn()
    torch.cuda.synchronize(dev)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def marks(fn: Callable[[], Any]) -> dict[str, float]:
    _coder.TRACE = True
    try:
        fn()
        m = list(_coder.TRACE_MARKS)
    finally:
        _coder.TRACE = False
    return {name: round((t - m[i][1]) * 1e3, 3) for i, (name, t, _e) in enumerate(m[1:])}


def timeline(fn: Callable[[], Any], dev: torch.device) -> dict[str, list[float]]:
    """Per stage mark of one unsynchronized call: [ms since the start when the host got there, ms
    since the start when the GPU got there]. Where the GPU's time equals the host's, the GPU was
    waiting for the host; the last row is the call's return (host) and the GPU's finish."""
    fn()
    torch.cuda.synchronize(dev)
    _coder.TRACE = "timeline"
    try:
        t0 = time.perf_counter()
        fn()
        t_ret = time.perf_counter()
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(dev))
        torch.cuda.synchronize(dev)
        m = list(_coder.TRACE_MARKS)
    finally:
        _coder.TRACE = False
    h0, e0 = m[0][1], m[0][2]
    out = {name: [round((t - h0) * 1e3, 3), round(e0.elapsed_time(ev), 3)] for name, t, ev in m[1:]}
    out["(return / GPU done)"] = [round((t_ret - h0) * 1e3, 3), round(e0.elapsed_time(end), 3)]
    out["(call started)"] = [round((t0 - h0) * 1e3, 3), 0.0]
    return out


def kernels(fn: Callable[[], Any], dev: torch.device, top: int = 12) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        w = time.perf_counter() - t0
    rows = []
    total = 0.0
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None)
        if dt is None:
            dt = getattr(ev, "cuda_time_total", 0.0)
        self_dt = getattr(ev, "self_device_time_total", None)
        if self_dt is None:
            self_dt = getattr(ev, "self_cuda_time_total", 0.0)
        if self_dt > 0:
            rows.append((ev.key[:70], ev.count, self_dt / 1e3))
            total += self_dt / 1e3
    rows.sort(key=lambda r: -r[2])
    return {
        "wall_ms_profiled": round(w * 1e3, 3),
        "gpu_ms_sum": round(total, 3),
        "top": [{"kernel": k, "calls": c, "ms": round(ms, 3)} for k, c, ms in rows[:top]],
    }


def host_profile(fn: Callable[[], Any], dev: torch.device, top: int = 15) -> str:
    """cProfile of 10 calls (each synchronized), by time spent in each function itself: which
    Python work the codec's host time goes to."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        fn()
        torch.cuda.synchronize(dev)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def run_s4w(
    tl: list[torch.Tensor], seg: int, repeats: int, dev: torch.device, cprofile: bool = False
) -> dict[str, Any]:
    base = _encode.PROFILES["fast"]
    _encode.PROFILES["fast"] = dataclasses.replace(base, segment_elems=seg)
    try:
        raw = sum(t.numel() * t.element_size() for t in tl)
        enc = _encode.encode_tensors_device(tl, "fast")
        plan = bench_peers._s4w_decode_plan(enc, tl)
        outs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in plan.nbytes]

        def encode() -> Any:
            return _encode.encode_tensors_device(tl, "fast")

        def decode() -> None:
            bench_peers._s4w_device_decode(enc, plan, outs)

        decode()
        torch.cuda.synchronize(dev)
        exact = all(torch.equal(o, t.contiguous().view(-1).view(torch.uint8)) for o, t in zip(outs, tl))
        te, td = wall(encode, repeats, dev), wall(decode, repeats, dev)
        # the encode with its plan prepared once (``PreparedEncode``; absent from older trees)
        prepared = getattr(_encode, "PreparedEncode", None)
        prep = prepared(tl, "fast") if prepared is not None else None
        tp = wall(prep, repeats, dev) if prep is not None else None
        prep_timeline = timeline(prep, dev) if prep is not None else None
        prep_kernels = kernels(prep, dev) if prep is not None else None
        del prep
        os.environ["S4W_MERGE_IN_PLACE"] = "0"  # the same decode with raw chunks placed first (A/B)
        try:
            td_placed = wall(decode, repeats, dev)
        finally:
            del os.environ["S4W_MERGE_IN_PLACE"]
        ids = enc.codec_ids
        host = nvcomp_host_cost(enc, dev)
        width = np.array([t.element_size() for t in tl], dtype=np.int64)[enc.owner_ji]
        later = enc.coded & (enc.owner_ci % width != 0)  # coded chunks of planes after the first
        return {
            "segment_elems": seg,
            "probe_min_gain": _coder.probe_min_gain(),  # S4W_PROBE_MIN_GAIN, else the module's value
            "later_planes_coded": int(later.sum()),
            # storages the layout probe wrote with ``planes`` (no rotation; absent from older trees)
            "planes_storages": sum(1 for v in getattr(enc, "transforms", {}).values() if v == "planes"),
            "later_planes_coded_stored_bytes": int(enc.out_len[later].sum()),
            "ratio": raw / enc.stored_bytes,
            "chunks": len(ids),
            "ans_chunks": sum(1 for c in ids if c != "raw"),
            "enc_ms": round(te * 1e3, 3),
            "dec_ms": round(td * 1e3, 3),
            "enc_GBps": raw / te / GB,
            "dec_GBps": raw / td / GB,
            "enc_prepared_ms": round(tp * 1e3, 3) if tp else None,
            "enc_prepared_GBps": raw / tp / GB if tp else None,
            "enc_prepared_timeline_ms": prep_timeline,
            "enc_prepared_kernels": prep_kernels,
            "dec_ms_raw_placed_first": round(td_placed * 1e3, 3),
            "bit_exact": exact,
            "nvcomp_host_ms": host,
            "enc_marks_ms": marks(encode),
            "dec_marks_ms": marks(decode),
            "enc_timeline_ms": timeline(encode, dev),
            "dec_timeline_ms": timeline(decode, dev),
            "enc_kernels": kernels(encode, dev),
            "dec_kernels": kernels(decode, dev),
            **({"enc_cprofile": host_profile(encode, dev), "dec_cprofile": host_profile(decode, dev)} if cprofile else {}),
        }
    finally:
        _encode.PROFILES["fast"] = base


def nvcomp_host_cost(enc: Any, dev: torch.device) -> dict[str, float]:
    """Host milliseconds of nvCOMP's Python layer for this many chunks: building the two chunk
    lists (``as_arrays``) of a call, and enqueuing the decode (no synchronization)."""
    from nvidia import nvcomp

    from s4w_core.gpu import _nvcomp

    coded = [i for i, c in enumerate(enc.codec_ids) if c != "raw"]
    offs = enc.out_off[coded].tolist()
    lens = enc.out_len[coded].tolist()
    s = _nvcomp.stream_for(dev).cuda_stream
    t0 = time.perf_counter()
    for _ in range(5):
        nvcomp.as_arrays(enc.out, offs, lens, s)
    t_arr = (time.perf_counter() - t0) / 5
    return {"chunks": len(coded), "as_arrays_ms": round(t_arr * 1e3, 3)}


def run_ans(tl: list[torch.Tensor], repeats: int, dev: torch.device) -> dict[str, Any]:
    from nvidia import nvcomp

    from s4w_core.gpu import _nvcomp

    _nvcomp._use_torch_allocator()
    el = tl[0].element_size()
    sizes = [t.numel() * el for t in tl]
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += -(-n // 256) * 256
    buf = torch.zeros(pos, dtype=torch.uint8, device=dev)
    for o, t, n in zip(offs, tl, sizes):
        buf[o : o + n] = t.contiguous().view(-1).view(torch.uint8)
    out = torch.empty_like(buf)
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        codec = nvcomp.Codec(algorithm="ANS", data_type={2: "<f2", 4: "<f4"}[el], cuda_stream=s.cuda_stream)
        srcs = nvcomp.as_arrays(buf, offs, sizes, s.cuda_stream)
        outs = nvcomp.as_arrays(out, offs, sizes, s.cuda_stream)
        cc = codec.compression_config(sizes)
        enc = codec.encode(srcs, compression_config=cc)
        dc = codec.decompression_config(cc)
        codec.decode(enc, out=outs, decompression_config=dc)
        s.synchronize()
        stored = sum(int(x) for x in enc.buffer_sizes)
        te = wall(lambda: codec.encode(srcs, compression_config=cc), repeats, dev)
        td = wall(lambda: codec.decode(enc, out=outs, decompression_config=dc), repeats, dev)
    raw = sum(sizes)
    return {"ratio": raw / stored, "enc_ms": round(te * 1e3, 3), "dec_ms": round(td * 1e3, 3),
            "enc_GBps": raw / te / GB, "dec_GBps": raw / td / GB}


def later_curve(tl: list[torch.Tensor], labels: list[str]) -> dict[str, Any]:
    """What the later planes' chunks (the mantissa bytes) are worth: every such chunk the probe
    samples coded (gate 0) against none coded (gate 1), chunk by chunk. Returns, for thresholds of
    the saving actually reached, the raw bytes an oracle selector would send to ANS and the bytes it
    would save, and the saving per tensor group (``labels``: one per tensor)."""
    shipped = _coder.PROBE_MIN_GAIN
    try:
        _coder.PROBE_MIN_GAIN = 0.0
        every = _encode.encode_tensors_device(tl, "fast")
        _coder.PROBE_MIN_GAIN = 1.0
        none = _encode.encode_tensors_device(tl, "fast")
    finally:
        _coder.PROBE_MIN_GAIN = shipped
    width = np.array([t.element_size() for t in tl], dtype=np.int64)[none.owner_ji]
    sampled = (none.owner_ci % width != 0) & ~none.coded  # later-plane chunks the gate left raw
    raw = none.out_len[sampled].astype(np.int64)
    saved = np.where(every.coded[sampled], raw - every.out_len[sampled], 0)
    frac = saved / np.maximum(raw, 1)
    rows = []
    for thr in (0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.12, 0.1, 0.05, 0.02, 0.0):
        m = (frac >= thr) & (saved > 0)
        rows.append({"min_saving": thr, "chunks": int(m.sum()), "raw_MB": round(float(raw[m].sum()) / 1e6, 1),
                     "saved_MB": round(float(saved[m].sum()) / 1e6, 1)})
    groups: dict[str, list[float]] = {}
    owners = none.owner_ji[sampled]
    for lab in sorted(set(labels)):
        m = np.array([labels[j] == lab for j in owners], dtype=bool)
        groups[lab] = [round(float(raw[m].sum()) / 1e6, 1), round(float(saved[m].sum()) / 1e6, 1)]
    return {"later_chunks": int(sampled.sum()), "raw_MB": round(float(raw.sum()) / 1e6, 1),
            "saved_MB": round(float(saved.sum()) / 1e6, 1), "by_saving": rows, "by_group_raw_saved_MB": groups}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default="bf16")
    ap.add_argument("--segments", default="524288")
    ap.add_argument("--gates", default=None,
                    help="comma list of PROBE_MIN_GAIN values to run at (the saving a later-plane chunk's sample must "
                    "promise to be sent to ANS); default: the shipped value")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--later-curve", action="store_true",
                    help="also print what the later planes' chunks save, chunk by chunk, against the saving reached")
    ap.add_argument("--cprofile", action="store_true", help="also print a cProfile of the host work per direction")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.gates and os.environ.get("S4W_PROBE_MIN_GAIN"):
        ap.error("--gates sets the gate itself: unset S4W_PROBE_MIN_GAIN (it would override every value)")
    dev = torch.device("cuda")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "variants": {}}
    for variant in a.variants.split(","):
        cfg = dict(_train_gpt.MODELS[a.model])
        tr = _train_gpt.Trainer(variant, max(a.steps, 1), device="cuda", **cfg)
        for _ in range(a.steps):
            tr.step()
        torch.cuda.synchronize(dev)
        keep = [t.is_floating_point() and t.numel() > 0 and t.is_cuda for t in tr._live()]
        tl = [t for t, k in zip(tr._live(), keep) if k]
        labels = [lab for lab, k in zip(tr.labels(), keep) if k]
        raw = sum(t.numel() * t.element_size() for t in tl)
        v: dict[str, Any] = {"tensors": len(tl), "raw_bytes": raw, "ans_alone": run_ans(tl, a.repeats, dev), "s4w": []}
        print(f"[{variant}] {len(tl)} tensors, {raw / GB:.3f} GB; ANS alone {json.dumps(v['ans_alone'])}", flush=True)
        if a.later_curve:
            v["later_curve"] = later_curve(tl, labels)
            print(f"[{variant}] later planes, chunk by chunk:", json.dumps(v["later_curve"]), flush=True)
        shipped_gate = _coder.PROBE_MIN_GAIN
        gates = [float(x) for x in a.gates.split(",")] if a.gates else [shipped_gate]
        for gate, seg in ((g, int(x)) for g in gates for x in a.segments.split(",")):
            _coder.PROBE_MIN_GAIN = gate
            try:
                r = run_s4w(tl, seg, a.repeats, dev, a.cprofile)
            finally:
                _coder.PROBE_MIN_GAIN = shipped_gate
            v["s4w"].append(r)
            print(f"[{variant}] seg {seg} gate {r['probe_min_gain']}: ratio {r['ratio']:.4f} enc {r['enc_GBps']:.1f} GB/s "
                  f"dec {r['dec_GBps']:.1f} GB/s exact {r['bit_exact']} (dec with raw chunks placed first: "
                  f"{r['dec_ms_raw_placed_first']} ms against {r['dec_ms']} ms); later-plane chunks coded "
                  f"{r['later_planes_coded']} ({r['later_planes_coded_stored_bytes'] / 1e6:.1f} MB stored); "
                  f"{r['planes_storages']} of {len(tl)} storages in 'planes'", flush=True)
            if r["enc_prepared_GBps"]:
                print(f"   enc with the plan prepared once: {r['enc_prepared_GBps']:.1f} GB/s ({r['enc_prepared_ms']} ms); "
                      f"timeline (host ms, GPU ms): {r['enc_prepared_timeline_ms']}; GPU sum "
                      f"{r['enc_prepared_kernels']['gpu_ms_sum']} ms", flush=True)
            print("   enc marks", r["enc_marks_ms"], "\n   dec marks", r["dec_marks_ms"], flush=True)
            for d in ("enc", "dec"):
                print(f"   {d} timeline (host ms, GPU ms):", r[f"{d}_timeline_ms"], flush=True)
            for d in ("enc", "dec"):
                k = r[f"{d}_kernels"]
                print(f"   {d}: wall {k['wall_ms_profiled']} ms, GPU sum {k['gpu_ms_sum']} ms", flush=True)
                for row in k["top"]:
                    print(f"      {row['ms']:8.3f} ms {row['calls']:5d}x {row['kernel']}", flush=True)
                if a.cprofile:
                    print(r[f"{d}_cprofile"], flush=True)
        res["variants"][variant] = v
        del tr, tl
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

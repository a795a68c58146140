"""Ratio side by side: s4weights (CPU-written, portable) vs. z4ai and ZipNN, per tensor group.

Data: a real fine-tune series of our own (benchmarks/_train_minilm.py: all-MiniLM-L6-v2, 22.7 M
parameters, AdamW, 5 snapshots 5 steps apart, bf16 and fp32; cached under ``--cache``). Groups:
``weights``, ``exp_avg``, ``exp_avg_sq`` (every parameter's tensor of that kind).

Columns, ratio = raw bytes / stored bytes (codec output only, summed over the group's tensors):

* ``plain``: each of the 5 snapshots coded on its own;
* ``chain``: snapshots 2..5 each coded against the one before: s4weights as its writer chooses
  (``encode_storage_cpu`` with the base: plain, ``xor`` or ``sub`` by its sample estimate);
  z4ai and ZipNN best-of(plain, XOR delta) per tensor (z4ai's ``compress_delta``, ZipNN on the
  XORed bytes).

s4weights: :func:`s4w_core.engine.encode_storage_cpu` per tensor, one thread, default transform.
z4ai: ``z4ai.compress(bytes, dtype=..., threads=1)`` (default effort). ZipNN: torch input mode,
one thread. Every peer frame of the first snapshot (and every delta frame of the second) is
decoded and compared to its input; s4weights' round trip is covered by its tests.

``--gpu`` (on a machine with CUDA and the GPU extra) adds GPU-written files side by side:
``s4w-gpu`` is ``s4w_core.save(..., profile="fast")`` of each group's CUDA tensors (the chain
against the previous snapshot's CUDA tensors through ``_base_lookup``), stored bytes = the chunk
bytes of its manifest; every file is loaded back on the GPU and compared bit for bit.
``s4w-gpu-nonz`` is the same writer with the nonzero transform switched off, to show what it buys.
The peers' sizes come from ``CACHE/peer_sizes.json`` when a CPU run left them there (so the device
needs neither z4ai nor ZipNN), else they are measured.

Usage::

    python benchmarks/bench_ratio.py [--precision bf16,fp32] [--cache /tmp/s4w_ratio_series]
        [--model-dir DIR] [--out benchmarks/results/ratio]   # writes ratio.md and ratio.json
    python benchmarks/bench_ratio.py --analyze   # the figures of docs/RATIO.md (planes, entropies)
    python benchmarks/bench_ratio.py --gpu --out benchmarks/results/ratio_gpu   # + GPU-written files
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from importlib import metadata
from typing import Any, Callable

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import _train_minilm  # noqa: E402

from s4w_core import engine  # noqa: E402
from s4w_core.planes import split_planes  # noqa: E402
from s4w_core.workers import Pool  # noqa: E402

GROUPS = ("weights", "exp_avg", "exp_avg_sq")
_Z4 = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


class _SizeWriter:
    """A ContainerWriter stand-in that only counts the chunk bytes."""

    def __init__(self) -> None:
        self.data_bytes = 0

    def add_chunk(self, data: Any) -> tuple[int, int, str]:
        n = memoryview(data).nbytes
        self.data_bytes += n
        return 0, n, ""


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def s4w_size(t: torch.Tensor, base: torch.Tensor | None, pool: Pool, name: str) -> int:
    w = _SizeWriter()
    job = engine.StorageJob(_u8(t), t.dtype, name, "cpu")
    if base is not None:
        job.base, job.base_ref = _u8(base), {"step": "prev"}
    engine.encode_storage_cpu(job, w, pool)  # type: ignore[arg-type]
    return w.data_bytes


def z4ai_size(t: torch.Tensor, base: torch.Tensor | None, check: bool) -> int:
    import z4ai

    raw = _u8(t).numpy().tobytes()
    plain = z4ai.compress(raw, dtype=_Z4[t.dtype], threads=1)
    if check and base is None:
        assert z4ai.decompress(plain) == raw
    if base is None:
        return len(plain)
    ref = _u8(base).numpy().tobytes()
    d = z4ai.compress_delta(raw, ref, dtype=_Z4[t.dtype], threads=1)
    if check:
        assert bytes(z4ai.decompress_delta(d, ref)) == raw
    return min(len(plain), len(d))


_zipnn: dict[torch.dtype, Any] = {}


def zipnn_size(t: torch.Tensor, base: torch.Tensor | None, check: bool) -> int:
    import zipnn

    z = _zipnn.get(t.dtype)
    if z is None:
        name = str(t.dtype).removeprefix("torch.")
        z = _zipnn[t.dtype] = zipnn.ZipNN(bytearray_dtype=name, input_format="torch", threads=1)

    def one(x: torch.Tensor) -> int:
        c = z.compress(x.clone())  # ZipNN reorders its input's bytes in place
        if check:
            assert torch.equal(_u8(z.decompress(c)), _u8(x))
        return len(c)

    n = one(t.contiguous().reshape(-1))
    if base is None:
        return n
    x = (_u8(t) ^ _u8(base)).view(t.dtype)
    return min(n, one(x))


def s4w_gpu_size(ts: dict[str, torch.Tensor], bases: dict[str, torch.Tensor] | None, nonzero: bool = True) -> int:
    """Chunk bytes of the GPU writer's ``fast`` file of the CUDA tensors ``ts`` (against ``bases``,
    the previous snapshot's, where given), after loading it back on the GPU bit for bit. With
    ``nonzero=False`` the writer never chooses the nonzero transform."""
    import io

    import s4w_core
    from s4w_core.gpu import _encode

    dev = torch.device("cuda")
    obj = {k: v.to(dev) for k, v in ts.items()}
    b = None if bases is None else {k: _u8(v.to(dev)) for k, v in bases.items()}

    def lookup(path: str, nbytes: int, dtype: str) -> Any:
        return (b[path], {"ref": path}) if b is not None and path in b and b[path].numel() == nbytes else None

    def resolve(ref: dict[str, Any], nbytes: int) -> torch.Tensor:
        assert b is not None
        return b[ref["ref"]]

    buf = io.BytesIO()
    orig = _encode.nonzero_choices_device
    if not nonzero:
        _encode.nonzero_choices_device = lambda items, dev: [False] * len(items)  # type: ignore[assignment]
    try:
        s4w_core.save(obj, buf, profile="fast", _base_lookup=lookup if b is not None else None)
    finally:
        _encode.nonzero_choices_device = orig  # type: ignore[assignment]
    data = buf.getvalue()
    back = s4w_core.load(data, map_location="cuda", _resolve_base=resolve if b is not None else None)
    for k, v in obj.items():
        assert torch.equal(_u8(back[k]), _u8(v)), f"GPU round trip of {k} is not bit-exact"
    m = s4w_core.api.open_reader(data).manifest
    return sum(c[2] for s in m["storages"] for c in s["chunks"])


def measure(
    series: list[tuple[int, dict[str, dict[str, torch.Tensor]]]],
    log: Callable[[str], None],
    memo: dict[str, int] | None = None,
    tag: str = "",
    gpu: bool = False,
) -> dict[str, Any]:
    """Sizes per group and codec; the peers' sizes are kept in ``memo`` (by ``tag``, group, step,
    tensor and column), so that a second run on the same cached series codes only s4weights'."""
    pool = engine.executor(1)
    memo = {} if memo is None else memo
    res: dict[str, Any] = {}
    for g in GROUPS:
        raw = {"plain": 0, "chain": 0}
        coders = ("s4w", "z4ai", "zipnn") + (("s4w-gpu", "s4w-gpu-nonz") if gpu else ())
        stored: dict[str, dict[str, int]] = {c: {"plain": 0, "chain": 0} for c in coders}
        for i, (_step, groups) in enumerate(series):
            prev = series[i - 1][1][g] if i else None
            if gpu:  # one file per group and snapshot (each storage is still coded on its own)
                for c, nz in (("s4w-gpu", True), ("s4w-gpu-nonz", False)):
                    stored[c]["plain"] += s4w_gpu_size(groups[g], None, nz)
                    if prev is not None:
                        stored[c]["chain"] += s4w_gpu_size(groups[g], prev, nz)
            for name, t in groups[g].items():
                nb = t.numel() * t.element_size()
                raw["plain"] += nb
                b = None if prev is None else prev[name]
                if b is not None:
                    raw["chain"] += nb
                check = i <= 1  # peers' frames of the first two snapshots are decoded and compared
                for c in ("s4w", "z4ai", "zipnn"):
                    for col, bb in (("plain", None), ("chain", b)):
                        if col == "chain" and bb is None:
                            continue
                        key = f"{tag}/{g}/{_step}/{name}/{c}/{col}"
                        if c == "s4w":
                            memo[key] = s4w_size(t, bb, pool, name)
                        elif key not in memo:
                            memo[key] = (z4ai_size if c == "z4ai" else zipnn_size)(t, bb, check)
                        stored[c][col] += memo[key]
        res[g] = {
            c: {k: round(raw[k] / max(1, stored[c][k]), 4) for k in raw} | {"stored": stored[c]}
            for c in stored
        } | {"raw": raw}
        log(f"  {g}: " + ", ".join(f"{c} {res[g][c]['plain']:.3f}/{res[g][c]['chain']:.3f}" for c in stored))
    return res


_LABEL = {"s4w": "s4w", "s4w-gpu": "s4w GPU", "s4w-gpu-nonz": "s4w GPU without nz", "z4ai": "z4ai", "zipnn": "ZipNN"}


def table(results: dict[str, Any]) -> str:
    first = next(iter(results.values()))[GROUPS[0]]
    coders = [c for c in ("s4w", "s4w-gpu", "s4w-gpu-nonz", "z4ai", "zipnn") if c in first]
    head = [f"{_LABEL[c]} {k}" for k in ("plain", "chain") for c in coders]
    lines = ["| group | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for prec, res in results.items():
        for g in GROUPS:
            r = res[g]
            cells = []
            for k in ("plain", "chain"):
                vals = {c: r[c][k] for c in coders}
                best = max(vals.values())
                cells += [f"**{v:.3f}**" if v == best else f"{v:.3f}" for v in vals.values()]
            lines.append(f"| {prec} {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- analysis
def _h0(x: np.ndarray) -> float:
    """Order-0 entropy of a uint8 array, bits per byte."""
    if x.size == 0:
        return 0.0
    p = np.bincount(x, minlength=256) / x.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def _h1(x: np.ndarray, ctx: np.ndarray) -> float:
    """Entropy of ``x`` given ``ctx`` (both uint8, same size), bits per byte."""
    if x.size == 0:
        return 0.0
    joint = np.bincount(ctx.astype(np.int64) * 256 + x, minlength=65536).reshape(256, 256)
    pc = joint.sum(1)
    h = 0.0
    for c in np.nonzero(pc)[0]:
        row = joint[c][joint[c] > 0] / pc[c]
        h += pc[c] / x.size * float(-(row * np.log2(row)).sum())
    return h


def analyze(groups: dict[str, dict[str, torch.Tensor]], prev: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Figures of one snapshot per group: zeros, zero rows, repeats, per-plane entropies."""
    out: dict[str, Any] = {}
    for g in GROUPS:
        ts = groups[g]
        n = sum(t.numel() for t in ts.values())
        zeros = sum(int((t == 0).sum()) for t in ts.values())
        zero_rows = sum(int((t == 0).all(1).sum()) * t.shape[1] for t in ts.values() if t.dim() == 2)
        flat = [_u8(t) for t in ts.values()]
        dtype = next(iter(ts.values())).dtype
        w = dtype.itemsize
        planes = np.concatenate([split_planes(u, dtype).numpy() for u in flat], axis=1)
        vals = np.concatenate([t.contiguous().reshape(-1).view(torch.int16 if w == 2 else torch.int32).numpy() for t in ts.values()])
        repeats = float((vals[1:] == vals[:-1]).mean())
        nz = vals != 0
        exp = planes[0]
        # exponent context: the previous element's exponent; and the element one row above (2-D)
        up_x, up_c = [], []
        for t in ts.values():
            if t.dim() == 2 and t.shape[0] > 1:
                p0 = split_planes(_u8(t), dtype).numpy()[0].reshape(t.shape)
                up_x.append(p0[1:].reshape(-1))
                up_c.append(p0[:-1].reshape(-1))
        ux, uc = np.concatenate(up_x), np.concatenate(up_c)
        enz = exp[nz]
        pl = {}
        for j in range(w):
            p = planes[j]
            pl[f"plane{j}"] = {"h0": round(_h0(p), 4), "h0_nonzero": round(_h0(p[nz]), 4)}
        pl["plane0"]["h1_prev"] = round(_h1(exp[1:], exp[:-1]), 4)
        pl["plane0"]["h1_prev_nonzero"] = round(_h1(enz[1:], enz[:-1]), 4)
        pl["plane0"]["h1_row_above"] = round(_h1(ux, uc), 4)
        sign = (vals < 0)[nz]
        low = planes[w - 1] >> 1  # the last plane without the sign bit (planes-rotl1)
        pbase = np.concatenate([split_planes(_u8(prev[g][k]), dtype).numpy()[0] for k in ts])
        out[g] = {
            "elements": n,
            "zero_frac": round(zeros / n, 4),
            "zero_row_frac": round(zero_rows / n, 4),
            "repeat_prev_frac": round(repeats, 4),
            "distinct_values": int(np.unique(vals).size),
            "sign_neg_frac_nonzero": round(float(sign.mean()) if sign.size else 0.0, 4),
            "low7_h0_nonzero": round(_h0(low[nz]), 4),
            "exp_h1_given_prev_step_exp": round(_h1(exp, pbase), 4),
            "planes": pl,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="bf16,fp32")
    ap.add_argument("--cache", default="/tmp/s4w_ratio_series")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--analyze", action="store_true", help="print the per-plane figures instead")
    ap.add_argument("--gpu", action="store_true", help="add GPU-written (fast profile) files, with and without nz")
    a = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    t_start = time.time()
    for prec in a.precision.split(","):
        series = _train_minilm.cached_series(prec, a.cache, path=a.model_dir)
        print(f"{prec}: {len(series)} snapshots, steps {[s for s, _ in series]}", flush=True)
        if a.analyze:
            results[prec] = analyze(series[-1][1], series[-2][1])
            print(json.dumps(results[prec], indent=1), flush=True)
        else:
            memo_path = os.path.join(a.cache, "peer_sizes.json")
            memo = json.load(open(memo_path)) if os.path.exists(memo_path) else {}
            results[prec] = measure(series, lambda s: print(s, flush=True), memo, f"minilm_{prec}", gpu=a.gpu)
            with open(memo_path + ".tmp", "w") as f:
                json.dump({k: v for k, v in memo.items() if "/s4w/" not in k}, f)
            os.replace(memo_path + ".tmp", memo_path)
    if a.analyze:
        if a.out:
            with open(a.out + ".json", "w") as f:
                json.dump({"analysis": results}, f, indent=1)
        return
    env = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.processor() or ''} CPU, {os.cpu_count()} cores (1 thread used)".strip()
        + (f"; GPU {torch.cuda.get_device_name()}" if a.gpu else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "s4weights": _version("s4weights"),
        "z4ai": _version("z4ai"),
        "zipnn": _version("zipnn"),
        "series": "all-MiniLM-L6-v2 sentence-embedding fine-tune, AdamW lr 2e-5 wd 0.01, snapshots at steps 5..25",
        "wall_s": round(time.time() - t_start, 1),
        "note": "z4ai/ZipNN sizes are kept in CACHE/peer_sizes.json and reused by later runs on the same "
        "cached series (wall_s then times s4weights only)",
    }
    md = table(results)
    print(md)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(
                f"# Ratio per tensor group: s4weights ({'CPU- and GPU-written' if a.gpu else 'CPU-written'}) "
                "vs. z4ai and ZipNN\n\n"
                f"Made by `python benchmarks/bench_ratio.py{' --gpu' if a.gpu else ''} --out {a.out}` (see its "
                "docstring for the columns). Ratio = raw bytes / codec output bytes; plain = 5 snapshots each alone, "
                "chain = snapshots 2-5 each against the one before. Bold: the best of the row's plain or chain "
                "columns.\n\n"
                + "\n".join(f"- {k}: {v}" for k, v in env.items())
                + "\n\n"
                + md
                + "\n"
            )


if __name__ == "__main__":
    main()

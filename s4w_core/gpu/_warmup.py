"""Compiling the GPU codec's Triton kernels before the first save needs them.

A process's first GPU save or load otherwise compiles every kernel variant it meets (the split,
probe, choice, gather and checksum kernels for each plane width and delta op; the merge kernels
on load): seconds with an empty Triton cache, inside the training loop. :func:`run` codes a small
synthetic state of each plane width with the GPU writer -- a plain step, then a delta step against
it (``xor`` and ``sub`` residuals, storages that stay plain; once from the device, once from
pinned host copies as the store's re-encoding codes them), a byte storage above the writer's
CPU threshold and one below it -- into a container in memory, and decodes both with the GPU
reader, checking every byte. Each plane width (and the byte storages) runs on its own thread and
stream, so their kernels compile side by side, and reports its stages as it goes: a save waits only
for the stages it needs (a plain save of bf16 tensors, the 2-byte plain stage), not for the rest.
Nothing of the user's is touched, and the bytes any later save writes
are the same (the kernels are deterministic; warming changes only when they are compiled). Triton
keeps what it compiled in its on-disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``),
and a warm-up on CUDA records which kernels it loaded (:mod:`s4w_core.gpu._kernel_record`), so a
later process's warm-up loads those from that cache directly (Triton's ``preload``) and codes
only the synthetic plain step (the first use of torch's and nvCOMP's own kernels, which a first
save would pay otherwise) instead of every synthetic step: loading the kernels before the first
save took 0.2-0.5 s off each warm first save in the framework benchmark, and leaving out the other
steps leaves the training loop the GIL time their Python took.
:func:`s4w_core.gpu.warm_up` runs this on a background thread.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from s4w_core import engine
from s4w_core.codecs import CODECS
from s4w_core.format.container import FORMAT_VERSION, ContainerReader, ContainerWriter
from s4w_core.format.manifest import validate_manifest
from s4w_core.gpu import _decode as _decode_mod
from s4w_core.gpu import _encode as _encode_mod
from s4w_core.gpu import _kernel_record, bundle
from s4w_core.planes import triton_kernels as _plane_kernels
from s4w_core.workers import Pool

__all__ = ["DEFAULT_DTYPES", "record_path", "run", "stage_key", "stage_keys", "synthetic_states"]

#: plane dtypes warmed when none are named: the two plane widths (bf16 and fp16 share the 2-byte kernels)
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
#: element counts per dtype: odd sizes and sizes of whole 16-byte words (the kernels' aligned and
#: unaligned variants: a model's tensors are mostly the latter), one above a GPU segment (2**19
#: elements); the smallest is still split into planes (scalars under ``jobs.PLANES_MIN_BYTES`` are
#: not). Small, so that a warm-up beside the first training steps takes little device memory.
_SIZES = (5, 1000, 4096, (1 << 16) + 5, 1 << 18, (1 << 19) + 7)
#: int64 element counts: 800 B (the writer's CPU path) and ~2 MiB (its GPU path)
_INT_SIZES = (100, (1 << 18) + 3)
#: the synthetic matrix with row and column scales (rows, cols)
_RC_SHAPE = (128, 256)


def synthetic_states(device: torch.device, dtypes: Iterable[torch.dtype], *, second: bool = True) -> tuple[dict, dict]:
    """Two consecutive states like a training run's (weights that moved a little, a moment that
    changed entirely, integer tensors), on ``device``; ``second=False``: the first only (the
    second empty)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    s0: dict[str, torch.Tensor] = {}
    s1: dict[str, torch.Tensor] = {}

    def put(s: dict[str, torch.Tensor], key: str, t: torch.Tensor) -> None:
        if second or s is s0:
            s[key] = t.to(device)

    for dt in dtypes:
        name = str(dt).removeprefix("torch.")
        for n in _SIZES:
            w = torch.randn(n, generator=g)
            put(s0, f"{name}/w{n}", w.to(dt))
            put(s1, f"{name}/w{n}", (w * (1 + 1e-3 * torch.randn(n, generator=g))).to(dt))  # -> a delta
            put(s0, f"{name}/m{n}", torch.randn(n, generator=g).to(dt))
            put(s1, f"{name}/m{n}", torch.randn(n, generator=g).to(dt))  # -> plain
        # an Adam moment with the zero rows of untouched embedding rows: the nonzero transform's
        # kernels, on save and on load (a resume's first load compiled them otherwise)
        n = 1 << 18
        for s in (s0, s1):
            z = torch.randn(n, generator=g)
            z[: n // 2] = 0
            put(s, f"{name}/z{n}", z.to(dt))
        # a matrix's squared gradients, with row and column scales: the row/column probe and
        # transform, whose torch kernels a first save (and a resume's first load) loaded otherwise
        rows, cols = _RC_SHAPE
        scale = torch.exp2(torch.randint(-12, 0, (rows, 1), generator=g) + torch.randint(-6, 0, (1, cols), generator=g))
        for s in (s0, s1):
            put(s, f"{name}/rc{rows}x{cols}", (scale * torch.rand(rows, cols, generator=g)).to(dt))
    for n in _INT_SIZES:
        put(s0, f"int/{n}", torch.arange(n))
        put(s1, f"int/{n}", torch.arange(n) + 1)
    return s0, s1


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _jobs(state: dict[str, torch.Tensor], bases: dict[str, torch.Tensor] | None,
          device: str | None = None) -> list[engine.StorageJob]:
    """Storage jobs of ``state`` (deltas against ``bases``); ``device``: the device the storages
    come from when they are host copies (the store's re-encoding codes pinned host copies of GPU
    storages)."""
    jobs = []
    for path, t in state.items():
        base = None if bases is None else _bytes(bases[path])
        ref = None if base is None else {"path": path}
        cols = t.shape[-1] if t.dim() == 2 else None
        jobs.append(engine.StorageJob(_bytes(t), t.dtype, path, device or str(t.device), base, ref, cols=cols))
    return jobs


def _encode(jobs: list[engine.StorageJob], pool: ThreadPoolExecutor) -> ContainerReader:
    """``jobs`` coded by the GPU writer (``fast``) into a container in memory, read back and validated."""
    buf = io.BytesIO()
    writer = ContainerWriter(buf)
    storages = _encode_mod.encode_storages(jobs, writer, pool, "fast")
    writer.finish({"format": "s4weights", "version": FORMAT_VERSION, "storages": storages, "tensors": [], "tree": None})
    reader = ContainerReader.from_bytes(buf.getvalue())
    validate_manifest(reader.manifest, reader.data_start, reader.data_end, set(CODECS))
    return reader


def _decode(reader: ContainerReader, jobs: list[engine.StorageJob], bases: dict[str, torch.Tensor] | None,
            device: torch.device, pool: Pool) -> None:
    """The GPU reader on ``reader``; every storage compared byte for byte with its job."""

    def resolve(ref: dict[str, Any], nbytes: int) -> torch.Tensor:
        assert bases is not None
        return _bytes(bases[ref["path"]])

    outs = _decode_mod.decode_storages(reader, reader.manifest["storages"], device, resolve if bases else None, pool)
    for out, job in zip(outs, jobs):
        if not torch.equal(out.to(job.raw.device), job.raw):
            raise RuntimeError(f"warm-up: {job.path} did not decode to its bytes")


def _sequence(s0: dict[str, torch.Tensor], s1: dict[str, torch.Tensor] | None, key: Any, device: torch.device,
              pool: Pool, on_stage: Callable[[tuple[str, Any]], None]) -> None:
    """Plain step, then (with ``s1``) a delta step against it, then both decoded; ``on_stage`` after each."""
    plain = _jobs(s0, None)
    r0 = _encode(plain, pool)
    on_stage(("plain", key))
    if s1 is not None:
        delta = _jobs(s1, s0)
        r1 = _encode(delta, pool)
        # the sample kernels of the delta-op choice take their aligned variant only when every
        # storage of the batch is whole 16-byte words (a model's usual case): such a batch too
        w0 = {k: v for k, v in s0.items() if v.numel() * v.element_size() % 16 == 0}
        w1 = {k: s1[k] for k in w0}
        _encode(_jobs(w1, w0), pool)
        if device.type == "cuda":  # a re-encoding: pinned host copies of both steps, both batches
            for a, b in ((s0, s1), (w0, w1)):
                h0 = {k: v.cpu().pin_memory() for k, v in a.items()}
                _encode(_jobs({k: v.cpu().pin_memory() for k, v in b.items()}, h0, str(device)), pool)
            if isinstance(key, int):  # the split's variants these states did not happen to need
                _plane_kernels.compile_split_variants(key, device)
        on_stage(("delta", key))
    _decode(r0, plain, None, device, pool)
    if s1 is not None:
        _decode(r1, delta, s0, device, pool)
    on_stage(("decode", key))


def stage_key(dtype: torch.dtype) -> Any:
    """The warm-up stage group a storage of ``dtype`` belongs to: its plane width for the float
    dtypes the planes kernels serve (2 or 4), else ``"bytes"``."""
    if dtype.is_floating_point and dtype.itemsize in (2, 4):
        return dtype.itemsize
    return "bytes"


def stage_keys(dtypes: Iterable[torch.dtype]) -> list[Any]:
    return sorted({stage_key(dt) for dt in dtypes} | {"bytes"}, key=str)


def record_path(device: torch.device, dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES) -> Path:
    """Where :func:`run` on a CUDA ``device`` records the kernels it loaded (for ``dtypes``), and
    where a later process's :func:`run` finds them (:mod:`s4w_core.gpu._kernel_record`)."""
    return _kernel_record.record_path(device, repr(stage_keys(dtypes)))


def run(device: torch.device, dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES,
        on_stage: Callable[[tuple[str, Any]], None] | None = None) -> None:
    """Code two synthetic steps (plain, then deltas) with the GPU writer on ``device`` and decode
    them with the GPU reader. One thread per plane width (and one for the byte storages), each on
    its own stream, so that their kernels compile side by side (Triton's compiler releases the GIL);
    ``on_stage((stage, key))`` is called as each group finishes a stage: ``("plain", 2)`` once the
    2-byte kernels of a plain save are compiled, then ``("delta", 2)``, then ``("decode", 2)`` (keys
    from :func:`stage_key`). On CUDA the kernels those steps loaded are recorded (:func:`record_path`);
    where a record is found, the warm-up loads its kernels instead and reports every stage done; where
    none is, the package's kernels compiled ahead for this Triton and GPU become it, if they apply
    (:func:`s4w_core.gpu.bundle.install`).
    Raises what the codec raises, or RuntimeError if a byte differs."""
    dtypes = tuple(dtypes)
    note = on_stage or (lambda stage: None)
    cuda = device.type == "cuda"
    record = record_path(device, dtypes) if cuda else None
    if record is not None and not record.exists():  # a first warm-up here: the package's compiled kernels, if they apply
        major, minor = torch.cuda.get_device_capability(device)
        bundle.install(major * 10 + minor, record, stage_keys(dtypes))
    preloaded: list[list[str]] = []  # (a record Triton refused part way: what it loaded before)
    if record is not None and _kernel_record.preload(device, record, preloaded):
        # every Triton kernel the stages below load is loaded; what a first save would still pay
        # is the first use of torch's and nvCOMP's own kernels (their modules load lazily): one
        # plain step of the synthetic state, on one thread, pays it here
        s0, _ = synthetic_states(device, dtypes, second=False)
        with Pool(2, "s4w-warm-up") as pool, torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.default_stream(device))  # the states' copies, made on that stream
            with torch.cuda.stream(stream):
                _encode(_jobs(s0, None), pool)
            stream.synchronize()
        for key in stage_keys(dtypes):
            for stage in ("plain", "delta", "decode"):
                note((stage, key))
        return
    s0, s1 = synthetic_states(device, dtypes)
    groups: dict[Any, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
    for path, t in s0.items():
        key = stage_key(t.dtype)
        g0, g1 = groups.setdefault(key, ({}, {}))
        g0[path] = t
        g1[path] = s1[path]
    with Pool(2, "s4w-warm-up") as pool:
        if not cuda:  # the tests' simulated GPU (TRITON_INTERPRET=1, a stand-in for nvCOMP): one after another
            for key, (g0, g1) in groups.items():
                _sequence(g0, g1, key, device, pool, note)
            return

        def one(key: Any) -> None:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.default_stream(device))  # the states' copies, made on that stream
            with torch.cuda.device(device), torch.cuda.stream(stream):
                _sequence(groups[key][0], groups[key][1], key, device, pool, note)
            stream.synchronize()

        with _kernel_record.Recorder(preloaded) as rec:
            with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="s4w-warm-up-group") as par:
                for f in [par.submit(one, key) for key in groups]:
                    f.result()
        assert record is not None
        rec.write(record)

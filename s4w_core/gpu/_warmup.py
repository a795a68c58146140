"""Compiling the GPU codec's Triton kernels before the first save needs them.

A process's first GPU save or load otherwise compiles every kernel variant it meets (the split,
probe, choice, gather and checksum kernels for each plane width and delta op; the merge kernels
on load): seconds with an empty Triton cache, inside the training loop. :func:`run` codes a small
synthetic state of each plane width with the GPU writer -- a plain step, then a delta step against
it (``xor`` and ``sub`` residuals, storages that stay plain), a byte storage above the writer's
CPU threshold and one below it -- into a container in memory, and decodes both with the GPU
reader, checking every byte. Nothing of the user's is touched, and the bytes any later save writes
are the same (the kernels are deterministic; warming changes only when they are compiled). Triton
keeps what it compiled in its on-disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``),
so a later process finds them there. :func:`s4w_core.gpu.warm_up` runs this on a background thread.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import torch

from s4w_core import engine
from s4w_core.codecs import CODECS
from s4w_core.format.container import FORMAT_VERSION, ContainerReader, ContainerWriter
from s4w_core.format.manifest import validate_manifest
from s4w_core.gpu import _decode, _encode

__all__ = ["DEFAULT_DTYPES", "run", "synthetic_states"]

#: plane dtypes warmed when none are named: the two plane widths (bf16 and fp16 share the 2-byte kernels)
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
#: element counts per dtype: odd and aligned sizes, one above a GPU segment
_SIZES = (3, 1000, (1 << 16) + 5, (1 << 20) + 7)
#: int64 element counts: 800 B (the writer's CPU path) and ~2 MiB (its GPU path)
_INT_SIZES = (100, (1 << 18) + 3)


def synthetic_states(device: torch.device, dtypes: Iterable[torch.dtype]) -> tuple[dict, dict]:
    """Two consecutive states like a training run's (weights that moved a little, a moment that
    changed entirely, integer tensors), on ``device``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    s0: dict[str, torch.Tensor] = {}
    s1: dict[str, torch.Tensor] = {}
    for dt in dtypes:
        name = str(dt).removeprefix("torch.")
        for n in _SIZES:
            w = torch.randn(n, generator=g)
            s0[f"{name}/w{n}"] = w.to(dt).to(device)
            s1[f"{name}/w{n}"] = (w * (1 + 1e-3 * torch.randn(n, generator=g))).to(dt).to(device)  # -> a delta
            s0[f"{name}/m{n}"] = torch.randn(n, generator=g).to(dt).to(device)
            s1[f"{name}/m{n}"] = torch.randn(n, generator=g).to(dt).to(device)  # -> plain
    for n in _INT_SIZES:
        s0[f"int/{n}"] = torch.arange(n, device=device)
        s1[f"int/{n}"] = torch.arange(n, device=device) + 1
    return s0, s1


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _round_trip(
    state: dict[str, torch.Tensor], bases: dict[str, torch.Tensor] | None, device: torch.device, pool: ThreadPoolExecutor
) -> None:
    """``state`` coded by the GPU writer (``fast``) as plain storages, or as deltas against
    ``bases``, into a container in memory; decoded by the GPU reader and compared byte for byte."""
    jobs = []
    for path, t in state.items():
        base = None if bases is None else _bytes(bases[path])
        jobs.append(engine.StorageJob(_bytes(t), t.dtype, path, str(t.device), base, None if base is None else {"path": path}))
    buf = io.BytesIO()
    writer = ContainerWriter(buf)
    storages = _encode.encode_storages(jobs, writer, pool, "fast")
    writer.finish({"format": "s4weights", "version": FORMAT_VERSION, "storages": storages, "tensors": [], "tree": None})
    reader = ContainerReader.from_bytes(buf.getvalue())
    validate_manifest(reader.manifest, reader.data_start, reader.data_end, set(CODECS))

    def resolve(ref: dict[str, Any], nbytes: int) -> torch.Tensor:
        assert bases is not None
        return _bytes(bases[ref["path"]])

    outs = _decode.decode_storages(reader, reader.manifest["storages"], device, resolve if bases else None, pool)
    for out, job in zip(outs, jobs):
        if not torch.equal(out.to(job.raw.device), job.raw):
            raise RuntimeError(f"warm-up: {job.path} did not decode to its bytes")


def run(device: torch.device, dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES) -> None:
    """Code two synthetic steps (plain, then deltas) with the GPU writer on ``device`` and decode
    them with the GPU reader, on a side stream. Raises what the codec raises, or RuntimeError if a
    byte differs."""
    s0, s1 = synthetic_states(device, tuple(dtypes))
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="s4w-warm-up") as pool:
        if stream is not None:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                _round_trip(s0, None, device, pool)
                _round_trip(s1, s0, device, pool)
            stream.synchronize()
        else:  # the tests' simulated GPU (TRITON_INTERPRET=1, a stand-in for nvCOMP)
            _round_trip(s0, None, device, pool)
            _round_trip(s1, s0, device, pool)

"""Compiling the GPU codec's Triton kernels before the first save needs them.

A process's first GPU save or load otherwise compiles every kernel variant it meets (the split,
probe, choice, gather and checksum kernels for each plane width and delta op; the merge kernels
on load): seconds with an empty Triton cache, inside the training loop. :func:`run` codes a small
synthetic state of each plane width through the public store API -- a plain step, a delta step
(``xor`` and ``sub`` residuals, storages that stay plain), a byte storage above the GPU writer's
CPU threshold and one below it -- on the device, and loads it back. The store is in memory
(``memory://``), its steps are deleted afterwards; nothing of the user's is touched, and the bytes
any later save writes are the same (the kernels are deterministic; warming changes only when they
are compiled). Triton keeps what it compiled in its on-disk cache (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), so a later process finds them there.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Iterable

import torch

from s4w_core.store import CheckpointStore

__all__ = ["DEFAULT_DTYPES", "run", "synthetic_states"]

#: plane dtypes warmed when none are named: the two plane widths (bf16 and fp16 share the 2-byte kernels)
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
#: element counts per dtype: odd and aligned sizes, one above a GPU segment
_SIZES = (3, 1000, (1 << 16) + 5, (1 << 20) + 7)


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
    for n in (100, (1 << 18) + 3):  # int64: 800 B (CPU path) and ~2 MiB (GPU path)
        s0[f"int/{n}"] = torch.arange(n, device=device)
        s1[f"int/{n}"] = torch.arange(n, device=device) + 1
    return s0, s1


def run(device: torch.device, dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES) -> None:
    """Save two synthetic steps into an in-memory store on ``device``'s GPU path and load them
    back, on a side stream; every step is deleted again. Raises what the codec raises. (A CPU
    ``device`` runs the same steps on the CPU path: what the tests on a machine without a GPU do.)"""
    s0, s1 = synthetic_states(device, tuple(dtypes))
    url = f"memory://s4w-warm-up-{uuid.uuid4().hex}"
    try:  # everything on this thread: no keyframe copy coded behind the save
        st = CheckpointStore(url, keyframe_copy=False)
    except TypeError:  # a store without keyframe copies
        st = CheckpointStore(url)
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    try:
        with contextlib.ExitStack() as ctx:
            if cuda:
                ctx.enter_context(torch.cuda.device(device))
                ctx.enter_context(torch.cuda.stream(stream))
            st.save(s0, step=0)
            st.save(s1, step=1)
            for step, want in ((1, s1), (0, s0)):
                back = st.load(step, map_location=device)
                if any(not torch.equal(back[k], v) for k, v in want.items()):
                    raise RuntimeError(f"warm-up: step {step} did not load back bit-exactly")
        if stream is not None:
            stream.synchronize()
    finally:
        for step in st.steps():
            st.delete(step)

"""The launch tables of the batched plane kernels start 16-byte aligned whatever their sizes.

Triton specializes a kernel on whether each pointer argument is 16-byte aligned: a table whose
alignment followed the sizes of the tables uploaded before it would make the kernel variants a save
compiles depend on its data, which the GPU warm-up cannot know (tests/parity/test_gpu_warmup.py
checks that a save after the warm-up compiles nothing; this checks the layout that makes it so,
without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from s4w_core.planes.triton_kernels import Tables  # noqa: E402


@pytest.mark.parametrize("seed", range(5))
def test_every_table_starts_on_a_16_byte_boundary_and_keeps_its_values(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tables = Tables()
    parts: list[np.ndarray] = []
    for _ in range(12):
        n = int(rng.integers(0, 9))
        a = rng.integers(-(2**40), 2**40, size=n, dtype=np.int64) if rng.random() < 0.5 else rng.integers(0, 2**30, size=n, dtype=np.int32)
        parts.append(a)
        tables.add(a)
    views = tables.upload(torch.device("cpu"))
    base = views[0].untyped_storage().data_ptr()
    for a, v in zip(parts, views):
        assert (v.data_ptr() - base) % 16 == 0, (len(a), a.dtype)
        assert v.dtype == (torch.int32 if a.dtype == np.int32 else torch.int64)
        assert np.array_equal(v.numpy()[: len(a)], a)  # an int32 map may carry one zero of padding
        assert v.numel() - len(a) in ((0, 1) if a.dtype == np.int32 else (0,))

"""Which GPU saves work within a tenth of the state (``_encode.host_work``): those that move host
storages to the device, whatever device the storages came from, since such saves run beside training."""

from __future__ import annotations

import pytest
import torch

from s4w_core.gpu import _encode, _nvcomp
from s4w_core.jobs import StorageJob


def _job(n: int, device: str, path: str) -> StorageJob:
    return StorageJob(torch.zeros(n, dtype=torch.uint8), torch.bfloat16, path, device)


@pytest.mark.parametrize("origin", ["cuda:0", "cpu"])
def test_host_storages_coded_on_the_gpu_get_the_work_bound(origin: str) -> None:
    # a store's pinned copies of CUDA storages ("cuda:0") and DCP's staged copies (host tensors)
    jobs = [_job(3 << 20, origin, "w"), _job(1 << 20, origin, "m"), _job(100, "cpu", "step")]
    total = sum(j.raw.numel() for j in jobs)
    assert _encode.host_work(jobs, [False, False, True]) == _nvcomp.work_bytes(total)
    # only storages the CPU path codes: nothing moves to the device
    assert _encode.host_work(jobs, [True, True, True]) is None


def test_device_storages_keep_the_default_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [_job(3 << 20, "cuda:0", "w"), _job(100, "cpu", "step")]
    monkeypatch.setattr(_encode, "_on_device", lambda t: t is jobs[0].raw)  # the first lives on the GPU
    assert _encode.host_work(jobs, [False, True]) is None  # a blocking save between steps
    assert _encode.host_work(jobs, [False, False]) == _nvcomp.work_bytes(sum(j.raw.numel() for j in jobs))

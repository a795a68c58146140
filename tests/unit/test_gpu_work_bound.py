"""Which GPU saves work within a tenth of the state (``_encode.host_work``): those that move host
storages to the device, whatever device the storages came from, since such saves run beside training."""

from __future__ import annotations

from typing import Any

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


def test_a_save_a_caller_waits_for_gets_the_default_batch() -> None:
    # a store's re-encoding behind the end of training's wait(): no training step runs beside it
    from s4w_core.workers import foreground

    jobs = [_job(3 << 20, "cuda:0", "w"), _job(100, "cpu", "step")]
    waiting = [False]
    with foreground(lambda: waiting[0]):
        assert _encode.host_work(jobs, [False, False]) == _nvcomp.work_bytes(sum(j.raw.numel() for j in jobs))
        waiting[0] = True
        assert _encode.host_work(jobs, [False, False]) is None


@pytest.mark.gpu
def test_gpu_a_save_of_host_copies_takes_larger_batches_once_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU save of host storages codes within the work bound (many small batches) until a caller
    waits for it; from then on, in the default batch (fewer calls); the same bytes decode either way."""
    import io

    import s4w_core
    from s4w_core import pipeline
    from s4w_core.workers import foreground

    if pipeline.gpu_backend() is None:
        pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16) for i in range(64)}  # 64 MiB
    calls: list[int] = []
    real = _encode._run_batch  # noqa: SLF001 - the batches, counted

    def counted(batch: Any, *a: Any, **k: Any) -> Any:
        calls.append(batch.nbytes)
        return real(batch, *a, **k)

    monkeypatch.setattr(_encode, "_run_batch", counted)
    counts = []
    for waited in (False, True):
        calls.clear()
        buf = io.BytesIO()
        with foreground(lambda waited=waited: waited):
            s4w_core.save(state, buf, profile="fast")
        counts.append(len(calls))
        back = s4w_core.load(buf.getvalue(), map_location="cpu")
        assert all(torch.equal(back[k].view(torch.uint16), v.view(torch.uint16)) for k, v in state.items())
    assert counts[1] * 4 <= counts[0], counts

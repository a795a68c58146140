"""@gpu: the GPU writer's nonzero transform (docs/FORMAT.md 4.5c) on CUDA tensors, bit for bit: Adam-moment-like
tensors (zero rows) and sparse fp32 deltas, read back by the GPU reader and, for the portable profile, by the CPU
reader; CPU-written nz files read by the GPU reader. The same paths run without a GPU, nvCOMP simulated, in
tests/parity/_interpret_checks.py (``pipeline_nonzero``).

Run on the device (`bash benchmarks/device_run.sh WHEELDIR tests`); skipped without CUDA.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import s4w_core
from s4w_core.choice import NonzeroTrial
from tests.parity._interpret_checks import assert_same, moments_like

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("S4W_DISABLE_GPU", raising=False)
    import s4w_core.gpu as gpu

    if not gpu.available():
        pytest.skip(f"GPU backend unavailable: {gpu.unavailable_reason()}")


def _storages(data: bytes) -> dict[str, dict[str, Any]]:
    return {s["path"]: s for s in s4w_core.api.open_reader(data).manifest["storages"]}


@pytest.mark.parametrize("profile", ["fast", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_moments_written_nonzero_on_gpu(profile: str, dtype: torch.dtype) -> None:
    from s4w_core.gpu._nonzero import NZ_TRANSFORM

    m = moments_like(dtype, 3000, 384, seed=1).view(3000, 384).cuda()
    d = torch.randn(200_000, device="cuda").to(dtype)
    obj = {"m": m, "d": d}
    buf = io.BytesIO()
    s4w_core.save(obj, buf, profile=profile)
    data = buf.getvalue()
    st = _storages(data)
    assert st["m"]["transform"] == NZ_TRANSFORM and st["d"]["transform"] != NZ_TRANSFORM
    assert ("nvcomp-ans" if profile == "fast" else "deflate") in {c[0] for c in st["m"]["chunks"]}
    back = s4w_core.load(data, map_location="cuda")
    assert back["m"].is_cuda
    assert_same(obj, back)
    if profile == "portable":  # GPU-written, CPU-read
        cpu = _load_cpu(data)
        for k, v in obj.items():
            assert torch.equal(cpu[k].view(torch.uint8), v.cpu().reshape(-1).view(torch.uint8)), k


def _load_cpu(data: bytes) -> dict[str, torch.Tensor]:
    """The CPU reader's decode of every storage, as CPU tensors by path (no GPU backend involved)."""
    from s4w_core import engine

    reader = s4w_core.api.open_reader(data)
    out: dict[str, torch.Tensor] = {}
    with engine.executor(2) as pool:
        for s in reader.manifest["storages"]:
            raw = engine.decode_storage_cpu(reader, s, pool, None, reader.name)
            out[s["path"]] = raw.view(engine.dtype_from_name(s["dtype"]))
    return out


def test_sparse_fp32_delta_nonzero_on_gpu() -> None:
    from s4w_core.gpu._nonzero import NZ_TRANSFORM

    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(1 << 20, generator=g)
    w1 = w0.clone()
    idx = torch.randint(0, w1.numel(), (w1.numel() // 100,), generator=g)
    w1[idx] = w1[idx] * 1.01 + 1e-4
    base = w0.view(torch.uint8).cuda()

    def lookup(path: str, nbytes: int, dtype: str) -> Any:
        return (base, {"ref": path}) if nbytes == base.numel() else None

    def resolve(ref_: dict[str, Any], nbytes: int) -> torch.Tensor:
        return base

    buf = io.BytesIO()
    s4w_core.save({"w": w1.cuda()}, buf, profile="fast", _base_lookup=lookup)
    st = _storages(buf.getvalue())["w"]
    assert st["transform"] == NZ_TRANSFORM and st["delta"]
    back = s4w_core.load(buf.getvalue(), map_location="cuda", _resolve_base=resolve)
    assert torch.equal(back["w"].cpu().view(torch.int32), w1.view(torch.int32))


def test_cpu_written_nonzero_read_by_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from s4w_core import engine

    monkeypatch.setattr(engine, "nonzero_trial", lambda *a, **k: NonzeroTrial(True))
    m = moments_like(torch.bfloat16, 1000, 384, seed=2)
    buf = io.BytesIO()
    s4w_core.save({"m": m}, buf, profile="portable")
    assert _storages(buf.getvalue())["m"]["transform"] == "nz-planes-rotl1"
    back = s4w_core.load(buf.getvalue(), map_location="cuda")
    assert back["m"].is_cuda and torch.equal(back["m"].cpu().view(torch.int16), m.view(torch.int16))

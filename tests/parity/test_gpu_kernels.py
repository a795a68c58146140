"""@gpu: the compiled Triton kernels on the device against the CPU reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from s4w_core import checksum as ck
from s4w_core import delta
from s4w_core.planes import reference as ref
from tests.parity._interpret_checks import all16, fp32_patterns

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tk():
    pytest.importorskip("triton")
    from s4w_core.planes import triton_kernels

    return triton_kernels


def _check(tk, raw_cpu: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    base_cpu = torch.randint(0, 256, (raw_cpu.numel(),), dtype=torch.uint8, generator=g)
    raw = raw_cpu.cuda()
    for b_cpu, op in ((None, "xor"), (base_cpu, "xor"), (base_cpu, "sub")):
        b = b_cpu.cuda() if b_cpu is not None else None
        planes = tk.split_planes(raw, dtype, b, op)
        resid = delta.forward(op, raw_cpu, b_cpu, dtype) if b_cpu is not None else raw_cpu
        exp = ref.split_planes(resid, dtype)
        assert torch.equal(planes.cpu(), exp), op
        back = tk.merge_planes(exp.cuda(), dtype, b, op)
        assert torch.equal(back.cpu(), raw_cpu), op


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern(tk, dtype):
    _check(tk, all16(), dtype, 1)


def test_fp32_specials_and_4m_random(tk):
    _check(tk, fp32_patterns(4 << 20, seed=2), torch.float32, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 2, 15, 17, 4095, 4097, 1 << 20, (1 << 20) + 3])
def test_sizes_and_adversarial(tk, dtype, n):
    w = ref.plane_width(dtype)
    g = torch.Generator().manual_seed(n)
    for fill in ("random", "zeros", "ones"):
        if fill == "random":
            raw = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g)
        else:
            raw = torch.full((n * w,), 0 if fill == "zeros" else 0xFF, dtype=torch.uint8)
        _check(tk, raw, dtype, n)


def test_fold64_on_device():
    pytest.importorskip("triton")
    from s4w_core.gpu import kernels

    g = torch.Generator().manual_seed(5)
    for n in (0, 1, 3, 4, 5, 4096, 8191, 1 << 20, (1 << 24) + 3):
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        want = ck.fold64(x)
        assert kernels.fold64(x.cuda()) == want, n
        assert ck.fold64(x.cuda()) == want, n
        if n > 2:
            assert kernels.fold64(x.cuda()[1:]) == ck.fold64(x[1:].clone()), n


def test_gather_copy_on_device():
    pytest.importorskip("triton")
    from s4w_core.gpu import kernels

    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    so, do, ln = [0, 16, 77, 500_000], [64, 100_000, 300_001, 600_000], [16, 99_000, 123_457, 300_000]
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    exp = dst.clone()
    for a, b, n in zip(so, do, ln):
        exp[b : b + n] = src[a : a + n]
    d = dst.cuda()
    kernels.gather_copy(src.cuda(), d, so, do, ln)
    assert torch.equal(d.cpu(), exp)


def test_batched_launches_on_device():
    pytest.importorskip("triton")
    from tests.parity._interpret_checks import batched_kernels_vs_reference

    batched_kernels_vs_reference("cuda")


def test_encode_choice_on_device():
    pytest.importorskip("triton")
    from tests.parity._interpret_checks import encode_choice_vs_numpy

    encode_choice_vs_numpy("cuda")


def test_plain_planes_kernels_on_device():
    """The split (per-item flags), merge and in-place chunk merge under ``planes`` against the CPU
    reference, compiled (the interpreted check ``plain_kernels`` runs the same in CI)."""
    pytest.importorskip("triton")
    from tests.parity._interpret_checks import plain_kernels_vs_reference

    plain_kernels_vs_reference("cuda")


def test_merge_chunks_on_device():
    pytest.importorskip("triton")
    from tests.parity._interpret_checks import merge_chunks_vs_reference

    merge_chunks_vs_reference("cuda")

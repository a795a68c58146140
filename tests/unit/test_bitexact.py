"""Bit-exactness: every 16-bit float pattern, fp32 specials and millions of random fp32 patterns,
through the plane transform and through the public save/load (several segments, with and without
an XOR delta base)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from s4w_core import engine
from s4w_core.planes import merge_planes, split_planes
from tests.unit.helpers import assert_same_tensor, bits, roundtrip

# ----------------------------------------------------------------------------- patterns
ALL16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)  # all 65,536 patterns

FP32_SPECIALS = [
    0x00000000, 0x80000000,  # +0, -0
    0x7F800000, 0xFF800000,  # +inf, -inf
    0x7FC00000, 0xFFC00000,  # canonical quiet NaNs
    0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FD55555,  # quiet NaNs with payloads
    0x7F800001, 0x7FA00000, 0xFF800001, 0x7FBFFFFF,  # signalling NaNs with payloads
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00400000,  # denormals, smallest/largest
    0x00800000, 0x80800000,  # smallest normals
    0x7F7FFFFF, 0xFF7FFFFF,  # largest finite
    0x3F800000, 0xBF800000, 0x40000000, 0xC0000000,  # ±1, ±2
    0x33800000, 0x4B000000, 0x3EAAAAAB,  # 2^-24, 2^23, 1/3
]


def fp32_specials() -> torch.Tensor:
    vals = [v - (1 << 32) if v >= 1 << 31 else v for v in FP32_SPECIALS]
    return torch.tensor(vals, dtype=torch.int32).view(torch.float32)


def random_fp32(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int64, generator=g).to(torch.int32).view(torch.float32)


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force many segments per storage so segment boundaries are exercised on small tensors."""
    monkeypatch.setattr(engine, "SEGMENT_ELEMS", 4093)


# ----------------------------------------------------------------------------- 16-bit floats
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_16bit_patterns_planes(dtype: torch.dtype) -> None:
    x = ALL16.view(dtype)
    planes = split_planes(bits(x), dtype)
    assert planes.shape == (2, 65536)
    assert torch.equal(merge_planes(planes, dtype), bits(x))
    # the transform is a bijection: distinct patterns give distinct (plane0, plane1) pairs
    pairs = planes[0].to(torch.int32) * 256 + planes[1].to(torch.int32)
    assert pairs.unique().numel() == 65536


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("segmented", [False, True])
def test_all_16bit_patterns_save_load(dtype: torch.dtype, segmented: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if segmented:
        monkeypatch.setattr(engine, "SEGMENT_ELEMS", 4093)
    x = ALL16.view(dtype).clone()
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(7))
    obj = {"ordered": x, "shuffled": x[perm].clone(), "matrix": x.reshape(256, 256).t()}
    out = roundtrip(obj)
    for k in obj:
        assert_same_tensor(obj[k], out[k])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_16bit_patterns_delta(dtype: torch.dtype, small_segments: None) -> None:
    """The XOR delta path (as the store uses it) is bit-exact against every base pattern too."""
    x = ALL16.view(dtype).clone()
    flips = torch.randint(0, 4, (65536,), dtype=torch.int16, generator=torch.Generator().manual_seed(3))
    base = (ALL16 ^ flips).view(dtype)  # a close base: the writer picks the delta
    out, used = _delta_roundtrip(x, base)
    assert used
    assert_same_tensor(x, out)


def _delta_roundtrip(x: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Save ``x`` with ``base`` offered as delta base (near-identical so the delta is chosen), load it back."""
    import io

    import s4w_core

    base_raw = bits(base)
    ref = {"step": 0, "path": "x"}

    def lookup(path: str, nbytes: int, dtype: str) -> tuple[torch.Tensor, dict] | None:
        assert nbytes == base_raw.numel()
        return base_raw, ref

    buf = io.BytesIO()
    rep = s4w_core.save({"x": x}, buf, profile="portable", _base_lookup=lookup)

    def resolve(r: dict, nbytes: int) -> torch.Tensor:
        assert r == ref
        return base_raw

    return s4w_core.load(buf.getvalue(), _resolve_base=resolve)["x"], rep.delta_tensors == 1


def test_delta_is_used_and_exact_for_close_checkpoints() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(100_000, generator=g).to(torch.bfloat16)
    x = (base.float() + 1e-3 * torch.randn(100_000, generator=g)).to(torch.bfloat16)
    import io

    import s4w_core

    buf = io.BytesIO()
    rep = s4w_core.save({"x": x}, buf, profile="portable", _base_lookup=lambda p, n, d: (bits(base), {"b": 1}))
    assert rep.delta_tensors == 1
    with pytest.raises(s4w_core.BaseMismatchError):
        s4w_core.load(buf.getvalue())
    wrong = bits(base).clone()
    wrong[5] ^= 1
    with pytest.raises(s4w_core.ChecksumMismatchError):
        s4w_core.load(buf.getvalue(), _resolve_base=lambda r, n: wrong)
    out = s4w_core.load(buf.getvalue(), _resolve_base=lambda r, n: bits(base))["x"]
    assert_same_tensor(x, out)


# ----------------------------------------------------------------------------- fp32
def test_fp32_specials_roundtrip(small_segments: None) -> None:
    x = fp32_specials()
    out = roundtrip({"x": x, "rev": x.flip(0).clone()})
    assert_same_tensor(x, out["x"])
    assert torch.equal(bits(out["rev"]), bits(x.flip(0)))


def test_fp32_specials_planes_are_exponent_first() -> None:
    """plane 0 of fp32 is exactly the 8-bit exponent field (docs/FORMAT.md)."""
    x = fp32_specials()
    p = split_planes(bits(x), torch.float32)
    exp = (x.view(torch.int32) >> 23) & 0xFF
    assert torch.equal(p[0].to(torch.int32), exp)
    sign = (x.view(torch.int32) >> 31) & 1
    assert torch.equal((p[3] & 1).to(torch.int32), sign)


def test_fp32_random_patterns_planes_4m() -> None:
    """4 Mi random fp32 bit patterns (all exponents incl. NaN/Inf/denormal) through the transform."""
    x = random_fp32(1 << 22, seed=11)
    raw = bits(x)
    assert torch.equal(merge_planes(split_planes(raw, torch.float32), torch.float32), raw)


def test_fp32_random_patterns_save_load_2m(small_segments: None) -> None:
    """2 Mi random fp32 patterns through save/load, cut into ~500 segments."""
    x = torch.cat([fp32_specials(), random_fp32(1 << 21, seed=12)])
    assert_same_tensor(x, roundtrip({"x": x})["x"])


@pytest.mark.slow
def test_fp32_random_patterns_save_load_16m() -> None:
    x = random_fp32(1 << 24, seed=13)
    assert_same_tensor(x, roundtrip({"x": x})["x"])


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    data=st.binary(min_size=0, max_size=4096),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_planes_property_any_bytes(dtype: torch.dtype, data: bytes, seed: int) -> None:
    """split/merge invert each other on arbitrary bytes, with and without a delta base."""
    w = torch.empty((), dtype=dtype).element_size()
    n = len(data) // w * w
    raw = torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    base = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    p = split_planes(raw, dtype)
    assert p.shape == (w, n // w)
    assert torch.equal(merge_planes(p, dtype), raw)
    pd = split_planes(raw, dtype, base)
    assert torch.equal(merge_planes(pd, dtype, base), raw)
    # a delta against itself is all zeros
    assert int(split_planes(raw, dtype, raw).count_nonzero()) == 0


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int64, torch.bool]),
    n=st.integers(min_value=0, max_value=3000),
    seed=st.integers(min_value=0, max_value=2**31),
    seg=st.sampled_from([1, 7, 64, 1 << 20]),
)
def test_save_load_property(dtype: torch.dtype, n: int, seed: int, seg: int) -> None:
    """Random bytes of any length, any segment size: save/load gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    x = raw.view(dtype)
    old = engine.SEGMENT_ELEMS
    engine.SEGMENT_ELEMS = seg
    try:
        out = roundtrip({"x": x})["x"]
    finally:
        engine.SEGMENT_ELEMS = old
    assert_same_tensor(x, out)

"""Delta ops are exact inverses on every bit pattern, and the encoder picks them where they pay."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import s4w_core
from s4w_core import delta, engine


def _oracle_sub(raw: torch.Tensor, base: torch.Tensor, bits: int) -> torch.Tensor:
    """The definition in s4w_core/delta.py, widened to int64 (no wrap-around anywhere)."""
    def words(u8: torch.Tensor) -> torch.Tensor:
        it = torch.int16 if bits == 16 else torch.int32
        return u8.view(it).to(torch.int64) & ((1 << bits) - 1)

    top, full = 1 << (bits - 1), (1 << bits) - 1

    def ordr(u: torch.Tensor) -> torch.Tensor:
        return torch.where((u & top) != 0, u ^ full, u ^ top)

    d = (ordr(words(raw)) - ordr(words(base))) & full
    sgn = d - ((d & top) << 1)
    z = ((sgn << 1) ^ (sgn >> (bits - 1))) & full
    z = z - ((z & top) << 1)
    return z.to(torch.int16 if bits == 16 else torch.int32).view(torch.uint8)


DTYPES = {"bfloat16": (torch.bfloat16, torch.int16), "float16": (torch.float16, torch.int16), "float32": (torch.float32, torch.int32)}


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(DTYPES)),
    data=st.data(),
)
def test_forward_inverse_exact(name: str, data) -> None:  # type: ignore[no-untyped-def]
    dt, it = DTYPES[name]
    bits = 16 if it == torch.int16 else 32
    ints = st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    n = data.draw(st.integers(0, 64))
    x = torch.tensor(data.draw(st.lists(ints, min_size=n, max_size=n)), dtype=torch.int64).to(it)
    b = torch.tensor(data.draw(st.lists(ints, min_size=n, max_size=n)), dtype=torch.int64).to(it)
    assert torch.equal(delta.forward("sub", x.view(torch.uint8), b.view(torch.uint8), dt), _oracle_sub(x.view(torch.uint8), b.view(torch.uint8), bits))
    for op in delta.OPS:
        r = delta.forward(op, x.view(torch.uint8), b.view(torch.uint8), dt)
        assert r.dtype == torch.uint8 and r.numel() == x.numel() * x.element_size()
        assert torch.equal(delta.inverse(op, r, b.view(torch.uint8), dt), x.view(torch.uint8))


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("host_path", ["numpy", "torch"])
def test_numpy_and_torch_paths_match_the_definition(name: str, host_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small host tensors run through numpy, the rest through torch: both give the definition's
    residuals and invert exactly, at sizes around the switch and with every sign/extreme pattern."""
    dt, it = DTYPES[name]
    bits = 16 if it == torch.int16 else 32
    monkeypatch.setattr(delta, "_NUMPY_BYTES", 1 << 40 if host_path == "numpy" else -1)
    g = torch.Generator().manual_seed(7)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    edge = torch.tensor([lo, lo + 1, -1, 0, 1, hi - 1, hi], dtype=torch.int64)
    for n in (1, 7, 4096, 70001):
        x = torch.cat([edge, torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64)]).to(it)
        b = torch.cat([edge.flip(0), torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64)]).to(it)
        r = delta.forward("sub", x.view(torch.uint8), b.view(torch.uint8), dt)
        assert torch.equal(r, _oracle_sub(x.view(torch.uint8), b.view(torch.uint8), bits))
        assert torch.equal(delta.inverse("sub", r, b.view(torch.uint8), dt), x.view(torch.uint8))


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_sub_small_moves_give_small_residuals(name: str) -> None:
    dt, it = DTYPES[name]
    b = torch.linspace(-3, 3, 4001).to(dt)  # crosses zero (sign flips) and many exponents
    x = torch.nextafter(b.float(), torch.tensor(float("inf"))).to(dt) if dt == torch.float32 else (b.view(it) + 1).view(dt)
    r = delta.forward("sub", x.view(torch.uint8), b.view(torch.uint8), dt).view(it)
    # +1 ulp in pattern order: residual 2 (zigzag), except where +1 pattern steps wrap at the sign
    assert (r.to(torch.int64).abs() <= 2).float().mean() > 0.99


def test_special_patterns_roundtrip_through_a_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from s4w_core.store import CheckpointStore

    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 3e38, -3e38])
    payloads = torch.tensor([0x7FC00001, -0x7FFFFFFF, 0x7F800001], dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(1)
    x0 = torch.cat([specials, payloads, torch.randn(20000, generator=g) * 0.02])
    x1 = torch.cat([specials.flip(0), payloads.flip(0), x0[12:] + 1e-5 * torch.randn(20000, generator=g)])
    st = CheckpointStore(str(tmp_path / "s"), profile="portable")
    states = []
    for i, x in enumerate((x0, x1)):
        s = {dt: x.to(dt) for dt in ("float32", "bfloat16", "float16") for dt in [getattr(torch, dt)]}
        states.append({str(k): v for k, v in s.items()})
        st.save(states[-1], i)
    st.wait()  # step 0 becomes a delta against step 1 behind the save
    assert st.info(0).kind == "delta" and st.info(0).base_step == 1 and st.info(0).delta_ops.get("sub", 0) >= 1
    fresh = CheckpointStore(str(tmp_path / "s"))
    for i, s in enumerate(states):
        got = fresh.load(i)
        for k, v in s.items():
            assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), (i, k)


def test_encoder_chooses_sub_for_slow_drift_and_plain_for_noise() -> None:
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(1 << 16, generator=g) * 0.02).to(torch.bfloat16)
    drift = (base.float() + 1e-4 * torch.randn(1 << 16, generator=g)).to(torch.bfloat16)
    noise = torch.randn(1 << 16, generator=g).to(torch.bfloat16)
    job = engine.StorageJob(drift.view(torch.uint8), torch.bfloat16, "w", "cpu", base.view(torch.uint8), {})
    assert engine.choose_delta_op(job, "planes-rotl1") == "sub"
    assert engine.choose_delta_op(job, "planes-rotl1", ("xor",)) == "xor"
    job2 = engine.StorageJob(noise.view(torch.uint8), torch.bfloat16, "m", "cpu", base.view(torch.uint8), {})
    assert engine.choose_delta_op(job2, "planes-rotl1") is None
    ints = torch.arange(1000)
    job3 = engine.StorageJob(ints.view(torch.uint8), torch.int64, "i", "cpu", ints.view(torch.uint8), {})
    assert engine.choose_delta_op(job3, "bytes") == "xor"  # sub does not apply to ints


def test_manifest_rejects_unknown_op_and_sub_on_bytes() -> None:
    from s4w_core.errors import ManifestError

    buf = io.BytesIO()
    s4w_core.save({"x": torch.ones(10)}, buf)
    from s4w_core.format.container import ContainerReader
    from s4w_core.format.manifest import validate_manifest

    r = ContainerReader.from_bytes(buf.getvalue())
    m = r.manifest
    m["storages"][0]["delta"] = {"op": "rot", "base": {}}
    with pytest.raises(ManifestError, match="unknown delta"):
        validate_manifest(m, r.data_start, r.data_end, {"raw", "deflate", "zstd", "nvcomp-ans"})
    m["storages"][0]["delta"] = {"op": "sub", "base": {}}
    validate_manifest(m, r.data_start, r.data_end, {"raw", "deflate", "zstd", "nvcomp-ans"})
    np.testing.assert_equal(m["storages"][0]["transform"], "planes-rotl1")

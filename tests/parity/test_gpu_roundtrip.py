"""@gpu: s4w_core.save/load through the GPU backend on CUDA tensors, bit for bit, and cross-decoding.

Run on the device (`bash benchmarks/device_run.sh WHEELDIR tests`); skipped without CUDA.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch

import s4w_core
from tests.parity._interpret_checks import all16, assert_same, fp32_patterns, sample_state
from tests.unit.helpers import deflate_plane0

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu_backend(monkeypatch):
    monkeypatch.delenv("S4W_DISABLE_GPU", raising=False)
    import s4w_core.gpu as gpu

    if not gpu.available():
        pytest.skip(f"GPU backend unavailable: {gpu.unavailable_reason()}")


def to_cuda(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cuda()
    if isinstance(obj, dict):
        return {k: to_cuda(v) for k, v in obj.items()}
    return obj


def roundtrip(obj: Any, profile: str, **load_kw: Any) -> tuple[Any, dict[str, Any], bytes]:
    buf = io.BytesIO()
    rep = s4w_core.save(obj, buf, profile=profile)
    assert rep.profile == profile
    data = buf.getvalue()
    return s4w_core.load(data, **load_kw), s4w_core.info(data), data


ALL_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def _random_of(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    nbytes = (
        torch.empty((), dtype=dtype).element_size() * int(torch.tensor(shape).prod())
        if shape
        else (torch.empty((), dtype=dtype).element_size())
    )
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("profile", ["fast", "portable"])
def test_sample_state_roundtrip(profile):
    obj = to_cuda(sample_state())
    back, info, _ = roundtrip(obj, profile)
    assert_same(obj, back)
    assert all(t.device.type == "cuda" for t in back.values() if isinstance(t, torch.Tensor))
    assert info["writer"].get("nvcomp"), "nvCOMP version must be recorded"
    if profile == "fast":
        assert "nvcomp-ans" in str(info["codecs"])
    else:
        assert "nvcomp-ans" not in str(info["codecs"]) and "deflate" in str(info["codecs"])


@pytest.mark.parametrize("profile", ["fast", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern(profile, dtype):
    x = all16().view(dtype).cuda()
    obj = {"x": x, "x2": x.view(256, 256).t(), "rev": x.flip(0)}
    back, _, _ = roundtrip(obj, profile)
    assert_same(obj, back)


@pytest.mark.parametrize("profile", ["fast", "portable"])
def test_fp32_specials_and_4m_random(profile):
    obj = {"x": fp32_patterns(4 << 20, seed=12).view(torch.float32).cuda()}
    back, _, _ = roundtrip(obj, profile)
    assert_same(obj, back)


@pytest.mark.parametrize("profile", ["fast", "portable"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype(profile, dtype):
    g = torch.Generator().manual_seed(hash(str(dtype)) % 1000)
    obj = {
        "big": _random_of(dtype, (3, 100_003), g).cuda(),
        "small": _random_of(dtype, (17,), g).cuda(),
        "scalar": _random_of(dtype, (), g).cuda(),
        "empty": torch.empty(0, 5, dtype=dtype, device="cuda"),
    }
    obj["view"] = obj["big"][:, 1::7]
    back, _, _ = roundtrip(obj, profile)
    assert_same(obj, back)
    assert back["view"].untyped_storage().data_ptr() == back["big"].untyped_storage().data_ptr()


def test_multi_batch(monkeypatch):
    monkeypatch.setenv("S4W_GPU_BATCH_BYTES", str(1 << 20))
    g = torch.Generator().manual_seed(3)
    obj = {f"t{i}": torch.randn(50_000 + 7 * i, generator=g).to(torch.bfloat16).cuda() for i in range(30)}
    obj["huge"] = torch.randn(3_000_001, generator=g).cuda()
    for profile in ("fast", "portable"):
        back, _, _ = roundtrip(obj, profile)
        assert_same(obj, back)


def test_portable_gpu_written_decodes_on_cpu_path(monkeypatch):
    obj = to_cuda(sample_state(21))
    buf = io.BytesIO()
    s4w_core.save(obj, buf, profile="portable")
    data = buf.getvalue()
    monkeypatch.setenv("S4W_DISABLE_GPU", "1")
    back = s4w_core.load(data, map_location="cpu")
    assert_same(obj, back)
    assert all(t.device.type == "cpu" for t in back.values() if isinstance(t, torch.Tensor))
    assert s4w_core.verify(data).ok


@pytest.mark.parametrize("plane0", ["zstd", "deflate"])
@pytest.mark.parametrize("gpu_inflate", ["1", "0"])
def test_cpu_written_decodes_on_gpu(monkeypatch, gpu_inflate, plane0):
    """The CPU writer's zstd planes (decoded on the host, then merged on the GPU), and deflate
    planes as the CPU writer of 0.1.0 wrote them."""
    monkeypatch.setenv("S4W_GPU_INFLATE", gpu_inflate)  # deflate chunks by nvCOMP, or on the CPU
    obj = sample_state(22)
    buf = io.BytesIO()
    with deflate_plane0() if plane0 == "deflate" else contextlib.nullcontext():
        s4w_core.save(obj, buf, profile="portable")  # CPU tensors: the CPU writer
    assert plane0 in s4w_core.info(buf.getvalue())["codecs"]["planes-rotl1[0]"]
    back = s4w_core.load(buf.getvalue(), map_location="cuda")
    assert all(t.device.type == "cuda" for t in back.values() if isinstance(t, torch.Tensor))
    assert_same(obj, back)


def test_fast_file_with_gpu_disabled_says_how_to_convert(monkeypatch):
    buf = io.BytesIO()
    s4w_core.save({"w": torch.randn(10_000, device="cuda").to(torch.bfloat16)}, buf, profile="fast")
    monkeypatch.setenv("S4W_DISABLE_GPU", "1")
    with pytest.raises(s4w_core.BackendUnavailableError, match="convert"):
        s4w_core.load(buf.getvalue(), map_location="cpu")
    with pytest.raises(s4w_core.BackendUnavailableError):
        s4w_core.save({"w": torch.ones(3)}, io.BytesIO(), profile="fast")


def test_corrupt_chunk_refused_before_gpu_decoder(monkeypatch):
    from s4w_core.gpu import _nvcomp

    buf = io.BytesIO()
    s4w_core.save({"w": torch.randn(300_000, device="cuda").to(torch.bfloat16)}, buf, profile="fast")
    data = bytearray(buf.getvalue())
    reader = s4w_core.api.open_reader(bytes(data))
    chunk = next(c for c in reader.manifest["storages"][0]["chunks"] if c[0] == "nvcomp-ans")
    calls = []
    orig = _nvcomp.decode_batch
    monkeypatch.setattr(_nvcomp, "decode_batch", lambda *a: calls.append(1) or orig(*a))
    for pos in (chunk[1], chunk[1] + chunk[2] // 2, chunk[1] + chunk[2] - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        with pytest.raises(s4w_core.ChecksumMismatchError):
            s4w_core.load(bytes(bad))
        assert not s4w_core.verify(bytes(bad), map_location="cuda").ok
    assert not calls
    assert_same({"w": s4w_core.load(bytes(data))["w"]}, s4w_core.load(bytes(data)))


@pytest.mark.parametrize("forced", [None, "xor", "sub"])
def test_delta_on_gpu(monkeypatch, forced):
    from s4w_core.gpu import _encode

    if forced:  # the writer's choice, replaced by ``forced`` wherever it chose a delta
        orig = _encode._choose_delta_ops
        monkeypatch.setattr(
            _encode, "_choose_delta_ops", lambda cands, **kw: [forced if op else None for op in orig(cands, **kw)]
        )
    g = torch.Generator().manual_seed(31)
    w0 = torch.randn(1_000_000, generator=g).to(torch.bfloat16)
    w1 = (w0.float() + 1e-3 * torch.randn(1_000_000, generator=g)).to(torch.bfloat16)
    # the base on the device, or in (pinned) host memory like the store's cache of the last step
    bases = {"cuda": w0.view(torch.uint8).cuda(), "cpu": w0.view(torch.uint8).clone().pin_memory()}

    def resolve(ref, nbytes):
        return bases["cuda"]

    for profile, where in (("fast", "cuda"), ("fast", "cpu"), ("portable", "cuda")):
        base = bases[where]

        def lookup(path, nbytes, dtype, base=base):
            return (base, {"ref": "b"}) if nbytes == base.numel() else None

        buf = io.BytesIO()
        s4w_core.save({"w": w1.cuda()}, buf, profile=profile, _base_lookup=lookup)
        m = s4w_core.api.open_reader(buf.getvalue()).manifest
        assert m["storages"][0]["delta"], "XOR delta should pay for a 1e-3 update"
        back = s4w_core.load(buf.getvalue(), _resolve_base=resolve)
        assert torch.equal(back["w"].cpu().view(torch.int16), w1.view(torch.int16))


@pytest.mark.parametrize("where", [None, "cuda", "cpu"])
def test_layout_choice_on_gpu(monkeypatch, where):
    """The fast writer's per-storage layout choice on the device (kernels.layout_probe): a
    non-negative tensor (Adam's ``exp_avg_sq`` kind, bf16 and fp32) takes ``planes``, signed weights
    ``planes-rotl1``; with a delta base on the device and in pinned host memory (the store's cache of
    the last step, staged per batch), and then with every sampled storage forced to ``planes``
    (deltas under ``planes``); everything loads bit-exactly on the GPU."""
    from s4w_core.gpu import kernels as K

    g = torch.Generator().manual_seed(41)
    sq0 = (torch.randn(1_000_000, generator=g) ** 2 * 1e-4).to(torch.bfloat16)
    sq1 = (sq0.float() * (1 + 0.05 * torch.randn(1_000_000, generator=g)).abs()).to(torch.bfloat16)
    state = {"sq": sq1.cuda(), "w": torch.randn(900_000, generator=g).to(torch.bfloat16).cuda(),
             "f": torch.randn(300_000, generator=g).abs().cuda()}
    base = None
    if where is not None:
        base = sq0.view(torch.uint8).cuda() if where == "cuda" else sq0.view(torch.uint8).clone().pin_memory()

    def lookup(path, nbytes, dtype):
        return (base, {"ref": "b"}) if base is not None and nbytes == base.numel() else None

    def resolve(ref, nbytes):
        return sq0.view(torch.uint8).cuda()

    def save_load():
        buf = io.BytesIO()
        s4w_core.save(state, buf, profile="fast", _base_lookup=lookup)
        m = s4w_core.api.open_reader(buf.getvalue()).manifest
        back = s4w_core.load(buf.getvalue(), map_location="cuda", _resolve_base=resolve)
        for k, t in state.items():
            assert torch.equal(back[k].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), k
        return {s["path"]: s for s in m["storages"]}

    st = save_load()
    assert st["w"]["transform"] == "planes-rotl1" and st["f"]["transform"] == "planes"
    assert bool(st["sq"]["delta"]) == (where is not None)
    # a delta residual keeps planes-rotl1 (docs/PERFORMANCE.md, "The layout choice")
    assert st["sq"]["transform"] == ("planes" if where is None else "planes-rotl1")
    monkeypatch.setattr(K, "LAYOUT_MARGIN", -1e9)  # every sampled storage takes planes
    st = save_load()
    assert {p: s["transform"] for p, s in st.items()} == {
        "sq": "planes" if where is None else "planes-rotl1", "w": "planes", "f": "planes"}


@pytest.mark.parametrize("op", ["xor", "sub"])
def test_planes_with_delta_decodes_on_gpu(monkeypatch, op):
    """Containers in the ``planes`` transform with ``xor`` / ``sub`` deltas (written by the CPU
    writer with the transform forced) decode bit-exactly through the GPU reader's merge kernels."""
    from s4w_core import engine
    from tests.unit.helpers import cpu_writer_with

    g = torch.Generator().manual_seed(43)
    w0 = torch.randn(1_000_000, generator=g).to(torch.bfloat16)
    f0 = torch.randn(300_001, generator=g)
    state = {"w": (w0.float() + 1e-3 * torch.randn(1_000_000, generator=g)).to(torch.bfloat16),
             "f": f0 * (1 + 1e-4 * torch.randn(300_001, generator=g))}
    bases = {2_000_000: w0.view(torch.uint8).clone(), 1_200_004: f0.view(torch.uint8).clone()}
    monkeypatch.setattr(engine, "encode_storage_cpu", cpu_writer_with("planes"))
    monkeypatch.setattr(engine, "choose_delta_op", lambda job, transform, ops=None: op)
    buf = io.BytesIO()
    s4w_core.save(state, buf, profile="portable", _base_lookup=lambda path, nbytes, dtype: (bases[nbytes], {"n": nbytes}))
    m = s4w_core.api.open_reader(buf.getvalue()).manifest
    assert {(s["transform"], s["delta"]["op"]) for s in m["storages"]} == {("planes", op)}
    back = s4w_core.load(buf.getvalue(), map_location="cuda", _resolve_base=lambda ref, nbytes: bases[nbytes].cuda())
    for k, t in state.items():
        assert back[k].is_cuda
        assert torch.equal(back[k].cpu().view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), k


def test_fast_ratio_beats_plain_bf16_on_normal_weights():
    w = torch.randn(4_000_000, device="cuda").to(torch.bfloat16)
    rep = s4w_core.save({"w": w}, io.BytesIO(), profile="fast")
    assert rep.ratio > 1.3, rep.ratio

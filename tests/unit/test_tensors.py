"""Every dtype torch checkpoints use, every kind of shape and view, shared storage and identity."""

from __future__ import annotations

import warnings

import pytest
import torch

import s4w_core
from tests.unit.helpers import assert_same_tensor, bits, roundtrip


def _dtypes() -> list[torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
        "complex64", "complex128", "complex32",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    ]
    out = []
    for n in names:
        dt = getattr(torch, n, None)
        if isinstance(dt, torch.dtype):
            out.append(dt)
    return out


DTYPES = _dtypes()


def random_of(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` holding random *bit patterns* (NaNs, denormals and all)."""
    g = torch.Generator().manual_seed(seed)
    item = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (257,), (5, 7, 3)], ids=str)
def test_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        x = random_of(dtype, shape, seed=len(shape))
        out = roundtrip({"x": x})["x"]
    assert_same_tensor(x, out)


def test_float_dtypes_special_values() -> None:
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 3.4e38, 1e-310, 1.0, -2.0]
    obj = {str(dt): torch.tensor(specials, dtype=torch.float64).to(dt) for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
    obj["complex"] = torch.tensor([complex(float("nan"), -0.0), complex(float("inf"), 1e-310)], dtype=torch.complex128)
    out = roundtrip(obj)
    for k, v in obj.items():
        assert_same_tensor(v, out[k])


def test_non_contiguous_views_keep_their_layout() -> None:
    base = torch.randn(6, 8, 4).to(torch.bfloat16)
    views = {
        "t": base[:, :, 0].t(),
        "step": base[::2, 1::3],
        "perm": base.permute(2, 0, 1),
        "offset": base[3:, 2],
        "expand": torch.randn(3, 1).expand(3, 5),  # stride 0
        "diag": torch.randn(5, 5).diagonal(),
        "unfold": torch.arange(20.0).unfold(0, 4, 2),
    }
    out = roundtrip(views)
    for k, v in views.items():
        assert_same_tensor(v, out[k])
        assert torch.equal(bits(v), bits(out[k]))


def test_views_share_one_storage_and_are_stored_once() -> None:
    base = torch.randn(1000)
    obj = {"a": base, "b": base[10:20], "c": base.view(10, 100).t(), "d": base.view(torch.int32)}
    buf = __import__("io").BytesIO()
    rep = s4w_core.save(obj, buf, profile="portable")
    assert rep.raw_bytes == 4000  # one storage, not four
    out = s4w_core.load(buf.getvalue())
    for k in obj:
        assert_same_tensor(obj[k], out[k])
    assert len({out[k].untyped_storage().data_ptr() for k in obj}) == 1
    out["a"][15] = 42.0
    assert out["b"][5].item() == 42.0  # still views of one storage


def test_slice_of_larger_storage_keeps_whole_storage() -> None:
    """Like torch.save, a view saves its whole storage and comes back as the same view."""
    big = torch.arange(100, dtype=torch.int64)
    v = big[40:45]
    out = roundtrip({"v": v})["v"]
    assert_same_tensor(v, out)
    assert out.untyped_storage().nbytes() == big.untyped_storage().nbytes()


def test_tied_weights_identity_and_parameters() -> None:
    emb = torch.nn.Parameter(torch.randn(50, 8))
    model = {"embed.weight": emb, "lm_head.weight": emb, "bias": torch.nn.Parameter(torch.zeros(8), requires_grad=False)}
    out = roundtrip({"model": model, "again": [emb]})
    assert out["model"]["embed.weight"] is out["model"]["lm_head.weight"]
    assert out["again"][0] is out["model"]["embed.weight"]
    assert isinstance(out["model"]["embed.weight"], torch.nn.Parameter)
    assert out["model"]["embed.weight"].requires_grad
    assert isinstance(out["model"]["bias"], torch.nn.Parameter) and not out["model"]["bias"].requires_grad
    assert_same_tensor(emb, out["model"]["embed.weight"])


def test_same_tensor_in_two_places_is_one_object() -> None:
    t = torch.randn(4)
    out = roundtrip({"x": t, "y": (t, t), "z": {"w": t}})
    assert out["x"] is out["y"][0] is out["y"][1] is out["z"]["w"]


def test_requires_grad_tensor_and_module_state_dict() -> None:
    t = torch.randn(3, requires_grad=True)
    out = roundtrip({"t": t})["t"]
    assert out.requires_grad and out.is_leaf
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.BatchNorm1d(3))
    sd = m.state_dict()
    out_sd = roundtrip(sd)
    assert type(out_sd) is type(sd) and list(out_sd) == list(sd)
    for k in sd:
        assert_same_tensor(sd[k], out_sd[k])
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.BatchNorm1d(3))
    m2.load_state_dict(out_sd)


def test_conj_and_neg_views_are_materialized() -> None:
    z = torch.randn(4, dtype=torch.complex64)
    c = z.conj()
    assert c.is_conj()
    out = roundtrip({"c": c})["c"]
    assert torch.equal(out, c.resolve_conj())
    assert not out.is_conj()


def test_unsupported_tensor_kinds_name_the_path() -> None:
    with pytest.raises(s4w_core.UnsupportedTypeError, match=r"a/sparse"):
        roundtrip({"a": {"sparse": torch.eye(3).to_sparse()}})
    with pytest.raises(s4w_core.UnsupportedTypeError, match=r"meta"):
        roundtrip({"m": torch.empty(3, device="meta")})
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(s4w_core.UnsupportedTypeError, match="q"):
        roundtrip({"q": q})

    class MyTensor(torch.Tensor):
        pass

    with pytest.raises(s4w_core.UnsupportedTypeError, match="MyTensor"):
        roundtrip({"sub": torch.randn(2).as_subclass(MyTensor)})


def test_map_location_and_missing_device() -> None:
    import io

    buf = io.BytesIO()
    s4w_core.save({"x": torch.ones(3)}, buf, profile="portable")
    assert s4w_core.load(buf.getvalue(), map_location="cpu")["x"].device.type == "cpu"
    assert s4w_core.load(buf.getvalue(), map_location="meta")["x"].device.type == "meta"
    assert s4w_core.load(buf.getvalue(), map_location={"cpu": "cpu"})["x"].device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(s4w_core.DeviceUnavailableError):
            s4w_core.load(buf.getvalue(), map_location="cuda:0")


def test_fast_profile_without_gpu_says_what_to_do() -> None:
    import s4w_core.api as api

    if api._gpu() is not None:
        pytest.skip("a GPU backend is usable here")
    with pytest.raises(s4w_core.BackendUnavailableError, match="portable"):
        roundtrip({"x": torch.ones(3)}, profile="fast")
    with pytest.raises(ValueError, match="profile"):
        roundtrip({"x": torch.ones(3)}, profile="bogus")
    # auto on CPU tensors is portable
    import io

    rep = s4w_core.save({"x": torch.ones(3)}, io.BytesIO(), profile="auto")
    assert rep.profile == "portable"

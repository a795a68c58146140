"""The non-tensor part of a checkpoint: nested containers, plain values, no pickle, clear errors."""

from __future__ import annotations

import argparse
import collections
import io
import json
import math
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import s4w_core
from tests.unit.helpers import assert_same_tensor, encode, forge, roundtrip


def test_optimizer_state_dict_with_int_keys() -> None:
    p = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    opt = torch.optim.AdamW(p, lr=1e-3)
    p[0].sum().backward()
    p[1].sum().backward()
    opt.step()
    sd = opt.state_dict()
    out = roundtrip(sd)
    assert set(out["state"]) == {0, 1} and all(type(k) is int for k in out["state"])
    assert out["param_groups"] == sd["param_groups"]
    for i in (0, 1):
        for k, v in sd["state"][i].items():
            assert_same_tensor(v, out["state"][i][k])


def test_plain_values_exact() -> None:
    obj = {
        "none": None, "t": True, "f": False,
        "big": 2**200, "neg_big": -(2**100) - 1, "zero": 0,
        "floats": [0.0, -0.0, 1.5, 1e308, 5e-324, float("inf"), float("-inf")],
        "nan": float("nan"), "neg_nan": -float("nan"),
        "nan_payload": struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000123))[0],
        "str": "héllo\x00wörld 🌍", "empty": "", "bytes": b"\x00\xffabc", "bytearray": bytearray(b"xyz"),
        "complex": complex(1.5, -0.0),
        "dtype": torch.bfloat16, "dtypes": [torch.float8_e4m3fn, torch.int64, torch.bool],
        "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "tuple": (1, (2, [3, {"a": (4,)}])), "empty_tuple": (), "empty_list": [], "empty_dict": {},
        "set": {3, 1, 2}, "frozenset": frozenset({"a", "b"}),
        "odict": collections.OrderedDict([("z", 1), ("a", 2)]),
        "mixed_keys": {1: "a", "1": "b", (1, 2): "c", None: "d", 2.5: "e", False: "f", b"k": "g"},
        "dollar_keys": {"$t": 1, "$dict": 2, "$": 3},
        "ns": argparse.Namespace(lr=0.1, name="run", layers=[1, 2]),
        "np_array": np.arange(6, dtype=np.float32).reshape(2, 3), "np_f16": np.array([1.0, -0.0], dtype=np.float16),
        "np_scalar": np.float64(2.5), "np_int": np.int64(-7), "np_bool": np.bool_(True), "np_dtype": np.dtype("<i4"),
    }
    out = roundtrip(obj)
    assert set(out) == set(obj)
    for k, v in obj.items():
        o = out[k]
        assert type(o) is type(v), k
        if k in ("nan", "neg_nan", "nan_payload"):
            assert struct.pack("<d", o) == struct.pack("<d", v), k
        elif k == "floats":
            assert [struct.pack("<d", a) for a in o] == [struct.pack("<d", a) for a in v]
        elif isinstance(v, np.ndarray):
            assert o.dtype == v.dtype and o.shape == v.shape and o.tobytes() == v.tobytes()
        elif k == "complex":
            assert struct.pack("<dd", o.real, o.imag) == struct.pack("<dd", v.real, v.imag)
        else:
            assert o == v, k
    assert list(out["odict"]) == ["z", "a"]
    assert list(out["mixed_keys"]) == list(obj["mixed_keys"])


def test_deep_nesting_and_lists_of_tensors() -> None:
    obj: object = torch.ones(2)
    for i in range(150):
        obj = [obj] if i % 2 else {"k": obj}
    out = roundtrip(obj)
    for i in reversed(range(150)):
        out = out[0] if i % 2 else out["k"]
    assert torch.equal(out, torch.ones(2))


def test_too_deep_and_cycles_raise() -> None:
    obj: list = []
    cur = obj
    for _ in range(300):
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    with pytest.raises(s4w_core.UnsupportedTypeError, match="deeper"):
        encode(obj)
    cyc: dict = {"a": {}}
    cyc["a"]["self"] = cyc
    with pytest.raises(s4w_core.UnsupportedTypeError, match="a/self"):
        encode(cyc)


class NotStorable:
    pass


@pytest.mark.parametrize(
    ("obj", "path"),
    [
        ({"model": {"layer": NotStorable()}}, "model/layer"),
        ({"opt": [1, 2, lambda x: x]}, "opt/2"),
        ({"cfg": {"sched": collections.defaultdict(int)}}, "cfg/sched"),
        ({"nt": collections.namedtuple("P", "a b")(1, 2)}, "nt"),
        ({"obj_arr": np.array([object()], dtype=object)}, "obj_arr"),
        ({"x": (1, {"y": io.BytesIO()})}, "x/1/y"),
        (NotStorable(), "<root>"),
    ],
)
def test_unstorable_values_raise_naming_the_path(obj: object, path: str) -> None:
    with pytest.raises(s4w_core.UnsupportedTypeError) as ei:
        encode(obj)
    assert path in str(ei.value)
    assert isinstance(ei.value, TypeError)  # also the builtin


def test_failed_save_leaves_no_file(tmp_path) -> None:
    p = tmp_path / "ck.s4w"
    with pytest.raises(s4w_core.UnsupportedTypeError):
        s4w_core.save({"w": torch.ones(3), "bad": NotStorable()}, p)
    assert list(tmp_path.iterdir()) == []
    s4w_core.save({"w": torch.ones(3)}, p)
    before = p.read_bytes()
    with pytest.raises(s4w_core.UnsupportedTypeError):
        s4w_core.save({"w": torch.zeros(3), "bad": NotStorable()}, p)
    assert p.read_bytes() == before  # the old file is untouched
    assert [q.name for q in tmp_path.iterdir()] == ["ck.s4w"]


class Marked(dict):
    pass


def test_dict_subclass_registered_and_unregistered() -> None:
    with pytest.warns(UserWarning, match="not a registered dict type"):
        out = roundtrip({"d": Marked(a=1)})
    assert type(out["d"]) is dict and out["d"] == {"a": 1}
    s4w_core.register_dict_type(Marked)
    out = roundtrip({"d": Marked(a=1)})
    assert type(out["d"]) is Marked and out["d"] == {"a": 1}
    with pytest.raises(TypeError):
        s4w_core.register_dict_type(list)  # type: ignore[arg-type]


def test_load_never_imports_or_runs_what_the_manifest_names(tmp_path) -> None:
    """A forged manifest naming a class (and pickle-ish tags) must not import/execute anything."""
    marker = tmp_path / "pwned"
    mod = tmp_path / "evil_mod_s4w.py"
    mod.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\nclass Evil(dict):\n    pass\n")
    blob = encode({"a": torch.ones(2)})

    def edit(m: dict) -> None:
        m["tree"] = {
            "a": {"$t": 0},
            "cls": {"$dictsub": "evil_mod_s4w.Evil", "items": [["k", 1]]},
            "os": {"$dictsub": "os.system", "items": []},
        }

    forged = forge(blob, edit)
    p = tmp_path / "forged.s4w"
    p.write_bytes(forged)
    script = textwrap.dedent(
        f"""
        import sys, warnings
        sys.path.insert(0, {str(tmp_path)!r})
        import s4w_core
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = s4w_core.load({str(p)!r})
        assert type(out["cls"]) is dict and out["cls"] == {{"k": 1}}, out
        assert "evil_mod_s4w" not in sys.modules
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    for tag in ({"$pickle": "gASVAAAAAAAAAAB9lC4="}, {"$reduce": ["os.system", ["echo hi"]]}, {"$global": "os.system"}):
        bad = forge(blob, lambda m, tag=tag: m.__setitem__("tree", {"x": tag}))
        with pytest.raises(s4w_core.ManifestError):
            s4w_core.load(bad)


def test_no_pickle_in_the_container() -> None:
    """The manifest is JSON and nothing in the file is a pickle stream."""
    blob = encode({"opt": {"state": {0: {"step": torch.tensor(1.0)}}}, "args": argparse.Namespace(a=1)})
    from tests.unit.helpers import manifest_text, split

    prefix, _t, m = split(blob)
    json.dumps(m)  # plain JSON
    # searched in the header + data and in the manifest's stored JSON bytes, not in its zstd frame:
    # compressed bytes (they change with the manifest's "created" time) hold any 2-byte pattern now and then
    for part in (prefix, manifest_text(blob)):
        assert b"\x80\x04\x95" not in part and b"\x80\x02" not in part


# ----------------------------------------------------------------------------- property test
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=8),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
tree = st.recursive(
    json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.tuples(kids, kids),
        st.dictionaries(keys, kids, max_size=4),
    ),
    max_leaves=25,
)


def _same(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)  # type: ignore[arg-type]
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    return a == b


@settings(max_examples=80, deadline=None)
@given(tree)
def test_tree_roundtrip_property(obj: object) -> None:
    out = roundtrip({"v": obj, "t": torch.ones(1)})
    assert _same(out["v"], obj)


def test_float_nan_sign_preserved() -> None:
    out = roundtrip([-math.nan, math.nan])
    assert math.copysign(1, out[0]) == -1 and math.copysign(1, out[1]) == 1

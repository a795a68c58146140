"""The row/column transforms ``rc-planes-rotl1`` / ``rc-planes`` (docs/FORMAT.md 4.5d): the offsets
and tiles against a literal reading of the spec (numpy and torch alike), containers decode
bit-exactly in s4w_core and in the reference reader (bf16/fp16/fp32, both layouts, plain and under
the ``xor`` / ``sub`` deltas, segments not aligned to rows), the writer's choice on moment-like,
weight-like and random data, and every malformed ``rowcol`` key fails with a ManifestError."""

from __future__ import annotations

import base64
import io
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import s4w_core
from s4w_core import choice, engine
from s4w_core.codecs import get_codec
from s4w_core.errors import ManifestError
from s4w_core.format.manifest import RC_TRANSFORMS
from s4w_core.jobs import row_length
from s4w_core.planes import rowcol, split_planes
from tests.unit.helpers import bits, forge, split

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ----------------------------------------------------------------------------- the definition
@st.composite
def grid_st(draw: Any) -> tuple[np.ndarray, int, int, int]:
    rows = draw(st.integers(1, 12))
    cols = draw(st.integers(1, 40))
    p0 = np.array(draw(st.lists(st.integers(0, 255), min_size=rows * cols, max_size=rows * cols)), dtype=np.uint8)
    s0 = draw(st.integers(0, rows * cols))
    s1 = draw(st.integers(s0, rows * cols))
    return p0, cols, s0, s1


@settings(max_examples=300, deadline=None)
@given(grid_st())
def test_offsets_and_tile_match_spec_numpy_and_torch(case: tuple[np.ndarray, int, int, int]) -> None:
    """The tile is ``row[i // C] + col[i % C]`` mod 256 for every element of any range (the
    literal spec, one element at a time); offsets are the integer-rounded means; the torch
    implementation (the GPU's, here on CPU tensors) gives the same bytes as numpy's."""
    p0, cols, s0, s1 = case
    rows = p0.size // cols
    row, col = rowcol.offsets_np(p0, cols)
    m = p0.reshape(rows, cols).astype(np.int64)
    exp_row = [(int(r.sum()) + cols // 2) // cols for r in m]
    exp_col = [((int(m[:, c].sum()) - sum(exp_row)) + rows // 2) // rows % 256 for c in range(cols)]
    assert row.tolist() == exp_row and col.tolist() == exp_col
    t = rowcol.tile_np(row, col, s0, s1)
    assert t.tolist() == [(exp_row[i // cols] + exp_col[i % cols]) % 256 for i in range(s0, s1)]
    trow, tcol = rowcol.offsets_torch(torch.from_numpy(p0), cols)
    assert trow.numpy().tolist() == exp_row and tcol.numpy().tolist() == exp_col
    for block in (1, cols, 3 * cols + 1):  # summed a block of rows at a time: the same bytes
        brow, bcol = rowcol.offsets_torch(torch.from_numpy(p0), cols, block_elems=block)
        assert brow.numpy().tolist() == exp_row and bcol.numpy().tolist() == exp_col
    assert rowcol.tile_torch(trow, tcol, s0, s1).numpy().tolist() == t.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [True, False])
def test_plane0_is_the_split_plane0(dtype: torch.dtype, rot: bool) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[:3] = torch.tensor([float("nan"), -0.0, float("-inf")]).to(dtype)
    raw = bits(x)
    w = dtype.itemsize
    ref = split_planes(raw, dtype, rot=rot)[0].numpy()
    words = raw.numpy().view({2: np.uint16, 4: np.uint32}[w])
    assert np.array_equal(rowcol.plane0_np(words, w, rot), ref)
    tw = raw.view({2: torch.int16, 4: torch.int32}[w])
    assert np.array_equal(rowcol.plane0_torch(tw, w, rot).numpy(), ref)


def test_row_length() -> None:
    a = torch.zeros(6, 4, 3)
    assert row_length(a, a.numel() * 4) == 12
    assert row_length(a.transpose(0, 2), a.numel() * 4) is None  # not contiguous
    assert row_length(a[1:], a.numel() * 4) is None  # does not start the storage
    assert row_length(torch.zeros(100), 400) is None  # 1-D
    assert row_length(torch.zeros(1, 100), 400) is None  # one row
    assert row_length(torch.zeros(0, 2), 0) is None  # empty


def test_format_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/FORMAT.md 4.5d's worked example, byte for byte."""
    monkeypatch.setattr(engine, "rowcol_choice", lambda raw, base, dt, tr, op, cols: (True, op))
    x = torch.tensor([[1.0, 2.0], [4.0, 8.0]], dtype=torch.bfloat16)
    assert bits(x).numpy().tobytes().hex(" ") == "80 3f 00 40 80 40 00 41"
    blob = io.BytesIO()
    s4w_core.save({"x": x}, blob, profile="portable")
    prefix, _t, m = split(blob.getvalue())
    s = m["storages"][0]
    assert s["transform"] == "rc-planes-rotl1"
    assert s["rowcol"] == {"cols": 2, "row": "gII=", "col": "/wA="}
    planes = []
    for cid, off, length, _h in s["chunks"]:
        planes.append(bytes(get_codec(cid).decode(prefix[off : off + length], 4)).hex(" "))
    assert planes == ["00 00 00 00", "00 00 00 00"]
    assert torch.equal(bits(s4w_core.load(blob.getvalue())["x"]), bits(x))


# ----------------------------------------------------------------------------- round trips
def moments(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """exp_avg_sq-like: a row scale times a column scale times noise, squared (log-additive)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.exp(2 * torch.randn(rows, 1, generator=g))
    c = torch.exp(2 * torch.randn(1, cols, generator=g))
    return ((r * c * torch.randn(rows, cols, generator=g)) ** 2 * 1e-6).to(dtype)


@pytest.mark.parametrize("op", [None, "xor", "sub"])
@pytest.mark.parametrize("tr", list(RC_TRANSFORMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_rowcol(rc: Any, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tr: str, op: str | None) -> None:
    """Forced on, with segments of 1003 elements (not a multiple of the 97-element rows): s4w_core
    and the reference reader decode it bit-exactly, specials included."""
    monkeypatch.setattr(engine, "SEGMENT_ELEMS", 1003)
    monkeypatch.setattr(engine, "rowcol_choice", lambda raw, base, dt, tr, op, cols: (True, op))
    if tr == "rc-planes":
        monkeypatch.setattr(engine, "transform_for", lambda dt, nb, transform=None: ("planes", dt.itemsize))
    if op is not None:
        monkeypatch.setattr(engine, "choose_delta_op", lambda job, transform, ops=None: op)
    x = moments(53, 97, dtype)
    x.view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), 0.0]).to(dtype)
    base = moments(53, 97, dtype, seed=1)
    kw: dict[str, Any] = {} if op is None else {"_base_lookup": lambda p, n, d: (bits(base), {"b": 0})}
    buf = io.BytesIO()
    s4w_core.save({"x": x, "y": x[3:]}, buf, profile="portable", **kw)
    blob = buf.getvalue()
    entry = split(blob)[2]["storages"][0]
    assert entry["transform"] == tr and (entry["delta"] or {}).get("op") == op
    assert entry["rowcol"]["cols"] == 97
    if op is None:
        back = s4w_core.load(blob)
    else:
        back = s4w_core.load(blob, _resolve_base=lambda e, i: bits(base))
    assert torch.equal(bits(back["x"]), bits(x)) and back["y"].storage_offset() == 3 * 97
    bases = None if op is None else {"x": bits(base).numpy().tobytes()}
    tree, _m = rc.read(blob, bases=bases)
    assert tree["x"].element_bytes() == bits(x).numpy().tobytes()


# ----------------------------------------------------------------------------- the writer's choice
def _transform_of(x: torch.Tensor) -> str:
    buf = io.BytesIO()
    s4w_core.save({"x": x}, buf, profile="portable")
    blob = buf.getvalue()
    assert torch.equal(bits(s4w_core.load(blob)["x"]), bits(x))
    return str(split(blob)[2]["storages"][0]["transform"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chooser_picks_it_for_moments(dtype: torch.dtype) -> None:
    assert _transform_of(moments(256, 384, dtype)) == "rc-planes-rotl1"
    # a single row or column scale, as well
    g = torch.Generator().manual_seed(3)
    x = torch.exp(3 * torch.randn(256, 1, generator=g)) * torch.randn(256, 384, generator=g)
    assert _transform_of(x.to(dtype)) == "rc-planes-rotl1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chooser_leaves_weights_and_random_bytes(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    assert _transform_of((0.02 * torch.randn(256, 384, generator=g)).to(dtype)) == "planes-rotl1"
    rnd = torch.randint(0, 256, (256 * 384 * dtype.itemsize,), dtype=torch.uint8, generator=g)
    assert _transform_of(rnd.view(dtype).view(256, 384)) == "planes-rotl1"
    # no 2-D view: never
    assert _transform_of(moments(256, 384, dtype).reshape(-1)) == "planes-rotl1"
    # too small to pay for its offsets
    assert not choice.rowcol_pays(bits(moments(8, 8, dtype)), None, dtype, "planes-rotl1", None, 8)


def test_rowcol_alone_beats_a_poor_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta whose residual codes worse than the tensor alone under the row/column variant is
    dropped (an exp_avg-like step: the same row/column scales, new noise and signs)."""
    monkeypatch.setattr(engine, "choose_delta_op", lambda job, transform, ops=None: "xor")
    g = torch.Generator().manual_seed(9)
    r, c = torch.exp(2 * torch.randn(256, 1, generator=g)), torch.exp(2 * torch.randn(1, 384, generator=g))
    x, base = (((r * c * torch.randn(256, 384, generator=g)) ** 2 * 1e-6).to(torch.bfloat16) for _ in range(2))
    buf = io.BytesIO()
    s4w_core.save({"x": x}, buf, profile="portable", _base_lookup=lambda p, n, d: (bits(base), {"b": 0}))
    e = split(buf.getvalue())[2]["storages"][0]
    assert e["transform"] == "rc-planes-rotl1" and e["delta"] is None
    assert torch.equal(bits(s4w_core.load(buf.getvalue())["x"]), bits(x))
    # and a delta that codes far smaller is kept
    y = base.clone()
    y.view(-1)[::97] = 1.0
    buf = io.BytesIO()
    s4w_core.save({"x": y}, buf, profile="portable", _base_lookup=lambda p, n, d: (bits(base), {"b": 0}))
    e = split(buf.getvalue())[2]["storages"][0]
    assert e["delta"] == {"op": "xor", "base": {"b": 0}}


# ----------------------------------------------------------------------------- hostile manifests
def _blob() -> bytes:
    buf = io.BytesIO()
    s4w_core.save({"x": moments(64, 96, torch.bfloat16)}, buf, profile="portable")
    blob = buf.getvalue()
    assert split(blob)[2]["storages"][0]["transform"] == "rc-planes-rotl1"
    return blob


def _b64(n: int) -> str:
    return base64.b64encode(bytes(n)).decode()


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing key", lambda s: s.pop("rowcol"), "needs a 'rowcol'"),
    ("not an object", lambda s: s.__setitem__("rowcol", [96]), "needs a 'rowcol'"),
    ("cols missing", lambda s: s["rowcol"].pop("cols"), "cols"),
    ("cols not dividing n", lambda s: s["rowcol"].__setitem__("cols", 95), "dividing"),
    ("cols zero", lambda s: s["rowcol"].__setitem__("cols", 0), "cols"),
    ("cols huge", lambda s: s["rowcol"].__setitem__("cols", 1 << 40), "cols"),
    ("cols a float", lambda s: s["rowcol"].__setitem__("cols", 96.0), "cols"),
    ("cols a bool", lambda s: s["rowcol"].__setitem__("cols", True), "cols"),
    ("row too short", lambda s: s["rowcol"].__setitem__("row", _b64(63)), "'row'"),
    ("row too long", lambda s: s["rowcol"].__setitem__("row", _b64(65)), "'row'"),
    ("col too short", lambda s: s["rowcol"].__setitem__("col", _b64(95)), "'col'"),
    ("col not base64", lambda s: s["rowcol"].__setitem__("col", "!" * 128), "base64"),
    ("col not a string", lambda s: s["rowcol"].__setitem__("col", [0] * 96), "'col'"),
    ("cols changed with the lengths", lambda s: s["rowcol"].update(cols=48, row=_b64(128), col=_b64(48 + 3)), "'col'"),
]


@pytest.mark.parametrize("what,edit,msg", BAD, ids=[b[0] for b in BAD])
def test_hostile_rowcol_rejected(rc: Any, what: str, edit: Callable[[dict[str, Any]], None], msg: str) -> None:
    bad = forge(_blob(), lambda m: edit(m["storages"][0]))
    with pytest.raises(ManifestError, match=msg):
        s4w_core.load(bad)
    with pytest.raises(rc.FormatError):
        rc.read(bad)


def test_wrong_offsets_fail_the_checksum() -> None:
    """Offsets that are valid but not the writer's decode to other bytes: the raw checksum says so."""
    def edit(m: dict[str, Any]) -> None:
        s = m["storages"][0]["rowcol"]
        s["col"] = base64.b64encode(bytes((b + 1) % 256 for b in base64.b64decode(s["col"]))).decode()

    with pytest.raises(s4w_core.ChecksumMismatchError):
        s4w_core.load(forge(_blob(), edit))


def test_unknown_to_old_transform_names() -> None:
    """A storage that is not rc- must not carry a transform name this reader does not know."""
    bad = forge(_blob(), lambda m: m["storages"][0].__setitem__("transform", "rc-bytes"))
    with pytest.raises(ManifestError, match="unknown transform"):
        s4w_core.load(bad)


# ----------------------------------------------------------------------------- the GPU writer's estimate
def _h_bits(x: np.ndarray) -> float:
    c = np.bincount(x, minlength=256)
    p = c[c > 0] / x.size
    return max(float(-(p * np.log2(p)).sum()), 1e-3) * x.size


@pytest.mark.parametrize("group_elems,work", [(None, None), (1, None), (30_000, None), (None, 1)])
def test_gpu_estimates_batched_match_one_by_one(
    monkeypatch: pytest.MonkeyPatch, group_elems: int | None, work: int | None
) -> None:
    """The GPU writer's estimate (the storages of a group at once: sums by index_add_, one
    bincount), run on CPU tensors, equals a plain per-storage computation (numpy: planes of the
    sampled rows, the offsets of :func:`rowcol.offsets_np`, order-0 entropies), for mixed widths,
    deltas and storages that are no candidates; whether the samples form one group, one group
    each, or groups of a few (``work``: the groups a bound on device memory makes)."""
    from s4w_core import delta
    from s4w_core.gpu import _rowcol
    from s4w_core.gpu._rowcol import rowcol_choices_device, rowcol_estimates_device

    if group_elems is not None:
        monkeypatch.setattr(_rowcol, "_RC_GROUP_ELEMS", group_elems)

    items: list[Any] = []
    for k, (dt, rows, cols) in enumerate([(torch.bfloat16, 300, 97), (torch.float32, 64, 130), (torch.bfloat16, 40, 700),
                                          (torch.float16, 100, 100), (torch.bfloat16, 3, 2000)]):
        x = moments(rows, cols, dt, k)
        items.append((bits(x), None, None, dt, cols))
    base = moments(300, 97, torch.bfloat16, 9)
    items.append((bits(moments(300, 97, torch.bfloat16, 0)), bits(base), "sub", torch.bfloat16, 97))
    items.append((bits(moments(300, 97, torch.bfloat16, 0)), None, None, torch.bfloat16, None))  # no row length
    items.append((bits(moments(10, 97, torch.bfloat16, 0)), None, None, torch.bfloat16, 97))  # too small
    got = rowcol_estimates_device(items, torch.device("cpu"), work=work)
    for (raw, b, op, dt, cols), est in zip(items, got):
        w = dt.itemsize
        n = raw.numel() // w
        if cols is None or n < choice.RC_MIN_ELEMS:
            assert est is None
            continue
        rows = n // cols
        pick = choice.rowcol_sample_rows(rows, cols)
        r = raw.view(rows, cols * w)[pick].reshape(-1)
        if b is not None:
            r = delta.forward(op, r, b.view(rows, cols * w)[pick].reshape(-1), dt)
        planes = split_planes(r, dt).numpy()
        row, col = rowcol.offsets_np(planes[0], cols)
        q = planes[0] - rowcol.tile_np(row, col, 0, planes[0].size)
        scale = n / planes[0].size / 8
        assert est is not None and est.others == 0.0
        assert est.plane0 == pytest.approx(_h_bits(planes[0]) * scale, rel=1e-9)
        assert est.rowcol0 == pytest.approx(_h_bits(q) * scale + rows + cols, rel=1e-9)
        # the CPU writer's estimate, where it samples the same rows (it takes fewer of a small storage)
        cpu = choice.rowcol_costs(raw, b, dt, "planes-rotl1", op, cols)
        assert cpu is not None
        if raw.numel() > choice.ESTIMATE_MAX_BYTES or len(pick) * cols <= choice.ESTIMATE_SAMPLE_ELEMS:
            assert (cpu.plane0, cpu.rowcol0) == pytest.approx((est.plane0, est.rowcol0), rel=1e-9)
    picks = rowcol_choices_device(items, torch.device("cpu"))
    assert picks[0] and picks[1] and not picks[6] and not picks[7]
    dense = torch.randn(300, 97, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert rowcol_choices_device([(bits(dense), None, None, torch.bfloat16, 97)], torch.device("cpu")) == [False]


@pytest.mark.parametrize("rows,cols", [(3, 2000), (300, 97), (64, 130), (40, 700), (100_000, 8), (5, 10_000), (2, 70_000)])
def test_gpu_sample_rows_are_the_probes(rows: int, cols: int) -> None:
    """The GPU writer computes the sampled rows on the device as ``(rows - 1) * i // (k - 1)``: the
    rows of :func:`choice.rowcol_sample_rows`, which the CPU probe and the tests use."""
    pick = choice.rowcol_sample_rows(rows, cols)
    k = len(pick)
    assert pick == sorted(set(pick)) and 2 <= k <= rows
    if k < rows:
        assert torch.div((rows - 1) * torch.arange(k), k - 1, rounding_mode="floor").tolist() == pick


def test_row_lengths_from_a_tensor_table_match_the_collector() -> None:
    """A step rebuilt from its manifest (the store's re-encodings) codes with the row length the
    save took from the live tensors."""
    from s4w_core.jobs import Collector, row_lengths

    big = torch.zeros(8, 6, dtype=torch.bfloat16)
    state = {
        "w": torch.zeros(5, 4, 3),  # prod(shape[1:]) = 12
        "v": big[2:],  # a view that does not start the storage: None
        "t": torch.zeros(6, 5).t(),  # not contiguous: None
        "b": torch.zeros(7),  # 1-D: None
        "r": torch.zeros(1, 9),  # one row: None
    }
    from s4w_core.skeleton import encode_tree

    col = Collector()
    encode_tree(state, col.add)
    got = row_lengths(col.tensors, [j.raw.numel() for j in col.jobs])
    assert got == [j.cols for j in col.jobs]
    assert sorted(c for c in got if c is not None) == [12]


def test_a_re_encoded_store_step_keeps_the_row_column_transform(tmp_path) -> None:
    """The step below the newest is re-coded from its host copy; a storage that does not pay as a
    delta stays whole under rc- (the delta is dropped where the tensor alone codes 2% smaller)."""
    g = torch.Generator().manual_seed(0)
    rows, cols = torch.rand(256, 1, generator=g) * 8, torch.rand(1, 512, generator=g) * 8
    def moment() -> torch.Tensor:
        return (torch.exp2(-(rows + cols)) * torch.rand(256, 512, generator=g)).to(torch.bfloat16)
    st = s4w_core.CheckpointStore(str(tmp_path / "st"))
    w = torch.randn(256, 512, generator=g).to(torch.bfloat16)
    w2 = w.clone()
    w2[:8] += 1  # a few rows move: the weights' delta pays, so step 1 becomes a delta step
    s1, s2 = {"w": w, "v": moment()}, {"w": w2, "v": moment()}
    st.save(s1, step=1)
    st.save(s2, step=2)
    st.wait()
    assert st.load(1)["v"].equal(s1["v"]) and st.load(2)["v"].equal(s2["v"])
    from s4w_core.format.container import ContainerReader

    recs = {r.step: r for r in st.list()}

    def storage(step: int, path: str) -> dict[str, Any]:
        data = (tmp_path / "st" / recs[step].object).read_bytes()
        return next(e for e in ContainerReader.from_bytes(data).manifest["storages"] if e["path"] == path)

    assert storage(2, "v")["transform"] in RC_TRANSFORMS  # the save, from the live tensor
    assert recs[1].kind == "delta" and storage(1, "w")["delta"]  # re-encoded from its host copy
    v1 = storage(1, "v")  # the moment alone under rc- beats any delta: stored whole in it
    assert v1["delta"] is None and v1["transform"] in RC_TRANSFORMS, v1["transform"]
    st.close()

"""The nonzero-element transforms ``nz-planes-rotl1`` / ``nz-planes`` (docs/FORMAT.md 4.5c):
bit-exact split/merge against a literal reading of the spec (hypothesis), containers that the CPU
writer chooses them for decode bit-exactly (plain and under the ``xor`` / ``sub`` deltas, several
segments, partial bitmap bytes), the writer's choice, and every malformed ``nnz`` / bitmap fails
with a clear error."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import s4w_core
from s4w_core import engine
from s4w_core.choice import NonzeroTrial
from s4w_core.errors import DecodeError, ManifestError
from s4w_core.format.container import ContainerReader
from s4w_core.format.manifest import NZ_TRANSFORMS, validate_manifest
from s4w_core.planes import nonzero as nzt
from s4w_core.planes import split_planes
from tests.unit.helpers import bits, forge, split
from tests.unit.test_bitexact import ALL16, fp32_specials

KNOWN_CODECS = {"raw", "deflate", "zstd", "nvcomp-ans"}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ----------------------------------------------------------------------------- the definition
def oracle_split(words: np.ndarray, w: int, rot: bool) -> tuple[bytes, np.ndarray]:
    """FORMAT.md 4.5c read literally, one element at a time in Python integers."""
    m = words.size
    bitmap = bytearray((m + 7) // 8)
    nz = []
    for i, x in enumerate(words.tolist()):
        if x:
            bitmap[i // 8] |= 1 << (i % 8)
            nz.append(x)
    bits_ = 8 * w
    mask = (1 << bits_) - 1
    if rot:
        nz = [((x << 1) | (x >> (bits_ - 1))) & mask for x in nz]
    planes = np.array([[(x >> (8 * (w - 1 - j))) & 0xFF for x in nz] for j in range(w)], dtype=np.uint8)
    return bytes(bitmap), planes.reshape(w, len(nz))


@st.composite
def words_st(draw: Any) -> tuple[np.ndarray, int]:
    w = draw(st.sampled_from([2, 4]))
    m = draw(st.integers(0, 300))
    vals = draw(st.lists(st.integers(0, (1 << (8 * w)) - 1), min_size=m, max_size=m))
    zero = draw(st.lists(st.booleans(), min_size=m, max_size=m))
    arr = np.array([0 if z else v for v, z in zip(vals, zero)], dtype=nzt.WORD[w])
    return arr, w


@settings(max_examples=200, deadline=None)
@given(words_st(), st.booleans())
def test_split_merge_match_the_definition(ww: tuple[np.ndarray, int], rot: bool) -> None:
    words, w = ww
    bitmap, planes = nzt.split_nonzero(words, w, rot=rot)
    ob, op = oracle_split(words, w, rot)
    assert bitmap.tobytes() == ob
    assert np.array_equal(planes, op)
    out = np.full(words.size * w, 0xAB, dtype=np.uint8)  # every byte rewritten
    nzt.merge_nonzero(bitmap, [planes[j] for j in range(w)], words.size, w, out, rot=rot)
    assert out.tobytes() == words.tobytes()
    # the nonzero elements' planes are the byte-plane transform of those elements
    nz = words[words != 0]
    ref = split_planes(torch.from_numpy(nz.view(np.uint8).copy()), torch.float32 if w == 4 else torch.bfloat16, rot=rot)
    assert np.array_equal(planes, ref.numpy())


def test_bad_bitmaps_are_decode_errors() -> None:
    words = np.array([0, 5, 0, 7, 9, 0, 0, 0, 1, 0], dtype=np.uint16)
    bitmap, planes = nzt.split_nonzero(words, 2, rot=True)
    parts = [planes[0], planes[1]]
    out = np.empty(words.size * 2, dtype=np.uint8)
    with pytest.raises(DecodeError, match="bitmap of 1 bytes, expected 2"):
        nzt.merge_nonzero(bitmap[:1], parts, words.size, 2, out, rot=True)
    extra = bitmap.copy()
    extra[0] |= 1  # one more set bit than planes hold
    with pytest.raises(DecodeError, match="marks 5 nonzero elements, planes hold 4"):
        nzt.merge_nonzero(extra, parts, words.size, 2, out, rot=True)
    pad = bitmap.copy()
    pad[1] |= 0x80  # a padding bit (element 15 of a 10-element segment)
    pad[1] &= 0xFE  # keep the count right: drop element 8
    with pytest.raises(DecodeError, match="padding"):
        nzt.merge_nonzero(pad, parts, words.size, 2, out, rot=True)
    zero_plane = [np.zeros(4, dtype=np.uint8), np.zeros(4, dtype=np.uint8)]
    with pytest.raises(DecodeError, match="decodes to zero"):
        nzt.merge_nonzero(bitmap, zero_plane, words.size, 2, out, rot=True)


# ----------------------------------------------------------------------------- containers
def sparse_rows(dtype: torch.dtype, rows: int = 300, cols: int = 97, seed: int = 0) -> torch.Tensor:
    """A moment-like tensor: most rows all zero (untouched embedding rows), the rest dense."""
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(rows, cols)
    live = torch.rand(rows, generator=g) < 0.3
    t[live] = torch.randn(int(live.sum()), cols, generator=g).abs() * 1e-6
    t = t.to(dtype)
    specials = ALL16.view(dtype) if dtype != torch.float32 else fp32_specials()
    return torch.cat([t.reshape(-1), specials[: 5000]])  # every pattern class, -0.0 among them


def _entry(blob: bytes) -> dict[str, Any]:
    return split(blob)[2]["storages"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tr", list(NZ_TRANSFORMS))
def test_container_roundtrip_nonzero(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tr: str) -> None:
    monkeypatch.setattr(engine, "SEGMENT_ELEMS", 4093)  # several segments, bitmaps ending mid-byte
    monkeypatch.setattr(engine, "nonzero_trial", lambda *a, **k: NonzeroTrial(True))
    if tr == "nz-planes":
        monkeypatch.setattr(engine, "transform_for", lambda dt, nb, transform=None: ("planes", dt.itemsize))
    x = sparse_rows(dtype)
    buf = io.BytesIO()
    s4w_core.save({"x": x}, buf, profile="portable")
    blob = buf.getvalue()
    e = _entry(blob)
    assert e["transform"] == tr
    n = x.numel()
    assert len(e["nnz"]) == -(-n // 4093) and len(e["chunks"]) == len(e["nnz"]) * (dtype.itemsize + 1)
    assert sum(e["nnz"]) == int((bits(x).view({2: torch.int16, 4: torch.int32}[dtype.itemsize]) != 0).sum())
    assert torch.equal(bits(s4w_core.load(blob)["x"]), bits(x))


@pytest.mark.parametrize("op", ["xor", "sub"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_container_delta_nonzero(monkeypatch: pytest.MonkeyPatch, op: str, dtype: torch.dtype) -> None:
    """Unchanged elements of a delta are zero residuals: the writer picks nz and the load is exact."""
    monkeypatch.setattr(engine, "SEGMENT_ELEMS", 4093)
    monkeypatch.setattr(engine, "choose_delta_op", lambda job, transform, ops=None: op)
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(30_000, generator=g) * 0.02).to(dtype)
    x = base.clone()
    moved = torch.rand(30_000, generator=g) < 0.05  # 5% of the elements change
    x[moved] = (x[moved].float() * (1 + 1e-2 * torch.randn(int(moved.sum()), generator=g))).to(dtype)
    specials = ALL16.view(dtype) if dtype != torch.float32 else fp32_specials()
    x = torch.cat([x, specials[:3000]])
    base = torch.cat([base, specials[:3000].flip(0)])
    buf = io.BytesIO()
    rep = s4w_core.save({"x": x}, buf, profile="portable", _base_lookup=lambda p, n, d: (bits(base), {"b": 0}))
    assert rep.delta_tensors == 1
    blob = buf.getvalue()
    e = _entry(blob)
    assert e["transform"] == "nz-planes-rotl1" and e["delta"]["op"] == op
    assert torch.equal(bits(s4w_core.load(blob, _resolve_base=lambda r, n: bits(base))["x"]), bits(x))
    # a wrong base is caught by the raw checksum
    with pytest.raises(s4w_core.ChecksumMismatchError):
        s4w_core.load(blob, _resolve_base=lambda r, n: bits(x))


def test_writer_choice() -> None:
    """Dense weights stay planes-rotl1 (no zeros: not even tried); a sparse XOR residual goes nz;
    and nz never loses to plain by more than the sample's noise on zero-row moments."""
    g = torch.Generator().manual_seed(0)
    dense = (torch.randn(1 << 16, generator=g) * 0.02).to(torch.bfloat16)
    assert not engine.nonzero_pays(bits(dense), None, torch.bfloat16, "planes-rotl1", None)
    near = dense.clone()
    near[::37] = (near[::37].float() * 1.01).to(torch.bfloat16)
    assert engine.nonzero_pays(bits(near), bits(dense), torch.bfloat16, "planes-rotl1", "xor")
    buf = io.BytesIO()
    s4w_core.save({"w": dense}, buf)
    assert _entry(buf.getvalue())["transform"] == "planes-rotl1"


def test_old_style_entries_unchanged() -> None:
    """A file without zeros has no nz storages and no ``nnz`` keys: exactly what readers before
    the nz transforms read."""
    buf = io.BytesIO()
    s4w_core.save({"x": torch.randn(5000), "b": torch.randn(100).bfloat16()}, buf)
    for s in split(buf.getvalue())[2]["storages"]:
        assert s["transform"] == "planes-rotl1" and "nnz" not in s


# ----------------------------------------------------------------------------- manifests
def _nz_blob(monkeypatch: pytest.MonkeyPatch) -> bytes:
    monkeypatch.setattr(engine, "SEGMENT_ELEMS", 4093)
    monkeypatch.setattr(engine, "nonzero_trial", lambda *a, **k: NonzeroTrial(True))
    buf = io.BytesIO()
    s4w_core.save({"x": sparse_rows(torch.bfloat16)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.pop("nnz"), "needs 'nnz'"),
        (lambda s: s.__setitem__("nnz", s["nnz"][:-1]), "needs 'nnz'"),
        (lambda s: s.__setitem__("nnz", "3"), "needs 'nnz'"),
        (lambda s: s["nnz"].__setitem__(0, -1), r"nnz\[0\] must be an integer in \[0, 4093\]"),
        (lambda s: s["nnz"].__setitem__(0, 4094), r"nnz\[0\] must be"),
        (lambda s: s["nnz"].__setitem__(1, 2.0), r"nnz\[1\] must be"),
        (lambda s: s.__setitem__("chunks", s["chunks"][:-1]), "chunks"),
        (lambda s: s.__setitem__("transform", "nz-planes-rotr1"), "unknown transform"),
    ],
)
def test_manifest_rejects_bad_nz_entries(monkeypatch: pytest.MonkeyPatch, edit: Any, match: str) -> None:
    blob = _nz_blob(monkeypatch)
    bad = forge(blob, lambda m: edit(m["storages"][0]))
    with pytest.raises(ManifestError, match=match):
        s4w_core.load(bad)


def test_nnz_shifted_between_segments_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts that still sum right but are moved between segments: the chunks' lengths disagree
    (raw chunks: a ManifestError) or the bitmaps' counts do (a DecodeError), never wrong bytes."""
    blob = _nz_blob(monkeypatch)

    def shift(m: dict[str, Any]) -> None:
        nnz = m["storages"][0]["nnz"]
        k = next(i for i, c in enumerate(nnz) if c > 0)
        nnz[k] -= 1
        nnz[k + 1 if k + 1 < len(nnz) else k - 1] += 1

    with pytest.raises((ManifestError, DecodeError)):
        s4w_core.load(forge(blob, shift))


def test_validator_sets_width_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    r = ContainerReader.from_bytes(_nz_blob(monkeypatch))
    m = r.manifest
    validate_manifest(m, r.data_start, r.data_end, KNOWN_CODECS)
    s = m["storages"][0]
    assert s["_width"] == 2
    assert engine.nonzero_chunk_lengths(s)[:3] == [(4093 + 7) // 8, s["nnz"][0], s["nnz"][0]]


def test_format_md_worked_example() -> None:
    """FORMAT.md 4.5c: bf16 [0.0, 1.0, 0.0, -2.0] -> bitmap 0A, planes 7F 80 / 00 01."""
    words = np.frombuffer(bytes.fromhex("0000803f000000c0"), dtype=np.uint16)
    bitmap, planes = nzt.split_nonzero(words, 2, rot=True)
    assert (bitmap.tobytes().hex(), planes[0].tobytes().hex(), planes[1].tobytes().hex()) == ("0a", "7f80", "0001")
    neg0 = np.array([0x8000, 0], dtype=np.uint16)  # -0.0 is a nonzero pattern
    assert nzt.split_nonzero(neg0, 2, rot=True)[0].tobytes() == b"\x01"


def test_gpu_reader_batches_nz_storages_alone() -> None:
    """The GPU reader decodes each nz storage as a batch of its own."""
    from s4w_core.gpu import _decode

    def e(t: str, n: int) -> dict[str, Any]:
        return {"transform": t, "nbytes": n}

    groups = _decode._groups(
        [e("planes-rotl1", 10), e("nz-planes-rotl1", 10), e("nz-planes", 5), e("planes", 3), e("bytes", 4)], 100
    )
    assert [[x["transform"] for x in g] for g in groups] == [
        ["planes-rotl1"], ["nz-planes-rotl1"], ["nz-planes"], ["planes", "bytes"]
    ]


@pytest.mark.gpu
def test_nz_file_loads_to_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setattr(engine, "SEGMENT_ELEMS", 4093)
    monkeypatch.setattr(engine, "nonzero_trial", lambda *a, **k: NonzeroTrial(True))
    x, d = sparse_rows(torch.bfloat16), torch.randn(5000)
    buf = io.BytesIO()
    s4w_core.save({"x": x, "d": d, "y": sparse_rows(torch.float32, seed=1)}, buf, profile="portable")
    out = s4w_core.load(buf.getvalue(), map_location="cuda")
    assert out["x"].is_cuda and torch.equal(bits(out["x"].cpu()), bits(x))
    assert torch.equal(bits(out["d"].cpu()), bits(d))


@settings(max_examples=100, deadline=None)
@given(words_st(), st.booleans())
def test_torch_path_matches_reference(ww: tuple[np.ndarray, int], rot: bool) -> None:
    """The device-agnostic torch split/merge (the GPU writer's building block) gives the
    reference's bytes; on CPU here, on CUDA in test_torch_path_on_gpu."""
    words, w = ww
    t = torch.from_numpy(words.view({2: np.int16, 4: np.int32}[w]).copy())
    bm, pl = nzt.split_nonzero_torch(t, w, rot=rot)
    rbm, rpl = nzt.split_nonzero(words, w, rot=rot)
    assert bm.numpy().tobytes() == rbm.tobytes() and np.array_equal(pl.numpy(), rpl)
    back = nzt.merge_nonzero_torch(bm, pl, words.size, w, rot=rot)
    assert back.numpy().tobytes() == words.tobytes()


@pytest.mark.gpu
def test_torch_path_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for w, dt in ((2, torch.bfloat16), (4, torch.float32)):
        x = sparse_rows(dt)
        words = bits(x).view({2: torch.int16, 4: torch.int32}[w])
        for rot in (True, False):
            bm, pl = nzt.split_nonzero_torch(words.cuda(), w, rot=rot)
            rbm, rpl = nzt.split_nonzero(words.numpy().view(nzt.WORD[w]), w, rot=rot)
            assert bm.cpu().numpy().tobytes() == rbm.tobytes() and np.array_equal(pl.cpu().numpy(), rpl)
            assert torch.equal(nzt.merge_nonzero_torch(bm, pl, words.numel(), w, rot=rot).cpu(), words)


def test_flip_in_every_nz_chunk_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flipped byte in any chunk of an nz storage (bitmap or plane, coded or raw) is a
    ChecksumMismatchError naming that chunk, never a wrong tensor or another error."""
    blob = _nz_blob(monkeypatch)
    m = split(blob)[2]
    chunks = m["storages"][0]["chunks"]
    tested = 0
    for i, (_codec, off, length, _h) in enumerate(chunks):
        if length == 0:
            continue
        tested += 1
        b = bytearray(blob)
        b[off + length // 2] ^= 0x10
        with pytest.raises(s4w_core.ChecksumMismatchError, match=f"chunk {i} of tensor"):
            s4w_core.load(bytes(b))
    assert tested >= 3 * 3  # bitmaps and planes of several segments


@settings(max_examples=60, deadline=None)
@given(words_st(), st.integers(1, 97), st.sampled_from([None, "xor", "sub"]))
def test_gpu_writer_nonzero_chunks_match_the_cpu_oracle(ww: tuple[np.ndarray, int], seg: int, op: str | None) -> None:
    """The GPU writer's nz coding (run on CPU tensors, nvCOMP simulated by raw deflate: chunks then
    decode with the CPU's ``deflate`` codec) gives, per segment, the bitmap and planes of the CPU
    oracle (:func:`oracle_split` of the residual words); the GPU reader's checked merge gives the
    residual words back."""
    from s4w_core import delta
    from s4w_core.codecs import get_codec
    from s4w_core.gpu import _nonzero
    from tests.parity._interpret_checks import simulated_gpu

    words, w = ww
    dtype = {2: torch.bfloat16, 4: torch.float32}[w]
    raw = torch.from_numpy(words.view(np.uint8).copy())
    base = None
    if op is not None:  # a base that equals the tensor in some elements: zero residuals
        base = raw.clone()
        b = base.numpy().view(nzt.WORD[w])
        b[::3] ^= nzt.WORD[w](0x5A5A5A5A & ((1 << (8 * w)) - 1))
    resid = raw if base is None or not raw.numel() else delta.forward(op, raw, base, dtype)
    rw = resid.numpy().view(nzt.WORD[w])
    dev = torch.device("cpu")
    with simulated_gpu():
        nnzs, chunks, _keep = _nonzero.encode_nonzero_many([(raw, base, op, dtype)], seg, "Deflate", "deflate", {}, dev)
    (nnz,), ((ids, views),) = nnzs, chunks
    n = words.size
    segs = [(a, min(n, a + seg)) for a in range(0, n, seg)]
    assert len(ids) == len(segs) * (w + 1) and len(nnz) == len(segs)
    chunks = []
    for c, (cid, v) in enumerate(zip(ids, views)):
        k, j = divmod(c, w + 1)
        m = segs[k][1] - segs[k][0]
        raw_len = (m + 7) // 8 if j == 0 else nnz[k]
        assert cid in ("deflate", "raw") and (cid == "deflate" or len(v) == raw_len)
        chunks.append(np.frombuffer(get_codec(cid).decode(bytes(v), raw_len), dtype=np.uint8))
    out = torch.empty(n * w, dtype=torch.uint8)
    for k, (a, z) in enumerate(segs):
        ob, op_planes = oracle_split(rw[a:z], w, True)
        assert chunks[k * (w + 1)].tobytes() == ob
        assert nnz[k] == op_planes.shape[1]
        for j in range(w):
            assert np.array_equal(chunks[k * (w + 1) + 1 + j], op_planes[j])
    lens = np.array([c.size for c in chunks], dtype=np.int64)
    slot = (lens + 15) // 16 * 16
    off = np.cumsum(slot) - slot
    dec = torch.zeros(max(int(slot.sum()), 1), dtype=torch.uint8)
    for c, o in zip(chunks, off.tolist()):
        dec[o : o + c.size] = torch.from_numpy(c.copy())
    _nonzero.check_and_merge(dec, lens, off, nnz, n, seg, w, True, out, "t")
    assert out.numpy().tobytes() == rw.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.lists(words_st(), min_size=1, max_size=5), st.sampled_from([8, 16, 40, 64, 7, 13]))
def test_gpu_writer_codes_many_nonzero_storages_in_one_group(group: list[tuple[np.ndarray, int]], seg: int) -> None:
    """:func:`encode_nonzero_many` (storages of both widths, empty ones among them, segments of a
    multiple of 8 elements -- the whole group split at once -- and of other lengths -- segment by
    segment) gives each storage the chunks of the CPU oracle, segment by segment, and the ``nnz``
    of each segment (run on CPU tensors, nvCOMP simulated by raw deflate)."""
    from s4w_core.codecs import get_codec
    from s4w_core.gpu import _nonzero
    from tests.parity._interpret_checks import simulated_gpu

    items = [(torch.from_numpy(words.view(np.uint8).copy()), None, None, {2: torch.bfloat16, 4: torch.float32}[w])
             for words, w in group]
    with simulated_gpu():
        nnzs, chunks, _keep = _nonzero.encode_nonzero_many(items, seg, "Deflate", "deflate", {}, torch.device("cpu"))
    assert len(nnzs) == len(chunks) == len(group)
    for (words, w), nnz, (ids, views) in zip(group, nnzs, chunks):
        segs = [(a, min(words.size, a + seg)) for a in range(0, words.size, seg)]
        assert len(nnz) == len(segs) and len(ids) == len(views) == len(segs) * (w + 1)
        for k, (a, z) in enumerate(segs):
            ob, op_planes = oracle_split(words[a:z], w, True)
            assert nnz[k] == op_planes.shape[1]
            got = [get_codec(ids[k * (w + 1) + j]).decode(bytes(views[k * (w + 1) + j]), len(ob) if j == 0 else nnz[k])
                   for j in range(w + 1)]
            assert got[0] == ob
            for j in range(w):
                assert got[1 + j] == op_planes[j].tobytes()


def _entropy_bits(b: np.ndarray) -> float:
    """Order-0 bits of the bytes ``b`` (at least 1e-3 a byte; 0 for none), as the writer's estimate counts."""
    if not b.size:
        return 0.0
    p = np.bincount(b, minlength=256) / b.size
    p = p[p > 0]
    return max(float(-(p * np.log2(p)).sum()), 1e-3) * b.size


@settings(max_examples=60, deadline=None)
@given(st.lists(words_st(), min_size=1, max_size=6))
def test_gpu_nonzero_estimates_match_a_literal_reading(group: list[tuple[np.ndarray, int]]) -> None:
    """The GPU writer's batched estimate (every sample of a width in one histogram) gives, per
    sample, its zero count and the order-0 bits of its planes and of its nonzero split (bitmap
    padded to a byte, then the planes of the nonzero elements) as computed sample by sample from
    the CPU oracle's split."""
    from s4w_core.gpu import _nonzero

    for w in (2, 4):
        mine = [words for words, ww in group if ww == w and words.size]
        if not mine:
            continue
        got = _nonzero.nz_estimates([torch.from_numpy(x.view({2: np.int16, 4: np.int32}[w])) for x in mine], w)
        for x, (zeros, plain, nz) in zip(mine, got.tolist()):
            rot = ((x.astype(np.uint64) << 1) | (x.astype(np.uint64) >> (8 * w - 1))) & ((1 << (8 * w)) - 1)
            planes = [((rot >> (8 * (w - 1 - j))) & 0xFF).astype(np.uint8) for j in range(w)]
            bm, nzp = oracle_split(x, w, True)
            assert zeros == x.size - np.count_nonzero(x)
            assert plain == pytest.approx(sum(_entropy_bits(p) for p in planes), rel=1e-9, abs=1e-9)
            want = _entropy_bits(np.frombuffer(bm, dtype=np.uint8)) + sum(_entropy_bits(nzp[j]) for j in range(w))
            assert nz == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_gpu_nonzero_choices_the_same_in_bounded_groups() -> None:
    """The GPU writer's choice gathers and estimates the samples a group at a time (bounded by
    ``work``, the device memory it may take): the same choice per storage as all at once, for
    storages with and without zero runs, with a delta base, and storages too small to sample."""
    from s4w_core.gpu import _nonzero

    g = torch.Generator().manual_seed(5)
    items: list[Any] = []
    for k in range(12):
        n = [70_000, 300_000, 1_500_000, 1000][k % 4]
        x = torch.randn(n, generator=g)
        if k % 3 == 0:
            x[: (n * 3) // 4] = 0  # zero rows: nonzero pays
        dt = torch.bfloat16 if k % 2 else torch.float32
        raw = x.to(dt).reshape(-1).view(torch.uint8)
        base = None
        op = None
        if k % 5 == 1:
            base, op = (x + 1e-3).to(dt).reshape(-1).view(torch.uint8), "xor"
        items.append((raw, base, op, dt))
    whole = _nonzero.nonzero_choices_device(items, torch.device("cpu"))
    assert any(whole) and not all(whole)
    for work in (1, 5 << 20):
        assert _nonzero.nonzero_choices_device(items, torch.device("cpu"), work=work) == whole


def test_a_small_storage_is_written_with_the_chunks_its_trial_coded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage the nonzero trial codes whole (one segment, its own sample) is written with the
    trial's chunks of the way chosen instead of being coded again: the container is byte for byte
    the one a writer that codes every storage anew writes, and it decodes bit-exactly."""
    import dataclasses

    g = torch.Generator().manual_seed(7)
    base = {f"t{i}": torch.randn(n, generator=g).to(dt) for i, (n, dt) in
            enumerate([(64, torch.bfloat16), (1000, torch.bfloat16), (4096, torch.float32), (3000, torch.float16),
                       (70000, torch.bfloat16)])}
    state = {}
    for i, (k, v) in enumerate(base.items()):
        x = v.clone()
        x[:: 2 + i] = (v[:: 2 + i].float() * 1.01).to(v.dtype)  # some elements unchanged: nonzero pays for some
        state[k] = x
    state["plain"] = torch.zeros(512, dtype=torch.bfloat16)
    state["plain"][::7] = 1.5

    def lookup(path: str, nbytes: int, dtype: Any) -> Any:
        return (bits(base[path]), {"b": path}) if path in base else None

    def written() -> bytes:
        buf = io.BytesIO()
        s4w_core.save(state, buf, profile="portable", _base_lookup=lookup)
        return buf.getvalue()

    reused = []
    orig = engine.nonzero_trial

    def counted(*a: Any, **k: Any) -> NonzeroTrial:
        t = orig(*a, **k)
        reused.append(t.chunks is not None)
        return t

    monkeypatch.setattr(engine, "nonzero_trial", counted)
    once = written()
    assert any(reused) and not all(reused), reused  # (the check covers both ways)
    monkeypatch.setattr(engine, "nonzero_trial", lambda *a, **k: dataclasses.replace(orig(*a, **k), chunks=None))
    assert written() == once
    transforms = {s["transform"] for s in ContainerReader.from_bytes(once).manifest["storages"]}
    assert any(t.startswith("nz-") for t in transforms) and any(not t.startswith("nz-") for t in transforms), transforms
    back = s4w_core.load(once, _resolve_base=lambda ref, n: bits(base[ref["b"]]))
    assert all(torch.equal(bits(back[k]), bits(v)) for k, v in state.items())

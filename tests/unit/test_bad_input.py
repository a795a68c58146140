"""Malformed input: truncation, bit flips, forged manifests, unknown codecs/versions, GPU-only codecs.

Every case must end in a specific :class:`s4w_core.S4WError` subclass — never another exception, a
crash, a hang or an allocation sized by a forged number.
"""

from __future__ import annotations

import copy
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import s4w_core
import s4w_core.api as api
from s4w_core import engine
from s4w_core.errors import (
    BackendUnavailableError,
    BadMagicError,
    ChecksumMismatchError,
    FormatError,
    ManifestError,
    S4WError,
    TruncatedError,
    UnknownCodecError,
    UnsupportedVersionError,
)
from s4w_core.format.container import HEADER_SIZE, TRAILER_SIZE
from s4w_core.format.limits import Limits, parse_limits, set_limits
from tests.unit.helpers import chunk_ranges, deflate_plane0, encode, forge, rebuild, split

_GPU = api._gpu() is not None


@pytest.fixture(scope="module")
def small_blob() -> bytes:
    """A small container (~1.5 KiB) with several storages, transforms, codecs and segments. The
    CPU writer codes planes with zstd; plane 0 is written as deflate here, as the GPU's portable
    profile (and the CPU writer of 0.1.0) writes it, so that every codec's reader is attacked."""
    old = engine.SEGMENT_ELEMS
    engine.SEGMENT_ELEMS = 64
    try:
        g = torch.Generator().manual_seed(0)
        with deflate_plane0():
            return encode(
                {
                    "w": torch.randn(150, generator=g).to(torch.bfloat16),
                    "f": torch.randn(40, generator=g),
                    "i": torch.arange(300, dtype=torch.int16) % 4,
                    "z": torch.zeros(200, dtype=torch.float16),
                    "meta": {"step": 7, "name": "x"},
                }
            )
    finally:
        engine.SEGMENT_ELEMS = old


def load_err(blob: bytes) -> S4WError:
    """load must raise an S4WError (and verify must agree that the file is bad)."""
    with pytest.raises(S4WError) as ei:
        s4w_core.load(blob)
    assert not s4w_core.verify(blob).ok
    return ei.value


def test_small_blob_is_valid(small_blob: bytes) -> None:
    assert s4w_core.verify(small_blob).ok
    _p, _t, m = split(small_blob)
    assert {c[0] for s in m["storages"] for c in s["chunks"]} >= {"raw", "deflate", "zstd"}
    assert len(small_blob) < 4096


# ----------------------------------------------------------------------------- truncation
def test_every_truncation_length(small_blob: bytes) -> None:
    for n in range(len(small_blob)):
        with pytest.raises((TruncatedError, BadMagicError)):
            s4w_core.load(small_blob[:n])


def test_truncated_file_on_disk(tmp_path, small_blob: bytes) -> None:
    p = tmp_path / "t.s4w"
    for n in (0, 10, HEADER_SIZE, len(small_blob) // 2, len(small_blob) - 1):
        p.write_bytes(small_blob[:n])
        with pytest.raises(TruncatedError):
            s4w_core.load(p)
        assert not s4w_core.verify(p).ok
    with pytest.raises(s4w_core.CheckpointNotFoundError):
        s4w_core.load(tmp_path / "missing.s4w")
    with pytest.raises(FileNotFoundError):  # also the builtin
        s4w_core.load(tmp_path / "missing.s4w")


def test_appended_garbage_is_rejected(small_blob: bytes) -> None:
    with pytest.raises(FormatError):
        s4w_core.load(small_blob + b"\x00" * 7)


# ----------------------------------------------------------------------------- bit flips
def _flip(blob: bytes, pos: int, mask: int = 0x01) -> bytes:
    b = bytearray(blob)
    b[pos] ^= mask
    return bytes(b)


def test_flip_in_every_chunk_names_tensor_and_chunk(small_blob: bytes) -> None:
    _p, _t, m = split(small_blob)
    k = 0
    for s in m["storages"]:
        for i, (_codec, off, length, _h) in enumerate(s["chunks"]):
            if length == 0:
                continue
            for pos in {off, off + length // 2, off + length - 1}:
                err = load_err(_flip(small_blob, pos, 0x10))
                assert isinstance(err, ChecksumMismatchError), err
                assert f"chunk {i}" in str(err) and s["path"] in str(err)
            k += 1
    assert k >= 10


def test_raw_chunks_are_hashed_only_when_their_storage_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A raw chunk goes to no decoder, so the CPU reader leaves its hash to the storage's checksum
    (an fp32 state is ~2/3 raw chunks); a flip in one is still named by chunk once that fails,
    also in a delta storage, whose residual would otherwise blame the base."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(20_000, generator=g)  # fp32: the low mantissa planes are stored raw
    blob = encode({"w": w})
    _p, _t, m = split(blob)
    chunks = m["storages"][0]["chunks"]
    raw = [(i, c) for i, c in enumerate(chunks) if c[0] == "raw"]
    assert raw and all(c[2] for _i, c in raw), "expected raw mantissa chunks"
    hashed: list[int] = []
    real = engine.xxh3_hexdigest
    monkeypatch.setattr(engine, "xxh3_hexdigest", lambda d: (hashed.append(len(d)), real(d))[1])
    assert torch.equal(s4w_core.load(blob, threads=1)["w"].view(torch.int32), w.view(torch.int32))
    assert len(hashed) == len(chunks) - len(raw)  # the coded chunks only
    for i, (_codec, off, length, _h) in raw:
        err = load_err(_flip(blob, off + length // 2, 0x04))
        assert isinstance(err, ChecksumMismatchError) and f"chunk {i} of tensor" in str(err), err


def test_corrupt_raw_residual_of_a_delta_is_named(tmp_path: Any) -> None:
    st = s4w_core.CheckpointStore(tmp_path / "s", profile="portable", keyframe_every=4)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(20_000, generator=g)
    st.save({"w": w}, step=0)
    st.save({"w": w + 1e-3 * torch.randn(20_000, generator=g)}, step=1)
    st.wait()  # step 0 becomes a delta against step 1 behind the save
    rec = st.info(0)
    assert rec.kind == "delta", rec
    path = tmp_path / "s" / rec.object
    blob = path.read_bytes()
    _p, _t, m = split(blob)
    raw = [(i, c) for i, c in enumerate(m["storages"][0]["chunks"]) if c[0] == "raw" and c[2]]
    assert raw and m["storages"][0]["delta"], m["storages"][0]
    i, (_codec, off, length, _h) = raw[0]
    path.write_bytes(_flip(blob, off + length // 2, 0x04))
    st.close()
    with pytest.raises(ChecksumMismatchError, match=rf"chunk {i} of tensor 'w'.* is corrupt"):
        s4w_core.CheckpointStore(tmp_path / "s").load(step=0, threads=1)


def test_flip_of_every_byte_is_detected(small_blob: bytes) -> None:
    """No byte of the file is unprotected: header, every chunk, the manifest and the trailer."""
    for pos in range(len(small_blob)):
        for mask in (0x01, 0x80):
            with pytest.raises(S4WError):
                s4w_core.load(_flip(small_blob, pos, mask))


def test_flip_in_manifest(small_blob: bytes) -> None:
    moff = struct.unpack("<Q", small_blob[-TRAILER_SIZE : -TRAILER_SIZE + 8])[0]
    mend = len(small_blob) - TRAILER_SIZE
    for pos in range(moff, mend, max(1, (mend - moff) // 50)):
        err = load_err(_flip(small_blob, pos, 0x04))
        assert isinstance(err, ChecksumMismatchError) and "manifest" in str(err)


def test_header_magic_and_version(small_blob: bytes) -> None:
    assert isinstance(load_err(b"PK\x03\x04" + small_blob[4:]), BadMagicError)
    future = small_blob[:8] + struct.pack("<H", 99) + small_blob[10:]
    err = load_err(future)
    assert isinstance(err, UnsupportedVersionError) and "upgrade" in str(err)
    for bit in (0x2, 0x8000):  # bit 0 is the compressed-manifest flag (tests/unit/test_manifest_zstd.py)
        flags = small_blob[:10] + struct.pack("<H", struct.unpack_from("<H", small_blob, 10)[0] | bit) + small_blob[12:]
        assert isinstance(load_err(flags), UnsupportedVersionError)
    assert isinstance(load_err(b"\x00" * 200), BadMagicError)


def test_torch_save_file_is_not_a_container(tmp_path) -> None:
    p = tmp_path / "x.pt"
    torch.save({"x": torch.ones(3)}, p)
    with pytest.raises(BadMagicError):
        s4w_core.load(p)


# ----------------------------------------------------------------------------- forged manifests
def _first(m: dict[str, Any], transform: str | None = None) -> dict[str, Any]:
    for s in m["storages"]:
        if transform is None or s["transform"] == transform:
            return s
    raise AssertionError


def _set(*path_then_value: Any) -> Callable[[dict[str, Any]], None]:
    """``_set("a", 0, "b", v)``: an edit doing ``m["a"][0]["b"] = v``."""
    *path, value = path_then_value

    def edit(m: dict[str, Any]) -> None:
        node: Any = m
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return edit


FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], type[S4WError]]] = {
    "format name": (_set("format", "zip"), ManifestError),
    "manifest version": (_set("version", 2), UnsupportedVersionError),
    "storages not a list": (_set("storages", {}), ManifestError),
    "no tree": (lambda m: m.pop("tree"), ManifestError),
    "no tensors": (lambda m: m.pop("tensors"), ManifestError),
    "nbytes +2": (lambda m: m["storages"][0].__setitem__("nbytes", m["storages"][0]["nbytes"] + 2), ManifestError),
    "nbytes huge": (_set("storages", 0, "nbytes", 1 << 60), ManifestError),
    "nbytes negative": (_set("storages", 0, "nbytes", -2), ManifestError),
    "nbytes float": (_set("storages", 0, "nbytes", 300.0), ManifestError),
    "nbytes bool": (_set("storages", 0, "nbytes", True), ManifestError),
    "segment 0": (_set("storages", 0, "segment_elems", 0), ManifestError),
    "segment huge": (_set("storages", 0, "segment_elems", 1 << 40), ManifestError),
    "transform unknown": (_set("storages", 0, "transform", "planes-rotl2"), ManifestError),
    "transform on int": (lambda m: _first(m, "bytes").__setitem__("transform", "planes-rotl1"), ManifestError),
    "dtype unknown": (_set("storages", 0, "dtype", "float128"), ManifestError),
    "dtype attr": (_set("storages", 0, "dtype", "__class__"), ManifestError),
    "device bogus": (_set("storages", 0, "device", "tpu:99"), FormatError),
    "checksum missing": (lambda m: m["storages"][0].pop("checksum"), ManifestError),
    "checksum algo": (_set("storages", 0, "checksum", "md5:00"), ManifestError),
    "checksum value": (_set("storages", 0, "checksum", "xxh3-64:0000000000000000"), ChecksumMismatchError),
    "delta op": (_set("storages", 0, "delta", {"op": "add"}), ManifestError),
    "chunk count": (lambda m: m["storages"][0]["chunks"].pop(), ManifestError),
    "chunk malformed": (_set("storages", 0, "chunks", 0, ["deflate", 16]), ManifestError),
    "chunk offset past data": (_set("storages", 0, "chunks", 0, 1, 1 << 40), ManifestError),
    "chunk offset in header": (_set("storages", 0, "chunks", 0, 1, 0), ManifestError),
    "chunk length past data": (_set("storages", 0, "chunks", 0, 2, 1 << 30), ManifestError),
    "chunk length negative": (_set("storages", 0, "chunks", 0, 2, -1), ManifestError),
    "chunk hash": (_set("storages", 0, "chunks", 0, 3, "0" * 16), ChecksumMismatchError),
    "codec unknown": (_set("storages", 0, "chunks", 0, 0, "brotli"), UnknownCodecError),
    "tensor storage index": (_set("tensors", 0, "storage", 99), ManifestError),
    "tensor shape huge": (_set("tensors", 0, "shape", [1 << 40]), ManifestError),
    "tensor shape overflow": (lambda m: m["tensors"][0].update(shape=[1 << 40, 1 << 40], stride=[0, 0]), ManifestError),
    "tensor shape negative": (_set("tensors", 0, "shape", [-1]), ManifestError),
    "tensor shape/stride rank": (_set("tensors", 0, "stride", []), ManifestError),
    "tensor stride past end": (lambda m: m["tensors"][0].update(shape=[2], stride=[10**6]), ManifestError),
    "tensor offset past end": (_set("tensors", 0, "offset", 10**6), ManifestError),
    "tensor dtype unknown": (_set("tensors", 0, "dtype", "float7"), ManifestError),
    "tensor dtype wider": (_set("tensors", 0, "dtype", "complex128"), ManifestError),
    "tree tensor index": (_set("tree", {"a": {"$t": 99}}), ManifestError),
    "tree tensor index bool": (_set("tree", {"a": {"$t": True}}), ManifestError),
    "tree unknown tag": (_set("tree", {"a": {"$eval": "1"}}), ManifestError),
    "tree bad float": (_set("tree", {"a": {"$f64": "zz"}}), ManifestError),
    "tree bad bytes": (_set("tree", {"a": {"$bytes": "!!"}}), ManifestError),
    "tree bad dtype": (_set("tree", {"a": {"$dtype": "Tensor"}}), ManifestError),
    "tree bad npscalar": (_set("tree", {"a": {"$npscalar": ["V0", ""]}}), ManifestError),
    "tree bad npscalar O": (_set("tree", {"a": {"$npscalar": ["|O", "AAAAAAAAAAA="]}}), ManifestError),
    "tree unhashable key": (_set("tree", {"$dict": [[[1], 2]]}), ManifestError),
    "tree deep": (_set("tree", __import__("functools").reduce(lambda a, _: [a], range(400), 0)), ManifestError),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_manifest(name: str, small_blob: bytes) -> None:
    edit, expected = FORGERIES[name]
    forged = forge(small_blob, edit)
    err = load_err(forged)
    assert isinstance(err, expected), f"{name}: {type(err).__name__}: {err}"


def test_manifest_not_json_or_not_object(small_blob: bytes) -> None:
    prefix, _t, _m = split(small_blob)
    import xxhash

    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b'{"a": ' + b"9" * 5000 + b"}", b"[" * 100000):
        tr = struct.pack("<QQQ8s", len(prefix), len(body), xxhash.xxh3_64_intdigest(body), b"S4WEND\x00\x00")
        err = load_err(prefix + body + tr)
        assert isinstance(err, ManifestError), (body[:10], err)


def test_swapped_chunks_are_caught_by_chunk_checksums(small_blob: bytes) -> None:
    def edit(m: dict[str, Any]) -> None:
        chunks = [c for s in m["storages"] for c in s["chunks"]]
        a, b = next((a, b) for a in chunks for b in chunks if a is not b and a[2] == b[2] and a[3] != b[3])
        a[1], b[1] = b[1], a[1]  # same lengths, so the ranges still tile the data section

    assert isinstance(load_err(forge(small_blob, edit)), ChecksumMismatchError)

    def edit_unequal(m: dict[str, Any]) -> None:
        a, b = m["storages"][0]["chunks"][0], m["storages"][0]["chunks"][1]
        assert a[2] != b[2]
        a[1], b[1] = b[1], a[1]

    assert isinstance(load_err(forge(small_blob, edit_unequal)), FormatError)


def test_spliced_chunk_entry_is_caught_by_raw_checksum(small_blob: bytes) -> None:
    """Swapping two whole chunk entries (their own hashes included) of the same plane in two
    segments passes every chunk checksum, so only the decoded-bytes checksum can catch it."""

    def edit(m: dict[str, Any]) -> None:
        s = _first(m, "planes-rotl1")
        w = 2 if s["dtype"] in ("bfloat16", "float16") else 4
        c = s["chunks"]
        assert c[0][3] != c[w][3]
        c[0], c[w] = copy.deepcopy(c[w]), copy.deepcopy(c[0])  # plane 0 of segments 0 and 1

    err = load_err(forge(small_blob, edit))
    assert isinstance(err, ChecksumMismatchError) and "decoded" in str(err)


def test_overlapping_chunks_cannot_claim_a_huge_tensor() -> None:
    """A small file whose manifest points every chunk of a 'huge' storage at the same bytes (each
    chunk within its codec's expansion bound): the reader must refuse, not allocate 1 TiB."""
    g = torch.Generator().manual_seed(0)
    blob = encode({"z": torch.randint(0, 16, (1 << 12,), dtype=torch.uint8, generator=g)})
    assert split(blob)[2]["storages"][0]["chunks"][0][0] == "zstd"
    assert split(blob)[2]["storages"][0]["chunks"][0][2] * 65536 > 1 << 26

    def edit(m: dict[str, Any]) -> None:
        s = m["storages"][0]
        c = s["chunks"][0]
        s["segment_elems"] = 1 << 26
        s["nbytes"] = 1 << 40
        s["chunks"] = [list(c) for _ in range((1 << 40) >> 26)]
        m["tensors"][0]["shape"] = [1 << 40]

    with pytest.raises(ManifestError):
        s4w_core.load(forge(blob, edit))


def test_expansion_bound(small_blob: bytes) -> None:
    """A stored chunk cannot claim more decoded bytes than its codec can produce from it."""
    blob = encode({"z": torch.zeros(1 << 16, dtype=torch.uint8)})

    def edit(m: dict[str, Any]) -> None:
        s = m["storages"][0]
        s["nbytes"] = s["segment_elems"] = 1 << 26
        m["tensors"][0]["shape"] = [1 << 26]

    with pytest.raises(ManifestError, match="expansion"):
        s4w_core.load(forge(blob, edit))


def test_bombs_stay_within_memory_and_time(tmp_path) -> None:
    """Forged files load with at most 3 GiB more address space than the child had after its
    imports, and finish quickly (run in a child; relative, because a CUDA build of torch maps
    most of 3 GiB at import)."""
    blob = encode({"z": torch.randint(0, 16, (1 << 12,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))})

    def huge(m: dict[str, Any]) -> None:
        s = m["storages"][0]
        c = s["chunks"][0]
        s["segment_elems"] = 1 << 26
        s["nbytes"] = 1 << 40
        s["chunks"] = [list(c) for _ in range((1 << 40) >> 26)]

    def wide(m: dict[str, Any]) -> None:
        m["tensors"][0].update(shape=[1 << 30, 1 << 30, 1 << 30], stride=[0, 0, 0])

    for i, e in enumerate((huge, wide)):
        (tmp_path / f"b{i}.s4w").write_bytes(forge(blob, e))
    script = textwrap.dedent(
        f"""
        import resource, glob, time
        import s4w_core
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), vm + (3 << 30)))
        for p in sorted(glob.glob({str(tmp_path)!r} + "/b*.s4w")):
            t = time.time()
            try:
                s4w_core.load(p)
                raise SystemExit(p + " loaded")
            except s4w_core.S4WError:
                pass
            assert time.time() - t < 30, p
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------- codecs and versions
def test_unknown_codec_says_upgrade(small_blob: bytes) -> None:
    err = load_err(forge(small_blob, _set("storages", 0, "chunks", 0, 0, "lzma-9000")))
    assert isinstance(err, UnknownCodecError) and isinstance(err, ValueError)
    assert "lzma-9000" in str(err) and "upgrade" in str(err)


@pytest.mark.skipif(_GPU, reason="a GPU backend is usable here")
def test_gpu_only_codec_on_cpu_machine(small_blob: bytes) -> None:
    def edit(m: dict[str, Any]) -> None:
        s = _first(m, "planes-rotl1")
        s["chunks"][0][0] = "nvcomp-ans"
        m["profile"] = "fast"
        m["codecs"]["nvcomp-ans"] = {"cpu_decodable": False}

    forged = forge(small_blob, edit)
    with pytest.raises(BackendUnavailableError) as ei:
        s4w_core.load(forged)
    assert isinstance(ei.value, ImportError)
    assert "s4w convert" in str(ei.value) and "portable" in str(ei.value)
    assert not s4w_core.verify(forged).ok
    assert s4w_core.info(forged)["profile"] == "fast"  # info still works without decoding


def test_raw_chunk_with_wrong_length(small_blob: bytes) -> None:
    def edit(m: dict[str, Any]) -> None:
        for s in m["storages"]:
            for c in s["chunks"]:
                if c[0] == "raw" and c[2] > 1:
                    c[2] -= 1
                    return
        raise AssertionError("no raw chunk")

    assert isinstance(load_err(forge(small_blob, edit)), ManifestError)


def test_corrupt_codec_stream_with_matching_checksum(small_blob: bytes) -> None:
    """A forged chunk whose checksum matches its (garbage) bytes: the codec must fail cleanly."""
    import xxhash

    prefix, _t, m = split(small_blob)
    for codec in ("deflate", "zstd"):
        mm = copy.deepcopy(m)
        for s in mm["storages"]:
            for c in s["chunks"]:
                if c[0] == codec:
                    garbage = bytes(range(7, 7 + c[2]))
                    p = bytearray(prefix)
                    p[c[1] : c[1] + c[2]] = garbage
                    c[3] = xxhash.xxh3_64_hexdigest(garbage)
                    err = load_err(rebuild(bytes(p), mm))
                    assert isinstance(err, FormatError), (codec, err)
                    break
            else:
                continue
            break


# ----------------------------------------------------------------------------- never expands
@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float64, torch.int32]),
    n=st.integers(0, 70_000),
    seed=st.integers(0, 2**31),
)
def test_incompressible_data_never_grows(dtype: torch.dtype, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.empty((), dtype=dtype).element_size()
    x = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g).view(dtype)
    buf = io.BytesIO()
    rep = s4w_core.save({"x": x}, buf, profile="portable")
    blob = buf.getvalue()
    assert rep.stored_bytes <= rep.raw_bytes == n * w
    _p, _t, m = split(blob)
    for s in m["storages"]:
        assert sum(c[2] for c in s["chunks"]) <= s["nbytes"]
    moff = struct.unpack("<Q", blob[-TRAILER_SIZE : -TRAILER_SIZE + 8])[0]
    manifest_len = len(blob) - TRAILER_SIZE - moff
    assert len(blob) == HEADER_SIZE + rep.stored_bytes + manifest_len + TRAILER_SIZE
    assert manifest_len < 2048  # one tensor: a small, fixed-size manifest


def test_chunks_are_back_to_back(small_blob: bytes) -> None:
    """The data section is the chunks in manifest order with no gaps (docs/FORMAT.md)."""
    pos = HEADER_SIZE
    for off, length in chunk_ranges(small_blob):
        assert off == pos
        pos += length
    assert pos == struct.unpack("<Q", small_blob[-TRAILER_SIZE : -TRAILER_SIZE + 8])[0]


# ----------------------------------------------------------------------------- limits (docs/SECURITY.md)
def test_limits_parse_and_reject_bad_items() -> None:
    lim = parse_limits("manifest_bytes=1G, manifest_inflation=128,pickle_ops=5")
    assert (lim.manifest_bytes, lim.manifest_inflation, lim.pickle_ops) == (1 << 30, 128, 5)
    assert parse_limits("") == Limits()
    for bad in ("nope=1", "manifest_bytes", "manifest_bytes=-1", "manifest_bytes=0", "manifest_bytes=1X"):
        with pytest.raises(ValueError):
            parse_limits(bad)


def test_manifest_limit_is_applied_and_can_be_raised(small_blob: bytes) -> None:
    """The manifest cap refuses a real file whose manifest is over it, names the knob, and
    set_limits (like S4W_LIMITS) raises it again."""
    _p, _t, m = split(small_blob)
    text_len = len(json.dumps(m, separators=(",", ":")))
    old = set_limits(manifest_bytes=text_len - 1)
    try:
        with pytest.raises(ManifestError, match="S4W_LIMITS"):
            s4w_core.load(small_blob)
        set_limits(manifest_bytes=text_len + 10)
        s4w_core.load(small_blob)
    finally:
        set_limits(old)


def test_s4w_limits_environment_variable_is_read() -> None:
    code = "from s4w_core.format.limits import get_limits; print(get_limits().manifest_free)"
    env = dict(os.environ, S4W_LIMITS="manifest_free=12M")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == str(12 << 20), r.stderr


def test_constant_storages_decode_first_and_stay_exact() -> None:
    """A storage claiming far more than its stored bytes (here: real zeros, ~20,000x) takes the
    decode-before-allocate path, and still comes back bit for bit; a forged claim of the same
    shape fails before its output is allocated."""
    x = torch.zeros(1 << 22, dtype=torch.float32)
    x[12345] = 1.5
    blob = encode({"x": x, "b": torch.zeros(3 << 20, dtype=torch.uint8)})
    _p, _t, m = split(blob)
    assert not any(engine.claims_plausible(s) for s in m["storages"])
    out = s4w_core.load(blob)
    assert torch.equal(out["x"].view(torch.int32), x.view(torch.int32)) and not out["b"].any()


def test_views_are_checked_before_any_storage_is_decoded(small_blob: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix, _t, m = split(small_blob)
    m["tensors"][0]["offset"] = 1 << 40
    calls = []
    monkeypatch.setattr(engine, "decode_storage_cpu", lambda *a, **k: calls.append(a))
    with pytest.raises(ManifestError, match="reaches past the end"):
        s4w_core.load(rebuild(prefix, m))
    assert calls == []


def test_dtype_names_never_import_torch_submodules() -> None:
    """A tensor/storage dtype or a $dtype tag naming a lazily imported torch submodule must not
    import it (checked in a fresh process, where none of them is loaded yet)."""
    code = textwrap.dedent(
        """
        import io, sys, torch, s4w_core
        from s4w_core.errors import ManifestError
        from tests.unit.helpers import encode, rebuild, split
        assert "torch.onnx" not in sys.modules
        prefix, _t, m = split(encode({"w": torch.ones(2)}))
        for name in ("onnx", "_dynamo", "jit"):
            m1 = dict(m, tree={"$dtype": name})
            try:
                s4w_core.load(rebuild(prefix, m1))
            except ManifestError:
                pass
            else:
                raise SystemExit("loaded")
        bad = sorted(k for k in sys.modules if k.startswith(("torch.onnx", "torch._dynamo")))
        print("IMPORTED", bad)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert "IMPORTED []" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
def test_constant_storages_for_a_gpu_target_decode_on_the_cpu_and_stay_exact() -> None:
    """With a GPU target, a storage claiming far more than its stored bytes is decoded by the CPU
    reader (chunks before output) and moved to the GPU: exact; a plausible one still goes to the GPU."""
    x = torch.zeros(1 << 22, dtype=torch.bfloat16)
    x[777] = 3.0
    y = torch.randn(1 << 16).to(torch.bfloat16)
    blob = encode({"x": x, "y": y})
    _p, _t, m = split(blob)
    assert [engine.claims_plausible(s) for s in m["storages"]] == [False, True]
    out = s4w_core.load(blob, map_location="cuda")
    assert out["x"].device.type == "cuda" and out["y"].device.type == "cuda"
    assert torch.equal(out["x"].cpu().view(torch.int16), x.view(torch.int16))
    assert torch.equal(out["y"].cpu().view(torch.int16), y.view(torch.int16))

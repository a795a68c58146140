"""Generators of hostile inputs, one family per attack class (docs/SECURITY.md).

Each generator returns :class:`Case` objects: a name, what to do with the payload (``load`` a
container, ``pack`` a framework file) and the payload bytes. :mod:`tests.attacks.child` runs them
in a subprocess under ``RLIMIT_AS``; every case must end in an ``S4WError`` or, where the input
is merely unusual rather than invalid, in a safe success.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import struct
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import xxhash
import zstandard

import s4w_core
from s4w_core.format.container import FLAG_MANIFEST_ZSTD, HEADER_SIZE, MAGIC, TRAILER_MAGIC

__all__ = ["Case", "all_cases", "container", "GENERATORS", "manifest_of", "storage_entry", "tensor_entry", "xxh", "gpu_only_claims"]


@dataclass
class Case:
    name: str
    kind: str  # "load": s4w_core.load + verify of a container; "pack": filepack.pack_file + unpack_bytes
    payload: bytes
    #: "error": must raise an S4WError; "ok": must succeed; "either": an S4WError or a success
    expect: str = "error"
    #: a sparse hole of this many zero bytes, then ``tail``, after ``payload`` in the file
    hole: int = 0
    tail: bytes = b""


# ----------------------------------------------------------------------------- building blocks
def container(data: bytes, manifest: Any, *, compress: bool = True, raw_manifest: bytes | None = None) -> bytes:
    """A container with the data section ``data`` and ``manifest`` (any JSON value, or the exact
    text ``raw_manifest``), its manifest zstd-compressed when ``compress``; trailer and checksum
    correct, so only validation can refuse it."""
    text = raw_manifest if raw_manifest is not None else json.dumps(manifest, separators=(",", ":")).encode()
    body = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(text) if compress else text
    header = struct.pack("<8sHHI", MAGIC, 1, FLAG_MANIFEST_ZSTD if compress else 0, 0)
    moff = HEADER_SIZE + len(data)
    return header + data + body + struct.pack("<QQQ8s", moff, len(body), xxhash.xxh3_64_intdigest(body), TRAILER_MAGIC)


def manifest_of(storages: list[Any], tensors: list[Any], tree: Any) -> dict[str, Any]:
    return {"format": "s4weights", "version": 1, "profile": "portable", "storages": storages, "tensors": tensors,
            "tree": tree}


def storage_entry(nbytes: int, chunks: list[Any], *, dtype: str = "uint8", transform: str = "bytes", seg: int = 1 << 16,
             checksum: str = "xxh3-64:0000000000000000") -> dict[str, Any]:
    return {"path": "w", "device": "cpu", "dtype": dtype, "nbytes": nbytes, "transform": transform,
            "segment_elems": seg, "checksum": checksum, "delta": None, "chunks": chunks}


def tensor_entry(storage: int, dtype: str, shape: list[int], stride: list[int], offset: int = 0) -> dict[str, Any]:
    return {"path": "w", "storage": storage, "dtype": dtype, "shape": shape, "stride": stride, "offset": offset,
            "requires_grad": False, "param": False}


def _valid(obj: Any) -> bytes:
    buf = io.BytesIO()
    s4w_core.save(obj, buf, profile="portable")
    return buf.getvalue()


def _split(blob: bytes) -> tuple[bytes, dict[str, Any]]:
    moff, mlen, _h, _m = struct.unpack("<QQQ8s", blob[-32:])
    stored = blob[moff : moff + mlen]
    flags = struct.unpack_from("<H", blob, 10)[0]
    text = zstandard.ZstdDecompressor().decompress(stored) if flags & FLAG_MANIFEST_ZSTD else stored
    return blob[HEADER_SIZE:moff], json.loads(text)


def xxh(b: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(b)


def _zframe(declared: int, content: bytes = b"\0") -> bytes:
    """A zstd frame by hand that declares ``declared`` bytes but holds one raw block of ``content``."""
    block = struct.pack("<I", (len(content) << 3) | 1)[:3]
    return b"\x28\xb5\x2f\xfd" + bytes([0b1110_0000]) + struct.pack("<Q", declared) + block + content


# ----------------------------------------------------------------------------- allocation bombs
def allocation_bombs() -> Iterator[Case]:
    # the 600-byte file: empty chunks claiming 65,600 bytes each (100k of them: 6.6 GB)
    n = 100_000
    seg = 65_600
    chunks = [["zstd", HEADER_SIZE, 0, xxh(b"")]] * n
    yield Case("empty_chunks_claim_6.6GB", "load", container(b"", manifest_of([storage_entry(n * seg, chunks, seg=seg)], [], None)))
    # 1-byte chunks at the codec's expansion bound (65,536 x 1 + 64 each): 20 GB claimed by 300 KB
    # of data (and a 12 MB plain manifest: validation passes, decoding must refuse)
    n = 300_000
    data = b"\x01" * n
    seg = 65_600
    chunks = [["zstd", HEADER_SIZE + i, 1, xxh(b"\x01")] for i in range(n)]
    yield Case("one_byte_chunks_claim_20GB", "load",
               container(data, manifest_of([storage_entry(n * seg, chunks, seg=seg)], [], None), compress=False))
    # real zstd frames that declare 64 MiB each but hold one byte: the chunk hashes match, so only
    # decoding shows the lie; 2,000 of them claim 128 GiB
    fr = _zframe(1 << 26)
    n = 2_000
    seg = 1 << 26
    # each claim must pass the per-chunk bound: length * 65536 + 64 >= 2**26 needs length >= 1024
    pad = fr + b"\0" * (1024 - len(fr))
    chunks = [["zstd", HEADER_SIZE + i * 1024, 1024, xxh(pad)] for i in range(n)]
    yield Case("lying_zstd_frames_claim_128GiB", "load",
               container(pad * n, manifest_of([storage_entry(n * seg, chunks, seg=seg)], [], None)))
    # many storages, each just under the "decode first" threshold, all forged
    fr = _zframe(1 << 20)
    frames = fr + b"\0" * (64 - len(fr))
    storages = [storage_entry(1 << 20, [["zstd", HEADER_SIZE + i * 64, 64, xxh(frames)]], seg=1 << 20) for i in range(4000)]
    yield Case("4000_storages_of_1MiB_forged", "load", container(frames * 4000, manifest_of(storages, [], None)))
    yield from gpu_only_claims()
    # nbytes / segment sizes / shapes past the format's bounds
    yield Case("nbytes_2_49", "load", container(b"", manifest_of([storage_entry(1 << 49, [])], [], None)))
    yield Case("segment_2_40", "load", container(b"", manifest_of([storage_entry(1 << 20, [], seg=1 << 40)], [], None)))


def gpu_only_claims() -> Iterator[Case]:
    """``nvcomp-ans`` storages: only a GPU decodes them. Validation bounds each chunk by nvCOMP's
    largest ANS chunk; a storage claiming more than 16x its stored bytes + 1 MiB is decoded first
    on the GPU (s4w_core.gpu._prove) before its output is allocated. On the CPU every case is a
    BackendUnavailableError (or a ManifestError from validation)."""
    # 1-byte chunks at the codec's expansion bound: 4.3 GB claimed by 64 KiB of data
    n, seg = 1 << 16, 65_600
    chunks = [["nvcomp-ans", HEADER_SIZE + i, 1, xxh(b"\x01")] for i in range(n)]
    yield Case("ans_one_byte_chunks_claim_4GB", "load", container(b"\x01" * n, manifest_of([storage_entry(n * seg, chunks, seg=seg)], [], None)))
    # one chunk claiming 32 MiB (within 65,536 x 1 KiB + 64, past nvCOMP's 16 MiB ANS chunks)
    blob = bytes(range(256)) * 4
    yield Case("ans_chunk_past_nvcomp_max", "load",
               container(blob, manifest_of([storage_entry(1 << 25, [["nvcomp-ans", HEADER_SIZE, 1024, xxh(blob)]], seg=1 << 25)], [], None)))
    # three forged storages of 128 MiB from 2 KiB each (refused by the proof of the first one)
    piece = bytes(range(256))
    storages = [storage_entry(1 << 27, [["nvcomp-ans", HEADER_SIZE + (8 * i + k) * 256, 256, xxh(piece)] for k in range(8)],
                         seg=1 << 24) for i in range(3)]
    yield Case("ans_three_storages_claim_384MiB", "load", container(piece * 24, manifest_of(storages, [], None)))
    # one forged storage of 128 MiB: validation passes; the CPU has no decoder
    # (BackendUnavailableError), the GPU's proof refuses the forged bitstream before the 128 MiB are allocated
    yield Case("ans_forged_128MiB", "load", container(piece * 8, manifest_of(storages[:1], [], None)))
    # a delta is not decoded first (its base proves its size): one without a base must be refused
    # before its 1 GiB output is allocated
    delta = dict(storage_entry(1 << 30, [["nvcomp-ans", HEADER_SIZE + k * 256, 256, xxh(piece)] for k in range(64)],
                               seg=1 << 24), delta={"op": "xor", "base": {"object": "x", "storage": 0}})
    yield Case("ans_delta_without_base_claims_1GiB", "load", container(piece * 64, manifest_of([delta], [], None)))


# ----------------------------------------------------------------------------- manifest bombs
def manifest_bombs() -> Iterator[Case]:
    m = json.dumps(manifest_of([], [], None)).encode()
    # a frame that declares 1 GiB: refused on the declaration, before anything is inflated
    yield Case("manifest_zstd_declares_1GiB", "load", _raw_container(_zframe(1 << 30, m)))
    # an honest frame of 256 MiB of JSON whitespace (~10 KB stored): past manifest_inflation
    co = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=len(m) - 1 + (256 << 20) + 1)
    pieces = [co.compress(m[:-1])] + [co.compress(b" " * (1 << 24)) for _ in range(16)] + [co.compress(b"}"), co.flush()]
    yield Case("manifest_zstd_honest_256MiB", "load", _raw_container(b"".join(pieces)))
    # a frame that declares the manifest's size but inflates to 64 MiB more (streamed, stopped)
    co = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=len(m) + (64 << 20))
    lie = bytearray(b"".join([co.compress(m)] + [co.compress(b" " * (1 << 24)) for _ in range(4)] + [co.flush()]))
    fhd = lie[4]
    pos = 5 + (0 if fhd & 0x20 else 1)
    width = {0: 1 if fhd & 0x20 else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    if width in (4, 8):
        lie[pos : pos + width] = len(m).to_bytes(width, "little")
        yield Case("manifest_zstd_lies_small", "load", _raw_container(bytes(lie)))
    # a huge [0,0,0,...] array in the tree (the 112 s case), within and beyond the limits
    for count in (1 << 20, 50 << 20):  # 2 MiB of JSON: within manifest_free; 100 MiB: not
        text = b'{"format":"s4weights","version":1,"storages":[],"tensors":[],"tree":[' + b"0," * (count - 1) + b"0]}"
        yield Case(f"tree_zero_array_{count}", "load", container(b"", None, raw_manifest=text),
                   "either" if count < (1 << 21) else "error")
    # a plain (uncompressed) manifest of 300 MiB, more than the manifest_bytes limit: a sparse file
    header = struct.pack("<8sHHI", MAGIC, 1, 0, 0)
    yield Case("plain_manifest_300MiB", "load", header, hole=300 << 20,
               tail=struct.pack("<QQQ8s", HEADER_SIZE, 300 << 20, 0, TRAILER_MAGIC))
    # NaN / Infinity literals
    for lit in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-2.5e400"):
        text = b'{"format":"s4weights","version":1,"storages":[],"tensors":[],"tree":[' + lit + b"]}"
        yield Case(f"json_{lit.decode()}", "load", container(b"", None, raw_manifest=text))
    # many empty objects: the most Python objects per JSON byte, up to manifest_free
    text = b'{"format":"s4weights","version":1,"storages":[],"tensors":[],"tree":[' + b"{}," * (1 << 20) + b"{}]}"
    yield Case("tree_1M_empty_objects", "load", container(b"", None, raw_manifest=text), "either")
    # 50k tensor entries viewing one storage (each becomes a torch view object)
    st = [storage_entry(0, [], checksum="xxh3-64:" + xxh(b""))]
    tensors = [tensor_entry(0, "float32", [0], [1])] * 50_000
    yield Case("50k_tensors", "load",
               container(b"", manifest_of(st, tensors, [{"$t": i} for i in range(0, 50_000, 7)]), compress=False), "either")


def _raw_container(stored_manifest: bytes) -> bytes:
    header = struct.pack("<8sHHI", MAGIC, 1, FLAG_MANIFEST_ZSTD, 0)
    return header + stored_manifest + struct.pack(
        "<QQQ8s", HEADER_SIZE, len(stored_manifest), xxhash.xxh3_64_intdigest(stored_manifest), TRAILER_MAGIC)


# ----------------------------------------------------------------------------- structure
def structure() -> Iterator[Case]:
    # nesting far past the tree's depth bound, in lists, objects and tags
    for depth in (300, 100_000):
        yield Case(f"nested_lists_{depth}", "load", container(b"", None, raw_manifest=b'{"format":"s4weights","version":1,"storages":[],"tensors":[],"tree":'
                   + b"[" * depth + b"]" * depth + b"}"))
        yield Case(f"nested_tuples_{depth}", "load", container(b"", None,
                   raw_manifest=b'{"format":"s4weights","version":1,"storages":[],"tensors":[],"tree":'
                   + b'{"$tuple":[' * depth + b"]}" * depth + b"}"))
    # duplicate keys: the manifest's own keys and a tree dict's (JSON lets the last one win)
    yield Case("duplicate_manifest_keys", "load", container(b"", None, raw_manifest=(
        b'{"format":"s4weights","version":1,"storages":[],"tensors":[],"tree":1,"tree":{"a":1,"a":2},'
        b'"storages":[]}')), "either")
    # overlapping views of one storage (legal, as in torch) and overlapping chunks (not)
    blob = _valid({"w": torch.arange(64, dtype=torch.float32)})
    data, m = _split(blob)
    t0 = m["tensors"][0]
    m["tensors"] = [dict(t0, shape=[32], stride=[1], offset=0), dict(t0, shape=[32], stride=[1], offset=16),
                    dict(t0, shape=[8, 8], stride=[0, 1], offset=3)]
    m["tree"] = {"a": {"$t": 0}, "b": {"$t": 1}, "c": {"$t": 2}}
    yield Case("overlapping_views", "load", container(data, m), "ok")
    _, m = _split(blob)
    chunks = m["storages"][0]["chunks"]
    if len(chunks) >= 2:
        chunks[1] = list(chunks[0])
        yield Case("overlapping_chunks", "load", container(data, m))
    # huge shape products and strides
    for name, shape, stride, exp in (
        ("shape_product_2_80", [1 << 40, 1 << 40], [0, 0], "error"),
        ("shape_2_40_stride0", [1 << 40], [0], "either"),  # a view of one element, 2**40 times: legal
        ("shape_2_40_stride1", [1 << 40], [1], "error"),
        ("negative_stride", [4], [-1], "error"),
        ("negative_shape", [-4], [1], "error"),
        ("65_dims", [1] * 65, [1] * 65, "error"),
        ("offset_past_end", [4], [1], "error"),
    ):
        _, m = _split(blob)
        m["tensors"][0].update(shape=shape, stride=stride, offset=(1 << 40) if name == "offset_past_end" else 0)
        yield Case(name, "load", container(data, m), exp)
    # names with NUL bytes and escapes, and a path traversal in tensor paths (names are just strings)
    _, m = _split(blob)
    m["tensors"][0]["path"] = "../../etc/passwd\x00\x1b[2J"
    m["storages"][0]["path"] = "/abs/\x00name"
    m["tree"] = {"../../x\x00": m["tree"]["w"]}
    yield Case("nul_and_traversal_in_names", "load", container(data, m), "either")


# ----------------------------------------------------------------------------- tags
def bad_tags() -> Iterator[Case]:
    base = manifest_of([], [], None)
    for i, tree in enumerate([
        {"$dtype": "_dynamo"}, {"$dtype": "onnx"}, {"$dtype": "jit"}, {"$dtype": "__class__"},
        {"$npdtype": "m8[1Y/0]"}, {"$npdtype": "<m8[1Y/0]"}, {"$npdtype": "M8[2s/0]"},
        {"$npscalar": ["m8[1Y/0]", base64.b64encode(b"\0" * 8).decode()]},
        {"$npdtype": "O"}, {"$npdtype": "(2,3)i4"}, {"$npdtype": "i4,f8"}, {"$npdtype": "V2000000000000"},
        {"$npdtype": 5}, {"$npscalar": ["<f8", 5]}, {"$npscalar": ["<f8"]},
        {"$namespace": [1]}, {"$namespace": {"a": {"$t": 3}}}, {"$size": [1 << 70]}, {"$size": [-1, "x"]},
        {"$device": "cuda:99999999999999999999"}, {"$device": 7}, {"$dictsub": "os.system", "items": []},
        {"$dict": [[[1], 2]]}, {"$size": [1] * 65}, {"$set": [[1]]}, {"$bytes": "!!"}, {"$complex": [1]}, {"$f64": "zz"},
        {"$ndarray": {"$t": 0}}, {"$ndarray": 1}, {"$evil": 1}, {"$t": True}, {"$t": -1},
    ]):
        yield Case(f"tag_{i}_{next(iter(tree))}", "load", container(b"", dict(base, tree=tree)),
                   "either" if "$dictsub" in tree else "error")  # an unregistered dict subclass: a plain dict
    # a storage / tensor dtype naming a torch submodule
    blob = _valid({"w": torch.arange(8, dtype=torch.uint8)})
    data, m = _split(blob)
    for dt in ("_dynamo", "onnx", "distributed", "qint8"):
        _, m = _split(blob)
        m["tensors"][0]["dtype"] = dt
        yield Case(f"tensor_dtype_{dt}", "load", container(data, m))
        _, m = _split(blob)
        m["storages"][0]["dtype"] = dt
        yield Case(f"storage_dtype_{dt}", "load", container(data, m))


# ----------------------------------------------------------------------------- framework files
def _torch_zip(pkl: bytes, *, method: int = zipfile.ZIP_STORED, extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as z:
        z.writestr("archive/data.pkl", pkl)
        for k, v in (extra or {}).items():
            z.writestr(k, v, compress_type=zipfile.ZIP_STORED)
    return buf.getvalue()


def framework_files() -> Iterator[Case]:
    # a 4 MB data.pkl of MARKs and TUPLEs (was quadratic: > 180 s), and one of 16 MB of MARKs
    yield Case("pickle_marks_4MB", "pack", _torch_zip(b"\x80\x02" + b"(" * (4 << 20) + b"t" * 16 + b"."), "ok")
    yield Case("pickle_mark_tuple_pairs", "pack", _torch_zip(b"\x80\x02" + b"(N" * (2 << 20) + b"t" * (2 << 20) + b"."),
               "ok")
    yield Case("pickle_many_ops_16MB", "pack", _torch_zip(b"\x80\x02" + b")" * (16 << 20) + b"."), "ok")
    # zip bomb: a data.pkl deflated from 1 GiB of zeros (~1 MB stored)
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = b"\0" * (1 << 24)
    parts = [co.compress(piece) for _ in range(64)] + [co.flush()]
    yield Case("zip_bomb_data_pkl_1GiB", "pack", _zip_with_deflated("archive/data.pkl", b"".join(parts), 1 << 30), "ok")
    # corrupt zips: cut, flipped central directory, unsupported method, encrypted, bad names
    good = io.BytesIO()
    torch.save({"w": torch.ones(64), "b": torch.arange(10)}, good)
    g = good.getvalue()
    yield Case("zip_truncated_half", "pack", g[: len(g) // 2], "ok")
    yield Case("zip_no_central_dir", "pack", g[: g.rfind(b"PK\x01\x02")], "ok")
    cd = g.rfind(b"PK\x05\x06")
    for name, off, val in (
        ("zip_eocd_count_huge", cd + 10, b"\xff\xff"), ("zip_eocd_offset_huge", cd + 16, b"\xff\xff\xff\x7f"),
        ("zip_eocd_size_huge", cd + 12, b"\xff\xff\xff\x7f"),
    ):
        yield Case(name, "pack", g[:off] + val + g[off + len(val) :], "ok")
    first_cd = g.find(b"PK\x01\x02")
    yield Case("zip_method_99", "pack", g[: first_cd + 10] + b"\x63\x00" + g[first_cd + 12 :], "ok")
    yield Case("zip_encrypted_flag", "pack", g[: first_cd + 8] + b"\x01\x00" + g[first_cd + 10 :], "ok")
    yield Case("zip_utf8_flag_bad_name", "pack",
               g[: first_cd + 8] + b"\x00\x08" + g[first_cd + 10 : first_cd + 46] + b"\xff\xfe" + g[first_cd + 48 :], "ok")
    yield Case("zip_header_offset_negative", "pack", g[: first_cd + 42] + b"\xff\xff\xff\xff" + g[first_cd + 46 :], "ok")
    for i in range(0, len(g), max(1, len(g) // 40)):
        yield Case(f"zip_flip_{i}", "pack", g[:i] + bytes([g[i] ^ 0xFF]) + g[i + 1 :], "ok")
    # pickles that break the scan in every way the old code raised on
    for i, pkl in enumerate([b"\x80\x02t.", b"\x80\x02\x93.", b"\x80\x02Q.", b"\x80\x02h\x05Q.", b"garbage",
                             b"\x80\x02" + b"L" + b"9" * 5000 + b"L\n.", b"\x80\x02" + b"\x85" * 100 + b"."]):
        yield Case(f"pickle_broken_{i}", "pack", _torch_zip(pkl), "ok")
    # safetensors headers: bad offsets, huge length, deep nesting
    for i, hdr in enumerate([
        b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}}',
        b'{"w":{"dtype":"F32","shape":[1],"data_offsets":["0","4"]}}',
        b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}',
        b'{"w":{"dtype":"F32","shape":[1],"data_offsets":null}}',
        b'{"w":[1,2]}',
        b'{"w":{"data_offsets":[4,0]}}',
        b"{" + b'"a":[' * 50_000 + b"]" * 50_000 + b"}",
        b'{"w":{"dtype":"F32","data_offsets":[0,NaN]}}',
    ]):
        yield Case(f"safetensors_{i}", "pack", struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16, "ok")
    yield Case("safetensors_len_2_60", "pack", struct.pack("<Q", 1 << 60) + b'{"w":{}}' + b"\0" * 16, "ok")
    # a zip whose 20,000 entries all name the same storage (duplicate keys: was a quadratic rename loop)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": the point
        z.writestr("archive/data.pkl", pickle.dumps({}))
        for _ in range(20_000):
            z.writestr("archive/data/0", b"\1\2\3\4")
    yield Case("zip_20k_duplicate_names", "pack", buf.getvalue(), "ok")


def _zip_with_deflated(name: str, deflated: bytes, size: int) -> bytes:
    """A zip holding one member ``name`` whose data is the raw deflate stream ``deflated`` of
    ``size`` bytes (CRC of zeros computed piecewise)."""
    crc = 0
    piece = b"\0" * (1 << 24)
    for _ in range(size >> 24):
        crc = zlib.crc32(piece, crc)
    nb = name.encode()
    size32 = min(size, 0xFFFFFFFF)
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(deflated), size32, len(nb), 0) + nb
    cd = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(deflated), size32, len(nb),
                     0, 0, 0, 0, 0, 0) + nb
    off = len(local) + len(deflated)
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(cd), off, 0)
    return local + deflated + cd + eocd


# ----------------------------------------------------------------------------- codec streams
def _plane_storage(data_chunks: list[tuple[str, bytes]], m: int) -> tuple[bytes, dict[str, Any]]:
    """A bf16 storage of ``m`` elements in one segment, its two plane chunks ``(codec, bytes)``."""
    data, chunks, off = b"", [], HEADER_SIZE
    for codec, b in data_chunks:
        chunks.append([codec, off, len(b), xxh(b)])
        data += b
        off += len(b)
    st = storage_entry(2 * m, chunks, dtype="bfloat16", transform="planes-rotl1", seg=m)
    return data, manifest_of([st], [tensor_entry(0, "bfloat16", [m], [1])], {"$t": 0})


def codec_streams() -> Iterator[Case]:
    """Chunks whose hash matches but whose coded bytes are forged: every decoder must refuse them
    cleanly (``DecodeError``). On a GPU, deflate chunks go to nvCOMP's inflater and ANS chunks to
    its ANS decoder (nvCOMP documents its Deflate decoder for valid input only): these cases are
    what ``test_attack_family_gpu`` holds it to."""
    m = 1 << 16
    rnd = bytes((i * 131 + 7) % 251 for i in range(4096))
    zeros = zlib.compressobj(9, zlib.DEFLATED, -15)
    good = zeros.compress(b"\0" * m) + zeros.flush()
    # random bytes as a raw deflate stream
    yield Case("deflate_random_bytes", "load", container(*_plane_storage([("deflate", rnd), ("deflate", rnd[::-1])], m)))
    # a stored block that declares 65,535 bytes but holds 123
    stored = bytes([0b001]) + struct.pack("<HH", 0xFFFF, 0x0000) + b"x" * 123
    yield Case("deflate_stored_block_short", "load", container(*_plane_storage([("deflate", stored), ("deflate", good)], m)))
    # a stream that decodes to twice the chunk's length, and one cut in half
    z2 = zlib.compressobj(9, zlib.DEFLATED, -15)
    long = z2.compress(b"\0" * (2 * m)) + z2.flush()
    yield Case("deflate_decodes_too_long", "load", container(*_plane_storage([("deflate", long), ("deflate", good)], m)))
    z3 = zlib.compressobj(9, zlib.DEFLATED, -15)
    noisy = z3.compress(bytes((i * i * 2654435761 >> 7) & 0xFF for i in range(m))) + z3.flush()
    yield Case("deflate_truncated", "load", container(*_plane_storage([("deflate", noisy[: len(noisy) // 2]), ("deflate", good)], m)))
    # dynamic-Huffman header with an over-subscribed code length set
    yield Case("deflate_bad_huffman_table", "load",
               container(*_plane_storage([("deflate", bytes([0b101]) + b"\xff" * 64), ("deflate", good)], m)))
    # zstd frames: random bytes after a valid header, and a frame of another content size
    zf = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * (m // 2))
    yield Case("zstd_wrong_content_size", "load", container(*_plane_storage([("zstd", zf), ("zstd", zf)], m)))
    yield Case("zstd_garbage_blocks", "load", container(*_plane_storage([("zstd", _zframe(m, rnd[:512])), ("zstd", zf)], m)))
    # ANS chunks of random bytes, of a nvCOMP-like header with absurd counts, and empty
    hdr = struct.pack("<QQQQII", 8, 1 << 40, m, 1 << 30, 255, 10) + rnd[:256]
    yield Case("ans_random_bytes", "load", container(*_plane_storage([("nvcomp-ans", rnd), ("nvcomp-ans", rnd[::-1])], m)))
    yield Case("ans_forged_header", "load", container(*_plane_storage([("nvcomp-ans", hdr), ("nvcomp-ans", hdr)], m)))
    yield Case("ans_empty_chunks", "load",
               container(*_plane_storage([("nvcomp-ans", b""), ("nvcomp-ans", b"")], 64)))


# ----------------------------------------------------------------------------- garbage
def garbage() -> Iterator[Case]:
    yield Case("empty", "load", b"")
    yield Case("magic_only", "load", MAGIC)
    yield Case("header_trailer_zero", "load", struct.pack("<8sHHI", MAGIC, 1, 0, 0) + b"\0" * 32)
    yield Case("trailer_len_2_63", "load", struct.pack("<8sHHI", MAGIC, 1, 0, 0) + struct.pack(
        "<QQQ8s", 16, 1 << 63, 0, TRAILER_MAGIC))
    yield Case("manifest_not_object", "load", container(b"", [1, 2, 3]))
    yield Case("manifest_not_utf8", "load", container(b"", None, raw_manifest=b'{"a":"\xff"}'))


GENERATORS: dict[str, Callable[[], Iterator[Case]]] = {
    "allocation": allocation_bombs,
    "manifest": manifest_bombs,
    "structure": structure,
    "tags": bad_tags,
    "framework": framework_files,
    "codec_streams": codec_streams,
    "garbage": garbage,
}


def all_cases() -> list[Case]:
    out: list[Case] = []
    for gen in GENERATORS.values():
        out.extend(gen())
    return out

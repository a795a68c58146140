"""Fuzzing of framework-file packing (:mod:`s4w_core.filepack`): ``torch.save`` zips,
safetensors files and anything else a framework adapter may be handed.

Contract, checked by :func:`check_framework_file`: for any bytes, :func:`pack_file` returns a tree
(falling back to opaque raw bytes for what it cannot parse; never an exception, never a slow path
the input controls) and :func:`unpack_bytes` gives the exact bytes back; through a container
(``save``/``load``) too, for every ``container_every``-th input.

Mutations (:func:`mutate_framework`) are structure-aware: byte flips, truncation and splices of
the file; forged zip headers (local and central directory: methods, flags, sizes, offsets, name
lengths); a mutated ``data.pkl`` re-zipped (opcode flips, MARK/TUPLE floods, truncation); and
forged safetensors headers (offsets, dtypes, lengths).
"""

from __future__ import annotations

import io
import json
import random
import struct
import zipfile
from typing import Any

import torch

import s4w_core
from s4w_core.filepack import pack_file, unpack_bytes

__all__ = ["framework_seeds", "mutate_framework", "check_framework_file", "run_one_framework"]

_SEEDS: list[bytes] | None = None


def _safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.float16: "F16", torch.uint8: "U8"}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for k, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def framework_seeds() -> list[bytes]:
    """Small valid framework files: torch.save zips (state dicts, an optimizer state, shared
    storages, views) and safetensors files."""
    global _SEEDS
    if _SEEDS is None:
        g = torch.Generator().manual_seed(0)
        out = []
        for obj in (
            {"w": torch.randn(16, generator=g).to(torch.bfloat16), "b": torch.arange(6)},
            {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, generator=g)}},
             "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.99)}]},
            {"x": (base := torch.randn(4, 4, generator=g)), "xt": base.t(), "row": base[1], "h": torch.ones(3).half()},
        ):
            buf = io.BytesIO()
            torch.save(obj, buf)
            out.append(buf.getvalue())
        out.append(_safetensors({"a": torch.randn(5, generator=g), "b": torch.arange(4), "c": torch.ones(2).half()}))
        out.append(b"\x00\x01 plain bytes, not a framework file" * 3)
        _SEEDS = out
    return _SEEDS


def _rezip(blob: bytes, fn: Any) -> bytes:
    """``blob`` (a zip) with each member's bytes passed through ``fn(name, data)``."""
    src = zipfile.ZipFile(io.BytesIO(blob))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            z.writestr(info.filename, fn(info.filename, src.read(info)))
    return buf.getvalue()


def _mutate_pickle(pkl: bytes, rng: random.Random) -> bytes:
    op = rng.randrange(5)
    b = bytearray(pkl)
    if op == 0 and b:  # flip bytes (opcodes and arguments)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if op == 1:  # truncate
        return bytes(b[: rng.randrange(len(b) + 1)])
    if op == 2:  # flood of MARKs / tuples / empty tuples / memo gets in the middle
        i = rng.randrange(len(b) + 1)
        flood = rng.choice([b"(", b"(t", b")", b"h\x00", b"(N", b"\x85", b"q\x00"]) * rng.randint(1, 2000)
        return bytes(b[:i]) + flood + bytes(b[i:])
    if op == 3:  # duplicate a slice
        i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
        return bytes(b[:j]) + bytes(b[i:j]) + bytes(b[j:])
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))  # garbage


def _mutate_zip_headers(blob: bytes, rng: random.Random) -> bytes:
    b = bytearray(blob)
    sigs = [(b"PK\x03\x04", (6, 8, 14, 18, 22, 26, 28)), (b"PK\x01\x02", (8, 10, 16, 20, 24, 28, 30, 32, 42)),
            (b"PK\x05\x06", (8, 10, 12, 16, 20))]
    sig, fields = rng.choice(sigs)
    hits = []
    pos = b.find(sig)
    while pos >= 0:
        hits.append(pos)
        pos = b.find(sig, pos + 1)
    if not hits:
        return bytes(b)
    at = rng.choice(hits) + rng.choice(fields)
    width = 4 if rng.random() < 0.5 else 2
    val = rng.choice([0, 1, 8, 12, 14, 99, 0xFFFF, 0xFFFFFFFF, 1 << 31, rng.randrange(1 << 16)]) & ((1 << (8 * width)) - 1)
    if at + width <= len(b):
        b[at : at + width] = val.to_bytes(width, "little")
    return bytes(b)


def _mutate_safetensors(blob: bytes, rng: random.Random) -> bytes:
    (n,) = struct.unpack_from("<Q", blob, 0)
    try:
        header = json.loads(blob[8 : 8 + n])
    except (ValueError, RecursionError):
        return blob
    if not isinstance(header, dict):
        return blob
    keys = [k for k in header if k != "__metadata__"]
    if not keys:
        return blob
    k = rng.choice(keys)
    field = rng.choice(["data_offsets", "dtype", "shape", None])
    val = rng.choice([[0, 1 << 40], [8, 4], [-1, 2], ["0", "4"], [0], None, "F64", "BOGUS", [1 << 62], {}, 7])
    if field is None or not isinstance(header[k], dict):
        header[k] = val
    else:
        header[k][field] = val
    h = json.dumps(header).encode()
    if rng.random() < 0.2:
        return struct.pack("<Q", rng.choice([0, len(h) + 1, 1 << 40, len(h) - 1])) + h + blob[8 + n :]
    return struct.pack("<Q", len(h)) + h + blob[8 + n :]


def mutate_framework(blob: bytes, rng: random.Random) -> bytes:
    """One random, structure-aware mutation of a framework file."""
    is_zip = blob[:4] == b"PK\x03\x04"
    is_st = len(blob) > 8 and blob[8:9] == b"{"
    # structure-aware mutations most of the time: pickle re-zipped, zip headers, safetensors header
    op = rng.choices(range(6), weights=(2, 1, 1, 3, 3, 1) if is_zip else (2, 1, 1, 0, 0, 6 if is_st else 1))[0]
    if op == 0 and blob:
        b = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if op == 1:
        return blob[: rng.randrange(len(blob) + 1)]
    if op == 2 and blob:  # splice in a piece of another seed
        other = rng.choice(framework_seeds())
        i, j = sorted(rng.randrange(len(other) + 1) for _ in range(2))
        at = rng.randrange(len(blob) + 1)
        return blob[:at] + other[i:j] + blob[at:]
    if is_zip and op == 3:
        try:
            return _rezip(blob, lambda name, data: _mutate_pickle(data, rng) if name.endswith("data.pkl") else data)
        except Exception:  # noqa: BLE001 - an earlier mutation broke the zip: fall back to bytes
            return blob[::-1] if rng.random() < 0.1 else blob[: len(blob) // 2]
    if is_zip and op == 4:
        return _mutate_zip_headers(blob, rng)
    if is_st and op == 5:
        return _mutate_safetensors(blob, rng)
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 128)))


def check_framework_file(data: bytes, through_container: bool = False) -> str:
    """Pack ``data``, unpack it, compare; returns the format the packer recognized. Any exception
    (or a different file back) propagates."""
    tree = pack_file(data)
    back = unpack_bytes(tree)
    if back != data:
        raise AssertionError(f"pack_file/unpack_bytes changed a {len(data)}-byte {tree['format']} file")
    if through_container:
        buf = io.BytesIO()
        s4w_core.save(tree, buf)
        if unpack_bytes(s4w_core.load(buf.getvalue())) != data:
            raise AssertionError("a packed file did not survive a container round trip")
    return str(tree["format"])


def run_one_framework(data: bytes) -> str:
    """A fuzz target over framework files: the first byte picks the seed and how many mutations
    (seeded by the remaining bytes) to stack; mode 0 checks the bytes as they are."""
    if not data:
        return check_framework_file(b"")
    mode = data[0] % 4
    if mode == 0:
        return check_framework_file(bytes(data[1:]))
    rng = random.Random(bytes(data[1:]))
    blob = framework_seeds()[data[0] % len(framework_seeds())]
    for _ in range(mode):
        blob = mutate_framework(blob, rng)
    return check_framework_file(blob, through_container=rng.random() < 0.05)

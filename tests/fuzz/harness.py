"""Fuzzing harness for the container reader, manifest validation, tree decoding and decoders.

One entry point, :func:`check_input`, shared by the coverage-guided atheris target
(``fuzz_reader.py``) and the hypothesis-driven CI test (``test_fuzz_short.py``). Its contract:
every input ends in a clean decode or an ``S4WError`` — never another exception, a crash, a hang
or an allocation beyond the documented bound. A clean decode must also be what ``verify`` says.

Inputs are built from *seed* containers (real, small, portable-profile checkpoints with several
segments per tensor) and *mutations*: raw byte flips, truncation, forged manifest fields (the
manifest checksum re-computed so validation, not the checksum, must catch them), spliced chunks
(a chunk's entry, checksum included, copied over another's so only the raw-bytes checksum can
catch it), unknown codecs and versions.
"""

from __future__ import annotations

import copy
import io
import json
import random
import struct
from typing import Any

import torch
import xxhash
import zstandard

import s4w_core
from s4w_core import engine
from s4w_core.errors import S4WError
from s4w_core.format.container import FLAG_MANIFEST_ZSTD, HEADER_SIZE, TRAILER_MAGIC, TRAILER_SIZE, inflate_manifest

__all__ = ["seeds", "check_input", "mutate", "rebuild", "split", "run_one", "run_one_outcome"]

_SEEDS: list[bytes] | None = None


def seeds() -> list[bytes]:
    """Small valid containers covering every transform and codec the CPU writes (the row/column and
    nonzero variants included: ``test_fuzz_short`` checks that they are chosen)."""
    global _SEEDS
    if _SEEDS is None:
        g = torch.Generator().manual_seed(0)
        old = engine.SEGMENT_ELEMS
        engine.SEGMENT_ELEMS = 96  # several segments per tensor
        try:
            objs: list[Any] = [
                {"w": torch.randn(300, generator=g).to(torch.bfloat16), "step": 3},
                {
                    "model": {"a": torch.randn(17, 9, generator=g), "b": torch.randn(64, generator=g).half()},
                    "opt": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.zeros(40)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
                    "ints": torch.arange(200, dtype=torch.int64),
                    "mask": torch.rand(50, generator=g) > 0.5,
                    "misc": (None, True, -0.0, float("nan"), b"xy", {1, 2}, torch.bfloat16, torch.Size([2, 3])),
                },
                {"view": torch.randn(8, 8, generator=g)[:, 2:5].t(), "empty": torch.empty(0, 4), "scalar": torch.tensor(1.5)},
                # appended (run_one picks seed data[0] % len(seeds()): the one regression input, first byte 1,
                # still picks seed 1)
                # a matrix with row and column scales: the row/column variant (rc-, FORMAT.md 4.5d)
                {"scaled": (torch.randn(64, 96, generator=g) * 2.0 ** torch.randint(-6, 7, (64, 1), generator=g)
                            * 2.0 ** torch.randint(-6, 7, (1, 96), generator=g)).to(torch.bfloat16)},
                # Adam moments with untouched (zero) rows: the nonzero variant (nz-, FORMAT.md 4.5c)
                {"exp_avg": torch.randn(64, 96, generator=g) * (torch.rand(64, 1, generator=g) > 0.5),
                 "exp_avg_sq": (torch.rand(64, 96, generator=g) * (torch.rand(64, 1, generator=g) > 0.5)).to(torch.bfloat16)},
            ]
            out = []
            for o in objs:
                buf = io.BytesIO()
                s4w_core.save(o, buf, profile="portable")
                out.append(buf.getvalue())
            _SEEDS = out
        finally:
            engine.SEGMENT_ELEMS = old
    return _SEEDS


def _compressed(blob: bytes) -> bool:
    return bool(struct.unpack_from("<H", blob, 10)[0] & FLAG_MANIFEST_ZSTD)


def split(blob: bytes) -> tuple[bytes, dict[str, Any]]:
    """(header+data bytes, manifest dict) of a valid container."""
    moff, mlen, _h, _m = struct.unpack("<QQQ8s", blob[-TRAILER_SIZE:])
    stored = blob[moff : moff + mlen]
    return blob[:moff], json.loads(inflate_manifest(stored) if _compressed(blob) else stored)


def rebuild(prefix: bytes, manifest: Any) -> bytes:
    """A container with ``manifest`` (any JSON value; compressed when the prefix's header says so)
    and a correct trailer/checksum."""
    body = json.dumps(manifest, separators=(",", ":")).encode()
    if _compressed(prefix):
        body = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(body)
    return prefix + body + struct.pack("<QQQ8s", len(prefix), len(body), xxhash.xxh3_64_intdigest(body), TRAILER_MAGIC)


_FORGE_VALUES: list[Any] = [
    -1, 0, 1, 2, 3, 7, 255, 1 << 31, 1 << 40, 1 << 62, 1 << 64, 10**30, 1.5, -0.0, None, True, "", "x",
    "raw", "deflate", "zstd", "nvcomp-ans", "lz77", "planes-rotl1", "planes", "bytes", "bfloat16", "float32",
    "qint8", "int4", "uint1", "cuda:0", "meta", "cpu", "xxh3-64:0", "fold64:0", [], [0], [1, 2], {}, {"$t": 0},
    {"$t": 99}, {"$dictsub": "os.system", "items": []}, {"$f64": "zz"}, {"$bytes": "!!"},
]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = root
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return root


def mutate(blob: bytes, rng: random.Random) -> bytes:
    """One random mutation of a valid container."""
    op = rng.randrange(7)
    parsed: tuple[bytes, Any] | None = None
    if op >= 2:
        try:
            parsed = split(blob)
            if not isinstance(parsed[1], dict) or not isinstance(parsed[1].get("storages"), list):
                raise ValueError
        except Exception:  # an earlier mutation broke the structure: fall back to byte-level ops
            op = rng.randrange(2)
    if op == 0 and blob:  # flip bits anywhere
        b = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if op == 1:  # truncate
        return blob[: rng.randrange(len(blob))] if blob else blob
    if op == 0:
        return blob
    assert parsed is not None
    prefix, m = parsed
    if op == 2:  # flip bits in the data section only, manifest intact
        b = bytearray(prefix)
        if len(b) > HEADER_SIZE:
            i = rng.randrange(HEADER_SIZE, len(b))
            b[i] ^= 1 << rng.randrange(8)
        return rebuild(bytes(b), m)
    if op == 3:  # forge manifest fields
        for _ in range(rng.randint(1, 3)):
            paths = _paths(m)
            m = _set(m, rng.choice(paths), copy.deepcopy(rng.choice(_FORGE_VALUES)))
        return rebuild(prefix, m)
    if op == 4:  # splice: copy one chunk entry (checksum included) over another
        chunks = chunks_of(m)
        if len(chunks) >= 2:
            a, b = rng.sample(range(len(chunks)), 2)
            chunks[b][:] = chunks[a]
        return rebuild(prefix, m)
    if op == 5:  # unknown codec / version / transform / header flags
        which = rng.randrange(4)
        if which == 0 and chunks_of(m):
            rng.choice(chunks_of(m))[0] = rng.choice(["lz4", "nvcomp-ans", "bitcomp", ""])
        elif which == 1:
            m["version"] = rng.choice([0, 2, 99, "1"])
        elif which == 2:
            b = bytearray(prefix)
            struct.pack_into("<H", b, 8, rng.choice([0, 2, 65535]))
            return rebuild(bytes(b), m)
        else:  # flags: unknown bits, or the manifest flag flipped with the stored bytes kept
            b = bytearray(prefix)
            flags = struct.unpack_from("<H", b, 10)[0]
            struct.pack_into("<H", b, 10, rng.choice([flags ^ FLAG_MANIFEST_ZSTD, flags | 2, flags | 0x8000]))
            body = rebuild(prefix, m)[len(prefix) :]
            return bytes(b) + body
        return rebuild(prefix, m)
    # op 6: a seed's manifest on another seed's data
    other = rng.choice(seeds())
    p2, _ = split(other)
    return rebuild(p2, m)


def chunks_of(m: dict[str, Any]) -> list[list[Any]]:
    return [c for s in m["storages"] if isinstance(s, dict) and isinstance(s.get("chunks"), list)
            for c in s["chunks"] if isinstance(c, list) and c]


def check_input(data: bytes) -> str:
    """Decode ``data``; return 'ok' or the S4WError class name. Any other exception propagates."""
    try:
        s4w_core.load(data, map_location="cpu")
    except S4WError as e:
        rep = s4w_core.verify(data)
        if rep.ok:
            raise AssertionError(f"load raised {type(e).__name__} but verify says the file is fine") from e
        return type(e).__name__
    rep = s4w_core.verify(data)
    if not rep.ok:
        raise AssertionError(f"load succeeded but verify found problems: {rep.problems}")
    return "ok"


def run_one(data: bytes) -> None:
    """The fuzz target's input handling (shared by atheris and the regression replays).

    The first byte picks the mode: 0 feeds the remaining bytes to the reader as they are; 1..3
    stacks that many structure-aware mutations of a seed, seeded by the remaining bytes.
    """
    run_one_outcome(data)


def run_one_outcome(data: bytes) -> str:
    """:func:`run_one`, returning :func:`check_input`'s outcome ('ok' or the error class)."""
    if not data:
        return "empty"
    mode = data[0] % 4
    if mode == 0:
        return check_input(bytes(data[1:]))
    rng = random.Random(bytes(data[1:]))
    blob = seeds()[data[0] % len(seeds())]
    for _ in range(mode):
        blob = mutate(blob, rng)
    return check_input(blob)

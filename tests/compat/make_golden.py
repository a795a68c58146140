"""Create the golden files under tests/compat/golden/ — once per format version, by hand.

    python -m tests.compat.make_golden            # writes only files that do not exist yet
    python -m tests.compat.make_golden --force    # overwrite: ONLY for a deliberate, reviewed change

Each ``NAME.s4w`` comes with ``NAME.expected.json``: a description of what it must decode to
(every tensor's dtype, shape, stride, offset and SHA-256 of its bytes; every plain value exactly).
tests/compat/test_golden.py decodes the committed files on every run and compares; it never
writes them. A reader change that cannot decode a released golden file byte-exactly is a format
break. Data is built from integer formulas only (no RNG, no libm), so it is the same everywhere.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).resolve().parent / "golden"


# ----------------------------------------------------------------------------- deterministic data
def _mix(n: int, seed: int) -> torch.Tensor:
    """n pseudo-random 32-bit values (int64 tensor) from integer arithmetic only."""
    x = (torch.arange(n, dtype=torch.int64) * 0x61C88647 + seed * 0x7FEB352D + 12345) % (1 << 32)
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) % (1 << 32)
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) % (1 << 32)
    return x ^ (x >> 15)


def _as(bits: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret unsigned ``width``-bit values (int64 tensor) as ``dtype``."""
    itype = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    signed = torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits) if width < 64 else bits
    return signed.to(itype).view(dtype)


def weights_bf16(n: int, seed: int) -> torch.Tensor:
    """Weight-like bf16: random sign and mantissa, exponent in a narrow band (as trained weights)."""
    h = _mix(n, seed)
    exp = 118 + (h >> 1) % 9
    return _as(((h & 1) << 15) | (exp << 7) | ((h >> 8) & 0x7F), 16, torch.bfloat16)


def weights_fp16(n: int, seed: int) -> torch.Tensor:
    h = _mix(n, seed)
    exp = 8 + (h >> 1) % 8
    return _as(((h & 1) << 15) | (exp << 10) | ((h >> 8) & 0x3FF), 16, torch.float16)


FP32_SPECIALS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00123, 0xFFFFFFFF,
                 0x7F800001, 0x7FA00000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F800000, 0xC0000000]


def weights_fp32(n: int, seed: int) -> torch.Tensor:
    h = _mix(n, seed)
    h2 = _mix(n, seed + 1)
    exp = 118 + (h >> 1) % 9
    bits = ((h & 1) << 31) | (exp << 23) | (h2 & 0x7FFFFF)
    return torch.cat([_as(torch.tensor(FP32_SPECIALS, dtype=torch.int64), 32, torch.float32), _as(bits, 32, torch.float32)])


def moments_rc(rows: int, cols: int, seed: int, width: int) -> torch.Tensor:
    """exp_avg_sq-like (non-negative; exponent = row offset + column offset + noise of 0..2;
    random mantissa) as bf16 (``width`` 16) or fp32 (32): data the row/column transform is for."""
    n = rows * cols
    h = _mix(n, seed)
    i = torch.arange(n, dtype=torch.int64)
    exp = 100 + (_mix(rows, seed + 1) % 12)[i // cols] + (_mix(cols, seed + 2) % 10)[i % cols] + (h >> 1) % 3
    if width == 16:
        return _as((exp << 7) | ((h >> 8) & 0x7F), 16, torch.bfloat16).reshape(rows, cols)
    return _as((exp << 23) | (_mix(n, seed + 3) & 0x7FFFFF), 32, torch.float32).reshape(rows, cols)


def build_objects() -> dict[str, tuple[Any, int]]:
    """Golden name -> (object, segment_elems used when writing it)."""
    emb = torch.nn.Parameter(weights_bf16(64 * 16, 1).reshape(64, 16))
    base = weights_fp32(33, 2).reshape(6, 8)  # 15 specials + 33
    mixed = {
        "model": collections.OrderedDict(
            [
                ("embed.weight", emb),
                ("lm_head.weight", emb),  # tied: one storage, one object
                ("block.w", weights_bf16(3000, 3).reshape(100, 30)),
                ("block.w16", weights_fp16(500, 4)),
                ("block.w32", weights_fp32(600, 5)),
                ("norm.bias", torch.nn.Parameter(torch.zeros(16, dtype=torch.bfloat16), requires_grad=False)),
            ]
        ),
        "views": {"t": base.t(), "cols": base[:, 2:5], "row": base[3], "scalar": torch.tensor(-0.0)},
        "ints": {
            "i64": (_mix(400, 6) % 50).to(torch.int64),
            "i32": (_mix(100, 7) % 1000 - 500).to(torch.int32),
            "i16": (_mix(64, 8) % 7).to(torch.int16),
            "i8": (_mix(256, 9) % 256 - 128).to(torch.int8),
            "u8": (_mix(300, 10) % 4).to(torch.uint8),
            "mask": (_mix(333, 11) % 3 == 0),
            "empty": torch.empty(0, 5, dtype=torch.int64),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": weights_fp32(40, 12)}, 1: {"step": torch.tensor(10.0)}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.1, "params": [0, 1]}],
        },
        "meta": {
            "step": 10, "big": 2**70, "none": None, "flag": True, "nan": float("nan"), "neg_zero": -0.0,
            "inf": float("-inf"), "name": "golden ✓", "blob": b"\x00\x01\xff", "dtype": torch.bfloat16,
            "shape": torch.Size([2, 3]), "tuple": (1, "a", None), "set": {1, 2, 3}, "int_keys": {3: "c", -1: "m"},
        },
    }
    all_bf16 = {"all_bf16": torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)}
    # the CPU writer once it coded byte planes as zstd frames (PLANE_PARAMS), exponent chunks under 64 KiB
    # as deflate where smaller
    zstd_planes = {"bf16": weights_bf16(1 << 16, 21), "fp32": weights_fp32(1 << 16, 22), "small": weights_bf16(1000, 23)}
    # the row/column transforms (FORMAT.md 4.5d): segments of 1000 elements, not whole rows of 80 / 96
    rowcol = {"exp_avg_sq": moments_rc(96, 80, 31, 16), "exp_avg_sq32": moments_rc(64, 96, 32, 32),
              "weight": weights_bf16(96 * 80, 33).reshape(96, 80)}
    return {
        "v1_portable_mixed": (mixed, 1024),
        "v1_portable_rowcol": (rowcol, 1000),
        "v1_portable_all_bf16": (all_bf16, 1 << 14),
        "v1_portable_zstd_planes": (zstd_planes, 1 << 16),
    }


# ----------------------------------------------------------------------------- description
def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def describe(obj: Any) -> Any:
    """A JSON-able, exact description of a loaded object (ties recorded as the first path's id)."""
    seen: dict[int, int] = {}

    def d(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if id(o) in seen:
                return {"tied_to": seen[id(o)]}
            seen[id(o)] = len(seen)
            return {
                "tensor": str(o.dtype).removeprefix("torch."), "shape": list(o.shape), "stride": list(o.stride()),
                "offset": o.storage_offset(), "param": isinstance(o, torch.nn.Parameter), "requires_grad": o.requires_grad,
                "sha256": hashlib.sha256(tensor_bytes(o)).hexdigest(), "id": seen[id(o)],
            }
        if isinstance(o, bool) or o is None or isinstance(o, str):
            return o
        if isinstance(o, int):
            return {"int": str(o)}
        if isinstance(o, float):
            return {"f64": struct.pack("<d", o).hex()}
        if isinstance(o, (bytes, bytearray)):
            return {type(o).__name__: o.hex()}
        if isinstance(o, torch.Size):
            return {"size": list(o)}
        if isinstance(o, tuple):
            return {"tuple": [d(v) for v in o]}
        if isinstance(o, list):
            return [d(v) for v in o]
        if isinstance(o, (set, frozenset)):
            return {type(o).__name__: sorted(json.dumps(d(v), sort_keys=True) for v in o)}
        if isinstance(o, dict):
            return {type(o).__name__: [[d(k), d(v)] for k, v in o.items()]}
        if isinstance(o, torch.dtype):
            return {"dtype": str(o)}
        raise TypeError(type(o))

    return d(obj)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="overwrite existing golden files (format change!)")
    args = ap.parse_args(argv)
    import s4w_core
    from s4w_core import engine

    GOLDEN.mkdir(exist_ok=True)
    for name, (obj, seg) in build_objects().items():
        path, exp = GOLDEN / f"{name}.s4w", GOLDEN / f"{name}.expected.json"
        if (path.exists() or exp.exists()) and not args.force:
            print(f"keep {path.name} (exists; --force to overwrite)")
            continue
        old = engine.SEGMENT_ELEMS
        engine.SEGMENT_ELEMS = seg
        try:
            rep = s4w_core.save(obj, path, profile="portable", extra={"golden": name})
        finally:
            engine.SEGMENT_ELEMS = old
        exp.write_text(json.dumps({"file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                   "describe": describe(s4w_core.load(path))}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path.name}: {rep.raw_bytes} raw -> {rep.file_bytes} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

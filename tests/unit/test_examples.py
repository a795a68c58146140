"""The examples run, and the pure-Python reference reader (examples/read_container.py, which does
not import s4w_core) decodes what s4w_core writes — the proof that docs/FORMAT.md is complete."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import s4w_core
from s4w_core import checksum, engine
from s4w_core.choice import NonzeroTrial
from tests.unit.helpers import bits, forge

ROOT = Path(__file__).resolve().parents[2]


def _same(rc: Any, ref: Any, loaded: Any, path: str = "") -> None:
    if isinstance(loaded, torch.Tensor):
        assert isinstance(ref, rc.Tensor), path
        assert ref.dtype == str(loaded.dtype).removeprefix("torch.")
        assert (ref.shape, ref.stride, ref.offset) == (list(loaded.shape), list(loaded.stride()), loaded.storage_offset())
        assert ref.element_bytes() == bits(loaded).numpy().tobytes(), path
    elif isinstance(loaded, dict):
        assert list(ref) == list(loaded), path
        for k in loaded:
            _same(rc, ref[k], loaded[k], f"{path}/{k}")
    elif isinstance(loaded, (list, tuple)):
        assert type(ref) is type(loaded) and len(ref) == len(loaded), path
        for i, (a, b) in enumerate(zip(ref, loaded)):
            _same(rc, a, b, f"{path}/{i}")


def test_reader_does_not_import_s4w_core() -> None:
    src = (ROOT / "examples" / "read_container.py").read_text()
    assert "s4w_core" not in src.replace("``s4w_core``", "").replace("import ``s4w_core``", "")
    assert "import torch" not in src and "import numpy" not in src


def test_reference_reader_matches_load(rc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "SEGMENT_ELEMS", 777)  # several segments, a short last one
    g = torch.Generator().manual_seed(0)
    obj = {
        "bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(41, 50, generator=g).half().t(),
        "fp32": torch.cat([torch.randn(2000, generator=g), torch.tensor([float("nan"), -0.0, float("inf")])]),
        "fp64": torch.randn(10, generator=g, dtype=torch.float64),
        "ints": [torch.arange(1000) % 7, torch.randint(-9, 9, (100,), dtype=torch.int8, generator=g)],
        "bool": torch.rand(999, generator=g) > 0.3,
        "f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 2),
        "misc": {1: (None, True, float("nan"), 2**70, b"xy", "s"), "odd": {"$x": 1}},
    }
    obj["tied"] = obj["bf16"]
    obj["slice"] = obj["bf16"][100:200:3]
    blob = io.BytesIO()
    s4w_core.save(obj, blob, profile="portable")
    tree, manifest = rc.read(blob.getvalue())
    assert manifest["version"] == 1
    _same(rc, tree, s4w_core.load(blob.getvalue()))
    assert tree["tied"] is tree["bf16"]


@pytest.mark.parametrize("op", ["xor", "sub", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_reader_delta(rc: Any, op: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both delta ops (FORMAT.md 4.4) decode in the reference reader."""
    if op != "auto":
        if op not in getattr(__import__("s4w_core.delta").delta, "OPS", ("xor",)):
            pytest.skip(f"this s4w_core has no delta op {op!r}")
        monkeypatch.setattr(engine, "choose_delta_op", lambda job, transform, ops=None: op)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5000, generator=g).to(dtype)
    x = (base.float() * (1 + 1e-3 * torch.randn(5000, generator=g))).to(dtype)
    buf = io.BytesIO()
    rep = s4w_core.save({"x": x}, buf, profile="portable", _base_lookup=lambda p, n, d: (bits(base), {"b": 0}))
    assert rep.delta_tensors == 1
    if op != "auto":
        from tests.unit.helpers import split

        assert split(buf.getvalue())[2]["storages"][0]["delta"]["op"] == op
    with pytest.raises(rc.FormatError, match="base"):
        rc.read(buf.getvalue())
    tree, _m = rc.read(buf.getvalue(), bases={"x": bits(base).numpy().tobytes()})
    assert tree["x"].element_bytes() == bits(x).numpy().tobytes()


@pytest.mark.parametrize("op", [None, "xor", "sub"])
@pytest.mark.parametrize("tr", ["nz-planes-rotl1", "nz-planes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_reader_nonzero(
    rc: Any, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tr: str, op: str | None
) -> None:
    """The nonzero transforms (FORMAT.md 4.5c), plain and as deltas, decode in the reference reader:
    segments whose bitmaps end mid-byte, an all-zero segment, -0.0 (a nonzero pattern)."""
    monkeypatch.setattr(engine, "SEGMENT_ELEMS", 1003)
    monkeypatch.setattr(engine, "nonzero_trial", lambda *a, **k: NonzeroTrial(True))
    if tr == "nz-planes":
        monkeypatch.setattr(engine, "transform_for", lambda dt, nb, transform=None: ("planes", dt.itemsize))
    if op is not None:
        monkeypatch.setattr(engine, "choose_delta_op", lambda job, transform, ops=None: op)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5000, generator=g).to(dtype)
    x[1003:2006] = 0  # one whole segment of zeros
    x[torch.rand(5000, generator=g) < 0.5] = 0
    x[7] = -0.0
    base = x.clone()
    base[torch.rand(5000, generator=g) < 0.1] = 1.5
    kw: dict[str, Any] = {} if op is None else {"_base_lookup": lambda p, n, d: (bits(base), {"b": 0})}
    buf = io.BytesIO()
    s4w_core.save({"x": x}, buf, profile="portable", **kw)
    from tests.unit.helpers import split

    entry = split(buf.getvalue())[2]["storages"][0]
    assert entry["transform"] == tr and (entry["delta"] or {}).get("op") == op
    bases = None if op is None else {"x": bits(base).numpy().tobytes()}
    tree, _m = rc.read(buf.getvalue(), bases=bases)
    assert tree["x"].element_bytes() == bits(x).numpy().tobytes()


def test_reference_reader_checks(rc: Any) -> None:
    blob = io.BytesIO()
    s4w_core.save({"x": torch.randn(1000)}, blob)
    data = bytearray(blob.getvalue())
    data[20] ^= 1
    with pytest.raises(rc.FormatError, match="checksum"):
        rc.read(bytes(data))
    with pytest.raises(rc.FormatError):
        rc.read(blob.getvalue()[:-1])
    gpu = forge(blob.getvalue(), lambda m: m["storages"][0]["chunks"][0].__setitem__(0, "nvcomp-ans"))
    with pytest.raises(rc.FormatError, match="CPU decoder"):
        rc.read(gpu, check=False)


def test_fold64_reference_matches_core(rc: Any) -> None:
    g = torch.Generator().manual_seed(2)
    for n in (0, 1, 3, 4, 5, 1000, 4099):
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert rc.fold64(raw.numpy().tobytes()) == checksum.fold64(raw)
    # and a fold64-checksummed storage (as the GPU writer records it) passes the reference check
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    rc.check_raw_checksum(f"fold64:{checksum.fold64(raw):016x}", raw.numpy().tobytes(), "x")
    with pytest.raises(rc.FormatError):
        rc.check_raw_checksum(f"fold64:{checksum.fold64(raw) ^ 1:016x}", raw.numpy().tobytes(), "x")


def test_reader_cli(tmp_path: Path) -> None:
    p = tmp_path / "c.s4w"
    s4w_core.save({"w": torch.ones(5, dtype=torch.bfloat16), "step": 1}, p)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "read_container.py"), str(p), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "every checksum OK" in r.stdout and "bfloat16(5,)" in r.stdout


TINY = ["--steps", "6", "--save-every", "3", "--d-model", "32", "--layers", "1", "--ctx", "32",
        "--batch", "4", "--corpus-bytes", "200000"]


@pytest.mark.parametrize("mode", ["plain", "store"])
def test_train_tiny_runs_saves_and_resumes(tmp_path: Path, mode: str) -> None:
    if mode == "store" and not hasattr(s4w_core, "CheckpointStore"):
        pytest.skip("s4w_core.CheckpointStore does not exist yet")
    out = tmp_path / "run"
    extra = ["--plain-files"] if mode == "plain" else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "examples" / "train_tiny.py"), "--out", str(out), *TINY, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stdlib source" in r.stdout and "reloaded step 6: bit-exact" in r.stdout
    assert r.stdout.count("saved in") == 2
    cmd[cmd.index("--steps") + 1] = "9"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from step 6" in r.stdout and "reloaded step 9: bit-exact" in r.stdout


# README's and docs' python blocks run in tests/unit/test_docs_snippets.py (each in a fresh interpreter).

"""The ``s4w`` command, ``import s4w_core`` without GPU packages, and the integration packages' hints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import s4w_core
from s4w_core import cli
from tests.unit.helpers import split

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    p = tmp_path / "c.s4w"
    s4w_core.save({"model": {"w": torch.randn(300).to(torch.bfloat16), "b": torch.zeros(7)}, "step": 3}, p)
    return p


def test_info_text(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "s4weights v1" in out and "profile portable" in out and "bfloat16" in out and ("deflate" in out or "zstd" in out)


def test_info_json(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", str(ckpt), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tensors"] == 2 and d["format_version"] == 1 and d == json.loads(json.dumps(s4w_core.info(ckpt)))


def test_verify_ok_and_corrupt(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["verify", str(ckpt)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    blob = bytearray(ckpt.read_bytes())
    _p, _t, m = split(bytes(blob))
    off = m["storages"][0]["chunks"][0][1]
    blob[off] ^= 0xFF
    bad = ckpt.with_name("bad.s4w")
    bad.write_bytes(bytes(blob))
    assert cli.main(["verify", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "FAIL" in err and "ChecksumMismatchError" in err
    bad.write_bytes(bytes(blob[:100]))
    assert cli.main(["verify", str(bad)]) == 1
    assert "TruncatedError" in capsys.readouterr().err


def test_errors_exit_1_with_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", str(tmp_path / "nope.s4w")]) == 1
    assert "CheckpointNotFoundError" in capsys.readouterr().err
    (tmp_path / "x.bin").write_bytes(b"hello world" * 10)
    assert cli.main(["info", str(tmp_path / "x.bin")]) == 1
    assert "BadMagicError" in capsys.readouterr().err


def test_convert(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "conv.s4w"
    assert cli.main(["convert", str(ckpt), str(out), "--profile", "portable"]) == 0
    a, b = s4w_core.load(ckpt), s4w_core.load(out)
    assert torch.equal(a["model"]["w"].view(torch.int16), b["model"]["w"].view(torch.int16)) and b["step"] == 3


def test_console_script_selftest_quick() -> None:
    """`s4w selftest --quick` through the installed entry point (or `python -m` when not installed)."""
    exe = Path(sys.executable).with_name("s4w")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "s4w_core.cli"]
    r = subprocess.run([*cmd, "selftest", "--quick"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "FAIL" not in r.stdout


def test_selftest_detects_a_broken_codec(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The self-test gate must fail when a round trip is not bit-exact."""
    import s4w_core.engine as engine
    from s4w_core.selftest import run_selftest

    real = engine.merge_into

    def broken(parts: Any, w: int, out: np.ndarray, base: np.ndarray | None = None) -> None:
        real(parts, w, out, base)
        if out.size > 3:
            out[3] ^= 1  # one flipped bit

    monkeypatch.setattr(engine, "merge_into", broken)
    monkeypatch.setattr(engine.ck, "verify_tensor_checksum", lambda expected, data: True)  # hide it from the checksum
    assert run_selftest(quick=True, verbose=True) is False
    assert "FAIL" in capsys.readouterr().out


BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
            return None
    sys.meta_path.insert(0, Block())
    """
)


def _run_blocked(blocked: set[str], body: str) -> subprocess.CompletedProcess[str]:
    code = BLOCKER.replace("{BLOCKED!r}", repr(sorted(blocked))) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_import_without_gpu_packages() -> None:
    r = _run_blocked(
        {"triton", "nvidia", "cupy"},
        """
        import io, sys, torch
        import s4w_core, s4w_core.cli, s4w_core.api
        assert not any(m.split(".")[0] in ("triton", "nvidia") for m in sys.modules), sorted(sys.modules)
        buf = io.BytesIO()
        rep = s4w_core.save({"x": torch.ones(10, dtype=torch.bfloat16)}, buf, profile="auto")
        assert rep.profile == "portable"
        assert torch.equal(s4w_core.load(buf.getvalue())["x"], torch.ones(10, dtype=torch.bfloat16))
        try:
            s4w_core.save({"x": torch.ones(2)}, io.BytesIO(), profile="fast")
        except s4w_core.BackendUnavailableError as e:
            assert "gpu-cu12" in str(e)
        else:
            raise SystemExit("fast profile did not fail")
        print("ok")
        """,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.parametrize(
    ("pkg", "framework", "extra"),
    [
        ("s4w_lightning", {"lightning", "pytorch_lightning"}, "lightning"),
        ("s4w_transformers", {"transformers"}, "transformers"),
        ("s4w_accelerate", {"accelerate"}, "accelerate"),
    ],
)
def test_integration_without_its_framework_says_what_to_install(pkg: str, framework: set[str], extra: str) -> None:
    r = _run_blocked(
        framework,
        f"""
        try:
            import {pkg}
        except ImportError as e:
            print("MSG:", e)
        else:
            raise SystemExit("imported without its framework")
        """,
    )
    assert r.returncode == 0, r.stderr
    assert f"pip install 's4weights[{extra}]'" in r.stdout, r.stdout


def test_version_is_single_sourced() -> None:
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "s4weights"
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "s4w_core._version.__version__"}
    assert meta["project"]["scripts"]["s4w"] == "s4w_core.cli:main"
    from importlib import metadata

    try:
        assert metadata.version("s4weights") == s4w_core.__version__
    except metadata.PackageNotFoundError:
        pass  # running from a source tree without installing

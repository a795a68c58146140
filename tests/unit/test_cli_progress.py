"""Progress bars of the ``s4w`` command: on stderr with ``--progress`` or when stderr is a terminal,
never with ``--no-progress`` (or ``restore --quiet``), and the commands' output unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import s4w_core
from s4w_core.cli import main
from s4w_core.store import CheckpointStore


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    p = tmp_path / "c.s4w"
    s4w_core.save({"w": torch.randn(20000).to(torch.bfloat16), "step": 1}, p)
    return p


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    st = CheckpointStore(url, keyframe_every=3, profile="portable")
    w = torch.randn(3000)
    for s in (10, 20, 30):
        w = w + 1e-3
        st.save({"w": w.clone()}, s)
    st.close()  # the re-encoding behind the last save finishes before the CLI reads the store
    return url


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_file_verify_bar_only_when_asked_or_on_a_terminal(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rc, out, err = _run(capsys, "verify", str(ckpt), "--progress")
    assert rc == 0 and out.startswith("OK") and "verify" in err
    rc, out2, err = _run(capsys, "verify", str(ckpt), "--no-progress")
    assert rc == 0 and out2 == out and err == ""
    rc, _, err = _run(capsys, "verify", str(ckpt))  # stderr is not a terminal under pytest
    assert rc == 0 and err == ""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, _, err = _run(capsys, "verify", str(ckpt))
    assert rc == 0 and "verify" in err
    rc, _, err = _run(capsys, "verify", str(ckpt), "--no-progress")
    assert rc == 0 and err == ""
    assert main(["verify", str(ckpt), "--progress", "--no-progress"]) == 2  # a usage error


def test_file_verify_with_bar_still_reports_corruption(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.s4w"
    bad.write_bytes(ckpt.read_bytes()[:100])
    rc, _, err = _run(capsys, "verify", str(bad), "--progress")
    assert rc == 1 and "TruncatedError" in err
    blob = bytearray(ckpt.read_bytes())
    blob[200] ^= 0xFF  # inside the data region
    bad.write_bytes(bytes(blob))
    rc, _, err = _run(capsys, "verify", str(bad), "--progress")
    assert rc == 1 and "FAIL" in err


def test_convert_with_bars(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "conv.s4w"
    rc, stdout, err = _run(capsys, "convert", str(ckpt), str(out), "--progress")
    assert rc == 0 and f"read {ckpt}" in err and f"write {out}" in err
    assert stdout.startswith(f"{out}: ")
    a, b = s4w_core.load(ckpt), s4w_core.load(out)
    assert torch.equal(a["w"].view(torch.int16), b["w"].view(torch.int16)) and b["step"] == 1
    rc, _, err = _run(capsys, "convert", str(ckpt), str(tmp_path / "c2.s4w"), "--no-progress")
    assert rc == 0 and err == ""


def test_store_commands_bars(store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "verify", store, "--progress")
    assert rc == 0 and out.count("OK ") == 3 and "verify steps" in err and "load step" in err
    rc, out, err = _run(capsys, "verify", store, "--no-progress")
    assert rc == 0 and out.count("OK ") == 3 and err == ""
    for cmd in ("ls", "stats"):
        rc, out, err = _run(capsys, cmd, store, "--progress")
        assert rc == 0 and "read commit records" in err and "/3" in err, cmd
        rc, out2, err = _run(capsys, cmd, store, "--no-progress")
        assert rc == 0 and err == "" and out2 == out
    rc, out, err = _run(capsys, "restore", store, "--step", "20", "--out", str(tmp_path / "r.pt"), "--progress")
    assert rc == 0 and "load step 20" in err and out.startswith("restored step 20")
    rc, out, err = _run(capsys, "restore", store, "--out", str(tmp_path / "r2.pt"), "--quiet")
    assert rc == 0 and err == ""
    rc, out, err = _run(capsys, "gc", store, "--progress", "--grace", "0")
    assert rc == 0 and "gc: read commit records" in err and out.startswith("freed")
    rc, out, err = _run(capsys, "rm", store, "--step", "30", "--progress")
    assert rc == 0 and "delete" in err and out == "deleted step 30\n"
    assert CheckpointStore(store).steps() == [10, 20]

"""Every ``s4w`` command given bad arguments or bad input: one line on stderr, no traceback, the
right exit status (2 for usage errors, 1 for bad input or a failed check); plus the CLI's own
promises (--version, help for every argument, a closed pipe, file kinds named, ``s4w import``)."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import s4w_core
from s4w_core import cli

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """A container, a store, a torch file, a safetensors file, garbage, a folder, a plain file."""
    from safetensors.torch import save_file

    d = {
        "ckpt": tmp_path / "c.s4w",
        "store": tmp_path / "store",
        "pt": tmp_path / "plain.pt",
        "legacy": tmp_path / "legacy.pt",
        "st": tmp_path / "w.safetensors",
        "junk": tmp_path / "junk.bin",
        "trunc": tmp_path / "trunc.s4w",
        "badzip": tmp_path / "bad.pt",
        "evil": tmp_path / "evil.pt",
        "afile": tmp_path / "afile",
        "dir": tmp_path / "folder",
    }
    s4w_core.save({"w": torch.randn(64), "step": 1}, d["ckpt"])
    st = s4w_core.CheckpointStore(str(d["store"]), delta=False)
    st.save({"w": torch.randn(64)}, 5)
    st.close()
    torch.save({"w": torch.ones(3)}, d["pt"])
    torch.save({"w": torch.ones(3)}, d["legacy"], _use_new_zipfile_serialization=False)
    save_file({"w": torch.ones(3)}, str(d["st"]))
    d["junk"].write_bytes(b"hello world" * 10)
    d["trunc"].write_bytes(d["ckpt"].read_bytes()[:100])
    d["badzip"].write_bytes(b"PK\x03\x04" + b"\x00" * 200)
    torch.save({"w": torch.ones(2), "x": _Evil(str(tmp_path / "pwned"))}, d["evil"])
    d["afile"].write_text("not a folder")
    d["dir"].mkdir()
    return {k: str(v) for k, v in d.items()}


class _Evil:
    """Unpickling this would create a file (the marker that code ran)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


USAGE = [  # (argv, what stderr names)
    ([], "required"),
    (["nosuch"], "invalid choice"),
    (["info"], "required: path"),
    (["info", "{ckpt}", "--bogus"], "unrecognized arguments"),
    (["info", "{store}", "--step", "1.5"], "a step is a whole number"),
    (["verify", "{ckpt}", "--map-location", "floppy:9"], "not a torch device"),
    (["verify", "{ckpt}", "--progress", "--no-progress"], "not allowed with"),
    (["selftest", "--bogus"], "unrecognized arguments"),
    (["convert", "{ckpt}"], "required: dst"),
    (["convert", "{ckpt}", "x.s4w", "--profile", "tiny"], "invalid choice"),
    (["import"], "required: src, dst"),
    (["import", "{pt}", "x.s4w", "--map-location", "nowhere"], "not a torch device"),
    (["ls"], "required: url"),
    (["restore", "{store}"], "required: --out"),
    (["restore", "{store}", "--out", "x.pt", "--step", "-1"], "a step is between 0"),
    (["restore", "{store}", "--out", "x.pt", "--step", "last"], "a step is a whole number"),
    (["restore", "{store}", "--out", "x.pt", "--format", "zip"], "invalid choice"),
    (["stats"], "required: url"),
    (["rm", "{store}"], "required: --step"),
    (["rm", "{store}", "--step"], "expected at least one argument"),
    (["gc", "{store}", "--grace", "-5"], "seconds >= 0"),
    (["gc", "{store}", "--grace", "soon"], "a number of seconds"),
    (["pin", "{store}", "--step", "x"], "a step is a whole number"),
]

BAD_INPUT = [  # (argv, what stderr names); exit 1
    (["info", "{tmp}/nope.s4w"], "CheckpointNotFoundError"),
    (["info", "{junk}"], "BadMagicError"),
    (["info", "{trunc}"], "TruncatedError"),
    (["info", "{pt}"], "is a PyTorch file (torch.save), not an s4weights container: import it with `s4w import"),
    (["info", "{legacy}"], "is a PyTorch file"),
    (["info", "{st}"], "is a safetensors file"),
    (["info", "{store}", "--step", "99"], "no committed step 99"),
    (["verify", "{tmp}/nope.s4w"], "CheckpointNotFoundError"),
    (["verify", "{pt}"], "is a PyTorch file"),
    (["verify", "{junk}"], "FAIL"),
    (["verify", "{trunc}"], "TruncatedError"),
    (["verify", "{store}", "--step", "99"], "no committed step 99"),
    (["convert", "{tmp}/nope.s4w", "{tmp}/o.s4w"], "CheckpointNotFoundError"),
    (["convert", "{st}", "{tmp}/o.s4w"], "s4w import"),
    (["convert", "{ckpt}", "{afile}/x.s4w"], "afile"),
    (["import", "{tmp}/nope.pt", "{tmp}/o.s4w"], "no such file"),
    (["import", "{junk}", "{tmp}/o.s4w"], "neither a PyTorch"),
    (["import", "{badzip}", "{tmp}/o.s4w"], "not a readable PyTorch file"),
    (["import", "{evil}", "{tmp}/o.s4w"], "weights_only=True) refused it"),
    (["import", "{pt}", "{afile}/x.s4w"], "afile"),
    (["ls", "{tmp}/nope"], "no such directory"),
    (["ls", "{afile}"], "is a file, not a checkpoint store"),
    (["restore", "{tmp}/nope", "--out", "{tmp}/r.pt"], "no such directory"),
    (["restore", "{store}", "--step", "99", "--out", "{tmp}/r.pt"], "no committed step 99"),
    (["restore", "{store}", "--out", "{dir}"], "is a directory"),
    (["restore", "{store}", "--out", "{afile}/r.pt"], "afile"),
    (["stats", "{afile}"], "is a file"),
    (["rm", "{afile}", "--step", "1"], "is a file"),
    (["gc", "{tmp}/nope"], "no such directory"),
    (["pin", "{store}", "--step", "99"], "99"),
]


def _fill(argv: list[str], files: dict[str, str], tmp: Path) -> list[str]:
    return [a.format(tmp=tmp, **files) for a in argv]


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("argv", "want"), USAGE, ids=[" ".join(a) or "(none)" for a, _ in USAGE])
def test_usage_errors(argv: list[str], want: str, files: dict[str, str], tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(_fill(argv, files, tmp_path)) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert out == "" and line.startswith("s4w") and "error:" in line and want in line, line


@pytest.mark.parametrize(("argv", "want"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input(argv: list[str], want: str, files: dict[str, str], tmp_path: Path,
                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(_fill(argv, files, tmp_path)) == 1
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert out == "" and want in line, line
    assert not (tmp_path / "pwned").exists()  # s4w import never runs code from a file


def test_every_command_and_argument_has_help() -> None:
    parser = cli.build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    assert len(subs) == 1
    names = {c.dest for c in subs[0]._choices_actions}  # noqa: SLF001
    assert {"info", "verify", "selftest", "convert", "import", "ls", "restore", "stats", "rm", "gc", "pin"} <= names
    assert all(c.help for c in subs[0]._choices_actions)  # noqa: SLF001
    missing = [
        f"{name} {a.dest}"
        for name, p in [("s4w", parser), *subs[0].choices.items()]
        for a in p._actions  # noqa: SLF001
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help  # noqa: SLF001
    ]
    assert not missing, missing


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip().startswith(f"s4w {s4w_core.__version__} (torch ")


def test_unexpected_errors_are_one_line_too(monkeypatch: pytest.MonkeyPatch, files: dict[str, str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A bug (an exception outside the error family) still prints one line; S4W_TRACEBACK=1
    lets the traceback through."""
    def boom(*a: object, **k: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli, "info", boom)
    monkeypatch.delenv("S4W_TRACEBACK", raising=False)
    assert cli.main(["info", files["ckpt"]]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "unexpected ZeroDivisionError" in line and "S4W_TRACEBACK=1" in line
    monkeypatch.setenv("S4W_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        cli.main(["info", files["ckpt"]])


def test_interrupt(monkeypatch: pytest.MonkeyPatch, files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "verify", interrupted)
    assert cli.main(["verify", files["ckpt"], "--no-progress"]) == 130
    assert _one_line(capsys.readouterr().err) == "s4w: error: interrupted"


def test_closed_pipe_is_quiet(files: dict[str, str]) -> None:
    """`s4w info x | head -1`: the reader is gone before s4w writes (the pipe is closed before the
    interpreter has even started): no BrokenPipeError traceback, no message."""
    p = subprocess.Popen([sys.executable, "-m", "s4w_core.cli", "info", files["ckpt"]], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=ENV)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1
    assert err == "", err


def test_errors_through_the_console_script(files: dict[str, str], tmp_path: Path) -> None:
    """The same through a real process: exit status and one line, no traceback."""
    for argv, code in ((["info", str(tmp_path / "nope.s4w")], 1), (["restore", files["store"]], 2),
                       (["ls", files["afile"]], 1)):
        r = subprocess.run([sys.executable, "-m", "s4w_core.cli", *argv], capture_output=True, text=True, env=ENV,
                           timeout=120)
        assert r.returncode == code and r.stdout == "", r
        _one_line(r.stderr)


def test_import_torch_and_safetensors_bit_exact(files: dict[str, str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, generator=g).to(torch.bfloat16), "b": torch.randn(7, generator=g),
             "n": torch.tensor([float("nan"), -0.0])}
    torch.save({"model": state, "step": 7}, tmp_path / "t.pt")
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "t.safetensors"))
    for src in ("t.pt", "t.safetensors"):
        out = tmp_path / "imported" / (src + ".s4w")
        assert cli.main(["import", str(tmp_path / src), str(out)]) == 0
        got = s4w_core.load(out)
        if src == "t.pt":
            assert got["step"] == 7
            flat_got = got["model"]
        else:
            flat_got = got
        for k, v in state.items():
            assert flat_got[k].dtype == v.dtype and torch.equal(flat_got[k].view(torch.uint8), v.view(torch.uint8)), k
    assert "->" in capsys.readouterr().out


def test_names_from_a_file_cannot_drive_the_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "e.s4w"
    s4w_core.save({"\x1b[2J\x1b]0;pwned\x07evil": {"w\x9b": torch.ones(3)}}, p)
    assert cli.main(["info", str(p)]) == 0
    out = capsys.readouterr().out
    assert "\\x1b[2J" in out and not any(c in out for c in "\x1b\x07\x9b")
    buf = io.BytesIO()
    torch.save({"\x1b[31mred": torch.ones(2)}, buf)
    (tmp_path / "e.pt").write_bytes(buf.getvalue())
    assert cli.main(["import", str(tmp_path / "e.pt"), str(tmp_path / "e2.s4w")]) == 0
    assert "\x1b" not in capsys.readouterr().out


def test_file_kind_of_a_zip_that_is_not_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A zip that is no torch file: import fails with one line naming the file."""
    with zipfile.ZipFile(tmp_path / "x.pt", "w") as z:
        z.writestr("hello.txt", "hi")
    assert cli.main(["import", str(tmp_path / "x.pt"), str(tmp_path / "x.s4w")]) == 1
    assert "not a readable PyTorch file" in _one_line(capsys.readouterr().err)

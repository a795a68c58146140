"""The local store's files and folders: the modes open() gives, and nothing created by reading."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import s4w_core

ROOT = Path(__file__).resolve().parents[2]


def test_store_files_have_the_modes_save_gives(tmp_path: Path) -> None:
    """Under umask 022 every object of a store is 0644, like a file of s4w_core.save (mkstemp
    alone would make them 0600)."""
    code = textwrap.dedent(
        f"""
        import os, stat
        os.umask(0o022)
        import torch, s4w_core
        st = s4w_core.CheckpointStore({str(tmp_path / "store")!r})
        for step in (1, 2):
            st.save({{"w": torch.randn(100) + step}}, step)
        st.close()
        s4w_core.save({{"w": torch.ones(2)}}, {str(tmp_path / "one.s4w")!r})
        modes = {{oct(stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode)) for d, _, fs in os.walk({str(tmp_path / "store")!r}) for f in fs}}
        print(sorted(modes), oct(stat.S_IMODE(os.stat({str(tmp_path / "one.s4w")!r}).st_mode)))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['0o644']", "0o644"]


def test_reading_a_mistyped_store_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(s4w_core.CheckpointNotFoundError):
        s4w_core.load_checkpoint("runs/typo")
    st = s4w_core.CheckpointStore("runs/typo2")
    assert st.steps() == [] and st.list() == []
    st.close()
    assert os.listdir(tmp_path) == []
    st = s4w_core.CheckpointStore("runs/new")  # the first save creates it
    st.save({"x": 1}, 1)
    st.close()
    assert os.listdir(tmp_path / "runs") == ["new"]


def test_a_file_is_not_a_store(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(s4w_core.StoreError, match="is a file, not a directory"):
        s4w_core.CheckpointStore(str(f))


# ----------------------------------------------------------------------------- durable=False
class _Fsyncs:
    """Counts os.fsync calls (observes; every call still runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = os.fsync

        def counted(fd: int) -> None:
            self.n += 1
            real(fd)

        monkeypatch.setattr(os, "fsync", counted)


@pytest.mark.parametrize("durable", [True, False])
def test_a_store_fsyncs_unless_durable_is_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool) -> None:
    """``durable=False`` drops every fsync of a save, its re-encoding and its retention (the bytes
    stay in the page cache, as torch.save's do); the steps load bit-exactly either way, and no
    temporary file is left."""
    import torch

    fs = _Fsyncs(monkeypatch)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 16, generator=g).to(torch.bfloat16)
    states = []
    for i in range(4):  # a few elements change per step: the deltas pay
        w = w.clone()
        w[torch.randint(0, w.numel(), (200,), generator=g)] += 1
        states.append({"w": w, "step": i})
    st = s4w_core.CheckpointStore(str(tmp_path / "s"), keep_last=3, durable=durable)
    assert st.durable is durable
    for i, s in enumerate(states):
        st.save(s, i + 1)
    st.wait()
    assert [r.kind for r in st.list()] == ["delta", "delta", "keyframe"]  # re-encoded behind the saves
    assert (fs.n > 0) is durable
    st.close()
    st = s4w_core.CheckpointStore(str(tmp_path / "s"))
    for i in (1, 2, 3):
        got = st.load(i + 1)
        assert torch.equal(got["w"].view(torch.int16), states[i]["w"].view(torch.int16)) and got["step"] == i
    assert st.backend.list_temporaries() == []  # type: ignore[attr-defined]
    st.close()


@pytest.mark.parametrize("durable", [True, False])
def test_a_single_file_save_fsyncs_unless_durable_is_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool) -> None:
    """``s4w_core.save(..., durable=False)`` (and the Lightning plugin's ``delta=False`` files, through
    ``Files.save``): temp file and rename, no fsync; the file loads the same."""
    import torch

    from s4w_core import frameworks

    fs = _Fsyncs(monkeypatch)
    x = torch.arange(1000, dtype=torch.float32)
    s4w_core.save({"x": x}, str(tmp_path / "a.s4w"), durable=durable)
    frameworks.Files({"durable": durable}).save(str(tmp_path / "b.s4w"), {"x": x}, "portable")
    assert (fs.n > 0) is durable
    for name in ("a.s4w", "b.s4w"):
        assert torch.equal(s4w_core.load(str(tmp_path / name))["x"], x)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.s4w", "b.s4w"]  # no temp file left


def test_pointer_files_follow_the_stores_durability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from s4w_core import frameworks

    fs = _Fsyncs(monkeypatch)
    frameworks.Files({"durable": False}).write(str(tmp_path / "p.ckpt"), b"abc")
    assert fs.n == 0 and (tmp_path / "p.ckpt").read_bytes() == b"abc"
    assert [p.name for p in tmp_path.iterdir()] == ["p.ckpt"]
    frameworks.Files().write(str(tmp_path / "q.ckpt"), b"abc")
    assert fs.n == 2  # the file and its directory


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_durable_must_be_a_bool(tmp_path: Path, bad: object) -> None:
    from s4w_core import frameworks

    with pytest.raises(ValueError, match="durable must be True or False"):
        s4w_core.CheckpointStore(str(tmp_path / "s"), durable=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="durable must be True or False"):  # an adapter's store_options
        frameworks.Files({"durable": bad})

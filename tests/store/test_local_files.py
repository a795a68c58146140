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

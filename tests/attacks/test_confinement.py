"""Nothing is written outside the target, and storage failures are StoreErrors naming the path.

Unpacking a folder never follows a symbolic link (planted where a directory of the tree goes) out of
its target; names with NUL bytes or traversal are refused; a single-file save that runs out of
space (a real ``EFBIG`` from ``RLIMIT_FSIZE``; ``ENOSPC`` from ``/dev/full``) raises
:class:`StoreError` naming the path and leaves nothing behind.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import s4w_core
from s4w_core._fsutil import storage_errors
from s4w_core.errors import ManifestError, StoreError, UnsafePathError
from s4w_core.filepack import pack_folder, replace_with_marker, unpack_folder

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _tree(tmp_path, files: dict[str, bytes]):  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    for rel, data in files.items():
        p = src.joinpath(*rel.split("/"))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return pack_folder(src)


def _through_a_container(tree):  # type: ignore[no-untyped-def]
    buf = io.BytesIO()
    s4w_core.save(tree, buf)
    return s4w_core.load(buf.getvalue())


def _snapshot(d) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    out = {}
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


def test_symlinked_directory_in_the_target_is_not_followed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tree = _through_a_container(_tree(tmp_path, {"sub/f.bin": b"x" * 10, "a.bin": b"a"}))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(outside, target / "sub")  # planted: target/sub -> outside
    before = _snapshot(outside)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        unpack_folder(tree, target)
    assert _snapshot(outside) == before  # nothing written through the link
    assert os.path.islink(target / "sub")


def test_symlink_deeper_in_the_path_and_to_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tree = _through_a_container(_tree(tmp_path, {"a/b/c/f.bin": b"x"}))
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "target"
    (target / "a").mkdir(parents=True)
    os.symlink(outside, target / "a" / "b")
    with pytest.raises(UnsafePathError):
        unpack_folder(tree, target)
    assert os.listdir(outside) == []
    # a symlink to a file where a directory goes
    (tmp_path / "file").write_bytes(b"f")
    target2 = tmp_path / "target2"
    target2.mkdir()
    os.symlink(tmp_path / "file", target2 / "a")
    with pytest.raises(UnsafePathError):
        unpack_folder(tree, target2)
    assert (tmp_path / "file").read_bytes() == b"f"


def test_symlink_where_a_file_goes_is_replaced_not_written_through(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tree = _through_a_container(_tree(tmp_path, {"f.bin": b"new"}))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(victim, target / "f.bin")
    unpack_folder(tree, target)
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(target / "f.bin") and (target / "f.bin").read_bytes() == b"new"


def test_a_clean_unpack_still_works(tmp_path) -> None:  # type: ignore[no-untyped-def]
    files = {"a/b/f.bin": b"x" * 100, "g.bin": b"y", "a/h.bin": b"z"}
    target = tmp_path / "target"
    unpack_folder(_through_a_container(_tree(tmp_path, files)), target)
    assert _snapshot(target) == {k.replace("/", os.sep): v for k, v in files.items()}


@pytest.mark.parametrize("name", ["a\x00b", "a/./b", ".", "a/\x00/b"])
def test_unsafe_names_are_refused(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    tree = _tree(tmp_path, {"f.bin": b"x"})
    tree["files"] = {name: tree["files"]["f.bin"]}
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(ManifestError, match="unsafe path"):
        unpack_folder(_through_a_container(tree), target)
    assert os.listdir(target) == []


def test_enospc_is_a_store_error_naming_it() -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(StoreError, match="ENOSPC: no space left on device") as ei:
        with storage_errors("/dev/full"), open("/dev/full", "wb") as f:
            f.write(b"x" * 65536)
            f.flush()
    assert "/dev/full" in str(ei.value) and isinstance(ei.value.__cause__, OSError)


def test_save_past_the_file_size_limit_is_a_store_error_and_leaves_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real write failure (EFBIG from RLIMIT_FSIZE, in a child): StoreError naming the path and
    the errno; the previous file at the path is intact and no temporary file is left."""
    target = tmp_path / "ckpt.s4w"
    s4w_core.save({"w": torch.ones(4)}, target)
    before = target.read_bytes()
    code = textwrap.dedent(
        f"""
        import resource, signal, sys, torch, s4w_core
        from s4w_core.errors import StoreError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            s4w_core.save({{"w": torch.randn(1 << 20)}}, {str(target)!r})
        except StoreError as e:
            print("STORE", e)
            sys.exit(0)
        sys.exit(3)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STORE" in r.stdout and str(target) in r.stdout and "EFBIG" in r.stdout, r.stdout
    assert target.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.s4w"]


def test_loading_a_directory_is_a_store_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StoreError, match=str(tmp_path)):
        s4w_core.load(tmp_path)


def test_replace_with_marker_never_deletes_through_a_symlink(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A directory of a packed folder swapped for a symbolic link (to a place outside) before the
    packed files are deleted: nothing outside is deleted; unsafe names are refused."""
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "f.bin").write_bytes(b"x")
    (folder / "top.bin").write_bytes(b"t")
    tree = pack_folder(folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f.bin").write_bytes(b"precious")
    (folder / "sub" / "f.bin").unlink()
    (folder / "sub").rmdir()
    os.symlink(outside, folder / "sub")
    replace_with_marker(folder, tree["files"], "marker.json", {"step": 1})
    assert (outside / "f.bin").read_bytes() == b"precious"
    assert sorted(os.listdir(folder)) == ["marker.json", "sub"]
    with pytest.raises(ManifestError, match="unsafe path"):
        replace_with_marker(folder, ["../outside/f.bin"], "marker.json", {"step": 1})
    assert (outside / "f.bin").exists()

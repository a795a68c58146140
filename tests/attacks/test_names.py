"""Names from a file or a caller that become paths: store object keys (from commit records, and at
the local backend), a pointer's store, a packed folder's files. NUL bytes, other control
characters, backslashes, ``.``/``..``/empty components and absolute names are refused with an
S4WError naming the name, before any path is touched (docs/SECURITY.md)."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from s4w_core import pointer
from s4w_core._fsutil import is_safe_name, name_parts
from s4w_core.dcp import METADATA_NAME, S4StorageReader, S4StorageWriter
from s4w_core.errors import ManifestError, S4WError, UnsafePathError
from s4w_core.store import CheckpointStore
from s4w_core.store._local import LocalBackend

UNSAFE = [
    "a\x00b", "data/x\x00.s4w", "data/\x1b[31mred", "data/tab\there", "data/del\x7f", "data/c1\x9b2J",
    "a\\..\\b", "data//x", "data/./x", "data/../x", "/etc/passwd", "", "..", "a/",
]


@pytest.mark.parametrize("name", UNSAFE)
def test_name_parts_refuses(name: str) -> None:
    with pytest.raises(UnsafePathError, match="unsafe|non-empty"):
        name_parts(name, "object key")
    assert not is_safe_name(name)


@pytest.mark.parametrize("name", ["data/step_000000000001.ab12.s4w", "f.bin", "a/b/c", "ü/名前.txt", "a..b", ".hidden"])
def test_name_parts_accepts(name: str) -> None:
    assert name_parts(name) == name.split("/")
    assert is_safe_name(name)


def test_name_parts_refuses_non_strings() -> None:
    for v in (None, 3, b"a", ["a"]):
        with pytest.raises(UnsafePathError):
            name_parts(v)


def _snapshot(root: str) -> dict[str, int]:
    out = {}
    for dp, _d, fs in os.walk(root):
        for f in fs:
            p = os.path.join(dp, f)
            out[os.path.relpath(p, root)] = os.stat(p).st_size
    return out


@pytest.mark.parametrize("bad", [n for n in UNSAFE if n.startswith("data/")] + ["data/a\\..\\..\\b.s4w"])
def test_commit_record_naming_an_unsafe_object(tmp_path, bad: str) -> None:  # type: ignore[no-untyped-def]
    """A commit record (a file in the store: untrusted) naming an unsafe data object: load,
    verify and delete raise an S4WError naming it; nothing in or beside the store changes."""
    root = str(tmp_path / "store")
    beside = tmp_path / "x"
    beside.write_bytes(b"keep")
    with CheckpointStore(root) as st:
        st.save({"w": torch.ones(4)}, step=1)
    rec = glob.glob(os.path.join(root, "commits", "*.json"))[0]
    r = json.load(open(rec))
    with open(rec, "w") as f:
        json.dump(dict(r, object=bad, objects=[bad]), f)
    before = _snapshot(str(tmp_path))
    with CheckpointStore(root) as st:
        for call in (lambda: st.load(step=1), lambda: st.verify(1), lambda: st.delete(1)):
            with pytest.raises(ManifestError, match="safe object name|must list the data objects") as ei:
                call()
            assert "\x00" not in str(ei.value) and "\x1b" not in str(ei.value)  # named through repr()
    assert _snapshot(str(tmp_path)) == before
    assert beside.read_bytes() == b"keep"


@pytest.mark.parametrize("key", ["a\x00b", "../x", "data/../../x", "/abs", "a\\b", "data/\x1b]0;t\x07"])
def test_local_backend_refuses_unsafe_keys(tmp_path, key: str) -> None:  # type: ignore[no-untyped-def]
    b = LocalBackend(str(tmp_path / "s"))
    for call in (lambda: b.put(key, b"x"), lambda: b.get(key), lambda: b.delete(key)):
        with pytest.raises(S4WError, match="unsafe"):
            call()
    assert _snapshot(str(tmp_path)) == {}


@pytest.mark.parametrize("store", [".s4w\x00", ".s4w/\x1b[2J", "a\\..\\..\\b", "./.s4w", ".s4w/", "C:\\x", "../B/.s4w", "/abs/.s4w", "s3://b/p"])
def test_pointer_store_names(tmp_path, store: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(pointer.PointerError, match="may only name its own store"):
        pointer.resolve_store(str(tmp_path / "last.ckpt"), store)


@pytest.mark.parametrize("bad", ["../b/x.s4w", "/abs/x.s4w", "x\x00y.s4w", "a\\..\\b.s4w", "\x1b[2Jx.s4w"])
def test_dcp_metadata_names_no_file_outside_its_folder(tmp_path, bad: str) -> None:  # type: ignore[no-untyped-def]
    """A DCP checkpoint's metadata (a JSON file: untrusted) names the data files to read: one that
    leads outside the checkpoint folder (another checkpoint's data, any file) or holds a NUL is a
    ManifestError naming it, never read."""
    a, b = tmp_path / "a", tmp_path / "b"
    dcp.save({"w": torch.arange(8.0)}, storage_writer=S4StorageWriter(str(a)))
    dcp.save({"w": torch.full((8,), 7.0)}, storage_writer=S4StorageWriter(str(b)))
    m = json.load(open(a / METADATA_NAME))
    real = next(n for n in os.listdir(b) if n.endswith(".s4w"))
    for e in m["storage_data"]:
        e["file"] = bad.replace("x.s4w", real) if bad.startswith("../b/") else bad
    (a / METADATA_NAME).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="data file .* is unsafe"):
        S4StorageReader(str(a)).read_metadata()
    out = {"w": torch.zeros(8)}
    with pytest.raises(CheckpointException, match="data file .* is unsafe"):  # DCP wraps the reader's ManifestError
        dcp.load(out, storage_reader=S4StorageReader(str(a)))
    assert torch.equal(out["w"], torch.zeros(8))

"""Hostile inputs: a crafted checkpoint must not run code, write outside its target directory or
exhaust memory. (The container reader's own bounds are fuzzed in tests/fuzz; tree decoding of
forged class names is in tests/unit/test_tree.py.)"""

from __future__ import annotations

import io
import os
import pickle
import zipfile

import pytest
import torch

import s4w_core
from s4w_core.errors import FormatError, ManifestError, S4WError
from s4w_core.filepack import pack_file, pack_folder, unpack_folder
from tests.fuzz.harness import rebuild, split


class _Evil:
    """Unpickling this calls os.makedirs(path): a visible side effect if anything ever runs it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.makedirs, (self.path,))


def test_pickle_payload_in_a_framework_file_is_never_executed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A torch.save-style zip whose pickle calls a function on load: packing it (as the HF/Accelerate
    adapters do for optimizer.pt) and restoring it only scans opcodes and copies bytes."""
    pwned = tmp_path / "pwned"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"state": _Evil(str(pwned)), "w": [1, 2]}))
        z.writestr("archive/version", "3\n")
    blob = buf.getvalue()
    src = tmp_path / "optimizer.pt"
    src.write_bytes(blob)
    tree = pack_file(str(src))
    saved = io.BytesIO()
    s4w_core.save(tree, saved)
    out = tmp_path / "restored"
    unpack_folder({"files": {"optimizer.pt": s4w_core.load(saved.getvalue())}}, out)
    assert (out / "optimizer.pt").read_bytes() == blob  # byte-exact copy
    assert not pwned.exists()  # and nothing ran
    pickle.loads(zipfile.ZipFile(io.BytesIO(blob)).read("archive/data.pkl"))  # the payload is live:
    assert pwned.exists()  # unpickling it does run it, so the check above can fail


@pytest.mark.parametrize("name", ["../evil.txt", "a/../../evil.txt", "/tmp/evil.txt", "a//b", "", "a\\..\\evil"])
def test_restore_never_writes_outside_the_target(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    good = tmp_path / "src"
    good.mkdir()
    (good / "f.bin").write_bytes(b"x" * 10)
    tree = pack_folder(good)
    tree["files"] = {name: tree["files"]["f.bin"]}
    # through a real container, as a hostile store would deliver it
    buf = io.BytesIO()
    s4w_core.save(tree, buf)
    target = tmp_path / "target"
    target.mkdir()
    before = set(os.listdir(tmp_path))
    with pytest.raises(ManifestError, match="unsafe path"):
        unpack_folder(s4w_core.load(buf.getvalue()), target)
    assert set(os.listdir(tmp_path)) == before
    assert os.listdir(target) == []
    assert not os.path.exists("/tmp/evil.txt") or name != "/tmp/evil.txt"


@pytest.mark.parametrize(
    "field,value",
    [("nbytes", 1 << 47), ("shape", [1 << 40, 1 << 40]), ("segment_elems", 1 << 40), ("shape_big_stride0", None)],
)
def test_forged_sizes_do_not_allocate(field: str, value: object) -> None:
    """Forged sizes/shapes are rejected by validation (cheap), not by trying to allocate them."""
    buf = io.BytesIO()
    s4w_core.save({"w": torch.randn(64)}, buf)
    prefix, m = split(buf.getvalue())
    if field == "shape":
        m["tensors"][0]["shape"] = value
        m["tensors"][0]["stride"] = [1, 1]
    elif field == "shape_big_stride0":
        m["tensors"][0]["shape"] = [1 << 30, 1 << 30]
        m["tensors"][0]["stride"] = [0, 0]
    else:
        m["storages"][0][field] = value
    with pytest.raises(S4WError):
        s4w_core.load(rebuild(prefix, m))


def test_tensor_view_past_its_storage_is_rejected() -> None:
    buf = io.BytesIO()
    s4w_core.save({"w": torch.randn(64)}, buf)
    prefix, m = split(buf.getvalue())
    m["tensors"][0]["offset"] = 60
    m["tensors"][0]["shape"] = [8]
    with pytest.raises(FormatError, match="past the end"):
        s4w_core.load(rebuild(prefix, m))

"""``s4w_core.replace_with_marker``: what the framework adapters leave of a checkpoint folder once
its packed tree is committed."""

from __future__ import annotations

import json
from pathlib import Path

import s4w_core


def _folder(tmp_path: Path) -> tuple[Path, list[str]]:
    d = tmp_path / "checkpoint-100"
    (d / "sub").mkdir(parents=True)
    files = ["model.safetensors", "optimizer.pt", "sub/rng.pth", "trainer_state.json"]
    for rel in files:
        (d / rel).write_bytes(rel.encode() * 10)
    return d, files


def test_leaves_the_marker_and_the_kept_files(tmp_path: Path) -> None:
    d, files = _folder(tmp_path)
    (d / "optimizer.pt").unlink()  # already gone: skipped
    record = {"store": "file:///s", "step": 100, "files": files}
    s4w_core.replace_with_marker(d, files, "s4w_checkpoint.json", record, keep=("trainer_state.json",))
    left = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert left == ["s4w_checkpoint.json", "trainer_state.json"]
    assert json.loads((d / "s4w_checkpoint.json").read_text()) == record
    assert not list(d.glob(".s4w-*"))  # the marker was written atomically: no temporary left


def test_a_packed_marker_is_never_deleted_and_a_missing_folder_is_left_alone(tmp_path: Path) -> None:
    d, files = _folder(tmp_path)
    s4w_core.replace_with_marker(d, [*files, "m.json"], "m.json", {"step": 1})
    assert sorted(p.name for p in d.rglob("*") if p.is_file()) == ["m.json"]
    gone = tmp_path / "rotated-away"
    s4w_core.replace_with_marker(gone, files, "m.json", {"step": 1})
    assert not gone.exists()

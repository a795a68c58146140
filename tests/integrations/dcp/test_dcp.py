"""torch.distributed.checkpoint through s4w_core.dcp: single process (no_dist) and 2 gloo processes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import s4w_core
from s4w_core.dcp import METADATA_NAME, S4StorageReader, S4StorageWriter

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    bf = torch.randn(64, 33, generator=g).to(torch.bfloat16)
    bf.view(torch.int16)[0, :4] = torch.tensor(
        [0x7FC1, -0x0001, 0x0001, -0x8000], dtype=torch.int16
    )  # NaN payload, denormal, -0
    big = torch.randn(1000, generator=g)
    return {
        "w_bf16": bf,
        "w_f32": torch.randn(17, 5, generator=g),
        "i64": torch.arange(10),
        "bool": torch.tensor([True, False, True]),
        "view": big[100:200],  # a view: only the projection is stored
        "transposed": torch.randn(8, 4, generator=g).t(),
        "scalar": torch.tensor(3.5),
        "opt": {"step": 7, "lr": 1e-3, "betas": (0.9, 0.999), "name": "adamw"},
    }


def _zeros_like(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def test_roundtrip_no_dist_bit_exact(tmp_path):
    sd = _state()
    w = S4StorageWriter(tmp_path / "c")
    dcp.save(sd, storage_writer=w, no_dist=True)
    files = sorted(os.listdir(tmp_path / "c"))
    assert METADATA_NAME in files and sum(f.endswith(".s4w") for f in files) == 1
    # the rank file is an ordinary s4weights container (s4w info / verify work on it)
    rank_file = next(f for f in files if f.endswith(".s4w"))
    assert s4w_core.verify(str(tmp_path / "c" / rank_file)).ok
    # the view of `big` stored only its 100 elements, not the 1000 of its storage
    content = s4w_core.load(str(tmp_path / "c" / rank_file))
    assert content["t"]["view"].untyped_storage().nbytes() == 400
    assert w.last_reports[0].raw_bytes == sum(r.raw_bytes for r in w.last_reports)
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=S4StorageReader(tmp_path / "c"), no_dist=True)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and torch.equal(_bits(out[k]), _bits(v)), k
    assert out["opt"] == sd["opt"]


def test_metadata_is_json_not_pickle(tmp_path):
    dcp.save({"x": torch.ones(3)}, storage_writer=S4StorageWriter(tmp_path), no_dist=True)
    doc = json.loads((tmp_path / METADATA_NAME).read_text())
    assert doc["format"] == "s4weights-dcp/1" and "x" in doc["state_dict_metadata"]


def test_checkpoint_id_and_overwrite(tmp_path):
    d = tmp_path / "step"
    dcp.save({"x": torch.ones(3)}, checkpoint_id=d, storage_writer=S4StorageWriter(), no_dist=True)
    first = {f for f in os.listdir(d) if f.endswith(".s4w")}
    dcp.save({"x": torch.full((3,), 2.0)}, checkpoint_id=d, storage_writer=S4StorageWriter(), no_dist=True)
    second = {f for f in os.listdir(d) if f.endswith(".s4w")}
    assert len(second) == 1 and not (first & second), "the old save's data files are gone after the new commit"
    out = {"x": torch.zeros(3)}
    dcp.load(out, checkpoint_id=d, storage_reader=S4StorageReader(), no_dist=True)
    assert out["x"].tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(BaseException, match="overwrite=False"):  # DCP wraps it in CheckpointException
        dcp.save({"x": torch.ones(3)}, storage_writer=S4StorageWriter(d, overwrite=False), no_dist=True)


def test_missing_and_corrupt_metadata(tmp_path):
    with pytest.raises(BaseException) as ei:
        dcp.load({"x": torch.zeros(3)}, storage_reader=S4StorageReader(tmp_path / "nothing"), no_dist=True)
    assert "no committed s4weights DCP checkpoint" in str(ei.value)
    dcp.save({"x": torch.ones(3)}, storage_writer=S4StorageWriter(tmp_path / "c"), no_dist=True)
    (tmp_path / "c" / METADATA_NAME).write_text('{"format": "s4weights-dcp/1", "state_dict_metadata": 5}')
    with pytest.raises(BaseException) as ei:
        dcp.load({"x": torch.zeros(3)}, storage_reader=S4StorageReader(tmp_path / "c"), no_dist=True)
    assert "malformed DCP metadata" in str(ei.value)


def test_stage_copies_and_async_save_no_dist(tmp_path):
    sd = {"x": torch.arange(5.0)}
    w = S4StorageWriter(tmp_path / "a")
    staged = w.stage(sd)
    sd["x"].add_(1)
    assert staged["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    fut = dcp.async_save({"x": torch.arange(5.0)}, storage_writer=S4StorageWriter(tmp_path / "b"), no_dist=True)
    fut.result()
    out = {"x": torch.zeros(5)}
    dcp.load(out, storage_reader=S4StorageReader(tmp_path / "b"), no_dist=True)
    assert out["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_byte_items_roundtrip(tmp_path):
    sd = {"blob": io.BytesIO(b"\x00\x01hello" * 100), "empty": io.BytesIO(b"")}
    dcp.save(sd, storage_writer=S4StorageWriter(tmp_path), no_dist=True)
    out = {"blob": io.BytesIO(), "empty": io.BytesIO()}
    dcp.load(out, storage_reader=S4StorageReader(tmp_path), no_dist=True)
    assert out["blob"].getvalue() == b"\x00\x01hello" * 100 and out["empty"].getvalue() == b""


def test_two_gloo_ranks_fsdp_train_save_resume_bit_exact(tmp_path):
    """2 processes, FSDP2 (DTensor) model + AdamW, dcp.save and dcp.async_save, resume == never stopped."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests/integrations/dcp/dcp_worker.py"),
            "--root",
            str(tmp_path),
            "--nproc",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["ok"], res
    for mode in ("save", "async_save"):
        assert res[mode]["bit_exact_after_load"] and res[mode]["bit_exact_vs_uninterrupted"], res[mode]
    # resharding: one process loads the 2-rank checkpoint into full, unsharded tensors
    full = s4w_core.load(str(tmp_path / "full_model_step3.s4w"))["model"]
    target = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    dcp.load(target, storage_reader=S4StorageReader(tmp_path / "save_step3"), no_dist=True)
    for k, v in full.items():
        assert torch.equal(_bits(target["model"][k]), _bits(v)), k


@pytest.mark.s3
def test_s3_roundtrip_and_async(s3_url):
    sd = _state()
    url = f"{s3_url}/dcp/step_1"
    dcp.save(sd, storage_writer=S4StorageWriter(url), no_dist=True)
    dcp.async_save(sd, storage_writer=S4StorageWriter(f"{s3_url}/dcp/step_2"), no_dist=True).result()
    for u in (url, f"{s3_url}/dcp/step_2"):
        out = _zeros_like(sd)
        dcp.load(out, storage_reader=S4StorageReader(u), no_dist=True)
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(_bits(out[k]), _bits(v)), k
        assert out["opt"] == sd["opt"]
    # overwrite at the same S3 prefix: old data objects go after the new commit
    dcp.save({"x": torch.ones(2)}, storage_writer=S4StorageWriter(url), no_dist=True)
    from s4w_core.store import open_backend

    names = [o.key for o in open_backend(url).list("")]
    assert sum(n.endswith(".s4w") for n in names) == 1 and METADATA_NAME in names

"""torch.distributed.checkpoint through s4w_core.dcp: single process (no_dist) and 2 gloo processes."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import s4w_core
from s4w_core import api
from s4w_core.dcp import METADATA_NAME, S4StorageReader, S4StorageWriter
from s4w_core.dcp import writer as s4dcp

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


# ----------------------------------------------------------------------------- staging (CPU)
def _rank_file(d) -> str:
    return str(next(p for p in (d).iterdir() if p.name.endswith(".s4w")))


def _assert_restored(sd: dict, out: dict) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert torch.equal(_bits(out[k]).cpu(), _bits(v).cpu()), k


def test_stage_to_default_is_cpu_and_validated():
    assert S4StorageWriter().stage_to == "cpu"
    assert S4StorageWriter(stage_to="device").stage_to == "device"
    for bad in ("gpu", "host", "", None):
        with pytest.raises(ValueError, match="stage_to"):
            S4StorageWriter(stage_to=bad)


@pytest.mark.parametrize("stage_to", ["cpu", "device"])
def test_cpu_state_stages_as_clones_without_the_pool(tmp_path, monkeypatch, stage_to):
    def no_pool():
        raise AssertionError("a CPU state must not use the pinned pool")

    monkeypatch.setattr(s4dcp, "_pinned_pool", no_pool)
    sd = _state()
    w = S4StorageWriter(tmp_path / "c", stage_to=stage_to)
    staged = w.stage(sd)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert staged[k].device.type == "cpu" and staged[k].data_ptr() != v.data_ptr(), k
            assert torch.equal(_bits(staged[k]), _bits(v)), k
    assert staged["opt"] == sd["opt"] and staged["opt"] is not sd["opt"]
    assert w._generations == [] and w._last is not None and w._last.device is None  # noqa: SLF001
    dcp.save(staged, storage_writer=w, no_dist=True)
    assert w._last is None  # noqa: SLF001 - the write took the staging's record
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=S4StorageReader(tmp_path / "c"), no_dist=True)
    _assert_restored(sd, out)
    assert s4w_core.info(_rank_file(tmp_path / "c"))["profile"] == "portable"


class _FakePool:
    """Stands in for s4w_core.store._async.PinnedPool on a machine without CUDA: same take/give
    semantics (reuse by size, free buffers not reused are dropped), pageable buffers cut from one
    slab per allocation at 512-byte slots."""

    def __init__(self) -> None:
        self.free: dict[int, list[torch.Tensor]] = {}
        self.allocations = 0
        self.taken: list[list[torch.Tensor]] = []
        self.given: list[list[torch.Tensor]] = []

    def take(self, sizes, device=None):
        free, self.free = self.free, {}
        out, missing = [], []
        for i, n in enumerate(sizes):
            lst = free.get(n)
            out.append(lst.pop() if lst else None)
            if out[-1] is None:
                missing.append(i)
        if missing:
            self.allocations += 1
            slots = [-(-max(sizes[i], 1) // 512) * 512 for i in missing]
            slab = torch.zeros(sum(slots), dtype=torch.uint8)
            pos = 0
            for i, n in zip(missing, slots):
                out[i] = slab[pos : pos + sizes[i]]
                pos += n
        self.taken.append(out)
        return out

    def give(self, bufs):
        self.given.append(list(bufs))
        for b in bufs:
            self.free.setdefault(b.numel(), []).append(b)


def _ptrs(bufs) -> list[int]:
    return sorted(b.data_ptr() for b in bufs)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU tensors take the pinned-pool staging path (as plain CUDA tensors do on a GPU)."""
    pool = _FakePool()
    monkeypatch.setattr(s4dcp, "_pinned_pool", lambda: pool)
    monkeypatch.setattr(
        s4dcp, "_pool_staged", lambda t: type(t) is torch.Tensor and t.layout == torch.strided and t.numel() > 0
    )
    monkeypatch.setattr(
        s4dcp, "_cuda_devices", lambda sd: [torch.device("cpu")] if any(True for _ in s4dcp._iter_tensors(sd)) else []
    )
    return pool


def test_pool_staging_async_saves_reuse_buffers_simulated(tmp_path, fake_cuda):
    pool = fake_cuda
    sd = _state() | {"empty": torch.zeros(0, 5), "half_empty": torch.zeros(3, 0, dtype=torch.bfloat16)}
    w = S4StorageWriter()
    expected = []
    for i in range(2):
        expected.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()})
        fut = dcp.async_save(sd, checkpoint_id=tmp_path / f"s{i}", storage_writer=w, no_dist=True)
        for v in sd.values():  # training goes on: the staged copy is not affected
            if isinstance(v, torch.Tensor) and v.dtype != torch.bool:
                v.add_(1)
        fut.result()
        assert w._generations == []  # noqa: SLF001 - the write gave its buffers back
    n_pool = sum(1 for v in sd.values() if isinstance(v, torch.Tensor) and v.numel())
    assert pool.allocations == 1 and [len(b) for b in pool.taken] == [n_pool, n_pool]
    assert _ptrs(pool.taken[0]) == _ptrs(pool.taken[1])  # the second save reused the first one's buffers
    assert [_ptrs(b) for b in pool.given] == [_ptrs(b) for b in pool.taken]
    for i in range(2):
        out = _zeros_like(expected[i])
        dcp.load(out, storage_reader=S4StorageReader(tmp_path / f"s{i}"), no_dist=True)
        _assert_restored(expected[i], out)
        assert out["opt"] == expected[i]["opt"]
    # a staged tensor owns exactly its bytes: the container stores the view's 100 floats, not the slab
    content = s4w_core.load(_rank_file(tmp_path / "s0"))
    assert content["t"]["view"].untyped_storage().nbytes() == 400


def test_pool_staging_interleaved_saves_give_back_the_right_generation(tmp_path, fake_cuda):
    pool = fake_cuda
    a = {"x": torch.arange(1000.0), "y": torch.arange(10, dtype=torch.int16)}
    b = {"x": torch.arange(1000.0) * 2, "y": torch.arange(10, dtype=torch.int16) * 2}
    w = S4StorageWriter()
    sa = w.stage(a)
    sb = w.stage(b)  # the next save is staged before the first one is written
    assert pool.allocations == 2 and len(w._generations) == 2  # noqa: SLF001
    assert sa["x"].data_ptr() in w._generations[0].keys  # noqa: SLF001
    # a blocking save with the same writer stages nothing: it gives nothing back
    dcp.save({"z": torch.ones(3)}, checkpoint_id=tmp_path / "z", storage_writer=w, no_dist=True)
    assert pool.given == [] and len(w._generations) == 2  # noqa: SLF001
    dcp.save(sb, checkpoint_id=tmp_path / "b", storage_writer=w, no_dist=True)
    assert [_ptrs(g) for g in pool.given] == [_ptrs(pool.taken[1])]
    dcp.save(sa, checkpoint_id=tmp_path / "a", storage_writer=w, no_dist=True)
    assert [_ptrs(g) for g in pool.given] == [_ptrs(pool.taken[1]), _ptrs(pool.taken[0])]
    assert w._generations == []  # noqa: SLF001
    for name, want in (("a", a), ("b", b)):
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(out, storage_reader=S4StorageReader(tmp_path / name), no_dist=True)
        _assert_restored(want, out)
    # the next staging reuses a generation that was given back
    w.stage(a)
    assert pool.allocations == 2


def test_pool_staging_gives_back_after_failed_or_abandoned_saves(tmp_path, fake_cuda, monkeypatch):
    pool = fake_cuda
    sd = {"x": torch.arange(100.0)}
    w = S4StorageWriter()
    staged = w.stage(sd)
    del staged  # its save never wrote it: once nothing refers to it, the next staging reclaims it
    gc.collect()
    staged = w.stage(sd)
    assert pool.allocations == 1 and len(pool.given) == 1 and len(w._generations) == 1  # noqa: SLF001

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(s4dcp.Folder, "save_container", boom)
    with pytest.raises(BaseException, match="disk full"):
        dcp.save(staged, checkpoint_id=tmp_path / "f", storage_writer=w, no_dist=True)
    assert len(pool.given) == 2 and w._generations == []  # noqa: SLF001 - a failed write gives back too


def test_pool_staging_of_dtensor_shards_simulated(tmp_path, fake_cuda):
    """A DTensor's local shard (FSDP2 / TP state, here a Parameter and a plain DTensor on a one-rank
    gloo mesh) is staged into the pool, wrapped again with the same sharding, with no autograd
    link, and the staging leaves the live shard alone."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    pool = fake_cuda
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(5)
        sd = {
            "w": torch.nn.Parameter(distribute_tensor(torch.randn(64, 8, generator=g), mesh, [Shard(0)])),
            "m": distribute_tensor(torch.randn(33, generator=g).to(torch.bfloat16), mesh, [Shard(0)]),
        }
        want = {k: _bits(v.to_local()).clone() for k, v in sd.items()}
        w = S4StorageWriter()
        staged = w.stage(sd)
        assert len(pool.taken) == 1 and len(pool.taken[0]) == 2
        for k, v in staged.items():
            assert isinstance(v, DTensor) and not v.requires_grad and v.grad_fn is None
            assert v.placements == sd[k].placements and v.shape == sd[k].shape and v.stride() == sd[k].stride()
            assert v.to_local().data_ptr() in {b.data_ptr() for b in pool.taken[0]}  # the shard is in the pool
            assert torch.equal(_bits(v.to_local()), want[k])
        with torch.no_grad():
            sd["w"].add_(1)  # training goes on: the staged copy keeps the saved step
        assert torch.equal(_bits(staged["w"].to_local()), want["w"])
        assert torch.equal(_bits(sd["m"].to_local()), want["m"])  # the live shard is untouched
        dcp.save(staged, checkpoint_id=tmp_path / "s", storage_writer=w)
        assert [_ptrs(b) for b in pool.given] == [_ptrs(pool.taken[0])]  # the write gave the shards back
        out = {k: distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), mesh, [Shard(0)]) for k, v in sd.items()}
        dcp.load(out, storage_reader=S4StorageReader(tmp_path / "s"))
        assert all(torch.equal(_bits(out[k].to_local()), want[k]) for k in sd)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- staging (GPU)
def _cuda_state() -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 200, generator=g)
    return {
        "w_bf16": torch.randn(1 << 20, generator=g).to(torch.bfloat16).cuda(),
        "w_f32": torch.randn(512, 1024, generator=g).cuda(),
        "nc": big.cuda().t()[:, 10:150],  # a non-contiguous view
        "empty": torch.zeros(0, 7, device="cuda"),
        "i64": torch.arange(1000, device="cuda"),
        "opt": {"step": 3, "name": "adamw"},  # a non-tensor leaf
    }


def _cuda_zeros_like(sd: dict) -> dict:
    return {
        k: (torch.zeros_like(v.contiguous()) if isinstance(v, torch.Tensor) else {kk: None for kk in v})
        for k, v in sd.items()
    }


def _state_bytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))


def _expected_profile() -> str:
    return "fast" if api._gpu() is not None else "portable"  # noqa: SLF001


@pytest.mark.gpu
def test_gpu_async_save_default_stages_to_pinned_host_and_codes_fast(tmp_path):
    sd = _cuda_state()
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    w = S4StorageWriter(tmp_path / "c")
    assert w.stage_to == "cpu"
    fut = dcp.async_save(sd, storage_writer=w, no_dist=True)
    for v in sd.values():  # training goes on while the write runs
        if isinstance(v, torch.Tensor):
            v.add_(1)
    fut.result()
    assert w.last_reports[0].profile == _expected_profile()
    assert s4w_core.info(_rank_file(tmp_path / "c"))["profile"] == _expected_profile()
    out = _cuda_zeros_like(sd)
    dcp.load(out, storage_reader=S4StorageReader(tmp_path / "c"), no_dist=True)
    assert all(v.is_cuda for v in out.values() if isinstance(v, torch.Tensor))
    _assert_restored(expected, out)
    assert out["opt"] == sd["opt"]


@pytest.mark.gpu
def test_gpu_stage_copies_into_pinned_buffers_without_device_memory(tmp_path):
    sd = _cuda_state()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    w = S4StorageWriter(tmp_path / "c")
    staged = w.stage(sd)
    grown = torch.cuda.max_memory_allocated() - base
    assert grown < 0.1 * _state_bytes(sd), (grown, _state_bytes(sd))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            s = staged[k]
            assert s.device.type == "cpu" and s.dtype == v.dtype and s.shape == v.shape and s.is_contiguous(), k
            assert v.numel() == 0 or s.is_pinned(), k
            assert torch.equal(_bits(s), _bits(v).cpu()), k
    assert len(w._generations) == 1  # noqa: SLF001
    assert all(s4dcp._pinned_pool().owns(b) for b in w._generations[0].bufs)  # noqa: SLF001
    assert w._generations[0].device == sd["w_f32"].device  # noqa: SLF001
    dcp.save(staged, storage_writer=w, no_dist=True)  # writes the staged copy: gives its buffers back
    assert w._generations == []  # noqa: SLF001
    assert w.last_reports[0].profile == _expected_profile()


@pytest.mark.gpu
def test_gpu_consecutive_async_saves_reuse_the_pinned_buffers(tmp_path, monkeypatch):
    pool = s4dcp._pinned_pool()  # noqa: SLF001
    taken: list[list[int]] = []
    real_take = pool.take

    def take(sizes, device=None):
        bufs = real_take(sizes, device)
        taken.append(sorted(b.data_ptr() for b in bufs))
        return bufs

    monkeypatch.setattr(pool, "take", take)
    sd = _cuda_state()
    w = S4StorageWriter()
    expected = []
    for i in range(3):
        expected.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()})
        dcp.async_save(sd, checkpoint_id=tmp_path / f"s{i}", storage_writer=w, no_dist=True).result()
        if i == 0:
            allocated = pool.allocations
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)
    assert pool.allocations == allocated, "the later saves allocated pinned memory again"
    assert len(taken) == 3 and taken[0] == taken[1] == taken[2]
    assert w._generations == []  # noqa: SLF001
    for i in range(3):
        out = _cuda_zeros_like(sd)
        dcp.load(out, storage_reader=S4StorageReader(tmp_path / f"s{i}"), no_dist=True)
        _assert_restored(expected[i], out)


@pytest.mark.gpu
def test_gpu_stage_to_device_still_works(tmp_path):
    sd = _cuda_state()
    w = S4StorageWriter(tmp_path / "c", stage_to="device")
    staged = w.stage(sd)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.numel():
            assert staged[k].is_cuda and staged[k].data_ptr() != v.data_ptr(), k
    assert w._generations == []  # noqa: SLF001
    del staged
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    fut = dcp.async_save(sd, storage_writer=w, no_dist=True)
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)
    fut.result()
    assert w.last_reports[-1].profile == _expected_profile()
    out = _cuda_zeros_like(sd)
    dcp.load(out, storage_reader=S4StorageReader(tmp_path / "c"), no_dist=True)
    _assert_restored(expected, out)


@pytest.mark.gpu
def test_gpu_blocking_save_gives_nothing_back(tmp_path, monkeypatch):
    pool = s4dcp._pinned_pool()  # noqa: SLF001
    given: list[int] = []
    real_give = pool.give
    monkeypatch.setattr(pool, "give", lambda bufs: (given.append(len(bufs)), real_give(bufs)))
    allocated = pool.allocations
    sd = _cuda_state()
    w = S4StorageWriter(tmp_path / "c")
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert given == [] and pool.allocations == allocated
    assert w.last_reports[0].profile == _expected_profile()
    out = _cuda_zeros_like(sd)
    dcp.load(out, storage_reader=S4StorageReader(tmp_path / "c"), no_dist=True)
    _assert_restored(sd, out)


@pytest.mark.gpu
def test_gpu_background_write_codes_on_the_state_device(tmp_path, monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    seen: list[int] = []
    real = s4dcp.Folder.save_container

    def save_container(self, *args, **kwargs):
        seen.append(torch.cuda.current_device())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(s4dcp.Folder, "save_container", save_container)
    with torch.cuda.device(1):
        sd = _cuda_state()
    assert torch.cuda.current_device() == 0 and sd["w_f32"].device.index == 1
    w = S4StorageWriter(tmp_path / "c")
    dcp.async_save(sd, storage_writer=w, no_dist=True).result()
    assert seen == [1]
    assert w.last_reports[0].profile == _expected_profile()
    with torch.cuda.device(1):
        out = _cuda_zeros_like(sd)
    dcp.load(out, storage_reader=S4StorageReader(tmp_path / "c"), no_dist=True)
    _assert_restored(sd, out)

"""FSDP2 training with ``dcp.async_save`` every N steps: DCP's ``FileSystemWriter`` against
s4weights' run-level ``S4StorageWriter(root, step=N)`` (each rank's shards a delta chain).

For each writer, a bf16 GPT (benchmarks/_train_gpt.py's model, AdamW with bf16 state) is trained
from the same seed on the same batches; every ``--every`` steps ``dcp.async_save`` starts (the
previous save is waited for first).  Measured per writer: time the loop was blocked per save,
save wall (``async_save`` to the future's completion, by a done callback), loop wall, bytes per step, load wall of the newest step
into a fresh FSDP model (2 ranks), resharding load 2->1 (rank 0 alone, unsharded model tensors),
bit-exactness of the loaded state against the state saved, and of two more training steps
against the run that never stopped.

GPU (2 GPUs, NCCL; the coordinator's command)::

    torchrun --standalone --nproc-per-node 2 benchmarks/dcp_fsdp.py --out $OUT

CPU smoke (gloo, tiny model; what CI runs)::

    python benchmarks/dcp_fsdp.py --cpu-smoke --out /tmp/o

Writes ``<out>/dcp_fsdp[_smoke].json`` and ``.md`` (a markdown table), printed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _pagecache import evict  # noqa: E402
from _train_gpt import GPT, corpus  # noqa: E402


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _setup(a: argparse.Namespace, device: torch.device, mesh: Any, seed: int = 0) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    with torch.device(device):
        m = GPT(layers=a.layers, d=a.d, heads=max(1, a.d // 64), ctx=a.ctx).to(torch.bfloat16)
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.01)
    return m, opt


def _batch(data: torch.Tensor, step: int, rank: int, a: argparse.Namespace, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, data.numel() - a.ctx - 1, (a.batch,), generator=g)
    return torch.stack([data[int(s) : int(s) + a.ctx + 1] for s in starts]).long().to(device)


def _train_step(m: Any, opt: Any, x: torch.Tensor) -> float:
    logits = m(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _state(m: Any, opt: Any, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd, "meta": {"step": step}}


def _local_bits(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_local_bits(v, f"{prefix}{k}/"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_local_bits(v, f"{prefix}{i}/"))
    elif isinstance(obj, torch.Tensor):
        t = obj.to_local() if isinstance(obj, DTensor) else obj
        out[prefix] = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def one_writer(kind: str, a: argparse.Namespace, rank: int, world: int, device: torch.device, mesh: Any, ckpt_pg: Any, data: torch.Tensor) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from s4w_core.dcp import S4StorageReader, S4StorageWriter, close_rank_stores, wait_rank_stores
    from s4w_core.dcp.run import RunRoot, rank_store, rank_store_name

    root = os.path.join(a.work, kind)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root, exist_ok=True)
    dist.barrier()

    def writer(step: int) -> Any:
        if kind == "fs":
            return dcp.FileSystemWriter(os.path.join(root, f"step_{step}"))
        return S4StorageWriter(root, step=step)

    m, opt = _setup(a, device, mesh)
    saves: list[dict[str, Any]] = []
    fut: Any = None
    pending: dict[str, Any] | None = None
    saved_bits: dict[str, torch.Tensor] = {}
    copy_s = 0.0
    _sync(device)
    t_loop = time.perf_counter()
    for step in range(1, a.steps + 1):
        _train_step(m, opt, _batch(data, step, rank, a, device))
        if step % a.every == 0:
            if fut is not None:
                t_wait = time.perf_counter()
                fut.result()
                assert pending is not None
                _close_save(pending, t_wait)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            state = _state(m, opt, step)
            if step + a.every > a.steps:  # the last save: what the loads must give back (not timed)
                t_copy = time.perf_counter()
                saved_bits = _local_bits(state)
                copy_s = time.perf_counter() - t_copy
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=writer(step), process_group=ckpt_pg)
            pending = {"step": step, "blocked_s": time.perf_counter() - t0, "_t0": t0}
            fut.add_done_callback(lambda _f, p=pending: p.setdefault("_done", time.perf_counter()))
            saves.append(pending)
    if fut is not None:
        t_wait = time.perf_counter()
        fut.result()
        assert pending is not None
        _close_save(pending, t_wait)
    _sync(device)
    loop_wall = time.perf_counter() - t_loop - copy_s
    last = saves[-1]["step"]
    if kind == "s4w":
        t0 = time.perf_counter()
        wait_rank_stores(root)  # the re-encoding behind the last save (not in the loop's wall)
        tail_s = time.perf_counter() - t0
        dist.barrier()
    else:
        tail_s = 0.0
    # bytes per step
    per_step: dict[int, int] = {}
    if kind == "fs":
        if rank == 0:
            per_step = {s["step"]: _du(os.path.join(root, f"step_{s['step']}")) for s in saves}
    elif rank == 0:
        for r in range(world):
            for info in rank_store(RunRoot(root), rank_store_name(r)).list():
                per_step[info.step] = per_step.get(info.step, 0) + info.object_bytes
    total_bytes = _du(root) if rank == 0 else 0

    # load the newest step into a fresh, differently initialised model (all ranks)
    m2, opt2 = _setup(a, device, mesh, seed=123)
    target = _state(m2, opt2, -1)
    loads: dict[str, float] = {}
    for cache in ("cold", "warm"):  # cold: the run's files dropped from the page cache first
        if cache == "cold":
            if rank == 0:
                evict(root)
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        reader = dcp.FileSystemReader(os.path.join(root, f"step_{last}")) if kind == "fs" else S4StorageReader(root)
        dcp.load(target, storage_reader=reader)
        _sync(device)
        loads[cache] = time.perf_counter() - t0
    load_s, load_warm_s = loads["cold"], loads["warm"]
    loaded_exact = _same(_local_bits(target), saved_bits)
    set_state_dict(m2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    del target
    # the saved step's unsharded model (collective; rank 0 keeps it) for the resharding check
    full = {k: v.full_tensor() for k, v in m2.state_dict().items()}
    full = {k: v.cpu() for k, v in full.items()} if rank == 0 else {}
    # resume: two more steps on the loaded model and on the one that never stopped
    for step in range(a.steps + 1, a.steps + 3):
        x = _batch(data, step, rank, a, device)
        _train_step(m, opt, x)
        _train_step(m2, opt2, x)
    resume_exact = _same(_local_bits(_state(m2, opt2, 0)), _local_bits(_state(m, opt, 0)))
    del m2, opt2
    # resharding 2 -> 1: rank 0 alone loads the model's unsharded tensors
    reshard: dict[str, Any] = {}
    if rank == 0:
        tgt = {"model": {k: torch.zeros_like(v, device=device) for k, v in full.items()}}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        rd = dcp.FileSystemReader(os.path.join(root, f"step_{last}")) if kind == "fs" else S4StorageReader(root, step=last)
        dcp.load(tgt, storage_reader=rd, no_dist=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        reshard["load_s"] = time.perf_counter() - t0
        reshard["bit_exact"] = all(
            torch.equal(_bytes(tgt["model"][k]), _bytes(v)) for k, v in full.items()
        )
        del tgt
    del full
    dist.barrier()
    if kind == "s4w":
        close_rank_stores(root)
    del m, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "writer": kind,
        "saves": saves,
        "loop_wall_s": loop_wall,
        "reencode_tail_s": tail_s,
        "bytes_per_step": per_step,
        "total_bytes": total_bytes,
        "load_s": load_s,
        "load_warm_s": load_warm_s,
        "loaded_bit_exact": loaded_exact,
        "resume_bit_exact": resume_exact,
        "reshard_2_to_1": reshard,
    }


def _close_save(pending: dict[str, Any], t_wait: float) -> None:
    """A save's wall time: from ``async_save`` to its future's completion (taken by a done
    callback, not when the loop next waits for it: a save that finishes while the loop trains is
    not charged the rest of the interval); ``waited_s``: how long the loop then waited for it."""
    now = time.perf_counter()
    t0 = pending.pop("_t0")
    done = pending.pop("_done", now)  # the callback runs right after the result is set
    pending["save_wall_s"] = done - t0
    pending["waited_s"] = now - t_wait


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _table(res: dict[str, Any]) -> str:
    rows = ["| writer | blocked per save (first / later, s) | save wall (s) | loop waited for it (s) | loop wall (s) | bytes per step | total | load newest, cold / warm (s) | reshard 2->1 load (s) | bit-exact load / resume / reshard |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        b = [s["blocked_s"] for s in r["saves"]]
        w = [s.get("save_wall_s", 0.0) for s in r["saves"]]
        waited = [s.get("waited_s", 0.0) for s in r["saves"]]
        later = sum(b[1:]) / max(1, len(b) - 1)
        steps = sorted(r["bytes_per_step"], key=int)
        bps = " / ".join(f"{r['bytes_per_step'][s] / 1e6:.1f}" for s in steps)
        rs = r["reshard_2_to_1"]
        rows.append(
            f"| {r['writer']} | {b[0]:.3f} / {later:.3f} | {sum(w) / len(w):.2f} | {sum(waited) / len(waited):.2f} | {r['loop_wall_s']:.1f} | {bps} MB "
            f"| {r['total_bytes'] / 1e6:.1f} MB | {r['load_s']:.2f} / {r.get('load_warm_s', float('nan')):.2f} | {rs.get('load_s', float('nan')):.2f} "
            f"| {r['loaded_bit_exact']} / {r['resume_bit_exact']} / {rs.get('bit_exact')} |"
        )
    note = ("save wall: from `async_save` to the future's completion (mean); loop waited: how long the next save "
            "point (or the end) waited for it. load newest: cold = every file of the run dropped from the page cache first (sync + "
            "posix_fadvise DONTNEED), warm = the same load again. bytes per step: oldest first. FileSystemWriter: one folder per step. s4weights: the newest "
            "step whole, each older step a delta against the step after it (what it adds to the run).")
    return "\n".join(rows) + "\n\n" + note + "\n"


def run(rank: int, world: int, a: argparse.Namespace, init_method: str | None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    if a.cpu_smoke:
        device, backend = torch.device("cpu"), "gloo"
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "cpu:gloo,cuda:nccl"
    kw: dict[str, Any] = {"rank": rank, "world_size": world, "timeout": datetime.timedelta(seconds=600)}
    if init_method:
        kw["init_method"] = init_method
    dist.init_process_group(backend, **kw)
    mesh = init_device_mesh(device.type, (world,))
    ckpt_pg = dist.new_group(backend="gloo")  # async_save's collectives must not race training's
    data = corpus(4 << 20)
    res: dict[str, Any] = {"world": world, "device": str(device), "torch": torch.__version__, "args": vars(a), "runs": []}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
        from s4w_core import gpu

        # the codec's kernels compiled (or loaded from Triton's cache) before training starts, as
        # a CheckpointStore or an adapter created at startup does: not part of any save
        t0 = time.perf_counter()
        res["gpu_warm_up"] = gpu.warm_up(device, wait=True)
        res["gpu_warm_up_s"] = round(time.perf_counter() - t0, 2)
    try:
        with torch.device("meta"):
            res["params"] = sum(p.numel() for p in GPT(layers=a.layers, d=a.d, heads=max(1, a.d // 64), ctx=a.ctx).parameters())
        t_start = time.perf_counter()
        for kind in a.writers.split(","):
            late = [time.perf_counter() - t_start > a.budget_s]
            dist.broadcast_object_list(late, src=0, group=ckpt_pg)  # every rank skips, or none
            if late[0]:
                res["runs"].append({"writer": kind, "skipped": "budget"})
                continue
            res["runs"].append(one_writer(kind, a, rank, world, device, mesh, ckpt_pg, data))
            if rank == 0:
                print(json.dumps({k: v for k, v in res["runs"][-1].items()}, default=str), flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        runs = {r["writer"]: r for r in res["runs"] if "skipped" not in r}
        if "fs" in runs and "s4w" in runs:
            fs, s4 = runs["fs"], runs["s4w"]

            def mean(x: list[float]) -> float:
                return sum(x) / max(1, len(x))

            steps = sorted(s4["bytes_per_step"], key=int)
            whole = s4["bytes_per_step"][steps[-1]]
            deltas = [s4["bytes_per_step"][s] for s in steps[:-1]]
            res["targets"] = {
                "later_step_bytes_vs_first": round(mean(deltas) / whole, 4) if deltas and whole else None,
                "largest_step_vs_dcp_raw": round(max(s4["bytes_per_step"].values()) / max(fs["bytes_per_step"].values()), 4),
                "blocked_vs_fs": round(mean([s["blocked_s"] for s in s4["saves"]]) / mean([s["blocked_s"] for s in fs["saves"]]), 4),
                "save_wall_speedup": round(mean([s["save_wall_s"] for s in fs["saves"]]) / mean([s["save_wall_s"] for s in s4["saves"]]), 4),
                "load_speedup": round(fs["load_s"] / s4["load_s"], 4),
                "load_speedup_warm": round(fs["load_warm_s"] / s4["load_warm_s"], 4),
                "reshard_load_speedup": round(fs["reshard_2_to_1"]["load_s"] / s4["reshard_2_to_1"]["load_s"], 4),
            }
        name = "dcp_fsdp_smoke" if a.cpu_smoke else "dcp_fsdp"
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"{name}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        md = f"# DCP + FSDP2: FileSystemWriter vs S4StorageWriter(root, step=N)\n\n{res.get('gpu', res['device'])} x{world}, {res['params'] / 1e6:.1f} M parameters (bf16, AdamW bf16 state), {a.steps} steps, async_save every {a.every}\n\n{_table(res)}\ntargets: {json.dumps(res.get('targets'))}\n"
        with open(os.path.join(a.out, f"{name}.md"), "w") as f:
            f.write(md)
        print(md, flush=True)
    return res


def _spawned(rank: int, world: int, a: argparse.Namespace, init_file: str) -> None:
    run(rank, world, a, f"file://{init_file}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "./device_out"))
    ap.add_argument("--work", default="/tmp/s4w_dcp_fsdp")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--writers", default="fs,s4w")
    ap.add_argument("--budget-s", type=float, default=420.0, help="writers not started by then are skipped")
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo, 2 spawned processes, a tiny model")
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    if a.cpu_smoke:
        a.layers, a.d, a.ctx, a.batch, a.steps, a.every = 2, 64, 32, 2, 6, 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a, None)
        return
    import tempfile

    import torch.multiprocessing as mp

    init_file = os.path.join(tempfile.mkdtemp(prefix="s4w-dist-"), "init")
    mp.spawn(_spawned, args=(a.nproc, a, init_file), nprocs=a.nproc)


if __name__ == "__main__":
    main()

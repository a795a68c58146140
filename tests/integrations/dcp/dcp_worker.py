"""Multi-process DCP round trip through s4weights' StorageWriter/StorageReader.

Trains a tiny FSDP2-sharded MLP (DTensor parameters and AdamW state) for a few steps, saves with
``dcp.save`` or ``dcp.async_save`` through :class:`s4w_core.dcp.S4StorageWriter`, loads into a
freshly (differently) initialised model with ``dcp.load``, checks the state bit for bit, trains on
and checks the result against a run that never stopped.

CPU (what CI runs, through tests/integrations/dcp/test_dcp.py)::

    python tests/integrations/dcp/dcp_worker.py --nproc 2 --backend gloo --root /tmp/dcp

Two GPUs (NCCL; on the device)::

    torchrun --standalone --nproc-per-node 2 tests/integrations/dcp/dcp_worker.py --backend nccl --root /tmp/dcp

Rank 0 writes ``<root>/result.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

STEPS_BEFORE, STEPS_AFTER = 3, 3


def _model(seed: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
    ).to(device)


def _batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    y = torch.randn(16, 8, generator=g)
    return x.to(device), y.to(device)


def _setup(seed: int, mesh: Any, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    m = _model(seed, device)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    return m, opt


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, device: torch.device) -> None:
    for s in steps:
        x, y = _batch(s, rank, device)
        loss = torch.nn.functional.mse_loss(m(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}/"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}{i}/"))
    else:
        out[prefix.rstrip("/")] = obj
    return out


def _diff(a: Any, b: Any) -> list[str]:
    """Keys whose values differ (tensors compared byte for byte, local shards for DTensors)."""
    fa, fb = _flat(a), _flat(b)
    bad = sorted(set(fa) ^ set(fb))
    for k in set(fa) & set(fb):
        x, y = _local(fa[k]), _local(fb[k])
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                bad.append(k)
                continue
            xb = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            yb = y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(xb, yb):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return bad


def _state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd, "meta": {"step": STEPS_BEFORE, "note": "s4weights dcp test"}}


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def run(rank: int, world: int, backend: str, root: str, init_method: str | None = None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import s4w_core
    from s4w_core.dcp import S4StorageReader, S4StorageWriter
    from s4w_core.dcp.writer import _pinned_pool

    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        pg_backend = "cpu:gloo,cuda:nccl"  # async_save needs a CPU backend too
    else:
        device = torch.device("cpu")
        pg_backend = "gloo"
    kw: dict[str, Any] = {"rank": rank, "world_size": world}
    if init_method:
        kw["init_method"] = init_method
    dist.init_process_group(pg_backend, **kw)
    mesh = init_device_mesh(device.type, (world,))
    ckpt_pg = dist.new_group(backend="gloo")  # async_save's collectives must not race training's
    result: dict[str, Any] = {"world": world, "backend": backend, "device": str(device), "torch": torch.__version__}
    try:
        # 1. the run that never stops
        m, opt = _setup(0, mesh, device)
        _train(m, opt, range(STEPS_BEFORE + STEPS_AFTER), rank, device)
        reference = _clone(_state(m, opt))
        del m, opt

        for mode in ("save", "async_save"):
            path = os.path.join(root, f"{mode}_step{STEPS_BEFORE}")
            # 2. train, save through DCP
            m, opt = _setup(0, mesh, device)
            _train(m, opt, range(STEPS_BEFORE), rank, device)
            saved = _state(m, opt)
            snapshot = _clone(saved)
            writer = S4StorageWriter(path)
            t0 = time.perf_counter()
            if mode == "save":
                dcp.save(saved, storage_writer=writer)
                blocking = time.perf_counter() - t0
            else:
                fut = dcp.async_save(saved, storage_writer=writer, process_group=ckpt_pg)
                blocking = time.perf_counter() - t0
                _train(m, opt, range(STEPS_BEFORE, STEPS_BEFORE + 1), rank, device)  # training goes on meanwhile
                fut.result()
            total = time.perf_counter() - t0
            del m, opt, saved
            # 3. a fresh, differently initialised model loads it
            m, opt = _setup(123, mesh, device)
            target = _state(m, opt)
            target["meta"] = {"step": -1, "note": ""}
            t1 = time.perf_counter()
            dcp.load(target, storage_reader=S4StorageReader(path))
            load_s = time.perf_counter() - t1
            set_state_dict(m, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
            after_load = _diff(_state(m, opt), snapshot)
            meta_ok = target["meta"] == snapshot["meta"]
            # 4. train on: must equal the run that never stopped
            _train(m, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank, device)
            after_train = _diff(_state(m, opt), reference)
            rep = writer.last_reports[0] if writer.last_reports else None
            result[mode] = {
                "bit_exact_after_load": not after_load,
                "bit_exact_vs_uninterrupted": not after_train,
                "meta_ok": meta_ok,
                "mismatches": (after_load + after_train)[:10],
                "blocking_s": round(blocking, 4),
                "total_s": round(total, 4),
                "load_s": round(load_s, 4),
                "rank_raw_bytes": rep.raw_bytes if rep else None,
                "rank_stored_bytes": rep.stored_bytes if rep else None,
                "profile": rep.profile if rep else None,
                # async_save staged the CUDA state (DTensor shards) into the pinned pool
                "pinned_pool_allocations": _pinned_pool().allocations,
            }
            del m, opt, target
        # 5. full (unsharded) tensors for a single-process reshard check by the caller
        m, opt = _setup(0, mesh, device)
        _train(m, opt, range(STEPS_BEFORE), rank, device)
        full = {k: v.full_tensor().cpu() for k, v in m.state_dict().items()}
        if rank == 0:
            s4w_core.save({"model": full}, os.path.join(root, "full_model_step3.s4w"), profile="portable")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    ok = all(
        result[m][k]
        for m in ("save", "async_save")
        for k in ("bit_exact_after_load", "bit_exact_vs_uninterrupted", "meta_ok")
    )
    result["ok"] = ok
    if rank == 0:
        with open(os.path.join(root, "result.json"), "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps(result, indent=2), flush=True)
    return result


def _spawned(rank: int, world: int, backend: str, root: str, init_file: str) -> None:
    res = run(rank, world, backend, root, f"file://{init_file}")
    if not res["ok"]:
        raise SystemExit(f"rank {rank}: DCP round trip not bit-exact: {res}")
    # every check is done and written: leave without interpreter finalization, where gloo's threads
    # can still abort the process (run_worker.py, mp_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn (without torchrun)")
    a = ap.parse_args()
    os.makedirs(a.root, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        res = run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a.backend, a.root)
        sys.exit(0 if res["ok"] else 1)
    import torch.multiprocessing as mp

    init_file = os.path.join(a.root, ".dist_init")
    if os.path.exists(init_file):
        os.unlink(init_file)
    mp.spawn(_spawned, args=(a.nproc, a.backend, a.root, init_file), nprocs=a.nproc)


if __name__ == "__main__":
    main()

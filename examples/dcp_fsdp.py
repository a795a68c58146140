"""torch.distributed.checkpoint + s4weights: 2 processes, FSDP2, compressed per-rank shards.

Two CPU processes (gloo) train an FSDP2-sharded byte-level MLP on Python standard-library source
for 200 steps; ``dcp.async_save`` at step 100 and ``dcp.save`` at step 200 go through
``S4StorageWriter``; then fresh, differently initialised models ``dcp.load`` the step-100
checkpoint through ``S4StorageReader``, train to 200, and are compared bit for bit with the run
that never stopped. Prints raw vs stored bytes. (On GPUs: ``torchrun --nproc-per-node 2
examples/dcp_fsdp.py --backend nccl``.)

    PYTHONPATH=.:integrations python examples/dcp_fsdp.py [--out DIR]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from s4w_core.dcp import S4StorageReader, S4StorageWriter

CTX, STEPS, SAVE_AT = 8, 200, 100


def data():
    import json as j

    src = torch.tensor(list(inspect.getsource(j.decoder).encode()), dtype=torch.long)
    idx = torch.arange(0, len(src) - CTX - 1)
    return torch.stack([src[i : i + CTX] for i in idx.tolist()]), src[idx + CTX]


def build(seed, mesh, device):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Embedding(256, 32),
        torch.nn.Flatten(),
        torch.nn.Linear(CTX * 32, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
    ).to(device)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3)


def train(m, opt, x, y, steps, rank, device):
    for s in steps:
        i = (torch.arange(32) + (s * 2 + rank) * 32) % len(x)
        loss = torch.nn.functional.cross_entropy(m(x[i].to(device)), y[i].to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()


def worker(rank, world, out, backend):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
            init_method=f"file://{out}/.init",
            rank=rank,
            world_size=world,
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    ckpt_pg = dist.new_group(backend="gloo")
    x, y = data()
    m, opt = build(0, mesh, device)
    train(m, opt, x, y, range(SAVE_AT), rank, device)
    msd, osd = get_state_dict(m, opt)
    fut = dcp.async_save(
        {"model": msd, "optim": osd}, storage_writer=S4StorageWriter(f"{out}/step_{SAVE_AT}"), process_group=ckpt_pg
    )
    train(m, opt, x, y, range(SAVE_AT, STEPS), rank, device)  # training goes on while it saves
    fut.result()
    writer = S4StorageWriter(f"{out}/step_{STEPS}")
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    final = {k: v.to_local().clone() for k, v in m.state_dict().items()}
    # resume: a differently initialised model loads step 100 and trains on
    m2, opt2 = build(123, mesh, device)
    msd2, osd2 = get_state_dict(m2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, storage_reader=S4StorageReader(f"{out}/step_{SAVE_AT}"))
    set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(m2, opt2, x, y, range(SAVE_AT, STEPS), rank, device)
    same = all(torch.equal(final[k], v.to_local()) for k, v in m2.state_dict().items())
    rep = writer.last_reports[0]
    stats = torch.tensor([rep.raw_bytes, rep.stored_bytes, int(same)], dtype=torch.long)
    dist.all_reduce(stats, group=ckpt_pg)
    if rank == 0:
        raw, stored, ok = stats.tolist()
        print(f"step {STEPS} checkpoint, {world} ranks: {raw:,} B raw -> {stored:,} B stored ({raw / stored:.2f}x)")
        print(json.dumps({"bit_exact_vs_uninterrupted": ok == world, "ratio": round(raw / stored, 3)}))
    dist.destroy_process_group()
    if not same:
        raise SystemExit(f"rank {rank}: resumed run differs from the uninterrupted one")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    a = ap.parse_args()
    out = os.path.abspath(a.out or tempfile.mkdtemp(prefix="s4w-dcp-"))
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("cpu:gloo,cuda:nccl" if a.backend == "nccl" else "gloo")
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), out, a.backend)
        return
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(2, out, a.backend), nprocs=2)


if __name__ == "__main__":
    main()

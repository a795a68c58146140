"""Multi-process worker for the run-level DCP tests (tests/integrations/dcp/test_dcp_run.py).

Every process builds the same deterministic "training" state for a step (bf16 weights drifting by
a little each step, fp32 optimizer moments, an odd-sized vector, a plain value), as DTensors on a
CPU mesh with one placement, and saves or loads it through
``S4StorageWriter(root, step=N)`` / ``S4StorageReader(root, step=...)``.

Phases (``--phase``):

save    save ``--steps`` with ``--placement``; after each, wait for the re-encoding behind it and
        record the bytes the run grew by; then load every step listed in ``--load`` with
        ``--load-placement`` (or the placement the entry names) and check it bit for bit.
load    only the loads.
kill    save ``--steps``; on the last one, rank 1 dies inside its write (``os._exit``) and the
        others time out: nothing of that step may become visible.

Rank 0 writes ``<out>`` (JSON) with what it measured and ``ok``.

    python tests/integrations/dcp/run_worker.py --root /tmp/run --nproc 2 --phase save \\
        --steps 10,20,30 --placement shard0 --load none,10 --load-placement shard1 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

ROWS, COLS, VEC = 64, 48, 50


def full_state(step: int) -> dict[str, Any]:
    """The whole (unsharded) state of ``step``: the same in every process."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(ROWS, COLS, generator=g)
    drift = torch.randn(ROWS, COLS, generator=g)
    m0 = torch.randn(ROWS, COLS, generator=g).abs() * 1e-3
    vec = torch.randn(VEC, generator=g)
    return {
        "model": {
            "w": (base + 1e-4 * step * drift).to(torch.bfloat16),
            "b": vec + 1e-6 * step,
        },
        "optim": {"exp_avg_sq": m0 * (1.0 + 1e-7 * step), "step": torch.tensor(float(step))},
        "meta": {"step": step, "note": "run worker"},
    }


def _placement(name: str, ndim: int) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if name == "replicate":
        return Replicate()
    if name == "shard1" and ndim >= 2:
        return Shard(1)
    return Shard(0)


def as_dtensors(state: Any, mesh: Any, placement: str, zeros: bool = False) -> Any:
    from torch.distributed.tensor import distribute_tensor

    if isinstance(state, dict):
        return {k: as_dtensors(v, mesh, placement, zeros) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        t = torch.zeros_like(state) if zeros else state
        if t.ndim == 0:
            return t.clone()
        return distribute_tensor(t, mesh, [_placement(placement, t.ndim)])
    return None if zeros else state


def diff(got: Any, want: Any, prefix: str = "") -> list[str]:
    from torch.distributed.tensor import DTensor

    bad: list[str] = []
    if isinstance(want, dict):
        for k, v in want.items():
            bad += diff(got.get(k) if isinstance(got, dict) else None, v, f"{prefix}{k}/")
        return bad
    if isinstance(want, torch.Tensor):
        g = got.full_tensor() if isinstance(got, DTensor) else got
        if not isinstance(g, torch.Tensor) or g.dtype != want.dtype or g.shape != want.shape:
            return [prefix]
        gb = g.detach().contiguous().reshape(-1).view(torch.uint8)
        wb = want.detach().contiguous().reshape(-1).view(torch.uint8)
        return [] if torch.equal(gb, wb) else [prefix]
    return [] if got == want else [prefix]


def run(rank: int, world: int, a: argparse.Namespace, init_method: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from s4w_core.dcp import S4StorageReader, S4StorageWriter, committed_steps, wait_rank_stores
    from s4w_core.dcp.run import run_bytes

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=init_method, timeout=datetime.timedelta(seconds=a.timeout)
    )
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {"world": world, "grew": {}, "loads": {}}
    steps = [int(s) for s in a.steps.split(",") if s]

    class DyingWriter(S4StorageWriter):
        """Rank 1 dies inside its write of the last step (before its store commits)."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            if a.phase == "kill" and self.step == steps[-1] and rank == 1:
                os._exit(3)
            return super().write_data(plan, planner)

    try:
        if a.phase in ("save", "kill"):
            before = run_bytes(a.root) if os.path.exists(a.root) else 0
            for s in steps:
                dcp.save(as_dtensors(full_state(s), mesh, a.placement), storage_writer=DyingWriter(a.root, step=s))
                wait_rank_stores(a.root)  # the step below is a delta now
                dist.barrier()
                if rank == 0:
                    now = run_bytes(a.root)
                    out["grew"][str(s)] = now - before
                    before = now
                dist.barrier()
        for spec in [x for x in a.load.split(",") if x]:
            which, _, placement = spec.partition(":")
            step = None if which == "none" else int(which)
            want = full_state(step if step is not None else committed_steps(a.root)[-1])
            target = as_dtensors(want, mesh, placement or a.load_placement, zeros=True)
            dcp.load(target, storage_reader=S4StorageReader(a.root, step=step))
            out["loads"][spec] = diff(target, want)
        out["committed"] = committed_steps(a.root)
    finally:
        dist.destroy_process_group()
    out["ok"] = all(not v for v in out["loads"].values())
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _spawned(rank: int, world: int, a: argparse.Namespace, init_file: str) -> None:
    from s4w_core.dcp import close_rank_stores

    res = run(rank, world, a, f"file://{init_file}")
    if not res["ok"]:
        raise SystemExit(f"rank {rank}: not bit-exact: {res}")
    # every check is done and written, the process group destroyed: leave without interpreter
    # finalization, where gloo's threads can still abort the process ("terminate called without an
    # active exception", seen in CI runs; pytorch/pytorch#190489), as mp_worker.py does. The
    # rank's stores are closed first (os._exit runs no finalizers).
    close_rank_stores()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--phase", choices=["save", "load", "kill"], default="save")
    ap.add_argument("--steps", default="")
    ap.add_argument("--placement", default="shard0", choices=["shard0", "shard1", "replicate"])
    ap.add_argument(
        "--load", default="", help="steps to load, comma-separated ('none': the newest; 'STEP:PLACEMENT' for another placement)"
    )
    ap.add_argument("--load-placement", default="shard0", choices=["shard0", "shard1", "replicate"])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import tempfile

    import torch.multiprocessing as mp

    init_file = os.path.join(tempfile.mkdtemp(prefix="s4w-dist-"), "init")
    mp.spawn(_spawned, args=(a.nproc, a, init_file), nprocs=a.nproc)


if __name__ == "__main__":
    main()

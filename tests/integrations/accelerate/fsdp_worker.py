"""s4w_accelerate under Accelerate's FSDP2 (``fsdp_version=2``, ``SHARDED_STATE_DICT``) on 2 CPU
processes (gloo), run by ``torch.distributed.run``: ``save_state`` puts the models' and optimizers'
shards into the run-level DCP root beside the store (``.s4w_dcp``) and the rest into the store;
``load_state`` resumes bit-exactly against a run that never stopped.  The main process prints one
JSON line.

Accelerate sets ``DistributedType.FSDP`` only for accelerator devices; on the CPU this worker sets it
before ``prepare``, which then runs Accelerate's own FSDP2 preparation (``fully_shard``, DTensor
parameters).  The same script with ``native`` as second argument runs Accelerate's own FSDP save.
With ``S4W_FSDP_WORKER_GPU=1`` each process takes a CUDA device and Accelerate sets FSDP itself (NCCL).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ProjectConfiguration

if __package__ in (None, ""):
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    sys.path[:0] = [here, os.path.join(here, "integrations")]

import s4w_accelerate  # noqa: E402
from s4w_core.dcp.run import committed_steps  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402

GPU = os.environ.get("S4W_FSDP_WORKER_GPU") == "1"  # one CUDA device per process (NCCL), as `accelerate launch` runs it


def setup(project, width=32):
    AcceleratorState._reset_state(True)
    config = ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=2)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    if GPU:
        acc = Accelerator(fsdp_plugin=plugin, project_config=config)
    else:
        acc = Accelerator(cpu=True, project_config=config)
        PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.7)
    model, opt, sched = acc.prepare(model, opt, sched)
    assert acc.is_fsdp2 and type(next(model.parameters())).__name__ == "DTensor"
    return acc, model, opt, sched


def train(acc, model, opt, sched, steps):
    for s in steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * s + acc.process_index)).to(acc.device)
        acc.backward(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()))
        opt.step()
        sched.step()
        opt.zero_grad()


def local_bits(model, opt):
    out = {k: v.to_local().detach().reshape(-1).view(torch.uint8).clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state_dict()["state"].values()):
        for k, v in st.items():
            t = v.to_local() if hasattr(v, "to_local") else v
            out[f"opt{i}.{k}"] = t.detach().reshape(-1).view(torch.uint8).clone()
    return out


def main(out):
    acc, model, opt, sched = setup(os.path.join(out, "ref"))
    train(acc, model, opt, sched, range(8))
    ref = local_bits(model, opt)
    s4w_accelerate.enable()
    acc, model, opt, sched = setup(os.path.join(out, "run"))
    for k in range(3):  # checkpoints after steps 2, 4, 6 (total_limit=2)
        train(acc, model, opt, sched, range(2 * k, 2 * k + 2))
        acc.save_state()
    root = os.path.join(out, "run", ".s4w_dcp")
    committed = committed_steps(root)
    acc, model, opt, sched = setup(os.path.join(out, "run"))
    acc.load_state()  # the newest: checkpoint_2, after step 6
    resumed_lr = sched.get_last_lr()
    train(acc, model, opt, sched, range(6, 8))
    got = local_bits(model, opt)
    same = got.keys() == ref.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    flags = [None] * acc.num_processes
    torch.distributed.all_gather_object(flags, same)
    # bad input: other shapes raise StateMismatchError on every process, nothing loaded
    acc, model, opt, sched = setup(os.path.join(out, "run"), width=16)
    before = local_bits(model, opt)
    try:
        acc.load_state()
        mismatch = "no error"
    except s4w_accelerate.StateMismatchError as e:
        after = local_bits(model, opt)
        mismatch = str(e) if all(torch.equal(before[k], after[k]) for k in before) else "changed"
    if acc.is_main_process:
        st = CheckpointStore(os.path.join(out, "run", ".s4w"))
        run = os.path.join(out, "run")
        files = sorted(os.path.relpath(os.path.join(d, f), run) for d, _, fs in os.walk(run) for f in fs)
        files = [f for f in files if not f.startswith((".s4w" + os.sep, ".s4w_dcp" + os.sep))]
        tree = st.load(2)
        print(json.dumps({"steps": st.steps(), "committed": committed, "same": flags, "files": files,
                          "models": len(tree["models"]), "optimizers": len(tree["optimizers"]),
                          "sharded": st.info(2).extra.get("sharded") == os.path.abspath(root),
                          "lr": resumed_lr, "mismatch": mismatch, "checkpoints": sorted(os.listdir(os.path.join(run, "checkpoints")))}))
        st.close()
    s4w_accelerate.finish_pending()
    acc.wait_for_everyone()
    # every check is done and printed: leave without freeing the process group at teardown (mp_worker.py
    # says why: a gloo teardown deadlock between the GIL and the group's runloop thread)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

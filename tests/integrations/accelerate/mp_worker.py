"""Run under torchrun (2 CPU processes, gloo): s4w_accelerate with several processes.

Prints one JSON line on the main process: the store's steps, how many RNG states it holds,
whether the resumed run equals the uninterrupted one bit for bit, and the files in the project.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import ProjectConfiguration

import s4w_accelerate
from s4w_core.store import CheckpointStore


def setup(project):
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return acc, *acc.prepare(model, opt)


def train(acc, model, opt, steps):
    torch.manual_seed(1000 + acc.process_index) if steps.start == 0 else None  # ranks draw different dropout
    for s in steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(s))
        acc.backward(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()))
        opt.step()
        opt.zero_grad()


def main(out):
    acc, model, opt = setup(os.path.join(out, "ref"))
    train(acc, model, opt, range(6))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    s4w_accelerate.enable()
    acc, model, opt = setup(os.path.join(out, "run"))
    train(acc, model, opt, range(3))
    acc.save_state()
    acc, model, opt = setup(os.path.join(out, "run"))
    acc.load_state()
    train(acc, model, opt, range(3, 6))
    same = all(torch.equal(ref[k], v) for k, v in model.state_dict().items())
    flags = [None] * acc.num_processes
    torch.distributed.all_gather_object(flags, same)
    if acc.is_main_process:
        st = CheckpointStore(os.path.join(out, "run", ".s4w"))
        files = sorted(
            os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(os.path.join(out, "run")) for f in fs
        )
        files = [f for f in files if not f.startswith(os.path.join("run", ".s4w"))]
        print(json.dumps({"steps": st.steps(), "rngs": len(st.load(0)["rng"]), "same": flags, "files": files}))
        st.close()
    # pending saves finished before the process leaves (os._exit below runs no finalizers)
    s4w_accelerate.finish_pending()
    acc.wait_for_everyone()
    # every check is done and printed: leave before the process group's last owner (DDP's Reducer, held by
    # this frame's model) is freed. Freeing it destroys ProcessGroupGloo with the GIL held, which joins
    # its runloop thread while that thread waits for the GIL to decref a tensor in an AsyncAllgatherWork
    # destructor: a deadlock seen under gdb in ~1 run in 8, after destroy_process_group() had returned
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

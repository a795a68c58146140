"""Run under torchrun (2 CPU processes, gloo): S4Callback under DDP, interrupted and resumed.

Prints one JSON line on rank 0: the store's steps, how many RNG states step 3 holds, whether the
resumed run equals the uninterrupted one bit for bit, and which checkpoint files exist.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers

from s4w_core.store import CheckpointStore
from s4w_transformers import S4Callback


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class StopAt(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= 3:
            control.should_training_stop = True
            control.should_save = True


def trainer(out, callbacks):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3, save_steps=100,
        logging_steps=100, report_to=[], use_cpu=True, disable_tqdm=True, seed=0, ddp_backend="gloo",
    )  # fmt: skip
    return transformers.Trainer(
        model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens(), callbacks=callbacks
    )


def main(out):
    ref = trainer(os.path.join(out, "ref"), [])
    ref.train()
    trainer(os.path.join(out, "run"), [StopAt(), S4Callback()]).train()
    tr = trainer(os.path.join(out, "run"), [S4Callback()])
    tr.train(resume_from_checkpoint=True)
    same = all(torch.equal(a, b) for a, b in zip(ref.model.state_dict().values(), tr.model.state_dict().values()))
    if tr.args.process_index == 0:
        st = CheckpointStore(os.path.join(out, "run", ".s4w"))
        files = sorted(os.listdir(os.path.join(out, "run")))
        print(json.dumps({"steps": st.steps(), "rngs": len(st.load(3)["rng"]), "same": same, "files": files}))
        st.close()
    # end cleanly: the gloo group's threads stopped before the interpreter exits (left running, they can
    # abort the process at exit: "terminate called without an active exception"), then leave without
    # interpreter finalization, where they still can (tests/integrations/accelerate/mp_worker.py)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

"""S4Callback under the HF Trainer's FSDP2 (``fsdp_config={"fsdp_version": 2}``) on 2 processes, run by
``torch.distributed.run``: every rank's shards of the model and optimizer go into the run-level DCP
root beside the store (``.s4w_dcp``), the rest (scheduler, RNG states, trainer state) into the store;
``save_total_limit`` rotates both; an interrupted run resumed with ``resume_from_checkpoint=True``
equals an uninterrupted one bit for bit on every rank.  The main process prints one JSON line.

The Trainer's FSDP setup comes from Accelerate, which enables FSDP only for accelerator devices: on
the CPU (gloo) this worker's Trainer sets Accelerate's state to FSDP with the plugin the Trainer
built from ``fsdp_config`` right after creating its Accelerator; ``prepare`` then runs Accelerate's
own FSDP2 preparation (``fully_shard``, DTensor parameters).  With ``S4W_FSDP_WORKER_GPU=1`` each
process takes a CUDA device and the Trainer sets FSDP itself (NCCL), with ``full_determinism`` (the
embedding's backward on CUDA adds atomically otherwise: the uninterrupted run could differ in its bits).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

if __package__ in (None, ""):
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    sys.path[:0] = [here, os.path.join(here, "integrations")]

import transformers.trainer  # noqa: E402

from s4w_core.dcp.run import RunRoot, committed_steps, rank_store, rank_store_name, wait_rank_stores  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_transformers import S4Callback, StateMismatchError, restore_checkpoint  # noqa: E402
from tests.integrations.transformers.test_transformers import StopAt  # noqa: E402

GPU = os.environ.get("S4W_FSDP_WORKER_GPU") == "1"
NATIVE_SAVES: list[str] = []  # calls of the Trainer's own FSDP writers (there must be none)


def _count(name, fn):
    def wrapped(*a, **kw):
        NATIVE_SAVES.append(name)
        return fn(*a, **kw)

    return wrapped


for _name in ("save_fsdp_model", "save_fsdp_optimizer"):
    setattr(transformers.trainer, _name, _count(_name, getattr(transformers.trainer, _name)))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=128, seed=0):
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class FSDPOnCPU(transformers.Trainer):
    """The Trainer with Accelerate's state set to FSDP on the CPU (the module docstring says why)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        st = self.accelerator.state
        if getattr(st, "fsdp_plugin", None) is None:
            st.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        PartialState().distributed_type = st.distributed_type = DistributedType.FSDP
        self.is_fsdp_enabled = True


class Probe(transformers.TrainerCallback):
    """Every on_save, with the files (outside the store and the run) in the output dir at that moment."""

    def __init__(self):
        self.saves, self.files = [], set()

    def on_save(self, args, state, control, **kw):
        self.saves.append(state.global_step)
        self.files |= set(payload(args.output_dir))


class Snapshots(transformers.TrainerCallback):
    """This rank's weights at every on_save (the saved step's)."""

    def __init__(self):
        self.bits = {}

    def on_save(self, args, state, control, model=None, **kw):
        self.bits[state.global_step] = weight_bits(model)


class Scores:
    """compute_metrics with a fixed score per evaluation: 1, 3, 2, 0 -> the best is the 2nd (step 4)."""

    def __init__(self):
        self.n = 0

    def __call__(self, pred):
        self.n += 1
        return {"score": [1.0, 3.0, 2.0, 0.0][min(self.n - 1, 3)]}


def payload(out):
    """Files under ``out`` outside the store (``.s4w``) and the run (``.s4w_dcp``)."""
    found = []
    for d, _, fs in os.walk(out):
        rel = os.path.relpath(d, out)
        if rel.split(os.sep)[0] not in (".s4w", ".s4w_dcp"):
            found += [os.path.normpath(os.path.join(rel, f)) for f in fs]
    return sorted(found)


def trainer(out, callbacks, n_embd=128, extra=None, **kw):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=n_embd, n_layer=2, n_head=2, resid_pdrop=0.1)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=8, per_device_train_batch_size=4, learning_rate=1e-4, lr_scheduler_type="linear",
        save_steps=2, save_total_limit=2, logging_steps=100, report_to=[], use_cpu=not GPU, disable_tqdm=True,
        seed=0, ddp_backend=None if GPU else "gloo", fsdp="full_shard", full_determinism=GPU,
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}, **kw,
    )  # fmt: skip
    cls = transformers.Trainer if GPU else FSDPOnCPU
    model = transformers.GPT2LMHeadModel(cfg)
    return cls(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks, **(extra or {}))


def raw(v):
    t = v.to_local() if hasattr(v, "to_local") else v
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def weight_bits(model):
    return {k: raw(v) for k, v in model.state_dict().items()}


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def local_bits(tr):
    """This rank's shards of the weights and of the optimizer state, as bytes."""
    out = weight_bits(tr.model)
    for i, st in enumerate(tr.optimizer.state_dict()["state"].values()):
        out.update({f"opt{i}.{k}": raw(v) for k, v in st.items()})
    return out


def all_ranks(value):
    got = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(got, value)
    return got


def main(out):
    ref = trainer(os.path.join(out, "ref"), [], save_strategy="no")
    assert ref.is_fsdp_enabled
    ref.train()
    want = local_bits(ref)
    run = os.path.join(out, "run")
    probe = Probe()
    first = trainer(run, [StopAt(6), S4Callback(), probe])
    first.train()  # saves 2, 4, 6; save_total_limit=2 keeps 4 and 6
    root = os.path.join(run, ".s4w_dcp")
    wait_rank_stores(root)
    rank = torch.distributed.get_rank()
    infos = {i.step: (i.kind, i.stored_bytes) for i in rank_store(RunRoot(root), rank_store_name(rank)).list()}
    first_steps = committed_steps(root)
    resumed = trainer(run, [S4Callback(), probe])
    resumed.train(resume_from_checkpoint=True)  # from step 6; trains 7 and 8, saves 8
    got = local_bits(resumed)
    same = equal(got, want)
    lr = resumed.lr_scheduler.get_last_lr() == ref.lr_scheduler.get_last_lr()
    # the explicit route: restore_checkpoint (every rank) gives the folder, into another output dir
    path = restore_checkpoint(os.path.join(run, ".s4w"), step=6)
    listed = sorted(os.listdir(path))
    again = trainer(os.path.join(out, "again"), [S4Callback()])
    again.train(resume_from_checkpoint=path)
    same_again = equal(local_bits(again), want)
    flags, kinds = all_ranks([bool(same and lr), same_again]), all_ranks(infos)
    # bad input: a model of other shapes resumed from the store fails on every rank, naming the step
    try:
        trainer(run, [S4Callback()], n_embd=16).train(resume_from_checkpoint=True)
        mismatch = "no error"
    except StateMismatchError as e:
        mismatch = str(e)
    mismatches = all_ranks(mismatch)
    # load_best_model_at_end: every rank loads its shards of the best step (4 of 2, 4, 6, 8), which
    # save_total_limit=2 keeps beside the newest
    snaps = Snapshots()
    evals = {"eval_dataset": Tokens(8, seed=1), "compute_metrics": Scores()}
    best = trainer(os.path.join(out, "best"), [S4Callback(), snaps], extra=evals, eval_strategy="steps", eval_steps=2,
                   metric_for_best_model="score", load_best_model_at_end=True)  # fmt: skip
    best.train()
    at_end = weight_bits(best.model)
    best_ok = all_ranks([best.state.best_global_step, equal(at_end, snaps.bits[4]), equal(at_end, snaps.bits[8])])
    best_root = os.path.join(out, "best", ".s4w_dcp")
    if resumed.args.process_index == 0:
        st = CheckpointStore(os.path.join(run, ".s4w"))
        tree = st.load(8)
        print(json.dumps({
            "first_steps": first_steps, "steps": st.steps(), "committed": committed_steps(root), "same": flags,
            "kinds": kinds, "native_saves": NATIVE_SAVES, "restored": listed, "probe_saves": probe.saves,
            "probe_files": sorted(probe.files), "files": payload(run), "keys": sorted(tree),
            "sharded": st.info(8).extra.get("sharded") == os.path.abspath(root), "mismatch": mismatches,
            "best": best_ok, "best_steps": CheckpointStore(os.path.join(out, "best", ".s4w")).steps(),
            "best_committed": committed_steps(best_root),
        }))  # fmt: skip
        st.close()
    torch.distributed.barrier()
    # every check is done and printed: leave without freeing the process group at teardown
    # (tests/integrations/accelerate/mp_worker.py says why: a gloo teardown deadlock)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

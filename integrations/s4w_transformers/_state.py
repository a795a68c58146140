"""What one step of an :class:`~s4w_transformers.S4Callback` store holds: the save point taken at an
event (:class:`Pending`), the state tree and its ``extra`` as the Trainer's own save would write them
(``trainer_state.json`` included), and the bookkeeping of ``save_strategy="best"``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode

from s4w_core import frameworks
from s4w_core.framework_steps import state_dicts

__all__ = [
    "FORMAT", "Pending", "dcp_route", "sharded_engine", "take", "trainer_state_json", "step_tree", "step_extra", "new_best",
]  # fmt: skip

FORMAT = 2  #: ``extra["format"]``: 2 the in-memory state tree; 1 (or "files" in extra) a packed checkpoint folder


def dcp_route(trainer: Any) -> bool:
    """FSDP2 (``fsdp_config={"fsdp_version": 2}``): the model's and optimizer's shards go through the
    run-level DCP writer beside the store, whatever the ``state_dict_type``."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    return getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "fsdp_version", 1) == 2


def sharded_engine(trainer: Any) -> str | None:
    """``"FSDP"`` (FSDP1) or ``"DeepSpeed"`` when ``trainer`` saves through that engine's own sharded
    writer, which the callback cannot intercept (FSDP2 goes through the run: :func:`dcp_route`)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return None if dcp_route(trainer) else "FSDP"
    return "DeepSpeed" if getattr(trainer, "is_deepspeed_enabled", False) else None


@dataclasses.dataclass
class Pending:
    """A save the Trainer asked for, taken at the next event: its step, this process's RNG states,
    the length of the log and the ``TrainerControl`` state at the save point."""

    step: int
    rng: dict[str, Any]
    log_len: int
    control_state: dict[str, Any]


def take(args: Any, state: Any, control: Any, step: int, as_saved: bool = True) -> Pending:
    """The save point now (``as_saved``: ``should_save`` recorded as the Trainer's own save does)."""
    cs = control.state()
    if as_saved:
        cs["args"]["should_save"] = True
    rng = frameworks.rng_state(cuda_all=args.parallel_mode == ParallelMode.DISTRIBUTED)
    return Pending(step, rng, len(state.log_history), cs)


def trainer_state_json(trainer: Trainer, state: Any, p: Pending) -> str:
    """``trainer_state.json`` as the Trainer's save writes it (callback states updated)."""
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, ExportableState):
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks.get(name), list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
    state.stateful_callbacks["TrainerControl"] = p.control_state
    d = dataclasses.asdict(state)
    d["log_history"] = d["log_history"][: p.log_len]
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def step_tree(
    trainer: Trainer,
    args: Any,
    state: Any,
    kw: dict[str, Any],
    p: Pending,
    rngs: list[Any],
    sharded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state tree of the save point ``p`` (``kw``: the event's keyword arguments; ``rngs``: every
    process's RNG states).  ``sharded``: the model and optimizer went into a run-level DCP step, whose
    pointer (``{"root", "step", "optimizer"}``) the tree holds instead of them."""
    model: Any = trainer.model
    tree: dict[str, Any] = {"sharded": sharded} if sharded is not None else {"model": model.state_dict()}
    if not args.save_only_model:
        if sharded is None:
            tree["optimizer"] = state_dicts([kw["optimizer"]])[0]
        tree["scheduler"] = state_dicts([kw["lr_scheduler"]])[0]
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        if scaler is not None:
            tree["scaler"] = scaler.state_dict()
        tree["rng"] = rngs
    tree["trainer_state"] = trainer_state_json(trainer, state, p)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        tree["config"] = config.to_json_string()
    return tree


def step_extra(args: Any, p: Pending, tree: dict[str, Any]) -> dict[str, Any]:
    """The step's ``extra`` (what :func:`~s4w_transformers.restore_checkpoint` and a resume check)."""
    extra: dict[str, Any] = {"format": FORMAT, "global_step": p.step, "save_only_model": bool(args.save_only_model),
             "world_size": int(args.world_size or 1)}  # fmt: skip
    if "sharded" in tree:  # the run's root: DCP's load plan checks the shards
        extra["sharded"] = tree["sharded"]["root"]
    else:
        extra["model"] = frameworks.fingerprint(tree["model"])
    return extra


def new_best(args: Any, state: Any, metrics: dict[str, Any]) -> bool:
    """``save_strategy="best"``: the Trainer's ``_determine_best_metric`` bookkeeping (same values,
    into ``state``); True when ``metrics`` is a new best, which leaves the Trainer nothing new to
    find, so it writes no folder and the callback takes the save."""
    name = args.metric_for_best_model
    key = None if name is None else name if name.startswith("eval_") else f"eval_{name}"
    if key is None or key not in metrics:
        return False  # the Trainer raises its own KeyError next
    best = state.best_metric
    if best is None:
        best = float("-inf") if args.greater_is_better else float("inf")
    if (np.greater if args.greater_is_better else np.less)(metrics[key], best):
        state.best_metric, state.best_global_step = metrics[key], state.global_step
        return True
    return False

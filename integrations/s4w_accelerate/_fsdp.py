"""Accelerate's sharded engines.  FSDP2 with sharded state dicts: every process's shards of the
models and optimizers go through the run-level DCP storage beside the store
(:func:`s4w_core.framework_steps.save_sharded`: ``S4StorageWriter`` / ``S4StorageReader``), the
rest into the store step.  FSDP1, DeepSpeed, Megatron-LM: Accelerate writes its own folder, which
is stored packed and written back when it is gone.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from s4w_accelerate._settings import ACTIVE, find_step, step_for, store_for
from s4w_core.filepack import unpack_folder
from s4w_core.framework_steps import load_sharded, warn_fallback
from s4w_core.frameworks import StateMismatchError
from s4w_core.store import CheckpointStore

__all__ = [
    "dcp_route", "sharded_engine", "save_dcp", "prune_dcp", "check_route", "load_dcp", "save_packed", "load_packed",
]  # fmt: skip

_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def dcp_route(acc: Accelerator) -> bool:
    """FSDP2 with sharded state dicts: models and optimizers go through the run-level DCP writer."""
    plugin = getattr(acc.state, "fsdp_plugin", None)
    return bool(acc.is_fsdp2 and "SHARDED" in str(getattr(plugin, "state_dict_type", "")))


def sharded_engine(acc: Accelerator) -> str | None:
    """The engine's name when ``acc`` saves through a sharded writer (FSDP, DeepSpeed, Megatron-LM)."""
    return str(acc.distributed_type) if acc.distributed_type in _SHARDED else None


def save_dcp(st: CheckpointStore, step: int, models: list[Any], optimizers: list[Any]) -> str:
    """Every process: its shards of ``models`` and ``optimizers`` as ``step`` of the run beside ``st``;
    returns the run's root (recorded in the store step's ``extra["sharded"]``)."""
    return ACTIVE.steps.save_sharded(st, step, models, optimizers)


def prune_dcp(st: CheckpointStore, root: str, acc: Accelerator) -> None:
    """Every process, after the store's retention: its shards of the steps ``st`` no longer holds deleted."""
    ACTIVE.steps.prune_sharded(st, root, acc.process_index)


def check_route(acc: Accelerator, where: str, root: str | None) -> None:
    """:class:`StateMismatchError` unless the step ``where`` (its run ``root``; None: none) was saved
    with FSDP2 sharded state dicts exactly when ``acc`` uses them."""
    if (root is not None) != dcp_route(acc):
        raise StateMismatchError(f"{where} was saved {'with' if root else 'without'} FSDP2 sharded state dicts, and "
                                 f"this Accelerator {'does not use' if root else 'uses'} them")  # fmt: skip


def load_dcp(root: str, step: int, models: list[Any], optimizers: list[Any]) -> None:
    """Models and optimizers from step ``step`` of the run ``root`` (DCP's load plan checks them first)."""
    load_sharded(root, step, models, optimizers, ACTIVE.steps.s3_options)


def save_packed(acc: Accelerator, engine: str, output_dir: str | None, safe_serialization: bool, **kw: Any) -> Any:
    """Accelerate's own ``save_state`` writes the folder; the main process stores it packed."""
    warn_fallback("s4w_accelerate", engine, "Accelerate", ACTIVE.warned)
    location = os.fspath(ACTIVE.originals["save_state"](acc, output_dir, safe_serialization, **kw))
    st, extra = store_for(location), {"folder": os.path.basename(os.path.normpath(location)), "packed": True}
    steps = ACTIVE.steps
    steps.store_written_folder(location, acc.is_main_process,
                               lambda f: steps.save_folder(st, f, step_for(f, False, acc, st), extra))  # fmt: skip
    return location


def load_packed(acc: Accelerator, engine: str, input_dir: str | None, load_kwargs: dict | None, **kw: Any) -> Any:
    """Accelerate's own ``load_state``, the folder first written back from the store when it is gone."""
    warn_fallback("s4w_accelerate", engine, "Accelerate", ACTIVE.warned)
    if input_dir is not None and (not os.path.isdir(input_dir) or not os.listdir(input_dir)):
        if acc.is_main_process:
            st, step, _ = find_step(acc, input_dir)
            unpack_folder(st.load(step, "cpu"), input_dir)
        acc.wait_for_everyone()
    return ACTIVE.originals["load_state"](acc, input_dir, load_kwargs, **kw)

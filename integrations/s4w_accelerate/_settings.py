"""The adapter's process-wide state: the active :class:`Config`, the stores it names, and where a
checkpoint folder's step is found (read by the save/load hook and the sharded-engine route)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import accelerate
from accelerate import Accelerator

from s4w_core import frameworks
from s4w_core.framework_steps import AdapterSteps, UnsupportedFrameworkError, private_attrs, step_from_name
from s4w_core.store import CheckpointStore

__all__ = [
    "ENV", "STORE_DIRNAME", "WRITER", "Config", "Active", "ACTIVE", "UnsupportedAccelerateError", "config", "enabled",
    "last_info", "finish_pending", "store_for", "registered", "step_for", "find_step",
]  # fmt: skip

ENV = "S4W_ACCELERATE"
STORE_DIRNAME = ".s4w"
WRITER = "s4w_accelerate"  #: ``extra["writer"]`` of the steps this adapter commits
UnsupportedAccelerateError = UnsupportedFrameworkError  #: an Accelerate without an attribute :func:`registered` reads
#: Accelerator attributes with no public getter (checked against accelerate 1.15.0; present since 0.x)
_PRIVATE = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects",
            "_save_model_state_pre_hook", "_load_model_state_pre_hook")  # fmt: skip


@dataclass
class Config:
    """The active settings (see :func:`~s4w_accelerate.enable`)."""

    store: str | None = None
    profile: str = "auto"
    store_options: dict[str, Any] | None = None
    async_save: bool = False


@dataclass
class Active:
    """What :func:`~s4w_accelerate.enable` switched on: the config (None: off), Accelerate's own
    methods it replaced, the steps in the stores, the fallback warnings given."""

    config: Config | None = None
    originals: dict[str, Any] = field(default_factory=dict)
    steps: AdapterSteps = field(default_factory=lambda: AdapterSteps(WRITER, profile="auto"))
    warned: set[str] = field(default_factory=set)


ACTIVE = Active()


def last_info() -> Any:
    """The :class:`~s4w_core.store.StepInfo` of the last durable save (ratio, kind, bytes), or None."""
    return ACTIVE.steps.last_info


def config() -> Config | None:
    """The active configuration, or None when the hook is off."""
    return ACTIVE.config


def enabled() -> bool:
    """Whether :func:`~s4w_accelerate.enable` is in effect."""
    return ACTIVE.config is not None


def finish_pending() -> None:
    """Wait for the background save (``async_save=True``), mirror rotation, and wait for the
    stores' own background work (the step below the newest re-encoded as a delta); raises the
    save's error if it failed. Call it at the end of training (the process's exit would
    otherwise wait for that work); ``save_state`` and ``load_state`` wait for the save first."""
    ACTIVE.steps.wait()


def store_for(folder: str | os.PathLike[str]) -> CheckpointStore:
    """The store that holds the checkpoint folder ``folder``: ``<parent>/.s4w`` by default
    (``<project_dir>/.s4w`` with automatic naming, outside the folder ``total_limit`` counts)."""
    if ACTIVE.config is not None and ACTIVE.config.store:
        url = frameworks.store_url(ACTIVE.config.store)
    else:
        parent = os.path.dirname(os.path.abspath(os.fspath(folder)))
        if os.path.basename(parent) == "checkpoints":
            parent = os.path.dirname(parent)
        url = os.path.join(parent, STORE_DIRNAME)
    return ACTIVE.steps.store(url)


def registered(acc: Accelerator) -> dict[str, Any]:
    """What ``save_state``/``load_state`` work on, which Accelerate keeps only in private attributes
    (no public getter in accelerate 1.15.0, which this was checked against): ``models``,
    ``optimizers``, ``schedulers``, ``dataloaders``, ``custom_objects`` (lists) and the
    ``save_model_state_pre_hook`` / ``load_model_state_pre_hook`` dicts.

    Raises:
        UnsupportedAccelerateError: an attribute is gone (an Accelerate this adapter does not know).
    """
    return private_attrs(acc, _PRIVATE, "accelerate", accelerate.__version__, "1.15.0")


def step_for(folder: str, automatic: bool, acc: Accelerator, st: CheckpointStore) -> int:
    """The store step of the checkpoint folder ``folder`` (``save_iteration`` with automatic naming)."""
    return int(acc.save_iteration) if automatic else step_from_name(os.path.basename(os.path.normpath(folder)), st)


def find_step(acc: Accelerator, input_dir: str | None) -> tuple[CheckpointStore, int, str]:
    """The store, step and folder name ``load_state(input_dir)`` loads."""
    if input_dir is None:
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        st = store_for(os.path.join(acc.project_dir, "checkpoints", "checkpoint_0"))
        info = ACTIVE.steps.find(st, "load_state()", automatic=True)
    else:
        st = store_for(input_dir)
        info = ACTIVE.steps.find(st, f"load_state({input_dir!r})", folder=os.path.basename(os.path.normpath(input_dir)))
    return st, info.step, info.extra["folder"]

"""framework_steps.caller_instance finds the calling framework object without leaving a
reference cycle through the frames it walked (which kept a training loop's locals alive)."""

from __future__ import annotations

import gc
from typing import Any

import torch

from s4w_core.framework_steps import caller_instance


class Owner:
    def fire(self, event: Any) -> Any:
        batch = torch.zeros(1000)  # a local of the framework's frame, like a training step's batch
        return event(batch)


def _event(batch: torch.Tensor) -> Any:
    return caller_instance(Owner)


def test_finds_the_owner_and_leaves_no_cycle() -> None:
    owner = Owner()
    assert caller_instance(Owner) is None
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        assert owner.fire(_event) is owner
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if type(o).__name__ in ("frame", "Tensor")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []

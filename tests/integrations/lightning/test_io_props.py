"""Property test (hypothesis): random sequences of what Lightning's ``ModelCheckpoint`` does to
its ``CheckpointIO`` -- a step saved under one name or several (top-k names, ``last.ckpt``),
names overwritten by later steps, names removed, checkpoints loaded, the plugin torn down and
made again, a run resumed from an older step that saves those step numbers again -- blocking
and asynchronous: every name loads exactly what was last saved under it, a removed name is gone,
and the store keeps the steps some name needs and no other."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("lightning")
from s4w_core import pointer  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_lightning import S4CheckpointIO  # noqa: E402
from tests.store.helpers import scratch_dir  # noqa: E402

NAMES = ("a.ckpt", "b.ckpt", "c.ckpt", "last.ckpt")

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.sampled_from(NAMES), st.integers(1, 2)),  # a new step (gap) under a name
        st.tuples(st.just("again"), st.sampled_from(NAMES), st.just(0)),  # the last step under another name
        st.tuples(st.just("remove"), st.sampled_from(NAMES), st.just(0)),
        st.tuples(st.just("load"), st.sampled_from(NAMES), st.just(0)),
        st.tuples(st.just("reopen"), st.just(""), st.just(0)),  # teardown, and a new plugin
        # a run resumed k steps back (a new plugin): it saves those step numbers again, with new values
        st.tuples(st.just("rewind"), st.just(""), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=20,
)


def _checkpoint(step: int, version: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 131 + version)
    w = torch.nn.Parameter(torch.randn(48, 32, generator=g))
    with torch.no_grad():
        w.add_(0)  # a parameter written in place (version > 0), as training leaves them
    return {
        "state_dict": {"w": w.detach(), "b": torch.randn(32, generator=g).to(torch.bfloat16)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(48, 32, generator=g), "step": torch.tensor(float(step))}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]}],  # fmt: skip
        "global_step": step,
        "epoch": version,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # bit for bit
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _run(root: str, ops: list, async_save: bool) -> None:
    d = os.path.join(root, "ckpts")
    io = S4CheckpointIO(async_save=async_save)
    files: dict[str, dict[str, Any]] = {}  # name -> the checkpoint last saved under it
    step, version, last = 0, 0, None
    try:
        for op, name, a in ops:
            path = os.path.join(d, name)
            if op == "save" or (op == "again" and last is None):
                step += max(a, 1)
                last = _checkpoint(step, version)
                io.save_checkpoint(last, path)
                files[name] = last
            elif op == "again":  # Lightning's second name of the step it just saved
                io.save_checkpoint(last, path)
                files[name] = last
            elif op == "remove" and name in files:
                io.remove_checkpoint(path)
                del files[name]
            elif op == "load" and name in files:
                assert _same(io.load_checkpoint(path), files[name]), name
            elif op in ("reopen", "rewind"):
                io.teardown()
                io = S4CheckpointIO(async_save=async_save)
                last = None
                if op == "rewind":
                    step, version = max(0, step - a), version + 1
        io.teardown()
        for name in NAMES:
            path = os.path.join(d, name)
            assert os.path.exists(path) == (name in files), name
            if name in files:
                got = S4CheckpointIO().load_checkpoint(path)
                assert _same(got, files[name]), f"{name} holds other values than were saved under it"
        if os.path.isdir(os.path.join(d, ".s4w")):  # (a file rewritten whole when its step was saved again names none)
            ptrs = [pointer.read(os.path.join(d, n)) for n in files]
            named = {p.step for p in ptrs if p is not None}
            assert CheckpointStore(os.path.join(d, ".s4w")).steps() == sorted(named), "steps no name needs"
    finally:
        io.teardown()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, async_save=st.booleans())
# a name removed, then the same step saved under a name again while the remove is still queued:
# the remove must not delete the step the new pointer names (it did before this test)
@example(ops=[("save", "a.ckpt", 1), ("remove", "a.ckpt", 0), ("again", "a.ckpt", 0)], async_save=True)
@example(ops=[("save", "a.ckpt", 1), ("remove", "a.ckpt", 0), ("again", "b.ckpt", 0)], async_save=True)
# a resumed run saving step 1 again under another name: a.ckpt keeps the values it was saved with
@example(ops=[("save", "a.ckpt", 1), ("rewind", "", 1), ("save", "b.ckpt", 1)], async_save=False)
def test_random_checkpoint_io_sequences(ops: list, async_save: bool) -> None:
    with scratch_dir("s4w-lprop-") as root:
        _run(root, ops, async_save)

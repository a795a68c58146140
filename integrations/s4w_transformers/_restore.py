"""Resume: a step :class:`~s4w_transformers.S4Callback` stored, as the folder the Trainer's resume reads."""

from __future__ import annotations

import json
import os
from typing import Any

import safetensors.torch
import torch

from s4w_core.framework_steps import AdapterSteps, cleanup_temp_folders, restore_into
from s4w_core.frameworks import StateMismatchError

__all__ = ["restore_checkpoint", "restore_parts", "cleanup_restored", "read_pointer", "WRITER", "POINTER"]

WRITER = "s4w_transformers"  #: ``extra["writer"]`` of the steps this adapter commits
POINTER = "s4w_sharded.json"  #: in a restored FSDP2 step: where its model and optimizer shards are
cleanup_restored = cleanup_temp_folders  #: remove the temporary folders :func:`restore_checkpoint` made
_FILES = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "scaler": "scaler.pt"}


def restore_checkpoint(
    store: str | os.PathLike[str],
    step: int | None = None,
    dest: str | os.PathLike[str] | None = None,
    *,
    model: torch.nn.Module | None = None,
    **store_options: Any,
) -> str:
    """Write a stored step as the folder ``trainer.train(resume_from_checkpoint=...)`` reads.

    Args:
        store: the store :class:`S4Callback` wrote (``<output_dir>/.s4w`` by default, or its URL).
        step: the global step; default the newest.
        dest: the folder to write (must not exist or be empty). Default: a new temporary folder
            ``.../checkpoint-{step}``, removed once an :class:`S4Callback`'s training has read it,
            by :func:`cleanup_restored`, or at exit.
        model: when given, checked against the stored weights first (keys, shapes, dtypes).
        **store_options: :class:`~s4w_core.store.CheckpointStore` arguments (``endpoint``...).
    Returns:
        The folder: ``trainer_state.json``, ``model.safetensors``, ``config.json`` and, unless the
        run saved only the model, ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth`` (and
        ``scaler.pt``).  A step saved under FSDP2 has ``s4w_sharded.json`` (:data:`POINTER`: the
        run-level DCP step holding the model's and optimizer's shards) instead of
        ``model.safetensors`` and ``optimizer.pt``: a Trainer with :class:`S4Callback` attached
        loads those shards on every rank where the Trainer loads its FSDP checkpoint.
    Raises:
        CheckpointNotFoundError: no such step (or an empty store).
        StateMismatchError: the step was not written by S4Callback, or does not fit ``model``.
        ConflictError: ``dest`` exists and is not empty (nothing is overwritten).
    """
    return restore_parts(store, step, dest, model, (), store_options)[0]


def restore_parts(
    store: str | os.PathLike[str],
    step: int | None,
    dest: str | os.PathLike[str] | None,
    model: torch.nn.Module | None,
    held: tuple[str, ...],
    store_options: dict[str, Any],
) -> tuple[str, dict[str, Any]]:
    """:func:`restore_checkpoint`, with the parts named in ``held`` (e.g. the optimizer) returned in
    memory, on the device they were saved on, instead of written to the folder."""
    steps = AdapterSteps(WRITER, **{"base_cache_bytes": 0, **store_options})  # read once: no delta base kept
    st = steps.store(os.fspath(store))
    return restore_into(steps, st, step, dest, _write_folder, what="S4Callback", model=model, held=held)


def _write_folder(tree: dict[str, Any], dest: str, where: str) -> None:
    """The files the Trainer's resume reads, from a stored tree."""
    for key in ("model" if "sharded" not in tree else "sharded", "trainer_state"):
        if key not in tree:
            raise StateMismatchError(f"{where}: key {key!r} missing; not a Trainer checkpoint")
    pointer = None if "sharded" not in tree else json.dumps(tree["sharded"], sort_keys=True)
    texts = {"trainer_state.json": tree["trainer_state"], "config.json": tree.get("config"), POINTER: pointer}
    for name, text in texts.items():
        if text is not None:
            with open(os.path.join(dest, name), "w", encoding="utf-8") as f:
                f.write(text)
    sd = tree.get("model")  # None under FSDP2: the shards stay in the run (POINTER)
    if sd is not None and all(isinstance(v, torch.Tensor) for v in sd.values()):
        seen: set[int] = set()
        flat = {}
        for k, v in sd.items():  # safetensors refuses tensors that share memory (tied weights): copy those
            ptr = v.untyped_storage().data_ptr() if v.numel() else -1
            flat[k] = v.contiguous() if ptr not in seen or ptr == -1 else v.clone(memory_format=torch.contiguous_format)
            seen.add(ptr)
        safetensors.torch.save_file(flat, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    elif sd is not None:  # a module's extra state that is not a tensor
        torch.save(sd, os.path.join(dest, "pytorch_model.bin"))
    for key, name in _FILES.items():
        if key in tree:
            torch.save(tree[key], os.path.join(dest, name))
    rngs = tree.get("rng") or []
    for r, s in enumerate(rngs):
        torch.save(s, os.path.join(dest, "rng_state.pth" if len(rngs) == 1 else f"rng_state_{r}.pth"))


def read_pointer(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run-level DCP step (``{"root", "step", "optimizer"}``) a restored FSDP2 step points to, or
    None when ``folder`` is not one.

    Raises:
        StateMismatchError: the pointer file is not such a record.
    """
    path = os.path.join(os.fspath(folder), POINTER)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise StateMismatchError(f"{path}: not JSON ({e})") from e
    if not (isinstance(doc, dict) and isinstance(doc.get("root"), str) and isinstance(doc.get("step"), int)
            and isinstance(doc.get("optimizer"), bool)):  # fmt: skip
        raise StateMismatchError(f"{path}: not a pointer to a sharded step (root, step, optimizer): {doc!r}")
    return doc

"""Resume: a step :class:`~s4w_transformers.S4Callback` stored, as what the Trainer's resume reads.

:func:`restore_checkpoint` writes the ``checkpoint-N`` files ``trainer.train(resume_from_checkpoint=...)``
reads into a temporary folder, removed once the callback's training has read it, or at exit;
:func:`restore_parts` hands some parts (the optimizer and scheduler states) back in memory instead.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

import safetensors.torch
import torch

from s4w_core import ConflictError, frameworks
from s4w_core.filepack import unpack_folder
from s4w_core.frameworks import StateMismatchError, barrier
from s4w_core.store import CheckpointStore

__all__ = ["restore_checkpoint", "restore_parts", "cleanup_restored", "restored_pending", "WRITER"]

WRITER = "s4w_transformers"  #: ``extra["writer"]`` of the steps this adapter commits
_RESTORED: set[str] = set()  # temporary folders made here; removed once read, or at exit


def cleanup_restored() -> None:
    """Remove the temporary folders :func:`restore_checkpoint` made in this process."""
    while _RESTORED:
        shutil.rmtree(_RESTORED.pop(), ignore_errors=True)


def restored_pending() -> bool:
    """Whether a temporary folder :func:`restore_checkpoint` made is still there."""
    return bool(_RESTORED)


atexit.register(cleanup_restored)


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
            or at exit.
        model: when given, checked against the stored weights first (keys, shapes, dtypes).
        **store_options: :class:`~s4w_core.store.CheckpointStore` arguments (``endpoint``...).
    Returns:
        The folder: ``trainer_state.json``, ``model.safetensors``, ``config.json`` and, unless the
        run saved only the model, ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth`` (and
        ``scaler.pt``).
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
    url = os.fspath(store)
    d = frameworks.dist()
    rank = d.get_rank() if d is not None else 0
    st = CheckpointStore(url, **{"base_cache_bytes": 0, **store_options})  # read once: no copy kept as a delta base
    info = st.info(step)
    where = f"{url} step {info.step}"
    if info.extra.get("writer") != WRITER and "files" not in info.extra:
        raise StateMismatchError(f"{where} was written by {info.extra.get('writer') or 'another writer'!r}, not by "
                                 "S4Callback: not a Trainer checkpoint")  # fmt: skip
    if dest is not None and os.path.isdir(dest) and os.listdir(dest):
        raise ConflictError(f"{os.fspath(dest)} exists and is not empty; restore_checkpoint overwrites nothing")
    if dest is None:
        base = frameworks.broadcast_object(tempfile.mkdtemp(prefix="s4w-restore-") if rank == 0 else None)
        if rank == 0:
            _RESTORED.add(str(base))
        dest = os.path.join(str(base), f"checkpoint-{info.step}")
    dest, kept = os.fspath(dest), {}
    if rank == 0:
        # decoded on the device it was saved from where this machine has it (a GPU decodes a
        # GPU-saved step far faster than the CPU); the files get CPU tensors, as the Trainer's own
        tree = st.load(info.step, frameworks.auto_location)
        if "files" in info.extra:  # a packed checkpoint folder (FSDP/DeepSpeed fallback)
            os.makedirs(dest, exist_ok=True)
            unpack_folder(tree, dest)
        else:
            if model is not None and "model" in tree:
                frameworks.check_state_dict(where, tree["model"], model.state_dict())
            kept = {k: tree.pop(k) for k in held if k in tree}
            _write_folder(_to_cpu(tree), dest, where)
    barrier()
    return dest, kept


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return type(obj)(_to_cpu(v) for v in obj) if type(obj) in (list, tuple) else obj


def _write_folder(tree: dict[str, Any], dest: str, where: str) -> None:
    """The files the Trainer's resume reads, from a stored tree."""
    for key in ("model", "trainer_state"):
        if key not in tree:
            raise StateMismatchError(f"{where}: key {key!r} missing; not a Trainer checkpoint")
    os.makedirs(dest, exist_ok=True)
    texts = {"trainer_state.json": tree["trainer_state"], "config.json": tree.get("config")}
    for name, text in texts.items():
        if text is not None:
            with open(os.path.join(dest, name), "w", encoding="utf-8") as f:
                f.write(text)
    sd = tree["model"]
    if all(isinstance(v, torch.Tensor) for v in sd.values()):
        seen: set[int] = set()
        flat = {}
        for k, v in sd.items():  # safetensors refuses tensors that share memory (tied weights): copy those
            ptr = v.untyped_storage().data_ptr() if v.numel() else -1
            flat[k] = v.contiguous() if ptr not in seen or ptr == -1 else v.clone(memory_format=torch.contiguous_format)
            seen.add(ptr)
        safetensors.torch.save_file(flat, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    else:  # a module's extra state that is not a tensor
        torch.save(sd, os.path.join(dest, "pytorch_model.bin"))
    files = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "scaler": "scaler.pt"}
    for key, name in files.items():
        if key in tree:
            torch.save(tree[key], os.path.join(dest, name))
    rngs = tree.get("rng") or []
    for r, s in enumerate(rngs):
        torch.save(s, os.path.join(dest, "rng_state.pth" if len(rngs) == 1 else f"rng_state_{r}.pth"))

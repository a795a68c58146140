"""Lightning's sharded checkpoints (``ModelParallelStrategy``: FSDP2 / tensor parallel) through
s4weights' run-level DCP storage: every rank's shards a delta chain (docs/INTEGRATIONS.md).

``Trainer(strategy=S4ModelParallelStrategy(...))`` is ``ModelParallelStrategy`` whose distributed
checkpoint is written with ``S4StorageWriter(run_root, step=global_step)`` instead of DCP's
``FileSystemWriter``.  The checkpoint folder Lightning names (``epoch=0-step=100.ckpt``) keeps
what Lightning writes besides the tensors (``meta.pt``: loops, callbacks, hyper-parameters) and a
small JSON pointer to the run's step; the tensors live in the run (default: ``.s4w_dcp`` next to
the checkpoint folders).  Loading reads the pointed-to step with ``S4StorageReader``, into any
world size; removing a checkpoint (``ModelCheckpoint``'s top-k) deletes its step from the run when
no other checkpoint folder points to it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from s4w_core.dcp import S4StorageReader, S4StorageWriter
from s4w_core.dcp.run import delete_step
from s4w_core.errors import CheckpointNotFoundError, ManifestError

try:
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError:  # pragma: no cover - the standalone package
    from pytorch_lightning.strategies import ModelParallelStrategy  # type: ignore[no-redef,assignment]

__all__ = ["S4ModelParallelStrategy", "POINTER_NAME", "RUN_DIRNAME"]

#: the pointer file inside a checkpoint folder: {"format", "root", "step"}
POINTER_NAME = "s4w_dcp.json"
#: the run's folder next to the checkpoint folders, unless ``run_root`` is given
RUN_DIRNAME = ".s4w_dcp"
#: what Lightning names the non-tensor part of a sharded checkpoint (it checks for this file)
META_NAME = "meta.pt"
_FORMAT = "s4weights-lightning-dcp/1"


def read_pointer(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """``(run root, step)`` of the checkpoint folder ``path`` (None: not one of ours)."""
    p = Path(path) / POINTER_NAME
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
        root, step = doc["root"], doc["step"]
        if doc.get("format") != _FORMAT or not isinstance(root, str) or type(step) is not int:
            raise ValueError("not a pointer of this format")
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{p}: malformed s4weights DCP pointer ({e})") from e
    return (root if os.path.isabs(root) or "://" in root else os.path.normpath(os.path.join(path, root))), step


class S4ModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed checkpoints are s4weights delta chains.

    Args:
        *args, **kwargs: as for ``ModelParallelStrategy`` (``save_distributed_checkpoint=False``
            saves a full checkpoint as Lightning does, through its ``CheckpointIO``).
        run_root: where the run's steps live (a local directory); default: ``.s4w_dcp`` in the
            folder of each checkpoint.
        profile: s4weights profile of the writer (``"auto"``: GPU codecs on a usable GPU).
    Example:
        >>> # Trainer(strategy=S4ModelParallelStrategy(data_parallel_size=2), devices=2)  # doctest: +SKIP
    """

    def __init__(self, *args: Any, run_root: str | os.PathLike[str] | None = None, profile: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run_root = None if run_root is None else os.fspath(run_root)
        self.profile = profile

    def _root_for(self, path: Path) -> str:
        return self.run_root if self.run_root is not None else str(path.parent / RUN_DIRNAME)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported")
        path = Path(self.broadcast(filepath))
        root = self._root_for(path)
        step = int(checkpoint.get("global_step", 0))
        if self.global_rank == 0:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        converted: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(converted, storage_writer=S4StorageWriter(root, step=step, profile=self.profile))
        if self.global_rank == 0:
            torch.save(checkpoint, path / META_NAME)  # Lightning's own sharded-checkpoint metadata
            rel = os.path.relpath(root, path) if self.run_root is None else root
            (path / POINTER_NAME).write_text(json.dumps({"format": _FORMAT, "root": rel, "step": step}))
        self.barrier("s4w_dcp_save")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        ptr = read_pointer(path)
        if ptr is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        root, step = ptr
        assert self.model is not None and self.lightning_module is not None
        module = self.model
        strict = self.lightning_module.strict_loading
        module_state = {"state_dict": get_model_state_dict(module)}
        dcp.load(module_state, storage_reader=S4StorageReader(root, step=step))
        module.load_state_dict(module_state["state_dict"], strict=strict)
        for idx, optim in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(module, optim)}
            dcp.load(optim_state, storage_reader=S4StorageReader(root, step=step))
            set_optimizer_state_dict(
                module, optim, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
            )
        meta = path / META_NAME
        if not meta.is_file():
            raise CheckpointNotFoundError(f"{path}: {META_NAME} is missing (Lightning's part of the checkpoint)")
        return torch.load(meta, weights_only=True if weights_only is None else weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        # every rank calls this: rank 0 reads the pointer and decides (another rank may look only
        # after rank 0 removed the folder); the step goes when no other checkpoint folder beside
        # it points to it, and then each rank deletes its own store's step
        decision: tuple[str, int, bool] | None = None
        if self.global_rank == 0:
            path = Path(filepath)
            ptr = read_pointer(path) if path.is_dir() else None
            if ptr is not None:
                others = False
                for sib in path.parent.iterdir():
                    if sib != path and sib.is_dir():
                        try:
                            others = others or read_pointer(sib) == ptr
                        except ManifestError:
                            continue
                decision = (ptr[0], ptr[1], others)
        decision = self.broadcast(decision)
        if decision is None:
            return super().remove_checkpoint(filepath)
        root, step, others = decision
        if self.global_rank == 0:
            shutil.rmtree(filepath, ignore_errors=True)
        if not others:
            delete_step(root, step, self.global_rank)

"""Replace ``Accelerator.save_state`` / ``load_state``: the state goes from memory into a store.

Enabled by the environment (``accelerate launch`` passes it to every worker) plus one import::

    S4W_ACCELERATE=1 accelerate launch train.py        # train.py has: import s4w_accelerate

or explicitly with ``s4w_accelerate.enable(...)``.  Environment variables (read at import):

=============================  ==============================================================
``S4W_ACCELERATE``             ``1``/``true``: enable with the store beside the checkpoint
                               folders (``<parent>/.s4w``, or ``<project_dir>/.s4w`` with
                               automatic checkpoint naming); or a URL (local dir, ``s3://...``)
``S4W_ACCELERATE_PROFILE``     ``auto`` (default), ``portable`` or ``fast``
``S4W_ACCELERATE_ASYNC``       ``1``: compress and write in the background (``save_async``)
=============================  ==============================================================

``save_state`` stores what Accelerate's would write (models, optimizers, schedulers, the samplers'
and stateful dataloaders' states, the gradient scaler, every process's RNG states, registered
objects) as one step of a :class:`~s4w_core.store.CheckpointStore`, read from memory: no
``model.safetensors`` / ``optimizer.bin`` / ``random_states_*.pkl`` is written.  The checkpoint
folder is still created (empty) and rotated as Accelerate does, so code that adds its own files to
it keeps working; the store mirrors ``total_limit``.  ``load_state`` loads a folder's step back.
Accelerate's save pre-hook sees model weights only, so both methods are replaced, not wrapped.
FSDP, DeepSpeed and Megatron-LM save through their own sharded writers: there the original
methods run and the folder is stored packed (:func:`s4w_core.filepack.pack_folder`), with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
from accelerate.utils import DistributedType

import s4w_core
from s4w_core import CheckpointNotFoundError, ConflictError, S4WError
from s4w_core.filepack import pack_folder, unpack_folder
from s4w_core.store import CheckpointStore

__all__ = [
    "enable", "disable", "enabled", "enable_from_env", "config", "finish_pending", "store_for", "last_info", "sharded_engine",
    "StateMismatchError", "STORE_DIRNAME", "ENV", "WRITER",
]  # fmt: skip

log = logging.getLogger("s4w_accelerate")

ENV = "S4W_ACCELERATE"
STORE_DIRNAME = ".s4w"
#: ``extra["writer"]`` of the steps this adapter commits.
WRITER = "s4w_accelerate"
_DIGITS = re.compile(r"(\d+)(?!.*\d)")
_NATIVE = ("model.safetensors", "pytorch_model.bin", "optimizer.bin")  # a folder Accelerate itself wrote
_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


class StateMismatchError(S4WError, ValueError):
    """A stored step does not fit this Accelerator: other writer, models, shapes or objects."""


@dataclass
class Config:
    """The active settings (see :func:`enable`)."""

    store: str | None = None
    profile: str = "auto"
    store_options: dict[str, Any] | None = None
    async_save: bool = False


_config: Config | None = None
_originals: dict[str, Any] = {}
_stores: dict[str, CheckpointStore] = {}
_inflight: tuple[Any, CheckpointStore, int | None] | None = None  # (handle, store, total_limit)
_warned: set[str] = set()
_last: list[Any] = [None]


def last_info() -> Any:
    """The :class:`~s4w_core.store.StepInfo` of the last durable save (ratio, kind, bytes), or None."""
    return _last[0]


def config() -> Config | None:
    """The active configuration, or None when the hook is off."""
    return _config


def enabled() -> bool:
    return _config is not None


def _default_store(folder: str) -> str:
    """``<parent>/.s4w``; for Accelerate's automatic naming (``<project>/checkpoints/checkpoint_N``)
    ``<project>/.s4w``, outside the folder whose entries ``total_limit`` counts."""
    parent = os.path.dirname(os.path.abspath(folder))
    if os.path.basename(parent) == "checkpoints":
        parent = os.path.dirname(parent)
    return os.path.join(parent, STORE_DIRNAME)


def _store_url(folder: str) -> str:
    if _config is not None and _config.store:
        return _config.store if _config.store.startswith("s3://") else os.path.abspath(_config.store)
    return _default_store(folder)


def store_for(folder: str | os.PathLike[str]) -> CheckpointStore:
    """The :class:`CheckpointStore` that holds the checkpoint folder ``folder`` (while enabled)."""
    url = _store_url(os.fspath(folder))
    st = _stores.get(url)
    if st is None:
        cfg = _config or Config()
        st = _stores[url] = CheckpointStore(url, **{"profile": cfg.profile, **(cfg.store_options or {})})
    return st


def _fingerprint(sd: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            h.update(f"{k}:{tuple(v.shape)}:{v.dtype};".encode())
    return h.hexdigest()[:16]


def _rng(acc: Accelerator) -> dict[str, Any]:
    """What Accelerate's ``save_accelerator_state`` records in ``random_states_{i}.pkl``."""
    st: dict[str, Any] = {
        "step": acc.step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        st["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng(st: dict[str, Any]) -> None:
    random.setstate(st["random_state"])
    np.random.set_state(st["numpy_random_seed"])
    torch.set_rng_state(st["torch_manual_seed"])
    if "torch_cuda_manual_seed" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["torch_cuda_manual_seed"])


def _gather(acc: Accelerator, obj: Any) -> list[Any]:
    """Every process's ``obj`` on the main process (``[obj]`` in a single process)."""
    if acc.num_processes == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * acc.num_processes if acc.is_main_process else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def _dataloader_states(acc: Accelerator) -> list[Any]:
    out: list[Any] = []
    for dl in acc._dataloaders:  # noqa: SLF001  # Accelerate keeps the prepared objects only here
        s: dict[str, Any] = {}
        if isinstance(dl.dataset, IterableDatasetShard):
            sampler = dl.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                s["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
        if getattr(dl, "use_stateful_dataloader", False):
            s["state_dict"] = dl.state_dict()
        out.append(s)
    return out


def _folder_for(acc: Accelerator, output_dir: str | None) -> tuple[str, bool]:
    """The checkpoint folder Accelerate would use, and whether it is automatically named;
    creates it (empty) and rotates ``checkpoints/`` as Accelerate does."""
    pc = acc.project_configuration
    if not pc.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs output_dir when automatic checkpoint naming is off")
        os.makedirs(output_dir, exist_ok=True)
        return os.fspath(output_dir), False
    base = os.path.join(acc.project_dir, "checkpoints")
    os.makedirs(base, exist_ok=True)
    folders = [os.path.join(base, f) for f in os.listdir(base) if _DIGITS.search(f)]
    if pc.total_limit is not None and len(folders) + 1 > pc.total_limit and acc.is_main_process:
        folders.sort(key=lambda f: int(_DIGITS.search(os.path.basename(f)).group(1)))  # type: ignore[union-attr]
        for f in folders[: len(folders) + 1 - pc.total_limit]:
            shutil.rmtree(f)
    folder = os.path.join(base, f"checkpoint_{acc.save_iteration}")
    if os.path.exists(folder):
        raise ValueError(
            f"Checkpoint directory {folder} ({acc.save_iteration}) already exists. Please manually override "
            "`self.save_iteration` with what iteration to start with."
        )
    acc.wait_for_everyone()
    os.makedirs(folder, exist_ok=True)
    return folder, True


def _step_for(folder: str, automatic: bool, acc: Accelerator, st: CheckpointStore) -> int:
    if automatic:
        return int(acc.save_iteration)
    m = _DIGITS.search(os.path.basename(os.path.normpath(folder)))
    if m:
        return int(m.group(1))
    last = st.latest()
    return 0 if last is None else last + 1


def _save_state(self: Accelerator, output_dir: str | None = None, safe_serialization: bool = True, **kw: Any) -> Any:
    global _inflight
    if _config is None:
        return _originals["save_state"](self, output_dir, safe_serialization, **kw)
    if sharded_engine(self) is not None:
        return _save_sharded(self, output_dir, safe_serialization, **kw)
    folder, automatic = _folder_for(self, None if output_dir is None else os.fspath(output_dir))
    weights = [self.get_state_dict(m, unwrap=False) for m in self._models]  # noqa: SLF001
    for hook in self._save_model_state_pre_hook.values():  # noqa: SLF001  # as Accelerate calls them
        hook(self._models, weights, folder)  # noqa: SLF001
    rngs = _gather(self, _rng(self))
    dls = _gather(self, _dataloader_states(self))
    if self.is_main_process:
        finish_pending()
        st = store_for(folder)
        tree: dict[str, Any] = {
            "models": weights,
            "optimizers": [o.state_dict() for o in self._optimizers],  # noqa: SLF001
            "schedulers": [s.state_dict() for s in self._schedulers],  # noqa: SLF001
            "dataloaders": dls,
            "rng": rngs,
            "custom": [o.state_dict() for o in self._custom_objects],  # noqa: SLF001
        }
        if self.scaler is not None:
            tree["scaler"] = self.scaler.state_dict()
        step = _step_for(folder, automatic, self, st)
        if automatic and step in st.steps():
            raise ConflictError(
                f"{st.url} already holds step {step} (another run?); Accelerate would refuse an existing "
                f"{folder} too: set save_iteration, or use another project_dir or store"
            )
        name = os.path.basename(os.path.normpath(folder))
        extra = {
            "writer": WRITER,
            "folder": name,
            "automatic": automatic,
            "num_processes": self.num_processes,
            "models": [_fingerprint(w) for w in weights],
        }
        limit = self.project_configuration.total_limit if automatic else None
        if _config.async_save:
            _inflight = (st.save_async(tree, step, extra=extra, overwrite=not automatic), st, limit)
        else:
            _last[0] = st.save(tree, step, extra=extra, overwrite=not automatic)
            _rotate(st, limit)
    self.project_configuration.iteration += 1
    self.wait_for_everyone()
    return folder


def _rotate(st: CheckpointStore, limit: int | None) -> None:
    """Mirror ``total_limit``: keep the newest ``limit`` automatically named steps."""
    if not limit:
        return
    auto = [i.step for i in st.list() if i.extra.get("writer") == WRITER and i.extra.get("automatic")]
    for s in auto[: max(len(auto) - limit, 0)]:
        st.delete(s)


def finish_pending() -> None:
    """Wait for the background save (``async_save=True``) and mirror rotation; raises its error if
    it failed. ``save_state`` and ``load_state`` call it first; call it at the end of training."""
    global _inflight
    p, _inflight = _inflight, None
    if p is None:
        return
    handle, st, limit = p
    _last[0] = handle.result()
    _rotate(st, limit)


def _find_step(acc: Accelerator, input_dir: str | None) -> tuple[CheckpointStore, int, str]:
    if input_dir is None:
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        probe = os.path.join(acc.project_dir, "checkpoints", "checkpoint_0")
        st = store_for(probe)
        auto = [i for i in st.list() if i.extra.get("writer") == WRITER and i.extra.get("automatic")]
        if not auto:
            raise CheckpointNotFoundError(f"load_state(): the store {st.url} holds no automatically named checkpoint")
        return st, auto[-1].step, auto[-1].extra["folder"]
    st = store_for(input_dir)
    name = os.path.basename(os.path.normpath(input_dir))
    for info in reversed(st.list()):
        if info.extra.get("folder") == name:
            if info.extra.get("writer") != WRITER:
                raise StateMismatchError(f"{st.url} step {info.step} was written by {info.extra.get('writer')!r}")
            return st, info.step, name
    raise CheckpointNotFoundError(
        f"load_state({input_dir!r}): the store {st.url} has no checkpoint of a folder {name!r}"
    )


def _check(where: str, what: str, stored: list[Any], own: list[Any]) -> None:
    if len(stored) != len(own):
        raise StateMismatchError(f"{where}: {len(stored)} {what} stored, {len(own)} registered here")


def _check_model(where: str, stored: dict[str, Any], own: dict[str, Any]) -> None:
    for k, v in stored.items():
        if k not in own:
            raise StateMismatchError(f"{where}: key {k!r} is stored but this model has no such key")
        o = own[k]
        if isinstance(v, torch.Tensor) and (tuple(v.shape) != tuple(o.shape) or v.dtype != o.dtype):
            raise StateMismatchError(
                f"{where}: key {k!r} is {tuple(v.shape)} {v.dtype} in the store but {tuple(o.shape)} {o.dtype} here"
            )
    missing = [k for k in own if k not in stored]
    if missing:
        raise StateMismatchError(f"{where}: key {missing[0]!r} of this model is not in the store")


def _load_state(self: Accelerator, input_dir: str | None = None, load_kwargs: dict | None = None, **kw: Any) -> Any:
    if _config is None:
        return _originals["load_state"](self, input_dir, load_kwargs, **kw)
    if sharded_engine(self) is not None:
        return _load_sharded(self, input_dir, load_kwargs, **kw)
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if os.path.isdir(input_dir) and any(f.startswith(_NATIVE) for f in os.listdir(input_dir)):
            return _originals["load_state"](self, input_dir, load_kwargs, **kw)  # Accelerate's own folder
    if self.is_main_process:
        finish_pending()
    self.wait_for_everyone()
    st, step, name = _find_step(self, input_dir)
    where = f"{st.url} step {step} ({name})"
    dev = "cpu" if kw.pop("map_location", None) == "cpu" else str(self.device)
    # tensors saved on an accelerator decode onto this process's device; CPU ones (RNG states) stay
    tree = st.load(step, lambda orig: "cpu" if torch.device(orig).type == "cpu" else dev)
    models, opts, scheds = self._models, self._optimizers, self._schedulers  # noqa: SLF001
    # check everything before changing anything
    _check(where, "models", tree["models"], models)
    _check(where, "optimizers", tree["optimizers"], opts)
    _check(where, "schedulers", tree["schedulers"], scheds)
    _check(where, "registered objects", tree["custom"], self._custom_objects)  # noqa: SLF001
    for i, (sd, m) in enumerate(zip(tree["models"], models)):
        _check_model(f"{where} model {i}", sd, m.state_dict())
    rngs = tree["rng"]
    if len(rngs) != self.num_processes:
        warnings.warn(
            f"{where}: saved by {len(rngs)} processes, loaded by {self.num_processes}: RNG states not restored",
            stacklevel=2,
        )
    strict = kw.pop("strict", True)
    remaining = list(models)
    for hook in self._load_model_state_pre_hook.values():  # noqa: SLF001  # a hook may load some models itself
        hook(remaining, input_dir)
    for sd, m in zip(tree["models"], models):
        if any(m is r for r in remaining):
            m.load_state_dict(sd, strict=strict)
    for sd, o in zip(tree["optimizers"], opts):
        o.load_state_dict(sd)
    for sd, s in zip(tree["schedulers"], scheds):
        s.load_state_dict(sd)
    dls = tree["dataloaders"]
    mine = dls[self.process_index] if self.process_index < len(dls) else []
    for s, dl in zip(mine, self._dataloaders):  # noqa: SLF001
        if "sampler" in s and isinstance(dl.dataset, IterableDatasetShard):
            sampler = dl.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                sampler.epoch = s["sampler"]["epoch"]
                sampler.initial_seed = s["sampler"]["initial_seed"]
        if "state_dict" in s and getattr(dl, "use_stateful_dataloader", False):
            dl.load_state_dict(s["state_dict"])
    if self.scaler is not None and "scaler" in tree:
        self.scaler.load_state_dict(tree["scaler"])
    for sd, obj in zip(tree["custom"], self._custom_objects):  # noqa: SLF001
        obj.load_state_dict(sd)
    if len(rngs) == self.num_processes:
        mine_rng = rngs[self.process_index]
        self.step = mine_rng["step"]
        _set_rng(mine_rng)
    return None


# ------------------------------------------------------------------------- FSDP / DeepSpeed fallback
def sharded_engine(acc: Accelerator) -> str | None:
    """The engine's name when ``acc`` saves through a sharded writer (FSDP, DeepSpeed, Megatron-LM)."""
    return str(acc.distributed_type) if acc.distributed_type in _SHARDED else None


def _warn_sharded(acc: Accelerator) -> None:
    kind = str(sharded_engine(acc))
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(
            f"s4w_accelerate: {kind} saves through its own sharded writer, which cannot be intercepted yet; "
            "Accelerate writes its checkpoint folder and s4weights stores a packed copy of it (the folder stays)",
            stacklevel=3,
        )


def _save_sharded(acc: Accelerator, output_dir: str | None, safe_serialization: bool, **kw: Any) -> Any:
    _warn_sharded(acc)
    location = os.fspath(_originals["save_state"](acc, output_dir, safe_serialization, **kw))
    acc.wait_for_everyone()
    if acc.is_main_process:
        st = store_for(location)
        tree = pack_folder(location)
        name = os.path.basename(os.path.normpath(location))
        extra = {"writer": WRITER, "folder": name, "files": sorted(tree["files"]), "packed": True}
        st.save(tree, _step_for(location, False, acc, st), extra=extra, overwrite=True)
    acc.wait_for_everyone()
    return location


def _load_sharded(acc: Accelerator, input_dir: str | None, load_kwargs: dict | None, **kw: Any) -> Any:
    _warn_sharded(acc)
    if input_dir is not None and (not os.path.isdir(input_dir) or not os.listdir(input_dir)):
        if acc.is_main_process:
            st, step, _ = _find_step(acc, input_dir)
            unpack_folder(st.load(step, "cpu"), input_dir)
        acc.wait_for_everyone()
    return _originals["load_state"](acc, input_dir, load_kwargs, **kw)


# ------------------------------------------------------------------------- switch
def enable(
    store: str | os.PathLike[str] | None = None,
    *,
    profile: str = "auto",
    store_options: dict[str, Any] | None = None,
    async_save: bool = False,
) -> None:
    """Make every ``Accelerator.save_state``/``load_state`` in this process use the store.

    Args:
        store: a local directory or ``s3://bucket/prefix``; default ``.s4w`` beside each
            checkpoint folder (``<project_dir>/.s4w`` with automatic checkpoint naming).
        profile, store_options: as for :class:`~s4w_core.store.CheckpointStore`.
        async_save: compress and write in the background (``CheckpointStore.save_async``):
            ``save_state`` returns once the state is copied; rotation waits until the save is
            durable (:func:`finish_pending`).
    Example:
        >>> import s4w_accelerate
        >>> s4w_accelerate.enable(profile="portable"); s4w_accelerate.enabled()
        True
        >>> s4w_accelerate.disable()
    """
    global _config
    if profile not in s4w_core.PROFILES:
        raise ValueError(f"profile must be one of {s4w_core.PROFILES}, got {profile!r}")
    finish_pending()
    _config = Config(None if store is None else os.fspath(store), profile, store_options, async_save)
    _stores.clear()
    if profile != "portable":  # the GPU codec compiled once training has started CUDA
        s4w_core.gpu.warm_up(when_cuda_used=True)
    if not _originals:
        _originals["save_state"] = Accelerator.save_state
        _originals["load_state"] = Accelerator.load_state
        Accelerator.save_state = functools.wraps(_originals["save_state"])(_save_state)  # type: ignore[method-assign]
        Accelerator.load_state = functools.wraps(_originals["load_state"])(_load_state)  # type: ignore[method-assign]


def disable() -> None:
    """Undo :func:`enable` (Accelerate's own save_state/load_state again), after finishing the
    background save in flight."""
    global _config
    try:
        finish_pending()
    finally:
        _config = None
    _stores.clear()
    if _originals:
        Accelerator.save_state = _originals.pop("save_state")  # type: ignore[method-assign]
        Accelerator.load_state = _originals.pop("load_state")  # type: ignore[method-assign]


def enable_from_env(environ: Any = os.environ) -> bool:
    """Enable from ``S4W_ACCELERATE*`` variables (what ``import s4w_accelerate`` does)."""
    v = (environ.get(ENV) or "").strip()
    if not v or v.lower() in ("0", "false", "no", "off"):
        return False
    store = None if v.lower() in ("1", "true", "yes", "on") else v
    enable(
        store,
        profile=(environ.get(f"{ENV}_PROFILE") or "auto").strip(),
        async_save=(environ.get(f"{ENV}_ASYNC") or "0").strip().lower() in ("1", "true", "yes", "on"),
    )
    return True

"""Replace ``Accelerator.save_state`` / ``load_state``: the state goes from memory into a store.

Switched on by ``S4W_ACCELERATE=1`` (or a store URL) in the environment plus ``import
s4w_accelerate``, or by :func:`enable`.  What is stored, the checkpoint folder (created empty and
rotated as Accelerate does; ``total_limit`` mirrored in the store), FSDP2 with sharded state dicts
(models and optimizers through the run-level DCP writer beside the store) and the fallback of the
other sharded engines (their folder stored packed): docs/INTEGRATIONS.md.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from typing import Any

import accelerate
from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
from accelerate.utils import DistributedType

from s4w_core import ConflictError, frameworks
from s4w_core import config as knobs
from s4w_core.filepack import unpack_folder
from s4w_core.framework_steps import (
    AdapterSteps,
    UnsupportedFrameworkError,
    check_states,
    load_sharded,
    load_states,
    patch_methods,
    prepare_profile,
    private_attrs,
    step_from_name,
    unpatch_methods,
    warn_fallback,
)
from s4w_core.frameworks import StateMismatchError
from s4w_core.store import CheckpointStore

__all__ = [
    "enable", "disable", "enabled", "enable_from_env", "config", "finish_pending", "store_for", "last_info",
    "registered", "sharded_engine", "StateMismatchError", "UnsupportedAccelerateError", "STORE_DIRNAME", "ENV",
    "WRITER",
]  # fmt: skip

ENV = "S4W_ACCELERATE"
STORE_DIRNAME = ".s4w"
WRITER = "s4w_accelerate"  #: ``extra["writer"]`` of the steps this adapter commits
_DIGITS = re.compile(r"(\d+)(?!.*\d)")
_NATIVE = ("model.safetensors", "pytorch_model.bin", "optimizer.bin")  # a folder Accelerate itself wrote
_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
_RNG_KEYS = {"python": "random_state", "numpy": "numpy_random_seed", "cpu": "torch_manual_seed",
             "cuda": "torch_cuda_manual_seed"}  # fmt: skip  # frameworks.rng_state -> Accelerate's names


@dataclass
class Config:
    """The active settings (see :func:`enable`)."""

    store: str | None = None
    profile: str = "auto"
    store_options: dict[str, Any] | None = None
    async_save: bool = False


UnsupportedAccelerateError = UnsupportedFrameworkError  #: an Accelerate without an attribute :func:`registered` reads
_config: Config | None = None
_originals: dict[str, Any] = {}
_steps = AdapterSteps(WRITER, profile="auto")
_warned: set[str] = set()
#: Accelerator attributes with no public getter (checked against accelerate 1.15.0; present since 0.x)
_PRIVATE = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects",
            "_save_model_state_pre_hook", "_load_model_state_pre_hook")  # fmt: skip


def last_info() -> Any:
    """The :class:`~s4w_core.store.StepInfo` of the last durable save (ratio, kind, bytes), or None."""
    return _steps.last_info


def config() -> Config | None:
    """The active configuration, or None when the hook is off."""
    return _config


def enabled() -> bool:
    return _config is not None


def finish_pending() -> None:
    """Wait for the background save (``async_save=True``) and mirror rotation; raises its error if
    it failed. ``save_state`` and ``load_state`` call it first; call it at the end of training."""
    _steps.finish()


def store_for(folder: str | os.PathLike[str]) -> CheckpointStore:
    """The store that holds the checkpoint folder ``folder``: ``<parent>/.s4w`` by default
    (``<project_dir>/.s4w`` with automatic naming, outside the folder ``total_limit`` counts)."""
    if _config is not None and _config.store:
        url = frameworks.store_url(_config.store)
    else:
        parent = os.path.dirname(os.path.abspath(os.fspath(folder)))
        if os.path.basename(parent) == "checkpoints":
            parent = os.path.dirname(parent)
        url = os.path.join(parent, STORE_DIRNAME)
    return _steps.store(url)


def registered(acc: Accelerator) -> dict[str, Any]:
    """What ``save_state``/``load_state`` work on, which Accelerate keeps only in private attributes
    (no public getter in accelerate 1.15.0, which this was checked against): ``models``,
    ``optimizers``, ``schedulers``, ``dataloaders``, ``custom_objects`` (lists) and the
    ``save_model_state_pre_hook`` / ``load_model_state_pre_hook`` dicts.

    Raises:
        UnsupportedAccelerateError: an attribute is gone (an Accelerate this adapter does not know).
    """
    return private_attrs(acc, _PRIVATE, "accelerate", accelerate.__version__, "1.15.0")


def _dataloader_states(dls: list[Any]) -> list[Any]:
    out: list[Any] = []
    for dl in dls:
        s: dict[str, Any] = {}
        sampler = dl.get_sampler() if isinstance(dl.dataset, IterableDatasetShard) else None
        if isinstance(sampler, SeedableRandomSampler):
            s["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
        if getattr(dl, "use_stateful_dataloader", False):
            s["state_dict"] = dl.state_dict()
        out.append(s)
    return out


def _folder_for(acc: Accelerator, output_dir: str | None) -> tuple[str, bool]:
    """The folder Accelerate would use and whether it is automatically named; created (empty),
    ``checkpoints/`` rotated as Accelerate does."""
    pc = acc.project_configuration
    if not pc.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs output_dir when automatic checkpoint naming is off")
        os.makedirs(output_dir, exist_ok=True)
        return os.fspath(output_dir), False
    base = os.path.join(acc.project_dir, "checkpoints")
    os.makedirs(base, exist_ok=True)
    folders = sorted((f for f in os.listdir(base) if _DIGITS.search(f)), key=lambda f: int(_DIGITS.findall(f)[-1]))
    if pc.total_limit is not None and len(folders) + 1 > pc.total_limit and acc.is_main_process:
        for f in folders[: len(folders) + 1 - pc.total_limit]:
            shutil.rmtree(os.path.join(base, f))
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
    return int(acc.save_iteration) if automatic else step_from_name(os.path.basename(os.path.normpath(folder)), st)


def _save_state(self: Accelerator, output_dir: str | None = None, safe_serialization: bool = True, **kw: Any) -> Any:
    if _config is None:
        return _originals["save_state"](self, output_dir, safe_serialization, **kw)
    dcp_route = _dcp_route(self)
    if sharded_engine(self) is not None and not dcp_route:
        return _save_packed(self, output_dir, safe_serialization, **kw)
    reg = registered(self)
    models, opts = reg["models"], reg["optimizers"]
    folder, automatic = _folder_for(self, None if output_dir is None else os.fspath(output_dir))
    if self.is_main_process:
        _steps.finish()
    st = store_for(folder)
    step = frameworks.broadcast_object(_step_for(folder, automatic, self, st) if self.is_main_process else None)
    if automatic and step in st.steps():  # every process checks: none is left waiting in a collective
        raise ConflictError(f"{st.url} already holds step {step} (another run?); Accelerate would refuse an existing "
                            f"{folder} too: set save_iteration, or use another project_dir or store")  # fmt: skip
    limit = self.project_configuration.total_limit if automatic else None  # total_limit mirrored
    extra: dict[str, Any] = {"folder": os.path.basename(os.path.normpath(folder)), "automatic": automatic,
                             "num_processes": self.num_processes}  # fmt: skip
    if dcp_route:  # FSDP2: every process writes its shards of the models and optimizers into the run
        extra["sharded"], models, opts = _steps.save_sharded(st, step, models, opts), [], []
    weights = [self.get_state_dict(m, unwrap=False) for m in models]
    for hook in reg["save_model_state_pre_hook"].values():  # as Accelerate calls them
        hook(reg["models"], weights, folder)
    rng = {_RNG_KEYS[k]: v for k, v in frameworks.rng_state().items()}
    rngs = frameworks.gather_object({"step": self.step, **rng})
    dl_states = frameworks.gather_object(_dataloader_states(reg["dataloaders"]))
    if self.is_main_process:
        tree: dict[str, Any] = {"models": weights, "dataloaders": dl_states, "rng": rngs}
        for key, objs in (("optimizers", opts), ("schedulers", reg["schedulers"]), ("custom", reg["custom_objects"])):
            tree[key] = [o.state_dict() for o in objs]
        if self.scaler is not None:
            tree["scaler"] = self.scaler.state_dict()
        extra["models"] = [frameworks.fingerprint(w) for w in weights]
        _steps.save(st, tree, step, extra, overwrite=not automatic, async_save=_config.async_save and not dcp_route,
                    then=functools.partial(_steps.retain, st, limit, automatic=True))  # fmt: skip
    if dcp_route and limit:  # the run's steps follow the store's retention, each process its own shards
        _steps.prune_sharded(st, extra["sharded"], self.process_index)
    self.project_configuration.iteration += 1
    self.wait_for_everyone()
    return folder


def _find_step(acc: Accelerator, input_dir: str | None) -> tuple[CheckpointStore, int, str]:
    """The store, step and folder name ``load_state(input_dir)`` loads."""
    if input_dir is None:
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        st = store_for(os.path.join(acc.project_dir, "checkpoints", "checkpoint_0"))
        info = _steps.find(st, "load_state()", automatic=True)
    else:
        st = store_for(input_dir)
        info = _steps.find(st, f"load_state({input_dir!r})", folder=os.path.basename(os.path.normpath(input_dir)))
    return st, info.step, info.extra["folder"]


def _load_state(self: Accelerator, input_dir: str | None = None, load_kwargs: dict | None = None, **kw: Any) -> Any:
    if _config is None:
        return _originals["load_state"](self, input_dir, load_kwargs, **kw)
    if sharded_engine(self) is not None and not _dcp_route(self):
        return _load_packed(self, input_dir, load_kwargs, **kw)
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if os.path.isdir(input_dir) and any(f.startswith(_NATIVE) for f in os.listdir(input_dir)):
            return _originals["load_state"](self, input_dir, load_kwargs, **kw)  # Accelerate's own folder
    if self.is_main_process:
        _steps.finish()
    self.wait_for_everyone()
    reg = registered(self)
    st, step, name = _find_step(self, input_dir)
    where = f"{st.url} step {step} ({name})"
    tree = st.load(step, frameworks.device_map("cpu" if kw.pop("map_location", None) == "cpu" else self.device))
    root, models = st.info(step).extra.get("sharded"), reg["models"]
    if (root is not None) != _dcp_route(self):
        raise StateMismatchError(f"{where} was saved {'with' if root else 'without'} FSDP2 sharded state dicts, and "
                                 f"this Accelerator {'does not use' if root else 'uses'} them")  # fmt: skip
    own = {"optimizers": reg["optimizers"], "schedulers": reg["schedulers"], "custom": reg["custom_objects"]}
    sharded = {"models": models, "optimizers": own.pop("optimizers")} if root is not None else {}
    models = [] if root is not None else models
    check_states(where, tree, {"models": models, **own})  # everything checked before anything changes
    if root is not None:  # models and optimizers from the run (DCP's load plan checks them first)
        load_sharded(root, step, sharded["models"], sharded["optimizers"], _steps.s3_options)
    rngs = tree["rng"]
    if len(rngs) != self.num_processes:
        warnings.warn(f"{where}: saved by {len(rngs)} processes, loaded by {self.num_processes}: RNG states not "
                      "restored", stacklevel=2)  # fmt: skip
    strict = kw.pop("strict", True)
    remaining = list(reg["models"])
    for hook in reg["load_model_state_pre_hook"].values():  # a hook may load some models itself
        hook(remaining, input_dir)
    for sd, m in zip(tree["models"], models):
        if any(m is r for r in remaining):
            m.load_state_dict(sd, strict=strict)
    load_states(tree, own)
    mine = tree["dataloaders"][self.process_index] if self.process_index < len(tree["dataloaders"]) else []
    for s, dl in zip(mine, reg["dataloaders"]):
        sampler = dl.get_sampler() if isinstance(dl.dataset, IterableDatasetShard) else None
        if "sampler" in s and isinstance(sampler, SeedableRandomSampler):
            sampler.epoch, sampler.initial_seed = s["sampler"]["epoch"], s["sampler"]["initial_seed"]
        if "state_dict" in s and getattr(dl, "use_stateful_dataloader", False):
            dl.load_state_dict(s["state_dict"])
    if self.scaler is not None and "scaler" in tree:
        self.scaler.load_state_dict(tree["scaler"])
    if len(rngs) == self.num_processes:
        r = rngs[self.process_index]
        self.step = r["step"]
        frameworks.set_rng_state({k: r[v] for k, v in _RNG_KEYS.items() if v in r})
    return None


# ------------------------------------------------------------------------- FSDP / DeepSpeed
def _dcp_route(acc: Accelerator) -> bool:
    """FSDP2 with sharded state dicts: models and optimizers go through the run-level DCP writer."""
    plugin = getattr(acc.state, "fsdp_plugin", None)
    return bool(acc.is_fsdp2 and "SHARDED" in str(getattr(plugin, "state_dict_type", "")))


def sharded_engine(acc: Accelerator) -> str | None:
    """The engine's name when ``acc`` saves through a sharded writer (FSDP, DeepSpeed, Megatron-LM)."""
    return str(acc.distributed_type) if acc.distributed_type in _SHARDED else None


def _save_packed(acc: Accelerator, output_dir: str | None, safe_serialization: bool, **kw: Any) -> Any:
    warn_fallback("s4w_accelerate", str(sharded_engine(acc)), "Accelerate", _warned)
    location = os.fspath(_originals["save_state"](acc, output_dir, safe_serialization, **kw))
    st, extra = store_for(location), {"folder": os.path.basename(os.path.normpath(location)), "packed": True}
    _steps.store_written_folder(location, acc.is_main_process,
                                lambda f: _steps.save_folder(st, f, _step_for(f, False, acc, st), extra))  # fmt: skip
    return location


def _load_packed(acc: Accelerator, input_dir: str | None, load_kwargs: dict | None, **kw: Any) -> Any:
    warn_fallback("s4w_accelerate", str(sharded_engine(acc)), "Accelerate", _warned)
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
    """
    global _config
    prepare_profile(profile)
    _steps.finish()
    _config = Config(None if store is None else os.fspath(store), profile, store_options, async_save)
    _steps.stores.defaults = {"profile": profile, **(store_options or {})}
    _steps.stores.clear()
    patch_methods(Accelerator, {"save_state": _save_state, "load_state": _load_state}, _originals)


def disable() -> None:
    """Undo :func:`enable` (after finishing the background save in flight)."""
    global _config
    try:
        _steps.finish()
    finally:
        _config = None
    _steps.stores.defaults = {"profile": "auto"}
    _steps.stores.clear()
    unpatch_methods(Accelerator, _originals)


def enable_from_env(environ: knobs.Environ | None = None) -> bool:
    """Enable from ``S4W_ACCELERATE*`` variables of ``environ`` (default ``os.environ``; what
    ``import s4w_accelerate`` does). A value that does not parse is a ConfigError naming it."""
    v = knobs.get_str("S4W_ACCELERATE", environ)
    if not v or v.lower() in ("0", "false", "no", "off"):
        return False
    enable(
        None if v.lower() in ("1", "true", "yes", "on") else v,
        profile=knobs.get_str("S4W_ACCELERATE_PROFILE", environ),
        async_save=knobs.get_bool("S4W_ACCELERATE_ASYNC", environ),
    )
    return True

"""Replace ``Accelerator.save_state`` / ``load_state``: the state goes from memory into a store.

Switched on by ``S4W_ACCELERATE=1`` (or a store URL) in the environment plus ``import
s4w_accelerate``, or by :func:`enable`.  What is stored, the checkpoint folder (created empty and
rotated as Accelerate does; ``total_limit`` mirrored in the store), FSDP2 with sharded state dicts
and the fallback of the other sharded engines (:mod:`s4w_accelerate._fsdp`): docs/INTEGRATIONS.md.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import warnings
from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

from s4w_accelerate._fsdp import (
    check_route,
    dcp_route,
    load_dcp,
    load_packed,
    prune_dcp,
    save_dcp,
    save_packed,
    sharded_engine,
)
from s4w_accelerate._settings import ACTIVE, Config, find_step, registered, step_for, store_for
from s4w_core import ConflictError, frameworks
from s4w_core import config as knobs
from s4w_core.framework_steps import check_states, load_states, patch_methods, prepare_profile, unpatch_methods

__all__ = ["enable", "disable", "enable_from_env"]

_DIGITS = re.compile(r"(\d+)(?!.*\d)")
_NATIVE = ("model.safetensors", "pytorch_model.bin", "optimizer.bin")  # a folder Accelerate itself wrote
_RNG_KEYS = {"python": "random_state", "numpy": "numpy_random_seed", "cpu": "torch_manual_seed",
             "cuda": "torch_cuda_manual_seed"}  # fmt: skip  # frameworks.rng_state -> Accelerate's names


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


def _folder_for(acc: Accelerator, output_dir: str | os.PathLike[str] | None) -> tuple[str, bool]:
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


def _save_state(self: Accelerator, output_dir: str | None = None, safe_serialization: bool = True, **kw: Any) -> Any:
    cfg = ACTIVE.config
    if cfg is None:
        return ACTIVE.originals["save_state"](self, output_dir, safe_serialization, **kw)
    dcp = dcp_route(self)
    engine = sharded_engine(self)
    if engine is not None and not dcp:
        return save_packed(self, engine, output_dir, safe_serialization, **kw)
    reg = registered(self)
    models, opts = reg["models"], reg["optimizers"]
    folder, automatic = _folder_for(self, output_dir)
    if self.is_main_process:
        ACTIVE.steps.finish()
    st = store_for(folder)
    step = frameworks.broadcast_object(step_for(folder, automatic, self, st) if self.is_main_process else None)
    if automatic and step in st.steps():  # every process checks: none is left waiting in a collective
        raise ConflictError(f"{st.url} already holds step {step} (another run?); Accelerate would refuse an existing "
                            f"{folder} too: set save_iteration, or use another project_dir or store")  # fmt: skip
    limit = self.project_configuration.total_limit if automatic else None  # total_limit mirrored
    extra: dict[str, Any] = {"folder": os.path.basename(os.path.normpath(folder)), "automatic": automatic,
                             "num_processes": self.num_processes}  # fmt: skip
    if dcp:  # FSDP2: every process writes its shards of the models and optimizers into the run
        extra["sharded"], models, opts = save_dcp(st, step, models, opts), [], []
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
        ACTIVE.steps.drop_rotated(st, step, limit, automatic=True)
        ACTIVE.steps.save(st, tree, step, extra, overwrite=not automatic, async_save=cfg.async_save and not dcp,
                          then=functools.partial(ACTIVE.steps.retain, st, limit, automatic=True))  # fmt: skip
    if dcp and limit:  # the run's steps follow the store's retention, each process its own shards
        prune_dcp(st, extra["sharded"], self)
    self.project_configuration.iteration += 1
    self.wait_for_everyone()
    return folder


def _load_state(self: Accelerator, input_dir: str | None = None, load_kwargs: dict | None = None, **kw: Any) -> Any:
    if ACTIVE.config is None:
        return ACTIVE.originals["load_state"](self, input_dir, load_kwargs, **kw)
    engine = sharded_engine(self)
    if engine is not None and not dcp_route(self):
        return load_packed(self, engine, input_dir, load_kwargs, **kw)
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if os.path.isdir(input_dir) and any(f.startswith(_NATIVE) for f in os.listdir(input_dir)):
            return ACTIVE.originals["load_state"](self, input_dir, load_kwargs, **kw)  # Accelerate's own folder
    if self.is_main_process:
        ACTIVE.steps.finish()
    self.wait_for_everyone()
    reg = registered(self)
    st, step, name = find_step(self, input_dir)
    where = f"{st.url} step {step} ({name})"
    tree = st.load(step, frameworks.device_map("cpu" if kw.pop("map_location", None) == "cpu" else self.device))
    root, models = st.info(step).extra.get("sharded"), reg["models"]
    check_route(self, where, root)
    own = {"optimizers": reg["optimizers"], "schedulers": reg["schedulers"], "custom": reg["custom_objects"]}
    if root is not None:  # models and optimizers from the run (DCP's load plan checks them)
        models, run_optimizers = [], own.pop("optimizers")
    check_states(where, tree, {"models": models, **own})  # everything checked before anything changes
    if root is not None:
        load_dcp(root, step, reg["models"], run_optimizers)
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
            durable (:func:`~s4w_accelerate.finish_pending`).
    """
    prepare_profile(profile)
    ACTIVE.steps.finish()
    ACTIVE.config = Config(None if store is None else os.fspath(store), profile, store_options, async_save)
    ACTIVE.steps.stores.defaults = {"profile": profile, **(store_options or {})}
    ACTIVE.steps.stores.clear()
    patch_methods(Accelerator, {"save_state": _save_state, "load_state": _load_state}, ACTIVE.originals)


def disable() -> None:
    """Undo :func:`enable` (after finishing the background save in flight)."""
    try:
        ACTIVE.steps.finish()
    finally:
        ACTIVE.config = None
    ACTIVE.steps.stores.defaults = {"profile": "auto"}
    ACTIVE.steps.stores.clear()
    unpatch_methods(Accelerator, ACTIVE.originals)


def enable_from_env(environ: knobs.Environ | None = None) -> bool:
    """Enable from ``S4W_ACCELERATE*`` variables of ``environ`` (default ``os.environ``; what
    ``import s4w_accelerate`` does). A value that does not parse is a ConfigError naming it."""
    v = knobs.get_str("S4W_ACCELERATE", environ)
    if not v or v.lower() in ("0", "false", "no", "off"):
        return False
    enable(
        None if v.lower() in ("1", "true", "yes", "on") else v,
        profile=knobs.get_str("S4W_ACCELERATE_PROFILE", environ),
        store_options=None if knobs.get_bool("S4W_ACCELERATE_DURABLE", environ) else {"durable": False},
        async_save=knobs.get_bool("S4W_ACCELERATE_ASYNC", environ),
    )
    return True

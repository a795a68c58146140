"""``S4Callback``: the HF Trainer's checkpoints go from memory into a store; no checkpoint folder.

What is saved, when (the save runs at the event after the Trainer's save point, with the RNG states
and log length of the last event before it), what of the Trainer's save still happens, FSDP2 (every
rank's shards of the model and optimizer through the run-level DCP writer beside the store) and the
FSDP1/DeepSpeed fallback (the folder the Trainer wrote, stored packed): docs/INTEGRATIONS.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from s4w_core import CheckpointNotFoundError, S4WError, frameworks
from s4w_core.framework_steps import (
    AdapterSteps,
    caller_instance,
    load_sharded,
    prepare_profile,
    private_attrs,
    sharded_root,
    temp_folders_pending,
    warn_fallback,
    warn_once,
)
from s4w_core.frameworks import StateMismatchError, barrier
from s4w_core.store import CheckpointStore
from s4w_transformers._restore import WRITER, cleanup_restored, read_pointer, restore_parts
from s4w_transformers._state import Pending, dcp_route, new_best, sharded_engine, step_extra, step_tree, take

__all__ = ["S4Callback", "UnsupportedSetupError", "STORE_DIRNAME"]

STORE_DIRNAME = ".s4w"  #: the store folder in ``output_dir`` when no ``store=`` is given
_CHECKED = "transformers 5.24.0"  # the version whose Trainer._load_from_checkpoint the FSDP2 resume wraps


class UnsupportedSetupError(S4WError, ValueError):
    """A Trainer setting the callback cannot honour (``push_to_hub``)."""


_CALLBACK_ATTR = "_s4w_callback"  # on a Trainer attach() bound: its S4Callback
_HOOKED: dict[type, type] = {}  # a Trainer class -> its subclass with the store hooks


def store_hooks(cls: type[Trainer]) -> type[Trainer]:
    """The subclass of ``cls`` (made once per class; same name, module and docs) whose ``train`` and
    ``_load_from_checkpoint`` go through the :class:`S4Callback` the instance holds, if any.

    Methods of the class, not closures stored on the instance: a bound method keeps its Trainer
    alive for the call (``make_trainer().train()``), and nothing makes a reference cycle."""
    if getattr(cls, "s4w_store_hooks", False):
        return cls
    hooked = _HOOKED.get(cls)
    if hooked is not None:
        return hooked
    own_train = cls.train

    @functools.wraps(own_train)
    def train(self: Trainer, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        cb = self.__dict__.get(_CALLBACK_ATTR)
        if not isinstance(cb, S4Callback):
            return own_train(self, resume_from_checkpoint, *args, **kwargs)
        return cb._train(self, own_train, resume_from_checkpoint, args, kwargs)

    ns: dict[str, Any] = {"train": train, "s4w_store_hooks": True, "__module__": cls.__module__,
                          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}  # fmt: skip
    own_load = getattr(cls, "_load_from_checkpoint", None)
    if own_load is not None:

        @functools.wraps(own_load)
        def load_from_checkpoint(self: Trainer, resume_from_checkpoint: str, model: Any = None) -> Any:
            cb = self.__dict__.get(_CALLBACK_ATTR)
            if not isinstance(cb, S4Callback):
                return own_load(self, resume_from_checkpoint, model)
            return cb._load(self, own_load, resume_from_checkpoint, model)

        ns["_load_from_checkpoint"] = load_from_checkpoint
    hooked = _HOOKED[cls] = type(cls.__name__, (cls,), ns)
    return hooked


class S4Callback(TrainerCallback):
    """Save each HF Trainer checkpoint from memory into a store (local or S3); no checkpoint folder.

    ``Trainer(..., callbacks=[S4Callback()])``, or ``S4Callback().attach(trainer)``; list it after
    callbacks that set ``control.should_save``.

    Under FSDP2 every rank's shards of the model and optimizer go into the run-level DCP root
    beside the store (``<store>_dcp``), the rest into the store step; resume loads them where the
    Trainer loads its FSDP checkpoint (docs/INTEGRATIONS.md).

    Args:
        store: a local directory or ``s3://bucket/prefix``; default ``<output_dir>/.s4w``.
        profile: s4weights profile (``"auto"``, ``"portable"``, ``"fast"``).
        async_save: compress and write in the background (:meth:`CheckpointStore.save_async`);
            rotation of that step waits until it is durable (the next save, or the end of training).
        overwrite: let a run from step 0 write into a store that already holds steps.
        store_options: more :class:`~s4w_core.store.CheckpointStore` arguments (``endpoint``...).
    Raises:
        UnsupportedSetupError: ``push_to_hub=True`` (there is no folder to push).
        ConflictError: a run from step 0 meets a store holding steps (another run's).
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | None = None,
        *,
        profile: str = "auto",
        async_save: bool = False,
        overwrite: bool = False,
        store_options: dict[str, Any] | None = None,
    ) -> None:
        prepare_profile(profile)
        self.store_url = None if store is None else os.fspath(store)
        self.profile, self.async_save, self.overwrite = profile, async_save, overwrite
        self.store_options = dict(store_options or {})
        self._steps = AdapterSteps(WRITER, **{"profile": profile, **self.store_options})
        self._trainer: weakref.ref[Trainer] | None = None  # weak: the Trainer holds this callback
        self._pending: Pending | None = None
        self._held: dict[str, Any] = {}  # optimizer / scheduler states of the step being resumed
        self._fallback = self._sharded = self._firing = False
        self._warned: set[str] = set()
        self.best_step: int | None = None  #: the store step ``load_best_model_at_end`` loaded, if any

    @property
    def last_info(self) -> Any:
        """The :class:`~s4w_core.store.StepInfo` of the last durable save (ratio, kind, bytes)."""
        return self._steps.last_info

    def url(self, args: Any) -> str:
        """The store URL for ``args`` (a TrainingArguments)."""
        return frameworks.store_url(self.store_url or os.path.join(args.output_dir, STORE_DIRNAME))

    def store(self, args: Any) -> CheckpointStore:
        """The :class:`CheckpointStore` this callback writes for ``args``."""
        return self._steps.store(self.url(args))

    def attach(self, trainer: Trainer) -> Trainer:
        """Bind this callback to ``trainer`` (added to its callbacks if it is not there yet) and make
        ``trainer.train(resume_from_checkpoint=True)`` resume from the store; returns ``trainer``.

        ``trainer``'s class becomes a subclass of it (one per Trainer class, same name) whose
        ``train`` (and, under FSDP2, ``_load_from_checkpoint``) reads this callback from the
        instance; the callback holds the Trainer weakly, so a dropped Trainer is freed at once."""
        if trainer is self._bound_or_none():
            return trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        if dcp_route(trainer):  # FSDP2 resume loads the shards where the Trainer loads its checkpoint
            private_attrs(trainer, ("_load_from_checkpoint",), "transformers", transformers.__version__, _CHECKED)
        self._trainer = weakref.ref(trainer)
        setattr(trainer, _CALLBACK_ATTR, self)
        trainer.__class__ = store_hooks(type(trainer))
        return trainer

    def _train(self, trainer: Trainer, train: Callable[..., Any], resume: Any, args: Any, kwargs: Any) -> Any:
        """``trainer.train(resume, *args, **kwargs)`` through ``train`` (the Trainer class's own), with
        ``resume_from_checkpoint=True`` or the store's URL restored from the store."""
        try:
            resume = self._resolve_resume(trainer, resume)
            if isinstance(resume, (str, os.PathLike)) and not dcp_route(trainer) and read_pointer(resume):
                raise StateMismatchError(f"{os.fspath(resume)} holds a step saved under FSDP2 (the model's shards "
                                         "in the run), and this Trainer does not use FSDP2: resume with "
                                         "fsdp_config={'fsdp_version': 2}")  # fmt: skip
            return train(trainer, resume, *args, **kwargs)
        finally:
            self._held = {}
            cleanup_restored()

    def _bind(self) -> None:
        trainer = caller_instance(Trainer)  # the Trainer whose __init__ or train fires this event
        if trainer is not None:
            self.attach(trainer)
        elif self._bound_or_none() is None:
            raise UnsupportedSetupError(
                "S4Callback found no transformers.Trainer firing its events: pass it in Trainer(callbacks=[...]) "
                "or bind it with S4Callback().attach(trainer)"
            )

    def _bound_or_none(self) -> Trainer | None:
        return None if self._trainer is None else self._trainer()

    def _bound(self) -> Trainer:
        """The Trainer bound at ``on_init_end`` / ``on_train_begin`` (either raises when there is none;
        the Trainer firing an event is alive)."""
        trainer = self._bound_or_none()
        assert trainer is not None
        return trainer

    def _load(self, trainer: Trainer, load: Callable[..., Any], resume_from_checkpoint: str, model: Any) -> Any:
        """FSDP2: the Trainer loads a checkpoint's weights in ``_load_from_checkpoint`` (after
        ``prepare``, on every rank; ``load`` is the Trainer class's own); for a folder restored from a
        sharded step, the shards are loaded from the run there instead."""
        pointer = read_pointer(resume_from_checkpoint) if dcp_route(trainer) else None
        if pointer is None:  # a folder with the model's files: the Trainer's own load
            return load(trainer, resume_from_checkpoint, model)
        self._load_sharded(trainer, resume_from_checkpoint, pointer, model)
        return None

    def _load_sharded(self, trainer: Trainer, folder: str, pointer: dict[str, Any], model: Any) -> None:
        """Every rank: the model's and optimizer's shards of a restored FSDP2 step from the run, and the
        LR scheduler (which the Trainer loads only beside an optimizer file)."""
        model = trainer.model_wrapped if model is None else model
        optimizers = [trainer.optimizer] if pointer["optimizer"] else []
        load_sharded(pointer["root"], pointer["step"], [model], optimizers, self._steps.s3_options)
        scheduler = os.path.join(folder, "scheduler.pt")
        if optimizers and trainer.lr_scheduler is not None and os.path.isfile(scheduler):
            trainer.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))

    def _resolve_resume(self, trainer: Trainer, resume: Any) -> Any:
        """``True`` (with no checkpoint folder in ``output_dir``) or the store's URL: the newest step,
        restored into a temporary folder."""
        args, url = trainer.args, self.url(trainer.args)
        if resume is True and get_last_checkpoint(args.output_dir) is not None:
            return resume  # a folder the Trainer wrote itself: its own route
        if resume is True or (isinstance(resume, (str, os.PathLike)) and os.fspath(resume) in (url, self.store_url)):
            if self.store(args).latest() is None:
                raise CheckpointNotFoundError(f"resume_from_checkpoint=True: no checkpoint folder in "
                                              f"{args.output_dir} and no committed step in the store {url}")  # fmt: skip
            # one process: optimizer and scheduler go from the store into the Trainer's objects at
            # on_train_begin (the Trainer loads neither when the folder has no optimizer.pt), not
            # through files written and read back
            held = ("optimizer", "scheduler") if frameworks.dist() is None else ()
            path, self._held = restore_parts(url, None, None, trainer.model, held, self.store_options)
            return path
        return resume

    # ---------------------------------------------------------------- events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._bind()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._bind()
        self._pending = None
        held, self._held = self._held, {}
        if "optimizer" in held:  # the resumed step's, where the Trainer's own resume would load them
            kwargs["optimizer"].load_state_dict(held["optimizer"])
            kwargs["lr_scheduler"].load_state_dict(held["scheduler"])
        if state.is_world_process_zero:
            self._steps.finish()  # a save of an earlier train() with this callback
        if getattr(args, "push_to_hub", False):
            raise UnsupportedSetupError(
                "S4Callback stores checkpoints in a store, not in folders the Trainer could push: set "
                "push_to_hub=False (push the final model with trainer.push_to_hub() after training)"
            )
        engine = sharded_engine(self._bound())
        self._fallback, self._sharded = engine is not None, dcp_route(self._bound())
        if engine is not None:
            warn_fallback("S4Callback", engine, "the Trainer")
        elif state.is_world_process_zero and state.global_step == 0 and not self.overwrite:
            self._steps.check_fresh(self.store(args), "resume with trainer.train(resume_from_checkpoint=True), or use "
                                    "another store or output_dir, or S4Callback(overwrite=True)")  # fmt: skip

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)

    on_substep_end = on_epoch_begin = on_step_begin

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)
        if temp_folders_pending() and state.is_world_process_zero:
            cleanup_restored()  # the resumed run has read its restored folder (RNG states last)
        self._intercept(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)
        self._intercept(args, state, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self._pending is not None and not (logs and "train_runtime" in logs):  # the end summary comes after
            self._pending.log_len = len(state.log_history)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        if self._fallback:
            return
        if args.save_strategy == "best" and metrics is not None and new_best(args, state, metrics):
            self._pending = take(args, state, control, state.global_step)
        if self._pending is not None:  # evaluation may draw random numbers: the save point is after it
            self._pending = take(args, state, control, self._pending.step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._firing:
            return
        if self._fallback:
            self._store_folder(args, state)
            return
        warn_once(self._warned, "order", f"S4Callback: a callback listed after it set control.should_save at "
                  f"step {state.global_step}, so the Trainer wrote its own checkpoint folder; list S4Callback last. "
                  "The step is stored too.")  # fmt: skip
        self._pending = take(args, state, control, state.global_step, as_saved=False)
        self._flush(args, state, control, kwargs, fire=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)
        if state.is_world_process_zero:
            self._steps.wait()
        barrier()
        if self._fallback:
            return
        st, best = self.store(args), state.best_global_step
        if args.load_best_model_at_end and best is not None and best in st.steps():
            model: Any = self._bound().model
            root = st.info(best).extra.get("sharded")
            if root is not None:  # every rank its shards
                load_sharded(root, best, [model], [], self._steps.s3_options)
            else:
                self._steps.load_model(st, best, model, args.device)
            self.best_step = best
        if best is not None and args.save_total_limit == 1:
            if state.is_world_process_zero:
                for s in (i.step for i in self._steps.own(st) if i.step != best):  # as the Trainer's last-folder delete
                    st.delete(s)
            if self._sharded:
                self._steps.prune_sharded(st, sharded_root(st.url), args.process_index)
        if state.is_world_process_zero:
            cleanup_restored()

    # ---------------------------------------------------------------- saving
    def _intercept(self, args: Any, state: Any, control: Any) -> None:
        if self._fallback or not control.should_save:
            return
        control.should_save = False  # the Trainer writes no folder
        if self._bound().hp_search_backend is None:
            self._bound().store_flos()  # what the Trainer's save does first (total_flos into the state)
        self._pending = take(args, state, control, state.global_step)

    def _flush(self, args: Any, state: Any, control: Any, kw: dict[str, Any], *, fire: bool = True) -> None:
        """Take the pending save (every rank: RNG states gathered, rank 0 writes)."""
        p, self._pending = self._pending, None
        if p is None:
            return
        rngs = [p.rng] if args.save_only_model else frameworks.gather_object(p.rng)
        sharded: dict[str, Any] | None = None
        st = self.store(args)
        if state.is_world_process_zero:
            self._steps.finish()
        if self._sharded:  # FSDP2: every rank its shards of the model and optimizer, as step p.step of the run
            optimizers = [] if args.save_only_model else [kw["optimizer"]]
            root = self._steps.save_sharded(st, p.step, [self._bound().model], optimizers)
            sharded = {"root": root, "step": p.step, "optimizer": bool(optimizers)}
        if state.is_world_process_zero:
            tree = step_tree(self._bound(), args, state, kw, p, rngs, sharded)
            self._steps.drop_rotated(st, p.step, args.save_total_limit, state.best_global_step)
            self._steps.save(st, tree, p.step, step_extra(args, p, tree), async_save=self.async_save and not sharded,
                             then=functools.partial(self._rotate, args, state))  # fmt: skip
        barrier()  # the other ranks wait for the save, as at the Trainer's own
        if sharded is not None and args.save_total_limit:  # the run follows the store's retention
            self._steps.prune_sharded(st, sharded["root"], args.process_index)
        if fire:
            self._firing = True
            try:
                new = self._bound().callback_handler.on_save(args, state, control)
            finally:
                self._firing = False
            if new is not None and new is not control:
                for f in dataclasses.fields(control):
                    setattr(control, f.name, getattr(new, f.name))

    def finish_pending(self) -> None:
        """Wait for the background save (``async_save=True``) and mirror rotation; raises its error."""
        self._steps.finish()

    def _rotate(self, args: Any, state: Any) -> None:
        """Mirror ``save_total_limit`` (the newest and the best step kept)."""
        self._steps.retain(self.store(args), args.save_total_limit, state.best_global_step)

    def _store_folder(self, args: Any, state: Any) -> None:
        """FSDP / DeepSpeed: store the folder the Trainer wrote, packed."""

        def save(folder: str) -> None:
            extra = {"format": 1, "world_size": int(args.world_size or 1)}
            self._steps.save_folder(self.store(args), folder, state.global_step, extra,
                                    functools.partial(self._rotate, args, state))  # fmt: skip

        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self._steps.store_written_folder(folder, state.is_world_process_zero, save)

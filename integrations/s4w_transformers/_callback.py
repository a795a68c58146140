"""``S4Callback``: the HF Trainer's checkpoints go from memory into a store; no checkpoint folder.

When the Trainer decides to save (``control.should_save``, from ``save_steps``, the epoch, the end
of training, or ``save_strategy="best"``), the callback clears that flag, so the Trainer writes no
``checkpoint-N`` folder, and saves instead, from memory, one step ``global_step`` of a
:class:`~s4w_core.store.CheckpointStore`: model weights, optimizer, LR scheduler, gradient scaler,
every rank's RNG states and ``trainer_state.json``'s text.  It then does what the Trainer's save
would have done: the ``ExportableState`` callbacks' states go into the trainer state, ``on_save``
fires for the other callbacks, ``save_total_limit`` rotation is mirrored in the store (the best
step kept, as the Trainer keeps the best folder) and, with ``load_best_model_at_end``, the best
step's weights are loaded at the end of training.

The Trainer's save point lies after that step's logging and evaluation, and no callback event fires
there, so the save runs at the next event (the next step's ``on_step_begin``, ``on_epoch_end`` or
``on_train_end``): weights, optimizer, scheduler and trainer state do not change in between; the
RNG states, which fetching the next batch may advance, and the log length are taken at the last
event before the save point.

Resume: :func:`restore_checkpoint` writes the files ``trainer.train(resume_from_checkpoint=...)``
reads into a temporary folder, removed once training has read it (or at exit); with the callback
attached, ``trainer.train(resume_from_checkpoint=True)`` does that by itself.

FSDP and DeepSpeed save through their own sharded writers: there the callback warns once and falls
back to storing the folder the Trainer wrote (:func:`s4w_core.filepack.pack_folder`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import random
import shutil
import tempfile
import warnings
from typing import Any

import numpy as np
import safetensors.torch
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import get_last_checkpoint
from transformers.training_args import ParallelMode

import s4w_core
from s4w_core import CheckpointNotFoundError, ConflictError, S4WError
from s4w_core.filepack import pack_folder, unpack_folder
from s4w_core.store import CheckpointStore

__all__ = [
    "S4Callback",
    "restore_checkpoint",
    "cleanup_restored",
    "sharded_engine",
    "StateMismatchError",
    "UnsupportedSetupError",
    "STORE_DIRNAME",
    "WRITER",
]

log = logging.getLogger("s4w_transformers")

#: the store folder created in ``output_dir`` when no ``store=`` is given.
STORE_DIRNAME = ".s4w"
#: ``extra["writer"]`` of the steps this adapter commits.
WRITER = "s4w_transformers"
_FORMAT = 2  # 2: the in-memory state tree; 1 (or "files" in extra): a packed checkpoint folder

#: temporary folders :func:`restore_checkpoint` made; removed once read, or at exit
_RESTORED: set[str] = set()


class StateMismatchError(S4WError, ValueError):
    """A stored step does not fit this run: written by another writer, or other model shapes."""


class UnsupportedSetupError(S4WError, ValueError):
    """A Trainer setting the callback cannot honour (``push_to_hub``)."""


def cleanup_restored() -> None:
    """Remove the temporary folders :func:`restore_checkpoint` made in this process."""
    while _RESTORED:
        path = _RESTORED.pop()
        shutil.rmtree(path, ignore_errors=True)


atexit.register(cleanup_restored)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    d = _dist()
    if d is not None:
        d.barrier()


def _fingerprint(sd: dict[str, Any]) -> str:
    """A hash of the model's keys, shapes and dtypes (a store from another model differs)."""
    h = hashlib.sha256()
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            h.update(f"{k}:{tuple(v.shape)}:{v.dtype};".encode())
    return h.hexdigest()[:16]


def _check_model(where: str, stored: dict[str, Any], model: torch.nn.Module) -> None:
    """Raise :class:`StateMismatchError` naming the first key whose shape or dtype differs."""
    own = model.state_dict()
    for k, v in stored.items():
        if k not in own:
            raise StateMismatchError(f"{where}: key {k!r} is stored but this model has no such key (another model?)")
        o = own[k]
        if isinstance(v, torch.Tensor) and (tuple(v.shape) != tuple(o.shape) or v.dtype != o.dtype):
            raise StateMismatchError(
                f"{where}: key {k!r} is {tuple(v.shape)} {v.dtype} in the store but {tuple(o.shape)} {o.dtype} "
                "in this model"
            )
    missing = [k for k in own if k not in stored]
    if missing:
        raise StateMismatchError(f"{where}: key {missing[0]!r} of this model is not in the store (another model?)")


def _rng_state(distributed: bool) -> dict[str, Any]:
    """What the Trainer's ``_save_rng_state`` records (python, numpy, cpu, cuda)."""
    st: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return st


def _rotate(steps: list[int], limit: int | None, best: int | None) -> list[int]:
    """The steps ``transformers.trainer_utils.rotate_checkpoints`` would delete: the newest and the
    best are protected, the oldest others go until ``limit`` remain."""
    if not limit or limit <= 0 or len(steps) <= limit:
        return []
    protected = {steps[-1]} | ({best} if best in steps else set())
    keep = max(limit, len(protected))
    doomed, remaining = [], len(steps)
    for s in steps:
        if remaining <= keep:
            break
        if s not in protected:
            doomed.append(s)
            remaining -= 1
    return doomed


def sharded_engine(trainer: Any) -> str | None:
    """``"FSDP"`` or ``"DeepSpeed"`` when ``trainer`` saves through that engine's sharded writer."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed"
    return None


@dataclasses.dataclass
class _Pending:
    """A save the Trainer asked for, taken at the next event (see the module docstring)."""

    step: int
    rng: dict[str, Any]
    log_len: int
    control_state: dict[str, Any]


class S4Callback(TrainerCallback):
    """Save each HF Trainer checkpoint from memory into a store (local or S3); no checkpoint folder.

    ``Trainer(..., callbacks=[S4Callback()])`` is the one-line change; list it after callbacks that
    set ``control.should_save`` (a save they request after it is written by the Trainer as a folder,
    with a warning).

    Args:
        store: a local directory or ``s3://bucket/prefix``; default ``<output_dir>/.s4w``.
        profile: s4weights profile (``"auto"``, ``"portable"``, ``"fast"``).
        async_save: compress and write in the background (:meth:`CheckpointStore.save_async`):
            training goes on once the state is copied; rotation of that step waits until it is
            durable (the next save, or the end of training, which raise its error if it failed).
        overwrite: let a run that starts from step 0 write into a store that already holds steps
            (default: :class:`~s4w_core.ConflictError`, nothing overwritten).
        store_options: more :class:`~s4w_core.store.CheckpointStore` arguments (``endpoint``...).
    Raises:
        UnsupportedSetupError: ``push_to_hub=True`` (there is no folder to push).
        ConflictError: a run from step 0 meets a store holding steps (another run's).
    Example:
        >>> from s4w_transformers import S4Callback
        >>> S4Callback("s3://bucket/run", async_save=True).async_save
        True
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
        if profile not in s4w_core.PROFILES:
            raise ValueError(f"profile must be one of {s4w_core.PROFILES}, got {profile!r}")
        self.store_url = None if store is None else os.fspath(store)
        self.profile = profile
        if profile != "portable":  # compile the GPU codec's kernels before the first save, once CUDA is up
            s4w_core.gpu.warm_up(when_cuda_used=True)
        self.async_save = async_save
        self.overwrite = overwrite
        self.store_options = dict(store_options or {})
        self._store: CheckpointStore | None = None
        self._trainer: Trainer | None = None
        self._pending: _Pending | None = None
        self._inflight: tuple[Any, Any, Any] | None = None  # (handle, args, state) of a save_async
        self._fallback = False
        self._firing = False
        self._warned_order = False
        #: the :class:`~s4w_core.store.StepInfo` of the last durable save (ratio, kind, bytes).
        self.last_info: Any = None
        #: the store step whose weights ``load_best_model_at_end`` loaded, if any.
        self.best_step: int | None = None

    # ---------------------------------------------------------------- store and trainer
    def url(self, args: Any) -> str:
        """The store URL for ``args`` (a TrainingArguments)."""
        if self.store_url is not None:
            return self.store_url if self.store_url.startswith("s3://") else os.path.abspath(self.store_url)
        return os.path.join(os.path.abspath(args.output_dir), STORE_DIRNAME)

    def store(self, args: Any) -> CheckpointStore:
        """The :class:`CheckpointStore` this callback writes for ``args``."""
        url = self.url(args)
        if self._store is None or self._store.url != url:
            self._store = CheckpointStore(url, **{"profile": self.profile, **self.store_options})
        return self._store

    def _bind(self) -> None:
        """Find the Trainer calling this event (callbacks are not handed it) and wrap its ``train``
        so that ``resume_from_checkpoint=True`` resumes from the store."""
        frame = inspect.currentframe()
        while frame is not None and not isinstance(frame.f_locals.get("self"), Trainer):
            frame = frame.f_back
        if frame is None:
            if self._trainer is None:
                raise UnsupportedSetupError("S4Callback must be one of a transformers.Trainer's callbacks")
            return
        trainer = frame.f_locals["self"]
        del frame
        if trainer is self._trainer:
            return
        self._trainer = trainer  # the callback may be handed to another Trainer later
        train = trainer.train

        @functools.wraps(train)
        def train_from_store(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            path = self._resolve_resume(trainer, resume_from_checkpoint)
            try:
                return train(path, *args, **kwargs)
            finally:
                cleanup_restored()

        trainer.train = train_from_store  # type: ignore[method-assign]

    def _resolve_resume(self, trainer: Trainer, resume: Any) -> Any:
        """``True`` (with no checkpoint folder in ``output_dir``) or the store's URL: the newest
        step, restored into a temporary folder."""
        args = trainer.args
        url = self.url(args)
        if resume is True and get_last_checkpoint(args.output_dir) is not None:
            return resume  # a folder the Trainer wrote itself: its own route
        if resume is True or (isinstance(resume, (str, os.PathLike)) and os.fspath(resume) in (url, self.store_url)):
            st = self.store(args)
            if st.latest() is None:
                raise CheckpointNotFoundError(
                    f"resume_from_checkpoint=True: no checkpoint folder in {args.output_dir} and no committed step "
                    f"in the store {url}"
                )
            return restore_checkpoint(url, model=trainer.model, **self.store_options)
        return resume

    # ---------------------------------------------------------------- events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._bind()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._bind()
        self._pending = None
        if state.is_world_process_zero:
            self.finish_pending()  # a save of an earlier train() with this callback
        if getattr(args, "push_to_hub", False):
            raise UnsupportedSetupError(
                "S4Callback stores checkpoints in a store, not in folders the Trainer could push: set "
                "push_to_hub=False (push the final model with trainer.push_to_hub() after training)"
            )
        engine = sharded_engine(self._trainer)
        self._fallback = engine is not None
        if engine is not None:
            warnings.warn(
                f"S4Callback: {engine} saves through its own sharded writer, which a callback cannot intercept "
                "yet; the Trainer writes its checkpoint folders and S4Callback stores a packed copy of each (no "
                "in-memory save, the folders stay)",
                stacklevel=2,
            )
            return
        if state.is_world_process_zero and state.global_step == 0 and not self.overwrite:
            st = self.store(args)
            steps = st.steps()
            if steps:
                raise ConflictError(
                    f"{st.url} already holds steps {steps[-5:]} (another run?) and this run starts at step 0; "
                    "resume with trainer.train(resume_from_checkpoint=True), or use another store or output_dir, "
                    "or S4Callback(overwrite=True)"
                )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)
        if _RESTORED and state.is_world_process_zero:
            cleanup_restored()  # the resumed run has read its restored folder (RNG states last)
        self._intercept(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)
        self._intercept(args, state, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        p = self._pending
        if p is not None and not (logs and "train_runtime" in logs):  # the end-of-training summary comes after
            p.log_len = len(state.log_history)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        if self._fallback:
            return
        if args.save_strategy == "best" and metrics is not None:
            self._best_strategy(args, state, control, metrics)
        p = self._pending
        if p is not None:  # evaluation may draw random numbers: the save point is after it
            p.rng = _rng_state(self._distributed(args))
            p.log_len = len(state.log_history)
            p.control_state = self._control_state(control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._firing:
            return
        if self._fallback:
            self._store_folder(args, state)
            return
        # the Trainer wrote checkpoint-N itself: a callback listed after this one asked for the save
        if not self._warned_order:
            warnings.warn(
                f"S4Callback: a callback listed after it set control.should_save at step {state.global_step}, so the "
                "Trainer wrote its own checkpoint folder; list S4Callback last. The step is stored too.",
                stacklevel=2,
            )
            self._warned_order = True
        self._pending = _Pending(
            state.global_step, _rng_state(self._distributed(args)), len(state.log_history), control.state()
        )
        self._flush(args, state, control, kwargs, fire=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)
        if state.is_world_process_zero:
            self.finish_pending()
            if self._store is not None:
                self._store.wait()
        _barrier()
        if self._fallback:
            return
        st = self.store(args)
        best = state.best_global_step
        if args.load_best_model_at_end and best is not None and best in st.steps():
            dev = str(args.device)
            tree = st.load(best, lambda orig: "cpu" if torch.device(orig).type == "cpu" else dev)
            model: Any = self._trainer.model if self._trainer is not None else kwargs["model"]
            _check_model(f"{st.url} step {best}", tree["model"], model)
            log.info("s4weights: loading the best model from %s step %d (score: %s)", st.url, best, state.best_metric)
            model.load_state_dict(tree["model"], False)
            self.best_step = best
        if state.is_world_process_zero and best is not None and args.save_total_limit == 1:
            for s in st.steps():  # the Trainer deletes the last folder if it is not the best
                if s != best and s in self._own_steps(st):
                    st.delete(s)
        if state.is_world_process_zero:
            cleanup_restored()

    # ---------------------------------------------------------------- saving
    @staticmethod
    def _distributed(args: Any) -> bool:
        return bool(args.parallel_mode == ParallelMode.DISTRIBUTED)

    @staticmethod
    def _control_state(control: Any) -> dict[str, Any]:
        cs = control.state()
        cs["args"]["should_save"] = True  # as the Trainer records it in its own save
        return cs

    def _intercept(self, args: Any, state: Any, control: Any) -> None:
        if self._fallback or not control.should_save:
            return
        control.should_save = False  # the Trainer writes no folder
        tr = self._trainer
        if tr is not None and tr.hp_search_backend is None:
            tr.store_flos()  # what the Trainer's save does first (total_flos into the state)
        self._pending = _Pending(
            state.global_step, _rng_state(self._distributed(args)), len(state.log_history), self._control_state(control)
        )

    def _best_strategy(self, args: Any, state: Any, control: Any, metrics: dict[str, Any]) -> None:
        """``save_strategy="best"``: the Trainer decides to save after this event, from
        ``_determine_best_metric``; doing its bookkeeping here (same values) leaves it nothing new
        to find, so it writes no folder, and the save is taken here."""
        name = args.metric_for_best_model
        if name is None:
            return
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            return  # the Trainer raises its own KeyError next
        better = np.greater if args.greater_is_better else np.less
        best = state.best_metric
        if best is None:
            best = float("-inf") if args.greater_is_better else float("inf")
        if better(metrics[key], best):
            state.best_metric = metrics[key]
            state.best_global_step = state.global_step
            self._pending = _Pending(
                state.global_step,
                _rng_state(self._distributed(args)),
                len(state.log_history),
                self._control_state(control),
            )

    def _trainer_state_json(self, state: Any, control: Any, p: _Pending) -> str:
        """``trainer_state.json`` as the Trainer's save writes it (callback states updated)."""
        handler = self._trainer.callback_handler if self._trainer is not None else None
        cbs = list(handler.callbacks) if handler is not None else []
        for cb in cbs:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
        state.stateful_callbacks["TrainerControl"] = p.control_state
        d = dataclasses.asdict(state)
        d["log_history"] = d["log_history"][: p.log_len]
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    def _tree(self, args: Any, state: Any, control: Any, kw: dict[str, Any], p: _Pending, rngs: list[Any]) -> dict:
        tr = self._trainer
        model: Any = tr.model if tr is not None else kw["model"]
        tree: dict[str, Any] = {"model": model.state_dict()}
        if not args.save_only_model:
            tree["optimizer"] = kw["optimizer"].state_dict()
            with warnings.catch_warnings():  # the scheduler's "save the optimizer too" warning
                warnings.simplefilter("ignore", UserWarning)
                tree["scheduler"] = kw["lr_scheduler"].state_dict()
            scaler = getattr(getattr(tr, "accelerator", None), "scaler", None)
            if scaler is not None:
                tree["scaler"] = scaler.state_dict()
            tree["rng"] = rngs
        tree["trainer_state"] = self._trainer_state_json(state, control, p)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            tree["config"] = config.to_json_string()
        return tree

    def _flush(self, args: Any, state: Any, control: Any, kw: dict[str, Any], *, fire: bool = True) -> None:
        """Take the pending save (every rank: RNG states gathered, rank 0 writes)."""
        p, self._pending = self._pending, None
        if p is None:
            return
        d = _dist()
        rngs: list[Any] = [p.rng]
        if d is not None and not args.save_only_model:
            gathered: list[Any] | None = [None] * d.get_world_size() if d.get_rank() == 0 else None
            d.gather_object(p.rng, gathered, dst=0)
            rngs = gathered or []
        if state.is_world_process_zero:
            self.finish_pending()
            st = self.store(args)
            tree = self._tree(args, state, control, kw, p, rngs)
            extra = {
                "writer": WRITER,
                "format": _FORMAT,
                "global_step": p.step,
                "save_only_model": bool(args.save_only_model),
                "world_size": int(args.world_size or 1),
                "model": _fingerprint(tree["model"]),
            }
            if self.async_save:
                self._inflight = (st.save_async(tree, p.step, extra=extra, overwrite=True), args, state)
            else:
                self.last_info = st.save(tree, p.step, extra=extra, overwrite=True)
                self._rotate(args, state)
        _barrier()  # the other ranks wait for the save, as at the Trainer's own
        if fire and self._trainer is not None:
            self._firing = True
            try:
                new = self._trainer.callback_handler.on_save(args, state, control)
            finally:
                self._firing = False
            if new is not None and new is not control:
                for f in dataclasses.fields(control):
                    setattr(control, f.name, getattr(new, f.name))

    def finish_pending(self) -> None:
        """Wait for the background save (``async_save=True``) and mirror rotation; raises its
        error if it failed. A no-op when none is in flight."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        handle, args, state = inflight
        self.last_info = handle.result()
        self._rotate(args, state)

    def _own_steps(self, st: CheckpointStore) -> list[int]:
        return [i.step for i in st.list() if i.extra.get("writer") == WRITER]

    def _rotate(self, args: Any, state: Any) -> None:
        """Mirror ``save_total_limit`` (the newest and the best step kept)."""
        st = self.store(args)
        for s in _rotate(self._own_steps(st), args.save_total_limit, state.best_global_step):
            st.delete(s)

    # ---------------------------------------------------------------- FSDP / DeepSpeed fallback
    def _store_folder(self, args: Any, state: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        _barrier()  # every rank has written its files
        if state.is_world_process_zero and os.path.isdir(folder):
            tree = pack_folder(folder)
            files = sorted(tree["files"])
            extra = {"writer": WRITER, "format": 1, "files": files, "world_size": int(args.world_size or 1)}
            self.last_info = self.store(args).save(tree, state.global_step, extra=extra, overwrite=True)
            self._rotate(args, state)
        _barrier()


# -------------------------------------------------------------------- restore
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
        ``scaler.pt``), holding exactly the stored values.
    Raises:
        CheckpointNotFoundError: no such step (or an empty store).
        StateMismatchError: the step was not written by S4Callback, or does not fit ``model``
            (names the step and the key).
        ConflictError: ``dest`` exists and is not empty (nothing is overwritten).
    Example:
        ``trainer.train(resume_from_checkpoint=s4w_transformers.restore_checkpoint("out/.s4w"))``
    """
    url = os.fspath(store)
    d = _dist()
    rank = d.get_rank() if d is not None else 0
    st = CheckpointStore(url, **store_options)
    info = st.info(step)
    where = f"{url} step {info.step}"
    if info.extra.get("writer") != WRITER and "files" not in info.extra:
        raise StateMismatchError(
            f"{where} was written by {info.extra.get('writer') or 'another writer'!r}, not by S4Callback: not a "
            "Trainer checkpoint"
        )
    if dest is not None and os.path.isdir(dest) and os.listdir(dest):
        raise ConflictError(f"{os.fspath(dest)} exists and is not empty; restore_checkpoint overwrites nothing")
    if dest is None:
        base = tempfile.mkdtemp(prefix="s4w-restore-") if rank == 0 else None
        if d is not None:
            holder = [base]
            d.broadcast_object_list(holder, src=0)
            base = holder[0]
        if rank == 0:
            _RESTORED.add(str(base))
        dest = os.path.join(str(base), f"checkpoint-{info.step}")
    dest = os.fspath(dest)
    if rank == 0:
        tree = st.load(info.step, "cpu")
        if "files" in info.extra:  # a packed checkpoint folder (FSDP/DeepSpeed fallback)
            os.makedirs(dest, exist_ok=True)
            unpack_folder(tree, dest)
        else:
            if model is not None:
                _check_model(where, tree["model"], model)
            _write_folder(tree, dest, where)
    _barrier()
    return dest


def _write_folder(tree: dict[str, Any], dest: str, where: str) -> None:
    """The files the Trainer's resume reads, from a stored tree."""
    for key in ("model", "trainer_state"):
        if key not in tree:
            raise StateMismatchError(f"{where}: key {key!r} missing; not a Trainer checkpoint")
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write(tree["trainer_state"])
    if "config" in tree:
        with open(os.path.join(dest, "config.json"), "w", encoding="utf-8") as f:
            f.write(tree["config"])
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
    if "optimizer" in tree:
        torch.save(tree["optimizer"], os.path.join(dest, "optimizer.pt"))
        torch.save(tree["scheduler"], os.path.join(dest, "scheduler.pt"))
    if "scaler" in tree:
        torch.save(tree["scaler"], os.path.join(dest, "scaler.pt"))
    rngs = tree.get("rng") or []
    if len(rngs) == 1:
        torch.save(rngs[0], os.path.join(dest, "rng_state.pth"))
    else:
        for r, s in enumerate(rngs):
            torch.save(s, os.path.join(dest, f"rng_state_{r}.pth"))

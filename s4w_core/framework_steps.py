"""The store side that the framework adapters share (``s4w_transformers``, ``s4w_accelerate``;
``s4w_lightning`` opens its stores here too).

- :class:`Stores`: one :class:`~s4w_core.store.CheckpointStore` per URL, opened once with the
  adapter's defaults.
- :class:`AdapterSteps`: one adapter's steps in its stores: a state tree saved as a step tagged
  ``extra["writer"]`` (blocking, or one background save in flight), the framework's retention
  mirrored once the step is durable, a step found by its ``extra``, a run from step 0 refused on a
  store holding steps, and the fallback where a sharded engine writes its own checkpoint folder:
  the folder stored packed (:func:`s4w_core.filepack.pack_folder`) and written back.
- :func:`restore_into`: a step written as the folder a framework's own resume reads (a temporary
  folder by default, removed by :func:`cleanup_temp_folders` or at exit); :func:`to_cpu`.
- :func:`check_states` / :func:`load_states`: every stored state checked against the live objects
  before any is loaded; :func:`state_dicts`.
- What adapters do around a framework: :func:`private_attrs` (the one place to read attributes a
  framework keeps private, failing with :class:`UnsupportedFrameworkError`), :func:`patch_methods` /
  :func:`unpatch_methods`, :func:`caller_instance`, :func:`prepare_profile`, :func:`step_from_name`,
  :func:`warn_once` / :func:`warn_fallback`.
- :func:`save_sharded` / :func:`load_sharded` / :func:`delete_sharded`: sharded (FSDP2 / DTensor)
  models and optimizers as one step of a run-level DCP root (:class:`s4w_core.dcp.S4StorageWriter`:
  each rank's shards a delta chain), beside the store step that holds the rest.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import re
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from s4w_core import gpu
from s4w_core.config import check_profile
from s4w_core.dcp import S4StorageWriter
from s4w_core.dcp.reader import S4StorageReader
from s4w_core.dcp.run import committed_steps, delete_step
from s4w_core.errors import CheckpointNotFoundError, ConflictError, S4WError
from s4w_core.filepack import pack_folder, unpack_folder
from s4w_core.frameworks import (
    S3_OPTIONS,
    StateMismatchError,
    StepSaver,
    auto_location,
    barrier,
    broadcast_object,
    check_count,
    check_state_dict,
    device_map,
    dist,
    rotate,
)
from s4w_core.store import CheckpointStore, StepInfo

__all__ = [
    "UnsupportedFrameworkError",
    "Stores",
    "AdapterSteps",
    "restore_into",
    "cleanup_temp_folders",
    "temp_folders_pending",
    "to_cpu",
    "state_dicts",
    "check_states",
    "load_states",
    "warn_once",
    "warn_fallback",
    "caller_instance",
    "prepare_profile",
    "private_attrs",
    "step_from_name",
    "patch_methods",
    "unpatch_methods",
    "sharded_root",
    "save_sharded",
    "load_sharded",
    "delete_sharded",
]

_DIGITS = re.compile(r"(\d+)(?!.*\d)")


class UnsupportedFrameworkError(S4WError, RuntimeError):
    """The installed framework lacks an attribute an adapter reads (a version it was not checked against)."""


class Stores:
    """:class:`CheckpointStore` objects opened once per URL with the same arguments (thread-safe)."""

    def __init__(self, **defaults: Any) -> None:
        self.defaults = defaults
        self._open: dict[str, CheckpointStore] = {}
        self._lock = threading.Lock()

    def open(self, url: str) -> CheckpointStore:
        with self._lock:
            if url not in self._open:
                self._open[url] = CheckpointStore(url, **self.defaults)
            return self._open[url]

    def opened(self) -> list[CheckpointStore]:
        with self._lock:
            return list(self._open.values())

    def clear(self) -> None:
        with self._lock:
            self._open.clear()


class AdapterSteps:
    """One adapter's steps: saved with ``extra["writer"] = writer``, retention mirrored, packed folders.

    Args:
        writer: the adapter's name, recorded in each step's ``extra``.
        **store_defaults: the :class:`CheckpointStore` arguments of every store opened (``profile``...).
    """

    def __init__(self, writer: str, **store_defaults: Any) -> None:
        self.writer = writer
        self.stores = Stores(**store_defaults)
        self.saver = StepSaver()

    @property
    def last_info(self) -> Any:
        """The :class:`~s4w_core.store.StepInfo` of the last durable save (ratio, kind, bytes), or None."""
        return self.saver.last_info

    def store(self, url: str) -> CheckpointStore:
        return self.stores.open(url)

    @property
    def s3_options(self) -> dict[str, Any]:
        """The S3 arguments among the stores' defaults (for the run-level DCP beside a store)."""
        return {k: v for k, v in self.stores.defaults.items() if k in S3_OPTIONS}

    def own(self, st: CheckpointStore, **match: Any) -> list[StepInfo]:
        """The steps of ``st`` this adapter wrote whose ``extra`` has each ``match`` item, oldest first."""
        return [i for i in st.list() if i.extra.get("writer") == self.writer
                and all(i.extra.get(k) == v for k, v in match.items())]  # fmt: skip

    def retain(self, st: CheckpointStore, limit: int | None, best: int | None = None, **match: Any) -> None:
        """Mirror a framework's ``limit`` on the steps matching ``match`` (:func:`rotate`: newest and ``best`` kept)."""
        for s in rotate([i.step for i in self.own(st, **match)], limit, best):
            st.delete(s)

    def drop_rotated(self, st: CheckpointStore, step: int, limit: int | None, best: int | None = None, **match: Any) -> None:
        """Before saving ``step``: the steps :meth:`retain` deletes once it is durable get no more
        background work (:meth:`CheckpointStore.drop_pending`: the save does not wait for their
        re-encoding), and those it deletes once a later save is durable get none unless they
        stay (:meth:`CheckpointStore.expect_drop`: the end of training, a changed ``best``)."""
        if not limit:
            return
        steps = {i.step for i in self.own(st, **match)} | {step}
        for s in rotate(sorted(steps), limit, best):
            st.drop_pending(s)
        for s in rotate(sorted(steps | {step + 1}), limit, best):  # (any later step rotates the same)
            st.expect_drop(s)

    def save(
        self,
        st: CheckpointStore,
        tree: dict[str, Any],
        step: int,
        extra: dict[str, Any],
        *,
        async_save: bool = False,
        overwrite: bool = True,
        then: Callable[[], None] = lambda: None,
    ) -> None:
        """Save ``tree`` as ``step`` (after the save in flight); ``then`` (retention) once it is durable."""
        extra = {"writer": self.writer, **extra}
        self.saver.save(st, tree, step, extra=extra, overwrite=overwrite, async_save=async_save, then=then)

    def finish(self) -> None:
        """Wait for the background save and run its ``then``; raises its error."""
        self.saver.finish()

    def wait(self) -> None:
        """:meth:`finish`, then every opened store's background work."""
        self.finish()
        for st in self.stores.opened():
            st.wait()

    def check_fresh(self, st: CheckpointStore, hint: str) -> None:
        """:class:`ConflictError` when a run starting at step 0 meets ``st`` holding steps (another run's?)."""
        if st.steps():
            raise ConflictError(f"{st.url} already holds steps {st.steps()[-5:]} (another run?) and this run starts "
                                f"at step 0; {hint}")  # fmt: skip

    def find(self, st: CheckpointStore, what: str, **match: Any) -> StepInfo:
        """The newest step of ``st`` whose ``extra`` has each ``match`` item.

        Raises:
            CheckpointNotFoundError: there is none. StateMismatchError: another writer wrote it.
        """
        for info in reversed(st.list()):
            if all(info.extra.get(k) == v for k, v in match.items()):
                if info.extra.get("writer") != self.writer:
                    raise StateMismatchError(f"{st.url} step {info.step} was written by {info.extra.get('writer')!r}")
                return info
        raise CheckpointNotFoundError(f"{what}: the store {st.url} has no step with "
                                      + ", ".join(f"{k}={v!r}" for k, v in match.items()))  # fmt: skip

    def save_sharded(self, st: CheckpointStore, step: int, models: list[Any], optimizers: list[Any]) -> str:
        """Every rank: :func:`save_sharded` into the run beside ``st`` (:func:`sharded_root`); returns the root."""
        root = sharded_root(st.url)
        save_sharded(root, step, models, optimizers, profile=self.stores.defaults.get("profile", "auto"),
                     s3_options=self.s3_options)  # fmt: skip
        return root

    def prune_sharded(self, st: CheckpointStore, root: str, rank: int) -> None:
        """Every rank, after the store's retention: delete the run's steps ``st`` no longer holds (rank 0 decides)."""
        barrier()
        gone = [s for s in committed_steps(root, self.s3_options) if s not in st.steps()] if rank == 0 else None
        delete_sharded(root, broadcast_object(gone), rank, self.s3_options)

    def info(self, st: CheckpointStore, step: int | None, what: str) -> StepInfo:
        """Step ``step`` (None: the newest); :class:`StateMismatchError` unless this adapter wrote it or it
        is a packed folder."""
        info = st.info(step)
        if info.extra.get("writer") != self.writer and "files" not in info.extra:
            raise StateMismatchError(f"{st.url} step {info.step} was written by "
                                     f"{info.extra.get('writer') or 'another writer'!r}, not by {what}")  # fmt: skip
        return info

    def save_folder(self, st: CheckpointStore, folder: str, step: int, extra: dict[str, Any],
                    then: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        """The sharded engines' fallback: the checkpoint folder a framework wrote, stored packed (blocking)."""
        tree = pack_folder(folder)
        self.save(st, tree, step, {**extra, "files": sorted(tree["files"])}, then=then)

    def store_written_folder(self, folder: str, main: bool, save: Callable[[str], None]) -> None:
        """Every rank, once the framework wrote ``folder``: after a barrier, ``save(folder)`` on the main
        rank where the folder exists (e.g. :meth:`save_folder`); the others wait for it."""
        barrier()
        if main and os.path.isdir(folder):
            save(folder)
        barrier()

    def load_model(self, st: CheckpointStore, step: int, model: torch.nn.Module, device: Any, key: str = "model") -> None:
        """Load the weights ``key`` of ``step`` into ``model`` (checked first: keys, shapes, dtypes)."""
        sd = st.load(step, device_map(device))[key]
        check_state_dict(f"{st.url} step {step}", sd, model.state_dict())
        model.load_state_dict(sd, False)


def prepare_profile(profile: str) -> None:
    """Check an adapter's ``profile``; unless ``"portable"``, compile the GPU codec's kernels once
    training has started CUDA (before the first save)."""
    check_profile(profile)
    if profile != "portable":
        gpu.warm_up(when_cuda_used=True)


def private_attrs(obj: Any, names: tuple[str, ...], framework: str, version: str, checked: str) -> dict[str, Any]:
    """``{name without its leading "_": obj.name}`` for attributes a framework keeps private with no
    public getter: an adapter's one place to read them.

    Raises:
        UnsupportedFrameworkError: one is missing (``version`` installed, the adapter ``checked`` against another).
    """
    missing = [a for a in names if not hasattr(obj, a)]
    if missing:
        raise UnsupportedFrameworkError(
            f"s4weights reads {type(obj).__name__}.{missing[0]}, which {framework} {version} does not have (checked "
            f"against {checked}): install a checked version or switch the s4weights adapter off"
        )
    return {a.lstrip("_"): getattr(obj, a) for a in names}


def step_from_name(name: str, st: CheckpointStore) -> int:
    """The last number in a checkpoint folder's ``name``; without one, the step after ``st``'s newest (or 0)."""
    m = _DIGITS.search(name)
    last = None if m else st.latest()
    return int(m.group(1)) if m else 0 if last is None else last + 1


def patch_methods(cls: type, methods: dict[str, Callable[..., Any]], originals: dict[str, Any]) -> None:
    """Replace methods of ``cls`` (each wrapped to carry the original's name and doc); the originals go
    into ``originals`` (nothing is done when it already holds them)."""
    if originals:
        return
    for name, fn in methods.items():
        originals[name] = getattr(cls, name)
        setattr(cls, name, functools.wraps(originals[name])(fn))


def unpatch_methods(cls: type, originals: dict[str, Any]) -> None:
    """Undo :func:`patch_methods` (``originals`` emptied)."""
    while originals:
        name, fn = originals.popitem()
        setattr(cls, name, fn)


def warn_once(seen: set[str], key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` is added to ``seen``."""
    if key not in seen:
        seen.add(key)
        warnings.warn(message, stacklevel=3)


def warn_fallback(adapter: str, engine: str, framework: str, seen: set[str] | None = None) -> None:
    """The one warning of an adapter whose framework saves through ``engine``'s own sharded writer:
    the framework writes its folders, the adapter stores a packed copy (once per ``engine`` with ``seen``)."""
    message = (f"{adapter}: {engine} saves through its own sharded writer, which {adapter} cannot intercept yet; "
               f"{framework} writes its checkpoint folders and s4weights stores a packed copy of each (the folders "
               "stay)")  # fmt: skip
    warn_once(set() if seen is None else seen, engine, message)


def caller_instance(cls: type) -> Any:
    """The ``self`` of the nearest calling frame that is an instance of ``cls``, or None (for
    callbacks a framework hands no reference to its owner)."""
    # from the caller's frame up: reading this frame's own f_locals would store this frame in
    # its own locals snapshot, a reference cycle keeping every frame above it (a training loop's
    # locals: batches, the model's state) alive until the cyclic GC
    frame = inspect.currentframe()
    try:
        frame = frame.f_back if frame is not None else None
        while frame is not None and not isinstance(frame.f_locals.get("self"), cls):
            frame = frame.f_back
        return None if frame is None else frame.f_locals["self"]
    finally:
        del frame


# ------------------------------------------------------------------------ states of live objects
def state_dicts(objs: Iterable[Any]) -> list[Any]:
    """Each object's ``state_dict()`` (an LR scheduler's "save the optimizer too" warning silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return [o.state_dict() for o in objs]


def check_states(where: str, stored: dict[str, list[Any]], own: dict[str, list[Any]], models: str = "models") -> None:
    """:class:`StateMismatchError` unless each kind of ``own`` objects has as many states in
    ``stored`` and the ``models`` states fit the live models (keys, shapes, dtypes)."""
    for what, objs in own.items():
        check_count(where, what, stored[what], objs)
    for i, (sd, m) in enumerate(zip(stored.get(models, []), own.get(models, []))):
        check_state_dict(f"{where} model {i}", sd, m.state_dict())


def load_states(stored: dict[str, list[Any]], own: dict[str, list[Any]]) -> None:
    """``load_state_dict`` each stored state into its object (after :func:`check_states`)."""
    for what, objs in own.items():
        for sd, o in zip(stored[what], objs):
            o.load_state_dict(sd)


# ------------------------------------------------------------------------ restore into a folder
_TEMP: set[str] = set()  # temporary folders restore_into made in this process


def cleanup_temp_folders() -> None:
    """Remove the temporary folders :func:`restore_into` made in this process."""
    while _TEMP:
        shutil.rmtree(_TEMP.pop(), ignore_errors=True)


def temp_folders_pending() -> bool:
    """Whether a temporary folder :func:`restore_into` made is still there."""
    return bool(_TEMP)


atexit.register(cleanup_temp_folders)


def restore_into(
    steps: AdapterSteps,
    st: CheckpointStore,
    step: int | None,
    dest: str | os.PathLike[str] | None,
    write: Callable[[dict[str, Any], str, str], None],
    *,
    what: str,
    model: torch.nn.Module | None = None,
    held: tuple[str, ...] = (),
) -> tuple[str, dict[str, Any]]:
    """Write a step of ``st`` as a framework's checkpoint folder: ``write(tree, dest, where)`` on rank 0
    (tensors on the CPU), a packed folder unpacked; every rank waits and gets the same folder.

    Args:
        steps, what: the adapter whose steps these are, and its name in errors.
        dest: the folder (must not exist or be empty); default ``<new temporary folder>/checkpoint-{step}``,
            removed by :func:`cleanup_temp_folders` or at exit.
        model: when given, checked against the tree's ``"model"`` first (keys, shapes, dtypes).
        held: keys of the tree returned in memory (on their saved device) instead of written.
    Returns:
        (the folder, the ``held`` parts).
    Raises:
        CheckpointNotFoundError: no such step. StateMismatchError: another writer's step, or one that
        does not fit ``model``. ConflictError: ``dest`` exists and is not empty.
    """
    d = dist()
    rank = d.get_rank() if d is not None else 0
    info = steps.info(st, step, what)
    where = f"{st.url} step {info.step}"
    if dest is not None and os.path.isdir(dest) and os.listdir(dest):
        raise ConflictError(f"{os.fspath(dest)} exists and is not empty; nothing is overwritten")
    if dest is None:
        base = broadcast_object(tempfile.mkdtemp(prefix="s4w-restore-") if rank == 0 else None)
        if rank == 0:
            _TEMP.add(str(base))
        dest = os.path.join(str(base), f"checkpoint-{info.step}")
    dest, kept = os.fspath(dest), {}
    if rank == 0:
        # decoded on the device it was saved from where this machine has it (a GPU decodes a
        # GPU-saved step far faster than the CPU); the files get CPU tensors
        tree = st.load(info.step, auto_location)
        if "files" in info.extra:  # a packed checkpoint folder (the sharded engines' fallback)
            os.makedirs(dest, exist_ok=True)
            unpack_folder(tree, dest)
        else:
            if model is not None and "model" in tree:
                check_state_dict(where, tree["model"], model.state_dict())
            kept = {k: tree.pop(k) for k in held if k in tree}
            os.makedirs(dest, exist_ok=True)
            write(to_cpu(tree), dest, where)
    barrier()
    return dest, kept


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor on the CPU (dicts, lists and tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return type(obj)(to_cpu(v) for v in obj) if type(obj) in (list, tuple) else obj



# ------------------------------------------------------------------ sharded models: run-level DCP
def sharded_root(store_url: str) -> str:
    """The run-level DCP root beside a store for its sharded steps: ``<store>_dcp`` (``.s4w_dcp``)."""
    return store_url.rstrip("/") + "_dcp"


def _sharded_state(models: list[Any], optimizers: list[Any]) -> dict[str, Any]:
    """DCP's state dicts of ``models`` and ``optimizers`` (optimizer ``i`` of ``models[i]``, as Accelerate pairs them)."""
    state: dict[str, Any] = {f"model_{i}": get_model_state_dict(m) for i, m in enumerate(models)}
    state.update({f"optimizer_{i}": get_optimizer_state_dict(models[i], o) for i, o in enumerate(optimizers)})
    return state


def save_sharded(root: str, step: int, models: list[Any], optimizers: list[Any], *, profile: str = "auto",
                 s3_options: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Every rank: its shards of ``models`` and ``optimizers`` as ``step`` of the run at ``root``
    (``dcp.save`` through :class:`~s4w_core.dcp.S4StorageWriter`; the step commits once every rank's data is durable)."""
    writer = S4StorageWriter(root, step=step, profile=profile, s3_options=s3_options)
    dcp.save(_sharded_state(models, optimizers), storage_writer=writer)


def load_sharded(root: str, step: int, models: list[Any], optimizers: list[Any],
                 s3_options: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Every rank: what :func:`save_sharded` stored, loaded into ``models`` and ``optimizers`` (any world size).

    Raises:
        StateMismatchError: the stored shards do not fit (other keys or shapes); nothing is loaded.
        CheckpointNotFoundError: the run has no such step.
    """
    state = _sharded_state(models, optimizers)
    try:
        dcp.load(state, storage_reader=S4StorageReader(root, step=step, s3_options=s3_options))
    except CheckpointException as e:  # DCP gathers every rank's failure
        causes = [exc for exc, _ in e.failures.values()]
        ours = [c for c in causes if isinstance(c, S4WError)]
        if ours:
            raise ours[0] from e
        raise StateMismatchError(f"{root} step {step}: the stored shards do not fit these models and optimizers "
                                 f"({type(causes[0]).__name__}: {causes[0]})") from e  # fmt: skip
    for i, m in enumerate(models):
        set_model_state_dict(m, state[f"model_{i}"])
    for i, o in enumerate(optimizers):
        set_optimizer_state_dict(models[i], o, state[f"optimizer_{i}"])


def delete_sharded(root: str, steps: list[int], rank: int, s3_options: dict[str, Any] | None = None) -> None:
    """Every rank: delete ``steps`` from the run at ``root`` (rank 0 their records, each rank its own shards)."""
    for step in steps:
        delete_step(root, step, rank, s3_options)

"""What the framework adapters share (``s4w_lightning``, ``s4w_transformers``, ``s4w_accelerate``).

The adapters convert a framework's checkpoint into a state tree and delegate to a
:class:`~s4w_core.store.CheckpointStore`; the pieces they would otherwise each repeat live here:

- checks of a stored step against the live objects (:func:`fingerprint`, :func:`check_state_dict`,
  :class:`StateMismatchError`), retention (:func:`rotate`), one background save at a time
  (:class:`StepSaver`), the torch.distributed helpers (:func:`dist`, :func:`barrier`,
  :func:`gather_object`, :func:`broadcast_object`) and the RNG states (:func:`rng_state`);
- whole-file I/O at local paths and ``s3://`` URLs (:class:`Files`), a background queue that runs
  saves and removes in call order (:class:`SerialQueue`) and pointer files at a framework's paths
  whose store steps go once no file names them (:class:`PointerFiles`);
- values without a pickle-free encoding (:func:`pack_objects` / :func:`unpack_objects`: stored with
  ``torch.save`` and checked to load back with ``torch.load(weights_only=True)`` when saved) and the
  recognition of a second name for a step already stored (:class:`SavedStep`).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import io
import os
import random
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed

from s4w_core import api, gpu, pointer
from s4w_core import checksum as ck
from s4w_core._fsutil import atomic_write
from s4w_core.errors import CheckpointNotFoundError, FormatError, S4WError, StoreError, UnsupportedTypeError
from s4w_core.store import CheckpointStore, open_backend

__all__ = [
    "StateMismatchError",
    "fingerprint",
    "check_state_dict",
    "check_count",
    "rotate",
    "StepSaver",
    "dist",
    "barrier",
    "gather_object",
    "broadcast_object",
    "rng_state",
    "set_rng_state",
    "store_url",
    "device_map",
    "auto_location",
    "norm_path",
    "is_s3",
    "split_path",
    "join_path",
    "Files",
    "SerialQueue",
    "PointerFiles",
    "pack_objects",
    "unpack_objects",
    "snapshot",
    "SavedStep",
]

S3_OPTIONS = ("region", "endpoint", "force_path_style", "unsigned", "client_options")
_OBJECTS = "__s4w_torch_objects__"
_OBJ_TAG = "__s4w_torch_object__"


class StateMismatchError(S4WError, ValueError):
    """A stored step does not fit this run: another writer, other models, shapes or objects."""


# ------------------------------------------------------------------------------------ checks
def fingerprint(sd: dict[str, Any]) -> str:
    """A hash of a state dict's keys, shapes and dtypes (a store from another model differs)."""
    h = hashlib.sha256()
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            h.update(f"{k}:{tuple(v.shape)}:{v.dtype};".encode())
    return h.hexdigest()[:16]


def check_state_dict(where: str, stored: dict[str, Any], own: dict[str, Any]) -> None:
    """Raise :class:`StateMismatchError` naming the first key missing on one side, or whose shape
    or dtype differs."""
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


def check_count(where: str, what: str, stored: list[Any], own: list[Any]) -> None:
    """Raise :class:`StateMismatchError` when a step stores another number of ``what`` than registered."""
    if len(stored) != len(own):
        raise StateMismatchError(f"{where}: {len(stored)} {what} stored, {len(own)} registered here")


def rotate(steps: list[int], limit: int | None, best: int | None = None) -> list[int]:
    """The steps to delete to keep ``limit`` (oldest first; the newest and ``best`` are kept), as
    the HF Trainer's ``rotate_checkpoints`` and Accelerate's ``total_limit`` do."""
    if not limit or limit <= 0 or len(steps) <= limit:
        return []
    protected = {steps[-1]} | ({best} if best in steps else set())
    doomed = [s for s in steps if s not in protected]
    return doomed[: len(steps) - max(limit, len(protected))]


class StepSaver:
    """Save state trees as store steps, blocking or with one :meth:`CheckpointStore.save_async`
    in flight; ``then`` (retention) runs once a step is durable."""

    def __init__(self) -> None:
        self._inflight: tuple[Any, Callable[[], None]] | None = None
        #: the :class:`~s4w_core.store.StepInfo` of the last durable save (ratio, kind, bytes).
        self.last_info: Any = None

    def save(
        self,
        st: CheckpointStore,
        tree: dict[str, Any],
        step: int,
        *,
        extra: dict[str, Any],
        overwrite: bool,
        async_save: bool,
        then: Callable[[], None] = lambda: None,
    ) -> None:
        self.finish()
        if async_save:
            self._inflight = (st.save_async(tree, step, extra=extra, overwrite=overwrite), then)
        else:
            self.last_info = st.save(tree, step, extra=extra, overwrite=overwrite)
            then()

    def finish(self) -> None:
        """Wait for the save in flight (a no-op when none is) and run its ``then``; raises its error."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self.last_info = inflight[0].result()
            inflight[1]()


# ------------------------------------------------------------------------- torch.distributed
def dist() -> Any:
    """``torch.distributed`` when a process group is initialised, else None."""
    d = torch.distributed
    return d if d.is_available() and d.is_initialized() else None


def barrier() -> None:
    d = dist()
    if d is not None:
        d.barrier()


def gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on rank 0 (``[]`` on the others, ``[obj]`` without a process group)."""
    d = dist()
    if d is None:
        return [obj]
    out: list[Any] | None = [None] * d.get_world_size() if d.get_rank() == 0 else None
    d.gather_object(obj, out, dst=0)
    return out or []


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    d = dist()
    if d is None:
        return obj
    holder = [obj]
    d.broadcast_object_list(holder, src=0)
    return holder[0]


def rng_state(cuda_all: bool = True) -> dict[str, Any]:
    """The python, numpy, torch CPU and (when present) CUDA generators' states."""
    st: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.random.get_rng_state_all() if cuda_all else torch.cuda.random.get_rng_state()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA only where this machine has it)."""
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.random.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        cuda = st["cuda"]
        if isinstance(cuda, (list, tuple)):
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            torch.cuda.random.set_rng_state(cuda)


# ------------------------------------------------------------------------------------ places
def norm_path(path: Any) -> str:
    """``os.fspath(path)``, with the ``s3:/b/k`` that ``pathlib`` makes of ``s3://b/k`` repaired."""
    s = os.fspath(path)
    if s.startswith("s3:/") and not s.startswith("s3://"):
        s = "s3://" + s[len("s3:/") :]
    return s


def is_s3(path: str) -> bool:
    return path.startswith("s3://")


def store_url(store: str | os.PathLike[str]) -> str:
    """A store location as its URL: ``s3://...`` as given, a local path made absolute."""
    s = norm_path(store)
    return s if is_s3(s) else os.path.abspath(s)


def split_path(path: str) -> tuple[str, str]:
    """(folder, name) of a local path (made absolute) or an ``s3://`` URL."""
    if is_s3(path):
        d, _, name = path.rstrip("/").rpartition("/")
        return d, name
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def join_path(d: str, rel: str) -> str:
    return d.rstrip("/") + "/" + rel if is_s3(d) else os.path.join(d, rel)


def device_map(device: Any) -> Callable[[str], str]:
    """A ``map_location``: tensors saved on an accelerator go to ``device``; CPU ones (RNG states) stay."""
    dev = str(device)
    return lambda orig: "cpu" if torch.device(orig).type == "cpu" else dev


def auto_location(orig: str) -> str:
    """A ``map_location``: the saved device where it exists here, else the CPU."""
    dev = torch.device(orig)
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        return "cpu"
    return orig if dev.type in ("cpu", "cuda", "meta") else "cpu"


class Files:
    """Whole files at local paths or ``s3://`` URLs (one backend per S3 folder, reused)."""

    def __init__(self, store_options: dict[str, Any] | None = None) -> None:
        self.s3_options = {k: v for k, v in (store_options or {}).items() if k in S3_OPTIONS}
        #: the stores' ``durable`` setting, for the files written beside them (pointer files)
        self.durable = (store_options or {}).get("durable", True)
        if type(self.durable) is not bool:
            raise ValueError(f"durable must be True or False, got {self.durable!r}")
        self._backends: dict[str, Any] = {}
        self._lock = threading.Lock()

    def backend(self, d: str) -> Any:
        with self._lock:
            b = self._backends.get(d)
            if b is None:
                b = self._backends[d] = open_backend(d, **self.s3_options)
            return b

    def read(self, path: str) -> bytes:
        """The file's bytes; :class:`CheckpointNotFoundError` when there is none."""
        try:
            if is_s3(path):
                d, name = split_path(path)
                return bytes(self.backend(d).get(name))
            with open(path, "rb") as f:
                return f.read()
        except (CheckpointNotFoundError, FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(f"Checkpoint file not found: {path}") from None

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` whole (locally: atomically, and durably unless the stores
        are not: ``durable=False``)."""
        if is_s3(path):
            d, name = split_path(path)
            self.backend(d).put(name, data)
        else:
            with atomic_write(path, durable=self.durable) as f:
                f.write(data)

    def save(self, path: str, obj: Any, profile: str) -> Any:
        """:func:`s4w_core.save` of ``obj`` as one container at ``path``."""
        if is_s3(path):
            d, name = split_path(path)
            with self.backend(d).writer(name) as fp:
                return api.save(obj, fp, profile=profile)
        return api.save(obj, path, profile=profile, durable=self.durable)

    def exists(self, path: str) -> bool:
        """Is there a file at ``path``?"""
        if is_s3(path):
            d, name = split_path(path)
            try:
                return any(o.key == name for o in self.backend(d).list(name))
            except CheckpointNotFoundError:
                return False
        return os.path.isfile(path)

    def remove(self, path: str) -> None:
        """Remove the file at ``path`` (none there: nothing to do)."""
        if is_s3(path):
            d, name = split_path(path)
            self.backend(d).delete(name)
            return
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def listdir(self, d: str) -> list[str]:
        """The paths of the files directly in folder ``d`` (none when it does not exist)."""
        if is_s3(d):
            try:
                return [f"{d}/{o.key}" for o in self.backend(d).list("") if "/" not in o.key]
            except (CheckpointNotFoundError, StoreError):
                return []
        try:
            return [e.path for e in os.scandir(d) if e.is_file()]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def pointer_at(self, path: str) -> pointer.Pointer | None:
        """The pointer file at ``path``, or None (no file, another kind of file, a malformed pointer)."""
        try:
            if is_s3(path):
                data = self.read(path)
                return pointer.parse(data, path) if pointer.is_pointer(data) else None
            return pointer.read(path)
        except (CheckpointNotFoundError, FormatError):
            return None


class SerialQueue:
    """Run calls in call order on one background thread (or at once when ``enabled`` is False).

    A failure is re-raised on the caller's thread by the next :meth:`submit`, :meth:`raise_error`
    or :meth:`wait`, and nothing queued behind it runs until then (e.g. no pointer to a step that
    never committed)."""

    def __init__(self, enabled: bool, name: str) -> None:
        self.enabled = enabled
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[Any]] = []
        self._error: BaseException | None = None

    def submit(self, fn: Callable[..., Any], *args: Any, skipped: Callable[[], None] | None = None) -> None:
        """Queue ``fn(*args)``; ``skipped``: called instead when a failure before it means it
        does not run (or when it cannot be queued)."""
        if not self.enabled:
            fn(*args)
            return
        try:
            self.raise_error()
        except BaseException:
            if skipped is not None:
                skipped()
            raise
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)

        def run() -> None:
            if self._error is not None:
                if skipped is not None:
                    skipped()
                return
            try:
                fn(*args)
            except BaseException as e:
                self._error = e
                raise

        self._pending.append(self._executor.submit(run))

    def raise_error(self) -> None:
        self._pending = [f for f in self._pending if not f.done()]
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def wait(self) -> None:
        """Block until every queued call is done; re-raise the first error."""
        for f in list(self._pending):
            try:
                f.result()
            except BaseException:
                pass
        self._pending = []
        self.raise_error()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class PointerFiles:
    """Pointer files (:mod:`s4w_core.pointer`) at the paths a framework gives, each naming a step of
    a store: by default the ``dirname`` folder beside it, or the one store ``store_url``.  A store
    step is deleted once no pointer names it any more: the files themselves are the references
    (those beside the pointer overwritten or removed, and in every folder pointers to the same
    store were written into from here).  Only the store a path's pointers belong to is ever touched.
    """

    def __init__(
        self,
        files: Files,
        open_store: Callable[[str], CheckpointStore],
        *,
        store_url: str | None = None,
        dirname: str = ".s4w",
        rebase_on_delete: bool = False,
        hint: Callable[[str], str] | None = None,
        on_delete: Callable[[str, int], None] = lambda url, step: None,
    ) -> None:
        self.files, self.open_store, self.store_url, self.dirname = files, open_store, store_url, dirname
        self.rebase_on_delete, self.hint, self.on_delete = rebase_on_delete, hint, on_delete
        self._folders: dict[str, set[str]] = {}  # per store: the folders pointers were written into
        #: pointers about to be written, per (store, step): a step one will name is not deleted
        self._pending: collections.Counter[tuple[str, int]] = collections.Counter()
        #: (store, step) pairs a remove is deciding on or deleting
        self._deleting: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._deleted = threading.Condition(self._lock)

    def expect(self, url: str, step: int) -> None:
        """A pointer to ``step`` of store ``url`` will be written (by a caller that queues its
        writes behind removes): until :meth:`settle`, no remove deletes the step.  A remove
        deleting it right now is waited for (the caller then finds it gone)."""
        with self._deleted:
            self._deleted.wait_for(lambda: (url, step) not in self._deleting)
            self._pending[(url, step)] += 1

    def settle(self, url: str, step: int) -> None:
        """The pointer :meth:`expect` announced was written (or will not be)."""
        with self._lock:
            self._pending[(url, step)] -= 1
            if self._pending[(url, step)] <= 0:
                del self._pending[(url, step)]

    def location(self, path: str) -> tuple[str, str]:
        """(store URL, the reference a pointer at ``path`` records: relative when beside it)."""
        if self.store_url is not None:
            url = store_url(self.store_url)
            return url, url
        return join_path(split_path(path)[0], self.dirname), self.dirname

    def own_store(self, path: str, ptr: pointer.Pointer) -> str | None:
        """The store ``ptr`` names if it is the one pointers at ``path`` belong to, else None."""
        url, _ = self.location(path)
        try:
            got = pointer.resolve_store(path, ptr.store, expected_store=self.store_url)
        except FormatError:
            return None
        same = got == url if is_s3(url) else os.path.abspath(got) == os.path.abspath(url)
        return url if same else None

    def write(self, path: str, step: int, meta: dict[str, Any] | None = None, payload: bytes | None = None) -> None:
        """Write the pointer to ``step`` at ``path``; the step an older pointer there named goes
        when no other pointer names it."""
        url, ref = self.location(path)
        old = self.files.pointer_at(path)
        folder, name = split_path(path)
        hint = None if self.hint is None else self.hint(name)
        self.files.write(path, pointer.encode(ref, step, meta=meta, payload=payload, hint=hint, name=name))
        with self._lock:
            self._folders.setdefault(url, set()).add(folder)
        if old is not None and old.step != step and self.own_store(path, old) == url:
            self.forget(url, old.step, path)

    def remove(self, path: str) -> None:
        """Remove the file at ``path``; the step a pointer there named goes when no other names it."""
        ptr = self.files.pointer_at(path)
        self.files.remove(path)
        url = None if ptr is None else self.own_store(path, ptr)
        if ptr is not None and url is not None:
            self.forget(url, ptr.step, path)

    def forget(self, url: str, step: int, removed_path: str) -> None:
        """Delete store ``step`` unless a pointer other than ``removed_path`` still names it (or
        one to it is about to be written: :meth:`expect`)."""
        with self._lock:
            if self._pending.get((url, step), 0) > 0 or (url, step) in self._deleting:
                return
            self._deleting.add((url, step))
        try:
            if next(self._naming(url, step, removed_path), None) is not None:
                return
            self.on_delete(url, step)
            try:
                self.open_store(url).delete(step, **({"rebase": True} if self.rebase_on_delete else {}))
            except CheckpointNotFoundError:
                pass
        finally:
            with self._deleted:
                self._deleting.discard((url, step))
                self._deleted.notify_all()

    def detach(self, url: str, step: int, keep: str) -> list[str]:
        """Before store ``step`` takes other values (a run resumed from an older step saving a
        step number again): rewrite every pointer but ``keep`` that names it as a self-contained
        file of the values it names now, so that no file changes what it loads.  Returns the
        paths rewritten (a folder's pointers are found where :meth:`forget` finds them)."""
        out = []
        state = None  # the step, read once for all the names
        for p, ptr in self._naming(url, step, keep):
            if state is None:
                state = self.open_store(url).load(step, "cpu", remember=False)
            obj = state if ptr.payload is None else pointer.merge(api.load(ptr.payload, map_location="cpu"), state)
            self.files.save(p, obj, "portable")
            out.append(p)
        return out

    def _naming(self, url: str, step: int, besides: str) -> Iterator[tuple[str, pointer.Pointer]]:
        """The pointers other than the one at ``besides`` that name ``step`` of store ``url``:
        in the folder of ``besides`` and every folder pointers to that store were written into."""
        with self._lock:
            folders = {split_path(besides)[0], *self._folders.get(url, ())}
        for p in (p for d in sorted(folders) for p in self.files.listdir(d) if p != besides):
            ptr = self.files.pointer_at(p)
            if ptr is not None and ptr.step == step and self.own_store(p, ptr) == url:
                yield p, ptr

    def newest(self, d: str, prefer: str = "last") -> str | None:
        """The pointer in folder ``d`` naming the newest step its store holds (a name starting with
        ``prefer`` first among pointers to the same step), or None."""
        url = self.location(join_path(d, "x"))[0]
        if not is_s3(url) and not os.path.isdir(url):
            return None
        try:
            steps = set(self.open_store(url).steps())
        except CheckpointNotFoundError:
            return None
        best: tuple[int, bool, str] | None = None
        for p in self.files.listdir(d):
            ptr = self.files.pointer_at(p)
            if ptr is not None and ptr.step in steps and self.own_store(p, ptr) == url:
                best = max(best or (-1, False, ""), (ptr.step, split_path(p)[1].startswith(prefer), p))
        return None if best is None else best[2]


# --------------------------------------------------------------- values s4weights cannot store
_PLAIN_SCALARS = (type(None), bool, str, bytes, bytearray, complex, torch.dtype, torch.device, torch.Size)


def _plain(o: Any) -> bool:
    if isinstance(o, _PLAIN_SCALARS) or type(o) in (int, float):
        return True
    if isinstance(o, torch.Tensor):
        return type(o) in (torch.Tensor, torch.nn.Parameter)
    if type(o).__module__ != "numpy":
        return False
    if isinstance(o, np.ndarray):
        return o.dtype != object
    return isinstance(o, (np.generic, np.dtype)) and not isinstance(o, np.object_)


def _dict_kind(o: Any) -> bool:
    """dict, OrderedDict or Lightning's AttributeDict: the dict types s4weights stores as such."""
    return isinstance(o, dict) and (
        type(o) in (dict, collections.OrderedDict) or type(o).__qualname__.endswith("AttributeDict")
    )


def _plain_dict(o: Any) -> bool:
    """A dict s4weights stores as a dict: one of :func:`_dict_kind` with plain keys."""
    return _dict_kind(o) and all(_plain(k) for k in o)


def _extract(obj: Any, found: list[Any]) -> Any:
    if _plain(obj):
        return obj
    if _plain_dict(obj):
        out = type(obj)()
        out.update((k, _extract(v, found)) for k, v in obj.items())
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_extract(v, found) for v in obj)
    if type(obj) in (set, frozenset) and all(_plain(v) for v in obj):
        return obj
    if type(obj) is argparse.Namespace:
        return argparse.Namespace(**{k: _extract(v, found) for k, v in vars(obj).items()})
    found.append(obj)
    return {_OBJ_TAG: len(found) - 1}


def _restore(obj: Any, objects: list[Any]) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and _OBJ_TAG in obj and type(obj[_OBJ_TAG]) is int:
            return objects[obj[_OBJ_TAG]]
        for k in list(obj):
            obj[k] = _restore(obj[k], objects)
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_restore(v, objects) for v in obj)
    if type(obj) is argparse.Namespace:
        for k, v in vars(obj).items():
            setattr(obj, k, _restore(v, objects))
    return obj


def pack_objects(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every value s4weights cannot store without pickle replaced by a placeholder,
    those values serialised together with ``torch.save`` under one key.

    Raises:
        UnsupportedTypeError: ``torch.load(weights_only=True)`` could not load them back (checked
            now, not at resume).
    """
    found: list[Any] = []
    out = _extract(state, found)
    if not found:
        return dict(out)
    buf = io.BytesIO()
    torch.save(found, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        kinds = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in found})
        raise UnsupportedTypeError(
            f"the checkpoint holds objects s4weights cannot store without pickle ({', '.join(kinds)}), "
            f"and torch.load(weights_only=True) could not load them back either: {e}. Convert them to "
            "plain values (e.g. in on_save_checkpoint / save_hyperparameters(ignore=[...])) or allow-list "
            "their classes with torch.serialization.add_safe_globals([...])"
        ) from e
    out = dict(out)
    out[_OBJECTS] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return out


def unpack_objects(state: Any) -> Any:
    """Undo :func:`pack_objects` (the values load with ``torch.load(weights_only=True)``)."""
    if isinstance(state, dict) and _OBJECTS in state:
        blob = state.pop(_OBJECTS)
        objects = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        state = _restore(state, objects)
    return state


def snapshot(obj: Any) -> Any:
    """``obj`` with every tensor cloned on its device (training may go on while the copy is saved)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = type(obj)() if _dict_kind(obj) else {}
        out.update((k, snapshot(v)) for k, v in obj.items())
        return out
    if type(obj) in (list, tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


# ------------------------------------------------------------------ a second name for a step
_Path = tuple[Any, ...]


def _tensors(obj: Any, path: _Path = ()) -> Iterator[tuple[_Path, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif _plain_dict(obj):
        for k, v in obj.items():
            yield from _tensors(v, (*path, k))
    elif type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, (*path, i))


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor has no version counter
        return 0


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except (RuntimeError, TypeError):  # a dtype without a byte view (quantized...): not shared
        return False


class SavedStep:
    """The tensors of the step last written to a store, to recognise a later save of the same
    step under another name (Lightning's top-k file, then ``last.ckpt``) and store only a pointer.

    A tensor's version counter moves with every in-place write of autograd's ops. Tensors written
    in place since they were made (views of live parameters, most optimizer state) are held, which
    costs nothing, and are the same later while their version is. A tensor of version 0 may be a
    fresh copy (an asynchronous checkpointer's clone: holding it would keep a copy of the state
    alive until the next save) or state that kernels outside autograd's counting update in place
    (CUDA's foreach/fused optimizers leave Adam's moments at version 0): it is not held but
    fingerprinted -- xxh3 on the host, ``fold64`` on its GPU (one batched pass per device, without
    synchronizing) -- and is the same later where its dtype, shape and fingerprint are.
    """

    def __init__(self, step: int, checkpoint: Any) -> None:
        self.step = step
        self.tensors: dict[_Path, tuple[torch.Tensor, int]] = {}
        fresh: list[tuple[_Path, torch.Tensor]] = []
        for p, t in _tensors(checkpoint):
            v = _version(t)
            if v > 0:
                self.tensors[p] = (t, v)
            elif _printable(t):
                fresh.append((p, t))
        #: path -> (dtype, shape, fingerprint) of the version-0 tensors
        self.prints: dict[_Path, tuple[torch.dtype, torch.Size, Any]] = {
            p: (t.dtype, t.shape, f) for (p, t), f in zip(fresh, _fingerprints([t for _, t in fresh]))
        }

    def same(self, path: _Path, t: torch.Tensor) -> bool:
        return path in self._same_paths([(path, t)])

    def _held_same(self, path: _Path, t: torch.Tensor) -> bool:
        rec = self.tensors.get(path)
        if rec is None:
            return False
        old, version = rec
        if t.dtype != old.dtype or t.shape != old.shape or t.device != old.device or t.is_sparse or old.is_sparse:
            return False
        if t.numel() == 0:
            return True
        if t.data_ptr() == old.data_ptr() and t.stride() == old.stride():
            return _version(t) == version  # the same memory: unchanged unless written in place since
        return _bits_equal(t, old)  # another copy: compare the bits

    def _same_paths(self, items: list[tuple[_Path, torch.Tensor]]) -> set[_Path]:
        """The paths of ``items`` whose tensor is the stored step's (fingerprints: one pass and one
        synchronization per device)."""
        same = {p for p, t in items if self._held_same(p, t)}
        check = [
            (p, t) for p, t in items
            if p not in same and p in self.prints and _printable(t) and (t.dtype, t.shape) == self.prints[p][:2]
        ]  # fmt: skip
        now = _fingerprints([t for _, t in check])
        same.update(p for (p, _t), ok in zip(check, _prints_equal(now, [self.prints[p][2] for p, _t in check])) if ok)
        return same

    def skeleton(self, obj: Any) -> Any:
        """``obj`` with each tensor the step holds bit for bit at the same place replaced by a
        :data:`s4w_core.pointer.REF_KEY` placeholder."""
        return self._skeleton(obj, (), self._same_paths(list(_tensors(obj))))

    def _skeleton(self, obj: Any, path: _Path, same: set[_Path]) -> Any:
        if isinstance(obj, torch.Tensor):
            return {pointer.REF_KEY: True} if path in same else obj
        if _plain_dict(obj):
            out = type(obj)()
            out.update((k, self._skeleton(v, (*path, k), same)) for k, v in obj.items())
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self._skeleton(v, (*path, i), same) for i, v in enumerate(obj))
        return obj


def _printable(t: torch.Tensor) -> bool:
    """Whether :func:`_fingerprints` takes ``t``: a dense tensor on the host or on a CUDA device
    the GPU backend runs on (elsewhere a version-0 tensor is stored again under the second name)."""
    if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
        return False
    if t.device.type == "cpu":
        return True
    return t.device.type == "cuda" and gpu.available()


def _fingerprints(ts: list[torch.Tensor]) -> list[Any]:
    """A fingerprint of the bytes of each tensor (each :func:`_printable`): the xxh3 of a host
    tensor; for CUDA tensors ``(sums, k)``, element ``k`` of one :func:`s4w_core.gpu.fold64_sums`
    per device, left there (see :func:`_prints_equal`)."""
    out: list[Any] = [None] * len(ts)
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(ts):
        if t.device.type == "cpu":
            out[i] = ck.tensor_checksum(t.detach().reshape(-1).contiguous().view(torch.uint8))
        else:
            by_dev.setdefault(t.device, []).append(i)
    for idx in by_dev.values():
        sums = gpu.fold64_sums([ts[i] for i in idx])
        for k, i in enumerate(idx):
            out[i] = (sums, k)
    return out


def _prints_equal(now: list[Any], old: list[Any]) -> list[bool]:
    """Pairwise equality of :func:`_fingerprints` results; device ones compared on their device,
    one read-back per device."""
    eq = [isinstance(a, str) and a == b for a, b in zip(now, old)]
    by_dev: dict[torch.device, list[int]] = {}
    for i, (a, b) in enumerate(zip(now, old)):
        if isinstance(a, tuple) and isinstance(b, tuple) and a[0].device == b[0].device:
            by_dev.setdefault(a[0].device, []).append(i)
    for idx in by_dev.values():
        x = torch.stack([now[i][0][now[i][1]] for i in idx])
        y = torch.stack([old[i][0][old[i][1]] for i in idx])
        for i, ok in zip(idx, (x == y).tolist()):
            eq[i] = bool(ok)
    return eq

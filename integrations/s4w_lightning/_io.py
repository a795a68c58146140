"""The Lightning ``CheckpointIO`` plugin: compressed delta checkpoints at the paths Lightning gives.

What lands where (default, ``S4CheckpointIO()``) for ``ModelCheckpoint(dirpath="ckpts")``::

    ckpts/epoch=0-step=100.ckpt   a pointer file (s4w_core.pointer): {store ".s4w", step 100}
    ckpts/last.ckpt               another pointer, to the same step when saved at the same time
    ckpts/.s4w/                   a CheckpointStore whose steps are the trainer's global steps

The first name of a global step stores the step; a further name (``last.ckpt`` after a top-k
file) is only a pointer holding what differs, e.g. a callback's state.  Overwriting ``last.ckpt``
or removing a top-k file never rewrites stored data: a store step is deleted once no pointer
beside it names it.  ``torch.load`` on a pointer fails with one line saying how to load it.
Values s4weights cannot store without pickle are stored with ``torch.save`` and checked at save
time to load back with ``torch.load(weights_only=True)`` (:func:`s4w_core.frameworks.pack_objects`).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import threading
from typing import Any, Callable

import torch

import s4w_core
from s4w_core import FormatError, pointer
from s4w_core.framework_steps import Stores, prepare_profile
from s4w_core.frameworks import (
    Files,
    PointerFiles,
    SavedStep,
    SerialQueue,
    auto_location,
    is_s3,
    norm_path,
    pack_objects,
    snapshot,
    unpack_objects,
)
from s4w_core.store import CheckpointStore

log = logging.getLogger("s4w_lightning")

__all__ = ["S4CheckpointIO", "last_checkpoint", "load_checkpoint", "load_from_checkpoint", "STORE_DIRNAME"]

STORE_DIRNAME = ".s4w"  #: the store folder created beside the checkpoints when no ``store=`` is given
_LEGACY_POINTER = "s4w_lightning_pointer"  # the pointer inside a container, before pointer files


def _checkpoint_io_bases() -> tuple[type, ...]:
    """The ``CheckpointIO`` ABC of each Lightning flavour installed (``lightning``, ``pytorch_lightning``):
    one plugin class then passes both Trainers' isinstance checks."""
    bases: list[type] = []
    for mod in ("lightning.fabric.plugins.io.checkpoint_io", "lightning_fabric.plugins.io.checkpoint_io"):
        try:
            bases.append(__import__(mod, fromlist=["CheckpointIO"]).CheckpointIO)
        except ImportError:
            pass
    if not bases:  # pragma: no cover - the package __init__ checks this first
        raise ImportError("s4w_lightning needs PyTorch Lightning: pip install 's4weights[lightning]'")
    return tuple(bases)


def _hint(name: str) -> str:
    """The one line ``torch.load`` / ``LightningModule.load_from_checkpoint`` show for a pointer."""
    return (
        f"{name} is an s4weights checkpoint (a pointer into the .s4w/ store beside it): load it with "
        f's4w_lightning.load_from_checkpoint(MyModule, "{name}"), or convert it to a plain Lightning file with '
        f"`s4w restore {name} --out plain.ckpt`"
    )


def _saved_dropper(saved: dict[str, SavedStep], lock: threading.RLock) -> Callable[[str, int], None]:
    """``on_delete`` of the plugin's pointers: forget the step last written to a store once the
    store deletes it (no later name may point to it)."""

    def drop(url: str, step: int) -> None:
        with lock:
            if url in saved and saved[url].step == step:
                del saved[url]

    return drop


class _S4CheckpointIOImpl:
    def __init__(
        self,
        store: str | os.PathLike[str] | None = None,
        *,
        profile: str = "auto",
        delta: bool = True,
        keyframe_every: int = 10,
        async_save: bool = False,
        map_location: Any = "auto",
        rebase_on_delete: bool = False,
        store_options: dict[str, Any] | None = None,
    ) -> None:
        prepare_profile(profile)
        if store is not None and not delta:
            raise ValueError("store= needs delta=True (delta=False writes self-contained files at Lightning's paths)")
        self.store_url = None if store is None else norm_path(store)
        self.profile, self.delta, self.keyframe_every, self.async_save = profile, delta, keyframe_every, async_save
        self.map_location, self.rebase_on_delete = map_location, rebase_on_delete
        self.store_options = dict(store_options or {})
        self.files = Files(self.store_options)
        self._stores = Stores(**{"profile": profile, "keyframe_every": keyframe_every, **self.store_options})
        self._saved: dict[str, SavedStep] = {}  # per store: the step last written, for its second names
        self._newest: dict[str, int] = {}  # per store: the newest step it held or was saved to from here
        # path -> the store step the save at that path stored or named (kept after a remove: with
        # Lightning's AsyncCheckpointIO a remove can come before the save that announces it)
        self._named: dict[str, int] = {}
        self._top_k: dict[tuple[str, str], set[str]] = {}  # (store, checkpoint callback) -> its kept paths
        # Lightning's AsyncCheckpointIO calls save_checkpoint on its own thread, later than the
        # remove_checkpoint of the same path may come on the trainer's: the paths whose save has
        # begun (a remove waits for one in progress), and those removed before their save began
        # (that save then writes nothing)
        self._begun: set[str] = set()
        self._saving: set[str] = set()
        self._doomed: set[str] = set()
        self._save_thread: int | None = None  # the thread the last save began on
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # the pointers' callbacks reach the stores and the saved steps, not this plugin: a bound
        # method of it would make a reference cycle (plugin -> pointers -> plugin) that kept a
        # dropped plugin's stores and their host copy of the newest step alive until the cyclic GC
        self.pointers = PointerFiles(self.files, self._stores.open, store_url=self.store_url, dirname=STORE_DIRNAME,
                                     rebase_on_delete=rebase_on_delete, hint=_hint,
                                     on_delete=_saved_dropper(self._saved, self._lock))  # fmt: skip
        self._queue = SerialQueue(async_save, "s4w-lightning")  # saves and removes, in call order
        self.last_info: Any = None  #: the :class:`~s4w_core.store.StepInfo` of the last save that wrote data

    # ---- where things live
    def store_for(self, path: Any) -> CheckpointStore:
        """The :class:`CheckpointStore` the checkpoints saved at ``path`` go to."""
        return self.store_at(self.pointers.location(norm_path(path))[0])

    def store_at(self, url: str) -> CheckpointStore:
        return self._stores.open(url)

    def wait(self) -> None:
        """Block until every queued save/remove is done; re-raise the first error."""
        self._queue.wait()

    # ---- CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write ``checkpoint`` so that a file exists at exactly ``path`` (see the module doc)."""
        if storage_options is not None:
            raise TypeError(
                "S4CheckpointIO.save_checkpoint does not take storage_options; configure S4CheckpointIO(...) instead"
            )
        path = norm_path(path)
        with self._cond:
            if path in self._doomed:  # removed before this save began: superseded, nothing to write
                self._doomed.discard(path)
                log.debug("s4weights: %s was removed before its save began; not written", path)
                return
            self._begun.add(path)
            self._saving.add(path)
            self._save_thread = threading.get_ident()
        try:
            self._save(checkpoint, path)
        finally:
            with self._cond:
                self._saving.discard(path)
                self._cond.notify_all()

    def _save(self, checkpoint: dict[str, Any], path: str) -> None:
        if not self.delta:
            state = pack_objects(snapshot(checkpoint) if self.async_save else checkpoint)
            self._queue.submit(self.files.save, path, state, self.profile)
            return
        self._queue.raise_error()
        url, _ = self.pointers.location(path)
        st = self.store_at(url)
        meta = {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
        gs = checkpoint.get("global_step")
        step = gs if type(gs) is int and gs >= 0 else None
        # the pointer this save writes will name the step: no remove deletes it from here on (a
        # remove deleting it now is waited for first; it then is no second name)
        announced = None
        if step is not None:
            self.pointers.expect(url, step)
            announced = step
        try:
            if step is not None and self._replaces(url, st, step):
                self._keep_other_names(url, step, path)
            with self._lock:
                saved = self._saved.get(url)
                if step is None:  # not a Trainer's checkpoint: the next free step (after one in flight too)
                    known = [s for s in (st.latest(), None if saved is None else saved.step) if s is not None]
                    step = max(known) + 1 if known else 0
                    self.pointers.expect(url, step)
                    announced = step
                if saved is not None and saved.step == step:  # a second name: a pointer with what differs
                    self._named[path] = step
                    buf = io.BytesIO()
                    s4w_core.save(pack_objects(saved.skeleton(checkpoint)), buf, profile="portable")
                    announced = None  # the queued pointer settles it (or, skipped, the queue does)
                    self._queue.submit(
                        self._point, url, path, step, meta, buf.getvalue(), None,
                        skipped=functools.partial(self.pointers.settle, url, step),
                    )  # fmt: skip
                    return
                extra = {"path": path, **meta, "writer": "s4w_lightning"}
                state = pack_objects(checkpoint)
                self._saved[url] = SavedStep(step, checkpoint)
                self._announce_rotation(url, st, step, checkpoint)
                self._named[path] = step
                if self.async_save:
                    # the store's non-blocking save makes the state safe (GPU: one copy to reused pinned
                    # host buffers; CPU: a snapshot) and codes, writes and commits it on its own worker;
                    # the pointer follows on this plugin's queue, in call order with removes
                    handle = st.save_async(state, step, extra=extra, overwrite=True)
                    announced = None
                    self._queue.submit(
                        self._point, url, path, step, meta, None, handle,
                        skipped=functools.partial(self.pointers.settle, url, step),
                    )  # fmt: skip
                    return
            try:
                self.last_info = st.save(state, step, extra=extra, overwrite=True)
            except BaseException:
                self._saved.pop(url, None)
                raise
            self.pointers.write(path, step, meta, None)
        finally:
            if announced is not None:
                self.pointers.settle(url, announced)

    def _announce_rotation(self, url: str, st: CheckpointStore, step: int, checkpoint: dict[str, Any]) -> None:
        """Before saving ``step``: tell the store what a ``ModelCheckpoint`` that keeps the newest
        steps (``monitor="step"``) removes. The checkpoint carries each callback's state as of
        this save: a path that left its ``best_k_models`` is removed right after the save
        (``drop_pending``: its step gets no more background work); once it keeps ``save_top_k``
        files, its ``kth_best_model_path`` is removed after the next save (``expect_drop``: the
        re-encoding of that step, due behind this save when it is the step just below, is held).
        Callbacks with another monitor keep the top steps by a metric, which no save can
        foresee: nothing is announced for them."""
        states = checkpoint.get("callbacks")
        if not isinstance(states, dict):
            return
        for key, cb in states.items():
            if not isinstance(cb, dict) or cb.get("monitor") != "step" or not isinstance(cb.get("best_k_models"), dict):
                continue
            kept = {norm_path(p) for p in cb["best_k_models"] if isinstance(p, (str, os.PathLike))}
            before, self._top_k[(url, str(key))] = self._top_k.get((url, str(key)), set()), kept
            for p in before - kept:
                s = self._named.get(p)
                if s is not None and s != step:
                    st.drop_pending(s)
            kth = cb.get("kth_best_model_path")
            kth = norm_path(kth) if isinstance(kth, (str, os.PathLike)) and kth else None
            s = self._named.get(kth) if kth in kept else None
            if s is not None and s != step:
                st.expect_drop(s)

    def _replaces(self, url: str, st: CheckpointStore, step: int) -> bool:
        """Whether a save of ``step`` may replace a step of the store with other values: a step
        number at most the newest the store held when this plugin first saved to it, or saved
        since (a resumed run saving its steps again), and not a second name of the step just saved."""
        saved = self._saved.get(url)
        if saved is not None and saved.step == step:
            return False
        with self._lock:
            top = self._newest.get(url)
            if top is None:
                newest = st.latest()
                top = -1 if newest is None else newest
            self._newest[url] = max(top, step)
        return step <= top

    def _keep_other_names(self, url: str, step: int, path: str) -> None:
        """Before a save replaces store ``step``: the files that name it keep the values they
        were saved with (rewritten as self-contained files: ``PointerFiles.detach``), after the
        queued pointers and removes (which may name it too) are done."""
        self.wait()
        if step in self.store_at(url).steps():
            moved = self.pointers.detach(url, step, path)
            if moved:
                log.warning(
                    "s4weights: step %d of %s is saved again (a resumed run): %d file(s) naming its earlier "
                    "values were rewritten as self-contained files (%s)", step, url, len(moved), ", ".join(moved)
                )

    def _point(
        self, url: str, path: str, step: int, meta: dict[str, Any], payload: bytes | None, handle: Any
    ) -> None:
        """Write the pointer at ``path`` once the store committed ``handle``'s step, if any."""
        try:
            if handle is not None:
                self.last_info = handle.result()
            self.pointers.write(path, step, meta, payload)
        finally:
            self.pointers.settle(url, step)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load what :meth:`save_checkpoint` wrote at ``path`` (or a plain ``torch.save`` checkpoint).

        ``map_location``: as for ``torch.load``; default ``"auto"`` (the saved device where it exists
        here, else CPU). The step is read once (``CheckpointStore.load(remember=False)``): a resume
        does not wait for a host copy of it to be made as the next save's delta base; the next save
        re-encodes it from its object, as the HF and Accelerate adapters' resumes do.
        """
        self.wait()
        path = norm_path(path)
        loc = map_location if map_location is not None else self.map_location
        loc = auto_location if loc == "auto" else loc
        data = self.files.read(path)
        if pointer.is_pointer(data):
            ptr = pointer.parse(data, path)
            return unpack_objects(
                pointer.load(ptr, loc, expected_store=self.store_url, opener=self.store_at, remember=False)
            )
        try:
            obj = s4w_core.load(data, map_location=loc)
        except s4w_core.BadMagicError:  # a checkpoint written by Lightning's own TorchCheckpointIO
            for mod in ("lightning.fabric.plugins.io.torch_io", "lightning_fabric.plugins.io.torch_io"):
                try:
                    torch_io = __import__(mod, fromlist=["TorchCheckpointIO"]).TorchCheckpointIO()
                except ImportError:
                    continue
                kw = {"weights_only": weights_only, **({} if map_location is None else {"map_location": map_location})}
                return torch_io.load_checkpoint(path, **kw)
            raise FormatError(f"{path} is not an s4weights checkpoint") from None  # pragma: no cover
        if isinstance(obj, dict) and isinstance(obj.get(_LEGACY_POINTER), dict):  # written before pointer files
            old = obj[_LEGACY_POINTER]
            ptr = pointer.Pointer(path, str(old.get("store")), int(old.get("step", -1)))
            obj = pointer.load(ptr, loc, expected_store=self.store_url, opener=self.store_at, remember=False)
        return unpack_objects(obj)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file at ``path``; its store step goes too once no other file names it.  A
        save of ``path`` in progress on another thread is waited for; while saves come on another
        thread than this call (Lightning's AsyncCheckpointIO queues them on its own), a path never
        saved here and not there yet is one whose save has not begun: that save writes nothing."""
        path = norm_path(path)
        with self._cond:
            self._cond.wait_for(lambda: path not in self._saving)
            # (saves on the caller's own thread: a missing file is only missing)
            queued = self._save_thread != threading.get_ident()
            if queued and path not in self._begun and not self.files.exists(path):
                self._doomed.add(path)
                return
        self._queue.submit(self.pointers.remove if self.delta else self.files.remove, path)

    def teardown(self) -> None:
        """Finish queued saves and the stores' background work."""
        try:
            self.wait()
            for st in self._stores.opened():
                st.wait()
        finally:
            self._queue.close()


S4CheckpointIO = type(
    "S4CheckpointIO",
    (_S4CheckpointIOImpl, *_checkpoint_io_bases()),
    {
        "__module__": "s4w_lightning",
        "__doc__": """Lightning ``CheckpointIO`` writing s4weights compressed (delta) checkpoints.

    ``Trainer(plugins=[S4CheckpointIO()])``, with ``lightning.Trainer`` or ``pytorch_lightning.Trainer``.

    Args:
        store: where the data lives: a local directory or ``s3://bucket/prefix``. Default: a
            ``.s4w`` folder beside each checkpoint path Lightning gives (local or S3).
        profile: ``"auto"`` (GPU codecs for tensors on a usable GPU), ``"portable"`` or ``"fast"``.
        delta: code each checkpoint against the previous one where that pays (default); ``False``
            writes one self-contained compressed file at each path, no store.
        keyframe_every: a full checkpoint at least every that many saves (bounds restore reads).
        async_save: return once the state is safe to modify (:meth:`CheckpointStore.save_async`;
            with ``delta=False``, tensors cloned and the file written in the background). Saves
            and removes run in call order; errors surface on the next call.
        map_location: default device mapping on load (``"auto"``: saved device if present, else CPU).
        rebase_on_delete: re-code the kept steps that are deltas on a removed step so its data is
            reclaimed at once (re-writes stored data; default: a remove writes nothing).
        store_options: more :class:`CheckpointStore` arguments (``endpoint``, ``region``...).
    Raises:
        UnsupportedTypeError: at save, for objects neither s4weights nor ``torch.load(weights_only=True)``
            can restore.
    """,
    },
)


# ----------------------------------------------------------------------------- helpers for users
def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu", **store_options: Any) -> dict[str, Any]:
    """Load the Lightning checkpoint dict that :class:`S4CheckpointIO` wrote at ``path``."""
    return S4CheckpointIO(store_options=store_options).load_checkpoint(path, map_location=map_location)


def last_checkpoint(dirpath: str | os.PathLike[str], *, store: str | None = None, **store_options: Any) -> str | None:
    """The checkpoint path of the newest save under ``dirpath`` (``None`` if there is none): what
    ``ckpt_path="last"`` does, also for ``s3://`` dirpaths (where Lightning starts from scratch)."""
    d = norm_path(dirpath)
    d = d.rstrip("/") if is_s3(d) else os.path.abspath(d)
    return S4CheckpointIO(store=store, store_options=store_options).pointers.newest(d)


def load_from_checkpoint(
    cls: type, checkpoint_path: str | os.PathLike[str], map_location: Any = None, strict: bool | None = None, **kw: Any
) -> Any:
    """``MyModule.load_from_checkpoint(path)`` for s4weights checkpoints (Lightning's own bypasses
    CheckpointIO and would ``torch.load`` the pointer); ``cls`` a LightningModule or
    LightningDataModule subclass; the module comes back on the device of its stored tensors."""
    for flavour in ("lightning.pytorch", "pytorch_lightning"):
        try:
            pkg = __import__(flavour, fromlist=["LightningModule", "LightningDataModule"])
        except ImportError:
            continue
        if issubclass(cls, (pkg.LightningModule, pkg.LightningDataModule)):
            load_state = __import__(f"{flavour}.core.saving", fromlist=["_load_state"])._load_state
            break
    else:
        raise TypeError(f"{cls!r} is not a LightningModule or LightningDataModule subclass")
    checkpoint = load_checkpoint(checkpoint_path, map_location=map_location if map_location is not None else "cpu")
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kw)  # type: ignore[attr-defined]  # a LightningModule / DataModule (checked above)
    if issubclass(cls, pkg.LightningDataModule):
        return load_state(cls, checkpoint, **kw)
    model = load_state(cls, checkpoint, strict=strict, **kw)
    tensors = [t for t in (checkpoint.get("state_dict") or {}).values() if isinstance(t, torch.Tensor)]
    return model.to(tensors[0].device) if tensors else model

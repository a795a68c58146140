"""The Lightning ``CheckpointIO`` plugin: compressed delta checkpoints at the paths Lightning gives.

What lands where (default, ``S4CheckpointIO()``) for ``ModelCheckpoint(dirpath="ckpts")``::

    ckpts/epoch=0-step=100.ckpt   a small s4weights container: a pointer {store, step} to ...
    ckpts/last.ckpt               ... another pointer
    ckpts/.s4w/                   a CheckpointStore holding the checkpoints as base -> delta chains

Every ``save_checkpoint`` call becomes one new step of the store (a counter, not the global step:
Lightning saves the same global step under several names, e.g. a top-k file and ``last.ckpt``; the
second one is then a near-empty delta).  ``remove_checkpoint`` deletes the pointer and the store
step; the store keeps the data of a removed step for as long as a kept step is a delta on it.
``S4CheckpointIO(delta=False)`` writes one self-contained container at each path instead.

Values s4weights cannot store without pickle (e.g. arbitrary objects in ``hyper_parameters``) are
serialised with ``torch.save`` and must load back with ``torch.load(weights_only=True)``; this is
checked at save time, and a value that would not load raises
:class:`~s4w_core.UnsupportedTypeError` then, not at resume (allow-list your own classes with
``torch.serialization.add_safe_globals``).
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

import s4w_core
from s4w_core import CheckpointNotFoundError, FormatError, UnsupportedTypeError
from s4w_core.store import CheckpointStore, open_backend

__all__ = ["S4CheckpointIO", "last_checkpoint", "load_checkpoint", "load_from_checkpoint", "STORE_DIRNAME"]

#: the store folder created beside the checkpoints when no ``store=`` is given.
STORE_DIRNAME = ".s4w"
_POINTER = "s4w_lightning_pointer"
_OBJECTS = "__s4w_torch_objects__"
_OBJ_TAG = "__s4w_torch_object__"


# ----------------------------------------------------------------------------- bases
def _checkpoint_io_bases() -> tuple[type, ...]:
    """The CheckpointIO ABC of every Lightning flavour installed (lightning and/or pytorch_lightning):
    one plugin class then passes both Trainers' isinstance checks."""
    bases: list[type] = []
    try:
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as A

        bases.append(A)
    except ImportError:
        pass
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as B

        bases.append(B)
    except ImportError:
        pass
    if not bases:  # pragma: no cover - the package __init__ checks this first
        raise ImportError("s4w_lightning needs PyTorch Lightning: pip install 's4weights[lightning]'")
    return tuple(bases)


# ----------------------------------------------------------------------------- paths
def _norm(path: Any) -> str:
    s = os.fspath(path)
    # FSDP / ModelParallel strategies pass Path("s3://b/k"), which collapses to "s3:/b/k"
    if s.startswith("s3:/") and not s.startswith("s3://"):
        s = "s3://" + s[len("s3:/") :]
    return s


def _is_s3(path: str) -> bool:
    return path.startswith("s3://")


def _split(path: str) -> tuple[str, str]:
    if _is_s3(path):
        d, _, name = path.rstrip("/").rpartition("/")
        return d, name
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def _join(d: str, rel: str) -> str:
    if _is_s3(d):
        return d.rstrip("/") + "/" + rel
    return os.path.join(d, rel)


# ----------------------------------------------------------------------------- objects s4w cannot store
_PLAIN_SCALARS = (type(None), bool, str, bytes, bytearray, complex, torch.dtype, torch.device, torch.Size)


def _plain(o: Any) -> bool:
    if isinstance(o, _PLAIN_SCALARS) or type(o) in (int, float):
        return True
    if isinstance(o, torch.Tensor):
        return type(o) in (torch.Tensor, torch.nn.Parameter)
    if type(o).__module__ == "numpy":
        import numpy as np

        if isinstance(o, np.ndarray):
            return o.dtype != object
        return isinstance(o, (np.generic, np.dtype)) and not isinstance(o, np.object_)
    return False


def _registered_dict(o: Any) -> bool:
    if type(o) in (dict, collections.OrderedDict):
        return True
    n = f"{type(o).__module__}.{type(o).__qualname__}"
    return n.endswith("AttributeDict") and isinstance(o, dict)


def _extract(obj: Any, found: list[Any]) -> Any:
    """Replace values s4weights cannot store by placeholders; they go to ``found``."""
    if _plain(obj):
        return obj
    if isinstance(obj, dict) and _registered_dict(obj):
        items = [(k, _extract(v, found)) for k, v in obj.items()]
        if all(_plain(k) for k, _ in items):
            out = type(obj)()
            out.update(items)
            return out
    elif type(obj) is list:
        return [_extract(v, found) for v in obj]
    elif type(obj) is tuple:
        return tuple(_extract(v, found) for v in obj)
    elif type(obj) in (set, frozenset) and all(_plain(v) for v in obj):
        return obj
    elif type(obj) is argparse.Namespace:
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
    if type(obj) is list:
        return [_restore(v, objects) for v in obj]
    if type(obj) is tuple:
        return tuple(_restore(v, objects) for v in obj)
    if type(obj) is argparse.Namespace:
        for k, v in vars(obj).items():
            setattr(obj, k, _restore(v, objects))
    return obj


def _pack(checkpoint: dict[str, Any]) -> dict[str, Any]:
    found: list[Any] = []
    state = _extract(checkpoint, found)
    if found:
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
        state = dict(state)
        state[_OBJECTS] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return state


def _unpack(state: Any) -> Any:
    if isinstance(state, dict) and _OBJECTS in state:
        blob = state.pop(_OBJECTS)
        objects = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        state = _restore(state, objects)
    return state


def _snapshot(obj: Any) -> Any:
    """Clone every tensor (on its device) so training may go on while a copy is saved."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = type(obj)() if _registered_dict(obj) else {}
        out.update((k, _snapshot(v)) for k, v in obj.items())
        return out
    if type(obj) is list:
        return [_snapshot(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_snapshot(v) for v in obj)
    return obj


def _auto_location(orig: str) -> str:
    dev = torch.device(orig)
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        return "cpu"
    if dev.type not in ("cpu", "cuda", "meta"):
        return "cpu"
    return orig


# ----------------------------------------------------------------------------- the plugin
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
        rebase_on_delete: bool = True,
        store_options: dict[str, Any] | None = None,
    ) -> None:
        if profile not in s4w_core.PROFILES:
            raise ValueError(f"profile must be one of {s4w_core.PROFILES}, got {profile!r}")
        if store is not None and not delta:
            raise ValueError("store= needs delta=True (delta=False writes self-contained files at Lightning's paths)")
        self.store_url = None if store is None else _norm(store)
        self.profile = profile
        if profile != "portable":  # the GPU codec compiled once training has started CUDA
            s4w_core.gpu.warm_up(when_cuda_used=True)
        self.delta = delta
        self.keyframe_every = keyframe_every
        self.async_save = async_save
        self.map_location = map_location
        self.rebase_on_delete = rebase_on_delete
        self.store_options = dict(store_options or {})
        self._stores: dict[str, CheckpointStore] = {}
        self._last_step: dict[str, int] = {}  # last step number handed out per store (async saves)
        self._backends: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[Any]] = []
        self._error: BaseException | None = None
        #: the :class:`~s4w_core.store.StepInfo` of the last save (ratio, kind, bytes), for logging.
        self.last_info: Any = None

    # ---- where things live
    def _store(self, url: str) -> CheckpointStore:
        with self._lock:
            st = self._stores.get(url)
            if st is None:
                opts = {"profile": self.profile, "keyframe_every": self.keyframe_every, **self.store_options}
                st = self._stores[url] = CheckpointStore(url, **opts)
            return st

    def _store_for(self, path: str) -> tuple[str, str]:
        """(store url, the reference a pointer at ``path`` records: relative when beside it)."""
        if self.store_url is not None:
            url = self.store_url if _is_s3(self.store_url) else os.path.abspath(self.store_url)
            return url, url
        d, _ = _split(path)
        return _join(d, STORE_DIRNAME), STORE_DIRNAME

    def _backend(self, d: str) -> Any:
        with self._lock:
            b = self._backends.get(d)
            if b is None:
                opts = {
                    k: v
                    for k, v in self.store_options.items()
                    if k in ("region", "endpoint", "force_path_style", "unsigned", "client_options")
                }
                b = self._backends[d] = open_backend(d, **opts)
            return b

    def _write_file(self, path: str, obj: Any, profile: str) -> Any:
        if _is_s3(path):
            d, name = _split(path)
            with self._backend(d).writer(name) as fp:
                return s4w_core.save(obj, fp, profile=profile)
        return s4w_core.save(obj, path, profile=profile)

    def _read_file(self, path: str, map_location: Any) -> Any:
        if _is_s3(path):
            d, name = _split(path)
            try:
                data = self._backend(d).get(name)
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(f"Checkpoint file not found: {path}") from None
            return s4w_core.load(data, map_location=map_location)
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"Checkpoint file not found: {path}")
        return s4w_core.load(path, map_location=map_location)

    def _pointer_at(self, path: str) -> dict[str, Any] | None:
        try:
            obj = self._read_file(path, "cpu")
        except (CheckpointNotFoundError, FormatError):
            return None
        return obj.get(_POINTER) if isinstance(obj, dict) and isinstance(obj.get(_POINTER), dict) else None

    def _resolve_store(self, path: str, ref: str) -> str:
        if _is_s3(ref) or os.path.isabs(ref):
            return ref
        return _join(_split(path)[0], ref)

    # ---- background queue (async_save=True): saves and removes run in call order
    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.async_save:
            fn(*args)
            return
        self._raise_pending()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s4w-lightning")

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # re-raised on the training thread by the next call
                self._error = e
                raise

        self._pending.append(self._executor.submit(run))

    def _raise_pending(self) -> None:
        self._pending = [f for f in self._pending if not f.done()]
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def wait(self) -> None:
        """Block until every queued save/remove is done; re-raise the first error."""
        for f in list(self._pending):
            try:
                f.result()
            except BaseException:
                pass
        self._pending = []
        self._raise_pending()

    # ---- CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write ``checkpoint`` so that a file exists at exactly ``path`` (see the module doc)."""
        if storage_options is not None:
            raise TypeError(
                "S4CheckpointIO.save_checkpoint does not take storage_options; configure S4CheckpointIO(...) instead"
            )
        path = _norm(path)
        if self.async_save and self.delta:
            # the store's non-blocking save makes the state safe (GPU: one copy to reused pinned
            # host buffers; CPU: a snapshot) and codes, writes and commits it on its own worker;
            # the pointer file follows on this plugin's queue, in call order with removes
            self._raise_pending()
            url, ref = self._store_for(path)
            st = self._store(url)
            gs, ep = checkpoint.get("global_step"), checkpoint.get("epoch")
            with self._lock:
                last = self._last_step.get(url)
                if last is None:
                    latest = st.latest()
                    last = -1 if latest is None else latest
                step = last + 1
                self._last_step[url] = step
                extra = {"path": path, "global_step": gs, "epoch": ep, "writer": "s4w_lightning"}
                handle = st.save_async(_pack(checkpoint), step, extra=extra)
            self._submit(self._after_save, handle, path, url, ref, step, gs, ep)
            return
        state = _pack(_snapshot(checkpoint) if self.async_save else checkpoint)
        self._submit(self._save_now, state, path, checkpoint.get("global_step"), checkpoint.get("epoch"))

    def _after_save(self, handle: Any, path: str, url: str, ref: str, step: int, global_step: Any, epoch: Any) -> None:
        """Background part of an ``async_save`` delta save: wait for the store's commit, then write
        the pointer at ``path`` and drop the step the old pointer named (as :meth:`_save_now`)."""
        old = self._pointer_at(path)
        self.last_info = handle.result()
        pointer = {_POINTER: {"version": 1, "store": ref, "step": step, "global_step": global_step, "epoch": epoch}}
        self._write_file(path, pointer, "portable")
        if old is not None and self._resolve_store(path, old["store"]) == url and old["step"] != step:
            self._forget(url, int(old["step"]), path)

    def _save_now(self, state: dict[str, Any], path: str, global_step: Any, epoch: Any) -> None:
        if not self.delta:
            self._write_file(path, state, self.profile)
            return
        url, ref = self._store_for(path)
        st = self._store(url)
        old = self._pointer_at(path)
        with self._lock:
            last = st.latest()
            step = 0 if last is None else last + 1
            self._last_step[url] = step
            extra = {"path": path, "global_step": global_step, "epoch": epoch, "writer": "s4w_lightning"}
            self.last_info = st.save(state, step, extra=extra)
        pointer = {_POINTER: {"version": 1, "store": ref, "step": step, "global_step": global_step, "epoch": epoch}}
        self._write_file(path, pointer, "portable")
        if old is not None and self._resolve_store(path, old["store"]) == url and old["step"] != step:
            self._forget(url, int(old["step"]), path)

    def _forget(self, url: str, step: int, removed_path: str) -> None:
        """Delete store ``step`` unless another pointer beside ``removed_path`` still names it."""
        if not _is_s3(removed_path):
            d, name = _split(removed_path)
            try:
                siblings = os.listdir(d)
            except FileNotFoundError:
                siblings = []
            for n in siblings:
                p = os.path.join(d, n)
                if n == name or os.path.islink(p) or not os.path.isfile(p) or os.path.getsize(p) > (1 << 16):
                    continue
                ptr = self._pointer_at(p)
                if ptr is not None and self._resolve_store(p, ptr["store"]) == url and int(ptr["step"]) == step:
                    return
        try:
            self._store(url).delete(step, rebase=self.rebase_on_delete)
        except CheckpointNotFoundError:
            pass

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load what :meth:`save_checkpoint` wrote at ``path`` (or a plain ``torch.save`` checkpoint).

        ``map_location``: as for ``torch.load``; default ``"auto"`` (the saved device where it exists
        here, else CPU).
        """
        self.wait()
        path = _norm(path)
        loc = map_location if map_location is not None else self.map_location
        if loc == "auto":
            loc = _auto_location
        try:
            obj = self._read_file(path, loc)
        except FormatError as e:
            if "magic" not in str(e).lower():
                raise
            return self._torch_fallback(path, map_location, weights_only)
        if isinstance(obj, dict) and isinstance(obj.get(_POINTER), dict):
            ptr = obj[_POINTER]
            url = self._resolve_store(path, ptr["store"])
            obj = self._store(url).load(int(ptr["step"]), loc)
        return _unpack(obj)

    def _torch_fallback(self, path: str, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """Not an s4weights file: a checkpoint written by Lightning's own TorchCheckpointIO."""
        for mod in ("lightning.fabric.plugins.io.torch_io", "lightning_fabric.plugins.io.torch_io"):
            try:
                TorchCheckpointIO = __import__(mod, fromlist=["TorchCheckpointIO"]).TorchCheckpointIO
            except ImportError:
                continue
            kw: dict[str, Any] = {"weights_only": weights_only}
            if map_location is not None:
                kw["map_location"] = map_location
            return TorchCheckpointIO().load_checkpoint(path, **kw)
        raise FormatError(f"{path} is not an s4weights checkpoint")  # pragma: no cover

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file at ``path`` and its store step (kept deltas on it stay loadable)."""
        path = _norm(path)
        self._submit(self._remove_now, path)

    def _remove_now(self, path: str) -> None:
        ptr = self._pointer_at(path) if self.delta else None
        if _is_s3(path):
            d, name = _split(path)
            self._backend(d).delete(name)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        if ptr is not None:
            self._forget(self._resolve_store(path, ptr["store"]), int(ptr["step"]), path)

    def teardown(self) -> None:
        """Finish queued saves (``async_save=True``) and the stores' background work (the last
        step's keyframe copy), and release store clients."""
        try:
            self.wait()
            for st in list(self._stores.values()):
                st.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


S4CheckpointIO = type(
    "S4CheckpointIO",
    (_S4CheckpointIOImpl, *_checkpoint_io_bases()),
    {
        "__module__": "s4w_lightning",
        "__doc__": """Lightning ``CheckpointIO`` writing s4weights compressed (delta) checkpoints.

    ``Trainer(plugins=[S4CheckpointIO()])`` — works with ``lightning.Trainer`` and
    ``pytorch_lightning.Trainer`` alike (the class subclasses the ``CheckpointIO`` of both).

    Args:
        store: where the checkpoints' data lives: a local directory or ``s3://bucket/prefix``
            (a :class:`s4w_core.store.CheckpointStore`). Default: a ``.s4w`` folder beside each
            checkpoint path Lightning gives (local or S3).
        profile: ``"auto"`` (GPU codecs for tensors on a usable GPU), ``"portable"`` (decodable on
            any machine) or ``"fast"``.
        delta: code each checkpoint against the previous one where that pays (default). With
            ``False``, each path holds a self-contained compressed checkpoint and no store is used.
        keyframe_every: a full checkpoint at least every that many saves (bounds restore reads).
        async_save: return before the checkpoint is durable. With ``delta`` (the default) this is
            :meth:`CheckpointStore.save_async`: the training thread waits only until the state is
            safe to modify (GPU state: one copy to reused pinned host buffers; CPU state: a
            snapshot), coding, writing and the commit run in the background; with ``delta=False``
            tensors are cloned on their device and the file is written in a background thread.
            Saves and removes run in call order; errors surface on the next call;
            ``load_checkpoint``/``teardown`` wait.
        map_location: default device mapping on load (``"auto"``: saved device if present, else CPU).
        rebase_on_delete: when Lightning removes a checkpoint that a kept one is a delta on, re-code
            the kept one (against an older kept step, or as a keyframe) so the removed data is
            reclaimed at once (default). ``False``: cheaper removes; the base's data stays until
            its dependents go.
        store_options: more :class:`CheckpointStore` arguments (``endpoint``, ``region``, ``threads``...).
    Raises:
        UnsupportedTypeError: at save, for objects neither s4weights nor ``torch.load(weights_only=True)``
            can restore.
    Example:
        >>> from s4w_lightning import S4CheckpointIO
        >>> io = S4CheckpointIO(profile="portable")
        >>> io.delta
        True
    """,
    },
)


# ----------------------------------------------------------------------------- helpers for users
def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu", **store_options: Any) -> dict[str, Any]:
    """Load the Lightning checkpoint dict that :class:`S4CheckpointIO` wrote at ``path``.

    Example:
        ``ckpt = s4w_lightning.load_checkpoint("ckpts/last.ckpt"); ckpt["global_step"]``
    """
    return S4CheckpointIO(store_options=store_options).load_checkpoint(path, map_location=map_location)


def last_checkpoint(dirpath: str | os.PathLike[str], *, store: str | None = None, **store_options: Any) -> str | None:
    """The checkpoint path of the newest save under ``dirpath``: what ``ckpt_path="last"`` does,
    also for ``s3://`` dirpaths (where Lightning silently starts from scratch).

    Use it as ``trainer.fit(model, ckpt_path=s4w_lightning.last_checkpoint("s3://b/run/ckpts"))``;
    returns ``None`` when there is none (then ``fit`` starts from scratch).
    """
    d = _norm(dirpath)
    url = _norm(store) if store is not None else _join(d if _is_s3(d) else os.path.abspath(d), STORE_DIRNAME)
    io_ = S4CheckpointIO(store=url, store_options=store_options)
    try:
        st = io_._store(url)
        infos = st.list()
    except CheckpointNotFoundError:
        return None
    for info in reversed(infos):
        p = info.extra.get("path") if isinstance(info.extra, dict) else None
        if not p:
            continue
        ptr = io_._pointer_at(p)
        if ptr is not None and int(ptr["step"]) == info.step:
            return str(p)
    return None


def load_from_checkpoint(
    cls: type,
    checkpoint_path: str | os.PathLike[str],
    map_location: Any = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``MyModule.load_from_checkpoint(path)`` for s4weights checkpoints (Lightning's own
    ``load_from_checkpoint`` bypasses CheckpointIO and would call ``torch.load`` on the pointer).

    Args:
        cls: a ``LightningModule`` or ``LightningDataModule`` subclass.
        checkpoint_path: a path :class:`S4CheckpointIO` wrote (local or ``s3://``).
        map_location: as for ``torch.load`` (default: CPU).
        strict, **kwargs: as for ``LightningModule.load_from_checkpoint`` (kwargs override hparams).
    Returns:
        The restored module (moved to the device of its stored tensors).
    """
    saving = None
    for flavour in ("lightning.pytorch", "pytorch_lightning"):
        try:
            pkg = __import__(flavour, fromlist=["LightningModule", "LightningDataModule"])
        except ImportError:
            continue
        if issubclass(cls, (pkg.LightningModule, pkg.LightningDataModule)):
            saving = __import__(f"{flavour}.core.saving", fromlist=["_load_state"])
            break
    if saving is None:
        raise TypeError(f"{cls!r} is not a LightningModule or LightningDataModule subclass")
    checkpoint = load_checkpoint(checkpoint_path, map_location=map_location if map_location is not None else "cpu")
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pkg.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    model = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    sd = checkpoint.get("state_dict") or {}
    device = next((t for t in sd.values() if isinstance(t, torch.Tensor)), torch.tensor(0)).device
    return model.to(device)

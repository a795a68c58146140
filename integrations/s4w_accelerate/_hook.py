"""Switch ``Accelerator.save_state`` / ``load_state`` to compressed delta checkpoints.

Enabled by the environment (``accelerate launch`` passes it to every worker) plus one import::

    S4W_ACCELERATE=1 accelerate launch train.py        # train.py has: import s4w_accelerate

or explicitly with ``s4w_accelerate.enable(...)``.  Environment variables (read at import):

=============================  ==============================================================
``S4W_ACCELERATE``             ``1``/``true``: enable with the store beside the checkpoint
                               folders (``<parent>/.s4w``, or ``<project_dir>/.s4w`` with
                               automatic checkpoint naming); or a URL (local dir, ``s3://...``)
``S4W_ACCELERATE_KEEP_LOCAL``  ``0`` drops the raw files once stored (default ``1``: keep)
``S4W_ACCELERATE_PROFILE``     ``auto`` (default), ``portable`` or ``fast``
``S4W_ACCELERATE_KEYFRAME``    a full checkpoint at least every N saves (default 10)
``S4W_ACCELERATE_ASYNC``       ``1``: compress and write in the background (``save_async``)
=============================  ==============================================================

After Accelerate writes a checkpoint folder (``model.safetensors``, ``optimizer.bin``,
``scheduler.bin``, ``random_states_*.pkl``, ...), the main process packs every file of it
(:func:`s4w_core.pack_folder`) into a :class:`~s4w_core.store.CheckpointStore` step, a delta on the
previous one where that pays.  ``load_state`` on a folder that is missing or whose raw files were
dropped first rebuilds it from the store, byte for byte.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any

import s4w_core
from s4w_core import CheckpointNotFoundError
from s4w_core.store import CheckpointStore

__all__ = [
    "enable", "disable", "enabled", "restore", "config", "finish_pending", "MARKER_NAME", "STORE_DIRNAME", "ENV",
]  # fmt: skip

ENV = "S4W_ACCELERATE"
STORE_DIRNAME = ".s4w"
MARKER_NAME = "s4w_checkpoint.json"
_DIGITS = re.compile(r"(\d+)(?!.*\d)")


@dataclass
class _Config:
    store: str | None = None
    keep_local: bool = True
    profile: str = "auto"
    keyframe_every: int = 10
    store_options: dict[str, Any] | None = None
    async_save: bool = False


@dataclass
class _Pending:
    """A background save not yet known to be durable, and what to do once it is."""

    handle: Any
    acc: Any
    store: CheckpointStore
    folder: str
    files: list[str]


_config: _Config | None = None
_originals: dict[str, Any] = {}
_stores: dict[str, CheckpointStore] = {}
_pending: _Pending | None = None


def config() -> _Config | None:
    """The active configuration, or None when the hook is off."""
    return _config


def enabled() -> bool:
    return _config is not None


def _default_store(folder: str) -> str:
    """``<parent>/.s4w``; for Accelerate's automatic naming (``<project>/checkpoints/checkpoint_N``)
    ``<project>/.s4w``, because its ``total_limit`` rotation counts every entry of ``checkpoints/``."""
    parent = os.path.dirname(os.path.abspath(folder))
    if os.path.basename(parent) == "checkpoints":
        parent = os.path.dirname(parent)
    return os.path.join(parent, STORE_DIRNAME)


def _store_url(folder: str) -> str:
    if _config is not None and _config.store:
        return _config.store if _config.store.startswith("s3://") else os.path.abspath(_config.store)
    return _default_store(folder)


def _store(url: str) -> CheckpointStore:
    st = _stores.get(url)
    if st is None:
        assert _config is not None
        opts = {"profile": _config.profile, "keyframe_every": _config.keyframe_every, **(_config.store_options or {})}
        st = _stores[url] = CheckpointStore(url, **opts)
    return st


def _step_for(folder: str, st: CheckpointStore) -> int:
    m = _DIGITS.search(os.path.basename(os.path.normpath(folder)))
    if m:
        return int(m.group(1))
    last = st.latest()
    return 0 if last is None else last + 1


def _after_save(acc: Any, folder: str) -> None:
    global _pending
    assert _config is not None
    acc.wait_for_everyone()  # every process wrote its random_states_{i}.pkl
    if acc.is_main_process:
        finish_pending()
        st = _store(_store_url(folder))
        tree = s4w_core.pack_folder(folder, exclude=lambda rel: rel == MARKER_NAME)
        files = sorted(tree["files"])
        name = os.path.basename(os.path.normpath(folder))
        extra = {"writer": "s4w_accelerate", "folder": name, "files": files, "num_processes": acc.num_processes}
        step = _step_for(folder, st)
        if _config.async_save:
            _pending = _Pending(st.save_async(tree, step, extra=extra, overwrite=True), acc, st, folder, files)
        else:
            acc._s4w_last_info = st.save(tree, step, extra=extra, overwrite=True)
            _after_durable(st, folder, files, acc._s4w_last_info.step)
    acc.wait_for_everyone()


def finish_pending() -> None:
    """Wait for the background save (``async_save=True``), then drop its raw files and mirror
    rotation; raises its error if it failed (the raw files then stay). ``save_state`` and
    ``load_state`` call it first; call it at the end of training to drop the last save's raw files
    (at interpreter exit the save itself is still waited for and a failure logged)."""
    global _pending
    p, _pending = _pending, None
    if p is None:
        return
    info = p.handle.result()
    p.acc._s4w_last_info = info
    _after_durable(p.store, p.folder, p.files, info.step)


def _after_durable(st: CheckpointStore, folder: str, files: list[str], step: int) -> None:
    """``folder`` is committed as ``step``: drop its raw files (``keep_local=False``), mirror rotation."""
    assert _config is not None
    name = os.path.basename(os.path.normpath(folder))
    if not _config.keep_local:  # a folder rotation removed since is left alone
        s4w_core.replace_with_marker(folder, files, MARKER_NAME, {"store": st.url, "step": step, "files": files})
    # mirror Accelerate's total_limit rotation: steps whose folder is gone leave the store
    parent = os.path.dirname(os.path.abspath(folder))
    for info in st.list():
        f = info.extra.get("folder")
        if (
            info.extra.get("writer") == "s4w_accelerate"
            and f
            and f != name
            and not os.path.isdir(os.path.join(parent, f))
        ):
            st.delete(info.step, rebase=True)  # bounded bytes: kept deltas re-coded, data reclaimed


def restore(
    folder: str | os.PathLike[str], store: str | None = None, step: int | None = None, **store_options: Any
) -> str:
    """Rebuild the checkpoint folder ``folder`` from its store (byte for byte) and return it.

    Args:
        folder: the folder ``save_state`` wrote (it may be gone, or hold only the marker).
        store: the store URL (default: the configured one, else ``<parent>/.s4w``).
        step: the store step (default: the step saved from a folder of that name).
    Raises:
        CheckpointNotFoundError: the store has no such checkpoint.
    """
    folder = os.fspath(folder)
    url = store or _store_url(folder)
    st = CheckpointStore(url, **store_options)
    name = os.path.basename(os.path.normpath(folder))
    if step is None:
        for info in reversed(st.list()):
            if info.extra.get("folder") == name:
                step = info.step
                break
        else:
            raise CheckpointNotFoundError(f"the store {url} has no checkpoint saved from a folder named {name!r}")
    info = st.info(step)
    tree = st.load(step, "cpu")
    os.makedirs(folder, exist_ok=True)
    s4w_core.unpack_folder(tree, folder)
    marker = os.path.join(folder, MARKER_NAME)
    if os.path.exists(marker):
        os.remove(marker)
    missing = [f for f in info.extra.get("files", []) if not os.path.exists(os.path.join(folder, *f.split("/")))]
    if missing:
        raise CheckpointNotFoundError(f"{folder}: {missing} missing after restore")
    return folder


def _needs_restore(folder: str) -> bool:
    return not os.path.isdir(folder) or os.path.exists(os.path.join(folder, MARKER_NAME))


def _save_state(self: Any, output_dir: str | None = None, safe_serialization: bool = True, **kw: Any) -> Any:
    location = _originals["save_state"](self, output_dir, safe_serialization, **kw)
    if _config is not None:
        _after_save(self, os.fspath(location))
    return location


def _load_state(self: Any, input_dir: str | None = None, load_kwargs: dict | None = None, **kw: Any) -> Any:
    if _config is not None:
        if self.is_main_process:
            finish_pending()  # a restore reads the store through another store object
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            base = os.path.join(self.project_dir, "checkpoints")
            if os.path.isdir(base):
                folders = [os.path.join(base, f) for f in os.listdir(base)]
                folders = [f for f in folders if _DIGITS.search(os.path.basename(f))]
                if folders:
                    input_dir = max(folders, key=lambda f: int(_DIGITS.search(os.path.basename(f)).group(1)))  # type: ignore[union-attr]
        if input_dir is not None:
            input_dir = os.path.expanduser(os.fspath(input_dir))
            if _needs_restore(input_dir):
                if self.is_main_process:
                    restore(input_dir, store=_store_url(input_dir))
                self.wait_for_everyone()
    return _originals["load_state"](self, input_dir, load_kwargs, **kw)


def enable(
    store: str | os.PathLike[str] | None = None,
    *,
    keep_local: bool = True,
    profile: str = "auto",
    keyframe_every: int = 10,
    store_options: dict[str, Any] | None = None,
    async_save: bool = False,
) -> None:
    """Make every ``Accelerator.save_state``/``load_state`` in this process use s4weights.

    Args:
        store: a local directory or ``s3://bucket/prefix``; default ``.s4w`` beside each
            checkpoint folder.
        keep_local: keep Accelerate's raw files (default); ``False`` deletes them once stored
            (``load_state`` rebuilds them from the store).
        profile, keyframe_every, store_options: as for :class:`~s4w_core.store.CheckpointStore`.
        async_save: compress and write in the background (``CheckpointStore.save_async``):
            ``save_state`` returns once the packed folder is copied; the raw files are dropped
            and rotation mirrored when the save is durable (:func:`finish_pending`).
    Example:
        >>> import s4w_accelerate
        >>> s4w_accelerate.enable(profile="portable"); s4w_accelerate.enabled()
        True
        >>> s4w_accelerate.disable()
    """
    global _config
    if profile not in s4w_core.PROFILES:
        raise ValueError(f"profile must be one of {s4w_core.PROFILES}, got {profile!r}")
    from accelerate import Accelerator

    finish_pending()
    _config = _Config(
        None if store is None else os.fspath(store), keep_local, profile, keyframe_every, store_options, async_save
    )
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
        from accelerate import Accelerator

        Accelerator.save_state = _originals.pop("save_state")  # type: ignore[method-assign]
        Accelerator.load_state = _originals.pop("load_state")  # type: ignore[method-assign]


def enable_from_env(environ: Any = os.environ) -> bool:
    """Enable from ``S4W_ACCELERATE*`` variables (what ``import s4w_accelerate`` does)."""
    v = (environ.get(ENV) or "").strip()
    if not v or v.lower() in ("0", "false", "no", "off"):
        return False
    store = None if v.lower() in ("1", "true", "yes", "on") else v
    keep = (environ.get(f"{ENV}_KEEP_LOCAL") or "1").strip().lower() not in ("0", "false", "no", "off")
    enable(
        store,
        keep_local=keep,
        profile=(environ.get(f"{ENV}_PROFILE") or "auto").strip(),
        keyframe_every=int(environ.get(f"{ENV}_KEYFRAME") or 10),
        async_save=(environ.get(f"{ENV}_ASYNC") or "0").strip().lower() in ("1", "true", "yes", "on"),
    )
    return True

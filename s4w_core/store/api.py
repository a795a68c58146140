"""Module functions over :class:`~s4w_core.store.CheckpointStore`.

:func:`save_checkpoint` keeps one store object per (url, options) for the life of the process,
so the previous step's bytes stay cached as the next save's delta base (see
``base_cache_bytes``); call :func:`close_stores` to drop them.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Literal, Mapping, overload

from s4w_core.errors import AsyncSaveError
from s4w_core.store.store import CheckpointStore, SaveHandle, StepInfo

__all__ = ["save_checkpoint", "load_checkpoint", "close_stores"]

_STORES: dict[tuple[Any, ...], CheckpointStore] = {}
_LOCK = threading.Lock()


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple, set, frozenset)):
        return tuple(sorted(_freeze(x) for x in v)) if isinstance(v, (set, frozenset)) else tuple(_freeze(x) for x in v)
    return v


def _store(url: str | os.PathLike[str], options: Mapping[str, Any]) -> CheckpointStore:
    key = (os.fspath(url), _freeze(options))
    with _LOCK:
        st = _STORES.get(key)
        if st is None:
            st = _STORES[key] = CheckpointStore(url, **options)
        return st


@overload
def save_checkpoint(
    state: Any,
    step: int,
    url: str | os.PathLike[str],
    *,
    extra: Mapping[str, Any] | None = ...,
    keyframe: bool = ...,
    overwrite: bool = ...,
    blocking: Literal[True] = ...,
    **store_options: Any,
) -> StepInfo: ...


@overload
def save_checkpoint(
    state: Any,
    step: int,
    url: str | os.PathLike[str],
    *,
    extra: Mapping[str, Any] | None = ...,
    keyframe: bool = ...,
    overwrite: bool = ...,
    blocking: Literal[False],
    **store_options: Any,
) -> SaveHandle: ...


def save_checkpoint(
    state: Any,
    step: int,
    url: str | os.PathLike[str],
    *,
    extra: Mapping[str, Any] | None = None,
    keyframe: bool = False,
    overwrite: bool = False,
    blocking: bool = True,
    **store_options: Any,
) -> StepInfo | SaveHandle:
    """Save ``state`` as ``step`` of the checkpoint store at ``url`` (a delta against the
    previous step where that pays).

    Args:
        state: e.g. ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}``.
        step: the training step.
        url: a local directory, ``s3://bucket/prefix`` or ``memory://name``.
        extra, keyframe, overwrite: as for :meth:`CheckpointStore.save`.
        blocking: ``False`` returns as soon as ``state`` may be modified, with a
            :class:`SaveHandle`; the save finishes on the store's worker thread
            (:meth:`CheckpointStore.save_async`).  The next call for the same store waits for it
            and raises its error; :func:`close_stores` (and interpreter exit) waits too.
        **store_options: :class:`CheckpointStore` arguments (``keep_last``, ``keyframe_every``,
            ``endpoint``, ``region``, ``profile``, ``max_pending_bytes``, ``fast_tier``, ...).
    Returns:
        The committed step's :class:`StepInfo` (``kind``, ``raw_bytes``, ``object_bytes``, ...),
        or with ``blocking=False`` its :class:`SaveHandle`.
    Raises:
        ConflictError: ``step`` already exists (pass ``overwrite=True``).
        StoreError: the backend failed; earlier checkpoints are untouched.
        AsyncSaveError: the previous non-blocking save to this store failed.
    Example:
        >>> import torch, tempfile, s4w_core
        >>> d = tempfile.mkdtemp()
        >>> s4w_core.save_checkpoint({"w": torch.ones(3)}, 10, d).step
        10
        >>> s4w_core.load_checkpoint(d)["w"].tolist()
        [1.0, 1.0, 1.0]
        >>> h = s4w_core.save_checkpoint({"w": torch.zeros(3)}, 20, d, blocking=False)
        >>> h.result().step
        20
    """
    st = _store(url, store_options)
    if not blocking:
        return st.save_async(state, step, extra=extra, keyframe=keyframe, overwrite=overwrite)
    return st.save(state, step, extra=extra, keyframe=keyframe, overwrite=overwrite)


def load_checkpoint(
    url: str | os.PathLike[str],
    step: int | None = None,
    map_location: Any = None,
    *,
    threads: int | None = None,
    **store_options: Any,
) -> Any:
    """Load ``step`` (default: the latest committed) from the store at ``url``, bit for bit.

    Args:
        url: a local directory, ``s3://bucket/prefix`` or ``memory://name``.
        step: the step; ``None`` for the newest committed one.
        map_location: as for :func:`s4w_core.load`.
        **store_options: :class:`CheckpointStore` arguments (``endpoint``, ``region``, ...).
    Returns:
        The saved object.
    Raises:
        CheckpointNotFoundError: the store is empty or has no such step.
        BaseMismatchError: a delta's base is missing or corrupt.
        FormatError: the step's container is truncated or corrupt.
        StoreError: the backend failed.
    Example:
        >>> import torch, tempfile, s4w_core
        >>> d = tempfile.mkdtemp()
        >>> _ = s4w_core.save_checkpoint({"step": 5}, 5, d)
        >>> s4w_core.load_checkpoint(d, step=5)["step"]
        5
    """
    return _store(url, store_options).load(step, map_location, threads=threads)


def close_stores() -> None:
    """Wait for their non-blocking saves, then forget the stores (and cached bases) that
    :func:`save_checkpoint` keeps per URL.

    Raises:
        AsyncSaveError: a non-blocking save failed (the first such error; every store is closed).
    """
    first: AsyncSaveError | None = None
    with _LOCK:
        for st in _STORES.values():
            try:
                st.close()
            except AsyncSaveError as e:
                first = first or e
        _STORES.clear()
    if first is not None:
        raise first

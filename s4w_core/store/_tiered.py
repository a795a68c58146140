"""Tiers for :class:`~s4w_core.store.CheckpointStore` (docs/STORE.md, "Tiers").

``CheckpointStore("s3://b/run", fast_tier="/local/nvme/run", fast_keep_last=2)``: a save commits
to the fast tier (same layout: data objects, then the commit record), then the worker copies the
same objects to the slow tier (the store's URL), data first, commit record last; a read of a data
object takes the fast tier's copy when it has one.  The fast tier keeps the newest
``fast_keep_last`` steps, and never drops a step the slow tier has not committed or an object a
step it keeps still needs.  Liveness for reclaiming: a slow-tier object is live while a commit
record on either tier lists it (a step still to upload needs its bases); a fast-tier object is
live while a fast-tier commit lists it.
"""

from __future__ import annotations

import builtins
import threading
from typing import Any

from s4w_core.errors import CheckpointNotFoundError, S4WError, StoreError
from s4w_core.store._async import Cancelled
from s4w_core.store._backend import Backend
from s4w_core.store.records import DATA, StepInfo, commit_key

#: the functions below take the :class:`~s4w_core.store.CheckpointStore` they work for (typed
#: ``Any``: this module is imported by the store's, and must not import it back)
__all__ = ["Tiers", "copy_object", "upload_missing", "prune_fast"]

_COPY_BLOCK = 8 << 20


class Tiers:
    """The fast tier of a store: its backend, retention and record cache."""

    def __init__(self, fast: Backend, keep_last: int | None) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"fast_keep_last must be a positive integer or None, got {keep_last!r}")
        self.fast = fast
        self.keep_last = keep_last
        self.records: dict[str, tuple[int, str | None, StepInfo]] = {}


def copy_object(src: Backend, dst: Backend, key: str, cancel: threading.Event | None = None) -> int:
    """Stream one object from ``src`` to ``dst`` (atomic on ``dst``, as every backend write is).
    Returns its size.  Backend errors become StoreError naming both ends.  ``cancel``: once set,
    the copy stops at its next block (:class:`~s4w_core.store._async.Cancelled`; nothing lands)."""
    rr = src.fetch(key)
    try:
        with dst.writer(key) as f:
            for off in range(0, rr.size, _COPY_BLOCK):
                if cancel is not None and cancel.is_set():
                    raise Cancelled
                data = rr.read(off, min(_COPY_BLOCK, rr.size - off))
                try:
                    f.write(data)
                except OSError as e:
                    if isinstance(e, S4WError):
                        raise
                    raise StoreError(f"cannot write {dst.describe(key)}: {e}") from e
        return rr.size
    finally:
        rr.close()


def upload_missing(store: Any, cancel: threading.Event | None = None) -> builtins.list[int]:
    """Copy every step the fast tier has committed and the slow tier has not, or has with
    another data object (re-encoded) or keyframe copy: the data objects its record keeps alive
    that the slow tier lacks, then its commit record; newest first, so that a delta's base step
    (a newer one) is there before the delta's record.  Then apply the fast tier's retention.
    Returns the steps uploaded, ascending.  Caller holds ``store._lock``.  ``cancel``: see
    :func:`copy_object`."""
    assert store.tiers is not None
    slow_b = store.backend
    fast, slow = store.tier_views()
    todo = [
        s for s, r in fast.items()
        if s not in slow or slow[s].object != r.object or slow[s].copy != r.copy or slow[s].hidden != r.hidden
    ]
    done: builtins.list[int] = []
    try:
        if todo:
            on_slow = {o.key for o in slow_b.list(DATA)}
            for step in sorted(todo, reverse=True):
                _upload_step(store, step, fast[step], slow.get(step), on_slow, cancel)
                done.append(step)
    except BaseException:
        try:  # what did reach the slow tier may still leave the fast one
            prune_fast(store)
        except Exception:  # noqa: BLE001 - the upload's error is the one to report
            pass
        raise
    prune_fast(store)
    return sorted(done)


def _upload_step(
    store: Any,
    step: int,
    rec: StepInfo,
    old: StepInfo | None,
    on_slow: set[str],
    cancel: threading.Event | None = None,
) -> None:
    tiers = store.tiers
    assert tiers is not None
    fast_b, slow_b = tiers.fast, store.backend
    for key in reversed(rec.live_objects):  # the copy, bases, own; the commit record last
        if key in on_slow:
            continue
        try:
            copy_object(fast_b, slow_b, key, cancel)
        except CheckpointNotFoundError as e:
            raise StoreError(
                f"cannot upload step {step} to {slow_b.url}: its chain's data object {key} is on neither tier ({e})"
            ) from e
        on_slow.add(key)
    slow_b.put(commit_key(step), fast_b.get(commit_key(step)), if_absent=old is None)
    store.forget_record(slow_b, commit_key(step))
    if old is not None:  # an overwrite: the old chain's objects may be free now
        store.reclaim(old.live_objects)


def prune_fast(store: Any) -> builtins.list[int]:
    """Drop from the fast tier every step but its newest ``fast_keep_last``, only those the slow
    tier has committed (same data object); then reclaim fast-tier objects no fast commit lists.
    Returns the steps dropped from the fast tier."""
    tiers = store.tiers
    assert tiers is not None
    if tiers.keep_last is None:
        return []
    fast, slow = store.tier_views()
    keep = set(builtins.list(s for s, r in fast.items() if not r.hidden)[-tiers.keep_last :])
    doomed = [s for s, r in fast.items() if s not in keep and s in slow and slow[s].object == r.object]
    if not doomed:
        return []
    candidates = {o for s in doomed for o in fast[s].live_objects}
    for s in doomed:
        tiers.fast.delete(commit_key(s))
        store.forget_record(tiers.fast, commit_key(s))
    store.reclaim(candidates)
    return doomed

"""Chain planning and re-encoding (docs/STORE.md, "Commit protocol", steps 4-7): behind each save
the step just below the new newest step becomes a delta against it; deleting or replacing a step
first re-codes the delta against it (:meth:`Reencoder._detach`).  The chain bound
(``keyframe_every``) decides which steps stay whole."""

from __future__ import annotations

import builtins
import functools
import io
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from s4w_core import engine, obs, pipeline
from s4w_core.errors import S4WError, StoreError
from s4w_core.jobs import row_lengths
from s4w_core.store import _tiered
from s4w_core.store._async import CancellableWriter, Cancelled, SaveHandle
from s4w_core.store._backend import Backend
from s4w_core.store.chain import BaseProvider, CachedBase, source_of_manifest
from s4w_core.store.loads import Loads
from s4w_core.store.records import StepInfo, data_key, deltas_into, new_record, replace_record, retained, visible
from s4w_core.store.reencode_check import same_storages
from s4w_core.workers import foreground

log = logging.getLogger("s4w_core.store")

__all__ = ["Reencoder", "Reencode", "REENCODE_MIN_GAIN", "REENCODE_BUFFER_BYTES"]

#: a re-encoded step (a delta against the step above it) replaces its whole object only when it is
#: at least this much smaller; otherwise the step stays whole (deltas of far-apart or tiny states)
REENCODE_MIN_GAIN = 0.05
#: steps whose whole object is at most this large are re-encoded into memory first, so that a
#: delta that does not pay writes nothing
REENCODE_BUFFER_BYTES = 64 << 20


@dataclass
class Reencode:
    """What re-encoding the previous newest step ``prev`` against the new one ``new`` needs:
    ``old``, the host copy of ``prev``'s bytes when the store kept one (None: decode it), and
    ``cache``, the host copy of ``new``'s, the delta base (None: decode it as the encoder asks)."""

    prev: StepInfo
    old: CachedBase | None
    new: StepInfo
    cache: CachedBase | None
    #: the visible steps once ``new`` is committed (whether a later save's retention deletes ``prev``)
    shown: frozenset[int] = frozenset()


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """The bound ``method`` without a strong reference to its object: a call once the object is
    gone does nothing and returns None."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        fn = ref()
        return None if fn is None else fn(*args)

    return call


class _Stale(Exception):
    """A re-encoding that no longer applies (the steps changed meanwhile, or no delta pays)."""



class Reencoder(Loads):
    """Turns whole steps into reverse deltas, and re-codes the deltas against a step that goes."""

    # ------------------------------------------------------------------ re-encoding (reverse deltas)
    def _schedule_reencode(self, todo: builtins.list[Reencode]) -> None:
        """Start the re-encoding ``_save`` asked for, on the worker, behind what is queued.  The
        next save waits for it (a step left whole would stay whole), unless that save's
        retention (``keep_last``) deletes the step: then the save cancels it, and so does a
        delete of the step -- its result would be dropped, and a save would wait for it.  A step
        expected to go at the next save (:meth:`_goes_next`) has its re-encoding held instead of
        run: the next save runs it first or drops it, :meth:`wait` and :meth:`close` run it."""
        if not todo:
            return
        job = todo[0]
        handle = SaveHandle(job.prev.step, "reencode", self.backend.url, what="re-encoding")
        # the pipeline keeps the handle (and a held job) after the call: neither may keep the store
        # alive, so that a store dropped without close() is collected (its finalizer then releases
        # a held job, which does nothing: the step stays whole)
        cancel = handle.cancel_before(functools.partial(_weakly(self._dropped_by), job))
        if self._goes_next(job):
            self._pipe.defer(handle, functools.partial(_weakly(self._reencode), handle, job, cancel), hold=True)
        else:
            self._pipe.defer(handle, functools.partial(self._reencode, handle, job, cancel))

    def _goes_next(self, job: Reencode) -> bool:
        """Is ``job.prev`` expected to be deleted once the next save is durable: a caller said so
        (:meth:`expect_drop`), or the store's ``keep_last`` deletes it at any later step's save?
        Its re-encoding is then held until a save or a wait shows whether it stays."""
        if job.prev.step in self._expected:
            return True
        return self._dropped_by(job, max(job.shown | {job.new.step}) + 1)

    def _dropped_by(self, job: Reencode, step: int) -> bool:
        """Does a save of ``step`` delete ``job.prev`` by retention (``keep_last``), judged by the
        steps visible when ``job`` was planned?  (Wrong only when steps were deleted or pinned
        since; then the step stays whole: it loads the same, it only takes more room.)"""
        if self.keep_last is None:
            return False
        return job.prev.step not in retained(job.shown | {step}, self.keep_last, self.pinned)

    def _drop_copies(self) -> None:
        """Remove the keyframe copies a store of the first layout kept for its newest step (the
        record first, then the object, on each tier): the newest step is now whole.  Caller
        holds ``self._lock``."""
        backends = [self.backend] + ([self.tiers.fast] if self.tiers is not None else [])
        freed: set[str] = set()
        for b in backends:
            for r in self._recs_on(b).values():
                if r.copy is not None:
                    self._put_record(b, replace_record(r, copy=None, copy_bytes=0), replace=True)
                    freed.add(r.copy)
        if freed:
            self.reclaim(freed)

    def _reencode_target(self, step: int, recs: Mapping[int, StepInfo]) -> StepInfo | None:
        """The step a save of the new newest ``step`` turns into a delta against it: the step
        just below, when it is whole, not pinned, and not the whole step that bounds the chains
        below it (``keyframe_every``: at most ``keyframe_every - 1`` deltas in a row)."""
        shown = visible(recs)
        if not self._caching() or any(s > step for s in shown):  # (an overwritten newest step: again)
            return None
        below = sorted((s for s in shown if s < step), reverse=True)
        if not below:
            return None
        prev = recs[below[0]]
        if prev.kind != "keyframe" or prev.pinned:
            return None
        return prev if deltas_into(recs, prev.step) + 1 < self.keyframe_every else None

    def _reencode(self, handle: SaveHandle, job: Reencode, cancel: threading.Event | None = None) -> None:
        """Turn the whole step ``job.prev`` into a delta against the newer whole step
        ``job.new``: encode it against ``job.new``'s bytes (the host copy kept as the cache),
        write a new data object, check that it stands for the step (same storages, same bytes),
        rewrite the step's commit record to point at it (the commit point), then remove the old
        whole object.  A crash leaves the step whole (and an unreferenced object for ``gc()``)
        or re-encoded (and the old object unreferenced); it loads bit-exactly either way.  Runs
        on the worker after the save; a failure is logged, never raised (the step stays whole).
        ``cancel``: set, the job stops at its next write and leaves the step whole (``cancelled``)."""
        prev, new, cache = job.prev, job.new, job.cache
        backend = self._home(prev.step)
        t0 = time.perf_counter()
        key: str | None = None
        size = 0
        outcome = "written"
        error: str | None = None
        try:
            if (cancel is not None and cancel.is_set()) or prev.step in self._dropped:
                raise Cancelled
            with self._lock:
                recs = self._read_records()
                if not self._still(backend, recs, prev, new):
                    raise _Stale
            t = time.perf_counter()
            own: Mapping[str, Any] | None = None
            devices: builtins.list[str] | None = None
            state = job.old.collected(prev.profile) if job.old is not None else None
            if state is not None and job.old is not None:
                raws = job.old.raws
                devices = [d for _, _, d in job.old.source[2]] if job.old.source is not None else None
                # the manifest the step was committed with (kept with its host copy; else read back)
                own = job.old.manifest if job.old.manifest is not None else self._own_manifest_of(prev)
                if own is None:
                    raise StoreError(f"cannot read the manifest of step {prev.step}")
            else:  # no host copy of it: decode it (one whole object)
                state, raws, own = self._decoded(prev, recs)
            handle.stages["read"] = time.perf_counter() - t
            provider = BaseProvider(
                self._open, self.backend.url, new, recs, self.threads, cache if cache is not None else self._cache
            )
            t = time.perf_counter()
            # a step small enough is coded into memory first and written only if the delta pays
            # (nothing written for nothing); a larger one is streamed to its object, removed if not
            buffered: io.BytesIO | None = io.BytesIO() if prev.object_bytes <= REENCODE_BUFFER_BYTES else None
            # a caller blocked on the store (the end of training's wait, a save behind this job):
            # no training step runs beside it, so the GPU codes in a blocking save's batches
            with foreground(self._pipe.waited):
                if buffered is not None:
                    m, size, prof = self._encode_into(state, buffered, provider, prev.step, prev.extra)
                else:
                    key = data_key(prev.step)
                    with backend.writer(key) as f:
                        out = f if cancel is None else CancellableWriter(f, cancel)
                        m, size, prof = self._encode_into(state, out, provider, prev.step, prev.extra)
            handle.stages["encode"] = time.perf_counter() - t
            del state
            t = time.perf_counter()
            why = same_storages(m, own, raws, devices, deltas=True)
            handle.stages["check"] = time.perf_counter() - t
            if why is not None:
                raise StoreError(f"the re-encoded step {prev.step} does not stand for it: {why}")
            if not any(e.get("delta") for e in m["storages"]) or size > prev.object_bytes * (1.0 - REENCODE_MIN_GAIN):
                raise _Stale  # the delta does not pay: the step stays whole
            if buffered is not None:
                t = time.perf_counter()
                key = data_key(prev.step)
                with backend.writer(key) as f:
                    f.write(buffered.getbuffer())
                del buffered
                handle.stages["write"] = time.perf_counter() - t
            t = time.perf_counter()
            with self._lock:
                if cancel is not None and cancel.is_set():
                    raise Cancelled
                recs = self._read_records()
                if not self._still(backend, recs, prev, new):
                    raise _Stale  # deleted, replaced or overtaken meanwhile
                assert key is not None  # written above
                info = replace_record(new_record(prev.step, key, size, m, prof, recs[new.step], prev.extra), created=prev.created)
                try:
                    self._put_record(backend, info, replace=True)  # the commit point
                except BaseException as e:
                    done = self.discard_unless_committed(backend, prev.step, key, e)
                    key = None  # deleted where unreferenced, else the record's or gc()'s
                    if not done:
                        raise
                key = None  # the record owns it now
                if self.tiers is not None:
                    _tiered.upload_missing(self)
                self.reclaim_later(prev.live_objects)  # the old whole object, behind the worker
            handle.stages["commit"] = time.perf_counter() - t
        except _Stale:
            outcome = "skipped"
        except Cancelled:
            outcome = "cancelled"
        except BaseException as e:  # noqa: BLE001 - logged; the step itself is intact
            if cancel is not None and cancel.is_set() and isinstance(e, S4WError):
                outcome = "cancelled"  # a backend that wrapped the stop in its own error
            else:
                # only the text: the exception's frames would keep this store alive (a cycle)
                error, outcome = f"{type(e).__name__}: {e}", "failed"
                log.warning(
                    "s4weights: re-encoding step %d of %s as a delta against step %d failed (%s); it stays whole",
                    prev.step, backend.url, new.step, error,
                )
        finally:
            self._unpool(job.old)
            if key is not None:
                try:
                    backend.delete(key)
                except S4WError:
                    pass  # gc() reclaims it
            total = time.perf_counter() - t0
            obs.record(
                obs.OpEvent(
                    op="reencode",
                    url=self.backend.url,
                    step=prev.step,
                    raw_bytes=prev.raw_bytes if outcome == "written" else 0,
                    stored_bytes=size if outcome == "written" else 0,
                    blocked_s=0.0,
                    total_s=total,
                    stages=dict(handle.stages),
                    kind="delta",
                    mode="background",
                    ok=error is None,
                    error=error,
                    extra={"outcome": outcome, "base_step": new.step},
                )
            )
            handle.mode = outcome

    def _still(self, backend: Backend, recs: Mapping[int, StepInfo], prev: StepInfo, new: StepInfo) -> bool:
        """Are ``prev`` (whole, on ``backend``) and ``new`` (in ``recs``) as they were when the
        re-encoding was planned, and is ``new`` the step just above ``prev``?"""
        p, n = self._recs_on(backend).get(prev.step), recs.get(new.step)
        if self.tiers is not None and backend is self.backend and (n is None or "slow" not in n.tiers):
            return False  # its base is not on the slow tier yet (an upload failed): later
        return (
            p is not None and n is not None and p.object == prev.object and p.kind == "keyframe" and not p.hidden
            and n.object == new.object and not n.hidden and not any(prev.step < s < new.step for s in visible(recs))
        )

    def _decoded(self, rec: StepInfo, recs: Mapping[int, StepInfo]) -> tuple[Any, builtins.list[torch.Tensor], Mapping[str, Any]]:
        """Step ``rec`` decoded to host memory, as a state to re-encode (its storages with the
        devices, tree and tensor table its manifest records, so the re-encoded container restores
        where the original did), its raw storages and its manifest."""
        obj, raws, reader = self._load_record(rec, "cpu", self.threads, source="chain", recs=recs)
        manifest = reader.manifest
        src = source_of_manifest(manifest)
        if src is not None and len(src[2]) == len(raws):
            cols = row_lengths(src[1], [r.numel() for r in raws])
            col = engine.Collector(
                tensors=src[1],
                jobs=[engine.StorageJob(r, dt, p, d, cols=c) for r, (dt, p, d), c in zip(raws, src[2], cols)],
            )
            return pipeline.Collected(col, src[0], rec.profile if rec.profile in ("portable", "fast") else self.profile), raws, manifest
        return obj, raws, manifest

    def _recode(self, rec: StepInfo, state: Any, base: StepInfo | None, recs: Mapping[int, StepInfo]) -> StepInfo:
        """Write ``state`` (the bytes of step ``rec``) as a new data object coded against
        ``base`` (None: whole) and rewrite the step's commit record to it.  Caller holds the lock
        and reclaims the old object."""
        backend = self._home(rec.step)
        provider = (
            BaseProvider(self._open, self.backend.url, base, recs, self.threads, self._cache) if base is not None else None
        )
        key = data_key(rec.step)
        try:
            with backend.writer(key) as f:
                m, size, prof = self._encode_into(state, f, provider, rec.step, rec.extra)
            info = replace_record(
                new_record(rec.step, key, size, m, prof, base, rec.extra), created=rec.created, hidden=rec.hidden
            )
        except BaseException:
            try:
                backend.delete(key)
            except S4WError:
                pass  # gc() reclaims it
            raise
        try:
            self._put_record(backend, info, replace=True)
        except BaseException as e:
            if not self.discard_unless_committed(backend, rec.step, key, e):
                raise
        if self.tiers is not None:
            _tiered.upload_missing(self)
        return info

    def _detach(self, step: int, recs: dict[int, StepInfo]) -> dict[int, StepInfo]:
        """Before ``step`` is replaced (an overwrite, or a new save of a hidden step): re-code
        every reverse delta against it (the step just below, committed or hidden) against the
        nearest step above ``step`` (the two deltas merged, or a delta against the whole step that
        follows), or whole when there is none, the dependent is pinned, or the chains through it
        would grow beyond ``keyframe_every - 1`` deltas.  Hidden steps no committed step needs are
        collected first.  Returns the records after.  Caller holds the lock."""
        self._collect_hidden()
        recs = self._read_records()
        for d in [r for r in recs.values() if r.reverse and r.base_step == step]:
            above = [s for s in recs if s > step]
            base = recs[min(above)] if above and not d.pinned else None
            if base is not None:
                if deltas_into(recs, d.step) + base.depth + 1 >= self.keyframe_every:
                    base = None
            state, _, _ = self._decoded(d, recs)
            self._recode(d, state, base, recs)
            del state
            recs = self._read_records()
        return recs

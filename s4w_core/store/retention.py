"""Retention of a :class:`~s4w_core.store.CheckpointStore`: pins, ``keep_last``, deleting
steps and collecting what no commit record needs (crashed saves)."""

from __future__ import annotations

import builtins
import time

from s4w_core.store import _tiered
from s4w_core.store._backend import Backend
from s4w_core.store.records import (
    DATA,
    PINS,
    STEP_RE,
    StepInfo,
    check_step,
    commit_key,
    pin_key,
    replace_record,
    retained,
    visible,
)
from s4w_core.store.reencode import Reencoder

__all__ = ["Retention"]


class Retention(Reencoder):
    """Pins, deletes and garbage collection."""

    # ------------------------------------------------------------------ pins, retention, deletion
    def pin(self, step: int) -> None:
        """Exempt ``step`` from retention (persisted as a marker object); a step whose
        non-blocking save is in flight is pinned once it is committed."""
        self._pipe.land(check_step(step))
        self._record(step, self._read_records())
        self.backend.put(pin_key(step), b"")
        self.pinned.add(step)  # (a save's keep_last then never cancels its re-encoding)

    def unpin(self, step: int) -> None:
        self.backend.delete(pin_key(check_step(step)))
        self.pinned.discard(step)

    def apply_retention(self) -> builtins.list[int]:
        """Delete every step but the newest ``keep_last`` and the pinned ones; returns the steps
        deleted.  Steps a kept delta is against stay hidden (see :meth:`delete`)."""
        if self.keep_last is None:
            return []
        recs = visible(self._read_records())
        keep = retained(recs, self.keep_last, (s for s, r in recs.items() if r.pinned))
        doomed = [s for s in recs if s not in keep]
        for s in doomed:
            self.delete(s)
        return doomed

    def drop_pending(self, step: int) -> None:
        """Stop background work on ``step`` that deleting it would discard: the re-encoding of
        ``step`` as a delta against the step above, when it is in flight (it stops at its next
        write; the step stays whole), or not started yet (it will not run).  For a caller that
        deletes ``step`` once its next save is durable (a framework's rotation): that save then
        does not wait for the re-encoding.  Nothing is deleted; deleting or saving ``step`` again
        ends this.  (Saves cancel it themselves where the store's own ``keep_last``
        deletes the step.)"""
        step = check_step(step)
        self._dropped.add(step)
        self._pipe.cancel_tail_of("re-encoding", step)

    def expect_drop(self, step: int) -> None:
        """Say that ``step`` is deleted once a later save is durable (a framework's rotation,
        known a save ahead: with two kept, each save rotates out the step two below it).  When a
        save makes the step above ``step`` the newest, ``step``'s re-encoding as a delta against it
        is then held instead of run behind that save: the next save runs it first, unless that
        save's retention deletes ``step`` or the caller calls :meth:`drop_pending` or
        :meth:`delete` for it (then it never runs); :meth:`wait` and :meth:`close` run it (the
        end of training: ``step`` stays).  Nothing is deleted; saving ``step`` again or deleting
        it ends this.  (A store's own ``keep_last`` holds such re-encodings by itself.)"""
        self._expected.add(check_step(step))

    def delete(self, step: int, *, rebase: bool = False) -> None:
        """Delete ``step``: it disappears from listings at once.  Deleting a step below the newest
        writes nothing but its commit record: when a kept step is a delta against it (the step
        just below), the record is rewritten as *hidden* and its data stays as long as a kept
        step's chain reaches it (it is collected, record and data, once none does); otherwise
        the record and the data only it kept are removed.  Deleting the oldest step (nothing
        depends on it) frees its data, behind the call: on the store's clean-up thread
        (:meth:`wait`, :meth:`close` and :meth:`gc` wait for it; a crash before leaves it to
        :meth:`gc`), or before it returns with ``rebase``.  Deleting the newest step re-codes the step below
        it whole, so that the newest step still loads as one object.

        Args:
            step: a committed step.
            rebase: reclaim its data now instead of when the steps that need it go: first re-code
                the delta against it (the step below) against the nearest step above it (merged),
                and, in stores written by the first layout (forward deltas), re-code as whole steps
                the kept steps whose chain runs through ``step``.
        Raises:
            CheckpointNotFoundError: no such step.
        """
        step = check_step(step)
        self._pipe.land(step)  # a step whose non-blocking save is in flight: deleted once committed
        self._pipe.cancel_tail_of("re-encoding", step)  # its result would be dropped: stop it
        self._dropped.discard(step)
        self._expected.discard(step)
        if rebase:  # re-coding steps: let a save in flight and the re-encoding behind it land
            self._pipe.settle()
        with self._lock:
            recs = self._read_records()
            rec = self._record(step, recs)
            before = self.all_objects()
            if rebase:  # reclaim its data now: the delta against it re-coded (merged onto the step above)
                recs = self._detach(step, recs)
                rebased = False
                for s in sorted(recs):
                    if s != step and rec.object in recs[s].objects[1:]:
                        self._rebase(s, exclude=step)
                        recs = self._read_records()
                        rebased = True
                if rebased and self.tiers is not None:  # the slow tier's records still name ``step``'s data
                    _tiered.upload_missing(self)
            tiers = [self.backend] + ([self.tiers.fast] if self.tiers is not None else [])
            shown = visible(recs)
            below = [s for s in shown if s < step]
            if step == max(shown) and below and recs[max(below)].reverse:
                # the step below becomes the newest: re-coded whole first (it loads as one object);
                # a crash before the delete leaves both steps committed and whole
                v = recs[max(below)]
                state, _, _ = self._decoded(v, recs)
                self._recode(v, state, None, recs)
                del state
                recs = self._read_records()
            if any(r.reverse and r.base_step == step for r in recs.values()):
                for b in tiers:  # hidden: the commit point (one record rewritten per tier)
                    r = self._recs_on(b).get(step)
                    if r is not None:
                        self._put_record(b, replace_record(r, hidden=True), replace=True)
            else:
                for b in reversed(tiers):  # the step is gone once the slow tier's record is
                    b.delete(commit_key(step))
                    self.forget_record(b, commit_key(step))
            self.backend.delete(pin_key(step))
            self.pinned.discard(step)
            if self._cache is not None and self._cache.step == step:
                self._cache = None
            self._collect_hidden()
            # the data only it kept goes behind the call (a large object's unlink takes ~0.1-0.2 s
            # a GB locally, and a framework's rotation deletes a step per save); ``rebase`` asks
            # for the room now
            if rebase:
                self.reclaim(before)
            else:
                self.reclaim_later(before)

    def _rebase(self, step: int, *, exclude: int) -> StepInfo:
        """Re-code ``step`` (a forward delta whose chain runs through ``exclude``) whole."""
        recs = self._read_records()
        state, _, _ = self._decoded(recs[step], recs)
        return self._recode(recs[step], state, None, recs)

    def gc(self, *, grace_seconds: float = 3600.0) -> int:
        """Delete data objects no commit record needs and leftovers of crashed writers older than
        ``grace_seconds`` (younger ones may belong to a save in progress). Returns bytes freed.
        With a fast tier, both tiers (see :meth:`_reclaim` for what is live where).  This store's
        own save in flight and the re-encoding behind it are waited for first (their objects
        are unreferenced until they commit, whatever ``grace_seconds`` says)."""
        self._pipe.settle()
        with self._lock:
            self._collect_hidden()  # e.g. a delete that crashed before it collected
        recs = visible(self._read_records())
        places: builtins.list[tuple[Backend, set[str]]] = [(self.backend, self.all_objects())]
        if self.tiers is not None:
            fast, _ = self.tier_views()
            places.append((self.tiers.fast, {o for r in fast.values() for o in r.live_objects}))
        now = time.time()
        freed = 0
        for backend, live in places:
            for o in backend.list(DATA):
                if o.key in live:
                    continue
                if o.mtime is not None and now - o.mtime < grace_seconds:
                    continue
                backend.delete(o.key)
                freed += o.size
            tmps = getattr(backend, "list_temporaries", None)
            if tmps is not None:
                for o in tmps():
                    if o.mtime is not None and now - o.mtime >= grace_seconds:
                        backend.delete(o.key)
        pins = self.backend.list(PINS)
        for o in pins:
            m = STEP_RE.match(o.key[len(PINS) :])
            if m and int(m.group(1)) not in recs:
                self.backend.delete(o.key)
        return freed

"""Retention of a :class:`~s4w_core.store.CheckpointStore`: pins, ``keep_last``, deleting
steps and collecting what no commit record needs (crashed saves)."""

from __future__ import annotations

import builtins
import time

from s4w_core.store import _tiered
from s4w_core.store._backend import Backend
from s4w_core.store.records import DATA, PINS, STEP_RE, StepInfo, check_step, commit_key, pin_key
from s4w_core.store.reencode import Reencoder

__all__ = ["Retention"]


class Retention(Reencoder):
    """Pins, deletes and garbage collection."""

    # ------------------------------------------------------------------ pins, retention, deletion
    def pin(self, step: int) -> None:
        """Exempt ``step`` from retention (persisted as a marker object)."""
        self._record(check_step(step), self._read_records())
        self.backend.put(pin_key(step), b"")

    def unpin(self, step: int) -> None:
        self.backend.delete(pin_key(check_step(step)))
        self.pinned.discard(step)

    def apply_retention(self) -> builtins.list[int]:
        """Delete every step but the newest ``keep_last`` and the pinned ones; returns the steps
        deleted.  Bases that kept deltas need stay (as data objects without a commit)."""
        if self.keep_last is None:
            return []
        recs = self._read_records()
        keep = set(list(recs)[-self.keep_last :]) | {s for s, r in recs.items() if r.pinned}
        doomed = [s for s in recs if s not in keep]
        for s in doomed:
            self.delete(s)
        return doomed

    def delete(self, step: int, *, rebase: bool = False) -> None:
        """Delete ``step``: it disappears from listings at once and its data is reclaimed.  The
        step just below it, when it is a delta against ``step``, is first re-coded against the
        nearest step above ``step`` (or whole: when there is none, it is pinned, or the chain
        bound says so); deleting the oldest step (nothing depends on it) re-codes nothing.

        Args:
            step: a committed step.
            rebase: for stores written by the first layout (forward deltas): first re-code, as
                whole steps, the kept steps whose chain runs through ``step``, so that its data is
                reclaimed now instead of when those deltas go.
        Raises:
            CheckpointNotFoundError: no such step.
        """
        step = check_step(step)
        if rebase:  # re-coding steps: let a save in flight and the re-encoding behind it land
            self._pipe.settle()
        with self._lock:
            recs = self._read_records()
            rec = self._record(step, recs)
            before = self.all_objects()
            recs = self._detach(step, recs)
            if rebase:
                rebased = False
                for s in sorted(recs):
                    if s != step and rec.object in recs[s].objects[1:]:
                        self._rebase(s, exclude=step)
                        recs = self._read_records()
                        rebased = True
                if rebased and self.tiers is not None:  # the slow tier's records still name ``step``'s data
                    _tiered.upload_missing(self)
            if self.tiers is not None:
                self.tiers.fast.delete(commit_key(step))
                self.forget_record(self.tiers.fast, commit_key(step))
            self.backend.delete(commit_key(step))  # the step is gone from here on
            self.backend.delete(pin_key(step))
            self.pinned.discard(step)
            if self._cache is not None and self._cache.step == step:
                self._cache = None
            self.forget_record(self.backend, commit_key(step))
            self.reclaim(before)

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
        recs = self._read_records()
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

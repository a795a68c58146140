"""The layout and commit protocol of a :class:`~s4w_core.store.CheckpointStore` (docs/STORE.md,
"Layout" and "Commit protocol"): :class:`StoreCore` holds a store's state and reads and writes
its commit records, opens its data objects, and reclaims the objects no record needs.

The store's other jobs build on it, one module each: the host copy of the newest step
(:mod:`.cache`), loads (:mod:`.loads`), re-encoding steps as reverse deltas (:mod:`.reencode`),
retention (:mod:`.retention`), saves (:mod:`.writes`); :mod:`.store` puts them together.
"""

from __future__ import annotations

import builtins
import functools
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, TypeVar

from s4w_core import pipeline
from s4w_core.errors import CheckpointNotFoundError, S4WError, TruncatedError
from s4w_core.format.container import ContainerReader
from s4w_core.hostmem import PinnedPool
from s4w_core.store import _async, _tiered
from s4w_core.store._backend import Backend, RangeReader
from s4w_core.store.chain import BaseProvider, CachedBase
from s4w_core.store.records import (
    COMMITS,
    DATA,
    PINS,
    STEP_RE,
    StepInfo,
    check_step,
    commit_key,
    needed_hidden,
    parse_record,
    replace_record,
    visible,
)

log = logging.getLogger("s4w_core.store")

__all__ = ["StoreCore", "StoreReader", "Progress", "after_saves", "WHOLE_READ_BYTES"]

_F = TypeVar("_F", bound=Callable[..., Any])


def delete_quietly(objects: builtins.list[tuple[Backend, str]]) -> None:
    """Delete unreferenced data objects; a failure is logged (``gc()`` reclaims them later)."""
    for backend, key in objects:
        try:
            backend.delete(key)
        except S4WError as e:
            log.warning("s4weights: could not delete the unreferenced object %s (%s); gc() reclaims it", key, e)


class StoreReader(ContainerReader):
    """A container reader over one data object of a store (a backend's :class:`RangeReader`),
    which closes the range reader with it; ``counter``, when set, is told the bytes each read
    returns (a progress bar).  ``whole``: the object's bytes, read at once (chunks are then read
    as views of them)."""

    def __init__(self, rr: RangeReader, whole: bytes | None = None) -> None:
        self.range_reader = rr
        view = None if whole is None else memoryview(whole)
        self._reads = _CountedRead(rr, view)
        super().__init__(self._reads, rr.size, rr.name, readinto=rr.readinto, view=view)

    @property
    def counter(self) -> Callable[[int], None] | None:
        return self._reads.counter

    @counter.setter
    def counter(self, fn: Callable[[int], None] | None) -> None:
        self._reads.counter = fn

    def close(self) -> None:
        super().close()
        self.range_reader.close()


class Progress:
    def __init__(self, enabled: bool, desc: str, total: int | None = None) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover - tqdm is a dependency of the CLI only
                return
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        if self.bar is not None:
            with self._lock:
                self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()



#: a data object of at most this many bytes that a load reads whole from a local (or memory)
#: store is read in one call, and its chunks are then views of it: a small training state's
#: hundreds of chunks cost one read instead of one each (the CPU resume of issue #23)
WHOLE_READ_BYTES = 16 << 20


class _CountedRead:
    """The reads of a :class:`StoreReader`: from the object's bytes in memory or by range, each
    told to ``counter`` when one is set.  An object of its own, not a bound method of the reader:
    that would be a reference cycle (reader -> its read function -> reader), which kept every
    reader and its parsed manifest (thousands of objects for a training state) alive until the
    cyclic GC ran, and made a load's garbage trigger collections of the caller's whole heap."""

    def __init__(self, rr: RangeReader, whole: memoryview | None) -> None:
        self.rr, self.whole = rr, whole
        self.counter: Callable[[int], None] | None = None

    def __call__(self, offset: int, length: int) -> bytes:
        b = self.whole[offset : offset + length].tobytes() if self.whole is not None else self.rr.read(offset, length)
        if self.counter is not None:
            self.counter(len(b))
        return b


def after_saves(fn: _F) -> _F:
    """Run ``fn`` after the store's save in flight is durable; raise its failure first.  (A
    re-encoding the store holds stays held: the steps load the same before and after it.)"""

    @functools.wraps(fn)
    def wrapper(self: StoreCore, *args: Any, **kwargs: Any) -> Any:
        self._pipe.wait(held=False)
        return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class StoreCore:
    """A store's state (set by :class:`~s4w_core.store.CheckpointStore`), its commit records and
    data objects."""

    url: str
    backend: Backend
    keep_last: int | None
    pinned: set[int]
    keyframe_every: int
    delta: bool
    profile: str
    threads: int | None
    base_cache_bytes: int | None
    progress: bool
    #: the fast tier (None: the store has one location); :mod:`._tiered` works on it
    tiers: _tiered.Tiers | None
    _cache: CachedBase | None
    _records: dict[str, tuple[int, str | None, StepInfo]]
    _lock: threading.RLock
    _rec_lock: threading.RLock
    _pipe: _async.Pipeline
    _pinned_pool: PinnedPool
    #: steps a caller deletes soon (``drop_pending``): not re-encoded
    _dropped: set[int]
    #: steps a caller deletes once a later save is durable (``expect_drop``): re-encoded only if they stay
    _expected: set[int]

    # ------------------------------------------------------------------ commit records
    # ------------------------------------------------------------------ listing
    def _tier_records(self, backend: Backend, cache: dict[str, tuple[int, str | None, StepInfo]]) -> dict[int, StepInfo]:
        """The commit records on one backend (cached by size and version), by step, ascending."""
        objs = [o for o in backend.list(COMMITS) if STEP_RE.match(o.key[len(COMMITS) :])]
        with self._rec_lock:
            todo = [o for o in objs if o.version is None or cache.get(o.key, (None, None))[:2] != (o.size, o.version)]

            def fetch(key: str) -> tuple[str, StepInfo]:
                return key, parse_record(backend.get(key), key, backend.url)

            if todo:
                if len(todo) == 1 or not backend.concurrent_reads:  # a local read costs less than a thread
                    got = [fetch(o.key) for o in todo]
                else:
                    with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
                        got = list(pool.map(fetch, [o.key for o in todo]))
                sizes = {o.key: (o.size, o.version) for o in todo}
                for key, rec in got:
                    cache[key] = (*sizes[key], rec)
            live = {o.key for o in objs}
            for k in list(cache):
                if k not in live:
                    del cache[k]
            return dict(sorted((cache[k][2].step, cache[k][2]) for k in live))

    def tier_views(self) -> tuple[dict[int, StepInfo], dict[int, StepInfo]]:
        """(fast tier's records, slow tier's records) of a tiered store."""
        assert self.tiers is not None
        return self._tier_records(self.tiers.fast, self.tiers.records), self._tier_records(self.backend, self._records)

    def forget_record(self, backend: Backend, key: str) -> None:
        with self._rec_lock:
            (self.tiers.records if self.tiers is not None and backend is self.tiers.fast else self._records).pop(key, None)

    def _read_records(self) -> dict[int, StepInfo]:
        recs = self._tier_records(self.backend, self._records)
        pins = {
            int(m.group(1))
            for o in self.backend.list(PINS)
            if (m := STEP_RE.match(o.key[len(PINS) :]))
        }
        if self.tiers is not None:  # the union; the fast tier's record is the newer one
            fast = self._tier_records(self.tiers.fast, self.tiers.records)
            slow = recs
            recs = {}
            for s in sorted(set(fast) | set(slow)):
                r = fast.get(s) or slow[s]
                where = tuple(t for t, rs in (("fast", fast), ("slow", slow)) if s in rs and rs[s].object == r.object)
                recs[s] = replace_record(r, tiers=where)
        out = {}
        for s, rec in recs.items():
            pinned = s in pins or s in self.pinned
            out[s] = rec if rec.pinned == pinned else replace_record(rec, pinned=pinned)
        for s in sorted(out, reverse=True):  # a reverse delta is as deep as its base, plus one
            rec = out[s]
            if rec.reverse and rec.base_step in out and rec.depth != out[rec.base_step].depth + 1:
                out[s] = replace_record(rec, depth=out[rec.base_step].depth + 1)
        return out

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return list(visible(self._read_records()))

    def list(self) -> list[StepInfo]:
        """:class:`StepInfo` of every committed step, ascending."""
        return list(visible(self._read_records()).values())

    def records(self) -> dict[int, StepInfo]:
        """Every step's record by step, the hidden ones too (deleted steps kept while a kept step is a
        delta against them): what resolving a step's chain of delta bases needs."""
        return self._read_records()

    def latest(self) -> int | None:
        """The newest committed step, or None for an empty store."""
        s = self.steps()
        return s[-1] if s else None

    def info(self, step: int | None = None) -> StepInfo:
        """The commit record of ``step`` (default: latest). Raises CheckpointNotFoundError."""
        return self._record(step, self._read_records())

    def _record(self, step: int | None, recs: dict[int, StepInfo]) -> StepInfo:
        """The committed (not hidden) step ``step`` of ``recs`` (None: the newest)."""
        recs = visible(recs)
        if step is None:
            if not recs:
                raise CheckpointNotFoundError(f"{self.backend.url}: no committed checkpoint in this store")
            return recs[max(recs)]
        check_step(step)
        if step not in recs:
            near = ", ".join(str(s) for s in list(recs)[-5:]) or "none"
            raise CheckpointNotFoundError(f"{self.backend.url}: no committed step {step} (latest steps: {near})")
        return recs[step]

    def sizes(self) -> dict[str, Any]:
        """Byte totals: ``raw_bytes`` (what the steps decode to), ``stored_bytes`` (their own
        containers), ``physical_bytes`` (every data object present, including bases kept only
        for a delta, keyframe copies (``copy_bytes``) and unreferenced leftovers), ``ratio`` =
        raw / stored, per ``kinds`` totals; ``hidden_bytes``: the data of deleted steps kept while a
        kept step is a delta against them.  Deletes already decided (a deleted step's data,
        removed behind :meth:`delete`) are waited for first: the totals are what stays."""
        self._pipe.wait_side()
        every = self._read_records()
        recs = visible(every)
        data = self.backend.list(DATA)
        live = {o for r in every.values() for o in r.live_objects}
        hidden = {o for r in every.values() if r.hidden for o in r.live_objects} - {o for r in recs.values() for o in r.live_objects}
        own = {r.object for r in recs.values()}
        copies = {r.copy for r in recs.values() if r.copy is not None}
        kinds: dict[str, dict[str, int]] = {}
        for r in recs.values():
            for k, g in r.kinds.items():
                d = kinds.setdefault(k, {"raw_bytes": 0, "stored_bytes": 0})
                d["raw_bytes"] += int(g.get("raw_bytes", 0))
                d["stored_bytes"] += int(g.get("stored_bytes", 0))
        raw = sum(r.raw_bytes for r in recs.values())
        stored = sum(r.object_bytes for r in recs.values())
        return {
            "steps": len(recs),
            "keyframes": sum(r.kind == "keyframe" for r in recs.values()),
            "raw_bytes": raw,
            "stored_bytes": stored,
            "ratio": round(raw / stored, 4) if stored else 1.0,
            "physical_bytes": sum(o.size for o in data),
            "base_only_bytes": sum(
                o.size for o in data if o.key in live and o.key not in own and o.key not in copies and o.key not in hidden
            ),
            "hidden_bytes": sum(o.size for o in data if o.key in hidden),
            "copy_bytes": sum(o.size for o in data if o.key in copies),
            "unreferenced_bytes": sum(o.size for o in data if o.key not in live),
            "kinds": kinds,
        }

    def _collect_hidden(self) -> None:
        """Remove the hidden steps that no committed step's chain reaches any more: their commit
        records (on every tier), then the data only they kept.  Caller holds ``self._lock``."""
        recs = self._read_records()
        keep = needed_hidden(recs)
        doomed = [s for s, r in recs.items() if r.hidden and s not in keep]
        if not doomed:
            return
        for s in doomed:
            for b in [self.backend] + ([self.tiers.fast] if self.tiers is not None else []):
                b.delete(commit_key(s))
                self.forget_record(b, commit_key(s))
        self.reclaim({o for s in doomed for o in recs[s].live_objects})

    def _recs_on(self, backend: Backend) -> dict[int, StepInfo]:
        """The commit records on one tier (the store's own backend or the fast tier)."""
        fast = self.tiers is not None and backend is self.tiers.fast
        return self._tier_records(backend, self.tiers.records if fast and self.tiers is not None else self._records)

    def _put_record(self, backend: Backend, info: StepInfo, *, replace: bool) -> None:
        body = json.dumps(info.record(), separators=(",", ":"), sort_keys=True).encode()
        backend.put(commit_key(info.step), body, if_absent=not replace)
        self.forget_record(backend, commit_key(info.step))

    def discard_unless_committed(self, backend: Backend, step: int, key: str, error: BaseException) -> bool:
        """After the put of ``step``'s commit record on ``backend`` raised ``error``, for the new data
        object ``key`` it was to name: True when the record names ``key`` after all (a put whose
        answer was lost on the way back -- a reset connection, a timeout -- may have been applied:
        the commit happened). Otherwise False, and ``key`` deleted where the record is known not to
        name it; where the record cannot be read now (or ``error`` is an interrupt, not an
        ``Exception``: no more requests then), ``key`` is left for :meth:`gc` -- never an object a
        committed record may name."""
        landed: bool | None = None
        if isinstance(error, Exception):
            self.forget_record(backend, commit_key(step))
            try:
                landed = parse_record(backend.get(commit_key(step)), commit_key(step), backend.url).object == key
            except CheckpointNotFoundError:
                landed = False
            except S4WError as e:
                log.warning("s4weights: %s: cannot tell whether step %d was committed (%s); %s is left to gc()",
                            backend.url, step, e, key)  # fmt: skip
        if landed is False:
            try:
                backend.delete(key)
            except S4WError:
                pass  # gc() reclaims it
        return landed is True

    def all_objects(self) -> set[str]:
        """Every data object some commit record (on either tier) lists."""
        if self.tiers is None:
            return {o for r in self._tier_records(self.backend, self._records).values() for o in r.live_objects}
        fast, slow = self.tier_views()
        return {o for recs in (fast, slow) for r in recs.values() for o in r.live_objects}

    def reclaim(self, candidates: Iterable[str]) -> None:
        """Delete those of ``candidates`` (data objects once committed) no commit needs now."""
        for backend, key in self.unreferenced(candidates):
            backend.delete(key)

    def reclaim_later(self, candidates: Iterable[str]) -> None:
        """:meth:`reclaim` on the store's clean-up thread (a large object's delete takes time:
        ~0.2 s a GB locally): :meth:`wait`, :meth:`close` and ``gc()`` wait for it; a crash
        before it leaves unreferenced objects to ``gc()``, as a crash after a commit always
        could.  Caller holds ``self._lock`` (what is unreferenced is decided now)."""
        dead = self.unreferenced(candidates)
        if dead:
            self._pipe.later(functools.partial(delete_quietly, dead))

    def unreferenced(self, candidates: Iterable[str]) -> builtins.list[tuple[Backend, str]]:
        """Those of ``candidates`` (data objects once committed) no commit needs now, with the
        tier each is to be deleted from.  With a fast tier: on the slow tier, an object stays while
        a record on either tier lists it (a step still to upload needs its bases); on the fast
        tier, while a fast record lists it.  Caller holds ``self._lock``."""
        cands = set(candidates)
        out = [(self.backend, o) for o in sorted(cands - self.all_objects())]
        if self.tiers is not None:
            fast, _ = self.tier_views()
            live_fast = {o for r in fast.values() for o in r.live_objects}
            out += [(self.tiers.fast, o) for o in sorted(cands - live_fast)]
        return out

    def _home(self, step: int) -> Backend:
        """Where a re-coded ``step`` is written: the fast tier while it holds the step (the
        upload behind it copies it on), else the store's own location."""
        if self.tiers is not None and step in self._recs_on(self.tiers.fast):
            return self.tiers.fast
        return self.backend

    # ------------------------------------------------------------------ data objects
    # ------------------------------------------------------------------ reading
    def _open(self, key: str, *, whole: bool, expect: int | None = None, what: str = "") -> ContainerReader:
        rr: RangeReader | None = None
        src = self.backend
        if self.tiers is not None:  # the fast tier's copy when it has one
            try:
                rr = self.tiers.fast.fetch(key) if whole else self.tiers.fast.open_range(key)
                src = self.tiers.fast
            except CheckpointNotFoundError:
                rr = None
        if rr is None:
            rr = self.backend.fetch(key) if whole else self.backend.open_range(key)
        try:
            if expect is not None and rr.size != expect:
                raise TruncatedError(
                    f"{rr.name}{what}: data object is {rr.size} bytes but its commit record says {expect}: "
                    "truncated or replaced"
                )
            data = rr.read(0, rr.size) if whole and not src.concurrent_reads and rr.size <= WHOLE_READ_BYTES else None
            reader = StoreReader(rr, data)
            pipeline.open_reader(reader)  # validates the manifest
        except BaseException:
            rr.close()
            raise
        return reader

    def _caching(self) -> bool:
        return self.delta and self.keyframe_every > 1

    def _encode_into(
        self, state: Any, fp: Any, provider: BaseProvider | None, step: int, extra: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any], int, str]:
        """:func:`pipeline.encode` of ``state`` into ``fp`` against ``provider``'s base (closed after)."""
        try:
            return pipeline.encode(
                state,
                fp,
                self.profile,
                self.threads,
                provider.lookup if provider is not None else None,
                {**(extra or {}), "step": step},
            )
        finally:
            if provider is not None:
                provider.close()

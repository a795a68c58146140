"""Saves into a :class:`~s4w_core.store.CheckpointStore` (docs/STORE.md, "Commit protocol",
steps 1-3, and "Non-blocking saves"): write the new step whole, commit its record, keep its bytes
as the host copy, apply retention, and hand the re-encoding of the step below to the worker."""

from __future__ import annotations

import builtins
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Literal, Mapping, overload

from s4w_core import engine, obs, pipeline
from s4w_core._fsutil import WriteThrough
from s4w_core.errors import BaseMismatchError, ConflictError, S4WError, StoreError
from s4w_core.hostmem import host_copies
from s4w_core.skeleton import encode_tree
from s4w_core.store import _async, _tiered
from s4w_core.store._async import SaveHandle
from s4w_core.store.chain import BaseProvider, CachedBase, state_source
from s4w_core.store.core import Progress
from s4w_core.store.records import StepInfo, check_step, commit_key, data_key, new_record, visible
from s4w_core.store.reencode import Reencode
from s4w_core.store.retention import Retention

log = logging.getLogger("s4w_core.store")

__all__ = ["Writes"]


@dataclass
class _PreEncoded:
    """A container encoded in the caller's thread (``async-gpu``), waiting to be written."""

    base: StepInfo | None
    key: str
    manifest: dict[str, Any]
    size: int
    profile: str
    buf: _async.HostBuffer
    cache: CachedBase | None


class CountingWriter(WriteThrough):
    """File-object wrapper that counts bytes (and drives a progress bar); a backend's write
    error (ENOSPC, EIO) becomes a :class:`StoreError` naming the object."""

    def __init__(self, f: IO[bytes], progress: Progress, where: str = "") -> None:
        super().__init__(f)
        self._p = progress
        self._where = where
        self.n = 0

    def through(self, fn: Callable[[Any], Any], data: Any) -> int:
        """``fn(data)`` (a write), its bytes counted; an OS error a :class:`StoreError` naming the object."""
        try:
            n = super().through(fn, data)
        except OSError as e:
            if isinstance(e, S4WError):
                raise
            raise StoreError(f"cannot write {self._where}: {e}") from e
        self.n += n
        self._p.update(n)
        return n


def _base_of(cache: CachedBase | None, prev: StepInfo | None) -> bool:
    """Is ``cache`` the host copy the re-encoding of ``prev`` (the step a save turns into a delta,
    or None) codes from: the same step and object, with the state's source kept?  Else a save gives
    its buffers back before it copies the new step."""
    return cache is not None and prev is not None and (cache.step, cache.object) == (prev.step, prev.object) and cache.source is not None


class Writes(Retention):
    """Blocking and non-blocking saves."""

    # ------------------------------------------------------------------ writing
    @overload
    def save(
        self,
        state: Any,
        step: int,
        *,
        extra: Mapping[str, Any] | None = ...,
        keyframe: bool = ...,
        overwrite: bool = ...,
        blocking: Literal[True] = ...,
    ) -> StepInfo: ...

    @overload
    def save(
        self,
        state: Any,
        step: int,
        *,
        extra: Mapping[str, Any] | None = ...,
        keyframe: bool = ...,
        overwrite: bool = ...,
        blocking: Literal[False],
    ) -> SaveHandle: ...

    def save(
        self,
        state: Any,
        step: int,
        *,
        extra: Mapping[str, Any] | None = None,
        keyframe: bool = False,
        overwrite: bool = False,
        blocking: bool = True,
    ) -> StepInfo | SaveHandle:
        """Save ``state`` as ``step``; it becomes visible only once all its data is durable.

        Args:
            state: any object :func:`s4w_core.save` accepts (``{"model": ..., "optimizer": ...}``).
            step: the training step (a non-negative integer).  The step is written whole; the
                newest committed step below it becomes a delta against it behind the save.
            extra: small JSON-able metadata kept in the commit record and the container.
            keyframe: accepted for compatibility: every step is written whole.
            overwrite: replace an existing commit of ``step`` (a delta against it is first
                re-coded, see :meth:`delete`).
            blocking: ``False`` is :meth:`save_async` (returns its :class:`SaveHandle`).
        Returns:
            The :class:`StepInfo` of the committed step.  With a fast tier, the step is then
            committed there and its upload to the store's URL runs in the background (see
            :meth:`wait`, :meth:`sync`).
        Raises:
            ConflictError: ``step`` is already committed and ``overwrite`` is False.
            UnsupportedTypeError: ``state`` holds a value that cannot be stored without pickle.
            StoreError: the backend failed; nothing committed before is changed.
            AsyncSaveError: an earlier non-blocking save or upload failed (this save did not run).
            SaveInProgressError: a non-blocking save is running and the store has ``on_busy="error"``.
        Example:
            >>> import torch, tempfile
            >>> from s4w_core import CheckpointStore
            >>> st = CheckpointStore(tempfile.mkdtemp())
            >>> st.save({"w": torch.zeros(8, dtype=torch.bfloat16)}, step=0).kind
            'keyframe'
        """
        if not blocking:
            return self.save_async(state, step, extra=extra, keyframe=keyframe, overwrite=overwrite)
        step = check_step(step)
        with self._pipe.front:
            handle = SaveHandle(step, "blocking", self.backend.url)
            self._begin(handle)
            return self._save_blocking(handle, state, step, extra, keyframe, overwrite)

    def save_async(
        self,
        state: Any,
        step: int,
        *,
        extra: Mapping[str, Any] | None = None,
        keyframe: bool = False,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Save ``state`` as ``step`` without waiting for it to be durable: returns once
        ``state`` may be modified; encoding, writing, uploading and the commit run on the store's
        worker thread.  One save is in flight at a time: this call first waits for the previous
        one (or raises, with ``on_busy="error"``).

        How the state is made safe (``handle.mode``): CUDA tensors with the ``fast`` profile are
        copied to reused pinned host buffers and coded on the GPU in the background
        (``"async-pinned"``: the caller waits for one device-to-host copy); with the ``portable``
        profile they are encoded on the GPU now, into host memory (``"async-gpu"``); otherwise
        every storage is copied (``"async-snapshot"``, ~10 GB/s on a CPU, much faster than
        encoding).  A
        save that alone needs more than ``max_pending_bytes`` runs blocking (``"blocking"``,
        with a warning).  Nothing partial is ever visible: the commit record is written last.

        Args:
            state, step, extra, keyframe, overwrite: as for :meth:`save`.
        Returns:
            A :class:`SaveHandle`: ``done()``, ``result(timeout)`` (the :class:`StepInfo`, or
            the background error), ``blocked_s``, ``host_bytes``, ``mode``.
        Raises:
            UnsupportedTypeError: ``state`` holds a value that cannot be stored (raised now).
            ConflictError: ``step`` is known to be committed and ``overwrite`` is False (else
                the background save fails with it).
            AsyncSaveError: the previous non-blocking save or upload failed (this save did not run).
            SaveInProgressError: a save is running and the store has ``on_busy="error"``.
        Example:
            >>> import torch, tempfile
            >>> from s4w_core import CheckpointStore
            >>> st = CheckpointStore(tempfile.mkdtemp())
            >>> w = torch.ones(4)
            >>> h = st.save_async({"w": w}, step=1)
            >>> w.zero_()  # safe: the save holds its own copy
            tensor([0., 0., 0., 0.])
            >>> h.result().step, st.load(1)["w"].tolist()
            (1, [1.0, 1.0, 1.0, 1.0])
        """
        step = check_step(step)
        with self._pipe.front:
            handle = SaveHandle(step, "async-snapshot", self.backend.url)
            self._begin(handle)
            try:
                col = engine.Collector()
                tree = encode_tree(state, col.add)  # values that cannot be stored fail here, in the caller
                mode = _async.choose_mode(col.jobs, self.profile)
                if mode == "async-gpu" and pipeline.resolve_profile(self.profile, col.jobs) == "fast":
                    mode = "async-pinned"
                if not overwrite and self._known_committed(step):
                    raise ConflictError(
                        f"{self.backend.url}: step {step} is already committed; delete it first or pass overwrite=True"
                    )
                need = sum(j.raw.numel() for j in col.jobs)
                bound = self._pipe.max_pending_bytes
                blocking = bound is not None and need > bound
                if not blocking:
                    handle.mode = mode
                    if mode == "async-pinned":
                        # the state's bytes to pinned host buffers (one copy per storage, one
                        # synchronize); the GPU codes them in the background, and they are kept as
                        # the step's bytes (for the re-encodings) without another copy
                        pre = None
                        t = time.perf_counter()
                        # a second generation only when the copy becomes the cached base (a store
                        # that does not delta-code gets its buffers back before the next save)
                        raws = host_copies([j.raw for j in col.jobs], self._pinned_pool, ahead=self._caching())
                        for j, r in zip(col.jobs, raws):
                            j.raw = r
                        state = pipeline.Collected(col, tree, "fast")
                        handle.stages["snapshot"] = time.perf_counter() - t
                        handle.host_bytes = hold = sum(r.numel() for r in raws)
                    elif mode == "async-gpu":
                        pre = self._encode_ahead(handle, state, step, col, tree, extra, keyframe, overwrite)
                        hold = handle.host_bytes
                    else:
                        pre = None
                        t = time.perf_counter()
                        state, handle.host_bytes, handle.device_bytes = _async.snapshot(state, col)
                        handle.stages["snapshot"] = time.perf_counter() - t
                        hold = handle.host_bytes + handle.device_bytes
                del col
            except BaseException as e:
                handle.blocked_s = handle.elapsed()
                self._record_save(handle, None, e)
                raise
            if blocking:
                log.warning(
                    "s4weights: step %d needs %d bytes held in flight, more than max_pending_bytes=%d of %s: "
                    "saving it blocking",
                    step, need, bound, self.backend.url,
                )
                handle.mode = "blocking"
                self._save_blocking(handle, state, step, extra, keyframe, overwrite)
                return handle
            log.debug("s4weights: step %d of %s: %s save, %d bytes held", step, self.backend.url, mode, hold)
            handle.blocked_s = handle.elapsed()
            job = functools.partial(
                self._background_save, handle, state if pre is None else None, step, extra, keyframe, overwrite, pre
            )
            del state
            self._pipe.submit(handle, job, hold)
            return handle

    def _begin(self, handle: SaveHandle) -> None:
        waited = self._pipe.begin(handle.step)
        if waited:
            handle.waited_s = waited
            handle.stages["wait"] = waited

    def _known_committed(self, step: int) -> bool:
        """Is ``step`` committed?  Asks the backend only when the record caches say so (a cheap
        check for the caller's thread; the worker checks again before it commits)."""
        key = commit_key(step)
        with self._rec_lock:
            cached = key in self._records or (self.tiers is not None and key in self.tiers.records)
        return cached and step in visible(self._read_records())

    def _save_blocking(
        self, handle: SaveHandle, state: Any, step: int, extra: Mapping[str, Any] | None, keyframe: bool, overwrite: bool
    ) -> StepInfo:
        """The save in the caller's thread; with a fast tier, the upload then runs behind (and a
        re-encoding of the step below behind that)."""
        todo: builtins.list[Reencode] = []
        try:
            info = self._save_locked(state, step, extra, keyframe, overwrite, handle.stages, reencode_out=todo)
        except BaseException as e:
            handle.blocked_s = handle.elapsed()
            handle.finish(None, e, observed=True)  # raised to the caller right here
            self._record_save(handle, None, e)
            raise
        handle.blocked_s = handle.elapsed()
        if self.tiers is None:
            handle.finish(info, None)
            self._record_save(handle, info)
        else:
            self._pipe.submit(handle, functools.partial(self._upload_job, handle, info), 0)
        self._schedule_reencode(todo)
        return info

    def _upload_job(self, handle: SaveHandle, info: StepInfo) -> StepInfo:
        try:
            self._upload(handle)
        except BaseException as e:
            self._record_save(handle, info, e)
            raise
        self._record_save(handle, info)
        return info

    def _upload(self, handle: SaveHandle) -> None:
        assert self.tiers is not None
        t = time.perf_counter()
        try:
            with self._lock:
                _tiered.upload_missing(self)
        except BaseException:
            handle.what = f"upload to {self.backend.url}"
            handle.hint = (
                f"it is committed on the fast tier {self.tiers.fast.url}; store.sync() or the next save retries"
            )
            raise
        finally:
            handle.stages["upload"] = time.perf_counter() - t

    def _background_save(
        self,
        handle: SaveHandle,
        state: Any,
        step: int,
        extra: Mapping[str, Any] | None,
        keyframe: bool,
        overwrite: bool,
        pre: _PreEncoded | None,
    ) -> StepInfo:
        info: StepInfo | None = None
        todo: builtins.list[Reencode] = []
        try:
            info = self._save_locked(
                state, step, extra, keyframe, overwrite, handle.stages, owned=True, pre=pre, reencode_out=todo
            )
            del state
            if self.tiers is not None:
                self._upload(handle)
        except BaseException as e:
            self._record_save(handle, info, e)
            raise
        self._record_save(handle, info)
        self._schedule_reencode(todo)  # runs on this worker once this save's handle is done
        return info

    def _record_save(self, handle: SaveHandle, info: StepInfo | None, error: BaseException | None = None) -> None:
        """One observability event per save, once it is durable (or failed)."""
        total = handle.elapsed()
        extra: dict[str, Any] = {"waited_s": round(handle.waited_s, 6)} if handle.waited_s else {}
        if info is not None:
            extra.update(depth=info.depth, profile=info.profile)
        if handle.device_bytes:
            extra["device_bytes"] = handle.device_bytes
        if self.tiers is not None:
            extra["fast_tier"] = self.tiers.fast.url
        obs.record(
            obs.OpEvent(
                op="save",
                url=self.backend.url,
                step=handle.step,
                raw_bytes=info.raw_bytes if info is not None else 0,
                stored_bytes=info.object_bytes if info is not None else 0,
                blocked_s=handle.blocked_s,
                total_s=total,
                stages=dict(handle.stages),
                kind=info.kind if info is not None else None,
                mode=handle.mode + ("+tiered" if self.tiers is not None else ""),
                host_bytes=handle.host_bytes,
                ok=error is None,
                error=None if error is None else f"{type(error).__name__}: {error}",
                extra=extra,
            )
        )

    def _save_locked(
        self,
        state: Any,
        step: int,
        extra: Mapping[str, Any] | None,
        keyframe: bool,
        overwrite: bool,
        stages: dict[str, float],
        *,
        owned: bool = False,
        pre: _PreEncoded | None = None,
        reencode_out: builtins.list[Reencode] | None = None,
    ) -> StepInfo:
        """Encode (unless ``pre``), write and commit ``step``, then retention; under the lock."""
        with self._lock:
            recs = self._read_records()
            if step in visible(recs) and not overwrite:
                raise ConflictError(
                    f"{self.backend.url}: step {step} is already committed; delete it first or pass overwrite=True"
                )
            self._dropped.discard(step)  # saved again: it is the caller's to keep
            self._expected.discard(step)
            before: set[str] = set()
            if step in recs:  # replaced (or saved again after a delete that left it hidden): the step
                # below it must not stay a delta against its old bytes
                before = self.all_objects()
                recs = self._detach(step, recs)
            info = self._save(
                state,
                step,
                recs,
                extra=extra,
                keyframe=keyframe,
                replace=step in recs,
                stages=stages,
                owned=owned,
                pre=pre,
                reencode_out=reencode_out,
            )
            t = time.perf_counter()
            if step in recs:
                self._collect_hidden()  # deleted steps only the replaced bytes' chain reached
                self.reclaim(before | set(recs[step].live_objects))
            if all(s <= step for s in recs) and any(r.copy is not None for r in recs.values()):
                self._drop_copies()  # a first-layout store: the newest step is whole now
            if self.keep_last is not None:
                self.apply_retention()
            stages["retention"] = time.perf_counter() - t
            return info

    def _plan(self, step: int, recs: Mapping[int, StepInfo], keyframe: bool) -> tuple[StepInfo | None, BaseProvider | None]:
        """The base of a new ``step`` and the provider of its bytes: none, a save writes the step
        whole (the step before it becomes a delta against it behind the save: :meth:`_reencode`)."""
        return None, None

    def _encode_ahead(
        self,
        handle: SaveHandle,
        state: Any,
        step: int,
        col: engine.Collector,
        tree: Any,
        extra: Mapping[str, Any] | None,
        keyframe: bool,
        overwrite: bool,
    ) -> _PreEncoded:
        """``async-gpu``: encode the whole container now into host memory, and copy the state's
        bytes to pinned host buffers, kept as the step's bytes (one synchronize)."""
        with self._lock:
            recs = self._read_records()
            if step in visible(recs) and not overwrite:
                raise ConflictError(
                    f"{self.backend.url}: step {step} is already committed; delete it first or pass overwrite=True"
                )
            base, provider = self._plan(step, recs, keyframe)
            key = data_key(step)
            buf = _async.HostBuffer()
            t = time.perf_counter()
            manifest, size, prof = self._encode_into(state, buf, provider, step, extra)
            handle.stages["encode"] = time.perf_counter() - t
            handle.host_bytes = buf.nbytes
            cache = None
            total = sum(j.raw.numel() for j in col.jobs)
            if self._caching() and (self.base_cache_bytes is None or total <= self.base_cache_bytes):
                t = time.perf_counter()
                raws = host_copies([j.raw for j in col.jobs], self._pinned_pool)
                cache = self._make_cache(step, key, manifest, raws, copy=False, pooled=True, source=state_source(tree, col))
                handle.stages["cache"] = time.perf_counter() - t
            return _PreEncoded(base, key, manifest, size, prof, buf, cache)

    def _save(
        self,
        state: Any,
        step: int,
        recs: Mapping[int, StepInfo],
        *,
        extra: Mapping[str, Any] | None,
        keyframe: bool,
        replace: bool,
        stages: dict[str, float] | None = None,
        owned: bool = False,
        pre: _PreEncoded | None = None,
        reencode_out: builtins.list[Reencode] | None = None,
    ) -> StepInfo:
        """Write and commit one step to the fast tier (if any) or the store.  ``pre``: already
        encoded (``async-gpu``); ``owned``: ``state`` is a snapshot nobody else holds, so its
        storages become the cached base without a copy.  ``reencode_out``: gets what turning the
        step below it into a delta against it needs, when it is the new newest step and that
        step is due (:meth:`_reencode_target`; :meth:`_schedule_reencode` starts it)."""
        stages = {} if stages is None else stages
        backend = self.tiers.fast if self.tiers is not None else self.backend
        prog = Progress(self.progress, f"save step {step}")
        collected: pipeline.Collected | None = None
        try:
            if pre is None:
                if not isinstance(state, pipeline.Collected) and self._caching():
                    # collected once: the encoder codes it, and its storages and tree become the
                    # cache below (not a second walk of the tree after the save)
                    col = engine.Collector()
                    collected = pipeline.Collected(col, encode_tree(state, col.add))
                    due = self._reencode_target(step, recs) if reencode_out is not None else None
                    self._reserve_copies([j.raw for j in col.jobs], _base_of(self._cache, due))
                base, provider = self._plan(step, recs, keyframe)
                key = data_key(step)
                t = time.perf_counter()
                with backend.writer(key) as f:
                    cw = CountingWriter(f, prog, backend.describe(key))
                    manifest, size, prof = self._encode_into(collected or state, cw, provider, step, extra)
                stages["encode"] = time.perf_counter() - t  # the bytes stream out while encoding
            else:
                base, key, manifest, size, prof = pre.base, pre.key, pre.manifest, pre.size, pre.profile
                if any(s.get("delta") for s in manifest["storages"]):
                    assert base is not None
                    now = recs.get(base.step)
                    if now is None or now.object != base.object:
                        raise BaseMismatchError(
                            f"{self.backend.url}: step {step} was coded against step {base.step}, which was "
                            "deleted or replaced while the save was in flight; save it again"
                        )
                t = time.perf_counter()
                with backend.writer(key) as f:
                    pre.buf.write_to(CountingWriter(f, prog, backend.describe(key)))
                stages["write"] = time.perf_counter() - t
        except BaseException:
            if pre is not None:
                self._unpool(pre.cache)
            raise
        finally:
            prog.close()
        info = new_record(step, key, size, manifest, prof, base, extra)
        body = json.dumps(info.record(), separators=(",", ":"), sort_keys=True).encode()
        t = time.perf_counter()
        try:
            backend.put(commit_key(step), body, if_absent=not replace)  # the commit point
            self.forget_record(backend, commit_key(step))
        except BaseException as e:
            # the data object is removed where the record does not name it; a put whose answer was
            # lost but that was applied committed the step
            if not self.discard_unless_committed(backend, step, key, e):
                if pre is not None:
                    self._unpool(pre.cache)
                raise
        stages["commit"] = time.perf_counter() - t
        # this step's bytes become the cache: the base the step below is re-encoded against now,
        # and the bytes of this step when the next save re-encodes it
        old, self._cache = self._cache, None
        prev = self._reencode_target(step, recs) if reencode_out is not None else None
        if not _base_of(old, prev):
            self._unpool(old)
            old = None
        if not self._caching() and isinstance(state, pipeline.Collected):  # its pinned buffers, for the next save
            self._pinned_pool.give([j.raw for j in state.col.jobs])
        if self._caching():
            t = time.perf_counter()
            if pre is not None:
                self._cache = pre.cache
            elif isinstance(state, pipeline.Collected):  # an async-pinned snapshot: its buffers
                raws = [j.raw for j in state.col.jobs]
                self._cache = self._make_cache(
                    info.step, info.object, manifest, raws, copy=False, pooled=True, source=state_source(state.tree, state.col)
                )
                if self._cache is None:
                    self._pinned_pool.give(raws)
            else:
                assert collected is not None  # collected above: the store caches
                raws, source = [j.raw for j in collected.col.jobs], state_source(collected.tree, collected.col)
                self._cache = self._base_copies(info.step, info.object, manifest, raws, copy=not owned, source=source)
            stages["cache"] = stages.get("cache", 0.0) + time.perf_counter() - t
        cache = self._cache
        if prev is not None and reencode_out is not None:
            shown = frozenset(visible(recs)) | {step}
            reencode_out.append(Reencode(prev, old, info, cache if cache is not None and cache.step == step else None, shown))
        else:
            self._unpool(old)
        return info

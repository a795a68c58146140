"""Loads from a :class:`~s4w_core.store.CheckpointStore`: the newest step reads one object,
an older one the bases its deltas need (:class:`~s4w_core.store.chain.Chain`); verify, inspect."""

from __future__ import annotations

import builtins
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Literal, Mapping, TypeVar

import torch

from s4w_core import api, obs, pipeline
from s4w_core.errors import BaseMismatchError, CheckpointNotFoundError, FormatError, ManifestError, S4WError, StoreError
from s4w_core.format.container import ContainerReader
from s4w_core.hostmem import HostFill
from s4w_core.skeleton import decode_tree
from s4w_core.store.cache import BaseCache
from s4w_core.store.chain import Chain, chain_device
from s4w_core.store.core import Progress, StoreReader, after_saves
from s4w_core.store.records import StepInfo, dict_or_empty, visible
from s4w_core.store.reencode_check import same_layout

log = logging.getLogger("s4w_core.store")

__all__ = ["Loads"]

_T = TypeVar("_T")


def _background(fn: Callable[..., _T], *args: Any) -> Future[_T]:
    """``fn(*args)`` on a thread of its own (a daemon: it never holds up interpreter exit)."""
    fut: Future[_T] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the result
            fut.set_exception(e)

    threading.Thread(target=run, name="s4w-load-aside", daemon=True).start()
    return fut



#: how often a load reads the records again and retries when an object of its chain went away
#: under it (a concurrent re-encoding or delete): each retry needs the chain to have changed
_RACE_RETRIES = 3


def _chain_of(step: int, recs: Mapping[int, StepInfo]) -> builtins.list[tuple[int, str]]:
    """``(step, data object)`` along ``step``'s chain of bases in ``recs`` (empty: not there)."""
    out: builtins.list[tuple[int, str]] = []
    r = recs.get(step)
    while r is not None and (r.step, r.object) not in out:
        out.append((r.step, r.object))
        r = recs.get(r.base_step) if r.base_step is not None else None
    return out


class Loads(BaseCache):
    """Reading steps back."""

    @after_saves
    def load(
        self,
        step: int | None = None,
        map_location: pipeline.MapLocation = None,
        *,
        threads: int | None = None,
        from_copy: bool = True,
        remember: bool = True,
    ) -> Any:
        """Load ``step`` (default: the latest committed) bit for bit.

        Args:
            step: the step to load; ``None`` for the newest committed one.
            map_location: as for :func:`s4w_core.load`.
            threads: CPU threads for decoding.
            from_copy: read the step's keyframe copy when it has one (one object); ``False``
                reads its chain (to measure or check it).  A copy that is missing or corrupt is
                skipped for the chain (a corrupt one with a warning).
            remember: keep the newest step's bytes in host memory as the next save's delta base
                (within ``base_cache_bytes``, docs/STORE.md "Host memory"); ``False`` reads it once:
                no host copy is made on the load's path, and the next save's re-encoding decodes
                the step from its object instead (a resume: the framework adapters load so).
        Returns:
            The object saved at ``step``; every tensor holds exactly the bits saved.
        Raises:
            CheckpointNotFoundError: no such step, or its data object is missing.
            BaseMismatchError: a delta's base object is missing, corrupt or not the bytes the
                delta was made against.
            FormatError: the step's own container is truncated or corrupt (subclass names how).
            StoreError: the backend failed (unreachable endpoint, credentials, I/O).
        Example:
            >>> import torch, tempfile
            >>> from s4w_core import CheckpointStore
            >>> st = CheckpointStore(tempfile.mkdtemp())
            >>> for s in (1, 2): _ = st.save({"w": torch.full((3,), float(s))}, step=s)
            >>> st.load(1)["w"].tolist()
            [1.0, 1.0, 1.0]
        """

        t0 = time.perf_counter()
        timer = obs.StageTimer()
        rec: StepInfo | None = None
        try:
            with timer.stage("list"):
                recs = self._read_records()
                rec = self._record(step, recs)
            remember = (  # the next save re-encodes it: kept when it fits base_cache_bytes
                remember and rec.step == max(visible(recs)) and self._caching()
                and (self.base_cache_bytes is None or rec.raw_bytes <= self.base_cache_bytes)
            )
            own = None  # a step read from its copy is remembered under its own container's manifest
            if remember and from_copy and rec.copy is not None:
                own = _background(self._own_manifest_of, rec)
            fills: builtins.list[HostFill] = []
            try:
                with timer.stage("decode"):  # reads and decodes the step and the bases its deltas need
                    for attempt in range(_RACE_RETRIES + 1):
                        used: builtins.list[str] = []
                        try:
                            obj, raws, reader = self._load_record(
                                rec, map_location, threads, reserve=remember, source="auto" if from_copy else "chain",
                                used=used, fills=fills, recs=recs,
                            )
                            break
                        except (CheckpointNotFoundError, BaseMismatchError) as e:
                            # an object gone under this load: another process (or this store's own
                            # worker) re-encoded or deleted a step of the chain since the records
                            # were read; read them again and retry if the chain changed meanwhile
                            missing = isinstance(e, CheckpointNotFoundError) or isinstance(e.__cause__, CheckpointNotFoundError)
                            if attempt == _RACE_RETRIES or not missing:
                                raise
                            fresh = self._read_records()
                            if _chain_of(rec.step, fresh) == _chain_of(rec.step, recs):
                                raise
                            log.debug("s4weights: step %d: its chain changed while it loaded (%s); again", rec.step, e)
                            recs = fresh
                            rec = self._record(rec.step, recs)
                if remember:
                    with timer.stage("cache"):
                        if used != [rec.copy]:
                            manifest: Mapping[str, Any] | None = reader.manifest
                        else:
                            m = own.result() if own is not None else self._own_manifest_of(rec)
                            manifest = m if m is not None and same_layout(reader.manifest, m) is None else None
                        if manifest is not None:
                            self._remember(rec, manifest, raws, fills[-1] if fills else None)
            finally:
                for f in fills:
                    f.close()
                if own is not None:
                    own.exception()  # its thread ends with the load
        except BaseException as e:
            total = time.perf_counter() - t0
            obs.record(obs.OpEvent(
                op="load", url=self.backend.url, step=rec.step if rec is not None else step, raw_bytes=0,
                stored_bytes=0, blocked_s=total, total_s=total, stages=timer.stages,
                kind=rec.kind if rec is not None else None, mode="blocking", ok=False,
                error=f"{type(e).__name__}: {e}",
            ))
            raise
        total = time.perf_counter() - t0
        from_the_copy = used == [rec.copy]
        obs.record(obs.OpEvent(
            op="load", url=self.backend.url, step=rec.step, raw_bytes=rec.raw_bytes,
            stored_bytes=rec.copy_bytes if from_the_copy else rec.object_bytes,
            blocked_s=total, total_s=total, stages=timer.stages, kind=rec.kind, mode="blocking",
            extra={
                "depth": rec.depth,
                "chain_objects": len(rec.objects),
                "profile": rec.profile,
                "from": "copy" if from_the_copy else "chain",
            },
        ))
        return obj

    def _load_record(
        self,
        rec: StepInfo,
        map_location: pipeline.MapLocation,
        threads: int | None,
        *,
        reserve: bool = False,
        source: Literal["auto", "chain", "copy"] = "auto",
        used: builtins.list[str] | None = None,
        fills: builtins.list[HostFill] | None = None,
        recs: Mapping[int, StepInfo] | None = None,
    ) -> tuple[Any, builtins.list[torch.Tensor], ContainerReader]:
        """Read and decode one step.  ``reserve``: the step will be remembered as the next base
        (:meth:`_remember`): its pinned buffers are allocated in the background while it loads,
        and CUDA storages are copied into them batch by batch (:class:`HostFill`, appended
        to ``fills``: the caller finishes or closes it).
        ``source``: ``auto`` reads the keyframe copy when the step has one (falling back to the
        chain if it is missing or corrupt), ``chain`` never, ``copy`` only (CheckpointNotFoundError
        without one).  ``used`` gets the data object the step was decoded from."""
        used = [] if used is None else used
        if source == "copy" and rec.copy is None:
            raise CheckpointNotFoundError(f"{self.backend.url}: step {rec.step} has no keyframe copy")
        if source != "chain" and rec.copy is not None:
            try:
                got = self._load_one(
                    rec, rec.copy, rec.copy_bytes, map_location, threads, reserve=reserve, fills=fills, recs=recs
                )
                used.append(rec.copy)
                return got
            except (CheckpointNotFoundError, FormatError, BaseMismatchError) as e:
                if source == "copy":
                    raise
                if isinstance(e, CheckpointNotFoundError):
                    log.debug("s4weights: step %d: its keyframe copy is gone (%s); reading its chain", rec.step, e)
                else:
                    log.warning(
                        "s4weights: step %d of %s: its keyframe copy %s is unusable (%s: %s); reading its chain",
                        rec.step, self.backend.url, rec.copy, type(e).__name__, e,
                    )
        got = self._load_one(rec, rec.object, rec.object_bytes, map_location, threads, reserve=reserve, fills=fills, recs=recs)
        used.append(rec.object)
        return got

    def _load_one(
        self,
        rec: StepInfo,
        key: str,
        nbytes: int,
        map_location: pipeline.MapLocation,
        threads: int | None,
        *,
        reserve: bool = False,
        fills: builtins.list[HostFill] | None = None,
        recs: Mapping[int, StepInfo] | None = None,
    ) -> tuple[Any, builtins.list[torch.Tensor], ContainerReader]:
        """Decode step ``rec`` from data object ``key``: its own container, or its keyframe copy
        (which must hold no delta)."""
        ctx = Chain(self._open, self.backend.url, rec, threads, recs if recs is not None else self._read_records())
        prog = Progress(self.progress, f"load step {rec.step}")
        fill: HostFill | None = None
        try:
            reader = ctx.reader(key, nbytes, rec.step)
            if key != rec.object:
                m = reader.manifest
                if any(e.get("delta") for e in m["storages"]):
                    raise ManifestError(f"{reader.name}: the keyframe copy of step {rec.step} holds deltas")
                if dict_or_empty(m.get("extra")).get("step") != rec.step or sum(e["nbytes"] for e in m["storages"]) != rec.raw_bytes:
                    raise ManifestError(f"{reader.name}: not a keyframe copy of step {rec.step} (another step or size)")
            if reserve:
                fill = self._reserve_base(reader.manifest, map_location)
            if reader.manifest and any(e.get("delta") for e in reader.manifest["storages"]):
                ctx.open_all(ctx.bases())  # the bases, in parallel
            if prog.bar is not None and isinstance(reader, StoreReader):
                reader.counter = prog.update
            ctx.prefetch(reader.manifest["storages"], chain_device(reader.manifest, map_location))
            raws = pipeline.decode_storages(reader, map_location, threads, ctx.resolve, fill)
            m = reader.manifest
            obj = decode_tree(m["tree"], pipeline.build_tensors(m, raws))
            if fill is not None and fills is not None:
                fills.append(fill)
                fill = None
            return obj, raws, reader
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(
                f"step {rec.step}: its data object {key} is missing from {self.backend.url} "
                f"(deleted concurrently, or the store was damaged): {e}"
            ) from e
        finally:
            if fill is not None:  # not handed to the caller: the load failed
                fill.close()
            prog.close()
            ctx.close()

    def _own_manifest_of(self, rec: StepInfo) -> Mapping[str, Any] | None:
        """The manifest of the step's own container, for a step loaded from its keyframe copy:
        the next save's delta names that container and its checksums (the copy was checked to
        hold the same bytes when it was committed, and its own checksums when it was decoded;
        the caller checks that the two line up with :func:`same_layout`). None (the next save
        then reads its base from the chain) if it cannot be read. One ranged read, which
        :meth:`load` runs while the copy loads."""
        try:
            reader = self._open(rec.object, whole=False, expect=rec.object_bytes, what=f" (step {rec.step})")
        except S4WError as e:
            log.debug("s4weights: step %d: its own container is unreadable (%s): not kept as the base", rec.step, e)
            return None
        try:
            return reader.manifest
        finally:
            reader.close()

    def verify(self, step: int | None = None) -> api.VerifyReport:
        """Decode ``step`` (and the bases it needs) and check every checksum, and its keyframe copy
        if it has one; never raises for corrupt content (``ok`` is False and ``problems`` says
        why)."""
        rec = self.info(step)
        problems: builtins.list[str] = []
        decoded: builtins.list[tuple[Mapping[str, Any], builtins.list[torch.Tensor]]] = []
        for source in ("chain", "copy") if rec.copy is not None else ("chain",):
            try:
                _, got, reader = self._load_record(rec, "cpu", self.threads, source=source)  # type: ignore[arg-type]
                decoded.append((reader.manifest, got))
            except (FormatError, BaseMismatchError, CheckpointNotFoundError, StoreError) as e:
                problems.append(("keyframe copy: " if source == "copy" else "") + f"{type(e).__name__}: {e}")
        if len(decoded) == 2:
            (own, a), (copy, b) = decoded
            why = same_layout(copy, own) or next(
                (f"storage {i} holds other bytes" for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)), None
            )
            if why is not None:
                problems.append(f"keyframe copy {rec.copy}: does not match the step's own container: {why}")
        raws = decoded[0][1] if decoded else []
        where = f"{self.backend.url} step {rec.step}"
        if problems:
            return api.VerifyReport(where, False, 0, 0, problems)
        return api.VerifyReport(where, True, len(raws), sum(r.numel() for r in raws), [])

    def chain_objects(self, step: int | None = None) -> builtins.list[str]:
        """The data objects a load of ``step`` (default: latest) may read: its own, then those of
        the steps its deltas are against (reads commit records only).

        Example:
            >>> import torch, tempfile
            >>> from s4w_core import CheckpointStore
            >>> st = CheckpointStore(tempfile.mkdtemp())
            >>> w = torch.randn(4096, generator=torch.Generator().manual_seed(0))
            >>> _ = st.save({"w": w}, step=1); _ = st.save({"w": w + 1e-3}, step=2)
            >>> st.wait(); len(st.chain_objects(1)), len(st.chain_objects(2))
            (2, 1)
        """
        recs = self._read_records()
        rec = self._record(step, recs)
        out = builtins.list(rec.objects)
        seen = {rec.step}
        while rec.reverse and rec.base_step in recs and rec.base_step not in seen:
            rec = recs[rec.base_step]
            seen.add(rec.step)
            out += [o for o in rec.objects if o not in out]
        return out

    def container_info(self, step: int | None = None) -> dict[str, Any]:
        """:func:`s4w_core.info` of the step's container (reads only its manifest)."""
        rec = self.info(step)
        reader = self._open(rec.object, whole=False, expect=rec.object_bytes, what=f" (step {rec.step})")
        try:
            d = api.info(reader)  # type: ignore[arg-type]  # open_reader takes readers too
        finally:
            reader.close()
        d["path"] = reader.name if self.tiers is not None else self.backend.describe(rec.object)
        return d

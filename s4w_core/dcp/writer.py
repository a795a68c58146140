"""The DCP :class:`S4StorageWriter`: compresses every rank's shards with s4weights.

DCP's own ``_extensions`` only see byte streams after ``torch.save`` (CPU, not tensor-aware).  This
module plugs in one level lower, at the public :class:`~torch.distributed.checkpoint.StorageWriter` /
:class:`~torch.distributed.checkpoint.StorageReader` interfaces, so the codec sees the tensors
themselves, on the device they live on (nvCOMP on the GPU where ``profile="auto"`` finds one).

Layout of one checkpoint (a folder, local or ``s3://bucket/prefix``)::

    __0_<save>.s4w       rank 0's tensors and byte items: one s4weights container
    __1_<save>.s4w       rank 1's ...
    .s4w_metadata.json   DCP's Metadata as JSON, written last (temp name, then rename): the commit

``<save>`` is an id shared by all ranks of one ``dcp.save``; data files of an older save at the same
path are deleted only after the new metadata is in place, so a crash mid-save leaves the previous
checkpoint readable.  Nothing is pickled by this module: the metadata is JSON.  (DCP's planner itself
turns non-tensor values into bytes with ``torch.save`` and back with ``torch.load``; those bytes are
stored verbatim, compressed.)

A training run's steps under one root (``step=``): each rank's items become one step of the
rank's own :class:`~s4w_core.store.CheckpointStore` (the newest step whole, older steps reverse
deltas against the step after them), and a step is committed by its metadata record, written
last; see :mod:`s4w_core.dcp.run` for the layout.  Loads of a run read, from each rank store,
only the storages their plan needs, so any world size and placement loads any step.

Example::

    import torch.distributed.checkpoint as dcp
    from s4w_core.dcp import S4StorageWriter, S4StorageReader

    # one self-contained checkpoint per folder
    dcp.save(state, storage_writer=S4StorageWriter("ckpt/step_100"))
    dcp.load(state, storage_reader=S4StorageReader("ckpt/step_100"))
    fut = dcp.async_save(state, storage_writer=S4StorageWriter("s3://bucket/run/step_200"))

    # a run: every step under one root, each rank's shards a delta chain
    dcp.async_save(state, storage_writer=S4StorageWriter("s3://bucket/run", step=300))
    dcp.load(state, storage_reader=S4StorageReader("s3://bucket/run"))            # the newest step
    dcp.load(state, storage_reader=S4StorageReader("s3://bucket/run", step=100))  # an older one
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import json
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

import s4w_core.config
from s4w_core import api, gpu, obs, pipeline
from s4w_core.dcp.run import (
    RunRoot,
    cleanup_orphans,
    rank_store,
    rank_store_name,
)
from s4w_core.errors import UnsupportedTypeError
from s4w_core.store.records import check_step

if TYPE_CHECKING:
    from s4w_core.hostmem import PinnedPool

from s4w_core.dcp.meta import (
    SUFFIX,
    Folder,
    FolderCheckpoint,
    ItemInfo,
    Prefix,
    item_key,
    merge_stages,
    metadata_name,
    metadata_to_json,
    projection,
    step_from,
)

__all__ = ["S4StorageWriter"]


# ----------------------------------------------------------------------------- staging
def _stage_tree(obj: Any, fn: Callable[[torch.Tensor], Any], leaf: Callable[[Any], Any] = copy.deepcopy) -> Any:
    """A copy of a (nested) state dict: ``fn`` applied to every tensor, ``leaf`` to every other
    value (dicts, lists and tuples are rebuilt; a namedtuple is a leaf)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _stage_tree(v, fn, leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stage_tree(v, fn, leaf) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_stage_tree(v, fn, leaf) for v in obj)
    return leaf(obj)


def _clone(obj: torch.Tensor, to_cpu: bool, pin: bool) -> torch.Tensor:
    """A copy of one tensor that no longer aliases training memory: on its device, or (``to_cpu``)
    in host memory, pinned by torch's allocator when ``pin`` (then copied with ``non_blocking``)."""
    t = obj.detach()
    if to_cpu and t.device.type != "cpu":
        out = torch.empty_like(t, device="cpu", pin_memory=pin)
        out.copy_(t, non_blocking=pin)
        return out
    return t.clone()


def _pool_staged(t: torch.Tensor) -> bool:
    """Is ``t`` staged into a buffer of the pinned pool (a plain dense CUDA tensor with bytes)?
    Everything else is staged by :func:`_clone`."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.is_cuda
        and not t.is_quantized
        and t.numel() > 0
    )


def _dtensor_local(t: torch.Tensor) -> torch.Tensor | None:
    """The local shard of a DTensor when it is a plain dense CUDA tensor (the pinned pool stages
    it; an empty one is a new empty host tensor), else None."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return None
    if isinstance(t, DTensor):
        with torch.no_grad():  # no autograd: the shard itself (a view of it for a Parameter), no copy
            local = t.to_local()
        if _pool_staged(local) or (type(local) is torch.Tensor and local.is_cuda and local.numel() == 0):
            return local
    return None


def _with_local(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """DTensor ``t``'s sharding over a staged copy of its local shard, as torch's own stagers build
    it (``_state_dict_utils``, ``_pg_transport``). No public API keeps a host shard on the host:
    ``DTensor.from_local`` moves it to the mesh's device, which would undo the staging."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, t._spec, requires_grad=False)  # type: ignore[attr-defined]  # noqa: SLF001 - no public way (above)


_POOL: PinnedPool | None = None
_POOL_LOCK = threading.Lock()


def _pinned_pool() -> PinnedPool:
    """The process-wide pool of pinned host buffers that ``stage_to="cpu"`` stages into
    (created on first use; every writer shares it, so consecutive saves reuse its buffers)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from s4w_core.hostmem import PinnedPool

            _POOL = PinnedPool()
        return _POOL


@dataclass(eq=False)
class _Staged:
    """What one :meth:`S4StorageWriter.stage` did, for the ``write_data`` of the same save."""

    staged_s: float  # seconds the caller was blocked
    device: torch.device | None  # the CUDA device the state came from (None: no CUDA tensors)
    bufs: list[torch.Tensor] = field(default_factory=list)  # pool buffers holding the copy
    keys: frozenset[int] = frozenset()  # their addresses: the staged tensors' data_ptr()s
    alive: list[weakref.ref[Any]] = field(default_factory=list)  # the arrays behind the staged tensors

    def dead(self) -> bool:
        """Nothing refers to the staged tensors any more (their save failed before writing)."""
        return bool(self.alive) and all(r() is None for r in self.alive)


def _cuda_devices(state_dict: Any) -> list[torch.device]:
    """The CUDA devices of the tensors in ``state_dict``, in order of appearance."""
    if not torch.cuda.is_available():
        return []
    return list(dict.fromkeys(t.device for t in _iter_tensors(state_dict) if t.is_cuda))


def _sync_streams(devices: Iterable[torch.device]) -> None:
    """Wait for the copies enqueued on the current stream of each CUDA device."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.current_stream(d).synchronize()


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _iter_tensors(v)


# ----------------------------------------------------------------------------- writer
class S4StorageWriter(FolderCheckpoint, StorageWriter):
    """A DCP :class:`StorageWriter` that writes one compressed s4weights container per rank.

    Works with ``dcp.save`` and ``dcp.async_save`` (it is its own ``AsyncStager``).  By default
    (``stage_to="cpu"``) ``dcp.async_save`` blocks for one device-to-host copy of the state into
    pinned host buffers that later saves reuse (the first save allocates them), and the background
    write still codes on the GPU the state came from (``profile="auto"`` gives ``"fast"`` there);
    ``stage_to="device"`` stages faster but holds a full device copy of the state until the write
    has finished.

    Args:
        path: the checkpoint folder, a local path or ``s3://bucket/prefix``; ``dcp.save``'s
            ``checkpoint_id`` overrides it.  With ``step``: the run's root, holding every step.
        step: save step ``step`` of the run at ``path`` (each rank's items a delta chain, see
            :mod:`s4w_core.dcp.run`); None (default): ``path`` is one self-contained checkpoint.
        keep_last: with ``step``: once the step is committed, only the newest ``keep_last`` steps
            stay listed; the others' data goes at each rank's next save.
        profile: s4weights profile (``"auto"``: GPU codecs when the tensors are on a usable GPU,
            or were staged from one by ``dcp.async_save``, else ``"portable"``; ``"portable"``:
            decodable anywhere).
        overwrite: allow writing over an existing checkpoint at ``path`` (the old one stays
            readable until the new metadata commits; its data files are deleted afterwards), or
            over a committed ``step`` of a run.
        threads: CPU threads for coding.
        stage_to: where ``dcp.async_save`` stages its copy: ``"cpu"`` (default; pinned host
            buffers, reused across saves) or ``"device"`` (a clone on the tensors' device).
        s3_options: passed to the store's S3 backend (endpoint, region, ...).
    Raises:
        RuntimeError: at save, when ``overwrite=False`` and a checkpoint (or ``step``) exists at ``path``.
        ValueError: ``step`` is not an integer in [0, 10**12).
        StoreError: the folder cannot be written.
    Example:
        >>> import torch, tempfile, torch.distributed.checkpoint as dcp
        >>> from s4w_core.dcp import S4StorageWriter, S4StorageReader
        >>> d = tempfile.mkdtemp(); sd = {"w": torch.arange(6.0)}
        >>> _ = dcp.save(sd, storage_writer=S4StorageWriter(d), no_dist=True)
        >>> out = {"w": torch.zeros(6)}; dcp.load(out, storage_reader=S4StorageReader(d), no_dist=True)
        >>> out["w"].tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """

    _synchronize_after_execute: bool = False  # AsyncStager: staging below is blocking

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        step: int | None = None,
        keep_last: int | None = None,
        profile: str = "auto",
        overwrite: bool = True,
        threads: int | None = None,
        stage_to: str = "cpu",
        s3_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        s4w_core.config.check_profile(profile)
        if profile != "portable":  # the GPU codec's kernels compiled (or loaded) before the first save needs them
            gpu.warm_up(when_cuda_used=True)
        if stage_to not in ("device", "cpu"):
            raise ValueError(f"stage_to must be 'device' or 'cpu', got {stage_to!r}")
        self.profile = profile
        self.overwrite = overwrite
        self.threads = threads
        self.stage_to = stage_to
        self._s3_options = s3_options
        self.folder = Folder(path, s3_options) if path is not None else None
        self.step = None if step is None else check_step(step)
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1 or step is None):
            raise ValueError(f"keep_last must be a positive integer, and needs step=, got {keep_last!r}")
        self.keep_last = keep_last
        self.run: RunRoot | None = None
        if self.step is not None and path is not None:
            self.run = RunRoot(path, s3_options)
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False
        self.use_collectives = True
        self.last_reports: list[api.SaveReport] = []
        self.last_steps: list[Any] = []  # run mode: the StepInfo of this rank's store, per save
        self._init_staging()

    def _init_staging(self) -> None:
        self._lock = threading.Lock()
        # the stagings into pool buffers whose write has not given them back yet (oldest first)
        self._generations: list[_Staged] = []
        # the last stage() without pool buffers, for the next write_data (its blocked time, device)
        self._last: _Staged | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a process-based async_save pickles the writer: the staging bookkeeping stays here
        state = self.__dict__.copy()
        for k in ("_lock", "_generations", "_last"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_staging()

    # ---- AsyncStager protocol (dcp.async_save uses the writer as its stager)
    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A training-safe copy of ``state_dict``: ``stage_to="cpu"``: plain CUDA tensors copied into
        pinned buffers of the process-wide pool (reused by the next save once this one is written),
        other tensors cloned to host memory; ``stage_to="device"``: tensors cloned on their device.
        Returns once the copies are complete."""
        t0 = time.perf_counter()
        devices = _cuda_devices(state_dict)
        gen: _Staged | None = None
        if self.stage_to == "cpu" and devices:
            staged, gen = self._stage_pinned(state_dict, devices)
        else:
            pin = torch.cuda.is_available()
            staged = _stage_tree(state_dict, functools.partial(_clone, to_cpu=self.stage_to == "cpu", pin=pin))
            _sync_streams(devices)
        info = gen if gen is not None else _Staged(0.0, None)
        info.device = devices[0] if devices else None
        info.staged_s = time.perf_counter() - t0
        with self._lock:
            if info.bufs:
                self._generations.append(info)
            else:
                self._last = info
        return staged

    def _stage_pinned(self, state_dict: dict[str, Any], devices: list[torch.device]) -> tuple[Any, _Staged]:
        """:meth:`stage` into the pinned pool: one ``take`` for all plain CUDA tensors, one
        non-blocking copy each, one stream synchronize per device."""
        pool = _pinned_pool()
        with self._lock:  # stagings whose save failed before writing: nothing reads them any more
            dead = [g for g in self._generations if g.dead()]
            self._generations = [g for g in self._generations if g not in dead]
        for g in dead:
            pool.give(g.bufs)
        srcs: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> None:
            local = t if _pool_staged(t) else _dtensor_local(t)
            if local is not None and local.numel():
                srcs.append(local)

        _stage_tree(state_dict, collect, lambda _: None)
        # No pool.ahead() afterwards: with one save in flight at a time (DCP's usual pattern) the
        # next take() reuses this generation once written, and a spare one would be dropped by it.
        bufs = pool.take([t.numel() * t.element_size() for t in srcs], srcs[0].device) if srcs else []
        it = iter(bufs)
        alive: list[weakref.ref[Any]] = []

        def into_buffer(t: torch.Tensor) -> torch.Tensor:
            # a tensor of its own storage (exactly its bytes, which the container stores) on the
            # buffer's memory; the array between them keeps the buffer alive, and tells when the
            # staged tensors are all gone
            arr = next(it).numpy()
            alive.append(weakref.ref(arr))
            out = torch.from_numpy(arr).view(t.dtype).view(t.shape)
            out.copy_(t.detach(), non_blocking=True)
            return out

        def copy_in(t: torch.Tensor) -> torch.Tensor:
            if _pool_staged(t):
                return into_buffer(t)
            local = _dtensor_local(t)
            if local is not None:  # FSDP2 / TP: the rank's shard into the pool, same sharding
                return _with_local(t, into_buffer(local) if local.numel() else torch.empty_like(local, device="cpu"))
            return _clone(t, to_cpu=True, pin=True)

        try:
            staged = _stage_tree(state_dict, copy_in)
            _sync_streams(devices)
        except BaseException:
            with contextlib.suppress(Exception):
                _sync_streams(devices)  # copies still in flight write into the buffers
            pool.give(bufs)
            raise
        return staged, _Staged(0.0, None, bufs, frozenset(b.data_ptr() for b in bufs), alive)

    def synchronize_staging(self) -> None:
        """Staging is blocking: nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""

    # ---- StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.folder = Folder(checkpoint_id, self._s3_options)
            if self.step is not None:
                self.run = RunRoot(checkpoint_id, self._s3_options)
        if self.folder is None:
            raise ValueError("S4StorageWriter needs a path (or a checkpoint_id passed to dcp.save)")
        self.save_id = uuid.uuid4().hex
        self.last_reports = []
        self.last_steps = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.folder is None:
            raise ValueError("S4StorageWriter needs a path (or a checkpoint_id passed to dcp.save)")
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _meta_name(self) -> str:
        return metadata_name(None if self.use_collectives or self.rank is None else self.rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        assert self.folder is not None
        self.folder.mkdir()
        if self.run is not None and self.step is not None:
            if (self.is_coordinator or not self.use_collectives) and not self.overwrite:
                mine = None if self.use_collectives or self.rank is None else self.rank
                if self.run.has(self.step, mine):
                    raise RuntimeError(f"step {self.step} is committed under {self.run} and overwrite=False")
            if not self.use_collectives and self.rank is not None:
                plan = dataclasses.replace(plan, storage_data=Prefix(rank_store_name(self.rank)))
            return plan
        if self.is_coordinator or not self.use_collectives:
            if self.folder.exists(self._meta_name()) and not self.overwrite:
                raise RuntimeError(f"a DCP checkpoint exists at {self.folder} and overwrite=False")
        if not self.use_collectives and self.rank is not None:
            plan = dataclasses.replace(plan, storage_data=Prefix(f"__{self.rank}_{self.save_id[:12]}"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.run is not None:
            return [
                dataclasses.replace(p, storage_data=Prefix(rank_store_name(i))) if p.storage_data is None else p
                for i, p in enumerate(plans)
            ]
        sid = self.save_id[:12]
        return [
            dataclasses.replace(p, storage_data=Prefix(f"__{i}_{sid}")) if p.storage_data is None else p
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.folder is not None
        t0 = time.perf_counter()
        timer = obs.StageTimer()
        inner: list[obs.OpEvent] = []
        info: _Staged | None = None
        claimed = False
        try:
            with timer.stage("resolve"):
                fname, tensors, blobs, placed = self._gather(plan, planner)
            info = self._claim(tensors.values(), planner)
            claimed = True
            profile = self.profile
            if profile == "auto" and info is not None and info.device is not None and self.stage_to == "cpu":
                # staged from the GPU into host memory: code it on the GPU still, as device staging does
                profile = "fast" if pipeline.gpu_backend() is not None else profile
            # DCP's async thread starts on cuda:0: code on the device the state came from
            dev = None if info is None else info.device
            on: contextlib.AbstractContextManager[Any] = (
                torch.cuda.device(dev) if dev is not None and dev.type == "cuda" else contextlib.nullcontext()
            )
            t1 = time.perf_counter()
            with on, obs.suppress() as inner:  # this rank's container: one event below, not one per file
                if self.run is not None:
                    report = self._save_step(fname, {"t": tensors, "b": blobs}, profile)
                else:
                    report = self.folder.save_container({"t": tensors, "b": blobs}, fname, profile, self.threads)
            container_s = time.perf_counter() - t1
        except BaseException as e:
            if not claimed:
                with contextlib.suppress(Exception):
                    info = self._claim([], planner)
            self._give_back(info, failed=True)
            self._record(t0, None if info is None else info.staged_s, timer.stages, inner, None, e)
            raise
        self._give_back(info, failed=False)
        merge_stages(timer.stages, inner)
        # closing the data object (an S3 multipart upload completes here) happens after save() returned
        late = container_s - sum(e.total_s for e in inner)
        if late > 0:
            timer.add("commit", late)
        self._record(t0, None if info is None else info.staged_s, timer.stages, inner, report, None)
        self.last_reports.append(report)
        results = [
            WriteResult(index=it.index, size_in_bytes=n, storage_data=ItemInfo(fname, kind, key))
            for it, kind, key, n in placed
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _save_step(self, name: str, state: dict[str, Any], profile: str) -> api.SaveReport:
        """Run mode: ``state`` (this rank's items) as step ``self.step`` of the rank's store
        ``name`` (whole; the step below becomes a delta against it behind the save).  A step of
        the rank store that no run step names and that a newer run step overtook is deleted
        first; the step itself is overwritten if an earlier, uncommitted save left it."""
        assert self.run is not None and self.step is not None
        t0 = time.perf_counter()
        store = rank_store(self.run, name, profile=profile, threads=self.threads)
        cleanup_orphans(store, self.run, self.step)
        info = store.save(state, self.step, overwrite=True, extra={"dcp_save_id": self.save_id})
        self.last_steps.append(info)
        return api.SaveReport(
            path=f"{store.backend.url}@{self.step}", profile=info.profile, raw_bytes=info.raw_bytes,
            stored_bytes=info.stored_bytes, file_bytes=info.object_bytes, seconds=time.perf_counter() - t0,
        )

    def _claim(self, tensors: Iterable[torch.Tensor], planner: SavePlanner) -> _Staged | None:
        """The :meth:`stage` whose copy this ``write_data`` writes: the staging into pool buffers
        that the tensors the plan resolved (or the planner's state dict: a rank's plan may hold none
        of its tensors after deduplication) live in, else the last staging without pool buffers;
        None when neither (a blocking ``dcp.save``).  A matched staging is no longer listed: this
        write gives its buffers back.  (A pool buffer's address identifies its staging: the
        staging holds the buffer until it is given back.)"""
        ptrs = {t.data_ptr() for t in tensors if t.device.type == "cpu" and t.numel()}
        sd = getattr(planner, "state_dict", None)  # DefaultSavePlanner: the (flattened) staged state
        if isinstance(sd, dict):
            for t in _iter_tensors(sd):
                if type(t) is torch.Tensor and t.device.type == "cpu" and t.numel():
                    ptrs.add(t.data_ptr())
        with self._lock:
            for g in self._generations:
                if g.keys & ptrs:
                    self._generations.remove(g)
                    return g
            info, self._last = self._last, None
            return info

    def _give_back(self, info: _Staged | None, failed: bool) -> None:
        """The container is written (or its write failed): the staged copy's pool buffers serve the
        next staging."""
        if info is None or not info.bufs:
            return
        if failed and info.device is not None and info.device.type == "cuda":
            with contextlib.suppress(Exception):  # host-to-device copies of the buffers may still run
                torch.cuda.synchronize(info.device)
        _pinned_pool().give(info.bufs)
        info.bufs = []

    def _record(
        self,
        t0: float,
        staged_s: float | None,
        stages: dict[str, float],
        inner: list[obs.OpEvent],
        report: api.SaveReport | None,
        error: BaseException | None,
    ) -> None:
        """One event per rank and save; after ``dcp.async_save`` its caller was blocked only while
        :meth:`stage` copied the state."""
        assert self.folder is not None
        took = time.perf_counter() - t0
        if staged_s is not None:
            stages = {"snapshot": staged_s, **stages}
        obs.record(obs.OpEvent(
            op="save", url=self.folder.location, step=self._obs_step(),
            raw_bytes=report.raw_bytes if report else 0, stored_bytes=report.file_bytes if report else 0,
            blocked_s=took if staged_s is None else staged_s, total_s=took + (staged_s or 0.0), stages=stages,
            mode="dcp" if staged_s is None else "dcp-async", ok=error is None,
            error=None if error is None else f"{type(error).__name__}: {error}", rank=self.rank,
            extra={"profile": report.profile} if report else {},
        ))

    def _gather(
        self, plan: SavePlan, planner: SavePlanner
    ) -> tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor], list[tuple[WriteItem, str, str, int]]]:
        prefix: Prefix = plan.storage_data
        fname = prefix.prefix if self.run is not None else prefix.prefix + SUFFIX
        tensors: dict[str, torch.Tensor] = {}
        blobs: dict[str, torch.Tensor] = {}
        placed: list[tuple[WriteItem, str, str, int]] = []
        for item in plan.items:
            key = item_key(item)
            if self.run is not None and item.tensor_data is not None:
                # a shard of another shape (another placement) is another storage: stored whole
                key += "#" + "x".join(str(int(x)) for x in item.tensor_data.chunk.sizes)
            while key in tensors or key in blobs:
                key += "+"
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                blobs[key] = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                )
                placed.append((item, "b", key, len(raw)))
            else:
                if not isinstance(data, torch.Tensor):
                    raise UnsupportedTypeError(
                        f"DCP item {item.index.fqn!r} resolved to {type(data).__qualname__}, not a tensor"
                    )
                t = projection(data)
                tensors[key] = t
                placed.append((item, "t", key, t.numel() * t.element_size()))
        return fname, tensors, blobs, placed

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.folder is not None
        metadata.version = "1.0.0"
        storage: dict[MetadataIndex, ItemInfo] = {}
        for wr_list in results:
            storage.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        body = metadata_to_json(metadata)
        if self.step is not None:
            body["step"] = self.step
        doc = json.dumps(body, separators=(",", ":")).encode()
        t0 = time.perf_counter()
        try:
            if self.run is not None and self.step is not None:
                # every rank's store committed its step (write_data returned on every rank): commit
                own = None if self.use_collectives or self.rank is None else self.rank
                self.run.put_record(self.step, doc, own)
                if self.keep_last is not None:  # retention: records now, each rank's data at its next save
                    for old in self.run.steps(own)[: -self.keep_last]:
                        self.run.drop_record(old, own)
                return
            self.folder.write_bytes(self._meta_name(), doc)  # the commit point
        except BaseException as e:  # the rank events said the data was written: this save failed after all
            took = time.perf_counter() - t0
            obs.record(obs.OpEvent(
                op="save", url=self.folder.location, step=self._obs_step(), raw_bytes=0,
                stored_bytes=0, blocked_s=took, total_s=took, stages={"commit": took}, mode="dcp", ok=False,
                error=f"{type(e).__name__}: {e}", rank=self.rank,
            ))
            raise
        # The previous save's data files (other save ids) are garbage now.
        keep = {i.file for i in storage.values()}
        if self.use_collectives or self.rank is None:
            stale = [n for n in self.folder.list() if n.startswith("__") and n.endswith(SUFFIX) and n not in keep]
        else:
            mine = f"__{self.rank}_"
            stale = [n for n in self.folder.list() if n.startswith(mine) and n.endswith(SUFFIX) and n not in keep]
        for n in stale:
            self.folder.remove(n)

    def _obs_step(self) -> int | None:
        assert self.folder is not None
        return self.step if self.step is not None else step_from(self.folder.location)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self.folder is None else self.folder.location, save_id=self.save_id)


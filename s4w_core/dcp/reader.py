"""The DCP :class:`S4StorageReader`: loads a checkpoint folder or a run's step written by
:class:`s4w_core.dcp.S4StorageWriter` (see :mod:`s4w_core.dcp` for the layout)."""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from s4w_core import obs
from s4w_core.dcp.run import (
    RunRoot,
    load_items,
    rank_store,
    wait_rank_stores,
)
from s4w_core.errors import CheckpointNotFoundError, ManifestError
from s4w_core.store.records import check_step

if TYPE_CHECKING:
    pass

from s4w_core.dcp.meta import (
    METADATA_NAME,
    Folder,
    FolderCheckpoint,
    ItemInfo,
    merge_stages,
    metadata_from_json,
    metadata_name,
    narrow,
    step_from,
)

__all__ = ["S4StorageReader"]


# ----------------------------------------------------------------------------- reader
class S4StorageReader(FolderCheckpoint, StorageReader):
    """A DCP :class:`StorageReader` for checkpoints written by :class:`S4StorageWriter`.

    Each rank decodes only the rank files its load plan needs (on the device of the tensors it
    loads into when that is a GPU), then copies the requested slices into place, so resharding
    (a different world size or placement on load) works.  From a run (``S4StorageWriter(root,
    step=N)``) it reads, by byte ranges, only the storages holding the items its plan asks for.

    Args:
        path: the checkpoint folder (local or ``s3://``), or a run's root; ``dcp.load``'s
            ``checkpoint_id`` overrides it.
        step: the step of the run at ``path`` to load; None: the newest committed step when
            ``path`` is a run's root (a folder without a single checkpoint's metadata).
        threads: CPU threads for decoding.
        s3_options: passed to the store's S3 backend.
    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path`` (or no such ``step``).
        ManifestError: the metadata file is malformed.
    Example: see :class:`S4StorageWriter`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        step: int | None = None,
        threads: int | None = None,
        s3_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._s3_options = s3_options
        self.folder = Folder(path, s3_options) if path is not None else None
        self.step = None if step is None else check_step(step)
        self.run: RunRoot | None = None
        self.loaded_step: int | None = None  # run mode: the step read_metadata chose
        self.threads = threads
        self.storage_data: dict[MetadataIndex, ItemInfo] = {}
        self.load_id = uuid.uuid4().hex
        self.rank: int | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.folder = Folder(checkpoint_id, self._s3_options)
            self.run = None
        self.load_id = uuid.uuid4().hex

    def _run_mode(self) -> bool:
        """A run root (``step`` given, or no single checkpoint's metadata at the path)."""
        assert self.folder is not None
        if self.run is None and (self.step is not None or not self.folder.exists(METADATA_NAME)):
            run = RunRoot(self.folder.location, self._s3_options)
            if self.step is None and not run.steps() and not run.steps(0):
                return False  # neither: the single-checkpoint error below names what is missing
            self.run = run
        return self.run is not None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.folder is None:
            raise ValueError("S4StorageReader needs a path (or a checkpoint_id passed to dcp.load)")
        rank = kwargs.get("rank")
        if self._run_mode():
            assert self.run is not None
            wait_rank_stores(self.run.url)  # this process's re-encodings of the run land first
            where = self.run.url
            self.loaded_step, raw = self.run.get_record(self.step, rank)
            name = f"step {self.loaded_step}"
        else:
            name = metadata_name(rank)
            where = self.folder.location
            try:
                raw = self.folder.read_bytes(name)
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(
                    f"no committed s4weights DCP checkpoint at {self.folder} ({name} is missing)"
                ) from None
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise ManifestError(f"{where}/{name}: not JSON ({e})") from e
        md = metadata_from_json(doc, f"{where}/{name}")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        if self.storage_data is None:
            raise ManifestError("DCP metadata has no storage_data")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.folder is not None
        t0 = time.perf_counter()
        timer = obs.StageTimer()
        inner: list[obs.OpEvent] = []
        try:
            with obs.suppress() as inner:  # one event per rank and load, not one per rank file
                self._read_data(plan, planner, timer)
        except BaseException as e:
            self._record(t0, timer, inner, e)
            raise
        self._record(t0, timer, inner, None)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _record(self, t0: float, timer: obs.StageTimer, inner: list[obs.OpEvent], error: BaseException | None) -> None:
        assert self.folder is not None
        took = time.perf_counter() - t0
        stages = dict(timer.stages)
        merge_stages(stages, inner)
        obs.record(obs.OpEvent(
            op="load", url=self.folder.location,
            step=self.loaded_step if self.run is not None else step_from(self.folder.location),
            raw_bytes=sum(e.raw_bytes for e in inner), stored_bytes=sum(e.stored_bytes for e in inner),
            blocked_s=took, total_s=took, stages=stages, mode="dcp", ok=error is None,
            error=None if error is None else f"{type(error).__name__}: {error}", rank=self.rank,
            extra={"files": len(inner)},
        ))

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner, timer: obs.StageTimer) -> None:
        assert self.folder is not None
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise ManifestError(f"DCP metadata has no storage entry for {req.storage_index}")
            per_file.setdefault(info.file, []).append(req)
        for fname, reqs in per_file.items():
            # decode straight onto the GPU when the first tensor we load into lives there
            target = "cpu"
            for req in reqs:
                if req.type != LoadItemType.BYTE_IO:
                    dev = planner.resolve_tensor(req).device
                    if dev.type == "cuda":
                        target = str(dev)
                    break
            if self.run is not None and self.loaded_step is not None:
                store = rank_store(self.run, fname, threads=self.threads)
                wanted = [(self.storage_data[r.storage_index].kind, self.storage_data[r.storage_index].key) for r in reqs]
                got = load_items(store, self.loaded_step, wanted, target, self.threads)
                content: dict[str, dict[str, torch.Tensor]] = {"t": {}, "b": {}}
                for (kind, key), t in got.items():
                    content[kind][key] = t
            else:
                content = self.folder.load_container(fname, target, self.threads)
            with timer.stage("copy"):
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO:
                        blob = content["b"][info.key]
                        planner.load_bytes(req, io.BytesIO(blob.cpu().numpy().tobytes()))
                    else:
                        src = narrow(content["t"][info.key], req.storage_offsets, req.lengths)
                        dst = planner.resolve_tensor(req).detach()
                        if dst.size() != src.size():
                            raise ManifestError(
                                f"DCP item {req.storage_index.fqn!r}: stored slice {tuple(src.size())} does not "
                                f"fit the target {tuple(dst.size())}"
                            )
                        dst.copy_(src)
                        planner.commit_tensor(req, dst)
            del content



"""A training run's DCP checkpoints under one root: every rank's shards as a delta chain, steps
committed by a global metadata record written last.

Layout of a run (a local directory or ``s3://bucket/prefix``)::

    ranks/00000/             a CheckpointStore holding rank 0's items, one step per save
    ranks/00001/             rank 1's ...
    steps/step_000000000100.json   DCP's Metadata for step 100 as JSON: the commit, written last

Each rank writes its items of a save (``{"t": {key: tensor}, "b": {key: bytes}}``) as one step of
its own :class:`~s4w_core.store.CheckpointStore`: the newest step whole, the step below re-coded
behind the save as a reverse delta against it (docs/STORE.md), from the host copy the rank's store
keeps (the rank's delta base: one copy, in host memory).  Items are keyed by their fully
qualified name and their offset in the global tensor, so a shard whose placement changed (another
world size, another sharding) has no base and is stored whole.  A step is listed only once its
metadata record exists, which the coordinator writes after every rank's store has committed.

Loads read, from each rank store a plan needs, only the storages holding the items the plan asks
for (ranged reads of the step's object; its delta bases through the store's chain resolution).

This module is the machinery behind ``S4StorageWriter(root, step=N)`` and
``S4StorageReader(root, step=None)`` of :mod:`s4w_core.dcp`; :func:`committed_steps` lists a run
and :func:`close_rank_stores` waits for the re-encodings behind the saves.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable, Mapping

import torch

from s4w_core import api, engine
from s4w_core.errors import CheckpointNotFoundError, ManifestError
from s4w_core.format.container import ContainerReader
from s4w_core.store import CheckpointStore, StepInfo, open_backend
from s4w_core.store.chain import Chain, chain_device, decode_many
from s4w_core.store.records import check_step

__all__ = [
    "RANKS_DIR",
    "STEPS_DIR",
    "RunRoot",
    "close_rank_stores",
    "committed_steps",
    "load_items",
    "rank_store",
    "rank_store_name",
    "run_bytes",
    "step_key",
    "wait_rank_stores",
    "cleanup_orphans",
    "delete_step",
]

RANKS_DIR = "ranks"
STEPS_DIR = "steps"
_RECORD_SUFFIX = ".json"

# CheckpointStore's names for the S3 options the DCP classes take as open_backend's
_S3_NAMES = {"profile": "profile_name"}


def step_key(step: int, rank: int | None = None) -> str:
    """The metadata record of ``step`` (``rank``: the record of one rank's save without collectives)."""
    tail = "" if rank is None else f".rank_{rank:05d}"
    return f"{STEPS_DIR}/step_{check_step(step):012d}{tail}{_RECORD_SUFFIX}"


def _step_of_key(key: str, rank: int | None) -> int | None:
    name = key.rsplit("/", 1)[-1]
    tail = ("" if rank is None else f".rank_{rank:05d}") + _RECORD_SUFFIX
    if not (name.startswith("step_") and name.endswith(tail)):
        return None
    digits = name[len("step_") : len(name) - len(tail)]
    return int(digits) if digits.isdigit() and len(digits) == 12 else None


def rank_store_name(rank: int) -> str:
    """The folder (relative to the run root) of the store holding ``rank``'s items."""
    return f"{RANKS_DIR}/{rank:05d}"


class RunRoot:
    """The root of one run: where its metadata records live (a local directory or S3 prefix)."""

    def __init__(self, root: str | os.PathLike[str], s3_options: Mapping[str, Any] | None = None) -> None:
        self.url = os.fspath(root).rstrip("/") or os.fspath(root)
        self.s3_options = dict(s3_options or {})
        self._backend: Any = None  # a store backend (s4w_core.store.open_backend)

    @property
    def backend(self) -> Any:
        """The run root's object backend (opened on first use; not pickled with the root)."""
        if self._backend is None:
            self._backend = (
                open_backend(self.url, **self.s3_options) if self.url.startswith("s3://") else open_backend(self.url)
            )
        return self._backend

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "s3_options": self.s3_options, "_backend": None}

    def __repr__(self) -> str:
        return self.url

    def steps(self, rank: int | None = None) -> list[int]:
        """Committed steps, oldest first (``rank``: those one rank saved without collectives)."""
        out = {_step_of_key(o.key, rank) for o in self.backend.list(f"{STEPS_DIR}/")}
        return sorted(s for s in out if s is not None)

    def put_record(self, step: int, doc: bytes, rank: int | None = None) -> None:
        """Commit ``step``: its metadata record, atomically (the commit point)."""
        self.backend.put(step_key(step, rank), doc)

    def drop_record(self, step: int, rank: int | None = None) -> None:
        """Un-commit ``step`` (it is no longer listed; the rank stores' data of it goes at their
        next save, :func:`cleanup_orphans`)."""
        self.backend.delete(step_key(step, rank))

    def get_record(self, step: int | None, rank: int | None = None) -> tuple[int, bytes]:
        """``(step, record bytes)`` of ``step`` (None: the newest committed)."""
        if step is None:
            steps = self.steps(rank)
            if not steps:
                raise CheckpointNotFoundError(f"no committed s4weights DCP step under {self.url}")
            step = steps[-1]
        try:
            return step, bytes(self.backend.get(step_key(step, rank)))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"step {step} is not committed under {self.url} (committed: {self.steps(rank)})"
            ) from None

    def has(self, step: int, rank: int | None = None) -> bool:
        return step in self.steps(rank)

    def store_url(self, name: str) -> str:
        return f"{self.url}/{name}"


_STORES: dict[str, CheckpointStore] = {}
_STORES_LOCK = threading.Lock()


def rank_store(
    run: RunRoot, name: str, *, profile: str | None = None, threads: int | None = None
) -> CheckpointStore:
    """The process's store object for rank store ``name`` of ``run``: one per location, kept for
    the life of the process (it holds the delta base of the next save; a load waits for the
    re-encoding in flight behind a save of the same store).  ``profile``: the codec profile of
    the next save (set on the store)."""
    url = run.store_url(name)
    with _STORES_LOCK:
        st = _STORES.get(url)
        if st is None:
            opts: dict[str, Any] = {"profile": profile or "auto", "threads": threads}
            if url.startswith("s3://"):
                opts.update({_S3_NAMES.get(k, k): v for k, v in run.s3_options.items()})
            st = _STORES[url] = CheckpointStore(url, **opts)
        elif profile is not None:
            st.profile = profile
        return st


def close_rank_stores(root: str | os.PathLike[str] | None = None) -> None:
    """Wait for the re-encodings behind this process's saves (of the run at ``root``, or all)
    and drop the store objects with their delta bases (the next save writes its step whole,
    and the step below it is re-coded from its object)."""
    prefix = None if root is None else os.fspath(root).rstrip("/") + "/"
    with _STORES_LOCK:
        mine = [k for k in _STORES if prefix is None or k.startswith(prefix)]
        stores = [_STORES.pop(k) for k in mine]
    for st in stores:
        st.close()


def wait_rank_stores(root: str | os.PathLike[str] | None = None) -> None:
    """Wait for the re-encodings behind this process's saves (the stores stay open)."""
    prefix = None if root is None else os.fspath(root).rstrip("/") + "/"
    with _STORES_LOCK:
        stores = [st for k, st in _STORES.items() if prefix is None or k.startswith(prefix)]
    for st in stores:
        st.wait()


def committed_steps(root: str | os.PathLike[str], s3_options: Mapping[str, Any] | None = None) -> list[int]:
    """The steps of the DCP run at ``root`` that every rank committed, oldest first."""
    return RunRoot(root, s3_options).steps()


def run_bytes(root: str | os.PathLike[str], s3_options: Mapping[str, Any] | None = None) -> int:
    """Bytes every object of the run at ``root`` occupies (rank stores and records)."""
    return sum(o.size for o in RunRoot(root, s3_options).backend.list(""))


def delete_step(
    root: str | os.PathLike[str], step: int, rank: int | None = None, s3_options: Mapping[str, Any] | None = None
) -> None:
    """Delete ``step`` from the run at ``root``: its metadata record first (rank 0, or ``rank``
    None), so that it is no longer listed, then the step of rank ``rank``'s store (None: of every
    rank store; each rank deletes its own when all ranks call this).  A step that is not there is
    no error."""
    run = RunRoot(root, s3_options)
    check_step(step)
    if rank is None or rank == 0:
        run.backend.delete(step_key(step))
    if rank is None:
        names = sorted({"/".join(o.key.split("/")[:2]) for o in run.backend.list(f"{RANKS_DIR}/")})
    else:
        names = [rank_store_name(rank)]
    for name in names:
        st = rank_store(run, name)
        if step in st.steps():
            st.delete(step)


def cleanup_orphans(store: CheckpointStore, run: RunRoot, step: int) -> list[int]:
    """Delete steps of a rank store that no committed run step names and that a newer committed
    step has overtaken (what a save that failed on another rank, or before its commit, left);
    the step being saved is left for its own ``overwrite``.  Returns the steps deleted."""
    committed = run.steps()
    if not committed:
        return []
    newest = committed[-1]
    done = set(committed)
    gone = [s for s in store.steps() if s not in done and s < newest and s != step]
    for s in gone:
        store.delete(s)
    return gone


def _open_object(store: CheckpointStore) -> Any:
    """The ``open_object`` a :class:`Chain` needs, over ``store``'s backend (ranged reads unless
    ``whole``)."""
    backend = store.backend

    def open_object(key: str, *, whole: bool, expect: int | None = None, what: str = "") -> ContainerReader:
        rr = backend.fetch(key) if whole else backend.open_range(key)
        try:
            if expect is not None and rr.size != expect:
                raise ManifestError(
                    f"{rr.name}{what}: data object is {rr.size} bytes but its commit record says {expect}"
                )
            reader = ContainerReader(rr.read, rr.size, rr.name, readinto=rr.readinto)
            api.open_reader(reader)  # validates the manifest
        except BaseException:
            rr.close()
            raise
        close_reader = reader.close

        def close() -> None:
            try:
                close_reader()
            finally:
                rr.close()

        reader.close = close  # type: ignore[method-assign]
        return reader

    return open_object


def _tensor_of(raw: torch.Tensor, t: Mapping[str, Any]) -> torch.Tensor:
    dt = engine.dtype_from_name(t["dtype"])
    if (int(t["_extent"]) + int(t["offset"])) * dt.itemsize > raw.numel():
        raise ManifestError(f"manifest: tensor {t['path']!r} reaches past the end of its storage")
    return torch.empty(0, dtype=dt, device=raw.device).set_(raw.untyped_storage(), t["offset"], t["shape"], t["stride"])


def load_items(
    store: CheckpointStore,
    step: int,
    wanted: Iterable[tuple[str, str]],
    map_location: api.MapLocation,
    threads: int | None = None,
) -> dict[tuple[str, str], torch.Tensor]:
    """Items ``(kind, key)`` of ``step`` of rank store ``store``, decoding only the storages that
    hold them: the step's object is read by byte ranges (its manifest, then those storages'
    chunks); the delta bases they need are resolved through the store's chain.  Every storage is
    checked against its checksum as it is decoded."""
    want = list(dict.fromkeys(wanted))
    recs: dict[int, StepInfo] = store.records()  # hidden steps too: a kept step's delta base may be one
    rec = recs.get(step)
    if rec is None or rec.hidden:
        raise CheckpointNotFoundError(
            f"{store.backend.url}: step {step} is not committed in this rank store (it has {store.steps()})"
        )
    open_object = _open_object(store)
    chain = Chain(open_object, store.backend.url, rec, threads, recs)
    reader = open_object(rec.object, whole=False, expect=rec.object_bytes, what=f" (step {step})")
    try:
        m = reader.manifest
        tree = m.get("tree")
        index: dict[tuple[str, str], int] = {}
        for kind, key in want:
            node = tree.get(kind, {}).get(key) if isinstance(tree, dict) and isinstance(tree.get(kind), dict) else None
            if not isinstance(node, dict) or type(node.get("$t")) is not int or not 0 <= node["$t"] < len(m["tensors"]):
                raise ManifestError(f"{reader.name}: step {step} holds no item {kind}/{key}")
            index[(kind, key)] = node["$t"]
        sids = sorted({int(m["tensors"][i]["storage"]) for i in index.values()})
        entries = [m["storages"][s] for s in sids]
        device = chain_device({"storages": entries}, map_location)
        if any(e.get("delta") for e in entries):
            chain.open_all(chain.bases())
            chain.prefetch(entries, device)
        raws = decode_many(reader, entries, threads, chain.resolve, device)
        by_sid = dict(zip(sids, raws))  # on the GPU that decoded them, else in host memory
        return {k: _tensor_of(by_sid[int(m["tensors"][i]["storage"])], m["tensors"][i]) for k, i in index.items()}
    finally:
        reader.close()
        chain.close()

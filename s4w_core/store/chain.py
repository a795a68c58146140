"""Delta chains of a store (docs/STORE.md, "Deltas"): resolving a step's bases while it is
decoded (:class:`Chain`), supplying a base's bytes to the encoder (:class:`BaseProvider`), and
the host copy of a step a store keeps (:class:`CachedBase`)."""

from __future__ import annotations

import builtins
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol

import torch

from s4w_core import checksum as ck
from s4w_core import engine, pipeline
from s4w_core._fsutil import is_safe_name
from s4w_core.codecs import get_codec
from s4w_core.errors import (
    BackendUnavailableError,
    BaseMismatchError,
    CheckpointNotFoundError,
    FormatError,
    S4WError,
    StoreError,
)
from s4w_core.format.container import ContainerReader
from s4w_core.jobs import row_lengths
from s4w_core.store.records import DATA, StepInfo, step_of_object
from s4w_core.workers import Pool

__all__ = [
    "BASE_ERRORS",
    "BaseProvider",
    "CachedBase",
    "Chain",
    "OpenObject",
    "chain_device",
    "decode_many",
    "decode_one",
    "source_of_manifest",
    "state_source",
]

log = logging.getLogger("s4w_core.store")


class OpenObject(Protocol):
    """Opens a data object of the store as a container reader (the store's ``_open``)."""

    def __call__(self, key: str, *, whole: bool, expect: int | None = None, what: str = "") -> ContainerReader: ...


@dataclass
class CachedBase:
    """Raw bytes of the last committed save, by storage path, to code the next save against."""

    step: int
    object: str
    storages: dict[str, tuple[torch.Tensor, dict[str, Any], str]]  # path -> (uint8 cpu, base_ref, dtype)
    nbytes: int
    pooled: bool = False  # the tensors are pinned buffers of the store's PinnedPool
    #: every storage's host bytes, in the container's order (the tensors of ``storages`` among them)
    raws: builtins.list[torch.Tensor] = field(default_factory=builtins.list)
    #: the state's tree, tensor table and (dtype, path, device) per storage: with ``raws``, what the
    #: step is re-encoded from as a delta (None: not kept, e.g. a step that was loaded; the
    #: re-encoding then decodes it)
    source: tuple[Any, builtins.list[dict[str, Any]], builtins.list[tuple[torch.dtype, str, str]]] | None = None
    #: the manifest the step was committed with (what its re-encoding is checked against)
    manifest: Mapping[str, Any] | None = None

    def collected(self, profile: str) -> pipeline.Collected | None:
        """The step as a collected state over the host copies (None without a source)."""
        if self.source is None or len(self.raws) != len(self.source[2]):
            return None
        tree, tensors, jobs = self.source
        cols = row_lengths(tensors, [r.numel() for r in self.raws])  # as the save coded it
        col = engine.Collector(
            tensors=tensors,
            jobs=[engine.StorageJob(r, dt, p, d, cols=c) for r, (dt, p, d), c in zip(self.raws, jobs, cols)],
        )
        return pipeline.Collected(col, tree, profile)


def state_source(tree: Any, col: engine.Collector) -> tuple[Any, builtins.list[dict[str, Any]], builtins.list[tuple[torch.dtype, str, str]]]:
    return tree, col.tensors, [(j.dtype, j.path, j.device) for j in col.jobs]


def source_of_manifest(manifest: Mapping[str, Any]) -> tuple[Any, builtins.list[dict[str, Any]], builtins.list[tuple[torch.dtype, str, str]]] | None:
    """:func:`state_source` of a step rebuilt from its container's manifest (a step that was loaded):
    what re-encoding it from the host copies of its storages needs.  None if it cannot be (the
    re-encoding then decodes the step; a rebuilt source is checked like any other, by
    :func:`_same_storages`)."""
    try:
        tensors = [{k: v for k, v in t.items() if not str(k).startswith("_")} for t in manifest["tensors"]]
        jobs = [(engine.dtype_from_name(e["dtype"]), str(e["path"]), str(e["device"])) for e in manifest["storages"]]
        return manifest["tree"], tensors, jobs
    except (KeyError, TypeError, ValueError, AttributeError, S4WError):
        return None


def chain_device(manifest: Mapping[str, Any], map_location: pipeline.MapLocation) -> torch.device | None:
    """Where a chain's bases are decoded: the GPU when the step is coded with GPU-only codecs or
    loads onto a GPU (and one is usable), else None (the CPU path)."""
    gpu_codecs = any(not get_codec(c[0]).cpu_decodable for s in manifest["storages"] for c in s["chunks"])
    to_gpu = any(d.type == "cuda" for d in pipeline.target_devices(manifest["storages"], map_location).values())
    if (gpu_codecs or to_gpu) and pipeline.gpu_backend() is not None:
        return torch.device("cuda", torch.cuda.current_device())
    return None


class Chain:
    """Resolves delta bases while one step is decoded: opens each data object once, decodes only
    the storages a delta needs (recursively, at most ``keyframe_every`` levels), and turns every
    failure of a base into a BaseMismatchError naming the step and object.

    A delta names its base by data object, storage index and raw checksum.  A forward delta's
    base objects are listed in its record (``objects``).  A reverse delta's base is the newer step
    ``base_step``, whose data may since have been re-encoded (as a delta against a still newer
    step) and its old object removed: a base object that is gone is found through that step's
    current commit record (the step named in the object's key, which must be on the chain of
    ``base_step`` links), and the decoded bytes are checked against the delta's raw checksum."""

    def __init__(
        self, open_object: OpenObject, url: str, rec: StepInfo, threads: int | None, recs: Mapping[int, StepInfo]
    ) -> None:
        self.open_object = open_object
        self.url = url
        self.rec = rec
        self.threads = threads
        self.readers: dict[str, ContainerReader] = {}
        self.recs = recs
        self.allowed = set(rec.objects)
        self.by_step: set[int] = set()  # the steps reverse deltas on this chain name as bases
        r: StepInfo | None = rec
        while r is not None and r.reverse and r.base_step is not None and r.base_step not in self.by_step:
            self.by_step.add(r.base_step)
            r = self.recs.get(r.base_step)
            if r is not None:
                self.allowed.update(r.objects)
        self._lock = threading.Lock()
        self._depth = 0
        self.memo: dict[tuple[str, int], torch.Tensor] = {}
        self._checked: set[tuple[str, int, str]] = set()
        self._gone: set[str] = set()  # objects a delta names that could not be read (see _made_against)

    def bases(self) -> builtins.list[str]:
        """The data objects this step's deltas may read (not its own)."""
        return sorted(self.allowed - {self.rec.object})

    def reader(self, key: str, expect: int | None = None, step: int | None = None) -> ContainerReader:
        with self._lock:
            r = self.readers.get(key)
            if r is None:
                what = f" (step {step})" if step is not None else f" (a base of step {self.rec.step})"
                r = self.open_object(key, whole=True, expect=expect, what=what)
                self.readers[key] = r
            return r

    def open_all(self, keys: Iterable[str]) -> None:
        """Read the chain's data objects in parallel (I/O bound: a delta at depth d needs d+1 whole
        objects). A key that fails to open is left for :meth:`reader` to open again, so its error
        is raised where it is understood (a missing base becomes a BaseMismatchError)."""
        todo = [k for k in dict.fromkeys(keys) if k not in self.readers]
        if len(todo) < 2:
            return

        def one(key: str) -> tuple[str, ContainerReader | None]:
            try:
                return key, self.open_object(key, whole=True, what=f" (a base of step {self.rec.step})")
            except S4WError:
                return key, None

        with ThreadPoolExecutor(max_workers=min(4, len(todo)), thread_name_prefix="s4w-read") as ex:
            for key, r in ex.map(one, todo):
                if r is not None:
                    with self._lock:
                        self.readers.setdefault(key, r)

    def _entry(self, ref: Mapping[str, Any], nbytes: int) -> tuple[ContainerReader, dict[str, Any], str, int, str | None]:
        """The base storage a delta names, checked against its reference (BaseMismatchError).
        The last item: a raw checksum the decoded bytes must still be checked against (a base
        found through its step's re-encoded data, whose manifest may use another algorithm)."""
        step = self.rec.step
        if not isinstance(ref, Mapping) or not isinstance(ref.get("object"), str) or type(ref.get("storage")) is not int or not isinstance(ref.get("checksum"), str):
            raise BaseMismatchError(f"step {step}: a delta names a malformed base {ref!r}")
        obj, idx, ck = ref["object"], ref["storage"], ref["checksum"]
        by_step = False
        if obj not in self.allowed:
            bstep = step_of_object(obj)
            if bstep is None or bstep not in self.by_step:
                raise BaseMismatchError(
                    f"step {step}: a delta names base object {obj}, which its commit record does not list "
                    f"as part of its chain {sorted(self.allowed)}"
                )
            brec = self.recs.get(bstep)
            if brec is None:
                raise BaseMismatchError(
                    f"step {step}: its delta base, step {bstep}, is no longer committed in {self.url}; "
                    f"step {step} cannot be restored"
                )
            found = self._made_against(obj, idx, ck, nbytes)
            if found is not None:
                return found
            obj, by_step = brec.object, True
        try:
            reader = self.reader(obj)
        except CheckpointNotFoundError as e:
            raise BaseMismatchError(
                f"step {step}: its delta base object {obj} is missing from {self.url}; "
                f"step {step} cannot be restored ({e})"
            ) from e
        except FormatError as e:
            raise BaseMismatchError(f"step {step}: its delta base object {obj} is corrupt: {e}") from e
        entries = reader.manifest["storages"]
        if not 0 <= idx < len(entries):
            raise BaseMismatchError(f"step {step}: base {obj} has no storage {idx}")
        entry = entries[idx]
        if (entry["checksum"] != ck and not by_step) or entry["nbytes"] != nbytes:
            raise BaseMismatchError(
                f"step {step}: storage {idx} ({entry['path']!r}) of base {obj} is not the one the delta "
                f"was made against (checksum {entry['checksum']} / {entry['nbytes']} bytes, "
                f"expected {ck} / {nbytes} bytes)"
            )
        return reader, entry, obj, idx, (ck if entry["checksum"] != ck else None)

    def _made_against(self, obj: str, idx: int, want: str, nbytes: int) -> tuple[ContainerReader, dict[str, Any], str, int, None] | None:
        """The base storage a reverse delta names, read from the object it was made against while
        that object is still there -- its step's record may point elsewhere by now: the step was
        re-encoded and its old object not yet removed, or (on S3, whose create-if-absent is a
        HEAD then a PUT) another writer committed the same step over it.  None where the object
        is gone, unreadable or holds another storage there: the step's current record is read."""
        if not obj.startswith(DATA) or not is_safe_name(obj) or obj in self._gone:
            return None
        try:
            reader = self.reader(obj)
        except S4WError:
            with self._lock:
                self._gone.add(obj)
            return None
        entries = reader.manifest["storages"]
        if not 0 <= idx < len(entries) or entries[idx]["checksum"] != want or entries[idx]["nbytes"] != nbytes:
            return None
        return reader, entries[idx], obj, idx, None

    def _checked_raw(self, raw: torch.Tensor, obj: str, idx: int, want: str | None) -> torch.Tensor:
        """``raw`` once it is known to be the bytes ``want`` (a raw checksum) names."""
        if want is None or (obj, idx, want) in self._checked:
            return raw
        flat = raw.reshape(-1)
        if not ck.verify_tensor_checksum(want, flat, flat.device if flat.device.type == "cuda" else None):
            raise BaseMismatchError(
                f"step {self.rec.step}: storage {idx} of base {obj} decodes to other bytes than the delta "
                f"was made against (checksum {want}): its base step was replaced"
            )
        self._checked.add((obj, idx, want))
        return raw

    def prefetch(self, entries: builtins.list[dict[str, Any]], device: torch.device | None) -> None:
        """Decode every base the delta ``entries`` need, level by level from the oldest, each level
        in one batched call (GPU decoders pay ~0.5 ms a call; a chain of N levels over a few hundred
        tensors decoded one storage at a time costs seconds per level). ``device``: where the GPU
        decodes (None: the CPU path). Afterwards :meth:`resolve` answers from memory."""
        step = self.rec.step
        refs = [(e["delta"].get("base"), e["nbytes"]) for e in entries if e.get("delta")]
        levels: builtins.list[dict[str, dict[int, dict[str, Any]]]] = []
        while refs:
            if len(levels) > max(64, 2 * len(self.allowed) + 2):
                raise BaseMismatchError(f"step {step}: delta chain is cyclic or too deep")
            level: dict[str, dict[int, dict[str, Any]]] = {}
            nxt: dict[tuple[str, int], tuple[Any, int]] = {}
            for ref, nbytes in refs:
                _reader, entry, obj, idx, _want = self._entry(ref, nbytes)
                if idx in level.setdefault(obj, {}):
                    continue
                level[obj][idx] = entry
                if entry.get("delta"):
                    base = entry["delta"].get("base")
                    key = (base.get("object"), base.get("storage")) if isinstance(base, Mapping) else (repr(base), -1)
                    nxt.setdefault(key, (base, entry["nbytes"]))  # type: ignore[arg-type]
            levels.append(level)
            refs = builtins.list(nxt.values())
        memo: dict[tuple[str, int], torch.Tensor] = {}
        for level in reversed(levels):
            below = memo

            def from_below(ref: Mapping[str, Any], nbytes: int, below: dict[tuple[str, int], torch.Tensor] = below) -> torch.Tensor:
                _r, _e, obj, idx, want = self._entry(ref, nbytes)
                return self._checked_raw(below[(obj, idx)], obj, idx, want)

            memo = {}
            for obj, items in level.items():
                reader = self.readers[obj]
                idxs = sorted(items)
                ents = [items[i] for i in idxs]
                try:
                    raws = decode_many(reader, ents, self.threads, from_below, device)
                except BaseMismatchError:
                    raise
                except FormatError as e:
                    raise BaseMismatchError(
                        f"step {step}: its delta base object {obj} is corrupt ({type(e).__name__}: {e})"
                    ) from e
                memo.update({(obj, i): r for i, r in zip(idxs, raws)})
        self.memo = memo

    def resolve(self, ref: Mapping[str, Any], nbytes: int) -> torch.Tensor:
        step = self.rec.step
        reader, entry, obj, idx, want = self._entry(ref, nbytes)
        hit = self.memo.get((obj, idx))
        if hit is not None:
            return self._checked_raw(hit, obj, idx, want)
        self._depth += 1
        try:
            if self._depth > max(64, 2 * len(self.allowed) + 2):
                raise BaseMismatchError(f"step {step}: delta chain through {obj} is cyclic or too deep")
            try:
                return self._checked_raw(decode_one(reader, entry, self.threads, self.resolve), obj, idx, want)
            except BaseMismatchError:
                raise
            except FormatError as e:
                raise BaseMismatchError(
                    f"step {step}: its delta base object {obj} is corrupt ({type(e).__name__}: {e})"
                ) from e
        finally:
            self._depth -= 1

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def decode_many(
    reader: ContainerReader,
    entries: builtins.list[dict[str, Any]],
    threads: int | None,
    resolve: engine.BaseResolver,
    device: torch.device | None,
) -> builtins.list[torch.Tensor]:
    """Decode storage entries of one container: on ``device`` (a GPU) in one batched call when
    given, else on the CPU path (GPU-only codecs still need the GPU: BackendUnavailableError)."""
    if device is not None and device.type == "cuda":
        gpu = pipeline.gpu_backend()
        if gpu is not None:
            with pipeline.executor(threads) as pool:
                return gpu.decode_storages(reader, entries, device, resolve, pool)
    # one pool for every storage: a pool per storage started its threads per storage (a warm DCP
    # load of 400 storages of 8 KiB: 0.13 -> 0.04 s, benchmarks/bench_dcp_warm.py --small 400)
    with pipeline.executor(threads) as pool:
        return [decode_one(reader, e, threads, resolve, pool) for e in entries]


#: what reading a delta base may raise that a save outlives (it codes those storages whole)
BASE_ERRORS = (FormatError, BaseMismatchError, CheckpointNotFoundError, StoreError, BackendUnavailableError)


def decode_one(
    reader: ContainerReader,
    entry: dict[str, Any],
    threads: int | None,
    resolve: engine.BaseResolver,
    pool: Pool | None = None,
) -> torch.Tensor:
    """Decode one storage entry to a CPU uint8 tensor (GPU codecs through the GPU backend); on the
    CPU with ``pool`` when given, else with a pool of ``threads`` of its own."""
    needs_gpu = any(not get_codec(c[0]).cpu_decodable for c in entry["chunks"])
    if needs_gpu:
        gpu = pipeline.gpu_backend()
        if gpu is None:
            raise BackendUnavailableError(
                f"{reader.name}: base tensor {entry['path']!r} uses GPU-only codecs; load on a GPU machine"
            )
        dev = torch.device("cuda", torch.cuda.current_device())
        return gpu.decode_storage(reader, entry, dev, resolve).cpu()
    if pool is not None:
        return engine.decode_storage_cpu(reader, entry, pool, resolve, reader.name)
    with pipeline.executor(threads) as own:
        return engine.decode_storage_cpu(reader, entry, own, resolve, reader.name)


class BaseProvider:
    """Supplies the previous step's bytes to the encoder: from the store's in-memory copy when it
    holds that step, else by decoding the needed storage from the store (lazily, one at a time)."""

    def __init__(
        self,
        open_object: OpenObject,
        url: str,
        base: StepInfo,
        recs: Mapping[int, StepInfo],
        threads: int | None,
        cache: CachedBase | None,
    ) -> None:
        self.open_object = open_object
        self.url = url
        self.base = base
        self.recs = recs
        self.threads = threads
        self.cache = cache if cache is not None and cache.object == base.object else None
        self.chain: Chain | None = None
        self.by_path: dict[str, int] | None = None
        #: why the base step's container cannot be read at all (then no storage is delta-coded)
        self.unreadable: S4WError | None = None
        self.warned = False

    def lookup(self, path: str, nbytes: int, dtype: str) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """The base bytes of storage ``path`` and its reference, or None: no delta for it. A base
        that cannot be read (missing, corrupt, GPU-only codecs on a machine without a GPU, a failed
        read) is no reason to fail the save: that storage is coded whole, with a warning (a whole
        step: a keyframe), and nothing read from the base is trusted unchecked (every storage's
        checksum is verified as it is decoded)."""
        if self.cache is not None:
            hit = self.cache.storages.get(path)
            if hit is None or hit[0].numel() != nbytes or hit[2] != dtype:
                return None
            return hit[0], dict(hit[1])
        if self.unreadable is not None:
            return None
        try:
            if self.chain is None:
                self.chain = Chain(self.open_object, self.url, self.base, self.threads, self.recs)
                try:
                    reader = self.chain.reader(self.base.object, self.base.object_bytes, self.base.step)
                except BASE_ERRORS as e:
                    self.unreadable = e
                    raise
                self.by_path = {}
                for i, s in enumerate(reader.manifest["storages"]):
                    self.by_path.setdefault(s["path"], i)
            assert self.by_path is not None
            idx = self.by_path.get(path)
            if idx is None:
                return None
            reader = self.chain.readers[self.base.object]
            entry = reader.manifest["storages"][idx]
            if entry["nbytes"] != nbytes or entry["dtype"] != dtype:
                return None
            raw = decode_one(reader, entry, self.threads, self.chain.resolve)
        except BASE_ERRORS as e:
            self._warn(path, e)
            return None
        return raw, {"object": self.base.object, "storage": idx, "checksum": entry["checksum"]}

    def _warn(self, path: str, e: S4WError) -> None:
        if self.warned:
            return
        self.warned = True
        what = "the whole step (a keyframe)" if self.unreadable is not None else f"{path!r} (and any other storage whose base cannot be read)"
        log.warning(
            "s4weights: %s: cannot read the delta base, step %d (%s: %s): coding %s without a delta",
            self.url, self.base.step, type(e).__name__, e, what,
        )

    def close(self) -> None:
        if self.chain is not None:
            self.chain.close()

"""The encode/decode pipeline every writer and reader of containers runs: collect a state's
storages, choose the profile, encode them into a container (CPU or GPU), and back: open and
validate a container, decode its storages to their target devices, build the tensors.

:mod:`s4w_core.api` (files), :mod:`s4w_core.store` (checkpoint stores) and :mod:`s4w_core.dcp`
call these by their public names; none of them reaches into another's private functions.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Mapping, Union

import torch

from s4w_core import config, engine
from s4w_core._fsutil import store_error
from s4w_core._version import __version__
from s4w_core.codecs import CODECS, get_codec
from s4w_core.errors import (
    BackendUnavailableError,
    CheckpointNotFoundError,
    DeviceUnavailableError,
    ManifestError,
)
from s4w_core.format.container import FORMAT_VERSION, ContainerReader, ContainerWriter
from s4w_core.format.manifest import validate_manifest
from s4w_core.skeleton import encode_tree
from s4w_core.workers import Pool

__all__ = [
    "PROFILES",
    "MapLocation",
    "GroupStats",
    "Collected",
    "kind_of",
    "summarize",
    "executor",
    "gpu_backend",
    "resolve_profile",
    "encode",
    "open_reader",
    "target_device",
    "target_devices",
    "decode_storages",
    "build_tensors",
]

PathLike = Union[str, "os.PathLike[str]"]
MapLocation = Union[None, str, torch.device, Mapping[str, str], Callable[[str], Any]]
PROFILES = config.PROFILES


def executor(threads: int | None) -> Pool:
    """The coding threads of one encode or decode (default: up to 8, the core count)."""
    return engine.executor(threads)


# ----------------------------------------------------------------------------- reports
@dataclass
class GroupStats:
    raw_bytes: int = 0
    stored_bytes: int = 0
    tensors: int = 0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes, "ratio": round(self.ratio, 4), "tensors": self.tensors}


def kind_of(path: str) -> str:
    """Tensor kind for reports: the last path component for optimizer state (exp_avg, ...), else
    'weights' for model-ish groups."""
    parts = path.split("/")
    if len(parts) >= 2 and not parts[-1].isdigit() and any(p in ("state", "optimizer", "optimizer_states") for p in parts):
        return parts[-1]
    return "weights"


def summarize(manifest: dict[str, Any]) -> tuple[dict[str, GroupStats], dict[str, GroupStats], dict[str, GroupStats], int, int, int]:
    groups: dict[str, GroupStats] = defaultdict(GroupStats)
    dtypes: dict[str, GroupStats] = defaultdict(GroupStats)
    kinds: dict[str, GroupStats] = defaultdict(GroupStats)
    raw = stored = deltas = 0
    for s in manifest["storages"]:
        sb = sum(c[2] for c in s["chunks"])
        g = s["path"].split("/", 1)[0] or "<root>"
        for stats in (groups[g], dtypes[s["dtype"]], kinds[kind_of(s["path"])]):
            stats.raw_bytes += s["nbytes"]
            stats.stored_bytes += sb
            stats.tensors += 1
        raw += s["nbytes"]
        stored += sb
        deltas += 1 if s.get("delta") else 0
    return dict(groups), dict(dtypes), dict(kinds), raw, stored, deltas


# ----------------------------------------------------------------------------- encode
def gpu_backend() -> Any:
    """The GPU backend module if it is usable here, else None."""
    try:
        from s4w_core import gpu
    except ImportError:
        return None
    return gpu if gpu.available() else None


def resolve_profile(profile: str, jobs: list[engine.StorageJob]) -> str:
    """The profile a save of ``jobs`` uses: ``auto`` is ``fast`` when a storage is on a usable
    GPU, else ``portable``.  Raises ConfigError (a ValueError) for an unknown name,
    BackendUnavailableError for ``fast`` without a GPU."""
    config.check_profile(profile)
    if profile == "auto":
        on_gpu = any(j.raw.device.type == "cuda" for j in jobs)
        return "fast" if on_gpu and gpu_backend() is not None else "portable"
    if profile == "fast" and gpu_backend() is None:
        raise BackendUnavailableError(
            "profile 'fast' needs a CUDA GPU with `pip install s4weights[gpu-cu12]` (or gpu-cu13); "
            "use profile='portable' on this machine"
        )
    return profile


@dataclass
class Collected:
    """A state already collected (its tree and storages), whose storages' ``raw`` bytes may have
    been replaced by copies: encoding it gives the container the original state gave when the
    copies were taken (tensor metadata, devices included, come from the original collection).
    ``profile``: the profile resolved for the original state (copies may live elsewhere)."""

    col: engine.Collector
    tree: Any
    profile: str | None = None


def encode(
    obj: Any,
    fp: IO[bytes],
    profile: str,
    threads: int | None,
    base_lookup: engine.BaseLookup | None,
    extra: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], int, str]:
    """Encode ``obj`` (a state, or a :class:`Collected` one) as one container into ``fp``: each
    storage coded against the base ``base_lookup`` returns for it (None: whole).  Returns the
    manifest, the container's size and the profile used."""
    if isinstance(obj, Collected):  # collected earlier (a snapshot of the storages' bytes)
        col, tree = obj.col, obj.tree
        prof = obj.profile or resolve_profile(profile, col.jobs)
    else:
        col = engine.Collector()
        tree = encode_tree(obj, col.add)
        prof = resolve_profile(profile, col.jobs)
    if base_lookup is not None:
        for job in col.jobs:
            found = base_lookup(job.path, job.raw.numel(), engine.dtype_name(job.dtype))
            if found is not None:
                job.base, job.base_ref = found
    writer = ContainerWriter(fp)
    # CUDA tensors, or host copies of them (a store's keyframe copy is coded from the pinned copy
    # of the last save it keeps): the GPU codes them with either profile
    on_gpu = any(j.raw.device.type == "cuda" or str(j.device).startswith("cuda") for j in col.jobs)
    gpu = gpu_backend() if prof == "fast" or on_gpu else None
    with executor(threads) as pool:
        if gpu is not None:  # fast profile, or portable with GPU storages: planes split on the GPU
            storages = gpu.encode_storages(col.jobs, writer, pool, profile=prof)
        else:
            storages = engine.encode_storages_cpu(col.jobs, writer, pool)
    manifest: dict[str, Any] = {
        "format": "s4weights",
        "version": FORMAT_VERSION,
        "profile": prof,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "writer": {"s4weights": __version__, "torch": torch.__version__, **(gpu.versions() if gpu else {})},
        "codecs": {cid: {"cpu_decodable": CODECS[cid].cpu_decodable} for cid in sorted({c[0] for s in storages for c in s["chunks"]})},
        "storages": storages,
        "tensors": col.tensors,
        "tree": tree,
        "extra": dict(extra or {}),
    }
    size = writer.finish(manifest)
    return manifest, size, prof


# ----------------------------------------------------------------------------- decode
def open_reader(src: PathLike | IO[bytes] | bytes | bytearray | memoryview | ContainerReader) -> ContainerReader:
    """A validated :class:`ContainerReader` over a path, file object or bytes."""
    if isinstance(src, ContainerReader):
        reader = src
    elif isinstance(src, (bytes, bytearray, memoryview)):
        reader = ContainerReader.from_bytes(src)
    elif hasattr(src, "read"):
        reader = ContainerReader.from_file(src)  # type: ignore[arg-type]
    else:
        p = os.fspath(src)  # type: ignore[arg-type]
        try:
            f = open(p, "rb")
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint at {p}") from None
        except OSError as e:  # a directory, no permission, an I/O error
            raise store_error(p, e, "read the checkpoint") from e
        reader = ContainerReader.from_file(f, p)
    if "_validated" not in reader.manifest:
        validate_manifest(reader.manifest, reader.data_start, reader.data_end, set(CODECS), reader.name)
        engine.check_views(reader.manifest, reader.name)
        reader.manifest["_validated"] = True
    return reader


def target_device(orig: str, map_location: MapLocation) -> torch.device:
    """Where a storage saved from device ``orig`` loads under ``map_location`` (checked to exist)."""
    try:
        torch.device(orig)
    except (RuntimeError, TypeError):
        raise ManifestError(f"manifest names an invalid device {orig!r}") from None
    if map_location is None:
        dev = torch.device(orig)
    elif isinstance(map_location, (str, torch.device)):
        dev = torch.device(map_location)
    elif isinstance(map_location, Mapping):
        dev = torch.device(map_location.get(orig, orig))
    elif callable(map_location):
        dev = torch.device(map_location(orig))
    else:
        raise TypeError(f"unsupported map_location {map_location!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"checkpoint tensors are mapped to {dev}, which this machine does not have; pass "
                "map_location='cpu' (or another device)"
            )
    elif dev.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as e:
            raise DeviceUnavailableError(f"device {dev} is not available here: {e}; pass map_location") from e
    return dev


def target_devices(storages: Iterable[Mapping[str, Any]], map_location: MapLocation) -> dict[str, torch.device]:
    """:func:`target_device` of each distinct ``device`` the manifest entries ``storages`` name
    (``map_location`` asked once per device, not once per storage: a training state's hundreds
    of storages name one or two)."""
    return {orig: target_device(orig, map_location) for orig in dict.fromkeys(s["device"] for s in storages)}


def decode_storages(
    reader: ContainerReader,
    map_location: MapLocation,
    threads: int | None,
    resolve_base: engine.BaseResolver | None,
    on_batch: Callable[[list[int], list[torch.Tensor]], None] | None = None,
) -> list[torch.Tensor]:
    """Decode every storage to its target device: GPU-routed ones in one batched GPU call per
    device (nvCOMP's per-call cost is ~0.5 ms), the rest on the CPU path.

    ``on_batch(indices, raws)``: called after each GPU batch with the storages (by manifest index)
    it decoded straight to their target device, decoded and checked, while the next batch is read."""
    m = reader.manifest
    out: list[torch.Tensor | None] = [None] * len(m["storages"])
    targets: list[torch.device] = []
    on_gpu: dict[torch.device, list[int]] = defaultdict(list)
    gpu = None
    devices = target_devices(m["storages"], map_location)
    for i, s in enumerate(m["storages"]):
        dev = devices[s["device"]]
        targets.append(dev)
        codecs = {c[0] for c in s["chunks"]}
        needs_gpu = any(not get_codec(c).cpu_decodable for c in codecs)
        if (needs_gpu or dev.type == "cuda") and gpu is None:
            gpu = gpu_backend()
        if needs_gpu and gpu is None:
            bad = sorted(c for c in codecs if not get_codec(c).cpu_decodable)
            raise BackendUnavailableError(
                f"{reader.name}: tensor {s['path']!r} uses GPU-only codec(s) {bad} (profile "
                f"{m.get('profile')!r}), and this machine has no usable CUDA GPU + nvCOMP. Read it on "
                "a GPU machine, or convert it there to the portable profile: "
                "`s4w convert IN OUT --profile portable`"
            )
        # a storage claiming far more than its stored bytes goes to the CPU reader, which decodes
        # its chunks before allocating its output, unless only a GPU can decode it (then the GPU
        # reader decodes its chunks first: s4w_core.gpu._prove)
        if gpu is not None and (needs_gpu or (dev.type == "cuda" and engine.claims_plausible(s))):
            gdev = dev if dev.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
            on_gpu[gdev].append(i)
    with executor(threads) as pool:
        for gdev, idx in on_gpu.items():
            assert gpu is not None
            hook = None
            if on_batch is not None:

                def hook(first: int, outs: list[torch.Tensor], idx: list[int] = idx) -> None:
                    at = idx[first : first + len(outs)]
                    final = [
                        (i, o) for i, o in zip(at, outs)
                        if o.device.type == targets[i].type and targets[i].index in (None, o.device.index)
                    ]  # those that .to(target) below returns as they are
                    if final:
                        on_batch([i for i, _ in final], [o for _, o in final])

            raws = gpu.decode_storages(reader, [m["storages"][i] for i in idx], gdev, resolve_base, pool, hook)
            for i, raw in zip(idx, raws):
                out[i] = raw.to(targets[i])
        for i, s in enumerate(m["storages"]):
            if out[i] is None:
                out[i] = engine.decode_storage_cpu(reader, s, pool, resolve_base, reader.name).to(targets[i])
    return [r for r in out if r is not None]


def build_tensors(m: dict[str, Any], raws: list[torch.Tensor]) -> list[torch.Tensor]:
    """The manifest's tensors as views of the decoded storages ``raws`` (manifest order)."""
    tensors: list[torch.Tensor] = []
    for i, t in enumerate(m["tensors"]):
        raw = raws[t["storage"]]
        dt = engine.dtype_from_name(t["dtype"])
        item = dt.itemsize
        if t["_extent"] * item > raw.numel():
            raise ManifestError(f"manifest: tensor {i} ({t['path']!r}) reaches past the end of its storage")
        x = torch.empty(0, dtype=dt, device=raw.device).set_(raw.untyped_storage(), t["offset"], t["shape"], t["stride"])
        if t.get("requires_grad") and not (dt.is_floating_point or dt.is_complex):
            raise ManifestError(f"manifest: tensor {i} ({t['path']!r}) of dtype {dt} cannot require grad")
        if t.get("param"):
            x = torch.nn.Parameter(x, requires_grad=bool(t.get("requires_grad")))
        elif t.get("requires_grad"):
            x.requires_grad_(True)
        tensors.append(x)
    return tensors

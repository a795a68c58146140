"""The public functions: :func:`save`, :func:`load`, :func:`info`, :func:`verify`."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Mapping

from s4w_core import engine, obs, pipeline
from s4w_core._fsutil import WriteThrough, atomic_write, storage_errors
from s4w_core.errors import CheckpointNotFoundError, S4WError
from s4w_core.format.container import ContainerReader, in_memory_file
from s4w_core.pipeline import PROFILES, Collected, GroupStats, MapLocation, PathLike, open_reader, summarize
from s4w_core.skeleton import decode_tree
from s4w_core.units import human_bytes as _h

__all__ = [
    "save",
    "load",
    "info",
    "verify",
    "SaveReport",
    "VerifyReport",
    "PROFILES",
    # the pipeline's names, also reachable here
    "Collected",
    "GroupStats",
    "MapLocation",
    "open_reader",
    "summarize",
]

#: kept for callers not switched to :mod:`s4w_core.pipeline` yet (dcp, tests)
_gpu = pipeline.gpu_backend
_build_tensors = pipeline.build_tensors


# ----------------------------------------------------------------------------- reports
@dataclass
class SaveReport:
    """What :func:`save` wrote. ``ratio`` = raw / stored over tensor data (the manifest is extra)."""

    path: str | None
    profile: str
    raw_bytes: int
    stored_bytes: int
    file_bytes: int
    seconds: float
    groups: dict[str, GroupStats] = field(default_factory=dict)
    dtypes: dict[str, GroupStats] = field(default_factory=dict)
    kinds: dict[str, GroupStats] = field(default_factory=dict)
    delta_tensors: int = 0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "profile": self.profile,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "file_bytes": self.file_bytes,
            "ratio": round(self.ratio, 4),
            "seconds": round(self.seconds, 4),
            "delta_tensors": self.delta_tensors,
            "groups": {k: v.as_dict() for k, v in self.groups.items()},
            "dtypes": {k: v.as_dict() for k, v in self.dtypes.items()},
            "kinds": {k: v.as_dict() for k, v in self.kinds.items()},
        }

    def __str__(self) -> str:
        lines = [
            f"{self.path or '<stream>'}: {_h(self.raw_bytes)} -> {_h(self.stored_bytes)} "
            f"({self.ratio:.3f}x, profile {self.profile}, {self.seconds:.2f}s)"
        ]
        for k, g in self.groups.items():
            lines.append(f"  {k:<28} {_h(g.raw_bytes):>10} -> {_h(g.stored_bytes):>10}  {g.ratio:.3f}x")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- save
def save(
    obj: Any,
    path: PathLike | IO[bytes],
    *,
    profile: str = "auto",
    threads: int | None = None,
    extra: Mapping[str, Any] | None = None,
    durable: bool = True,
    _base_lookup: engine.BaseLookup | None = None,
) -> SaveReport:
    """Save a checkpoint (any nest of dict/list/tuple holding tensors and plain values), compressed.

    Args:
        obj: e.g. ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 100}``.
            Tensors may live on any device, have any dtype and shape, be views; tensors sharing
            storage are stored once and come back sharing it.
        path: file path (written atomically: temp file, fsync, rename) or a writable binary file object.
        profile: ``"portable"`` (every codec has a CPU decoder), ``"fast"`` (GPU codecs: nvCOMP ANS;
            decodes only on a GPU) or ``"auto"`` (``fast`` when tensors are on a usable GPU).
        threads: CPU threads for coding (default: up to 8, the core count).
        extra: small JSON-able metadata stored in the manifest (``info()`` shows it).
        durable: with a file path, fsync the file and its directory before returning (default);
            ``False`` keeps the temp file and the rename but not the fsyncs (the durability of
            ``torch.save``: atomic against the process dying, not against a power loss).
    Returns:
        A :class:`SaveReport` with raw/stored bytes and ratios per group, dtype and tensor kind.
    Raises:
        UnsupportedTypeError: ``obj`` holds a value that cannot be stored without pickling.
        BackendUnavailableError: ``profile="fast"`` without a usable GPU backend.
        StoreError: the file cannot be written (an ``OSError`` such as ``ENOSPC``, named; the
            temporary file is removed, an existing file at ``path`` is left as it was).
    Example:
        >>> import torch, s4w_core, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.s4w")
        >>> rep = s4w_core.save({"w": torch.ones(1000, dtype=torch.bfloat16), "step": 3}, p)
        >>> s4w_core.load(p)["step"]
        3
    """
    t0 = time.perf_counter()
    url = _url_of(path)
    tw: _TimedWriter | None = None
    commit_s = 0.0
    try:
        if hasattr(path, "write"):
            # (an in-memory file's writes are copies, counted in the encode: it is handed over as it is)
            tw = None if in_memory_file(path) else _TimedWriter(path)  # type: ignore[arg-type]
            manifest, size, prof = pipeline.encode(obj, tw or path, profile, threads, _base_lookup, extra)  # type: ignore[arg-type]
            out_path = None
        else:
            out_path = os.fspath(path)  # type: ignore[arg-type]
            with storage_errors(out_path, "save the checkpoint"), atomic_write(out_path, durable=durable) as f:
                tw = _TimedWriter(f)
                manifest, size, prof = pipeline.encode(obj, tw, profile, threads, _base_lookup, extra)  # type: ignore[arg-type]
                commit_s = time.perf_counter()
            commit_s = time.perf_counter() - commit_s  # flush, fsync, rename, fsync of the directory
        groups, dtypes, kinds, raw, stored, deltas = summarize(manifest)
    except BaseException as e:
        _record("save", url, _step_of(extra, obj), 0, 0, t0, _save_stages(t0, tw, commit_s), error=e)
        raise
    rep = SaveReport(out_path, prof, raw, stored, size, time.perf_counter() - t0, groups, dtypes, kinds, deltas)
    _record(
        "save", url, _step_of(extra, obj), raw, size, t0, _save_stages(t0, tw, commit_s),
        kind="delta" if deltas else None, extra={"profile": prof},
    )
    return rep


# ----------------------------------------------------------------------------- observability
class _TimedWriter(WriteThrough):
    """The file object :func:`save` writes through: counts the seconds spent in ``write`` (and in
    ``writev``, offered where the file has it: a local file takes a storage's chunks where they lie)."""

    def __init__(self, fp: IO[bytes]) -> None:
        super().__init__(fp)
        self.seconds = 0.0

    def through(self, fn: Callable[[Any], Any], data: Any) -> int:
        t = time.perf_counter()
        try:
            return super().through(fn, data)
        finally:
            self.seconds += time.perf_counter() - t


def _url_of(src: Any) -> str:
    if isinstance(src, (str, os.PathLike)):
        return os.fspath(src)  # type: ignore[arg-type]
    if isinstance(src, ContainerReader):
        return src.name
    if isinstance(src, (bytes, bytearray, memoryview)):
        return "<bytes>"
    name = getattr(src, "name", None)
    return name if isinstance(name, str) else "<stream>"


def _step_of(*candidates: Any) -> int | None:
    """The training step for the log line: ``extra["step"]``, else the checkpoint's top-level
    ``step`` / ``global_step`` when it is a plain int."""
    for c in candidates:
        if isinstance(c, Mapping):
            for k in ("step", "global_step"):
                v = c.get(k)
                if type(v) is int:
                    return v
    return None


def _save_stages(t0: float, tw: _TimedWriter | None, commit_s: float) -> dict[str, float]:
    write_s = tw.seconds if tw is not None else 0.0
    out = {"encode": max(0.0, time.perf_counter() - t0 - write_s - commit_s), "write": write_s}
    if commit_s:
        out["commit"] = commit_s
    return out


def _record(
    op: str,
    url: str,
    step: int | None,
    raw: int,
    stored: int,
    t0: float,
    stages: dict[str, float],
    *,
    kind: str | None = None,
    error: BaseException | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """One :class:`~s4w_core.obs.OpEvent` for a blocking file-level save or load."""
    total = time.perf_counter() - t0
    obs.record(
        obs.OpEvent(
            op=op, url=url, step=step, raw_bytes=raw, stored_bytes=stored, blocked_s=total, total_s=total,
            stages=stages, kind=kind, mode="blocking", ok=error is None,
            error=None if error is None else f"{type(error).__name__}: {error}", extra=extra or {},
        )
    )


# ----------------------------------------------------------------------------- load
def load(
    path: PathLike | IO[bytes] | bytes,
    map_location: MapLocation = None,
    *,
    threads: int | None = None,
    _resolve_base: engine.BaseResolver | None = None,
) -> Any:
    """Load what :func:`save` wrote, bit for bit.

    Args:
        path: a file path, a readable binary file object or the container's bytes.
        map_location: like ``torch.load``: ``None`` (each tensor to the device it was saved from),
            a device, or a dict ``{"cuda:0": "cpu"}``.
        threads: CPU threads for decoding.
    Returns:
        The saved object, with tensors restored bit-exactly (NaN payloads, -0.0, denormals included).
    Raises:
        CheckpointNotFoundError: no file at ``path``.
        FormatError: truncated/corrupt/forged container (subclasses name the check that failed).
        UnknownCodecError: a codec this version does not know.
        BackendUnavailableError: GPU-only codecs on a machine without a usable GPU.
        DeviceUnavailableError: a saved device does not exist here and ``map_location`` is not set.
        BaseMismatchError: a delta whose base cannot be resolved (load it through its store).
    Example:
        >>> import torch, s4w_core, io
        >>> buf = io.BytesIO(); _ = s4w_core.save({"x": torch.arange(4)}, buf)
        >>> s4w_core.load(buf.getvalue())["x"].tolist()
        [0, 1, 2, 3]
    """
    t0 = time.perf_counter()
    url = _url_of(path)
    stages: dict[str, float] = {}
    try:
        reader = open_reader(path)
    except BaseException as e:
        _record("load", url, None, 0, 0, t0, {"open": time.perf_counter() - t0}, error=e)
        raise
    stages["open"] = time.perf_counter() - t0
    read = reader._read
    io_s = [0.0]
    lock = threading.Lock()

    def timed_read(o: int, n: int) -> bytes:  # reads run in the decoding threads: sum their seconds
        t = time.perf_counter()
        try:
            return read(o, n)
        finally:
            with lock:
                io_s[0] += time.perf_counter() - t

    reader._read = timed_read
    m = reader.manifest
    obj: Any = None
    try:
        t1 = time.perf_counter()
        raws = pipeline.decode_storages(reader, map_location, threads, _resolve_base)
        obj = decode_tree(m["tree"], pipeline.build_tensors(m, raws), reader.name)
        stages["decode"] = time.perf_counter() - t1
    except BaseException as e:
        stages["read"] = io_s[0]
        _record("load", url, _step_of(m.get("extra")), 0, 0, t0, stages, error=e)
        raise
    finally:
        reader._read = read
        if reader is not path:
            reader.close()
    stages["read"] = io_s[0]
    raw = sum(int(s["nbytes"]) for s in m["storages"])
    _record(
        "load", url, _step_of(m.get("extra"), obj), raw, reader.size, t0, stages,
        kind="delta" if any(s.get("delta") for s in m["storages"]) else None, extra={"profile": m.get("profile")},
    )
    return obj


# ----------------------------------------------------------------------------- info / verify
def info(path: PathLike | IO[bytes] | bytes) -> dict[str, Any]:
    """Describe a checkpoint without decoding it.

    Returns:
        dict with ``profile``, ``writer`` (versions), ``raw_bytes``, ``stored_bytes``, ``ratio``,
        per-``groups`` / ``dtypes`` / ``kinds`` stats, ``codecs`` (chunk count per codec per plane)
        and ``tensors`` (count).
    Raises:
        The same format errors as :func:`load` for the header, trailer and manifest.
    Example:
        >>> import torch, s4w_core, io
        >>> buf = io.BytesIO(); _ = s4w_core.save({"x": torch.zeros(10)}, buf)
        >>> s4w_core.info(buf.getvalue())["tensors"]
        1
    """
    reader = open_reader(path)
    reader.close()
    m = reader.manifest
    groups, dtypes, kinds, raw, stored, deltas = summarize(m)
    planes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for s in m["storages"]:
        w = s["_width"]
        for k, c in enumerate(s["chunks"]):
            planes[f"{s['transform']}[{k % w}]" if w > 1 else s["transform"]][c[0]] += 1
    return {
        "path": reader.name,
        "format_version": reader.version,
        "profile": m.get("profile"),
        "writer": m.get("writer"),
        "created": m.get("created"),
        "file_bytes": reader.size,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": round(raw / stored, 4) if stored else 1.0,
        "tensors": len(m["tensors"]),
        "storages": len(m["storages"]),
        "delta_storages": deltas,
        "groups": {k: v.as_dict() for k, v in groups.items()},
        "dtypes": {k: v.as_dict() for k, v in dtypes.items()},
        "kinds": {k: v.as_dict() for k, v in kinds.items()},
        "codecs": {k: dict(v) for k, v in planes.items()},
        "extra": m.get("extra", {}),
    }


@dataclass
class VerifyReport:
    path: str
    ok: bool
    storages: int
    raw_bytes: int
    problems: list[str]


def verify(
    path: PathLike | IO[bytes] | bytes,
    *,
    map_location: MapLocation = "cpu",
    _resolve_base: engine.BaseResolver | None = None,
) -> VerifyReport:
    """Decode every tensor and check every checksum (stored chunks and decoded bytes).

    Returns:
        A :class:`VerifyReport`; ``ok`` is False (and ``problems`` says why) on any mismatch.
        Never raises for corrupt content; raises only when the file cannot be opened at all.
    Example:
        >>> import torch, s4w_core, io
        >>> buf = io.BytesIO(); _ = s4w_core.save({"x": torch.zeros(10)}, buf)
        >>> s4w_core.verify(buf.getvalue()).ok
        True
    """
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else "<stream>"
    try:
        reader = open_reader(path)
    except CheckpointNotFoundError:
        raise
    except S4WError as e:
        return VerifyReport(name, False, 0, 0, [f"{type(e).__name__}: {e}"])
    problems: list[str] = []
    m = reader.manifest
    raw = 0
    try:
        raws = pipeline.decode_storages(reader, map_location, None, _resolve_base)
        raw = sum(r.numel() for r in raws)
        decode_tree(m["tree"], pipeline.build_tensors(m, raws), reader.name)
    except S4WError as e:
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        if reader is not path:
            reader.close()
    return VerifyReport(reader.name, not problems, len(m["storages"]), raw, problems)

"""CheckpointStore: base -> delta chains of s4weights containers, atomic commits, retention.

Layout under the store's root (a directory, an ``s3://bucket/prefix`` or ``memory://name``)::

    data/step_000000000100.<token>.s4w   one s4weights container per save (immutable; a fresh
                                          random token per attempt, so no save ever overwrites data)
    commits/step_000000000100.json       the commit record, written LAST: a step exists iff its
                                          commit record does
    pins/step_000000000100               empty marker: the step is exempt from retention

Commit protocol (docs/STORE.md): (1) stream the container to a new data object (atomic: temp +
fsync + rename locally, a completed multipart upload on S3); (2) write the commit record
(atomic, create-if-absent unless ``overwrite=True``).  A crash before (2) leaves at most an
unreferenced data object that no listing shows and :meth:`CheckpointStore.gc` reclaims.  Readers
list ``commits/`` only, so they never see a half-written checkpoint.

Deltas: each storage of a new checkpoint may be coded against the storage at the same tree path
in the previous committed step (the base), see :mod:`s4w_core.delta`.  A delta's manifest entry
names its base by data object, storage index and checksum, so a base can be verified and is never
confused with a later re-save of the same step.  Every commit record lists the data objects its
chain needs (``objects``); a data object is live while any commit record lists it.

Keyframes: a step is coded without base when the previous step is ``keyframe_every - 1`` deltas
deep (so restoring any step reads at most ``keyframe_every`` containers per tensor), when no
tensor's delta pays, when there is no earlier step, or when asked (``keyframe=True``).
"""

from __future__ import annotations

import builtins
import datetime as _dt
import json
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Mapping

import torch

from s4w_core import api, engine
from s4w_core.codecs import get_codec
from s4w_core.errors import (
    BackendUnavailableError,
    BaseMismatchError,
    CheckpointNotFoundError,
    ConflictError,
    FormatError,
    ManifestError,
    S4WError,
    StoreError,
    TruncatedError,
)
from s4w_core.format.container import ContainerReader
from s4w_core.skeleton import decode_tree, encode_tree
from s4w_core.store._backend import Backend, RangeReader

__all__ = ["CheckpointStore", "StepInfo", "open_backend", "STORE_FORMAT", "STORE_VERSION", "DEFAULT_KEYFRAME_EVERY"]

STORE_FORMAT = "s4weights-store"
STORE_VERSION = 1
#: default bound on a delta chain: a keyframe at least every 10 saves (restore reads <= 10 containers).
DEFAULT_KEYFRAME_EVERY = 10

_COMMITS = "commits/"
_DATA = "data/"
_PINS = "pins/"
_STEP_RE = re.compile(r"^step_(\d{12})(?:\.json)?$")
_MAX_RECORD = 1 << 24


def _commit_key(step: int) -> str:
    return f"{_COMMITS}step_{step:012d}.json"


def _pin_key(step: int) -> str:
    return f"{_PINS}step_{step:012d}"


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**12:
        raise ValueError(f"step must be an integer in [0, 10**12), got {step!r}")
    return step


def open_backend(url: str | os.PathLike[str], **options: Any) -> Backend:
    """The backend for ``url``: ``s3://bucket/prefix``, ``memory://name`` or a local path
    (``file://`` accepted).  ``options`` go to the S3 backend (region, endpoint, ...)."""
    u = os.fspath(url)
    if u.startswith("s3://"):
        from s4w_core.store._s3 import S3Backend

        return S3Backend(u, **options)
    s3_only = {k for k, v in options.items() if v is not None and k not in ("create",)}
    if s3_only:
        raise ValueError(f"options {sorted(s3_only)} apply only to s3:// stores, not {u!r}")
    if u.startswith("memory://"):
        from s4w_core.store._memory import MemoryBackend

        return MemoryBackend(u[len("memory://") :])
    if "://" in u and not u.startswith("file://"):
        raise ValueError(f"unsupported store URL {u!r}: use a local path, file://, s3:// or memory://")
    from s4w_core.store._local import LocalBackend

    return LocalBackend(u[len("file://") :] if u.startswith("file://") else u, create=options.get("create", True))


# ----------------------------------------------------------------------------- records
@dataclass(frozen=True)
class StepInfo:
    """One committed step, as its commit record describes it (no data is read)."""

    step: int
    kind: str  # "keyframe" | "delta"
    depth: int  # deltas since the last keyframe (0 for a keyframe)
    base_step: int | None
    object: str
    object_bytes: int
    raw_bytes: int
    stored_bytes: int
    objects: tuple[str, ...]
    created: str
    profile: str
    kinds: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    delta_ops: dict[str, int] = field(default_factory=dict)  # storages per delta op
    pinned: bool = False

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.object_bytes if self.object_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "depth": self.depth,
            "base_step": self.base_step,
            "object": self.object,
            "object_bytes": self.object_bytes,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.ratio, 4),
            "objects": list(self.objects),
            "created": self.created,
            "profile": self.profile,
            "kinds": self.kinds,
            "groups": self.groups,
            "extra": self.extra,
            "delta_ops": self.delta_ops,
            "pinned": self.pinned,
        }

    def _record(self) -> dict[str, Any]:
        d = self.as_dict()
        d.pop("ratio")
        d.pop("pinned")
        return {"format": STORE_FORMAT, "version": STORE_VERSION, **d}


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _parse_record(body: bytes, key: str, where: str) -> StepInfo:
    def bad(why: str) -> ManifestError:
        return ManifestError(f"{where}: commit record {key} is invalid: {why}")

    if len(body) > _MAX_RECORD:
        raise bad(f"{len(body)} bytes, larger than {_MAX_RECORD}")
    try:
        r = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise bad(f"not JSON ({e}): truncated or corrupt") from e
    if not isinstance(r, dict) or r.get("format") != STORE_FORMAT:
        raise bad("not an s4weights-store commit record")
    if r.get("version") != STORE_VERSION:
        raise bad(f"store version {r.get('version')!r}; this s4weights reads version {STORE_VERSION}")
    m = _STEP_RE.match(key[len(_COMMITS) :])
    try:
        step = _check_step(r["step"])
        if m is None or int(m.group(1)) != step:
            raise bad(f"it names step {step}, but its key names another")
        obj, objects = r["object"], r["objects"]
        if not isinstance(obj, str) or not obj.startswith(_DATA) or ".." in obj:
            raise bad(f"data object {obj!r} is not under {_DATA}")
        if not isinstance(objects, list) or not objects or objects[0] != obj or not all(
            isinstance(o, str) and o.startswith(_DATA) and ".." not in o for o in objects
        ):
            raise bad("'objects' must list the data objects of its chain, its own first")
        ints = {k: r[k] for k in ("depth", "object_bytes", "raw_bytes", "stored_bytes")}
        for k, v in ints.items():
            if type(v) is not int or v < 0:
                raise bad(f"{k} must be a non-negative integer, got {v!r}")
        base = r.get("base_step")
        if base is not None and (type(base) is not int or base >= step):
            raise bad(f"base_step {base!r} must be an earlier step")
        if r["kind"] not in ("keyframe", "delta"):
            raise bad(f"unknown kind {r['kind']!r}")
        return StepInfo(
            step=step,
            kind=r["kind"],
            depth=r["depth"],
            base_step=base,
            object=obj,
            object_bytes=r["object_bytes"],
            raw_bytes=r["raw_bytes"],
            stored_bytes=r["stored_bytes"],
            objects=tuple(objects),
            created=str(r.get("created", "")),
            profile=str(r.get("profile", "")),
            kinds=_dict(r.get("kinds")),
            groups=_dict(r.get("groups")),
            extra=_dict(r.get("extra")),
            delta_ops=_dict(r.get("delta_ops")),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ManifestError):
            raise
        raise bad(f"missing or malformed field ({e})") from e


# ----------------------------------------------------------------------------- base cache
@dataclass
class _CachedBase:
    """Raw bytes of the last committed save, by storage path, to code the next save against."""

    step: int
    object: str
    storages: dict[str, tuple[torch.Tensor, dict[str, Any], str]]  # path -> (uint8 cpu, base_ref, dtype)
    nbytes: int


class _Progress:
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


class _CountingWriter:
    """File-object wrapper that counts bytes (and drives a progress bar); a backend's write
    error (ENOSPC, EIO) becomes a :class:`StoreError` naming the object."""

    def __init__(self, f: IO[bytes], progress: _Progress, where: str = "") -> None:
        self._f = f
        self._p = progress
        self._where = where
        self.n = 0

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            if isinstance(e, S4WError):
                raise
            raise StoreError(f"cannot write {self._where}: {e}") from e
        n = len(data) if n is None else n
        self.n += n
        self._p.update(n)
        return n


# ----------------------------------------------------------------------------- the store
class CheckpointStore:
    """A run's checkpoints as a chain of compressed containers on a local directory or S3.

    Args:
        url: a local directory (the default kind; created if missing), ``file://PATH``,
            ``s3://BUCKET/PREFIX`` or ``memory://NAME`` (tests).
        keep_last: after each save keep only the newest ``keep_last`` steps (plus pinned ones);
            ``None`` keeps everything.
        pinned: steps exempt from retention (also see :meth:`pin`, which persists).
        keyframe_every: bound on the delta chain: a full (keyframe) checkpoint at least every
            ``keyframe_every`` saves, so loading any step reads at most that many containers.
            ``1`` disables deltas.
        delta: code tensors against the previous step where that pays (default True).
        profile: codec profile for :func:`s4w_core.save` (``auto``/``portable``/``fast``).
        threads: CPU threads for coding.
        base_cache_bytes: host memory the store may use to keep the last saved (or loaded) step's
            bytes as the base of the next save; ``None``: no limit; ``0``: never cache (each save
            then re-reads the storages it needs from the previous step, decoding its chain).
        region, endpoint, force_path_style, unsigned, profile_name, client_options: S3 settings
            (see :mod:`s4w_core.store._s3`); environment variables such as ``AWS_ENDPOINT_URL``
            apply when these are not given.
        progress: show tqdm progress bars on saves and loads.
    Raises:
        StoreError: the local path is not a directory or cannot be created.
        BackendUnavailableError: ``s3://`` without s3torchconnector installed.
    Example:
        >>> import torch, tempfile
        >>> from s4w_core import CheckpointStore
        >>> st = CheckpointStore(tempfile.mkdtemp())
        >>> _ = st.save({"w": torch.ones(4)}, step=10)
        >>> st.steps(), st.load()["w"].tolist()
        ([10], [1.0, 1.0, 1.0, 1.0])
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        pinned: Iterable[int] = (),
        keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
        delta: bool = True,
        profile: str = "auto",
        threads: int | None = None,
        base_cache_bytes: int | None = None,
        region: str | None = None,
        endpoint: str | None = None,
        force_path_style: bool | None = None,
        unsigned: bool | None = None,
        profile_name: str | None = None,
        client_options: Mapping[str, Any] | None = None,
        progress: bool = False,
        _backend: Backend | None = None,
    ) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if type(keyframe_every) is not int or keyframe_every < 1:
            raise ValueError(f"keyframe_every must be a positive integer, got {keyframe_every!r}")
        if profile not in api.PROFILES:
            raise ValueError(f"profile must be one of {api.PROFILES}, got {profile!r}")
        self.url = os.fspath(url)
        if _backend is not None:
            self.backend = _backend
        else:
            s3opts = {
                "region": region,
                "endpoint": endpoint,
                "force_path_style": force_path_style,
                "unsigned": unsigned,
                "profile": profile_name,
                "client_options": client_options,
            }
            if self.url.startswith("s3://"):
                self.backend = open_backend(self.url, **{k: v for k, v in s3opts.items() if v is not None})
            else:
                self.backend = open_backend(self.url, **s3opts)
        self.keep_last = keep_last
        self.pinned = {_check_step(s) for s in pinned}
        self.keyframe_every = keyframe_every
        self.delta = delta
        self.profile = profile
        self.threads = threads
        self.base_cache_bytes = base_cache_bytes
        self.progress = progress
        self._cache: _CachedBase | None = None
        self._records: dict[str, tuple[int, str | None, StepInfo]] = {}
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.backend.url!r}, keyframe_every={self.keyframe_every}, keep_last={self.keep_last})"

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._cache = None
        self.backend.close()

    # ------------------------------------------------------------------ listing
    def _read_records(self) -> dict[int, StepInfo]:
        objs = [o for o in self.backend.list(_COMMITS) if _STEP_RE.match(o.key[len(_COMMITS) :])]
        pins = {
            int(m.group(1))
            for o in self.backend.list(_PINS)
            if (m := _STEP_RE.match(o.key[len(_PINS) :]))
        }
        todo = [o for o in objs if o.version is None or self._records.get(o.key, (None, None))[:2] != (o.size, o.version)]

        def fetch(key: str) -> tuple[str, StepInfo]:
            return key, _parse_record(self.backend.get(key), key, self.backend.url)

        if todo:
            if len(todo) == 1:
                got = [fetch(todo[0].key)]
            else:
                with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
                    got = list(pool.map(fetch, [o.key for o in todo]))
            sizes = {o.key: (o.size, o.version) for o in todo}
            for key, rec in got:
                self._records[key] = (*sizes[key], rec)
        live = {o.key for o in objs}
        for k in list(self._records):
            if k not in live:
                del self._records[k]
        out = {}
        for key in live:
            rec = self._records[key][2]
            pinned = rec.step in pins or rec.step in self.pinned
            out[rec.step] = rec if rec.pinned == pinned else _replace(rec, pinned=pinned)
        return dict(sorted(out.items()))

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return list(self._read_records())

    def list(self) -> list[StepInfo]:
        """:class:`StepInfo` of every committed step, ascending."""
        return list(self._read_records().values())

    def latest(self) -> int | None:
        """The newest committed step, or None for an empty store."""
        s = self.steps()
        return s[-1] if s else None

    def info(self, step: int | None = None) -> StepInfo:
        """The commit record of ``step`` (default: latest). Raises CheckpointNotFoundError."""
        return self._record(step, self._read_records())

    def _record(self, step: int | None, recs: dict[int, StepInfo]) -> StepInfo:
        if step is None:
            if not recs:
                raise CheckpointNotFoundError(f"{self.backend.url}: no committed checkpoint in this store")
            return recs[max(recs)]
        _check_step(step)
        if step not in recs:
            near = ", ".join(str(s) for s in list(recs)[-5:]) or "none"
            raise CheckpointNotFoundError(f"{self.backend.url}: no committed step {step} (latest steps: {near})")
        return recs[step]

    def sizes(self) -> dict[str, Any]:
        """Byte totals: ``raw_bytes`` (what the steps decode to), ``stored_bytes`` (their own
        containers), ``physical_bytes`` (every data object present, including bases kept only
        for a delta and unreferenced leftovers), ``ratio`` = raw / stored, per ``kinds`` totals."""
        recs = self._read_records()
        data = self.backend.list(_DATA)
        live = {o for r in recs.values() for o in r.objects}
        own = {r.object for r in recs.values()}
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
            "base_only_bytes": sum(o.size for o in data if o.key in live and o.key not in own),
            "unreferenced_bytes": sum(o.size for o in data if o.key not in live),
            "kinds": kinds,
        }

    # ------------------------------------------------------------------ reading
    def _open(self, key: str, *, whole: bool, expect: int | None = None, what: str = "") -> ContainerReader:
        rr: RangeReader = self.backend.fetch(key) if whole else self.backend.open_range(key)
        try:
            if expect is not None and rr.size != expect:
                raise TruncatedError(
                    f"{rr.name}{what}: data object is {rr.size} bytes but its commit record says {expect}: "
                    "truncated or replaced"
                )
            reader = ContainerReader(rr.read, rr.size, rr.name)
            api.open_reader(reader)  # validates the manifest
        except BaseException:
            rr.close()
            raise
        reader._fp = _Closer(rr.close)  # type: ignore[assignment]  # noqa: SLF001
        return reader

    def load(
        self,
        step: int | None = None,
        map_location: api.MapLocation = None,
        *,
        threads: int | None = None,
    ) -> Any:
        """Load ``step`` (default: the latest committed) bit for bit.

        Args:
            step: the step to load; ``None`` for the newest committed one.
            map_location: as for :func:`s4w_core.load`.
            threads: CPU threads for decoding.
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
        recs = self._read_records()
        rec = self._record(step, recs)
        obj, raws, reader = self._load_record(rec, map_location, threads)
        latest = max(recs)
        if rec.step == latest and self.delta and self.keyframe_every > 1:
            self._remember(rec, reader.manifest, raws)
        return obj

    def _load_record(
        self, rec: StepInfo, map_location: api.MapLocation, threads: int | None
    ) -> tuple[Any, builtins.list[torch.Tensor], ContainerReader]:
        ctx = _Chain(self, rec, threads)
        prog = _Progress(self.progress, f"load step {rec.step}")
        try:
            reader = ctx.reader(rec.object, rec.object_bytes, rec.step)
            if prog.bar is not None:
                read = reader._read  # noqa: SLF001

                def counted(o: int, n: int) -> bytes:
                    b = read(o, n)
                    prog.update(len(b))
                    return b

                reader._read = counted  # noqa: SLF001
            raws = api._decode_storages(reader, map_location, threads, ctx.resolve)  # noqa: SLF001
            m = reader.manifest
            obj = decode_tree(m["tree"], api._build_tensors(m, raws))  # noqa: SLF001
            return obj, raws, reader
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(
                f"step {rec.step}: its data object {rec.object} is missing from {self.backend.url} "
                f"(deleted concurrently, or the store was damaged): {e}"
            ) from e
        finally:
            prog.close()
            ctx.close()

    def verify(self, step: int | None = None) -> api.VerifyReport:
        """Decode ``step`` (and the bases it needs) and check every checksum; never raises for
        corrupt content (``ok`` is False and ``problems`` says why)."""
        rec = self.info(step)
        try:
            _, raws, _ = self._load_record(rec, "cpu", self.threads)
        except (FormatError, BaseMismatchError, CheckpointNotFoundError, StoreError) as e:
            return api.VerifyReport(f"{self.backend.url} step {rec.step}", False, 0, 0, [f"{type(e).__name__}: {e}"])
        return api.VerifyReport(f"{self.backend.url} step {rec.step}", True, len(raws), sum(r.numel() for r in raws), [])

    def container_info(self, step: int | None = None) -> dict[str, Any]:
        """:func:`s4w_core.info` of the step's container (reads only its manifest)."""
        rec = self.info(step)
        reader = self._open(rec.object, whole=False, expect=rec.object_bytes, what=f" (step {rec.step})")
        try:
            d = api.info(reader)  # type: ignore[arg-type]  # open_reader takes readers too
        finally:
            reader.close()
        d["path"] = self.backend.describe(rec.object)
        return d

    # ------------------------------------------------------------------ writing
    def save(
        self,
        state: Any,
        step: int,
        *,
        extra: Mapping[str, Any] | None = None,
        keyframe: bool = False,
        overwrite: bool = False,
    ) -> StepInfo:
        """Save ``state`` as ``step``; it becomes visible only once all its data is durable.

        Args:
            state: any object :func:`s4w_core.save` accepts (``{"model": ..., "optimizer": ...}``).
            step: the training step (a non-negative integer); the base of a delta is the newest
                committed step below it.
            extra: small JSON-able metadata kept in the commit record and the container.
            keyframe: force a full checkpoint (no delta).
            overwrite: replace an existing commit of ``step`` (the old data stays as long as a
                later delta needs it).
        Returns:
            The :class:`StepInfo` of the committed step.
        Raises:
            ConflictError: ``step`` is already committed and ``overwrite`` is False.
            UnsupportedTypeError: ``state`` holds a value that cannot be stored without pickle.
            StoreError: the backend failed; nothing committed before is changed.
        Example:
            >>> import torch, tempfile
            >>> from s4w_core import CheckpointStore
            >>> st = CheckpointStore(tempfile.mkdtemp())
            >>> st.save({"w": torch.zeros(8, dtype=torch.bfloat16)}, step=0).kind
            'keyframe'
        """
        step = _check_step(step)
        with self._lock:
            recs = self._read_records()
            if step in recs and not overwrite:
                raise ConflictError(
                    f"{self.backend.url}: step {step} is already committed; delete it first or pass overwrite=True"
                )
            info = self._save(state, step, recs, extra=extra, keyframe=keyframe, replace=step in recs)
            if step in recs:
                self._reclaim(recs[step].objects)
            if self.keep_last is not None:
                self.apply_retention()
            return info

    def _base_for(self, step: int, recs: Mapping[int, StepInfo]) -> StepInfo | None:
        earlier = [s for s in recs if s < step]
        return recs[max(earlier)] if earlier else None

    def _save(
        self,
        state: Any,
        step: int,
        recs: Mapping[int, StepInfo],
        *,
        extra: Mapping[str, Any] | None,
        keyframe: bool,
        replace: bool,
    ) -> StepInfo:
        base = self._base_for(step, recs)
        use_delta = (
            self.delta and not keyframe and base is not None and base.depth + 1 < self.keyframe_every
        )
        provider: _BaseProvider | None = None
        if use_delta:
            assert base is not None
            provider = _BaseProvider(self, base)
        key = f"{_DATA}step_{step:012d}.{uuid.uuid4().hex[:12]}.s4w"
        prog = _Progress(self.progress, f"save step {step}")
        try:
            with self.backend.writer(key) as f:
                cw = _CountingWriter(f, prog, f"{self.backend.url}/{key}")
                manifest, size, prof = api._encode(  # noqa: SLF001
                    state,
                    cw,  # type: ignore[arg-type]
                    self.profile,
                    self.threads,
                    provider.lookup if provider is not None else None,
                    {**(extra or {}), "step": step},
                )
        finally:
            prog.close()
            if provider is not None:
                provider.close()
        groups, _dtypes, kinds, raw, stored, ndelta = api.summarize(manifest)
        is_delta = ndelta > 0
        assert base is not None or not is_delta
        info = StepInfo(
            step=step,
            kind="delta" if is_delta else "keyframe",
            depth=base.depth + 1 if is_delta and base is not None else 0,
            base_step=base.step if is_delta and base is not None else None,
            object=key,
            object_bytes=size,
            raw_bytes=raw,
            stored_bytes=stored,
            objects=tuple([key, *(base.objects if is_delta and base is not None else ())]),
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            profile=prof,
            kinds={k: v.as_dict() for k, v in kinds.items()},
            groups={k: v.as_dict() for k, v in groups.items()},
            extra=dict(extra or {}),
            delta_ops=_count_ops(manifest),
        )
        body = json.dumps(info._record(), separators=(",", ":"), sort_keys=True).encode()  # noqa: SLF001
        try:
            self.backend.put(_commit_key(step), body, if_absent=not replace)  # the commit point
            self._records.pop(_commit_key(step), None)
        except BaseException:
            # the data object is unreferenced: remove it (best effort; gc() would too)
            try:
                self.backend.delete(key)
            except S4WError:
                pass
            raise
        # remember this step's bytes as the next save's base
        self._cache = None
        if self.delta and self.keyframe_every > 1:
            col = engine.Collector()
            encode_tree(state, col.add)
            self._remember(info, manifest, [j.raw for j in col.jobs])
        return info

    def _remember(self, rec: StepInfo, manifest: Mapping[str, Any], raws: builtins.list[torch.Tensor]) -> None:
        """Keep copies of a committed step's storages (within ``base_cache_bytes``)."""
        self._cache = None
        total = sum(r.numel() for r in raws)
        if self.base_cache_bytes is not None and total > self.base_cache_bytes:
            return
        storages: dict[str, tuple[torch.Tensor, dict[str, Any], str]] = {}
        for i, (s, raw) in enumerate(zip(manifest["storages"], raws)):
            if s["path"] in storages or raw.numel() != s["nbytes"]:
                continue
            ref = {"object": rec.object, "storage": i, "checksum": s["checksum"]}
            storages[s["path"]] = (raw.detach().to("cpu", copy=True).view(-1), ref, s["dtype"])
        self._cache = _CachedBase(rec.step, rec.object, storages, total)

    # ------------------------------------------------------------------ pins, retention, deletion
    def pin(self, step: int) -> None:
        """Exempt ``step`` from retention (persisted as a marker object)."""
        self._record(_check_step(step), self._read_records())
        self.backend.put(_pin_key(step), b"")

    def unpin(self, step: int) -> None:
        self.backend.delete(_pin_key(_check_step(step)))
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
        """Delete ``step``: it disappears from listings at once; its data is reclaimed unless a
        kept step's chain still needs it.

        Args:
            step: a committed step.
            rebase: first re-code every kept step whose chain runs through ``step`` against the
                nearest kept earlier step (or as a keyframe), so that ``step``'s data can be
                reclaimed now instead of when those deltas go.
        Raises:
            CheckpointNotFoundError: no such step.
        """
        step = _check_step(step)
        with self._lock:
            recs = self._read_records()
            rec = self._record(step, recs)
            before = {o for r in recs.values() for o in r.objects}
            if rebase:
                for s in sorted(recs):
                    if s != step and rec.object in recs[s].objects:
                        self._rebase(s, exclude=step)
                        recs = self._read_records()
            self.backend.delete(_commit_key(step))  # the step is gone from here on
            self.backend.delete(_pin_key(step))
            self.pinned.discard(step)
            if self._cache is not None and self._cache.step == step:
                self._cache = None
            self._records.pop(_commit_key(step), None)
            self._reclaim(before)

    def _reclaim(self, candidates: Iterable[str]) -> None:
        """Delete those of ``candidates`` (data objects once committed) no commit needs now."""
        recs = self._read_records()
        live = {o for r in recs.values() for o in r.objects}
        for o in sorted(set(candidates) - live):
            self.backend.delete(o)

    def _rebase(self, step: int, *, exclude: int) -> StepInfo:
        """Re-code ``step`` against the newest kept step below it (never ``exclude``)."""
        recs = self._read_records()
        rec = recs[step]
        state, _, _ = self._load_record(rec, "cpu", self.threads)
        others = {s: r for s, r in recs.items() if s < step and s != exclude and recs[exclude].object not in r.objects}
        saved_cache = self._cache
        self._cache = None
        try:
            return self._save(state, step, {**others, step: rec}, extra=rec.extra, keyframe=False, replace=True)
        finally:
            self._cache = saved_cache if saved_cache is not None and saved_cache.step != step else self._cache

    def gc(self, *, grace_seconds: float = 3600.0) -> int:
        """Delete data objects no commit record needs and leftovers of crashed writers older than
        ``grace_seconds`` (younger ones may belong to a save in progress). Returns bytes freed."""
        recs = self._read_records()
        live = {o for r in recs.values() for o in r.objects}
        now = time.time()
        freed = 0
        for o in self.backend.list(_DATA):
            if o.key in live:
                continue
            if o.mtime is not None and now - o.mtime < grace_seconds:
                continue
            self.backend.delete(o.key)
            freed += o.size
        tmps = getattr(self.backend, "list_temporaries", None)
        if tmps is not None:
            for o in tmps():
                if o.mtime is not None and now - o.mtime >= grace_seconds:
                    self.backend.delete(o.key)
        pins = self.backend.list(_PINS)
        for o in pins:
            m = _STEP_RE.match(o.key[len(_PINS) :])
            if m and int(m.group(1)) not in recs:
                self.backend.delete(o.key)
        return freed


def _count_ops(manifest: Mapping[str, Any]) -> dict[str, int]:
    ops: dict[str, int] = {}
    for s in manifest["storages"]:
        if s.get("delta"):
            ops[s["delta"]["op"]] = ops.get(s["delta"]["op"], 0) + 1
    return ops


def _replace(rec: StepInfo, **kw: Any) -> StepInfo:
    import dataclasses

    return dataclasses.replace(rec, **kw)


class _Closer:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.close = fn


# ----------------------------------------------------------------------------- chains
class _Chain:
    """Resolves delta bases while one step is decoded: opens each data object once, decodes only
    the storages a delta needs (recursively, at most ``keyframe_every`` levels), and turns every
    failure of a base into a BaseMismatchError naming the step and object."""

    def __init__(self, store: CheckpointStore, rec: StepInfo, threads: int | None) -> None:
        self.store = store
        self.rec = rec
        self.threads = threads
        self.readers: dict[str, ContainerReader] = {}
        self.allowed = set(rec.objects)
        self._lock = threading.Lock()
        self._depth = 0

    def reader(self, key: str, expect: int | None = None, step: int | None = None) -> ContainerReader:
        with self._lock:
            r = self.readers.get(key)
            if r is None:
                what = f" (step {step})" if step is not None else f" (a base of step {self.rec.step})"
                r = self.store._open(key, whole=True, expect=expect, what=what)  # noqa: SLF001
                self.readers[key] = r
            return r

    def resolve(self, ref: Mapping[str, Any], nbytes: int) -> torch.Tensor:
        step = self.rec.step
        if not isinstance(ref, Mapping) or not isinstance(ref.get("object"), str) or type(ref.get("storage")) is not int or not isinstance(ref.get("checksum"), str):
            raise BaseMismatchError(f"step {step}: a delta names a malformed base {ref!r}")
        obj, idx, ck = ref["object"], ref["storage"], ref["checksum"]
        if obj not in self.allowed:
            raise BaseMismatchError(
                f"step {step}: a delta names base object {obj}, which its commit record does not list "
                f"as part of its chain {sorted(self.allowed)}"
            )
        self._depth += 1
        try:
            if self._depth > max(64, 2 * len(self.allowed) + 2):
                raise BaseMismatchError(f"step {step}: delta chain through {obj} is cyclic or too deep")
            try:
                reader = self.reader(obj)
            except CheckpointNotFoundError as e:
                raise BaseMismatchError(
                    f"step {step}: its delta base object {obj} is missing from {self.store.backend.url}; "
                    f"step {step} cannot be restored ({e})"
                ) from e
            except FormatError as e:
                raise BaseMismatchError(f"step {step}: its delta base object {obj} is corrupt: {e}") from e
            entries = reader.manifest["storages"]
            if not 0 <= idx < len(entries):
                raise BaseMismatchError(f"step {step}: base {obj} has no storage {idx}")
            entry = entries[idx]
            if entry["checksum"] != ck or entry["nbytes"] != nbytes:
                raise BaseMismatchError(
                    f"step {step}: storage {idx} ({entry['path']!r}) of base {obj} is not the one the delta "
                    f"was made against (checksum {entry['checksum']} / {entry['nbytes']} bytes, "
                    f"expected {ck} / {nbytes} bytes)"
                )
            try:
                return _decode_one(reader, entry, self.threads, self.resolve)
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


def _decode_one(
    reader: ContainerReader, entry: dict[str, Any], threads: int | None, resolve: engine.BaseResolver
) -> torch.Tensor:
    """Decode one storage entry to a CPU uint8 tensor (GPU codecs through the GPU backend)."""
    needs_gpu = any(not get_codec(c[0]).cpu_decodable for c in entry["chunks"])
    if needs_gpu:
        gpu = api._gpu()  # noqa: SLF001
        if gpu is None:
            raise BackendUnavailableError(
                f"{reader.name}: base tensor {entry['path']!r} uses GPU-only codecs; load on a GPU machine"
            )
        dev = torch.device("cuda", torch.cuda.current_device())
        return gpu.decode_storage(reader, entry, dev, resolve).cpu()
    with engine._executor(threads) as pool:  # noqa: SLF001
        return engine.decode_storage_cpu(reader, entry, pool, resolve, reader.name)


class _BaseProvider:
    """Supplies the previous step's bytes to the encoder: from the store's in-memory copy when it
    holds that step, else by decoding the needed storage from the store (lazily, one at a time)."""

    def __init__(self, store: CheckpointStore, base: StepInfo) -> None:
        self.store = store
        self.base = base
        cache = store._cache  # noqa: SLF001
        self.cache = cache if cache is not None and cache.object == base.object else None
        self.chain: _Chain | None = None
        self.by_path: dict[str, int] | None = None

    def lookup(self, path: str, nbytes: int, dtype: str) -> tuple[torch.Tensor, dict[str, Any]] | None:
        if self.cache is not None:
            hit = self.cache.storages.get(path)
            if hit is None or hit[0].numel() != nbytes or hit[2] != dtype:
                return None
            return hit[0], dict(hit[1])
        if self.chain is None:
            self.chain = _Chain(self.store, self.base, self.store.threads)
            reader = self.chain.reader(self.base.object, self.base.object_bytes, self.base.step)
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
        raw = _decode_one(reader, entry, self.store.threads, self.chain.resolve)
        return raw, {"object": self.base.object, "storage": idx, "checksum": entry["checksum"]}

    def close(self) -> None:
        if self.chain is not None:
            self.chain.close()

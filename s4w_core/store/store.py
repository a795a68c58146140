"""CheckpointStore: the newest step whole, older steps deltas against newer ones, atomic commits.

Layout under the store's root (a directory, an ``s3://bucket/prefix`` or ``memory://name``)::

    data/step_000000000100.<token>.s4w   one s4weights container per step (immutable; a fresh
                                          random token per write, so nothing committed is overwritten)
    commits/step_000000000100.json       the commit record, written LAST: a step exists iff its
                                          commit record does
    pins/step_000000000100               empty marker: the step is exempt from retention

Each save writes its step whole (a keyframe).  Behind it, on the store's worker, the step just
below (whole until then) is re-encoded as a delta against the new step from the host copies the
store keeps, checked to hold the same bytes, and committed by rewriting its record (atomic); its
old whole object is then removed.  At most ``keyframe_every - 1`` deltas in a row: then a step
stays whole.  A reverse delta's manifest names its base by data object, storage and raw checksum;
that object may since have been re-encoded itself, so a base object that is gone is found through
its step's current commit record and the decoded bytes are checked against the checksum
(:class:`Chain`).  Deleting the oldest step re-codes nothing; deleting (or overwriting) a step a
delta is against first re-codes that delta against the nearest step above it (or whole).

Stores written by the first layout (forward deltas, ``version: 1`` records, keyframe copies of the
newest step) are read as they are; the first save into one drops its keyframe copy.

Commit protocol (docs/STORE.md): (1) write a data object (atomic: temp + fsync + rename locally,
a completed multipart upload on S3); (2) write or rewrite the commit record (atomic); (3) only
then remove what no record needs.  A crash leaves every committed step loadable and at most
unreferenced objects, which :meth:`CheckpointStore.gc` reclaims.

Non-blocking saves (:meth:`CheckpointStore.save_async`, :mod:`s4w_core.store._async`): the caller
waits only until the state is safe to modify; one worker thread per store encodes, writes and
commits, one save at a time, and re-encodes behind it.  Tiers (``fast_tier=``,
:mod:`s4w_core.store._tiered`): a save commits to the fast tier, then the worker copies it on.
"""

from __future__ import annotations

import builtins
import datetime as _dt
import functools
import io
import json
import logging
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Literal, Mapping, TypeVar, overload

import torch

from s4w_core import api, engine, gpu, obs
from s4w_core import checksum as ck
from s4w_core.errors import (
    AsyncSaveError,
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
from s4w_core.store import _async, _tiered
from s4w_core.store._async import SaveHandle
from s4w_core.store._backend import Backend, RangeReader
from s4w_core.store.chain import (
    BaseProvider,
    CachedBase,
    Chain,
    chain_device,
    source_of_manifest,
    state_source,
)
from s4w_core.store.records import (
    COMMITS,
    DATA,
    PINS,
    STEP_RE,
    STORE_FORMAT,
    STORE_VERSION,
    StepInfo,
    check_step,
    commit_key,
    data_key,
    dict_or_empty,
    parse_record,
    pin_key,
    replace_record,
)

__all__ = [
    "CheckpointStore",
    "StepInfo",
    "SaveHandle",
    "open_backend",
    "STORE_FORMAT",
    "STORE_VERSION",
    "DEFAULT_KEYFRAME_EVERY",
]

_T = TypeVar("_T")
log = logging.getLogger("s4w_core.store")

#: a re-encoded step (a delta against the step above it) replaces its whole object only when it is
#: at least this much smaller; otherwise the step stays whole (deltas of far-apart or tiny states)
REENCODE_MIN_GAIN = 0.05
#: steps whose whole object is at most this large are re-encoded into memory first, so that a
#: delta that does not pay writes nothing
REENCODE_BUFFER_BYTES = 64 << 20

#: default bound on the delta chains: at most 9 deltas in a row (a load reads <= 10 containers).
DEFAULT_KEYFRAME_EVERY = 10

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


def _same_storages(
    copy: Mapping[str, Any],
    own: Mapping[str, Any],
    raws: builtins.list[torch.Tensor] | None = None,
    devices: builtins.list[str] | None = None,
    *,
    deltas: bool = False,
) -> str | None:
    """Why a re-encoded container's manifest does not stand for the step's own (None: it does):
    the same storages in the same order (path, dtype, size), none a delta unless ``deltas``, same tree, and the same
    bytes: equal checksums, or, where the two were computed with different algorithms (the
    GPU writer sums data on a device with ``fold64``, hashes host data with ``xxh3``), the
    step's own checksum verified on ``raws``, the host bytes the copy was encoded from
    (``fold64`` on ``devices[i]`` when that is a usable GPU)."""
    why = _same_layout(copy, own, deltas=deltas)
    if why is not None:
        return why
    for i, (x, y) in enumerate(zip(copy["storages"], own["storages"])):
        if x["checksum"] == y["checksum"]:
            continue
        if raws is None or str(x["checksum"]).split(":")[0] == str(y["checksum"]).split(":")[0]:
            return f"storage {i} ({x['path']!r}) holds other bytes (checksum {x['checksum']}, the step's {y['checksum']})"
        dev = devices[i] if devices is not None else "cpu"
        where = torch.device(dev) if dev.startswith("cuda") and torch.cuda.is_available() else None
        if not ck.verify_tensor_checksum(y["checksum"], raws[i], where):
            return f"storage {i} ({x['path']!r}): the host copy it was encoded from is not the step's bytes"
    return None


def _same_layout(copy: Mapping[str, Any], own: Mapping[str, Any], *, deltas: bool = False) -> str | None:
    """:func:`_same_storages` without the bytes: storages (path, dtype, size), no delta (unless
    ``deltas``), tree."""
    a, b = copy["storages"], own["storages"]
    if len(a) != len(b):
        return f"{len(a)} storages, the step has {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.get("delta") and not deltas:
            return f"storage {i} is a delta"
        if (x["path"], x["dtype"], x["nbytes"]) != (y["path"], y["dtype"], y["nbytes"]):
            return f"storage {i} ({x['path']!r}) differs"
    def table(m: Mapping[str, Any]) -> builtins.list[dict[str, Any]]:  # without a reader's own annotations
        return [{k: v for k, v in t.items() if not k.startswith("_")} for t in m["tensors"]]

    if copy["tree"] != own["tree"] or table(copy) != table(own):
        return "its tree or tensor table differs"
    return None


@dataclass
class _Reencode:
    """What re-encoding the previous newest step ``prev`` against the new one ``new`` needs:
    ``old``, the host copy of ``prev``'s bytes when the store kept one (None: decode it), and
    ``cache``, the host copy of ``new``'s, the delta base (None: decode it as the encoder asks)."""

    prev: StepInfo
    old: CachedBase | None
    new: StepInfo
    cache: CachedBase | None


class _Stale(Exception):
    """A re-encoding that no longer applies (the steps changed meanwhile, or no delta pays)."""


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


def _step_info(
    step: int,
    key: str,
    size: int,
    manifest: dict[str, Any],
    prof: str,
    base: StepInfo | None,
    extra: Mapping[str, Any] | None,
) -> StepInfo:
    """The commit record of a step whose container ``manifest`` was written to ``key``.  A delta
    against a newer ``base`` (the reverse layout) lists only its own object: its chain is found
    through ``base_step`` (:class:`Chain`); one against an older base lists its chain's objects."""
    groups, _dtypes, kinds, raw, stored, ndelta = api.summarize(manifest)
    is_delta = ndelta > 0
    assert base is not None or not is_delta
    reverse = is_delta and base is not None and base.step > step
    return StepInfo(
        step=step,
        kind="delta" if is_delta else "keyframe",
        depth=base.depth + 1 if is_delta and base is not None else 0,
        base_step=base.step if is_delta and base is not None else None,
        object=key,
        object_bytes=size,
        raw_bytes=raw,
        stored_bytes=stored,
        objects=tuple([key, *(base.objects if is_delta and base is not None and not reverse else ())]),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        profile=prof,
        kinds={k: v.as_dict() for k, v in kinds.items()},
        groups={k: v.as_dict() for k, v in groups.items()},
        extra=dict(extra or {}),
        delta_ops=_count_ops(manifest),
    )


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


_F = TypeVar("_F", bound=Callable[..., Any])


def _after_saves(fn: _F) -> _F:
    """Run ``fn`` after the store's save in flight is durable; raise its failure first."""

    @functools.wraps(fn)
    def wrapper(self: CheckpointStore, *args: Any, **kwargs: Any) -> Any:
        self.wait()
        return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the store
class CheckpointStore:
    """A run's checkpoints as a chain of compressed containers on a local directory or S3.

    Args:
        url: a local directory (the default kind; created if missing), ``file://PATH``,
            ``s3://BUCKET/PREFIX`` or ``memory://NAME`` (tests).
        keep_last: after each save keep only the newest ``keep_last`` steps (plus pinned ones);
            ``None`` keeps everything.
        pinned: steps exempt from retention (also see :meth:`pin`, which persists).
        keyframe_every: bound on the delta chains: at most ``keyframe_every - 1`` deltas in a
            row, so loading any step reads at most ``keyframe_every`` containers.  ``1``
            disables deltas.
        delta: turn each step into a delta against the next where that pays (default True).
        profile: codec profile for :func:`s4w_core.save` (``auto``/``portable``/``fast``).
        threads: CPU threads for coding.
        base_cache_bytes: host memory the store may use to keep the newest saved (or loaded)
            step's bytes: the base the step below it is re-encoded against, and the bytes the next
            save re-encodes; ``None``: no limit; ``0``: never keep them (each re-encoding then
            decodes both steps from their objects).
        region, endpoint, force_path_style, unsigned, profile_name, client_options: S3 settings
            (see :mod:`s4w_core.store._s3`); environment variables such as ``AWS_ENDPOINT_URL``
            apply when these are not given.
        progress: show tqdm progress bars on saves and loads.
        max_pending_bytes: bound on the memory a non-blocking save (:meth:`save_async`) holds
            while in flight (its snapshot, or its encoded bytes); a save that alone needs more runs
            blocking (``handle.mode == "blocking"``, with a warning).  ``None``: no bound (one
            save's worth: at most one save is in flight).
        on_busy: what a save does while the previous non-blocking save is still running:
            ``"wait"`` for it (default) or ``"error"`` (:class:`SaveInProgressError`).
        fast_tier: a second location (a local directory such as an NVMe path, or
            ``memory://NAME``) that saves commit to first; the worker then copies each step to
            ``url`` behind it, and loads read the fast tier's copy when it has one.
        fast_keep_last: steps the fast tier keeps (the newest; never one ``url`` lacks);
            ``None`` keeps all.
        keyframe_copy: ignored, with a DeprecationWarning (the newest step is always whole).
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
        max_pending_bytes: int | None = None,
        on_busy: Literal["wait", "error"] = "wait",
        fast_tier: str | os.PathLike[str] | None = None,
        fast_keep_last: int | None = 2,
        keyframe_copy: bool | None = None,
        _backend: Backend | None = None,
        _fast_backend: Backend | None = None,
    ) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if type(keyframe_every) is not int or keyframe_every < 1:
            raise ValueError(f"keyframe_every must be a positive integer, got {keyframe_every!r}")
        if profile not in api.PROFILES:
            raise ValueError(f"profile must be one of {api.PROFILES}, got {profile!r}")
        if profile != "portable":  # the GPU codec's kernels compiled before the first save needs them
            gpu.warm_up(when_cuda_used=True)
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
        self.pinned = {check_step(s) for s in pinned}
        self.keyframe_every = keyframe_every
        self.delta = delta
        if keyframe_copy is not None:
            warnings.warn(
                "CheckpointStore(keyframe_copy=...) has no effect: the newest step is always stored whole",
                DeprecationWarning,
                stacklevel=2,
            )
        self.profile = profile
        self.threads = threads
        self.base_cache_bytes = base_cache_bytes
        self.progress = progress
        self._cache: CachedBase | None = None
        self._records: dict[str, tuple[int, str | None, StepInfo]] = {}
        self._lock = threading.RLock()
        self._rec_lock = threading.RLock()  # the record caches (the worker lists too)
        self._pipe = _async.Pipeline(self.url, max_pending_bytes, on_busy)
        # a store dropped with a failure nobody saw: log it, end the worker (no reference to self)
        weakref.finalize(self, self._pipe.drain_quietly, "the store was garbage-collected").atexit = False
        self._pinned_pool = _async.PinnedPool()
        self._tiers: _tiered.Tiers | None = None
        if fast_tier is not None or _fast_backend is not None:
            fb = _fast_backend if _fast_backend is not None else open_backend(fast_tier)  # type: ignore[arg-type]
            if fb.url == self.backend.url:
                raise ValueError(f"fast_tier {fb.url!r} is the store's own location")
            self._tiers = _tiered.Tiers(fb, fast_keep_last)

    def __repr__(self) -> str:
        tier = f", fast_tier={self._tiers.fast.url!r}" if self._tiers is not None else ""
        return (
            f"CheckpointStore({self.backend.url!r}{tier}, keyframe_every={self.keyframe_every}, "
            f"keep_last={self.keep_last})"
        )

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:  # an error is already on its way: do not mask it
            try:
                self.close()
            except AsyncSaveError as e:
                log.error("s4weights: %s", e)
            return
        self.close()

    def close(self) -> None:
        """Wait for the save in flight, release clients and the cached base.

        Raises:
            AsyncSaveError: a non-blocking save (or tier upload) failed and was not yet reported;
                the store is closed all the same.
        """
        err: AsyncSaveError | None = None
        try:
            self._pipe.wait()
        except AsyncSaveError as e:
            err = e
        self._pipe.stop()
        self._cache = None
        self.backend.close()
        if self._tiers is not None:
            self._tiers.fast.close()
        if err is not None:
            raise err

    # ------------------------------------------------------------------ non-blocking saves
    def wait(self, timeout: float | None = None) -> None:
        """Wait until the save (or tier upload) in flight is durable.

        Args:
            timeout: seconds; ``None`` waits as long as it takes.
        Raises:
            AsyncSaveError: a background save or upload failed (named step; ``__cause__`` is the
                original error); raised once, later calls go on.
            TimeoutError: still running after ``timeout`` seconds.
        Example:
            >>> import torch, tempfile
            >>> from s4w_core import CheckpointStore
            >>> st = CheckpointStore(tempfile.mkdtemp())
            >>> h = st.save_async({"w": torch.ones(4)}, step=1)
            >>> st.wait(); st.steps()
            [1]
        """
        self._pipe.wait(timeout)

    def reserve(self, state: Any, *, wait: bool = False) -> None:
        """Start allocating, on a background thread, the pinned host memory that saves of
        ``state`` will use, so that the first save does not wait for it.

        A save of CUDA tensors copies them to pinned host buffers: :meth:`save_async` (mode
        ``async-pinned``) is blocked only for that copy, and both kinds of save keep the copy as
        the step's bytes (re-encoded as a delta by the next save).  The buffers are reused from the third save on, and the
        second generation is allocated in the background once the first save's copy is done;
        this call also takes the first one out of the training loop (0.2-0.4 s for a 1.82 GB
        state on an H100 host; ``benchmarks/bench_host_io.py``).  Call it once the state exists (after the
        optimizer's first step, whose state tensors it must include).  States without CUDA
        tensors need no pinned memory: a no-op.  Returns at once (``wait=True``: once the memory
        is allocated); the memory counts towards the store's host memory (at most two
        generations: twice the CUDA bytes of the state).

        Example:
            >>> import torch, tempfile
            >>> from s4w_core import CheckpointStore
            >>> st = CheckpointStore(tempfile.mkdtemp())
            >>> st.reserve({"w": torch.ones(4)})  # CPU tensors: nothing to pin
        """
        col = engine.Collector()
        encode_tree(state, col.add)
        cuda = [j.raw for j in col.jobs if j.raw.device.type == "cuda"]
        if cuda:
            self._pinned_pool.reserve([r.numel() for r in cuda], cuda[0].device, wait=wait)

    @property
    def pending_bytes(self) -> int:
        """Memory held now by the save in flight (snapshot or encoded bytes; 0 when idle)."""
        return self._pipe.pending_bytes

    @property
    def peak_pending_bytes(self) -> int:
        """The most :attr:`pending_bytes` has been since the store was opened."""
        return self._pipe.peak_pending_bytes

    @property
    def max_pending_bytes(self) -> int | None:
        return self._pipe.max_pending_bytes

    @property
    def in_flight(self) -> SaveHandle | None:
        """The handle of the save (or upload) running in the background, or None."""
        h = self._pipe.inflight
        return h if h is not None and not h.done() else None

    @property
    def fast_tier(self) -> str | None:
        """The fast tier's location, or None."""
        return self._tiers.fast.url if self._tiers is not None else None

    def sync(self) -> builtins.list[int]:
        """Copy to the slow tier (the store's URL) every step the fast tier holds and it lacks
        (e.g. after an upload failed), now, in this thread; then apply ``fast_keep_last``.

        Returns:
            The steps uploaded (ascending); ``[]`` for a store without a fast tier.
        Raises:
            StoreError: an upload failed (the fast tier keeps the step; call again later).
        """
        h = self._pipe.inflight
        if h is not None:
            h._event.wait()  # noqa: SLF001
        if self._tiers is None:
            return []
        with self._lock:
            done = _tiered.upload_missing(self)
        self._pipe.forget_failure("upload")  # retried and done: nothing left to report
        return done

    # ------------------------------------------------------------------ listing
    def _tier_records(self, backend: Backend, cache: dict[str, tuple[int, str | None, StepInfo]]) -> dict[int, StepInfo]:
        """The commit records on one backend (cached by size and version), by step, ascending."""
        objs = [o for o in backend.list(COMMITS) if STEP_RE.match(o.key[len(COMMITS) :])]
        with self._rec_lock:
            todo = [o for o in objs if o.version is None or cache.get(o.key, (None, None))[:2] != (o.size, o.version)]

            def fetch(key: str) -> tuple[str, StepInfo]:
                return key, parse_record(backend.get(key), key, backend.url)

            if todo:
                if len(todo) == 1:
                    got = [fetch(todo[0].key)]
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

    def _tier_views(self) -> tuple[dict[int, StepInfo], dict[int, StepInfo]]:
        """(fast tier's records, slow tier's records) of a tiered store."""
        assert self._tiers is not None
        return self._tier_records(self._tiers.fast, self._tiers.records), self._tier_records(self.backend, self._records)

    def _forget_record(self, backend: Backend, key: str) -> None:
        with self._rec_lock:
            (self._tiers.records if self._tiers is not None and backend is self._tiers.fast else self._records).pop(key, None)

    def _read_records(self) -> dict[int, StepInfo]:
        recs = self._tier_records(self.backend, self._records)
        pins = {
            int(m.group(1))
            for o in self.backend.list(PINS)
            if (m := STEP_RE.match(o.key[len(PINS) :]))
        }
        if self._tiers is not None:  # the union; the fast tier's record is the newer one
            fast = self._tier_records(self._tiers.fast, self._tiers.records)
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
        check_step(step)
        if step not in recs:
            near = ", ".join(str(s) for s in list(recs)[-5:]) or "none"
            raise CheckpointNotFoundError(f"{self.backend.url}: no committed step {step} (latest steps: {near})")
        return recs[step]

    def sizes(self) -> dict[str, Any]:
        """Byte totals: ``raw_bytes`` (what the steps decode to), ``stored_bytes`` (their own
        containers), ``physical_bytes`` (every data object present, including bases kept only
        for a delta, keyframe copies (``copy_bytes``) and unreferenced leftovers), ``ratio`` =
        raw / stored, per ``kinds`` totals."""
        recs = self._read_records()
        data = self.backend.list(DATA)
        live = {o for r in recs.values() for o in r.live_objects}
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
            "base_only_bytes": sum(o.size for o in data if o.key in live and o.key not in own and o.key not in copies),
            "copy_bytes": sum(o.size for o in data if o.key in copies),
            "unreferenced_bytes": sum(o.size for o in data if o.key not in live),
            "kinds": kinds,
        }

    # ------------------------------------------------------------------ reading
    def _open(self, key: str, *, whole: bool, expect: int | None = None, what: str = "") -> ContainerReader:
        rr: RangeReader | None = None
        if self._tiers is not None:  # the fast tier's copy when it has one
            fast = self._tiers.fast
            try:
                rr = fast.fetch(key) if whole else fast.open_range(key)
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
            reader = ContainerReader(rr.read, rr.size, rr.name, readinto=rr.readinto)
            api.open_reader(reader)  # validates the manifest
        except BaseException:
            rr.close()
            raise
        reader._fp = _Closer(rr.close)  # type: ignore[assignment]  # noqa: SLF001
        return reader

    @_after_saves
    def load(
        self,
        step: int | None = None,
        map_location: api.MapLocation = None,
        *,
        threads: int | None = None,
        from_copy: bool = True,
    ) -> Any:
        """Load ``step`` (default: the latest committed) bit for bit.

        Args:
            step: the step to load; ``None`` for the newest committed one.
            map_location: as for :func:`s4w_core.load`.
            threads: CPU threads for decoding.
            from_copy: read the step's keyframe copy when it has one (one object); ``False``
                reads its chain (to measure or check it).  A copy that is missing or corrupt is
                skipped for the chain (a corrupt one with a warning).
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
        from s4w_core import obs

        t0 = time.perf_counter()
        timer = obs.StageTimer()
        rec: StepInfo | None = None
        try:
            with timer.stage("list"):
                recs = self._read_records()
                rec = self._record(step, recs)
            remember = rec.step == max(recs) and self._caching()  # the next save re-encodes it
            own = None  # a step read from its copy is remembered under its own container's manifest
            if remember and from_copy and rec.copy is not None:
                own = _background(self._own_manifest_of, rec)
            fills: builtins.list[_async.HostFill] = []
            try:
                with timer.stage("decode"):  # reads and decodes the step and the bases its deltas need
                    used: builtins.list[str] = []
                    obj, raws, reader = self._load_record(
                        rec, map_location, threads, reserve=remember, source="auto" if from_copy else "chain",
                        used=used, fills=fills, recs=recs,
                    )
                if remember:
                    with timer.stage("cache"):
                        if used != [rec.copy]:
                            manifest: Mapping[str, Any] | None = reader.manifest
                        else:
                            m = own.result() if own is not None else self._own_manifest_of(rec)
                            manifest = m if m is not None and _same_layout(reader.manifest, m) is None else None
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
        map_location: api.MapLocation,
        threads: int | None,
        *,
        reserve: bool = False,
        source: Literal["auto", "chain", "copy"] = "auto",
        used: builtins.list[str] | None = None,
        fills: builtins.list[_async.HostFill] | None = None,
        recs: Mapping[int, StepInfo] | None = None,
    ) -> tuple[Any, builtins.list[torch.Tensor], ContainerReader]:
        """Read and decode one step.  ``reserve``: the step will be remembered as the next base
        (:meth:`_remember`): its pinned buffers are allocated in the background while it loads,
        and CUDA storages are copied into them batch by batch (:class:`_async.HostFill`, appended
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
        map_location: api.MapLocation,
        threads: int | None,
        *,
        reserve: bool = False,
        fills: builtins.list[_async.HostFill] | None = None,
        recs: Mapping[int, StepInfo] | None = None,
    ) -> tuple[Any, builtins.list[torch.Tensor], ContainerReader]:
        """Decode step ``rec`` from data object ``key``: its own container, or its keyframe copy
        (which must hold no delta)."""
        ctx = Chain(self._open, self.backend.url, rec, threads, recs if recs is not None else self._read_records())
        prog = _Progress(self.progress, f"load step {rec.step}")
        fill: _async.HostFill | None = None
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
            if prog.bar is not None:
                read = reader._read  # noqa: SLF001

                def counted(o: int, n: int) -> bytes:
                    b = read(o, n)
                    prog.update(len(b))
                    return b

                reader._read = counted  # noqa: SLF001
            ctx.prefetch(reader.manifest["storages"], chain_device(reader.manifest, map_location))
            raws = api._decode_storages(reader, map_location, threads, ctx.resolve, fill)  # noqa: SLF001
            m = reader.manifest
            obj = decode_tree(m["tree"], api._build_tensors(m, raws))  # noqa: SLF001
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
        the caller checks that the two line up with :func:`_same_layout`). None (the next save
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
            why = _same_layout(copy, own) or next(
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
        d["path"] = reader.name if self._tiers is not None else self.backend.describe(rec.object)
        return d

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
                if mode == "async-gpu" and api._resolve_profile(self.profile, col.jobs) == "fast":  # noqa: SLF001
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
                        raws = _async.host_copies([j.raw for j in col.jobs], self._pinned_pool, ahead=self._caching())
                        for j, r in zip(col.jobs, raws):
                            j.raw = r
                        state = api.Collected(col, tree, "fast")
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
                handle.blocked_s = time.perf_counter() - handle._t0  # noqa: SLF001
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
            handle.blocked_s = time.perf_counter() - handle._t0  # noqa: SLF001
            job = functools.partial(
                self._background_save, handle, state if pre is None else None, step, extra, keyframe, overwrite, pre
            )
            del state
            self._pipe.submit(handle, job, hold)
            return handle

    def _begin(self, handle: SaveHandle) -> None:
        waited = self._pipe.begin()
        if waited:
            handle.waited_s = waited
            handle.stages["wait"] = waited

    def _known_committed(self, step: int) -> bool:
        """Is ``step`` committed?  Asks the backend only when the record caches say so (a cheap
        check for the caller's thread; the worker checks again before it commits)."""
        key = commit_key(step)
        with self._rec_lock:
            cached = key in self._records or (self._tiers is not None and key in self._tiers.records)
        return cached and step in self._read_records()

    def _save_blocking(
        self, handle: SaveHandle, state: Any, step: int, extra: Mapping[str, Any] | None, keyframe: bool, overwrite: bool
    ) -> StepInfo:
        """The save in the caller's thread; with a fast tier, the upload then runs behind (and a
        re-encoding of the step below behind that)."""
        todo: builtins.list[_Reencode] = []
        try:
            info = self._save_locked(state, step, extra, keyframe, overwrite, handle.stages, reencode_out=todo)
        except BaseException as e:
            handle.blocked_s = time.perf_counter() - handle._t0  # noqa: SLF001
            handle._finish(None, e)  # noqa: SLF001
            handle._observed = True  # noqa: SLF001 - raised to the caller right here
            self._record_save(handle, None, e)
            raise
        handle.blocked_s = time.perf_counter() - handle._t0  # noqa: SLF001
        if self._tiers is None:
            handle._finish(info, None)  # noqa: SLF001
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
        assert self._tiers is not None
        t = time.perf_counter()
        try:
            with self._lock:
                _tiered.upload_missing(self)
        except BaseException:
            handle.what = f"upload to {self.backend.url}"
            handle.hint = (
                f"it is committed on the fast tier {self._tiers.fast.url}; store.sync() or the next save retries"
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
        todo: builtins.list[_Reencode] = []
        try:
            info = self._save_locked(
                state, step, extra, keyframe, overwrite, handle.stages, owned=True, pre=pre, reencode_out=todo
            )
            del state
            if self._tiers is not None:
                self._upload(handle)
        except BaseException as e:
            self._record_save(handle, info, e)
            raise
        self._record_save(handle, info)
        self._schedule_reencode(todo)  # runs on this worker once this save's handle is done
        return info

    def _record_save(self, handle: SaveHandle, info: StepInfo | None, error: BaseException | None = None) -> None:
        """One observability event per save, once it is durable (or failed)."""
        total = time.perf_counter() - handle._t0  # noqa: SLF001
        extra: dict[str, Any] = {"waited_s": round(handle.waited_s, 6)} if handle.waited_s else {}
        if info is not None:
            extra.update(depth=info.depth, profile=info.profile)
        if handle.device_bytes:
            extra["device_bytes"] = handle.device_bytes
        if self._tiers is not None:
            extra["fast_tier"] = self._tiers.fast.url
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
                mode=handle.mode + ("+tiered" if self._tiers is not None else ""),
                host_bytes=handle.host_bytes,
                ok=error is None,
                error=None if error is None else f"{type(error).__name__}: {error}",
                extra=extra,
            )
        )

    # ------------------------------------------------------------------ re-encoding (reverse deltas)
    def _schedule_reencode(self, todo: builtins.list[_Reencode]) -> None:
        """Start the re-encoding ``_save`` asked for, on the worker, behind what is queued.  The
        next save waits for it (it is not cancelled: a step left whole would stay whole)."""
        if not todo:
            return
        job = todo[0]
        handle = SaveHandle(job.prev.step, "reencode", self.backend.url, what="re-encoding")
        self._pipe.defer(handle, functools.partial(self._reencode, handle, job))

    def _recs_on(self, backend: Backend) -> dict[int, StepInfo]:
        """The commit records on one tier (the store's own backend or the fast tier)."""
        fast = self._tiers is not None and backend is self._tiers.fast
        return self._tier_records(backend, self._tiers.records if fast and self._tiers is not None else self._records)

    def _put_record(self, backend: Backend, info: StepInfo, *, replace: bool) -> None:
        body = json.dumps(info.record(), separators=(",", ":"), sort_keys=True).encode()  # noqa: SLF001
        backend.put(commit_key(info.step), body, if_absent=not replace)
        self._forget_record(backend, commit_key(info.step))

    def _drop_copies(self) -> None:
        """Remove the keyframe copies a store of the first layout kept for its newest step (the
        record first, then the object, on each tier): the newest step is now whole.  Caller
        holds ``self._lock``."""
        backends = [self.backend] + ([self._tiers.fast] if self._tiers is not None else [])
        freed: set[str] = set()
        for b in backends:
            for r in self._recs_on(b).values():
                if r.copy is not None:
                    self._put_record(b, replace_record(r, copy=None, copy_bytes=0), replace=True)
                    freed.add(r.copy)
        if freed:
            self._reclaim(freed)

    def _reencode_target(self, step: int, recs: Mapping[int, StepInfo]) -> StepInfo | None:
        """The step a save of the new newest ``step`` turns into a delta against it: the step
        just below, when it is whole, not pinned, and not the whole step that bounds the chains
        below it (``keyframe_every``: at most ``keyframe_every - 1`` deltas in a row)."""
        if not self._caching() or any(s > step for s in recs):  # (an overwritten newest step: again)
            return None
        below = sorted((s for s in recs if s < step), reverse=True)
        if not below:
            return None
        prev = recs[below[0]]
        if prev.kind != "keyframe" or prev.pinned:
            return None
        run, above = 0, prev.step
        for s in below[1:]:
            r = recs[s]
            if not (r.reverse and r.base_step == above):
                break
            run, above = run + 1, s
        return prev if run + 1 < self.keyframe_every else None

    def _reencode(self, handle: SaveHandle, job: _Reencode) -> None:
        """Turn the whole step ``job.prev`` into a delta against the newer whole step
        ``job.new``: encode it against ``job.new``'s bytes (the host copy kept as the cache),
        write a new data object, check that it stands for the step (same storages, same bytes),
        rewrite the step's commit record to point at it (the commit point), then remove the old
        whole object.  A crash leaves the step whole (and an unreferenced object for ``gc()``)
        or re-encoded (and the old object unreferenced); it loads bit-exactly either way.  Runs
        on the worker after the save; a failure is logged, never raised (the step stays whole)."""
        prev, new, cache = job.prev, job.new, job.cache
        backend = self._home(prev.step)
        t0 = time.perf_counter()
        key: str | None = None
        size = 0
        outcome = "written"
        error: str | None = None
        try:
            with self._lock:
                recs = self._read_records()
                if not self._still(backend, recs, prev, new):
                    raise _Stale
            t = time.perf_counter()
            own: Mapping[str, Any] | None = None
            devices: builtins.list[str] | None = None
            state = job.old.collected(prev.profile) if job.old is not None else None
            if state is not None and job.old is not None:
                raws = job.old.raws
                devices = [d for _, _, d in job.old.source[2]] if job.old.source is not None else None
                own = self._own_manifest_of(prev)
                if own is None:
                    raise StoreError(f"cannot read the manifest of step {prev.step}")
            else:  # no host copy of it: decode it (one whole object)
                state, raws, own = self._decoded(prev, recs)
            handle.stages["read"] = time.perf_counter() - t
            provider = BaseProvider(
                self._open, self.backend.url, new, recs, self.threads, cache if cache is not None else self._cache
            )
            t = time.perf_counter()
            # a step small enough is coded into memory first and written only if the delta pays
            # (nothing written for nothing); a larger one is streamed to its object, removed if not
            buffered: io.BytesIO | None = io.BytesIO() if prev.object_bytes <= REENCODE_BUFFER_BYTES else None
            if buffered is not None:
                m, size, prof = self._encode_into(state, buffered, provider, prev.step, prev.extra)
            else:
                key = data_key(prev.step)
                with backend.writer(key) as f:
                    m, size, prof = self._encode_into(state, f, provider, prev.step, prev.extra)
            handle.stages["encode"] = time.perf_counter() - t
            del state
            t = time.perf_counter()
            why = _same_storages(m, own, raws, devices, deltas=True)
            handle.stages["check"] = time.perf_counter() - t
            if why is not None:
                raise StoreError(f"the re-encoded step {prev.step} does not stand for it: {why}")
            if not any(e.get("delta") for e in m["storages"]) or size > prev.object_bytes * (1.0 - REENCODE_MIN_GAIN):
                raise _Stale  # the delta does not pay: the step stays whole
            if buffered is not None:
                t = time.perf_counter()
                key = data_key(prev.step)
                with backend.writer(key) as f:
                    f.write(buffered.getbuffer())
                del buffered
                handle.stages["write"] = time.perf_counter() - t
            t = time.perf_counter()
            with self._lock:
                recs = self._read_records()
                if not self._still(backend, recs, prev, new):
                    raise _Stale  # deleted, replaced or overtaken meanwhile
                assert key is not None  # written above
                info = replace_record(_step_info(prev.step, key, size, m, prof, recs[new.step], prev.extra), created=prev.created)
                self._put_record(backend, info, replace=True)  # the commit point
                key = None  # the record owns it now
                if self._tiers is not None:
                    _tiered.upload_missing(self)
                self._reclaim(prev.live_objects)
            handle.stages["commit"] = time.perf_counter() - t
        except _Stale:
            outcome = "skipped"
        except BaseException as e:  # noqa: BLE001 - logged; the step itself is intact
            # only the text: the exception's frames would keep this store alive (a cycle)
            error, outcome = f"{type(e).__name__}: {e}", "failed"
            log.warning(
                "s4weights: re-encoding step %d of %s as a delta against step %d failed (%s); it stays whole",
                prev.step, backend.url, new.step, error,
            )
        finally:
            self._unpool(job.old)
            if key is not None:
                try:
                    backend.delete(key)
                except S4WError:
                    pass  # gc() reclaims it
            total = time.perf_counter() - t0
            obs.record(
                obs.OpEvent(
                    op="reencode",
                    url=self.backend.url,
                    step=prev.step,
                    raw_bytes=prev.raw_bytes if outcome == "written" else 0,
                    stored_bytes=size if outcome == "written" else 0,
                    blocked_s=0.0,
                    total_s=total,
                    stages=dict(handle.stages),
                    kind="delta",
                    mode="background",
                    ok=error is None,
                    error=error,
                    extra={"outcome": outcome, "base_step": new.step},
                )
            )
            handle.mode = outcome

    def _home(self, step: int) -> Backend:
        """Where a re-coded ``step`` is written: the fast tier while it holds the step (the
        upload behind it copies it on), else the store's own location."""
        if self._tiers is not None and step in self._recs_on(self._tiers.fast):
            return self._tiers.fast
        return self.backend

    def _still(self, backend: Backend, recs: Mapping[int, StepInfo], prev: StepInfo, new: StepInfo) -> bool:
        """Are ``prev`` (whole, on ``backend``) and ``new`` (in ``recs``) as they were when the
        re-encoding was planned, and is ``new`` the step just above ``prev``?"""
        p, n = self._recs_on(backend).get(prev.step), recs.get(new.step)
        if self._tiers is not None and backend is self.backend and (n is None or "slow" not in n.tiers):
            return False  # its base is not on the slow tier yet (an upload failed): later
        return (
            p is not None and n is not None and p.object == prev.object and p.kind == "keyframe"
            and n.object == new.object and not any(prev.step < s < new.step for s in recs)
        )

    def _decoded(self, rec: StepInfo, recs: Mapping[int, StepInfo]) -> tuple[Any, builtins.list[torch.Tensor], Mapping[str, Any]]:
        """Step ``rec`` decoded to host memory, as a state to re-encode (its storages with the
        devices, tree and tensor table its manifest records, so the re-encoded container restores
        where the original did), its raw storages and its manifest."""
        obj, raws, reader = self._load_record(rec, "cpu", self.threads, source="chain", recs=recs)
        manifest = reader.manifest
        src = source_of_manifest(manifest)
        if src is not None and len(src[2]) == len(raws):
            col = engine.Collector(
                tensors=src[1], jobs=[engine.StorageJob(r, dt, p, d) for r, (dt, p, d) in zip(raws, src[2])]
            )
            return api.Collected(col, src[0], rec.profile if rec.profile in ("portable", "fast") else self.profile), raws, manifest
        return obj, raws, manifest

    def _recode(self, rec: StepInfo, state: Any, base: StepInfo | None, recs: Mapping[int, StepInfo]) -> StepInfo:
        """Write ``state`` (the bytes of step ``rec``) as a new data object coded against
        ``base`` (None: whole) and rewrite the step's commit record to it.  Caller holds the lock
        and reclaims the old object."""
        backend = self._home(rec.step)
        provider = (
            BaseProvider(self._open, self.backend.url, base, recs, self.threads, self._cache) if base is not None else None
        )
        key = data_key(rec.step)
        try:
            with backend.writer(key) as f:
                m, size, prof = self._encode_into(state, f, provider, rec.step, rec.extra)
            info = replace_record(_step_info(rec.step, key, size, m, prof, base, rec.extra), created=rec.created)
            self._put_record(backend, info, replace=True)
        except BaseException:
            try:
                backend.delete(key)
            except S4WError:
                pass  # gc() reclaims it
            raise
        if self._tiers is not None:
            _tiered.upload_missing(self)
        return info

    def _detach(self, step: int, recs: dict[int, StepInfo]) -> dict[int, StepInfo]:
        """Before ``step`` is deleted or replaced: re-code every reverse delta against it (the
        step just below) against the nearest step above ``step`` (the two deltas merged, or a
        delta against the whole step that follows), or whole when there is none, the dependent is
        pinned, or the chains through it would grow beyond ``keyframe_every - 1`` deltas.
        Returns the records after.  Caller holds the lock."""
        for d in [r for r in recs.values() if r.reverse and r.base_step == step]:
            above = [s for s in recs if s > step]
            base = recs[min(above)] if above and not d.pinned else None
            if base is not None:
                below, s = 0, d.step  # the deltas below ``d`` whose chains pass through it
                for r in sorted((r for r in recs.values() if r.step < d.step), key=lambda r: -r.step):
                    if not (r.reverse and r.base_step == s):
                        break
                    below, s = below + 1, r.step
                if below + base.depth + 1 >= self.keyframe_every:
                    base = None
            state, _, _ = self._decoded(d, recs)
            self._recode(d, state, base, recs)
            del state
            recs = self._read_records()
        return recs

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
        reencode_out: builtins.list[_Reencode] | None = None,
    ) -> StepInfo:
        """Encode (unless ``pre``), write and commit ``step``, then retention; under the lock."""
        with self._lock:
            recs = self._read_records()
            if step in recs and not overwrite:
                raise ConflictError(
                    f"{self.backend.url}: step {step} is already committed; delete it first or pass overwrite=True"
                )
            before: set[str] = set()
            if step in recs:  # replaced: the step below it must not stay a delta against its old bytes
                before = self._all_objects()
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
                self._reclaim(before | set(recs[step].live_objects))
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

    def _caching(self) -> bool:
        return self.delta and self.keyframe_every > 1

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
            if step in recs and not overwrite:
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
                raws = _async.host_copies([j.raw for j in col.jobs], self._pinned_pool)
                cache = self._make_cache(step, key, manifest, raws, copy=False, pooled=True, source=state_source(tree, col))
                handle.stages["cache"] = time.perf_counter() - t
            return _PreEncoded(base, key, manifest, size, prof, buf, cache)

    def _encode_into(
        self, state: Any, fp: Any, provider: BaseProvider | None, step: int, extra: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any], int, str]:
        """:func:`api._encode` of ``state`` into ``fp`` against ``provider``'s base (closed after)."""
        try:
            return api._encode(  # noqa: SLF001
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
        reencode_out: builtins.list[_Reencode] | None = None,
    ) -> StepInfo:
        """Write and commit one step to the fast tier (if any) or the store.  ``pre``: already
        encoded (``async-gpu``); ``owned``: ``state`` is a snapshot nobody else holds, so its
        storages become the cached base without a copy.  ``reencode_out``: gets what turning the
        step below it into a delta against it needs, when it is the new newest step and that
        step is due (:meth:`_reencode_target`; :meth:`_schedule_reencode` starts it)."""
        stages = {} if stages is None else stages
        backend = self._tiers.fast if self._tiers is not None else self.backend
        prog = _Progress(self.progress, f"save step {step}")
        try:
            if pre is None:
                base, provider = self._plan(step, recs, keyframe)
                key = data_key(step)
                t = time.perf_counter()
                with backend.writer(key) as f:
                    cw = _CountingWriter(f, prog, backend.describe(key))
                    manifest, size, prof = self._encode_into(state, cw, provider, step, extra)
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
                    pre.buf.write_to(_CountingWriter(f, prog, backend.describe(key)))
                stages["write"] = time.perf_counter() - t
        except BaseException:
            if pre is not None:
                self._unpool(pre.cache)
            raise
        finally:
            prog.close()
        info = _step_info(step, key, size, manifest, prof, base, extra)
        body = json.dumps(info.record(), separators=(",", ":"), sort_keys=True).encode()  # noqa: SLF001
        t = time.perf_counter()
        try:
            backend.put(commit_key(step), body, if_absent=not replace)  # the commit point
            self._forget_record(backend, commit_key(step))
        except BaseException:
            # the data object is unreferenced: remove it (best effort; gc() would too)
            try:
                backend.delete(key)
            except S4WError:
                pass
            if pre is not None:
                self._unpool(pre.cache)
            raise
        stages["commit"] = time.perf_counter() - t
        # this step's bytes become the cache: the base the step below is re-encoded against now,
        # and the bytes of this step when the next save re-encodes it
        old, self._cache = self._cache, None
        prev = self._reencode_target(step, recs) if reencode_out is not None else None
        if prev is None or old is None or old.step != prev.step or old.object != prev.object or old.source is None:
            self._unpool(old)
            old = None
        if not self._caching() and isinstance(state, api.Collected):  # its pinned buffers, for the next save
            self._pinned_pool.give([j.raw for j in state.col.jobs])
        if self._caching():
            t = time.perf_counter()
            if pre is not None:
                self._cache = pre.cache
            elif isinstance(state, api.Collected):  # an async-pinned snapshot: its buffers
                raws = [j.raw for j in state.col.jobs]
                self._cache = self._make_cache(
                    info.step, info.object, manifest, raws, copy=False, pooled=True, source=state_source(state.tree, state.col)
                )
                if self._cache is None:
                    self._pinned_pool.give(raws)
            else:
                col = engine.Collector()
                tree = encode_tree(state, col.add)
                self._cache = self._base_copies(
                    info.step, info.object, manifest, [j.raw for j in col.jobs], copy=not owned, source=state_source(tree, col)
                )
            stages["cache"] = stages.get("cache", 0.0) + time.perf_counter() - t
        cache = self._cache
        if prev is not None and reencode_out is not None:
            reencode_out.append(_Reencode(prev, old, info, cache if cache is not None and cache.step == step else None))
        else:
            self._unpool(old)
        return info

    def _unpool(self, cache: CachedBase | None) -> None:
        """Give a pooled cache's pinned buffers back for the next GPU save's copy."""
        if cache is not None and cache.pooled:
            self._pinned_pool.give(cache.raws or [t for t, _, _ in cache.storages.values()])

    def _make_cache(
        self,
        step: int,
        obj: str,
        manifest: Mapping[str, Any],
        raws: builtins.list[torch.Tensor],
        *,
        copy: bool = True,
        pooled: bool = False,
        source: Any = None,
    ) -> CachedBase | None:
        """Host copies of a step's storages by path (None beyond ``base_cache_bytes``); with
        ``copy=False`` CPU ``raws`` are kept as they are (a snapshot, or pinned copies).
        ``source``: :func:`state_source` of the state, kept for a keyframe copy."""
        total = sum(r.numel() for r in raws)
        if self.base_cache_bytes is not None and total > self.base_cache_bytes:
            return None
        storages: dict[str, tuple[torch.Tensor, dict[str, Any], str]] = {}
        hosts: builtins.list[torch.Tensor] = []
        for i, (s, raw) in enumerate(zip(manifest["storages"], raws)):
            t = raw.detach() if not copy and raw.device.type == "cpu" else raw.detach().to("cpu", copy=True)
            hosts.append(t.view(-1))
            if s["path"] in storages or raw.numel() != s["nbytes"]:
                continue
            ref = {"object": obj, "storage": i, "checksum": s["checksum"]}
            storages[s["path"]] = (t.view(-1), ref, s["dtype"])
        return CachedBase(step, obj, storages, total, pooled, hosts, source)

    def _remember(
        self,
        rec: StepInfo,
        manifest: Mapping[str, Any],
        raws: builtins.list[torch.Tensor],
        fill: _async.HostFill | None = None,
    ) -> None:
        """Keep copies of a committed step's storages (within ``base_cache_bytes``), the bytes the
        next save re-encodes (see :meth:`_base_copies`); ``fill``: the load's copies, made while
        it loaded."""
        old, self._cache = self._cache, None
        self._unpool(old)
        hosts = fill.finish(raws) if fill is not None else None
        source = source_of_manifest(manifest)
        if hosts is not None:
            self._cache = self._make_cache(rec.step, rec.object, manifest, hosts, copy=False, pooled=True, source=source)
        else:
            self._cache = self._base_copies(rec.step, rec.object, manifest, raws, copy=True, source=source)

    def _reserve_base(self, manifest: Mapping[str, Any], map_location: api.MapLocation) -> _async.HostFill | None:
        """For a step that loads onto a GPU: start allocating the pinned buffers that will hold
        it as the next base (one per CUDA storage; a store that saved already has its
        generations), so that the allocation runs while the step is read and decoded instead of
        after it, and the :class:`_async.HostFill` that copies each decoded batch into them
        (None: the step loads onto no GPU or onto several, is larger than ``base_cache_bytes``,
        or the store's pinned buffers are all in use; :meth:`_base_copies` then makes the copies
        after the load)."""
        try:
            devs = [api._target_device(s["device"], map_location) for s in manifest["storages"]]  # noqa: SLF001
            sizes = {i: int(s["nbytes"]) for i, (s, d) in enumerate(zip(manifest["storages"], devs)) if d.type == "cuda"}
            total = sum(int(s["nbytes"]) for s in manifest["storages"])
            gpus = {torch.device("cuda", devs[i].index if devs[i].index is not None else torch.cuda.current_device()) for i in sizes}
        except Exception:  # noqa: BLE001 - the load itself reports what is wrong with the manifest
            return None
        if not sizes or len(gpus) != 1 or (self.base_cache_bytes is not None and total > self.base_cache_bytes):
            return None
        device = next(iter(gpus))
        pool = self._pinned_pool
        if pool.live_bytes == 0:
            pool.reserve(list(sizes.values()), device)
        elif pool.free_bytes < sum(sizes.values()):
            # the store's generations are in use (the base of its own last save): copying during
            # the load would allocate one more; after it, the old base's buffers are reused
            return None
        return _async.HostFill(pool, sizes, device)

    def _base_copies(
        self,
        step: int,
        obj: str,
        manifest: Mapping[str, Any],
        raws: builtins.list[torch.Tensor],
        *,
        copy: bool,
        source: Any = None,
    ) -> CachedBase | None:
        """:meth:`_make_cache` of a step's storages; CUDA ones go to the pinned pool's buffers
        (one synchronize, one reused generation: the previous cache was given back first), which
        are ~5x faster to fill than pageable copies and to stage for the next save."""
        if any(r.device.type == "cuda" for r in raws) and (
            self.base_cache_bytes is None or sum(r.numel() for r in raws) <= self.base_cache_bytes
        ):
            hosts = _async.host_copies(raws, self._pinned_pool, ahead=False)
            return self._make_cache(step, obj, manifest, hosts, copy=False, pooled=True, source=source)
        return self._make_cache(step, obj, manifest, raws, copy=copy, source=source)

    # ------------------------------------------------------------------ pins, retention, deletion
    def pin(self, step: int) -> None:
        """Exempt ``step`` from retention (persisted as a marker object)."""
        self._record(check_step(step), self._read_records())
        self.backend.put(pin_key(step), b"")

    def unpin(self, step: int) -> None:
        self.backend.delete(pin_key(check_step(step)))
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
        """Delete ``step``: it disappears from listings at once and its data is reclaimed.  The
        step just below it, when it is a delta against ``step``, is first re-coded against the
        nearest step above ``step`` (or whole: when there is none, it is pinned, or the chain
        bound says so); deleting the oldest step (nothing depends on it) re-codes nothing.

        Args:
            step: a committed step.
            rebase: for stores written by the first layout (forward deltas): first re-code, as
                whole steps, the kept steps whose chain runs through ``step``, so that its data is
                reclaimed now instead of when those deltas go.
        Raises:
            CheckpointNotFoundError: no such step.
        """
        step = check_step(step)
        if rebase:  # re-coding steps: let a save in flight and the re-encoding behind it land
            self._pipe.settle()
        with self._lock:
            recs = self._read_records()
            rec = self._record(step, recs)
            before = self._all_objects()
            recs = self._detach(step, recs)
            if rebase:
                rebased = False
                for s in sorted(recs):
                    if s != step and rec.object in recs[s].objects[1:]:
                        self._rebase(s, exclude=step)
                        recs = self._read_records()
                        rebased = True
                if rebased and self._tiers is not None:  # the slow tier's records still name ``step``'s data
                    _tiered.upload_missing(self)
            if self._tiers is not None:
                self._tiers.fast.delete(commit_key(step))
                self._forget_record(self._tiers.fast, commit_key(step))
            self.backend.delete(commit_key(step))  # the step is gone from here on
            self.backend.delete(pin_key(step))
            self.pinned.discard(step)
            if self._cache is not None and self._cache.step == step:
                self._cache = None
            self._forget_record(self.backend, commit_key(step))
            self._reclaim(before)

    def _all_objects(self) -> set[str]:
        """Every data object some commit record (on either tier) lists."""
        if self._tiers is None:
            return {o for r in self._tier_records(self.backend, self._records).values() for o in r.live_objects}
        fast, slow = self._tier_views()
        return {o for recs in (fast, slow) for r in recs.values() for o in r.live_objects}

    def _reclaim(self, candidates: Iterable[str]) -> None:
        """Delete those of ``candidates`` (data objects once committed) no commit needs now.  With
        a fast tier: on the slow tier, an object stays while a record on either tier lists it (a
        step still to upload needs its bases); on the fast tier, while a fast record lists it."""
        cands = set(candidates)
        if self._tiers is None:
            live = self._all_objects()
            for o in sorted(cands - live):
                self.backend.delete(o)
            return
        fast, _ = self._tier_views()
        live_fast = {o for r in fast.values() for o in r.live_objects}
        for o in sorted(cands - self._all_objects()):
            self.backend.delete(o)
        for o in sorted(cands - live_fast):
            self._tiers.fast.delete(o)

    def _rebase(self, step: int, *, exclude: int) -> StepInfo:
        """Re-code ``step`` (a forward delta whose chain runs through ``exclude``) whole."""
        recs = self._read_records()
        state, _, _ = self._decoded(recs[step], recs)
        return self._recode(recs[step], state, None, recs)

    def gc(self, *, grace_seconds: float = 3600.0) -> int:
        """Delete data objects no commit record needs and leftovers of crashed writers older than
        ``grace_seconds`` (younger ones may belong to a save in progress). Returns bytes freed.
        With a fast tier, both tiers (see :meth:`_reclaim` for what is live where).  This store's
        own save in flight and the re-encoding behind it are waited for first (their objects
        are unreferenced until they commit, whatever ``grace_seconds`` says)."""
        self._pipe.settle()
        recs = self._read_records()
        places: builtins.list[tuple[Backend, set[str]]] = [(self.backend, self._all_objects())]
        if self._tiers is not None:
            fast, _ = self._tier_views()
            places.append((self._tiers.fast, {o for r in fast.values() for o in r.live_objects}))
        now = time.time()
        freed = 0
        for backend, live in places:
            for o in backend.list(DATA):
                if o.key in live:
                    continue
                if o.mtime is not None and now - o.mtime < grace_seconds:
                    continue
                backend.delete(o.key)
                freed += o.size
            tmps = getattr(backend, "list_temporaries", None)
            if tmps is not None:
                for o in tmps():
                    if o.mtime is not None and now - o.mtime >= grace_seconds:
                        backend.delete(o.key)
        pins = self.backend.list(PINS)
        for o in pins:
            m = STEP_RE.match(o.key[len(PINS) :])
            if m and int(m.group(1)) not in recs:
                self.backend.delete(o.key)
        return freed


def _count_ops(manifest: Mapping[str, Any]) -> dict[str, int]:
    ops: dict[str, int] = {}
    for s in manifest["storages"]:
        if s.get("delta"):
            ops[s["delta"]["op"]] = ops.get(s["delta"]["op"], 0) + 1
    return ops


class _Closer:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.close = fn



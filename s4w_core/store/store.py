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

Commit protocol (docs/STORE.md, "Commit protocol"): write a data object (atomic: temp + fsync +
rename locally, a completed multipart upload on S3), then write or rewrite the commit record
(atomic), and only then remove what no record needs.  A crash leaves every committed step loadable and at most
unreferenced objects, which :meth:`CheckpointStore.gc` reclaims.

Non-blocking saves (:meth:`CheckpointStore.save_async`, :mod:`s4w_core.store._async`): the caller
waits only until the state is safe to modify; one worker thread per store encodes, writes and
commits, one save at a time, and re-encodes behind it.  Tiers (``fast_tier=``,
:mod:`s4w_core.store._tiered`): a save commits to the fast tier, then the worker copies it on.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import warnings
import weakref
from typing import Any, Iterable, Literal, Mapping

from s4w_core import engine, gpu, pipeline
from s4w_core.errors import AsyncSaveError
from s4w_core.hostmem import PinnedPool
from s4w_core.skeleton import encode_tree
from s4w_core.store import _async, _tiered
from s4w_core.store._async import SaveHandle
from s4w_core.store._backend import Backend
from s4w_core.store.backends import open_backend
from s4w_core.store.chain import CachedBase
from s4w_core.store.records import STORE_FORMAT, STORE_VERSION, StepInfo, check_step
from s4w_core.store.writes import Writes

log = logging.getLogger("s4w_core.store")

__all__ = [
    "CheckpointStore",
    "StepInfo",
    "SaveHandle",
    "open_backend",
    "STORE_FORMAT",
    "STORE_VERSION",
    "DEFAULT_KEYFRAME_EVERY",
]

#: default bound on the delta chains: at most 9 deltas in a row (a load reads <= 10 containers).
DEFAULT_KEYFRAME_EVERY = 10


class CheckpointStore(Writes):
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
        durable: a save returns (or, non-blocking, completes) only once its bytes are on disk:
            every object and commit record fsynced, then renamed into place (default True).
            ``False`` keeps the temporary files and renames but drops the fsyncs, the durability
            of ``torch.save`` and of the frameworks' own checkpoints (their bytes left in the page
            cache): a process that dies still leaves a consistent store, but a power loss or an
            OS crash can lose the newest steps -- and a step below them re-encoded as a delta
            against them (a lost step fails its checksums when read, never reads as other bytes).
            Local directories only: an S3 object is durable once written.
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
        durable: bool = True,
        _backend: Backend | None = None,
        _fast_backend: Backend | None = None,
    ) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if type(keyframe_every) is not int or keyframe_every < 1:
            raise ValueError(f"keyframe_every must be a positive integer, got {keyframe_every!r}")
        if profile not in pipeline.PROFILES:
            raise ValueError(f"profile must be one of {pipeline.PROFILES}, got {profile!r}")
        if type(durable) is not bool:
            raise ValueError(f"durable must be True or False, got {durable!r}")
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
                self.backend = open_backend(self.url, durable=durable, **s3opts)
        self.durable = durable
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
        #: steps a caller said it deletes soon (:meth:`drop_pending`): never re-encoded
        self._dropped: set[int] = set()
        #: steps a caller said it deletes once a later save is durable (:meth:`expect_drop`)
        self._expected: set[int] = set()
        # a store dropped with a failure nobody saw: log it, end the worker (no reference to self)
        weakref.finalize(self, self._pipe.drain_quietly, "the store was garbage-collected").atexit = False
        self._pinned_pool = PinnedPool()
        self.tiers: _tiered.Tiers | None = None
        if fast_tier is not None or _fast_backend is not None:
            fb = _fast_backend if _fast_backend is not None else open_backend(fast_tier, durable=durable)  # type: ignore[arg-type]
            if fb.url == self.backend.url:
                raise ValueError(f"fast_tier {fb.url!r} is the store's own location")
            self.tiers = _tiered.Tiers(fb, fast_keep_last)

    def __repr__(self) -> str:
        tier = f", fast_tier={self.tiers.fast.url!r}" if self.tiers is not None else ""
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
        if self.tiers is not None:
            self.tiers.fast.close()
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
        return self.tiers.fast.url if self.tiers is not None else None

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
            h.wait_done()
        if self.tiers is None:
            return []
        with self._lock:
            done = _tiered.upload_missing(self)
        self._pipe.forget_failure("upload")  # retried and done: nothing left to report
        return done

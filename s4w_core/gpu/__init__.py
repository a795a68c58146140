"""The GPU backend: byte planes split/merged by Triton kernels, chunks entropy-coded by nvCOMP.

``import s4w_core.gpu`` always works; :func:`available` says whether the backend can run here
(a CUDA device, ``triton`` and ``nvidia.nvcomp`` importable, an nvCOMP codec can be created).
Set ``S4W_DISABLE_GPU=1`` to force the CPU path on a GPU machine (tests use it).

Entry points used by :mod:`s4w_core.api`:

* :func:`encode_storages` -- the ``fast`` profile (nvCOMP ANS, GPU-only decoder) and the
  ``portable`` profile written on the GPU (nvCOMP Deflate, standard RFC 1951 streams that the CPU
  decodes), all chunks of all storages batched into as few nvCOMP calls as memory allows.
* :func:`decode_storage` / :func:`decode_storages` -- any validated storage entry to a CUDA tensor;
  every chunk's xxh3 is checked on the host before any GPU decoder sees its bytes.
* :func:`warm_up` -- compile the codec's Triton kernels in a background thread (a
  ``CheckpointStore`` and the framework adapters start it when they are created, before the first
  save), so the first save does not pay the compilation; :func:`encode_storages` waits only for
  the warm-up stages its storages need (a plain bf16 save: the 2-byte plain stage),
  :func:`decode_storages` for the whole warm-up. (A DCP ``S4StorageWriter`` is made for each save:
  call ``s4w_core.gpu.warm_up()`` once the model is on the GPU.)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

from s4w_core import config

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import ThreadPoolExecutor
    from typing import Callable

    import torch

    from s4w_core import engine
    from s4w_core.format.container import ContainerReader, ContainerWriter
    from s4w_core.workers import Pool

__all__ = [
    "available",
    "unavailable_reason",
    "versions",
    "encode_storages",
    "decode_storage",
    "decode_storages",
    "fold64_sums",
    "release",
    "warm_up",
    "wait_warm_up",
    "warm_up_status",
    "WARM_UP_ENV",
    "WARM_UP_WAIT_S",
]

_log = logging.getLogger(__name__)

_PROBE: tuple[bool, str] | None = None


def _probe() -> tuple[bool, str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device"
        import triton  # noqa: F401
        from nvidia import nvcomp

        nvcomp.Codec(algorithm="ANS", bitstream_kind=nvcomp.BitstreamKind.RAW)
    except ImportError as e:
        return False, f"missing package: {e} (pip install s4weights[gpu-cu12] or [gpu-cu13])"
    except Exception as e:  # nvCOMP raises RuntimeError on a driver/runtime mismatch
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def available() -> bool:
    """True if the GPU backend can run here (cached; ``S4W_DISABLE_GPU=1`` forces False)."""
    global _PROBE
    if config.get_bool("S4W_DISABLE_GPU"):
        return False
    if _PROBE is None:
        _PROBE = _probe()
    return _PROBE[0]


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    if config.get_bool("S4W_DISABLE_GPU"):
        return "disabled by S4W_DISABLE_GPU"
    available()
    assert _PROBE is not None
    return _PROBE[1]


def versions() -> dict[str, Any]:
    """Versions recorded in ``manifest["writer"]`` (nvCOMP ANS bitstreams depend on the nvCOMP version)."""
    from s4w_core.gpu import _nvcomp

    return _nvcomp.versions()


def encode_storages(
    jobs: list[engine.StorageJob],
    writer: ContainerWriter,
    pool: ThreadPoolExecutor,
    profile: str = "fast",
) -> list[dict[str, Any]]:
    """Encode ``jobs`` on the GPU; returns their manifest storage entries (same keys as the CPU path).

    Args:
        jobs: storages to write, in manifest order (tensors may be on the CPU or any CUDA device).
        writer: the container; each batch's chunks are appended as one group (the file's chunk
            order is not the manifest's; readers assume none).
        pool: CPU threads (used for storages that take the CPU path, e.g. small integer tensors).
        profile: ``"fast"`` (nvCOMP ANS, decodes only on a GPU) or ``"portable"`` (only codecs with
            a CPU decoder: nvCOMP Deflate on the GPU, zstd on the CPU for non-float storages).
    Returns:
        One manifest entry per job.
    """
    from s4w_core.gpu import _encode, _warmup

    need = set()
    for j in jobs:
        key = _warmup.stage_key(j.dtype)
        need.add(("plain", key))
        if j.base is not None:
            need.add(("delta", key))
    wait_warm_up(need=need)
    return _encode.encode_storages(jobs, writer, pool, profile)


def decode_storage(
    reader: ContainerReader,
    entry: dict[str, Any],
    device: torch.device,
    resolve_base: engine.BaseResolver | None,
) -> torch.Tensor:
    """Decode one validated storage entry to a 1-D uint8 tensor on ``device`` (a CUDA device).

    Raises:
        ChecksumMismatchError: a stored chunk (checked on the host before decoding) or the decoded
            bytes do not match their checksums.
        BaseMismatchError: a delta whose base cannot be resolved.
    """
    return decode_storages(reader, [entry], device, resolve_base)[0]


def decode_storages(
    reader: ContainerReader,
    entries: list[dict[str, Any]],
    device: torch.device,
    resolve_base: engine.BaseResolver | None,
    pool: Pool | None = None,
    on_batch: Callable[[int, list[torch.Tensor]], None] | None = None,
) -> list[torch.Tensor]:
    """Batched :func:`decode_storage`: all chunks of all ``entries`` in as few nvCOMP calls as memory allows.

    ``on_batch(first, outs)``: called on the caller's thread after each batch, with the batch's
    decoded and checked storages (``entries[first:first + len(outs)]``), while the next batch is
    read: e.g. to start copying them elsewhere."""
    from s4w_core.gpu import _decode

    wait_warm_up()
    return _decode.decode_storages(reader, entries, device, resolve_base, pool, on_batch)


def fold64_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The ``fold64`` word sums (:mod:`s4w_core.checksum`) of the bytes of each tensor of one CUDA
    device, as an int64 tensor on that device, in two kernel launches and without synchronizing:
    a fingerprint of a state to compare with a later one (equal sums: the same bytes, but for a
    ~2**-64 chance). Non-contiguous tensors are summed over a contiguous copy."""
    import torch

    from s4w_core.gpu.kernels import fold64_batched

    dev = tensors[0].device
    acc = torch.zeros(len(tensors), dtype=torch.int64, device=dev)
    flat = [(t.detach().reshape(-1).view(torch.uint8), i) for i, t in enumerate(tensors)]
    fold64_batched(flat, acc)
    return acc


def release() -> None:
    """Drop cached nvCOMP codecs (and the device memory their pools hold)."""
    if _PROBE is not None and _PROBE[0]:
        from s4w_core.gpu import _nvcomp

        _nvcomp.release()


# ----------------------------------------------------------------------------- warm-up
#: ``S4W_WARM_UP=0`` turns :func:`warm_up` off (then the first save compiles what it needs).
WARM_UP_ENV = "S4W_WARM_UP"
#: the longest a save or load waits for a warm-up in progress before it goes on without it.
WARM_UP_WAIT_S = 120.0

_warm_lock = threading.Lock()
_warm_threads: dict[str, threading.Thread] = {}
_warm_state: dict[str, str] = {}  # device -> "running" / "done" / "failed: ..."
_warm_stages: dict[str, set[tuple[str, Any]]] = {}  # device -> stages finished, e.g. ("plain", 2)
_warm_cond = threading.Condition(_warm_lock)


def warm_up(
    device: Any = None, dtypes: Iterable[Any] | None = None, *, wait: bool = False, when_cuda_used: bool = False
) -> bool:
    """Compile the GPU codec's kernels for ``device`` in a background thread, once per device and
    process: a small synthetic state of ``dtypes`` (default bfloat16 and float32, i.e. both plane
    widths) is coded by the GPU writer as a plain and a delta step into containers in memory and
    decoded by the GPU reader, every byte compared (:mod:`s4w_core.gpu._warmup`). Triton's on-disk
    cache keeps the result for later processes, and a record beside it the kernels the warm-up
    loaded: a later process's warm-up loads just those from that cache.

    ``device``: default ``cuda:$LOCAL_RANK`` (as torchrun, Lightning and Accelerate set it), else
    ``cuda:0``. ``when_cuda_used=True`` (what a :class:`~s4w_core.CheckpointStore` and the adapters pass when
    they are created): the thread first waits until this process has initialised CUDA itself, so
    creating one never starts CUDA in a process that does not use it (a CPU job, or the parent of
    Lightning's spawned workers, which must not have CUDA initialised).

    Returns False (and does nothing) where the GPU backend is not usable (:func:`available`), or
    with ``S4W_WARM_UP=0``; True once a warm-up is started or done. ``wait=True`` blocks until it
    has finished. Saves and loads on the GPU wait for a warm-up in progress (at most
    :data:`WARM_UP_WAIT_S`) instead of compiling the same kernels beside it. A failed warm-up is
    logged and changes nothing: the first save compiles as it would have. Never changes the bytes
    a save writes."""
    if not config.get_bool("S4W_WARM_UP"):
        return False
    import torch

    if when_cuda_used:  # the probe (nvCOMP creates a CUDA context) runs in the thread once CUDA is in use
        if config.get_bool("S4W_DISABLE_GPU") or not torch.cuda.is_available():
            return False
    elif not available():
        return False
    if device is None:
        rank = os.environ.get("LOCAL_RANK", "")
        idx = int(rank) if rank.isdigit() and int(rank) < torch.cuda.device_count() else 0
        dev = torch.device("cuda", idx)
    else:
        dev = torch.device(device)
        if dev.type != "cuda":
            return False
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    key = str(dev)
    with _warm_lock:
        t = _warm_threads.get(key)
        if t is None:
            t = threading.Thread(
                target=_warm_main, args=(dev, dtypes, when_cuda_used), name=f"s4w-warm-up-{key}", daemon=True
            )
            _warm_threads[key] = t
            _warm_state[key] = "waiting for CUDA" if when_cuda_used else "running"
            t.start()
    if wait and t is not threading.current_thread():
        t.join()
    return True


#: how often a ``when_cuda_used`` warm-up looks whether the process has initialised CUDA
_CUDA_POLL_S = 0.25


def _warm_main(dev: Any, dtypes: Iterable[Any] | None, when_cuda_used: bool) -> None:
    import torch

    key = str(dev)
    while when_cuda_used and not torch.cuda.is_initialized():
        time.sleep(_CUDA_POLL_S)
    if not available():
        _warm_state[key] = f"unavailable: {unavailable_reason()}"
        return
    _warm_state[key] = "running"
    try:
        from s4w_core.gpu import _warmup

        def on_stage(stage: tuple[str, Any]) -> None:
            with _warm_cond:
                _warm_stages.setdefault(key, set()).add(stage)
                _warm_cond.notify_all()

        _warmup.run(dev, _warmup.DEFAULT_DTYPES if dtypes is None else tuple(dtypes), on_stage=on_stage)
    except Exception as e:  # the first real save compiles instead
        state = f"failed: {type(e).__name__}: {e}"
        _log.warning("s4w_core.gpu.warm_up on %s failed (the first save compiles instead): %s", key, e)
    else:
        state = "done"
    with _warm_cond:
        _warm_state[key] = state
        _warm_cond.notify_all()


def warm_up_status() -> dict[str, str]:
    """Per device warmed in this process: ``"running"``, ``"done"`` or ``"failed: ..."``."""
    with _warm_lock:
        return dict(_warm_state)  # "waiting for CUDA" too


def wait_warm_up(timeout: float | None = WARM_UP_WAIT_S, need: Iterable[tuple[str, Any]] | None = None) -> None:
    """Wait for the warm-ups in progress (not from a warm-up thread itself, and not for one still
    waiting for CUDA), at most ``timeout`` s. ``need``: wait only until these stages are done
    (e.g. ``{("plain", 2)}`` for a plain save of 2-byte floats: see :func:`s4w_core.gpu._warmup.run`),
    not for the whole warm-up."""
    me = threading.current_thread()
    with _warm_lock:
        running = {
            k: t for k, t in _warm_threads.items() if t.is_alive() and t is not me and _warm_state.get(k) == "running"
        }
    if not running:
        return
    if need is None:
        for t in running.values():
            t.join(timeout)
        return
    want = set(need)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _warm_cond:
        for k in running:
            while _warm_state.get(k) == "running" and not want <= _warm_stages.get(k, set()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                _warm_cond.wait(left)

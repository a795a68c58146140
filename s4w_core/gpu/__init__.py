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
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import ThreadPoolExecutor
    from typing import Callable

    import torch

    from s4w_core import engine
    from s4w_core.format.container import ContainerReader, ContainerWriter

__all__ = [
    "available",
    "unavailable_reason",
    "versions",
    "encode_storages",
    "decode_storage",
    "decode_storages",
    "release",
]

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
    if os.environ.get("S4W_DISABLE_GPU", "") not in ("", "0"):
        return False
    if _PROBE is None:
        _PROBE = _probe()
    return _PROBE[0]


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    if os.environ.get("S4W_DISABLE_GPU", "") not in ("", "0"):
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
        writer: the container; chunks are appended in manifest order.
        pool: CPU threads (used for storages that take the CPU path, e.g. small integer tensors).
        profile: ``"fast"`` (nvCOMP ANS, decodes only on a GPU) or ``"portable"`` (only codecs with
            a CPU decoder: nvCOMP Deflate on the GPU, zstd on the CPU for non-float storages).
    Returns:
        One manifest entry per job.
    """
    from s4w_core.gpu import _encode

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
    pool: ThreadPoolExecutor | None = None,
    on_batch: Callable[[int, list[torch.Tensor]], None] | None = None,
) -> list[torch.Tensor]:
    """Batched :func:`decode_storage`: all chunks of all ``entries`` in as few nvCOMP calls as memory allows.

    ``on_batch(first, outs)``: called on the caller's thread after each batch, with the batch's
    decoded and checked storages (``entries[first:first + len(outs)]``), while the next batch is
    read: e.g. to start copying them elsewhere."""
    from s4w_core.gpu import _decode

    return _decode.decode_storages(reader, entries, device, resolve_base, pool, on_batch)


def release() -> None:
    """Drop cached nvCOMP codecs (and the device memory their pools hold)."""
    if _PROBE is not None and _PROBE[0]:
        from s4w_core.gpu import _nvcomp

        _nvcomp.release()

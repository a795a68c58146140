"""Every ``S4W_*`` environment variable s4weights reads, declared once, with typed accessors; and
the checkpoint profile names, checked once.

A knob is declared in :data:`KNOBS` (name, type, default, what it does, the area it tunes); code
reads it only through :func:`get_bool`, :func:`get_int`, :func:`get_float`, :func:`get_str` (or
:func:`get_opt_int`, :func:`get_opt_float` for a knob whose default is automatic),
which parse the variable at each call (tests and benchmarks change them between calls) and raise
:class:`~s4w_core.errors.ConfigError` naming the variable and what it accepts when the value does
not parse. Reading an undeclared name is a ``KeyError`` (a bug, not a user error). Each accessor
takes an optional ``environ`` mapping to read instead of ``os.environ`` (an adapter's injectable
environment).
docs/CONFIG.md holds :func:`markdown_table` of this table (a test compares them).

Example:
    >>> from s4w_core import config
    >>> config.get_int("S4W_STAGE_AHEAD")
    4
    >>> config.check_profile("fast")
    'fast'
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from s4w_core.errors import ConfigError

__all__ = [
    "Knob",
    "KNOBS",
    "Environ",
    "PROFILES",
    "check_profile",
    "raw",
    "get_bool",
    "get_int",
    "get_opt_int",
    "get_float",
    "get_opt_float",
    "get_str",
    "markdown_table",
]

#: the checkpoint profiles a save accepts: ``auto`` (``fast`` for tensors on a GPU with nvCOMP,
#: else ``portable``), ``portable`` (readable on any machine), ``fast`` (GPU-only codecs)
PROFILES = ("auto", "portable", "fast")


def check_profile(profile: Any) -> str:
    """``profile`` if it is one of :data:`PROFILES`; ConfigError (a ValueError) otherwise."""
    if not isinstance(profile, str) or profile not in PROFILES:
        raise ConfigError(f"profile must be one of {PROFILES}, got {profile!r}")
    return profile


@dataclass(frozen=True)
class Knob:
    """One environment variable: ``kind`` is ``bool``, ``int``, ``bytes`` (an int that takes the
    suffixes K, M, G), ``float``, ``str`` or ``choice`` (one of ``choices``); ``default`` is what
    an unset or empty variable means (``None``: automatic, ``auto`` says how); ``low``/``high``
    bound a number."""

    name: str
    kind: str
    default: Any
    doc: str
    area: str
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    auto: str = ""


_MiB = 1 << 20
_DECLARED = (
    # -- reading untrusted files
    Knob("S4W_LIMITS", "str", "", "raise the reader's limits for trusted files: `field=value,...` (docs/SECURITY.md)", "limits"),
    # -- logs and metrics
    Knob("S4W_LOG", "str", "", "log every save/load to stderr at this level (`debug`, `info`, `warning`, `error`; `1`: info; `off`)", "logging"),
    Knob("S4W_LOG_FORMAT", "choice", "json", "`text`: a line for people instead of JSON", "logging", ("json", "text")),
    Knob("S4W_METRICS_PORT", "int", None, "serve Prometheus metrics on this port + `LOCAL_RANK` from the first save or load (0: any free port)", "logging", low=0, high=65535, auto="off"),
    Knob("S4W_METRICS_HOST", "str", "127.0.0.1", "address the metrics endpoint binds to", "logging"),
    Knob("S4W_METRICS_STALE_S", "float", None, "drop a label set from the metrics after this many seconds without an operation", "logging", low=0, auto="never"),
    Knob("S4W_TRACEBACK", "bool", False, "`1`: the `s4w` command prints the traceback of an unexpected error", "cli"),
    # -- CPU path and local files
    Knob("S4W_NUMBA", "bool", True, "`0`: the CPU plane transform stays on numpy even where numba is installed", "cpu"),
    Knob("S4W_WRITEBACK_BYTES", "bytes", 64 * _MiB, "local writes start the kernel's writeback every this many bytes (0: off)", "cpu", low=0),
    Knob("S4W_PINNED_THP", "bool", True, "`0`: pinned host slabs are not advised `MADV_HUGEPAGE`", "cpu"),
    # -- GPU path
    Knob("S4W_DISABLE_GPU", "bool", False, "`1`: the CPU path on a GPU machine", "gpu"),
    Knob("S4W_WARM_UP", "bool", True, "`0`: no background compile of the GPU kernels when a store or adapter is created", "gpu"),
    Knob("S4W_KERNEL_BUNDLE", "bool", True, "`0`: a first warm-up on a machine compiles the GPU kernels instead of installing those the package ships compiled for its Triton and GPU", "gpu"),
    Knob("S4W_GPU_BATCH_BYTES", "bytes", None, "raw bytes the GPU codes per batch (at least 1 MiB); a save's extra device memory is about 5x this", "gpu", low=1, auto="48 MiB, or free device memory / 8 if less; a save of host copies (non-blocking, re-encoding): at most 1/60 of the state (1/6 of its 10 % device-memory bound, which is at least 32 MiB) until a caller waits for it"),
    Knob("S4W_STAGE_AHEAD", "int", 4, "batches a GPU load reads and checks ahead of the one it decodes", "gpu", low=1),
    Knob("S4W_READ_BLOCK", "bytes", 32 * _MiB, "largest read a GPU load issues into its pinned staging buffer", "gpu", low=1),
    Knob("S4W_PROBE_MIN_GAIN", "float", None, "the saving a later-plane chunk must promise to be sent to nvCOMP ANS (0 to 1; 1: later planes raw)", "gpu", low=0, high=1, auto="0.05; 0.01 for a batch with delta residuals"),
    Knob("S4W_NVCOMP_C", "bool", True, "`0`: nvCOMP ANS through its Python API instead of the batched C API", "gpu"),
    Knob("S4W_GPU_INFLATE", "bool", True, "`0`: deflate chunks of a GPU load are inflated on the CPU", "gpu"),
    Knob("S4W_MERGE_IN_PLACE", "bool", True, "`0`: a GPU load places raw chunks into the planes buffer before the merge", "gpu"),
    Knob("S4W_PLANES_BLOCK", "int", 4096, "elements per program of the Triton plane merge", "kernels", low=1),
    Knob("S4W_PLANES_WARPS", "int", 4, "warps per program of the Triton plane merge", "kernels", low=1),
    Knob("S4W_PLANES_WIDE", "bool", True, "`0`: the Triton merge and split never take their 16-byte vector path", "kernels"),
    Knob("S4W_SPLIT_BLOCK", "int", 2048, "elements per program of the Triton plane split", "kernels", low=1),
    Knob("S4W_SPLIT_WARPS", "int", 4, "warps per program of the Triton plane split", "kernels", low=1),
    Knob("S4W_GATHER_WORDS", "int", 8192, "int64 words per program of the decode's gather copy", "kernels", low=1),
    Knob("S4W_GATHER_ITERS", "int", 2, "iterations per program of the decode's gather copy", "kernels", low=1),
    Knob("S4W_GATHER_WARPS", "int", 16, "warps per program of the decode's gather copy", "kernels", low=1),
    Knob("S4W_COMPACT_CONFIG", "str", "8192,2,16", "`words,tiles,warps` of the encoder's compaction copies", "kernels"),
    # -- stores on S3
    Knob("S4W_S3_DEADLINE", "float", 15.0, "seconds a dead, silent or misconfigured S3 endpoint may take to fail", "store", low=1e-9),
    Knob("S4W_S3_FETCH_PART", "bytes", 32 * _MiB, "a load streams each S3 object as ranged GETs of this size (at least 1 MiB)", "store", low=1),
    Knob("S4W_S3_FETCH_THREADS", "int", 8, "threads of those ranged GETs", "store", low=1),
    # -- the Accelerate adapter
    Knob("S4W_ACCELERATE", "str", "", "`1`/`true`: `import s4w_accelerate` enables the store beside the checkpoints; or a store URL", "adapters"),
    Knob("S4W_ACCELERATE_PROFILE", "choice", "auto", "the profile of the Accelerate adapter's saves", "adapters", PROFILES),
    Knob("S4W_ACCELERATE_ASYNC", "bool", False, "`1`: the Accelerate adapter compresses and writes in the background", "adapters"),
    Knob("S4W_ACCELERATE_DURABLE", "bool", True, "`0`: the Accelerate adapter's store does not fsync (`CheckpointStore(durable=False)`: the durability of Accelerate's own files)", "adapters"),
)
#: every knob by name
KNOBS: dict[str, Knob] = {k.name: k for k in _DECLARED}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SIZE = re.compile(r"^(\d+)\s*([KMGT]?)(?:i?B)?$", re.IGNORECASE)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


#: variables by name: what every accessor reads when given as ``environ`` (default ``os.environ``)
Environ = Mapping[str, str]


def raw(name: str, environ: Environ | None = None) -> str | None:
    """The variable's text in ``environ`` (default: ``os.environ``), stripped; ``None`` when it is
    unset or empty."""
    KNOBS[name]  # noqa: B018 - an undeclared knob is a KeyError
    v = ((os.environ if environ is None else environ).get(name) or "").strip()
    return v or None


def _bad(k: Knob, v: str, expected: str) -> ConfigError:
    return ConfigError(f"{k.name}={v!r}: expected {expected} ({k.doc})")


def _number(k: Knob, v: str, x: float) -> None:
    if (k.low is not None and x < k.low) or (k.high is not None and x > k.high):
        lo = "" if k.low is None else f" >= {k.low:g}"
        hi = "" if k.high is None else f" <= {k.high:g}"
        raise _bad(k, v, f"a number{lo}{' and' if lo and hi else ''}{hi}")


def get_bool(name: str, environ: Environ | None = None) -> bool:
    """A ``bool`` knob: ``1/true/yes/on`` or ``0/false/no/off`` (any case); unset: its default."""
    k = KNOBS[name]
    assert k.kind == "bool", name
    v = raw(name, environ)
    if v is None:
        return bool(k.default)
    if v.lower() in _TRUE:
        return True
    if v.lower() in _FALSE:
        return False
    raise _bad(k, v, "1/true/yes/on or 0/false/no/off")


def get_opt_int(name: str, environ: Environ | None = None) -> int | None:
    """An ``int`` or ``bytes`` knob (``bytes`` takes K, M, G, T suffixes: ``64M``); unset: its
    default (``None``: automatic)."""
    k = KNOBS[name]
    assert k.kind in ("int", "bytes"), name
    v = raw(name, environ)
    if v is None:
        return k.default  # type: ignore[no-any-return]
    if k.kind == "bytes":
        m = _SIZE.match(v)
        x = int(m.group(1)) * _UNIT[m.group(2).upper()] if m else None
    else:
        x = int(v) if re.fullmatch(r"-?\d+", v) else None
    if x is None:
        raise _bad(k, v, "a whole number" + (" of bytes (K, M, G suffixes allowed)" if k.kind == "bytes" else ""))
    _number(k, v, x)
    return x


def get_int(name: str, environ: Environ | None = None) -> int:
    """:func:`get_opt_int` of a knob with a default."""
    assert KNOBS[name].default is not None, name
    x = get_opt_int(name, environ)
    assert x is not None
    return x


def get_opt_float(name: str, environ: Environ | None = None) -> float | None:
    """A ``float`` knob; unset: its default (``None``: automatic)."""
    k = KNOBS[name]
    assert k.kind == "float", name
    v = raw(name, environ)
    if v is None:
        return k.default  # type: ignore[no-any-return]
    try:
        x = float(v)
    except ValueError:
        raise _bad(k, v, "a number") from None
    if x != x or x in (float("inf"), float("-inf")):
        raise _bad(k, v, "a finite number")
    _number(k, v, x)
    return x


def get_float(name: str, environ: Environ | None = None) -> float:
    """:func:`get_opt_float` of a knob with a default."""
    assert KNOBS[name].default is not None, name
    x = get_opt_float(name, environ)
    assert x is not None
    return x


def get_str(name: str, environ: Environ | None = None) -> str:
    """A ``str`` or ``choice`` knob (a choice compared in lower case); unset: its default."""
    k = KNOBS[name]
    assert k.kind in ("str", "choice"), name
    v = raw(name, environ)
    if v is None:
        return str(k.default)
    if k.kind == "choice":
        if v.lower() not in k.choices:
            raise _bad(k, v, "one of " + ", ".join(k.choices))
        return v.lower()
    return v


def _default_text(k: Knob) -> str:
    if k.default is None:
        return k.auto
    if k.kind == "bool":
        return "1" if k.default else "0"
    if k.kind == "bytes" and k.default and k.default % _MiB == 0:
        return f"{k.default // _MiB} MiB"
    if k.default == "":
        return "unset"
    return f"`{k.default}`" if isinstance(k.default, str) else f"{k.default:g}" if isinstance(k.default, float) else str(k.default)


def markdown_table() -> str:
    """The table of every knob docs/CONFIG.md holds (one row per knob, in declaration order)."""
    rows = ["| variable | type | default | what | area |", "|---|---|---|---|---|"]
    for k in _DECLARED:
        kind = k.kind if k.kind != "choice" else " / ".join(k.choices)
        rows.append(f"| `{k.name}` | {kind} | {_default_text(k)} | {k.doc} | {k.area} |")
    return "\n".join(rows) + "\n"

"""Resource limits a reader applies to untrusted input (docs/SECURITY.md).

Every size a file claims is checked against what its bytes can produce (the format's own bounds,
docs/FORMAT.md section 7) *and* against the caps here, before memory is reserved. The caps have
defaults that no checkpoint s4weights writes comes near; one knob raises them:

* the environment variable ``S4W_LIMITS``, e.g. ``S4W_LIMITS="manifest_bytes=1G,pickle_bytes=512M"``
  (comma-separated ``field=value``; values take the suffixes ``K``, ``M``, ``G``), read once, the
  first time a limit is needed, by :func:`get_limits`;
* or, in a program, :func:`set_limits` (which replaces what the environment said).

:func:`get_limits` is the one place every reader asks.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from dataclasses import dataclass

from s4w_core import config
from s4w_core.errors import ConfigError

__all__ = ["Limits", "get_limits", "set_limits", "ENV_VAR", "parse_limits"]

#: the environment variable :func:`get_limits` reads
ENV_VAR = "S4W_LIMITS"


@dataclass(frozen=True)
class Limits:
    """Caps on what an untrusted file may make a reader allocate or do.

    Attributes:
        manifest_bytes: the most JSON text a manifest may have (stored as it is, or after
            decompression), at most the format's 2**30. Parsing JSON costs up to ~20x its size in
            Python objects.
        manifest_inflation: a compressed manifest may inflate to at most this many times its
            stored size ...
        manifest_free: ... or to this many bytes, whichever is larger (real manifests compress
            about 7x; a zstd bomb 10,000x and more).
        pickle_bytes: the largest ``data.pkl`` of a ``torch.save`` zip that framework-file
            packing (:mod:`s4w_core.filepack`) scans for tensor types; a larger one, or one that
            inflates more than ``pickle_inflation`` times its compressed size, leaves the file's
            bytes untyped (stored as raw bytes: still exact).
        pickle_inflation: see ``pickle_bytes``.
        pickle_ops: the most pickle opcodes the scan follows before giving up the same way.
        safetensors_header_bytes: the largest safetensors JSON header packing parses.
    """

    manifest_bytes: int = 256 << 20
    manifest_inflation: int = 64
    manifest_free: int = 4 << 20
    pickle_bytes: int = 64 << 20
    pickle_inflation: int = 100
    pickle_ops: int = 2_000_000
    safetensors_header_bytes: int = 100_000_000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if type(v) is not int or v < 1:
                raise ConfigError(f"s4weights limit {f.name} must be a positive integer, got {v!r}")


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_ITEM = re.compile(r"^\s*([a-z_]+)\s*=\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_limits(text: str, base: Limits | None = None) -> Limits:
    """``base`` (default: the defaults) with the ``field=value,...`` of ``text`` applied.
    Raises :class:`~s4w_core.errors.ConfigError` (a ValueError) naming the bad item."""
    known = {f.name for f in dataclasses.fields(Limits)}
    changes: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        m = _ITEM.match(item)
        if m is None or m.group(1).lower() not in known:
            raise ConfigError(
                f"{ENV_VAR}: cannot read {item!r}; expected field=value with a field among {sorted(known)}"
            )
        changes[m.group(1).lower()] = int(m.group(2)) * _SUFFIX[m.group(3).upper()]
    return dataclasses.replace(base or Limits(), **changes)


_lock = threading.Lock()
_current: Limits | None = None


def get_limits() -> Limits:
    """The limits in force: those given to :func:`set_limits`, else the defaults changed by the
    ``S4W_LIMITS`` environment variable (read once)."""
    global _current
    cur = _current
    if cur is None:
        with _lock:
            if _current is None:
                _current = parse_limits(config.get_str(ENV_VAR))
            cur = _current
    return cur


def set_limits(limits: Limits | None = None, **changes: int) -> Limits:
    """Put ``limits`` (or the current limits with ``changes`` applied; ``None`` and no changes:
    back to the environment's) in force for this process; returns the previous ones.

    Example:
        >>> from s4w_core.format.limits import get_limits, set_limits
        >>> old = set_limits(manifest_bytes=1 << 30)
        >>> get_limits().manifest_bytes
        1073741824
        >>> _ = set_limits(old)
    """
    global _current
    prev = get_limits()
    with _lock:
        if limits is None and not changes:
            _current = None
        else:
            _current = dataclasses.replace(limits or prev, **changes)
    return prev

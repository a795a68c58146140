"""Error hierarchy of s4weights.

Every error raised on purpose by the library subclasses :class:`S4WError` and, where one fits, the
matching builtin (``ValueError``, ``FileNotFoundError``, ``OSError``, ``ImportError``), so callers can
catch either.  All errors are picklable (they only carry a message), so they cross process
boundaries (DataLoader workers, ``multiprocessing``, DCP ranks) intact.
"""

from __future__ import annotations

__all__ = [
    "S4WError",
    "FormatError",
    "TruncatedError",
    "BadMagicError",
    "UnsupportedVersionError",
    "ManifestError",
    "ChecksumMismatchError",
    "UnknownCodecError",
    "DecodeError",
    "UnsupportedTypeError",
    "CheckpointNotFoundError",
    "BaseMismatchError",
    "StoreError",
    "ConflictError",
    "SaveInProgressError",
    "AsyncSaveError",
    "BackendUnavailableError",
    "DeviceUnavailableError",
    "UnsafePathError",
    "ConfigError",
]


class S4WError(Exception):
    """Root of every error s4weights raises on purpose."""


class FormatError(S4WError, ValueError):
    """The bytes are not a well-formed s4weights container (corrupt, truncated or forged)."""


class TruncatedError(FormatError):
    """The container is shorter than its own header, trailer or manifest says it is."""


class BadMagicError(FormatError):
    """The file does not start/end with the s4weights magic: not an s4weights container."""


class UnsupportedVersionError(FormatError):
    """The container was written in a format version this reader does not know."""


class ManifestError(FormatError):
    """The JSON manifest is malformed, inconsistent or names impossible sizes/offsets."""


class ChecksumMismatchError(FormatError):
    """Stored bytes or decoded bytes do not match the checksum recorded when they were written."""


class DecodeError(FormatError):
    """A codec failed to decode a chunk whose checksum matched (a codec bug or a forged chunk)."""


class UnknownCodecError(S4WError, ValueError):
    """The container names a codec id this installation does not know."""


class UnsupportedTypeError(S4WError, TypeError):
    """``save`` met a Python object it cannot store without pickling it."""


class CheckpointNotFoundError(S4WError, FileNotFoundError):
    """The checkpoint (file, step or object) does not exist."""


class BaseMismatchError(S4WError, ValueError):
    """A delta's base is missing, or is not the exact bytes the delta was computed against."""


class StoreError(S4WError, OSError):
    """A storage backend failed (I/O error, S3 error, unreachable endpoint, bad credentials)."""


class ConflictError(StoreError):
    """Another writer holds or changed the same checkpoint location."""


class SaveInProgressError(StoreError):
    """A save was started while the store's previous non-blocking save is still running and the
    store was opened with ``on_busy="error"``."""


class AsyncSaveError(StoreError):
    """A non-blocking save (or the upload of a step to the slow tier) failed in the background.
    Raised by the store's next call; names the step, and ``__cause__`` is the original error."""


class BackendUnavailableError(S4WError, ImportError):
    """A codec or device backend is needed but not installed/usable here (e.g. a GPU-only codec
    on a CPU-only machine)."""


class DeviceUnavailableError(S4WError, RuntimeError):
    """A tensor's recorded device does not exist here; pass ``map_location``."""


class UnsafePathError(S4WError, ValueError):
    """A write or delete would leave its target directory: a path that names a place outside it,
    or a symbolic link on the way (unpacking never follows one)."""


class ConfigError(S4WError, ValueError):
    """A setting is invalid: an ``S4W_*`` environment variable that does not parse (the message
    names it and what it accepts), or an argument such as an unknown profile name."""

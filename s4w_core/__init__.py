"""s4weights core: lossless, GPU-fast compression of PyTorch checkpoints.

Public API: :func:`save`, :func:`load`, :func:`info`, :func:`verify` and the error classes.
``import s4w_core`` needs neither a GPU nor triton/nvCOMP; the GPU backend loads lazily.
"""

from s4w_core._version import __version__
from s4w_core.api import PROFILES, SaveReport, VerifyReport, info, load, save, verify
from s4w_core.errors import (
    BackendUnavailableError,
    BadMagicError,
    BaseMismatchError,
    ChecksumMismatchError,
    CheckpointNotFoundError,
    ConflictError,
    DecodeError,
    DeviceUnavailableError,
    FormatError,
    ManifestError,
    S4WError,
    StoreError,
    TruncatedError,
    UnknownCodecError,
    UnsupportedTypeError,
    UnsupportedVersionError,
)
from s4w_core.skeleton import register_dict_type

__all__ = [
    "__version__",
    "PROFILES",
    "SaveReport",
    "VerifyReport",
    "save",
    "load",
    "info",
    "verify",
    "register_dict_type",
    "S4WError",
    "FormatError",
    "TruncatedError",
    "BadMagicError",
    "UnsupportedVersionError",
    "ManifestError",
    "ChecksumMismatchError",
    "DecodeError",
    "UnknownCodecError",
    "UnsupportedTypeError",
    "CheckpointNotFoundError",
    "BaseMismatchError",
    "StoreError",
    "ConflictError",
    "BackendUnavailableError",
    "DeviceUnavailableError",
]

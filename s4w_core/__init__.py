"""s4weights core: lossless, GPU-fast compression of PyTorch checkpoints.

Public API: :func:`save`, :func:`load`, :func:`info`, :func:`verify` and the error classes.
``import s4w_core`` needs neither a GPU nor triton/nvCOMP; the GPU backend loads lazily.
"""

from s4w_core._version import __version__
from s4w_core.api import PROFILES, SaveReport, VerifyReport, info, load, save, verify
from s4w_core.errors import (
    AsyncSaveError,
    BackendUnavailableError,
    BadMagicError,
    BaseMismatchError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConflictError,
    DecodeError,
    DeviceUnavailableError,
    FormatError,
    ManifestError,
    S4WError,
    SaveInProgressError,
    StoreError,
    TruncatedError,
    UnknownCodecError,
    UnsupportedTypeError,
    UnsupportedVersionError,
)
from s4w_core.skeleton import register_dict_type
from s4w_core.store import CheckpointStore, SaveHandle, StepInfo, load_checkpoint, save_checkpoint

__all__ = [
    "__version__",
    "PROFILES",
    "SaveReport",
    "VerifyReport",
    "save",
    "load",
    "info",
    "verify",
    "CheckpointStore",
    "StepInfo",
    "SaveHandle",
    "save_checkpoint",
    "load_checkpoint",
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
    "SaveInProgressError",
    "AsyncSaveError",
    "BackendUnavailableError",
    "DeviceUnavailableError",
    "S4StorageWriter",
    "S4StorageReader",
    "pack_file",
    "unpack_file",
    "pack_folder",
    "unpack_folder",
    "replace_with_marker",
]

_LAZY = {
    "S4StorageWriter": "s4w_core.dcp",
    "S4StorageReader": "s4w_core.dcp",
    "pack_file": "s4w_core.filepack",
    "unpack_file": "s4w_core.filepack",
    "pack_folder": "s4w_core.filepack",
    "unpack_folder": "s4w_core.filepack",
    "replace_with_marker": "s4w_core.filepack",
}


def __getattr__(name: str) -> object:
    # torch.distributed.checkpoint is imported only when its storage classes are asked for
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 's4w_core' has no attribute {name!r}")

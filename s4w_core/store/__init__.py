"""Checkpoint stores: base -> delta chains on a local directory or S3, atomic commits, retention.

Public surface: :class:`CheckpointStore`, :class:`StepInfo`, :class:`SaveHandle`,
:func:`save_checkpoint`, :func:`load_checkpoint`.  See docs/STORE.md for the layout, the commit
protocol, non-blocking saves and tiers.
"""

from s4w_core.store.api import load_checkpoint, save_checkpoint
from s4w_core.store.store import DEFAULT_KEYFRAME_EVERY, CheckpointStore, SaveHandle, StepInfo, open_backend

__all__ = [
    "CheckpointStore",
    "StepInfo",
    "SaveHandle",
    "save_checkpoint",
    "load_checkpoint",
    "open_backend",
    "DEFAULT_KEYFRAME_EVERY",
]

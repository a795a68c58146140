"""Checkpoint stores: base -> delta chains on a local directory or S3, atomic commits, retention.

Public surface: :class:`CheckpointStore`, :class:`StepInfo`, :func:`save_checkpoint`,
:func:`load_checkpoint`.  See docs/STORE.md for the layout and the commit protocol.
"""

from s4w_core.store.api import load_checkpoint, save_checkpoint
from s4w_core.store.store import DEFAULT_KEYFRAME_EVERY, CheckpointStore, StepInfo, open_backend

__all__ = ["CheckpointStore", "StepInfo", "save_checkpoint", "load_checkpoint", "open_backend", "DEFAULT_KEYFRAME_EVERY"]

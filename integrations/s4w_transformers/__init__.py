"""s4weights for the Hugging Face Trainer: checkpoints saved from memory into a store.

``Trainer(..., callbacks=[S4Callback()])`` saves each checkpoint the Trainer decides on into a
:class:`s4w_core.store.CheckpointStore` (local or S3) instead of a ``checkpoint-N`` folder;
``trainer.train(resume_from_checkpoint=True)`` (with the callback attached) or
``trainer.train(resume_from_checkpoint=restore_checkpoint(store))`` resumes bit-exactly.  See
docs/INTEGRATIONS.md.

Importing this package without Hugging Face Transformers installed raises ImportError with the
install hint (``pip install 's4weights[transformers]'``).
"""

from __future__ import annotations

try:
    import transformers as _framework  # noqa: F401
except ImportError as _e:
    raise ImportError(
        "s4w_transformers needs Hugging Face Transformers, which is not installed: pip install 's4weights[transformers]'"
    ) from _e

from s4w_core.frameworks import StateMismatchError
from s4w_transformers._callback import STORE_DIRNAME, S4Callback, UnsupportedSetupError
from s4w_transformers._restore import WRITER, cleanup_restored, restore_checkpoint
from s4w_transformers._state import sharded_engine

__all__ = [
    "S4Callback",
    "restore_checkpoint",
    "cleanup_restored",
    "sharded_engine",
    "StateMismatchError",
    "UnsupportedSetupError",
    "STORE_DIRNAME",
    "WRITER",
]

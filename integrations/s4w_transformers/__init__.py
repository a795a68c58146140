"""s4weights for the Hugging Face Trainer: compressed delta copies of every checkpoint folder.

``Trainer(..., callbacks=[S4Callback()])`` stores each ``checkpoint-N`` folder in a
:class:`s4w_core.store.CheckpointStore` (local or S3); :func:`restore_checkpoint` gives the folder
back, byte for byte, for ``trainer.train(resume_from_checkpoint=...)``.  See docs/INTEGRATIONS.md.

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

from s4w_transformers._callback import MARKER_NAME, STORE_DIRNAME, S4Callback, restore_checkpoint

__all__ = ["S4Callback", "restore_checkpoint", "MARKER_NAME", "STORE_DIRNAME"]

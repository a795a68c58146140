"""s4weights for PyTorch Lightning: compressed delta checkpoints through Lightning's own save path.

``Trainer(plugins=[S4CheckpointIO()])`` is the one-line change (``lightning`` or
``pytorch_lightning``); ``ModelCheckpoint`` works as configured.  Resume with
``trainer.fit(model, ckpt_path=...)``; :func:`last_checkpoint` finds the newest checkpoint (also
on ``s3://``, where ``ckpt_path="last"`` does not work), :func:`load_from_checkpoint` replaces
``MyModule.load_from_checkpoint``.  See docs/INTEGRATIONS.md.

Importing this package without PyTorch Lightning installed raises ImportError with the install
hint (``pip install 's4weights[lightning]'``).
"""

from __future__ import annotations

try:
    import lightning as _framework  # noqa: F401
except ImportError:
    try:
        import pytorch_lightning as _framework  # type: ignore[no-redef]  # noqa: F401
    except ImportError as _e:
        raise ImportError(
            "s4w_lightning needs PyTorch Lightning, which is not installed: pip install 's4weights[lightning]'"
        ) from _e

from s4w_lightning._fsdp import S4ModelParallelStrategy
from s4w_lightning._io import STORE_DIRNAME, S4CheckpointIO, last_checkpoint, load_checkpoint, load_from_checkpoint

__all__ = [
    "S4CheckpointIO",
    "S4ModelParallelStrategy",
    "last_checkpoint",
    "load_checkpoint",
    "load_from_checkpoint",
    "STORE_DIRNAME",
]

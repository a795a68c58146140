"""s4weights for Hugging Face Accelerate: ``save_state``/``load_state`` go from memory into a store
when switched on.

Switch it on with the environment plus one import line in the training script::

    S4W_ACCELERATE=1 accelerate launch train.py       # train.py: import s4w_accelerate

(``S4W_ACCELERATE=s3://bucket/run`` puts the store on S3), or call :func:`enable`.  The
``accelerate config`` YAML rejects unknown keys, but ``accelerate launch`` passes the environment
to every worker.  See docs/INTEGRATIONS.md.

Importing this package without Hugging Face Accelerate installed raises ImportError with the
install hint (``pip install 's4weights[accelerate]'``).
"""

from __future__ import annotations

try:
    import accelerate as _framework  # noqa: F401
except ImportError as _e:
    raise ImportError(
        "s4w_accelerate needs Hugging Face Accelerate, which is not installed: pip install 's4weights[accelerate]'"
    ) from _e

from s4w_accelerate._fsdp import sharded_engine
from s4w_accelerate._hook import disable, enable, enable_from_env
from s4w_accelerate._settings import (
    ENV,
    STORE_DIRNAME,
    WRITER,
    Config,
    UnsupportedAccelerateError,
    config,
    enabled,
    finish_pending,
    last_info,
    registered,
    store_for,
)
from s4w_core.frameworks import StateMismatchError

__all__ = [
    "enable",
    "disable",
    "enabled",
    "enable_from_env",
    "config",
    "finish_pending",
    "last_info",
    "sharded_engine",
    "store_for",
    "registered",
    "Config",
    "StateMismatchError",
    "UnsupportedAccelerateError",
    "ENV",
    "STORE_DIRNAME",
    "WRITER",
]

enable_from_env()

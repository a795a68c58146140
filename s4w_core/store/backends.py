"""Opening a store's backend from its URL: a local directory, ``s3://``, ``memory://``."""

from __future__ import annotations

import os
from typing import Any

from s4w_core.store._backend import Backend

__all__ = ["open_backend"]


def open_backend(url: str | os.PathLike[str], **options: Any) -> Backend:
    """The backend for ``url``: ``s3://bucket/prefix``, ``memory://name`` or a local path
    (``file://`` accepted).  ``options`` go to the S3 backend (region, endpoint, ...);
    ``durable`` (default True) and ``create`` to a local one (an S3 object is durable once its
    upload completes: ``durable`` changes nothing there)."""
    u = os.fspath(url)
    durable = options.pop("durable", True)
    if type(durable) is not bool:
        raise ValueError(f"durable must be True or False, got {durable!r}")
    if u.startswith("s3://"):
        from s4w_core.store._s3 import S3Backend

        return S3Backend(u, **options)
    s3_only = {k for k, v in options.items() if v is not None and k not in ("create",)}
    if s3_only:
        raise ValueError(f"options {sorted(s3_only)} apply only to s3:// stores, not {u!r}")
    if u.startswith("memory://"):
        from s4w_core.store._memory import MemoryBackend

        return MemoryBackend(u[len("memory://") :])
    if "://" in u and not u.startswith("file://"):
        raise ValueError(f"unsupported store URL {u!r}: use a local path, file://, s3:// or memory://")
    from s4w_core.store._local import LocalBackend

    return LocalBackend(
        u[len("file://") :] if u.startswith("file://") else u, create=options.get("create", True), durable=durable
    )


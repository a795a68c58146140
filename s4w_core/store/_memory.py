"""In-process backend (``memory://NAME``): for tests and fault injection, not for checkpoints
you want to keep.  Stores with the same NAME share objects within one process."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from typing import IO, Iterator

from s4w_core.errors import CheckpointNotFoundError, ConflictError
from s4w_core.store._backend import Backend, ObjectInfo, RangeReader

__all__ = ["MemoryBackend"]

_SPACES: dict[str, dict[str, tuple[bytes, float]]] = {}
_LOCK = threading.Lock()


class MemoryBackend(Backend):
    def __init__(self, name: str) -> None:
        self.url = f"memory://{name}"
        with _LOCK:
            self._objs = _SPACES.setdefault(name, {})

    @staticmethod
    def drop(name: str) -> None:
        """Forget everything stored under ``memory://name``."""
        with _LOCK:
            _SPACES.pop(name, None)

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        buf = io.BytesIO()
        yield buf
        with _LOCK:
            self._objs[key] = (buf.getvalue(), time.time())

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        with _LOCK:
            if if_absent and key in self._objs:
                raise ConflictError(f"{self.describe(key)} already exists")
            self._objs[key] = (bytes(data), time.time())

    def _obj(self, key: str) -> bytes:
        with _LOCK:
            try:
                return self._objs[key][0]
            except KeyError:
                raise CheckpointNotFoundError(f"{self.describe(key)} does not exist") from None

    def get(self, key: str) -> bytes:
        return self._obj(key)

    def open_range(self, key: str) -> RangeReader:
        data = memoryview(self._obj(key))
        return RangeReader(lambda o, n: bytes(data[o : o + n]), len(data), self.describe(key))

    def list(self, prefix: str) -> list[ObjectInfo]:
        with _LOCK:
            return [
                ObjectInfo(k, len(v[0]), v[1], f"{id(v[0])}-{v[1]}") for k, v in self._objs.items() if k.startswith(prefix)
            ]

    def delete(self, key: str) -> None:
        with _LOCK:
            self._objs.pop(key, None)

"""The object-store interface a :class:`~s4w_core.store.CheckpointStore` is built on.

A backend stores immutable objects under string keys (``/``-separated, relative to the store's
root).  The store needs only these verbs; their call order in a save is: ``writer`` (data
object, streamed) -> ``put`` (commit record, small, last).  Call order in a load: ``list`` (commit
records) -> ``get`` (one record) -> ``open_range`` (data objects).

Guarantees every backend gives:

* ``writer(key)`` and ``put(key, ...)`` are atomic: the object exists, whole, after a clean exit
  from the ``with`` block (or after ``put`` returns), and a failure at any point leaves either
  the previous object under that key or nothing.  Never half an object.
* ``put(..., if_absent=True)`` fails with :class:`~s4w_core.errors.ConflictError` when the key
  exists (atomic on the local backend; on S3 a check-then-put, see docs/STORE.md: the hook for
  the multi-writer work).
* Missing keys raise :class:`~s4w_core.errors.CheckpointNotFoundError`; every other backend
  failure raises :class:`~s4w_core.errors.StoreError` naming the URL and what went wrong.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import IO, Callable, Iterator

from s4w_core.format.container import ReadInto

__all__ = ["Backend", "ObjectInfo", "RangeReader"]


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float | None = None
    #: changes whenever the object is rewritten (S3 ETag; inode + mtime_ns locally)
    version: str | None = None


@dataclass
class RangeReader:
    """``read(offset, length) -> bytes`` over one object of ``size`` bytes (thread-safe).

    ``readinto(offset, buffers) -> int``, where the backend has it, fills the caller's buffers in
    turn instead (a scatter read, no intermediate ``bytes``; see
    :data:`s4w_core.format.container.ReadInto`): pass it on to
    :class:`~s4w_core.format.container.ContainerReader`.
    """

    read: Callable[[int, int], bytes]
    size: int
    name: str
    close: Callable[[], None] = lambda: None
    readinto: ReadInto | None = None


class Backend(abc.ABC):
    """An object store rooted at one URL (a local directory, an S3 prefix, memory)."""

    url: str
    #: whether reading several small objects at once (commit records) pays a thread pool: True for
    #: a remote store, where each read waits for a round trip; a local or memory read costs less
    #: than starting a thread
    concurrent_reads: bool = False

    @abc.abstractmethod
    def writer(self, key: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary file to stream one object into; it becomes visible only on a clean exit."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a small object atomically (replacing any previous one unless ``if_absent``)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object."""

    @abc.abstractmethod
    def open_range(self, key: str) -> RangeReader:
        """Random access to one object, by byte ranges."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (no temporaries, any order)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; removing a missing object is not an error."""

    def fetch(self, key: str) -> RangeReader:
        """Like :meth:`open_range`, but may download the object whole first (faster on S3 when
        every byte will be read).  Default: :meth:`open_range`."""
        return self.open_range(key)

    def close(self) -> None:  # noqa: B027 - optional
        """Release clients/handles (optional)."""

    def describe(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def __iter__(self) -> Iterator[ObjectInfo]:  # pragma: no cover - convenience
        return iter(self.list(""))

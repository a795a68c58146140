"""Durable, atomic local file writes shared by every writer of the library (save, DCP, filepack)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Any, Iterator

__all__ = ["atomic_write", "fsync_dir", "EarlyWriteback"]

#: bytes written between two writeback starts (``S4W_WRITEBACK_BYTES``; 0 turns it off)
WRITEBACK_BYTES = int(os.environ.get("S4W_WRITEBACK_BYTES", 64 << 20))


class EarlyWriteback:
    """A binary file whose written bytes the kernel starts writing to disk every
    :data:`WRITEBACK_BYTES`, while the writer goes on, so that the fsync that makes the file
    durable waits only for the last window instead of the whole file.

    Linux's ``posix_fadvise(POSIX_FADV_DONTNEED)`` on a written range starts asynchronous
    writeback of its dirty pages (and drops pages that are already clean); it changes no byte and
    durability still comes from the caller's fsync. Elsewhere, or for a file without a
    descriptor, it is a plain pass-through."""

    def __init__(self, f: IO[bytes], window: int | None = None) -> None:
        self._f = f
        self._window = WRITEBACK_BYTES if window is None else window
        self._pos = 0
        self._started = 0
        try:
            self._fd: int | None = f.fileno() if self._window > 0 and hasattr(os, "posix_fadvise") else None
        except (AttributeError, OSError, ValueError):
            self._fd = None

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        n = len(memoryview(data).cast("B")) if n is None else n
        self._pos += n
        if self._fd is not None and self._pos - self._started >= self._window:
            self._f.flush()
            try:
                os.posix_fadvise(self._fd, self._started, self._pos - self._started, os.POSIX_FADV_DONTNEED)
            except OSError:
                self._fd = None  # not supported here: stop trying
            self._started = self._pos
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)



def _read_umask() -> int:
    mask = os.umask(0o022)  # read once at import (os.umask can only be read by setting it)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def fsync_dir(d: str) -> None:
    """fsync a directory so a rename inside it is durable (best effort where unsupported)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], prefix: str = ".s4w-") -> Iterator[IO[bytes]]:
    """Yield a binary file; on normal exit its bytes appear at ``path`` atomically and durably.

    The data goes to a temporary file in the same directory (mode 0666 & ~umask, as ``open``
    would give), which is flushed, fsync'ed and renamed over ``path``; the directory is fsync'ed
    too. On an exception the temporary file is removed and ``path`` is untouched.
    """
    dest = os.fspath(path)
    d = os.path.dirname(os.path.abspath(dest))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=d)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            yield EarlyWriteback(f)  # type: ignore[misc]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(d)

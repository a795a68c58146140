"""Durable, atomic local file writes shared by every writer of the library (save, DCP, filepack)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator

__all__ = ["atomic_write", "fsync_dir"]


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
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(d)

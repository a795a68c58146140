"""Dropping a benchmark's files from the page cache, so that the next read comes from the disk."""

from __future__ import annotations

import os

__all__ = ["evict"]


def evict(path: str) -> bool:
    """Drop ``path``'s files (a file or a tree) from the page cache: sync, then posix_fadvise DONTNEED."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
    return True

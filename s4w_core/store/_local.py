"""Local-directory backend: temp file + fsync + rename for every object; pread/preadv for ranges.

``durable=False`` drops the fsyncs (the temp file and the rename stay): a write is then atomic
against the process dying, as before, but a power loss or an OS crash can lose the newest objects'
bytes -- the durability of ``torch.save`` and of the frameworks' own checkpoint files, which leave
their bytes in the page cache.  A step whose bytes were lost fails its checksums when read; it is
never read as other bytes.

The store's directory is created by its first write, not when the backend is opened: opening a
mistyped path to read from it (``load_checkpoint("runs/typo")``) leaves nothing behind.  Object
files get the mode ``open()`` would give (0666 less the umask: 0644 under umask 022), as files
written by :func:`s4w_core.save` do.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import tempfile
from typing import IO, Iterator, Sequence

from s4w_core._fsutil import EarlyWriteback, name_parts
from s4w_core._fsutil import fsync_dir as _fsync_dir
from s4w_core.errors import CheckpointNotFoundError, ConflictError, StoreError
from s4w_core.format.container import pread_into
from s4w_core.store._backend import Backend, ObjectInfo, RangeReader

__all__ = ["LocalBackend"]

_TMP_PREFIX = ".s4w-tmp-"


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells it (``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (once, at import)
    os.umask(mask)
    return mask


#: the mode of every object file: what ``open(path, "wb")`` would give
FILE_MODE = 0o666 & ~_umask()


class LocalBackend(Backend):
    """Objects are files under ``root``; keys map to relative paths."""

    def __init__(self, root: str, *, create: bool = True, durable: bool = True) -> None:
        """``create``: whether writes may create the directory (and the folders above it); it is
        created by the first write either way, never by opening.  ``durable``: fsync each object
        and its directory before it counts as written (see the module's docstring)."""
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.create = create
        self.durable = durable
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StoreError(f"{self.root} is a file, not a directory: not a checkpoint store")

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *name_parts(key, f"object key in {self.root}"))

    @contextlib.contextmanager
    def _tmp(self, key: str) -> Iterator[tuple[IO[bytes], str, str]]:
        path = self._path(key)
        d = os.path.dirname(path)
        if not self.create and not os.path.isdir(self.root):
            raise StoreError(f"cannot write {path}: the store directory {self.root} does not exist")
        try:
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=d)
        except OSError as e:
            raise StoreError(f"cannot write {path}: {e}") from e
        try:
            os.fchmod(fd, FILE_MODE)  # mkstemp makes 0600
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StoreError(f"cannot write {path}: {e}") from e
        try:
            with os.fdopen(fd, "wb") as f:
                yield f, tmp, path
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        with self._tmp(key) as (f, tmp, path):
            # the closing fsync waits for the last window only
            yield EarlyWriteback(f, None if self.durable else 0)  # type: ignore[misc]
            try:
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            except OSError as e:
                raise StoreError(f"cannot write {path}: {e}") from e
        self._publish(tmp, path, replace=True)

    def _publish(self, tmp: str, path: str, *, replace: bool) -> None:
        try:
            if replace:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError:
                    raise ConflictError(f"{path} already exists (written by another writer?)") from None
                finally:
                    os.unlink(tmp)
        except ConflictError:
            raise
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StoreError(f"cannot publish {path}: {e}") from e
        if self.durable:
            _fsync_dir(os.path.dirname(path))

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        with self._tmp(key) as (f, tmp, path):
            try:
                f.write(data)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            except OSError as e:
                raise StoreError(f"cannot write {path}: {e}") from e
        self._publish(tmp, path, replace=not if_absent)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist") from None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e}") from e

    def open_range(self, key: str) -> RangeReader:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist") from None
        except OSError as e:
            raise StoreError(f"cannot open {path}: {e}") from e
        size = os.fstat(fd).st_size

        def read(off: int, n: int) -> bytes:
            try:
                return os.pread(fd, n, off)
            except OSError as e:
                raise StoreError(f"cannot read {path}: {e}") from e

        def readinto(off: int, bufs: Sequence[memoryview]) -> int:
            try:
                return pread_into(fd, off, bufs)
            except OSError as e:
                raise StoreError(f"cannot read {path}: {e}") from e

        closed = [False]

        def close() -> None:
            if not closed[0]:
                closed[0] = True
                os.close(fd)

        return RangeReader(read, size, path, close, readinto)

    def list(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        # walk only the directory that holds the prefix
        head, _, _ = prefix.rpartition("/")
        top = self._path(head) if head else self.root
        if not os.path.isdir(top):
            return out
        try:
            for dirpath, _dirs, files in os.walk(top):
                rel = os.path.relpath(dirpath, self.root)
                for name in files:
                    if name.startswith(_TMP_PREFIX):
                        continue
                    key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                    if key.startswith(prefix):
                        try:
                            st = os.stat(os.path.join(dirpath, name))
                        except FileNotFoundError:
                            continue
                        out.append(ObjectInfo(key, st.st_size, st.st_mtime, f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"))
        except OSError as e:
            raise StoreError(f"cannot list {top}: {e}") from e
        return out

    def list_temporaries(self) -> builtins.list[ObjectInfo]:
        """Leftover temp files of crashed writers (for :meth:`CheckpointStore.gc`)."""
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(_TMP_PREFIX):
                    p = os.path.join(dirpath, name)
                    with contextlib.suppress(FileNotFoundError):
                        out.append(ObjectInfo(os.path.relpath(p, self.root).replace(os.sep, "/"), 0, os.stat(p).st_mtime))
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno == errno.EISDIR:
                raise StoreError(f"cannot delete {path}: is a directory") from e
            raise StoreError(f"cannot delete {path}: {e}") from e

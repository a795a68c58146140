"""Durable, atomic local file writes shared by every writer of the library (save, DCP, filepack)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import tempfile
from typing import IO, Any, Callable, Iterator, Sequence

from s4w_core import config
from s4w_core.errors import S4WError, StoreError, UnsafePathError

__all__ = ["WriteThrough", "name_parts", "is_safe_name", "store_error", "storage_errors", "atomic_write", "atomic_write_at", "open_dir_nofollow", "fsync_dir", "EarlyWriteback", "write_vectors", "IOV_MAX", "NOFOLLOW_AT"]

#: bytes written between two writeback starts (``S4W_WRITEBACK_BYTES``; 0 turns it off)
WRITEBACK_BYTES = config.get_int("S4W_WRITEBACK_BYTES")


class EarlyWriteback:
    """A binary file whose written bytes the kernel starts writing to disk every
    :data:`WRITEBACK_BYTES`, while the writer goes on, so that the fsync that makes the file
    durable waits only for the last window instead of the whole file.

    Linux's ``posix_fadvise(POSIX_FADV_DONTNEED)`` on a written range starts asynchronous
    writeback of its dirty pages (and drops pages that are already clean); it changes no byte and
    durability still comes from the caller's fsync. Elsewhere, with ``window=0`` (a store that
    does not fsync), or for a file without a descriptor, it is a plain pass-through.

    :meth:`writev` writes many buffers where they lie, in one call (the container writer's
    chunks, from the pinned memory they were copied to from the GPU)."""

    def __init__(self, f: IO[bytes], window: int | None = None) -> None:
        self._f = f
        self._window = WRITEBACK_BYTES if window is None else window
        self._pos = 0
        self._started = 0
        try:
            self._fileno: int | None = f.fileno()
        except (AttributeError, OSError, ValueError):
            self._fileno = None
        self._fd = self._fileno if self._window > 0 and hasattr(os, "posix_fadvise") else None

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        n = len(memoryview(data).cast("B")) if n is None else n
        self._wrote(n)
        return n

    def writev(self, views: Sequence[memoryview]) -> int:
        """Write ``views`` in order from where they lie (:func:`write_vectors`; the file object's
        buffer flushed first); returns the bytes written."""
        if self._fileno is None:
            return sum(self.write(v) for v in views)
        self._f.flush()
        n = write_vectors(self._fileno, views)
        self._wrote(n)
        return n

    def _wrote(self, n: int) -> None:
        self._pos += n
        if self._fd is not None and self._pos - self._started >= self._window:
            self._f.flush()
            try:
                os.posix_fadvise(self._fd, self._started, self._pos - self._started, os.POSIX_FADV_DONTNEED)
            except OSError:
                self._fd = None  # not supported here: stop trying
            self._started = self._pos

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


#: buffers one ``os.writev`` call takes at most (POSIX's IOV_MAX; 1024 on Linux)
IOV_MAX = 1024
with contextlib.suppress(AttributeError, ValueError, OSError):
    IOV_MAX = max(16, min(IOV_MAX, os.sysconf("SC_IOV_MAX")))


def write_vectors(fd: int, views: Sequence[memoryview]) -> int:
    """Write the byte views ``views`` to ``fd`` in order, with ``os.writev`` (the GIL released for
    each call, up to :data:`IOV_MAX` buffers a call; a short write goes on from where it stopped);
    ``os.write`` of each where there is no ``writev``. Returns the bytes written."""
    total = 0
    pending = [v for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        run = pending[i : i + IOV_MAX]
        n = os.writev(fd, run) if hasattr(os, "writev") else os.write(fd, run[0])
        if n <= 0:
            raise OSError(errno.EIO, f"write of {sum(v.nbytes for v in run)} bytes wrote {n}")
        total += n
        for v in run:  # past the views written whole; a partly written one goes on from its rest
            if n < v.nbytes:
                pending[i] = v[n:]
                break
            n -= v.nbytes
            i += 1
    return total


#: characters no name from a file or a caller may hold: NUL and the other C0 controls, DEL and the
#: C1 controls (a terminal escape in a name, a NUL that the OS refuses with a ValueError)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def name_parts(name: Any, what: str = "name", error: type[S4WError] = UnsafePathError) -> list[str]:
    """The ``/``-separated components of a relative ``name`` that a file or a caller gave and that
    becomes a path under a folder the library owns (a store object key, a packed folder's file, a
    pointer's store). Refused, as ``error(...)`` naming ``what`` and the name: not a non-empty
    string, an absolute name, an empty, ``.`` or ``..`` component, a backslash, a NUL byte or any
    other control character.

    Example:
        >>> name_parts("data/step_000000000001.ab12.s4w")
        ['data', 'step_000000000001.ab12.s4w']
    """
    if not isinstance(name, str) or not name:
        raise error(f"{what} must be a non-empty string, got {name!r}")
    parts = name.split("/")
    bad = (
        "an absolute path" if name.startswith("/") else
        "a '..' component" if ".." in parts else
        "an empty or '.' component" if "" in parts or "." in parts else
        "a backslash" if "\\" in name or (os.altsep and os.altsep in name) else
        "a NUL byte" if "\x00" in name else
        "a control character" if _CONTROL.search(name) else
        None
    )
    if bad is not None:
        raise error(f"{what} {name!r} is unsafe ({bad}): names must be relative, '/'-separated, printable")
    return parts


def is_safe_name(name: Any) -> bool:
    """Whether :func:`name_parts` accepts ``name``."""
    try:
        name_parts(name)
    except UnsafePathError:
        return False
    return True


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
def atomic_write(path: str | os.PathLike[str], prefix: str = ".s4w-", *, durable: bool = True) -> Iterator[IO[bytes]]:
    """Yield a binary file; on normal exit its bytes appear at ``path`` atomically and durably.

    The data goes to a temporary file in the same directory (mode 0666 & ~umask, as ``open``
    would give), which is flushed, fsync'ed and renamed over ``path``; the directory is fsync'ed
    too. On an exception the temporary file is removed and ``path`` is untouched.
    ``durable=False``: no fsync (atomic against the process dying, not against a power loss).
    """
    dest = os.fspath(path)
    d = os.path.dirname(os.path.abspath(dest))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=d)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            yield EarlyWriteback(f, None if durable else 0)  # type: ignore[misc]
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(d)


#: whether :func:`open_dir_nofollow` / :func:`atomic_write_at` work here (``O_NOFOLLOW`` and
#: ``dir_fd`` support: Linux, macOS, the BSDs)
NOFOLLOW_AT = hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY") and os.open in os.supports_dir_fd


def open_dir_nofollow(root_fd: int, parts: Sequence[str], where: str = "", *, create: bool = True) -> int:
    """A descriptor of the directory ``root_fd/parts[0]/parts[1]/...``: each component created
    when missing (if ``create``) and opened with ``O_NOFOLLOW``, so a symbolic link on the way (one
    planted to point outside the target) is refused, never followed. The caller closes the
    descriptor.

    Raises:
        UnsafePathError: a component is a symbolic link or not a directory.
        FileNotFoundError: a component is missing and ``create`` is false.
    """
    fd = os.dup(root_fd)
    try:
        for i, p in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(p, 0o777, dir_fd=fd)
            try:
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(
                        f"{os.path.join(where, *parts[: i + 1])} is a symbolic link or not a directory: "
                        "refusing to write through it"
                    ) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def atomic_write_at(dir_fd: int, name: str, prefix: str = ".s4w-") -> Iterator[IO[bytes]]:
    """:func:`atomic_write` of the file ``name`` in the directory open as ``dir_fd`` (from
    :func:`open_dir_nofollow`): the temporary file is created there with ``O_EXCL | O_NOFOLLOW``
    and renamed over ``name`` inside the same directory (a symbolic link at ``name`` is replaced,
    not followed)."""
    tmp = f"{prefix}{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            yield EarlyWriteback(f)  # type: ignore[misc]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)


def store_error(path: str, e: OSError, what: str = "write") -> StoreError:
    """A :class:`StoreError` for the ``OSError`` ``e`` met while doing ``what`` at ``path``: names
    the path and the error (``ENOSPC`` as "no space left on device"). Raise it ``from e``."""
    code = errno.errorcode.get(e.errno or 0, "")
    reason = f"{code}: {e.strerror}" if code and e.strerror else str(e)
    if e.errno == errno.ENOSPC:
        reason = f"ENOSPC: no space left on device ({e.strerror or e})"
    return StoreError(f"{path}: cannot {what} ({reason})")


@contextlib.contextmanager
def storage_errors(path: str, what: str = "write") -> Iterator[None]:
    """Turn an ``OSError`` raised inside into :func:`store_error` (``__cause__`` is the original).
    S4WErrors pass as they are. Writers inside (:func:`atomic_write`) have removed their temporary
    file by then."""
    try:
        yield
    except S4WError:
        raise
    except OSError as e:
        raise store_error(path, e, what) from e


class WriteThrough:
    """A write-only file object over ``f`` whose ``write`` -- and ``writev``, offered only where
    ``f`` has it (a local file: a container's chunks written where they lie) -- go through
    :meth:`through`, which a subclass overrides to count, time or stop them."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        return self.through(self._f.write, data)

    @property
    def writev(self) -> Callable[[Any], int] | None:
        """``f``'s ``writev`` through :meth:`through`; ``None`` where it has none (the container
        writer then joins what it gathered into one write)."""
        return self._writev if callable(getattr(self._f, "writev", None)) else None

    def _writev(self, views: Any) -> int:
        return self.through(self._f.writev, views)

    def through(self, fn: Callable[[Any], Any], data: Any) -> int:
        """``fn(data)`` (a write of ``data``): its byte count (``len(data)`` where ``fn`` returns None)."""
        n = fn(data)
        return len(data) if n is None else int(n)

"""Byte layout of one s4weights file (trailer-last; see docs/FORMAT.md)::

    offset 0        header   16 B   MAGIC(8) | u16 version | u16 flags | u32 reserved(0)
    offset 16       data     chunks back to back, no gaps (readers assume no order)
    offset M        manifest UTF-8 JSON, or one zstd frame of it (flag bit 0), M = manifest_offset
    offset size-32  trailer  32 B   u64 manifest_offset | u64 manifest_length |
                                    u64 xxh3-64(stored manifest) | TRAILER_MAGIC(8)

All integers little-endian.  The manifest comes last so a writer can stream chunks out (to a
file, a pipe or a multipart S3 upload) as they are encoded, without knowing sizes in advance and
without seeking back.

Header flags: bit 0 (:data:`FLAG_MANIFEST_ZSTD`) says the stored manifest is one zstd frame
(declaring its content size) of the JSON text; ``manifest_length`` and the trailer checksum are
those of the stored (compressed) bytes, which a reader checks before it decompresses, and the
JSON text is bounded by :data:`MAX_MANIFEST_BYTES` like a stored one. Any other flag bit is
rejected (:class:`UnsupportedVersionError`): a reader that predates a bit fails clearly. Files
without the flag (every file written before it, and those whose manifest zstd does not shrink) keep
plain JSON. The writer keeps the header in its first write block and sets the flag when it writes
the manifest; only a writer that had to flush the header earlier (more than 16 MiB of chunks, or
chunks handed to a file's ``writev`` by :meth:`ContainerWriter.add_chunks`) sets it at that first
flush and then always compresses (a JSON manifest zstd cannot shrink costs at most the frame's ~12
bytes there).
"""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import threading
from typing import IO, Any, Callable, Sequence

import numpy as np
import xxhash

from s4w_core.checksum import xxh3_hex_holding_gil
from s4w_core.errors import (
    BadMagicError,
    ChecksumMismatchError,
    ManifestError,
    TruncatedError,
    UnsupportedVersionError,
)
from s4w_core.format.limits import ENV_VAR, get_limits

__all__ = [
    "in_memory_file",
    "MAGIC",
    "FLAG_MANIFEST_ZSTD",
    "TRAILER_MAGIC",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "TRAILER_SIZE",
    "MAX_MANIFEST_BYTES",
    "ContainerWriter",
    "ContainerReader",
]

MAGIC = b"S4WCKPT\x00"
TRAILER_MAGIC = b"S4WEND\x00\x00"
FORMAT_VERSION = 1
HEADER_SIZE = 16
TRAILER_SIZE = 32
#: A reader refuses a manifest larger than this (a forged length must not size an allocation), stored
#: or decompressed.
MAX_MANIFEST_BYTES = 1 << 30
#: header flag bit 0: the stored manifest is one zstd frame of the JSON text (docs/FORMAT.md 2.3)
FLAG_MANIFEST_ZSTD = 0x0001
#: the flag bits this reader knows; any other set bit is refused
KNOWN_FLAGS = FLAG_MANIFEST_ZSTD
#: zstd level of the manifest: level 1 measured as small as levels 3-12 on real manifests (the hex
#: checksums are most of the bytes; 70 KB of a bf16 training state to 9.8 KB, 7.2x) in 0.4 ms;
#: levels 15-19 gain another 9% of that in 16-65 ms of every save (measured on the CPU VM; the
#: table is in git history under benchmarks/results/)
MANIFEST_ZSTD_LEVEL = 1
#: bytes of JSON the reader decompresses at a time (what it allocates follows the output produced)
_MANIFEST_PIECE = 1 << 20

_HEADER = struct.Struct("<8sHHI")
_TRAILER = struct.Struct("<QQQ8s")

ReadRange = Callable[[int, int], bytes]
#: ``readinto(offset, buffers) -> int``: fill ``buffers`` in turn with consecutive bytes from
#: ``offset`` on (a scatter read, like ``preadv``); returns the bytes read, fewer than the buffers
#: hold only at the end of the object. Thread-safe.
ReadInto = Callable[[int, Sequence[memoryview]], int]

#: buffers one ``os.preadv`` call takes (IOV_MAX on Linux and macOS)
_IOV_MAX = 1024


def pread_into(fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
    """:data:`ReadInto` over a file descriptor: ``os.preadv`` straight into ``bufs`` (at most
    ``IOV_MAX`` buffers a call, again after a short read) until they are full or the file ends.
    Returns the bytes read. ``OSError`` propagates."""
    views = [b.cast("B") for b in bufs if b.nbytes]
    total = i = 0
    while i < len(views):
        n = os.preadv(fd, views[i : i + _IOV_MAX], offset + total)
        if n == 0:  # end of file
            break
        total += n
        while n:  # skip the buffers this call filled; a partly filled one keeps its rest
            k = views[i].nbytes
            if n < k:
                views[i] = views[i][n:]
                break
            n -= k
            i += 1
    return total


#: copies of at least this many bytes go through numpy, which releases the GIL while it copies
#: (a memoryview assignment holds it: a download thread copying 64 MiB stalls every other thread)
_NP_COPY = 256 << 10


def copy_bytes(dst: memoryview, src: Any) -> None:
    """``dst[:] = src`` (same length, contiguous bytes) without holding the GIL for large copies."""
    if dst.nbytes >= _NP_COPY:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


def copy_into(src: memoryview, offset: int, bufs: Sequence[memoryview]) -> int:
    """:data:`ReadInto` over bytes already in memory: ``src[offset:]`` copied into ``bufs`` in
    turn until they are full or ``src`` ends. Returns the bytes copied."""
    src = src.cast("B")
    pos = offset
    for b in bufs:
        b = b.cast("B")
        n = max(0, min(b.nbytes, src.nbytes - pos))
        copy_bytes(b[:n], src[pos : pos + n])
        pos += n
        if n < b.nbytes:
            break
    return pos - offset


#: bytes a writer gathers before one ``write`` to its file object: a write to a file or an S3
#: stream releases the GIL, and a thread that gives it up waits up to the switch interval (5 ms) to
#: get it back while another thread runs Python -- per 512 KiB chunk that made an upload beside a
#: busy thread 8x slower (``benchmarks/bench_s3_fetch.py --write``)
_WRITE_BLOCK = 16 << 20
#: the block copies are gathered in starts this large and doubles as it fills, up to
#: :data:`_WRITE_BLOCK`: a small container (a training state of a few MB) never allocates and
#: touches 16 MiB (every save then left the block's pages resident: +16 MiB of peak RSS per thread)
_FIRST_BLOCK = 256 << 10
#: chunks handed over together (:meth:`ContainerWriter.add_chunks`) of at least this many bytes go to a
#: file that takes ``writev`` where they lie; fewer are gathered
_DIRECT_BYTES = 1 << 20


def in_memory_file(fp: Any) -> bool:
    """Whether ``fp`` is a plain in-memory file (an :class:`io.BytesIO` with its own ``write``): a
    write there is a copy, with no system call and no GIL hand-off to gather for."""
    return isinstance(fp, io.BytesIO) and type(fp).write is io.BytesIO.write


class ContainerWriter:
    """Streams a container to a binary file object: ``add_chunk`` in order, then ``finish``.

    Chunks are gathered into writes of up to 16 MiB (a larger chunk is written as it is). A file
    with ``writev`` (a local file) takes each gathered write as one vector write: an immutable
    ``bytes`` chunk (what the CPU coders return) is held where it lies, any other buffer copied
    into the writer's block (its owner may reuse it at once: the GPU writer's pinned read-back
    buffers). Any other file (an S3 stream) gets every byte copied into the block, written in one
    call. A plain in-memory file takes each chunk as it comes. Every byte has been written to
    ``fp`` when :meth:`finish` returns, and a write error is raised by the call that flushed it."""

    def __init__(self, fp: IO[bytes]) -> None:
        self._fp = fp
        self._direct = in_memory_file(fp)
        self._writev = getattr(fp, "writev", None)
        self._pending: list[memoryview] = []  # with writev: the gathered pieces, in order
        self._buf: memoryview | None = None  # the block copies go to, allocated at the first, grown as it fills
        self._used = 0  # its bytes in use
        self._fill = 0  # the bytes gathered, not yet written
        #: header flags; ``None`` while the header is still unwritten (the first piece gathered)
        self._flags: int | None = None
        self._pos = HEADER_SIZE
        self.data_bytes = 0
        if self._direct:  # the header's flags are fixed in place at the end
            self._fp.write(_HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0))
            self._start = fp.tell() - HEADER_SIZE
        else:
            self._write(_HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0))

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._direct:
            self._fp.write(view)
            return
        if self._fill and self._fill + n > _WRITE_BLOCK:
            self._flush()
        if n >= _WRITE_BLOCK:  # (the header went with the flush above: it is always gathered first)
            self._fp.write(view)
            return
        if self._writev is not None and isinstance(view.obj, bytes):
            self._pending.append(view)  # nobody can change it: held where it lies
        else:
            if self._buf is None or self._used + n > len(self._buf):
                self._grow(self._used + n)
            assert self._buf is not None
            region = self._buf[self._used : self._used + n]
            region[:] = view  # a copy holding the GIL: ``data`` may be reused at once
            self._used += n
            if self._writev is not None:
                self._pending.append(region)
        self._fill += n

    def _grow(self, need: int) -> None:
        """A block of at least ``need`` (<= :data:`_WRITE_BLOCK`) bytes. Without ``writev`` it holds
        everything gathered (what the old one held is copied over); with it, the pieces gathered in
        the old one stay there (their views keep it) and the new one starts empty."""
        size = _FIRST_BLOCK if self._buf is None else 2 * len(self._buf)
        while size < need:
            size *= 2
        buf = memoryview(bytearray(min(size, _WRITE_BLOCK)))
        if self._writev is not None:
            self._used = 0
        elif self._buf is not None and self._used:
            buf[: self._used] = self._buf[: self._used]
        self._buf = buf

    def _commit_header(self, flags: int) -> None:
        """Fix the header's flags before the header is written (the first piece gathered; an
        in-memory file's in place)."""
        if self._flags is None:
            self._flags = flags
            header = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, 0)
            if self._direct:
                self._fp.getbuffer()[self._start : self._start + HEADER_SIZE] = header  # type: ignore[attr-defined]
            elif self._writev is not None:
                self._pending[0] = memoryview(header)
            else:
                assert self._buf is not None
                self._buf[:HEADER_SIZE] = header

    def _flush(self) -> None:
        """Write the gathered bytes (a file object must not keep the buffer it was given, so the
        block is reused). The first flush writes the header: the manifest will be compressed."""
        if not self._fill:
            return
        self._commit_header(FLAG_MANIFEST_ZSTD)
        n, self._fill = self._fill, 0
        if self._writev is None:  # every gathered byte is in the block, in order
            assert self._buf is not None
            self._fp.write(self._buf[:n])
        else:
            pieces, self._pending = self._pending, []
            if len(pieces) == 1:
                self._fp.write(pieces[0])
            else:
                self._writev(pieces)
        self._used = 0

    def add_chunk(self, data: bytes | bytearray | memoryview) -> tuple[int, int, str]:
        """Append one chunk; returns ``(offset, length, xxh3-64 hex)`` for the manifest."""
        off = self._pos
        n = memoryview(data).nbytes
        self._write(data)
        self._pos += n
        self.data_bytes += n
        return off, n, xxh3_hex_holding_gil(data)

    def add_chunks(self, chunks: Sequence[bytes | bytearray | memoryview]) -> list[tuple[int, int, str]]:
        """:meth:`add_chunk` for each of ``chunks``, in order. A file object with ``writev(views)``
        (a local file, :class:`~s4w_core._fsutil.EarlyWriteback`) is handed them where they lie in
        one call when they are :data:`_DIRECT_BYTES` or more: no copy into the write block (a copy
        holding the GIL, of every byte a save writes), and the GIL released for the whole write.
        Smaller hand-overs (a small storage's chunks), and other file objects, take them as
        :meth:`add_chunk` (gathered into the block: no write, no GIL hand-off each)."""
        views = [memoryview(c).cast("B") for c in chunks]
        writev = getattr(self._fp, "writev", None)
        if writev is None or sum(v.nbytes for v in views) < _DIRECT_BYTES:
            return [self.add_chunk(v) for v in views]
        self._flush()  # the header and any gathered bytes go first
        placed = []
        for v in views:
            n = v.nbytes
            placed.append((self._pos, n, xxh3_hex_holding_gil(v)))
            self._pos += n
            self.data_bytes += n
        writev(views)  # (empty views are skipped there)
        return placed

    def finish(self, manifest: dict[str, Any]) -> int:
        """Write manifest and trailer; returns the container's total size. The manifest is stored
        as one zstd frame when that is smaller (header flag :data:`FLAG_MANIFEST_ZSTD`), as plain
        JSON otherwise; a writer that already wrote its header compresses in any case."""
        body = json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode("utf-8")
        import zstandard

        packed = zstandard.ZstdCompressor(
            level=MANIFEST_ZSTD_LEVEL, write_content_size=True, write_checksum=False, write_dict_id=False
        ).compress(body)
        if self._flags is None:
            self._commit_header(FLAG_MANIFEST_ZSTD if len(packed) < len(body) else 0)
        if self._flags:
            body = packed
        off = self._pos
        self._write(body)
        self._write(_TRAILER.pack(off, len(body), xxhash.xxh3_64_intdigest(body), TRAILER_MAGIC))
        self._flush()
        self._pos += len(body) + TRAILER_SIZE
        return self._pos


def manifest_cap(stored_len: int, compressed: bool) -> int:
    """The most JSON text a manifest stored in ``stored_len`` bytes may have: the format's
    :data:`MAX_MANIFEST_BYTES` and the ``manifest_bytes`` limit (:mod:`s4w_core.format.limits`);
    a compressed one also at most ``manifest_inflation`` times its stored size, or
    ``manifest_free`` bytes, whichever is larger (what a zstd bomb can claim is tied to the file)."""
    lim = get_limits()
    cap = min(MAX_MANIFEST_BYTES, lim.manifest_bytes)
    if compressed:
        cap = min(cap, max(lim.manifest_free, lim.manifest_inflation * stored_len))
    return cap


def _cap_hint(cap: int) -> str:
    return (
        f"more than the {cap} a manifest may have here (docs/SECURITY.md: raise the limit with "
        f"{ENV_VAR}=manifest_bytes=...,manifest_inflation=... if the file is trusted)"
    )


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed in a manifest (non-finite floats are tagged)")


def _finite(text: str) -> float:
    v = float(text)
    if v - v != 0.0:  # inf (an exponent past the double range: 1e999); NaN cannot be spelled as a number
        raise ValueError(f"{text[:40]!r} is not a finite float (non-finite floats are tagged)")
    return v


def parse_manifest_json(text: bytes, name: str = "<container>") -> Any:
    """The JSON value of a manifest's text: UTF-8, no ``NaN``/``Infinity`` (as literals, or as a
    number past the double range). Raises ManifestError."""
    try:
        return json.loads(text.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digit limit, NaN
        raise ManifestError(f"{name}: manifest is not valid JSON: {e}") from e


def inflate_manifest(stored: bytes, name: str = "<container>") -> bytes:
    """The JSON text of a manifest stored as one zstd frame (header flag :data:`FLAG_MANIFEST_ZSTD`).

    The frame must declare its content size, at most :func:`manifest_cap` (the format's
    :data:`MAX_MANIFEST_BYTES`, and the limits tied to the stored size), and decode to exactly
    that many bytes. It is decompressed a piece at a time, so what is allocated grows with
    the output actually produced, never with a declared number, and stops one piece past the
    declared size (a zip bomb, a second frame). Raises :class:`ManifestError` naming the problem:
    not a zstd frame, no or too large a declared size, corrupt, or a different length."""
    import zstandard

    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise ManifestError(f"{name}: compressed manifest is not a zstd frame: {e}") from e
    if declared < 0:
        raise ManifestError(f"{name}: compressed manifest's zstd frame does not declare its size")
    cap = manifest_cap(len(stored), True)
    if declared > cap:
        raise ManifestError(f"{name}: compressed manifest of {len(stored)} bytes declares {declared} bytes, {_cap_hint(cap)}")
    pieces: list[bytes] = []
    total = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False) as r:
            while total <= declared:
                got = r.read(min(_MANIFEST_PIECE, declared + 1 - total))
                if not got:
                    break
                total += len(got)
                pieces.append(got)
    except zstandard.ZstdError as e:
        raise ManifestError(f"{name}: compressed manifest is corrupt (zstd: {e})") from e
    if total != declared:
        raise ManifestError(
            f"{name}: compressed manifest decodes to {'more than ' if total > declared else ''}{total} bytes, "
            f"but its frame declares {declared}: corrupt"
        )
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class ContainerReader:
    """Random-access reader over a container of known ``size``.

    ``read_range(offset, length)`` returns exactly those bytes (a file, an mmap, an S3 ranged GET);
    ``readinto`` (optional, :data:`ReadInto`) reads into the caller's buffers instead, which
    :meth:`read_into` uses when it is given (no intermediate ``bytes``); ``view`` (optional, the
    whole container as one byte view) makes :meth:`read_chunk` return views of it instead of copies.
    The constructor reads and checks header, trailer and manifest checksum; it does not read data.
    """

    def __init__(
        self,
        read_range: ReadRange,
        size: int,
        name: str = "<container>",
        *,
        readinto: ReadInto | None = None,
        view: memoryview | None = None,
    ) -> None:
        self.name = name
        self.size = size
        self._read = read_range
        self._readinto = readinto
        self._view = view  # the whole container in memory (from_bytes): chunks are read as views of it
        self._fp: IO[bytes] | None = None
        if size < HEADER_SIZE + TRAILER_SIZE:
            raise TruncatedError(
                f"{name}: {size} bytes is shorter than an s4weights header and trailer "
                f"({HEADER_SIZE + TRAILER_SIZE} bytes): truncated or not an s4weights file"
            )
        magic, version, _flags, _res = _HEADER.unpack(self._exact(0, HEADER_SIZE))
        if magic != MAGIC:
            raise BadMagicError(f"{name}: not an s4weights file (bad magic {magic!r})")
        if version != FORMAT_VERSION:
            raise UnsupportedVersionError(
                f"{name}: format version {version}; this s4weights reads version {FORMAT_VERSION}"
                + (": upgrade s4weights" if version > FORMAT_VERSION else "")
            )
        if _flags & ~KNOWN_FLAGS or _res:
            raise UnsupportedVersionError(
                f"{name}: header flags {_flags & ~KNOWN_FLAGS:#x} / reserved {_res:#x} are set, which format "
                f"version {version} does not define here: written by a newer s4weights (upgrade s4weights), "
                "or corrupt"
            )
        self.version = version
        self.flags = _flags
        moff, mlen, mhash, tmagic = _TRAILER.unpack(self._exact(size - TRAILER_SIZE, TRAILER_SIZE))
        if tmagic != TRAILER_MAGIC:
            raise TruncatedError(
                f"{name}: no s4weights trailer at the end of the file: it is truncated or was not "
                "completely written"
            )
        if moff < HEADER_SIZE or mlen > MAX_MANIFEST_BYTES or moff + mlen != size - TRAILER_SIZE:
            raise ManifestError(
                f"{name}: trailer gives manifest offset {moff} and length {mlen}, which do not fit a "
                f"{size}-byte file"
            )
        if not _flags & FLAG_MANIFEST_ZSTD and mlen > manifest_cap(mlen, False):
            raise ManifestError(f"{name}: manifest of {mlen} bytes is {_cap_hint(manifest_cap(mlen, False))}")
        body = self._exact(moff, mlen)
        if xxhash.xxh3_64_intdigest(body) != mhash:
            raise ChecksumMismatchError(f"{name}: manifest checksum mismatch: the manifest is corrupt")
        if _flags & FLAG_MANIFEST_ZSTD:
            body = inflate_manifest(body, name)
        manifest = parse_manifest_json(body, name)
        if not isinstance(manifest, dict):
            raise ManifestError(f"{name}: manifest is not a JSON object")
        self.manifest: dict[str, Any] = manifest
        self.data_start = HEADER_SIZE
        self.data_end = moff

    def _exact(self, offset: int, length: int) -> bytes:
        data = self._read(offset, length)
        if len(data) != length:
            raise self._truncated(offset, length, len(data))
        return data

    def _truncated(self, offset: int, length: int, got: int) -> TruncatedError:
        return TruncatedError(f"{self.name}: wanted {length} bytes at offset {offset}, got {got}: truncated")

    def check_range(self, offset: int, length: int) -> None:
        """Raise :class:`ManifestError` unless ``[offset, +length)`` lies inside the data section."""
        if offset < self.data_start or offset + length > self.data_end:
            raise ManifestError(f"{self.name}: chunk [{offset}, +{length}) lies outside the data section")

    def read_chunk(self, offset: int, length: int) -> bytes | memoryview:
        """The stored bytes of one chunk: a view into the container for a reader over bytes in
        memory (:meth:`from_bytes`: no copy), else ``bytes``."""
        self.check_range(offset, length)
        if self._view is not None:
            return self._view[offset : offset + length]
        return self._exact(offset, length)

    def read_into(self, offset: int, bufs: memoryview | Sequence[memoryview]) -> None:
        """Fill ``bufs`` (one writable buffer, or several filled in turn: consecutive bytes of the
        container scattered to separate places) with the data-section bytes from ``offset`` on.

        Raises :class:`ManifestError` when the range leaves the data section (as :meth:`read_chunk`)
        and :class:`TruncatedError` when the object ends first.
        """
        views = [bufs] if isinstance(bufs, memoryview) else list(bufs)
        length = sum(v.nbytes for v in views)
        self.check_range(offset, length)
        if self._readinto is not None:
            got = self._readinto(offset, views)
        else:
            got = copy_into(memoryview(self._read(offset, length)), 0, views)
        if got != length:
            raise self._truncated(offset, length, got)

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, name: str = "<bytes>") -> "ContainerReader":
        mv = memoryview(data).cast("B")
        return cls(lambda o, n: bytes(mv[o : o + n]), mv.nbytes, name, readinto=functools.partial(copy_into, mv), view=mv)

    @classmethod
    def from_file(cls, fp: IO[bytes], name: str | None = None) -> "ContainerReader":
        fp.seek(0, os.SEEK_END)
        size = fp.tell()
        try:
            fd = fp.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):
            fd = -1
        readinto: ReadInto | None = None
        if fd >= 0:

            def read_range(o: int, n: int) -> bytes:  # pread: safe from many threads at once
                return os.pread(fd, n, o)

            readinto = functools.partial(pread_into, fd)

        else:
            lock = threading.Lock()

            def read_range(o: int, n: int) -> bytes:
                with lock:
                    fp.seek(o)
                    return fp.read(n)

        reader = cls(read_range, size, name or str(getattr(fp, "name", "<file>")), readinto=readinto)
        reader._fp = fp  # keeps the file (and its descriptor) open as long as the reader lives
        return reader

    def close(self) -> None:
        fp = getattr(self, "_fp", None)
        if fp is not None:
            fp.close()

    def __enter__(self) -> "ContainerReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

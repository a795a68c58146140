"""Store a framework's checkpoint *file* compressed and give it back byte for byte. No unpickling.

Frameworks write checkpoints as files we do not control: ``model.safetensors``, ``optimizer.pt`` /
``optimizer.bin`` (``torch.save`` zip archives), ``rng_state.pth``, ``training_args.bin``...
:func:`pack_file` cuts such a file into *parts*: the tensor data regions, typed (dtype and element
count read from the safetensors header, or from the ``torch.save`` pickle by *scanning* its opcodes
with :mod:`pickletools`, never executing it), and the raw bytes between them.  The result is a plain
tree for :func:`s4w_core.save` / a :class:`CheckpointStore`: the tensors get the byte-plane codecs and,
through a store, XOR deltas against the previous checkpoint's tensor at the same path.
:func:`unpack_file` concatenates the parts again and checks the whole file's SHA-256.

Tree layout (``format`` = ``"safetensors"``, ``"torch-zip"`` or ``"raw"``)::

    {"format": str, "size": int, "sha256": hex,
     "parts": [["raw", uint8 tensor] | ["tensor", key], ...],   # in file order
     "tensors": {key: tensor}}                                   # 1-D, typed
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickletools
import struct
import zipfile
from typing import IO, Any, Iterable, Mapping

import torch

from s4w_core._fsutil import NOFOLLOW_AT, atomic_write, atomic_write_at, name_parts, open_dir_nofollow, storage_errors
from s4w_core.errors import ChecksumMismatchError, ManifestError, UnsafePathError
from s4w_core.format.limits import get_limits

__all__ = ["pack_file", "unpack_file", "unpack_bytes", "pack_folder", "unpack_folder", "replace_with_marker", "safe_parts"]

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        _ST_DTYPES[_name] = getattr(torch, _attr)

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


def _typed(buf: bytearray, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    item = dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    if nbytes % item or offset % item:
        if nbytes % item:
            dtype, item = torch.uint8, 1
        return torch.frombuffer(bytearray(buf[offset : offset + nbytes]), dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=nbytes // item, offset=offset)


def _raw(buf: bytearray, a: int, b: int) -> torch.Tensor:
    if b <= a:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8, count=b - a, offset=a)


# ----------------------------------------------------------------------------- safetensors
def _safetensors_regions(buf: bytearray) -> list[tuple[int, int, str, torch.dtype]] | None:
    """The tensor regions of a safetensors file, or None when it is not one we can follow."""
    if len(buf) < 8:
        return None
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > get_limits().safetensors_header_bytes or 8 + n > len(buf):
        return None
    try:
        header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    start = 8 + n
    out = []
    for name, v in header.items():
        if name == "__metadata__":
            continue
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)):
            return None
        a, b = offs
        dt = _ST_DTYPES.get(str(v.get("dtype")), torch.uint8)
        if not (0 <= a <= b <= len(buf) - start):
            return None
        out.append((start + a, start + b, name, dt))
    return out


# ----------------------------------------------------------------------------- torch.save zip
_UNKNOWN = object()


class _Mark:
    pass


class _GiveUp(Exception):
    """The pickle scan stops: the file's storages stay untyped bytes (still stored exactly)."""


_TEXT_OPS = frozenset(
    ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BINSTRING", "SHORT_BINSTRING", "STRING")
)
_INT_OPS = frozenset(("BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4"))


def _scan_pickle(pkl: bytes, max_ops: int | None = None) -> dict[str, tuple[torch.dtype, int]]:
    """Storage key -> (dtype, numel) from a torch.save pickle, by symbolic execution of its opcodes
    (only strings, ints, globals and tuples are tracked; nothing is imported or called).

    Linear in the pickle's size: marks are kept on their own stack (as the unpickler's
    metastack), so a ``MARK`` and the op that pops it cost O(1) and O(items) each, never a search of
    the stack. Raises :class:`_GiveUp` after ``max_ops`` opcodes (default: the ``pickle_ops``
    limit) or on a pickle it cannot follow."""
    limit = get_limits().pickle_ops if max_ops is None else max_ops
    stack: list[Any] = []
    marks: list[int] = []  # positions in ``stack`` where each open MARK's items begin
    memo: dict[int, Any] = {}
    found: dict[str, tuple[torch.dtype, int]] = {}
    ops = 0

    def pop_mark() -> int:
        if not marks:
            raise _GiveUp("pop of a MARK that is not there")
        i = marks.pop()
        return i if i <= len(stack) else len(stack)

    for op, arg, _pos in pickletools.genops(pkl):
        ops += 1
        if ops > limit:
            raise _GiveUp(f"more than {limit} pickle opcodes")
        name = op.name
        if name == "MARK":
            marks.append(len(stack))
        elif name in _TEXT_OPS or name in _INT_OPS:
            stack.append(arg)
        elif name == "GLOBAL":
            stack.append(("$global", str(arg).replace(" ", ".")))
        elif name == "STACK_GLOBAL":
            if len(stack) < 2:
                raise _GiveUp("STACK_GLOBAL on a short stack")
            qual, mod = stack.pop(), stack.pop()
            stack.append(("$global", f"{mod}.{qual}"))
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            if stack:
                memo[int(arg)] = stack[-1]  # type: ignore[arg-type]
        elif name == "MEMOIZE":
            if stack:
                memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo.get(int(arg), _UNKNOWN))  # type: ignore[arg-type]
        elif name == "TUPLE":
            i = pop_mark()
            items = tuple(stack[i:])
            del stack[i:]
            stack.append(items)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            k = int(name[-1])
            if len(stack) < k:
                raise _GiveUp(f"{name} on a short stack")
            items = tuple(stack[-k:])
            del stack[-k:]
            stack.append(items)
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name == "BINPERSID":
            pid = stack.pop() if stack else _UNKNOWN
            if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
                g, key, numel = pid[1], pid[2], pid[4]
                if isinstance(g, tuple) and g[0] == "$global" and isinstance(key, str) and isinstance(numel, int):
                    dt = _STORAGE_DTYPES.get(g[1].rsplit(".", 1)[-1])
                    if dt is not None:
                        found[key] = (dt, numel)
            stack.append(_UNKNOWN)
        else:
            before, after = op.stack_before, op.stack_after
            if pickletools.markobject in before:  # pops everything down to (and with) the last MARK
                del stack[pop_mark() :]
                before = [b for b in before if b is not pickletools.markobject and b is not pickletools.stackslice]
            n = len(before)
            if n:
                del stack[-n:]
            stack.extend(_UNKNOWN for _ in after)
    return found


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes | None:
    """The bytes of a zip member, or None when it is larger than the ``pickle_bytes`` limit or
    inflates more than ``pickle_inflation`` times its stored size (a zip bomb): checked on the
    sizes the archive declares, and again on what inflating produces (read in bounded pieces)."""
    lim = get_limits()
    cap = min(lim.pickle_bytes, max(1 << 20, lim.pickle_inflation * info.compress_size))
    if info.file_size > cap:
        return None
    pieces: list[bytes] = []
    total = 0
    with zf.open(info) as f:
        while True:
            got = f.read(min(1 << 20, cap + 1 - total))
            if not got:
                break
            total += len(got)
            if total > cap:
                return None
            pieces.append(got)
    return b"".join(pieces)


def _zip_regions(buf: bytearray) -> list[tuple[int, int, str, torch.dtype]] | None:
    """The storage regions of a ``torch.save`` zip, or None when it is not one we can follow.
    Anything the zip or pickle parsers raise on a corrupt file means "not one we can follow"."""
    import io

    try:
        return _zip_regions_of(zipfile.ZipFile(io.BytesIO(buf)), buf)
    except Exception:  # noqa: BLE001 - corrupt zips raise BadZipFile, struct.error, UnicodeDecodeError,
        # NotImplementedError, zlib.error, EOFError, RuntimeError (encrypted), ...: all mean "store it raw"
        return None


def _zip_regions_of(zf: zipfile.ZipFile, buf: bytearray) -> list[tuple[int, int, str, torch.dtype]] | None:
    infos = zf.infolist()
    pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
    if pkl is None:
        return None
    prefix = pkl.filename[: -len("data.pkl")]
    types: dict[str, tuple[torch.dtype, int]] = {}
    try:
        data = _read_member(zf, pkl)
        if data is not None:
            types = _scan_pickle(data)
    except Exception:  # noqa: BLE001 - a pickle we cannot follow: keep the storages as bytes
        types = {}
    out = []
    for i in infos:
        if not i.filename.startswith(prefix + "data/") or i.compress_type != zipfile.ZIP_STORED:
            continue
        key = i.filename[len(prefix + "data/") :]
        h = i.header_offset
        if h < 0 or buf[h : h + 4] != b"PK\x03\x04":
            return None
        n, m = struct.unpack_from("<HH", buf, h + 26)
        a = h + 30 + n + m
        b = a + i.file_size
        if b > len(buf):
            return None
        dt, numel = types.get(key, (torch.uint8, i.file_size))
        if numel * dt.itemsize != i.file_size:
            dt = torch.uint8
        out.append((a, b, key, dt))
    return out


# ----------------------------------------------------------------------------- public
def pack_file(src: str | os.PathLike[str] | bytes | bytearray) -> dict[str, Any]:
    """Cut a checkpoint file into typed tensors and raw bytes (see the module docstring).

    Args:
        src: a path, or the file's bytes.
    Returns:
        A tree of tensors and plain values for :func:`s4w_core.save` or a store; tensors view one
        in-memory copy of the file.
    Example:
        >>> import io, torch, s4w_core
        >>> from s4w_core.filepack import pack_file, unpack_bytes
        >>> b = io.BytesIO(); torch.save({"w": torch.ones(4, dtype=torch.bfloat16)}, b)
        >>> tree = pack_file(b.getvalue())
        >>> tree["format"], [t.dtype for t in tree["tensors"].values()]
        ('torch-zip', [torch.bfloat16])
        >>> unpack_bytes(tree) == b.getvalue()
        True
    """
    if isinstance(src, (bytes, bytearray)):
        buf = bytearray(src)
    else:
        with open(os.fspath(src), "rb") as f:
            buf = bytearray(f.read())
    regions = None
    fmt = "raw"
    if buf[:4] == b"PK\x03\x04":
        regions = _zip_regions(buf)
        fmt = "torch-zip" if regions is not None else "raw"
    elif len(buf) >= 10 and buf[8:9] == b"{":
        regions = _safetensors_regions(buf)
        fmt = "safetensors" if regions is not None else "raw"
    parts: list[list[Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    dup: dict[str, int] = {}
    pos = 0
    for a, b, key, dt in sorted(regions or [], key=lambda r: r[0]):
        if a < pos:  # overlapping regions: not a layout we understand; store those bytes raw
            continue
        if a > pos:
            parts.append(["raw", _raw(buf, pos, a)])
        if key in tensors:  # a name twice (zips allow it): "key+1", "key+2", ... (linear, not a search)
            k = dup.get(key, 0)
            while f"{key}+{k + 1}" in tensors:
                k += 1
            dup[key] = k + 1
            key = f"{key}+{k + 1}"
        tensors[key] = _typed(buf, a, b - a, dt)
        parts.append(["tensor", key])
        pos = b
    if pos < len(buf) or not parts:
        parts.append(["raw", _raw(buf, pos, len(buf))])
    return {
        "format": fmt,
        "size": len(buf),
        "sha256": hashlib.sha256(buf).hexdigest(),
        "parts": parts,
        "tensors": tensors,
    }


def _chunks(tree: dict[str, Any]) -> Any:
    try:
        parts, tensors = tree["parts"], tree["tensors"]
        for kind, v in parts:
            t = v if kind == "raw" else tensors[v]
            t = t.detach().cpu().contiguous().reshape(-1)
            if t.dtype != torch.uint8:
                t = t.view(torch.uint8)
            yield t.numpy().tobytes()
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise ManifestError(f"not a packed file tree ({type(e).__name__}: {e})") from e


def _write(tree: dict[str, Any], out: IO[bytes]) -> None:
    h = hashlib.sha256()
    n = 0
    for piece in _chunks(tree):
        h.update(piece)
        n += len(piece)
        out.write(piece)
    if n != tree.get("size") or h.hexdigest() != tree.get("sha256"):
        raise ChecksumMismatchError(
            f"rebuilt file has {n} bytes / sha256 {h.hexdigest()[:16]}…, expected {tree.get('size')} / "
            f"{str(tree.get('sha256'))[:16]}…"
        )


def unpack_bytes(tree: dict[str, Any]) -> bytes:
    """The original file's bytes from a :func:`pack_file` tree (SHA-256 checked).

    Raises:
        ChecksumMismatchError: the rebuilt bytes are not the packed file's.
        ManifestError: ``tree`` is not a packed file.
    """
    import io

    b = io.BytesIO()
    _write(tree, b)
    return b.getvalue()


def unpack_file(tree: dict[str, Any], dest: str | os.PathLike[str]) -> str:
    """Write the original file to ``dest`` (atomically: temp file, then rename; SHA-256 checked).

    Returns:
        ``dest`` as a string.
    Raises:
        ChecksumMismatchError: the rebuilt bytes are not the packed file's (nothing is written).
        StoreError: the file cannot be written (``ENOSPC`` and the like; nothing partial is left).
    """
    dest = os.fspath(dest)
    with storage_errors(dest):
        with atomic_write(dest) as f:
            _write(tree, f)
    return dest


# ----------------------------------------------------------------------------- folders
def pack_folder(folder: str | os.PathLike[str], *, exclude: Any = None) -> dict[str, Any]:
    """Every regular file under ``folder`` (recursively), packed: ``{"files": {relpath: tree}}``.

    Args:
        folder: a checkpoint folder (e.g. ``checkpoint-500`` of the HF Trainer).
        exclude: optional ``callable(relpath) -> bool``; files for which it is true are skipped.
    Returns:
        A tree for :func:`s4w_core.save` / ``CheckpointStore.save``. Relative paths use ``/``.
    Example:
        >>> import os, tempfile, torch
        >>> from s4w_core.filepack import pack_folder, unpack_folder
        >>> d = tempfile.mkdtemp(); torch.save({"w": torch.ones(3)}, os.path.join(d, "optimizer.pt"))
        >>> tree = pack_folder(d); sorted(tree["files"])
        ['optimizer.pt']
        >>> out = unpack_folder(tree, tempfile.mkdtemp()); sorted(os.listdir(out))
        ['optimizer.pt']
    """
    root = os.fspath(folder)
    files: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            rel = os.path.relpath(p, root).replace(os.sep, "/")
            if exclude is not None and exclude(rel):
                continue
            files[rel] = pack_file(p)
    return {"files": files}


def safe_parts(rel: Any) -> list[str]:
    """The components of a packed folder's relative path ``rel`` (``/``-separated); ManifestError
    for a path that could leave the folder or is ambiguous: absolute, ``..``, ``.`` or empty
    components, backslashes, NUL bytes or other control characters (:func:`name_parts`)."""
    return name_parts(rel, "packed folder names an unsafe path:", ManifestError)


def unpack_folder(tree: dict[str, Any], dest: str | os.PathLike[str]) -> str:
    """Write every file of a :func:`pack_folder` tree under ``dest`` (each SHA-256 checked).

    Nothing is written outside ``dest``: a path naming a place outside it is refused, and so is a
    symbolic link met on the way to a file (it is never followed: directories are opened with
    ``O_NOFOLLOW``; a symbolic link where a file goes is replaced, not written through).

    Returns:
        ``dest`` as a string.
    Raises:
        ChecksumMismatchError: a rebuilt file is not the packed one.
        ManifestError: ``tree`` is not a packed folder, or names an unsafe path (outside ``dest``,
            empty components, backslashes, NUL bytes).
        UnsafePathError: a symbolic link (or a file) stands where a directory of the tree goes.
        StoreError: a file cannot be written (``ENOSPC`` and the like).
    """
    dest = os.fspath(dest)
    files = tree.get("files") if isinstance(tree, dict) else None
    if not isinstance(files, dict):
        raise ManifestError("not a packed folder (no 'files')")
    checked = [(safe_parts(rel), ft) for rel, ft in files.items()]
    if not NOFOLLOW_AT:  # pragma: no cover - no O_NOFOLLOW/dir_fd (Windows): resolve and check instead
        root = os.path.realpath(dest)
        for parts, ft in checked:
            target = os.path.join(dest, *parts)
            if os.path.commonpath([root, os.path.realpath(os.path.dirname(target))]) != root:
                raise UnsafePathError(f"{target}: a symbolic link on the way leads outside {dest}")
            unpack_file(ft, target)
        return dest
    with storage_errors(dest):
        os.makedirs(dest, exist_ok=True)
        root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for parts, ft in checked:
            target = os.path.join(dest, *parts)
            with storage_errors(target):
                dfd = open_dir_nofollow(root_fd, parts[:-1], dest)
                try:
                    with atomic_write_at(dfd, parts[-1]) as f:
                        _write(ft, f)
                finally:
                    os.close(dfd)
    finally:
        os.close(root_fd)
    return dest


def replace_with_marker(
    folder: str | os.PathLike[str],
    files: Iterable[str],
    marker: str,
    record: Mapping[str, Any],
    *,
    keep: Iterable[str] = (),
) -> None:
    """Once a :func:`pack_folder` tree of ``folder`` is committed somewhere, leave in ``folder``
    only a marker: write ``record`` as JSON to ``folder/marker`` (atomically) and delete the packed
    ``files`` (paths relative to ``folder`` with ``/``), except those in ``keep``.  Files already
    gone are skipped; a folder that is gone (rotated away meanwhile) is left alone.

    The framework adapters call this after a save is durable, so that a checkpoint folder costs a
    few bytes on local disk and :func:`unpack_folder` (or the adapter's ``restore``) rebuilds it.

    Example:
        >>> import os, tempfile, torch
        >>> from s4w_core.filepack import pack_folder, replace_with_marker
        >>> d = tempfile.mkdtemp(); torch.save({"w": torch.ones(3)}, os.path.join(d, "optimizer.pt"))
        >>> tree = pack_folder(d)  # ... committed to a store here ...
        >>> replace_with_marker(d, tree["files"], "s4w_checkpoint.json", {"step": 7}); os.listdir(d)
        ['s4w_checkpoint.json']
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return
    with atomic_write(os.path.join(folder, marker)) as f:
        f.write(json.dumps(dict(record)).encode())
    spared = set(keep) | {marker}
    doomed = [safe_parts(rel) for rel in files if rel not in spared]
    if not NOFOLLOW_AT:  # pragma: no cover - no O_NOFOLLOW/dir_fd (Windows)
        for parts in doomed:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, *parts))
        return
    # deleted relative to descriptors opened without following links: a directory swapped for a
    # symbolic link since the folder was packed leads nowhere outside it
    root_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for parts in doomed:
            try:
                dfd = open_dir_nofollow(root_fd, parts[:-1], folder, create=False)
            except (UnsafePathError, FileNotFoundError):
                continue
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(parts[-1], dir_fd=dfd)
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)

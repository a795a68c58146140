"""Pointer files: a small file that names one step of a checkpoint store beside it.

Framework adapters (the Lightning plugin) write one at every checkpoint path the framework asks
for, so that several names for the same training step (``epoch=5-step=300.ckpt`` and
``last.ckpt``) share the step's data in the store instead of writing it again.  The ``s4w`` CLI
follows them: ``s4w info / verify / restore x.ckpt``.

File layout (all integers little-endian)::

    80 02 8a 0a <10 bytes> 2e        a pickle of torch's legacy-format magic number
    80 02 58 <u32 n> <n bytes> 2e    a pickle of a one-line UTF-8 message (the ``hint``)
    "s4w-pointer\\n" <u32 m> <m bytes of JSON>   {"version", "store", "step", "meta", ...}
    <payload>                        optional: an s4weights container (see below)

The first two records are there for ``torch.load`` and everything built on it
(``LightningModule.load_from_checkpoint``): it reads the magic number, then the protocol version,
finds the message instead and raises ``RuntimeError: Invalid protocol version: <message>``, one
line that says how to load the file.  Nothing in the file is ever unpickled here: the reader
compares the fixed bytes and parses the lengths itself.

``store`` is where the data is, *relative to the pointer's own folder* (``".s4w"``); a pointer can
name no other store: absolute paths, URLs, ``..`` and symlinks that lead out of the folder are
refused (:class:`PointerError`) unless the caller names that very store as the one it expects
(``expected_store=``, an identity check against the store an adapter was configured with).

The payload, when present, is the checkpoint as the writer was given it with every tensor that
is bit-identical to the stored step's tensor at the same place replaced by ``{REF_KEY: True}``:
the second name of a step stores only what differs (e.g. a callback's own state).
:func:`load` merges it over the step.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

from s4w_core import api
from s4w_core._fsutil import atomic_write, name_parts
from s4w_core.errors import CheckpointNotFoundError, FormatError, S4WError, UnsafePathError
from s4w_core.store import CheckpointStore, open_backend

__all__ = [
    "Pointer",
    "PointerError",
    "REF_KEY",
    "default_hint",
    "encode",
    "parse",
    "is_pointer",
    "read",
    "write",
    "resolve_store",
    "open_store",
    "load",
    "verify",
    "merge",
]

#: torch's legacy serialization magic number, pickled (protocol 2, LONG1)
_TORCH_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."
_MARK = b"s4w-pointer\n"
_VERSION = 1
#: the most a pointer's message and JSON header may take (a pointer is small; a forged length
#: never makes the reader allocate more)
MAX_HINT_BYTES = 4096
MAX_HEADER_BYTES = 1 << 16
#: the placeholder a payload holds where the stored step's tensor at the same place belongs
REF_KEY = "__s4w_pointer_ref__"


class PointerError(FormatError):
    """A pointer file is malformed, or names a store it may not name (outside its folder)."""


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says."""

    path: str  #: where the pointer file is (as given)
    store: str  #: the store as recorded: relative to the pointer's folder (or an expected store's URL)
    step: int  #: the store step
    meta: dict[str, Any] = field(default_factory=dict)  #: the writer's small metadata (global_step, epoch...)
    payload: bytes | None = None  #: an s4weights container merged over the step on load, or None

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def _is_s3(path: str) -> bool:
    return path.startswith("s3://")


def _one_line(s: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in s)[:1024]


def default_hint(name: str) -> str:
    """The message :func:`encode` writes when given none (``name``: the file's name)."""
    name = _one_line(name)
    return (
        f"{name} is an s4weights pointer into the checkpoint store beside it, not a torch file: "
        f"convert it with `s4w restore {name} --out plain.pt`"
    )


def encode(
    store: str,
    step: int,
    *,
    meta: dict[str, Any] | None = None,
    payload: bytes | None = None,
    hint: str | None = None,
    name: str = "x.ckpt",
) -> bytes:
    """The bytes of a pointer file naming ``step`` of ``store`` (``hint``: the one-line message
    ``torch.load`` shows; default: how to convert it with ``s4w restore``)."""
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    msg = _one_line(hint if hint is not None else default_hint(name)).encode()[:MAX_HINT_BYTES]
    head = json.dumps(
        {"version": _VERSION, "store": store, "step": step, "meta": dict(meta or {})},
        sort_keys=True,
        allow_nan=False,
    ).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"pointer metadata too large ({len(head)} bytes > {MAX_HEADER_BYTES})")
    return b"".join(
        (
            _TORCH_MAGIC,
            b"\x80\x02X",
            struct.pack("<I", len(msg)),
            msg,
            b".",
            _MARK,
            struct.pack("<I", len(head)),
            head,
            payload or b"",
        )
    )


def is_pointer(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` (a file's first bytes suffice) starts like a pointer file."""
    return bytes(data[: len(_TORCH_MAGIC) + 3]) == _TORCH_MAGIC + b"\x80\x02X"


def parse(data: bytes, where: str) -> Pointer:
    """Parse a pointer file's bytes (``where``: its path, for messages and for resolving)."""

    def bad(why: str) -> PointerError:
        return PointerError(f"{where}: not a valid s4weights pointer file: {why}")

    if not is_pointer(data):
        raise bad("it does not start with the pointer header")
    o = len(_TORCH_MAGIC) + 3
    if len(data) < o + 4:
        raise bad("truncated")
    (n,) = struct.unpack_from("<I", data, o)
    if n > MAX_HINT_BYTES:
        raise bad(f"message length {n} > {MAX_HINT_BYTES}")
    o += 4 + n
    if data[o : o + 1 + len(_MARK)] != b"." + _MARK:
        raise bad("no pointer record after the message")
    o += 1 + len(_MARK)
    if len(data) < o + 4:
        raise bad("truncated")
    (m,) = struct.unpack_from("<I", data, o)
    if m > MAX_HEADER_BYTES or len(data) < o + 4 + m:
        raise bad(f"header length {m} is more than the file holds or {MAX_HEADER_BYTES}")
    o += 4
    try:
        head = json.loads(data[o : o + m].decode(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(head, dict):
        raise bad("header is not a JSON object")
    if head.get("version") != _VERSION:
        raise bad(f"unsupported pointer version {head.get('version')!r}")
    store, step, meta = head.get("store"), head.get("step"), head.get("meta", {})
    if not isinstance(store, str) or not store or "\x00" in store:
        raise bad(f"'store' must be a non-empty string, got {store!r}")
    if type(step) is not int or step < 0:
        raise bad(f"'step' must be a non-negative integer, got {step!r}")
    if not isinstance(meta, dict):
        raise bad("'meta' must be an object")
    payload = bytes(data[o + m :]) or None
    return Pointer(where, store, step, meta, payload)


def _split(path: str) -> tuple[str, str]:
    if _is_s3(path):
        d, _, name = path.rstrip("/").rpartition("/")
        return d, name
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def _read_bytes(path: str, **store_options: Any) -> bytes:
    if _is_s3(path):
        d, name = _split(path)
        return open_backend(d, **store_options).get(name)  # CheckpointNotFoundError when missing
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"Checkpoint file not found: {path}") from None
    except IsADirectoryError:
        raise PointerError(f"{path} is a directory, not a pointer file") from None
    except OSError as e:
        raise CheckpointNotFoundError(f"cannot read {path}: {e}") from e


def read(path: str | os.PathLike[str], **store_options: Any) -> Pointer | None:
    """The pointer at ``path`` (local or ``s3://``), or ``None`` when the file is something else.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        PointerError: it starts like a pointer but is malformed.
    """
    p = os.fspath(path)
    if not _is_s3(p):
        try:
            with open(p, "rb") as f:
                if not is_pointer(f.read(len(_TORCH_MAGIC) + 3)):
                    return None
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(f"Checkpoint file not found: {p}") from None
        except IsADirectoryError:
            return None
    data = _read_bytes(p, **store_options)
    return parse(data, p) if is_pointer(data) else None


def write(path: str | os.PathLike[str], data: bytes) -> None:
    """Write pointer bytes (from :func:`encode`) at a local ``path``, atomically."""
    with atomic_write(os.fspath(path)) as f:
        f.write(data)


def _norm_url(url: str) -> str:
    return url.rstrip("/") if _is_s3(url) or "://" in url else os.path.abspath(url)


def resolve_store(pointer_path: str | os.PathLike[str], store: str, *, expected_store: str | None = None) -> str:
    """The store location a pointer at ``pointer_path`` recording ``store`` may use.

    ``store`` must be relative and stay inside the pointer's folder (no ``..``, no absolute path or
    URL, no symlink leading out), unless it is ``expected_store`` itself.

    Raises:
        PointerError: the pointer names a store it may not name.
    """
    p = os.fspath(pointer_path)
    if expected_store is not None and _norm_url(store) == _norm_url(expected_store):
        return expected_store
    try:
        parts = name_parts(store, "store")
        unsafe = "://" in store or os.path.isabs(store)
    except UnsafePathError:
        unsafe = True
    if unsafe:
        raise PointerError(
            f"{p} names the checkpoint store {store!r}, which is not a folder beside it; a pointer may only name "
            "its own store (e.g. '.s4w'). To read that store, name it directly: "
            f"s4w restore STORE --step N"
        )
    d, _ = _split(p)
    if _is_s3(p):
        return d + "/" + "/".join(parts)
    url = os.path.join(d, *parts)
    real, rd = os.path.realpath(url), os.path.realpath(d)
    if os.path.commonpath([real, rd]) != rd:
        raise PointerError(
            f"{p} names the checkpoint store {store!r}, which leads out of its folder (to {real}); "
            "a pointer may only name its own store"
        )
    return url


def open_store(
    ptr: Pointer,
    *,
    expected_store: str | None = None,
    opener: Callable[[str], CheckpointStore] | None = None,
    **store_options: Any,
) -> CheckpointStore:
    """The :class:`CheckpointStore` ``ptr`` names (confined, see :func:`resolve_store`); creates
    nothing.  ``opener(url)``: how to open it (default ``CheckpointStore(url, **store_options)``).

    Raises:
        CheckpointNotFoundError: the store is missing (the message says what to copy) or lacks
            the step.
    """
    url = resolve_store(ptr.path, ptr.store, expected_store=expected_store)
    missing = CheckpointNotFoundError(
        f"{ptr.path} points to step {ptr.step} of the checkpoint store {ptr.store!r} beside it, which is missing "
        f"here ({url}): copy the {ptr.store.rstrip('/')}/ folder along with the .ckpt files, or, where both are, "
        f"convert it to a plain file: s4w restore {ptr.name} --out plain.ckpt"
    )
    if not _is_s3(url) and "://" not in url and not os.path.isdir(url):
        raise missing
    st = opener(url) if opener is not None else CheckpointStore(url, **store_options)
    steps = st.steps()
    if not steps:
        raise missing
    if ptr.step not in steps:
        raise CheckpointNotFoundError(
            f"{ptr.path} points to step {ptr.step} of {url}, which does not hold it (its steps: "
            f"{', '.join(map(str, steps[-8:]))}): the step's data was deleted"
        )
    return st


def _is_ref(o: Any) -> bool:
    return isinstance(o, dict) and len(o) == 1 and o.get(REF_KEY) is True


def merge(skeleton: Any, stored: Any, where: str = "") -> Any:
    """``skeleton`` (a payload) with each ``{REF_KEY: True}`` replaced by the object at the same
    place in ``stored`` (the step's state)."""
    if _is_ref(skeleton):
        if stored is None:
            raise PointerError(f"the pointer refers to a tensor at {where or '/'} that the store step does not hold")
        return stored
    if isinstance(skeleton, dict):
        for k in list(skeleton):
            sub = stored.get(k) if isinstance(stored, dict) else None
            skeleton[k] = merge(skeleton[k], sub, f"{where}/{k}")
        return skeleton
    if type(skeleton) in (list, tuple):
        ok = type(stored) in (list, tuple)
        out = [
            merge(v, stored[i] if ok and i < len(stored) else None, f"{where}/{i}") for i, v in enumerate(skeleton)
        ]
        return out if type(skeleton) is list else tuple(out)
    return skeleton


def load(
    path: str | os.PathLike[str] | Pointer,
    map_location: api.MapLocation = "cpu",
    *,
    expected_store: str | None = None,
    opener: Callable[[str], CheckpointStore] | None = None,
    remember: bool = True,
    **store_options: Any,
) -> Any:
    """The checkpoint a pointer file stands for: its step, with the pointer's payload merged in.
    ``remember``: as for :meth:`CheckpointStore.load` (``False``: no host copy kept as the next
    save's delta base).

    Raises:
        PointerError: not a pointer file, a malformed one, or one naming another store.
        CheckpointNotFoundError: the pointer, its store or its step is missing.
    """
    ptr = path if isinstance(path, Pointer) else read(path, **store_options)
    if ptr is None:
        raise PointerError(f"{os.fspath(path)} is not an s4weights pointer file")  # type: ignore[arg-type]
    st = open_store(ptr, expected_store=expected_store, opener=opener, **store_options)
    state = st.load(ptr.step, map_location, remember=remember)
    if ptr.payload is None:
        return state
    return merge(api.load(ptr.payload, map_location=map_location), state)


def verify(path: str | os.PathLike[str], **store_options: Any) -> api.VerifyReport:
    """Check everything a pointer needs: its store and step are there, the step decodes with every
    checksum matching, and its payload too.  Never raises for a missing or corrupt part (``ok`` is
    False and ``problems`` says what)."""
    p = os.fspath(path)
    try:
        ptr = read(p, **store_options)
        if ptr is None:
            raise PointerError(f"{p} is not an s4weights pointer file")
        st = open_store(ptr, **store_options)
        rep = st.verify(ptr.step)
    except S4WError as e:
        return api.VerifyReport(p, False, 0, 0, [f"{type(e).__name__}: {e}"])
    problems = list(rep.problems)
    storages, raw = rep.storages, rep.raw_bytes
    if ptr.payload is not None:
        extra = api.verify(ptr.payload)
        problems += [f"payload: {q}" for q in extra.problems]
        storages += extra.storages
        raw += extra.raw_bytes
        if extra.ok and rep.ok:
            try:
                merge(api.load(ptr.payload), st.load(ptr.step, "cpu"))
            except S4WError as e:
                problems.append(f"{type(e).__name__}: {e}")
    where = f"{p} -> {rep.path}"
    return api.VerifyReport(where, not problems, storages, raw, problems)

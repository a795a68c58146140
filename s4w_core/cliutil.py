"""What the ``s4w`` subcommands share (:mod:`s4w_core.cli` for files, :mod:`s4w_core.store.cli`
for stores): progress bars, byte counts for humans, text from files made safe for a terminal, and
telling a foreign checkpoint file (torch.save, safetensors) from an s4weights container.

Progress bars: tqdm bars on stderr when stderr is a terminal; ``--progress`` forces them (e.g.
under a log collector), ``--no-progress`` turns them off.  Without tqdm installed there are no bars.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
import sys
from typing import Any, Iterator

import torch

from s4w_core.api import open_reader
from s4w_core.errors import BadMagicError, CheckpointNotFoundError
from s4w_core.format.container import MAGIC, ContainerReader
from s4w_core.pointer import is_pointer
from s4w_core.units import human_bytes

__all__ = [
    "add_progress_args",
    "want_progress",
    "NoBar",
    "progress_bar",
    "counted_reader",
    "device_arg",
    "CountingFile",
    "human_bytes",
    "printable",
    "file_kind",
    "check_is_container",
]


# ----------------------------------------------------------------------------- progress bars
def add_progress_args(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (default: bars when stderr is a terminal)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show progress bars on stderr (default: when stderr is a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bars")


def want_progress(args: argparse.Namespace) -> bool:
    """Whether this command shows progress bars: the flag, else whether stderr is a terminal."""
    p = getattr(args, "progress", None)
    if p is not None:
        return bool(p)
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class NoBar:
    """What :func:`progress_bar` yields when bars are off: the same calls, doing nothing."""

    total: float | None = None

    def update(self, n: float = 1) -> None:
        pass

    def refresh(self) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def write(self, s: str, file: Any = None) -> None:
        print(s, file=file if file is not None else sys.stdout)


@contextlib.contextmanager
def progress_bar(args: argparse.Namespace, desc: str, total: float | None = None, unit: str = "B") -> Iterator[Any]:
    """A tqdm bar on stderr (bytes when ``unit="B"``), or a no-op one when bars are off; print
    through its ``write`` while it runs so lines do not tear the bar."""
    if not want_progress(args):
        yield NoBar()
        return
    try:
        from tqdm.auto import tqdm  # optional: bars only where tqdm is installed
    except ImportError:
        if getattr(args, "progress", None):
            print("s4w: --progress needs tqdm: pip install tqdm", file=sys.stderr)
        yield NoBar()
        return
    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True, **scale)
    try:
        yield bar  # bar.write(line) prints to stdout (or file=) without tearing the bar
    finally:
        bar.close()


@contextlib.contextmanager
def counted_reader(path: str, bar: Any) -> Iterator[ContainerReader]:
    """A validated reader over the container at ``path`` whose reads advance ``bar`` (total: the
    data region's size)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint at {path}") from None
    try:
        def read(o: int, n: int) -> bytes:
            b = os.pread(fd, n, o)
            bar.update(len(b))
            return b

        reader = open_reader(ContainerReader(read, os.fstat(fd).st_size, path))
        bar.total = max(0, reader.data_end - reader.data_start)
        bar.refresh()
        yield reader
    finally:
        os.close(fd)


class CountingFile:
    """A file object for :func:`s4w_core.save` that advances a bar by the bytes written."""

    def __init__(self, fp: Any, bar: Any, name: str) -> None:
        self._fp = fp
        self._bar = bar
        self.name = name

    def write(self, data: Any) -> int:
        n = self._fp.write(data)
        self._bar.update(len(data) if n is None else n)
        return len(data) if n is None else int(n)


def device_arg(text: str) -> str:
    """An argparse type: a torch device name (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    try:
        torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    return text


# ----------------------------------------------------------------------------- text
def printable(s: object) -> str:
    """``str(s)`` safe to print on a terminal, on one line: control characters (C0, DEL, C1,
    which carry terminal escape sequences), line and paragraph separators are written as
    ``\\xNN`` / ``\\uNNNN`` escapes; everything else is kept.

    >>> printable("layer\\x1b[2J.weight\\n")
    'layer\\\\x1b[2J.weight\\\\x0a'
    """
    t = str(s)
    if t.isprintable():
        return t
    out = []
    for ch in t:
        o = ord(ch)
        if o < 0x20 or 0x7F <= o < 0xA0:
            out.append(f"\\x{o:02x}")
        elif not ch.isprintable() and ch != " ":
            out.append(f"\\u{o:04x}" if o <= 0xFFFF else f"\\U{o:08x}")
        else:
            out.append(ch)
    return "".join(out)


# ----------------------------------------------------------------------------- foreign files
#: the magic number torch.save's legacy (non-zip) format pickles first
_TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def file_kind(path: str) -> str | None:
    """What the regular file at ``path`` is, from its first bytes: ``"s4w"``, ``"pointer"`` (an
    s4weights pointer file, e.g. a Lightning ``.ckpt`` naming a store step), ``"torch"``
    (a torch.save file, zip or legacy format), ``"safetensors"``, or None (something else, or not a
    regular readable file)."""
    try:
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            head = f.read(32)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if head.startswith(MAGIC):
        return "s4w"
    if is_pointer(head):
        return "pointer"
    if head.startswith(b"PK\x03\x04"):
        return "torch"
    if head[:2] == b"\x80\x02" and head[2:3] == b"\x8a":  # protocol 2, then a LONG1: the legacy magic
        n = head[3]
        if int.from_bytes(head[4 : 4 + n], "little", signed=True) == _TORCH_LEGACY_MAGIC:
            return "torch"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= size - 8 and head[8:9] == b"{":
            return "safetensors"
    return None


def check_is_container(path: str) -> None:
    """Raise :class:`BadMagicError` saying what ``path`` is when it is a torch.save or safetensors
    file rather than an s4weights container (and how to import it); do nothing otherwise."""
    kind = file_kind(path)
    if kind == "pointer":
        raise BadMagicError(
            f"{path} is an s4weights pointer file (it names a step of a store): "
            f"`s4w restore {path} --out plain.ckpt` writes that step as a plain file"
        )
    if kind in ("torch", "safetensors"):
        what = "a PyTorch file (torch.save)" if kind == "torch" else "a safetensors file"
        raise BadMagicError(
            f"{path} is {what}, not an s4weights container: import it with `s4w import {path} OUT.s4w`"
        )

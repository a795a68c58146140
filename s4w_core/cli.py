"""The ``s4w`` command.

Subcommands on single files live here (info, verify, selftest, convert); store subcommands (ls,
restore, stats, ...) are registered by :mod:`s4w_core.store.cli` when the store package exists.

Long operations show tqdm progress bars on stderr when stderr is a terminal; ``--progress`` forces
them (e.g. under a log collector), ``--no-progress`` turns them off.  Without tqdm installed there
are no bars.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Callable, Iterator

__all__ = ["main", "build_parser"]


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


class _NoBar:
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
        yield _NoBar()
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if getattr(args, "progress", None):
            print("s4w: --progress needs tqdm: pip install tqdm", file=sys.stderr)
        yield _NoBar()
        return
    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True, **scale)
    try:
        yield bar  # bar.write(line) prints to stdout (or file=) without tearing the bar
    finally:
        bar.close()


@contextlib.contextmanager
def counted_reads(reader: Any, bar: Any) -> Iterator[Any]:
    """Advance ``bar`` by the bytes ``reader`` (a validated ContainerReader) reads from its data
    region on; the bar's total is that region's size."""
    if isinstance(bar, _NoBar):
        yield reader
        return
    bar.total = max(0, reader.data_end - reader.data_start)
    read = reader._read  # noqa: SLF001

    def counted(o: int, n: int) -> bytes:
        b = read(o, n)
        bar.update(len(b))
        return b

    reader._read = counted  # noqa: SLF001
    try:
        yield reader
    finally:
        reader._read = read  # noqa: SLF001


class _CountingFile:
    """A file object for :func:`s4w_core.save` that advances a bar by the bytes written."""

    def __init__(self, fp: Any, bar: Any, name: str) -> None:
        self._fp = fp
        self._bar = bar
        self.name = name

    def write(self, data: Any) -> int:
        n = self._fp.write(data)
        self._bar.update(len(data) if n is None else n)
        return len(data) if n is None else int(n)


def _cmd_info(args: argparse.Namespace) -> int:
    from s4w_core.api import _h, info

    d = info(args.path)
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))
        return 0
    print(f"{d['path']}: s4weights v{d['format_version']}, profile {d['profile']}, written by {d['writer']}")
    print(f"  {d['tensors']} tensors in {d['storages']} storages; {_h(d['raw_bytes'])} raw -> "
          f"{_h(d['stored_bytes'])} stored ({d['ratio']:.3f}x); file {_h(d['file_bytes'])}")
    for title in ("groups", "dtypes", "kinds"):
        print(f"  by {title[:-1]}:")
        for k, g in sorted(d[title].items(), key=lambda kv: -kv[1]["raw_bytes"]):
            print(f"    {k:<32} {_h(g['raw_bytes']):>10} -> {_h(g['stored_bytes']):>10}  {g['ratio']:.3f}x  ({g['tensors']} tensors)")
    print("  codec per plane (chunks):")
    for plane, codecs in sorted(d["codecs"].items()):
        print(f"    {plane:<20} " + ", ".join(f"{c}: {n}" for c, n in sorted(codecs.items())))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from s4w_core.api import open_reader, verify
    from s4w_core.errors import CheckpointNotFoundError, S4WError

    with progress_bar(args, "verify") as bar:
        reader = None
        if not isinstance(bar, _NoBar):
            try:
                reader = open_reader(args.path)
            except CheckpointNotFoundError:
                raise
            except S4WError:
                reader = None  # verify() itself reports what is wrong with the file
        if reader is None:
            rep = verify(args.path, map_location=args.map_location)
        else:
            try:
                with counted_reads(reader, bar):
                    rep = verify(reader, map_location=args.map_location)  # type: ignore[arg-type]
            finally:
                reader.close()
    if rep.ok:
        print(f"OK {rep.path}: {rep.storages} storages, {rep.raw_bytes} bytes decoded, every checksum matches")
        return 0
    for p in rep.problems:
        print(f"FAIL {rep.path}: {p}", file=sys.stderr)
    return 1


def _cmd_selftest(args: argparse.Namespace) -> int:
    from s4w_core.selftest import run_selftest

    return 0 if run_selftest(quick=args.quick, verbose=not args.quiet) else 1


def _cmd_convert(args: argparse.Namespace) -> int:
    from s4w_core._fsutil import atomic_write
    from s4w_core.api import load, open_reader, save

    if not want_progress(args):
        obj = load(args.src, map_location=args.map_location)
        rep = save(obj, args.dst, profile=args.profile)
        print(rep)
        return 0
    with progress_bar(args, f"read {args.src}") as bar:
        reader = open_reader(args.src)
        try:
            with counted_reads(reader, bar):
                obj = load(reader, map_location=args.map_location)  # type: ignore[arg-type]
        finally:
            reader.close()
    with progress_bar(args, f"write {args.dst}") as bar, atomic_write(args.dst) as f:
        rep = save(obj, _CountingFile(f, bar, args.dst), profile=args.profile)  # type: ignore[arg-type]
    rep.path = args.dst
    print(rep)
    return 0


_EXTENSIONS: list[Callable[[Any], None]] = []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s4w", description="s4weights: lossless compressed PyTorch checkpoints")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("info", help="sizes, ratios and codecs of a checkpoint file, without decoding")
    a.add_argument("path")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=_cmd_info)
    a = sub.add_parser("verify", help="decode everything and check every checksum; exit 1 on mismatch")
    a.add_argument("path")
    a.add_argument("--map-location", default="cpu")
    add_progress_args(a)
    a.set_defaults(func=_cmd_verify)
    a = sub.add_parser("selftest", help="adversarial bit-exact round trips on this machine's CPU and GPU")
    a.add_argument("--quick", action="store_true", help="fewer random patterns")
    a.add_argument("--quiet", action="store_true")
    a.set_defaults(func=_cmd_selftest)
    a = sub.add_parser("convert", help="re-encode a checkpoint file (e.g. fast GPU profile -> portable)")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--profile", default="portable", choices=["portable", "fast", "auto"])
    a.add_argument("--map-location", default=None)
    add_progress_args(a)
    a.set_defaults(func=_cmd_convert)
    try:
        from s4w_core.store import cli as store_cli
    except ImportError:
        store_cli = None  # type: ignore[assignment]
    if store_cli is not None:
        store_cli.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from s4w_core.errors import S4WError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except S4WError as e:
        print(f"s4w: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The ``s4w`` command.

Subcommands on single files live here (info, verify, selftest, convert, import); store subcommands
(ls, restore, stats, ...) are registered by :mod:`s4w_core.store.cli`.

Exit status: 0 on success; 1 when a check fails or an input is bad (a missing file, a corrupt
container, an unreachable store, ...): one line on stderr, ``s4w: error: ...``, never a
traceback; 2 for a usage error (an unknown option, a missing argument); 130 when interrupted.
Output cut short by a closed pipe (``s4w info x | head -1``) ends quietly.  ``S4W_TRACEBACK=1``
shows the traceback of an unexpected error (a bug) instead of its one line.

Long operations show tqdm progress bars on stderr when stderr is a terminal; ``--progress`` forces
them (e.g. under a log collector), ``--no-progress`` turns them off.  Without tqdm installed there
are no bars.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from typing import Any, NoReturn

import torch

from s4w_core import config, pointer
from s4w_core._fsutil import atomic_write
from s4w_core._version import __version__
from s4w_core.api import info, load, save, verify
from s4w_core.cliutil import (
    CountingFile,
    NoBar,
    add_progress_args,
    check_is_container,
    counted_reader,
    device_arg,
    file_kind,
    human_bytes,
    printable,
    progress_bar,
    want_progress,
)
from s4w_core.errors import (
    BackendUnavailableError,
    BadMagicError,
    CheckpointNotFoundError,
    ConfigError,
    FormatError,
    S4WError,
    UnsupportedTypeError,
)
from s4w_core.store import CheckpointStore
from s4w_core.store import cli as store_cli

__all__ = ["main", "build_parser", "add_progress_args", "progress_bar", "want_progress"]


def _cmd_info(args: argparse.Namespace) -> int:
    check_is_container(args.path)
    d = info(args.path)
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))  # JSON escapes control characters itself
        return 0
    p = printable
    print(f"{p(d['path'])}: s4weights v{d['format_version']}, profile {p(d['profile'])}, written by {p(d['writer'])}")
    print(f"  {d['tensors']} tensors in {d['storages']} storages; {human_bytes(d['raw_bytes'])} raw -> "
          f"{human_bytes(d['stored_bytes'])} stored ({d['ratio']:.3f}x); file {human_bytes(d['file_bytes'])}")
    for title in ("groups", "dtypes", "kinds"):
        print(f"  by {title[:-1]}:")
        for k, g in sorted(d[title].items(), key=lambda kv: -kv[1]["raw_bytes"]):
            print(f"    {p(k):<32} {human_bytes(g['raw_bytes']):>10} -> {human_bytes(g['stored_bytes']):>10}  "
                  f"{g['ratio']:.3f}x  ({g['tensors']} tensors)")
    print("  codec per plane (chunks):")
    for plane, codecs in sorted(d["codecs"].items()):
        print(f"    {p(plane):<20} " + ", ".join(f"{p(c)}: {n}" for c, n in sorted(codecs.items())))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    check_is_container(args.path)
    rep = None
    with progress_bar(args, "verify") as bar:
        if not isinstance(bar, NoBar):
            try:
                with counted_reader(args.path, bar) as reader:
                    rep = verify(reader, map_location=args.map_location)  # type: ignore[arg-type]
            except CheckpointNotFoundError:
                raise
            except S4WError:
                rep = None  # verify() itself reports what is wrong with the file
        if rep is None:
            rep = verify(args.path, map_location=args.map_location)
    if rep.ok:
        print(f"OK {printable(rep.path)}: {rep.storages} storages, {rep.raw_bytes} bytes decoded, every checksum matches")
        return 0
    if any(p.startswith("BaseMismatchError") for p in rep.problems):
        return _verify_in_store(args)
    for p in rep.problems:
        print(f"FAIL {printable(rep.path)}: {printable(p)}", file=sys.stderr)
    return 1


#: how many folders above a delta object ``s4w verify`` looks for the store that holds it
_STORE_LEVELS = 3


def _verify_in_store(args: argparse.Namespace) -> int:
    """A container holding deltas can only be checked with its base: find the local store whose
    committed step uses it and verify that step (with its chain) through the store."""
    path = os.path.abspath(args.path)
    d = os.path.dirname(path)
    for _ in range(_STORE_LEVELS):
        rel = os.path.relpath(path, d).replace(os.sep, "/")
        st = CheckpointStore(d, base_cache_bytes=0)
        try:
            recs = st.list()
            hit = [r for r in recs if rel in (r.object, r.copy)]
            if hit:
                rep = st.verify(hit[0].step)
                where = f"{printable(args.path)} is the data object of step {hit[0].step} of the store {printable(d)}"
                if rep.ok:
                    print(f"OK {where}: verified with its delta chain through the store; {rep.storages} storages, "
                          f"{rep.raw_bytes} bytes decoded, every checksum matches")
                    return 0
                for p in rep.problems:
                    print(f"FAIL {where}: {printable(p)}", file=sys.stderr)
                return 1
            if recs:
                print(f"s4w: error: {printable(args.path)} holds deltas against a base that is not in it, and no "
                      f"committed step of the store {printable(d)} uses it (left by an interrupted save? "
                      f"`s4w gc {printable(d)}` removes such objects)", file=sys.stderr)
                return 1
        finally:
            st.close()
        d = os.path.dirname(d)
    print(f"s4w: error: {printable(args.path)} holds deltas against a base checkpoint that is not in it, and no "
          "store around it uses it: verify it through its store (`s4w verify STORE --step N`)", file=sys.stderr)
    return 1


def _cmd_selftest(args: argparse.Namespace) -> int:
    from s4w_core.selftest import run_selftest  # the self-test's patterns load only when asked for

    return 0 if run_selftest(quick=args.quick, verbose=not args.quiet) else 1


def _cmd_convert(args: argparse.Namespace) -> int:
    check_is_container(args.src)
    if not want_progress(args):
        obj = load(args.src, map_location=args.map_location)
        rep = save(obj, args.dst, profile=args.profile)
        _print_report(rep)
        return 0
    with progress_bar(args, f"read {args.src}") as bar, counted_reader(args.src, bar) as reader:
        obj = load(reader, map_location=args.map_location)  # type: ignore[arg-type]
    with progress_bar(args, f"write {args.dst}") as bar, atomic_write(args.dst) as f:
        rep = save(obj, CountingFile(f, bar, args.dst), profile=args.profile)  # type: ignore[arg-type]
    rep.path = args.dst
    _print_report(rep)
    return 0


def _read_foreign(src: str, map_location: str) -> Any:
    """The object in a torch.save or safetensors file, read without running code from it."""
    if not os.path.exists(src):
        raise CheckpointNotFoundError(f"no such file: {src}")
    kind = file_kind(src)
    if kind == "s4w":
        return load(src, map_location=map_location)
    if kind == "pointer":  # a framework's .ckpt naming a store step: that step
        ptr = pointer.read(src)
        if ptr is not None:
            return pointer.load(ptr, map_location)
    if kind == "safetensors":
        try:
            from safetensors import SafetensorError
            from safetensors.torch import load_file
        except ImportError as e:  # optional dependency
            raise BackendUnavailableError(f"importing {src} needs safetensors: pip install safetensors") from e
        try:
            return load_file(src, device=map_location)
        except SafetensorError as e:
            raise FormatError(f"{src}: not a readable safetensors file: {e}") from e
    if kind == "torch":
        try:
            zipped = open(src, "rb").read(4) == b"PK\x03\x04"
            return torch.load(src, map_location=map_location, weights_only=True, mmap=zipped)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsupportedTypeError(
                f"{src}: torch.load(weights_only=True) refused it ({first}); s4w import never runs code from a file. "
                "If you trust the file: s4w_core.save(torch.load(path, weights_only=False), out)"
            ) from e
        except (RuntimeError, EOFError, ValueError) as e:
            raise FormatError(f"{src}: not a readable PyTorch file: {e}") from e
    raise BadMagicError(f"{src} is neither a PyTorch (torch.save) file, a safetensors file nor an s4weights container")


def _cmd_import(args: argparse.Namespace) -> int:
    obj = _read_foreign(args.src, args.map_location)
    rep = save(obj, args.dst, profile=args.profile)
    _print_report(rep)
    return 0


def _print_report(rep: Any) -> None:
    """A SaveReport, with the names it lists (from the input file) unable to drive the terminal."""
    for line in str(rep).splitlines():
        print(printable(line))


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (``s4w info: error: ... (see s4w info --help)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {printable(message)} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="s4w", description="s4weights: lossless compressed PyTorch checkpoints",
                epilog="exit status: 0 ok, 1 a failed check or bad input, 2 a usage error, 130 interrupted. "
                       "s3:// stores: an endpoint that does not answer, missing credentials, a missing bucket or "
                       "denied access fail within S4W_S3_DEADLINE seconds (default 15).")
    p.add_argument("--version", action="version", version=f"s4w {__version__} (torch {torch.__version__})",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    a = sub.add_parser("info", help="sizes, ratios and codecs of a checkpoint file, without decoding")
    a.add_argument("path", help="an .s4w file, or a store (a directory or s3://BUCKET/PREFIX) with --step")
    a.add_argument("--json", action="store_true", help="print a JSON object for scripts")
    a.set_defaults(func=_cmd_info)
    a = sub.add_parser("verify", help="decode everything and check every checksum; exit 1 on mismatch")
    a.add_argument("path", help="an .s4w file, or a store (a directory or s3://BUCKET/PREFIX): every step or --step")
    a.add_argument("--map-location", default="cpu", type=device_arg, help="device to decode on, e.g. cpu or cuda:0 (default: cpu)")
    add_progress_args(a)
    a.set_defaults(func=_cmd_verify)
    a = sub.add_parser("selftest", help="adversarial bit-exact round trips on this machine's CPU and GPU")
    a.add_argument("--quick", action="store_true", help="fewer random patterns")
    a.add_argument("--quiet", action="store_true", help="print only the verdict")
    a.set_defaults(func=_cmd_selftest)
    a = sub.add_parser("convert", help="re-encode a checkpoint file (e.g. fast GPU profile -> portable)")
    a.add_argument("src", help="the .s4w file to read")
    a.add_argument("dst", help="the .s4w file to write (folders above it are created)")
    a.add_argument("--profile", default="portable", choices=list(config.PROFILES),
                   help="codecs of the new file: portable (any machine), fast (GPU only), auto (default: portable)")
    a.add_argument("--map-location", default=None, type=device_arg, help="device to decode on (default: where the tensors were saved)")
    add_progress_args(a)
    a.set_defaults(func=_cmd_convert)
    a = sub.add_parser("import", help="turn a torch.save or safetensors file into an .s4w file (never runs code from it)")
    a.add_argument("src", help="a torch.save file (read with weights_only=True) or a .safetensors file")
    a.add_argument("dst", help="the .s4w file to write (folders above it are created)")
    a.add_argument("--profile", default="portable", choices=list(config.PROFILES),
                   help="codecs of the new file (default: portable)")
    a.add_argument("--map-location", default="cpu", type=device_arg, help="device to read the tensors onto (default: cpu)")
    a.set_defaults(func=_cmd_import)
    store_cli.register(sub)
    return p


def _say(msg: str) -> int:
    """One line on stderr (terminal escapes and newlines from names in files made harmless)."""
    try:
        print(f"s4w: error: {printable(msg)}", file=sys.stderr)
    except (OSError, ValueError):  # stderr is gone too
        pass
    return 1


def _quiet_stdout() -> None:
    """After a closed pipe on stdout: point it at /dev/null so the interpreter's final flush
    does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a descriptor (captured in tests)
        pass


def main(argv: list[str] | None = None) -> int:
    """Run ``s4w`` with ``argv`` (default: the process arguments); returns the exit status."""
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help, --version, usage errors
            return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
        return int(args.func(args) or 0)
    except BrokenPipeError:
        _quiet_stdout()
        return 1
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except S4WError as e:
        return _say(f"{type(e).__name__}: {e}")
    except OSError as e:
        return _say(f"{e.strerror}: {e.filename}" if e.filename and e.strerror else f"{type(e).__name__}: {e}")
    except MemoryError:
        return _say("out of memory")
    except Exception as e:
        if _wants_traceback():
            raise
        return _say(f"unexpected {type(e).__name__}: {e} (a bug in s4w? S4W_TRACEBACK=1 shows the traceback)")


def _wants_traceback() -> bool:
    """``S4W_TRACEBACK``: a value it cannot read still asks for the traceback."""
    try:
        return config.get_bool("S4W_TRACEBACK")
    except ConfigError:
        return True


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

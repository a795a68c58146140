"""The ``s4w`` command.

Subcommands on single files live here (info, verify, selftest, convert); store subcommands (ls,
restore, stats, ...) are registered by :mod:`s4w_core.store.cli` when the store package exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

__all__ = ["main", "build_parser"]


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
    from s4w_core.api import verify

    rep = verify(args.path, map_location=args.map_location)
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
    from s4w_core.api import load, save

    obj = load(args.src, map_location=args.map_location)
    rep = save(obj, args.dst, profile=args.profile)
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

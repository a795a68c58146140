"""Store subcommands of ``s4w``: ls, restore, stats, rm, gc, pin; ``info``/``verify`` on a store
URL with ``--step``.  :func:`register` is called by :func:`s4w_core.cli.build_parser`.

Progress bars (``--progress`` / ``--no-progress``, default: when stderr is a terminal): the store's
own byte bars for each step loaded or saved, plus a bar over steps or commit records for commands
that walk many (verify, ls, stats, gc, rm)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
from typing import Any, Callable, Iterator

import torch

from s4w_core import pointer
from s4w_core.api import save
from s4w_core.cliutil import add_progress_args, device_arg, human_bytes, printable, progress_bar, want_progress
from s4w_core.errors import BackendUnavailableError, CheckpointNotFoundError, StoreError, UnsupportedTypeError
from s4w_core.store.records import COMMITS as _COMMITS  # the layout docs/STORE.md documents
from s4w_core.store.store import CheckpointStore

__all__ = ["register", "is_store_url"]

_KINDS = ("weights", "exp_avg", "exp_avg_sq")


def is_store_url(path: str) -> bool:
    """A checkpoint store (s3://, memory://, or a local directory) rather than a container file."""
    p = os.fspath(path)
    return p.startswith(("s3://", "memory://", "file://")) or os.path.isdir(p)


_h = human_bytes


def _print(*parts: Any, **kw: Any) -> None:
    """print, with what came from a store's records (names, paths) unable to drive the terminal."""
    print(*(printable(x) for x in parts), **kw)

#: where a store keeps its commit records (the layout docs/STORE.md documents)


def _store(args: argparse.Namespace, **kw: Any) -> Any:
    opts: dict[str, Any] = {"base_cache_bytes": 0, "progress": want_progress(args), **kw}
    if str(args.url).startswith("s3://"):
        if getattr(args, "endpoint", None):
            opts["endpoint"] = args.endpoint
        if getattr(args, "region", None):
            opts["region"] = args.region
    elif not is_store_url(args.url):
        if os.path.exists(args.url):
            raise StoreError(
                f"{args.url} is a file, not a checkpoint store (a store is a directory or s3://BUCKET/PREFIX; "
                "for one checkpoint file use `s4w info` / `s4w verify`)"
            )
        raise CheckpointNotFoundError(f"{args.url} is not a checkpoint store (no such directory)")
    return CheckpointStore(args.url, **opts)


def _add_url(p: argparse.ArgumentParser, progress: bool = True) -> None:
    p.add_argument("url", help="the store: a directory or s3://BUCKET/PREFIX")
    p.add_argument("--endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--region", default=None, help="S3 region (default: AWS_REGION or us-east-1)")
    if progress:
        add_progress_args(p)


class _WatchedBackend:
    """The store's backend, calling ``hooks[method](args, result)`` after the methods named there
    (to drive a progress bar from the objects a store command reads or deletes)."""

    def __init__(self, inner: Any, hooks: dict[str, Callable[[tuple[Any, ...], Any], None]]) -> None:
        self._inner = inner
        self._hooks = hooks

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        hook = self._hooks.get(name)
        if hook is None or not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            r = attr(*a, **k)
            hook(a, r)
            return r

        return call


@contextlib.contextmanager
def _records_progress(st: Any, args: argparse.Namespace, desc: str, deletes: bool = False) -> Iterator[Any]:
    """A bar over the commit records the store fetches (total: the records listed), and, with
    ``deletes``, counting the objects it deletes; no-op without bars."""
    if not want_progress(args):
        with progress_bar(args, desc) as bar:
            yield bar
        return
    with progress_bar(args, desc, unit="rec") as bar:
        deleted = [0]

        def on_list(a: tuple[Any, ...], r: Any) -> None:
            if a and str(a[0]).startswith(_COMMITS) and bar.total is None:
                bar.total = len(r)
                bar.refresh()

        def on_get(a: tuple[Any, ...], r: Any) -> None:
            if a and str(a[0]).startswith(_COMMITS):
                bar.update(1)

        def on_delete(a: tuple[Any, ...], r: Any) -> None:
            deleted[0] += 1
            bar.set_postfix_str(f"{deleted[0]} objects deleted")

        hooks: dict[str, Callable[[tuple[Any, ...], Any], None]] = {"list": on_list, "get": on_get}
        if deletes:
            hooks["delete"] = on_delete
        inner = st.backend
        st.backend = _WatchedBackend(inner, hooks)
        try:
            yield bar
        finally:
            st.backend = inner


# ----------------------------------------------------------------------------- ls
def _cmd_ls(args: argparse.Namespace) -> int:
    st = _store(args)
    with _records_progress(st, args, "read commit records"):
        recs = st.list()
    if args.json:
        print(json.dumps({"steps": [r.as_dict() for r in recs], "sizes": st.sizes()}, indent=2, sort_keys=True))
        return 0
    _print(f"{st.backend.url}: {len(recs)} committed steps")
    _print(f"{'step':>10}  {'kind':<8} {'depth':>5} {'base':>8} {'raw':>11} {'stored':>11} {'ratio':>7}  {'pin':<3} created")
    for r in recs:
        _print(
            f"{r.step:>10}  {r.kind:<8} {r.depth:>5} {'' if r.base_step is None else r.base_step:>8} "
            f"{_h(r.raw_bytes):>11} {_h(r.object_bytes):>11} {r.ratio:>6.3f}x  {'*' if r.pinned else '':<3} {r.created}"
            + (f"  (+ keyframe copy {_h(r.copy_bytes)})" if r.copy is not None else "")
        )
    sz = st.sizes()
    _print(
        f"total: {_h(sz['raw_bytes'])} raw -> {_h(sz['stored_bytes'])} stored ({sz['ratio']:.3f}x); "
        f"on storage {_h(sz['physical_bytes'])} (bases kept for deltas {_h(sz['base_only_bytes'])}, "
        f"keyframe copies {_h(sz['copy_bytes'])}, unreferenced {_h(sz['unreferenced_bytes'])})"
    )
    return 0


# ----------------------------------------------------------------------------- info / verify
def _cmd_store_info(args: argparse.Namespace) -> int:
    args.url = args.path
    st = _store(args)
    rec = st.info(args.step)
    d = st.container_info(rec.step)
    if args.json:
        print(json.dumps({"step": rec.as_dict(), "container": d}, indent=2, sort_keys=True))
        return 0
    _print(f"{st.backend.url} step {rec.step}: {rec.kind} (depth {rec.depth}"
          + (f", base step {rec.base_step})" if rec.base_step is not None else ")")
          + (" [pinned]" if rec.pinned else ""))
    _print(f"  data object {rec.object}: {_h(rec.raw_bytes)} raw -> {_h(rec.object_bytes)} ({rec.ratio:.3f}x)")
    if rec.copy is not None:
        _print(f"  keyframe copy {rec.copy}: {_h(rec.copy_bytes)} (a load reads it alone)")
    chain = st.chain_objects(rec.step)
    if len(chain) > 1:
        _print(f"  restoring from the chain reads {len(chain)} objects: " + ", ".join(chain))
    _print(f"  created {rec.created}, profile {rec.profile}, {d['tensors']} tensors, {d['delta_storages']} of "
          f"{d['storages']} storages stored as deltas")
    for title in ("kinds", "groups"):
        _print(f"  by {title[:-1]}:")
        for k, g in sorted(d[title].items(), key=lambda kv: -kv[1]["raw_bytes"]):
            _print(f"    {k:<32} {_h(g['raw_bytes']):>10} -> {_h(g['stored_bytes']):>10}  {g['ratio']:.3f}x  ({g['tensors']} tensors)")
    if rec.extra:
        _print(f"  extra: {json.dumps(rec.extra)}")
    return 0


def _cmd_store_verify(args: argparse.Namespace) -> int:
    args.url = args.path
    st = _store(args)
    steps = [args.step] if args.step is not None else st.steps()
    bad = 0
    with progress_bar(args, "verify steps", total=len(steps), unit="step") as bar:
        for s in steps:
            rep = st.verify(s)
            if rep.ok:
                bar.write(printable(f"OK {rep.path}: {rep.storages} storages, {rep.raw_bytes} bytes, every checksum matches"))
            else:
                bad += 1
                for p in rep.problems:
                    bar.write(printable(f"FAIL {rep.path}: {p}"), file=sys.stderr)
            bar.update(1)
    return 1 if bad else 0


def _wrap(orig: Callable[[argparse.Namespace], int], store_fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def dispatch(args: argparse.Namespace) -> int:
        ptr = pointer.read(args.path) if os.path.isfile(args.path) else None  # a framework's .ckpt
        if ptr is not None:
            return _follow(args, ptr, store_fn)
        if getattr(args, "step", None) is not None or is_store_url(args.path):
            return store_fn(args)
        return orig(args)

    return dispatch


def _follow(args: argparse.Namespace, ptr: pointer.Pointer, store_fn: Callable[[argparse.Namespace], int]) -> int:
    """info / verify on a pointer file: the step it names (verify: exit 1 when anything is missing)."""
    if store_fn is _cmd_store_verify:
        rep = pointer.verify(args.path)
        if rep.ok:
            print(f"OK {rep.path}: {rep.storages} storages, {rep.raw_bytes} bytes decoded, every checksum matches")
            return 0
        for p in rep.problems:
            print(f"FAIL {rep.path}: {p}", file=sys.stderr)
        return 1
    args.path = pointer.open_store(ptr).url
    args.step = ptr.step
    return store_fn(args)


# ----------------------------------------------------------------------------- restore
def _flat_tensors(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict) and obj and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        return obj
    return None


def _safetensors_dict(flat: dict[str, torch.Tensor], step: int, budget: int) -> dict[str, torch.Tensor]:
    """The tensors as safetensors can hold them: each its own contiguous data.  Views that share
    storage or are not contiguous are copied; a copy may not grow the output past ``budget``
    bytes (a broadcast view, stride 0 over a huge shape, would need terabytes)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    extra = 0
    for k, v in flat.items():  # safetensors refuses shared storage: give sharers their own copy
        key = (v.untyped_storage().data_ptr(), v.untyped_storage().nbytes())
        if key in seen or not v.is_contiguous():
            size = v.numel() * v.element_size()
            extra += size
            if extra > budget:
                raise UnsupportedTypeError(
                    f"tensor {k!r} of step {step} is a view (shape {list(v.shape)}, strides {list(v.stride())}) "
                    f"over {_h(v.untyped_storage().nbytes())} of storage; safetensors stores each tensor as "
                    f"contiguous data, which would take {_h(size)}: restore it as a torch or s4w file "
                    "(--format torch / --format s4w) instead"
                )
            out[k] = v.detach().clone()
        else:
            out[k] = v.detach()
        seen.add(key)
    return out


def _cmd_restore(args: argparse.Namespace) -> int:
    ptr = pointer.read(args.url) if os.path.isfile(args.url) else None  # a framework's .ckpt
    st = _store(args) if ptr is None else pointer.open_store(ptr)  # the store's byte bar while the step (and its chain) is read
    rec = st.info(args.step if ptr is None else ptr.step)
    fmt = args.format
    if fmt == "auto":
        fmt = "safetensors" if args.out.endswith(".safetensors") else "s4w" if args.out.endswith(".s4w") else "torch"
    if os.path.isdir(args.out):
        raise StoreError(f"--out {args.out} is a directory; give the file to write")
    # Like s4w_core.save: missing folders above --out are created (before the step is read, so a
    # bad --out fails at once), the file appears whole or not at all (a temporary beside it,
    # renamed), with the mode open() gives (0644 under umask 022).
    parent = os.path.dirname(os.path.abspath(args.out))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create the folder {parent} for --out: {e.strerror or e}") from e
    obj = st.load(rec.step, map_location=args.map_location) if ptr is None else pointer.load(ptr, args.map_location)
    if fmt == "safetensors":
        flat = _flat_tensors(obj)
        if flat is None:
            raise UnsupportedTypeError(
                f"step {rec.step} is not a flat dict of tensors, which is all safetensors can hold; "
                "restore to a torch file (--format torch) instead"
            )
        try:
            from safetensors.torch import save_file  # optional dependency
        except ImportError as e:
            raise BackendUnavailableError("--format safetensors needs safetensors: pip install safetensors") from e
        tensors = _safetensors_dict(flat, rec.step, max(int(rec.raw_bytes), 1 << 20))
        _replace_via_temp(args.out, lambda tmp: save_file(tensors, tmp))
    elif fmt == "s4w":
        save(obj, args.out, profile="portable")
    else:
        _replace_via_temp(args.out, lambda tmp: torch.save(obj, tmp))
    _print(f"restored step {rec.step} ({rec.kind}, {_h(rec.raw_bytes)}) from {st.backend.url} to {args.out} ({fmt})")
    return 0


def _replace_via_temp(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a temporary beside ``path``, then rename it over ``path``; no temporary is
    left behind on failure."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- stats
def _kind_of(k: str) -> str:
    return k if k in _KINDS else "other"


def _has_matplotlib() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


_PLOT_HINT = "--plot needs matplotlib: pip install 's4weights[plot]' (or pip install matplotlib)"


def _cmd_stats(args: argparse.Namespace) -> int:
    if args.plot and not _has_matplotlib():
        raise BackendUnavailableError(_PLOT_HINT)  # before any output, not after the table
    st = _store(args)
    with _records_progress(st, args, "read commit records"):
        recs = st.list()
    rows = []
    for r in recs:
        per: dict[str, list[int]] = {k: [0, 0] for k in (*_KINDS, "other")}
        for k, g in r.kinds.items():
            per[_kind_of(k)][0] += int(g.get("raw_bytes", 0))
            per[_kind_of(k)][1] += int(g.get("stored_bytes", 0))
        rows.append((r, per))
    sz = st.sizes()
    if args.json:
        print(json.dumps({
            "steps": [{"step": r.step, "kind": r.kind, "raw_bytes": r.raw_bytes, "stored_bytes": r.object_bytes,
                       "groups": {k: {"raw_bytes": v[0], "stored_bytes": v[1]} for k, v in per.items() if v[0]}}
                      for r, per in rows],
            "totals": sz,
        }, indent=2, sort_keys=True))
    else:
        kinds = [k for k in (*_KINDS, "other") if any(per[k][0] for _, per in rows)]
        _print(f"{st.backend.url}: stored vs raw per step and tensor group (ratio = raw / stored)")
        _print(f"{'step':>10} {'kind':<8} {'raw':>10} {'stored':>10} {'ratio':>7}  " + "  ".join(f"{k:>10}" for k in kinds))
        for r, per in rows:
            cells = "  ".join(f"{per[k][0] / per[k][1]:>9.3f}x" if per[k][1] else f"{'-':>10}" for k in kinds)
            _print(f"{r.step:>10} {r.kind:<8} {_h(r.raw_bytes):>10} {_h(r.object_bytes):>10} {r.ratio:>6.3f}x  {cells}")
        tot = "  ".join(
            f"{(sum(p[k][0] for _, p in rows) / max(1, sum(p[k][1] for _, p in rows))):>9.3f}x" for k in kinds
        )
        _print(f"{'all':>10} {'':<8} {_h(sz['raw_bytes']):>10} {_h(sz['stored_bytes']):>10} {sz['ratio']:>6.3f}x  {tot}")
    if args.plot:
        _plot(rows, args.plot, st.backend.url)
        _print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _plot(rows: list, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise BackendUnavailableError(_PLOT_HINT) from e
    steps = [r.step for r, _ in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    bottom = [0.0] * len(rows)
    colors = {"weights": "tab:blue", "exp_avg": "tab:orange", "exp_avg_sq": "tab:green", "other": "tab:gray"}
    width = (min(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 1 else 1) * 0.8
    for k in (*_KINDS, "other"):
        vals = [per[k][1] / 2**20 for _, per in rows]
        if any(vals):
            ax1.bar(steps, vals, width=width, bottom=bottom, label=f"{k} stored", color=colors[k])
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.plot(steps, [r.raw_bytes / 2**20 for r, _ in rows], "k--", label="raw")
    for i, (r, _) in enumerate(rows):
        if r.kind == "keyframe":
            ax1.annotate("K", (r.step, bottom[i]), ha="center", va="bottom", fontsize=7)
    ax1.set_ylabel("MiB per step")
    ax1.set_title(f"{title}: stored vs raw (K = keyframe)")
    ax1.legend(fontsize=8)
    for k in (*_KINDS, "other"):
        ratios = [per[k][0] / per[k][1] if per[k][1] else None for _, per in rows]
        if any(ratios):
            ax2.plot(steps, ratios, marker="o", ms=3, label=k, color=colors[k])
    ax2.plot(steps, [r.ratio for r, _ in rows], "k-", lw=2, label="step total")
    ax2.set_ylabel("raw / stored")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- rm / gc / pin
def _cmd_rm(args: argparse.Namespace) -> int:
    st = _store(args)  # with --rebase, the store's byte bars show each re-coded step
    with progress_bar(args, "delete", total=len(args.step), unit="step") as bar:
        for s in args.step:
            st.delete(s, rebase=args.rebase)
            bar.write(f"deleted step {s}")
            bar.update(1)
    st.wait()  # the data the deletes free is removed behind them: gone before the command returns
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    st = _store(args)
    with _records_progress(st, args, "gc: read commit records", deletes=True):
        freed = st.gc(grace_seconds=args.grace)
    _print(f"freed {_h(freed)} of unreferenced data in {st.backend.url}")
    return 0


def _cmd_pin(args: argparse.Namespace) -> int:
    st = _store(args)
    for s in args.step:
        (st.unpin if args.unpin else st.pin)(s)
        _print(f"{'unpinned' if args.unpin else 'pinned'} step {s}")
    return 0


def _step(text: str) -> int:
    """A step number for argparse: an integer in [0, 10**12)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is a whole number, not {text!r}") from None
    if not 0 <= v < 10**12:
        raise argparse.ArgumentTypeError(f"a step is between 0 and 10**12, not {v}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, not {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"a number of seconds >= 0, not {text!r}")
    return v


def register(sub: Any) -> None:
    """Add the store subcommands to the ``s4w`` subparsers (and ``--step`` to info/verify)."""
    for name, fn in (("info", _cmd_store_info), ("verify", _cmd_store_verify)):
        p = sub.choices.get(name)
        if p is not None:
            p.add_argument("--step", type=_step, default=None,
                           help="with a store: the step (default: info the latest, verify every step)")
            p.add_argument("--endpoint", default=None, help="S3 endpoint URL for s3:// stores (default: AWS_ENDPOINT_URL or AWS)")
            p.add_argument("--region", default=None, help="S3 region for s3:// stores (default: AWS_REGION or us-east-1)")
            p.set_defaults(func=_wrap(p.get_default("func"), fn))

    a = sub.add_parser("ls", help="steps of a checkpoint store: keyframe or delta, raw and stored bytes")
    _add_url(a)
    a.add_argument("--json", action="store_true", help="print a JSON object for scripts")
    a.set_defaults(func=_cmd_ls)

    a = sub.add_parser("restore", help="write one step of a store as a torch / safetensors / s4w file")
    _add_url(a)
    a.add_argument("--step", type=_step, default=None, help="the step to write (default: the latest committed step)")
    a.add_argument("--out", required=True,
                   help="the file to write; .safetensors / .s4w pick the format, folders above it are created")
    a.add_argument("--format", choices=["auto", "torch", "safetensors", "s4w"], default="auto",
                   help="output format (default auto: from --out's extension, else torch.save)")
    a.add_argument("--map-location", default="cpu", type=device_arg, help="device to load the tensors onto (default: cpu)")
    a.add_argument("--quiet", dest="progress", action="store_false", default=None, help="same as --no-progress")
    a.set_defaults(func=_cmd_restore)

    a = sub.add_parser("stats", help="stored vs raw bytes per step and tensor group (table, --plot PNG)")
    _add_url(a)
    a.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw the table as a PNG (needs matplotlib: the 'plot' extra)")
    a.add_argument("--json", action="store_true", help="print a JSON object for scripts")
    a.set_defaults(func=_cmd_stats)

    a = sub.add_parser("rm", help="delete steps from a store (kept deltas stay loadable)")
    _add_url(a)
    a.add_argument("--step", type=_step, nargs="+", required=True, help="the steps to delete")
    a.add_argument("--rebase", action="store_true", help="re-code dependents now so the data is freed at once")
    a.set_defaults(func=_cmd_rm)

    a = sub.add_parser("gc", help="delete data no commit needs (leftovers of crashed saves)")
    _add_url(a)
    a.add_argument("--grace", type=_seconds, default=3600.0,
                   help="only objects older than this many seconds (default: 3600)")
    a.set_defaults(func=_cmd_gc)

    a = sub.add_parser("pin", help="exempt steps from retention (--unpin to undo)")
    _add_url(a, progress=False)
    a.add_argument("--step", type=_step, nargs="+", required=True, help="the steps to pin (or unpin)")
    a.add_argument("--unpin", action="store_true", help="unpin the steps instead")
    a.set_defaults(func=_cmd_pin)

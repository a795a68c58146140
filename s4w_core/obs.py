"""Observability: one structured log line and in-process metrics per save and load, an optional
HTTP endpoint (Prometheus ``/metrics``, JSON ``/healthz``) for long-running jobs.

Every save and load of :func:`s4w_core.save` / :func:`s4w_core.load`, :class:`~s4w_core.CheckpointStore`
and the DCP storage classes ends in :func:`record` with an :class:`OpEvent`.  :func:`record`

1. logs ONE line on the logger ``s4w_core.ops`` (INFO; ERROR for a failed operation): a JSON object
   with every field of the event plus ``ratio`` (raw / stored), ``GBps`` (raw bytes / seconds, per
   stage and ``total``) and ``ts``.  Enable it with ``logging.basicConfig(level=logging.INFO)`` (or
   ``logging.getLogger("s4w_core").setLevel("INFO")`` where a handler exists), or with the
   environment variable ``S4W_LOG=info`` (s4weights then logs to stderr itself).
   ``S4W_LOG_FORMAT=text`` gives a human line instead of JSON;
2. updates in-process metrics (counters, histograms, gauges; see docs/OBSERVABILITY.md), exposed in
   Prometheus' text format by :func:`metrics_text`, :func:`registry` (a private
   ``prometheus_client.CollectorRegistry``, when that package is installed) and :func:`serve`;
3. calls every callback given to :func:`subscribe`.

Nothing here can make a save or load fail: errors in logging, metrics or a subscriber are
swallowed (and logged on ``s4w_core.obs``).  Importing this module starts nothing and imports
neither torch nor prometheus_client; ``S4W_METRICS_PORT=N`` starts :func:`serve` lazily, on the
first :func:`record`.

Example:
    >>> from s4w_core import obs
    >>> seen = []
    >>> obs.subscribe(seen.append)
    >>> obs.record(obs.OpEvent(op="save", url="/tmp/x.s4w", step=7, raw_bytes=2000, stored_bytes=1000,
    ...                        blocked_s=0.5, total_s=0.5, stages={"encode": 0.4, "write": 0.1}, rank=0))
    >>> obs.unsubscribe(seen.append)
    >>> seen[0].step, obs.event_dict(seen[0])["ratio"]
    (7, 2.0)
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from s4w_core import config
from s4w_core.errors import ConfigError

__all__ = [
    "OpEvent",
    "record",
    "event_dict",
    "subscribe",
    "unsubscribe",
    "suppress",
    "StageTimer",
    "metrics_text",
    "registry",
    "health",
    "serve",
    "MetricsServer",
    "reset",
    "LOGGER_NAME",
]

#: the logger every operation's line goes to (a child of ``s4w_core``).
LOGGER_NAME = "s4w_core.ops"
_log = logging.getLogger(LOGGER_NAME)
_internal = logging.getLogger("s4w_core.obs")
# A library adds no handler but a NullHandler: without one, Python's last-resort handler would
# print failed-save lines (ERROR) to stderr of every program that never configured logging.
logging.getLogger("s4w_core").addHandler(logging.NullHandler())

#: histogram buckets (seconds) for blocked and total time.
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


# ----------------------------------------------------------------------------- the event
@dataclass
class OpEvent:
    """One save or load, as :func:`record` receives it.

    ``stages`` maps a stage to its seconds.  Saves: ``snapshot`` (copy taken before an
    asynchronous save returns), ``encode``, ``write``, ``upload``, ``commit`` (fsync + rename,
    or the commit record).  Loads: ``open`` (header + manifest), ``decode`` (reading and decoding
    every tensor, wall clock), ``read`` (seconds inside storage reads, summed over the decoding
    threads: it overlaps ``decode``).  ``extra`` holds anything else worth logging (chain depth,
    objects read, profile).
    """

    op: str  # "save" | "load"
    url: str
    step: int | None
    raw_bytes: int
    stored_bytes: int
    blocked_s: float  # seconds the caller was blocked
    total_s: float  # seconds until durable (save) / returned (load)
    stages: dict[str, float] = field(default_factory=dict)
    kind: str | None = None  # "keyframe" | "delta"
    mode: str | None = None  # "blocking" | "async-gpu" | "async-snapshot" | "tiered" | "dcp" ...
    host_bytes: int = 0
    ok: bool = True
    error: str | None = None
    rank: int | None = None  # filled in by record() when None
    extra: dict[str, Any] = field(default_factory=dict)


def _rank() -> int:
    """torch.distributed's rank when a process group is up, else ``RANK``, else 0."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a half-torn-down process group: fall through
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def event_dict(event: OpEvent, ts: float | None = None) -> dict[str, Any]:
    """The JSON object :func:`record` logs for ``event``: every field, plus ``ratio`` (raw /
    stored, None when nothing was stored), ``GBps`` (raw bytes / 1e9 / seconds for every stage
    of at least a millisecond, and for ``total``) and ``ts`` (ISO 8601, UTC).

    Example:
        >>> from s4w_core.obs import OpEvent, event_dict
        >>> d = event_dict(OpEvent("load", "run/", 3, 4_000_000_000, 2_000_000_000, 2.0, 2.0, {"decode": 1.0}))
        >>> d["ratio"], d["GBps"]
        (2.0, {'decode': 4.0, 'total': 2.0})
    """
    vals: dict[str, Any] = {}
    for f in fields(event):
        v = getattr(event, f.name)
        if isinstance(v, float):
            v = round(v, 6)
        elif f.name == "stages":
            v = {k: round(float(s), 6) for k, s in v.items()}
        vals[f.name] = v
    vals["ts"] = _iso(time.time() if ts is None else ts)
    vals["ratio"] = round(event.raw_bytes / event.stored_bytes, 4) if event.stored_bytes > 0 else None
    gbps: dict[str, float] = {}
    if event.raw_bytes > 0:  # a rate over less than a millisecond (a commit record, retention) is noise
        gbps = {k: _sig(event.raw_bytes / 1e9 / s) for k, s in event.stages.items() if _MIN_S <= s < math.inf}
        if event.total_s > 0:
            gbps["total"] = _sig(event.raw_bytes / 1e9 / event.total_s)
    vals["GBps"] = gbps
    if not vals["extra"]:
        del vals["extra"]
    # people read the line left to right: what, outcome, where, then the numbers
    return {k: vals.pop(k) for k in _ORDER if k in vals} | vals


_MIN_S = 1e-3
_ORDER = ("ts", "op", "ok", "rank", "step", "url", "kind", "mode", "raw_bytes", "stored_bytes", "ratio",
          "blocked_s", "total_s", "stages", "GBps", "host_bytes", "error")


def _h(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _text_line(d: dict[str, Any]) -> str:
    """``S4W_LOG_FORMAT=text``: the same facts for people."""
    head = f"s4w {d['op']} {'ok' if d['ok'] else 'FAILED'} rank={d['rank']} step={d['step']} {d['url']}"
    parts = [f"blocked {d['blocked_s']:.3f}s, total {d['total_s']:.3f}s"]
    if d["raw_bytes"] or d["stored_bytes"]:
        parts.insert(0, f"{_h(d['raw_bytes'])} -> {_h(d['stored_bytes'])}" + (f" ({d['ratio']:.3f}x)" if d["ratio"] else ""))
    if d["kind"] or d["mode"]:
        parts.append("/".join(x for x in (d["kind"], d["mode"]) if x))
    stages = ", ".join(
        f"{k} {s:.3f}s" + (f" {d['GBps'][k]:.3g} GB/s" if k in d["GBps"] else "") for k, s in d["stages"].items()
    )
    if stages:
        parts.append(stages)
    if d["error"]:
        parts.append(f"error: {d['error']}")
    return head + ": " + "; ".join(parts)


# ----------------------------------------------------------------------------- metrics state
class _Hist:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(BUCKETS):
            if v <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += v
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip((*(repr(float(b)) for b in BUCKETS), "+Inf"), self.counts):
            acc += c
            out.append((b, acc))
        return out


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.time()
        self.ops: dict[tuple[str, str], int] = {}
        self.raw: dict[str, int] = {}
        self.stored: dict[str, int] = {}
        self.stage_s: dict[tuple[str, str], float] = {}
        self.blocked: dict[str, _Hist] = {}
        self.total: dict[str, _Hist] = {}
        self.last_step: dict[str, int] = {}
        self.last_ratio: dict[str, float] = {}
        self.last_host: dict[str, int] = {}
        self.last_ok_ts: dict[str, float] = {}
        self.last_save: dict[str, Any] | None = None  # the latest save event (ok or not)
        self.last_ok_save: dict[str, Any] | None = None
        self.last_error: dict[str, Any] | None = None
        self.rank: int | None = None

    def update(self, e: OpEvent, ts: float) -> None:
        op, ok = e.op, "true" if e.ok else "false"
        with self.lock:
            self.rank = e.rank
            self.ops[(op, ok)] = self.ops.get((op, ok), 0) + 1
            self.blocked.setdefault(op, _Hist()).observe(max(0.0, e.blocked_s))
            self.total.setdefault(op, _Hist()).observe(max(0.0, e.total_s))
            brief = {"step": e.step, "url": e.url, "ts": ts, "time": _iso(ts), "error": e.error}
            if e.op == "save":
                self.last_save = brief
            if not e.ok:
                self.last_error = {"op": e.op, **brief}
                return
            self.raw[op] = self.raw.get(op, 0) + max(0, e.raw_bytes)
            self.stored[op] = self.stored.get(op, 0) + max(0, e.stored_bytes)
            for k, s in e.stages.items():
                self.stage_s[(op, k)] = self.stage_s.get((op, k), 0.0) + max(0.0, float(s))
            if e.step is not None:
                self.last_step[op] = e.step
            if e.stored_bytes > 0:
                self.last_ratio[op] = e.raw_bytes / e.stored_bytes
            self.last_host[op] = e.host_bytes
            self.last_ok_ts[op] = ts
            if e.op == "save":
                self.last_ok_save = brief

    def families(self) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        """(name, type, help, samples) for every metric, the one source of both expositions."""
        with self.lock:
            fam: list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]] = [
                ("s4w_ops", "counter", "Saves and loads recorded, by operation and outcome.",
                 [("s4w_ops_total", {"op": op, "ok": ok}, float(n)) for (op, ok), n in sorted(self.ops.items())]),
                ("s4w_raw_bytes", "counter", "Raw (uncompressed) tensor bytes of successful saves and loads.",
                 [("s4w_raw_bytes_total", {"op": op}, float(n)) for op, n in sorted(self.raw.items())]),
                ("s4w_stored_bytes", "counter", "Stored (compressed) bytes written by saves and read by loads.",
                 [("s4w_stored_bytes_total", {"op": op}, float(n)) for op, n in sorted(self.stored.items())]),
                ("s4w_stage_seconds", "counter", "Seconds spent per stage of successful operations.",
                 [("s4w_stage_seconds_total", {"op": op, "stage": st}, s) for (op, st), s in sorted(self.stage_s.items())]),
            ]
            for name, hists, doc in (
                ("s4w_blocked_seconds", self.blocked, "Seconds the caller was blocked, per operation."),
                ("s4w_op_seconds", self.total, "Seconds until durable (save) or returned (load), per operation."),
            ):
                samples: list[tuple[str, dict[str, str], float]] = []
                for op, h in sorted(hists.items()):
                    samples += [(f"{name}_bucket", {"op": op, "le": le}, float(c)) for le, c in h.cumulative()]
                    samples += [(f"{name}_count", {"op": op}, float(h.n)), (f"{name}_sum", {"op": op}, h.sum)]
                fam.append((name, "histogram", doc, samples))
            for name, vals, doc in (
                ("s4w_last_step", self.last_step, "Step of the last successful operation."),
                ("s4w_last_ratio", self.last_ratio, "Raw / stored bytes of the last successful operation."),
                ("s4w_last_host_bytes", self.last_host, "Host memory used by the last successful operation."),
                ("s4w_last_success_timestamp_seconds", self.last_ok_ts, "Unix time of the last successful operation."),
            ):
                fam.append((name, "gauge", doc, [(name, {"op": op}, float(v)) for op, v in sorted(vals.items())]))
            failing = self.last_save is not None and self.last_save.get("error") is not None
            fam.append(("s4w_last_save_failed", "gauge", "1 when the most recent save failed, else 0.",
                        [("s4w_last_save_failed", {}, 1.0 if failing else 0.0)]))
        return fam


_state = _State()
_subscribers: list[Callable[[OpEvent], Any]] = []
_sub_lock = threading.Lock()
_SCOPE: contextvars.ContextVar[list[OpEvent] | None] = contextvars.ContextVar("s4w_obs_scope", default=None)


# ----------------------------------------------------------------------------- environment
_env_lock = threading.Lock()
_env_done = False
_env_server: MetricsServer | None = None


def _configure_from_env() -> None:
    """Once, on the first record(): ``S4W_LOG`` and ``S4W_METRICS_PORT``."""
    global _env_done, _env_server
    if _env_done:
        return
    with _env_lock:
        if _env_done:
            return
        _env_done = True
        level = config.get_str("S4W_LOG").upper()
        if level and level not in ("0", "OFF", "NONE", "FALSE"):
            lvl = logging.getLevelName("INFO" if level in ("1", "TRUE", "ON") else level)
            lg = logging.getLogger("s4w_core")
            lg.setLevel(lvl if isinstance(lvl, int) else logging.INFO)
            if not any(getattr(h, "_s4w_env", False) for h in lg.handlers):
                h = logging.StreamHandler(sys.stderr)
                h.setFormatter(logging.Formatter("%(message)s"))
                h._s4w_env = True  # type: ignore[attr-defined]
                lg.addHandler(h)
                lg.propagate = False  # our handler prints it; a configured root would print it twice
        if config.raw("S4W_METRICS_PORT") is not None:
            try:
                port = config.get_opt_int("S4W_METRICS_PORT") or 0
                p = port + (int(os.environ.get("LOCAL_RANK", "0") or 0) if port else 0)
                _env_server = serve(
                    p, config.get_str("S4W_METRICS_HOST"), stale_after_s=config.get_opt_float("S4W_METRICS_STALE_S")
                )
                _internal.info("s4w metrics endpoint at %s/metrics", _env_server.url)
            except (OSError, ValueError) as e:  # ConfigError is a ValueError
                _internal.warning("S4W_METRICS_PORT=%s: cannot start the metrics endpoint: %s",
                                  config.raw("S4W_METRICS_PORT"), e)


def _log_format() -> str:
    """``S4W_LOG_FORMAT``; a value it does not know keeps JSON (a log line is never lost to it)."""
    try:
        return config.get_str("S4W_LOG_FORMAT")
    except ConfigError:
        return "json"


# ----------------------------------------------------------------------------- record
def record(event: OpEvent) -> None:
    """Log, count and publish one finished save or load.  Never raises.

    Fills in ``event.rank`` when it is None (torch.distributed's rank when a process group is up,
    else the ``RANK`` environment variable, else 0).  Inside :func:`suppress` the event is only
    collected for the enclosing operation.

    Args:
        event: the :class:`OpEvent` of the operation (also for a failed one: ``ok=False``, ``error``).
    Returns:
        None.
    Example:
        >>> from s4w_core import obs
        >>> obs.record(obs.OpEvent("load", "ckpt.s4w", None, 10, 5, 0.1, 0.1))
    """
    try:
        if event.rank is None:
            event.rank = _rank()
        scope = _SCOPE.get()
        if scope is not None:
            scope.append(event)
            return
        _configure_from_env()
        ts = time.time()
        _state.update(event, ts)
        level = logging.INFO if event.ok else logging.ERROR
        if _log.isEnabledFor(level):
            d = event_dict(event, ts)
            msg = _text_line(d) if _log_format() == "text" else json.dumps(d, default=str, allow_nan=False)
            _log.log(level, "%s", msg, extra={"s4w_event": d})
    except Exception:  # noqa: BLE001 - observability must never break a save
        _safe_internal("s4w: recording an operation failed")
    with _sub_lock:
        subs = list(_subscribers)
    for cb in subs:
        try:
            cb(event)
        except Exception:  # noqa: BLE001
            _safe_internal(f"s4w: subscriber {cb!r} raised")


def _safe_internal(msg: str) -> None:
    try:
        _internal.warning(msg, exc_info=True)
    except Exception:  # noqa: BLE001
        pass


def subscribe(callback: Callable[[OpEvent], Any]) -> None:
    """Call ``callback(event)`` after every recorded operation, in the thread that recorded it
    (an asynchronous save's background thread, for one).  Its exceptions are logged and ignored.

    Example:
        >>> from s4w_core import obs
        >>> def on_event(e): pass
        >>> obs.subscribe(on_event); obs.unsubscribe(on_event)
    """
    with _sub_lock:
        if callback not in _subscribers:
            _subscribers.append(callback)


def unsubscribe(callback: Callable[[OpEvent], Any]) -> None:
    """Stop calling ``callback`` (no error when it was not subscribed)."""
    with _sub_lock:
        if callback in _subscribers:
            _subscribers.remove(callback)


@contextlib.contextmanager
def suppress() -> Iterator[list[OpEvent]]:
    """Collect, instead of recording, the events of operations run inside (in this thread or
    task): for an operation that records one event of its own around inner saves and loads (a
    DCP rank file is an :func:`s4w_core.save`).  Yields the list the inner events go to.

    Example:
        >>> import io, torch, s4w_core
        >>> from s4w_core import obs
        >>> with obs.suppress() as inner:
        ...     _ = s4w_core.save({"x": torch.ones(4)}, io.BytesIO())
        >>> [e.op for e in inner]
        ['save']
    """
    events: list[OpEvent] = []
    token = _SCOPE.set(events)
    try:
        yield events
    finally:
        _SCOPE.reset(token)


class StageTimer:
    """Wall-clock seconds per stage, for building an :class:`OpEvent`.

    Example:
        >>> from s4w_core.obs import StageTimer
        >>> t = StageTimer()
        >>> with t.stage("encode"):
        ...     pass
        >>> sorted(t.stages), t.elapsed() >= 0
        (['encode'], True)
    """

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stages: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def reset() -> None:
    """Forget every metric and the health state (for tests; subscribers stay)."""
    global _state
    _state = _State()


# ----------------------------------------------------------------------------- exposition
def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if not float(v).is_integer() else f"{v:.1f}"


def _render_text() -> str:
    """Prometheus text format (0.0.4) without prometheus_client."""
    out = []
    for name, typ, doc, samples in _state.families():
        shown = f"{name}_total" if typ == "counter" else name
        out.append(f"# HELP {shown} {doc}")
        out.append(f"# TYPE {shown} {typ}")
        for sname, labels, value in samples:
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            out.append(f"{sname}{{{lab}}} {_fmt(value)}" if lab else f"{sname} {_fmt(value)}")
    return "\n".join(out) + "\n"


class _Collector:
    """prometheus_client collector over the in-process state."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import Metric

        for name, typ, doc, samples in _state.families():
            m = Metric(name, doc, typ)
            for sname, labels, value in samples:
                m.add_sample(sname, labels, value)
            yield m


_registry: Any = None
_reg_lock = threading.Lock()


def registry() -> Any:
    """A ``prometheus_client.CollectorRegistry`` holding s4weights' metrics, and nothing else
    (the global registry is never touched).  Merge it into yours with
    ``prometheus_client.REGISTRY.register(obs.registry())``.

    Raises:
        BackendUnavailableError: prometheus_client is not installed (``pip install 's4weights[metrics]'``).
    Example:
        >>> from s4w_core import obs
        >>> "s4w_ops" in {m.name for m in obs.registry().collect()}
        True
    """
    global _registry
    with _reg_lock:
        if _registry is None:
            try:
                from prometheus_client import CollectorRegistry
            except ImportError as e:
                from s4w_core.errors import BackendUnavailableError

                raise BackendUnavailableError(
                    "obs.registry() needs prometheus_client: pip install 's4weights[metrics]'"
                ) from e
            reg = CollectorRegistry(auto_describe=True)
            reg.register(_Collector())  # type: ignore[arg-type]
            _registry = reg
        return _registry


def metrics_text() -> tuple[str, str]:
    """The metrics in Prometheus' text exposition format: ``(body, content_type)``, through
    prometheus_client when it is installed, else rendered here in the same format.

    Example:
        >>> from s4w_core import obs
        >>> body, ctype = obs.metrics_text()
        >>> "# TYPE s4w_ops_total counter" in body and ctype.startswith("text/plain")
        True
    """
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    except ImportError:
        return _render_text(), "text/plain; version=0.0.4; charset=utf-8"
    return generate_latest(registry()).decode("utf-8"), CONTENT_TYPE_LATEST


def health(stale_after_s: float | None = None) -> tuple[bool, dict[str, Any]]:
    """Is checkpointing healthy?  ``(ok, details)``: not ok when the most recent save failed, or
    when ``stale_after_s`` is given and more seconds than that passed since the last successful
    save (since this process started recording, before the first one).

    Example:
        >>> from s4w_core import obs
        >>> ok, d = obs.health()
        >>> sorted(d)[:3]
        ['last_error', 'last_save', 'last_success']
    """
    now = time.time()
    st = _state
    with st.lock:
        last_save = dict(st.last_save) if st.last_save else None
        ok_save = dict(st.last_ok_save) if st.last_ok_save else None
        d: dict[str, Any] = {
            "last_error": dict(st.last_error) if st.last_error else None,
            "last_save": last_save,
            "last_success": ok_save,
            "saves_ok": st.ops.get(("save", "true"), 0),
            "saves_failed": st.ops.get(("save", "false"), 0),
            "loads_ok": st.ops.get(("load", "true"), 0),
            "loads_failed": st.ops.get(("load", "false"), 0),
            "rank": st.rank,
            "pid": os.getpid(),
            "uptime_s": round(now - st.started, 3),
        }
        since = now - (ok_save["ts"] if ok_save else st.started)
    d["seconds_since_last_success"] = round(now - ok_save["ts"], 3) if ok_save else None
    d["stale_after_s"] = stale_after_s
    status, reason = "ok", None
    if last_save is not None and last_save.get("error") is not None:
        status, reason = "failing", f"the last save (step {last_save['step']}) failed: {last_save['error']}"
    elif stale_after_s is not None and since > stale_after_s:
        status = "stale"
        reason = f"no successful save for {since:.0f} s (stale after {stale_after_s:g} s)"
    d = {"ok": status == "ok", "status": status, "reason": reason, **d}
    return d["ok"], d


# ----------------------------------------------------------------------------- HTTP endpoint
class MetricsServer:
    """The HTTP endpoint :func:`serve` starts: ``GET /metrics`` (Prometheus text format) and
    ``GET /healthz`` (JSON from :func:`health`; status 503 when not healthy), on a daemon thread.
    ``port``, ``url``; ``close()`` stops it (also as a context manager)."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", *, stale_after_s: float | None = None) -> None:
        self.stale_after_s = stale_after_s
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self._httpd.daemon_threads = True
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.1,), name=f"s4w-metrics:{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url})"


def _handler_for(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            try:
                if path == "/metrics":
                    body, ctype = metrics_text()
                    self._send(200, body.encode(), ctype)
                elif path == "/healthz":
                    ok, d = health(server.stale_after_s)
                    self._send(200 if ok else 503, json.dumps(d, default=str).encode(), "application/json")
                elif path == "/":
                    self._send(200, b"s4weights metrics: /metrics /healthz\n", "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
            except Exception as e:  # noqa: BLE001
                self._send(500, f"{type(e).__name__}: {e}\n".encode(), "text/plain; charset=utf-8")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            pass

    return Handler


def serve(port: int = 0, host: str = "127.0.0.1", *, stale_after_s: float | None = None) -> MetricsServer:
    """Start the metrics/health endpoint on a daemon thread.

    Args:
        port: TCP port; 0 picks a free one (read it from ``.port``).
        host: address to bind; the default serves this machine only (``"0.0.0.0"`` for a scraper
            elsewhere).
        stale_after_s: ``/healthz`` answers 503 when no save succeeded for this many seconds.
    Returns:
        The running :class:`MetricsServer`.
    Raises:
        OSError: the port cannot be bound.
    Example:
        >>> import urllib.request
        >>> from s4w_core import obs
        >>> with obs.serve() as srv:
        ...     urllib.request.urlopen(srv.url + "/healthz").status
        200
    """
    return MetricsServer(port, host, stale_after_s=stale_after_s)

"""Crash-consistency harness: SIGKILL a process working on a store at random moments, then check it.

A child process (forked from a zygote that imported torch once) opens the store and runs a random
sequence of operations on it until it is killed: saves of the next step (``keep_last``, so
retention deletes run inside them), and, fewer, deletes of a step below the newest (one a delta
is against becomes hidden), ``delete(rebase=True)`` (the delta against the step re-coded against
the step above it: two deltas merged), deletes of the newest step (the step below re-coded
whole first) and overwrites of a listed step with new contents (the delta against it re-coded
first).  Behind every save, on the store's worker thread, the step below the new one is
re-encoded as a delta against it.  The child prints flushed, timestamped lines:

* ``O OP STEP GEN`` before an operation and ``D`` after it returns (``GEN`` picks the contents);
* ``P PHASE OP`` before each backend call of the operation ``OP``: ``data`` (streaming a data
  object), ``publish`` (its fsync/rename or upload completion), ``published``, ``commit``
  (writing a commit record), ``committed``, ``delete`` (removing a record or object), ``idle``
  (after ``D``: reading the listing, waiting for the re-encoding);
* the same with a ``re-`` prefix for the re-encoding on the worker thread, framed by
  ``re-start`` (its first call: reading the records, then reading/encoding/checking the step)
  and ``re-end-OUTCOME`` (written, skipped or failed: its ``op="reencode"`` event).

The parent kills the child with SIGKILL after a random delay, or a random time after a chosen
marker (a phase; ``re-start`` + up to the measured re-encoding time; an operation's ``O`` line +
up to its measured duration; a phase marker of an operation other than a save), then replays
the child's lines on its model of the store (step -> contents) and checks, with a fresh
:class:`CheckpointStore`:

* the listed steps are exactly those the model holds before and after the operation in flight,
  give or take what that operation changes (its step; for a save, the steps its retention drops);
* every listed step loads and equals, byte for byte, its contents before or after that operation;
* the newest listed step is whole, and every delta's base step has a commit record (hidden ones
  included).

The store as checked is the model of the next trial, whose child resumes from it (so every
operation after a crash must work).  At the end the parent saves once more, runs
``gc(grace_seconds=0)`` and checks that exactly the data objects the records need are left (and no
temporaries on a local store).  The result counts kills by operation and phase (``OP:PHASE``) and
by what the re-encoding was doing (``none``: no re-encoding in flight); a kill whose marker did
not come within the trial's time is a kill at a random moment (``targets_not_reached``).

Usage::

    PYTHONPATH=. python tests/reliability/crash_harness.py --url /tmp/crash-store --trials 300 --seed 1 --out r.json
    PYTHONPATH=. python tests/reliability/crash_harness.py --seaweedfs --trials 100 --seed 2 --out r.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))

#: the operations a child runs; ``save`` is the next step (retention inside it)
OPS = ("save", "delete", "rebase", "delnewest", "overwrite")


# ----------------------------------------------------------------------------- the state
_BASE: dict[int, Any] = {}


def make_state(step: int, numel: int, gen: int = 0) -> dict[str, Any]:
    """The state saved as ``step`` (``gen`` > 0: the contents of an overwrite): a fixed base
    (seed 0) of which a seeded 5 % of the elements move, so neighbouring steps delta-code; plus a
    fresh fp32 "exp_avg" and an int."""
    import torch

    if numel not in _BASE:
        g = torch.Generator().manual_seed(0)
        _BASE[numel] = (
            (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16),
            torch.randn(numel // 2, generator=g) * 0.02,
        )
    b16, b32 = _BASE[numel]
    g = torch.Generator().manual_seed(1000 + step + 7919 * gen)
    w16 = b16.clone()
    # unique indices: index_put_ with duplicates keeps an unspecified one of the values (it varies
    # with the thread count), which would make the expected state itself nondeterministic
    idx = torch.randperm(numel, generator=g)[: numel // 20]
    w16[idx] = (torch.randn(idx.numel(), generator=g) * 0.02).to(torch.bfloat16)
    w32 = b32.clone()
    idx = torch.randperm(numel // 2, generator=g)[: numel // 40]
    w32[idx] = torch.randn(idx.numel(), generator=g) * 0.02
    return {
        "model": {"w16": w16.view(-1, 64), "w32": w32},
        "optimizer": {"exp_avg": torch.randn(numel // 8, generator=g), "step": torch.tensor(step)},
        "step": step,
    }


def state_bytes(obj: Any) -> Any:
    """``obj`` with every tensor replaced by (dtype, shape, raw bytes): compare with ``==``."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        return (str(t.dtype), tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(obj, dict):
        return {k: state_bytes(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(state_bytes(v) for v in obj)
    return obj


def all_records(backend: Any) -> dict[int, Any]:
    """Every commit record on ``backend`` (hidden ones included), by step."""
    from s4w_core.store.records import COMMITS, STEP_RE, parse_record

    out = {}
    for o in backend.list(COMMITS):
        if STEP_RE.match(o.key[len(COMMITS) :]):
            r = parse_record(backend.get(o.key), o.key, backend.url)
            out[r.step] = r
    return out


# ----------------------------------------------------------------------------- the child
def _worker(args: argparse.Namespace, fifo: str, seed: int, focus: str) -> None:
    """The process that is killed: says its pid, then runs operations until it is killed (or
    one raises: then it says ``E ERROR`` and exits)."""
    import threading

    from s4w_core import obs
    from s4w_core.store.store import CheckpointStore

    out = open(fifo, "w", buffering=1)  # noqa: SIM115 - lives until the process is killed
    lock = threading.Lock()

    def emit(line: str) -> None:
        with lock:
            out.write(f"{line} {time.monotonic():.6f}\n")
            out.flush()

    emit(f"pid {os.getpid()}")
    main = threading.main_thread()
    reencoding = threading.Event()

    doing = ["-"]  # the operation the main thread is in

    def mark(p: str) -> None:
        if threading.current_thread() is main:
            emit(f"P {p} {doing[0]}")
        else:
            emit(f"P re-{p} re")

    def on_event(e: Any) -> None:
        if e.op == "reencode":
            reencoding.clear()
            emit(f"P re-end-{(e.extra or {}).get('outcome', '?')} re")

    obs.subscribe(on_event)
    store = CheckpointStore(
        args.url, keep_last=args.keep_last, keyframe_every=args.keyframe_every, durable=args.durable
    )
    inner = store.backend

    class Phases:
        """Delegates to the real backend; says which phase the child is in before each call."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def list(self, prefix: str) -> Any:
            # the re-encoding's first call is a listing of the records, on the worker thread
            if threading.current_thread() is not main and not reencoding.is_set():
                reencoding.set()
                mark("start")
            return inner.list(prefix)

        @contextlib.contextmanager
        def writer(self, key: str) -> Any:
            mark("data")
            with inner.writer(key) as f:
                yield f
                mark("publish")
            mark("published")

        def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
            mark("commit" if key.startswith("commits/") else "put")
            inner.put(key, data, if_absent=if_absent)
            mark("committed" if key.startswith("commits/") else "put-done")

        def delete(self, key: str) -> None:
            mark("delete")
            inner.delete(key)

    store.backend = Phases()  # type: ignore[assignment]
    rng = random.Random(seed)
    weights = [0.6, 0.1, 0.1, 0.1, 0.1] if focus == "any" else [1.0 if o == focus else 0.0 for o in OPS]
    if focus not in ("any", "save"):
        weights = [0.65 if o == "save" else 0.35 if o == focus else 0.0 for o in OPS]  # deltas to merge
    gen = seed % 1_000_000 * 100
    try:
        _operations(store, args, rng, weights, gen, emit, mark, doing)
    except BaseException as e:
        emit("E " + f"{type(e).__name__}: {e}".replace("\n", " ")[:800])
        raise


def _operations(store: Any, args: argparse.Namespace, rng: random.Random, weights: list[float], gen: int,
                emit: Any, mark: Any, doing: list[str]) -> None:
    """The child's loop of operations (see the module's docstring)."""
    while True:
        steps = store.steps()
        op = rng.choices(OPS, weights)[0]
        if op in ("delete", "rebase") and len(steps) < 2 or op == "delnewest" and len(steps) < 2:
            op = "save"
        if op == "overwrite" and not steps:
            op = "save"
        if op != "save" and rng.random() < 0.75:
            store.wait()  # the re-encoding behind the last save lands: deltas to merge or re-code
        doing[0] = op
        if op == "save":
            step = (steps[-1] + 1) if steps else 1
            emit(f"O save {step} 0")
            store.save(make_state(step, args.numel), step)
        elif op == "overwrite":
            step = rng.choice(steps)
            gen += 1
            emit(f"O overwrite {step} {gen}")
            store.save(make_state(step, args.numel, gen), step, overwrite=True)
        else:
            # a middle step when there is one: the step below it is a delta against it (to hide or merge)
            step = steps[-1] if op == "delnewest" else rng.choice(steps[1:-1] or steps[:-1])
            emit(f"O {op} {step} 0")
            store.delete(step, rebase=op == "rebase")
        emit("D")
        doing[0] = "-"
        mark("idle")


def _zygote(args: argparse.Namespace) -> None:
    """A fresh interpreter (started with subprocess) that imports torch and s4w_core once, then
    forks one worker per ``fork FIFO SEED FOCUS`` line on stdin: the workers skip the ~2 s import,
    so the kill window is spent working."""
    import s4w_core.store.store  # noqa: F401 - imported once, before the forks

    make_state(0, args.numel)  # the base, computed once
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped automatically
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd != "fork":
            break
        if os.fork() == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(0)
                _worker(args, rest[0], int(rest[1]), rest[2])
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(1)


# ----------------------------------------------------------------------------- the parent
class _Zygote:
    def __init__(self, args: argparse.Namespace, tmpdir: str) -> None:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--zygote",
            "--url",
            args.url,
            "--numel",
            str(args.numel),
            "--keep-last",
            str(args.keep_last),
            "--keyframe-every",
            str(args.keyframe_every),
            *([] if getattr(args, "durable", True) else ["--no-fsync"]),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("OMP_NUM_THREADS", "1")
        self.tmpdir = tmpdir
        self.n = 0
        self.pending = b""
        self.err = open(os.path.join(tmpdir, "zygote.err"), "w+b")  # noqa: SIM115
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env, bufsize=0
        )
        assert self.p.stdout is not None
        if self.p.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"crash harness zygote failed: {self.stderr()}")

    def stderr(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-3000:]

    def fork(self, seed: int, focus: str) -> tuple[int, int]:
        """Start a worker; returns (its pid, the read end of its output)."""
        self.n += 1
        fifo = os.path.join(self.tmpdir, f"w{self.n}")
        os.mkfifo(fifo)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        assert self.p.stdin is not None
        self.p.stdin.write(f"fork {fifo} {seed} {focus}\n".encode())
        buf = b""
        deadline = time.monotonic() + 60
        while b"\n" not in buf:
            if time.monotonic() > deadline or self.p.poll() is not None:
                raise RuntimeError(f"worker did not start: {self.stderr()}")
            if select.select([fd], [], [], 0.05)[0]:
                buf += os.read(fd, 4096)
        os.unlink(fifo)
        line, _, rest = buf.partition(b"\n")
        self.pending = rest
        return int(line.split()[1]), fd

    def close(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.close()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.err.close()


def _run_and_kill(
    z: _Zygote, seed: int, focus: str, delay: float, target: tuple[str, int] | None, jitter: float
) -> tuple[list[list[str]], bool]:
    """Fork a worker and SIGKILL it ``delay`` seconds later, or ``jitter`` seconds after its
    ``target[1]``-th line starting with ``target[0]``; returns (its lines, split; whether the
    target was reached before ``delay``)."""
    pid, fd = z.fork(seed, focus)
    buf = z.pending
    deadline = time.monotonic() + delay
    want = ("\n" + target[0] + " ").encode() if target is not None else b""
    reached = False
    while time.monotonic() < deadline:
        if target is not None and (b"\n" + buf).count(want) >= target[1]:
            reached = True
            if jitter:
                time.sleep(jitter)
            break
        if select.select([fd], [], [], 0.0005 if target else 0.02)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the worker exited by itself: an operation raised (its E line says which)
                break
            buf += chunk
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.set_blocking(fd, True)
    while chunk := os.read(fd, 1 << 16):  # EOF once the worker is gone
        buf += chunk
    os.close(fd)
    while True:  # and reaped
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.001)
    lines = buf.decode().split("\n")
    return [x.split() for x in lines[:-1] if x], reached  # a line cut by the kill has no newline: dropped


def _apply(model: dict[int, int], op: tuple[str, int, int], keep_last: int | None) -> dict[int, int]:
    """``model`` (step -> contents) after ``op`` completed."""
    name, step, gen = op
    out = dict(model)
    if name in ("save", "overwrite"):
        out[step] = gen
        if keep_last is not None:
            out = {s: out[s] for s in sorted(out)[-keep_last:]}
    else:
        out.pop(step, None)
    return out


def _check(
    args: argparse.Namespace, before: dict[int, int], after: dict[int, int]
) -> tuple[dict[int, int], list[str]]:
    """Open the store fresh and check it against the model before and after the operation in
    flight; returns (the store as found: step -> contents, failures)."""
    from s4w_core.store.store import CheckpointStore

    fails: list[str] = []
    found: dict[int, int] = {}
    with CheckpointStore(args.url) as st:
        listed = st.steps()
        must, may = set(before) & set(after), set(before) | set(after)
        if not must <= set(listed):
            fails.append(f"committed steps lost: {sorted(must - set(listed))} (listed {listed})")
        if not set(listed) <= may:
            fails.append(f"listed steps never committed: {sorted(set(listed) - may)} (listed {listed})")
        recs = all_records(st.backend)
        if listed and recs[listed[-1]].kind != "keyframe":
            fails.append(f"the newest step {listed[-1]} is not whole: {recs[listed[-1]].kind}")
        for r in recs.values():
            if r.kind == "delta" and r.base_step not in recs:
                fails.append(f"step {r.step} is a delta against step {r.base_step}, which has no record")
        for s in listed:
            try:
                got = state_bytes(st.load(s))
            except Exception as e:  # noqa: BLE001 - any failure to load is a finding
                fails.append(f"step {s} does not load: {type(e).__name__}: {e}")
                continue
            gens = sorted({g for g in (before.get(s), after.get(s)) if g is not None})
            match = [g for g in gens if got == state_bytes(make_state(s, args.numel, g))]
            if match:
                found[s] = match[0]
            else:
                fails.append(f"step {s} loads but differs from what was saved (contents {gens})")
    return found, fails


def _final(args: argparse.Namespace) -> list[str]:
    """A save after the last crash works, and gc leaves exactly the data objects records need."""
    from s4w_core.store.store import CheckpointStore

    fails: list[str] = []
    with CheckpointStore(args.url, keep_last=args.keep_last, keyframe_every=args.keyframe_every) as st:
        latest = max(all_records(st.backend), default=0)  # above every hidden step too
        step = latest + 1
        st.save(make_state(step, args.numel), step)
        st.wait()
        st.gc(grace_seconds=0)
        live = st.all_objects()
        present = {o.key for o in st.backend.list("data/")}
        if present != live:
            fails.append(f"after gc: data objects {sorted(present ^ live)} present/live mismatch")
        tmps = getattr(st.backend, "list_temporaries", None)
        if tmps is not None and tmps():
            fails.append(f"after gc: temporaries left: {[o.key for o in tmps()]}")
        if state_bytes(st.load(step)) != state_bytes(make_state(step, args.numel)):
            fails.append("final save does not load bit-exactly")
    return fails


#: kill just after one of these markers (+0..2 ms): the short phases of every operation
_PHASES = [
    "data", "publish", "published", "commit", "committed", "delete", "idle",
    "re-data", "re-publish", "re-published", "re-commit", "re-committed", "re-delete",
]
#: the phases each operation other than a save goes through (deletes: the hidden record's rewrite
#: or the record's and object's removal; the others: re-coding a step, then removing what it frees)
_OP_PHASES = {
    "delete": ["commit", "committed", "delete"],
    "rebase": ["data", "publish", "published", "commit", "committed", "delete"],
    "delnewest": ["data", "publish", "published", "commit", "committed", "delete"],
    "overwrite": ["data", "publish", "published", "commit", "committed", "delete"],
}


def _window(samples: list[float], default: float) -> float:
    return 1.2 * statistics.median(samples[-50:]) if samples else default


def run(args: argparse.Namespace, log: Any = None) -> dict[str, Any]:
    """Trials in turn: a kill after a uniform random delay; just after a random phase marker (+
    0..2 ms); at a uniform random time in the re-encoding window (after ``re-start``); at a
    uniform random time inside a delete, a merging delete, a delete of the newest step or an
    overwrite (after its ``O`` line)."""
    rng = random.Random(args.seed)
    model: dict[int, int] = {}
    by_stage: collections.Counter[str] = collections.Counter()
    by_reencode: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[str] = collections.Counter()
    ops_done: collections.Counter[str] = collections.Counter()
    ops_recoding: collections.Counter[str] = collections.Counter()  # ... that wrote a data object
    re_times: list[float] = []
    op_times: dict[str, list[float]] = collections.defaultdict(list)
    failures: list[dict[str, Any]] = []
    missed = 0
    t0 = time.monotonic()
    tmpdir = tempfile.mkdtemp(prefix="s4w-crash-")
    z = _Zygote(args, tmpdir)
    try:
        for trial in range(args.trials):
            kind = trial % 5
            focus, target, delay, jitter = "any", None, 2.5, 0.0
            if kind == 0:
                delay = rng.uniform(0.0, args.max_delay)
            elif kind == 1:
                target = (f"P {rng.choice(_PHASES)}", rng.randint(1, 3))
                jitter = rng.choice([0.0, rng.uniform(0, 0.002)])
            elif kind == 2:
                focus = "save"
                target = ("P re-start", rng.randint(1, 3))
                jitter = rng.uniform(0, _window(re_times, 0.05))
            elif kind == 3:
                focus = rng.choice(OPS[1:])
                target = (f"O {focus}", rng.randint(1, 2))
                jitter = rng.uniform(0, _window(op_times[focus], 0.05))
            else:
                focus = rng.choice(OPS[1:])
                target = (f"P {rng.choice(_OP_PHASES[focus])} {focus}", rng.randint(1, 2))
                jitter = rng.choice([0.0, rng.uniform(0, 0.002)])
            lines, reached = _run_and_kill(z, trial + args.seed * 1_000_003, focus, delay, target, jitter)
            # replay the child's lines on the model
            before, inflight, phase, re_phase, re_t = dict(model), None, "startup", "none", 0.0
            cur = dict(model)
            op_t, wrote = 0.0, False
            errors: list[str] = []
            for x in lines:
                if x[0] == "O":
                    inflight, op_t, wrote = (x[1], int(x[2]), int(x[3])), float(x[4]), False
                    before = dict(cur)
                    phase = "start"
                elif x[0] == "D":
                    assert inflight is not None
                    cur = _apply(cur, inflight, args.keep_last)
                    ops_done[inflight[0]] += 1
                    ops_recoding[inflight[0]] += wrote
                    op_times[inflight[0]].append(float(x[1]) - op_t)
                    before, inflight, phase = dict(cur), None, "idle"
                elif x[0] == "E":
                    errors.append(" ".join(x[1:-1]))
                elif x[0] == "P" and x[1].startswith("re-"):
                    if x[1] == "re-start":
                        re_t = float(x[-1])
                    if x[1].startswith("re-end-"):
                        outcomes[x[1][len("re-end-") :]] += 1
                        re_times.append(float(x[-1]) - re_t)
                        re_phase = "none"
                    else:
                        re_phase = x[1]
                elif x[0] == "P":
                    phase = x[1]
                    wrote = wrote or phase == "data"
            after = _apply(before, inflight, args.keep_last) if inflight is not None else before
            stage = f"{inflight[0] if inflight else 'between'}:{phase}"
            by_stage[stage] += 1
            by_reencode[re_phase] += 1
            found, fails = _check(args, before, after)
            fails = [f"the child's {stage.split(':')[0]} raised {e}" for e in errors] + fails
            model = found  # the store, once checked, is the model of the next trial
            if target is not None and reached:
                how = f"after {target[0]} #{target[1]} +{jitter * 1e3:.2f}ms"
            elif target is not None:
                how = f"after {delay:.1f}s ({target[0]} #{target[1]} not reached)"
                missed += 1
            else:
                how = f"after {delay:.3f}s"
            if fails:
                failures.append(
                    {"trial": trial, "kill": how, "stage": stage, "reencode": re_phase, "listed": sorted(found), "failures": fails}
                )
            if log is not None:
                print(
                    f"trial {trial}: kill {how}, in {stage}, re-encoding {re_phase}, "
                    f"ops {sum(1 for x in lines if x[0] == 'D')}, listed {sorted(found)}: "
                    f"{'FAIL ' + str(fails) if fails else 'ok'}",
                    file=log,
                    flush=True,
                )
    finally:
        z.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    final = _final(args)
    if final:
        failures.append({"trial": "final", "failures": final})
    import torch

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "url": args.url,
        "trials": args.trials,
        "seed": args.seed,
        "numel": args.numel,
        "keep_last": args.keep_last,
        "keyframe_every": args.keyframe_every,
        "max_delay_s": args.max_delay,
        "durable": getattr(args, "durable", True),
        "kills_by_stage": dict(sorted(by_stage.items())),
        "targets_not_reached": missed,
        "kills_by_reencode_phase": dict(sorted(by_reencode.items())),
        "ops_completed": dict(sorted(ops_done.items())),
        "ops_completed_writing_data": dict(sorted(ops_recoding.items())),
        "reencodes": dict(sorted(outcomes.items())),
        "reencode_median_s": round(statistics.median(re_times), 4) if re_times else None,
        "op_median_s": {k: round(statistics.median(v), 4) for k, v in sorted(op_times.items()) if v},
        "failures": failures,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="store URL (local path, s3://BUCKET/PREFIX)")
    ap.add_argument("--seaweedfs", action="store_true", help="start a local SeaweedFS and use s3://BUCKET/crash-<seed>")
    ap.add_argument("--trials", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--numel", type=int, default=1 << 19, help="bf16 elements (the state is ~4.5x this in bytes)")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--keyframe-every", type=int, default=4)
    ap.add_argument("--max-delay", type=float, default=1.5, help="kill after uniform(0, this) seconds")
    ap.add_argument("--no-fsync", dest="durable", action="store_false",
                    help="CheckpointStore(durable=False): a killed process must still leave a consistent store")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.zygote:
        _zygote(args)
        return 0
    srv = None
    if args.seaweedfs:
        sys.path.insert(0, _ROOT)
        from tests.fixtures.seaweedfs import start_seaweedfs

        srv = start_seaweedfs()
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
            os.environ.pop(k, None)
        os.environ.update(srv.env())
        args.url = f"s3://{srv.bucket}/crash-{args.seed}"
    if not args.url:
        ap.error("--url or --seaweedfs is required")
    try:
        res = run(args, log=sys.stderr if args.verbose else None)
    finally:
        if srv is not None:
            srv.stop()
    res["command"] = "python tests/reliability/crash_harness.py " + " ".join(argv if argv is not None else sys.argv[1:])
    summary = {k: v for k, v in res.items() if k != "failures"}
    summary["failures"] = len(res["failures"])
    print(json.dumps(summary, indent=1))
    for f in res["failures"][:10]:
        print("FAILURE", json.dumps(f)[:2000])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

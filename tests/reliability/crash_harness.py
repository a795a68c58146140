"""Crash-consistency harness: SIGKILL a saving process at random moments, then check the store.

A child process (a fresh interpreter, not a fork) opens the store, resumes at ``latest + 1`` and
saves steps of a deterministic state in a loop (``keep_last`` so that retention deletes run),
printing flushed lines: phase markers (``P data|published|commit|committed|delete``; with a
``re-`` prefix when the store's worker thread makes the call: the re-encoding of the step below
the newest as a delta against it, which runs behind each save) and ``committed K`` after each
save returns. The parent kills it with SIGKILL after a random delay, then checks, with a fresh
:class:`CheckpointStore`:

* every listed step was reported committed, or is the step in flight (its commit landed but the
  child died before saying so);
* the listed steps are contiguous, at most one more than before the trial or ``keep_last + 1``
  (a kill between commit and retention leaves one extra), and include every reported
  step that retention had no reason to delete; the latest is >= the last step reported committed;
* every listed step loads and equals the deterministic state of that step, byte for byte;
* the newest listed step is whole, and every delta's base step is listed.

The next trial's child resumes from the crashed store (so a save after a crash must work), and at
the end the parent saves once more, runs ``gc(grace_seconds=0)`` and checks that exactly the data
objects the commits need are left (no temporaries on a local store).

To keep the interpreter start-up (torch import, ~2 s) out of the kill window, the next child is
started while the current trial runs and waits on stdin for ``go``.

Usage::

    PYTHONPATH=. python tests/reliability/crash_harness.py --url /tmp/crash-store --trials 300 --seed 1 --out r.json
    PYTHONPATH=. python tests/reliability/crash_harness.py --seaweedfs --trials 100 --seed 2 --out r.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))


# ----------------------------------------------------------------------------- the state
_BASE: dict[int, Any] = {}


def make_state(step: int, numel: int) -> dict[str, Any]:
    """The state saved as ``step``: a fixed base (seed 0) of which a step-seeded 5 % of the
    elements move, so consecutive steps delta-code; plus a fresh fp32 "exp_avg" and an int."""
    import torch

    if numel not in _BASE:
        g = torch.Generator().manual_seed(0)
        _BASE[numel] = (
            (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16),
            torch.randn(numel // 2, generator=g) * 0.02,
        )
    b16, b32 = _BASE[numel]
    g = torch.Generator().manual_seed(1000 + step)
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


# ----------------------------------------------------------------------------- the child
def _worker(args: argparse.Namespace, fifo: str) -> None:
    """The saving process: says its pid, then saves steps until it is killed."""
    import contextlib

    from s4w_core.store.store import CheckpointStore

    out = open(fifo, "w", buffering=1)  # noqa: SIM115 - lives until the process is killed
    out.write(f"pid {os.getpid()}\n")
    out.flush()

    import threading

    main = threading.main_thread()

    def mark(p: str) -> None:
        out.write(f"P {'' if threading.current_thread() is main else 're-'}{p}\n")
        out.flush()

    store = CheckpointStore(args.url, keep_last=args.keep_last, keyframe_every=args.keyframe_every)
    inner = store.backend

    class Phases:
        """Delegates to the real backend; says which phase the child is in before each call."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

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
    latest = store.latest()
    step = 1 if latest is None else latest + 1
    while True:
        mark("encode")
        store.save(make_state(step, args.numel), step)
        out.write(f"committed {step}\n")
        out.flush()
        mark("idle")
        step += 1


def _zygote(args: argparse.Namespace) -> None:
    """A fresh interpreter (started with subprocess) that imports torch and s4w_core once, then
    forks one worker per ``fork FIFO`` line on stdin: the workers skip the ~2 s import, so the
    kill window is spent saving."""
    import s4w_core.store.store  # noqa: F401 - imported once, before the forks

    make_state(0, args.numel)  # the base, computed once
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped automatically
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, fifo = line.strip().partition(" ")
        if cmd != "fork":
            break
        if os.fork() == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(0)
                _worker(args, fifo)
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
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("OMP_NUM_THREADS", "1")
        self.tmpdir = tmpdir
        self.n = 0
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

    def fork(self) -> tuple[int, int]:
        """Start a worker; returns (its pid, the read end of its output)."""
        self.n += 1
        fifo = os.path.join(self.tmpdir, f"w{self.n}")
        os.mkfifo(fifo)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        assert self.p.stdin is not None
        self.p.stdin.write(f"fork {fifo}\n".encode())
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


def _run_and_kill(z: _Zygote, delay: float, target: tuple[str, int] | None, jitter: float) -> tuple[list[int], str]:
    """Fork a worker and SIGKILL it ``delay`` seconds later, or ``jitter`` seconds after its
    ``target[1]``-th ``P target[0]`` marker; returns (steps reported committed, last marker)."""
    pid, fd = z.fork()
    buf = z.pending
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline:
        if target is not None and buf.count(f"P {target[0]}\n".encode()) >= target[1]:
            if jitter:
                time.sleep(jitter)
            break
        if select.select([fd], [], [], 0.0005 if target else 0.02)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"worker {pid} exited by itself:\n{z.stderr()}")
            buf += chunk
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
    lines = buf.decode().splitlines()
    committed = [int(x.split()[1]) for x in lines if x.startswith("committed ")]
    phases = [x[2:] for x in lines if x.startswith("P ")]
    return committed, (phases[-1] if phases else "startup")


def _check(
    args: argparse.Namespace, reported: set[int], last_reported: int | None, before: int = 0
) -> tuple[list[int], list[str]]:
    """Open the store fresh and check it; returns (listed steps, failures)."""
    from s4w_core.store.store import CheckpointStore

    fails: list[str] = []
    with CheckpointStore(args.url) as st:
        listed = st.steps()
        allowed = set(reported) | ({last_reported + 1} if last_reported is not None else {1})
        if not set(listed) <= allowed:
            fails.append(f"listed steps never committed: {sorted(set(listed) - allowed)}")
        if last_reported is not None and (not listed or max(listed) < last_reported):
            fails.append(f"latest {listed[-1:] or None} < last reported committed {last_reported}")
        if listed:
            if listed != list(range(listed[0], listed[-1] + 1)):
                fails.append(f"listed steps not contiguous: {listed}")
            # retention runs after each commit: a kill between the two leaves one step more,
            # which the next completed save deletes (so consecutive such kills can add up)
            if len(listed) > max(before, args.keep_last) + 1:
                fails.append(f"{len(listed)} steps listed (keep_last={args.keep_last}, {before} before): {listed}")
            must = {s for s in reported if s > listed[-1] - args.keep_last}
            if not must <= set(listed):
                fails.append(f"committed steps lost: {sorted(must - set(listed))}")
        recs = {r.step: r for r in st.list()}
        if listed and recs[listed[-1]].kind != "keyframe":
            fails.append(f"the newest step {listed[-1]} is not whole: {recs[listed[-1]].kind}")
        for r in recs.values():
            if r.kind == "delta" and r.base_step not in recs:
                fails.append(f"step {r.step} is a delta against step {r.base_step}, which is not listed")
        for s in listed:
            try:
                got = st.load(s)
            except Exception as e:  # noqa: BLE001 - any failure to load is a finding
                fails.append(f"step {s} does not load: {type(e).__name__}: {e}")
                continue
            if state_bytes(got) != state_bytes(make_state(s, args.numel)):
                fails.append(f"step {s} loads but differs from what was saved")
    return listed, fails


def _final(args: argparse.Namespace) -> list[str]:
    """A save after the last crash works, and gc leaves exactly the live data objects."""
    from s4w_core.store.store import CheckpointStore

    fails: list[str] = []
    with CheckpointStore(args.url, keep_last=args.keep_last, keyframe_every=args.keyframe_every) as st:
        latest = st.latest()
        step = 1 if latest is None else latest + 1
        st.save(make_state(step, args.numel), step)
        st.gc(grace_seconds=0)
        live = {o for r in st.list() for o in r.live_objects}
        present = {o.key for o in st.backend.list("data/")}
        if present != live:
            fails.append(f"after gc: data objects {sorted(present ^ live)} present/live mismatch")
        tmps = getattr(st.backend, "list_temporaries", None)
        if tmps is not None and tmps():
            fails.append(f"after gc: temporaries left: {[o.key for o in tmps()]}")
        if state_bytes(st.load(step)) != state_bytes(make_state(step, args.numel)):
            fails.append("final save does not load bit-exactly")
    return fails


_TARGETS = [
    "data", "publish", "published", "commit", "committed", "delete", "idle",
    # the re-encoding behind a save: its data object, its record rewrite, the old object's removal
    "re-data", "re-publish", "re-published", "re-commit", "re-committed", "re-delete",
]


def run(args: argparse.Namespace, log: Any = None) -> dict[str, Any]:
    """Half the kills after a uniform random delay, half just after a randomly chosen phase
    marker (plus up to 2 ms), so that the short phases (publish, commit, deletes) are hit too."""
    rng = random.Random(args.seed)
    reported: set[int] = set()
    last_reported: int | None = None
    phases: collections.Counter[str] = collections.Counter()
    failures: list[dict[str, Any]] = []
    commits_per_trial: list[int] = []
    before = 0
    t0 = time.monotonic()
    tmpdir = tempfile.mkdtemp(prefix="s4w-crash-")
    z = _Zygote(args, tmpdir)
    try:
        for trial in range(args.trials):
            if trial % 2:
                target: tuple[str, int] | None = (rng.choice(_TARGETS), rng.randint(1, 3))
                delay, jitter = 10.0, rng.choice([0.0, rng.uniform(0, 0.002)])
            else:
                target, delay, jitter = None, rng.uniform(0.0, args.max_delay), 0.0
            committed, phase = _run_and_kill(z, delay, target, jitter)
            phases[phase] += 1
            commits_per_trial.append(len(committed))
            reported |= set(committed)
            if committed:
                last_reported = max(committed)
            listed, fails = _check(args, reported, last_reported, before)
            before = len(listed)
            # the store, once checked, is the reference for the next trial: a listed step is
            # committed (the in-flight one included); steps retention deleted are not required
            reported = set(listed)
            last_reported = max(listed) if listed else last_reported
            how = f"after P {target[0]} #{target[1]} +{jitter * 1e3:.2f}ms" if target else f"after {delay:.3f}s"
            if fails:
                failures.append({"trial": trial, "kill": how, "phase": phase, "listed": listed, "failures": fails})
            if log is not None:
                print(
                    f"trial {trial}: kill {how}, last phase {phase}, committed {committed}, listed {listed}: "
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
        "kills_by_phase": dict(sorted(phases.items())),
        "saves_committed": sum(commits_per_trial),
        "trials_with_no_commit": sum(1 for c in commits_per_trial if c == 0),
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

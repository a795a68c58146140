"""A long fuzzing run without atheris: random structure-aware mutations of seed containers and
framework files, one process (one core), every input under a 10 s alarm.

Usage::

    python -m tests.fuzz.long_run --containers 1000000 --framework 100000 --out results.txt

Containers go through :func:`harness.run_one` (load + verify; 1-3 stacked mutations of a seed, or,
for 5% of inputs, 1-16 random bytes fed as they are), framework files through :func:`framework.run_one_framework` (pack,
unpack, byte compare; 5% through a container). A finding is any exception other than an
``S4WError`` from a container, any exception from a framework file, or an input running past the
alarm: each is written to ``--artifacts`` (replay it with ``harness.run_one`` /
``framework.run_one_framework``). Prints a summary (and writes it to ``--out``): inputs, outcome
classes, findings, slowest input, peak RSS.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import signal
import sys
import time
import traceback
from collections import Counter
from typing import Any, Callable

from tests.fuzz import framework, harness


class _Hang(Exception):
    pass


def _alarm(_sig: int, _frame: Any) -> None:
    raise _Hang


def _phase(name: str, n: int, target: Callable[[bytes], str], rng: random.Random, args: argparse.Namespace,
           report: list[str]) -> int:
    outcomes: Counter[str] = Counter()
    findings = 0
    slowest = (0.0, b"")
    t0 = time.perf_counter()
    for i in range(n):
        first = rng.randrange(256)
        if first % 4 == 0 and rng.random() < 0.8:  # mode 0 (bytes as they are: tiny, mostly garbage) at 5%
            first += rng.randrange(1, 4)
        data = bytes([first]) + rng.randbytes(rng.randint(1, 16))
        t = time.perf_counter()
        signal.alarm(args.timeout)
        try:
            outcomes[target(data)] += 1
        except _Hang:
            findings += 1
            outcomes["HANG"] += 1
            _save(args, name, "hang", data, "")
        except Exception as e:  # noqa: BLE001 - the finding
            findings += 1
            outcomes[f"FINDING {type(e).__name__}"] += 1
            _save(args, name, type(e).__name__, data, traceback.format_exc())
        finally:
            signal.alarm(0)
        dt = time.perf_counter() - t
        if dt > slowest[0]:
            slowest = (dt, data)
        if args.progress and (i + 1) % args.progress == 0:
            print(f"{name}: {i + 1}/{n} inputs, {findings} findings, {(i + 1) / (time.perf_counter() - t0):.0f}/s",
                  file=sys.stderr, flush=True)
    secs = time.perf_counter() - t0
    report.append(f"{name}: {n} inputs in {secs:.0f} s ({n / max(secs, 1e-9):.0f}/s), {findings} findings, "
                  f"slowest input {slowest[0]:.2f} s ({slowest[1].hex()})")
    for k, v in outcomes.most_common():
        report.append(f"  {k}: {v}")
    return findings


def _save(args: argparse.Namespace, phase: str, kind: str, data: bytes, tb: str) -> None:
    os.makedirs(args.artifacts, exist_ok=True)
    base = os.path.join(args.artifacts, f"{phase}-{kind}-{data.hex()}")
    with open(base + ".bin", "wb") as f:
        f.write(data)
    with open(base + ".txt", "w") as f:
        f.write(tb)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--containers", type=int, default=10_000)
    ap.add_argument("--framework", type=int, default=1_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=10, help="seconds per input before it counts as a hang")
    ap.add_argument("--artifacts", default="fuzz-artifacts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--progress", type=int, default=0, help="print progress every N inputs")
    args = ap.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(args.seed)
    harness.seeds()
    framework.framework_seeds()
    report = [f"# tests/fuzz/long_run.py --containers {args.containers} --framework {args.framework} --seed {args.seed}",
              f"# python {sys.version.split()[0]}, one process"]
    found = _phase("containers", args.containers, harness.run_one_outcome, rng, args, report)
    found += _phase("framework files", args.framework, framework.run_one_framework, rng, args, report)
    report.append(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10} MiB; findings {found}")
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

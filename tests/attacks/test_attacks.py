"""The attack suite: every hostile input ends in an ``S4WError`` (or a safe success) within 10 s
and 512 MiB of address space above a warm import-only process, run in a subprocess under
``RLIMIT_AS`` (tests/attacks/child.py; one child per attack family). On a GPU the container
cases run again with ``map_location="cuda"``, the GPU's peak allocation held to the same bound."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import s4w_core
from tests.attacks.generators import GENERATORS, Case

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUDGET_MB = 512
CASE_SECONDS = 10.0
#: torch submodules a file must never make a reader import (by naming them as a dtype)
FORBIDDEN_MODULES = ("torch.onnx", "torch._dynamo", "torch.jit", "torch.distributed")


def _write_cases(cases: list[Case], d: str) -> None:
    index = []
    for i, c in enumerate(cases):
        fn = f"{i:04d}.bin"
        with open(os.path.join(d, fn), "wb") as f:
            f.write(c.payload)
            if c.hole:
                f.seek(c.hole, os.SEEK_CUR)  # sparse: costs no disk
            f.write(c.tail)
        index.append({"file": fn, "name": c.name, "kind": c.kind})
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump(index, f)


def run_cases(cases: list[Case], tmp: str, device: str = "cpu") -> dict[str, dict[str, Any]]:
    """Run ``cases`` in one child; returns the result line per case name. A child that dies or
    hangs fails the test naming the case it was running."""
    _write_cases(cases, tmp)
    env = dict(os.environ, MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("S4W_LIMITS", None)  # the defaults are what is tested
    budget = 60 + CASE_SECONDS * len(cases) * 2
    try:
        r = subprocess.run(
            [sys.executable, "-m", "tests.attacks.child", tmp, str(BUDGET_MB), device],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget,
        )
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = "timeout", None
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    results = {x["name"]: x for x in lines if "name" in x}
    started = [x["start"] for x in lines if "start" in x]
    if rc != 0 or len(results) != len(cases):
        culprit = started[-1] if started else "<startup>"
        pytest.fail(f"the child died or hung (rc={rc}) while running case {culprit!r}:\n{err[-3000:]}")
    return results


def check(cases: list[Case], results: dict[str, dict[str, Any]], device: str = "cpu") -> None:
    problems = []
    for c in cases:
        r = results[c.name]
        if r["outcome"] == "other":
            problems.append(f"{c.name}: not an S4WError: {r['error']}\n{r.get('trace', '')}")
        elif c.expect == "error" and r["outcome"] != "error":
            problems.append(f"{c.name}: expected an S4WError, it loaded")
        elif c.expect == "ok" and r["outcome"] != "ok":
            problems.append(f"{c.name}: expected a clean success, got {r.get('error')}")
        if c.kind == "load" and r["outcome"] == "error" and r.get("verify_ok"):
            problems.append(f"{c.name}: load failed ({r.get('error')}) but verify says OK")
        if r["seconds"] > CASE_SECONDS:
            problems.append(f"{c.name}: took {r['seconds']} s (> {CASE_SECONDS})")
        bad_mods = [m for m in r["new_torch_modules"] if m.startswith(FORBIDDEN_MODULES)]
        if bad_mods:
            problems.append(f"{c.name}: imported {bad_mods}")
        if device == "cuda" and r.get("gpu_peak", 0) > BUDGET_MB << 20:
            problems.append(f"{c.name}: GPU peak {r['gpu_peak'] >> 20} MiB")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("family", sorted(GENERATORS))
def test_attack_family(family: str, tmp_path: "os.PathLike[str]") -> None:
    cases = list(GENERATORS[family]())
    assert len({c.name for c in cases}) == len(cases)
    results = run_cases(cases, str(tmp_path))
    check(cases, results)
    # the suite can fail: every family has cases that must be refused
    assert any(c.expect == "error" for c in cases) or family == "framework"


CONTAINER_FAMILIES = ("allocation", "manifest", "structure", "tags", "codec_streams", "garbage")


@pytest.mark.gpu
@pytest.mark.parametrize("family", CONTAINER_FAMILIES)
def test_attack_family_gpu(family: str, tmp_path: "os.PathLike[str]") -> None:
    cases = [c for c in GENERATORS[family]() if c.kind == "load"]
    results = run_cases(cases, str(tmp_path), device="cuda")
    check(cases, results, device="cuda")


def test_the_child_catches_a_budget_breach(tmp_path: "os.PathLike[str]") -> None:
    """The harness itself can fail: a case that allocates past the budget is reported as not an
    S4WError (the address-space cap turns the allocation into a MemoryError/RuntimeError)."""
    buf = io.BytesIO()
    s4w_core.save({"w": torch.zeros(BUDGET_MB << 18, dtype=torch.float32)}, buf)  # 512 MiB of zeros: legal, too big
    case = Case("legit_but_over_budget", "load", buf.getvalue(), "ok")
    results = run_cases([case], str(tmp_path))
    assert results[case.name]["outcome"] == "other", results

"""The framework examples run end to end at their default sizes (20-40 s each on 2 CPU cores),
report bit-exact resume, and do what their docstrings say: each claim below is read from the
docstring and must match what the run prints.  (train_tiny.py and read_container.py run in
tests/unit/test_examples.py; README's and docs' snippets in tests/unit/test_docs_snippets.py.)"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

#: (package it needs, script, claims): a claim is (regex over the docstring whose groups are the
#: claimed values, regex over the output with {0}, {1}... for them)
EXAMPLES = [
    ("lightning", "examples/lightning_char_lm.py", [
        (r"Trains (\d+) steps", r"trained to step {0}\b"),
        (r"resumes from the oldest checkpoint top-3 kept", r"^resumed from epoch=\d+-step=\d+\.ckpt \(the oldest kept\)"),
        (r"a new\s+``/tmp/(s4w-lightning-)\*``", r"^writing under \S*/{0}\w+ "),  # /tmp: TMPDIR here
    ]),
    ("transformers", "examples/hf_tiny_gpt2.py", [
        (r"\[--steps (\d+)\]", r"to step {0}\b"),
        (r"the step-(\d+)\s+checkpoint is restored from the store", r"resumed from step {0} \(restored from the store\)"),
    ]),
    ("accelerate", "examples/accelerate_mlp.py", [
        (r"trains (\d+) steps, ``save_state\(\)`` every (\d+)", r"store step 3 \(checkpoint_3\)"),
        (r"``load_state\(\)``s the step-(\d+)\s+checkpoint \(``checkpoints/(checkpoint_\d+)``\)",
         r"resumed from {1} \(step {0}, restored from the store\)"),
    ]),
    ("torch", "examples/dcp_fsdp.py", [
        (r"``dcp.save`` at step (\d+)", r"^step {0} checkpoint, 2 ranks"),
    ]),
]


def _doc(script: str) -> str:
    with open(os.path.join(ROOT, script)) as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    assert doc, f"{script} has no docstring"
    return doc


@pytest.mark.parametrize(("pkg", "script", "claims"), EXAMPLES, ids=[e[1].split("/")[-1] for e in EXAMPLES])
def test_docstring_claims_are_found(pkg: str, script: str, claims: list[tuple[str, str]]) -> None:
    """Cheap: each claim the run is checked against is still in the docstring."""
    doc = _doc(script)
    for claim, _ in claims:
        assert re.search(claim, doc), f"{script}: its docstring no longer says {claim!r}"


@pytest.mark.slow
@pytest.mark.parametrize(("pkg", "script", "claims"), EXAMPLES, ids=[e[1].split("/")[-1] for e in EXAMPLES])
def test_example(pkg: str, script: str, claims: list[tuple[str, str]], tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip(pkg)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]), OMP_NUM_THREADS="1",
               TMPDIR=str(tmp_path))
    out_dir = [] if script.endswith("lightning_char_lm.py") else ["--out", str(tmp_path)]  # its default folder is a claim
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *out_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    assert last["bit_exact_vs_uninterrupted"] is True
    assert "savings" in r.stdout or "stored" in r.stdout
    doc = _doc(script)
    for claim, shown in claims:
        m = re.search(claim, doc)
        assert m, f"{script}: its docstring no longer says {claim!r}"
        want = shown.format(*(re.escape(g) for g in m.groups()))
        assert re.search(want, r.stdout, re.M), f"{script} claims {m.group(0)!r}, but its output has no {want!r}:\n{r.stdout[-3000:]}"


def test_every_example_is_run_somewhere() -> None:
    ran = {os.path.basename(s) for _, s, _ in EXAMPLES} | {"train_tiny.py", "read_container.py"}
    assert set(os.listdir(os.path.join(ROOT, "examples"))) - ran <= {"__pycache__"}
    with open(os.path.join(ROOT, "tests", "unit", "test_examples.py")) as f:
        unit = f.read()
    assert "train_tiny.py" in unit and "read_container.py" in unit

"""The GPU kernels (and the GPU writer/reader plumbing) against the CPU reference, without a GPU.

Each check in :mod:`tests.parity._interpret_checks` runs in a subprocess with ``TRITON_INTERPRET=1``
set before triton is imported, so Triton's interpreter executes the kernels on CPU tensors. CI runs
these; the @gpu tests in this folder run the same kernels compiled, on the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")

from tests.parity._interpret_checks import CHECKS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_interpreted(name: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("S4W_DISABLE_GPU", None)
    r = subprocess.run(
        [sys.executable, "-m", "tests.parity._interpret_checks", name],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    assert f"ok {name}" in r.stdout

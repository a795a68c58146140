"""s4w_accelerate with 2 CPU processes (gloo) through torchrun: the main process stores every
process's RNG states; each process resumes bit-exactly."""

from __future__ import annotations

import os

import pytest

from tests.integrations._util import torchrun_json

pytest.importorskip("accelerate")


def test_two_processes_resume_bit_exact(tmp_path):
    got = torchrun_json(os.path.join(os.path.dirname(__file__), "mp_worker.py"), str(tmp_path), 240)
    assert got == {"steps": [0], "rngs": 2, "same": [True, True], "files": []}

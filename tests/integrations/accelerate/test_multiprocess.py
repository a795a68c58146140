"""s4w_accelerate with 2 CPU processes (gloo) through torchrun: the main process stores every
process's RNG states; each process resumes bit-exactly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def test_two_processes_resume_bit_exact(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]), OMP_NUM_THREADS="1")
    env.pop("S4W_ACCELERATE", None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    worker = os.path.join(os.path.dirname(__file__), "mp_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    r = subprocess.run(
        [*cmd, "--master_port", port, worker, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    assert got == {"steps": [0], "rngs": 2, "same": [True, True], "files": []}

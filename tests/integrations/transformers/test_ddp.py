"""S4Callback under DDP: 2 CPU processes (gloo) through torchrun; rank 0 writes every rank's RNG."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def test_ddp_two_processes_resume_bit_exact(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]), OMP_NUM_THREADS="1")
    worker = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", port, worker]
    r = subprocess.run([*cmd, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    assert got == {"steps": [3, 6], "rngs": 2, "same": True, "files": [".s4w"]}

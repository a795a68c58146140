"""Helpers shared by the integration tests: bit-exact comparison of nested checkpoint state, and a
worker script run on 2 processes through torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}/"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}/"))
    else:
        out[prefix.rstrip("/")] = obj
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def diff(a: Any, b: Any, ignore: tuple[str, ...] = ()) -> list[str]:
    """Paths where ``a`` and ``b`` differ; tensors compared byte for byte (dtype and shape too)."""
    fa, fb = flatten(a), flatten(b)
    bad = sorted(k for k in set(fa) ^ set(fb) if not k.startswith(ignore))
    for k in sorted(set(fa) & set(fb)):
        if ignore and k.startswith(ignore):
            continue
        x, y = fa[k], fb[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if (
                not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor))
                or x.dtype != y.dtype
                or x.shape != y.shape
            ):
                bad.append(k)
            elif not torch.equal(bits(x), bits(y)):
                bad.append(k)
        elif type(x) is not type(y) or x != y:
            if not (isinstance(x, float) and isinstance(y, float) and x != x and y != y):
                bad.append(k)
    return bad


def torchrun_json(worker: str, out: str, timeout: float, **env_extra: str) -> dict[str, Any]:
    """Run ``worker out`` on 2 processes (``torch.distributed.run``, a free loopback port; the project
    and the caller's PYTHONPATH first); fail with its output unless it exits 0; return the last JSON
    line it printed."""
    paths = [ROOT, os.path.join(ROOT, "integrations"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", **env_extra)
    env.pop("S4W_ACCELERATE", None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    r = subprocess.run([*cmd, "--master_port", port, worker, out], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])

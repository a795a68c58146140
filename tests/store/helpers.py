"""Shared helpers for the store tests: synthetic training states, bit-exact comparison, a
fault-injecting backend wrapper."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from typing import IO, Any, Callable, Iterator

import torch

from s4w_core.store._backend import Backend, ObjectInfo, RangeReader
from s4w_core.store._memory import MemoryBackend

SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.0e38]


def make_run(steps: int, *, n: int = 3000, seed: int = 0, lr: float = 1e-3) -> list[dict[str, Any]]:
    """``steps`` states of a fake AdamW run: bf16 and fp32 weights drifting slowly, exp_avg
    noisy, exp_avg_sq slowly varying, special values included, a shared-storage view, an int
    buffer and plain Python values."""
    g = torch.Generator().manual_seed(seed)
    w32 = torch.randn(n, generator=g) * 0.02
    w16 = (torch.randn(n, 64, generator=g) * 0.02).to(torch.bfloat16)
    v = torch.rand(n, generator=g) * 1e-4
    out = []
    for t in range(steps):
        grad = torch.randn(n, generator=g)
        w32 = w32 - lr * torch.randn(n, generator=g).sign() * 0.5
        w16 = (w16.float() - lr * torch.randn(n, 64, generator=g)).to(torch.bfloat16)
        v = 0.95 * v + 0.05 * grad * grad * 1e-4
        w32s = w32.clone()
        w32s[: len(SPECIAL)] = torch.tensor(SPECIAL)
        emb = w16.clone()
        out.append(
            {
                "model": {"w32": w32s, "emb": emb, "emb_view": emb[2:5], "buf": torch.arange(t, t + 7)},
                "optimizer": {
                    "state": {0: {"step": torch.tensor(float(t)), "exp_avg": grad.clone(), "exp_avg_sq": v.clone()}},
                    "param_groups": [{"lr": lr, "betas": (0.9, 0.95), "params": [0]}],
                },
                "step": t,
                "note": f"step {t}",
            }
        )
    return out


def bits_equal(a: Any, b: Any) -> bool:
    """Structural equality with tensors compared bit for bit (NaN payloads, -0.0 included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.contiguous(), b.contiguous()
        return bool(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))) if a.numel() else True
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))
    return a == b


class Crash(Exception):
    """The injected failure."""


class FaultyBackend(Backend):
    """Wraps a backend; ``fail(verb, key)`` may return True to raise :class:`Crash` there.
    For ``writer`` the failure happens after ``after_bytes`` bytes were streamed."""

    def __init__(self, inner: Backend, fail: Callable[[str, str], bool], after_bytes: int = 100) -> None:
        self.inner = inner
        self.url = inner.url
        self.fail = fail
        self.after_bytes = after_bytes

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        doomed = self.fail("writer", key)
        with self.inner.writer(key) as f:
            if not doomed:
                yield f
                return
            outer = self

            class _W:
                n = 0

                def write(self, data: Any) -> int:
                    if self.n + len(data) > outer.after_bytes:
                        raise Crash(f"injected crash while writing {key}")
                    self.n += len(data)
                    return f.write(data)

            yield _W()  # type: ignore[misc]

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if self.fail("put", key):
            raise Crash(f"injected crash before writing {key}")
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def open_range(self, key: str) -> RangeReader:
        return self.inner.open_range(key)

    def fetch(self, key: str) -> RangeReader:
        return self.inner.fetch(key)

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        if self.fail("delete", key):
            raise Crash(f"injected crash before deleting {key}")
        self.inner.delete(key)


@contextlib.contextmanager
def memory_urls(*prefixes: str) -> Iterator[list[str]]:
    """Fresh ``memory://`` store URLs, one per prefix, dropped afterwards (a hypothesis example's
    stores: function-scoped fixtures run once per test, not per example)."""
    names = [f"{p}-{uuid.uuid4().hex[:10]}" for p in prefixes]
    try:
        yield [f"memory://{n}" for n in names]
    finally:
        for n in names:
            MemoryBackend.drop(n)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[str]:
    """A fresh temporary directory, removed afterwards (per hypothesis example, as above)."""
    d = tempfile.mkdtemp(prefix=prefix)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)

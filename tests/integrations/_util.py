"""Helpers shared by the integration tests: bit-exact comparison of nested checkpoint state."""

from __future__ import annotations

from typing import Any

import torch


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

"""Checks that a re-encoded container stands for the step it replaces: the same storages, tree
and tensor table, and the same bytes."""

from __future__ import annotations

import builtins
from typing import Any, Mapping

import torch

from s4w_core import checksum as ck

__all__ = ["same_storages", "same_layout"]


def same_storages(
    copy: Mapping[str, Any],
    own: Mapping[str, Any],
    raws: builtins.list[torch.Tensor] | None = None,
    devices: builtins.list[str] | None = None,
    *,
    deltas: bool = False,
) -> str | None:
    """Why a re-encoded container's manifest does not stand for the step's own (None: it does):
    the same storages in the same order (path, dtype, size), none a delta unless ``deltas``, same tree, and the same
    bytes: equal checksums, or, where the two were computed with different algorithms (the
    GPU writer sums data on a device with ``fold64``, hashes host data with ``xxh3``), the
    step's own checksum verified on ``raws``, the host bytes the copy was encoded from
    (``fold64`` on ``devices[i]`` when that is a usable GPU)."""
    why = same_layout(copy, own, deltas=deltas)
    if why is not None:
        return why
    for i, (x, y) in enumerate(zip(copy["storages"], own["storages"])):
        if x["checksum"] == y["checksum"]:
            continue
        if raws is None or str(x["checksum"]).split(":")[0] == str(y["checksum"]).split(":")[0]:
            return f"storage {i} ({x['path']!r}) holds other bytes (checksum {x['checksum']}, the step's {y['checksum']})"
        dev = devices[i] if devices is not None else "cpu"
        where = torch.device(dev) if dev.startswith("cuda") and torch.cuda.is_available() else None
        if not ck.verify_tensor_checksum(y["checksum"], raws[i], where):
            return f"storage {i} ({x['path']!r}): the host copy it was encoded from is not the step's bytes"
    return None


def same_layout(copy: Mapping[str, Any], own: Mapping[str, Any], *, deltas: bool = False) -> str | None:
    """:func:`_same_storages` without the bytes: storages (path, dtype, size), no delta (unless
    ``deltas``), tree."""
    a, b = copy["storages"], own["storages"]
    if len(a) != len(b):
        return f"{len(a)} storages, the step has {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.get("delta") and not deltas:
            return f"storage {i} is a delta"
        if (x["path"], x["dtype"], x["nbytes"]) != (y["path"], y["dtype"], y["nbytes"]):
            return f"storage {i} ({x['path']!r}) differs"
    def table(m: Mapping[str, Any]) -> builtins.list[dict[str, Any]]:  # without a reader's own annotations
        return [{k: v for k, v in t.items() if not k.startswith("_")} for t in m["tensors"]]

    if copy["tree"] != own["tree"] or table(copy) != table(own):
        return "its tree or tensor table differs"
    return None

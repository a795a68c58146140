"""Samples for the GPU writer's choices (the delta op, the nonzero and the row/column transforms):
gathered onto the device in one copy, and estimated in groups of bounded size.

Each choice estimates every candidate storage's coded size on a sample of it; the estimates of
many storages run in a fixed number of kernels per group of samples, and a group's temporaries
(int64 keys and indices per sample element, several of them) bound the device memory a save's
choices take: :func:`bounded_groups` cuts the samples into groups of at most a given number of
elements.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from s4w_core.gpu import _nvcomp

__all__ = ["bounded_groups", "gather_samples", "runs_of"]

_T = TypeVar("_T", bound=tuple)
_I = TypeVar("_I")


def gather_samples(
    items: list[tuple[torch.Tensor, list[tuple[int, int]], int]], dev: torch.device
) -> list[torch.Tensor]:
    """The elements ``ranges`` of each byte tensor ``t`` (element width ``w``) of ``items`` ``(t,
    ranges, w)``, concatenated per item, on ``dev``: a device tensor's gathered there, the host
    tensors' gathered on the host and moved over in one copy for all of them (a host copy's sample
    is many small ranges, a re-encoding's hundreds of storages: a transfer each would cost more
    than the estimate)."""
    out: list[torch.Tensor] = []
    host: list[tuple[int, list[np.ndarray]]] = []
    for k, (t, ranges, w) in enumerate(items):
        if t.device.type == "cpu":
            a = t.numpy()
            host.append((k, [a[s0 * w : s1 * w] for s0, s1 in ranges]))
            out.append(t[:0])  # replaced by its device copy below
        else:
            s = torch.cat([t[s0 * w : s1 * w] for s0, s1 in ranges] or [t[:0]])
            out.append(s if s.device == dev else s.to(dev))
    if host:
        lens = [sum(p.size for p in parts) for _k, parts in host]
        if dev.type == "cuda":  # gathered straight into pinned memory, moved without a host-side wait
            stage = _nvcomp.host_empty(sum(lens))
        else:
            stage = torch.empty(max(sum(lens), 1), dtype=torch.uint8)
        at = sum(lens)
        if at:  # every range in one C loop
            np.concatenate([p for _k, parts in host for p in parts], out=stage.numpy()[:at])
        flat = stage[:at].to(dev, non_blocking=True)
        for (k, _parts), piece in zip(host, torch.split(flat, lens)):
            out[k] = piece
    return out


def bounded_groups(items: list[_T], limit: int, at: int = 1) -> list[list[_T]]:
    """``items`` (tuples holding a sample tensor at index ``at``) cut, in order, into runs of at
    most ``limit`` sample elements (one item more where a single item exceeds it)."""
    return runs_of(items, [it[at].numel() for it in items], limit)


def runs_of(items: list[_I], sizes: list[int], limit: int) -> list[list[_I]]:
    """``items`` cut, in order, into runs whose ``sizes`` add up to at most ``limit`` (one item
    more where a single item exceeds it)."""
    out: list[list[_I]] = []
    total = 0
    for it, n in zip(items, sizes):
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(it)
        total += n
    return out

"""The host copy of a store's newest step (docs/STORE.md, "Host memory"): the bytes the step
below it is re-encoded against, and the bytes the next save re-encodes as a delta.  CUDA states,
and large host states in a process that uses CUDA (a DCP rank's staged shards), are kept in the
store's pinned buffers (:class:`~s4w_core.hostmem.PinnedPool`), reused from save to save."""

from __future__ import annotations

import builtins
from typing import Any, Mapping

import torch

from s4w_core import pipeline
from s4w_core.hostmem import HostFill, host_copies, pooled_sizes, pools_host_copies
from s4w_core.store.chain import CachedBase, source_of_manifest
from s4w_core.store.core import StoreCore
from s4w_core.store.records import StepInfo

__all__ = ["BaseCache"]


class BaseCache(StoreCore):
    """Keeps, gives back and fills the host copy of the newest step."""

    def _unpool(self, cache: CachedBase | None) -> None:
        """Give a pooled cache's pinned buffers back for the next GPU save's copy."""
        if cache is not None and cache.pooled:
            self._pinned_pool.give(cache.raws or [t for t, _, _ in cache.storages.values()])

    def _make_cache(
        self,
        step: int,
        obj: str,
        manifest: Mapping[str, Any],
        raws: builtins.list[torch.Tensor],
        *,
        copy: bool = True,
        pooled: bool = False,
        source: Any = None,
    ) -> CachedBase | None:
        """Host copies of a step's storages by path (None beyond ``base_cache_bytes``); with
        ``copy=False`` CPU ``raws`` are kept as they are (a snapshot, or pinned copies).
        ``source``: :func:`state_source` of the state, kept for a keyframe copy."""
        total = sum(r.numel() for r in raws)
        if self.base_cache_bytes is not None and total > self.base_cache_bytes:
            return None
        storages: dict[str, tuple[torch.Tensor, dict[str, Any], str]] = {}
        hosts: builtins.list[torch.Tensor] = []
        for i, (s, raw) in enumerate(zip(manifest["storages"], raws)):
            t = raw.detach() if not copy and raw.device.type == "cpu" else raw.detach().to("cpu", copy=True)
            hosts.append(t.view(-1))
            if s["path"] in storages or raw.numel() != s["nbytes"]:
                continue
            ref = {"object": obj, "storage": i, "checksum": s["checksum"]}
            storages[s["path"]] = (t.view(-1), ref, s["dtype"])
        return CachedBase(step, obj, storages, total, pooled, hosts, source, manifest)

    def _remember(
        self,
        rec: StepInfo,
        manifest: Mapping[str, Any],
        raws: builtins.list[torch.Tensor],
        fill: HostFill | None = None,
    ) -> None:
        """Keep copies of a committed step's storages (within ``base_cache_bytes``), the bytes the
        next save re-encodes (see :meth:`_base_copies`); ``fill``: the load's copies, made while
        it loaded."""
        old, self._cache = self._cache, None
        self._unpool(old)
        hosts = fill.finish(raws) if fill is not None else None
        source = source_of_manifest(manifest)
        if hosts is not None:
            self._cache = self._make_cache(rec.step, rec.object, manifest, hosts, copy=False, pooled=True, source=source)
        else:
            self._cache = self._base_copies(rec.step, rec.object, manifest, raws, copy=True, source=source)

    def _reserve_base(self, manifest: Mapping[str, Any], map_location: pipeline.MapLocation) -> HostFill | None:
        """For a step that loads onto a GPU: start allocating the pinned buffers that will hold
        it as the next base (one per CUDA storage; a store that saved already has its
        generations), so that the allocation runs while the step is read and decoded instead of
        after it, and the :class:`HostFill` that copies each decoded batch into them
        (None: the step loads onto no GPU or onto several, is larger than ``base_cache_bytes``,
        or the store's pinned buffers are all in use; :meth:`_base_copies` then makes the copies
        after the load)."""
        try:
            by_orig = pipeline.target_devices(manifest["storages"], map_location)
            devs = [by_orig[s["device"]] for s in manifest["storages"]]
            sizes = {i: int(s["nbytes"]) for i, (s, d) in enumerate(zip(manifest["storages"], devs)) if d.type == "cuda"}
            total = sum(int(s["nbytes"]) for s in manifest["storages"])
            gpus = {torch.device("cuda", devs[i].index if devs[i].index is not None else torch.cuda.current_device()) for i in sizes}
        except Exception:  # noqa: BLE001 - the load itself reports what is wrong with the manifest
            return None
        if not sizes or len(gpus) != 1 or (self.base_cache_bytes is not None and total > self.base_cache_bytes):
            return None
        device = next(iter(gpus))
        pool = self._pinned_pool
        if pool.live_bytes == 0:
            pool.reserve(list(sizes.values()), device)
        elif pool.free_bytes < sum(sizes.values()):
            # the store's generations are in use (the base of its own last save): copying during
            # the load would allocate one more; after it, the old base's buffers are reused
            return None
        return HostFill(pool, sizes, device)

    def _reserve_copies(self, raws: builtins.list[torch.Tensor], keeps_old: bool) -> None:
        """Start allocating the pinned buffers that :meth:`_base_copies` of a GPU state being saved
        will take, on a background thread while the state is encoded, where the pool has none
        free for it: a store's first save, and its second when the first one's copy stays (the
        base of the re-encoding behind it: ``keeps_old``, the rule the save applies after its
        commit) -- the caller waited ~0.1 s a GB for each allocation after the encode.  Not where
        the current copy's buffers come back first."""
        if not any(r.device.type == "cuda" for r in raws):
            return
        if self.base_cache_bytes is not None and sum(r.numel() for r in raws) > self.base_cache_bytes:
            return
        if self._cache is not None and self._cache.pooled and not keeps_old:
            return  # its buffers are given back before the copy: reused
        pool = self._pinned_pool
        sizes = pooled_sizes(raws)
        if pool.ready() and pool.free_bytes < sum(sizes):
            pool.reserve(sizes, next(r.device for r in raws if r.device.type == "cuda"))

    def _base_copies(
        self,
        step: int,
        obj: str,
        manifest: Mapping[str, Any],
        raws: builtins.list[torch.Tensor],
        *,
        copy: bool,
        source: Any = None,
    ) -> CachedBase | None:
        """:meth:`_make_cache` of a step's storages; CUDA ones go to the pinned pool's buffers
        (one synchronize, one reused generation: the previous cache was given back first), which
        are ~5x faster to fill than pageable copies and to stage for the next save; so do host
        ones to be copied (``copy``) where :func:`~s4w_core.hostmem.pools_host_copies`, copied on
        several threads."""
        within = self.base_cache_bytes is None or sum(r.numel() for r in raws) <= self.base_cache_bytes
        if within and (any(r.device.type == "cuda" for r in raws) or (copy and pools_host_copies(raws))):
            hosts = host_copies(raws, self._pinned_pool, ahead=False)
            return self._make_cache(step, obj, manifest, hosts, copy=False, pooled=True, source=source)
        return self._make_cache(step, obj, manifest, raws, copy=copy, source=source)

"""GPU writer: plane split (Triton) + batched nvCOMP coding + per-chunk codec choice + ordered output.

One *batch* = pieces (segment ranges) of one or more storages whose raw bytes fit the batch budget.
Per batch, all on our stream and with one host synchronization, at the end (:class:`~s4w_core.gpu._coder.EncodePlan`,
in :mod:`s4w_core.gpu._coder`; this module plans the batches, chooses delta ops and writes the chunks):

1. split every piece into planes in one buffer, plane-major (first planes back to back, then plane
   ``j`` of every piece at ``j * P``; slots rounded so every chunk starts 256-byte aligned), XORed
   with the delta base in the same kernel where the storage is an ``xor`` delta (other delta ops of
   :mod:`s4w_core.delta` are applied first, on the device);
2. on the device, the probe zeroes the coder's input length of each later-plane chunk whose sample
   looks near random; compress every chunk with one nvCOMP call (ANS for ``fast``, Deflate
   entropy-only for ``portable``) into fixed-capacity slots;
3. on the device, per chunk, keep the coded bytes only if they are smaller (plane 0, non-float
   storages) or save at least :data:`MIN_GAIN` (other planes); otherwise the chunk is raw; coded
   chunks and raw first planes are compacted after the planes, raw later planes stay where the
   split wrote them; the choice is read back;
4. copy the chunks to pinned host memory (one copy per run of chunks that lie together) and append
   them to the container as one group.

With nvCOMP's Python API (``S4W_NVCOMP_C=0``, an nvCOMP other than 6.x, the portable profile's
Deflate) the chunks to code are read back between the probe and the coder.

Storages that take the CPU path (portable profile: CPU tensors that are not host copies of GPU
storages, and non-float storages; fast
profile: small non-float storages, where zstd beats order-0 ANS) are encoded by
:func:`s4w_core.engine.encode_storage_cpu` into a recording writer and spliced in at their place.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from s4w_core import checksum as ck
from s4w_core import choice, delta, engine
from s4w_core.errors import BaseMismatchError
from s4w_core.format.container import ContainerWriter
from s4w_core.format.manifest import PLAIN, PLANE_TRANSFORMS
from s4w_core.gpu import _nvcomp
from s4w_core.gpu._coder import (
    LAYOUT_DECIDE,
    LAYOUT_PLAIN,
    LAYOUT_ROTL1,
    MIN_GAIN,
    PROFILES,
    Batch,
    Piece,
    PreparedEncode,
    Profile,
    encode_batch_device,
    encode_tensors_device,
)
from s4w_core.gpu._nonzero import NZ_TRANSFORM, encode_nonzero_many, nonzero_choices_device
from s4w_core.gpu._rowcol import RC_TRANSFORM, encode_rowcol_many, rowcol_choices_device
from s4w_core.gpu._samples import gather_samples, runs_of
from s4w_core.gpu.kernels import fold64_batched, fold64_finish
from s4w_core.planes.triton_kernels import split_planes_batched
from s4w_core.workers import in_foreground

__all__ = ["encode_storages", "encode_tensors_device", "host_work", "PreparedEncode", "PROFILES", "MIN_GAIN"]

#: non-float storages up to this size take the CPU path (zstd) in the fast profile.
SMALL_BYTES_STORAGE = 1 << 20


class _RecordingWriter:
    """Stands in for the container while the CPU path encodes a storage out of order."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def add_chunk(self, data: bytes | bytearray | memoryview) -> tuple[int, int, str]:
        self.chunks.append(bytes(data))
        return 0, len(data), ""


class _ChunkSink:
    """Writes each group of chunks handed to it (a batch's, a storage's) to the container, groups
    in the order they come (that is the file's order: readers assume none, docs/FORMAT.md), and
    puts each chunk's manifest entry at its index in its storage's list. One thread writes (the
    writer's I/O thread) while others add jobs."""

    def __init__(self, writer: ContainerWriter) -> None:
        self.writer = writer
        self.entries: list[dict[str, Any]] = []

    def add_job(self, entry: dict[str, Any], nchunks: int) -> int:
        entry["chunks"] = [None] * nchunks
        self.entries.append(entry)
        return len(self.entries) - 1

    def write(self, items: list[tuple[int, int, str, Any]]) -> None:
        placed = self.writer.add_chunks([data for _ji, _ci, _cid, data in items])
        for (ji, ci, cid, _data), where in zip(items, placed):
            self.entries[ji]["chunks"][ci] = [cid, *where]

    def done(self) -> bool:
        return all(c is not None for e in self.entries for c in e["chunks"])


class _Writer:
    """Runs the container writes of finished batches on one I/O thread, in order, so the GPU codes
    batch k+1 while the host checksums and writes batch k. At most ``depth`` batches wait (their
    pinned host buffers are the memory this holds); errors surface at the next submit or at finish."""

    def __init__(self, sink: _ChunkSink, depth: int = 2) -> None:
        self.sink = sink
        self.depth = depth
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s4w-write")
        self.pending: collections.deque[Any] = collections.deque()

    def submit(self, items: list[tuple[int, int, str, Any]], keep: Any = None) -> None:
        # finished writes first (a failed one raises here, one batch after it failed, not
        # ``depth`` batches later: a cancelled background copy stops sooner), then room
        while self.pending and (len(self.pending) >= self.depth or self.pending[0].done()):
            self.pending.popleft().result()

        def run(items: list[tuple[int, int, str, Any]] = items, keep: Any = keep) -> None:
            self.sink.write(items)
            del keep  # the pinned buffer the views point into lives until they are written

        self.pending.append(self.pool.submit(run))

    def finish(self) -> None:
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown(wait=True)

    def close(self) -> None:
        """Stop without raising (after an error elsewhere: queued writes are dropped)."""
        for f in self.pending:
            f.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True)


#: what a group's coder returns: per storage its entry's value and (codec ids, chunk bytes); the host buffer
_Coded = tuple[list[Any], list[tuple[list[str], list[memoryview]]], torch.Tensor]


class _Group:
    """Storages of one transform coded together by ``code`` (all their chunks in one nvCOMP call and
    one read-back; a storage at a time, a state's hundreds of them cost a call and a synchronization
    each), flushed at the batch budget: ``code(items)`` returns per storage its entry's ``key``
    value and its chunks' codec ids and bytes, and the host buffer they point into; the chunks go
    to the I/O thread in one hand-over per group, written while the GPU codes on."""

    def __init__(self, key: str, io: _Writer, budget: int, code: Callable[[list[Any]], _Coded]) -> None:
        self.key, self.io, self.budget, self.code = key, io, budget, code
        self.members: list[tuple[int, dict[str, Any], Any]] = []
        self.nbytes = 0

    def add(self, ji: int, entry: dict[str, Any], item: Any, nbytes: int) -> None:
        self.members.append((ji, entry, item))
        self.nbytes += nbytes
        if self.nbytes >= self.budget:
            self.flush()

    def flush(self) -> None:
        if not self.members:
            return
        values, chunks, keep = self.code([item for _ji, _e, item in self.members])
        items: list[tuple[int, int, str, Any]] = []
        for (ji, entry, _item), value, (ids, views) in zip(self.members, values, chunks):
            entry[self.key] = value
            items += [(ji, ci, cid, v) for ci, (cid, v) in enumerate(zip(ids, views))]
        self.io.submit(items, keep=keep)
        self.members.clear()
        self.nbytes = 0


#: elements sampled per storage (16 runs spread over it) by the GPU writer's delta choice.
DEVICE_DELTA_SAMPLE = 1 << 14


def _choose_delta_ops(
    cands: list[tuple[engine.StorageJob, str, int]],
    dev: torch.device | None = None,
    work: int | None = None,
) -> list[str | None]:
    """Per storage: plain coding, or the delta op (:mod:`s4w_core.delta`) whose residual planes
    have the smallest order-0 entropy on a sample -- the rule of :func:`engine.choose_delta_op`
    (an op must save :data:`engine.DELTA_MIN_GAIN`), computed on the device for every storage of
    the checkpoint at once: one sample gather, the split kernel per candidate op, one histogram
    per (storage, plane), one small read-back; with ``work`` (the device memory a save of host
    copies may take, :func:`~s4w_core.gpu._nvcomp.work_bytes`), a group of storages at a time
    whose samples' temporaries fit in it. (The CPU writer estimates each storage on the host: at
    checkpoint scale that cost ~1 s per save on the GPU path, where it blocks the caller.)"""
    if not cands:
        return []
    if dev is None:
        dev = next((j.raw.device for j, _t, _w in cands if j.raw.device.type != "cpu"), cands[0][0].raw.device)
    runs = choice.DELTA_RUNS
    samples: list[tuple[list[tuple[int, int]], int]] = []  # per candidate: its ranges, its sample elements
    for job, _transform, w in cands:
        assert job.base is not None
        if job.base.numel() != job.raw.numel():
            raise BaseMismatchError(f"{job.path}: base has {job.base.numel()} bytes, tensor {job.raw.numel()}")
        n = job.raw.numel() // w
        run = max(1, min(n, DEVICE_DELTA_SAMPLE) // runs)
        starts = sorted({(n - run) * k // (runs - 1) for k in range(runs)}) if n > run else [0]
        ln = min(n, run)
        samples.append(([(a, a + ln) for a in starts], len(starts) * ln))
    if work is None:
        groups = [list(range(len(cands)))]
    else:  # ~16 bytes of temporaries per sample byte (both samples, the planes, int32 histogram keys)
        sizes = [c * w for (_r, c), (_j, _t, w) in zip(samples, cands)]
        groups = runs_of(list(range(len(cands))), sizes, max(1 << 20, work // 16))
    out: list[str | None] = []
    for group in groups:
        out += _delta_choices([cands[k] for k in group], [samples[k] for k in group], dev)
    return out


def _delta_choices(
    cands: list[tuple[engine.StorageJob, str, int]], samples: list[tuple[list[tuple[int, int]], int]], dev: torch.device
) -> list[str | None]:
    """:func:`_choose_delta_ops` for one group of candidates and their samples."""
    counts = [c for _r, c in samples]
    # host copies (a re-encoding's) gathered on the host and moved in one copy
    items: list[tuple[torch.Tensor, list[tuple[int, int]], int]] = []
    for part in ("raw", "base"):
        items += [(getattr(job, part), r, w) for (job, _t, w), (r, _c) in zip(cands, samples)]
    got = gather_samples(items, dev)
    raw_s, base_s = got[: len(cands)], got[len(cands) :]
    # the planes of each candidate, back to back (plane stride = sample length: no padding)
    ws = [w for _j, _t, w in cands]
    off: list[int] = []
    pos = 0
    for c, w in zip(counts, ws):
        off.append(pos)
        pos += c * w
    plane_len = torch.tensor([c for c, w in zip(counts, ws) for _ in range(w)], dtype=torch.int64)
    # each sample byte's histogram segment, made on the device (on the host: a pageable copy of
    # 4 bytes per sample byte, ~60 MB for a re-encoding's samples)
    seg = torch.repeat_interleave(
        torch.arange(len(plane_len), dtype=torch.int32, device=dev), plane_len.to(dev), output_size=pos
    ) * 256
    nplanes = len(plane_len)
    costs = []
    for op in (None, "xor", "sub"):
        buf = torch.empty(max(pos, 1), dtype=torch.uint8, device=dev)
        by_width: dict[int, list[Any]] = {}
        for k, ((job, transform, w), c) in enumerate(zip(cands, counts)):
            r, b = raw_s[k], base_s[k]
            use = op if op in delta.ops_for(job.dtype, transform) else None
            if transform in PLANE_TRANSFORMS:
                by_width.setdefault(w, []).append((r, b if use else None, off[k], c, use or "xor"))
            elif use == "xor":
                torch.bitwise_xor(r, b, out=buf[off[k] : off[k] + c])
            else:
                buf[off[k] : off[k] + c].copy_(r)
        for w, items in by_width.items():
            split_planes_batched(items, w, buf)
        bits = _entropy_bits(seg + buf[:pos].to(torch.int32), nplanes, plane_len.to(dev, torch.float32)).clamp_min(1e-3)
        costs.append(bits * plane_len.to(dev, torch.float32) / 8)
    per_plane = torch.stack(costs).cpu()  # (3, nplanes): the one read-back
    out: list[str | None] = []
    i = 0
    for (job, transform, w), _c in zip(cands, counts):
        est = per_plane[:, i : i + w].sum(1).tolist()
        i += w
        best: str | None = None
        best_cost = est[0]
        limit = (1.0 - engine.DELTA_MIN_GAIN) * best_cost
        for k, op in ((1, "xor"), (2, "sub")):
            if op in delta.ops_for(job.dtype, transform) and est[k] < limit and est[k] < best_cost:
                best, best_cost = op, est[k]
        out.append(best)
    return out


def _device_resident(job: engine.StorageJob) -> bool:
    """Whether ``job``'s bytes or its delta base live on a GPU (both on the host: the host's
    estimate, :func:`engine.choose_delta_ops`; the device's sampler moves host samples over)."""
    return _on_device(job.raw) or (job.base is not None and _on_device(job.base))


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` already lives on a GPU (a hook: the CPU simulation in tests/parity overrides it)."""
    return t.device.type == "cuda"


def _from_device(job: engine.StorageJob) -> bool:
    """Whether ``job`` is a GPU storage: on the device, or a host copy of one (the store's keyframe
    copy codes the pinned host copy it keeps of the last save): the GPU codes it with either
    profile (host-to-device per batch) instead of the CPU path."""
    return _on_device(job.raw) or str(job.device).startswith("cuda")


def _device_for(jobs: list[engine.StorageJob]) -> torch.device:
    for j in jobs:
        if j.raw.device.type == "cuda":
            return j.raw.device
    for j in jobs:  # host copies of GPU storages: the device they came from
        if str(j.device).startswith("cuda"):
            d = torch.device(j.device)
            return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device())


def encode_storages(
    jobs: list[engine.StorageJob],
    writer: ContainerWriter,
    pool: ThreadPoolExecutor,
    profile: str = "fast",
) -> list[dict[str, Any]]:
    if profile not in PROFILES:
        raise ValueError(f"GPU writer has no profile {profile!r}")
    prof = PROFILES[profile]
    dev = _device_for(jobs)
    sink = _ChunkSink(writer)
    # where each storage is coded
    plan: list[tuple[str, int, bool]] = []
    for job in jobs:
        nbytes = job.raw.numel()
        transform, w = engine.transform_for(job.dtype, nbytes)
        cpu_path = (profile == "portable" and (not _from_device(job) or transform == "bytes")) or (
            profile == "fast" and transform == "bytes" and nbytes <= SMALL_BYTES_STORAGE
        )
        plan.append((transform, w, cpu_path))
    work = host_work(jobs, [p[2] for p in plan])
    budget = _nvcomp.batch_bytes(dev, work)
    entries: list[dict[str, Any]] = []
    fold_slots: list[tuple[int, int]] = []  # (entry index, nbytes)
    fold_items: list[tuple[torch.Tensor, int]] = []
    io = _Writer(sink)
    with contextlib.ExitStack() as stack:
        stack.callback(io.close)  # on an error: stop the I/O thread (its error, if any, is dropped)
        stack.enter_context(_nvcomp.on_stream(dev))
        acc = torch.zeros(max(1, len(jobs)), dtype=torch.int64, device=dev)
        # the delta op of every GPU-coded storage (one transfer)
        cands = [(i, (job, plan[i][0], plan[i][1])) for i, job in enumerate(jobs) if job.base is not None and not plan[i][2]]
        # storages on the device, and host copies of GPU storages (the store's re-encoding of a step
        # from its pinned copy against the pinned copy of the step above): their samples estimated
        # on the device (host samples moved over: ~1 ms); other host storages on the host, by the
        # CPU writer's rule (the same estimate; at checkpoint scale ~1 s of CPU per re-encoding)
        on_dev = [(i, c) for i, c in cands if _device_resident(c[0]) or _from_device(c[0])]
        on_host = [(i, c) for i, c in cands if not (_device_resident(c[0]) or _from_device(c[0]))]
        chosen = _choose_delta_ops([c for _, c in on_dev], dev=dev, work=work) if on_dev else []
        ops: dict[int, str | None] = {i: op for (i, _), op in zip(on_dev, chosen)}
        if on_host:
            host_ops = engine.choose_delta_ops([c[0] for _, c in on_host], [c[1] for _, c in on_host])
            ops.update({i: op for (i, _), op in zip(on_host, host_ops)})
        # storages coded on the CPU path: their delta ops chosen in one pass too
        engine.choose_delta_ops([j for j, p in zip(jobs, plan) if p[2] and j.base is not None])
        # which GPU-coded storages take the nonzero transform (a read-back per group of samples)
        nz_jobs = [i for i, p in enumerate(plan) if not p[2] and p[0] in PLANE_TRANSFORMS]
        nz_items = [(jobs[i].raw, jobs[i].base if ops.get(i) else None, ops.get(i), jobs[i].dtype) for i in nz_jobs]
        nz_pick = dict(zip(nz_jobs, nonzero_choices_device(nz_items, dev, work=work)))
        # ... and which of the others the row/column transform (a read-back per group of samples; a
        # storage with zeros enough for the nonzero transform keeps it: it codes those as runs)
        # (plain storages only: a delta's residual has its scales removed already)
        rc_jobs = [i for i in nz_jobs if not nz_pick[i] and jobs[i].cols and ops.get(i) is None]
        rc_items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype, int | None]] = [
            (jobs[i].raw, None, None, jobs[i].dtype, jobs[i].cols) for i in rc_jobs
        ]
        rc_pick = dict(zip(rc_jobs, rowcol_choices_device(rc_items, dev, work=work)))
        batch = Batch()
        # the transform of each storage: the layout probe chooses it with the storage's first piece;
        # its later pieces (in later batches) take the same
        chosen_layout: dict[int, str] = {}

        # the row/column and the nonzero storages, each coded with others of its kind
        def coded(fn: Callable[..., _Coded]) -> Callable[[list[Any]], _Coded]:
            return functools.partial(fn, seg=prof.segment_elems, algorithm=prof.algorithm, codec_id=prof.codec_id,
                                     opts=dict(prof.opts), dev=dev)

        rc_group = _Group("rowcol", io, budget, coded(encode_rowcol_many))
        nz_group = _Group("nnz", io, budget, coded(encode_nonzero_many))
        moved: list[tuple[torch.Tensor, int]] = []  # device copies of host storages, not yet summed
        moved_bytes = 0
        # device copies of host storages held by the batch and the two groups, together at most a
        # batch budget (each alone would hold up to one: three budgets of copies beside training)
        uploaded = {"batch": 0, "rowcol": 0, "nnz": 0}

        def fold_moved() -> None:
            nonlocal moved_bytes
            fold64_batched(moved, acc)
            moved.clear()
            moved_bytes = 0

        def run(b: Batch) -> None:
            uploaded["batch"] = 0
            for ji, tr in _run_batch(b, prof, dev, io).items():
                if ji not in chosen_layout:
                    chosen_layout[ji] = tr
                    sink.entries[ji]["transform"] = tr
                elif chosen_layout[ji] != tr:  # never expected: later pieces are given the layout
                    raise RuntimeError(f"GPU writer: storage {sink.entries[ji]['path']!r} split with two layouts")

        for jidx, job in enumerate(jobs):
            if work is not None and in_foreground():  # a caller now waits for this save: a blocking one's batches
                work = None
                budget = max(budget, _nvcomp.batch_bytes(dev))
                rc_group.budget = nz_group.budget = budget
            nbytes = job.raw.numel()
            transform, w, cpu_path = plan[jidx]
            if cpu_path:
                rec = _RecordingWriter()
                entry = engine.encode_storage_cpu(job, rec, pool)  # type: ignore[arg-type]
                codecs = [c[0] for c in entry["chunks"]]
                entry["chunks"] = []
                ji = sink.add_job(entry, len(codecs))
                io.submit([(ji, ci, cid, data) for ci, (cid, data) in enumerate(zip(codecs, rec.chunks))])
                entries.append(entry)
                continue
            raw = _nvcomp.to_device(job.raw, dev)  # (a host copy: queued on the stream, not waited for)
            kind = "nnz" if nz_pick.get(jidx) else "rowcol" if rc_pick.get(jidx) else "batch"
            if raw is not job.raw:
                while any(uploaded.values()) and sum(uploaded.values()) + nbytes > budget:
                    fullest = max(uploaded, key=lambda k: uploaded[k])
                    if fullest == "batch":
                        run(batch)
                        batch = Batch()
                    else:
                        (rc_group if fullest == "rowcol" else nz_group).flush()
                        uploaded[fullest] = 0
                uploaded[kind] += nbytes
            n = nbytes // w
            seg = prof.segment_elems
            entry: dict[str, Any] = {  # type: ignore[no-redef]
                "path": job.path,
                "device": job.device,
                "dtype": engine.dtype_name(job.dtype),
                "nbytes": nbytes,
                "transform": transform,
                "segment_elems": seg,
                "checksum": None,
                "delta": None,
                "chunks": [],
            }
            op = ops.get(jidx)
            base = job.base if op is not None else None
            if op is not None:
                entry["delta"] = {"op": op, "base": job.base_ref}
            if _on_device(job.raw):
                fold_items.append((raw, len(entries)))
                fold_slots.append((len(entries), nbytes))
            elif _on_device(raw):
                # a host copy of a GPU storage, moved over whole: summed there with the others
                # moved over, a batch budget at a time (its device copy is not held to the end),
                # the same checksum as the step coded from the GPU
                moved.append((raw, len(entries)))
                moved_bytes += nbytes
                fold_slots.append((len(entries), nbytes))
                if moved_bytes >= budget:
                    fold_moved()
            else:
                entry["checksum"] = ck.tensor_checksum(job.raw)
            if nz_pick.get(jidx):
                # the nonzero variant (docs/FORMAT.md 4.5c): coded by the profile's coder with the
                # other nonzero storages of its group, one nvCOMP call and read-back per group
                entry["transform"] = NZ_TRANSFORM
                ji = sink.add_job(entry, -(-n // seg) * (w + 1))
                entries.append(entry)
                nz_group.add(ji, entry, (raw, base, op, job.dtype), nbytes)
                if not nz_group.members:  # flushed at its budget
                    uploaded["nnz"] = 0
                continue
            if rc_pick.get(jidx):
                # the row/column variant (docs/FORMAT.md 4.5d): coded by the profile's coder with the
                # other row/column storages of its group, one nvCOMP call and read-back per group;
                assert job.cols is not None
                entry["transform"] = RC_TRANSFORM
                ji = sink.add_job(entry, -(-n // seg) * w)
                entries.append(entry)
                rc_group.add(ji, entry, (raw, base, op, job.dtype, job.cols), nbytes)
                if not rc_group.members:  # flushed at its budget
                    uploaded["rowcol"] = 0
                continue
            nseg = -(-n // seg)
            ji = sink.add_job(entry, nseg * w)
            entries.append(entry)
            # cut the storage into segment-aligned pieces that fill the batch budget
            per_seg = seg * w
            s = 0
            while s < nseg:
                room = (budget - batch.nbytes) // per_seg
                if room <= 0 and not batch.pieces:
                    room = 1
                if room <= 0:
                    run(batch)
                    batch = Batch()
                    continue
                take = min(nseg - s, room)
                e0, e1 = s * seg, min(n, (s + take) * seg)
                layout = LAYOUT_DECIDE
                if ji in chosen_layout:
                    layout = LAYOUT_PLAIN if chosen_layout[ji] == PLAIN else LAYOUT_ROTL1
                batch.pieces.append(Piece(ji, raw, base, op, job.dtype, transform, w, e0, e1, seg, s * w, layout))
                batch.nbytes += (e1 - e0) * w
                s += take
        if batch.pieces:
            run(batch)
        rc_group.flush()
        nz_group.flush()
        fold_moved()
        if fold_items:
            fold64_batched(fold_items, acc)
        sums = acc.cpu().tolist() if fold_slots else []
        io.finish()
    assert sink.done(), "GPU writer: chunks left unwritten"
    for i, nb in fold_slots:
        entries[i]["checksum"] = f"fold64:{fold64_finish(int(sums[i]), nb):016x}"
    return entries


def host_work(jobs: list[engine.StorageJob], cpu_path: list[bool]) -> int | None:
    """The device memory a GPU save may take (:func:`~s4w_core.gpu._nvcomp.work_bytes` of the
    state) where it moves host storages to the device to code them -- a non-blocking save's pinned
    copies, a store's re-encoding, DCP's staged copies (host tensors, whatever device they came
    from): such a save runs beside training steps. ``None`` where every storage it codes on the GPU
    lives there already (a blocking save, between steps: the default batch), and where a caller
    waits for the save (:func:`~s4w_core.workers.in_foreground`: a store's re-encoding behind its
    ``wait()``, at the end of training; no step runs beside it). ``cpu_path``: per job, whether the
    CPU path codes it (nothing moved). (A save that a caller starts waiting for on its way takes
    the blocking batch from its next storage on: :func:`encode_storages`.)"""
    if in_foreground():
        return None
    if any(not cpu and not _on_device(j.raw) for j, cpu in zip(jobs, cpu_path)):
        return _nvcomp.work_bytes(sum(j.raw.numel() for j in jobs))
    return None


def _run_batch(batch: Batch, prof: Profile, dev: torch.device, io: _Writer) -> dict[int, str]:
    """Code ``batch`` and hand its chunks to the I/O thread; returns the transform of each
    plane-transformed storage (sink job) of the batch."""
    r = encode_batch_device(batch, prof, dev)
    # the chunks' bytes to pinned host memory, one copy per run of chunks that lie together (not
    # the dead slots of chunks coded elsewhere); the I/O thread appends them to the container
    runs, hoff = r.host_layout()
    host = _nvcomp.host_empty(sum(b - a for a, b, _h in runs))
    for a, b, h in runs:
        host[h : h + b - a].copy_(r.out[a:b], non_blocking=True)
    _nvcomp.synchronize(dev)
    mv = memoryview(host.numpy())
    ids, off, ln = r.codec_ids, hoff.tolist(), r.out_len.tolist()
    io.submit([(ji, ci, ids[i], mv[off[i] : off[i] + ln[i]]) for i, (ji, ci) in enumerate(r.owner)], keep=host)
    return r.transforms


def _entropy_bits(keys: torch.Tensor, groups: int, counts: torch.Tensor) -> torch.Tensor:
    """Order-0 entropy in bits per byte of each group, on the device: ``keys`` are
    ``group * 256 + byte``; ``counts`` the bytes in each group (float32)."""
    hist = torch.bincount(keys, minlength=groups * 256).view(groups, 256).to(torch.float32)
    p = hist / counts[:, None]
    return -(p * torch.log2(torch.where(p > 0, p, torch.ones_like(p)))).sum(1)


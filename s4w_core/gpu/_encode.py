"""GPU writer: plane split (Triton) + batched nvCOMP coding + per-chunk codec choice + ordered output.

One *batch* = pieces (segment ranges) of one or more storages whose raw bytes fit the batch budget.
Per batch, all on our stream and with one host synchronization, at the end (:class:`EncodePlan`):

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
   them to the container in manifest order.

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
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from s4w_core import checksum as ck
from s4w_core import delta, engine
from s4w_core.codecs import DEFLATE, NVCOMP_ANS, RAW
from s4w_core.errors import BaseMismatchError
from s4w_core.format.container import ContainerWriter
from s4w_core.format.manifest import PLAIN, PLANE_TRANSFORMS, ROTL1
from s4w_core.gpu import _nvcomp
from s4w_core.gpu.kernels import (
    LAYOUT_RUN,
    LAYOUT_RUNS,
    choose_and_gather,
    fold64_batched,
    fold64_finish,
    layout_probe,
    probe_gate,
)
from s4w_core.planes.triton_kernels import (
    OPS,
    SPLIT,
    Tables,
    block_config,
    launch_items,
    launch_rows,
    program_map,
    split_planes_batched,
)

__all__ = ["encode_storages", "encode_tensors_device", "PreparedEncode", "PROFILES", "MIN_GAIN"]

#: a chunk of a plane other than the first keeps its coded form only if it saves this fraction.
MIN_GAIN = 0.005
#: non-float storages up to this size take the CPU path (zstd) in the fast profile.
SMALL_BYTES_STORAGE = 1 << 20
_REGION_ALIGN = 256
#: a piece's layout flag (``_Piece.layout``, the split's per-item flags): decided on the device by
#: the layout probe, or given
LAYOUT_DECIDE, LAYOUT_ROTL1, LAYOUT_PLAIN = 0, 1, 2
#: whether the layout probe also chooses for delta residuals (off: they keep planes-rotl1; a
#: benchmark switches it on to measure, docs/PERFORMANCE.md, "The layout choice")
LAYOUT_DELTAS = False


@dataclass(frozen=True)
class Profile:
    name: str
    codec_id: str
    algorithm: str
    segment_elems: int  # elements per segment = bytes per plane chunk
    opts: tuple[tuple[str, Any], ...]
    probe: bool = False  # skip the coder for chunks a sample says are near random (_worth_coding)


PROFILES = {
    # 512 Ki-element segments (512 KiB ANS chunks per plane): on all-MiniLM-L6-v2 bf16 the ratio is
    # 1.481 / 1.495 / 1.502 / 1.505 / 1.506 for 64K / 128K / 256K / 512K / 1M elements (ZipNN:
    # 1.504); benchmarks/results/README.md has the sweep and its throughput.
    "fast": Profile("fast", NVCOMP_ANS.id, "ANS", 1 << 19, (("data_type", "|u1"),), probe=True),
    # nvCOMP Deflate compresses chunks of at most 64 KiB; algorithm_type 0 = entropy only.
    "portable": Profile("portable", DEFLATE.id, "Deflate", 1 << 16, (("algorithm_type", 0),)),
}


#: stage timings of the last traced batch, for benchmarks: ``TRACE = True`` synchronizes at each
#: mark (host time per stage); ``TRACE = "timeline"`` does not: each mark records the host's clock
#: and a CUDA event on the current stream, so that a benchmark can tell when the host enqueued a
#: stage and when the GPU got there (``benchmarks/profile_codec.py``).
TRACE: bool | str = False
TRACE_MARKS: list[tuple[str, float, Any]] = []


def mark(name: str, dev: torch.device) -> None:
    if TRACE:
        import time

        if TRACE == "timeline":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            TRACE_MARKS.append((name, time.perf_counter(), ev))
        else:
            _nvcomp.synchronize(dev)
            TRACE_MARKS.append((name, time.perf_counter(), None))


def _round(x: int, a: int) -> int:
    return -(-x // a) * a


class _RecordingWriter:
    """Stands in for the container while the CPU path encodes a storage out of order."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def add_chunk(self, data: bytes | bytearray | memoryview) -> tuple[int, int, str]:
        self.chunks.append(bytes(data))
        return 0, len(data), ""


class _OrderedSink:
    """Appends chunks to the container strictly in manifest order as they become ready.

    Thread-safe for one draining thread (the writer's I/O thread) and any number of threads adding
    jobs and chunks; the container writes (checksums, file I/O) happen outside the lock."""

    def __init__(self, writer: ContainerWriter) -> None:
        self.writer = writer
        self.entries: list[dict[str, Any]] = []
        self.nchunks: list[int] = []
        self.ready: dict[tuple[int, int], tuple[str, Any]] = {}
        self.ji = 0
        self.ci = 0
        self.lock = threading.Lock()

    def add_job(self, entry: dict[str, Any], nchunks: int) -> int:
        with self.lock:
            self.entries.append(entry)
            self.nchunks.append(nchunks)
            return len(self.entries) - 1

    def put(self, ji: int, ci: int, codec_id: str, data: Any) -> None:
        with self.lock:
            self.ready[(ji, ci)] = (codec_id, data)

    def drain(self) -> None:
        while True:
            with self.lock:
                if self.ji >= len(self.entries):
                    return
                if self.ci == self.nchunks[self.ji]:
                    self.ji += 1
                    self.ci = 0
                    continue
                item = self.ready.pop((self.ji, self.ci), None)
                if item is None:
                    return
                ji = self.ji
            codec_id, data = item
            off, length, h = self.writer.add_chunk(data)
            with self.lock:
                self.entries[ji]["chunks"].append([codec_id, off, length, h])
                self.ci += 1

    def done(self) -> bool:
        with self.lock:
            return self.ji == len(self.entries) and not self.ready


class _Writer:
    """Runs the container writes of finished batches on one I/O thread, in order, so the GPU codes
    batch k+1 while the host checksums and writes batch k. At most ``depth`` batches wait (their
    pinned host buffers are the memory this holds); errors surface at the next submit or at finish."""

    def __init__(self, sink: _OrderedSink, depth: int = 2) -> None:
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
            for ji, ci, cid, data in items:
                self.sink.put(ji, ci, cid, data)
            self.sink.drain()
            del keep  # the pinned buffer the views point into lives until they are written

        self.pending.append(self.pool.submit(run))

    def finish(self) -> None:
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown(wait=True)
        self.sink.drain()

    def close(self) -> None:
        """Stop without raising (after an error elsewhere: queued writes are dropped)."""
        for f in self.pending:
            f.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True)


@dataclass(slots=True)
class _Piece:
    ji: int  # job index in the sink
    raw: torch.Tensor  # the whole storage on the device, contiguous (its bytes, or the tensor itself)
    base: torch.Tensor | None  # whole base storage (device or host); None: no delta
    op: str | None  # delta op of s4w_core.delta, fused into the split kernel
    dtype: torch.dtype
    transform: str
    w: int
    e0: int  # element range of this piece (segment aligned)
    e1: int
    seg: int
    chunk0: int  # index of the piece's first chunk in its storage
    layout: int = LAYOUT_DECIDE  # LAYOUT_*: the transform, or 0 for the layout probe to choose


@dataclass
class _Batch:
    pieces: list[_Piece] = field(default_factory=list)
    nbytes: int = 0


#: elements sampled per storage (16 runs spread over it) by the GPU writer's delta choice.
DEVICE_DELTA_SAMPLE = 1 << 14


def _choose_delta_ops(
    cands: list[tuple[engine.StorageJob, str, int]], pool: ThreadPoolExecutor, dev: torch.device | None = None
) -> list[str | None]:
    """Per storage: plain coding, or the delta op (:mod:`s4w_core.delta`) whose residual planes
    have the smallest order-0 entropy on a sample -- the rule of :func:`engine.choose_delta_op`
    (an op must save :data:`engine.DELTA_MIN_GAIN`), computed on the device for every storage of
    the checkpoint at once: one sample gather, the split kernel per candidate op, one histogram
    per (storage, plane), one small read-back. (The CPU writer estimates each storage on the host:
    at checkpoint scale that cost ~1 s per save on the GPU path, where it blocks the caller.)"""
    if not cands:
        return []
    if dev is None:
        dev = next((j.raw.device for j, _t, _w in cands if j.raw.device.type != "cpu"), cands[0][0].raw.device)
    runs = engine._DELTA_RUNS  # noqa: SLF001
    raw_parts: list[torch.Tensor] = []
    base_parts: list[torch.Tensor] = []
    counts: list[int] = []
    for job, _transform, w in cands:
        assert job.base is not None
        if job.base.numel() != job.raw.numel():
            raise BaseMismatchError(f"{job.path}: base has {job.base.numel()} bytes, tensor {job.raw.numel()}")
        n = job.raw.numel() // w
        run = max(1, min(n, DEVICE_DELTA_SAMPLE) // runs)
        starts = sorted({(n - run) * k // (runs - 1) for k in range(runs)}) if n > run else [0]
        ln = min(n, run)
        raw_parts.extend(job.raw[a * w : (a + ln) * w] for a in starts)
        base_parts.extend(job.base[a * w : (a + ln) * w] for a in starts)
        counts.append(len(starts) * ln)
    raw_s = _cat_on(raw_parts, dev)
    base_s = _cat_on(base_parts, dev)
    # the planes of each candidate, back to back (plane stride = sample length: no padding)
    ws = [w for _j, _t, w in cands]
    off: list[int] = []
    pos = 0
    for c, w in zip(counts, ws):
        off.append(pos)
        pos += c * w
    plane_len = torch.tensor([c for c, w in zip(counts, ws) for _ in range(w)], dtype=torch.int64)
    seg = (torch.repeat_interleave(torch.arange(len(plane_len), dtype=torch.int32), plane_len) * 256).to(dev, non_blocking=True)
    nplanes = len(plane_len)
    costs = []
    for op in (None, "xor", "sub"):
        buf = torch.empty(max(pos, 1), dtype=torch.uint8, device=dev)
        by_width: dict[int, list[Any]] = {}
        for k, ((job, transform, w), c) in enumerate(zip(cands, counts)):
            r = raw_s[off[k] : off[k] + c * w]
            b = base_s[off[k] : off[k] + c * w]
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


def _cat_on(parts: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """``parts`` (on ``dev`` or on the host) concatenated on ``dev``, in order."""
    if all(p.device == dev for p in parts):
        return torch.cat(parts)
    return torch.cat([p.to(dev, non_blocking=True) for p in parts])


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
    sink = _OrderedSink(writer)
    budget = _nvcomp.batch_bytes(dev)
    entries: list[dict[str, Any]] = []
    fold_slots: list[tuple[int, int]] = []  # (entry index, nbytes)
    fold_items: list[tuple[torch.Tensor, int]] = []
    io = _Writer(sink)
    with contextlib.ExitStack() as stack:
        stack.callback(io.close)  # on an error: stop the I/O thread (its error, if any, is dropped)
        stack.enter_context(_nvcomp.on_stream(dev))
        acc = torch.zeros(max(1, len(jobs)), dtype=torch.int64, device=dev)
        # where each storage is coded, and the delta op of every GPU-coded storage (one transfer)
        plan: list[tuple[str, int, bool]] = []
        for job in jobs:
            nbytes = job.raw.numel()
            transform, w = engine.transform_for(job.dtype, nbytes)
            cpu_path = (profile == "portable" and (not _from_device(job) or transform == "bytes")) or (
                profile == "fast" and transform == "bytes" and nbytes <= SMALL_BYTES_STORAGE
            )
            plan.append((transform, w, cpu_path))
        cands = [(i, (job, plan[i][0], plan[i][1])) for i, job in enumerate(jobs) if job.base is not None and not plan[i][2]]
        # storages on the device: their samples estimated there; host copies (the store's re-encoding
        # of a step from its pinned copy, against the pinned copy of the step above) on the host,
        # where their bytes are, by the CPU writer's rule (the same estimate)
        on_dev = [(i, c) for i, c in cands if _device_resident(c[0])]
        on_host = [(i, c) for i, c in cands if not _device_resident(c[0])]
        chosen = _choose_delta_ops([c for _, c in on_dev], pool, dev=dev) if on_dev else []
        ops: dict[int, str | None] = {i: op for (i, _), op in zip(on_dev, chosen)}
        if on_host:
            host_ops = engine.choose_delta_ops([c[0] for _, c in on_host], [c[1] for _, c in on_host])
            ops.update({i: op for (i, _), op in zip(on_host, host_ops)})
        # storages coded on the CPU path: their delta ops chosen in one pass too
        engine.choose_delta_ops([j for j, p in zip(jobs, plan) if p[2] and j.base is not None])
        batch = _Batch()
        # the transform of each storage: the layout probe chooses it with the storage's first piece;
        # its later pieces (in later batches) take the same
        chosen_layout: dict[int, str] = {}

        def run(b: _Batch) -> None:
            for ji, tr in _run_batch(b, prof, dev, io).items():
                if ji not in chosen_layout:
                    chosen_layout[ji] = tr
                    sink.entries[ji]["transform"] = tr
                elif chosen_layout[ji] != tr:  # never expected: later pieces are given the layout
                    raise RuntimeError(f"GPU writer: storage {sink.entries[ji]['path']!r} split with two layouts")

        for jidx, job in enumerate(jobs):
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
            raw = job.raw if job.raw.device == dev else job.raw.to(dev)
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
            else:
                entry["checksum"] = ck.tensor_checksum(job.raw)
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
                    batch = _Batch()
                    continue
                take = min(nseg - s, room)
                e0, e1 = s * seg, min(n, (s + take) * seg)
                layout = LAYOUT_DECIDE
                if ji in chosen_layout:
                    layout = LAYOUT_PLAIN if chosen_layout[ji] == PLAIN else LAYOUT_ROTL1
                batch.pieces.append(_Piece(ji, raw, base, op, job.dtype, transform, w, e0, e1, seg, s * w, layout))
                batch.nbytes += (e1 - e0) * w
                s += take
        if batch.pieces:
            run(batch)
        if fold_items:
            fold64_batched(fold_items, acc)
        sums = acc.cpu().tolist() if fold_slots else []
        io.finish()
    assert sink.done(), "GPU writer: chunks left unwritten"
    for i, nb in fold_slots:
        entries[i]["checksum"] = f"fold64:{fold64_finish(int(sums[i]), nb):016x}"
    return entries


@dataclass
class _Encoded:
    """A batch coded on the device, in ``out``: per chunk, as numpy arrays, its offset and length in
    ``out``, coded or raw, owner (sink job, chunk index). The raw chunks of planes after the first
    lie where the split wrote them, the others (coded chunks, and first planes stored raw) back to
    back after them, 16-byte aligned (:meth:`host_layout` says what to copy to the host)."""

    out: torch.Tensor
    out_off: np.ndarray
    out_len: np.ndarray
    coded: np.ndarray  # bool: coded with ``codec_id``, else stored raw
    codec_id: str
    owner_ji: np.ndarray
    owner_ci: np.ndarray
    raw_bytes: int
    #: per piece of the batch: its storage (sink job), and its layout (``LAYOUT_*``; 0 for pieces
    #: coded as bytes)
    piece_ji: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    piece_layout: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def transforms(self) -> dict[int, str]:
        """The transform each plane-transformed storage (sink job) of the batch was coded with."""
        m = self.piece_layout > 0
        names = np.where(self.piece_layout[m] == LAYOUT_PLAIN, PLAIN, ROTL1)
        return dict(zip(self.piece_ji[m].tolist(), names.tolist()))

    def host_layout(self, gap: int = 1 << 16) -> tuple[list[tuple[int, int, int]], np.ndarray]:
        """What to copy to the host: the ranges of ``out`` that hold chunks -- chunks less than
        ``gap`` bytes apart share one range, so the dead slots of the later planes' chunks that were
        coded (their bytes went to the compacted part) are not copied -- as ``(start, end, host
        offset)``, and each chunk's offset in that host copy."""
        n = len(self.out_off)
        if not n:
            return [], np.zeros(0, dtype=np.int64)
        order = np.argsort(self.out_off, kind="stable")
        a = self.out_off[order]
        b = a + self.out_len[order]
        new = np.ones(n, dtype=bool)
        new[1:] = a[1:] > np.maximum.accumulate(b)[:-1] + gap
        first = np.nonzero(new)[0]
        run_of = np.cumsum(new) - 1
        run_a, run_b = a[first], np.maximum.reduceat(b, first)
        size = run_b - run_a
        pos = np.cumsum(size) - size
        hoff = np.empty(n, dtype=np.int64)
        hoff[order] = pos[run_of] + (a - run_a[run_of])
        return list(zip(run_a.tolist(), run_b.tolist(), pos.tolist())), hoff

    @property
    def stored_bytes(self) -> int:
        return int(self.out_len.sum())

    @property
    def codec_ids(self) -> list[str]:
        return np.where(self.coded, self.codec_id, RAW.id).tolist()

    @property
    def owner(self) -> list[tuple[int, int]]:
        return list(zip(self.owner_ji.tolist(), self.owner_ci.tolist()))


def _run_batch(batch: _Batch, prof: Profile, dev: torch.device, io: _Writer) -> dict[int, str]:
    """Code ``batch`` and hand its chunks to the I/O thread; returns the transform of each
    plane-transformed storage (sink job) of the batch."""
    r = _encode_batch_device(batch, prof, dev)
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


def _tensor_batch(tensors: list[torch.Tensor], prof: Profile) -> _Batch:
    batch = _Batch()
    seg = prof.segment_elems
    for i, t in enumerate(tensors):
        raw = t if t.is_contiguous() else t.contiguous()  # the kernels take its address: no byte view needed
        nbytes = raw.numel() * raw.element_size()
        transform, w = engine.transform_for(raw.dtype, nbytes)
        batch.pieces.append(_Piece(i, raw, None, None, raw.dtype, transform, w, 0, nbytes // w, seg, 0))
        batch.nbytes += nbytes
    return batch


def encode_tensors_device(tensors: list[torch.Tensor], profile: str = "fast") -> _Encoded:
    """Code CUDA tensors as one batch and stop on the device (benchmarks: no D2H, no container).

    Synchronizes once (the per-chunk choice is read back at the end).
    """
    prof = PROFILES[profile]
    batch = _tensor_batch(tensors, prof)
    dev = batch.pieces[0].raw.device
    with _nvcomp.on_stream(dev):
        return _encode_batch_device(batch, prof, dev)


class PreparedEncode:
    """:func:`encode_tensors_device` for tensors coded again and again (a training state saved every
    few hundred steps keeps its storages): the plan (:class:`EncodePlan` with ``keep``) is built once,
    each call codes the tensors' current contents. The returned :class:`_Encoded` is valid until the
    next call; the plan holds its buffers (about twice the raw bytes, plus the coder's slots).

    The plan reads the tensors at the addresses they had when it was built. It keeps their storages
    alive, and each call checks, while the GPU works and before the result is read back, that every
    tensor still has its storage and size (0.43 ms for 1172 tensors on a 2-core VM): a tensor given new
    storage (``param.data = ...``, ``resize_``) is a ValueError, never a code of stale bytes."""

    def __init__(self, tensors: list[torch.Tensor], profile: str = "fast") -> None:
        prof = PROFILES[profile]
        batch = _tensor_batch(tensors, prof)
        if any(p.raw is not t for p, t in zip(batch.pieces, tensors)):
            raise ValueError("PreparedEncode: every tensor must be contiguous (the plan keeps their addresses)")
        self._tensors = list(tensors)
        self._storages = [t.untyped_storage() for t in tensors]  # the memory the plan reads stays allocated
        self._where = self._addresses()
        self.dev = batch.pieces[0].raw.device
        with _nvcomp.on_stream(self.dev):
            self.plan = EncodePlan(batch, prof, self.dev, keep=True)

    def _addresses(self) -> np.ndarray:
        ts = self._tensors
        return np.stack([np.fromiter((t.data_ptr() for t in ts), np.int64, count=len(ts)),
                         np.fromiter((t.numel() for t in ts), np.int64, count=len(ts))])

    def _check(self) -> None:
        if not np.array_equal(self._addresses(), self._where):
            raise ValueError("PreparedEncode: a tensor has new storage or another size since the plan was built; "
                             "build a new PreparedEncode")

    def __call__(self) -> _Encoded:
        with _nvcomp.on_stream(self.dev):
            return self.plan.run(before_readback=self._check)


def _entropy_bits(keys: torch.Tensor, groups: int, counts: torch.Tensor) -> torch.Tensor:
    """Order-0 entropy in bits per byte of each group, on the device: ``keys`` are
    ``group * 256 + byte``; ``counts`` the bytes in each group (float32)."""
    hist = torch.bincount(keys, minlength=groups * 256).view(groups, 256).to(torch.float32)
    p = hist / counts[:, None]
    return -(p * torch.log2(torch.where(p > 0, p, torch.ones_like(p)))).sum(1)


#: bytes sampled per chunk by the probe (16 runs of 256 bytes spread over the chunk)
PROBE_BYTES = 4096
#: the probe sends a chunk other than a first (exponent) plane's to the coder only if its sample's
#: order-0 entropy promises at least this saving; first planes are always coded.
PROBE_MIN_GAIN = 0.05
#: the same for a batch that holds delta residuals: their later planes often promise 1-5% (at 0.05 a
#: store's chain of four bf16 saves lost 0.5% of its ratio; docs/PERFORMANCE.md, "The layout choice")
PROBE_MIN_GAIN_DELTA = 0.01


def probe_min_gain(delta: bool = False) -> float:
    """The saving a later plane's chunk must promise to be coded: ``S4W_PROBE_MIN_GAIN`` (0 to 1)
    or :data:`PROBE_MIN_GAIN` (:data:`PROBE_MIN_GAIN_DELTA` for a batch with ``delta`` residuals).
    1 stores raw every later-plane chunk the probe samples (those of at least :data:`PROBE_BYTES`):
    the encode and decode skip nvCOMP on the mantissa planes, for less ratio
    (docs/PERFORMANCE.md, "Knobs")."""
    env = os.environ.get("S4W_PROBE_MIN_GAIN")
    if env is None or env == "":
        return PROBE_MIN_GAIN_DELTA if delta else PROBE_MIN_GAIN
    try:
        gain = float(env)
    except ValueError:
        gain = -1.0
    if not 0.0 <= gain <= 1.0:
        raise ValueError(f"S4W_PROBE_MIN_GAIN={env!r}: expected a number from 0 to 1")
    return gain

#: columns of a batch's chunk table (int64, one entry per chunk each; one upload): the first five
#: are nvCOMP's batched-compression arguments (input address, bytes handed to the coder -- the
#: probe zeroes those of chunks it skips --, output address, output size, int32 status).
_COLS = ("in_ptr", "gate", "out_ptr", "size", "status", "length", "limit", "first", "src_off", "comp_off")


def _stage_bases(pieces: list[_Piece], dev: torch.device) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
    """Each piece's slice of its delta base on ``dev``, as the address of its first byte (0: no
    base). Device bases are used in place; host bases (the store's cache of the previous step) are
    copied slice by slice into one buffer for this batch, so device memory for bases is bounded by
    the batch, not by the checkpoint. Also returns the staged slices (piece index -> tensor), which
    must stay referenced until the batch's kernels are enqueued."""
    addr = np.zeros(len(pieces), dtype=np.int64)
    host: list[int] = []
    for k, p in enumerate(pieces):
        if p.base is None:
            continue
        if p.base.device == dev:
            addr[k] = p.base.data_ptr() + p.e0 * p.w
        else:
            host.append(k)
    staged: dict[int, torch.Tensor] = {}
    if host:
        sizes = [(pieces[k].e1 - pieces[k].e0) * pieces[k].w for k in host]
        slots = [_round(n, _REGION_ALIGN) for n in sizes]
        buf = torch.empty(max(sum(slots), 1), dtype=torch.uint8, device=dev)
        pos = 0
        for k, n, slot in zip(host, sizes, slots):
            p = pieces[k]
            dst = buf[pos : pos + n]
            dst.copy_(p.base[p.e0 * p.w : p.e1 * p.w], non_blocking=True)  # type: ignore[index]
            staged[k] = dst
            addr[k] = dst.data_ptr()
            pos += slot
    return addr, staged


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t if t.dtype == torch.uint8 and t.dim() == 1 else t.reshape(-1).view(torch.uint8)


def _encode_batch_device(batch: _Batch, prof: Profile, dev: torch.device) -> _Encoded:
    """Code one batch on the device (a plan built and run once)."""
    return EncodePlan(batch, prof, dev).run()


class EncodePlan:
    """One batch's encode on the device: the host work done once, the device work per :meth:`run`.

    Layout of ``out`` (one allocation): the pieces' first planes back to back (``P`` bytes, each
    piece's slot rounded to 256 bytes), then plane ``j`` of every piece at ``j * P`` from the same
    slot offset (one plane stride ``P`` for the whole batch), then the compacted chunks from
    ``maxw * P`` on. The raw chunks of planes after the first -- the mantissa bytes the probe finds
    near random, about half a bf16 state -- are never moved: they are stored from where the split
    wrote them. A run enqueues everything without a read-back (with nvCOMP's C API) up to the one
    at the end, which returns the per-chunk choice.

    The plan holds the chunk table and the split's launch tables (on the host and, where no delta
    base must be staged from the host, on the device). With ``keep`` it also keeps its ``out`` and
    coder buffers and the device copy of the chunk table between runs: a run is then the launches,
    the coder call and one read-back, and the :class:`_Encoded` it returns is valid until the next
    run. It codes the tensors' contents at the time of each run; the tensors must keep their
    storage (same addresses and sizes) while the plan is used."""

    def __init__(self, batch: _Batch, prof: Profile, dev: torch.device, keep: bool = False) -> None:
        pieces = self.pieces = batch.pieces
        self.prof, self.dev, self.raw_bytes, self.keep = prof, dev, batch.nbytes, keep
        k = len(pieces)
        meta = np.array(
            [(p.e0, p.e1, p.w, p.seg, p.raw.data_ptr(), OPS[p.op] if p.base is not None else 0,
              p.transform in PLANE_TRANSFORMS)
             for p in pieces],
            dtype=np.int64,
        ).reshape(k, 7)
        e0, e1, w, seg, rot = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3], meta[:, 6].astype(bool)
        ne = self.ne = e1 - e0
        ps = (ne + _REGION_ALIGN - 1) // _REGION_ALIGN * _REGION_ALIGN
        off = self.off = np.cumsum(ps) - ps  # each piece's slot in every plane region
        stride = int(ps.sum())  # P: the plane stride of every piece
        # the chunk table: chunk (segment s, plane j) of a piece lies at off + j * P + s * seg
        nseg = (ne + seg - 1) // seg
        nch = nseg * w
        piece_of = np.repeat(np.arange(k, dtype=np.int64), nch)
        local = np.arange(int(nch.sum()), dtype=np.int64) - np.repeat(np.cumsum(nch) - nch, nch)
        j_idx = local % w[piece_of]
        s0 = (local // w[piece_of]) * seg[piece_of]
        self.src_off = src_off = off[piece_of] + j_idx * stride + s0
        self.lengths = lengths = np.minimum(seg[piece_of], ne[piece_of] - s0)
        self.piece_ji = np.array([p.ji for p in pieces], dtype=np.int64)
        self.owner_ji = self.piece_ji[piece_of]
        self.owner_ci = np.array([p.chunk0 for p in pieces], dtype=np.int64)[piece_of] + local
        n = self.n = len(lengths)
        self.maxlen, self.total = int(lengths.max()), int(lengths.sum())
        self.c0 = int(w.max()) * stride
        self.out_bytes = self.c0 + int(((lengths + 15) // 16 * 16).sum())
        self.coder = _nvcomp.codec(prof.algorithm, dev, _round(self.maxlen, 1 << 16), **dict(prof.opts))
        self.cap = _nvcomp.max_compressed(self.coder, self.maxlen, dev)
        self.comp_off = np.arange(n, dtype=np.int64) * self.cap
        # the compaction copies 16-byte granules where every chunk and slot is 16-byte aligned
        self.words = dev.type == "cuda" and self.cap % 16 == 0 and not (src_off % 16).any()
        # the chunk table's host copy (pinned on a GPU): buffer addresses are added per run
        self.host = _nvcomp.host_empty(8 * len(_COLS) * n).view(torch.int64) if dev.type == "cuda" else (
            torch.empty(len(_COLS) * n, dtype=torch.int64))
        h = self.host.numpy().reshape(len(_COLS), n)
        first = (j_idx == 0) | ~rot[piece_of]
        limit = np.where(j_idx == 0, lengths, np.ceil(lengths * (1.0 - MIN_GAIN))).astype(np.int64)
        for name, col in (("gate", lengths), ("size", -1), ("status", 0), ("length", lengths), ("limit", limit),
                          ("first", first), ("src_off", src_off), ("comp_off", self.comp_off)):
            h[_COLS.index(name)] = col
        # the split's launches: rows (element address, base address, slot, elements, plane stride)
        self.rows = np.column_stack([meta[:, 4] + e0 * w, np.zeros(k, np.int64), off, ne, np.full(k, stride, np.int64)])
        self.ops, self.w, self.rot = meta[:, 5], w, rot
        self.host_bases = any(p.base is not None and p.base.device != dev for p in pieces)
        # the transform of each piece: given, or chosen by the layout probe on the device (the fast
        # profile's split launches from a prepared table; the other paths keep planes-rotl1)
        layout = np.array([p.layout for p in pieces], dtype=np.int64)
        small = ne < LAYOUT_RUNS * LAYOUT_RUN
        undecided = layout == LAYOUT_DECIDE
        # delta residuals keep planes-rotl1: a store run (4 saves, bf16) lost 0.6% of its chain's ratio
        # when they were probed too (docs/PERFORMANCE.md, "The layout choice")
        has_base = np.array([p.base is not None and not LAYOUT_DELTAS for p in pieces], dtype=bool)
        layout[undecided & (small | ~rot | (not prof.probe) | has_base | (self.host_bases and keep))] = LAYOUT_ROTL1
        self.layout = layout
        self.split: list[tuple[int, int, torch.Tensor, torch.Tensor, int, bool]] | None = None
        self.flag_slices: list[tuple[int, int, bool]] = []  # per split launch: its flags' slice, and whether to probe
        self.flags_init: torch.Tensor | None = None
        self.flags_run: torch.Tensor | None = None  # with ``keep``: the flags of a run (reset from flags_init)
        self.flag_order = np.zeros(0, dtype=np.int64)  # the pieces of the split's items, in launch order
        # delta bases on the host (the store's cache of the previous step) are copied to the device
        # here when the plan runs once (no ``keep``): the split's tables then hold their addresses, and
        # the layout probe runs for the batch's other pieces whatever bases share their batch
        self._staged: dict[int, torch.Tensor] | None = {}
        if not self.host_bases or not keep:
            self.rows[:, 1], self._staged = _stage_bases(pieces, dev)
            self.split = self._split_launches()
        self.out: torch.Tensor | None = None
        self.comp: torch.Tensor | None = None
        self.cols_init: torch.Tensor | None = None
        if keep:
            self.out, self.comp = self._buffers()
            self.cols_init = self._upload_cols(self.out, self.comp)
            self.cols_run = torch.empty_like(self.cols_init)
            if self.flags_init is not None:
                self.flags_run = torch.empty_like(self.flags_init)
        self.back = _nvcomp.host_empty(32 * n + 8 * k).view(torch.int64) if dev.type == "cuda" else None

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(self.out_bytes, dtype=torch.uint8, device=self.dev),
                torch.empty(self.cap * self.n, dtype=torch.uint8, device=self.dev))

    def _upload_cols(self, out: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
        """The chunk table with ``out``'s and ``comp``'s addresses, on the device in one copy (a
        copy of the host table on the CPU, where the interpreter runs the kernels)."""
        h = self.host.numpy().reshape(len(_COLS), self.n)
        np.add(self.src_off, out.data_ptr(), out=h[_COLS.index("in_ptr")])
        np.add(self.comp_off, comp.data_ptr(), out=h[_COLS.index("out_ptr")])
        return self.host.to(self.dev, non_blocking=True) if self.dev.type == "cuda" else self.host.clone()

    def _split_launches(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor, int, bool]]:
        """Per element width and delta op: the split's item table and program map, uploaded once,
        and the pieces of its items. Also the items' layout flags, in launch order, uploaded in the
        same copy (:attr:`flags_init`): each launch reads its slice (see :meth:`run`)."""
        block, _warps = block_config(SPLIT)
        tables = Tables()
        groups = []
        for width in np.unique(self.w[self.rot]).tolist():
            for code in np.unique(self.ops[self.rot & (self.w == width)]).tolist():
                idx = np.nonzero(self.rot & (self.w == width) & (self.ops == code) & (self.ne > 0))[0]
                if not len(idx):
                    continue
                r = self.rows[idx]
                programs = -(-r[:, 3] // block)
                aligned = not ((r[:, 0] | r[:, 1] | r[:, 2] | r[:, 4]) % 16).any()
                groups.append((int(width), int(code), tables.add(np.column_stack([r, np.cumsum(programs) - programs])),
                               tables.add(program_map(programs)), int(programs.sum()), aligned, idx,
                               bool((self.layout[idx] == LAYOUT_DECIDE).any())))
        order = np.concatenate([g[6] for g in groups]) if groups else np.zeros(0, dtype=np.int64)
        counts = [len(g[6]) for g in groups]
        starts = np.cumsum([0, *counts])[:-1].tolist()
        self.flag_slices = [(pos, cnt, g[7]) for pos, cnt, g in zip(starts, counts, groups)]
        t_flags = tables.add(self.layout[order] if len(order) else np.zeros(1, dtype=np.int64))
        self.flag_order = order
        dev = tables.upload(self.dev)
        self.flags_init = dev[t_flags]
        return [(wd, code, dev[t], dev[m], total, aligned) for wd, code, t, m, total, aligned, _idx, _d in groups]

    def run(self, before_readback: Any = None) -> _Encoded:
        """Code the batch; ``before_readback``: called once everything is enqueued, before the
        read-back (a check that may raise while the GPU works)."""
        dev, pieces, n = self.dev, self.pieces, self.n
        TRACE_MARKS.clear()
        mark("start", dev)
        if self.keep:
            assert self.out is not None and self.comp is not None and self.cols_init is not None
            out, comp = self.out, self.comp
            self.cols_run.copy_(self.cols_init)
            table = self.cols_run
        else:
            out, comp = self._buffers()
            table = self._upload_cols(out, comp)
        cols = {name: table[i * n : (i + 1) * n] for i, name in enumerate(_COLS)}
        cols["status"] = cols["status"].view(torch.int32)[:n]
        mark("tables", dev)
        # 1. planes of every piece (one launch per element width and delta op); the layout probe
        #    first chooses, on the device, the transform of each piece whose flag is 0
        staged: dict[int, torch.Tensor] = {}
        flags: torch.Tensor | None = None
        if self.split is not None:
            assert self.flags_init is not None
            if self._staged is None:
                raise RuntimeError("EncodePlan: a plan with delta bases staged from the host runs once")
            staged = self._staged
            if self.flags_run is not None:
                flags = self.flags_run
                flags.copy_(self.flags_init)
            else:
                flags = self.flags_init
            for (wd, code, t, m, total, aligned), (pos, cnt, decide) in zip(self.split, self.flag_slices):
                fl = flags[pos : pos + cnt]
                if decide:
                    layout_probe(t, fl, wd, code)
                launch_items(SPLIT, wd, code, t, m, total, out, aligned and out.data_ptr() % 16 == 0, flags=fl)
        else:
            rows = self.rows.copy()
            rows[:, 1], staged = _stage_bases(pieces, dev)
            for width in np.unique(self.w[self.rot]).tolist():
                sel = self.rot & (self.w == width)
                launch_rows(SPLIT, int(width), out, rows[sel], self.ops[sel])
        for i in np.nonzero(~self.rot)[0].tolist():  # storages coded as bytes (rare on this path): one plane
            p = pieces[i]
            src = _as_bytes(p.raw)[p.e0 * p.w : p.e1 * p.w]
            dst = out[int(self.off[i]) : int(self.off[i]) + int(self.ne[i])]
            if p.base is None:
                dst.copy_(src)
            else:
                b = staged[i] if i in staged else p.base[p.e0 * p.w : p.e1 * p.w]
                torch.bitwise_xor(src, b, out=dst)
        del staged
        if self.host_bases and not self.keep:
            self._staged = None  # the staged bases go once their kernels are enqueued (the plan runs once)
        mark("split", dev)
        # 2. one coder call over every chunk; the probe, on the device, zeroes the length handed to
        #    the coder of each chunk whose sample looks near random (it is then stored raw)
        if self.prof.probe:
            probe_gate(out, cols["length"], cols["src_off"], cols["first"], cols["gate"], PROBE_BYTES,
                       8.0 * (1.0 - probe_min_gain(bool(self.ops.any()))))
        mark("probe", dev)
        if isinstance(self.coder, _nvcomp._AnsC):  # noqa: SLF001 - sizes and statuses stay on the device
            self.coder.encode_cols(cols["in_ptr"], cols["gate"], cols["out_ptr"], cols["size"], cols["status"],
                                   self.maxlen, self.total)
        else:  # nvCOMP's Python API (or a stand-in): the chunks to code are read back first
            todo = np.nonzero(cols["gate"].cpu().numpy() > 0)[0]
            if len(todo):
                sizes = _nvcomp.encode_batch(self.coder, out, self.src_off[todo], self.lengths[todo], comp,
                                             self.comp_off[todo], np.full(len(todo), self.cap, dtype=np.int64))
                got = np.full(n, -1, dtype=np.int64)
                got[todo] = sizes
                cols["size"].copy_(torch.from_numpy(got).to(dev, non_blocking=True))
        mark("nvcomp_encode", dev)
        # 3. per chunk on the device: coded only if smaller (first plane) or MIN_GAIN smaller (other
        #    planes); coded chunks and first planes compacted after the planes, in chunk order
        words = self.words and (out.data_ptr() | comp.data_ptr()) % 16 == 0
        res = choose_and_gather(cols, out, comp, self.c0, self.maxlen, words)
        mark("choose+compact", dev)
        if before_readback is not None:
            before_readback()
        nf = len(self.flag_order) if flags is not None else 0
        if self.back is not None:  # the batch's one read-back
            self.back[: 4 * n].copy_(res.reshape(-1), non_blocking=True)
            if nf:
                assert flags is not None
                self.back[4 * n : 4 * n + nf].copy_(flags[:nf], non_blocking=True)
            _nvcomp.synchronize(dev)
            back = self.back.numpy()[: 4 * n].reshape(4, n)
            got = self.back.numpy()[4 * n : 4 * n + nf].copy()
        else:
            back = res.cpu().numpy()
            got = flags[:nf].cpu().numpy() if flags is not None else np.zeros(0, dtype=np.int64)
        mark("readback", dev)
        layout = self.layout.copy()
        if nf:
            if got.min() < LAYOUT_ROTL1 or got.max() > LAYOUT_PLAIN:
                raise RuntimeError("GPU writer: the layout probe left a piece undecided")  # never expected
            layout[self.flag_order[:nf]] = got
        if (layout[self.rot] == LAYOUT_DECIDE).any():
            raise RuntimeError("GPU writer: a piece's layout was never chosen")  # never expected
        layout[~self.rot] = 0
        coded, out_len, out_off, bad = back[0].astype(bool), back[1].copy(), back[2].copy(), back[3]
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise RuntimeError(f"nvCOMP ANS compress: {int(bad.sum())} chunk(s) failed (first: chunk {i})")
        if (out_len > self.lengths).any() or (out_off < 0).any() or int((out_off + out_len).max()) > out.numel():
            raise RuntimeError("GPU writer: the device's chunk table is inconsistent")  # never expected
        return _Encoded(out, out_off, out_len, coded, self.prof.codec_id, self.owner_ji, self.owner_ci, self.raw_bytes,
                        self.piece_ji, layout)

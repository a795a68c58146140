"""The device side of the GPU writer: one batch of pieces (segment ranges of storages) split into
planes, probed, coded by nvCOMP and compacted on the device, with one read-back (:class:`EncodePlan`);
the profiles, the probe's thresholds and the stage marks benchmarks read. :mod:`s4w_core.gpu._encode`
cuts a checkpoint's storages into batches and writes the chunks to the container."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from s4w_core import config
from s4w_core.codecs import DEFLATE, NVCOMP_ANS, RAW
from s4w_core.format.manifest import PLAIN, PLANE_TRANSFORMS, ROTL1
from s4w_core.gpu import _nvcomp
from s4w_core.gpu.kernels import LAYOUT_RUN, LAYOUT_RUNS, choose_and_gather, layout_probe, probe_gate
from s4w_core.jobs import transform_for
from s4w_core.planes.triton_kernels import (
    OPS,
    SPLIT,
    Tables,
    block_config,
    launch_items,
    launch_rows,
    program_map,
)

__all__ = [
    "MIN_GAIN",
    "PROFILES",
    "Batch",
    "EncodePlan",
    "Encoded",
    "Piece",
    "PreparedEncode",
    "Profile",
    "encode_batch_device",
    "encode_tensors_device",
    "mark",
    "probe_min_gain",
]

#: a chunk of a plane other than the first keeps its coded form only if it saves this fraction.
MIN_GAIN = 0.005
_REGION_ALIGN = 256
#: a piece's layout flag (``Piece.layout``, the split's per-item flags): decided on the device by
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


@dataclass(slots=True)
class Piece:
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
class Batch:
    pieces: list[Piece] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class Encoded:
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


def _tensor_batch(tensors: list[torch.Tensor], prof: Profile) -> Batch:
    batch = Batch()
    seg = prof.segment_elems
    for i, t in enumerate(tensors):
        raw = t if t.is_contiguous() else t.contiguous()  # the kernels take its address: no byte view needed
        nbytes = raw.numel() * raw.element_size()
        transform, w = transform_for(raw.dtype, nbytes)
        batch.pieces.append(Piece(i, raw, None, None, raw.dtype, transform, w, 0, nbytes // w, seg, 0))
        batch.nbytes += nbytes
    return batch


def encode_tensors_device(tensors: list[torch.Tensor], profile: str = "fast") -> Encoded:
    """Code CUDA tensors as one batch and stop on the device (benchmarks: no D2H, no container).

    Synchronizes once (the per-chunk choice is read back at the end).
    """
    prof = PROFILES[profile]
    batch = _tensor_batch(tensors, prof)
    dev = batch.pieces[0].raw.device
    with _nvcomp.on_stream(dev):
        return encode_batch_device(batch, prof, dev)


class PreparedEncode:
    """:func:`encode_tensors_device` for tensors coded again and again (a training state saved every
    few hundred steps keeps its storages): the plan (:class:`EncodePlan` with ``keep``) is built once,
    each call codes the tensors' current contents. The returned :class:`Encoded` is valid until the
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

    def __call__(self) -> Encoded:
        with _nvcomp.on_stream(self.dev):
            return self.plan.run(before_readback=self._check)

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
    gain = config.get_opt_float("S4W_PROBE_MIN_GAIN")  # a ConfigError (a ValueError) outside 0 to 1
    if gain is None:
        return PROBE_MIN_GAIN_DELTA if delta else PROBE_MIN_GAIN
    return gain

#: columns of a batch's chunk table (int64, one entry per chunk each; one upload): the first five
#: are nvCOMP's batched-compression arguments (input address, bytes handed to the coder -- the
#: probe zeroes those of chunks it skips --, output address, output size, int32 status).
_COLS = ("in_ptr", "gate", "out_ptr", "size", "status", "length", "limit", "first", "src_off", "comp_off")


def _stage_bases(pieces: list[Piece], dev: torch.device) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
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


def encode_batch_device(batch: Batch, prof: Profile, dev: torch.device) -> Encoded:
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
    the coder call and one read-back, and the :class:`Encoded` it returns is valid until the next
    run. It codes the tensors' contents at the time of each run; the tensors must keep their
    storage (same addresses and sizes) while the plan is used."""

    def __init__(self, batch: Batch, prof: Profile, dev: torch.device, keep: bool = False) -> None:
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
        lengths = np.minimum(seg[piece_of], ne[piece_of] - s0)
        # the table holds the chunks by size class (in piece order within one): each class is coded
        # by a coder call of its own, its output slots sized for its own longest chunk
        order = np.argsort(_nvcomp.slot_classes(lengths), kind="stable")
        piece_of, local, j_idx, s0, lengths = piece_of[order], local[order], j_idx[order], s0[order], lengths[order]
        self.src_off = src_off = off[piece_of] + j_idx * stride + s0
        self.lengths = lengths
        self.piece_ji = np.array([p.ji for p in pieces], dtype=np.int64)
        self.owner_ji = self.piece_ji[piece_of]
        self.owner_ci = np.array([p.chunk0 for p in pieces], dtype=np.int64)[piece_of] + local
        n = self.n = len(lengths)
        self.maxlen, self.total = int(lengths.max()), int(lengths.sum())
        self.c0 = int(w.max()) * stride
        self.out_bytes = self.c0 + int(((lengths + 15) // 16 * 16).sum())
        # per class (contiguous in the table): its rows [lo, hi), its coder, the slot size, and the
        # longest and total lengths
        classes, self.comp_off, self.comp_bytes = _nvcomp.class_slots(
            prof.algorithm, dev, lengths, np.arange(n, dtype=np.int64), **dict(prof.opts)
        )
        self.calls: list[tuple[int, int, Any, int, int, int]] = [
            (int(idx[0]), int(idx[-1]) + 1, coder, cap, longest, int(lengths[idx].sum()))
            for idx, coder, cap, longest in classes
        ]
        self.caps = np.repeat([c[3] for c in self.calls], [c[1] - c[0] for c in self.calls]).astype(np.int64)
        # the compaction copies 16-byte granules where every chunk and slot is 16-byte aligned
        self.words = dev.type == "cuda" and not (self.caps % 16).any() and not (src_off % 16).any()
        # the chunk table's host copy (pinned on a GPU): buffer addresses are added per run
        # columns of an even length: each starts 16-byte aligned (Triton specializes the kernels
        # that take them on pointer alignment; odd-length columns made it follow the chunk count)
        ns = self.ns = n + (n & 1)
        self.host = _nvcomp.host_empty(8 * len(_COLS) * ns).view(torch.int64) if dev.type == "cuda" else (
            torch.zeros(len(_COLS) * ns, dtype=torch.int64))
        h = self.host.numpy().reshape(len(_COLS), ns)[:, :n]
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
        # the read-back: 4 words per chunk, then the split's flags (a piece each, a pad per launch at most)
        self.back = _nvcomp.host_empty(32 * n + 16 * (k + 1)).view(torch.int64) if dev.type == "cuda" else None

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(self.out_bytes, dtype=torch.uint8, device=self.dev),
                torch.empty(max(self.comp_bytes, 1), dtype=torch.uint8, device=self.dev))

    def _upload_cols(self, out: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
        """The chunk table with ``out``'s and ``comp``'s addresses, on the device in one copy (a
        copy of the host table on the CPU, where the interpreter runs the kernels)."""
        h = self.host.numpy().reshape(len(_COLS), self.ns)[:, : self.n]
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
        # the flags of each launch from an even index: its slice starts 16-byte aligned (Triton
        # specializes on pointer alignment: see Tables.add); a pad entry (-1 in the order) is read
        # by no launch
        parts: list[np.ndarray] = []
        self.flag_slices = []
        pos = 0
        for g in groups:
            if pos % 2:
                parts.append(np.full(1, -1, dtype=np.int64))
                pos += 1
            self.flag_slices.append((pos, len(g[6]), g[7]))
            parts.append(np.asarray(g[6], dtype=np.int64))
            pos += len(g[6])
        order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        flags0 = np.where(order >= 0, self.layout[np.maximum(order, 0)], LAYOUT_ROTL1) if len(order) else np.zeros(1, dtype=np.int64)
        t_flags = tables.add(flags0)
        self.flag_order = order
        dev = tables.upload(self.dev)
        self.flags_init = dev[t_flags]
        return [(wd, code, dev[t], dev[m], total, aligned) for wd, code, t, m, total, aligned, _idx, _d in groups]

    def run(self, before_readback: Any = None) -> Encoded:
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
        ns = self.ns
        cols = {name: table[i * ns : i * ns + n] for i, name in enumerate(_COLS)}
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
        if isinstance(self.calls[0][2], _nvcomp.AnsC):  # sizes and statuses stay on the device
            for lo, hi, coder, _cap, longest, summed in self.calls:
                coder.encode_cols(cols["in_ptr"][lo:hi], cols["gate"][lo:hi], cols["out_ptr"][lo:hi],
                                  cols["size"][lo:hi], cols["status"][lo:hi], longest, summed)
        else:  # nvCOMP's Python API (or a stand-in): the chunks to code are read back first
            gate = cols["gate"].cpu().numpy()
            got = np.full(n, -1, dtype=np.int64)
            for lo, hi, coder, _cap, _longest, _summed in self.calls:
                todo = lo + np.nonzero(gate[lo:hi] > 0)[0]
                if len(todo):
                    got[todo] = _nvcomp.encode_batch(coder, out, self.src_off[todo], self.lengths[todo], comp,
                                                     self.comp_off[todo], self.caps[todo])
            if (got >= 0).any():
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
            live = self.flag_order[:nf] >= 0
            layout[self.flag_order[:nf][live]] = got[live]
        if (layout[self.rot] == LAYOUT_DECIDE).any():
            raise RuntimeError("GPU writer: a piece's layout was never chosen")  # never expected
        layout[~self.rot] = 0
        coded, out_len, out_off, bad = back[0].astype(bool), back[1].copy(), back[2].copy(), back[3]
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise RuntimeError(f"nvCOMP ANS compress: {int(bad.sum())} chunk(s) failed (first: chunk {i})")
        if (out_len > self.lengths).any() or (out_off < 0).any() or int((out_off + out_len).max()) > out.numel():
            raise RuntimeError("GPU writer: the device's chunk table is inconsistent")  # never expected
        return Encoded(out, out_off, out_len, coded, self.prof.codec_id, self.owner_ji, self.owner_ci, self.raw_bytes,
                        self.piece_ji, layout)

"""The tables of one staged batch's device decode (:class:`DecodePlan`): every table that does not
depend on where the batch's buffers lie, built with numpy and checked on the stager thread
(:func:`s4w_core.gpu._decode.stage`) while the GPU decodes the batch before."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from s4w_core import config
from s4w_core.errors import DecodeError
from s4w_core.format.manifest import PLAIN, PLANE_TRANSFORMS, RC_TRANSFORMS
from s4w_core.gpu import _nvcomp
from s4w_core.gpu.kernels import fold64_programs
from s4w_core.planes.triton_kernels import OP_PLAIN, OPS, block_config, merge_block, program_map

__all__ = ["GPU_DECODERS", "Call", "DecodePlan", "Group", "StagedChunks", "plan_key"]

_A = _nvcomp.ALIGN


def _round(x: int, a: int) -> int:
    return -(-x // a) * a


#: nvCOMP decoder per staged kind: (algorithm, codec options)
GPU_DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ans": ("ANS", {"data_type": "|u1"}),
    "inflate": ("Deflate", {}),
}


class StagedChunks(Protocol):
    """What a plan reads of a staged batch (:class:`s4w_core.gpu._decode.Staged`): per chunk, as
    numpy arrays, its slot in the staged buffer, its kind, its stored bytes and (entry, plane, s0,
    raw length)."""

    slot: Any
    kinds: Any
    stored: Any
    recs: Any


def plan_key() -> tuple[Any, ...]:
    """What a plan depends on besides its batch: the in-place merge switch and the merge block."""
    return config.get_bool("S4W_MERGE_IN_PLACE"), block_config()


class Call(NamedTuple):
    """One nvCOMP call of a batch's decode: chunks at ``src`` (offsets in the staged buffer) decode
    to ``dst`` (offsets in the planes buffer, or in a scratch buffer of ``scratch`` bytes whose
    slots are then copied to ``place`` in the planes buffer: places not 16-byte aligned)."""

    algorithm: str
    opts: dict[str, Any]
    chunk_bytes: int  # the codec's chunk size (the largest chunk, rounded up to 64 KiB)
    src: np.ndarray
    lengths: np.ndarray
    dst: np.ndarray
    raw: np.ndarray
    scratch: int
    place: np.ndarray | None
    ans: _nvcomp.AnsDecodeTable | None = None  # the call's host table, prepared (ANS through nvCOMP's C API)


class Group(NamedTuple):
    """The entries of one batched launch (a merge: one element width and delta op; a fold64: whole
    words or not), with the launch's static table columns and its program-to-item map."""

    w: int  # element width (merge) or 1 for whole words, 0 for bytes (fold64)
    op: int
    idx: np.ndarray  # entry indices, in the table's row order
    cols: np.ndarray  # the table's columns after the addresses, ending in each row's first program
    pmap: np.ndarray  # int32
    programs: int


def make_group(w: int, op: int, idx: np.ndarray, cols: list[np.ndarray], programs: np.ndarray) -> Group:
    first = np.cumsum(programs) - programs
    return Group(w, op, idx, np.column_stack([*cols, first]), program_map(programs), int(programs.sum()))


class DecodePlan:
    """Everything the device decode of one staged batch needs that does not depend on where its
    buffers lie: per-entry geometry and delta ops, the planes layout, the nvCOMP calls, which raw
    chunks are placed and which are merged where they were staged, the merge's chunk table, and the
    merge and fold64 launches' tables and program maps. Built with numpy on the stager thread
    (:func:`stage`), so that :func:`decode_device` enqueues the entropy decoders at once and keeps
    the GPU busy while it finishes the rest: its own host work is filling in buffer addresses, one
    table upload and the launches. Validated here: a chunk table that does not cover every segment
    and plane of every plane-transformed entry exactly once, or a delta op that does not apply,
    raises :class:`DecodeError`."""

    __slots__ = (
        "entries", "key", "k", "width", "nbytes", "rot", "n_el", "region", "op", "planes_bytes", "staged_end",
        "calls", "place", "in_place", "chunk_staged", "chunk_off", "chunk_aligned", "merge_cols", "rot_widths",
        "merge_groups", "byte_entries", "fold_idx", "fold_groups", "maps_host", "map_at", "rc_fix",
    )
    entries: list[dict[str, Any]]
    key: tuple[Any, ...]
    k: int
    width: np.ndarray
    nbytes: np.ndarray
    rot: np.ndarray
    n_el: np.ndarray
    region: np.ndarray
    op: np.ndarray  # OPS code per entry (0: no delta base)
    planes_bytes: int
    staged_end: int
    calls: list[Call]
    place: tuple[np.ndarray, np.ndarray, np.ndarray]
    in_place: bool
    chunk_staged: np.ndarray | None
    chunk_off: np.ndarray | None
    chunk_aligned: bool
    merge_cols: np.ndarray | None  # the merge's columns after the addresses (placed path; in place: the groups')
    rot_widths: list[int]
    merge_groups: list[Group]
    byte_entries: list[int]
    fold_idx: np.ndarray
    fold_groups: list[Group]
    maps_host: torch.Tensor  # the groups' program maps (int32, merge groups first), pinned on a GPU machine
    #: the plane-0 chunks of row/column-transform entries (docs/FORMAT.md 4.5d), to which the decode
    #: adds the offsets before merging: ``(entry, first element, elements, in the staged buffer, offset)``
    rc_fix: list[tuple[int, int, int, bool, int]]
    map_at: list[int]  # each group's map's first element in ``maps_host``

    @classmethod
    def build(cls, st: StagedChunks, entries: list[dict[str, Any]], name: str = "<checkpoint>") -> DecodePlan:
        p = cls()
        p.entries = entries
        p.key = plan_key()
        k_n = p.k = len(entries)
        meta = np.array(
            [(e["_width"], e["nbytes"], e["transform"] in PLANE_TRANSFORMS or e["transform"] in RC_TRANSFORMS,
              e["segment_elems"],
              e["checksum"].startswith("fold64:"))
             for e in entries],
            dtype=np.int64,
        ).reshape(k_n, 5)
        width, rot, seg = meta[:, 0], meta[:, 2].astype(bool), meta[:, 3]
        p.width, p.nbytes, p.rot = width, meta[:, 1], rot
        p.op = np.zeros(k_n, dtype=np.int64)
        for i, e in enumerate(entries):
            if e.get("delta"):
                op = e["delta"].get("op", "xor")
                if op not in (("xor", "sub") if rot[i] else ("xor",)):
                    raise DecodeError(f"{name}: delta op {op!r} does not apply to tensor {e['path']!r}")
                p.op[i] = OPS[op]
            if e["transform"] == PLAIN or RC_TRANSFORMS.get(e["transform"]) == PLAIN:
                p.op[i] |= OP_PLAIN  # the merge launches are grouped by this code: one more constexpr
        n_el = p.n_el = meta[:, 1] // width
        ps = (n_el + _A - 1) // _A * _A
        size = (width * ps + 255) // 256 * 256
        region = p.region = np.cumsum(size) - size
        p.planes_bytes = int(size.sum())
        rec = st.recs
        k, j, s0, raw_len = rec[:, 0], rec[:, 1], rec[:, 2], rec[:, 3]
        dst = region[k] + j * ps[k] + s0
        slot, stored, kinds = st.slot, st.stored, st.kinds
        cp = kinds == "copy"
        ends = slot + np.where(cp, np.maximum(stored, raw_len), stored)
        p.staged_end = int(ends.max()) if len(ends) else 0
        # one nvCOMP call for every chunk of a codec (two if some places are not 16-byte aligned)
        p.calls = []
        for kind, (algorithm, opts) in GPU_DECODERS.items():
            sel = kinds == kind
            if not sel.any():
                continue
            direct = sel & (dst % _A == 0)
            via = sel & (dst % _A != 0)
            for m, scratched in ((direct, False), (via, True)):
                if not m.any():
                    continue
                rl = raw_len[m]
                chunk_bytes = _round(int(rl.max()), 1 << 16)
                if scratched:
                    sz = (rl + _A - 1) // _A * _A
                    soff = np.cumsum(sz) - sz
                    call = Call(algorithm, opts, chunk_bytes, slot[m], stored[m], soff, rl, int(sz.sum()), dst[m])
                else:
                    call = Call(algorithm, opts, chunk_bytes, slot[m], stored[m], dst[m], rl, 0, None)
                if algorithm == "ANS" and opts == {"data_type": "|u1"}:
                    call = call._replace(ans=_nvcomp.ans_decode_table(call.src, call.lengths, call.dst, call.raw))
                p.calls.append(call)
        # plane-transformed storages merge their raw chunks where they lie in the staged buffer (no
        # placement copy) when every segment is a whole number of merge blocks (``S4W_MERGE_IN_PLACE=0``:
        # never); other raw chunks are placed into the planes buffer first
        block = merge_block()
        p.in_place = in_place = (
            bool(rot.any()) and not (seg[rot] % block).any() and config.get_bool("S4W_MERGE_IN_PLACE")
        )
        place = cp & ~rot[k] if in_place else cp
        p.place = (slot[place], dst[place], raw_len[place])
        p.rot_widths = np.unique(width[rot]).tolist()
        p.merge_groups = []
        if in_place:
            nch = np.where(rot, -(-n_el // np.maximum(seg, 1)) * width, 0)
            first = np.cumsum(nch) - nch
            mine = rot[k]
            km = k[mine]
            idx = first[km] + (s0[mine] // seg[km]) * width[km] + j[mine]
            total = int(nch.sum())
            have = np.bincount(idx, minlength=total) if total and not (idx < 0).any() else np.zeros(0, dtype=np.int64)
            if len(have) != total or (have != 1).any():
                raise DecodeError(f"{name}: the chunk table does not cover every segment and plane exactly once")
            p.chunk_staged = np.zeros(total, dtype=bool)
            p.chunk_off = np.zeros(total, dtype=np.int64)
            p.chunk_staged[idx] = cp[mine]
            p.chunk_off[idx] = np.where(cp[mine], slot[mine], dst[mine])
            p.chunk_aligned = not (p.chunk_off % 16).any()
            p.merge_cols = None
            # one launch per element width and delta op (the op is undone in the same pass)
            for w_ in p.rot_widths:
                for code in np.unique(p.op[rot & (width == w_)]).tolist():
                    g = np.nonzero(rot & (width == w_) & (p.op == code) & (n_el > 0))[0]
                    if len(g):
                        p.merge_groups.append(
                            make_group(int(w_), int(code), g, [first[g], n_el[g], seg[g]], -(-n_el[g] // block))
                        )
        else:
            p.chunk_staged = p.chunk_off = None
            p.chunk_aligned = False
            p.merge_cols = np.column_stack([region, n_el, ps])
        # row/column entries: where each plane-0 chunk lies when the merge reads it (a raw or
        # host-decoded chunk merged in place stays in the staged buffer; every other one is in the
        # planes buffer)
        rc = np.array([e["transform"] in RC_TRANSFORMS for e in entries], dtype=bool)
        p.rc_fix = []
        if rc.any():
            sel = np.nonzero(rc[k] & (j == 0))[0]
            in_staged = (cp & rot[k]) if in_place else np.zeros(len(k), dtype=bool)
            p.rc_fix = [
                (int(k[c]), int(s0[c]), int(raw_len[c]), bool(in_staged[c]), int(slot[c] if in_staged[c] else dst[c]))
                for c in sel.tolist()
            ]
        p.byte_entries = np.nonzero(~rot)[0].tolist()
        fold = meta[:, 4].astype(bool) & (p.nbytes > 0)
        p.fold_idx = np.nonzero(fold)[0]
        p.fold_groups = []
        for words in (True, False):
            g = np.nonzero(fold & ((p.nbytes % 4 == 0) == words))[0]
            if len(g):
                p.fold_groups.append(make_group(int(words), 0, g, [p.nbytes[g], g], fold64_programs(p.nbytes[g])))
        # the program maps (the largest tables: one int32 per program) go to pinned memory here, off
        # the decode's critical path, so that the decode sends them to the device without a host copy
        # (each map from a 16-byte boundary: Triton specializes on pointer alignment, and an
        # alignment that followed the sizes of the maps before it would compile data-dependent variants)
        maps = [g.pmap for g in p.merge_groups + p.fold_groups]
        lens = -(-np.array([len(m) for m in maps], dtype=np.int64) // 4) * 4
        p.map_at = (np.cumsum(lens) - lens).tolist()
        p.maps_host = _nvcomp.host_empty(4 * max(int(lens.sum()), 4)).view(torch.int32)
        host = p.maps_host.numpy()
        for m, at in zip(maps, p.map_at):
            host[at : at + len(m)] = m
        return p

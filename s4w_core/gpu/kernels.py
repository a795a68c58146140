"""Triton kernels of the GPU backend besides the plane transform: the encoder's probe and per-chunk
choice, a batched gather-copy and fold64.

* :func:`probe_gate` and :func:`choose_and_gather` are the encoder's steps around the entropy
  coder, on the device with no read-back between them: which chunks the coder takes (a histogram of
  a sample per chunk), then per chunk coded or raw and the compaction of the chosen bytes (a scan
  over the chunk table in one program, then one copy launch). The parity checks hold them to a
  numpy model of the rule.
* :func:`gather_copy` copies many byte ranges between two buffers in one launch (the chunk table
  lives on the device), so placing decoded chunks into their planes costs one launch instead of one
  per chunk.
* :func:`fold64_into` accumulates the ``fold64`` checksum (defined in :mod:`s4w_core.checksum`)
  of a storage into an int64 slot of a device tensor with atomics: many storages, one read-back.
  The torch definition in :mod:`s4w_core.checksum` is the oracle; the parity tests check every
  length class (``nbytes % 4``) against it.

Specialization: the kernels take small device tables (item rows, program maps, chunk columns)
whose addresses are views at any 8-byte offset of one uploaded buffer, and counts of any value.
They are declared with ``do_not_specialize_on_alignment`` / ``do_not_specialize`` for those
arguments, so one compiled variant per set of constexprs serves every call: what the warm-up
(:mod:`s4w_core.gpu._warmup`) compiles is exactly what later saves and loads run.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from s4w_core import config
from s4w_core.errors import ConfigError
from s4w_core.planes.triton_kernels import fwd16, fwd32, item_table, upload

__all__ = [
    "gather_copy",
    "fold64_into",
    "fold64_finish",
    "fold64",
    "fold64_batched",
    "fold64_rows",
    "fold64_programs",
    "fold64_launch",
    "probe_gate",
    "layout_probe",
    "choose_and_gather",
]

_COPY_BLOCK = 8192
_FOLD_BLOCK = 2048  # words per program
_KLEN = 0x94D049BB133111EB


@triton.jit(do_not_specialize_on_alignment=['src_off_ptr', 'dst_off_ptr', 'len_ptr'])
def _gather_copy_kernel(
    src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, len_ptr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr
):
    c = tl.program_id(0)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    ln = tl.load(len_ptr + c)
    so = tl.load(src_off_ptr + c)
    do = tl.load(dst_off_ptr + c)
    if ALIGNED:
        so = tl.multiple_of(so, 16)
        do = tl.multiple_of(do, 16)
    offs = start + tl.arange(0, BLOCK)
    m = offs < ln
    v = tl.load(src_ptr + so + offs, mask=m)
    tl.store(dst_ptr + do + offs, v, mask=m)


@triton.jit(do_not_specialize_on_alignment=['src_off_ptr', 'dst_off_ptr', 'len_ptr'])
def _gather_words_kernel(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, len_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """As :func:`_gather_copy_kernel` on 16-byte granules (offsets in int64 words, lengths rounded
    up to whole granules): 8-byte accesses instead of single bytes, ``ITERS`` tiles per program."""
    c = tl.program_id(0)
    nw = tl.load(len_ptr + c)
    so = tl.multiple_of(tl.load(src_off_ptr + c), 2)
    do = tl.multiple_of(tl.load(dst_off_ptr + c), 2)
    base = tl.program_id(1).to(tl.int64) * (BLOCK * ITERS)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        m = offs < nw
        v = tl.load(src_ptr + so + offs, mask=m)
        tl.store(dst_ptr + do + offs, v, mask=m)


def gather_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_off: Sequence[int] | np.ndarray,
    dst_off: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    pad_ok: bool = False,
) -> None:
    """``dst[dst_off[i] : +lengths[i]] = src[src_off[i] : +lengths[i]]`` for every ``i``, one launch.

    ``src``/``dst``: 1-D uint8 tensors on one device. Offsets and lengths: sequences or int64 numpy
    arrays. Ranges must lie inside the buffers (checked here, on the host, with numpy: no host work
    per range). Enqueued on the current stream.
    ``pad_ok``: the caller guarantees that each destination range may be written up to its next
    16-byte boundary (slot padding nobody reads) and no two rounded ranges overlap; with every
    offset 16-byte aligned the copy then moves whole 16-byte granules (about 10x faster).
    """
    so = np.asarray(src_off, dtype=np.int64)
    do = np.asarray(dst_off, dtype=np.int64)
    ln = np.asarray(lengths, dtype=np.int64)
    if not len(ln):
        return
    if (
        int((so + ln).max()) > src.numel()
        or int((do + ln).max()) > dst.numel()
        or int(so.min()) < 0
        or int(do.min()) < 0
        or int(ln.min()) < 0
    ):
        raise ValueError("gather_copy: a range lies outside its buffer")
    aligned = not ((so | do) % 16).any() and src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0
    rounded = -(-ln // 16) * 16
    words = (
        pad_ok
        and aligned
        and src.numel() % 16 == 0
        and dst.numel() % 16 == 0
        and int((so + rounded).max()) <= src.numel()
        and int((do + rounded).max()) <= dst.numel()
    )
    if words:
        table_np = np.stack([so // 8, do // 8, rounded // 8])
        block = config.get_int("S4W_GATHER_WORDS")
        iters = config.get_int("S4W_GATHER_ITERS")
    else:
        table_np = np.stack([so, do, ln])
        block = _COPY_BLOCK
    table = upload(table_np, src.device)
    longest = max(int(ln.max()), 1)
    if words:
        grid = (len(ln), triton.cdiv(longest, 8 * block * iters))
        _gather_words_kernel[grid](
            src.view(torch.int64), dst.view(torch.int64), table[0], table[1], table[2], BLOCK=block, ITERS=iters,
            num_warps=config.get_int("S4W_GATHER_WARPS"),
        )
    else:
        grid = (len(ln), triton.cdiv(longest, _COPY_BLOCK))
        _gather_copy_kernel[grid](src, dst, table[0], table[1], table[2], ALIGNED=aligned, BLOCK=block, num_warps=4)


def fold64_into(flat_u8: torch.Tensor, acc: torch.Tensor, slot: int) -> None:
    """Add the word sum of ``fold64(flat_u8)`` into ``acc[slot]`` (int64, same device; start at 0).

    Finish with :func:`fold64_finish`. Enqueued on the current stream; no host synchronization.
    """
    fold64_batched([(flat_u8, slot)], acc)


def fold64_finish(word_sum: int, nbytes: int) -> int:
    """The fold64 value from the accumulated (signed int64) word sum and the byte length."""
    return (word_sum + nbytes * _KLEN) & ((1 << 64) - 1)


def fold64(flat_u8: torch.Tensor) -> int:
    """fold64 of one tensor (synchronizes); equals :func:`s4w_core.checksum.fold64`."""
    acc = torch.zeros(1, dtype=torch.int64, device=flat_u8.device)
    fold64_into(flat_u8, acc, 0)
    return fold64_finish(int(acc.item()), flat_u8.numel())


@triton.jit(do_not_specialize_on_alignment=['items_ptr', 'map_ptr', 'acc_ptr'])
def _fold64_batched_kernel(items_ptr, map_ptr, acc_ptr, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    item = tl.load(map_ptr + b)
    row = items_ptr + 4 * item
    addr = tl.load(row)
    nbytes = tl.load(row + 1)
    slot = tl.load(row + 2)
    start = tl.multiple_of((b - tl.load(row + 3)) * BLOCK, BLOCK)  # lets Triton vectorize
    w = start + tl.arange(0, BLOCK)
    nwords = (nbytes + 3) // 4
    valid = w < nwords
    if WORDS:
        xp = addr.to(tl.pointer_type(tl.int32))
        word = tl.load(xp + w, mask=valid, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    else:
        xp = addr.to(tl.pointer_type(tl.uint8))
        bo = w * 4
        b0 = tl.load(xp + bo, mask=bo < nbytes, other=0).to(tl.uint64) & 0xFF
        b1 = tl.load(xp + bo + 1, mask=bo + 1 < nbytes, other=0).to(tl.uint64) & 0xFF
        b2 = tl.load(xp + bo + 2, mask=bo + 2 < nbytes, other=0).to(tl.uint64) & 0xFF
        b3 = tl.load(xp + bo + 3, mask=bo + 3 < nbytes, other=0).to(tl.uint64) & 0xFF
        word = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    x = word + (w + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    x = x ^ (x >> 33)
    x = x * 0xFF51AFD7ED558CCD
    x = x ^ (x >> 33)
    x = x * 0xC4CEB9FE1A85EC53
    x = x ^ (x >> 33)
    x = tl.where(valid, x, 0)
    s = tl.sum(x, axis=0)
    tl.atomic_add(acc_ptr + slot, s.to(tl.int64, bitcast=True))


def fold64_batched(items: list[tuple[torch.Tensor, int]], acc: torch.Tensor) -> None:
    """:func:`fold64_into` for many ``(flat_u8, slot)`` pairs in at most two launches (aligned whole
    words, and the rest); see :func:`fold64_rows`."""
    items = [(x, slot) for x, slot in items if x.numel()]
    if items:
        fold64_rows(
            np.fromiter((x.data_ptr() for x, _ in items), dtype=np.int64, count=len(items)),
            np.fromiter((x.numel() for x, _ in items), dtype=np.int64, count=len(items)),
            np.fromiter((slot for _, slot in items), dtype=np.int64, count=len(items)),
            acc,
        )


def fold64_programs(nbytes: np.ndarray) -> np.ndarray:
    """Programs of :func:`fold64_launch` per item of ``nbytes`` bytes."""
    return -(-((nbytes + 3) // 4) // _FOLD_BLOCK)


def fold64_launch(table: torch.Tensor, prog_map: torch.Tensor, programs: int, acc: torch.Tensor, words: bool) -> None:
    """:func:`fold64_rows`'s launch over a table uploaded ahead (``planes.triton_kernels.Tables``):
    rows ``(address, bytes, slot, first program)``, programs from :func:`fold64_programs`; with
    ``words`` every address is 4-byte aligned and every length a multiple of 4."""
    _fold64_batched_kernel[(programs,)](table, prog_map, acc, WORDS=words, BLOCK=_FOLD_BLOCK, num_warps=4)


def fold64_rows(addr: np.ndarray, nbytes: np.ndarray, slot: np.ndarray, acc: torch.Tensor) -> None:
    """Add the fold64 word sums of the byte ranges ``addr[i] : +nbytes[i]`` (device addresses of
    the caller's tensors, on ``acc``'s device) into ``acc[slot[i]]``: at most two launches (whole
    aligned words, and the rest). A small item table goes to the device in one copy and the
    program-to-item map is built there, so host work is a few numpy operations whatever the number
    of items or bytes."""
    live = nbytes > 0
    addr, nbytes, slot = addr[live], nbytes[live], slot[live]
    whole = (nbytes % 4 == 0) & (addr % 4 == 0)
    for words in (True, False):
        sel = whole if words else ~whole
        if not sel.any():
            continue
        n = nbytes[sel]
        table, prog_map, total = item_table(
            np.column_stack([addr[sel], n, slot[sel]]), fold64_programs(n), acc.device
        )
        _fold64_batched_kernel[(total,)](table, prog_map, acc, WORDS=words, BLOCK=_FOLD_BLOCK, num_warps=4)


@triton.jit
def _entropy256(x, N: tl.constexpr):
    """Order-0 entropy in bits of ``N`` values 0..255 (a 1-D tensor)."""
    h = tl.histogram(x, 256).to(tl.float32)
    p = h / N
    return -tl.sum(tl.where(h > 0, p * tl.log2(tl.where(h > 0, p, 1.0)), 0.0), axis=0)


@triton.jit
def _sample_bits(buf_ptr, st, RUNS: tl.constexpr, RUN: tl.constexpr):
    """Order-0 entropy (bits per byte, float32) of the bytes ``buf[s : s + RUN]`` for every ``s`` in
    ``st`` taken together: one histogram."""
    x = tl.load(buf_ptr + st[:, None] + tl.arange(0, RUN)[None, :]).to(tl.int32) & 0xFF
    return _entropy256(tl.reshape(x, (RUNS * RUN,)), RUNS * RUN)


@triton.jit(do_not_specialize_on_alignment=['len_ptr', 'off_ptr', 'first_ptr', 'gate_ptr'])
def _probe_gate_kernel(buf_ptr, len_ptr, off_ptr, first_ptr, gate_ptr, thr, RUNS: tl.constexpr, RUN: tl.constexpr):
    c = tl.program_id(0)
    ln = tl.load(len_ptr + c)
    first = tl.load(first_ptr + c)
    if (first == 0) & (ln >= RUNS * RUN):
        step = (ln - RUN) // (RUNS - 1)
        st = tl.load(off_ptr + c) + step * tl.arange(0, RUNS).to(tl.int64)
        bits = _sample_bits(buf_ptr, st, RUNS, RUN)
        if bits >= thr:
            tl.store(gate_ptr + c, tl.zeros((), tl.int64))


def probe_gate(
    buf: torch.Tensor, lengths: torch.Tensor, src_off: torch.Tensor, first: torch.Tensor, gate: torch.Tensor,
    sample_bytes: int, max_bits: float,
) -> None:
    """The encoder's probe, on the device, with no read-back: for every chunk ``c`` that is not a
    first plane's (``first[c] == 0``) and holds at least ``sample_bytes`` bytes, the order-0
    entropy of a sample (16 runs spread over ``buf[src_off[c] : +lengths[c]]``, one histogram);
    where it is not below ``max_bits`` bits per byte, ``gate[c] = 0``
    (the entropy coder then skips the chunk). Other entries of ``gate`` are left as they are.
    ``lengths``, ``src_off``, ``first``, ``gate``: int64 device tensors of one entry per chunk
    (views of one table are fine); the caller sized the chunks inside ``buf``. One launch."""
    n = lengths.numel()
    if n:
        runs = 16
        _probe_gate_kernel[(n,)](buf, lengths, src_off, first, gate, float(max_bits), RUNS=runs, RUN=sample_bytes // runs,
                                 num_warps=4)


#: the layout probe samples ``LAYOUT_RUNS`` runs of ``LAYOUT_RUN`` elements spread over each item; an
#: item with fewer elements keeps ``planes-rotl1``
LAYOUT_RUNS = 16
LAYOUT_RUN = 128
#: bits per element by which ``planes`` must beat ``planes-rotl1`` on the sample's plane 0
LAYOUT_MARGIN = 0.125


@triton.jit(do_not_specialize_on_alignment=['items_ptr', 'flags_ptr'])
def _layout_probe_kernel(items_ptr, flags_ptr, margin, W: tl.constexpr, OP: tl.constexpr, RUNS: tl.constexpr,
                         RUN: tl.constexpr):
    i = tl.program_id(0)
    if tl.load(flags_ptr + i) == 0:
        row = items_ptr + 6 * i
        src = tl.load(row)
        base = tl.load(row + 1)
        n = tl.load(row + 3)
        step = (n - RUN) // (RUNS - 1)
        e = (step * tl.arange(0, RUNS).to(tl.int64))[:, None] + tl.arange(0, RUN)[None, :]
        e = tl.reshape(e, (RUNS * RUN,))
        zero = tl.zeros((), tl.int32)
        if W == 2:
            u = tl.load(src.to(tl.pointer_type(tl.int16)) + e).to(tl.int32) & 0xFFFF
            v = u
            if (OP & 3) != 0:
                v = tl.load(base.to(tl.pointer_type(tl.int16)) + e).to(tl.int32) & 0xFFFF
            x = fwd16(u, v, (OP & 3) | 4, zero)  # the residual, not rotated
            plain = (x >> 8) & 0xFF
            rot = (((x << 1) | (x >> 15)) >> 8) & 0xFF
        else:
            u = tl.load(src.to(tl.pointer_type(tl.int32)) + e).to(tl.int64) & 0xFFFFFFFF
            v = u
            if (OP & 3) != 0:
                v = tl.load(base.to(tl.pointer_type(tl.int32)) + e).to(tl.int64) & 0xFFFFFFFF
            x = fwd32(u, v, (OP & 3) | 4, zero)
            plain = ((x >> 24) & 0xFF).to(tl.int32)
            rot = ((((x << 1) | (x >> 31)) >> 24) & 0xFF).to(tl.int32)
        better = _entropy256(plain, RUNS * RUN) + margin < _entropy256(rot, RUNS * RUN)
        tl.store(flags_ptr + i, tl.where(better, 2, 1).to(tl.int64))


def layout_probe(table: torch.Tensor, flags: torch.Tensor, w: int, op: int, margin: float | None = None) -> None:
    """The encoder's layout choice, on the device, with no read-back: for each item ``i`` of a split
    launch table (rows ``(element address, base address, slot, elements, plane stride, first
    program)``) whose ``flags[i]`` is 0, sample :data:`LAYOUT_RUNS` runs of :data:`LAYOUT_RUN`
    elements spread over it, take their residual under delta op ``op`` (:data:`OPS` code), and set
    ``flags[i]`` to 2 (``planes``) where plane 0's order-0 entropy without the rotation is at least
    ``margin`` bits (default :data:`LAYOUT_MARGIN`) lower than with it, else 1 (``planes-rotl1``). Items with another flag are left
    as they are; the caller gives every item of fewer than ``LAYOUT_RUNS * LAYOUT_RUN`` elements
    another flag. ``flags``: int64, one per item, on the table's device. One launch.

    Plane 0 is the plane the fast profile always codes; under ``planes`` it holds the sign bit, which
    costs nothing there when it is (nearly) constant -- non-negative tensors such as Adam's
    ``exp_avg_sq``, or delta residuals -- while under ``planes-rotl1`` it would sit in the last plane,
    stored raw unless an ANS pass over that whole plane pays (docs/PERFORMANCE.md, "The layout
    choice")."""
    k = flags.numel()
    if k:
        m = LAYOUT_MARGIN if margin is None else margin
        _layout_probe_kernel[(k,)](table, flags, float(m), W=w, OP=op, RUNS=LAYOUT_RUNS, RUN=LAYOUT_RUN,
                                   num_warps=4)


@triton.jit(do_not_specialize_on_alignment=['gate_ptr', 'size_ptr', 'status_ptr', 'len_ptr', 'limit_ptr', 'first_ptr', 'off_ptr', 'res_ptr'], do_not_specialize=['n', 'c0'])
def _choose_chunks_kernel(gate_ptr, size_ptr, status_ptr, len_ptr, limit_ptr, first_ptr, off_ptr, res_ptr, n, c0,
                          BLOCK: tl.constexpr):
    run = tl.full((), 0, tl.int64) + c0
    for b in range(0, tl.cdiv(n, BLOCK)):
        i = b * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        gl = tl.load(gate_ptr + i, mask=m, other=0)
        sz = tl.load(size_ptr + i, mask=m, other=0)
        st = tl.load(status_ptr + i, mask=m, other=0)
        ln = tl.load(len_ptr + i, mask=m, other=0)
        lim = tl.load(limit_ptr + i, mask=m, other=0)
        first = tl.load(first_ptr + i, mask=m, other=0)
        so = tl.load(off_ptr + i, mask=m, other=0)
        ok = (gl > 0) & (st == 0) & (sz > 0) & (sz < lim)
        olen = tl.where(ok, sz, ln)
        into = (ok | (first != 0)) & m
        slot = tl.where(into, (olen + 15) // 16 * 16, 0)
        incl = tl.cumsum(slot, axis=0)
        dst = tl.where(into, run + incl - slot, so)
        bad = (gl > 0) & (st != 0)
        tl.store(res_ptr + i, ok.to(tl.int64), mask=m)
        tl.store(res_ptr + n + i, olen, mask=m)
        tl.store(res_ptr + 2 * n + i, dst, mask=m)
        tl.store(res_ptr + 3 * n + i, bad.to(tl.int64), mask=m)
        run += tl.sum(slot, axis=0)


@triton.jit
def _copy_tiles(src_ptr, dst_ptr, so, do, units, base, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    for k in tl.static_range(ITERS):
        offs = base + k * BLOCK + tl.arange(0, BLOCK)
        mk = offs < units
        tl.store(dst_ptr + do + offs, tl.load(src_ptr + so + offs, mask=mk), mask=mk)


@triton.jit(do_not_specialize_on_alignment=['res_ptr', 'first_ptr', 'off_ptr', 'comp_off_ptr'], do_not_specialize=['n'])
def _gather_chosen_kernel(res_ptr, first_ptr, off_ptr, comp_off_ptr, n, out_ptr, comp_ptr, WORDS: tl.constexpr,
                          BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Per chunk (program row): a coded chunk's bytes from ``comp``, a first plane's raw chunk from
    ``out``, to its slot in ``out``; other chunks stay. ``WORDS``: the buffers are int64 views and
    every offset a multiple of 16 bytes (16-byte granules, slots padded)."""
    c = tl.program_id(0)
    ok = tl.load(res_ptr + c) != 0
    if ok | (tl.load(first_ptr + c) != 0):
        olen = tl.load(res_ptr + n + c)
        dst = tl.load(res_ptr + 2 * n + c)
        base = tl.program_id(1).to(tl.int64) * (BLOCK * ITERS)
        if WORDS:
            units = (olen + 15) // 16 * 2
            do = tl.multiple_of(dst // 8, 2)
            if ok:
                _copy_tiles(comp_ptr, out_ptr, tl.multiple_of(tl.load(comp_off_ptr + c) // 8, 2), do, units, base,
                            BLOCK, ITERS)
            else:
                _copy_tiles(out_ptr, out_ptr, tl.multiple_of(tl.load(off_ptr + c) // 8, 2), do, units, base, BLOCK,
                            ITERS)
        else:
            if ok:
                _copy_tiles(comp_ptr, out_ptr, tl.load(comp_off_ptr + c), dst, olen, base, BLOCK, ITERS)
            else:
                _copy_tiles(out_ptr, out_ptr, tl.load(off_ptr + c), dst, olen, base, BLOCK, ITERS)


def _compact_config() -> tuple[int, int, int]:
    """(int64 words per tile, tiles per program, warps) of the compaction's 16-byte copies:
    ``S4W_COMPACT_CONFIG="words,tiles,warps"`` (benchmarks sweep it; default ``8192,2,16``)."""
    text = config.get_str("S4W_COMPACT_CONFIG")
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdecimal() and int(p) > 0 for p in parts):
        raise ConfigError(f"S4W_COMPACT_CONFIG={text!r}: expected three whole numbers >= 1: words,tiles,warps")
    b, i, w = (int(p) for p in parts)
    return b, i, w


def choose_and_gather(
    cols: dict[str, torch.Tensor], out: torch.Tensor, comp: torch.Tensor, c0: int, max_len: int, words: bool
) -> torch.Tensor:
    """The encoder's per-chunk choice and compaction, on the device, after the entropy coder and
    with no read-back between them (:mod:`s4w_core.gpu._encode` documents the layout).

    ``cols``: int64 device tensors of one entry per chunk: ``gate`` (bytes handed to the coder, 0:
    skipped), ``size`` (its output size), ``status`` (int32: the coder's status), ``length`` (raw
    bytes), ``limit`` (coded only if ``size < limit``), ``first`` (a first plane's chunk, or a
    storage coded as bytes: always moved), ``src_off`` (raw bytes in ``out``), ``comp_off`` (coded
    bytes in ``comp``). A chunk is *coded* if the coder took it, succeeded and beat ``limit``; a
    coded or first chunk is copied (its coded or raw bytes) to the next 16-byte slot from ``c0`` on
    in ``out``, in chunk order; any other chunk stays raw where it lies. Returns a ``(4, n)`` int64
    device tensor: coded (0/1), stored length, offset in ``out``, coder failure (0/1). ``max_len``:
    the longest chunk; ``words``: every ``src_off``, ``comp_off``, ``c0`` and both buffers 16-byte
    aligned, both buffers' sizes multiples of 16, and every source readable up to its next 16-byte
    boundary (16-byte copies)."""
    n = cols["length"].numel()
    if not n:
        return torch.empty((4, 0), dtype=torch.int64, device=out.device)
    res = torch.empty(4 * n, dtype=torch.int64, device=out.device)
    _choose_chunks_kernel[(1,)](cols["gate"], cols["size"], cols["status"], cols["length"], cols["limit"], cols["first"],
                                cols["src_off"], res, n, c0, BLOCK=1024, num_warps=4)
    block, iters, warps = _compact_config() if words else (_COPY_BLOCK, 1, 4)
    units = -(-max_len // 16) * 2 if words else max_len
    grid = (n, max(1, triton.cdiv(units, block * iters)))
    if words:
        ob, cb = out.view(torch.int64), comp.view(torch.int64)
    else:
        ob, cb = out, comp
    _gather_chosen_kernel[grid](res, cols["first"], cols["src_off"], cols["comp_off"], n, ob, cb, WORDS=words,
                                BLOCK=block, ITERS=iters, num_warps=warps)
    return res.view(4, n)

"""Triton kernels of the GPU backend besides the plane transform: a batched gather-copy and fold64.

* :func:`gather_copy` copies many byte ranges between two buffers in one launch (the chunk table
  lives on the device), so assembling the compact output of thousands of chunks, or placing decoded
  chunks into their planes, costs one launch instead of one per chunk.
* :func:`fold64_into` accumulates the ``fold64`` checksum (defined in :mod:`s4w_core.checksum`)
  of a storage into an int64 slot of a device tensor with atomics: many storages, one read-back.
  The torch definition in :mod:`s4w_core.checksum` is the oracle; the parity tests check every
  length class (``nbytes % 4``) against it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["gather_copy", "fold64_into", "fold64_finish", "fold64", "fold64_batched"]

_COPY_BLOCK = 8192
_FOLD_BLOCK = 2048  # words per program
_KLEN = 0x94D049BB133111EB


@triton.jit
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


@triton.jit
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
    src_off: list[int],
    dst_off: list[int],
    lengths: list[int],
    pad_ok: bool = False,
) -> None:
    """``dst[dst_off[i] : +lengths[i]] = src[src_off[i] : +lengths[i]]`` for every ``i``, one launch.

    ``src``/``dst``: 1-D uint8 tensors on one device. Ranges must lie inside the buffers (checked
    here, on the host, from the lists). Enqueued on the current stream.
    ``pad_ok``: the caller guarantees that each destination range may be written up to its next
    16-byte boundary (slot padding nobody reads) and no two rounded ranges overlap; with every
    offset 16-byte aligned the copy then moves whole 16-byte granules (about 10x faster).
    """
    if not lengths:
        return
    if (
        max(o + n for o, n in zip(src_off, lengths)) > src.numel()
        or max(o + n for o, n in zip(dst_off, lengths)) > dst.numel()
        or min(src_off) < 0
        or min(dst_off) < 0
    ):
        raise ValueError("gather_copy: a range lies outside its buffer")
    aligned = (
        all(o % 16 == 0 for o in src_off)
        and all(o % 16 == 0 for o in dst_off)
        and src.data_ptr() % 16 == 0
        and dst.data_ptr() % 16 == 0
    )
    words = (
        pad_ok
        and aligned
        and src.numel() % 16 == 0
        and dst.numel() % 16 == 0
        and max(o + -(-n // 16) * 16 for o, n in zip(src_off, lengths)) <= src.numel()
        and max(o + -(-n // 16) * 16 for o, n in zip(dst_off, lengths)) <= dst.numel()
    )
    if words:
        table = torch.tensor(
            [[o // 8 for o in src_off], [o // 8 for o in dst_off], [-(-n // 16) * 2 for n in lengths]], dtype=torch.int64
        )
        block = int(os.environ.get("S4W_GATHER_WORDS", "8192"))
        iters = int(os.environ.get("S4W_GATHER_ITERS", "2"))
    else:
        table = torch.tensor([src_off, dst_off, lengths], dtype=torch.int64)
        block = _COPY_BLOCK
    if src.device.type == "cuda":
        table = table.pin_memory().to(src.device, non_blocking=True)
    if words:
        grid = (len(lengths), triton.cdiv(max(int(max(lengths)), 1), 8 * block * iters))
        _gather_words_kernel[grid](
            src.view(torch.int64), dst.view(torch.int64), table[0], table[1], table[2], BLOCK=block, ITERS=iters,
            num_warps=int(os.environ.get("S4W_GATHER_WARPS", "16")),
        )
    else:
        grid = (len(lengths), triton.cdiv(max(int(max(lengths)), 1), _COPY_BLOCK))
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


@triton.jit
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
    words, and the rest). A small item table goes to the device in one copy; the program-to-item
    map is built there, so no host work grows with the bytes checked."""
    for words in (True, False):
        rows: list[list[int]] = []
        counts: list[int] = []
        first = 0
        for x, slot in items:
            n = x.numel()
            if n == 0 or (n % 4 == 0 and x.data_ptr() % 4 == 0) != words:
                continue
            nb = -(-((n + 3) // 4) // _FOLD_BLOCK)
            rows.append([x.data_ptr(), n, slot, first])
            counts.append(nb)
            first += nb
        if not rows:
            continue
        table = torch.tensor(rows, dtype=torch.int64).view(-1)
        nbs = torch.tensor(counts, dtype=torch.int64)
        if acc.device.type == "cuda":
            both = torch.cat([table, nbs]).pin_memory().to(acc.device, non_blocking=True)
            table, nbs = both[: table.numel()], both[table.numel() :]
        prog_map = torch.repeat_interleave(
            torch.arange(len(rows), dtype=torch.int32, device=acc.device), nbs, output_size=first
        )
        _fold64_batched_kernel[(first,)](table, prog_map, acc, WORDS=words, BLOCK=_FOLD_BLOCK, num_warps=4)

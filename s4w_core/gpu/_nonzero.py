"""The nonzero transforms (``nz-planes-rotl1``, docs/FORMAT.md 4.5c) on the GPU: the writer's choice
and coding of a storage, and the reader's decode of any ``nz-`` storage (GPU- or CPU-written).

Writer, per storage the GPU codes: on a sample (the ranges of
:func:`s4w_core.choice.delta_sample_ranges`), the order-0 entropy of the planes of every element
against that of the bitmap plus the planes of the nonzero elements; the nonzero variant is used
where the sample holds at least :data:`~s4w_core.choice.NZ_MIN_ZERO_FRAC` zero elements and the
estimate saves :data:`~s4w_core.choice.NZ_MIN_GAIN`. The GPU's coders are order-0 (nvCOMP ANS,
Deflate entropy-only), so the estimate is what they get: the zero rows of Adam moments (untouched
embedding rows) and the unchanged elements of a delta then cost a bitmap bit each. Every candidate's
estimate is computed in one histogram per group of samples (:func:`nz_estimates`). The storages are
split on the device a group at a time (:func:`encode_nonzero_many`), their chunks (per segment: the
bitmap, then the ``w`` planes of its ``nnz`` elements) coded in one nvCOMP call per group, each kept
coded only if smaller, read back once per group.

Reader: every chunk's xxh3 checked on the host before any decoder sees it; chunks of the GPU's
codecs decoded in one nvCOMP call, the others (``raw``, ``zstd``, and ``deflate`` where the GPU does
not inflate) on the host; the bitmaps' counts and padding and the planes' nonzero elements checked
on the device (one read-back) before the merge; the delta undone; the raw checksum checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from s4w_core import checksum as ck
from s4w_core import choice, delta
from s4w_core.codecs import DEFLATE, NVCOMP_ANS, RAW, get_codec
from s4w_core.engine import nonzero_chunk_lengths
from s4w_core.errors import ChecksumMismatchError, DecodeError
from s4w_core.format.container import ContainerReader
from s4w_core.format.manifest import NZ_TRANSFORMS, ROTL1
from s4w_core.gpu import _nvcomp
from s4w_core.gpu._samples import bounded_groups, gather_samples, runs_of
from s4w_core.jobs import dtype_from_name
from s4w_core.planes import nonzero as nzt
from s4w_core.workers import segments

__all__ = ["NZ_MIN_ELEMS", "NZ_TRANSFORM", "check_and_merge", "code_parts_device", "decode_nonzero_device",
           "decode_on_device", "fetch_chunks_device", "encode_nonzero_many",
           "nonzero_choices_device", "nz_estimates",
           "plane_bytes", "residual_words"]

#: storages of fewer elements keep their plane transform (the choice costs a read-back)
NZ_MIN_ELEMS = 1 << 16
#: the nonzero transform the GPU writer writes
NZ_TRANSFORM = next(k for k, v in NZ_TRANSFORMS.items() if v == ROTL1)
_ITYPE = {2: torch.int16, 4: torch.int32}
_POPCOUNT: dict[torch.device, torch.Tensor] = {}


def _round(x: int, a: int) -> int:
    return -(-x // a) * a


def residual_words(raw: torch.Tensor, base: torch.Tensor | None, op: str | None, dtype: torch.dtype) -> torch.Tensor:
    """The elements to code as int16/int32 words (the residual under ``op`` where there is a base)."""
    if raw.numel() == 0:
        return torch.empty(0, dtype=_ITYPE[dtype.itemsize], device=raw.device)
    r = raw if base is None or op is None else delta.forward(op, raw, base, dtype)
    return r.view(_ITYPE[dtype.itemsize])


def plane_bytes(words: torch.Tensor, w: int) -> list[torch.Tensor]:
    """The ``planes-rotl1`` planes of ``words`` (plane 0 first), one uint8 tensor each."""
    bits = 8 * w
    r = (words << 1) | ((words >> (bits - 1)) & 1)
    return [((r >> (8 * (w - 1 - j))) & 0xFF).to(torch.uint8) for j in range(w)]


def _cat_padded(xs: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """``xs`` (words on one device) back to back, each padded with zero words to a multiple of 8
    (a whole bitmap byte, as a segment's split pads), and the padding of each."""
    pads = [(-x.numel()) % 8 for x in xs]
    if len(xs) == 1 and not pads[0]:
        return xs[0], pads  # (no copy)
    return torch.cat([t for x, p in zip(xs, pads) for t in ((x, x.new_zeros(p)) if p else (x,))]), pads


#: sample elements gathered and estimated together by :func:`nonzero_choices_device` (bounds its
#: device memory: about 50 bytes per 16-bit element, 80 per 32-bit one); with a ``work`` bound,
#: ``work // _NZ_BYTES_PER_ELEM`` of them
_NZ_GROUP_ELEMS = 1 << 20
_NZ_BYTES_PER_ELEM = 96


def nonzero_choices_device(
    items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype]],
    dev: torch.device,
    *,
    work: int | None = None,
) -> list[bool]:
    """Per storage ``(raw bytes, base, delta op, dtype)``: whether the GPU writer codes it with
    :data:`NZ_TRANSFORM` -- the order-0 estimate on a sample (module docstring). The samples are
    gathered onto the device a group at a time (at most ``_NZ_GROUP_ELEMS`` sample elements, or what
    ``work`` bytes of device memory hold, :func:`~s4w_core.gpu._nvcomp.work_bytes`); per group one
    read-back of the zero counts and, for the storages with zeros enough to be candidates, one of
    the estimates of each run of them."""
    out = [False] * len(items)
    limit = _NZ_GROUP_ELEMS if work is None else max(1 << 16, min(_NZ_GROUP_ELEMS, work // _NZ_BYTES_PER_ELEM))
    picked: list[tuple[int, int, str | None, torch.dtype, torch.Tensor, torch.Tensor | None, list[tuple[int, int]]]] = []
    sizes: list[int] = []
    for i, (raw, base, op, dtype) in enumerate(items):
        w = dtype.itemsize
        n = raw.numel() // w
        if n < NZ_MIN_ELEMS or w not in _ITYPE:
            continue
        ranges = choice.delta_sample_ranges(n)
        with_base = base is not None and op is not None
        picked.append((i, w, op if with_base else None, dtype, raw, base if with_base else None, ranges))
        sizes.append(sum(z - a for a, z in ranges))
    for group in runs_of(picked, sizes, limit):
        gathers: list[tuple[torch.Tensor, list[tuple[int, int]], int]] = []
        for _i, w, _op, _dt, raw, base, ranges in group:
            gathers.append((raw, ranges, w))
            if base is not None:
                gathers.append((base, ranges, w))
        moved = iter(gather_samples(gathers, dev))
        samples: list[tuple[int, torch.Tensor, int]] = []
        for i, w, op, dtype, _raw, base, _ranges in group:
            r = next(moved)
            b = next(moved) if base is not None else None
            samples.append((i, residual_words(r, b, op, dtype), w))
        del moved, gathers
        # the zero counts first (one read-back): the entropy estimates only for the storages with
        # enough zeros to be candidates
        zeros_of = torch.stack([(words == 0).sum() for _, words, _w in samples]).cpu().tolist()
        by_width: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for (i, words, w), zeros in zip(samples, zeros_of):
            if zeros >= choice.NZ_MIN_ZERO_FRAC * words.numel():
                by_width.setdefault(w, []).append((i, words))
        del samples
        for w, cands in by_width.items():
            for run in bounded_groups(cands, limit):
                stats = nz_estimates([wd for _i, wd in run], w).tolist()  # one read-back per run
                for (i, words), (zeros, plain_cost, nz_cost) in zip(run, stats):
                    m = words.numel()
                    out[i] = zeros >= choice.NZ_MIN_ZERO_FRAC * m and nz_cost < (1.0 - choice.NZ_MIN_GAIN) * plain_cost
    return out


def nz_estimates(samples: list[torch.Tensor], w: int) -> torch.Tensor:
    """Per sample (int16/int32 words of width ``w``, on one device), on the host: its zero count,
    the order-0 bits of its ``planes-rotl1`` planes and those of its nonzero split (the bitmap,
    padded to a byte, then the planes of its nonzero elements) -- every sample in one histogram."""
    dev = samples[0].device
    k = len(samples)
    m = torch.tensor([s.numel() for s in samples], dtype=torch.int64)
    # each sample padded to whole bitmap bytes (padding words are zero: bitmap bits 0, as the split pads)
    padded, pads = _cat_padded(samples)
    pad = torch.tensor(pads, dtype=torch.int64)
    valid_len = m + pad
    sid = torch.repeat_interleave(
        torch.arange(k, dtype=torch.int32, device=dev), valid_len.to(dev), output_size=int(valid_len.sum())
    )
    bitmap, nz_planes = nzt.split_nonzero_torch(padded, w, rot=True)  # every sample's, as a segment's
    nz_sid = sid[padded != 0]
    bsid = sid.view(-1, 8)[:, 0]
    slots = 2 * w + 1  # w planes, the bitmap, w planes of the nonzero elements (int32 keys: k * slots * 256 < 2**31)
    planes = plane_bytes(padded, w)
    keys = [(sid * slots + j) * 256 + planes[j] for j in range(w)]  # the padding counted too: taken off below
    keys.append((bsid * slots + w) * 256 + bitmap)
    keys += [(nz_sid * slots + w + 1 + j) * 256 + nz_planes[j] for j in range(w)]
    hist = torch.bincount(torch.cat(keys), minlength=k * slots * 256).view(k, slots, 256)
    hist[:, :w, 0] -= pad.to(dev)[:, None]  # a padding word's plane bytes are 0
    hist = hist.to(torch.float64)
    nnz = torch.bincount(nz_sid, minlength=k)
    sizes = torch.empty((k, slots), dtype=torch.float64, device=dev)
    md = m.to(dev, torch.float64)
    sizes[:, :w] = md[:, None]
    sizes[:, w] = (valid_len // 8).to(dev, torch.float64)
    sizes[:, w + 1 :] = nnz.to(torch.float64)[:, None]
    p = hist / sizes.clamp_min(1.0)[:, :, None]
    h = -(p * torch.log2(torch.where(p > 0, p, torch.ones_like(p)))).sum(2)
    bits = torch.where(sizes > 0, h.clamp_min(1e-3) * sizes, torch.zeros_like(sizes))
    return torch.stack([md - nnz.to(torch.float64), bits[:, :w].sum(1), bits[:, w:].sum(1)], 1).cpu()


def encode_nonzero_many(
    items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype]],
    seg: int,
    algorithm: str,
    codec_id: str,
    opts: dict[str, Any],
    dev: torch.device,
) -> tuple[list[list[int]], list[tuple[list[str], list[memoryview]]], torch.Tensor]:
    """Code storages ``(raw bytes on dev, base, delta op, dtype)`` with :data:`NZ_TRANSFORM` in
    segments of ``seg`` elements, all their chunks in one nvCOMP call and one read-back (a storage
    at a time, a re-encoding's hundreds of sparse residuals cost a call and a synchronization
    each): per storage the ``nnz`` of each segment and per chunk, in manifest order (per segment
    the bitmap, then the ``w`` planes of its nonzero elements), its codec id and bytes (views into
    the returned pinned host buffer, which must outlive them). A chunk is coded (``algorithm`` with
    ``opts``, written as ``codec_id``) only where that is smaller.

    With ``seg`` a multiple of 8 (every profile's) the storages of one width are split together:
    one compaction and one count per segment for all of them, each segment's bitmap a slice of
    the group's (a storage padded to a whole byte, as a segment's bitmap is); else segment by
    segment (:func:`~s4w_core.planes.nonzero.split_nonzero_torch`)."""
    words = [residual_words(raw, None if base is None else _nvcomp.to_device(base, dev), op, dtype) for raw, base, op, dtype in items]
    per: list[list[tuple[torch.Tensor, list[torch.Tensor], int]]] = [[] for _ in items]  # (bitmap, planes, nnz) per segment
    if seg % 8:
        for k, ((_raw, _b, _op, dtype), wd) in enumerate(zip(items, words)):
            for s0, s1 in segments(wd.numel(), seg):
                bitmap, planes = nzt.split_nonzero_torch(wd[s0:s1], dtype.itemsize, rot=True)
                per[k].append((bitmap, list(planes), int(planes.shape[1])))
    else:
        by_width: dict[int, list[int]] = {}
        for k, (_raw, _b, _op, dtype) in enumerate(items):
            by_width.setdefault(dtype.itemsize, []).append(k)
        for w, ks in by_width.items():
            for k, segs in zip(ks, _split_many([words[k] for k in ks], w, seg)):
                per[k] = segs
    parts: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    for segs in per:
        start = len(parts)
        for bm, pls, _nnz in segs:
            parts.append(bm)
            parts.extend(pls)
        spans.append((start, len(parts) - start))
    ids, views, host = code_parts_device(parts, algorithm, codec_id, opts, dev)
    return [[nnz for _b, _p, nnz in segs] for segs in per], [(ids[a : a + m], views[a : a + m]) for a, m in spans], host


def _split_many(words: list[torch.Tensor], w: int, seg: int) -> list[list[tuple[torch.Tensor, list[torch.Tensor], int]]]:
    """The nonzero split (:func:`~s4w_core.planes.nonzero.split_nonzero_torch`, rotated) of every
    segment of ``seg`` elements (a multiple of 8) of each of ``words`` (int16/int32 tensors of
    width ``w`` on one device): per storage, per segment, ``(bitmap, planes, nnz)`` -- views into
    the group's bitmap and planes, the same bytes as a segment split alone."""
    dev = words[0].device
    lens = [x.numel() for x in words]
    flat, pads = _cat_padded(words)
    bitmap, split = nzt.split_nonzero_torch(flat, w, rot=True)  # the group's, as one segment's
    del flat
    planes = list(split)
    # the elements before each segment's end, from the bitmap bytes' counts: one read-back for all
    seg_ends: list[int] = []  # bitmap byte index of each segment's end, group-wide
    at = 0
    for n, p in zip(lens, pads):
        seg_ends.extend((at + min(n, s + seg) + 7) // 8 for s in range(0, n, seg))
        at += n + p
    ends: list[int] = []
    if seg_ends:
        counts = torch.cumsum(_popcount_table(dev)[bitmap.to(torch.int64)], 0)
        ends = counts[torch.tensor([e - 1 for e in seg_ends], dtype=torch.int64).to(dev)].cpu().tolist()
    out: list[list[tuple[torch.Tensor, list[torch.Tensor], int]]] = []
    at, i, prev_end, prev_byte = 0, 0, 0, 0
    for n, p in zip(lens, pads):
        segs: list[tuple[torch.Tensor, list[torch.Tensor], int]] = []
        for _s in range(0, n, seg):
            e, b = ends[i], seg_ends[i]
            segs.append((bitmap[prev_byte:b], [pl[prev_end:e] for pl in planes], e - prev_end))
            prev_end, prev_byte = e, b
            i += 1
        out.append(segs)
        at += n + p
        prev_byte = at // 8  # the padding words' bytes belong to the storage's last segment
    return out


def code_parts_device(
    parts: list[torch.Tensor], algorithm: str, codec_id: str, opts: dict[str, Any], dev: torch.device
) -> tuple[list[str], list[memoryview], torch.Tensor]:
    """Code the uint8 tensors ``parts`` (on ``dev``; one chunk each) in one nvCOMP call: per chunk
    its codec id (``codec_id``, coded by ``algorithm`` with ``opts``, where that is smaller; else
    ``raw``) and its bytes, views into the returned pinned host buffer (which must outlive them)."""
    lengths = np.array([p.numel() for p in parts], dtype=np.int64)
    slots = (lengths + _nvcomp.ALIGN - 1) // _nvcomp.ALIGN * _nvcomp.ALIGN
    src_off = np.cumsum(slots) - slots
    src = torch.empty(max(int(slots.sum()), 1), dtype=torch.uint8, device=dev)
    _cat_into(src, parts, (slots - lengths).tolist())
    todo = np.nonzero(lengths > 0)[0]
    coded = np.zeros(len(parts), dtype=bool)
    sizes = np.zeros(len(parts), dtype=np.int64)
    comp = src
    comp_off = np.zeros(len(parts), dtype=np.int64)
    if len(todo):
        # a coder call per size class, each chunk's slot sized for its class
        calls, comp_off, total = _nvcomp.class_slots(algorithm, dev, lengths, todo, **opts)
        comp = torch.empty(total, dtype=torch.uint8, device=dev)
        for idx, coder, cap, _longest in calls:
            got = _nvcomp.encode_batch(coder, src, src_off[idx], lengths[idx], comp, comp_off[idx],
                                       np.full(len(idx), cap, dtype=np.int64))
            sizes[idx] = np.asarray(list(got), dtype=np.int64)
        coded[todo] = (sizes[todo] > 0) & (sizes[todo] < lengths[todo])
    out_len = np.where(coded, sizes, lengths)
    host_off = np.cumsum(out_len) - out_len
    host = _nvcomp.host_empty(max(int(out_len.sum()), 1))
    # every chunk's bytes (coded, or its part) back to back on the device, then one copy to the host
    outs = [
        comp[int(comp_off[i]) : int(comp_off[i]) + int(out_len[i])] if coded[i] else parts[i]
        for i in range(len(parts))
        if out_len[i]
    ]
    if outs:
        packed = torch.empty(int(out_len.sum()), dtype=torch.uint8, device=dev)
        _cat_into(packed, outs)
        host[: packed.numel()].copy_(packed, non_blocking=True)
    _nvcomp.synchronize(dev)
    mv = memoryview(host.numpy())
    views = [mv[int(host_off[i]) : int(host_off[i] + out_len[i])] for i in range(len(parts))]
    ids = [codec_id if c else RAW.id for c in coded.tolist()]
    return ids, views, host


def _cat_into(out: torch.Tensor, parts: list[torch.Tensor], gaps: list[int] | None = None) -> None:
    """``parts`` (uint8, on ``out``'s device) written back to back into ``out``, each followed by
    ``gaps[k]`` zero bytes: one batched copy kernel per many parts instead of a copy each (a group's
    thousands of chunks)."""
    seq: list[torch.Tensor] = []
    if gaps is None:
        seq = list(parts)
    else:
        pad = out.new_zeros(max(gaps, default=0))
        for p, g in zip(parts, gaps):
            seq.append(p)
            if g:
                seq.append(pad[:g])
    n = sum(t.numel() for t in seq)
    if n:
        torch.cat(seq, out=out[:n])


def _popcount_table(dev: torch.device) -> torch.Tensor:
    t = _POPCOUNT.get(dev)
    if t is None:
        v = torch.arange(256, dtype=torch.int64)
        c = torch.zeros(256, dtype=torch.int64)
        for k in range(8):
            c += (v >> k) & 1
        t = _POPCOUNT[dev] = c.to(dev)
    return t


#: nvCOMP decoder per codec id: (algorithm, options)
_GPU_CODECS: dict[str, tuple[str, dict[str, Any]]] = {
    NVCOMP_ANS.id: ("ANS", {"data_type": "|u1"}),
    DEFLATE.id: ("Deflate", {}),
}


def decode_nonzero_device(
    reader: ContainerReader,
    entry: dict[str, Any],
    dev: torch.device,
    base: torch.Tensor | None,
    inflate: bool = True,
) -> torch.Tensor:
    """Decode one (validated) ``nz-`` storage entry to a 1-D uint8 tensor on ``dev``, verifying every
    checksum (module docstring). ``base``: its delta base on ``dev`` (None for a plain entry);
    ``inflate``: deflate chunks are decoded by nvCOMP (else on the host). Raises
    ChecksumMismatchError or DecodeError naming the tensor."""
    name = reader.name
    w = entry["_width"]
    nbytes = entry["nbytes"]
    n = nbytes // w
    seg = entry["segment_elems"]
    dtype = dtype_from_name(entry["dtype"])
    rot = NZ_TRANSFORMS[entry["transform"]] == ROTL1
    lens = np.asarray(nonzero_chunk_lengths(entry), dtype=np.int64)
    where = f"{name}: tensor {entry['path']!r}"
    out = torch.empty(nbytes, dtype=torch.uint8, device=dev)  # on the caller's stream: it outlives ours
    with _nvcomp.on_stream(dev):
        dec_dev, dst_off = fetch_chunks_device(reader, entry, lens, dev, inflate, where)
        check_and_merge(dec_dev, lens, dst_off, entry["nnz"], n, seg, w, rot, out, where)
        if base is not None:
            op = (entry.get("delta") or {}).get("op", "xor")
            if op not in delta.ops_for(dtype, NZ_TRANSFORMS[entry["transform"]]):
                raise DecodeError(f"{where}: delta op {op!r} does not apply")
            out.copy_(delta.inverse(op, out, base, dtype))
        _nvcomp.synchronize(dev)
    algo = entry["checksum"].split(":", 1)[0]
    if ck.compute_checksum(algo, out) != entry["checksum"]:
        raise ChecksumMismatchError(
            f"{where} decoded to bytes that do not match its recorded checksum {entry['checksum']}"
            + (" (is the delta base the right one?)" if base is not None else "")
        )
    return out


def fetch_chunks_device(
    reader: ContainerReader, entry: dict[str, Any], lens: np.ndarray, dev: torch.device, inflate: bool, where: str
) -> tuple[torch.Tensor, np.ndarray]:
    """Every chunk of the (validated) storage ``entry`` decoded into one uint8 buffer on ``dev``
    (called within ``_nvcomp.on_stream(dev)``): chunk ``i`` (``lens[i]`` decoded bytes) at
    ``dst_off[i]`` (16-byte aligned); returns ``(buffer, dst_off)``. Each chunk's xxh3 is checked
    on the host before any decoder sees it; the GPU's codecs decode on the device in one nvCOMP call
    per codec (deflate only where ``inflate``), the others on the host."""
    chunks = entry["chunks"]
    dst_slot = (lens + _nvcomp.ALIGN - 1) // _nvcomp.ALIGN * _nvcomp.ALIGN
    dst_off = np.cumsum(dst_slot) - dst_slot
    hostdec = _nvcomp.host_empty(max(int(dst_slot.sum()), 1))
    hd = hostdec.numpy()
    gpu: dict[str, list[tuple[int, Any]]] = {}
    for i, (cid, off, length, h) in enumerate(chunks):
        reader.check_range(off, length)
        data = reader.read_chunk(off, length)
        if ck.xxh3_hex(data) != h:
            raise ChecksumMismatchError(
                f"{where}: chunk {i} (bytes {off}..{off + length}) is corrupt: checksum mismatch "
                "(found before any GPU decoder saw it)"
            )
        if cid in _GPU_CODECS and (cid != DEFLATE.id or inflate):
            gpu.setdefault(cid, []).append((i, data))
            continue
        try:
            dec = get_codec(cid).decode(data, int(lens[i]))
        except DecodeError as e:
            raise DecodeError(f"{where}: chunk {i} ({cid}): {e}") from e
        hd[int(dst_off[i]) : int(dst_off[i] + lens[i])] = np.frombuffer(dec, dtype=np.uint8)
    dec_dev = hostdec.to(dev, non_blocking=True) if dev.type == "cuda" else hostdec.clone()
    for cid, items in gpu.items():
        decode_on_device(cid, items, lens, dst_off, dec_dev, dev, where)
    return dec_dev, dst_off


def decode_on_device(
    cid: str,
    items: list[tuple[int, Any]],
    lens: np.ndarray,
    dst_off: np.ndarray,
    dec: torch.Tensor,
    dev: torch.device,
    where: str,
) -> None:
    """Decode the chunks ``items`` (index, stored bytes) of codec ``cid`` with one nvCOMP call into
    their slots of ``dec``; DecodeError if nvCOMP fails or yields another length."""
    idx = np.array([i for i, _d in items], dtype=np.int64)
    stored = np.array([len(d) for _i, d in items], dtype=np.int64)
    slots = (stored + _nvcomp.ALIGN - 1) // _nvcomp.ALIGN * _nvcomp.ALIGN
    src_off = np.cumsum(slots) - slots
    host = _nvcomp.host_empty(max(int(slots.sum()), 1))
    hv = host.numpy()
    for (_i, d), o in zip(items, src_off.tolist()):
        hv[o : o + len(d)] = np.frombuffer(d, dtype=np.uint8)
    staged = host.to(dev, non_blocking=True) if dev.type == "cuda" else host
    algorithm, opts = _GPU_CODECS[cid]
    raw = lens[idx]
    nonempty = raw > 0
    if not nonempty.all():  # an empty chunk is stored raw by every writer: a coded one is forged
        raise DecodeError(f"{where}: a {cid} chunk decodes to 0 bytes")
    c = _nvcomp.codec(algorithm, dev, _round(int(raw.max()), 1 << 16), **opts)
    try:
        got = _nvcomp.decode_batch(c, staged, src_off, stored, dec, dst_off[idx], raw)
        sizes = np.asarray(list(got), dtype=np.int64)
    except (RuntimeError, ValueError) as e:
        raise DecodeError(f"{where}: nvCOMP {algorithm} failed to decode a chunk whose checksum matched: {e}") from e
    bad = np.nonzero(sizes != raw)[0]
    if len(bad):
        raise DecodeError(
            f"{where}: nvCOMP {algorithm} decoded chunk {int(idx[bad[0]])} to {int(sizes[bad[0]])} bytes, "
            f"expected {int(raw[bad[0]])}"
        )


def check_and_merge(
    dec: torch.Tensor,
    lens: np.ndarray,
    dst_off: np.ndarray,
    nnz: list[int],
    n: int,
    seg: int,
    w: int,
    rot: bool,
    out: torch.Tensor,
    where: str,
) -> None:
    """Check every segment's bitmap (set bits = ``nnz``, padding bits zero) and planes (no nonzero
    element decodes to zero) on the device, one read-back; then merge each segment into ``out``."""
    pop = _popcount_table(dec.device)
    segs = list(segments(n, seg))
    stats: list[torch.Tensor] = []
    views: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k, (s0, s1) in enumerate(segs):
        c = k * (w + 1)
        m = s1 - s0
        bm = dec[int(dst_off[c]) : int(dst_off[c] + lens[c])]
        pl = torch.stack([dec[int(dst_off[c + 1 + j]) : int(dst_off[c + 1 + j]) + nnz[k]] for j in range(w)])
        views.append((bm, pl))
        count = pop[bm.to(torch.int64)].sum() if bm.numel() else torch.zeros((), dtype=torch.int64, device=dec.device)
        pad = (bm[-1].to(torch.int64) >> (m % 8)) if m % 8 and bm.numel() else torch.zeros((), dtype=torch.int64,
                                                                                       device=dec.device)
        zero = (pl == 0).all(0).sum() if nnz[k] else torch.zeros((), dtype=torch.int64, device=dec.device)
        stats.append(torch.stack([count, pad, zero.to(torch.int64)]))
    got = torch.stack(stats).cpu().numpy() if stats else np.zeros((0, 3), dtype=np.int64)
    for k in range(len(segs)):
        if int(got[k, 0]) != nnz[k]:
            raise DecodeError(f"{where} segment {k}: bitmap marks {int(got[k, 0])} nonzero elements, planes hold {nnz[k]}")
        if got[k, 1]:
            raise DecodeError(f"{where} segment {k}: bitmap padding bits are not zero")
        if got[k, 2]:
            raise DecodeError(f"{where} segment {k}: a nonzero element decodes to zero")
    for (s0, s1), (bm, pl) in zip(segs, views):
        words = nzt.merge_nonzero_torch(bm, pl, s1 - s0, w, rot=rot)
        out[s0 * w : s1 * w].copy_(words.view(torch.uint8))

"""The nonzero transforms (``nz-planes-rotl1``, docs/FORMAT.md 4.5c) on the GPU: the writer's choice
and coding of a storage, and the reader's decode of any ``nz-`` storage (GPU- or CPU-written).

Writer, per storage the GPU codes: on a sample (the ranges of
:func:`s4w_core.choice.delta_sample_ranges`), the order-0 entropy of the planes of every element
against that of the bitmap plus the planes of the nonzero elements; the nonzero variant is used
where the sample holds at least :data:`~s4w_core.choice.NZ_MIN_ZERO_FRAC` zero elements and the
estimate saves :data:`~s4w_core.choice.NZ_MIN_GAIN`. The GPU's coders are order-0 (nvCOMP ANS,
Deflate entropy-only), so the estimate is what they get: the zero rows of Adam moments (untouched
embedding rows) and the unchanged elements of a delta then cost a bitmap bit each. The storage is
split on the device (:func:`~s4w_core.planes.nonzero.split_nonzero_torch`), its chunks (per
segment: the bitmap, then the ``w`` planes of its ``nnz`` elements) coded in one nvCOMP call,
each kept coded only if smaller, read back once.

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
from s4w_core.jobs import dtype_from_name
from s4w_core.planes import nonzero as nzt
from s4w_core.workers import segments

__all__ = ["NZ_MIN_ELEMS", "NZ_TRANSFORM", "check_and_merge", "code_parts_device", "decode_nonzero_device",
           "decode_on_device", "fetch_chunks_device", "encode_nonzero_device", "nonzero_choices_device",
           "nonzero_pays_device", "plane_bytes", "residual_words"]

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


def _bits_each(xs: list[torch.Tensor]) -> torch.Tensor:
    """Order-0 entropy times length of each uint8 tensor of ``xs``: its order-0 cost in bits
    (float64, one per tensor, at least 1e-3 bits a byte), from one histogram for all of them."""
    dev = xs[0].device
    sizes = torch.tensor([x.numel() for x in xs], dtype=torch.float64, device=dev)
    keys = torch.cat([x.to(torch.int32) + 256 * g for g, x in enumerate(xs)])
    hist = torch.bincount(keys, minlength=256 * len(xs)).view(len(xs), 256).to(torch.float64)
    p = hist / sizes.clamp_min(1.0)[:, None]
    h = -(p * torch.log2(torch.where(p > 0, p, torch.ones_like(p)))).sum(1)
    return torch.where(sizes > 0, h.clamp_min(1e-3) * sizes, torch.zeros_like(sizes))


def _sample_on(t: torch.Tensor, ranges: list[tuple[int, int]], w: int, dev: torch.device) -> torch.Tensor:
    """The elements ``ranges`` of the byte tensor ``t`` (element width ``w``), concatenated on
    ``dev``: gathered where ``t`` lives, then moved in one copy (a host copy's sample is many
    small ranges; one transfer each would cost more than the estimate)."""
    s = torch.cat([t[a * w : z * w] for a, z in ranges])
    return s if s.device == dev else s.to(dev)


def nonzero_choices_device(
    items: list[tuple[torch.Tensor, torch.Tensor | None, str | None, torch.dtype]], dev: torch.device
) -> list[bool]:
    """Per storage ``(raw bytes, base, delta op, dtype)``: whether the GPU writer codes it with
    :data:`NZ_TRANSFORM` -- the order-0 estimate on a sample (module docstring), every storage's
    estimate on the device and one read-back for all of them."""
    out = [False] * len(items)
    samples: list[tuple[int, torch.Tensor, int]] = []
    for i, (raw, base, op, dtype) in enumerate(items):
        w = dtype.itemsize
        n = raw.numel() // w
        if n < NZ_MIN_ELEMS or w not in _ITYPE:
            continue
        ranges = choice.delta_sample_ranges(n)
        r = _sample_on(raw, ranges, w, dev)
        b = None if base is None or op is None else _sample_on(base, ranges, w, dev)
        samples.append((i, residual_words(r, b, op, dtype), w))
    if not samples:
        return out
    # the zero count first, for every sample at once (one read-back): the entropy estimates (about
    # twenty small kernels per storage) only for the storages with enough zeros to be candidates
    zeros_of = torch.stack([(words == 0).sum() for _, words, _w in samples]).cpu().tolist()
    stats: list[torch.Tensor] = []
    idx: list[int] = []
    sizes: list[int] = []
    for (i, words, w), zeros in zip(samples, zeros_of):
        if zeros < choice.NZ_MIN_ZERO_FRAC * words.numel():
            continue
        bitmap, planes = nzt.split_nonzero_torch(words, w, rot=True)
        costs = _bits_each(plane_bytes(words, w) + [bitmap] + [planes[j] for j in range(w)])
        plain, nz = costs[:w].sum(), costs[w:].sum()
        nonzero = (words != 0).sum().to(torch.float64)
        stats.append(torch.stack([words.numel() - nonzero, plain, nz]))
        idx.append(i)
        sizes.append(words.numel())
    if stats:
        for i, m, (zeros, plain_cost, nz_cost) in zip(idx, sizes, torch.stack(stats).cpu().tolist()):
            out[i] = zeros >= choice.NZ_MIN_ZERO_FRAC * m and nz_cost < (1.0 - choice.NZ_MIN_GAIN) * plain_cost
    return out


def nonzero_pays_device(
    raw: torch.Tensor, base: torch.Tensor | None, op: str | None, dtype: torch.dtype, dev: torch.device
) -> bool:
    """:func:`nonzero_choices_device` for one storage."""
    return nonzero_choices_device([(raw, base, op, dtype)], dev)[0]


def encode_nonzero_device(
    raw: torch.Tensor,
    base: torch.Tensor | None,
    op: str | None,
    dtype: torch.dtype,
    seg: int,
    algorithm: str,
    codec_id: str,
    opts: dict[str, Any],
    dev: torch.device,
) -> tuple[list[int], list[str], list[memoryview], torch.Tensor]:
    """Code the storage bytes ``raw`` (on ``dev``) with :data:`NZ_TRANSFORM` in segments of ``seg``
    elements: returns the ``nnz`` of each segment, then per chunk in manifest order its codec id
    and its bytes (views into the returned pinned host buffer, which must outlive them). A chunk is
    coded (``algorithm`` with ``opts``, written as ``codec_id``) only where that is smaller."""
    w = dtype.itemsize
    n = raw.numel() // w
    words = residual_words(raw, None if base is None else base.to(dev), op, dtype)
    parts: list[torch.Tensor] = []
    nnz: list[int] = []
    for s0, s1 in segments(n, seg):
        bitmap, planes = nzt.split_nonzero_torch(words[s0:s1], w, rot=True)
        nnz.append(int(planes.shape[1]))
        parts.append(bitmap)
        parts.extend(planes[j] for j in range(w))
    ids, views, host = code_parts_device(parts, algorithm, codec_id, opts, dev)
    return nnz, ids, views, host


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
    for p, o, ln in zip(parts, src_off.tolist(), lengths.tolist()):
        src[o : o + ln].copy_(p)
    todo = np.nonzero(lengths > 0)[0]
    coded = np.zeros(len(parts), dtype=bool)
    sizes = np.zeros(len(parts), dtype=np.int64)
    comp = src
    comp_off = np.zeros(len(parts), dtype=np.int64)
    if len(todo):
        maxlen = int(lengths.max())
        coder = _nvcomp.codec(algorithm, dev, _round(maxlen, 1 << 16), **opts)
        cap = _nvcomp.max_compressed(coder, maxlen, dev)
        comp = torch.empty(cap * len(todo), dtype=torch.uint8, device=dev)
        comp_off[todo] = np.arange(len(todo), dtype=np.int64) * cap
        got = _nvcomp.encode_batch(coder, src, src_off[todo], lengths[todo], comp, comp_off[todo],
                                   np.full(len(todo), cap, dtype=np.int64))
        sizes[todo] = np.asarray(list(got), dtype=np.int64)
        coded[todo] = (sizes[todo] > 0) & (sizes[todo] < lengths[todo])
    out_len = np.where(coded, sizes, lengths)
    host_off = np.cumsum(out_len) - out_len
    host = _nvcomp.host_empty(max(int(out_len.sum()), 1))
    for i in range(len(parts)):
        if out_len[i]:
            a, z = int(host_off[i]), int(host_off[i] + out_len[i])
            srcb = comp[int(comp_off[i]) : int(comp_off[i]) + int(out_len[i])] if coded[i] else parts[i]
            host[a:z].copy_(srcb, non_blocking=True)
    _nvcomp.synchronize(dev)
    mv = memoryview(host.numpy())
    views = [mv[int(host_off[i]) : int(host_off[i] + out_len[i])] for i in range(len(parts))]
    ids = [codec_id if c else RAW.id for c in coded.tolist()]
    return ids, views, host


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

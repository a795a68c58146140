"""GPU reader: verify on the host, stage, decode in one nvCOMP call per batch, merge planes (Triton).

Order of work for a batch of storage entries:

1. host, thread pool: read every chunk, check its xxh3 against the manifest (a mismatch raises
   :class:`ChecksumMismatchError` before any byte reaches a GPU decoder: FACTS, nvCOMP can crash or
   hang on corrupt input); zstd chunks are decoded right there (and deflate chunks too when
   ``S4W_GPU_INFLATE=0``);
2. pack all chunks into one pinned buffer (16-byte aligned slots), one host-to-device copy;
3. one nvCOMP call per codec (ANS for ``nvcomp-ans``, Deflate for ``deflate``: nvCOMP's inflater
   reads zlib's Huffman-only streams and its own, checked on the device) decodes every chunk
   straight into its place in a planes buffer (``planes[j * plane_stride + s0]``; chunks whose
   place is not 16-byte aligned, which only a writer with an odd ``segment_elems`` produces, go
   through a scratch slot); one gather-copy launch places raw and CPU-decoded chunks;
4. merge planes into each output tensor (the delta op, ``xor`` or ``sub``, undone against the base
   in the same kernel), then check each storage's raw
   checksum: ``fold64`` on the GPU (one read-back for the batch), ``xxh3-64`` on the host.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from s4w_core import checksum as ck
from s4w_core import engine
from s4w_core.codecs import DEFLATE, NVCOMP_ANS, RAW, get_codec
from s4w_core.errors import ChecksumMismatchError, DecodeError
from s4w_core.format.container import ContainerReader
from s4w_core.gpu import _nvcomp
from s4w_core.gpu._encode import TRACE_MARKS, _mark
from s4w_core.gpu.kernels import fold64_batched, fold64_finish, gather_copy
from s4w_core.planes.triton_kernels import merge_planes_batched

__all__ = ["decode_storages", "stage", "decode_device", "Staged"]

_A = _nvcomp.ALIGN


def _round(x: int, a: int) -> int:
    return -(-x // a) * a


def decode_storages(
    reader: ContainerReader,
    entries: list[dict[str, Any]],
    device: torch.device,
    resolve_base: engine.BaseResolver | None,
    pool: ThreadPoolExecutor | None = None,
) -> list[torch.Tensor]:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    own = pool is None
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
    try:
        budget = _nvcomp.batch_bytes(device)
        outs: list[torch.Tensor] = []
        group: list[dict[str, Any]] = []
        size = 0
        for e in entries:
            if group and size + e["nbytes"] > budget:
                outs.extend(_decode_group(reader, group, device, resolve_base, pool))
                group, size = [], 0
            group.append(e)
            size += e["nbytes"]
        if group:
            outs.extend(_decode_group(reader, group, device, resolve_base, pool))
        return outs
    finally:
        if own:
            pool.shutdown(wait=True)


def _fetch(reader: ContainerReader, entry: dict[str, Any], i: int, raw_len: int) -> tuple[str, bytes]:
    """Read chunk ``i``, check its xxh3; CPU codecs are decoded here. Returns (kind, bytes)."""
    codec_id, off, length, h = entry["chunks"][i]
    data = reader.read_chunk(off, length)
    if ck.xxh3_hex(data) != h:
        raise ChecksumMismatchError(
            f"{reader.name}: chunk {i} of tensor {entry['path']!r} (bytes {off}..{off + length}) is corrupt: "
            "checksum mismatch (found before any GPU decoder saw it)"
        )
    if codec_id == NVCOMP_ANS.id:
        return "ans", data
    if codec_id == RAW.id:
        return "copy", data
    if codec_id == DEFLATE.id and _gpu_inflate():
        return "inflate", data
    return "copy", get_codec(codec_id).decode(data, raw_len)


def _gpu_inflate() -> bool:
    """Inflate deflate chunks with nvCOMP (verified on the device to read zlib's and nvCOMP's raw
    deflate streams); ``S4W_GPU_INFLATE=0`` keeps them on the CPU. zstd chunks always decode on
    the CPU: nvCOMP's Zstd decoder can hang on malformed input (FACTS) and an xxh3 match is no
    protection against a deliberately forged file."""
    return os.environ.get("S4W_GPU_INFLATE", "1") != "0"


#: nvCOMP decoder per staged kind: (algorithm, codec options)
_GPU_DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ans": ("ANS", {"data_type": "|u1"}),
    "inflate": ("Deflate", {}),
}


@dataclass
class Staged:
    """A batch of chunks checked and packed on the host, ready for one host-to-device copy."""

    host: torch.Tensor  # pinned uint8
    slot: list[int]  # offset of each chunk in ``host``
    kinds: list[str]  # "ans"/"inflate" (decoded by nvCOMP) or "copy" (raw or CPU-decoded bytes)
    stored: list[int]  # bytes of each chunk in ``host``
    recs: list[tuple[int, int, int, int]]  # (entry, plane, s0, raw_len)


def stage(reader: ContainerReader, entries: list[dict[str, Any]], pool: ThreadPoolExecutor) -> Staged:
    """Read and verify every chunk (host threads), CPU-decode deflate/zstd, pack into pinned memory."""
    recs: list[tuple[int, int, int, int]] = []
    futs = []
    for k, e in enumerate(entries):
        for i, (s0, s1, j) in enumerate(engine.chunk_layout(e)):
            recs.append((k, j, s0, s1 - s0))
            futs.append(pool.submit(_fetch, reader, e, i, s1 - s0))
    fetched = [f.result() for f in futs]  # raises on the first corrupt chunk, before any decoding
    slot: list[int] = []
    pos = 0
    for _kind, data in fetched:
        slot.append(pos)
        pos += _round(len(data), _A)
    host = _nvcomp.host_empty(pos)
    hv = host.numpy()
    for (_kind, data), o in zip(fetched, slot):
        if data:
            hv[o : o + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return Staged(host, slot, [f[0] for f in fetched], [len(f[1]) for f in fetched], recs)


def _decode_group(
    reader: ContainerReader,
    entries: list[dict[str, Any]],
    dev: torch.device,
    resolve_base: engine.BaseResolver | None,
    pool: ThreadPoolExecutor,
) -> list[torch.Tensor]:
    name = reader.name
    # outputs and bases first, on the caller's stream (they outlive our stream's work)
    outs = [torch.empty(e["nbytes"], dtype=torch.uint8, device=dev) for e in entries]
    bases = [engine.resolve_base_bytes(e, resolve_base, name, dev) for e in entries]
    st = stage(reader, entries, pool)
    with _nvcomp.on_stream(dev):
        staged = st.host.to(dev, non_blocking=True)
        sums = decode_device(staged, st, entries, outs, bases, dev, name)
        del staged
    for k, e in enumerate(entries):
        algo = e["checksum"].split(":", 1)[0]
        if algo == "fold64":
            got = f"fold64:{fold64_finish(int(sums[k]), e['nbytes']):016x}"
        else:
            got = ck.compute_checksum(algo, outs[k])
        if got != e["checksum"]:
            raise ChecksumMismatchError(
                f"{name}: tensor {e['path']!r} decoded to bytes that do not match its recorded "
                f"checksum {e['checksum']}" + (" (is the delta base the right one?)" if bases[k] is not None else "")
            )
    return outs


def decode_device(
    staged: torch.Tensor,
    st: Staged,
    entries: list[dict[str, Any]],
    outs: list[torch.Tensor],
    bases: list[torch.Tensor | None],
    dev: torch.device,
    name: str = "<checkpoint>",
) -> list[int]:
    """Device part of decoding (call under ``_nvcomp.on_stream``): chunks already on the device in
    ``staged`` to ``outs``. Returns the fold64 word sums per entry (0 for xxh3 entries); reading
    them back is the one synchronization."""
    TRACE_MARKS.clear()
    _mark("start", dev)
    width = np.array([e["_width"] for e in entries], dtype=np.int64)
    n_el = np.array([e["nbytes"] for e in entries], dtype=np.int64) // width
    ps = (n_el + _A - 1) // _A * _A
    size = (width * ps + 255) // 256 * 256
    region = np.cumsum(size) - size
    planes = torch.empty(max(int(size.sum()), 1), dtype=torch.uint8, device=dev)
    rec = np.asarray(st.recs, dtype=np.int64).reshape(-1, 4)
    k, j, s0, raw_len = rec[:, 0], rec[:, 1], rec[:, 2], rec[:, 3]
    dst = region[k] + j * ps[k] + s0
    slot = np.asarray(st.slot, dtype=np.int64)
    stored = np.asarray(st.stored, dtype=np.int64)
    kinds = np.asarray(st.kinds)
    cp = kinds == "copy"
    gather_copy(staged, planes, slot[cp].tolist(), dst[cp].tolist(), raw_len[cp].tolist(), pad_ok=True)
    _mark("tables+place_raw", dev)
    for kind, (algorithm, opts) in _GPU_DECODERS.items():
        sel = kinds == kind
        if not sel.any():
            continue
        # one nvCOMP call for every chunk of this codec (two if some places are not 16-byte aligned)
        direct = sel & (dst % _A == 0)
        via = sel & (dst % _A != 0)
        _gpu_decode(
            algorithm, opts, dev, staged, planes, slot[direct], stored[direct], dst[direct], raw_len[direct], name
        )
        if via.any():
            rl = raw_len[via]
            sz = (rl + _A - 1) // _A * _A
            soff = np.cumsum(sz) - sz
            scratch = torch.empty(int(sz.sum()), dtype=torch.uint8, device=dev)
            _gpu_decode(algorithm, opts, dev, staged, scratch, slot[via], stored[via], soff, rl, name)
            gather_copy(scratch, planes, soff.tolist(), dst[via].tolist(), rl.tolist())
    _mark("nvcomp_decode", dev)
    # merge (one launch per element width and delta op: the op is undone in the same pass),
    # then raw checksums (one launch)
    by_width: dict[int, list[tuple[torch.Tensor, torch.Tensor | None, int, int, str | None]]] = {}
    folds: list[tuple[torch.Tensor, int]] = []
    for i, e in enumerate(entries):
        off = int(region[i])
        base = bases[i]
        op = (e.get("delta") or {}).get("op", "xor") if base is not None else None
        if e["transform"] == "planes-rotl1":
            by_width.setdefault(int(width[i]), []).append((outs[i], base, off, int(ps[i]), op))
        elif base is None:
            outs[i].copy_(planes[off : off + int(n_el[i])])
        elif op == "xor":
            torch.bitwise_xor(planes[off : off + int(n_el[i])], base, out=outs[i])
        else:
            raise DecodeError(f"{name}: delta op {op!r} does not apply to tensor {e['path']!r} (transform bytes)")
        if e["checksum"].startswith("fold64:"):
            folds.append((outs[i], i))
    for w_, items in by_width.items():
        merge_planes_batched(items, w_, planes)
    _mark("merge", dev)
    acc = torch.zeros(max(1, len(entries)), dtype=torch.int64, device=dev)
    fold64_batched(folds, acc)
    sums = [int(x) for x in acc.cpu().tolist()]
    _mark("fold64+readback", dev)
    return sums


def _gpu_decode(
    algorithm: str,
    opts: dict[str, Any],
    dev: torch.device,
    src: torch.Tensor,
    dst: torch.Tensor,
    src_off: np.ndarray,
    lengths: np.ndarray,
    dst_off: np.ndarray,
    raw: np.ndarray,
    name: str,
) -> None:
    if not len(src_off):
        return
    c = _nvcomp.codec(algorithm, dev, _round(int(raw.max()), 1 << 16), **opts)
    try:
        got = _nvcomp.decode_batch(c, src, src_off.tolist(), lengths.tolist(), dst, dst_off.tolist(), raw.tolist())
    except (RuntimeError, ValueError) as e:
        raise DecodeError(f"{name}: nvCOMP {algorithm} failed to decode a chunk whose checksum matched: {e}") from e
    bad = [i for i, (g, r) in enumerate(zip(got, raw.tolist())) if g != r]
    if bad:
        raise DecodeError(
            f"{name}: nvCOMP {algorithm} decoded {len(bad)} chunk(s) to a different length than recorded "
            f"(first: {got[bad[0]]} bytes, expected {int(raw[bad[0]])})"
        )

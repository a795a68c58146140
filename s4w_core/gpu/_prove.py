"""Decode first on the GPU: an implausible claim of a GPU-only storage is proven before its output
is allocated (docs/SECURITY.md, "Fixed bounds").

A storage whose raw size exceeds :data:`~s4w_core.format.manifest.PLAUSIBLE_RATIO` times its
stored bytes plus :data:`~s4w_core.format.manifest.PLAUSIBLE_SLACK` is constant data or a forged
size. The CPU reader decodes such a storage chunk by chunk before it allocates the output
(:func:`s4w_core.engine.decode_storage_cpu`); one coded with a GPU-only codec (``nvcomp-ans``) is
proven here the same way, before the GPU reader stages it (:func:`prove_claims`, called by
:func:`s4w_core.gpu._decode.decode_storages` before anything else):

* its chunks are read and their xxh3 checked (as the reader does: no GPU decoder sees a corrupt
  chunk), in groups of at most :data:`PROOF_BYTES` decoded bytes (and as many stored bytes);
* the GPU-only chunks of a group are decoded in one nvCOMP call into one scratch buffer, reused by
  every group of every storage; nvCOMP reports each chunk's status and decoded size, and each must
  be a success of exactly the length the manifest gives the chunk;
* chunks of a CPU codec (``zstd``, ``deflate``; no writer mixes them into a GPU-only storage, but
  the format allows it) are decoded on the host, one at a time, to the same check; ``raw`` chunks
  need none (validation holds their length to their raw length).

A mismatch is a :class:`~s4w_core.errors.DecodeError` (a corrupt chunk: ``ChecksumMismatchError``)
naming the file, the tensor and the chunk, raised before anything of the claimed size is
allocated: a forged size costs one group, a real one what its chunks yield (the decode of constant
data is fast; such storages are then decoded a second time, as today). Device memory during the
proof is bounded by the scratch buffer, one group's stored bytes and nvCOMP's temporary buffer,
whatever the claim.

A delta storage whose chunks are all GPU-decoded or ``raw`` is not proven: its size must equal its
base's, and the GPU reader resolves the base before it allocates the output (a fast store's deltas
of unchanged tensors are constant data, decoded once).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from s4w_core import checksum as ck
from s4w_core import engine
from s4w_core.codecs import NVCOMP_ANS, RAW, get_codec
from s4w_core.errors import ChecksumMismatchError, DecodeError
from s4w_core.format.container import ContainerReader
from s4w_core.format.manifest import NZ_TRANSFORMS, claims_plausible
from s4w_core.gpu import _nvcomp
from s4w_core.gpu._decplan import GPU_DECODERS

__all__ = ["PROOF_BYTES", "needs_proof", "prove_claims", "proof_groups"]

#: decoded bytes of one proof group (the scratch buffer's size), and the most stored bytes it reads
PROOF_BYTES = 64 << 20
#: the most chunks of one group (bounds the call's tables and the gaps read between chunks)
_GROUP_CHUNKS = 4096
#: a gap of at most this many bytes between two chunks of a group is read (and dropped) so that
#: both come in one read, while a read's gaps stay within its chunks' own bytes
_MAX_GAP = 64 << 10
_A = _nvcomp.ALIGN
#: the GPU decoder of each GPU-only codec id (a kind of :data:`~s4w_core.gpu._decplan.GPU_DECODERS`)
_GPU_KIND = {NVCOMP_ANS.id: "ans"}


class ProofChunk(NamedTuple):
    """One chunk of a storage to prove."""

    nth: int  # its index among the storage's chunks
    codec: str
    off: int
    length: int
    xxh3: str
    raw_len: int


def _round(x: int, a: int) -> int:
    return -(-x // a) * a


def needs_proof(entry: dict[str, Any]) -> bool:
    """Whether a (validated) storage entry routed to the GPU reader is proven before its output is
    allocated: its claim is implausible (:func:`~s4w_core.format.manifest.claims_plausible`), it
    has a GPU-only chunk, it is plane- or byte-transformed (a nonzero-transform storage goes to
    the CPU reader, which decodes first itself), and it is not a delta whose base bounds it (a delta
    with a host-decoded chunk is proven: staging allocates that chunk's claim before the base is
    resolved)."""
    chunks = entry.get("chunks")
    if not chunks or entry.get("transform") in NZ_TRANSFORMS:
        return False
    codecs = {c[0] for c in chunks}
    gpu_only = {c for c in codecs if not get_codec(c).cpu_decodable}
    if not gpu_only or claims_plausible(entry):
        return False
    return entry.get("delta") is None or bool(codecs - gpu_only - {RAW.id})


def proof_groups(entry: dict[str, Any], limit: int = PROOF_BYTES) -> list[list[ProofChunk]]:
    """The chunks of ``entry`` that need a check (all but ``raw`` ones), in manifest order, cut into
    groups of at most ``limit`` decoded bytes, ``limit`` stored bytes and :data:`_GROUP_CHUNKS`
    chunks (a larger chunk alone)."""
    groups: list[list[ProofChunk]] = []
    raw_sum = stored_sum = 0
    for i, ((codec, off, length, h), (s0, s1, _j)) in enumerate(zip(entry["chunks"], engine.chunk_layout(entry))):
        if codec == RAW.id:
            continue
        raw_len = s1 - s0
        if not groups or raw_sum + raw_len > limit or stored_sum + length > limit or len(groups[-1]) >= _GROUP_CHUNKS:
            groups.append([])
            raw_sum = stored_sum = 0
        groups[-1].append(ProofChunk(i, codec, off, length, h, raw_len))
        raw_sum += raw_len
        stored_sum += length
    return groups


def prove_claims(reader: ContainerReader, entries: list[dict[str, Any]], device: torch.device) -> None:
    """Prove every entry of ``entries`` that :func:`needs_proof` (see the module's docstring) on
    ``device``; raises before the GPU reader allocates anything at a claimed size."""
    todo = [e for e in entries if needs_proof(e)]
    if not todo:
        return
    scratch: list[torch.Tensor] = []  # the one scratch buffer, grown to the largest group's need
    for e in todo:
        for group in proof_groups(e, PROOF_BYTES):
            _prove_group(reader, e, group, device, scratch)


def _read_group(reader: ContainerReader, group: list[ProofChunk]) -> list[memoryview]:
    """The stored bytes of each chunk of ``group``: chunks back to back in the file, or nearly (see
    :data:`_MAX_GAP`), share a read."""
    order = sorted(range(len(group)), key=lambda k: group[k].off)
    runs: list[list[int]] = []
    own = 0  # the stored bytes of the chunks of the last run
    for k in order:
        c = group[k]
        if runs:
            first, last = group[runs[-1][0]], group[runs[-1][-1]]
            gap = c.off - (last.off + last.length)
            if 0 <= gap <= _MAX_GAP and c.off + c.length - first.off <= 2 * (own + c.length) + _MAX_GAP:
                runs[-1].append(k)
                own += c.length
                continue
        runs.append([k])
        own = c.length
    out: list[memoryview] = [memoryview(b"")] * len(group)
    for run in runs:
        start = group[run[0]].off
        last = group[run[-1]]
        buf = memoryview(bytearray(last.off + last.length - start))
        reader.read_into(start, buf)
        for k in run:
            c = group[k]
            out[k] = buf[c.off - start : c.off - start + c.length]
    return out


def _prove_group(
    reader: ContainerReader,
    entry: dict[str, Any],
    group: list[ProofChunk],
    device: torch.device,
    scratch: list[torch.Tensor],
) -> None:
    name = reader.name
    path = entry["path"]
    datas = _read_group(reader, group)
    for c, data in zip(group, datas):
        if ck.xxh3_hex(data) != c.xxh3:
            raise ChecksumMismatchError(
                f"{name}: chunk {c.nth} of tensor {path!r} (bytes {c.off}..{c.off + c.length}) is corrupt: "
                "checksum mismatch (found before any GPU decoder saw it)"
            )
    on_gpu: dict[str, list[int]] = {}
    for k, c in enumerate(group):
        kind = _GPU_KIND.get(c.codec)
        if kind is not None:
            on_gpu.setdefault(kind, []).append(k)
            continue
        if not get_codec(c.codec).cpu_decodable:
            raise DecodeError(f"{name}: chunk {c.nth} of tensor {path!r}: codec {c.codec!r} has no GPU decoder here")
        try:
            get_codec(c.codec).decode(datas[k], c.raw_len)  # checks the decoded length; the bytes are dropped
        except DecodeError as e:
            raise DecodeError(f"{name}: chunk {c.nth} of tensor {path!r} (bytes {c.off}..{c.off + c.length}): {e}; "
                              f"{_claim(entry)}") from e
    for kind, members in on_gpu.items():
        _decode_on_gpu(name, entry, [group[k] for k in members], [datas[k] for k in members], kind, device, scratch)


def _claim(entry: dict[str, Any]) -> str:
    stored = sum(c[2] for c in entry["chunks"])
    return (f"the storage claims {entry['nbytes']} bytes from {stored} stored bytes, and nothing was allocated "
            "for them")


def _decode_on_gpu(
    name: str,
    entry: dict[str, Any],
    chunks: list[ProofChunk],
    datas: list[memoryview],
    kind: str,
    device: torch.device,
    scratch: list[torch.Tensor],
) -> None:
    """One nvCOMP call: ``chunks`` (stored bytes ``datas``) into the scratch buffer; every chunk
    must decode without an error status to exactly its ``raw_len``."""
    algorithm, opts = GPU_DECODERS[kind]
    path = entry["path"]
    lengths = np.array([c.length for c in chunks], dtype=np.int64)
    raw = np.array([c.raw_len for c in chunks], dtype=np.int64)
    ssz = (lengths + _A - 1) // _A * _A
    src = np.cumsum(ssz) - ssz
    dsz = (raw + _A - 1) // _A * _A
    dst = np.cumsum(dsz) - dsz
    host = _nvcomp.host_empty(int(ssz.sum()))
    h = host.numpy()
    for s, data in zip(src.tolist(), datas):
        h[s : s + len(data)] = np.frombuffer(data, dtype=np.uint8)
    need = max(int(dsz.sum()), 1)
    sizes: np.ndarray | None = None
    status: np.ndarray | None = None
    failed = ""
    with _nvcomp.on_stream(device):
        if not scratch or scratch[0].numel() < need:
            scratch[:] = []  # the old buffer goes back to the allocator before the larger one is taken
            scratch.append(torch.empty(need, dtype=torch.uint8, device=device))
        staged = host.to(device, non_blocking=True)
        c = _nvcomp.codec(algorithm, device, _round(int(raw.max()), 1 << 16), **opts)
        try:
            got: Any = _nvcomp.decode_batch(c, staged, src, lengths, scratch[0], dst, raw)
            dev_status = getattr(got, "status", None)  # the C API's per-chunk statuses, on the device
            if isinstance(dev_status, torch.Tensor):
                sizes = np.asarray(got.sizes.cpu().numpy(), dtype=np.int64)
                status = np.asarray(dev_status.cpu().numpy(), dtype=np.int64)
            else:
                sizes = np.asarray(list(got), dtype=np.int64)
        except (RuntimeError, ValueError) as e:
            failed = str(e)
        del staged
    if sizes is None or len(sizes) != len(chunks):
        first, last = chunks[0], chunks[-1]
        raise DecodeError(
            f"{name}: tensor {path!r}: nvCOMP {algorithm} failed on its chunks {first.nth}..{last.nth} "
            f"(bytes {first.off}..{last.off + last.length}), whose checksums matched: {failed or 'no sizes'}; "
            f"{_claim(entry)}"
        )
    if status is None:
        status = np.zeros(len(sizes), dtype=np.int64)
    bad = np.nonzero((sizes != raw) | (status != 0))[0]
    if len(bad):
        b = int(bad[0])
        c0 = chunks[b]
        raise DecodeError(
            f"{name}: chunk {c0.nth} of tensor {path!r} (bytes {c0.off}..{c0.off + c0.length}) does not decode "
            f"to the {c0.raw_len} bytes the manifest gives it (nvCOMP {algorithm}: status {int(status[b])}, "
            f"{int(sizes[b])} bytes; {len(bad)} such chunk(s) in this group); {_claim(entry)}"
        )

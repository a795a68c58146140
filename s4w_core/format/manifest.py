"""Validation of a parsed manifest before anything is allocated or decoded.

Everything numeric in a manifest is untrusted: sizes, offsets, shapes and strides are checked
against the container and each other here, so that decoding never indexes out of bounds and never
allocates more than the bound stated in docs/FORMAT.md ("Resource bounds").
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from s4w_core.codecs import get_codec
from s4w_core.errors import ManifestError, S4WError, UnsupportedVersionError
from s4w_core.format.container import FORMAT_VERSION

__all__ = [
    "validate_manifest",
    "MAX_EXPANSION",
    "MAX_SEGMENT_BYTES",
    "MAX_STORAGE_BYTES",
    "PLANE_TRANSFORMS",
    "NZ_TRANSFORMS",
    "RC_TRANSFORMS",
    "nz_counts",
    "rowcol_offsets",
    "NVCOMP_ANS_MAX_CHUNK",
    "PLAUSIBLE_RATIO",
    "PLAUSIBLE_SLACK",
    "claims_plausible",
]

#: largest decoded/stored ratio a chunk of each codec may claim (deflate's format limit is
#: ~1032:1; zstd and ANS can go further on constant data, capped here).
MAX_EXPANSION = {"raw": 1, "deflate": 1040, "zstd": 1 << 16, "nvcomp-ans": 1 << 16}
MAX_SEGMENT_BYTES = 1 << 26
#: the most bytes one ``nvcomp-ans`` chunk decodes to: nvCOMP's ANS compressor refuses larger
#: chunks (``nvcompANSCompressionMaxAllowedChunkSize``, 2**24, nvCOMP 6), so no file written by
#: it claims more. (The rANS coder itself gives no ratio bound: a symbol of probability 1 costs no
#: bits, so constant data codes to little more than the chunk's ~60-byte header.)
NVCOMP_ANS_MAX_CHUNK = 1 << 24
#: a storage whose raw size is at most this many times its stored bytes (plus
#: :data:`PLAUSIBLE_SLACK`) may be allocated before its chunks are decoded; one that claims more is
#: decoded first (real data compresses far less: a claim that large is constant data or forged): by
#: the CPU reader, or, where only a GPU decodes the storage, by the GPU reader (s4w_core.gpu._prove)
PLAUSIBLE_RATIO = 16
PLAUSIBLE_SLACK = 1 << 20
MAX_STORAGE_BYTES = 1 << 48
#: the byte-plane transforms (docs/FORMAT.md 4.5 and 4.5b): ``planes-rotl1`` rotates each element
#: left by one bit before the split, ``planes`` splits it as it is; the width comes from the dtype.
#: The one definition of these names (s4w_core.engine, .delta and .gpu import them).
ROTL1, PLAIN = "planes-rotl1", "planes"
PLANE_TRANSFORMS = (ROTL1, PLAIN)
#: the nonzero-element transforms (docs/FORMAT.md 4.5c): a bitmap of the nonzero elements, then
#: those elements through the byte-plane transform each one names; ``nnz`` lists their count per segment.
NZ_ROTL1, NZ_PLAIN = "nz-planes-rotl1", "nz-planes"
NZ_TRANSFORMS = {NZ_ROTL1: ROTL1, NZ_PLAIN: PLAIN}
#: the row/column exponent-model transforms (docs/FORMAT.md 4.5d): the byte-plane transform each
#: one names, with plane 0 stored less a per-row and a per-column offset, held by the ``rowcol`` key.
RC_ROTL1, RC_PLAIN = "rc-planes-rotl1", "rc-planes"
RC_TRANSFORMS = {RC_ROTL1: ROTL1, RC_PLAIN: PLAIN}
_WIDTH = {ROTL1: None, PLAIN: None, NZ_ROTL1: None, NZ_PLAIN: None, RC_ROTL1: None, RC_PLAIN: None, "bytes": 1}
#: delta ops (s4w_core.delta): "xor" for any storage, "sub" for byte-plane (planes-rotl1, planes) storages.
_DELTA_OPS = ("xor", "sub")
_PLANE_WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ManifestError(f"manifest: {what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def nz_counts(s: dict[str, Any], n: int, seg: int, where: str) -> list[int]:
    """The ``nnz`` list of a nonzero-transform storage entry of ``n`` elements in segments of
    ``seg``, checked: one integer per segment, each at most the segment's elements."""
    nnz = s.get("nnz")
    nseg = -(-n // seg)
    if not isinstance(nnz, list) or len(nnz) != nseg:
        raise ManifestError(f"manifest: {where}: transform {s.get('transform')} needs 'nnz', one count per segment ({nseg})")
    for k, c in enumerate(nnz):
        m = min(seg, n - k * seg)
        if type(c) is not int or not 0 <= c <= m:
            raise ManifestError(f"manifest: {where}: nnz[{k}] must be an integer in [0, {m}], got {c!r}")
    return nnz


def _b64(v: Any, size: int, what: str) -> bytes:
    """``v``, a base64 string (RFC 4648, padded) that must decode to exactly ``size`` bytes: its
    length is checked before anything is decoded."""
    if not isinstance(v, str) or len(v) != 4 * (-(-size // 3)):
        raise ManifestError(
            f"manifest: {what} must be the base64 text of exactly {size} bytes "
            f"({4 * (-(-size // 3))} characters), got {type(v).__name__} of {len(v) if isinstance(v, str) else '?'}"
        )
    try:
        out = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ManifestError(f"manifest: {what} is not valid base64: {e}") from None
    if len(out) != size:
        raise ManifestError(f"manifest: {what} decodes to {len(out)} bytes, expected {size}")
    return out


def rowcol_offsets(s: dict[str, Any], n: int, where: str) -> tuple[int, bytes, bytes]:
    """The ``rowcol`` key of a row/column-transform storage entry of ``n`` elements, checked and
    decoded (docs/FORMAT.md 4.5d): ``(cols, row, col)``, ``cols`` dividing ``n``, ``row`` the
    ``n // cols`` row offsets and ``col`` the ``cols`` column offsets (bytes). Every length is
    checked against ``n`` before a byte is decoded; ManifestError otherwise."""
    rc = s.get("rowcol")
    if not isinstance(rc, dict):
        raise ManifestError(f"manifest: {where}: transform {s.get('transform')} needs a 'rowcol' object")
    cols = rc.get("cols")
    if type(cols) is not int or not 1 <= cols <= n or n % cols:
        raise ManifestError(
            f"manifest: {where}: rowcol 'cols' must be an integer in [1, {n}] dividing the {n} elements, got {cols!r}"
        )
    row = _b64(rc.get("row"), n // cols, f"{where} rowcol 'row'")
    col = _b64(rc.get("col"), cols, f"{where} rowcol 'col'")
    return cols, row, col


def claims_plausible(entry: dict[str, Any]) -> bool:
    """Whether a (validated) storage entry's raw size is at most :data:`PLAUSIBLE_RATIO` times its
    stored bytes plus :data:`PLAUSIBLE_SLACK`: then its output may be allocated before its chunks
    are decoded."""
    return bool(entry["nbytes"] <= PLAUSIBLE_RATIO * sum(c[2] for c in entry["chunks"]) + PLAUSIBLE_SLACK)


def validate_manifest(
    m: dict[str, Any], data_start: int, data_end: int, known_codecs: set[str], name: str | None = None
) -> None:
    """Check ``m`` in place; adds ``_width`` to each storage entry. Raises ManifestError (or
    UnsupportedVersionError, UnknownCodecError) whose message starts with ``name`` (the file)."""
    try:
        _validate(m, data_start, data_end, known_codecs)
    except S4WError as e:
        if name is None:
            raise
        raise type(e)(f"{name}: {e}") from e.__cause__


def _validate(m: dict[str, Any], data_start: int, data_end: int, known_codecs: set[str]) -> None:
    if m.get("format") != "s4weights":
        raise ManifestError("manifest: 'format' is not 's4weights'")
    if m.get("version") != FORMAT_VERSION:
        raise UnsupportedVersionError(f"manifest version {m.get('version')!r}; this reader knows {FORMAT_VERSION}")
    storages = m.get("storages")
    tensors = m.get("tensors")
    if not isinstance(storages, list) or not isinstance(tensors, list):
        raise ManifestError("manifest: 'storages' and 'tensors' must be lists")
    if "tree" not in m:
        raise ManifestError("manifest: 'tree' is missing")
    spans: list[tuple[int, int]] = []  # (offset, length) of every non-empty chunk
    for i, s in enumerate(storages):
        where = f"storage {i}"
        if not isinstance(s, dict):
            raise ManifestError(f"manifest: {where} is not an object")
        if not isinstance(s.get("path"), str) or not isinstance(s.get("device"), str):
            raise ManifestError(f"manifest: {where} lacks path/device")
        nbytes = _int(s.get("nbytes"), f"{where} nbytes", 0, MAX_STORAGE_BYTES)
        tr = s.get("transform")
        if not isinstance(tr, str) or tr not in _WIDTH:
            raise ManifestError(f"manifest: {where} has unknown transform {tr!r}")
        if not isinstance(s.get("dtype"), str):
            raise ManifestError(f"manifest: {where} dtype must be a string")
        w = _PLANE_WIDTH.get(s["dtype"]) if tr != "bytes" else 1
        if w is None or nbytes % w:
            raise ManifestError(f"manifest: {where}: transform {tr} does not apply to {s['dtype']} x {nbytes} bytes")
        seg = _int(s.get("segment_elems"), f"{where} segment_elems", 1, MAX_SEGMENT_BYTES // w)
        ck = s.get("checksum")
        if not isinstance(ck, str) or ck.split(":", 1)[0] not in ("xxh3-64", "fold64"):
            raise ManifestError(f"manifest: {where} has no valid checksum")
        delta = s.get("delta")
        if delta is not None and (not isinstance(delta, dict) or delta.get("op") not in _DELTA_OPS):
            raise ManifestError(f"manifest: {where} has an unknown delta {delta!r}")
        if delta is not None and delta["op"] == "sub" and tr == "bytes":
            raise ManifestError(
                f"manifest: {where}: delta op 'sub' applies only to byte-plane (planes-rotl1, planes) storages"
            )
        n = nbytes // w
        nseg = -(-n // seg)
        nnz = nz_counts(s, n, seg, where) if tr in NZ_TRANSFORMS else None
        if tr in RC_TRANSFORMS:
            rowcol_offsets(s, n, where)
        per = w if nnz is None else w + 1  # a nz segment: its bitmap chunk, then its w plane chunks
        chunks = s.get("chunks")
        if not isinstance(chunks, list) or len(chunks) != nseg * per:
            raise ManifestError(
                f"manifest: {where} must have {nseg * per} chunks ({nseg} segments x {per} chunks), "
                f"has {len(chunks) if isinstance(chunks, list) else chunks!r}"
            )
        # the per-chunk checks inline: this loop runs for every chunk of every load
        emax = MAX_EXPANSION
        for k, c in enumerate(chunks):
            if not (type(c) is list and len(c) == 4 and type(c[0]) is str and type(c[3]) is str):
                raise ManifestError(f"manifest: {where} chunk {k} is malformed")
            codec, off, length = c[0], c[1], c[2]
            if codec not in known_codecs:
                get_codec(codec)  # raises UnknownCodecError with the install hint
            if not (type(off) is int and data_start <= off <= data_end):
                _int(off, f"{where} chunk {k} offset", data_start, data_end)
            if not (type(length) is int and 0 <= length <= data_end - off):
                _int(length, f"{where} chunk {k} length", 0, data_end - off)
            seg_i = k // per
            raw_len = seg if (seg_i + 1) * seg <= n else n - seg_i * seg
            if nnz is not None:
                raw_len = nnz[seg_i] if k % per else (raw_len + 7) // 8
            if codec == "raw" and length != raw_len:
                raise ManifestError(f"manifest: {where} chunk {k}: raw chunk of {length} bytes, expected {raw_len}")
            if raw_len > length * emax.get(codec, 1 << 16) + 64:  # an empty chunk: 64 bytes at most
                raise ManifestError(
                    f"manifest: {where} chunk {k} claims {raw_len} bytes from {length} stored bytes of {codec}: "
                    "beyond that codec's possible expansion"
                )
            if codec == "nvcomp-ans" and raw_len > NVCOMP_ANS_MAX_CHUNK:
                raise ManifestError(
                    f"manifest: {where} chunk {k} claims {raw_len} bytes of nvcomp-ans, more than the "
                    f"{NVCOMP_ANS_MAX_CHUNK} an nvCOMP ANS chunk holds"
                )
            if length:
                spans.append((off, length))
        s["_width"] = w
    # Chunks may not overlap: otherwise a tiny file could point many chunks at the same bytes and
    # claim (and make the reader allocate) an arbitrarily large decoded size.
    spans.sort()
    for (o1, n1), (o2, _n2) in zip(spans, spans[1:]):
        if o2 < o1 + n1:
            raise ManifestError(f"manifest: chunks at offsets {o1} (+{n1}) and {o2} overlap")
    for i, t in enumerate(tensors):
        where = f"tensor {i}"
        if not isinstance(t, dict):
            raise ManifestError(f"manifest: {where} is not an object")
        sidx = _int(t.get("storage"), f"{where} storage", 0, len(storages) - 1)
        if not isinstance(t.get("dtype"), str) or not isinstance(t.get("path"), str):
            raise ManifestError(f"manifest: {where} lacks dtype/path")
        shape, stride = t.get("shape"), t.get("stride")
        if not isinstance(shape, list) or not isinstance(stride, list) or len(shape) != len(stride) or len(shape) > 64:
            raise ManifestError(f"manifest: {where} has malformed shape/stride")
        for d in shape:
            if not (type(d) is int and 0 <= d <= MAX_STORAGE_BYTES):
                _int(d, f"{where} shape entry", 0, MAX_STORAGE_BYTES)
        for d in stride:
            if not (type(d) is int and 0 <= d <= MAX_STORAGE_BYTES):
                _int(d, f"{where} stride entry", 0, MAX_STORAGE_BYTES)
        off = _int(t.get("offset"), f"{where} offset", 0, MAX_STORAGE_BYTES)
        numel = 1
        for d in shape:
            numel *= d
        if numel > MAX_STORAGE_BYTES:
            raise ManifestError(f"manifest: {where} has {numel} elements, more than {MAX_STORAGE_BYTES}")
        t["_itemsize"] = None  # filled by the loader, which knows dtypes
        t["_extent"] = (
            0 if 0 in shape else off + 1 + sum((d - 1) * st for d, st in zip(shape, stride))
        )  # elements of the storage the view reaches
        _ = storages[sidx]

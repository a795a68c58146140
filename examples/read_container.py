#!/usr/bin/env python3
"""A reference reader for s4weights containers (format version 1), written from docs/FORMAT.md alone.

It does not import ``s4w_core`` (nor torch or numpy): it proves that the specification is enough to
read a checkpoint. It needs only the standard library, plus ``zstandard`` for ``zstd`` chunks and compressed manifests and,
optionally, ``xxhash`` to check the xxh3-64 checksums (without it, xxh3 checks are skipped and
``fold64`` checks still run). It reads the *portable* profile: codecs ``raw``, ``deflate`` and
``zstd``; a ``fast``-profile file (``nvcomp-ans``) needs a GPU and is refused.

Usage::

    python examples/read_container.py CHECKPOINT.s4w          # prints the tree and every tensor
    python examples/read_container.py CHECKPOINT.s4w --check  # also verifies every checksum

As a library::

    tree, manifest = read("ckpt.s4w")
    t = tree["model"]["w"]        # a Tensor record: dtype, shape, stride, offset, storage bytes
    t.element_bytes()             # its elements' bytes in row-major order (little-endian)

Speed is not the point (it is about 10-50 MB/s), but the byte-plane merge uses whole-plane big-int
operations rather than a per-element loop, so checkpoints of tens of MB are fine.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

MAGIC = b"S4WCKPT\x00"
TRAILER_MAGIC = b"S4WEND\x00\x00"
HEADER = struct.Struct("<8sHHI")  # magic, version, flags, reserved
TRAILER = struct.Struct("<QQQ8s")  # manifest offset, manifest length, xxh3-64(stored manifest), magic
VERSION = 1
FLAG_MANIFEST_ZSTD = 1  # header flag bit 0: the manifest is stored as one zstd frame
MAX_MANIFEST_BYTES = 1 << 30
PLANE_WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}

# byte -> byte maps used by the plane merge (FORMAT.md, "planes-rotl1")
_SHR1 = bytes(b >> 1 for b in range(256))  # drop bit 0
_BIT0_TO_BIT7 = bytes((b & 1) << 7 for b in range(256))  # bit 0 moves to bit 7


class FormatError(ValueError):
    """The file is not a well-formed version-1 container (or fails a checksum)."""


@dataclass
class Tensor:
    """One tensor: a view (shape, stride, offset in elements) into the bytes of its storage."""

    path: str
    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int
    storage: bytes = field(repr=False)
    requires_grad: bool = False
    param: bool = False

    def element_bytes(self) -> bytes:
        """The elements' bytes in row-major (C) order, each element little-endian."""
        item = ITEMSIZE[self.dtype]
        out = bytearray()
        n = 1
        for d in self.shape:
            n *= d
        if n == 0:
            return b""
        idx = [0] * len(self.shape)
        for _ in range(n):
            e = self.offset + sum(i * s for i, s in zip(idx, self.stride))
            out += self.storage[e * item : (e + 1) * item]
            for k in reversed(range(len(idx))):  # odometer increment
                idx[k] += 1
                if idx[k] < self.shape[k]:
                    break
                idx[k] = 0
        return bytes(out)


# ----------------------------------------------------------------------------- checksums
def _xxh3(data: bytes) -> str | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64_hexdigest(data)


def fold64(raw: bytes) -> int:
    """FORMAT.md "fold64": order-sensitive 64-bit sum over the little-endian uint32 words."""
    mask = (1 << 64) - 1
    n = len(raw)
    padded = raw + b"\x00" * (-n % 4)
    total = 0
    for i, (w,) in enumerate(struct.iter_unpack("<I", padded)):
        x = (w + (i + 1) * 0x9E3779B97F4A7C15) & mask
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & mask
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & mask
        x ^= x >> 33
        total += x
    return (total + n * 0x94D049BB133111EB) & mask


def check_raw_checksum(expected: str, raw: bytes, where: str) -> None:
    algo, _, value = expected.partition(":")
    if algo == "xxh3-64":
        got = _xxh3(raw)
        if got is not None and got != value:
            raise FormatError(f"{where}: decoded bytes do not match {expected}")
    elif algo == "fold64":
        if f"{fold64(raw):016x}" != value:
            raise FormatError(f"{where}: decoded bytes do not match {expected}")
    else:
        raise FormatError(f"{where}: unknown checksum {expected!r}")


# ----------------------------------------------------------------------------- codecs
def decode_chunk(codec: str, data: bytes, raw_len: int) -> bytes:
    if codec == "raw":
        out = data
    elif codec == "deflate":  # RFC 1951 raw deflate, no zlib/gzip wrapper
        d = zlib.decompressobj(-15)
        out = d.decompress(data, raw_len)
        if not d.eof:
            raise FormatError("deflate stream does not end where the chunk ends")
    elif codec == "zstd":  # one Zstandard frame (RFC 8878)
        import zstandard

        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_len)
    else:
        raise FormatError(f"codec {codec!r} has no CPU decoder in this reader (a GPU profile?)")
    if len(out) != raw_len:
        raise FormatError(f"{codec} chunk decoded to {len(out)} bytes, expected {raw_len}")
    return out


# ----------------------------------------------------------------------------- planes-rotl1
def merge_planes(planes: list[bytes], n: int) -> bytes:
    """Inverse of the byte-plane split: ``w`` planes of ``n`` bytes -> ``n`` little-endian elements.

    Plane j holds big-endian byte j of r = rotl1(x). So big-endian byte j of x = rotr1(r) is
    ``(plane[j] >> 1) | ((plane[j-1] & 1) << 7)``, with plane[-1] meaning plane[w-1] (the bit
    rotated out of the bottom of r goes back to the top of x). Element i's little-endian byte k is
    big-endian byte w-1-k.
    """
    w = len(planes)
    out = bytearray(n * w)
    for j in range(w):
        hi = int.from_bytes(planes[j].translate(_SHR1), "big")
        lo = int.from_bytes(planes[(j - 1) % w].translate(_BIT0_TO_BIT7), "big")
        out[w - 1 - j :: w] = (hi | lo).to_bytes(n, "big")  # disjoint bits: OR acts bytewise
    return bytes(out)


def merge_planes_plain(planes: list[bytes], n: int) -> bytes:
    """Inverse of the ``planes`` split (FORMAT.md 4.5b, no rotation): plane j is big-endian byte j
    of x, i.e. little-endian byte w-1-j of each element."""
    w = len(planes)
    out = bytearray(n * w)
    for j in range(w):
        out[w - 1 - j :: w] = planes[j]
    return bytes(out)


def xor_bytes(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def unsub(resid: bytes, base: bytes, w: int) -> bytes:
    """Inverse of the ``sub`` delta op (FORMAT.md 4.4) on little-endian ``w``-byte elements."""
    bits = 8 * w
    mask, top = (1 << bits) - 1, 1 << (bits - 1)
    fmt = "<H" if w == 2 else "<I"
    out = bytearray()
    for (z,), (b,) in zip(struct.iter_unpack(fmt, resid), struct.iter_unpack(fmt, base)):
        s = (z >> 1) ^ -(z & 1)  # un-zigzag
        ob = b ^ mask if b & top else b ^ top  # ord(base)
        o = (ob + s) & mask
        out += struct.pack(fmt, o ^ top if o & top else o ^ mask)  # unord
    return bytes(out)


# ----------------------------------------------------------------------------- container
def parse(blob: bytes) -> dict[str, Any]:
    """Check header and trailer, return the manifest (a dict)."""
    if len(blob) < HEADER.size + TRAILER.size:
        raise FormatError("shorter than header + trailer")
    magic, version, flags, reserved = HEADER.unpack_from(blob, 0)
    if magic != MAGIC:
        raise FormatError("bad magic: not an s4weights container")
    if version != VERSION or flags & ~FLAG_MANIFEST_ZSTD or reserved:
        raise FormatError(
            f"format version {version} (flags {flags:#x}, reserved {reserved}); this reader knows version 1, "
            "flag bit 0 and reserved 0"
        )
    moff, mlen, mhash, tmagic = TRAILER.unpack_from(blob, len(blob) - TRAILER.size)
    if tmagic != TRAILER_MAGIC:
        raise FormatError("no trailer: truncated")
    if moff < HEADER.size or moff + mlen != len(blob) - TRAILER.size:
        raise FormatError("manifest offset/length do not fit the file")
    body = blob[moff : moff + mlen]
    got = _xxh3(body)
    if got is not None and int(got, 16) != mhash:
        raise FormatError("manifest checksum mismatch")
    if flags & FLAG_MANIFEST_ZSTD:  # one zstd frame declaring its size, at most 2^30 bytes
        import zstandard

        size = zstandard.frame_content_size(body)
        if not 0 <= size <= MAX_MANIFEST_BYTES:
            raise FormatError(f"compressed manifest declares {size} bytes")
        with zstandard.ZstdDecompressor().stream_reader(body) as r:
            body = r.read(size + 1)  # (a reader that cares about memory reads it in pieces)
        if len(body) != size:
            raise FormatError("compressed manifest does not decode to its declared size")
    m = json.loads(body.decode("utf-8"))
    if m.get("format") != "s4weights" or m.get("version") != VERSION:
        raise FormatError("manifest format/version")
    return m


def expand_nonzero(bitmap: bytes, nz: bytes, m: int, w: int, where: str) -> bytes:
    """Inverse of the nonzero split (FORMAT.md 4.5c): ``m`` elements of ``w`` bytes, the nonzero
    ones (``nz``, in order) where bit ``i % 8`` of bitmap byte ``i // 8`` is set, zeros elsewhere."""
    if len(bitmap) != (m + 7) // 8 or (m % 8 and bitmap[-1] >> (m % 8)):
        raise FormatError(f"{where}: bitmap length or padding bits")
    bits = int.from_bytes(bitmap, "little")
    if bin(bits).count("1") * w != len(nz):
        raise FormatError(f"{where}: bitmap count does not match nnz")
    out = bytearray(m * w)
    pos = 0
    for i in range(m):
        if bits >> i & 1:
            e = nz[pos : pos + w]
            if not any(e):
                raise FormatError(f"{where}: a nonzero element decodes to zero")
            out[i * w : (i + 1) * w] = e
            pos += w
    return bytes(out)


def decode_storage(blob: bytes, s: dict[str, Any], base: bytes | None = None, check: bool = True) -> bytes:
    """The raw bytes of one storage entry (``base``: the delta base's raw bytes, if it has one)."""
    tr = s["transform"]
    nzt = tr.removeprefix("nz-") if tr in ("nz-planes-rotl1", "nz-planes") else None  # FORMAT.md 4.5c
    rct = tr.removeprefix("rc-") if tr in ("rc-planes-rotl1", "rc-planes") else None  # FORMAT.md 4.5d
    if rct:
        tr = rct
    if tr in ("planes-rotl1", "planes") or nzt:
        w = PLANE_WIDTH[s["dtype"]]
    elif tr == "bytes":
        w = 1
    else:
        raise FormatError(f"unknown transform {tr!r}")
    nbytes, seg = s["nbytes"], s["segment_elems"]
    n = nbytes // w
    nseg = -(-n // seg)
    per = w + 1 if nzt else w  # an nz segment: its bitmap chunk, then its w plane chunks
    if len(s["chunks"]) != nseg * per or (nzt and len(s.get("nnz", ())) != nseg):
        raise FormatError(f"{s['path']}: expected {nseg * per} chunks")
    if s.get("delta") and base is None:
        raise FormatError(f"{s['path']} is an XOR delta; its base is needed")
    if rct:  # the row/column offsets of plane 0
        rc = s.get("rowcol")
        cols = rc.get("cols") if isinstance(rc, dict) else None
        if type(cols) is not int or not 1 <= cols <= n or n % cols:
            raise FormatError(f"{s['path']}: rowcol cols {cols!r} does not divide {n} elements")
        assert isinstance(rc, dict)
        try:
            row, col = base64.b64decode(rc.get("row"), validate=True), base64.b64decode(rc.get("col"), validate=True)
        except (TypeError, ValueError) as e:
            raise FormatError(f"{s['path']}: rowcol offsets are not base64: {e}") from None
        if len(row) != n // cols or len(col) != cols:
            raise FormatError(f"{s['path']}: rowcol offsets are not {n // cols} and {cols} bytes")

    def chunk(c: int, raw_len: int) -> bytes:
        codec, off, length, h = s["chunks"][c]
        data = blob[off : off + length]
        if len(data) != length or off < HEADER.size:
            raise FormatError("chunk outside the file")
        got = _xxh3(data) if check else None
        if got is not None and got != h:
            raise FormatError(f"{s['path']}: chunk {c} checksum mismatch")
        return decode_chunk(codec, data, raw_len)

    out = bytearray()
    for k in range(nseg):
        m = min(seg, n - k * seg)  # elements in this segment
        c0 = k * per
        if nzt:
            bitmap = chunk(c0, (m + 7) // 8)
            c0, elems = c0 + 1, s["nnz"][k]  # the planes hold the nonzero elements only
        else:
            elems = m
        planes = [chunk(c0 + j, elems) for j in range(w)]
        if rct:  # plane 0 of element i was stored less row[i // cols] + col[i % cols], modulo 256
            i0 = k * seg
            planes[0] = bytes((v + row[i // cols] + col[i % cols]) & 0xFF for i, v in enumerate(planes[0], i0))
        if tr == "bytes":
            out += planes[0]
            continue
        merged = merge_planes(planes, elems) if (nzt or tr) == "planes-rotl1" else merge_planes_plain(planes, elems)
        out += expand_nonzero(bitmap, merged, m, w, f"{s['path']} segment {k}") if nzt else merged
    raw = bytes(out)  # with a delta: the residual
    if s.get("delta"):
        assert base is not None
        op = s["delta"].get("op")
        if op == "xor":
            raw = xor_bytes(raw, base)
        elif op == "sub" and w > 1:
            raw = unsub(raw, base, w)
        else:
            raise FormatError(f"{s['path']}: unknown delta op {op!r}")
    if check:
        check_raw_checksum(s["checksum"], raw, s["path"])
    return raw


def decode_tree(node: Any, tensors: list[Tensor]) -> Any:
    """FORMAT.md "tree": tagged JSON back to Python values. Never imports anything it names."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [decode_tree(v, tensors) for v in node]
    tag = next((k for k in node if k.startswith("$")), None)
    if tag is None:
        return {k: decode_tree(v, tensors) for k, v in node.items()}
    v = node[tag]

    def f64(x: Any) -> float:
        return struct.unpack("<d", bytes.fromhex(x["$f64"]))[0] if isinstance(x, dict) else float(x)

    def pairs(items: list[list[Any]]) -> list[tuple[Any, Any]]:
        return [(decode_tree(k, tensors), decode_tree(x, tensors)) for k, x in items]

    if tag == "$t":
        return tensors[v]
    if tag == "$f64":
        return f64(node)
    if tag == "$tuple":
        return tuple(decode_tree(x, tensors) for x in v)
    if tag in ("$dict", "$odict"):
        return dict(pairs(v))  # insertion order is the saved order
    if tag == "$dictsub":  # a dict subclass, named but never imported here
        return dict(pairs(node["items"]))
    if tag == "$set":
        return {decode_tree(x, tensors) for x in v}
    if tag == "$frozenset":
        return frozenset(decode_tree(x, tensors) for x in v)
    if tag == "$bytes":
        return base64.b64decode(v, validate=True)
    if tag == "$bytearray":
        return bytearray(base64.b64decode(v, validate=True))
    if tag == "$complex":
        return complex(f64(v[0]) if isinstance(v[0], dict) else v[0], f64(v[1]) if isinstance(v[1], dict) else v[1])
    if tag == "$dtype":
        return f"torch.{v}"
    if tag == "$device":
        return f"device({v})"
    if tag == "$size":
        return tuple(v)
    if tag == "$namespace":
        return SimpleNamespace(**{k: decode_tree(x, tensors) for k, x in v.items()})
    if tag == "$ndarray":
        return decode_tree(v, tensors)  # a Tensor record
    if tag == "$npscalar":
        return ("numpy-scalar", v[0], base64.b64decode(v[1]))
    if tag == "$npdtype":
        return ("numpy-dtype", v)
    raise FormatError(f"unknown tree tag {tag!r}")


def read(src: str | bytes, bases: dict[str, bytes] | None = None, check: bool = True) -> tuple[Any, dict[str, Any]]:
    """Decode a whole container: returns ``(tree, manifest)`` with tensors as :class:`Tensor`."""
    if isinstance(src, (bytes, bytearray)):
        blob = bytes(src)
    else:
        with open(src, "rb") as f:
            blob = f.read()
    m = parse(blob)
    raws = [decode_storage(blob, s, (bases or {}).get(s["path"]), check) for s in m["storages"]]
    tensors = []
    for t in m["tensors"]:
        tensors.append(
            Tensor(t["path"], t["dtype"], t["shape"], t["stride"], t["offset"], raws[t["storage"]],
                   bool(t.get("requires_grad")), bool(t.get("param")))
        )
    return decode_tree(m["tree"], tensors), m


def _show(node: Any, indent: str = "") -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (dict, list, tuple)) and v:
                print(f"{indent}{k!r}:")
                _show(v, indent + "  ")
            else:
                print(f"{indent}{k!r}: {_fmt(v)}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            if isinstance(v, (dict, list, tuple)) and v:
                print(f"{indent}[{i}]:")
                _show(v, indent + "  ")
            else:
                print(f"{indent}[{i}]: {_fmt(v)}")
    else:
        print(indent + _fmt(node))


def _fmt(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"tensor {v.dtype}{tuple(v.shape)} stride={tuple(v.stride)} offset={v.offset} storage={len(v.storage)} B"
    return repr(v)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    tree, m = read(argv[0], check="--check" in argv)
    raw = sum(s["nbytes"] for s in m["storages"])
    stored = sum(c[2] for s in m["storages"] for c in s["chunks"])
    print(f"{argv[0]}: version {m['version']}, profile {m.get('profile')}, {len(m['tensors'])} tensors, "
          f"{raw} raw bytes -> {stored} stored" + (", every checksum OK" if "--check" in argv else ""))
    _show(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

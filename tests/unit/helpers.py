"""Helpers shared by the unit tests: bit-exact comparison, in-memory round trips, container surgery."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import struct
from typing import Any, Callable, Iterator

import torch
import xxhash
import zstandard

import s4w_core
from s4w_core.format.container import FLAG_MANIFEST_ZSTD, HEADER_SIZE, TRAILER_MAGIC, TRAILER_SIZE, inflate_manifest

_TRAILER = struct.Struct("<QQQ8s")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``'s elements in logical order (1-D uint8, CPU), for bit-exact compares."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, *, check_stride: bool = True) -> None:
    """``b`` is ``a`` bit for bit: type, dtype, shape, (stride, offset) and every byte."""
    assert type(a) is type(b), (type(a), type(b))
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    if check_stride:
        assert a.stride() == b.stride(), (a.stride(), b.stride())
        assert a.storage_offset() == b.storage_offset()
    assert a.requires_grad == b.requires_grad
    assert torch.equal(bits(a), bits(b)), "bytes differ"


def roundtrip(obj: Any, **save_kw: Any) -> Any:
    """save to memory, then load; returns the loaded object."""
    buf = io.BytesIO()
    save_kw.setdefault("profile", "portable")
    s4w_core.save(obj, buf, **save_kw)
    return s4w_core.load(buf.getvalue())


def encode(obj: Any, **save_kw: Any) -> bytes:
    buf = io.BytesIO()
    save_kw.setdefault("profile", "portable")
    s4w_core.save(obj, buf, **save_kw)
    return buf.getvalue()


def manifest_compressed(blob: bytes) -> bool:
    """Whether the header flags say the stored manifest is a zstd frame."""
    return bool(struct.unpack_from("<H", blob, 10)[0] & FLAG_MANIFEST_ZSTD)


def manifest_text(blob: bytes) -> bytes:
    """The manifest's JSON bytes of a well-formed container (decompressed when stored compressed)."""
    moff, mlen, _h, magic = _TRAILER.unpack(blob[-TRAILER_SIZE:])
    assert magic == TRAILER_MAGIC
    stored = blob[moff : moff + mlen]
    return inflate_manifest(stored) if manifest_compressed(blob) else stored


def split(blob: bytes) -> tuple[bytes, bytes, dict[str, Any]]:
    """``(header + data, trailer, manifest)`` of a well-formed container (the manifest
    decompressed when the header says it is stored compressed)."""
    moff = _TRAILER.unpack(blob[-TRAILER_SIZE:])[0]
    return blob[:moff], blob[-TRAILER_SIZE:], json.loads(manifest_text(blob))


def rebuild(prefix: bytes, manifest: dict[str, Any]) -> bytes:
    """A container with ``prefix`` (header + data) and ``manifest`` (stored the way the prefix's
    header says: compressed or not), with a *correct* manifest checksum, so that only validation
    can reject a forged field."""
    body = json.dumps(manifest, separators=(",", ":")).encode()
    if manifest_compressed(prefix):
        body = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(body)
    return prefix + body + _TRAILER.pack(len(prefix), len(body), xxhash.xxh3_64_intdigest(body), TRAILER_MAGIC)


def forge(blob: bytes, edit: Any) -> bytes:
    """Apply ``edit(manifest)`` (in place) and rebuild with a recomputed manifest checksum."""
    prefix, _t, m = split(blob)
    edit(m)
    return rebuild(prefix, m)


def chunk_ranges(blob: bytes) -> list[tuple[int, int]]:
    """(offset, length) of every stored chunk, in manifest order."""
    _p, _t, m = split(blob)
    return [(c[1], c[2]) for s in m["storages"] for c in s["chunks"]]


__all__ = [
    "HEADER_SIZE",
    "TRAILER_SIZE",
    "bits",
    "assert_same_tensor",
    "roundtrip",
    "encode",
    "manifest_compressed",
    "split",
    "rebuild",
    "forge",
    "chunk_ranges",
]


@contextlib.contextmanager
def deflate_plane0() -> Iterator[None]:
    """While active, the CPU writer codes plane 0 of every float storage as raw deflate, as the
    GPU's portable profile (nvCOMP Deflate) and s4weights <= 0.4's CPU writer do; the other chunks
    as it chooses (zstd, raw). Lets CPU-only tests build files that hold every codec's chunks."""
    from s4w_core.codecs import DEFLATE, chunk
    from s4w_core.format.manifest import PLANE_TRANSFORMS

    choose = chunk.choose_codec
    chunk.choose_codec = lambda transform, j, plane: (  # type: ignore[assignment]
        DEFLATE if transform in PLANE_TRANSFORMS and j == 0 else choose(transform, j, plane)
    )
    try:
        yield
    finally:
        chunk.choose_codec = choose  # type: ignore[assignment]


def cpu_writer_with(transform: str) -> Callable[..., Any]:
    """``engine.encode_storage_cpu`` writing ``transform`` (e.g. ``"planes"``) for every storage of a
    byte-plane dtype (monkeypatch it over ``s4w_core.engine.encode_storage_cpu``)."""
    from s4w_core import engine
    from s4w_core.planes import PLANE_DTYPES, plane_width

    orig = engine.encode_storage_cpu

    @functools.wraps(orig)
    def enc(job: engine.StorageJob, writer: Any, pool: Any, segment_elems: int | None = None, **kw: Any) -> Any:
        if job.dtype in PLANE_DTYPES and job.raw.numel() % plane_width(job.dtype) == 0:
            kw.setdefault("transform", transform)
        return orig(job, writer, pool, segment_elems, **kw)

    return enc

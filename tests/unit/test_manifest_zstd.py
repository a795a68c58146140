"""The manifest stored as one zstd frame (header flag bit 0, docs/FORMAT.md 2.1/2.3): written when it
is smaller, read back by every path; containers without the flag (every file written before it) still
read; and a compressed manifest is untrusted input like the rest (checksum first, bounded size)."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
import xxhash
import zstandard

import s4w_core
from s4w_core.errors import ChecksumMismatchError, ManifestError, UnsupportedVersionError
from s4w_core.format import container as ct
from s4w_core.format.container import (
    FLAG_MANIFEST_ZSTD,
    HEADER_SIZE,
    MAX_MANIFEST_BYTES,
    TRAILER_MAGIC,
    TRAILER_SIZE,
    ContainerReader,
    ContainerWriter,
)
from tests.unit.helpers import assert_same_tensor, encode, manifest_compressed, split

_TRAILER = struct.Struct("<QQQ8s")


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b": torch.randn(48, generator=g),
        "i": torch.arange(100, dtype=torch.int64),
        "step": 3,
    }


def _flags(blob: bytes) -> int:
    return int(struct.unpack_from("<H", blob, 10)[0])


def _with_manifest(prefix: bytes, stored: bytes, flags: int | None = None) -> bytes:
    """``prefix`` (header + data) with header flags ``flags`` (unchanged if None), then ``stored``
    as the manifest bytes and a trailer with their *correct* checksum."""
    b = bytearray(prefix)
    if flags is not None:
        struct.pack_into("<H", b, 10, flags)
    return bytes(b) + stored + _TRAILER.pack(len(b), len(stored), xxhash.xxh3_64_intdigest(stored), TRAILER_MAGIC)


def _json(m: object) -> bytes:
    return json.dumps(m, separators=(",", ":")).encode()


def _zstd(body: bytes, **kw: object) -> bytes:
    kw.setdefault("write_content_size", True)
    return zstandard.ZstdCompressor(level=1, **kw).compress(body)  # type: ignore[arg-type]


def _load_err(blob: bytes) -> Exception:
    with pytest.raises(Exception) as ei:
        s4w_core.load(blob)
    return ei.value


@pytest.fixture(scope="module")
def blob() -> bytes:
    return encode(_state())


def test_writer_stores_the_manifest_compressed_when_smaller(blob: bytes) -> None:
    moff, mlen, _h, _m = _TRAILER.unpack(blob[-TRAILER_SIZE:])
    stored = blob[moff : moff + mlen]
    assert _flags(blob) == FLAG_MANIFEST_ZSTD and manifest_compressed(blob)
    assert stored[:4] == b"\x28\xb5\x2f\xfd"  # one zstd frame
    text = zstandard.ZstdDecompressor().decompress(stored)
    assert len(stored) < len(text) == zstandard.frame_content_size(stored)
    r = ContainerReader.from_bytes(blob)
    assert r.flags == FLAG_MANIFEST_ZSTD and r.manifest == json.loads(text)
    back = s4w_core.load(blob)
    for k, v in _state().items():
        if isinstance(v, torch.Tensor):
            assert_same_tensor(v, back[k])
    assert s4w_core.verify(blob).ok
    assert s4w_core.info(blob)["tensors"] == 3


def test_reads_a_container_written_without_the_flag(blob: bytes) -> None:
    """The layout before the flag, built by hand: flags 0, the manifest as plain JSON text."""
    prefix, _t, m = split(blob)
    old = _with_manifest(prefix, _json(m), flags=0)
    assert _flags(old) == 0 and old[-TRAILER_SIZE - 1 : -TRAILER_SIZE] == b"}"
    r = ContainerReader.from_bytes(old)
    assert r.flags == 0 and r.manifest == m
    back = s4w_core.load(old)
    for k, v in _state().items():
        if isinstance(v, torch.Tensor):
            assert_same_tensor(v, back[k])
    assert s4w_core.verify(old).ok
    # the same bytes through a file and through ranged reads (a store's object)
    with ContainerReader.from_file(io.BytesIO(old)) as fr:
        assert fr.manifest == m
    ranged = ContainerReader(lambda o, n: old[o : o + n], len(old), "ranged")
    assert ranged.manifest == m


def test_writer_keeps_a_manifest_zstd_cannot_shrink_plain() -> None:
    out = io.BytesIO()
    w = ContainerWriter(out)
    w.add_chunk(b"abc")
    size = w.finish({})
    data = out.getvalue()
    assert size == len(data) == HEADER_SIZE + 3 + 2 + TRAILER_SIZE
    assert _flags(data) == 0 and data[HEADER_SIZE + 3 : HEADER_SIZE + 5] == b"{}"
    assert ContainerReader.from_bytes(data).manifest == {}


def test_small_file_never_larger_than_with_a_plain_manifest(blob: bytes) -> None:
    prefix, _t, m = split(blob)
    assert len(blob) < len(_with_manifest(prefix, _json(m), flags=0))


def test_manifest_checksum_is_checked_before_decompressing(blob: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> bytes:
        raise AssertionError("decompressed a manifest whose checksum was not checked")

    monkeypatch.setattr(ct, "inflate_manifest", boom)
    moff = _TRAILER.unpack(blob[-TRAILER_SIZE:])[0]
    for pos in range(moff, len(blob) - TRAILER_SIZE, 7):
        b = bytearray(blob)
        b[pos] ^= 0x20
        err = _load_err(bytes(b))
        assert isinstance(err, ChecksumMismatchError) and "manifest" in str(err)


def _manifest_error(blob: bytes, *words: str) -> None:
    err = _load_err(blob)
    assert isinstance(err, ManifestError), repr(err)
    for w in words:
        assert w in str(err), str(err)


def test_corrupt_compressed_manifest(blob: bytes) -> None:
    """Stored bytes that are not exactly one valid frame of the JSON text: each a ManifestError
    (the checksum is right, so only the decompression can tell)."""
    prefix, _t, m = split(blob)
    text = _json(m)
    good = _zstd(text)
    cases = {
        "not a frame": (b"{not zstd at all}", "not a zstd frame"),
        "empty": (b"", "not a zstd frame"),
        "truncated frame": (good[: len(good) // 2], "compressed manifest"),
        "no declared size": (_zstd(text, write_content_size=False), "does not declare its size"),
        "two frames": (good + good, "declares"),
        "plain JSON under the flag": (text, "not a zstd frame"),
    }
    corrupt = bytearray(good)
    corrupt[zstandard.frame_header_size(good)] |= 0b110  # the first block's type: 3, reserved
    cases["corrupt block"] = (bytes(corrupt), "compressed manifest is corrupt")
    for name, (stored, word) in cases.items():
        _manifest_error(_with_manifest(prefix, stored), word)
        assert name


def test_compressed_manifest_without_the_flag_is_not_json(blob: bytes) -> None:
    prefix, _t, m = split(blob)
    _manifest_error(_with_manifest(prefix, _zstd(_json(m)), flags=0), "not valid JSON")


def _frame(declared: int, content: bytes) -> bytes:
    """A zstd frame by hand: single segment, 8-byte content size ``declared``, one raw block."""
    fhd = 0b1110_0000  # frame content size field 8 bytes, single segment, no checksum, no dict
    block = struct.pack("<I", (len(content) << 3) | 1)[:3]  # raw block, last
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + struct.pack("<Q", declared) + block + content


def test_oversize_decompressed_manifest(blob: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix, _t, m = split(blob)
    text = _json(m)
    assert zstandard.ZstdDecompressor().decompress(_frame(len(text), text)) == text  # the hand-made frame is valid
    # a declared size past the bound: refused before anything is decompressed or allocated
    _manifest_error(_with_manifest(prefix, _frame(MAX_MANIFEST_BYTES + 1, text)), "declares", "more than")
    _manifest_error(_with_manifest(prefix, _frame(1 << 62, text)), "declares", "more than")
    # a frame that produces more than it declares (a zip bomb's shape): stopped one piece past it
    _manifest_error(_with_manifest(prefix, _frame(10, text)), "compressed manifest")
    # a real manifest over a (lowered) bound
    monkeypatch.setattr(ct, "MAX_MANIFEST_BYTES", len(text) - 1)
    _manifest_error(blob, "more than")
    monkeypatch.setattr(ct, "MAX_MANIFEST_BYTES", len(text))
    assert ContainerReader.from_bytes(blob).manifest == m


def test_zip_bomb_is_read_in_bounded_pieces(blob: bytes) -> None:
    """A frame of the manifest followed by a second one of 256 MiB of zeros (a few KiB stored):
    decompression stops one byte past the declared size, having allocated about the manifest."""
    import tracemalloc

    prefix, _t, m = split(blob)
    text = _json(m)
    bomb = _zstd(text) + _zstd(bytes(256 << 20))
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match="decodes to more than"):
            ct.inflate_manifest(bomb, "bomb")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(text) + (1 << 20), peak
    _manifest_error(_with_manifest(prefix, bomb), "more than")


def test_unknown_flag_bits_are_refused(blob: bytes) -> None:
    """Bit 0 is known; any other set bit (alone or beside bit 0) is refused as from a newer writer."""
    prefix, _t, m = split(blob)
    for flags in (0x2, 0x4, 0x100, 0x8000, FLAG_MANIFEST_ZSTD | 0x2, 0xFFFF):
        b = bytearray(blob)
        struct.pack_into("<H", b, 10, flags)
        err = _load_err(bytes(b))
        assert isinstance(err, UnsupportedVersionError) and "flags" in str(err) and "upgrade" in str(err), err
    # the same for a file with a plain manifest
    plain = _with_manifest(prefix, _json(m), flags=0x2)
    assert isinstance(_load_err(plain), UnsupportedVersionError)


def test_gc_frees_a_loaded_checkpoint_without_the_cyclic_collector(blob: bytes) -> None:
    """Dropping what load returned frees its tensors at once (no reference cycle holds them)."""
    import gc
    import weakref

    was = gc.isenabled()
    gc.disable()
    try:
        back = s4w_core.load(blob)
        ref = weakref.ref(back["w"])
        del back
        assert ref() is None
    finally:
        if was:
            gc.enable()

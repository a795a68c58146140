"""Codec registry.

A codec id names a *format*, never a device.  Two implementations (CPU, GPU) may share an id only
if each decodes the other's output; the manifest records per codec whether it has a CPU decoder.

CPU implementations live here and take/return bytes-like objects; GPU implementations live in
:mod:`s4w_core.codecs.gpu` (imported lazily, only where CUDA is present).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

from s4w_core.errors import BackendUnavailableError, DecodeError, UnknownCodecError

__all__ = ["Codec", "CODECS", "get_codec", "RAW", "DEFLATE", "ZSTD", "NVCOMP_ANS"]

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Codec:
    """One chunk codec.

    Attributes:
        id: the id written into the manifest.
        cpu_decodable: a CPU-only machine can decode it (true for every codec of the portable profile).
        encode_cpu / decode_cpu: CPU implementation, or ``None`` where there is none.
    """

    id: str
    cpu_decodable: bool
    encode_cpu: Callable[[Buffer], bytes] | None
    decode_cpu: Callable[[Buffer, int], bytes] | None
    description: str

    def decode(self, data: Buffer, raw_len: int) -> bytes:
        if self.decode_cpu is None:
            raise BackendUnavailableError(
                f"codec {self.id!r} has no CPU decoder; decode this checkpoint on a machine with a "
                "CUDA GPU and `pip install s4weights[gpu-cu12]` (or gpu-cu13), or convert it there "
                "with `s4w convert PATH OUT --profile portable`"
            )
        out = self.decode_cpu(data, raw_len)
        if len(out) != raw_len:
            raise DecodeError(f"codec {self.id!r} produced {len(out)} bytes, expected {raw_len}")
        return out


# ----------------------------------------------------------------------------- raw
def _raw_encode(data: Buffer) -> bytes:
    return bytes(data)


def _raw_decode(data: Buffer, raw_len: int) -> bytes:
    return bytes(data)


# ----------------------------------------------------------------------------- deflate
# RFC 1951 raw deflate. We write Huffman-only blocks (no LZ77: float planes have no useful
# matches, and Huffman-only is 3x faster to write and beats zstd's ratio on exponent planes;
# see benchmarks/results). Any RFC 1951 stream decodes, on the CPU with ISA-L (or zlib) and on
# the GPU with nvCOMP's Deflate decoder.
try:  # ISA-L inflates ~3x faster than zlib; optional
    from isal import isal_zlib as _inflate_mod
except ImportError:  # pragma: no cover - isal is a hard dependency, kept optional for robustness
    _inflate_mod = zlib  # type: ignore[assignment,misc]


try:  # zlib-ng's Huffman-only deflate is ~2.5x faster than zlib's; same format
    from zlib_ng import zlib_ng as _deflate_mod
except ImportError:  # pragma: no cover - zlib-ng is a dependency, zlib the fallback
    _deflate_mod = zlib  # type: ignore[assignment,misc]


def _deflate_encode(data: Buffer) -> bytes:
    c = _deflate_mod.compressobj(1, _deflate_mod.DEFLATED, -15, 9, _deflate_mod.Z_HUFFMAN_ONLY)
    return c.compress(data) + c.flush()


def _deflate_decode(data: Buffer, raw_len: int) -> bytes:
    d = _inflate_mod.decompressobj(-15)
    try:
        out = d.decompress(data, raw_len)
    except Exception as e:  # zlib.error / isal error on a corrupt stream
        raise DecodeError(f"deflate stream is corrupt: {e}") from e
    if len(out) != raw_len or not d.eof:
        raise DecodeError(
            f"deflate stream decodes to a different length than the {raw_len} bytes recorded"
        )
    return out


# ----------------------------------------------------------------------------- zstd
def _zstd_encode(data: Buffer) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)


def _zstd_decode(data: Buffer, raw_len: int) -> bytes:
    import io

    import zstandard

    try:
        # A stream reader never allocates more than we ask for, whatever size the frame claims.
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
            out = r.read(raw_len + 1)
    except zstandard.ZstdError as e:
        raise DecodeError(f"zstd frame is corrupt: {e}") from e
    return out


RAW = Codec("raw", True, _raw_encode, _raw_decode, "bytes stored as they are")
DEFLATE = Codec(
    "deflate", True, _deflate_encode, _deflate_decode, "RFC 1951 raw deflate (Huffman-only when we write it)"
)
ZSTD = Codec("zstd", True, _zstd_encode, _zstd_decode, "one Zstandard frame (RFC 8878)")
NVCOMP_ANS = Codec(
    "nvcomp-ans",
    False,
    None,
    None,
    "one nvCOMP ANS RAW bitstream (nvCOMP >= 6.0, uint8 symbols); GPU-only, no CPU decoder exists",
)

CODECS: dict[str, Codec] = {c.id: c for c in (RAW, DEFLATE, ZSTD, NVCOMP_ANS)}


def get_codec(codec_id: str) -> Codec:
    try:
        return CODECS[codec_id]
    except KeyError:
        raise UnknownCodecError(
            f"unknown codec id {codec_id!r}; this s4weights knows {sorted(CODECS)}: upgrade s4weights "
            "(`pip install -U s4weights`) to read this checkpoint"
        ) from None

"""Codec registry.

A codec id names a *format*, never a device.  Two implementations (CPU, GPU) may share an id only
if each decodes the other's output; the manifest records per codec whether it has a CPU decoder.

CPU implementations live here and take/return bytes-like objects; GPU implementations live in
:mod:`s4w_core.codecs.gpu` (imported lazily, only where CUDA is present).
"""

from __future__ import annotations

import io
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from s4w_core.errors import BackendUnavailableError, DecodeError, UnknownCodecError

__all__ = ["Codec", "CODECS", "get_codec", "RAW", "DEFLATE", "ZSTD", "NVCOMP_ANS", "PLANE_PARAMS", "zstd_encode_plane"]

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
    decode_cpu: Callable[[Buffer, int], Buffer] | None
    description: str

    def decode(self, data: Buffer, raw_len: int) -> Buffer:
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


def _raw_decode(data: Buffer, raw_len: int) -> Buffer:
    return data if isinstance(data, (bytes, memoryview)) else bytes(data)  # no copy of a chunk read for us


# ----------------------------------------------------------------------------- deflate
# RFC 1951 raw deflate, Huffman-only blocks (no LZ77: float planes have no useful matches). The
# GPU writes it in the portable profile (nvCOMP's Deflate); any RFC 1951 stream decodes, on the CPU
# with ISA-L (or zlib) and on the GPU with nvCOMP's Deflate decoder. The CPU writer of 0.1.0 wrote it
# for planes too; it now writes zstd frames tuned for planes (PLANE_PARAMS: same ratio, faster),
# and deflate only for exponent chunks under 64 KiB, where its smaller header wins.
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
# One compressor / decompressor per thread (python-zstandard's contexts are not thread-safe, and
# making one costs more than coding a small chunk).
_tls = threading.local()

#: Parameters the CPU path codes byte planes with. Level 1 with the shortest hash table and the
#: longest minimum match: zstd then finds almost no matches in a float plane and spends its time
#: in huff0, its Huffman coder (4 streams, table-driven). On the exponent plane of a trained bf16
#: state this gives deflate's Huffman-only ratio (2.82 against 2.81) at ~3x its encode speed and
#: ~2x ISA-L's inflate speed; mantissa planes 7x / 3x (benchmarks/bench_cpu_core.py --planes).
PLANE_PARAMS = {"compression_level": 1, "min_match": 7, "hash_log": 7}


def _zstd_ctx(kind: str) -> Any:
    """This thread's zstd context: ``zplane`` / ``z3`` compressors, ``unzstd`` the decompressor."""
    c = getattr(_tls, kind, None)
    if c is None:
        import zstandard

        if kind == "zplane":
            params = zstandard.ZstdCompressionParameters(**PLANE_PARAMS, write_content_size=True)
            c = zstandard.ZstdCompressor(compression_params=params)
        elif kind == "z3":
            c = zstandard.ZstdCompressor(level=3, write_content_size=True)
        else:
            c = zstandard.ZstdDecompressor()
        setattr(_tls, kind, c)
    return c


def _zstd_encode(data: Buffer) -> bytes:
    return _zstd_ctx("z3").compress(data)


def zstd_encode_plane(data: Buffer) -> bytes:
    """One zstd frame (codec ``zstd``) of a byte plane, coded with :data:`PLANE_PARAMS`."""
    return _zstd_ctx("zplane").compress(data)


def _zstd_decode(data: Buffer, raw_len: int) -> bytes:
    import zstandard

    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise DecodeError(f"zstd frame is corrupt: {e}") from e
    try:
        if declared == raw_len:  # the buffer is allocated at the size the frame declares: checked
            return _zstd_ctx("unzstd").decompress(data)
        if declared >= 0:
            raise DecodeError(f"zstd frame declares {declared} bytes, expected {raw_len}")
        # No declared size (not written by s4weights): a stream reader never allocates more than
        # we ask for.
        with _zstd_ctx("unzstd").stream_reader(io.BytesIO(data)) as r:
            return r.read(raw_len + 1)
    except zstandard.ZstdError as e:
        raise DecodeError(f"zstd frame is corrupt: {e}") from e


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

"""Probe nvCOMP facts the GPU backend relies on (run on a GPU machine; prints JSON).

* ANS RAW batch encode/decode into caller-owned torch buffers (``as_arrays(buf, offsets, sizes)``
  as ``out=``), and the alignment each codec requires;
* codec ids shared between CPU and GPU implementations decode each other's output:
  nvCOMP Deflate (algorithm_type 0/1/2) output read by zlib, and zlib's Huffman-only raw deflate
  (what the CPU writer produces, 64 KiB and 1 MiB chunks) read by nvCOMP's Deflate decoder;
  zstandard frames read by nvCOMP's Zstd decoder;
* the cost of creating a codec.

Usage: ``python benchmarks/probe_nvcomp.py [OUT.json]``
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import zlib
from typing import Any, Callable

import torch
from nvidia import nvcomp


def exponent_plane(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16)
    return ((((x.to(torch.int32) & 0xFFFF) << 1) >> 8) & 0xFF).to(torch.uint8).numpy().tobytes()


def dev_buf(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()


def batch_encode(c: Any, chunks: list[bytes], stream: int) -> list[bytes]:
    align = 256
    offs, pos = [], 0
    for ch in chunks:
        offs.append(pos)
        pos += -(-len(ch) // align) * align
    src = torch.zeros(pos, dtype=torch.uint8)
    for o, ch in zip(offs, chunks):
        src[o : o + len(ch)] = torch.frombuffer(bytearray(ch), dtype=torch.uint8)
    src = src.cuda()
    cap = c.get_max_comp_buffer_size(
        nvcomp.as_array(torch.empty(max(map(len, chunks)), dtype=torch.uint8, device="cuda"), stream)
    )
    cap = -(-cap // align) * align
    out = torch.empty(cap * len(chunks), dtype=torch.uint8, device="cuda")
    res = c.encode(
        nvcomp.as_arrays(src, offs, [len(x) for x in chunks], stream),
        out=nvcomp.as_arrays(out, [i * cap for i in range(len(chunks))], [cap] * len(chunks), stream),
    )
    sizes = list(res.buffer_sizes)
    host = out.cpu().numpy().tobytes()
    return [host[i * cap : i * cap + s] for i, s in enumerate(sizes)]


def batch_decode(c: Any, comp: list[bytes], raw_lens: list[int], stream: int) -> list[bytes]:
    align = 256
    offs, pos = [], 0
    for ch in comp:
        offs.append(pos)
        pos += -(-len(ch) // align) * align
    src = torch.zeros(pos, dtype=torch.uint8)
    for o, ch in zip(offs, comp):
        src[o : o + len(ch)] = torch.frombuffer(bytearray(ch), dtype=torch.uint8)
    src = src.cuda()
    doffs, dpos = [], 0
    for n in raw_lens:
        doffs.append(dpos)
        dpos += -(-n // align) * align
    out = torch.full((dpos,), 0xEE, dtype=torch.uint8, device="cuda")
    res = c.decode(
        nvcomp.as_arrays(src, offs, [len(x) for x in comp], stream), out=nvcomp.as_arrays(out, doffs, raw_lens, stream)
    )
    sizes = list(res.buffer_sizes)
    host = out.cpu().numpy().tobytes()
    return [host[o : o + s] for o, s in zip(doffs, sizes)]


def main() -> int:
    s = torch.cuda.Stream()
    sp = s.cuda_stream
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "nvcomp": getattr(nvcomp, "__version__", "?"),
        "nvcomp_cuda": str(getattr(nvcomp, "__cuda_version__", "?")),
        "torch": torch.__version__,
    }

    def probe(name: str, fn: Callable[[], Any]) -> None:
        try:
            with torch.cuda.stream(s):
                report[name] = fn()
        except Exception as e:
            report[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        print(name, json.dumps(report[name])[:400], flush=True)

    planes64 = [exponent_plane(1 << 16, i) for i in range(8)]
    planes1m = [exponent_plane(1 << 20, 10 + i) for i in range(2)]

    def mk(alg: str, chunk: int = 1 << 16, **kw: Any) -> Any:
        return nvcomp.Codec(
            algorithm=alg, bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=sp, uncomp_chunk_size=chunk, **kw
        )

    def codec_creation() -> dict[str, float]:
        out = {}
        for alg in ("ANS", "Deflate", "Zstd"):
            t = time.perf_counter()
            mk(alg)
            out[alg + "_ms"] = round(1e3 * (time.perf_counter() - t), 2)
        return out

    probe("codec_creation", codec_creation)

    def alignments() -> dict[str, Any]:
        out = {}
        for alg in ("ANS", "Deflate", "Zstd"):
            c = mk(alg)
            out[alg] = [c.get_required_compression_alignment(), c.get_required_decompression_alignment()]
        return out

    probe("alignments", alignments)

    def ans_roundtrip() -> dict[str, Any]:
        c = mk("ANS", 1 << 18, data_type="|u1")
        chunks = [exponent_plane(1 << 18, 20), exponent_plane(1000, 21), bytes(1 << 18), exponent_plane(7, 22)]
        comp = batch_encode(c, chunks, sp)
        back = batch_decode(c, comp, [len(x) for x in chunks], sp)
        return {"ok": back == chunks, "ratios": [round(len(a) / len(b), 3) for a, b in zip(chunks, comp)]}

    probe("ans_raw_batch_roundtrip_external_buffers", ans_roundtrip)

    def nv_deflate_to_zlib() -> dict[str, Any]:
        out = {}
        for at in (0, 1, 2):
            c = mk("Deflate", 1 << 16, algorithm_type=at)
            comp = batch_encode(c, planes64, sp)
            ok = all(zlib.decompress(x, -15) == p for x, p in zip(comp, planes64))
            try:
                import isal.isal_zlib as iz

                ok_isal = all(iz.decompress(x, -15) == p for x, p in zip(comp, planes64))
            except ImportError:
                ok_isal = None
            out[f"type{at}"] = {
                "zlib_ok": ok,
                "isal_ok": ok_isal,
                "ratio": round(sum(map(len, planes64)) / sum(map(len, comp)), 4),
            }
        return out

    probe("nvcomp_deflate_output_decoded_by_zlib", nv_deflate_to_zlib)

    def zlib_to_nv_deflate() -> dict[str, Any]:
        out = {}
        for label, planes in (("64KiB", planes64), ("1MiB", planes1m)):
            comp = []
            for p in planes:
                z = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
                comp.append(z.compress(p) + z.flush())
            c = mk("Deflate", max(map(len, planes)))
            back = batch_decode(c, comp, [len(p) for p in planes], sp)
            out[label] = {"ok": back == planes}
        return out

    probe("cpu_huffman_deflate_decoded_by_nvcomp", zlib_to_nv_deflate)

    def zstd_to_nv() -> dict[str, Any]:
        import zstandard

        out = {}
        for label, planes in (("64KiB", planes64), ("1MiB", planes1m)):
            comp = [zstandard.ZstdCompressor(level=3, write_content_size=True).compress(p) for p in planes]
            c = mk("Zstd", max(map(len, planes)))
            back = batch_decode(c, comp, [len(p) for p in planes], sp)
            out[label] = {"ok": back == planes}
        return out

    probe("cpu_zstd_decoded_by_nvcomp", zstd_to_nv)

    def nv_zstd_to_cpu() -> dict[str, Any]:
        import zstandard

        c = mk("Zstd", 1 << 16)
        comp = batch_encode(c, planes64, sp)
        d = zstandard.ZstdDecompressor()
        return {"ok": all(d.decompress(x, max_output_size=1 << 20) == p for x, p in zip(comp, planes64))}

    probe("nvcomp_zstd_output_decoded_by_zstandard", nv_zstd_to_cpu)

    text = json.dumps(report, indent=2)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

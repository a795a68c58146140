"""Feasibility measurement, not product code: would an entropy coder of our own, fused with the
byte-plane merge, decode a bf16 state faster than nvCOMP ANS ``'<f2'`` at a ratio at least as good?

Why this question (docs/PERFORMANCE.md, "What the decode target needs"): s4weights decodes a bf16
batch as nvCOMP ANS on the exponent planes (~1.0 ms for the 1.82 GB state on an H100) followed by
the merge kernel that interleaves them with the raw mantissa planes (~1.2 ms, at the H100's memory
bandwidth: it reads 1.82 GB and writes 1.82 GB). nvCOMP ANS ``'<f2'`` decodes the same tensors in
~1.4 ms. No sequence of "decode a plane, then merge" can beat that; a decoder that writes the
interleaved output itself might.

The code measured here: a canonical Huffman code per 512 Ki-symbol chunk of exponent plane (code
lengths limited to 12 bits), the chunk cut into tiles of ``S`` lanes x ``L`` symbols; lane ``l`` of a
tile codes the tile's symbols ``t * S + l`` (so that at each step the lanes of a tile write adjacent
output elements) into its own 32-bit-word stream, whose start is stored (int32 per lane). One Triton
kernel decodes every lane of a tile step by step (a 64-bit bit buffer per lane, one 4096-entry lookup
table per chunk), reads the raw mantissa byte, puts the bf16 element back together (the
``planes-rotl1`` transform inverted) and stores it: one pass, final layout.

It prints, on the same tensors (a medium model's bf16 weights and AdamW moments after ``--steps``
steps of training on real text, as ``profile_codec.py``): the ratio of this code (every stored byte
counted: lane offsets, code lengths, padding), nvCOMP ANS ``'<f2'``'s ratio and decode time, the
s4weights ``fast`` codec's ratio and decode time, and this kernel's decode time (lookup tables built
on the GPU from the stored code lengths, inside the timed region), checked bit for bit. The encoder
here is torch on the GPU (scatter-add of code words), for the measurement only: its speed is not the
question and is not reported as a result.

    python benchmarks/proto_huffman.py --model medium --steps 200 --config 128x512,256x256
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

CHUNK = 1 << 19  # symbols per Huffman table (= the fast profile's 512 Ki-element segment)
MAXLEN = 12  # longest code; the lookup table has 2**MAXLEN entries per chunk


# ----------------------------------------------------------------------------- code construction
def code_lengths(hist: np.ndarray, limit: int = MAXLEN) -> np.ndarray:
    """Huffman code lengths for a 256-bin histogram, none over ``limit`` (the counts are halved
    and rebuilt until they fit, the usual way). A symbol that does not occur gets length 0."""
    h = hist.astype(np.int64).copy()
    while True:
        nz = np.nonzero(h)[0]
        lens = np.zeros(256, dtype=np.int64)
        if len(nz) == 1:
            lens[nz[0]] = 1
            return lens
        heap = [(int(h[s]), i, [int(s)]) for i, s in enumerate(nz)]
        heapq.heapify(heap)
        k = len(heap)
        while len(heap) > 1:
            c1, _, a = heapq.heappop(heap)
            c2, _, b = heapq.heappop(heap)
            lens[a + b] += 1
            heapq.heappush(heap, (c1 + c2, k, a + b))
            k += 1
        if lens.max() <= limit:
            return lens
        h = np.where(h > 0, np.maximum(h >> 1, 1), 0)


def canonical_reversed(lens: np.ndarray) -> np.ndarray:
    """Canonical codes for ``lens``, bit-reversed within their length (the stream is read from the
    least significant bit)."""
    codes = np.zeros(256, dtype=np.int64)
    code = 0
    prev = 0
    for s in sorted((s for s in range(256) if lens[s]), key=lambda s: (lens[s], s)):
        code <<= int(lens[s]) - prev
        prev = int(lens[s])
        codes[s] = int(format(code, f"0{prev}b")[::-1], 2)
        code += 1
    return codes


def build_luts(lens: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Decode tables on the device from the per-chunk code lengths and codes ([chunks, 256] each):
    entry ``p`` of chunk ``c`` = ``symbol | length << 8`` of the code that the low bits of ``p``
    start with. For each length a [chunks, 2**length] table maps a code to its symbol; an index
    takes the one length whose table has a symbol for its low bits (the code is prefix-free)."""
    nch = lens.shape[0]
    dev = lens.device
    idx = torch.arange(1 << MAXLEN, device=dev)
    lut = torch.zeros(nch, 1 << MAXLEN, dtype=torch.int32, device=dev)
    found = torch.zeros(nch, 1 << MAXLEN, dtype=torch.bool, device=dev)
    sym = torch.arange(256, device=dev).expand(nch, 256)
    rows = torch.arange(nch, device=dev)[:, None].expand(nch, 256)
    for ln in range(1, MAXLEN + 1):
        sel = lens == ln
        if not bool(sel.any()):
            continue
        t = torch.full((nch, 1 << ln), -1, dtype=torch.int32, device=dev)
        t[rows[sel], codes[sel]] = sym[sel].to(torch.int32)
        cand = t.gather(1, (idx & ((1 << ln) - 1)).expand(nch, -1))
        hit = (cand >= 0) & ~found
        lut = torch.where(hit, cand | (ln << 8), lut)
        found |= hit
    return lut.view(-1)


def encode(e: torch.Tensor, S: int, L: int) -> dict[str, Any]:
    """Code an exponent plane (uint8, padded to whole chunks) into lane streams."""
    dev = e.device
    T = S * L
    assert CHUNK % T == 0
    n = e.numel()
    nch = n // CHUNK
    group = 32 * CHUNK  # chunks are worked on in groups, so that the int64 temporaries stay small

    def sym_index(g0: int) -> torch.Tensor:  # chunk * 256 + symbol, for the group at g0
        return torch.arange(g0, min(g0 + group, n), device=dev) // CHUNK * 256 + e[g0 : g0 + group].long()

    hist = sum(torch.bincount(sym_index(g0), minlength=nch * 256) for g0 in range(0, n, group))
    hist = hist.view(nch, 256).cpu().numpy()
    lens_np = np.stack([code_lengths(h) for h in hist])
    # for comparison: the chunks' order-0 entropy, and the best fixed-width code with an escape
    # (b bits name the 2**b - 1 commonest symbols, the rest stored as bytes; 4 bytes per 4096
    # symbols locate the escapes): the simplest code a GPU decodes in parallel
    hd = hist.astype(np.float64)
    p = hd / hd.sum(1, keepdims=True)
    entropy_bits = float(-(hd * np.log2(np.where(p > 0, p, 1))).sum())
    srt = -np.sort(-hd, axis=1)
    fixed_bits = float(sum(min(min(CHUNK * b + 8 * (CHUNK - srt[c, : (1 << b) - 1].sum()) for b in range(1, 7))
                               + 8 * 4 * (CHUNK // 4096), 8 * CHUNK) for c in range(nch)))
    codes_np = np.stack([canonical_reversed(x) for x in lens_np])
    lens = torch.from_numpy(lens_np).to(dev)
    codes = torch.from_numpy(codes_np).to(dev)
    tiles = n // T
    lane_words_all = []
    for g0 in range(0, n, group):
        ln = lens.view(-1)[sym_index(g0)]
        lane_words_all.append(((ln.view(-1, L, S).sum(dim=1) + 31) // 32).view(-1))
    flat_words = torch.cat(lane_words_all)
    lane_off = torch.cumsum(flat_words, 0) - flat_words  # word offset of each lane's stream
    total_words = int(flat_words.sum())
    words = torch.zeros(total_words + 4, dtype=torch.int64, device=dev)  # +: the decoder reads ahead
    for g0 in range(0, n, group):
        sym = sym_index(g0)
        sym_len, sym_code = lens.view(-1)[sym], codes.view(-1)[sym]
        ln3 = sym_len.view(-1, L, S)
        pos_in_lane = torch.cumsum(ln3, dim=1) - ln3  # exclusive, bits
        t0 = g0 // T
        P = (lane_off[t0 * S : (t0 + ln3.shape[0]) * S].view(-1, 1, S) * 32 + pos_in_lane).view(-1)
        w = P >> 5
        sh = P & 31
        words.index_add_(0, w, (sym_code << sh) & 0xFFFFFFFF)
        words.index_add_(0, w + 1, sym_code >> (32 - sh))  # 0 where the code fits in its first word
        del sym, sym_len, sym_code, ln3, pos_in_lane, P, w, sh
    assert lane_off.numel() == tiles * S
    words32 = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    stored = 4 * total_words + 4 * lane_off.numel() + nch * 128  # words, int32 lane offsets, 4-bit lengths
    return {"words": words32, "lane_off": lane_off.to(torch.int32), "lens": lens, "codes": codes,
            "stored_bytes": stored, "bits_per_symbol": 8 * stored / n,
            "entropy_bits_per_symbol": entropy_bits / n, "fixed_width_bits_per_symbol": fixed_bits / n}


# ----------------------------------------------------------------------------- fused decode
@triton.jit
def _decode_merge_kernel(words_ptr, lane_off_ptr, lut_ptr, mant_ptr, out_ptr, n,
                         S: tl.constexpr, L: tl.constexpr, TILES_PER_CHUNK: tl.constexpr, MAXLEN: tl.constexpr):
    tile = tl.program_id(0)
    lane = tl.arange(0, S)
    off = tl.load(lane_off_ptr + tile * S + lane)
    w0 = tl.load(words_ptr + off).to(tl.uint32).to(tl.uint64)
    w1 = tl.load(words_ptr + off + 1).to(tl.uint32).to(tl.uint64)
    buf = w0 | (w1 << 32)
    nb = tl.full([S], 64, tl.int32)
    wp = off + 2
    lut = lut_ptr + (tile // TILES_PER_CHUNK) * (1 << MAXLEN)
    base = tile.to(tl.int64) * (S * L) + lane
    for t in range(L):
        ent = tl.load(lut + (buf & ((1 << MAXLEN) - 1)).to(tl.int32))
        ln = ent >> 8
        buf = buf >> ln.to(tl.uint64)
        nb = nb - ln
        need = nb <= 32
        w = tl.load(words_ptr + wp, mask=need, other=0).to(tl.uint32).to(tl.uint64)
        buf = buf | tl.where(need, w << nb.to(tl.uint64), 0)
        nb = nb + tl.where(need, 32, 0)
        wp = wp + need.to(tl.int32)
        idx = base + t * S
        m = tl.load(mant_ptr + idx, mask=idx < n, other=0).to(tl.int32)
        r = ((ent & 0xFF) << 8) | m  # rotl1(x): exponent byte, then mantissa bits and the sign
        x = (r >> 1) | ((r & 1) << 15)
        tl.store(out_ptr + idx, x.to(tl.int16), mask=idx < n)


def decode(enc: dict[str, Any], mant: torch.Tensor, out: torch.Tensor, S: int, L: int, W: int = 0) -> None:
    """``W`` warps per tile (default one lane per thread); fewer give each thread several lanes,
    whose loads it issues back to back."""
    lut = build_luts(enc["lens"], enc["codes"])
    tiles = enc["lane_off"].numel() // S
    _decode_merge_kernel[(tiles,)](enc["words"], enc["lane_off"], lut, mant, out, out.numel(),
                                   S=S, L=L, TILES_PER_CHUNK=CHUNK // (S * L), MAXLEN=MAXLEN, num_warps=W or max(1, S // 32))


# ----------------------------------------------------------------------------- the measurement
def wall_ms(fn: Any, repeats: int) -> float:
    """``profile_codec.wall`` (one warm-up, then the median of ``repeats`` synchronized wall-clock
    runs on the GPU), in milliseconds."""
    import profile_codec

    return profile_codec.wall(fn, repeats, torch.device("cuda")) * 1e3


def bench_state(model: str, steps: int, elements: int, dev: torch.device) -> dict[str, Any]:
    """The tensors measured (a trained model's bf16 weights and moments, or ``elements`` of
    synthetic data), their bits (``flat``, int16), exponent plane (``e``, uint8, padded to whole
    chunks) and mantissa plane (``mant``), after ``planes-rotl1``."""
    tr = None
    if elements:
        g = torch.Generator().manual_seed(0)
        tl_ = [(torch.randn(elements, generator=g) * 0.02).to(torch.bfloat16).to(dev)]
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import _train_gpt

        tr = _train_gpt.Trainer("bf16", max(steps, 1), device=str(dev), **_train_gpt.MODELS[model])
        for _ in range(steps):
            tr.step()
        tl_ = [t for t in tr._live() if t.dtype == torch.bfloat16 and t.numel() > 0]
    flat = torch.cat([t.reshape(-1).view(torch.int16) for t in tl_])
    n = flat.numel()
    npad = -(-n // CHUNK) * CHUNK
    x = flat.to(torch.int32) & 0xFFFF
    r = ((x << 1) | (x >> 15)) & 0xFFFF
    e = torch.zeros(npad, dtype=torch.uint8, device=dev)
    e[:n] = (r >> 8).to(torch.uint8)
    return {"trainer": tr, "tensors": tl_, "flat": flat, "n": n, "e": e, "mant": (r & 0xFF).to(torch.uint8)}


def device_for_run() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--config", default="128x512,256x256", help="lanes x symbols per lane [x warps], comma-separated")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--delta-steps", type=int, default=20,
                    help="then train this many steps more and report the code's size on the XOR delta's exponent plane")
    ap.add_argument("--elements", type=int, default=0, help="synthetic data of this many elements instead (CPU check)")
    a = ap.parse_args()
    dev = device_for_run()
    st = bench_state(a.model, a.steps, a.elements, dev)
    tr, tl_, flat, n, e, mant = st["trainer"], st["tensors"], st["flat"], st["n"], st["e"], st["mant"]
    raw = 2 * n
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                           "tensors": len(tl_), "raw_bytes": raw, "configs": []}
    if dev.type == "cuda" and not a.elements:
        import profile_codec

        res["ans_f2"] = profile_codec.run_ans(tl_, a.repeats, dev)
        s4w = profile_codec.run_s4w(tl_, CHUNK, a.repeats, dev)
        res["s4w_fast"] = {k: s4w[k] for k in ("ratio", "dec_GBps", "dec_ms", "bit_exact")}
        print("nvCOMP ANS '<f2':", json.dumps(res["ans_f2"]), "\ns4w fast:", json.dumps(res["s4w_fast"]), flush=True)
    for cfg in a.config.split(","):
        S, L, W = ([int(v) for v in cfg.split("x")] + [0])[:3]
        enc = encode(e, S, L)
        out = torch.empty(n, dtype=torch.int16, device=dev)
        decode(enc, mant, out, S, L, W)
        exact = bool(torch.equal(out, flat))
        row: dict[str, Any] = {"lanes": S, "symbols_per_lane": L, "warps": W or max(1, S // 32), "bit_exact": exact,
                               "exponent_bits_per_symbol": round(enc["bits_per_symbol"], 4),
                               "order0_entropy_bits": round(enc["entropy_bits_per_symbol"], 4),
                               "fixed_width_escape_bits": round(enc["fixed_width_bits_per_symbol"], 4),
                               "ratio": raw / (enc["stored_bytes"] + n)}
        if dev.type == "cuda":
            ms = wall_ms(lambda enc=enc, out=out, S=S, L=L, W=W: decode(enc, mant, out, S, L, W), a.repeats)
            row.update(dec_ms=round(ms, 3), dec_GBps=round(raw / ms / 1e6, 1))
            if "ans_f2" in res:
                row["dec_vs_ans_f2"] = round(res["ans_f2"]["dec_ms"] / ms, 3)
                row["ratio_vs_ans_f2"] = round(row["ratio"] / res["ans_f2"]["ratio"], 4)
        res["configs"].append(row)
        print(json.dumps(row), flush=True)
        if not exact:
            print("MISMATCH", flush=True)
            return 1
    if a.delta_steps and not a.elements:
        for _ in range(a.delta_steps):
            tr.step()
        d = torch.cat([t.reshape(-1).view(torch.int16) for t in tl_]) ^ flat
        x = d.to(torch.int32) & 0xFFFF
        e[:n] = ((((x << 1) | (x >> 15)) & 0xFFFF) >> 8).to(torch.uint8)
        enc = encode(e, *(int(v) for v in a.config.split(",")[0].split("x")[:2]))
        res["xor_delta"] = {"after_steps": a.delta_steps, "exponent_bits_per_symbol": round(enc["bits_per_symbol"], 4),
                            "order0_entropy_bits": round(enc["entropy_bits_per_symbol"], 4),
                            "fixed_width_escape_bits": round(enc["fixed_width_bits_per_symbol"], 4)}
        print("XOR delta:", json.dumps(res["xor_delta"]), flush=True)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Feasibility measurement, not product code: an exponent-plane code that a GPU decodes fully in
parallel (no sequential bit stream), decoded and merged with the mantissa plane in one pass.

``proto_huffman.py`` showed that a Huffman decoder in Triton is bound by each lane's chain of
lookups (4-9x slower than nvCOMP ANS ``'<f2'``). This code has no chain: every symbol's position is
known from its index and a prefix count.

The code, per 512 Ki-symbol chunk of the exponent plane: the chunk's symbols ranked by frequency;
up to three *levels* of fixed-width codes. Level 1 holds a ``b1``-bit code for every symbol: ranks
``0 .. 2**b1 - 2`` as themselves, ``2**b1 - 1`` meaning "the next level" (on the last level every
value is a rank). Level 2 holds a ``b2``-bit code for each symbol level 1 escaped, in element order;
level 3 the same for level 2's escapes. The widths are chosen per chunk from its histogram, for the
fewest bits. A decoder finds a symbol's level-2 entry by counting the escapes before it in its block
of 4096 symbols (a prefix sum inside the block) plus the count before the block (stored, 4 bytes per
block and level); levels are read with byte loads at computed bit offsets.

One Triton program per block decodes the levels, maps ranks to symbols, reads the raw mantissa
byte, undoes ``planes-rotl1`` and stores the bf16 element. Printed beside it, on the same tensors
(``proto_huffman.py``'s state): nvCOMP ANS ``'<f2'`` and the s4weights fast profile. The encoder
here is torch (scatter-add of code bits), for the measurement only.

    python benchmarks/proto_levels.py --model medium --steps 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proto_huffman import CHUNK, bench_state, device_for_run, wall_ms  # noqa: E402

BLOCK = 4096  # symbols per decode program and per stored escape count


def choose_widths(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk ([chunks, 256] histogram): the widths (b1, b2, b3; 0 = level unused) with the fewest
    bits, and the rank order (symbols by falling count)."""
    nch = hist.shape[0]
    order = np.argsort(-hist, axis=1, kind="stable")
    hs = np.take_along_axis(hist, order, axis=1).astype(np.float64)
    cum = np.concatenate([np.zeros((nch, 1)), np.cumsum(hs, axis=1)], axis=1)
    n = cum[:, -1]
    distinct = (hs > 0).sum(axis=1)
    best = np.full(nch, np.inf)
    widths = np.zeros((nch, 3), dtype=np.int64)
    for levels in (1, 2, 3):
        for bs in itertools.product(range(1, 9), repeat=levels):
            cost = np.zeros(nch)
            reach = n.copy()
            covered = 0
            for i, b in enumerate(bs):
                cost += reach * b
                covered += (1 << b) - (0 if i == levels - 1 else 1)
                reach = n - cum[:, min(covered, 256)]
            ok = distinct <= covered
            better = ok & (cost < best)
            best = np.where(better, cost, best)
            widths[better] = list(bs) + [0] * (3 - levels)
    return widths, order


def encode(e: torch.Tensor) -> dict[str, Any]:
    """Code an exponent plane (uint8, whole chunks) into the three levels' byte regions."""
    dev = e.device
    n = e.numel()
    nch = n // CHUNK
    bpc = CHUNK // BLOCK
    hist = torch.zeros(nch * 256, dtype=torch.int64, device=dev)
    for g0 in range(0, n, 32 * CHUNK):
        seg = e[g0 : g0 + 32 * CHUNK].long()
        hist += torch.bincount(torch.arange(g0, g0 + seg.numel(), device=dev) // CHUNK * 256 + seg, minlength=nch * 256)
    hist_np = hist.view(nch, 256).cpu().numpy()
    widths_np, order_np = choose_widths(hist_np)
    rank_np = np.argsort(order_np, axis=1)
    widths = torch.from_numpy(widths_np).to(dev)
    rank = torch.from_numpy(rank_np).to(dev)
    b1, b2, b3 = widths[:, 0], widths[:, 1], widths[:, 2]
    nlev = (widths > 0).sum(1)
    k1 = torch.where(nlev > 1, (1 << b1) - 1, 1 << 30)  # ranks level 1 names (escape code = k1)
    k2 = torch.where(nlev > 2, (1 << b2) - 1, 1 << 30)
    # entries of levels 2 and 3 per chunk, from the histogram (ranks at or past k1, k1 + k2)
    hs = np.take_along_axis(hist_np, order_np, axis=1)
    cum = np.concatenate([np.zeros((nch, 1), dtype=np.int64), np.cumsum(hs, axis=1)], axis=1)
    k1n, k2n = k1.cpu().numpy(), k2.cpu().numpy()
    n2 = torch.from_numpy(CHUNK - cum[np.arange(nch), np.minimum(k1n, 256)]).to(dev)
    n3 = torch.from_numpy(CHUNK - cum[np.arange(nch), np.minimum(k1n + k2n, 256)]).to(dev)
    # byte regions: level 1, 2, 3 of chunk 0, then of chunk 1, ... (2 bytes of slack after each)
    sz1 = CHUNK * b1 // 8 + 2
    sz2 = (n2 * b2 + 7) // 8 + 2
    sz3 = (n3 * b3 + 7) // 8 + 2
    per = torch.stack([sz1, sz2, sz3], 1).view(-1)
    offs = (torch.cumsum(per, 0) - per).view(nch, 3)
    total = int(per.sum()) + 8
    words = torch.zeros(total // 4 + 4, dtype=torch.int64, device=dev)

    def put(bits: torch.Tensor, vals: torch.Tensor) -> None:
        w, sh = bits >> 5, bits & 31
        words.index_add_(0, w, (vals << sh) & 0xFFFFFFFF)
        words.index_add_(0, w + 1, vals >> (32 - sh))

    base2 = torch.zeros(nch, bpc, dtype=torch.int64, device=dev)
    base3 = torch.zeros(nch, bpc, dtype=torch.int64, device=dev)
    idx = torch.arange(CHUNK, device=dev)
    G = 16  # chunks at a time: the int64 temporaries stay small
    for c0 in range(0, nch, G):
        cs = slice(c0, min(c0 + G, nch))
        kk1, kk2 = k1[cs, None], k2[cs, None]
        g = e[c0 * CHUNK : cs.stop * CHUNK].view(-1, CHUNK).long()
        r = rank[cs].gather(1, g)
        esc1 = r >= kk1
        esc2 = esc1 & (r - kk1 >= kk2)
        c1 = torch.cumsum(esc1.to(torch.int64), 1)
        c2 = torch.cumsum(esc2.to(torch.int64), 1)
        assert torch.equal(c1[:, -1], n2[cs]) and torch.equal(c2[:, -1], n3[cs])
        base2[cs, 1:] = c1[:, BLOCK - 1 :: BLOCK][:, :-1]
        base3[cs, 1:] = c2[:, BLOCK - 1 :: BLOCK][:, :-1]
        put((offs[cs, 0:1] * 8 + idx[None, :] * b1[cs, None]).view(-1), torch.where(esc1, kk1, r).view(-1))
        sel = esc1.view(-1)
        put((offs[cs, 1:2] * 8 + (c1 - 1) * b2[cs, None]).view(-1)[sel], torch.where(esc2, kk2, r - kk1).view(-1)[sel])
        sel = esc2.view(-1)
        put((offs[cs, 2:3] * 8 + (c2 - 1) * b3[cs, None]).view(-1)[sel], (r - kk1 - kk2).view(-1)[sel])
    stream = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).view(torch.uint8)
    meta = torch.stack([offs[:, 0], offs[:, 1], offs[:, 2], b1, b2, b3, nlev, torch.zeros_like(b1)], 1)
    bases = torch.stack([base2, base3], 2).to(torch.int32).view(-1)
    # stored: the regions (slack included), per chunk the rank order of its symbols that occur (one
    # byte each) and 8 bytes of widths and sizes, per block two 4-byte escape counts
    stored = int(per.sum()) + int((hist_np > 0).sum()) + 8 * nch + 8 * nch * bpc
    return {"stream": stream, "meta": meta.contiguous(), "bases": bases,
            "order": torch.from_numpy(order_np.astype(np.uint8)).to(dev).view(-1),
            "stored_bytes": stored, "bits_per_symbol": 8 * stored / n,
            "levels_used": {int(k): int(v) for k, v in zip(*np.unique((widths_np > 0).sum(1), return_counts=True))}}


@triton.jit
def _code_at(stream_ptr, region, bit, b, mask):
    """The ``b``-bit code at bit ``bit`` of the byte region at ``region`` (two byte loads)."""
    p = region + (bit >> 3)
    w = tl.load(stream_ptr + p, mask=mask, other=0).to(tl.int32) | (
        tl.load(stream_ptr + p + 1, mask=mask, other=0).to(tl.int32) << 8)
    return (w >> (bit & 7)) & ((1 << b) - 1)


@triton.jit
def _escape_index(esc, base, ROWS: tl.constexpr):
    """Each escape's entry on the next level: the escapes before it in the block, plus ``base``.
    ``ROWS``: the block is [B // 32, 32] rows, counted as a prefix over the rows' counts plus one
    inside each row; else one prefix sum over the block."""
    e = esc.to(tl.int32)
    if ROWS:
        rows = tl.sum(e, axis=1)
        return (tl.cumsum(rows, 0) - rows)[:, None] + tl.cumsum(e, axis=1) - 1 + base
    else:
        return tl.cumsum(e, 0) - 1 + base


@triton.jit
def _levels_decode_kernel(stream_ptr, meta_ptr, bases_ptr, order_ptr, mant_ptr, out_ptr, n, e_ptr,
                          B: tl.constexpr, BPC: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr):
    """MODE 3 decodes; 0-2 are ablations for ``--ablate`` (not bit-exact): 0 reads the exponent
    plane itself (the merge alone), 1 decodes level 1 only, 2 levels 1 and 2. ``ROWS``: see
    :func:`_escape_index`."""
    pid = tl.program_id(0)
    c = pid // BPC
    blk = pid % BPC
    if ROWS:
        i = tl.arange(0, B // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
    else:
        i = tl.arange(0, B)
    g = pid.to(tl.int64) * B + i
    if MODE == 0:
        sym = tl.load(e_ptr + g).to(tl.int32)
    else:
        mp = meta_ptr + c * 8
        b1 = tl.load(mp + 3).to(tl.int32)
        b2 = tl.load(mp + 4).to(tl.int32)
        nlev = tl.load(mp + 6).to(tl.int32)
        # level 1: a b1-bit code per symbol (bit offsets within a chunk's region fit 32 bits)
        v1 = _code_at(stream_ptr, tl.load(mp), (blk * B + i) * b1, b1, i >= 0)
        k1 = (1 << b1) - 1
        r = v1
        if MODE >= 2:
            esc1 = v1 == tl.where(nlev > 1, k1, -1)  # no escape code on the last level
            j = _escape_index(esc1, tl.load(bases_ptr + pid * 2), ROWS)
            v2 = _code_at(stream_ptr, tl.load(mp + 1), j * b2, b2, esc1)
            k2 = (1 << b2) - 1
            r = tl.where(esc1, k1 + v2, r)
            if MODE >= 3:
                b3 = tl.load(mp + 5).to(tl.int32)
                esc2 = esc1 & (v2 == tl.where(nlev > 2, k2, -1))
                j = _escape_index(esc2, tl.load(bases_ptr + pid * 2 + 1), ROWS)
                r = tl.where(esc2, k1 + k2 + _code_at(stream_ptr, tl.load(mp + 2), j * b3, b3, esc2), r)
        sym = tl.load(order_ptr + c * 256 + r).to(tl.int32)
    m = tl.load(mant_ptr + g, mask=g < n, other=0).to(tl.int32)
    x = (sym << 8) | m
    x = (x >> 1) | ((x & 1) << 15)
    tl.store(out_ptr + g, x.to(tl.int16), mask=g < n)


def decode(enc: dict[str, Any], mant: torch.Tensor, out: torch.Tensor, warps: int, mode: int = 3,
           e: torch.Tensor | None = None) -> None:
    """``mode`` 3: decode; 4: decode with the row-wise escape counts; 0-2: the ablations."""
    blocks = enc["bases"].numel() // 2
    _levels_decode_kernel[(blocks,)](enc["stream"], enc["meta"], enc["bases"], enc["order"], mant, out, out.numel(),
                                     e if e is not None else mant, B=BLOCK, BPC=CHUNK // BLOCK, MODE=min(mode, 3),
                                     ROWS=mode == 4, num_warps=warps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warps", default="8,16,4")
    ap.add_argument("--kernels", default="3,4", help="3: one prefix sum per block; 4: row-wise prefix counts")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--delta-steps", type=int, default=20)
    ap.add_argument("--no-peers", action="store_true", help="skip nvCOMP ANS and the fast profile (for ncu)")
    ap.add_argument("--ablate", action="store_true", help="also time the kernel with parts taken out (MODE 0-2)")
    ap.add_argument("--elements", type=int, default=0, help="synthetic data of this many elements instead (CPU check)")
    a = ap.parse_args()
    dev = device_for_run()
    st = bench_state(a.model, a.steps, a.elements, dev)
    flat, n, e, mant = st["flat"], st["n"], st["e"], st["mant"]
    raw = 2 * n
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                           "tensors": len(st["tensors"]), "raw_bytes": raw, "runs": []}
    if dev.type == "cuda" and not a.elements and not a.no_peers:
        import profile_codec

        res["ans_f2"] = profile_codec.run_ans(st["tensors"], a.repeats, dev)
        s4w = profile_codec.run_s4w(st["tensors"], CHUNK, a.repeats, dev)
        res["s4w_fast"] = {k: s4w[k] for k in ("ratio", "dec_GBps", "dec_ms", "bit_exact")}
        print("nvCOMP ANS '<f2':", json.dumps(res["ans_f2"]), "\ns4w fast:", json.dumps(res["s4w_fast"]), flush=True)
    enc = encode(e)
    res["code"] = {"exponent_bits_per_symbol": round(enc["bits_per_symbol"], 4), "ratio": raw / (enc["stored_bytes"] + n),
                   "chunks_by_levels": enc["levels_used"]}
    if "ans_f2" in res:
        res["code"]["ratio_vs_ans_f2"] = round(res["code"]["ratio"] / res["ans_f2"]["ratio"], 4)
    print("code:", json.dumps(res["code"]), flush=True)
    out = torch.empty(n, dtype=torch.int16, device=dev)
    for kern, warps in itertools.product((int(k) for k in a.kernels.split(",")), (int(w) for w in a.warps.split(","))):
        out.zero_()
        decode(enc, mant, out, warps, kern)
        row: dict[str, Any] = {"kernel": kern, "warps": warps, "bit_exact": bool(torch.equal(out, flat))}
        if dev.type == "cuda":
            ms = wall_ms(lambda warps=warps, kern=kern: decode(enc, mant, out, warps, kern), a.repeats)
            row.update(dec_ms=round(ms, 3), dec_GBps=round(raw / ms / 1e6, 1))
            if "ans_f2" in res:
                row["dec_vs_ans_f2"] = round(res["ans_f2"]["dec_ms"] / ms, 3)
                row["dec_vs_s4w_fast"] = round(res["s4w_fast"]["dec_ms"] / ms, 3)
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        if not row["bit_exact"]:
            print("MISMATCH", flush=True)
            return 1
    if a.ablate and dev.type == "cuda":
        w0 = int(a.warps.split(",")[0])
        for mode in (0, 1, 2):
            ms = wall_ms(lambda mode=mode: decode(enc, mant, out, w0, mode, e), a.repeats)
            res.setdefault("ablate", []).append({"mode": mode, "warps": w0, "dec_ms": round(ms, 3)})
            print(json.dumps(res["ablate"][-1]), flush=True)
        decode(enc, mant, out, w0, 0, e)
        print("mode 0 (exponent plane read as is) bit-exact:", bool(torch.equal(out, flat)), flush=True)
    if a.delta_steps and not a.elements:
        tr = st["trainer"]
        for _ in range(a.delta_steps):
            tr.step()
        d = torch.cat([t.reshape(-1).view(torch.int16) for t in st["tensors"]]) ^ flat
        x = d.to(torch.int32) & 0xFFFF
        e[:n] = ((((x << 1) | (x >> 15)) & 0xFFFF) >> 8).to(torch.uint8)
        dn = encode(e)
        res["xor_delta"] = {"after_steps": a.delta_steps, "exponent_bits_per_symbol": round(dn["bits_per_symbol"], 4),
                            "chunks_by_levels": dn["levels_used"]}
        print("XOR delta:", json.dumps(res["xor_delta"]), flush=True)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Feasibility measurement, not product code: the encode side of ``proto_levels.py``'s three-level
code, on the GPU, straight from the bf16 tensors (the split fused in), with no read-back.

Steps, all on the device and all inside the timed call:

1. a sampled histogram of each 512 Ki-symbol chunk's exponent bytes (every 128th element);
2. per chunk, the rank order of its symbols and the level widths with the fewest bits for the
   sample, among those whose last level covers all 256 byte values (a symbol the sample missed
   still has a code);
3. kernel 1, one program per 4096 symbols: reads the tensor, writes the mantissa plane, packs the
   level-1 codes (8 codes of ``b1`` bits are ``b1`` whole bytes) and counts the block's escapes;
4. prefix sums of the escape counts (torch), the level regions' offsets, the level-2/3 area zeroed;
5. kernel 2, one program per 4096 symbols: reads the tensor again and ORs each escape's code into
   its level's region at its bit offset (atomics).

It checks the output with ``proto_levels.py``'s decode kernel, bit for bit, and times the encode
against nvCOMP ANS ``'<f2'`` and the s4weights fast profile (its plan prepared once) on the same
tensors. The stored size counts the regions, the per-chunk tables and the per-block escape counts.

    python benchmarks/proto_levels_encode.py --model medium --steps 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proto_huffman import CHUNK, bench_state, device_for_run, wall_ms  # noqa: E402
from proto_levels import BLOCK, decode  # noqa: E402

SAMPLE = 128  # every SAMPLE-th element goes into the histogram (4096 per chunk)


def _combos() -> torch.Tensor:
    """(b1, b2, b3, levels) for every width choice whose last level covers all 256 values."""
    rows = []
    for levels in (1, 2, 3):
        for bs in itertools.product(range(1, 9), repeat=levels):
            covered = sum((1 << b) - (0 if i == levels - 1 else 1) for i, b in enumerate(bs))
            if covered >= 256:
                rows.append(list(bs) + [0] * (3 - levels) + [levels])
    return torch.tensor(rows, dtype=torch.int64)


@triton.jit
def _ranks(x_ptr, n, rank_ptr, wid_ptr, c, g):
    """The elements' bits after ``planes-rotl1``, their exponents' ranks, the chunk's widths, the
    codes that escape on levels 1 and 2, and which elements escape from each."""
    x = tl.load(x_ptr + g, mask=g < n, other=0).to(tl.int32) & 0xFFFF
    r16 = ((x << 1) | (x >> 15)) & 0xFFFF
    rk = tl.load(rank_ptr + c * 256 + (r16 >> 8))
    b1 = tl.load(wid_ptr + c * 4)
    b2 = tl.load(wid_ptr + c * 4 + 1)
    b3 = tl.load(wid_ptr + c * 4 + 2)
    nlev = tl.load(wid_ptr + c * 4 + 3)
    k1 = tl.where(nlev > 1, (1 << b1) - 1, 1 << 20)
    k2 = tl.where(nlev > 2, (1 << b2) - 1, 1 << 20)
    esc1 = rk >= k1
    return r16, rk, b1, b2, b3, k1, k2, esc1, esc1 & (rk - k1 >= k2)


@triton.jit
def _encode1_kernel(x_ptr, n, rank_ptr, wid_ptr, l1off_ptr, out_ptr, mant_ptr, cnt_ptr,
                    B: tl.constexpr, BPC: tl.constexpr):
    pid = tl.program_id(0)
    c = pid // BPC
    blk = pid % BPC
    g = pid.to(tl.int64) * B + tl.arange(0, B)
    r16, rk, b1, b2, b3, k1, k2, esc1, esc2 = _ranks(x_ptr, n, rank_ptr, wid_ptr, c, g)
    tl.store(mant_ptr + g, (r16 & 0xFF).to(tl.uint8), mask=g < n)
    v1 = tl.where(esc1, k1, rk).to(tl.int64)
    # 8 codes of b1 bits are b1 whole bytes
    sh = tl.arange(0, 8)[None, :].to(tl.int64) * b1
    val = tl.sum(tl.reshape(v1, (B // 8, 8)) << sh, axis=1)
    u = tl.arange(0, 8)[None, :]
    byte = (val[:, None] >> (8 * u).to(tl.int64)) & 0xFF
    dst = tl.load(l1off_ptr + c) + blk * (B // 8) * b1 + tl.arange(0, B // 8)[:, None] * b1 + u
    tl.store(out_ptr + dst, byte.to(tl.uint8), mask=u < b1)
    tl.store(cnt_ptr + pid * 2, tl.sum(esc1.to(tl.int32), 0))
    tl.store(cnt_ptr + pid * 2 + 1, tl.sum(esc2.to(tl.int32), 0))


@triton.jit
def _zero_kernel(words_ptr, bounds_ptr, BLK: tl.constexpr):
    start = tl.load(bounds_ptr)
    end = tl.load(bounds_ptr + 1)
    off = start + tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
    tl.store(words_ptr + off, tl.zeros([BLK], tl.int32), mask=off < end)


@triton.jit
def _or_bits(words_ptr, bit, v, b, m):
    w = bit >> 5
    sh = (bit & 31).to(tl.int32)
    tl.atomic_or(words_ptr + w, v << sh, mask=m, sem="relaxed")
    tl.atomic_or(words_ptr + w + 1, v >> tl.where(sh > 0, 32 - sh, 0), mask=m & (sh + b > 32), sem="relaxed")


@triton.jit
def _encode2_kernel(x_ptr, n, rank_ptr, wid_ptr, base_ptr, l2off_ptr, l3off_ptr, words_ptr,
                    B: tl.constexpr, BPC: tl.constexpr):
    pid = tl.program_id(0)
    c = pid // BPC
    g = pid.to(tl.int64) * B + tl.arange(0, B)
    r16, rk, b1, b2, b3, k1, k2, esc1, esc2 = _ranks(x_ptr, n, rank_ptr, wid_ptr, c, g)
    j = tl.cumsum(esc1.to(tl.int32), 0) - 1 + tl.load(base_ptr + pid * 2)
    _or_bits(words_ptr, tl.load(l2off_ptr + c) * 8 + j.to(tl.int64) * b2, tl.where(esc2, k2, rk - k1), b2, esc1)
    j = tl.cumsum(esc2.to(tl.int32), 0) - 1 + tl.load(base_ptr + pid * 2 + 1)
    _or_bits(words_ptr, tl.load(l3off_ptr + c) * 8 + j.to(tl.int64) * b3, rk - k1 - k2, b3, esc2)


class GpuEncoder:
    """Buffers sized once for ``n`` elements (as a prepared plan would hold them)."""

    def __init__(self, n: int, dev: torch.device) -> None:
        self.n = n
        self.npad = -(-n // CHUNK) * CHUNK
        self.nch = self.npad // CHUNK
        self.blocks = self.npad // BLOCK
        self.l2start = -(-(self.npad + 2 * self.nch + 16) // 16) * 16  # after the level-1 area's worst case
        self.out = torch.empty(self.l2start + 2 * self.npad + 2 * 2 * self.nch + 64, dtype=torch.uint8, device=dev)
        self.mant = torch.empty(self.npad, dtype=torch.uint8, device=dev)
        self.cnt = torch.empty(self.blocks * 2, dtype=torch.int32, device=dev)
        self.combos = _combos().to(dev)
        self.dev = dev

    def encode(self, flat: torch.Tensor) -> dict[str, Any]:
        dev, nch = self.dev, self.nch
        # 1. sampled histogram per chunk
        x = flat[::SAMPLE].to(torch.int32) & 0xFFFF
        ex = ((((x << 1) | (x >> 15)) & 0xFFFF) >> 8).long()
        cid = torch.arange(ex.numel(), device=dev) * SAMPLE // CHUNK
        hist = torch.bincount(cid * 256 + ex, minlength=nch * 256).view(nch, 256)
        # 2. rank order and widths per chunk
        order = torch.sort(hist, dim=1, descending=True, stable=True).indices
        rank = torch.argsort(order, dim=1).to(torch.int32)
        cum = torch.nn.functional.pad(torch.cumsum(torch.gather(hist, 1, order), 1), (1, 0))
        tot = cum[:, -1:]
        cb = self.combos
        k1 = torch.where(cb[:, 3] > 1, (1 << cb[:, 0]) - 1, 256)
        k2 = torch.where(cb[:, 3] > 2, (1 << cb[:, 1]) - 1, 256)
        reach1 = tot - cum[:, k1.clamp(max=256)]
        reach2 = tot - cum[:, (k1 + k2).clamp(max=256)]
        cost = tot * cb[:, 0] + reach1 * cb[:, 1] + reach2 * cb[:, 2]  # [chunks, combos]
        wid = cb[cost.argmin(1)]  # [chunks, 4]: b1, b2, b3, levels
        wid32 = wid.to(torch.int32).contiguous()
        b1, b2, b3 = wid[:, 0], wid[:, 1], wid[:, 2]
        sz1 = CHUNK * b1 // 8 + 2
        l1off = torch.cumsum(sz1, 0) - sz1
        # 3. kernel 1
        _encode1_kernel[(self.blocks,)](flat, self.n, rank, wid32, l1off, self.out, self.mant, self.cnt,
                                        B=BLOCK, BPC=CHUNK // BLOCK, num_warps=8)
        # 4. escape counts -> per-block bases and the level regions
        cnt = self.cnt.view(nch, CHUNK // BLOCK, 2).long()
        incl = torch.cumsum(cnt, 1)
        base = (incl - cnt).to(torch.int32).contiguous()
        n23 = incl[:, -1, :]
        sz = (n23 * torch.stack([b2, b3], 1) + 7) // 8 + 2
        offs = (torch.cumsum(sz.view(-1), 0) - sz.view(-1)).view(nch, 2) + self.l2start
        end = self.l2start + sz.sum()
        bounds = torch.stack([torch.tensor(self.l2start // 4, device=dev), (end + 3) // 4 + 1])
        words = self.out.view(torch.int32)
        zb = 4096
        _zero_kernel[(triton.cdiv(words.numel() - self.l2start // 4, zb),)](words, bounds, BLK=zb)
        # 5. kernel 2
        _encode2_kernel[(self.blocks,)](flat, self.n, rank, wid32, base, offs[:, 0].contiguous(),
                                        offs[:, 1].contiguous(), words, B=BLOCK, BPC=CHUNK // BLOCK, num_warps=8)
        meta = torch.stack([l1off, offs[:, 0], offs[:, 1], b1, b2, b3, wid[:, 3], torch.zeros_like(b1)], 1)
        return {"stream": self.out, "meta": meta.contiguous(), "bases": base.view(-1), "mant": self.mant,
                "order": order.to(torch.uint8).contiguous().view(-1), "sizes": (sz1, sz), "hist": hist}

    def stored_bytes(self, enc: dict[str, Any]) -> int:
        sz1, sz = enc["sizes"]
        # regions (slack included); per chunk its rank order (256 bytes: the sample may miss a
        # symbol, so all are kept) and 8 bytes of widths; per block two 4-byte escape counts
        return int(sz1.sum() + sz.sum()) + self.nch * (256 + 8) + self.blocks * 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--elements", type=int, default=0, help="synthetic data of this many elements instead (CPU check)")
    a = ap.parse_args()
    dev = device_for_run()
    st = bench_state(a.model, a.steps, a.elements, dev)
    flat, n = st["flat"], st["n"]
    raw = 2 * n
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                           "tensors": len(st["tensors"]), "raw_bytes": raw}
    if dev.type == "cuda" and not a.elements and not a.no_peers:
        import profile_codec

        res["ans_f2"] = profile_codec.run_ans(st["tensors"], a.repeats, dev)
        s4w = profile_codec.run_s4w(st["tensors"], CHUNK, a.repeats, dev)
        res["s4w_fast"] = {k: s4w[k] for k in ("ratio", "enc_prepared_ms", "enc_prepared_GBps", "dec_ms")}
        print("nvCOMP ANS '<f2':", json.dumps(res["ans_f2"]), "\ns4w fast:", json.dumps(res["s4w_fast"]), flush=True)
    enc_ = GpuEncoder(n, dev)
    enc = enc_.encode(flat)
    out = torch.zeros(n, dtype=torch.int16, device=dev)
    decode(enc, enc["mant"], out, 8)
    stored = enc_.stored_bytes(enc)
    row: dict[str, Any] = {"bit_exact": bool(torch.equal(out, flat)), "ratio": raw / (stored + n),
                           "exponent_bits_per_symbol": round(8 * stored / enc_.npad, 4)}
    if dev.type == "cuda":
        ms = wall_ms(lambda: enc_.encode(flat), a.repeats)
        row.update(enc_ms=round(ms, 3), enc_GBps=round(raw / ms / 1e6, 1))
        if "ans_f2" in res:
            row["enc_vs_ans_f2"] = round(res["ans_f2"]["enc_ms"] / ms, 3)
            row["enc_vs_s4w_fast_prepared"] = round(res["s4w_fast"]["enc_prepared_ms"] / ms, 3)
            row["ratio_vs_ans_f2"] = round(row["ratio"] / res["ans_f2"]["ratio"], 4)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            enc_.encode(flat)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        row["gpu_ms_by_kernel"] = {k.key[:40]: round(k.device_time_total / 1e3, 3) for k in
                                   sorted(ka, key=lambda k: -k.device_time_total)[:8]}
    res["gpu_encode"] = row
    print(json.dumps(res), flush=True)
    return 0 if row["bit_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

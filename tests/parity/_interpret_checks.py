"""Checks of the GPU backend's Triton kernels on the CPU through Triton's interpreter.

Run as ``python -m tests.parity._interpret_checks NAME...`` (tests/parity/test_triton_interpret.py
does, in a subprocess, because ``TRITON_INTERPRET=1`` must be set before triton is imported).
Each check raises AssertionError on a mismatch and prints ``ok NAME`` when it passes.

``pipeline_*`` checks run the whole GPU writer and reader (s4w_core.gpu._encode / _decode) on the
CPU: the Triton kernels through the interpreter, nvCOMP replaced by a stand-in codec (raw Huffman
deflate), streams and pinned memory by no-ops. That proves the plumbing (chunk tables, batching
across storages, order of chunks in the container, codec choice, staging, the unaligned-scratch
path, deltas, fold64 checksums) in CI; nvCOMP itself is covered by the @gpu tests on the device.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import zlib
from typing import Any, Callable, Iterator

import numpy as np
import torch

from s4w_core.planes import reference as ref

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


FP32_SPECIALS = [
    0x00000000,
    0x80000000,  # +-0
    0x7F800000,
    0xFF800000,  # +-inf
    0x7FC00000,
    0xFFC00000,
    0x7FC00001,
    0x7FFFFFFF,
    0xFFFFFFFF,  # quiet NaNs with payloads
    0x7F800001,
    0xFF800001,
    0x7FBFFFFF,
    0x7FA5A5A5,  # signalling NaNs with payloads
    0x00000001,
    0x80000001,
    0x007FFFFF,
    0x807FFFFF,
    0x00400000,  # denormals
    0x00800000,
    0x80800000,
    0x7F7FFFFF,
    0xFF7FFFFF,  # smallest normal, extremes
    0x3F800000,
    0xBF800000,
    0x40490FDB,
    0x55555555,
    0xAAAAAAAA,
]


def fp32_patterns(n_random: int, seed: int = 0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    sp = np.array(FP32_SPECIALS, dtype=np.uint32)
    rnd = g.integers(0, 1 << 32, size=n_random, dtype=np.uint64).astype(np.uint32)
    return torch.from_numpy(np.concatenate([sp, rnd]).view(np.uint8).copy())


def all16() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).clone()


def _planes_roundtrip(raw: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    from s4w_core.planes import triton_kernels as tk

    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g)
    from s4w_core import delta

    # the sub op (an arithmetic delta) against its torch definition in s4w_core.delta
    sub = tk.split_planes(raw, dtype, base, "sub")
    exp_sub = ref.split_planes(delta.forward("sub", raw, base, dtype), dtype)
    assert torch.equal(sub, exp_sub), f"split sub {dtype}"
    assert torch.equal(tk.merge_planes(exp_sub, dtype, base, "sub"), raw), f"merge sub {dtype}"
    for b in (None, base):
        p = tk.split_planes(raw, dtype, b)
        r = ref.split_planes(raw, dtype, b)
        assert torch.equal(p, r), f"split {dtype} base={b is not None}"
        m = tk.merge_planes(r, dtype, b)
        assert torch.equal(m, raw), f"merge {dtype} base={b is not None}"
        # padded plane stride and an unaligned element count inside a larger buffer
        w = ref.plane_width(dtype)
        n = raw.numel() // w
        k = n - 3
        ps = k + 37
        buf = torch.full((w * ps + 11,), 0xA5, dtype=torch.uint8)
        sub_b = b[: k * w] if b is not None else None
        tk.split_planes_into(raw[: k * w], dtype, buf[5:], ps, sub_b)
        exp = ref.split_planes(raw[: k * w], dtype, sub_b)
        for j in range(w):
            assert torch.equal(buf[5 + j * ps : 5 + j * ps + k], exp[j]), f"split_into plane {j}"
            assert bool((buf[5 + j * ps + k : 5 + (j + 1) * ps] == 0xA5).all()), "wrote past a plane"
        out = torch.full((k * w,), 0x5A, dtype=torch.uint8)
        tk.merge_planes_from(buf[5:], dtype, out, ps, sub_b)
        assert torch.equal(out, raw[: k * w]), "merge_from"


@check
def planes_bf16_fp16_all_patterns() -> None:
    raw = all16()
    for dt in (torch.bfloat16, torch.float16):
        _planes_roundtrip(raw, dt, 1)


@check
def planes_fp32_specials_random() -> None:
    _planes_roundtrip(fp32_patterns(1 << 18, seed=2), torch.float32, 3)


@check
def planes_edge_sizes() -> None:
    from s4w_core.planes import triton_kernels as tk

    g = torch.Generator().manual_seed(4)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        w = ref.plane_width(dt)
        for n in (0, 1, 2, 15, 16, 17, 4095, 4096, 4097, 3 * 4096 + 5):
            raw = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g)
            assert torch.equal(tk.split_planes(raw, dt), ref.split_planes(raw, dt)), (dt, n)
            assert torch.equal(tk.merge_planes(ref.split_planes(raw, dt), dt), raw), (dt, n)


@check
def fold64_matches_torch_definition() -> None:
    from s4w_core import checksum as ck
    from s4w_core.gpu import kernels as k

    g = torch.Generator().manual_seed(5)
    for n in (0, 1, 2, 3, 4, 5, 7, 8, 9, 1000, 2048 * 4, 2048 * 4 + 3, 100_003, 1 << 20):
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert k.fold64(x) == ck.fold64(x), n
        if n > 1:  # unaligned start: the byte-wise path
            assert k.fold64(x[1:]) == ck.fold64(x[1:].clone()), n
    for v in (0x00, 0xFF):
        x = torch.full((4099,), v, dtype=torch.uint8)
        assert k.fold64(x) == ck.fold64(x)
    # accumulation of several storages into slots
    acc = torch.zeros(3, dtype=torch.int64)
    xs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (10, 0, 50_001)]
    for i, x in enumerate(xs):
        k.fold64_into(x, acc, i)
    for i, x in enumerate(xs):
        assert k.fold64_finish(int(acc[i]), x.numel()) == ck.fold64(x)


@check
def gather_copy_ranges() -> None:
    from s4w_core.gpu import kernels as k

    g = torch.Generator().manual_seed(6)
    src = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=g)
    for aligned in (True, False):
        if aligned:
            so, do, ln = [0, 16, 1024, 160_000], [32, 20_000, 48_000, 100_000], [16, 20_000, 9984, 40_000]
        else:
            so, do, ln = [1, 17, 1023, 199_990], [3, 20_001, 48_005, 100_007], [15, 19_999, 9985, 10]
        dst = torch.zeros(150_000, dtype=torch.uint8)
        exp = dst.clone()
        for a, b, n in zip(so, do, ln):
            exp[b : b + n] = src[a : a + n]
        k.gather_copy(src, dst, so, do, ln)
        assert torch.equal(dst, exp), aligned
    # pad_ok: whole 16-byte granules (lengths not multiples of 16; rounded tails land in padding)
    so, do, ln = [0, 32, 4096, 160_000], [0, 20_000, 48_000, 100_000], [5, 19_999, 9985, 33]
    dst = torch.zeros(150_000, dtype=torch.uint8)
    k.gather_copy(src, dst, so, do, ln, pad_ok=True)
    for a, b, n in zip(so, do, ln):
        assert torch.equal(dst[b : b + n], src[a : a + n]), (a, b, n)
        assert torch.equal(dst[b + n : -(-(b + n) // 16) * 16], src[a + n : a + -(-n // 16) * 16]), "granule tail"
    try:
        k.gather_copy(src, dst, [0], [149_999], [2])
    except ValueError:
        pass
    else:
        raise AssertionError("out-of-range copy was not refused")


def encode_choice_vs_numpy(device: str = "cpu") -> None:
    """The encoder's device-side steps after the split -- the probe's gate (``probe_gate``) and the
    per-chunk choice and compaction (``choose_and_gather``) -- against a numpy model of the rule,
    over more chunks than one block of the choice kernel (its running offset crosses blocks), in
    16-byte and byte copies."""
    from s4w_core.gpu import _coder
    from s4w_core.gpu import kernels as k

    rng = np.random.default_rng(5)
    n = 2300
    runs, run = 16, _coder.PROBE_BYTES // 16
    thr = 8.0 * (1.0 - _coder.probe_min_gain())
    lengths = rng.integers(1, 9000, size=n).astype(np.int64)
    lengths[:40] = _coder.PROBE_BYTES + np.arange(-20, 20)  # around the probe's minimum
    first = (rng.random(n) < 0.3).astype(np.int64)
    for words in (True, False):
        pad = np.zeros(n, np.int64) if words else rng.integers(0, 5, size=n)
        slot = (lengths + 15) // 16 * 16 + pad
        src_off = np.cumsum(slot) - slot + (0 if words else 3)
        c0 = int(-(-int((src_off + slot).max()) // 16) * 16)
        out_np = rng.integers(0, 256, size=c0 + int(((lengths + 15) // 16 * 16).sum()) + 16, dtype=np.uint8)
        low = rng.random(n) < 0.5  # half the chunks low entropy (the probe keeps them), half random
        for c in np.nonzero(low)[0]:
            out_np[src_off[c] : src_off[c] + lengths[c]] = rng.integers(0, 6, size=int(lengths[c]), dtype=np.uint8)
        for c in np.nonzero((first == 0) & (lengths >= _coder.PROBE_BYTES))[0][:3]:  # 0 bits: the edge of a 0 gate
            out_np[src_off[c] : src_off[c] + lengths[c]] = 7
        cap = int(-(-int(lengths.max()) // 16) * 16) + 32
        comp_off = np.arange(n, dtype=np.int64) * cap + (0 if words else 1)
        comp_np = rng.integers(0, 256, size=cap * n + 16, dtype=np.uint8)
        limit = np.where(first == 1, lengths, np.ceil(lengths * 0.995)).astype(np.int64)
        size = np.where(rng.random(n) < 0.5, rng.integers(1, lengths + 1), lengths + rng.integers(0, 9, size=n))
        size[rng.random(n) < 0.05] = 0
        status = np.where(rng.random(n) < 0.03, 3, 0).astype(np.int32)

        # numpy model: the probe
        gate = lengths.copy()
        sure = np.ones(n, dtype=bool)
        for c in np.nonzero((first == 0) & (lengths >= _coder.PROBE_BYTES))[0]:
            step = (lengths[c] - run) // (runs - 1)
            sample = np.concatenate([out_np[src_off[c] + step * r : src_off[c] + step * r + run] for r in range(runs)])
            p = np.bincount(sample, minlength=256) / sample.size
            bits = -(p[p > 0] * np.log2(p[p > 0])).sum()
            sure[c] = abs(bits - thr) > 1e-3
            if bits >= thr:
                gate[c] = 0
        # numpy model: the choice and the compaction
        ok = (gate > 0) & (status == 0) & (size > 0) & (size < limit)
        olen = np.where(ok, size, lengths)
        into = ok | (first == 1)
        room = np.where(into, (olen + 15) // 16 * 16, 0)
        dst = np.where(into, c0 + np.cumsum(room) - room, src_off)
        bad = (gate > 0) & (status != 0)

        out = torch.from_numpy(out_np.copy()).to(device)
        comp = torch.from_numpy(comp_np).to(device)
        cols = {name: torch.from_numpy(np.ascontiguousarray(a)).to(device) for name, a in (
            ("gate", lengths.copy()), ("size", size.astype(np.int64)), ("length", lengths), ("limit", limit),
            ("first", first), ("src_off", src_off.astype(np.int64)), ("comp_off", comp_off))}
        cols["status"] = torch.from_numpy(status).to(device)
        k.probe_gate(out, cols["length"], cols["src_off"], cols["first"], cols["gate"], _coder.PROBE_BYTES, thr)
        got_gate = cols["gate"].cpu().numpy()
        assert (got_gate[sure] == gate[sure]).all(), np.nonzero((got_gate != gate) & sure)[0][:10]
        if not words:  # S4W_PROBE_MIN_GAIN=1 (threshold 0 bits): every later-plane chunk it samples stays raw
            g0 = torch.from_numpy(lengths.copy()).to(device)
            k.probe_gate(out, cols["length"], cols["src_off"], cols["first"], g0, _coder.PROBE_BYTES, 0.0)
            sampled = (first == 0) & (lengths >= _coder.PROBE_BYTES)
            assert (g0.cpu().numpy() == np.where(sampled, 0, lengths)).all()
        cols["gate"] = torch.from_numpy(gate).to(device)  # the model's gate from here (unsure chunks)
        res = k.choose_and_gather(cols, out, comp, c0, int(lengths.max()), words).cpu().numpy()
        assert (res[0] == ok).all() and (res[1] == olen).all(), words
        assert (res[2] == dst).all() and (res[3] == bad).all(), words
        got = out.cpu().numpy()
        for c in range(n):
            want = (comp_np[comp_off[c] : comp_off[c] + olen[c]] if ok[c]
                    else out_np[src_off[c] : src_off[c] + lengths[c]])
            assert (got[dst[c] : dst[c] + olen[c]] == want).all(), (words, c, bool(ok[c]), bool(into[c]))
        assert (got[:c0] == out_np[:c0]).all(), "a chunk left in place was written over"


@check
def encode_choice() -> None:
    encode_choice_vs_numpy("cpu")


def merge_chunks_vs_reference(device: str = "cpu") -> None:
    """The in-place merge (planes read chunk by chunk from a table of addresses, chunks scattered
    over two buffers in shuffled order) against the reference, every width and delta op, with
    16-byte aligned chunks (vector path) and with odd ones (element path)."""
    from s4w_core import delta
    from s4w_core.planes import triton_kernels as tk

    block = tk.merge_block()
    rng = np.random.default_rng(33)
    for dt, w in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        for aligned in (True, False):
            seg = 2 * block
            sizes = [1, 3, block, 2 * block + 5, 5 * block + 3, 0]
            raws = [torch.from_numpy(rng.integers(0, 256, size=n * w, dtype=np.uint8)) for n in sizes]
            bases = [torch.from_numpy(rng.integers(0, 256, size=r.numel(), dtype=np.uint8)) for r in raws]
            ops = [None, "xor", "sub", None, "sub", "xor"]
            # every chunk's bytes (the reference planes of the delta residual), in shuffled order
            chunks = []
            for i, (r, b, op) in enumerate(zip(raws, bases, ops)):
                n = r.numel() // w
                resid = delta.forward(op, r, b, dt) if op else r
                planes = ref.split_planes(resid, dt)
                for s0 in range(0, n, seg):
                    for j in range(w):
                        chunks.append((i, s0 // seg, j, planes[j, s0 : min(n, s0 + seg)].clone()))
            order = rng.permutation(len(chunks))
            bufs = [bytearray(), bytearray()]
            place = {}
            for c in order.tolist():
                i, s, j, data = chunks[c]
                b = bufs[c % 2]
                b.extend(b"\0" * ((-len(b)) % 16 + (0 if aligned else 1 + c % 7)))
                place[(i, s, j)] = (c % 2, len(b))
                b.extend(data.numpy().tobytes())
            dev_bufs = [torch.frombuffer(bytearray(b) + bytearray(16), dtype=torch.uint8).clone().to(device) for b in bufs]
            outs = [torch.full((r.numel(),), 0x5A, dtype=torch.uint8, device=device) for r in raws]
            dbases = [b.to(device) for b in bases]
            table, rows, codes = [], [], []
            for i, r in enumerate(raws):
                n = r.numel() // w
                rows.append((outs[i].data_ptr(), dbases[i].data_ptr() if ops[i] else 0, len(table), n, seg))
                codes.append(tk.OPS[ops[i]])
                for s in range(-(-n // seg)):
                    for j in range(w):
                        which, off = place[(i, s, j)]
                        table.append(dev_bufs[which].data_ptr() + off)
            tk.merge_chunks(w, torch.tensor(table, dtype=torch.int64, device=device),
                            np.array(rows, dtype=np.int64), np.array(codes, dtype=np.int64), aligned)
            for i, (o, r) in enumerate(zip(outs, raws)):
                assert torch.equal(o.cpu(), r), (dt, aligned, i, sizes[i], ops[i])
    try:
        tk.merge_chunks(2, torch.zeros(1, dtype=torch.int64), np.array([[0, 0, 0, 10, block + 1]]), np.zeros(1, np.int64), False)
    except ValueError:
        pass
    else:
        raise AssertionError("a segment that is not a whole number of blocks was accepted")


@check
def merge_chunks() -> None:
    merge_chunks_vs_reference("cpu")


def batched_kernels_vs_reference(device: str = "cpu") -> None:
    """split/merge/fold64 batched launches (table of addresses) against the reference, on ``device``."""
    from s4w_core import checksum as ck
    from s4w_core.gpu import kernels as k
    from s4w_core.planes import triton_kernels as tk

    g = torch.Generator().manual_seed(12)
    for dt, w in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        raws = [
            torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g) for n in (1, 5000, 4096, 9999, 0, 12345)
        ]
        bases = [
            None if i % 2 else torch.randint(0, 256, (r.numel(),), dtype=torch.uint8, generator=g)
            for i, r in enumerate(raws)
        ]
        layout = []
        off = 0
        for r in raws:
            n = r.numel() // w
            ps = n + (16 - n % 16) % 16 + 16
            layout.append((off, ps))
            off += w * ps + 32
        dr = [r.to(device) for r in raws]
        db = [b.to(device) if b is not None else None for b in bases]
        out = torch.zeros(off, dtype=torch.uint8, device=device)
        tk.split_planes_batched([(r, b, o, ps) for r, b, (o, ps) in zip(dr, db, layout)], w, out)
        host = out.cpu()
        for r, b, (o, ps) in zip(raws, bases, layout):
            e = ref.split_planes(r, dt, b)
            n = r.numel() // w
            for j in range(w):
                assert torch.equal(host[o + j * ps : o + j * ps + n], e[j]), (dt, n, j)
        outs = [torch.full_like(r, 0x5A) for r in dr]
        tk.merge_planes_batched([(x, b, o, ps) for x, b, (o, ps) in zip(outs, db, layout)], w, out)
        for x, r in zip(outs, raws):
            assert torch.equal(x.cpu(), r), dt
    xs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 1, 4, 7, 10000, 8191 * 4, 1 << 20)]
    acc = torch.zeros(len(xs) + 1, dtype=torch.int64, device=device)
    dxs = [x.to(device) for x in xs]
    k.fold64_batched([(x, i + 1) for i, x in enumerate(dxs)] + [(dxs[-1][3:], 0)], acc)
    sums = acc.cpu().tolist()
    for i, x in enumerate(xs):
        assert k.fold64_finish(int(sums[i + 1]), x.numel()) == ck.fold64(x), i
    assert k.fold64_finish(int(sums[0]), xs[-1].numel() - 3) == ck.fold64(xs[-1][3:].clone())


def plain_kernels_vs_reference(device: str = "cpu") -> None:
    """The kernels under the ``planes`` transform against the CPU reference (``rot=False``): the
    split with per-item flags (plain and rotl1 items in one launch), the merge from a planes buffer
    and the in-place chunk merge with the ``OP_PLAIN`` op bit, for every bf16 and fp16 pattern and fp32
    specials, without a delta and with ``xor`` / ``sub``."""
    from s4w_core import delta
    from s4w_core.planes import triton_kernels as tk

    g = torch.Generator().manual_seed(21)
    cases = [(torch.bfloat16, all16()), (torch.float16, all16()), (torch.float32, fp32_patterns(20_000, 3))]
    for dt, raw in cases:
        w = ref.plane_width(dt)
        n = raw.numel() // w
        base = torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g)
        for op in (None, "xor", "sub"):
            b = None if op is None else base
            resid = delta.forward("sub", raw, base, dt) if op == "sub" else raw
            want_plain = ref.split_planes(resid, dt, None if op != "xor" else base, rot=False)
            want_rot = ref.split_planes(resid, dt, None if op != "xor" else base)
            code = tk.OPS[op]
            # two items over the same input, the first plain, the second rotl1, in one split launch
            ps = n + (16 - n % 16) % 16
            rd, bd = raw.to(device), (b.to(device) if b is not None else None)
            out = torch.zeros(2 * w * ps + 64, dtype=torch.uint8, device=device)
            rows = np.array([[rd.data_ptr(), bd.data_ptr() if bd is not None else 0, o, n, 2 * ps] for o in (0, ps)],
                            dtype=np.int64)
            block, _ = tk.block_config(tk.SPLIT)
            table, pmap, total = tk.item_table(rows, -(-rows[:, 3] // block), out.device)
            flags = torch.tensor([2, 1], dtype=torch.int64, device=device)
            tk.launch_items(tk.SPLIT, w, code, table, pmap, total, out, True, flags=flags)
            host = out.cpu()
            for o, want in ((0, want_plain), (ps, want_rot)):
                for j in range(w):
                    got = host[o + j * 2 * ps : o + j * 2 * ps + n]
                    assert torch.equal(got, want[j]), (dt, op, o, j)
            # merge from a planes buffer (launch_rows) with the OP_PLAIN bit
            planes = torch.cat([want_plain[j] for j in range(w)]).to(device)
            dst = torch.full((raw.numel(),), 0x5A, dtype=torch.uint8, device=device)
            mrows = np.array([[dst.data_ptr(), bd.data_ptr() if bd is not None else 0, 0, n, n]], dtype=np.int64)
            tk.launch_rows(tk.MERGE, w, planes, mrows, np.array([code | tk.OP_PLAIN], dtype=np.int64))
            assert torch.equal(dst.cpu(), raw), (dt, op, "merge")
            # the in-place chunk merge (one segment per chunk) with the OP_PLAIN bit
            seg = tk.merge_block() * 2
            nseg = -(-n // seg)
            chunks = []
            for s_ in range(nseg):
                for j in range(w):
                    chunks.append(want_plain[j][s_ * seg : (s_ + 1) * seg].clone().to(device))
            addr = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device=device)
            dst2 = torch.full((raw.numel(),), 0x5A, dtype=torch.uint8, device=device)
            crow = np.array([[dst2.data_ptr(), bd.data_ptr() if bd is not None else 0, 0, n, seg]], dtype=np.int64)
            aligned = all(c.data_ptr() % 16 == 0 for c in chunks) and dst2.data_ptr() % 16 == 0 and (
                bd is None or bd.data_ptr() % 16 == 0)
            tk.merge_chunks(w, addr, crow, np.array([code | tk.OP_PLAIN], dtype=np.int64), aligned)
            assert torch.equal(dst2.cpu(), raw), (dt, op, "merge_chunks")


@check
def plain_kernels() -> None:
    plain_kernels_vs_reference()


@check
def batched_kernels() -> None:
    batched_kernels_vs_reference("cpu")


# ----------------------------------------------------------------------------- pipeline simulation
@contextlib.contextmanager
def simulated_gpu(batch_bytes: int = 3 << 20, segment_elems: int | None = None) -> Iterator[None]:
    """Run s4w_core.gpu's writer/reader on the CPU with a stand-in for nvCOMP."""
    import s4w_core.gpu as gpu
    from s4w_core.gpu import _coder, _decode, _encode, _nvcomp

    def enc(
        c: Any, src: torch.Tensor, so: list[int], ln: list[int], dst: torch.Tensor, do: list[int], cap: list[int]
    ) -> list[int]:
        sizes = []
        for a, n, b, cp in zip(so, ln, do, cap):
            z = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
            out = z.compress(src[a : a + n].numpy().tobytes()) + z.flush()
            assert len(out) <= cp, "stand-in codec overflowed its slot"
            dst[b : b + len(out)] = torch.frombuffer(bytearray(out), dtype=torch.uint8)
            sizes.append(len(out))
        return sizes

    def dec(
        c: Any, src: torch.Tensor, so: list[int], ln: list[int], dst: torch.Tensor, do: list[int], raw: list[int]
    ) -> list[int]:
        sizes = []
        for a, n, b in zip(so, ln, do):
            out = zlib.decompress(src[a : a + n].numpy().tobytes(), -15)
            dst[b : b + len(out)] = torch.frombuffer(bytearray(out), dtype=torch.uint8)
            sizes.append(len(out))
        return sizes

    patches: list[tuple[Any, str, Any]] = [
        (gpu, "available", lambda: True),
        (gpu, "versions", lambda: {"nvcomp": "simulated"}),
        (_nvcomp, "on_stream", lambda dev: contextlib.nullcontext()),
        (_nvcomp, "host_empty", lambda n: torch.empty(max(n, 1), dtype=torch.uint8)),
        (_nvcomp, "synchronize", lambda dev: None),
        (_nvcomp, "batch_bytes", lambda dev, work=None: batch_bytes),
        (_nvcomp, "codec", lambda alg, dev, chunk, **o: alg),
        (_nvcomp, "max_compressed", lambda c, n, dev: n + n // 8 + 1024),
        (_nvcomp, "encode_batch", enc),
        (_nvcomp, "decode_batch", dec),
        (_encode, "_on_device", lambda t: True),
        (_encode, "_device_for", lambda jobs: torch.device("cpu")),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    profiles = dict(_coder.PROFILES)  # one table (the encoder imports it): changed in place, as benchmarks do
    try:
        for obj, name, val in patches:
            setattr(obj, name, val)
        if segment_elems is not None:
            import dataclasses

            _coder.PROFILES.update({k: dataclasses.replace(v, segment_elems=segment_elems) for k, v in profiles.items()})
        assert _decode is not None
        yield
    finally:
        _coder.PROFILES.update(profiles)
        for obj, name, val in saved:
            setattr(obj, name, val)


def sample_state(seed: int = 7) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(700_000, generator=g)  # > 2 fast segments, spans batches of 3 MiB
    f32 = torch.cat([fp32_patterns(50_000, seed).view(torch.float32), big[:10_000]])
    return {
        "bf16": big.to(torch.bfloat16).view(700, 1000),
        "bf16_view": big.to(torch.bfloat16)[5:905:3],  # strided view of its own storage
        "fp16_all": all16().view(torch.float16),
        "bf16_all": all16().view(torch.bfloat16),
        "fp32": f32,
        "fp32_big": big.view(7, 100_000),
        "odd_bf16": big[:12_345].to(torch.bfloat16),
        "int64_small": torch.arange(1000),
        "int8_big": torch.randint(-5, 5, (1_500_000,), dtype=torch.int8, generator=g),
        "uint8": torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=g),
        "bool": torch.rand(777, generator=g) > 0.5,
        "fp64": torch.randn(5000, generator=g, dtype=torch.float64),
        "complex64": torch.randn(300, generator=g, dtype=torch.complex64),
        "fp8": torch.randn(4000, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "step": 11,
    }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.stride() == b.stride(), where
        av = a.contiguous().view(-1).view(torch.uint8) if a.numel() else a.reshape(-1)
        bv = b.contiguous().view(-1).view(torch.uint8) if b.numel() else b.reshape(-1)
        assert torch.equal(av.cpu(), bv.cpu()), f"bits differ at {where}"
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, where


def _decode_all_gpu_sim(data: bytes, resolve: Any = None) -> Any:
    from s4w_core import api
    from s4w_core.gpu import decode_storages
    from s4w_core.skeleton import decode_tree

    reader = api.open_reader(data)
    m = reader.manifest
    raws = decode_storages(reader, m["storages"], torch.device("cpu"), resolve)
    return decode_tree(m["tree"], api._build_tensors(m, raws)), m


@check
def pipeline_fast_roundtrip() -> None:
    import s4w_core

    obj = sample_state()
    buf = io.BytesIO()
    with simulated_gpu():
        rep = s4w_core.save(obj, buf, profile="fast")
        back, m = _decode_all_gpu_sim(buf.getvalue())
    assert_same(obj, back)
    codecs = {c[0] for s in m["storages"] for c in s["chunks"]}
    assert codecs >= {"nvcomp-ans", "raw", "zstd"}, codecs
    assert m["writer"]["nvcomp"] == "simulated"
    assert all(
        s["checksum"].startswith("fold64:")
        for s in m["storages"]
        if s["transform"] != "bytes" or s["nbytes"] > (1 << 20)
    ), "GPU-resident storages carry fold64"
    assert rep.ratio > 1.0
    # chunks lie back to back from the header on (in the order the writer's groups went out)
    offs = sorted((c[1], c[2]) for s in m["storages"] for c in s["chunks"])
    assert offs[0][0] == 16
    for (o1, l1), (o2, _) in zip(offs, offs[1:]):
        assert o1 + l1 == o2, "a gap or an overlap between chunks"


@check
def pipeline_portable_cross_decode_on_cpu_path() -> None:
    import s4w_core

    obj = sample_state(8)
    buf = io.BytesIO()
    with simulated_gpu():
        s4w_core.save(obj, buf, profile="portable")
    m = s4w_core.info(buf.getvalue())
    assert "nvcomp-ans" not in str(m["codecs"])
    # the real CPU path (no GPU backend) decodes what the simulated GPU writer wrote
    back = s4w_core.load(buf.getvalue())
    assert_same(obj, back)
    assert s4w_core.verify(buf.getvalue()).ok


@check
def pipeline_cpu_written_decoded_by_gpu_reader() -> None:
    import s4w_core

    obj = sample_state(9)
    buf = io.BytesIO()
    s4w_core.save(obj, buf, profile="portable")  # the CPU writer
    with simulated_gpu():
        back, _ = _decode_all_gpu_sim(buf.getvalue())
    assert_same(obj, back)


@check
def pipeline_odd_segments_use_scratch() -> None:
    import s4w_core

    obj = sample_state(10)
    buf = io.BytesIO()
    with simulated_gpu(batch_bytes=1 << 20, segment_elems=1003):
        s4w_core.save(obj, buf, profile="fast")
        back, m = _decode_all_gpu_sim(buf.getvalue())
    assert {s["segment_elems"] for s in m["storages"] if s["transform"] == "planes-rotl1"} == {1003}
    assert_same(obj, back)


@check
def pipeline_delta() -> None:
    import s4w_core
    from s4w_core.gpu import _encode

    g = torch.Generator().manual_seed(11)
    w0 = torch.randn(300_000, generator=g).to(torch.bfloat16)
    w1 = (w0.float() + 1e-3 * torch.randn(300_000, generator=g)).to(torch.bfloat16)
    e0 = torch.randn(300_000, generator=g)
    i0 = torch.randint(0, 1000, (400_000,), generator=g)  # int64, > 1 MiB: the GPU path, xor only
    i1 = i0.clone()
    i1[::1000] += 1
    bases = {
        "w": w0.view(torch.uint8).clone(),
        "e": torch.randn(300_000, generator=g).view(torch.uint8).clone(),
        "i": i0.view(torch.uint8).clone(),
    }

    def lookup(path: str, nbytes: int, dtype: str) -> Any:
        b = bases.get(path)
        return (b, {"ref": path}) if b is not None and b.numel() == nbytes else None

    def resolve(ref_: dict[str, Any], nbytes: int) -> torch.Tensor:
        return bases[ref_["ref"]]

    obj = {"w": w1, "e": e0, "i": i1}
    seen_ops = set()
    for forced in (None, "xor", "sub"):
        with contextlib.ExitStack() as stack:
            stack.enter_context(simulated_gpu())
            if forced:  # the op the writer chose, replaced by ``forced`` on float storages
                orig = _encode._choose_delta_ops

                def force(cands: Any, f: str = forced, o: Any = orig, **kw: Any) -> list[Any]:
                    ops = o(cands, **kw)
                    return [f if op is not None and c[1] == "planes-rotl1" else op for c, op in zip(cands, ops)]

                _encode._choose_delta_ops = force  # type: ignore[assignment]
                stack.callback(setattr, _encode, "_choose_delta_ops", orig)
            buf = io.BytesIO()
            s4w_core.save(obj, buf, profile="fast", _base_lookup=lookup)
            back, m = _decode_all_gpu_sim(buf.getvalue(), resolve)
            deltas = {s["path"]: (s["delta"] or {}).get("op") for s in m["storages"]}
            assert deltas["e"] is None and deltas["w"] and deltas["i"] == "xor", deltas
            seen_ops.add(deltas["w"])
            assert_same(obj, back)
            buf2 = io.BytesIO()
            s4w_core.save(obj, buf2, profile="portable", _base_lookup=lookup)
        assert_same(obj, s4w_core.load(buf2.getvalue(), _resolve_base=resolve))  # the CPU reader
    assert {"xor", "sub"} <= seen_ops, seen_ops


def _layout_model(u: np.ndarray, v: np.ndarray | None, w: int, op: int, runs: int, run: int, margin: float) -> int:
    """numpy model of ``kernels.layout_probe`` for one item: 2 (``planes``) or 1 (``planes-rotl1``)."""
    from s4w_core import delta

    bits = 8 * w
    n = u.size
    step = (n - run) // (runs - 1)
    e = (step * np.arange(runs, dtype=np.int64))[:, None] + np.arange(run)[None, :]
    e = e.reshape(-1)
    dt = {2: torch.bfloat16, 4: torch.float32}[w]
    x_t = torch.from_numpy(u[e].copy())
    if op:
        assert v is not None
        r = delta.forward({1: "xor", 2: "sub"}[op], x_t.view(torch.uint8), torch.from_numpy(v[e].copy()).view(torch.uint8), dt)
        x_t = r.view(x_t.dtype)
    x = x_t.numpy().astype(np.int64) & ((1 << bits) - 1)
    plain = (x >> (bits - 8)) & 0xFF
    rot = ((((x << 1) | (x >> (bits - 1))) & ((1 << bits) - 1)) >> (bits - 8)) & 0xFF

    def h(b: np.ndarray) -> float:
        p = np.bincount(b, minlength=256)[np.bincount(b, minlength=256) > 0] / b.size
        return float(-(p * np.log2(p)).sum())

    return 2 if h(plain) + margin < h(rot) else 1


@check
def layout_probe_vs_numpy() -> None:
    """``kernels.layout_probe`` (the encoder's per-storage choice of ``planes`` against
    ``planes-rotl1``) against a numpy model on the same samples: non-negative and signed tensors,
    bf16 and fp32, without a delta and with ``xor`` / ``sub`` residuals; items whose flag is already
    set are left alone."""
    from s4w_core.gpu import kernels as K

    g = torch.Generator().manual_seed(5)
    n = 40_000
    cases = []
    for w, dt in ((2, torch.bfloat16), (4, torch.float32)):
        pos = (torch.randn(n, generator=g) ** 2).to(dt)
        sig = torch.randn(n, generator=g).to(dt)
        pos2 = (pos.float() * (1 + 1e-2 * torch.randn(n, generator=g))).abs().to(dt)
        sig2 = (sig.float() + 1e-3 * torch.randn(n, generator=g)).to(dt)
        for a, b in ((pos, None), (sig, None), (pos2, pos), (sig2, sig)):
            for op in ((0,) if b is None else (1, 2)):
                cases.append((w, a, b, op))
    seen = set()
    for w, a, b, op in cases:
        it = {2: torch.int16, 4: torch.int32}[w]
        rows = np.array([[a.data_ptr(), b.data_ptr() if b is not None else 0, 0, n, n, 0],
                         [a.data_ptr(), b.data_ptr() if b is not None else 0, 0, n, n, 0]], dtype=np.int64)
        flags = torch.tensor([0, 1], dtype=torch.int64)
        K.layout_probe(torch.from_numpy(rows.reshape(-1)), flags, w, op)
        u = a.view(it).numpy()
        v = b.view(it).numpy() if b is not None else None
        want = _layout_model(u, v, w, op, K.LAYOUT_RUNS, K.LAYOUT_RUN, K.LAYOUT_MARGIN)
        assert flags.tolist() == [want, 1], (w, op, flags.tolist(), want)
        seen.add(want)
    assert seen == {1, 2}, seen


@check
def pipeline_layout_choice() -> None:
    """The GPU writer's layout choice end to end (simulated nvCOMP): non-negative tensors (Adam's
    ``exp_avg_sq`` kind) are written with ``planes``, signed ones and small ones with
    ``planes-rotl1``; a storage that spans two batches keeps its first piece's choice; the portable
    profile keeps ``planes-rotl1``, and so do delta residuals. Then containers written by the CPU
    writer with ``planes`` forced, with ``xor`` and ``sub`` deltas, through the GPU reader's merges
    and the CPU reader. All decode bit-exactly."""
    import s4w_core
    from s4w_core.gpu import kernels as K

    g = torch.Generator().manual_seed(3)
    sq0 = (torch.randn(1_700_000, generator=g) ** 2).to(torch.bfloat16)  # 3.4 MB: two 3 MiB batches
    obj = {
        "sq": (sq0.float() * 1.01).to(torch.bfloat16),
        "sq32": torch.randn(300_000, generator=g).abs(),
        "w": torch.randn(300_000, generator=g).to(torch.bfloat16),
        "tiny": torch.rand(100, generator=g).to(torch.bfloat16),
    }
    w0 = (obj["w"].float() + 1e-3 * torch.randn(300_000, generator=g)).to(torch.bfloat16)
    bases = {"sq": sq0.view(torch.uint8).clone(), "w": w0.view(torch.uint8).clone()}

    def lookup(path: str, nbytes: int, dtype: str) -> Any:
        b = bases.get(path)
        return (b, {"ref": path}) if b is not None and b.numel() == nbytes else None

    def resolve(ref_: dict[str, Any], nbytes: int) -> torch.Tensor:
        return bases[ref_["ref"]]

    def save(profile: str, **kw: Any) -> dict[str, Any]:
        buf = io.BytesIO()
        with simulated_gpu():
            s4w_core.save(obj, buf, profile=profile, **kw)
            back, m = _decode_all_gpu_sim(buf.getvalue(), resolve)
        assert_same(obj, back)
        return m

    m = save("fast")
    tr = {s["path"]: s["transform"] for s in m["storages"]}
    assert tr == {"sq": "planes", "sq32": "planes", "w": "planes-rotl1", "tiny": "planes-rotl1"}, tr
    m = save("portable")
    assert {s["transform"] for s in m["storages"]} == {"planes-rotl1"}, "the portable profile keeps rotl1"
    # deltas keep planes-rotl1, whatever the probe would say (the margin set so that it says planes)
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, K, "LAYOUT_MARGIN", K.LAYOUT_MARGIN)
        K.LAYOUT_MARGIN = -1e9
        m = save("fast", _base_lookup=lookup)
        st = {s["path"]: s for s in m["storages"]}
        assert st["sq"]["delta"] and st["w"]["delta"], st
        tr = {p: s["transform"] for p, s in st.items()}
        assert tr == {"sq": "planes-rotl1", "sq32": "planes", "w": "planes-rotl1", "tiny": "planes-rotl1"}, tr
    # the GPU reader's merges under planes with each delta op: a CPU-written container with planes forced
    from s4w_core import engine
    from tests.unit.helpers import cpu_writer_with

    for forced in ("xor", "sub"):
        with contextlib.ExitStack() as stack:
            orig_enc, orig_op = engine.encode_storage_cpu, engine.choose_delta_op

            def op(job: Any, transform: str, ops: Any = None, f: str = forced) -> Any:
                return f

            stack.callback(setattr, engine, "encode_storage_cpu", orig_enc)
            stack.callback(setattr, engine, "choose_delta_op", orig_op)
            engine.encode_storage_cpu = cpu_writer_with("planes")  # type: ignore[assignment]
            engine.choose_delta_op = op  # type: ignore[assignment]
            buf = io.BytesIO()
            s4w_core.save(obj, buf, profile="portable", _base_lookup=lookup)
        with simulated_gpu():
            back, m = _decode_all_gpu_sim(buf.getvalue(), resolve)
        assert_same(obj, back)
        assert_same(obj, s4w_core.load(buf.getvalue(), _resolve_base=resolve))
        st = {s["path"]: s for s in m["storages"]}
        assert {s["transform"] for s in st.values()} == {"planes"}, st
        assert st["sq"]["delta"]["op"] == forced and st["w"]["delta"]["op"] == forced


@check
def pipeline_write_error_surfaces() -> None:
    """A failing write on the writer's I/O thread (disk full) reaches the caller; nothing hangs."""
    import s4w_core

    class Full(io.RawIOBase):
        def __init__(self) -> None:
            self.n = 0

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            self.n += len(b)
            if self.n > 200_000:
                raise OSError(28, "No space left on device")
            return len(b)

    obj = {f"w{i}": torch.randn(300_000).to(torch.bfloat16) for i in range(4)}
    with simulated_gpu(batch_bytes=300_000):
        try:
            s4w_core.save(obj, Full(), profile="fast")
        except OSError as e:
            assert e.errno == 28, e
        else:
            raise AssertionError("the write error was swallowed")


@check
def pipeline_file_reader_scatter_reads() -> None:
    """The reader on a file: scatter reads (``os.preadv``, through ``ContainerReader.from_file`` and
    the local backend's ``RangeReader.readinto``) into aligned slots, several chunks a read or one
    (``S4W_READ_BLOCK``), batches pipelined, a request with holes (every other storage)."""
    import tempfile

    import s4w_core
    from s4w_core import api
    from s4w_core.format.container import ContainerReader
    from s4w_core.gpu import decode_storages
    from s4w_core.store._local import LocalBackend

    obj = sample_state(12)
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as d, simulated_gpu(batch_bytes=1 << 20):
        path = os.path.join(d, "c.s4w")
        s4w_core.save(obj, path, profile="fast")
        with open(path, "rb") as f:
            data = f.read()
        back, m = _decode_all_gpu_sim(data)  # a bytes reader: read_into's read_range fallback
        assert_same(obj, back)
        full = decode_storages(api.open_reader(data), m["storages"], cpu, None)
        rr = LocalBackend(d).open_range("c.s4w")
        try:
            for block in (32 << 20, 65536):  # the default: several chunks a read; one chunk a read
                os.environ["S4W_READ_BLOCK"] = str(block)
                for reader in (
                    api.open_reader(path),
                    api.open_reader(ContainerReader(rr.read, rr.size, rr.name, readinto=rr.readinto)),
                ):
                    with reader:
                        got = decode_storages(reader, reader.manifest["storages"][::2], cpu, None)
                    assert len(got) == len(full[::2])
                    for g, want in zip(got, full[::2]):
                        assert torch.equal(g, want)
        finally:
            os.environ.pop("S4W_READ_BLOCK", None)
            rr.close()


def moments_like(dtype: torch.dtype, n_rows: int, cols: int, seed: int) -> torch.Tensor:
    """Adam-moment-like: most rows exactly zero (untouched embedding rows), the rest dense, with
    -0.0, denormals, NaN and Inf patterns among the live values."""
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(n_rows, cols)
    live = torch.rand(n_rows, generator=g) < 0.35
    t[live] = torch.randn(int(live.sum()), cols, generator=g).abs() * 1e-6
    flat = t.to(dtype).reshape(-1)
    k = torch.randint(0, flat.numel(), (64,), generator=g)
    flat[k[:16]] = -0.0
    flat[k[16:32]] = float("nan")
    flat[k[32:48]] = float("inf")
    flat[k[48:]] = torch.finfo(dtype).tiny / 4
    return flat


def _reference_reader() -> Any:
    """``examples/read_container.py`` (the standalone reader of docs/FORMAT.md), imported as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "read_container", Path(__file__).resolve().parents[2] / "examples" / "read_container.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["read_container"] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _as_gpu_host_copies() -> Iterator[None]:
    """While active, every storage a save collects claims to be a host copy of a CUDA storage (as the
    store's pinned copies are): the GPU writer then codes it with either profile."""
    from s4w_core import engine

    orig = engine.Collector

    class Collector(orig):  # type: ignore[misc, valid-type]
        def add(self, t: torch.Tensor, path: str) -> int:
            i = super().add(t, path)
            for job in self.jobs:
                job.device = "cuda:0"
            return i

    engine.Collector = Collector  # type: ignore[misc]
    try:
        yield
    finally:
        engine.Collector = orig  # type: ignore[misc]


@check
def pipeline_nonzero() -> None:
    """The GPU writer's nonzero transform (docs/FORMAT.md 4.5c) against the CPU oracle, simulated
    nvCOMP: moment-like tensors (zero rows) and sparse deltas, every float dtype, segments that end
    mid-byte of the bitmap; GPU-written ``fast`` files decoded by the GPU reader, GPU-written
    ``portable`` files by the CPU reader and the GPU reader, CPU-written nz files by the GPU reader."""
    import s4w_core
    from s4w_core import engine
    from s4w_core.gpu import _nonzero

    g = torch.Generator().manual_seed(5)
    for case, (dtype, rows, cols, seg) in enumerate(
        [(torch.bfloat16, 700, 384, None), (torch.float16, 333, 301, 1003), (torch.float32, 257, 400, 40_000)]
    ):
        m1 = moments_like(dtype, rows, cols, seed=case)
        dense = torch.randn(90_000, generator=g).to(dtype)  # no zeros: keeps its plane transform
        w0 = torch.randn(rows * cols, generator=g).to(dtype)
        w1 = w0.clone()
        idx = torch.randint(0, w1.numel(), (w1.numel() // 50,), generator=g)
        w1[idx] = (w1[idx].float() * 1.01 + 1e-3).to(dtype)  # 2 % of the elements change
        base = {"w": w0.view(-1).view(torch.uint8).clone()}

        def lookup(path: str, nbytes: int, dt: str, b: dict[str, torch.Tensor] = base) -> Any:
            return (b["w"], {"ref": path}) if path == "w" and b["w"].numel() == nbytes else None

        def resolve(ref_: dict[str, Any], nbytes: int, b: dict[str, torch.Tensor] = base) -> torch.Tensor:
            return b["w"]

        zero = torch.zeros(1 << 21, dtype=dtype)  # all zeros: a size claim far above its stored bytes
        obj = {"m": m1.view(rows, cols), "d": dense, "w": w1, "z": zero}
        for profile in ("fast", "portable"):
            buf = io.BytesIO()
            with simulated_gpu(segment_elems=seg), contextlib.ExitStack() as stack:
                if profile == "portable":  # host copies of GPU storages: the GPU writer codes them
                    stack.enter_context(_as_gpu_host_copies())
                s4w_core.save(obj, buf, profile=profile, _base_lookup=lookup)
                back, m = _decode_all_gpu_sim(buf.getvalue(), resolve)
            assert_same(obj, back, f"{dtype} {profile} (GPU reader)")
            by = {s["path"]: s for s in m["storages"]}
            assert by["m"]["transform"] == _nonzero.NZ_TRANSFORM, (dtype, profile, by["m"]["transform"])
            assert by["w"]["delta"], (dtype, profile)
            if dtype == torch.float32:  # a sparse fp32 delta pays (4 planes of mostly zeros); 16-bit ones break even
                assert by["w"]["transform"] == _nonzero.NZ_TRANSFORM, (dtype, profile)
            assert by["d"]["transform"] in ("planes-rotl1", "planes"), by["d"]["transform"]
            assert by["z"]["transform"] == _nonzero.NZ_TRANSFORM and not engine.claims_plausible(
                dict(by["z"], _width=dtype.itemsize)
            )
            for s in [t for t in (by["m"], by["w"]) if t["transform"] == _nonzero.NZ_TRANSFORM]:
                raw = (obj["m"] if s is by["m"] else w1).reshape(-1).view(torch.uint8)
                words = raw.numpy().view({2: np.uint16, 4: np.uint32}[dtype.itemsize])
                if s["delta"]:
                    words = engine.delta.forward(s["delta"]["op"], raw, base["w"], dtype).numpy().view(words.dtype)
                step = s["segment_elems"]
                assert s["nnz"] == [int(np.count_nonzero(words[a : a + step])) for a in range(0, words.size, step)]
                assert len(s["chunks"]) == len(s["nnz"]) * (dtype.itemsize + 1)
            want = "nvcomp-ans" if profile == "fast" else "deflate"
            assert want in {c[0] for c in by["m"]["chunks"]}, by["m"]["chunks"][:4]
            if profile == "portable":  # the CPU reader decodes what the GPU wrote
                reader = s4w_core.api.open_reader(buf.getvalue())
                with engine.executor(2) as pool:
                    for s in reader.manifest["storages"]:
                        got = engine.decode_storage_cpu(reader, s, pool, resolve, reader.name)
                        want = obj[s["path"]].reshape(-1).view(torch.uint8)
                        assert torch.equal(got, want), f"{dtype} {s['path']} (CPU reader)"
                tree, _m = _reference_reader().read(buf.getvalue(), bases={"w": base["w"].numpy().tobytes()})
                assert tree["m"].element_bytes() == obj["m"].reshape(-1).view(torch.uint8).numpy().tobytes()
                assert tree["w"].element_bytes() == w1.view(torch.uint8).numpy().tobytes()
        # the CPU writer's nz file, read by the GPU reader
        buf = io.BytesIO()
        s4w_core.save(obj, buf, profile="portable", _base_lookup=lookup)
        with simulated_gpu():
            back, m = _decode_all_gpu_sim(buf.getvalue(), resolve)
        assert_same(obj, back, f"{dtype} CPU-written, GPU reader")


@check
def pipeline_nonzero_forged_counts_refused() -> None:
    """A GPU-read nz storage whose bitmap disagrees with its ``nnz``, whose bitmap has padding bits
    set, or whose planes hold a zero element (a forged manifest or forged chunks with valid
    checksums) is a DecodeError naming what is wrong, never a wrong tensor."""
    import s4w_core
    from s4w_core.gpu import _nonzero

    x = moments_like(torch.bfloat16, 400, 384, seed=3)
    buf = io.BytesIO()
    with simulated_gpu():
        s4w_core.save({"m": x}, buf, profile="fast")
    reader = s4w_core.api.open_reader(buf.getvalue())
    e = reader.manifest["storages"][0]
    assert e["transform"] == _nonzero.NZ_TRANSFORM
    bad = dict(e, nnz=[e["nnz"][0] + 1, *e["nnz"][1:]])
    with simulated_gpu():
        try:
            _nonzero.decode_nonzero_device(reader, bad, torch.device("cpu"), None)
        except s4w_core.DecodeError as err:
            assert "'m'" in str(err), err
        else:
            raise AssertionError("forged nnz not detected")
    # the device checks themselves, on hand-made segments of 3 bf16 elements (bitmap 1 byte, planes at 8)
    cases = {
        "bitmap marks 1 nonzero elements, planes hold 2": ([0b001], 2, [1, 1]),
        "padding bits": ([0b1000_0001], 2, [1, 1]),
        "decodes to zero": ([0b011], 2, [1, 0]),
    }
    for msg, (bm, nnz, hi) in cases.items():
        dec = torch.zeros(32, dtype=torch.uint8)
        dec[0] = bm[0]
        dec[8 : 8 + nnz] = torch.tensor(hi, dtype=torch.uint8)  # plane 0 (high bytes); plane 1 all zero
        try:
            _nonzero.check_and_merge(dec, np.array([1, nnz, nnz]), np.array([0, 8, 16]), [nnz], 3, 3, 2, True,
                                     torch.empty(6, dtype=torch.uint8), "t")
        except s4w_core.DecodeError as err:
            assert msg in str(err), (msg, err)
        else:
            raise AssertionError(f"not detected: {msg}")
    out = torch.empty(6, dtype=torch.uint8)  # and a good segment merges: elements 0 and 1 nonzero
    dec = torch.zeros(32, dtype=torch.uint8)
    dec[0], dec[8], dec[9] = 0b011, 0x7F, 0x80
    _nonzero.check_and_merge(dec, np.array([1, 2, 2]), np.array([0, 8, 16]), [2], 3, 3, 2, True, out, "t")
    assert out.view(torch.int16).tolist() == [0x3F80, 0x4000, 0], out


@check
def pipeline_corrupt_chunk_refused_before_decoding() -> None:
    import s4w_core
    from s4w_core.gpu import _nvcomp

    obj = {"w": torch.randn(100_000).to(torch.bfloat16)}
    buf = io.BytesIO()
    with simulated_gpu():
        s4w_core.save(obj, buf, profile="fast")
    data = bytearray(buf.getvalue())
    m = s4w_core.info(bytes(data))
    assert m["codecs"]
    reader = s4w_core.api.open_reader(bytes(data))
    chunk = next(c for c in reader.manifest["storages"][0]["chunks"] if c[0] == "nvcomp-ans")
    data[chunk[1] + 3] ^= 0x40
    calls = []
    with simulated_gpu():
        orig = _nvcomp.decode_batch
        _nvcomp.decode_batch = lambda *a: calls.append(1) or orig(*a)  # type: ignore[assignment]
        try:
            _decode_all_gpu_sim(bytes(data))
        except s4w_core.ChecksumMismatchError as e:
            assert "chunk" in str(e)
        else:
            raise AssertionError("corrupt chunk not detected")
    assert not calls, "a GPU decoder saw bytes before the checksum was verified"


@check
def coder_slots_sized_by_class() -> None:
    """A batch codes each size class of its chunks in a coder call of its own, every output slot
    sized for its class's longest chunk (not the batch's): small storages beside full segments
    take small slots, and the container still round-trips."""
    import s4w_core
    from s4w_core.gpu import _coder, _nvcomp

    g = torch.Generator().manual_seed(3)
    seg = 1 << 16
    state = {f"bias{i}": torch.randn(96 + i, generator=g).to(torch.bfloat16) for i in range(40)}
    state["ln"] = torch.randn(10_000, generator=g).to(torch.bfloat16)  # 10 KB planes: the 32 KiB class
    state["w"] = torch.randn(3 * seg + 77, generator=g).to(torch.bfloat16)  # full segments and a tail
    with simulated_gpu(batch_bytes=8 << 20, segment_elems=seg):
        batch = _coder.Batch()
        prof = _coder.PROFILES["fast"]
        for i, t in enumerate(state.values()):
            n = t.numel()
            batch.pieces.append(_coder.Piece(i, t, None, None, t.dtype, "planes-rotl1", 2, 0, n, seg, 0))
            batch.nbytes += 2 * n
        plan = _coder.EncodePlan(batch, prof, torch.device("cpu"))
        cls = _nvcomp.slot_classes(plan.lengths)
        assert (np.diff(cls) >= 0).all(), "the chunk table is not grouped by size class"
        assert len(plan.calls) == len(set(cls.tolist())) >= 3, plan.calls
        ends = plan.comp_off + plan.caps
        assert (plan.comp_off[1:] >= ends[:-1]).all() and int(ends[-1]) == plan.comp_bytes, "slots overlap"
        need = np.array([_nvcomp.max_compressed(None, int(n), torch.device("cpu")) for n in plan.lengths])
        for lo, hi, _c, cap, longest, _s in plan.calls:
            assert longest == int(plan.lengths[lo:hi].max())
            assert (plan.caps[lo:hi] == cap).all() and (need[lo:hi] <= cap).all(), "a slot below its chunk's bound"
        uniform = plan.n * _nvcomp.max_compressed(None, plan.maxlen, torch.device("cpu"))
        assert plan.comp_bytes < uniform / 2, (plan.comp_bytes, uniform)
        enc = plan.run()
        assert sorted(zip(enc.owner_ji.tolist(), enc.owner_ci.tolist())) == sorted(set(zip(enc.owner_ji.tolist(), enc.owner_ci.tolist())))
        buf = io.BytesIO()
        s4w_core.save(state, buf, profile="fast")
        back, _m = _decode_all_gpu_sim(buf.getvalue())
    assert_same(state, back)


@check
def delta_choices_same_in_groups() -> None:
    """The GPU writer's delta-op choice, run a group of storages at a time (a save of host copies
    bounds the device memory its samples take), chooses as it does for every storage at once."""
    from s4w_core import engine
    from s4w_core.gpu import _encode

    g = torch.Generator().manual_seed(4)
    cands = []
    for k in range(48):  # ~2.3 MB of samples: three groups of the 1 MiB least a bound makes
        dt = (torch.bfloat16, torch.float32)[k % 2]
        n = (20_000, 5_000, 70_000)[k % 3]
        x = torch.randn(n, generator=g)
        b = x + (1e-3 if k % 4 else 1.0) * torch.randn(n, generator=g)  # near (a delta pays) or far
        raw, base = x.to(dt).view(torch.uint8), b.to(dt).view(torch.uint8)
        job = engine.StorageJob(raw, dt, f"t{k}", "cuda:0", base, {"path": f"t{k}"})
        cands.append((job, "planes-rotl1", dt.itemsize))
    whole = _encode._choose_delta_ops(cands, dev=torch.device("cpu"))
    calls: list[int] = []
    orig = _encode._delta_choices
    _encode._delta_choices = lambda c, s, d: calls.append(len(c)) or orig(c, s, d)  # type: ignore[assignment]
    try:
        grouped = _encode._choose_delta_ops(cands, dev=torch.device("cpu"), work=1)
    finally:
        _encode._delta_choices = orig  # type: ignore[assignment]
    assert len(calls) >= 2 and sum(calls) == len(cands), calls
    assert whole == grouped, (whole, grouped)
    assert None in whole and {"xor", "sub"} & set(whole), whole


def run_checks(checks: dict[str, Callable[[], None]], names: list[str]) -> int:
    """Run the ``checks`` named (all when none) under Triton's interpreter, printing ``ok NAME`` for
    each: what the subprocess entry points of the interpreted parity modules do."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set")
    os.environ["TRITON_INTERPRET"] = "1"  # before the checks import triton
    for name in names or list(checks):
        checks[name]()
        print("ok", name, flush=True)
    return 0


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

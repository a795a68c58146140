"""Host cost of each step of the GPU decode's enqueue, one step at a time (device synchronized
between calls, median of 50): which host work stands between the decode's launches.

Builds the state of ``profile_codec.py`` (``bench_peers``' medium model, 20 steps), encodes it on
the device, then times the decode's host steps on their own -- nvCOMP's ANS call and its parts,
the tables of the merge and fold64 launches, the read-backs, a plan rebuild -- and the whole
``decode_device`` and encode for scale. Hosts of the lent machines differ by 2x or more in Python
speed: compare rows of one run only.

    python benchmarks/diag_decode_host.py [bf16|fp32]
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import _train_gpt  # noqa: E402
import bench_peers  # noqa: E402

from s4w_core.gpu import _decode, _encode, _nvcomp  # noqa: E402
from s4w_core.gpu.kernels import fold64_rows  # noqa: E402
from s4w_core.planes import triton_kernels as tk  # noqa: E402


def t(name: str, fn: Any, n: int = 50) -> None:
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"{name:40s} {statistics.median(ts)*1e6:9.1f} us  (min {min(ts)*1e6:.1f})", flush=True)


def main() -> None:
    dev = torch.device("cuda")
    variant = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    tr = _train_gpt.Trainer(variant, 20, device="cuda", **dict(_train_gpt.MODELS["medium"]))
    for _ in range(20):
        tr.step()
    tl = [x for x in tr._live() if x.is_floating_point() and x.numel() > 0 and x.is_cuda]
    enc = _encode.encode_tensors_device(tl, "fast")
    plan = bench_peers._s4w_decode_plan(enc, tl)
    outs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in plan.nbytes]
    st, entries = plan.st, plan.entries
    bench_peers._s4w_device_decode(enc, plan, outs)
    torch.cuda.synchronize()
    p = st.plan
    staged = enc.compact
    planes = torch.empty(p.planes_bytes, dtype=torch.uint8, device=dev)
    call = p.calls[0]
    print(f"{variant}: {len(tl)} tensors, {len(st.slot)} chunks, {len(call.src)} ANS chunks, {len(p.calls)} calls")
    with _nvcomp.on_stream(dev):
        c = _nvcomp.codec(call.algorithm, dev, call.chunk_bytes, **call.opts)
        t("whole decode_device", lambda: _decode.decode_device(staged, st, entries, outs, [None] * len(outs), dev))
        t("codec()", lambda: _nvcomp.codec(call.algorithm, dev, call.chunk_bytes, **call.opts))
        n = len(call.src)
        cols = [staged.data_ptr() + call.src, call.lengths, call.raw, planes.data_ptr() + call.dst]
        t("_AnsC._table", lambda: c._table(cols, 2 * n))
        host = np.concatenate(cols)
        t("  from_numpy+pin_memory", lambda: torch.from_numpy(host).pin_memory())
        pinned = torch.empty(len(host), dtype=torch.int64, pin_memory=True)
        t("  pinned empty", lambda: torch.empty(len(host), dtype=torch.int64, pin_memory=True))
        t("  numpy->pinned copy", lambda: pinned.numpy().__setitem__(slice(None), host))
        dt = torch.empty(len(host) + 2 * n, dtype=torch.int64, device=dev)
        t("  H2D copy_ non_blocking", lambda: dt[: len(host)].copy_(pinned, non_blocking=True))
        t("  device empty", lambda: torch.empty(len(host) + 2 * n, dtype=torch.int64, device=dev))
        import ctypes
        lib = _nvcomp._ans_c()
        tb = ctypes.c_size_t()
        maxlen, total = int(call.raw.max()), int(call.raw.sum())
        t("GetTempSize", lambda: lib.nvcompBatchedANSDecompressGetTempSize(n, maxlen, _nvcomp._DOPTS, ctypes.byref(tb), total, c.stream.cuda_stream))
        t("c.decode (all)", lambda: c.decode(staged, call.src, call.lengths, planes, call.dst, call.raw))
        t("decode_batch (all)", lambda: _nvcomp.decode_batch(c, staged, call.src, call.lengths, planes, call.dst, call.raw))
        temp = torch.empty(max(int(tb.value), 1), dtype=torch.uint8, device=dev)
        w = dt.data_ptr()
        t("DecompressAsync only", lambda: lib.nvcompBatchedANSDecompressAsync(w, w + 8 * n, w + 16 * n, w + 32 * n, n, temp.data_ptr(), tb.value, w + 24 * n, _nvcomp._DOPTS, w + 40 * n, c.stream.cuda_stream))
        got = c.decode(staged, call.src, call.lengths, planes, call.dst, call.raw)
        torch.cuda.synchronize()
        t("sizes check readback (list(got))", lambda: list(got))
        t("out_addr fromiter", lambda: np.fromiter((o.data_ptr() for o in outs), dtype=np.int64, count=len(outs)))
        out_addr = np.fromiter((o.data_ptr() for o in outs), dtype=np.int64, count=len(outs))
        bases = [None] * len(outs)
        t("bases scan", lambda: [i for i, b in enumerate(bases) if b is not None])
        zeros = np.zeros(len(outs), dtype=np.int64)
        rows = np.column_stack([out_addr, zeros, p.merge_cols])
        t("column_stack rows", lambda: np.column_stack([out_addr, zeros, p.merge_cols]))
        addr = np.where(p.chunk_staged, staged.data_ptr(), planes.data_ptr()) + p.chunk_off
        t("addr np.where", lambda: np.where(p.chunk_staged, staged.data_ptr(), planes.data_ptr()) + p.chunk_off)
        t("upload(addr)", lambda: tk.upload(addr, dev))
        chunks = tk.upload(addr, dev)
        t("block_config", tk.block_config)
        t("merge_block", tk.merge_block)
        block, warps = tk.block_config()
        for w_ in p.rot_widths:
            sel = p.rot & (p.width == w_)
            r, o = rows[sel], zeros[sel]
            t(f"merge_chunks w={w_} (item_table + launch)", lambda w_=w_, r=r, o=o: tk.merge_chunks(int(w_), chunks, r, o, True))
            t(f"  item_table w={w_}", lambda r=r: tk.item_table(r, -(-r[:, 3] // block), dev))
            table, pm, tot = tk.item_table(r, -(-r[:, 3] // block), dev)
            t(
                f"  triton launch w={w_}",
                lambda w_=w_, table=table, pm=pm, tot=tot: tk.MERGE_CHUNKS[(tot,)](
                    table, pm, chunks, W=int(w_), OP=0, ALIGNED=True, BLOCK=block, num_warps=warps
                ),
            )
        acc = torch.zeros(len(outs), dtype=torch.int64, device=dev)
        t("torch.zeros acc", lambda: torch.zeros(len(outs), dtype=torch.int64, device=dev))
        idx = np.arange(len(outs))
        t("fold64_rows", lambda: fold64_rows(out_addr, p.nbytes, idx, acc))
        t("acc.cpu().tolist()", lambda: [int(x) for x in acc.cpu().tolist()])
        t("planes empty", lambda: torch.empty(p.planes_bytes, dtype=torch.uint8, device=dev))
        t("plan rebuild (stager thread)", lambda: _decode.DecodePlan.build(st, entries))
        # encode side
        t("whole encode (sync)", lambda: (_encode.encode_tensors_device(tl, "fast"), torch.cuda.synchronize()), n=20)
    encode_steps(tl, dev)


def encode_steps(tl: list[torch.Tensor], dev: torch.device) -> None:
    """The encoder's host steps one at a time (``_encode_batch_device`` taken apart)."""
    from s4w_core import engine
    from s4w_core.gpu.kernels import gather_copy, sample_entropy

    prof = _encode.PROFILES["fast"]
    seg = prof.segment_elems

    def pieces() -> Any:
        batch = _encode._Batch()
        for i, x in enumerate(tl):
            raw = x if x.is_contiguous() else x.contiguous()
            nbytes = raw.numel() * raw.element_size()
            transform, w = engine.transform_for(raw.dtype, nbytes)
            batch.pieces.append(_encode._Piece(i, raw, None, None, raw.dtype, transform, w, 0, nbytes // w, seg, 0))
            batch.nbytes += nbytes
        return batch

    print("encode steps:")
    t("piece loop (encode_tensors_device)", pieces, n=20)
    ps = pieces().pieces
    meta_fn = lambda: np.array(  # noqa: E731
        [(p.e0, p.e1, p.w, p.seg, p.raw.data_ptr(), tk.OPS[p.op] if p.base is not None else 0, p.transform == _encode.ROTL1)
         for p in ps], dtype=np.int64).reshape(len(ps), 7)
    t("meta listcomp", meta_fn, n=20)
    meta = meta_fn()
    e0, e1, w, sg = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3]
    ne = e1 - e0
    pps = (ne + 255) // 256 * 256
    size = w * pps
    off = np.cumsum(size) - size
    planes = torch.empty(int(size.sum()), dtype=torch.uint8, device=dev)
    with _nvcomp.on_stream(dev):
        t("_stage_bases", lambda: _encode._stage_bases(ps, dev), n=20)
        rows = np.column_stack([meta[:, 4] + e0 * w, np.zeros(len(ps), np.int64), off, ne, pps])
        rot = meta[:, 6].astype(bool)
        for width in np.unique(w[rot]).tolist():
            sel = rot & (w == width)
            r, o = rows[sel], meta[sel, 5]
            t(f"launch_rows SPLIT w={width}", lambda width=width, r=r, o=o: tk.launch_rows(tk.SPLIT, int(width), planes, r, o))
            block, _warps = tk.block_config()
            t(f"  item_table w={width}", lambda r=r, block=block: tk.item_table(r, -(-r[:, 3] // block), dev))
        nseg = (ne + sg - 1) // sg
        nch = nseg * w

        def chunk_table() -> Any:
            piece_of = np.repeat(np.arange(len(ps), dtype=np.int64), nch)
            local = np.arange(int(nch.sum()), dtype=np.int64) - np.repeat(np.cumsum(nch) - nch, nch)
            s_idx = local // w[piece_of]
            j_idx = local % w[piece_of]
            s0 = s_idx * sg[piece_of]
            return off[piece_of] + j_idx * pps[piece_of] + s0, np.minimum(sg[piece_of], ne[piece_of] - s0), j_idx

        t("chunk table (numpy)", chunk_table, n=20)
        src_off, lengths, j_idx = chunk_table()
        cand = np.nonzero((j_idx != 0) & (lengths >= _encode.PROBE_BYTES))[0]
        step = (lengths[cand] - 256) // 15
        starts = src_off[cand][:, None] + step[:, None] * np.arange(16)[None, :]
        t("sample_entropy launch", lambda: sample_entropy(planes, starts, 256), n=20)
        bits = sample_entropy(planes, starts, 256)
        torch.cuda.synchronize()
        t("probe read-back (.cpu)", lambda: (bits < 7.92).cpu().numpy(), n=20)
        todo = np.ones(len(lengths), dtype=bool)
        todo[cand] = (bits < 7.92).cpu().numpy()
        idx = np.nonzero(todo)[0]
        maxlen = int(lengths[idx].max())
        c = _nvcomp.codec(prof.algorithm, dev, -(-maxlen // 65536) * 65536, **dict(prof.opts))
        cap = _nvcomp.max_compressed(c, maxlen, dev)
        t("max_compressed (cached)", lambda: _nvcomp.max_compressed(c, maxlen, dev), n=20)
        comp = torch.empty(cap * len(idx), dtype=torch.uint8, device=dev)
        comp_off = np.arange(len(idx), dtype=np.int64) * cap
        capv = np.full(len(idx), cap, dtype=np.int64)
        t("ANS encode enqueue (C API)", lambda: c.encode(planes, src_off[idx], lengths[idx], comp, comp_off), n=20)
        got = c.encode(planes, src_off[idx], lengths[idx], comp, comp_off)
        torch.cuda.synchronize()
        t("sizes read-back", lambda: list(got), n=20)
        t("encode_batch (enqueue + read-back)", lambda: _nvcomp.encode_batch(c, planes, src_off[idx], lengths[idx], comp, comp_off, capv), n=10)
        sizes = np.full(len(lengths), -1, dtype=np.int64)
        sizes[idx] = list(got)
        limit = np.where(j_idx == 0, lengths, lengths * 0.99)
        coded = (sizes > 0) & (sizes < limit)
        out_len = np.where(coded, sizes, lengths)
        slot = (out_len + 15) // 16 * 16
        out_off = np.cumsum(slot) - slot
        compact = torch.empty(int(slot.sum()), dtype=torch.uint8, device=dev)
        raw_m = ~coded
        t("gather_copy raw", lambda: gather_copy(planes, compact, src_off[raw_m], out_off[raw_m], lengths[raw_m], pad_ok=True), n=20)
        co = np.zeros(len(lengths), dtype=np.int64)
        co[idx] = comp_off
        t("gather_copy coded", lambda: gather_copy(comp, compact, co[coded], out_off[coded], sizes[coded], pad_ok=True), n=20)


if __name__ == "__main__":
    main()

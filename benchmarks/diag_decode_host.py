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
    staged = enc.out
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


if __name__ == "__main__":
    main()

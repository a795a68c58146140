"""Smoke tests of benchmarks/bench_peers.py, the peers benchmark (one process, one table).

* ``--tiny --cpu`` end to end in a subprocess: exit 0, every CPU-runnable peer ran and read back
  bit-exact (S3 peers against SeaweedFS when ``weed`` is installed, as the store tests do), the
  table and the targets are printed.
* the benchmark's device decoder (``_s4w_device_decode``: ``encode_tensors_device``'s compact
  buffer back to tensors through ``s4w_core.gpu._decode.decode_device``) on the CPU, with the
  Triton interpreter and the nvCOMP stand-in of tests/parity, so a change in the GPU reader's
  internals breaks here and not on the lent GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_peers.py"

#: every peer that runs without a GPU (codec peers in --cpu mode, all end-to-end peers)
CPU_PEERS = {
    "s4w_cpu", "s4w_cpu_1t", "zipnn", "zipnn_1t", "zstd", "zstd_1t",
    "s4w_store_async", "s4w_store_async_reserved", "s4w_store", "s4w_store_reserved", "torch_save", "dcp_save", "dcp_async", "dcp_async_zstd", "s4w_dcp", "s4w_dcp_async",
}  # fmt: skip
S3_PEERS = {"s4w_store_s3", "s4w_store_s3_reserved", "s3ckpt_torch_save", "dcp_s3", "s4w_dcp_s3"}
CODEC_PEERS = {"s4w_cpu", "s4w_cpu_1t", "zipnn", "zipnn_1t", "zstd", "zstd_1t"}


def _weed() -> bool:
    return bool(os.environ.get("S4W_WEED") or shutil.which("weed") or (Path(sys.executable).parent / "weed").exists())


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["S4W_DISABLE_GPU"] = "1"
    return env


@pytest.mark.s3  # starts SeaweedFS (when `weed` is installed) for the S3 peers; runs in the default suite
def test_bench_peers_tiny_cpu(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--cpu", "--dir", str(tmp_path), "--out", str(out)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, log
    res = json.loads(out.read_text())
    s3_up = isinstance(res["meta"]["s3"], dict)
    if os.environ.get("S4W_REQUIRE_S3") == "1" or _weed():
        assert s3_up, f"SeaweedFS did not start: {res['meta']['s3']}\n{log}"
    assert set(res["meta"]["cpu_runnable_peers"]) == CPU_PEERS | S3_PEERS
    # s3torchconnector.dcp imports tenacity, which s3torchconnector 1.5.0 does not declare
    optional_na = set() if importlib.util.find_spec("tenacity") else {"dcp_s3"}
    assert [v["variant"] for v in res["variants"]] == ["bf16", "fp32"]
    for v in res["variants"]:
        assert v["state_bytes"] > 0
        for name in sorted(CPU_PEERS | S3_PEERS):
            rec = v["peers"].get(name)
            assert rec is not None, f"{v['variant']}: peer {name} missing from the JSON"
            if (name in S3_PEERS and not s3_up) or (name in optional_na and rec["status"] == "n/a"):
                assert rec["status"] == "n/a", rec
                continue
            assert rec["status"] == "ok", f"{v['variant']}/{name}: {rec.get('reason')}\n{rec.get('trace', '')}"
            assert rec["bit_exact"] is True, f"{v['variant']}/{name}: {rec.get('mismatch')}"
            assert rec["ratio"] > 0
            if name in CODEC_PEERS:
                assert rec["enc_GBps"] > 0 and rec["dec_GBps"] > 0
            else:
                assert len(rec["saves"]) == 2 and rec["load_s"] > 0 and rec["save_first_s"] > 0
        assert v["peers"]["s4w_store_async"]["async"] is True  # CheckpointStore.save_async was timed
    assert res["targets"] and {t["status"] for t in res["targets"]} <= {"PASS", "FAIL", "n/a"}
    assert "| peer | variant | runs on |" in proc.stdout, log
    assert "### targets" in proc.stdout, log
    assert "NOT BIT-EXACT" not in proc.stdout + proc.stderr


_DEVICE_DECODE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [{root!r}, {bench!r}]
import torch
from tests.parity._interpret_checks import simulated_gpu
import bench_peers as bp
from s4w_core.gpu import _encode

g = torch.Generator().manual_seed(0)
cases = [
    [(torch.randn(n, generator=g) * 0.02).to(torch.bfloat16) for n in (70_000, 1000, 3)],
    [torch.randn(n, generator=g) * 0.02 for n in (50_000, 17)],
    [torch.full((40_000,), 0.5, dtype=torch.bfloat16), torch.randn(9000, generator=g).to(torch.float16)],
]
with simulated_gpu(segment_elems=1 << 14):
    for tl in cases:
        enc = _encode.encode_tensors_device(tl, "fast")
        plan = bp._s4w_decode_plan(enc, tl)
        outs = [torch.empty(n, dtype=torch.uint8) for n in plan.nbytes]
        bp._s4w_device_decode(enc, plan, outs)
        assert all(torch.equal(o, bp._bytes(t)) for o, t in zip(outs, tl)), "device decode"
        assert set(enc.codec_ids) <= {{"nvcomp-ans", "raw"}}, enc.codec_ids
print("device decode ok")
"""


def test_bench_peers_device_decoder_simulated() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed (the dev extra has it): the Triton interpreter runs the GPU kernels")
    code = _DEVICE_DECODE.format(root=str(ROOT), bench=str(ROOT / "benchmarks"))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "device decode ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]

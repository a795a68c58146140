"""@gpu: the GPU writer's device memory. A batch's coder slots are sized by each chunk's size
class, not by the batch's longest chunk (a GPT's hundreds of small storages took ~300 MB of slots
beside training); the device copies of host storages it codes (a store's re-encoding from pinned
copies, a non-blocking save) are held by the batch and the row/column and nonzero groups together
within one batch budget. Without a GPU the slot layout is checked under Triton's interpreter
(``coder_slots_sized_by_class`` in tests/parity/_interpret_checks.py)."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from s4w_core import engine
from s4w_core.codecs import CODECS
from s4w_core.format.container import FORMAT_VERSION, ContainerReader, ContainerWriter
from s4w_core.format.manifest import validate_manifest
from s4w_core.gpu import _coder, _decode, _encode, _nvcomp
from s4w_core.gpu._nonzero import NZ_TRANSFORM
from s4w_core.gpu._rowcol import RC_TRANSFORM
from s4w_core.workers import Pool
from tests.parity.test_gpu_roundtrip import _gpu_backend  # noqa: F401 - the GPU backend on, or a skip

pytestmark = pytest.mark.gpu


def gpt_like(layers: int = 4, d: int = 512, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPT block stack's bf16 tensors: large matrices beside many small norms and biases, and
    Adam-moment-like matrices with row and column scales (the row/column group) and with zero rows
    (the nonzero group)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for name, shape in (("ln1.w", (d,)), ("ln1.b", (d,)), ("attn.w", (d, 3 * d)), ("attn.b", (3 * d,)),
                            ("proj.w", (d, d)), ("proj.b", (d,)), ("ln2.w", (d,)), ("ln2.b", (d,)),
                            ("fc.w", (d, 4 * d)), ("fc.b", (4 * d,))):
            out[f"{i}.{name}"] = (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        r = torch.exp(2 * torch.randn(d, 1, generator=g))
        c = torch.exp(2 * torch.randn(1, 4 * d, generator=g))
        out[f"{i}.fc.w.exp_avg_sq"] = ((r * c * torch.randn(d, 4 * d, generator=g)) ** 2 * 1e-8).to(torch.bfloat16)
        z = 1e-3 * torch.randn(4 * d, d, generator=g)
        z[: 3 * d] = 0  # untouched rows
        out[f"{i}.emb.exp_avg"] = z.to(torch.bfloat16)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_coder_slots_follow_each_chunks_class():
    dev = torch.device("cuda", torch.cuda.current_device())
    prof = _coder.PROFILES["fast"]
    seg = prof.segment_elems
    batch = _coder.Batch()
    for i, t in enumerate(gpt_like(layers=2, d=256).values()):
        t = t.to(dev).reshape(-1)
        n = t.numel()
        batch.pieces.append(_coder.Piece(i, t, None, None, t.dtype, "planes-rotl1", 2, 0, n, seg, 0))
        batch.nbytes += 2 * n
    with _nvcomp.on_stream(dev):
        plan = _coder.EncodePlan(batch, prof, dev)
        coder = plan.calls[0][2]
        bounds = [*_nvcomp.SLOT_CLASSES, plan.maxlen]
        cls = _nvcomp.slot_classes(plan.lengths)
        assert len(plan.calls) >= 2, plan.calls
        for i, n in enumerate(plan.lengths.tolist()):
            # each chunk's slot: at least its own bound, at most its class's
            top = _nvcomp.max_compressed(coder, min(bounds[cls[i]], plan.maxlen), dev)
            assert _nvcomp.max_compressed(coder, n, dev) <= plan.caps[i] <= top, (i, n, plan.caps[i], top)
        uniform = plan.n * _nvcomp.max_compressed(coder, plan.maxlen, dev)
        assert plan.comp_bytes == int(plan.caps.sum()) and plan.comp_bytes < uniform / 2, (plan.comp_bytes, uniform)
        plan.run()  # (checks the device's chunk table against the host's)


def _host_jobs(state: dict[str, torch.Tensor], origin: str) -> list[engine.StorageJob]:
    """Pinned host copies of the GPU storages of ``state``, said to come from ``origin`` (a device:
    what a store's re-encoding codes; ``"cpu"``: DCP's staged copies, host tensors)."""
    jobs = []
    for path, t in state.items():
        h = _bytes(t.contiguous()).pin_memory()
        cols = t.shape[-1] if t.dim() == 2 else None
        jobs.append(engine.StorageJob(h, t.dtype, path, origin, None, None, cols=cols))
    return jobs


@pytest.mark.parametrize("origin", ["device", "cpu"])
def test_host_copies_coded_within_a_tenth_of_the_state(origin: str):
    """A GPU save of host storages (what a non-blocking save, a re-encoding and DCP's staged copies
    code, beside training) keeps its extra device memory within about a tenth of the state
    (``_nvcomp.work_bytes``): its batches, the device copies the batch and the row/column and nonzero
    groups hold together, and the samples of the transform choices. (Before: ~300 MB for a GPT-2
    151M's 0.91 GB state; DCP's host tensors took the default batch, +0.2 GB in the framework run.)"""
    dev = torch.device("cuda", torch.cuda.current_device())
    state = gpt_like(layers=12, d=1024, seed=1)
    jobs = _host_jobs(state, str(dev) if origin == "device" else "cpu")
    total = sum(j.raw.numel() for j in jobs)
    largest = max(j.raw.numel() for j in jobs)
    work = _nvcomp.work_bytes(total)
    buf = io.BytesIO()
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with ThreadPoolExecutor(2) as pool:
        writer = ContainerWriter(buf)
        storages = _encode.encode_storages(jobs, writer, pool, "fast")
        writer.finish({"format": "s4weights", "version": FORMAT_VERSION, "storages": storages, "tensors": [], "tree": None})
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    transforms = {s["transform"] for s in storages}
    print(f"state {total / 2**20:.0f} MiB, work {work / 2**20:.0f} MiB, peak {peak / 2**20:.1f} MiB, "
          f"largest storage {largest / 2**20:.1f} MiB, transforms {sorted(transforms)}")
    assert {RC_TRANSFORM, NZ_TRANSFORM, "planes-rotl1"} <= transforms, transforms  # all three holders
    assert peak <= 1.25 * work + largest, (peak >> 20, work >> 20)
    reader = ContainerReader.from_bytes(buf.getvalue())
    validate_manifest(reader.manifest, reader.data_start, reader.data_end, set(CODECS))
    with Pool(2, "test") as p:
        outs = _decode.decode_storages(reader, reader.manifest["storages"], dev, None, p)
    for out, job in zip(outs, jobs):
        assert torch.equal(out.cpu(), job.raw), job.path

"""The delta-op choice estimated for many storages at once (engine.choose_delta_ops) gives the
choices of the per-plane estimate, one by one or batched, and costs a few numpy passes per batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from s4w_core import delta, engine
from s4w_core.errors import BaseMismatchError
from s4w_core.planes import split_planes


def _bytes_est(planes: np.ndarray) -> float:
    """Order-0 entropy bytes of each plane, on a strided sample of at most 2**16 bytes."""
    tot = 0.0
    for row in planes:
        s = row[:: max(1, row.size // (1 << 16))]
        c = np.bincount(s, minlength=256)
        p = c[c > 0] / s.size
        tot += row.size * max(float(-(p * np.log2(p)).sum()), 1e-3) / 8
    return tot


def reference(job: engine.StorageJob, transform: str) -> str | None:
    w = 1 if transform == "bytes" else job.dtype.itemsize
    ranges = engine.delta_sample_ranges(job.raw.numel() // w)
    raw = torch.cat([job.raw[a * w : z * w] for a, z in ranges])
    base = torch.cat([job.base[a * w : z * w] for a, z in ranges])  # type: ignore[index]

    def planes(op: str | None) -> np.ndarray:
        r, b = raw, None
        if op == "sub":
            r = delta.forward("sub", raw, base, job.dtype)
        elif op == "xor":
            b = base
        if transform == "bytes":
            return (r if b is None else r ^ b).view(1, -1).numpy()
        return split_planes(r, job.dtype, b, rot=engine.plane_rot(transform)).numpy()

    best, best_cost = None, _bytes_est(planes(None))
    limit = (1 - engine.DELTA_MIN_GAIN) * best_cost
    for op in delta.ops_for(job.dtype, transform):
        c = _bytes_est(planes(op))
        if c < limit and c < best_cost:
            best, best_cost = op, c
    return best


def _jobs(seed: int = 0) -> list[tuple[engine.StorageJob, str]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate((1, 3, 64, 1000, 4096, 8193, 20000, 70000, 300000)):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(n, generator=g).to(dt)
            kind = (i + dt.itemsize) % 4
            if kind == 0:  # a small update: a delta pays
                b = (x.float() + 1e-3 * torch.randn(n, generator=g)).to(dt)
            elif kind == 1:  # unrelated values (exp_avg-like): plain
                b = torch.randn(n, generator=g).to(dt)
            elif kind == 2:
                b = x.clone()
            else:
                b = (x.float() * (1 + 1e-2 * torch.randn(n, generator=g))).to(dt)
            for tr in ("planes-rotl1", "planes", "bytes"):
                out.append((engine.StorageJob(x.view(torch.uint8), dt, f"t{i}", "cpu", b.view(torch.uint8), {}), tr))
    ints = torch.randint(0, 1000, (5000,), generator=g)
    out.append((engine.StorageJob(ints.view(torch.uint8), torch.int64, "ints", "cpu", (ints + 1).view(torch.uint8), {}), "bytes"))
    return out


def test_one_by_one_and_batched_match_the_per_plane_estimate() -> None:
    cases = _jobs()
    want = [reference(j, tr) for j, tr in cases]
    assert {"sub", "xor", None} <= set(want)  # every outcome is exercised
    assert [engine.choose_delta_op(j, tr) for j, tr in cases] == want
    fresh = _jobs()
    assert engine.choose_delta_ops([j for j, _ in fresh], [tr for _, tr in fresh]) == want
    # each choice is recorded on its job and returned for the same transform without estimating
    for (j, tr), w in zip(fresh, want):
        assert j.delta_choice == (tr, w)
        assert engine.choose_delta_op(j, tr) == w


def test_recorded_choice_is_per_transform_and_ops_still_filter() -> None:
    x = torch.randn(5000).to(torch.bfloat16)
    b = (x.float() + 1e-3).to(torch.bfloat16)
    job = engine.StorageJob(x.view(torch.uint8), torch.bfloat16, "w", "cpu", b.view(torch.uint8), {})
    assert engine.choose_delta_ops([job]) == ["sub"]
    assert job.delta_choice == ("planes-rotl1", "sub")
    job.delta_choice = ("planes-rotl1", None)  # a recorded choice is what choose_delta_op returns
    assert engine.choose_delta_op(job, "planes-rotl1") is None
    assert engine.choose_delta_op(job, "planes") == "sub"  # another transform is estimated
    assert engine.choose_delta_op(job, "planes-rotl1", ("xor",)) in ("xor", None)  # explicit ops: estimated


def test_plain_jobs_and_size_mismatch() -> None:
    x = torch.randn(100)
    plain = engine.StorageJob(x.view(torch.uint8), torch.float32, "p", "cpu")
    assert engine.choose_delta_ops([plain]) == [None] and plain.delta_choice is None
    bad = engine.StorageJob(x.view(torch.uint8), torch.float32, "bad", "cpu", torch.zeros(8, dtype=torch.uint8), {})
    with pytest.raises(BaseMismatchError, match="bad"):
        engine.choose_delta_ops([plain, bad])


def test_small_storages_share_histogram_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 small storages cost a handful of bincounts (one per pass of up to 64), not 6 per storage."""
    g = torch.Generator().manual_seed(3)
    jobs = []
    for i in range(200):
        x = torch.randn(64 + i, generator=g).to(torch.bfloat16)
        b = (x.float() + 1e-3 * torch.randn(x.numel(), generator=g)).to(torch.bfloat16)
        jobs.append(engine.StorageJob(x.view(torch.uint8), torch.bfloat16, f"t{i}", "cpu", b.view(torch.uint8), {}))
    want = [reference(j, "planes-rotl1") for j in jobs]
    calls = []
    orig = np.bincount
    monkeypatch.setattr(np, "bincount", lambda *a, **k: calls.append(1) or orig(*a, **k))
    assert engine.choose_delta_ops(jobs) == want
    assert len(calls) <= 4, len(calls)


def test_delta_save_roundtrip_uses_batched_choice(tmp_path) -> None:
    from s4w_core import CheckpointStore

    g = torch.Generator().manual_seed(5)
    s0 = {f"t{i}": torch.randn(32 * (i + 1), generator=g).to(torch.bfloat16) for i in range(50)}
    s1 = {k: (v.float() * (1 + 1e-2 * torch.randn(v.numel(), generator=g))).to(torch.bfloat16) for k, v in s0.items()}
    st = CheckpointStore(str(tmp_path), keyframe_copy=False)
    st.save(s0, step=1)
    st.save(s1, step=2)
    back = st.load(2)
    for k, v in s1.items():
        assert torch.equal(back[k].view(torch.int16), v.view(torch.int16))


def test_small_storages_are_coded_without_the_pool() -> None:
    """A small storage's chunks are coded on the calling thread (no hand-off per chunk); a large
    one's still go to the pool. Either way the bytes are those of the one-thread path."""
    import io

    from s4w_core.format.container import ContainerWriter
    from s4w_core.workers import Pool

    class CountingPool(Pool):
        submitted = 0

        def submit(self, *a, **k):  # type: ignore[no-untyped-def, override]
            CountingPool.submitted += 1
            return super().submit(*a, **k)

    small = torch.randn(1000).to(torch.bfloat16).view(torch.uint8)
    large = torch.randn(engine.INLINE_ENCODE_BYTES).view(torch.uint8)
    for raw, pooled in ((small, False), (large, True)):
        CountingPool.submitted = 0
        entries = []
        for threads in (2, 1):
            with CountingPool(threads) as pool:
                w = ContainerWriter(io.BytesIO())
                entries.append(engine.encode_storage_cpu(engine.StorageJob(raw, torch.float32 if pooled else torch.bfloat16, "t", "cpu"), w, pool))
        assert (CountingPool.submitted > 0) == pooled
        assert [c[3] for c in entries[0]["chunks"]] == [c[3] for c in entries[1]["chunks"]]

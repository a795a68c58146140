"""The CPU writer's cheap choices for small storages (docs/PERFORMANCE.md, "On a CPU"): storages of at
most ``choice.ESTIMATE_MAX_BYTES`` choose the row/column and nonzero variants and their delta op by
order-0 estimates on samples of ~4096 elements, never by coding samples with the chunk coder; larger
ones keep the trial codings. The estimates' helpers give the numbers of the plain computation, the
small-plane coder skips the level-3 retry between 4x and 8x, a store's save walks the state once, and
on a small GPT's training state the estimates store within 0.5 % of the trial codings' bytes."""

from __future__ import annotations

import io
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import s4w_core
from s4w_core import CheckpointStore, checksum, choice, engine
from s4w_core.codecs import ZSTD, Codec
from s4w_core.codecs import chunk as chunk_mod
from s4w_core.planes import nonzero as nzt
from s4w_core.store import writes
from tests.unit.helpers import bits, split

ROOT = Path(__file__).resolve().parents[2]


def moments(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """exp_avg_sq-like: a row scale times a column scale times noise, squared."""
    g = torch.Generator().manual_seed(seed)
    r = torch.exp(2 * torch.randn(rows, 1, generator=g))
    c = torch.exp(2 * torch.randn(1, cols, generator=g))
    return ((r * c * torch.randn(rows, cols, generator=g)) ** 2 * 1e-6).to(dtype)


def sparse_delta(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``(x, base)``: x is base with 5 % of its elements changed (a residual mostly zeros)."""
    g = torch.Generator().manual_seed(seed)
    base = (0.02 * torch.randn(n, generator=g)).to(torch.bfloat16)
    x = base.clone()
    moved = torch.rand(n, generator=g) < 0.05
    x[moved] = (x[moved].float() * (1 + 1e-2 * torch.randn(int(moved.sum()), generator=g))).to(torch.bfloat16)
    return x, base


class Trials:
    """Counts the chunk coder's calls made by the choices (``choice.encode_chunk``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = choice.encode_chunk

        def counting(*a: Any) -> Any:
            self.calls += 1
            return real(*a)

        monkeypatch.setattr(choice, "encode_chunk", counting)


def test_small_storages_choose_without_trial_coding(monkeypatch: pytest.MonkeyPatch) -> None:
    trials = Trials(monkeypatch)
    dt, rot = torch.bfloat16, "planes-rotl1"
    x = moments(128, 256, dt)  # 64 KiB: estimated
    assert x.numel() * 2 <= choice.ESTIMATE_MAX_BYTES
    assert choice.rowcol_pays(bits(x), None, dt, rot, None, 256)  # the row/column scales are seen
    base = moments(128, 256, dt, seed=1)
    assert choice.rowcol_choice(bits(x), bits(base), dt, rot, "xor", 256) == (True, None)
    s, b = sparse_delta(1 << 15)
    assert choice.nonzero_pays(bits(s), bits(b), dt, rot, "xor")  # the estimate says it pays: ...
    assert trials.calls > 0  # ... then its sample is coded both ways, as for a large storage
    trials.calls = 0
    assert not choice.nonzero_pays(bits(x), bits(base), dt, rot, "xor")
    assert not choice.rowcol_pays(bits((0.02 * torch.randn(128, 256)).to(dt)), None, dt, rot, None, 256)
    assert trials.calls == 0
    # a storage above the bound: the row/column probe estimates its (larger) sample too; the
    # nonzero trial codes its sample both ways
    big = moments(512, 256, dt)
    assert big.numel() * 2 > choice.ESTIMATE_MAX_BYTES
    assert choice.rowcol_pays(bits(big), None, dt, rot, None, 256) and trials.calls == 0
    s, b = sparse_delta(1 << 17)
    assert choice.nonzero_pays(bits(s), bits(b), dt, rot, "xor") and trials.calls >= 2


def test_estimated_choices_round_trip_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small storages coded with the estimated variants (row/column, each delta op) decode
    bit-exactly, through a store's re-encoding as well; no trial coding was made for them (no
    residual here has zeros enough for the nonzero variant's trial)."""

    def no_trials(*a: Any) -> Any:
        raise AssertionError("a small storage's choice coded a sample")

    monkeypatch.setattr(choice, "encode_chunk", no_trials)
    g = torch.Generator().manual_seed(4)
    w0 = (0.02 * torch.randn(96, 384, generator=g)).to(torch.bfloat16)
    s0 = {"w": w0, "m": moments(96, 384, torch.bfloat16), "b": torch.randn(96, generator=g).to(torch.bfloat16)}
    s0["w"].view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("inf")]).to(torch.bfloat16)
    s1 = {k: v.clone() for k, v in s0.items()}
    s1["w"] += (1e-3 * torch.randn(96, 384, generator=g)).to(torch.bfloat16)
    s1["m"] = moments(96, 384, torch.bfloat16, seed=5)
    s1["b"] = torch.randn(96, generator=g).to(torch.bfloat16)
    buf = io.BytesIO()
    s4w_core.save(s0, buf)
    tr = {s["path"]: s["transform"] for s in split(buf.getvalue())[2]["storages"]}
    assert tr["m"] == "rc-planes-rotl1" and tr["w"] == "planes-rotl1", tr
    back = s4w_core.load(buf.getvalue())
    assert all(torch.equal(bits(back[k]), bits(v)) for k, v in s0.items())
    with tempfile.TemporaryDirectory() as d:
        st = CheckpointStore(d)
        st.save(s0, step=0)
        st.save(s1, step=1)
        st.wait()  # step 0 re-encoded as a delta against step 1
        assert st.info(0).kind == "delta"
        for step, s in ((0, s0), (1, s1)):
            got = st.load(step)
            assert all(torch.equal(bits(got[k]), bits(v)) for k, v in s.items())
        st.close()


def test_small_sparse_residual_still_takes_nonzero() -> None:
    """A small storage whose residual is mostly zeros (a bias a fine-tune step barely moved) still
    goes nz: the estimate lets the trial run, and the trial says it pays."""
    dt, rot = torch.bfloat16, "planes-rotl1"
    x, base = sparse_delta(384)
    assert choice.nonzero_estimates(bits(x), bits(base), dt, rot, "xor") is not None
    assert choice.nonzero_pays(bits(x), bits(base), dt, rot, "xor")
    dense = (0.02 * torch.randn(384)).to(dt)
    assert not choice.nonzero_pays(bits(dense), None, dt, rot, None)


def test_order0_bytes_is_the_entropy_estimate() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 7, 100, 4096, chunk_mod._CLOGC_MAX, chunk_mod._CLOGC_MAX + 1, 70_000):
        a = rng.integers(0, 1 + n % 40, n).astype(np.uint8)
        assert chunk_mod.order0_bytes(a) == pytest.approx(n / chunk_mod.entropy_ratio(a), rel=1e-12)
    assert chunk_mod.order0_bytes(np.zeros(0, np.uint8)) == 0.0
    assert chunk_mod.order0_bytes(np.zeros(5000, np.uint8)) == pytest.approx(5000 * 1e-3 / 8)


@pytest.mark.parametrize("op", [None, "xor", "sub"])
def test_nonzero_estimates_are_those_of_the_split(op: str | None) -> None:
    """The nonzero planes' histograms taken from the plain ones less the zeros: the estimates of
    splitting the nonzero elements out (nzt.split_nonzero)."""
    x, base = sparse_delta(20_000, seed=3)
    est = choice.nonzero_estimates(bits(x), bits(base), torch.bfloat16, "planes-rotl1", op)
    ranges = choice.estimate_ranges(20_000)
    r = torch.cat([bits(x)[a * 2 : z * 2] for a, z in ranges])
    b = torch.cat([bits(base)[a * 2 : z * 2] for a, z in ranges])
    words = nzt.residual_words(r, torch.bfloat16, b, op)
    bitmap, planes = nzt.split_nonzero(words, 2, rot=True)
    plain = engine.planes_of(torch.from_numpy(words.view(np.uint8)), torch.bfloat16, "planes-rotl1", None).numpy()
    want_plain = sum(chunk_mod.order0_bytes(p) for p in plain)
    want_nz = chunk_mod.order0_bytes(bitmap) + sum(chunk_mod.order0_bytes(p) for p in planes)
    if op is None:  # x alone has no zeros
        assert est is None
        return
    assert est is not None
    assert est[0] == pytest.approx(want_plain, rel=1e-12) and est[1] == pytest.approx(want_nz, rel=1e-12)


def _level3_calls(monkeypatch: pytest.MonkeyPatch, plane: np.ndarray, j: int = 1) -> int:
    calls = []
    real = ZSTD

    def enc(data: Any) -> bytes:
        calls.append(1)
        assert real.encode_cpu is not None
        return real.encode_cpu(data)

    monkeypatch.setattr(chunk_mod, "ZSTD", Codec(real.id, True, enc, real.decode_cpu, real.description))
    cid, out = chunk_mod.encode_chunk("planes-rotl1", j, plane)
    assert bytes(ZSTD.decode(out, plane.size) if cid == "zstd" else out) == plane.tobytes()
    return len(calls)


def test_mid_planes_retry_level3_only_below_one_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    # ~1.2 bits a byte under Huffman: 4x to 8x smaller
    mid = rng.choice(np.array([0, 1, 2], np.uint8), size=30_000, p=[0.8, 0.1, 0.1])
    size = len(chunk_mod.zstd_encode_plane(mid))
    assert chunk_mod.LOW_ENTROPY_RATIO * size < mid.size <= chunk_mod.LOW_ENTROPY_RATIO_SMALL * size
    assert _level3_calls(monkeypatch, mid) == 0
    near_constant = np.zeros(30_000, np.uint8)
    near_constant[::997] = 3
    assert _level3_calls(monkeypatch, near_constant) == 1
    # a plane of SMALL_PLANE bytes or more, or under TINY_PLANE (a bias): at 4x, as before
    big = rng.choice(np.array([0, 1, 2], np.uint8), size=chunk_mod.SMALL_PLANE, p=[0.8, 0.1, 0.1])
    assert _level3_calls(monkeypatch, big) == 1
    tiny = rng.choice(np.array([0, 1, 2], np.uint8), size=chunk_mod.TINY_PLANE - 1, p=[0.8, 0.1, 0.1])
    size = len(chunk_mod.zstd_encode_plane(tiny))
    assert chunk_mod.LOW_ENTROPY_RATIO * size < tiny.size <= chunk_mod.LOW_ENTROPY_RATIO_SMALL * size
    assert _level3_calls(monkeypatch, tiny) == 1


def test_delta_choice_passes_split_by_elements_keep_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(6)
    jobs = []
    for i, n in enumerate([96, 384, 12_288, 36_864, 36_864, 70_000, 5, 8192]):
        b = (0.02 * torch.randn(n, generator=g)).to(torch.bfloat16)
        x = (b.float() + (1e-4 if i % 2 else 1e-2) * torch.randn(n, generator=g)).to(torch.bfloat16)
        jobs.append(engine.StorageJob(bits(x), torch.bfloat16, f"t{i}", "cpu", bits(b), {}))

    def choose(**kw: Any) -> list[str | None]:
        for j in jobs:
            j.delta_choice = None
        return engine.choose_delta_ops(jobs, **kw)

    whole = choose(estimate_small=True)
    full = choose()
    monkeypatch.setattr(choice, "_BATCH_PASS_ELEMS", 1)
    assert choose(estimate_small=True) == whole and choose() == full
    assert set(full) - {None}  # some delta chosen


def test_large_storages_keep_the_full_delta_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage above ESTIMATE_MAX_BYTES whose delta sample is no larger (147,456 bf16 elements:
    a 2**16-element sample, 128 KiB) is estimated on its whole sample, as before; a small one on
    ~4096 elements, in a shared pass."""
    one: list[int] = []
    real_one = choice._choose_one

    def spy(raw: np.ndarray, *a: Any) -> Any:
        one.append(raw.size)
        return real_one(raw, *a)

    monkeypatch.setattr(choice, "_choose_one", spy)
    g = torch.Generator().manual_seed(8)
    jobs = []
    for n in (384 * 384, 96 * 384):
        b = (0.02 * torch.randn(n, generator=g)).to(torch.bfloat16)
        x = (b.float() + 1e-3 * torch.randn(n, generator=g)).to(torch.bfloat16)
        jobs.append(engine.StorageJob(bits(x), torch.bfloat16, f"t{n}", "cpu", bits(b), {}))
    assert len(engine.delta_sample_ranges(384 * 384)) > 1
    engine.choose_delta_ops(jobs, estimate_small=True)
    assert one == [(1 << 16) * 2]  # the large one alone, on its whole sample


def test_store_save_walks_the_state_once(monkeypatch: pytest.MonkeyPatch) -> None:
    walks = []
    real = writes.encode_tree

    def counting(*a: Any) -> Any:
        walks.append(1)
        return real(*a)

    monkeypatch.setattr(writes, "encode_tree", counting)
    monkeypatch.setattr(s4w_core.pipeline, "encode_tree", counting)
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    with tempfile.TemporaryDirectory() as d:
        st = CheckpointStore(d)
        st.save(state, step=1)
        assert len(walks) == 1
        st.save(state, step=2)  # the cache of step 1 became step 1's re-encoding's source
        st.wait()
        assert len(walks) == 2
        assert torch.equal(st.load(1)["w"], state["w"])
        st.close()


def test_xxh3_of_bytes_held() -> None:
    for n in (0, 1, 17, 4096, checksum._HOLD_GIL_BELOW, checksum._HOLD_GIL_BELOW + 1):
        data = bytes(range(256)) * (n // 256) + bytes(n % 256)
        assert checksum.xxh3_hex_holding_gil(data) == xxhash.xxh3_64_hexdigest(data)
        assert checksum.xxh3_hex_holding_gil(bytearray(data)) == xxhash.xxh3_64_hexdigest(data)


@pytest.fixture(scope="module")
def gpt_states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """benchmarks/bench_tensor_cost.py's state: a 0.5 M-parameter bf16 GPT + AdamW, 3 steps apart."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _train_gpt import Trainer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    torch.manual_seed(0)
    tr = Trainer("bf16", 20, layers=4, d=96, ctx=64, batch=4)

    def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
        if isinstance(tree, torch.Tensor):
            return {prefix: tree.detach().clone()}
        if isinstance(tree, dict):
            return {k2: v2 for k, v in tree.items() for k2, v2 in flat(v, f"{prefix}/{k}").items()}
        return {}

    for _ in range(3):
        tr.step()
    s0 = flat(tr.state())
    for _ in range(3):
        tr.step()
    return s0, flat(tr.state())


def _stored(s0: dict[str, torch.Tensor], s1: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Bytes of ``s1`` saved whole and of ``s0`` as a delta against it (the store's re-encoding)."""
    col = engine.Collector()
    s4w_core.skeleton.encode_tree(s1, col.add)
    by_path = {j.path: j.raw for j in col.jobs}
    whole, delta = io.BytesIO(), io.BytesIO()
    s4w_core.save(s1, whole)
    s4w_core.save(s0, delta, _base_lookup=lambda p, n, d: (by_path[p], {"b": p}) if p in by_path else None)
    m = split(delta.getvalue())[2]
    assert sum(1 for e in m["storages"] if e["delta"]) > len(m["storages"]) // 2
    return len(whole.getvalue()), len(delta.getvalue())


def test_estimates_store_within_half_a_percent_of_trials(
    gpt_states: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    s0, s1 = gpt_states
    estimated = _stored(s0, s1)
    monkeypatch.setattr(choice, "ESTIMATE_MAX_BYTES", -1)  # every storage coded on trial, as before
    trials = _stored(s0, s1)
    assert sum(estimated) <= 1.005 * sum(trials), (estimated, trials)
    assert estimated[0] <= 1.005 * trials[0] and estimated[1] <= 1.005 * trials[1], (estimated, trials)

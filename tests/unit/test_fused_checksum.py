"""The CPU load's fused merge + xxh3 (``engine.decode_storage_cpu`` with
``planes.reference.merge_hash_into``): the streamed digest is the one-shot digest of the whole
output, and a byte the merge gets wrong is still caught."""

from __future__ import annotations

import io
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import s4w_core
from s4w_core import checksum as ck
from s4w_core import engine
from s4w_core.errors import ChecksumMismatchError
from s4w_core.planes import _jit
from s4w_core.planes import reference as ref
from tests.unit.helpers import rebuild, split

numba_only = pytest.mark.skipif(not _jit.enabled(), reason="numba is not installed (pip install s4weights[numba])")

#: 3 segments of 4 MiB (the default segment), well above engine.FUSED_HASH_MIN_BYTES
N_BIG = 3 * (1 << 20) + 12_345


def _big_blob(n: int = N_BIG, seed: int = 0) -> tuple[torch.Tensor, bytes]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * 0.02
    buf = io.BytesIO()
    s4w_core.save({"w": t, "small": torch.randn(1000, generator=g)}, buf, profile="portable", threads=1)
    return t, buf.getvalue()


def _count_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    orig = engine.merge_hash_into

    def counting(parts: Any, w: int, out: np.ndarray, *a: Any, **k: Any) -> None:
        calls.append(out.size)
        orig(parts, w, out, *a, **k)

    monkeypatch.setattr(engine, "merge_hash_into", counting)
    return calls


@pytest.mark.parametrize("numba_on", [True, False])
@settings(max_examples=40, deadline=None)
@given(
    w=st.sampled_from([2, 4]),
    n=st.integers(0, 20_000),
    block=st.integers(1, 9_999),
    seed=st.integers(0, 2**31),
    with_base=st.booleans(),
)
def test_fused_digest_equals_one_shot(numba_on: bool, w: int, n: int, block: int, seed: int, with_base: bool) -> None:
    """Any length, any block size (odd ones too): the same bytes as merge_into, and the streamed
    xxh3 equals the one-shot xxh3 of the output."""
    if numba_on and not _jit.enabled():
        pytest.skip("numba is not installed")
    with pytest.MonkeyPatch.context() as mp:
        if not numba_on:
            mp.setenv("S4W_NUMBA", "0")
        rng = np.random.default_rng(seed)
        parts = [np.frombuffer(rng.bytes(n), dtype=np.uint8) for _ in range(w)]  # read-only, like decoded chunks
        base = rng.integers(0, 256, n * w, dtype=np.uint8) if with_base else None
        want = np.empty(n * w, dtype=np.uint8)
        ref.merge_into(parts, w, want, base)
        out = np.empty(n * w, dtype=np.uint8)
        h = xxhash.xxh3_64()
        seen: list[int] = []

        def update(b: np.ndarray) -> None:
            seen.append(b.size)
            h.update(b)

        ref.merge_hash_into(parts, w, out, base, update, block)
        assert np.array_equal(out, want)
        assert sum(seen) == n * w
        assert h.hexdigest() == xxhash.xxh3_64_hexdigest(want) == xxhash.xxh3_64_hexdigest(out)


def test_merge_hash_into_refuses_partial_elements() -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("S4W_NUMBA", "0")
        with pytest.raises(ValueError):
            ref.merge_hash_into([np.zeros(2, np.uint8)] * 4, 4, np.empty(9, np.uint8), None, lambda b: None)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_load_round_trip(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    t, blob = _big_blob()
    calls = _count_fused(monkeypatch)
    back = s4w_core.load(blob, threads=threads)
    assert torch.equal(back["w"].view(torch.int32), t.view(torch.int32))
    assert sum(calls) == t.numel() * 4  # every segment of the large tensor went through the fused path


def _flip_on_call(k: int, calls: list[int], out_arg: int) -> Any:
    """A wrapper factory: after the ``k``-th call of the wrapped merge, flip one bit in the middle
    of what it wrote (its argument ``out_arg``)."""

    def wrap(orig: Any) -> Any:
        def merged(*a: Any, **kw: Any) -> Any:
            r = orig(*a, **kw)
            calls.append(1)
            if len(calls) == k:
                out = a[out_arg]
                out[out.size // 2] ^= 1
            return r

        return merged

    return wrap


@pytest.mark.parametrize("numba_on", [pytest.param(True, marks=numba_only), False])
def test_fused_path_catches_a_wrong_merged_byte(monkeypatch: pytest.MonkeyPatch, numba_on: bool) -> None:
    """A merge that writes one wrong byte in the middle of a large fp32 tensor (the chunks are all
    intact, so only the tensor checksum can see it) fails the load with ChecksumMismatchError."""
    t, blob = _big_blob()
    fused = _count_fused(monkeypatch)
    merges: list[int] = []
    if numba_on:
        assert _jit._kernels is not None
        monkeypatch.setitem(_jit._kernels, "merge4", _flip_on_call(30, merges, -1)(_jit._kernels["merge4"]))
    else:
        monkeypatch.setenv("S4W_NUMBA", "0")
        monkeypatch.setattr(ref, "merge_into", _flip_on_call(30, merges, 2)(ref.merge_into))
    with pytest.raises(ChecksumMismatchError, match=r"tensor 'w' decoded to bytes that do not match its recorded checksum xxh3-64:"):
        s4w_core.load(blob, threads=1)
    assert fused and len(merges) >= 30


def test_fold64_storage_keeps_the_one_shot_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large plane storage whose recorded checksum is fold64 (as a GPU writer records) is verified
    as before: loads when right, fails when wrong."""
    t, blob = _big_blob()
    prefix, _trailer, man = split(blob)
    (entry,) = [s for s in man["storages"] if s["nbytes"] == t.numel() * 4]
    right = f"fold64:{ck.fold64(t.view(torch.uint8)):016x}"
    entry["checksum"] = right
    calls = _count_fused(monkeypatch)
    back = s4w_core.load(rebuild(prefix, man), threads=1)
    assert torch.equal(back["w"].view(torch.int32), t.view(torch.int32)) and not calls
    entry["checksum"] = right[:-1] + ("0" if right[-1] != "0" else "1")
    with pytest.raises(ChecksumMismatchError):
        s4w_core.load(rebuild(prefix, man), threads=1)


def test_fused_xor_delta_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """An xor delta of a large fp32 storage is undone and hashed in the fused merge; a wrong base
    is still caught."""
    from s4w_core.store import CheckpointStore

    monkeypatch.setattr(engine, "choose_delta_op", lambda job, transform: "xor")
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(600_000, generator=g)
    w1 = w0 + 1e-4 * torch.randn(600_000, generator=g)
    calls = _count_fused(monkeypatch)
    with tempfile.TemporaryDirectory() as d:
        st_ = CheckpointStore(d, threads=1)
        st_.save({"w": w1}, step=1)
        st_.save({"w": w0}, step=2)
        st_.wait()  # step 1 becomes a delta against step 2 behind the save
        rec = st_.info(1)
        assert rec.kind == "delta" and rec.delta_ops == {"xor": 1}, rec
        calls.clear()
        assert torch.equal(st_.load(step=1, threads=1)["w"].view(torch.int32), w1.view(torch.int32))
        assert sum(calls) == 2 * w1.numel() * 4  # the base (whole) and the delta, each merged and hashed once
        st_.close()

"""Non-blocking saves (:meth:`CheckpointStore.save_async`): every step loads bit for bit as it was
when the call returned although the caller changes the state at once; saves run in order, one at
a time; ``on_busy="error"``; a background failure surfaces on the next call, on ``wait()``, on
``close()`` and at interpreter exit; ``max_pending_bytes`` is respected and reported."""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import io
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import s4w_core
from s4w_core import engine, hostmem, obs, pipeline
from s4w_core._fsutil import EarlyWriteback
from s4w_core.errors import (
    AsyncSaveError,
    ConflictError,
    SaveInProgressError,
    StoreError,
    UnsupportedTypeError,
)
from s4w_core.skeleton import encode_tree
from s4w_core.store import CheckpointStore, SaveHandle, open_backend
from s4w_core.store._async import CancellableWriter, Cancelled, snapshot
from s4w_core.store._backend import Backend

from .helpers import Crash, FaultyBackend, bits_equal, make_run

REPO = Path(__file__).resolve().parents[2]


def _mutate(state: dict[str, Any]) -> None:
    """What a training loop does right after the save returns: every tensor changed in place
    (the shared view's storage too) and new Python values."""
    m = state["model"]
    m["w32"].add_(1.0)
    m["emb"].mul_(2)
    m["buf"].zero_()
    st = state["optimizer"]["state"][0]
    st["exp_avg"].fill_(float("nan"))
    st["exp_avg_sq"].neg_()
    st["step"].add_(1)
    group = state["optimizer"]["param_groups"][0]
    group["lr"] = 123.0
    group["betas"] = (0.0, 0.0)
    group["params"].append(99)
    state["note"] = "mutated"
    state["step"] = -1


class Gated(FaultyBackend):
    """Data writes wait for ``gate``; commit records are logged in order."""

    def __init__(self, inner: Backend, fail: Any = None) -> None:
        super().__init__(inner, fail or (lambda verb, key: False))
        self.gate = threading.Event()
        self.gate.set()
        self.commits: list[str] = []

    def writer(self, key: str) -> Any:
        if key.startswith("data/"):
            assert self.gate.wait(60), "gate never opened"
        return super().writer(key)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        super().put(key, data, if_absent=if_absent)
        if key.startswith("commits/"):
            self.commits.append(key)


# ----------------------------------------------------------------------------- bit-exact chains
def test_async_chain_bit_exact_while_caller_mutates(store_url: str) -> None:
    run = make_run(6)
    ref_run = copy.deepcopy(run)
    st = CheckpointStore(store_url, profile="portable", keyframe_every=4)
    expected, handles = [], []
    for i, s in enumerate(run):
        expected.append(copy.deepcopy(s))
        h = st.save_async(s, i, extra={"i": i})
        _mutate(s)  # at once, while the save runs in the background
        handles.append(h)
    infos = [h.result(timeout=120) for h in handles]
    assert [i.step for i in infos] == list(range(6))
    assert {h.mode for h in handles} == {"async-snapshot"}
    assert all(h.host_bytes == infos[0].raw_bytes and h.blocked_s >= 0 for h in handles)
    st.wait()  # the re-encoding of the step below the newest
    recs = st.list()
    assert recs[-1].kind == "keyframe" and "delta" in {r.kind for r in recs} and max(r.depth for r in recs) < 4
    for i in range(6):
        assert bits_equal(st.load(i), expected[i]), f"step {i}"
    # the same states saved blocking make the same chain: async is the reference path, later
    ref = CheckpointStore(store_url.rstrip("/") + "-ref", profile="portable", keyframe_every=4)
    for i, s in enumerate(ref_run):
        ref.save(s, i, extra={"i": i})
    ref.wait()
    # (the coded data, not the whole object: its compressed manifest holds the time and the URL)
    shape = [(r.kind, r.depth, r.base_step, r.stored_bytes, r.delta_ops) for r in ref.list()]
    assert [(r.kind, r.depth, r.base_step, r.stored_bytes, r.delta_ops) for r in recs] == shape
    st.close()
    ref.close()


def test_snapshot_encodes_exactly_like_the_state_did() -> None:
    class Cfg(dict):
        pass

    s4w_core.register_dict_type(Cfg)
    base = torch.arange(24, dtype=torch.float32)
    p = torch.nn.Parameter(torch.randn(3, 4))
    c = torch.randn(4, dtype=torch.complex64)
    state = {
        "base": base,
        "strided": base[2:20:3],
        "transposed": base.view(4, 6).t(),
        "p": p,
        "same": [p, p],
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "grad": torch.ones(3, requires_grad=True),
        "conj": c.conj(),
        "empty": torch.empty(0, 3),
        "bf16": (1, torch.ones(5, dtype=torch.bfloat16)),
        "od": collections.OrderedDict(b=2, a=torch.arange(3)),
        "cfg": Cfg(lr=0.1),
        "ns": argparse.Namespace(x=1),
        "set": {3, 1, 2},
        "bytes": b"\x00\xff",
        "np": np.arange(5, dtype=np.int16),
        "meta": [torch.float16, torch.device("cpu"), torch.Size([2, 3])],
        7: "int key",
    }

    def encode(obj: Any) -> dict[str, Any]:
        m, _, _ = pipeline.encode(obj, io.BytesIO(), "portable", 1, None, None)
        m.pop("created")
        return m  # chunk offsets, lengths and checksums: equal manifests mean equal bytes

    want = encode(state)
    col = engine.Collector()
    encode_tree(state, col.add)
    snap, host, dev = snapshot(state, col)
    assert host == sum(j.raw.numel() for j in col.jobs) and dev == 0
    base.add_(1)
    p.data.mul_(3)
    c.zero_()
    state["od"]["a"].add_(5)
    state["cfg"]["lr"] = 9
    state["np"][:] = 0
    assert encode(snap) == want
    assert snap["same"][0] is snap["same"][1] and snap["strided"].untyped_storage().data_ptr() == snap["base"].data_ptr()
    assert type(snap["p"]) is torch.nn.Parameter and snap["grad"].requires_grad and type(snap["cfg"]) is Cfg


# ----------------------------------------------------------------------------- order, busy
def test_next_save_waits_for_the_previous_one(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    gb = Gated(open_backend(url))
    st = CheckpointStore(url, profile="portable", _backend=gb)
    run = make_run(3)
    gb.gate.clear()
    h0 = st.save_async(run[0], 0)
    assert not h0.done() and st.in_flight is h0 and st.pending_bytes == h0.host_bytes > 0
    threading.Timer(0.3, gb.gate.set).start()
    h1 = st.save_async(run[1], 1)  # waits for step 0 to be committed: its base
    assert h0.done() and h1.waited_s >= 0.2 and "wait" in h1.stages and h1.blocked_s >= h1.waited_s
    st.save(run[2], 2)  # a blocking save waits for the one in flight too
    st.wait()
    # each save commits in order; the step below is re-encoded (its record rewritten) behind it
    assert list(dict.fromkeys(gb.commits)) == [f"commits/step_{i:012d}.json" for i in range(3)]
    assert [r.base_step for r in st.list()] == [1, 2, None]
    assert st.pending_bytes == 0 and st.peak_pending_bytes == h0.host_bytes
    for i in range(3):
        assert bits_equal(st.load(i), run[i])


def test_delete_and_pin_of_a_step_in_flight_wait_for_its_save(tmp_path: Path) -> None:
    """``delete(step)`` / ``pin(step)`` right after ``save_async(state, step)``: the save is
    waited for, so the step is deleted / pinned, not reported missing (and then committed)."""
    url = str(tmp_path / "s")
    gb = Gated(open_backend(url))
    st = CheckpointStore(url, profile="portable", _backend=gb)
    run = make_run(3)
    st.save(run[0], 0)
    for step, act in ((1, st.delete), (2, st.pin)):
        gb.gate.clear()
        h = st.save_async(run[step], step)
        assert not h.done()
        threading.Timer(0.2, gb.gate.set).start()
        act(step)
        assert h.done()
        st.wait()  # (the re-encoding behind the save writes through the gate too)
    assert st.steps() == [0, 2] and st.info(2).pinned
    assert bits_equal(st.load(2), run[2]) and bits_equal(st.load(0), run[0])


def test_on_busy_error_raises_and_runs_nothing(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    gb = Gated(open_backend(url))
    st = CheckpointStore(url, profile="portable", on_busy="error", _backend=gb)
    run = make_run(2)
    gb.gate.clear()
    h0 = st.save_async(run[0], 0)
    with pytest.raises(SaveInProgressError, match="step 0 is still running"):
        st.save_async(run[1], 1)
    with pytest.raises(SaveInProgressError):
        st.save(run[1], 1)
    assert isinstance(SaveInProgressError("x"), StoreError)
    gb.gate.set()
    st.wait()
    assert h0.done() and st.steps() == [0]
    st.save_async(run[1], 1).result(timeout=60)
    assert st.steps() == [0, 1]
    with pytest.raises(ValueError, match="on_busy"):
        CheckpointStore(url, on_busy="drop")  # type: ignore[arg-type]


def test_caller_errors_are_raised_at_once(tmp_path: Path) -> None:
    st = CheckpointStore(str(tmp_path / "s"), profile="portable")
    with pytest.raises(UnsupportedTypeError):
        st.save_async({"x": object()}, 0)
    assert st.in_flight is None and st.steps() == []
    st.save({"w": torch.ones(3)}, 0)
    st.save({"w": torch.ones(3)}, 1)
    with pytest.raises(ConflictError):  # known committed: raised in the caller; else by the worker
        st.save_async({"w": torch.ones(3)}, 1).result(timeout=60)
    h = st.save_async({"w": torch.zeros(3)}, 1, overwrite=True)
    assert h.result(timeout=60).step == 1 and st.load(1)["w"].tolist() == [0.0, 0.0, 0.0]
    h = st.save({"w": torch.ones(3)}, 2, blocking=False)
    assert isinstance(h, SaveHandle) and h.result(timeout=60).step == 2


# ----------------------------------------------------------------------------- failures
@pytest.mark.parametrize("surface", ["save", "save_async", "load", "wait", "close"])
def test_background_failure_surfaces_on_the_next_call(store_url: str, surface: str) -> None:
    run = make_run(3)
    doomed = "commits/step_000000000001.json"
    fb = FaultyBackend(open_backend(store_url), lambda verb, key: verb == "put" and key == doomed)
    st = CheckpointStore(store_url, profile="portable", _backend=fb)
    st.save(run[0], 0)
    h = st.save_async(run[1], 1)
    while not h.done():  # done() does not report the error
        h._event.wait(0.05)  # noqa: SLF001
    call = {
        "save": lambda: st.save(run[2], 2),
        "save_async": lambda: st.save_async(run[2], 2),
        "load": lambda: st.load(0),
        "wait": st.wait,
        "close": st.close,
    }[surface]
    with pytest.raises(AsyncSaveError, match="step 1") as ei:
        call()
    assert isinstance(ei.value.__cause__, Crash) and isinstance(ei.value, StoreError)
    # reported once; nothing partial is visible; the store goes on from the last commit
    st2 = CheckpointStore(store_url, profile="portable") if surface == "close" else st
    assert st2.steps() == [0]
    assert not [o.key for o in st2.backend.list("data/") if "step_000000000001" in o.key]
    st2.save_async(run[2], 2).result(timeout=60)
    st2.wait()
    assert st2.info(0).base_step == 2 and st2.info(2).kind == "keyframe"
    assert bits_equal(st2.load(2), run[2]) and bits_equal(st2.load(0), run[0])
    st2.close()


def test_failure_seen_through_the_handle_is_not_raised_again(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    fb = FaultyBackend(open_backend(url), lambda verb, key: verb == "writer" and "step_000000000000" in key, 10)
    st = CheckpointStore(url, profile="portable", _backend=fb)
    h = st.save_async(make_run(1)[0], 0)
    with pytest.raises(Crash):
        h.result(timeout=60)
    st.wait()  # nothing to report
    st.save({"w": torch.ones(2)}, 1)
    assert st.steps() == [1]


def test_errors_at_exit_are_logged_and_saves_in_flight_finish(tmp_path: Path) -> None:
    ok, bad = str(tmp_path / "ok"), str(tmp_path / "bad")
    script = textwrap.dedent(
        """
        import logging, sys, time
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
        from s4w_core.store import CheckpointStore, open_backend
        from tests.store.helpers import FaultyBackend, make_run

        class Slow(FaultyBackend):
            def writer(self, key):
                time.sleep(0.5)
                return super().writer(key)

        run = make_run(2)
        never = lambda verb, key: False
        commit = lambda verb, key: verb == "put" and key.startswith("commits/")
        good = CheckpointStore(sys.argv[1], profile="portable", _backend=Slow(open_backend(sys.argv[1]), never))
        bad = CheckpointStore(sys.argv[2], profile="portable", _backend=FaultyBackend(open_backend(sys.argv[2]), commit))
        bad.save_async(run[0], 7)
        good.save_async(run[1], 5)
        print("returned", flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run(
        [sys.executable, "-c", script, ok, bad], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "returned" in p.stdout
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("ERROR s4w_core.store")]
    assert err and "step 7" in err[0] and "Crash" in err[0] and "at interpreter exit" in err[0], p.stderr
    assert CheckpointStore(ok).steps() == [5] and bits_equal(CheckpointStore(ok).load(5), make_run(2)[1])
    assert CheckpointStore(bad).steps() == []


def test_store_is_not_kept_alive_and_its_unseen_error_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "s")
    fb = FaultyBackend(open_backend(url), lambda verb, key: verb == "put" and key.startswith("commits/"))
    st = CheckpointStore(url, profile="portable", _backend=fb)
    h = st.save_async({"w": torch.ones(4)}, 3)
    while not h.done():
        h._event.wait(0.05)  # noqa: SLF001
    ref = weakref.ref(st)
    with caplog.at_level(logging.ERROR, logger="s4w_core.store"):
        del st
        gc.collect()
        assert ref() is None
    assert "step 3" in caplog.text and "garbage-collected" in caplog.text


# ----------------------------------------------------------------------------- memory bound
def test_max_pending_bytes_falls_back_to_blocking_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(2)
    need = sum(j.raw.numel() for j in _jobs(run[0]))
    small = CheckpointStore(str(tmp_path / "a"), profile="portable", max_pending_bytes=need - 1)
    with caplog.at_level(logging.WARNING, logger="s4w_core.store"):
        h = small.save_async(run[0], 0)
    assert h.mode == "blocking" and h.done() and h.host_bytes == 0
    assert "max_pending_bytes" in caplog.text and "blocking" in caplog.text
    assert h.result().raw_bytes == need and small.peak_pending_bytes == 0
    assert bits_equal(small.load(0), run[0])

    url = str(tmp_path / "b")
    gb = Gated(open_backend(url))
    fits = CheckpointStore(url, profile="portable", max_pending_bytes=need, _backend=gb)
    gb.gate.clear()
    h = fits.save_async(run[0], 0)
    assert h.mode == "async-snapshot" and h.host_bytes == need and fits.pending_bytes == need
    gb.gate.set()
    fits.wait()
    assert fits.pending_bytes == 0 and fits.peak_pending_bytes == need <= fits.max_pending_bytes  # type: ignore[operator]
    with pytest.raises(ValueError, match="max_pending_bytes"):
        CheckpointStore(url, max_pending_bytes=-1)


def _jobs(state: Any) -> list[engine.StorageJob]:
    col = engine.Collector()
    encode_tree(state, col.add)
    return col.jobs


# ----------------------------------------------------------------------------- reporting
def test_one_event_per_save_when_durable(tmp_path: Path) -> None:
    events: list[obs.OpEvent] = []
    url = str(tmp_path / "s")
    fb = FaultyBackend(open_backend(url), lambda verb, key: verb == "put" and "step_000000000002" in key)


    def mine(e: obs.OpEvent) -> None:  # this store's events only: another test's background work may report here
        if e.url == fb.url:
            events.append(e)

    obs.subscribe(mine)
    try:
        st = CheckpointStore(url, profile="portable", _backend=fb)
        run = make_run(3)
        st.save(run[0], 0)
        h1 = st.save_async(run[1], 1)
        st.wait()
        saves = [e for e in events if e.op == "save"]
        assert [(e.step, e.mode, e.ok) for e in saves] == [(0, "blocking", True), (1, "async-snapshot", True)]
        e1 = saves[1]
        assert e1.host_bytes == h1.host_bytes and e1.raw_bytes == run_bytes(run[1]) and e1.kind == "keyframe"
        assert {"snapshot", "encode", "commit"} <= set(e1.stages) and e1.blocked_s <= e1.total_s
        # behind it, step 0 became a delta against step 1: one event of its own
        re = [e for e in events if e.op == "reencode"]
        assert [(e.step, e.ok, e.extra["outcome"], e.extra["base_step"]) for e in re] == [(0, True, "written", 1)]
        st.save_async(run[2], 2)
        with pytest.raises(AsyncSaveError):
            st.wait()
        last = [e for e in events if e.op == "save"][-1]
        assert (last.step, last.ok) == (2, False) and "Crash" in (last.error or "")
    finally:
        obs.unsubscribe(mine)


def run_bytes(state: Any) -> int:
    return sum(j.raw.numel() for j in _jobs(state))


def test_save_checkpoint_non_blocking(tmp_path: Path) -> None:
    from s4w_core.store import api as store_api

    d = str(tmp_path / "s")
    w = torch.arange(6, dtype=torch.float32)
    h = s4w_core.save_checkpoint({"w": w}, 1, d, blocking=False, profile="portable")
    w.zero_()
    assert isinstance(h, SaveHandle)
    store_api.close_stores()  # waits for it
    assert h.done() and s4w_core.load_checkpoint(d, 1)["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize(("profile", "mode"), [("auto", "async-pinned"), ("portable", "async-gpu")])
def test_async_gpu_chain_bit_exact_while_caller_mutates(tmp_path: Path, profile: str, mode: str) -> None:
    if pipeline.gpu_backend() is None:
        pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    run = [
        {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in s["model"].items()} | {"step": s["step"]}
        for s in make_run(5, n=200_000)
    ]
    st = CheckpointStore(str(tmp_path / "s"), keyframe_every=3, profile=profile)
    expected, handles = [], []
    for i, s in enumerate(run):
        expected.append({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in s.items()})
        h = st.save_async(s, i)
        for v in s.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)
        handles.append(h)
    for h in handles:
        h.result(timeout=120)
    assert {h.mode for h in handles} == {mode}
    assert "delta" in {r.kind for r in st.list()}
    for i in range(5):
        got = st.load(i, map_location="cpu")
        assert bits_equal(got, expected[i]), f"step {i}"
    on_gpu = st.load(4)  # tensors come back where they were saved from
    assert all(v.device.type == "cuda" for v in on_gpu.values() if isinstance(v, torch.Tensor))


def _cuda_state(n: int = 3 << 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(n, generator=g).to(torch.bfloat16).cuda(),
        "m": torch.randn(n // 2, generator=g).cuda(),
        "small": torch.randn(100, generator=g).cuda(),
    }


def _vmflags(addr: int) -> set[str] | None:
    """The ``VmFlags`` of the mapping of this process that holds ``addr`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return None


class _Cudart:
    """Stands in for ``torch.cuda.cudart()`` on a machine without CUDA: records registrations."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.registered.append((ptr, n))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
@pytest.mark.parametrize("thp", ["1", "0"])
def test_pinned_slab_asks_for_huge_pages_before_faulting_in(monkeypatch: pytest.MonkeyPatch, thp: str) -> None:
    """A slab's mapping is private, not inherited by a fork (VmFlags ``dc``) and advised
    MADV_HUGEPAGE (``hg``, where the kernel has transparent huge pages) unless S4W_PINNED_THP=0;
    it is faulted in whole and registered once.  CUDA's registration is stood in for: the GPU test
    below checks the same on a real slab."""
    fake = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setenv("S4W_PINNED_THP", thp)
    slab, registered = hostmem.pinned_slab(8 << 20, threads=2)
    assert registered and fake.registered == [(slab.data_ptr(), 8 << 20)]
    flags = _vmflags(slab.data_ptr())
    assert flags is not None
    thp_kernel = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    assert ("hg" in flags) == (thp == "1" and thp_kernel)  # MADV_HUGEPAGE
    assert "dc" in flags  # MADV_DONTFORK: a fork does not copy it
    assert "sh" not in flags  # private: THP does not apply to shared anonymous memory by default
    assert int(slab.sum()) == 0  # faulted in as zeros
    ptr = slab.data_ptr()
    del slab
    gc.collect()
    assert ptr in fake.unregistered


@pytest.mark.gpu
def test_pinned_slab_is_pinned_and_unregistered_when_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gone: list[int] = []
    freed: list[int] = []
    real = hostmem._unregister  # noqa: SLF001
    monkeypatch.setattr(hostmem, "_unregister", lambda p: (gone.append(p), real(p)))
    big, registered = hostmem.pinned_slab(64 << 20, on_free=freed.append)
    assert registered and big.is_pinned() and big.numel() == 64 << 20
    assert {"hg", "dc"} <= (_vmflags(big.data_ptr()) or set())  # huge pages, not inherited by a fork
    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    view = big[4096 : 4096 + src.numel()].detach().view(-1)  # a detached view: no ._base link
    view.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(view, src.cpu())
    ptr = big.data_ptr()
    del big
    gc.collect()
    # (``gone`` may also get slabs of earlier tests' pools that this collection finalizes: only
    # this slab's address counts)
    assert ptr not in gone and freed == [] and view.is_pinned()  # the view holds the slab's storage
    del view
    gc.collect()
    assert gone.count(ptr) == 1 and freed == [ptr]  # unregistered (while still mapped) once the last view is gone
    dev = torch.device("cuda", torch.cuda.current_device())
    sizes = [100, 9 << 20, 3] + [40 << 20] * 6
    bufs, registered = hostmem.pinned_buffers(sizes, dev)
    assert [b.numel() for b in bufs] == sizes
    slabs = {b.untyped_storage().data_ptr() for b in bufs}
    assert registered == slabs and 1 < len(slabs) <= 8  # several slabs, allocated in parallel
    assert all(b.is_pinned() for b in bufs)
    assert all(b.data_ptr() % 512 == 0 for b in bufs)


@pytest.mark.gpu
def test_pinned_pool_allocates_the_next_generation_ahead_and_reuses_two() -> None:
    from s4w_core.hostmem import PinnedPool

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    sizes = [9 << 20, 100, 1 << 20]
    need = sum(sizes)
    pool = PinnedPool()
    pool.reserve(sizes, dev)  # generation 1, in the background
    a = pool.take(sizes, dev)  # waits for it
    pool.ahead(sizes, dev)  # generation 2, in the background
    assert [t.numel() for t in a] == sizes and all(t.is_pinned() for t in a)
    b = pool.take(sizes, dev)  # generation 2, allocated ahead: nothing allocated now
    pool.ahead(sizes, dev)  # the pool holds two generations: no third
    assert {t.data_ptr() for t in a}.isdisjoint(t.data_ptr() for t in b)
    assert pool.live_bytes == 2 * need
    pool.give(a)
    c = pool.take(sizes, dev)  # generation 1 again; no third generation
    assert [t.data_ptr() for t in c] == [t.data_ptr() for t in a]
    assert pool.live_bytes == 2 * need and pool.allocations == 2
    d = [t.detach().view(-1) for t in c]  # what a base cache keeps: detached views
    assert all(pool.owns(t) for t in d) and not pool.owns(torch.empty(3))
    pool.give(d)
    e = pool.take(sizes, dev)
    assert [t.data_ptr() for t in e] == [t.data_ptr() for t in a] and pool.allocations == 2
    del a, b, c, d, e
    gc.collect()
    assert pool.live_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("delta", [True, False])
def test_gpu_saves_reuse_pinned_buffers(tmp_path: Path, delta: bool) -> None:
    """Blocking saves of a GPU state keep the next base in one reused pinned generation;
    save_async keeps two (snapshot and cached base), or one when the store does not delta-code."""
    if pipeline.gpu_backend() is None:
        pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    sd = _cuda_state()
    raw = sum(v.untyped_storage().nbytes() for v in sd.values())
    st = CheckpointStore(str(tmp_path / "blocking"), delta=delta, profile="fast")
    expected = []
    for i in range(4):
        st.save(sd, step=i)
        expected.append({k: v.cpu() for k, v in sd.items()})
        for v in sd.values():
            v.add_(1)
    st.wait()
    pool = st._pinned_pool  # noqa: SLF001
    # with deltas: the newest step's bytes and the previous step's (re-encoded against them), two
    # buffers used in turn; without: none kept
    assert (pool.live_bytes, pool.allocations) == ((2 * raw, 2) if delta else (0, 0))
    for i in range(4):
        assert bits_equal(st.load(i, map_location="cpu"), expected[i])
    st.close()

    st = CheckpointStore(str(tmp_path / "async"), delta=delta, profile="fast")
    st.reserve(sd)
    expected = []
    for i in range(4):
        h = st.save_async(sd, i)
        assert h.mode == "async-pinned"
        expected.append({k: v.cpu() for k, v in sd.items()})
        for v in sd.values():
            v.add_(1)
        h.result(timeout=120)
    pool = st._pinned_pool  # noqa: SLF001
    # two generations when the snapshot becomes the cached base, else one
    assert (pool.live_bytes, pool.allocations) == ((2 * raw, 2) if delta else (raw, 1))
    for i in range(4):
        assert bits_equal(st.load(i, map_location="cpu"), expected[i])
    st.close()


@pytest.mark.parametrize("piece", [7, 64, 1 << 20])
def test_copy_parallel_copies_every_byte(monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    """Host copies cut into pieces on several threads: every byte lands where it belongs,
    whatever the piece size against the tensors' sizes; a size mismatch is refused."""
    monkeypatch.setattr(hostmem, "_COPY_PIECE", piece)
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 1, 63, 64, 65, 1000, 4099)]
    dsts = [torch.zeros_like(s) for s in srcs]
    hostmem.copy_parallel(dsts, srcs, threads=3)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    with pytest.raises(ValueError, match="3 bytes to fill from 4"):
        hostmem.copy_parallel([torch.zeros(3, dtype=torch.uint8)], [torch.zeros(4, dtype=torch.uint8)])


@pytest.mark.gpu
def test_gpu_process_host_state_cache_reuses_pinned_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host state (a DCP rank's staged shards) saved in a process that uses CUDA: the store's
    copy of the newest step goes to its pinned pool (copied on several threads), one generation
    reused in turn, and every step loads bit for bit."""
    if pipeline.gpu_backend() is None:
        pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    torch.zeros(1, device="cuda")  # CUDA in use, as in a training process
    monkeypatch.setattr(hostmem, "POOLED_HOST_COPY_BYTES", 1 << 20)
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": (torch.randn(256, 1024, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)}
    raw = sum(v.untyped_storage().nbytes() for v in sd.values())
    st = CheckpointStore(str(tmp_path / "st"), profile="fast")
    expected = []
    for i in range(4):
        st.save(sd, step=i)
        expected.append({k: v.clone() for k, v in sd.items()})
        assert st._cache is not None and st._cache.pooled  # noqa: SLF001
        for v in sd.values():
            v.view(torch.int16)[::7] += 1
    st.wait()
    pool = st._pinned_pool  # noqa: SLF001
    assert (pool.live_bytes, pool.allocations) == (2 * raw, 2)
    for i in range(4):
        assert bits_equal(st.load(i, map_location="cpu"), expected[i])
    st.close()


def _nudge(sd: dict[str, torch.Tensor]) -> None:
    """Move a few values of every tensor (the rest unchanged): the step below becomes a delta that pays."""
    for v in sd.values():
        v[:64].add_(1)


def _reencoded(st: CheckpointStore, step: int, base: int) -> None:
    """``step`` was re-encoded behind the save of ``base``: a delta against it."""
    st.wait()
    rec = st.info(step)
    assert rec.kind == "delta" and rec.base_step == base, rec


def _spy_decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps the store's re-encodings decode from their objects (instead of a host copy)."""
    steps: list[int] = []
    real = CheckpointStore._decoded  # noqa: SLF001

    def spy(self: CheckpointStore, rec: Any, recs: Any) -> Any:
        steps.append(rec.step)
        return real(self, rec, recs)

    monkeypatch.setattr(CheckpointStore, "_decoded", spy)
    return steps


@pytest.mark.gpu
def test_gpu_load_of_the_newest_step_allocates_its_base_buffers_while_it_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh store that loads its newest step onto the GPU reserves the pinned generation that
    step's host copy takes, while the step loads: one allocation, taken by the copy.  The next save
    writes its step whole (its own copy takes a second generation) and re-encodes the loaded step
    against it from that copy, bit-exact; the generation is then free for the next copy."""
    if pipeline.gpu_backend() is None:
        pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    sd = _cuda_state()
    raw = sum(v.untyped_storage().nbytes() for v in sd.values())
    url = str(tmp_path / "store")
    st = CheckpointStore(url, profile="fast")
    expected = []
    for i in range(2):
        st.save(sd, step=i)
        expected.append({k: v.cpu() for k, v in sd.items()})
        _nudge(sd)
    st.close()

    st = CheckpointStore(url, profile="fast")
    pool = st._pinned_pool  # noqa: SLF001
    loaded = st.load(map_location="cuda")
    assert (pool.live_bytes, pool.allocations) == (raw, 1)  # the reserved generation, now the host copy
    assert bits_equal({k: v.cpu() for k, v in loaded.items()}, expected[1])
    decoded = _spy_decoded(monkeypatch)
    info = st.save(sd, step=2)
    assert info.kind == "keyframe" and pool.allocations == 2  # the new step's copy: a second generation
    _reencoded(st, 1, 2)
    assert decoded == []  # step 1 re-encoded from its host copy, not decoded from its object
    expected.append({k: v.cpu() for k, v in sd.items()})
    for i in range(2):  # not the newest: no host copy kept, nothing reserved
        assert bits_equal(st.load(i, map_location="cpu"), expected[i]), i
    st.load(1, map_location="cuda")
    assert pool.allocations == 2
    # the newest step again: copied during the load into the generation step 1's re-encoding
    # gave back, not into a third; the copy it replaces is given back for the next save
    again = st.load(map_location="cuda")
    assert (pool.live_bytes, pool.allocations) == (2 * raw, 2)
    assert bits_equal({k: v.cpu() for k, v in again.items()}, expected[2])
    _nudge(sd)
    assert st.save(sd, step=3).kind == "keyframe" and pool.allocations == 2
    _reencoded(st, 2, 3)
    assert bits_equal(st.load(3, map_location="cpu"), {k: v.cpu() for k, v in sd.items()})
    assert bits_equal(st.load(2, map_location="cpu"), expected[2])
    st.close()


@pytest.mark.gpu
@pytest.mark.parametrize("damage", ["intact", "corrupt"])
def test_gpu_load_copies_each_decoded_batch_into_the_base_while_it_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """The newest step's host copy is made batch by batch (``HostFill``): each decoded batch is
    copied into the pinned buffers while the next one is read, so the load's end waits only for
    the last. With 1 MiB batches: several batches, every storage copied once, the kept copy holds
    the step's bytes (on the pool's buffers) and the next save re-encodes the step against the new
    one from it, bit-exact.  A corrupt newest step decodes some batches before its checksum fails:
    the load raises, keeps no copy and gives the buffers back, and the load after a repair reuses
    them (no second allocation)."""
    if pipeline.gpu_backend() is None:
        pytest.skip("the GPU backend (nvCOMP, Triton) is not installed")
    monkeypatch.setenv("S4W_GPU_BATCH_BYTES", str(1 << 20))
    g = torch.Generator().manual_seed(11)
    sd = {f"w{i}": (torch.randn(300_000, generator=g) * 0.02).to(torch.bfloat16).cuda() for i in range(10)}
    sd |= {f"m{i}": torch.randn(100_000, generator=g).cuda() for i in range(4)}
    raw = sum(v.untyped_storage().nbytes() for v in sd.values())
    url = str(tmp_path / "store")
    st = CheckpointStore(url, profile="fast")
    expected = []
    for i in range(2):
        st.save(sd, step=i)
        expected.append({k: v.cpu() for k, v in sd.items()})
        sd["w0"].add_(1)  # the rest unchanged: step 0 becomes a delta against step 1
    st.close()
    check = CheckpointStore(url)
    rec = check.info(1)
    assert rec.kind == "keyframe" and rec.copy is None and check.info(0).kind == "delta"

    calls: list[list[int]] = []
    real = hostmem.HostFill.__call__

    def spy(self: Any, idx: list[int], raws: list[torch.Tensor]) -> None:
        calls.append(list(idx))
        real(self, idx, raws)

    monkeypatch.setattr(hostmem.HostFill, "__call__", spy)
    st = CheckpointStore(url, profile="fast")
    pool = st._pinned_pool  # noqa: SLF001
    n = len(sd)
    if damage == "corrupt":  # a flipped byte in the last chunk: the first batches decode fine
        from s4w_core.errors import FormatError
        from s4w_core.format.container import ContainerReader

        backend = open_backend(url)
        good = backend.get(rec.object)
        blob = bytearray(good)
        m = ContainerReader(lambda o, n: bytes(blob[o : o + n]), len(blob)).manifest
        off, length = m["storages"][-1]["chunks"][-1][1:3]
        blob[off + length // 2] ^= 0x10
        backend.put(rec.object, bytes(blob))
        with pytest.raises(FormatError):
            st.load(map_location="cuda")
        assert calls and len({i for c in calls for i in c}) < n  # some batches were copied
        assert st._cache is None  # noqa: SLF001 - nothing kept of a load that failed
        pool.reserve([], wait=True)  # the background allocation the load started has ended
        assert pool.allocations == 1 and pool.free_bytes == raw  # the buffers given back
        backend.put(rec.object, good)  # repaired
        calls.clear()
    loaded = st.load(map_location="cuda")
    assert bits_equal({k: v.cpu() for k, v in loaded.items()}, expected[1])
    assert len(calls) > 2
    assert sorted(i for c in calls for i in c) == list(range(n)), "every storage copied once"
    assert pool.allocations == 1  # after a failed load too: its buffers reused
    cache = st._cache  # noqa: SLF001
    assert cache is not None and cache.pooled and cache.step == 1 and cache.object == rec.object
    assert len(cache.raws) == n and all(pool.owns(h) for h in cache.raws)
    for host, v in zip(cache.raws, loaded.values()):  # the manifest keeps the state's order
        assert torch.equal(host, v.cpu().contiguous().view(-1).view(torch.uint8))
    decoded = _spy_decoded(monkeypatch)
    info = st.save(sd, step=2)
    assert info.kind == "keyframe"
    _reencoded(st, 1, 2)
    assert decoded == []  # from the kept copy
    st.close()
    fresh = CheckpointStore(url)
    assert bits_equal(fresh.load(2, map_location="cpu"), {k: v.cpu() for k, v in sd.items()})
    assert bits_equal(fresh.load(1, map_location="cpu"), expected[1])


def test_clean_up_behind_the_worker_is_waited_for_and_never_holds_up_a_save(tmp_path):
    """The old whole object a re-encoding replaces is deleted on the side thread: wait() (and
    close()) return only once it is gone, and a failing clean-up is logged, not raised."""
    from s4w_core.store._async import Pipeline

    p = Pipeline("memory://side", None, "wait")
    gate, done = threading.Event(), []

    def slow() -> None:
        gate.wait(5)
        done.append(1)

    p.later(slow)
    with pytest.raises(TimeoutError, match="deletes of unreferenced objects"):
        p.wait(timeout=0.05)
    gate.set()
    p.wait(timeout=5)
    assert done == [1]
    p.later(lambda: (_ for _ in ()).throw(OSError("disk gone")))  # logged by the side thread
    p.wait(timeout=5)
    p.stop()

    st = s4w_core.CheckpointStore(str(tmp_path / "st"), keep_last=5)
    w = torch.arange(4096, dtype=torch.float32)
    st.save({"w": w}, step=1)
    st.save({"w": w + 1}, step=2)  # step 1 becomes a delta against 2; its whole object goes behind
    st.wait()
    data = sorted(os.listdir(tmp_path / "st" / "data"))
    named = {r.object for r in st.list()}
    assert set(data) == {os.path.basename(o) for o in named}, (data, named)
    assert [(r.step, r.kind) for r in st.list()] == [(1, "delta"), (2, "keyframe")]
    assert st.load(1)["w"].equal(w)
    st.close()


def test_a_held_tail_runs_only_once_something_waits_for_it() -> None:
    """Pipeline.defer(hold=True): the job is not queued; wait(held=False) (a read) leaves it held,
    a second deferred job, begin() (the next save), wait() and settle() queue it and wait for it;
    a cancelled one is queued too (to end at once)."""
    from s4w_core.store._async import Pipeline, SaveHandle

    p = Pipeline("memory://held", None, "wait")
    ran: list[str] = []

    def held(name: str) -> SaveHandle:
        h = SaveHandle(1, "reencode", "memory://held", what="re-encoding")
        p.defer(h, lambda: ran.append(name), hold=True)
        return h

    h = held("a")
    p.wait(timeout=5, held=False)
    time.sleep(0.05)
    assert ran == [] and p.holds(h) and not h.done()
    p.wait(timeout=5)
    assert ran == ["a"] and h.done() and not p.holds(h)

    hb = held("b")
    h = held("c")  # the held one before it runs first
    assert hb.wait_done(5) and ran == ["a", "b"] and p.holds(h)
    p.begin(2)
    assert ran == ["a", "b", "c"] and h.done()

    h = held("d")
    p.settle()
    assert ran[-1] == "d" and h.done()

    h = SaveHandle(1, "reencode", "memory://held", what="re-encoding")
    cancel = h.cancel_before(lambda step: step == 3)
    p.defer(h, lambda: ran.append("cancelled" if cancel.is_set() else "e"), hold=True)
    p.cancel_tail_of("re-encoding", 1)
    assert h.wait_done(5) and ran[-1] == "cancelled"
    p.stop()


def test_cancellable_writer_passes_vector_writes_and_stops_them(tmp_path: Path) -> None:
    cancel = threading.Event()
    assert CancellableWriter(io.BytesIO(), cancel).writev is None  # nothing to hand vectors to
    p = tmp_path / "o"
    with open(p, "wb") as raw:
        w = CancellableWriter(EarlyWriteback(raw, window=0), cancel)
        assert w.writev([memoryview(b"ab"), memoryview(b"cd")]) == 4
        cancel.set()
        with pytest.raises(Cancelled):
            w.writev([memoryview(b"ef")])
    assert p.read_bytes() == b"abcd"

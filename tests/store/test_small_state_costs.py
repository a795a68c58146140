"""The fixed costs of a small training state (issue #23, CPU): what a save or a resume of a
few-MB state does besides coding its bytes -- threads started, objects listed and parsed, files
read -- checked as behaviour, not as timings."""

from __future__ import annotations

import gc
import sys
import threading
import types
from typing import Any, Iterator

import pytest
import torch

from s4w_core import CheckpointStore, engine


def _state(n_small: int = 40, big: int = 0, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    st: dict[str, Any] = {f"b{i}": torch.randn(96, generator=g).to(torch.bfloat16) for i in range(n_small)}
    st["w"] = torch.randn(96, 288, generator=g).to(torch.bfloat16)  # 55 KB, like a GPT-2 c_attn of the CPU model
    st["mlp"] = torch.randn(96, 384, generator=g).to(torch.bfloat16)  # 74 KB, its MLP weights (the largest)
    if big:
        st["big"] = torch.randn(big // 2, generator=g).to(torch.bfloat16)
    return st


@pytest.fixture
def started_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the threads started while the test runs (``threading.Thread.start`` counted)."""
    names: list[str] = []
    orig = threading.Thread.start

    def start(self: threading.Thread) -> None:
        names.append(self.name)
        orig(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    yield names


def test_a_small_resume_starts_no_thread(tmp_path: Any, started_threads: list[str]) -> None:
    """A resume opens the store afresh (its commit records not parsed yet) and loads the newest
    step: on a local store neither the records nor the small storages go through a thread pool."""
    with CheckpointStore(tmp_path / "s") as st:
        for step in (1, 2, 3):
            st.save(_state(seed=step), step=step)
    state = _state(seed=3)
    started_threads.clear()
    with CheckpointStore(tmp_path / "s") as st:
        assert st.steps() == [1, 2, 3]
        got = st.load(threads=4)
    assert started_threads == [], started_threads
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())


def test_map_location_is_asked_per_device_not_per_storage(tmp_path: Any) -> None:
    calls: list[str] = []

    def where(orig: str) -> str:
        calls.append(orig)
        return "cpu"

    state = _state(n_small=60)
    with CheckpointStore(tmp_path / "s") as st:
        st.save(state, step=1)
        got = st.load(map_location=where)
    assert set(calls) == {"cpu"} and len(calls) <= 3, calls  # once per place that needs the devices
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())


def test_a_large_storage_is_still_decoded_by_the_pool(tmp_path: Any, started_threads: list[str]) -> None:
    st = CheckpointStore(tmp_path / "s", base_cache_bytes=0)
    big = 8 * engine.INLINE_DECODE_BYTES  # several plane chunks per segment: worth the pool
    state = _state(n_small=2, big=big)
    st.save(state, step=1)
    st.wait()
    started_threads.clear()
    got = st.load(threads=4)
    assert started_threads, "a storage above INLINE_DECODE_BYTES decodes its chunks on the pool"
    assert torch.equal(got["big"].view(torch.uint8), state["big"].view(torch.uint8))
    st.close()


def test_a_small_save_codes_on_the_calling_thread(tmp_path: Any, started_threads: list[str]) -> None:
    """A whole save of a small state (the largest storage 74 KB, a 96-wide GPT-2's MLP weight)
    hands no chunk to the CPU path's pool: no pool thread is started."""
    state = _state()
    assert state["mlp"].untyped_storage().nbytes() <= engine.INLINE_ENCODE_BYTES
    with CheckpointStore(tmp_path / "s", delta=False) as st:
        st.save(state, step=1, extra={})
        assert [n for n in started_threads if n.startswith("ThreadPoolExecutor")] == [], started_threads
        got = st.load()
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())


def test_a_small_object_is_read_in_one_call(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local store's small data object is read whole in one call (its chunks are views of
    it), not with one read per chunk; a large one is still read by ranges."""
    from s4w_core.store import _local
    from s4w_core.store._backend import RangeReader
    from s4w_core.store.core import WHOLE_READ_BYTES

    reads: dict[str, int] = {}
    orig = _local.LocalBackend.open_range

    def counted(self: Any, key: str) -> RangeReader:
        rr = orig(self, key)
        read = rr.read

        def r(off: int, n: int) -> bytes:
            reads[key] = reads.get(key, 0) + 1
            return read(off, n)

        rr.read = r
        return rr

    monkeypatch.setattr(_local.LocalBackend, "open_range", counted)
    small = _state()
    big = {"big": torch.randn(WHOLE_READ_BYTES, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)}
    for name, state in (("small", small), ("big", big)):
        with CheckpointStore(tmp_path / name) as st:
            st.save(state, step=1)
        reads.clear()
        with CheckpointStore(tmp_path / name) as st:
            got = st.load()
        data = [k for k in reads if k.startswith("data/")]
        assert len(data) == 1
        assert (reads[data[0]] == 1) == (name == "small"), reads
        assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())


def test_a_load_beyond_base_cache_bytes_prepares_no_host_copy(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``base_cache_bytes=0`` (or a step larger than it): the load does not prepare the step as the
    next base (no source rebuilt from its manifest, nothing reserved); within it, it does."""
    from s4w_core.store import cache

    built: list[int] = []
    orig = cache.source_of_manifest
    monkeypatch.setattr(cache, "source_of_manifest", lambda m: built.append(1) or orig(m))
    with CheckpointStore(tmp_path / "s") as st:
        st.save(_state(), step=1)
    for limit, remember, expected in ((0, True, 0), (None, True, 1), (None, False, 0)):
        built.clear()
        with CheckpointStore(tmp_path / "s", base_cache_bytes=limit) as st:
            st.load(remember=remember)
        assert len(built) == expected, (limit, remember, built)


def test_a_read_once_resume_re_encodes_the_step_from_its_object(tmp_path: Any) -> None:
    """``load(remember=False)`` then a save: the loaded step still becomes a delta against the new
    one, decoded from its object, to the same bytes as after a load that kept its host copy; both
    steps load back bit for bit."""
    first = _state()
    second = {k: (v.float() * 1.001).to(v.dtype) if v.is_floating_point() else v + 1 for k, v in first.items()}
    objects = {}
    for remember in (True, False):
        root = tmp_path / f"r{int(remember)}"
        with CheckpointStore(root) as st:
            st.save(first, step=1)
        with CheckpointStore(root) as st:
            st.load(remember=remember)
            st.save(second, step=2)
            st.wait()
            assert st.info(1).kind == "delta", f"remember={remember}: step 1 stayed whole"
            for step, want in ((1, first), (2, second)):
                got = st.load(step)
                assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())
        objects[remember] = {p.name.split(".")[0]: _coded(p.read_bytes()) for p in (root / "data").iterdir()}
    assert objects[True] == objects[False]


def _coded(data: bytes) -> list[Any]:
    """What a container codes, per storage (transform, delta op, chunks with their checksums); not
    the names of the objects its deltas are against (random per store)."""
    from s4w_core import api

    return [(s["path"], s["transform"], (s["delta"] or {}).get("op"), s["chunks"])
            for s in api.open_reader(data).manifest["storages"]]  # fmt: skip


def _ours(o: Any) -> bool:
    mod = getattr(o, "__module__", None)  # an instance's class's module, a function's own
    return isinstance(o, torch.Tensor) or (mod if isinstance(mod, str) else type(o).__module__).startswith(("s4w_", "torch"))


def _name(o: Any) -> str:
    """A garbage object's name: a function's module and qualified name, else its type's."""
    if isinstance(o, types.FunctionType):
        return f"function {o.__module__}.{o.__qualname__}"
    return type(o).__qualname__


def _garbage_of(fn: Any) -> list[str]:
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fn()
        gc.collect()
        return sorted(_name(o) for o in gc.garbage if _ours(o))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def cyclic_garbage(fn: Any, again: Any = None) -> list[str]:
    """The objects of s4weights and torch that ``fn()`` leaves for the cyclic GC to free (held by
    reference cycles), by name.  (Other libraries' garbage, e.g. numba compiling its kernels on a
    background thread, is not counted.)  The collector sees the whole process: what another
    thread (a test before this one) or a library's one-time set-up leaves at that moment is
    counted too.  So a measure that finds some runs ``again`` (default: ``fn``) and returns what
    that run leaves: garbage ``fn`` makes each time shows both times."""
    first = _garbage_of(fn)
    if not first:
        return first
    second = _garbage_of(fn if again is None else again)
    if second:
        print(f"cyclic garbage (first run): {first}", file=sys.stderr)
    return second


def test_saves_and_loads_leave_no_reference_cycles(tmp_path: Any) -> None:
    """A save or a load frees what it made when it returns: no reference cycle keeps its
    collected state (every storage job and tensor) or a reader's parsed manifest alive until the
    cyclic GC runs (which then walks the training process's whole heap, in a training step)."""
    url = tmp_path / "s"

    def save(step: int) -> None:
        with CheckpointStore(url) as st:
            st.save(_state(seed=step), step=step)

    def load() -> None:
        with CheckpointStore(url) as st:
            st.load()

    save(1)
    assert cyclic_garbage(lambda: save(2), again=lambda: save(3)) == []
    assert cyclic_garbage(load) == []


def test_a_small_container_is_written_without_a_16_mib_block(tmp_path: Any) -> None:
    """The container writer's write block grows with what it gathers: a save of a small state
    allocates about the container's size, not the 16 MiB a large one gathers per write (which
    every save left resident); a state past the block size still round-trips bit for bit."""
    import tracemalloc

    import s4w_core

    small = _state()
    s4w_core.save(small, tmp_path / "warm.s4w")  # imports and codec contexts outside the measure
    tracemalloc.start()
    try:
        s4w_core.save(small, tmp_path / "small.s4w")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the state is 0.1 MB
    g = torch.Generator().manual_seed(3)
    many = {f"t{i}": torch.randn(64 << 10, generator=g).to(torch.bfloat16) for i in range(160)}  # 20 MiB, 128 KiB each
    s4w_core.save(many, tmp_path / "many.s4w")
    got = s4w_core.load(tmp_path / "many.s4w")
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in many.items())

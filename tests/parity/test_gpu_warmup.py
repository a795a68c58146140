"""s4w_core.gpu.warm_up: the codec's Triton kernels compiled in the background before the first
save, a no-op without a GPU, never a change of bytes. The GPU tests run on the device:
``pytest -q -m gpu tests/parity/test_gpu_warmup.py``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.jit import JITFunction

import s4w_core
from s4w_core import gpu
from s4w_core.gpu import _kernel_record, _warmup, bundle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_no_gpu_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S4W_DISABLE_GPU", "1")
    assert gpu.warm_up() is False
    assert gpu.warm_up(wait=True) is False
    assert gpu.warm_up_status() == {}
    gpu.wait_warm_up()  # nothing running: returns at once


def test_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "available", lambda: True)
    monkeypatch.setenv(gpu.WARM_UP_ENV, "0")
    assert gpu.warm_up() is False
    assert gpu.warm_up_status() == {}


def test_cpu_device_is_not_warmed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "available", lambda: True)
    assert gpu.warm_up("cpu") is False


def test_the_entry_points_that_save_on_the_gpu_start_the_warm_up(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store and DCP's writer start the warm-up when made (it waits for the process to use CUDA),
    so a first save finds the kernels compiled or loaded; not with the portable profile (CPU only)."""
    pytest.importorskip("torch.distributed.checkpoint")
    from s4w_core.dcp import S4StorageWriter

    calls: list[dict] = []
    monkeypatch.setattr(gpu, "warm_up", lambda *a, **k: calls.append(k) or True)
    s4w_core.CheckpointStore(str(tmp_path / "store"))
    S4StorageWriter(str(tmp_path / "dcp"))
    assert calls == [{"when_cuda_used": True}] * 2
    s4w_core.CheckpointStore(str(tmp_path / "store2"), profile="portable")
    S4StorageWriter(str(tmp_path / "dcp2"), profile="portable")
    assert len(calls) == 2


def test_warm_up_sequence_on_the_simulated_gpu() -> None:
    """The warm-up's own sequence -- the GPU writer on a plain and a delta step, the GPU reader
    decoding both, every byte compared -- under Triton's interpreter with a stand-in for nvCOMP
    (tests/parity/_interpret_checks.simulated_gpu): what the device runs."""
    from s4w_core.gpu import _coder

    s0, s1 = _warmup.synthetic_states(torch.device("cpu"), _warmup.DEFAULT_DTYPES)
    assert {v.dtype for v in s0.values()} == {torch.bfloat16, torch.float32, torch.int64}
    assert any(v.numel() > _coder.PROFILES["fast"].segment_elems for v in s0.values())  # more than one GPU segment
    only, none = _warmup.synthetic_states(torch.device("cpu"), _warmup.DEFAULT_DTYPES, second=False)
    assert not none and only.keys() == s0.keys() and all(torch.equal(only[k], s0[k]) for k in s0)  # the same first state
    assert s1.keys() == s0.keys()
    code = (
        "import torch\n"
        "from tests.parity._interpret_checks import simulated_gpu\n"
        "from s4w_core.gpu import _encode, _warmup\n"
        "seen = []\n"
        "orig = _encode.encode_storages\n"
        "_encode.encode_storages = lambda jobs, *a, **k: seen.append([j.base is not None for j in jobs]) or orig(jobs, *a, **k)\n"
        "_warmup._SIZES, _warmup._INT_SIZES = (3, 1000, 5000), (100, 3000)  # interpreted kernels are slow\n"
        "with simulated_gpu(batch_bytes=1 << 14):\n"
        "    _warmup.run(torch.device('cpu'), (torch.bfloat16,))\n"
        "assert [any(x) for x in seen] == [False, True, True, False, True, True], seen  # plain, delta, aligned delta\n"
        "assert all(seen[1]) and all(seen[2]) and all(seen[4]) and all(seen[5]), seen\n"
        "print('ok warm-up')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("S4W_DISABLE_GPU", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "ok warm-up" in r.stdout, r.stderr[-4000:]


def test_a_failed_warm_up_is_reported_and_harmless(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "available", lambda: True)
    monkeypatch.setattr(gpu, "_warm_threads", {})
    monkeypatch.setattr(gpu, "_warm_state", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def boom(device: torch.device, dtypes: object, on_stage: object = None) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_warmup, "run", boom)
    assert gpu.warm_up("cuda:0", wait=True) is True
    assert gpu.warm_up_status() == {"cuda:0": "failed: RuntimeError: no compiler here"}
    assert gpu.warm_up("cuda:0") is True  # once per device and process: not started again
    gpu.wait_warm_up()


def test_when_cuda_used_waits_for_the_process_to_start_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Creating a store never starts CUDA: the warm-up waits until the process has done it."""
    import threading
    import time

    monkeypatch.setattr(gpu, "available", lambda: True)
    monkeypatch.setattr(gpu, "_warm_threads", {})
    monkeypatch.setattr(gpu, "_warm_state", {})
    monkeypatch.setattr(gpu, "_CUDA_POLL_S", 0.01)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    inited = threading.Event()
    monkeypatch.setattr(torch.cuda, "is_initialized", inited.is_set)
    ran: list[torch.device] = []
    monkeypatch.setattr(_warmup, "run", lambda device, dtypes, on_stage=None: ran.append(device))
    assert gpu.warm_up(when_cuda_used=True) is True
    time.sleep(0.1)
    assert ran == [] and gpu.warm_up_status() == {"cuda:1": "waiting for CUDA"}
    gpu.wait_warm_up(timeout=0.05)  # a save does not wait for a warm-up that waits for CUDA
    inited.set()
    gpu.warm_up(when_cuda_used=True, wait=True)
    assert ran == [torch.device("cuda", 1)] and gpu.warm_up_status() == {"cuda:1": "done"}


def test_a_save_waits_only_for_the_stages_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain save of 2-byte floats waits for the warm-up's ("plain", 2) stage, not for the delta
    and decode stages after it; a wait without ``need`` waits for the whole warm-up."""
    import threading
    import time

    monkeypatch.setattr(gpu, "available", lambda: True)
    monkeypatch.setattr(gpu, "_warm_threads", {})
    monkeypatch.setattr(gpu, "_warm_state", {})
    monkeypatch.setattr(gpu, "_warm_stages", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    release = threading.Event()

    def staged(device: torch.device, dtypes: object, on_stage=None) -> None:
        on_stage(("plain", 2))
        release.wait(10)
        on_stage(("delta", 2))

    monkeypatch.setattr(_warmup, "run", staged)
    assert gpu.warm_up("cuda:0") is True
    t0 = time.monotonic()
    gpu.wait_warm_up(need={("plain", 2)})  # reached: returns while the warm-up still runs
    assert time.monotonic() - t0 < 5 and gpu.warm_up_status() == {"cuda:0": "running"}
    t0 = time.monotonic()
    gpu.wait_warm_up(timeout=0.2, need={("delta", 2)})  # not reached: waits out its timeout
    assert time.monotonic() - t0 >= 0.2 and gpu.warm_up_status() == {"cuda:0": "running"}
    release.set()
    gpu.wait_warm_up()
    assert gpu.warm_up_status() == {"cuda:0": "done"}
    assert _warmup.stage_key(torch.bfloat16) == 2 and _warmup.stage_key(torch.float32) == 4
    assert _warmup.stage_key(torch.int64) == "bytes" and _warmup.stage_key(torch.float64) == "bytes"


#: a process's warm-up (``argv[1] == "1"``), then a delta save and a load into a store at ``argv[2]``; it
#: prints what they added to the Triton cache and loaded. ``argv[3] == "bundle"``: the warm-up must not
#: code its synthetic steps even where no record was there before it (the package's bundle installs one)
_FIRST_SAVE = r"""
import json, os, sys, torch
from s4w_core import gpu, CheckpointStore
warm = sys.argv[1] == "1"
cache = os.environ["TRITON_CACHE_DIR"]
os.makedirs(cache, exist_ok=True)  # Triton makes it at its first compile
from s4w_core.gpu import _warmup
recorded = _warmup.record_path(torch.device("cuda", 0)).exists()
if recorded or sys.argv[3:] == ["bundle"]:  # the warm-up must load recorded kernels, not code the synthetic steps
    def no_steps(*a, **k):
        raise AssertionError("the warm-up coded its synthetic steps")
    _warmup._sequence = no_steps
if warm:
    assert gpu.warm_up(wait=True) and gpu.warm_up_status()["cuda:0"] == "done", gpu.warm_up_status()
before = sorted(os.listdir(cache))
import triton
loads = []  # kernels this process compiles or loads from the disk cache from here on (Triton calls the hook for each)
triton.knobs.runtime.jit_cache_hook = lambda *a, **k: loads.append(1)
g = torch.Generator().manual_seed(1)
model = {f"l{i}.w": torch.randn(768 * (i + 3), generator=g) for i in range(6)}
model.update({f"l{i}.b": torch.randn(97 + i, generator=g) for i in range(6)})
s0 = {k: v.to(torch.bfloat16).cuda() for k, v in model.items()}
s1 = {k: (v.float() * (1 + 1e-3 * torch.randn(v.shape, generator=g).cuda())).to(torch.bfloat16) for k, v in s0.items()}
st = CheckpointStore(sys.argv[2])
st.save(s0, step=1); st.save(s1, step=2); st.load(2, map_location="cuda")
after = sorted(os.listdir(cache))
print(json.dumps({"new": sorted(set(after) - set(before)), "warmed": len(before), "loads": len(loads),
                  "recorded": recorded, "records_now": _warmup.record_path(torch.device("cuda", 0)).exists()}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason=gpu.unavailable_reason() or "no GPU")
def test_gpu_first_save_after_warm_up_compiles_nothing(tmp_path) -> None:
    """In a fresh process with an empty Triton cache: after warm_up(wait=True), a delta save and a
    load of a model-like state add no entry to the cache (nothing compiled) and load no kernel into
    the process, and the bytes equal those of a process that never warmed up; a later process on
    the same cache: its warm-up loads the kernels the first one recorded (coding only the synthetic
    plain step, not the delta steps), which are every kernel the save and load use."""
    script = _FIRST_SAVE
    outs = {}
    for warm in ("1", "0"):
        # the compile path: no kernels installed from the package's bundle (test_gpu_kernel_bundle_...)
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton{warm}"), S4W_WARM_UP=warm, S4W_KERNEL_BUNDLE="0")
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
        p = subprocess.run([sys.executable, "-c", script, warm, str(tmp_path / f"store{warm}")], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[warm] = json.loads(p.stdout.strip().splitlines()[-1])
    assert outs["1"]["warmed"] > 0
    assert not outs["1"]["recorded"] and outs["1"]["records_now"], outs["1"]  # the full warm-up wrote its record
    assert not outs["0"]["records_now"], outs["0"]
    assert outs["1"]["new"] == [], outs["1"]  # the warm-up compiled everything the save and load used
    assert outs["1"]["loads"] == 0, outs["1"]  # ... and they were in this process already
    assert outs["0"]["new"] and outs["0"]["loads"], outs["0"]  # (without it they compile: the checks can fail)
    # a later process on the same cache: its warm-up loads what the first one compiled; nothing new
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton1"), S4W_WARM_UP="1", S4W_KERNEL_BUNDLE="0")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", script, "1", str(tmp_path / "store2")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    later = json.loads(p.stdout.strip().splitlines()[-1])
    # it loaded the recorded kernels (no synthetic delta steps); nothing compiled, and nothing left for
    # the first save to load: the record holds every kernel the full warm-up loaded
    assert later["recorded"], later
    assert later["new"] == [] and later["loads"] == 0, later
    for step in (1, 2):  # the same bytes whether warmed or not
        m1 = s4w_core.CheckpointStore(str(tmp_path / "store1")).info(step)
        m0 = s4w_core.CheckpointStore(str(tmp_path / "store0")).info(step)
        assert (m1.stored_bytes, m1.delta_ops, m1.kind) == (m0.stored_bytes, m0.delta_ops, m0.kind), (step, m1, m0)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason=gpu.unavailable_reason() or "no GPU")
def test_gpu_kernel_bundle_makes_a_cold_warm_up_load_only(tmp_path) -> None:
    """With an empty Triton cache and the package's bundle for this Triton and GPU: the warm-up
    installs and loads the bundle's kernels (it codes no synthetic step: the stand-in for them
    raises), after which a delta save and a load compile nothing and load no kernel; the bytes
    equal those of a process that compiled its kernels (no warm-up, no bundle)."""
    import triton

    major, minor = torch.cuda.get_device_capability()
    if not bundle.bundle_path(triton.__version__, major * 10 + minor).exists():
        pytest.skip(f"no kernel bundle in the package for Triton {triton.__version__} on sm{major}{minor}")
    outs = {}
    for run, extra in (("bundle", {"S4W_WARM_UP": "1", "S4W_KERNEL_BUNDLE": "1"}),
                       ("compiled", {"S4W_WARM_UP": "0", "S4W_KERNEL_BUNDLE": "0"})):
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton-{run}"), **extra)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
        warm = extra["S4W_WARM_UP"]
        p = subprocess.run([sys.executable, "-c", _FIRST_SAVE, warm, str(tmp_path / f"store-{run}"), run], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[run] = json.loads(p.stdout.strip().splitlines()[-1])
    b = outs["bundle"]
    assert not b["recorded"] and b["records_now"] and b["warmed"] > 0, b  # installed by the warm-up
    assert b["new"] == [] and b["loads"] == 0, b  # every kernel the save and load use came with it
    assert outs["compiled"]["new"] and outs["compiled"]["loads"], outs["compiled"]  # (the check can fail)
    for step in (1, 2):
        mb = s4w_core.CheckpointStore(str(tmp_path / "store-bundle")).info(step)
        mc = s4w_core.CheckpointStore(str(tmp_path / "store-compiled")).info(step)
        assert (mb.stored_bytes, mb.delta_ops, mb.kind) == (mc.stored_bytes, mc.delta_ops, mc.kind), (step, mb, mc)


# ----------------------------------------------------------------------------- the kernel record
def _an_entry(name: str = "_split_kernel") -> list[str]:
    fn = _kernel_record.kernels()[("s4w_core.planes.triton_kernels", name)]
    return [fn.fn.__module__, fn.fn.__qualname__, json.dumps({"name": name})]


def test_kernel_record_names_only_the_codecs_kernels() -> None:
    names = {n for _, n in _kernel_record.kernels()}
    assert {"_split_kernel", "_merge_kernel", "_probe_gate_kernel", "_gather_chosen_kernel"} <= names
    assert {m for m, _ in _kernel_record.kernels()} == {"s4w_core.gpu.kernels", "s4w_core.planes.triton_kernels"}


_GOOD = object()  # stands for a valid entry


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b"{}",
        b"[]",
        b"[" + b" " * (5 << 20) + b"]",  # larger than any record
        [_GOOD, ["os", "system", "{}"]],  # not a kernel of the codec: nothing imported or called
        [_GOOD, ["s4w_core.gpu.kernels", "_no_such_kernel", "{}"]],
        [_GOOD, ["s4w_core.planes.triton_kernels", "_split_kernel"]],
        [_GOOD, ["s4w_core.planes.triton_kernels", "_split_kernel", 7]],
        [_GOOD, "_split_kernel"],
    ],
)
def test_a_record_that_does_not_check_loads_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch, content: object) -> None:
    """Each entry is checked before any kernel is loaded: a bad one anywhere in the record (here
    after a good one) and the warm-up codes its synthetic steps instead."""
    calls: list[str] = []
    monkeypatch.setattr(JITFunction, "preload", lambda self, data: calls.append(data))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    path = tmp_path / "rec.json"
    good = _an_entry()
    path.write_bytes(
        content if isinstance(content, bytes) else json.dumps([good if e is _GOOD else e for e in content]).encode()
    )
    assert _kernel_record.preload(torch.device("cuda", 0), path) is False
    assert calls == []
    assert _kernel_record.preload(torch.device("cuda", 0), tmp_path / "missing.json") is False
    path.write_text(json.dumps([good, good]))  # (the checks can pass)
    assert _kernel_record.preload(torch.device("cuda", 0), path) is True and calls == [good[2], good[2]]


def test_a_record_that_triton_refuses_is_not_used(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton refusing an entry part way: preload says False (the full warm-up runs), and the
    entries it loaded before stay in the record the full warm-up writes (Triton calls no hook
    for a kernel it already holds)."""

    def refuse_the_second(self: JITFunction, data: str) -> None:
        if data.endswith("2"):
            raise RuntimeError("Specialization data is for another target")

    monkeypatch.setattr(JITFunction, "preload", refuse_the_second)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    path = tmp_path / "rec.json"
    first, second = _an_entry("_split_kernel"), _an_entry("_merge_kernel")
    first[2], second[2] = "spec-1", "spec-2"
    path.write_text(json.dumps([first, second]))
    loaded: list[list[str]] = []
    assert _kernel_record.preload(torch.device("cuda", 0), path, loaded) is False
    assert loaded == [first]
    assert _kernel_record.Recorder(loaded).entries == [first]


def test_recorder_keeps_the_codecs_kernels_and_chains_the_hook_before_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import triton

    seen: list[str] = []
    before = lambda **kw: seen.append(kw["fn"].name)  # noqa: E731 - someone else's hook
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", before)
    ours = _kernel_record.kernels()[("s4w_core.planes.triton_kernels", "_split_kernel")]
    info = lambda fn: type("Info", (), {"module": fn.fn.__module__, "name": fn.fn.__qualname__})()  # noqa: E731

    with _kernel_record.Recorder() as rec:
        hook = triton.knobs.runtime.jit_post_compile_hook
        hook(fn=info(ours), compile={"specialization_data": "A"}, key=None)
        hook(fn=type("Info", (), {"module": "user", "name": "mine"})(), compile={"specialization_data": "B"}, key=None)
        hook(fn=info(ours), compile={"specialization_data": "A"}, key=None)  # the same again: one entry
    assert triton.knobs.runtime.jit_post_compile_hook is before  # put back
    assert seen == ["_split_kernel", "mine", "_split_kernel"]  # the earlier hook saw every call
    assert rec.entries == [["s4w_core.planes.triton_kernels", "_split_kernel", "A"]]
    path = tmp_path / "sub" / "rec.json"
    assert rec.write(path) and json.loads(path.read_text()) == rec.entries
    assert [p.name for p in path.parent.iterdir()] == ["rec.json"]  # no temporary left
    assert _kernel_record.Recorder().write(tmp_path / "none.json") is False  # nothing recorded: no file
    assert not (tmp_path / "none.json").exists()

    # a hook installed over ours while it records stays installed
    with _kernel_record.Recorder():
        other = lambda **kw: None  # noqa: E731
        triton.knobs.runtime.jit_post_compile_hook = other
    assert triton.knobs.runtime.jit_post_compile_hook is other

"""The row/column transform (docs/FORMAT.md 4.5d) on the GPU writer and reader.

Without a GPU: each check below runs in a subprocess with ``TRITON_INTERPRET=1`` (as
tests/parity/test_triton_interpret.py does) and nvCOMP simulated (``simulated_gpu``): the GPU writer's
rc- files, ``fast`` and ``portable``, decode bit for bit in the GPU reader and (``portable``) in the CPU
reader, the oracle; CPU-written rc- files decode in the GPU reader; with ``xor`` / ``sub`` deltas and
segments not aligned to rows. With a GPU (@gpu): the same on CUDA tensors.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS: dict[str, Callable[[], None]] = {}


def _check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def rc_like(dtype: torch.dtype, rows: int, cols: int, seed: int) -> torch.Tensor:
    """exp_avg_sq-like: (row scale x column scale x noise) squared, with a few specials (fp16: a
    narrower spread, inside its range)."""
    g = torch.Generator().manual_seed(seed)
    spread, scale = (1.0, 1e-2) if dtype == torch.float16 else (2.0, 1e-6)
    r = torch.exp(spread * torch.randn(rows, 1, generator=g))
    c = torch.exp(spread * torch.randn(1, cols, generator=g))
    t = ((r * c * torch.randn(rows, cols, generator=g)) ** 2 * scale).to(dtype)
    t.view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), 0.0]).to(dtype)
    return t


@_check
def pipeline_rowcol() -> None:
    import base64

    import numpy as np

    import s4w_core
    from s4w_core import engine
    from s4w_core.codecs import get_codec
    from s4w_core.gpu import _encode, _rowcol
    from s4w_core.planes import rowcol
    from tests.parity._interpret_checks import _as_gpu_host_copies, _decode_all_gpu_sim, assert_same, simulated_gpu

    for case, (dtype, rows, cols, seg) in enumerate(
        [(torch.bfloat16, 700, 384, None), (torch.float16, 333, 301, 1003), (torch.float32, 257, 400, 40_000)]
    ):
        v = rc_like(dtype, rows, cols, case)
        dense = torch.randn(90_000, generator=torch.Generator().manual_seed(case)).to(dtype)
        obj = {"v": v, "d": dense.view(300, 300)}
        for profile in ("fast", "portable"):
            buf = io.BytesIO()
            with simulated_gpu(segment_elems=seg), contextlib.ExitStack() as stack:
                if profile == "portable":  # host copies of GPU storages: the GPU writer codes them
                    stack.enter_context(_as_gpu_host_copies())
                s4w_core.save(obj, buf, profile=profile)
                back, m = _decode_all_gpu_sim(buf.getvalue())
            assert_same(obj, back, f"{dtype} {profile} (GPU reader)")
            by = {s["path"]: s for s in m["storages"]}
            assert by["v"]["transform"] == _rowcol.RC_TRANSFORM, (dtype, profile, by["v"]["transform"])
            assert by["v"]["rowcol"]["cols"] == cols
            assert not by["d"]["transform"].startswith("rc-"), by["d"]["transform"]
            if profile == "portable":  # GPU-written, CPU-read (the oracle)
                assert_same(obj, s4w_core.load(buf.getvalue(), map_location="cpu"), f"{dtype} portable (CPU reader)")
        # deltas: the GPU writer keeps a storage with a delta on its plane transform (the residual
        # has no row/column scales) ...
        base = rc_like(dtype, rows, cols, case + 10)
        for op in ("xor", "sub"):
            bb = base.reshape(-1).view(torch.uint8).clone()

            def lookup(path: str, nbytes: int, dt: str, b: torch.Tensor = bb) -> Any:
                return (b, {"ref": path}) if path == "v" else None

            buf = io.BytesIO()
            with simulated_gpu(segment_elems=seg), contextlib.ExitStack() as stack:
                stack.enter_context(_as_gpu_host_copies())
                orig_choose = _encode._choose_delta_ops
                _encode._choose_delta_ops = lambda cands, dev=None, work=None, o=op: [o] * len(cands)
                try:
                    s4w_core.save({"v": v}, buf, profile="portable", _base_lookup=lookup)
                finally:
                    _encode._choose_delta_ops = orig_choose
                back, m = _decode_all_gpu_sim(buf.getvalue(), lambda ref, nbytes, b=bb: b)
            e = m["storages"][0]
            assert not e["transform"].startswith("rc-") and e["delta"]["op"] == op, (e["transform"], e["delta"])
            assert_same({"v": v}, back, f"{dtype} {op}")
            # ... but any writer may combine them (FORMAT.md 4.5d): the CPU writer, forced, and the
            # GPU reader; and the GPU coder of a residual, forced, read back by the CPU reader
            orig_rc = engine.rowcol_choice
            engine.rowcol_choice = lambda raw, b, dt, tr, o, c: (True, o)
            orig_op = engine.choose_delta_op
            engine.choose_delta_op = lambda job, transform, ops=None, o=op: o
            try:
                buf = io.BytesIO()
                s4w_core.save({"v": v}, buf, profile="portable", _base_lookup=lookup)
            finally:
                engine.rowcol_choice, engine.choose_delta_op = orig_rc, orig_op
            with simulated_gpu():
                back, m = _decode_all_gpu_sim(buf.getvalue(), lambda ref, nbytes, b=bb: b)
            e = m["storages"][0]
            assert e["transform"] == "rc-planes-rotl1" and e["delta"]["op"] == op, (e["transform"], e["delta"])
            assert_same({"v": v}, back, f"{dtype} {op} CPU-written, GPU-read")
            with simulated_gpu():
                (key,), ((ids, views),), _keep = _rowcol.encode_rowcol_many(
                    [(bits_of(v), bb, op, dtype, cols)], 1000, "Deflate", "deflate", {}, torch.device("cpu")
                )
            ref = engine.planes_of(bits_of(v), dtype, "planes-rotl1", bb, op).numpy()
            row = np.frombuffer(base64.b64decode(key["row"]), dtype=np.uint8)
            col = np.frombuffer(base64.b64decode(key["col"]), dtype=np.uint8)
            n = v.numel()
            for c, (cid, data) in enumerate(zip(ids, views)):
                k, j = divmod(c, dtype.itemsize)
                s0, s1 = k * 1000, min(n, (k + 1) * 1000)
                got = np.frombuffer(get_codec(cid).decode(bytes(data), s1 - s0), dtype=np.uint8)
                want = ref[j, s0:s1] - (rowcol.tile_np(row, col, s0, s1) if j == 0 else 0)
                assert np.array_equal(got, want.astype(np.uint8)), (dtype, op, c)


@_check
def pipeline_rowcol_groups() -> None:
    """Several row/column storages among plane, integer and small ones: the GPU writer codes them in
    groups (one nvCOMP call each, several groups under a small batch budget) while the other
    storages' chunks go on; the container keeps manifest order and every storage decodes."""
    import s4w_core
    from s4w_core.gpu import _rowcol
    from tests.parity._interpret_checks import _decode_all_gpu_sim, assert_same, simulated_gpu

    obj: dict[str, Any] = {}
    for i in range(5):
        obj[f"m{i}/v"] = rc_like(torch.bfloat16 if i % 2 else torch.float32, 300 + 17 * i, 256, 40 + i)
        obj[f"m{i}/w"] = torch.randn(200, 150, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        obj[f"m{i}/step"] = torch.tensor(float(i))
        obj[f"m{i}/idx"] = torch.arange(70_000, dtype=torch.int64) * (i + 1)
    for budget in (1 << 20, 64 << 20):  # several rc groups, and one
        buf = io.BytesIO()
        with simulated_gpu(batch_bytes=budget):
            s4w_core.save(obj, buf, profile="fast")
            back, m = _decode_all_gpu_sim(buf.getvalue())
        assert_same(obj, back, f"groups of rc storages, budget {budget}")
        by = {s["path"]: s for s in m["storages"]}
        assert all(by[f"m{i}/v"]["transform"] == _rowcol.RC_TRANSFORM for i in range(5)), budget
        assert [s["path"] for s in m["storages"]] == list(obj), "storages out of manifest order"


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@_check
def pipeline_rowcol_cpu_written_gpu_read() -> None:
    import s4w_core
    from s4w_core import engine
    from tests.parity._interpret_checks import _decode_all_gpu_sim, assert_same, simulated_gpu

    orig = engine.SEGMENT_ELEMS
    engine.SEGMENT_ELEMS = 1003  # segments not aligned to the 97-element rows
    try:
        obj = {"a": rc_like(torch.bfloat16, 300, 97, 1), "b": rc_like(torch.float32, 120, 97, 2)}
        buf = io.BytesIO()
        s4w_core.save(obj, buf, profile="portable")
    finally:
        engine.SEGMENT_ELEMS = orig
    with simulated_gpu():
        back, m = _decode_all_gpu_sim(buf.getvalue())
    assert [s["transform"] for s in m["storages"]] == ["rc-planes-rotl1"] * 2
    assert_same(obj, back)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_interpreted(name: str) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("S4W_DISABLE_GPU", None)
    r = subprocess.run(
        [sys.executable, "-m", "tests.parity.test_gpu_rowcol", name],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    assert f"ok {name}" in r.stdout


# ----------------------------------------------------------------------------- on the device
def _gpu_available() -> bool:
    if not torch.cuda.is_available():
        return False
    import s4w_core.gpu as gpu

    return bool(gpu.available())


@pytest.mark.gpu
@pytest.mark.parametrize("profile", ["fast", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rowcol_on_gpu(profile: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA tensors: the GPU writer picks the row/column transform for exp_avg_sq-like tensors and
    not for dense random ones; the GPU reader and (portable) the CPU reader decode them bit for bit;
    a CPU-written rc- file decodes on the GPU."""
    monkeypatch.delenv("S4W_DISABLE_GPU", raising=False)
    if not _gpu_available():
        pytest.skip("needs a CUDA GPU and the GPU backend")
    import s4w_core
    from s4w_core.gpu._rowcol import RC_TRANSFORM
    from tests.parity._interpret_checks import assert_same

    obj = {"v": rc_like(dtype, 3000, 768, 1).cuda(), "d": torch.randn(1000, 768, device="cuda").to(dtype)}
    buf = io.BytesIO()
    s4w_core.save(obj, buf, profile=profile)
    data = buf.getvalue()
    st = {s["path"]: s for s in s4w_core.api.open_reader(data).manifest["storages"]}
    assert st["v"]["transform"] == RC_TRANSFORM and not st["d"]["transform"].startswith("rc-")
    assert_same(obj, s4w_core.load(data, map_location="cuda"))
    if profile == "portable":
        assert_same({k: v.cpu() for k, v in obj.items()}, s4w_core.load(data, map_location="cpu"))
    cpu_obj = {k: v.cpu() for k, v in obj.items()}
    buf = io.BytesIO()
    s4w_core.save(cpu_obj, buf, profile="portable")
    assert s4w_core.api.open_reader(buf.getvalue()).manifest["storages"][0]["transform"].startswith("rc-")
    assert_same(obj, s4w_core.load(buf.getvalue(), map_location="cuda"))


@pytest.mark.gpu
def test_rowcol_groups_on_gpu() -> None:
    """Many row/column storages among others, on CUDA: grouped coding, manifest order, bit-exact."""
    if not _gpu_available():
        pytest.skip("needs a CUDA GPU (run on the device: see docs/DEVELOPING.md)")
    import s4w_core
    from s4w_core.gpu._rowcol import RC_TRANSFORM
    from tests.parity._interpret_checks import assert_same

    obj: dict[str, Any] = {}
    for i in range(40):
        obj[f"m{i}/v"] = rc_like(torch.bfloat16, 1024, 512 + 8 * i, i).cuda()
        obj[f"m{i}/w"] = torch.randn(512, 512, device="cuda").to(torch.bfloat16)
        obj[f"m{i}/step"] = torch.tensor(float(i))
    buf = io.BytesIO()
    s4w_core.save(obj, buf, profile="fast")
    data = buf.getvalue()
    st = s4w_core.api.open_reader(data).manifest["storages"]
    assert [s["path"] for s in st] == list(obj)
    assert all(s["transform"] == RC_TRANSFORM for s in st if s["path"].endswith("/v"))
    assert_same(obj, s4w_core.load(data, map_location="cuda"))


@pytest.mark.gpu
def test_rowcol_choice_device_memory_is_bounded() -> None:
    """The row/column choice over many candidates (160 storages, ~5 M sample elements: ~550 MB of
    temporaries estimated at once) takes device memory for one group of samples, not for all."""
    if not _gpu_available():
        pytest.skip("needs a CUDA GPU (run on the device: see docs/DEVELOPING.md)")
    from s4w_core.gpu import _rowcol

    items: list[Any] = []
    for i in range(160):
        t = rc_like(torch.bfloat16, 256, 1024, i).cuda()
        items.append((t.view(-1).view(torch.uint8), None, None, torch.bfloat16, 1024))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    picks = _rowcol.rowcol_choices_device(items, torch.device("cuda"))
    extra = torch.cuda.max_memory_allocated() - before
    assert all(picks)
    assert extra < 160 * _rowcol._RC_GROUP_ELEMS, extra  # ~110 B an element of one group, and the samples


def main(names: list[str]) -> int:
    from tests.parity._interpret_checks import run_checks

    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

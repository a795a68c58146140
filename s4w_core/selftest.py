"""Adversarial, bit-exact round trips through the public :func:`~s4w_core.save` / :func:`~s4w_core.load`
on this machine: the CPU always, and the GPU where one is usable (``s4w selftest``).

A build whose round trip is not bit-exact here must not be trusted with checkpoints: the CLI exits
1 when :func:`run_selftest` returns False, so a deployment script can gate on it.

Inputs: all 65,536 bf16 and fp16 bit patterns; fp32 and fp64 specials (quiet and signalling NaNs
with payloads, ±Inf, ±0, denormals, extremes) plus random bit patterns (enough to span several
segments); random bytes of every dtype a checkpoint uses; views, 0-d, empty and tied tensors; an
delta (xor or sub) against a close base. Routes (where a GPU backend is usable): CPU → CPU, and for the
``portable`` profile every pairing of GPU/CPU writer with GPU/CPU reader, plus ``fast`` (GPU only).
"""

from __future__ import annotations

import io
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["run_selftest", "CheckResult"]

_FP32_SPECIALS = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # ±0, ±inf
    0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF,  # quiet NaNs (+payloads)
    0x7F800001, 0x7FA00000, 0xFF800001, 0x7FBFFFFF,  # signalling NaNs (+payloads)
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # denormals
    0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xC0000000,  # min normal, max finite, 1, -2
]
_FP64_SPECIALS = [
    0x0000000000000000, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000,
    0x7FF8000000000000, 0x7FF8000000000001, 0xFFFFFFFFFFFFFFFF, 0x7FF0000000000001,
    0x7FF4000000000000, 0x0000000000000001, 0x800FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF,
]


@dataclass
class CheckResult:
    """One line of the self-test table."""

    case: str
    route: str
    ok: bool
    detail: str


def _signed(vals: list[int], bits: int) -> list[int]:
    return [v - (1 << bits) if v >= 1 << (bits - 1) else v for v in vals]


def _random_bits(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    item = dtype.itemsize
    raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


def _dtypes() -> list[torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8",
        "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    ]
    return [dt for n in names if isinstance(dt := getattr(torch, n, None), torch.dtype)]


def _cases(quick: bool) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """(name, builder) pairs; builders make CPU objects (moved to the GPU by the GPU routes)."""
    n_rand = (1 << 20) + 3 if quick else (1 << 23) + 3  # spans several 1 Mi-element segments

    def all16(dtype: torch.dtype) -> Callable[[], dict[str, Any]]:
        def build() -> dict[str, Any]:
            x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
            perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))
            return {"ordered": x, "shuffled": x[perm].clone()}

        return build

    def fp32() -> dict[str, Any]:
        g = torch.Generator().manual_seed(2)
        sp = torch.tensor(_signed(_FP32_SPECIALS, 32), dtype=torch.int32).view(torch.float32)
        return {"specials": sp, "random": torch.cat([sp, _random_bits(torch.float32, n_rand, g)])}

    def fp64() -> dict[str, Any]:
        g = torch.Generator().manual_seed(3)
        sp = torch.tensor(_signed(_FP64_SPECIALS, 64), dtype=torch.int64).view(torch.float64)
        return {"specials": sp, "random": _random_bits(torch.float64, 1 << 16, g)}

    def every_dtype() -> dict[str, Any]:
        g = torch.Generator().manual_seed(4)
        return {str(dt): _random_bits(dt, 4099, g) for dt in _dtypes()}

    def shapes() -> dict[str, Any]:
        g = torch.Generator().manual_seed(5)
        base = torch.randn(8, 6, generator=g).to(torch.bfloat16)
        w = torch.nn.Parameter(torch.randn(5, 4, generator=g))
        return {
            "scalar": torch.tensor(-0.0),
            "empty": torch.empty(0, 3, dtype=torch.float16),
            "view_t": base.t(),
            "view_step": base[1::3, ::2],
            "expand": torch.randn(3, 1, generator=g).expand(3, 4),
            "tied_a": w,
            "tied_b": w,
            "nested": {0: [base, (w,)], "step": 7, "lr": float("nan")},
        }

    return [
        ("bf16: all 65,536 patterns", all16(torch.bfloat16)),
        ("fp16: all 65,536 patterns", all16(torch.float16)),
        (f"fp32: specials + {n_rand:,} random", fp32),
        ("fp64: specials + 65,536 random", fp64),
        (f"every dtype ({len(_dtypes())}), random bytes", every_dtype),
        ("views, 0-d, empty, tied, nested", shapes),
    ]


def _to(obj: Any, device: str) -> Any:
    """Move every tensor to ``device``, keeping shared storages shared and tied tensors tied."""
    tensors: dict[int, torch.Tensor] = {}
    storages: dict[int, Any] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st.data_ptr() if st.nbytes() else id(st)
        if key not in storages:
            storages[key] = st.to(device=torch.device(device))
        out = torch.empty(0, dtype=t.dtype, device=device).set_(storages[key], t.storage_offset(), t.shape, t.stride())
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return out

    def mv(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if id(o) not in tensors:
                tensors[id(o)] = move(o)
            return tensors[id(o)]
        if isinstance(o, dict):
            return type(o)((k, mv(v)) for k, v in o.items())
        if isinstance(o, list):
            return [mv(v) for v in o]
        if isinstance(o, tuple):
            return tuple(mv(v) for v in o)
        return o

    return mv(obj)


def _compare(a: Any, b: Any, path: str, ids: dict[int, int]) -> str | None:
    """None if ``b`` is ``a`` bit for bit (tensors: dtype, shape, stride, bytes, ties); else why not."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or type(a) is not type(b):
            return f"{path}: type {type(b).__name__}, expected {type(a).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
            return f"{path}: {b.dtype}{tuple(b.shape)}/{b.stride()} != {a.dtype}{tuple(a.shape)}/{a.stride()}"
        if id(a) in ids and ids[id(a)] != id(b):
            return f"{path}: a tied tensor came back as a separate object"
        ids[id(a)] = id(b)
        ra = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        rb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(ra, rb):
            bad = int((ra != rb).nonzero()[0]) if ra.numel() == rb.numel() else -1
            return f"{path}: bytes differ (first at byte {bad})"
        return None
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return f"{path}: keys differ"
        for k in a:
            r = _compare(a[k], b[k], f"{path}/{k}", ids)
            if r:
                return r
        return None
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: sequence differs"
        for i, (x, y) in enumerate(zip(a, b)):
            r = _compare(x, y, f"{path}/{i}", ids)
            if r:
                return r
        return None
    if isinstance(a, float) and isinstance(b, float):
        import struct

        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"{path}: {b!r} != {a!r}"
    return None if (type(a) is type(b) and a == b) else f"{path}: {b!r} != {a!r}"


def _h(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _roundtrip(obj: Any, profile: str, map_location: str) -> tuple[Any, str]:
    from s4w_core import load, save

    t0 = time.perf_counter()
    buf = io.BytesIO()
    rep = save(obj, buf, profile=profile)
    out = load(buf.getvalue(), map_location=map_location)
    dt = time.perf_counter() - t0
    return out, f"{_h(rep.raw_bytes)} -> {_h(rep.stored_bytes)} ({rep.ratio:.2f}x), {dt:.2f}s"


def _delta_case() -> tuple[str, Callable[[], str | None]]:
    def run() -> str | None:
        from s4w_core import load, save

        g = torch.Generator().manual_seed(6)
        base = _random_bits(torch.bfloat16, 1 << 17, g)
        x = (base.view(torch.int16) ^ torch.randint(0, 4, base.shape, dtype=torch.int16, generator=g)).view(torch.bfloat16)
        braw = base.view(torch.uint8)
        buf = io.BytesIO()
        rep = save({"x": x}, buf, profile="portable", _base_lookup=lambda p, n, d: (braw, {"ref": 1}))
        if rep.delta_tensors != 1:
            return "the writer did not choose a delta for a close base"
        out = load(buf.getvalue(), map_location="cpu", _resolve_base=lambda r, n: braw)
        return _compare({"x": x}, out, "", {})

    return "bf16: delta vs a close base", run


def run_selftest(quick: bool = False, verbose: bool = True) -> bool:
    """Round-trip adversarial checkpoints through save/load on this machine; True if all bit-exact.

    Args:
        quick: fewer random fp32 patterns (1 Mi instead of 8 Mi); every 16-bit pattern either way.
        verbose: print the pass/fail table (the result is returned either way).
    Returns:
        True if every check passed; False on any mismatch or error.
    Raises:
        Nothing: errors inside a check count as that check's failure.
    Example:
        >>> from s4w_core.selftest import run_selftest
        >>> run_selftest(quick=True, verbose=False)
        True
    """
    from s4w_core._version import __version__

    results: list[CheckResult] = []

    def record(case: str, route: str, fn: Callable[[], tuple[str | None, str]]) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                problem, detail = fn()
        except Exception as e:  # a crash is a failure of this check, not of the self-test
            problem, detail = f"{type(e).__name__}: {e}", ""
        results.append(CheckResult(case, route, problem is None, problem or detail))
        if verbose:
            r = results[-1]
            print(f"  {r.case:<36} {r.route:<30} {'PASS' if r.ok else 'FAIL'}  {r.detail}", flush=True)

    gpu_reason = _gpu_status()
    if verbose:
        print(f"s4weights {__version__} self-test ({'quick' if quick else 'full'}), torch {torch.__version__}")
        print(f"  GPU: {'usable: ' + torch.cuda.get_device_name() if gpu_reason is None else 'not tested (' + gpu_reason + ')'}")
        print(f"  {'case':<36} {'route':<30} result")

    for name, build in _cases(quick):
        obj = build()

        def cpu_route(obj: Any = obj) -> tuple[str | None, str]:
            out, detail = _roundtrip(obj, "portable", "cpu")
            return _compare(obj, out, "", {}), detail

        record(name, "cpu -> portable -> cpu", cpu_route)
        if gpu_reason is None:
            for writer, profile, reader in (
                ("cuda", "portable", "cpu"),
                ("cuda", "portable", "cuda"),
                ("cpu", "portable", "cuda"),
                ("cuda", "fast", "cuda"),
                ("cuda", "fast", "cpu"),
            ):

                def gpu_route(obj: Any = obj, w: str = writer, p: str = profile, r: str = reader) -> tuple[str | None, str]:
                    src = _to(obj, "cuda") if w == "cuda" else obj
                    out, detail = _roundtrip(src, p, r)
                    return _compare(obj, out, "", {}), detail

                record(name, f"{writer} -> {profile} -> {reader}", gpu_route)

    dname, drun = _delta_case()
    record(dname, "cpu -> portable+delta -> cpu", lambda: (drun(), ""))

    ok = all(r.ok for r in results)
    if verbose:
        failed = sum(not r.ok for r in results)
        print(f"RESULT: {'PASS' if ok else 'FAIL'} ({len(results) - failed} checks passed, {failed} failed)")
    return ok


def _gpu_status() -> str | None:
    """None if the GPU routes can run here, else why not."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        from s4w_core import gpu
    except ImportError as e:
        return f"GPU backend does not import: {e}"
    if not gpu.available():
        reason = getattr(gpu, "unavailable_reason", lambda: "unavailable")()
        return f"GPU backend unavailable: {reason}"
    return None

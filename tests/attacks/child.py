"""Runs attack cases in one process, under ``RLIMIT_AS``; one JSON line per case on stdout.

Usage: ``python -m tests.attacks.child CASEDIR BUDGET_MB DEVICE``. ``CASEDIR/index.json`` lists the
cases (file, name, kind). After the imports and one real save/load/pack (the import-only baseline,
warm), the address space is capped at the baseline plus ``BUDGET_MB`` (on ``cpu``; CUDA reserves
address space of its own, so on ``cuda`` the GPU's peak allocation is measured instead). Each case
prints ``{"start": name}`` before it runs, so that a case that kills the process or hangs is named
by the parent.
"""

from __future__ import annotations

import io
import json
import os
import resource
import sys
import time
import traceback
from typing import Any


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    casedir, budget_mb, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import torch

    import s4w_core
    from s4w_core.errors import S4WError
    from s4w_core.filepack import pack_file, unpack_bytes

    # warm: the first real save/load/pack imports and allocates what every later one reuses
    buf = io.BytesIO()
    s4w_core.save({"w": torch.randn(4096).to(torch.bfloat16), "i": torch.arange(100), "n": [1, "x"]}, buf)
    s4w_core.load(buf.getvalue(), map_location=device)
    s4w_core.verify(buf.getvalue())
    zbuf = io.BytesIO()
    torch.save({"w": torch.ones(8)}, zbuf)
    unpack_bytes(pack_file(zbuf.getvalue()))
    base_vm = _status("VmSize")
    base_rss = _status("VmRSS")
    if device == "cpu":
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (base_vm + (budget_mb << 20), hard))
    print(json.dumps({"baseline_vm": base_vm, "baseline_rss": base_rss}), flush=True)
    with open(os.path.join(casedir, "index.json")) as f:
        index: list[dict[str, Any]] = json.load(f)
    for c in index:
        path = os.path.join(casedir, c["file"])
        print(json.dumps({"start": c["name"]}), flush=True)
        mods = set(sys.modules)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        gpu0 = torch.cuda.memory_allocated() if device == "cuda" else 0
        t0 = time.perf_counter()
        res: dict[str, Any] = {"name": c["name"]}
        try:
            if c["kind"] == "load":
                s4w_core.load(path, map_location=device)
            else:
                with open(path, "rb") as f:
                    blob = f.read()
                if unpack_bytes(pack_file(path)) != blob:
                    raise AssertionError("pack_file/unpack_bytes did not give the file back")
                del blob
            res["outcome"] = "ok"
        except S4WError as e:
            res["outcome"] = "error"
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        except BaseException as e:  # noqa: BLE001 - anything else is the finding
            res["outcome"] = "other"
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["trace"] = traceback.format_exc()[-2000:]
        res["seconds"] = round(time.perf_counter() - t0, 3)
        if c["kind"] == "load" and res["outcome"] != "other":
            try:  # verify must agree with load
                res["verify_ok"] = s4w_core.verify(path, map_location=device).ok
            except S4WError as e:
                res["verify_ok"] = False
                res["verify_error"] = type(e).__name__
            except BaseException as e:  # noqa: BLE001
                res["outcome"] = "other"
                res["error"] = f"verify: {type(e).__name__}: {str(e)[:300]}"
        res["new_torch_modules"] = sorted(m for m in set(sys.modules) - mods if m.startswith("torch."))
        # the process's peak resident memory so far over the warm baseline (a running maximum)
        res["hwm_over_baseline"] = _status("VmHWM") - base_rss
        if device == "cuda":
            res["gpu_peak"] = torch.cuda.max_memory_allocated() - gpu0
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

"""Create tests/compat/golden/store_v1/: a checkpoint store written by the first store layout
(forward deltas: a keyframe, then deltas on the step before; the newest delta step with a
keyframe copy; a pinned step) — once, by hand, with the code of that layout.

    python -m tests.compat.make_golden_store      # refuses when the directory exists

tests/compat/test_golden_store.py loads every step of the committed store bit-exactly and saves
into a copy of it; it never writes the golden directory. Data is formula-made (make_golden.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch

from tests.compat.make_golden import GOLDEN, describe, weights_bf16, weights_fp32

STORE = GOLDEN / "store_v1"
STEPS = (10, 20, 30, 40, 50)


def state_at(step: int) -> dict[str, Any]:
    """The state saved at ``step``: a few tensors that change a little from step to step."""
    i = STEPS.index(step)
    w = weights_bf16(1024, 31).clone()
    w[: 16 * (i + 1)] = weights_bf16(16 * (i + 1), 40 + i)  # a growing slice moves
    m = weights_fp32(256, 32).clone()
    m[i::7] = weights_fp32(len(range(i, 271, 7)), 50 + i)[: len(m[i::7])]
    return {
        "model": {"w": w, "b": torch.arange(8, dtype=torch.int32) + i},
        "optimizer": {"exp_avg": m, "step": torch.tensor(float(step))},
        "step": step,
    }


def main() -> int:
    import s4w_core

    if STORE.exists():
        print(f"keep {STORE} (exists; it is committed, never regenerated)")
        return 0
    store = s4w_core.CheckpointStore(STORE, keyframe_every=3, profile="portable")
    for s in STEPS:
        info = store.save(state_at(s), step=s)
        print(f"step {s}: {info.kind} depth {info.depth} base {info.base_step} {info.object_bytes} bytes")
    store.pin(20)
    store.close()  # waits for the keyframe copy of the newest step
    recs = {r.step: r for r in s4w_core.CheckpointStore(STORE).list()}
    assert recs[50].copy is not None, "the newest delta step should have a keyframe copy"
    expected = {str(s): describe(state_at(s)) for s in STEPS}
    (GOLDEN / "store_v1.expected.json").write_text(json.dumps(
        {"steps": list(STEPS), "pinned": [20], "describe": expected,
         "kinds": {str(s): recs[s].kind for s in STEPS},
         "files_sha256": {str(p.relative_to(STORE)): hashlib.sha256(p.read_bytes()).hexdigest()
                          for p in sorted(STORE.rglob("*")) if p.is_file()}},
        indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

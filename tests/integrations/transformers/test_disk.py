"""What an S4Callback run leaves on disk (tiny GPT-2 on the CPU, as in test_transformers.py):
exactly the steps the Trainer's own ``save_total_limit`` rotation keeps, the older one a delta
against the newer, each tensor stored once, and no other file."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_transformers import S4Callback  # noqa: E402
from tests.integrations.transformers.test_transformers import make_trainer  # noqa: E402


def _files(root):
    return {
        os.path.relpath(os.path.join(d, n), root): os.path.getsize(os.path.join(d, n))
        for d, _, names in os.walk(root)
        for n in names
    }


def _bytes(objs):
    """Bytes of the tensors and arrays among ``objs``, each storage once (tied weights share one)."""
    seen, total = set(), 0
    for o in objs:
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(o, np.ndarray):
            total += o.nbytes
    return total


def test_store_holds_what_the_trainers_rotation_keeps(tmp_path):
    """save_steps=3, save_total_limit=2, 9 steps: the Trainer keeps checkpoint-6 and checkpoint-9;
    the store ends (when train() returns) with steps 6 (a delta against 9) and 9 (whole), their two
    objects and two commit records, nothing else in output_dir."""
    ref = make_trainer(tmp_path / "ref", 9, save_total_limit=2)
    ref.train()
    kept = sorted(int(n.split("-")[1]) for n in os.listdir(tmp_path / "ref") if n.startswith("checkpoint-"))
    assert kept == [6, 9]

    tr = make_trainer(tmp_path / "out", 9, [S4Callback()], save_total_limit=2)
    tr.train()
    st = CheckpointStore(str(tmp_path / "out" / ".s4w"))
    assert st.steps() == kept
    old, new = st.info(6), st.info(9)
    assert (old.kind, old.base_step, new.kind) == ("delta", 9, "keyframe")
    assert old.object_bytes < new.object_bytes
    assert not old.hidden and new.copy is None and old.objects == (old.object,) and new.objects == (new.object,)
    want = {f".s4w/{i.object}" for i in (old, new)} | {f".s4w/commits/step_{s:012d}.json" for s in kept}
    files = _files(tmp_path / "out")
    assert set(files) == want, sorted(files)
    assert files[f".s4w/{old.object}"] == old.object_bytes and files[f".s4w/{new.object}"] == new.object_bytes
    # every tensor once: the model's, the optimizer's and the RNG states' bytes, nothing twice
    # (the JSON texts, trainer state and config, are not tensors)
    tree = st.load(9)
    assert sorted(tree) == ["config", "model", "optimizer", "rng", "scheduler", "trainer_state"]
    opt = [t for s in tr.optimizer.state_dict()["state"].values() for t in s.values()]
    rng = [v for r in tree["rng"] for v in (r["cpu"], r["numpy"][1])]
    assert new.raw_bytes == _bytes(tr.model.state_dict().values()) + _bytes(opt) + _bytes(rng)
    st.close()

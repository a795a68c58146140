"""A store written by the first store layout (forward deltas, a keyframe copy of the newest step,
a pinned step; tests/compat/golden/store_v1, made once by make_golden_store.py) stays readable
bit-exactly, and saving into it continues it correctly.  The committed directory is never
written: every test works on a copy."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import s4w_core
from tests.compat.make_golden import GOLDEN, describe
from tests.compat.make_golden_store import STEPS, STORE, state_at

EXPECTED = json.loads((GOLDEN / "store_v1.expected.json").read_text())


@pytest.fixture
def store_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "store_v1"
    shutil.copytree(STORE, dst)
    return dst


def test_golden_store_is_unchanged() -> None:
    got = {str(p.relative_to(STORE)): hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(STORE.rglob("*")) if p.is_file()}
    assert got == EXPECTED["files_sha256"], "the golden store was modified"


def test_golden_store_matches_its_builder() -> None:
    for s in STEPS:
        assert describe(state_at(s)) == EXPECTED["describe"][str(s)]


def test_every_step_of_a_v1_store_loads_bit_exactly(store_copy: Path) -> None:
    st = s4w_core.CheckpointStore(store_copy)
    assert st.steps() == list(STEPS)
    assert [r.step for r in st.list() if r.pinned] == EXPECTED["pinned"]
    for s in STEPS:
        assert describe(st.load(s)) == EXPECTED["describe"][str(s)], f"step {s}"
        assert st.verify(s).ok, st.verify(s).problems
    assert describe(st.load()) == EXPECTED["describe"][str(STEPS[-1])]
    st.close()


def _next_state(i: int) -> dict:
    s = state_at(STEPS[-1])
    s["model"]["w"][-8 * i:] = torch.arange(8 * i, dtype=torch.bfloat16)
    s["step"] = 50 + 10 * i
    return s


def test_saving_into_a_v1_store_keeps_every_step_loadable(store_copy: Path) -> None:
    st = s4w_core.CheckpointStore(store_copy)
    new = {50 + 10 * i: _next_state(i) for i in (1, 2, 3)}
    for s, state in new.items():
        st.save(state, step=s)
    st.close()
    st = s4w_core.CheckpointStore(store_copy)  # a fresh process's view
    assert st.steps() == [*STEPS, *new]
    recs = {r.step: r for r in st.list()}
    # the first layout's steps stay as they were (the keyframe copy is dropped: the newest step is
    # whole now); the new steps take the reverse layout
    assert recs[50].base_step == 40 and recs[50].copy is None
    assert [(recs[s].kind, recs[s].base_step) for s in new] == [("delta", 70), ("delta", 80), ("keyframe", None)]
    for s in STEPS:
        assert describe(st.load(s)) == EXPECTED["describe"][str(s)], f"old step {s}"
    for s, state in new.items():
        assert describe(st.load(s)) == describe(state), f"new step {s}"
    for s in st.steps():
        assert st.verify(s).ok, (s, st.verify(s).problems)
    # deleting old steps (unpinned, oldest first) never breaks what is kept
    for s in (10, 30, 40):
        st.delete(s)
        for k in st.steps():
            got = st.load(k)
            want = EXPECTED["describe"][str(k)] if k in STEPS else describe(new[k])
            assert describe(got) == want, (s, k)
    st.close()

"""s4w_core.framework_steps: the store side the HF Trainer and Accelerate adapters share."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from s4w_core import CheckpointNotFoundError, CheckpointStore, ConflictError
from s4w_core import framework_steps as fs
from s4w_core.frameworks import StateMismatchError
from tests.integrations._util import diff


def _tree(v: float) -> dict:
    return {"model": {"w": torch.full((4, 4), v)}, "trainer_state": "{}"}


def test_stores_open_once_per_url(tmp_path):
    stores = fs.Stores(profile="portable")
    a = stores.open(str(tmp_path / "a"))
    assert stores.open(str(tmp_path / "a")) is a and stores.open(str(tmp_path / "b")) is not a
    assert len(stores.opened()) == 2
    stores.clear()
    assert stores.opened() == [] and stores.open(str(tmp_path / "a")) is not a


@pytest.mark.parametrize("async_save", [False, True])
def test_adapter_steps_save_retain_find(tmp_path, async_save):
    steps = fs.AdapterSteps("me", profile="portable")
    st = steps.store(str(tmp_path / "s"))
    for i in range(1, 6):
        steps.save(st, _tree(i), i, {"auto": i != 3}, async_save=async_save,
                   then=lambda: steps.retain(st, 2, best=2, auto=True))
    steps.finish()
    assert steps.last_info.step == 5
    # the newest and the best of the matching steps kept; step 3 (another kind) untouched
    assert st.steps() == [2, 3, 5] and [i.step for i in steps.own(st, auto=True)] == [2, 5]
    assert steps.find(st, "w", auto=False).step == 3 and steps.find(st, "w").step == 5
    with pytest.raises(CheckpointNotFoundError, match="w: the store .* has no step with auto='x'"):
        steps.find(st, "w", auto="x")
    other = fs.AdapterSteps("other", profile="portable")
    other.save(st, _tree(9), 9, {"auto": True})
    with pytest.raises(StateMismatchError, match="step 9 was written by 'other'"):
        steps.find(st, "w", auto=True)
    with pytest.raises(StateMismatchError, match="step 9 was written by 'other', not by Me"):
        steps.info(st, None, "Me")
    assert steps.info(st, 5, "Me").extra["writer"] == "me"
    with pytest.raises(ConflictError, match=r"already holds steps \[2, 3, 5, 9\] .* at step 0; hint"):
        steps.check_fresh(st, "hint")
    steps.check_fresh(steps.store(str(tmp_path / "empty")), "hint")


def test_load_model_checks_first(tmp_path):
    steps = fs.AdapterSteps("me", profile="portable")
    st = steps.store(str(tmp_path / "s"))
    steps.save(st, {"model": {"weight": torch.ones(2, 3), "bias": torch.ones(2)}}, 1, {})
    model = torch.nn.Linear(3, 2)
    steps.load_model(st, 1, model, "cpu")
    assert torch.equal(model.weight, torch.ones(2, 3))
    small = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in small.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"step 1: key 'weight' is \(2, 3\)"):
        steps.load_model(st, 1, small, "cpu")
    assert not diff(small.state_dict(), before)


def test_packed_folder_and_restore_into(tmp_path):
    src = tmp_path / "checkpoint-7"
    src.mkdir()
    torch.save({"x": torch.arange(5)}, src / "optimizer.pt")
    (src / "trainer_state.json").write_text("{}")
    steps = fs.AdapterSteps("me", profile="portable")
    st = steps.store(str(tmp_path / "s"))
    steps.save_folder(st, str(src), 7, {"format": 1})
    assert st.info(7).extra["files"] == ["optimizer.pt", "trainer_state.json"]
    dest, kept = fs.restore_into(steps, st, None, tmp_path / "out", lambda *a: None, what="Me")
    assert kept == {} and sorted(os.listdir(dest)) == ["optimizer.pt", "trainer_state.json"]
    assert (src / "optimizer.pt").read_bytes() == (tmp_path / "out" / "optimizer.pt").read_bytes()
    with pytest.raises(ConflictError, match="exists and is not empty"):
        fs.restore_into(steps, st, 7, tmp_path / "out", lambda *a: None, what="Me")
    # a tree step: written by the adapter's function into a temporary folder, some parts held back
    steps.save(st, {"model": {"w": torch.ones(3)}, "optimizer": {"s": torch.zeros(2)}}, 8, {})
    seen = {}
    dest, kept = fs.restore_into(steps, st, 8, None, lambda tree, d, where: seen.update(tree=tree, where=where),
                                 what="Me", held=("optimizer",))  # fmt: skip
    assert os.path.basename(dest) == "checkpoint-8" and fs.temp_folders_pending()
    assert list(seen["tree"]) == ["model"] and seen["where"].endswith("step 8") and "s" in kept["optimizer"]
    fs.cleanup_temp_folders()
    assert not fs.temp_folders_pending() and not os.path.exists(os.path.dirname(dest))
    with pytest.raises(StateMismatchError, match="step 8: key 'w' is stored but this model has no such key"):
        fs.restore_into(steps, st, 8, tmp_path / "o2", lambda *a: None, what="Me", model=torch.nn.Linear(2, 2))


def test_states_checked_before_loading():
    class Obj:
        def __init__(self):
            self.sd = {"n": 0}

        def state_dict(self):
            return dict(self.sd)

        def load_state_dict(self, sd):
            self.sd = dict(sd)

    m, o = torch.nn.Linear(2, 2), Obj()
    stored = {"models": [{k: v + 1 for k, v in m.state_dict().items()}], "objs": [{"n": 5}]}
    fs.check_states("w", stored, {"models": [m], "objs": [o]})
    with pytest.raises(StateMismatchError, match="w: 1 objs stored, 2 registered here"):
        fs.check_states("w", stored, {"models": [m], "objs": [o, o]})
    with pytest.raises(StateMismatchError, match="w model 0: key 'weight'"):
        fs.check_states("w", stored, {"models": [torch.nn.Linear(3, 2)], "objs": [o]})
    fs.load_states(stored, {"objs": [o]})
    assert o.sd == {"n": 5}
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(m.parameters(), lr=0.1), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fs.state_dicts([sched, o])[1] == {"n": 5}


def test_small_helpers(tmp_path):
    st = CheckpointStore(str(tmp_path / "s"), profile="portable")
    assert fs.step_from_name("checkpoint_12", st) == 12 and fs.step_from_name("run3-step_40", st) == 40
    assert fs.step_from_name("final", st) == 0
    st.save({"a": torch.ones(1)}, 4)
    assert fs.step_from_name("final", st) == 5
    seen: set[str] = set()
    with pytest.warns(UserWarning, match="once"):
        fs.warn_once(seen, "k", "once")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs.warn_once(seen, "k", "once")
    assert fs.sharded_root("s3://b/run/.s4w/") == "s3://b/run/.s4w_dcp"


def test_private_attrs_fail_loudly():
    class Thing:
        _a, _b = 1, 2

    assert fs.private_attrs(Thing(), ("_a", "_b"), "fw", "9.9", "1.0") == {"a": 1, "b": 2}
    with pytest.raises(fs.UnsupportedFrameworkError, match=r"Thing._c, which fw 9.9 does not have \(checked against 1.0\)"):
        fs.private_attrs(Thing(), ("_a", "_c"), "fw", "9.9", "1.0")


def test_patch_and_unpatch_methods():
    class K:
        def f(self) -> int:
            """doc of f"""
            return 1

    originals: dict = {}
    fs.patch_methods(K, {"f": lambda self: 2}, originals)
    fs.patch_methods(K, {"f": lambda self: 3}, originals)  # already patched: nothing changes
    assert K().f() == 2 and K.f.__doc__ == "doc of f" and K.f.__name__ == "f"
    fs.unpatch_methods(K, originals)
    assert K().f() == 1 and originals == {}


def test_caller_instance():
    class Owner:
        def run(self, fn):
            return fn()

    o = Owner()
    assert o.run(lambda: fs.caller_instance(Owner)) is o
    assert fs.caller_instance(Owner) is None

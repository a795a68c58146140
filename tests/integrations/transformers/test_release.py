"""A Trainer with S4Callback is freed when its last reference goes, as a bare Trainer is: no
reference cycle keeps its model and optimizer until the cyclic garbage collector runs (tiny GPT-2
on the CPU, as in test_transformers.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.integrations._util import diff

pytest.importorskip("transformers")
import transformers  # noqa: E402

from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_transformers import S4Callback  # noqa: E402
from tests.integrations.transformers.test_transformers import StopAt, make_trainer, tiny_gpt2  # noqa: E402


@pytest.fixture()
def no_cyclic_gc():
    """The cyclic collector off for the test: only reference counting frees objects."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _refs(tr):
    return weakref.ref(tr), weakref.ref(tr.model), weakref.ref(tr.optimizer) if tr.optimizer is not None else None


def _dead(refs):
    return [r is None or r() is None for r in refs]


@pytest.mark.parametrize("how", ["callbacks", "attach"])
def test_dropped_trainer_is_freed_without_the_cyclic_gc(tmp_path, no_cyclic_gc, how):
    """Trained (saves at steps 1 and 2), then dropped: the Trainer, its model and optimizer go at
    ``del``, though the callback itself is still referenced."""
    cb = S4Callback()
    if how == "callbacks":
        tr = make_trainer(tmp_path / "out", 2, [cb], save_steps=1)
    else:
        tr = cb.attach(make_trainer(tmp_path / "out", 2, save_steps=1))
    tr.train()
    refs = _refs(tr)
    assert _dead(refs) == [False, False, False]
    del tr
    assert _dead(refs) == [True, True, True]
    assert CheckpointStore(str(tmp_path / "out" / ".s4w")).steps() == [1, 2]
    # only attached: freed too
    tr = make_trainer(tmp_path / "other", 2, [S4Callback()])
    refs = _refs(tr)
    del tr
    assert _dead(refs)[:2] == [True, True]


def test_chained_train_and_resume(tmp_path, no_cyclic_gc):
    """``make_trainer().train()``: no reference but the call's keeps the Trainer alive, and it
    saves, then resumes bit-exactly from the store, as the uninterrupted run."""
    ref = make_trainer(tmp_path / "ref", 9, save_steps=100)
    ref.train()
    out = make_trainer(tmp_path / "out", 9, [StopAt(5), S4Callback()]).train()
    assert out.global_step == 5
    assert CheckpointStore(str(tmp_path / "out" / ".s4w")).steps() == [3, 5]
    model = tiny_gpt2()
    out = make_trainer(tmp_path / "out", 9, [S4Callback()], model=model).train(resume_from_checkpoint=True)
    assert out.global_step == 9
    assert not diff(model.state_dict(), ref.model.state_dict())
    out = S4Callback().attach(make_trainer(tmp_path / "out2", 3)).train()  # the attach() form, chained
    assert out.global_step == 3 and CheckpointStore(str(tmp_path / "out2" / ".s4w")).steps() == [3]


class MyTrainer(transformers.Trainer):
    pass


def test_trainer_class_kept_for_the_user(tmp_path):
    """The Trainer's class after binding: named as before, an instance of the user's class, one
    subclass per Trainer class (made once)."""
    a, b = make_trainer(tmp_path / "a", 3, [S4Callback()]), make_trainer(tmp_path / "b", 3, [S4Callback()])
    assert type(a) is type(b) and type(a) is not transformers.Trainer
    assert type(a).__name__ == "Trainer" and isinstance(a, transformers.Trainer)
    args = a.args
    mine = S4Callback().attach(MyTrainer(model=tiny_gpt2(), args=args))
    assert type(mine).__name__ == "MyTrainer" and isinstance(mine, MyTrainer) and type(mine) is not MyTrainer
    again = S4Callback().attach(mine)  # a second callback: the class stays, the new callback is used
    assert type(again) is type(mine)

"""s4w_core.frameworks: the pieces the Lightning, HF Trainer and Accelerate adapters share."""

from __future__ import annotations

import argparse
import collections
import os
import random
import threading

import numpy as np
import pytest
import torch

from s4w_core import CheckpointNotFoundError, CheckpointStore, UnsupportedTypeError, frameworks, pointer
from s4w_core.frameworks import StateMismatchError
from tests.integrations._util import diff


def test_rotate_keeps_the_newest_and_the_best():
    assert frameworks.rotate([1, 2, 3, 4], None) == []
    assert frameworks.rotate([1, 2, 3, 4], 0) == []
    assert frameworks.rotate([1, 2, 3, 4], 2) == [1, 2]
    assert frameworks.rotate([1, 2, 3, 4], 2, best=1) == [2, 3]
    assert frameworks.rotate([1, 2, 3, 4], 1, best=2) == [1, 3]  # the newest and the best both stay
    assert frameworks.rotate([1, 2, 3, 4], 1) == [1, 2, 3]
    assert frameworks.rotate([1, 2], 5, best=9) == []


def test_check_state_dict_names_the_key():
    own = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    frameworks.check_state_dict("s step 1", {"a": torch.ones(2, 3), "b": torch.ones(4)}, own)
    with pytest.raises(StateMismatchError, match=r"s step 1: key 'a' is \(3, 2\) torch.float32 in the store"):
        frameworks.check_state_dict("s step 1", {"a": torch.ones(3, 2), "b": torch.ones(4)}, own)
    with pytest.raises(StateMismatchError, match="key 'b' is .* torch.float16"):
        frameworks.check_state_dict("w", {"a": torch.ones(2, 3), "b": torch.ones(4, dtype=torch.float16)}, own)
    with pytest.raises(StateMismatchError, match="key 'c' is stored but this model has no such key"):
        frameworks.check_state_dict("w", {**own, "c": torch.ones(1)}, own)
    with pytest.raises(StateMismatchError, match="key 'b' of this model is not in the store"):
        frameworks.check_state_dict("w", {"a": own["a"]}, own)
    with pytest.raises(StateMismatchError, match="w: 1 optimizers stored, 2 registered here"):
        frameworks.check_count("w", "optimizers", [{}], [1, 2])
    assert issubclass(StateMismatchError, ValueError)


def test_fingerprint_tells_shapes_and_dtypes_apart():
    a = {"w": torch.zeros(2, 3)}
    assert frameworks.fingerprint(a) == frameworks.fingerprint({"w": torch.ones(2, 3)})
    assert frameworks.fingerprint(a) != frameworks.fingerprint({"w": torch.zeros(3, 2)})
    assert frameworks.fingerprint(a) != frameworks.fingerprint({"w": torch.zeros(2, 3, dtype=torch.bfloat16)})
    assert frameworks.fingerprint(a) != frameworks.fingerprint({"v": torch.zeros(2, 3)})


@pytest.mark.parametrize("async_save", [False, True])
def test_step_saver_runs_retention_once_durable(tmp_path, async_save):
    st = CheckpointStore(str(tmp_path / "s"), profile="portable")
    saver, done = frameworks.StepSaver(), []
    for step in (1, 2):
        tree = {"w": torch.full((8,), float(step))}
        saver.save(st, tree, step, extra={"k": step}, overwrite=False, async_save=async_save,
                   then=lambda step=step: done.append(step))  # fmt: skip
    assert done == ([1] if async_save else [1, 2])  # the second save finished the first
    saver.finish()
    saver.finish()  # nothing in flight: a no-op
    assert done == [1, 2] and saver.last_info.step == 2
    assert st.load(2)["w"].tolist() == [2.0] * 8 and st.info(1).extra == {"k": 1}


def test_rng_state_round_trip():
    st = frameworks.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(3))
    frameworks.set_rng_state(st)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    assert frameworks.gather_object(1) == [1] and frameworks.broadcast_object(2) == 2  # no process group


def test_paths():
    assert frameworks.norm_path("s3:/b/run/x.ckpt") == "s3://b/run/x.ckpt"
    assert frameworks.split_path("s3://b/run/x.ckpt") == ("s3://b/run", "x.ckpt")
    assert frameworks.join_path("s3://b/run/", ".s4w") == "s3://b/run/.s4w"
    assert frameworks.store_url("s3://b/p") == "s3://b/p"
    assert frameworks.store_url("rel") == os.path.abspath("rel")
    assert frameworks.split_path("a/b.ckpt") == (os.path.abspath("a"), "b.ckpt")
    assert frameworks.device_map("cuda:1")("cpu") == "cpu" and frameworks.device_map("cuda:1")("cuda:0") == "cuda:1"
    assert frameworks.auto_location("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert frameworks.auto_location("cuda:0") == "cpu"


def test_files_local(tmp_path):
    files = frameworks.Files()
    p = str(tmp_path / "a.bin")
    with pytest.raises(CheckpointNotFoundError, match="a.bin"):
        files.read(p)
    files.write(p, b"xyz")
    assert files.read(p) == b"xyz" and files.listdir(str(tmp_path)) == [p]
    assert files.pointer_at(p) is None  # another kind of file
    q = str(tmp_path / "b.ckpt")
    files.write(q, pointer.encode(".s4w", 7))
    assert files.pointer_at(q).step == 7
    files.remove(p)
    files.remove(p)  # gone already: nothing to do
    assert files.listdir(str(tmp_path)) == [q] and files.listdir(str(tmp_path / "none")) == []


def test_files_s3(s3_url):
    files = frameworks.Files()
    d = s3_url.rstrip("/") + "/ckpts"
    assert files.listdir(d) == []
    files.write(d + "/x.ckpt", pointer.encode(".s4w", 3))
    files.write(d + "/sub/y", b"1")
    assert files.listdir(d) == [d + "/x.ckpt"]  # files directly in the folder only
    assert files.pointer_at(d + "/x.ckpt").step == 3 and files.pointer_at(d + "/none") is None
    files.save(d + "/c.s4w", {"w": torch.arange(4)}, "portable")
    files.remove(d + "/x.ckpt")
    assert sorted(files.listdir(d)) == [d + "/c.s4w"]


def test_serial_queue_runs_in_order_and_surfaces_the_first_error():
    q, seen, gate = frameworks.SerialQueue(True, "t"), [], threading.Event()
    q.submit(gate.wait)
    for i in range(5):
        q.submit(seen.append, i)
    assert seen == []  # queued behind the gate, not run on this thread
    gate.set()
    q.wait()
    assert seen == [0, 1, 2, 3, 4]

    def boom():
        raise OSError("disk full")

    skipped = []
    q.submit(boom)
    q.submit(seen.append, 99, skipped=lambda: skipped.append(99))  # after a failure nothing queued behind it runs
    with pytest.raises(OSError, match="disk full"):
        q.wait()
    assert 99 not in seen and skipped == [99]  # its ``skipped`` ran instead (a pointer's announced step settled)
    q.submit(seen.append, 5)
    q.wait()
    assert seen[-1] == 5
    q.close()
    sync, out = frameworks.SerialQueue(False, "t"), []
    sync.submit(out.append, 1)
    assert out == [1]


class Opaque:
    def __init__(self, x):
        self.x = x


def test_pack_objects_round_trip_and_refusal():
    state = {
        "w": torch.arange(3.0),
        "hp": collections.OrderedDict(lr=0.1, ns=argparse.Namespace(a=1, b=[1, (2, 3)])),
        "np": np.arange(3),
        "s": {1, 2},
        "odd": {(1, 2): "tuple key"},  # a dict with a non-plain key: stored whole with torch.save
    }
    packed = frameworks.pack_objects(state)
    assert packed["hp"] == state["hp"] and "__s4w_torch_objects__" in packed
    back = frameworks.unpack_objects(packed)
    assert back["odd"] == {(1, 2): "tuple key"} and back["hp"]["ns"].b == [1, (2, 3)]
    assert not diff(back["w"], state["w"])
    assert "__s4w_torch_objects__" not in frameworks.pack_objects({"w": torch.zeros(1), "n": None})
    with pytest.raises(UnsupportedTypeError, match="Opaque"):
        frameworks.pack_objects({"o": Opaque(1)})


def test_snapshot_clones_tensors():
    w = torch.zeros(3)
    snap = frameworks.snapshot({"a": [w, (w,)], "n": 1})
    w += 1
    assert snap["a"][0].tolist() == [0.0] * 3 and isinstance(snap["a"][1], tuple) and snap["n"] == 1


def test_saved_step_recognises_the_same_tensors():
    p = torch.nn.Parameter(torch.zeros(4))
    with torch.no_grad():
        p.add_(1)  # written in place: version > 0, held
    ck = {"state_dict": {"p": p}, "fresh": torch.ones(2), "cb": {"k": 1}}
    saved = frameworks.SavedStep(5, ck)
    sk = saved.skeleton({"state_dict": {"p": p}, "fresh": torch.ones(2), "cb": {"k": 2}})
    assert sk["state_dict"]["p"] == {pointer.REF_KEY: True}
    assert sk["fresh"] == {pointer.REF_KEY: True}  # version 0: not held, the same fingerprint
    assert "fresh" not in {p[0] for p in saved.tensors}
    assert sk["cb"] == {"k": 2}
    assert saved.same(("state_dict", "p"), p.detach().clone())  # another copy with the same bits
    with torch.no_grad():
        p.add_(1)  # changed since: no longer the stored step's
    assert saved.skeleton({"state_dict": {"p": p}})["state_dict"]["p"] is p
    changed = torch.tensor([1.0, 1.0 + 2**-20])  # version 0 and other bits: stored again
    assert saved.skeleton({"fresh": changed})["fresh"] is changed
    assert not saved.same(("fresh",), torch.ones(3))  # another shape
    assert not saved.same(("fresh",), torch.ones(2, dtype=torch.float64))  # another dtype


def _leaves(obj):
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def _foreach_adam_state(device):
    """A model and the state of a foreach AdamW after two steps (CUDA: its moments keep version 0)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    for _ in range(2):
        m(torch.randn(4, 16, device=device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_saved_step_recognises_optimizer_state_of_version_0(device):
    """A second name of the same step is all placeholders, also for state that in-place kernels
    outside autograd's version counting update (CUDA foreach AdamW's moments); a step later it
    is none of them."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m, opt = _foreach_adam_state(device)

    def checkpoint():
        return {"state_dict": m.state_dict(), "optimizer_states": [opt.state_dict()]}

    saved = frameworks.SavedStep(2, checkpoint())
    sk = saved.skeleton(checkpoint())
    leaves = [t for t in _leaves(sk) if isinstance(t, torch.Tensor)]
    assert not leaves, f"tensors stored again under the second name: {len(leaves)}"
    m(torch.randn(4, 16, device=device)).square().mean().backward()
    opt.step()
    sk = saved.skeleton(checkpoint())
    moments = sk["optimizer_states"][0]["state"][0]
    assert isinstance(moments["exp_avg"], torch.Tensor) and isinstance(moments["exp_avg_sq"], torch.Tensor)
    assert isinstance(sk["state_dict"]["weight"], torch.Tensor)


def test_pointer_files_delete_a_step_once_no_file_names_it(tmp_path):
    files, stores = frameworks.Files(), {}

    def open_store(url):
        return stores.setdefault(url, CheckpointStore(url, profile="portable"))

    deleted = []
    pf = frameworks.PointerFiles(files, open_store, on_delete=lambda url, step: deleted.append(step))
    d = tmp_path / "ckpts"
    d.mkdir()
    url, ref = pf.location(str(d / "a.ckpt"))
    assert (url, ref) == (str(d / ".s4w"), ".s4w")
    st = open_store(url)
    for step in (1, 2):
        st.save({"w": torch.full((4,), float(step))}, step=step)
    pf.write(str(d / "top.ckpt"), 1)
    pf.write(str(d / "last.ckpt"), 1)
    assert pf.newest(str(d)) == str(d / "last.ckpt")  # same step: "last" preferred
    pf.write(str(d / "last.ckpt"), 2)  # overwritten: step 1 is still named by top.ckpt
    assert st.steps() == [1, 2] and deleted == [] and pf.newest(str(d)) == str(d / "last.ckpt")
    pf.remove(str(d / "top.ckpt"))  # the last file naming step 1
    assert st.steps() == [2] and deleted == [1] and not (d / "top.ckpt").exists()
    # a pointer naming a store outside its folder is never followed into it
    other = tmp_path / "elsewhere"
    other.mkdir()
    files.write(str(other / "x.ckpt"), pointer.encode(".s4w", 2))
    assert pf.own_store(str(other / "x.ckpt"), files.pointer_at(str(other / "x.ckpt"))) == str(other / ".s4w")
    files.write(str(d / "evil.ckpt"), pointer.encode("../elsewhere/.s4w", 2))
    pf.remove(str(d / "evil.ckpt"))
    assert st.steps() == [2] and deleted == [1]
    assert pf.newest(str(tmp_path / "empty")) is None

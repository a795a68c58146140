"""Lightning checkpoints as pointer files: store steps are global steps, a second name of a step
writes no store data, removals only delete, pointers stay inside their store, tools follow them."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import weakref

import pytest
import torch

from tests.integrations._util import diff

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

import s4w_core  # noqa: E402
import s4w_lightning  # noqa: E402
from s4w_core import pointer  # noqa: E402
from s4w_core.cli import main as s4w_main  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_lightning import S4CheckpointIO  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "integrations")]))
BATCHES = 4


class Tiny(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 0.01, width: int = 32):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def _data(n: int = BATCHES, width: int = 32) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * n, width, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _files(d) -> dict[str, tuple[int, int, int]]:
    """Every file under ``d``: (inode, mtime_ns, size), to tell written files from kept ones."""
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            st = os.stat(os.path.join(root, n))
            out[os.path.relpath(os.path.join(root, n), d)] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


class Audit(S4CheckpointIO):
    """Records every dict Lightning hands over, and the store calls each of its calls makes."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.saved: dict[str, dict] = {}
        self.calls: list[tuple[str, str, int | None, list]] = []  # (what, path, global step, store calls)
        self.log: list[tuple] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        import copy

        self.saved[os.fspath(path)] = copy.deepcopy(checkpoint)
        del self.log[:]
        super().save_checkpoint(checkpoint, path)
        self.calls.append(("save", os.fspath(path), checkpoint["global_step"], list(self.log)))

    def remove_checkpoint(self, path):
        del self.log[:]
        super().remove_checkpoint(path)
        self.calls.append(("remove", os.fspath(path), None, list(self.log)))


@pytest.fixture
def store_calls(monkeypatch):
    """Route every CheckpointStore save/save_async/delete through a recorder (the real ones run)."""
    sinks: list[list] = []

    def spy(name):
        real = getattr(CheckpointStore, name)

        def call(self, *a, **kw):
            for sink in sinks:
                sink.append((name, a[1] if name != "delete" else a[0], kw))
            return real(self, *a, **kw)

        monkeypatch.setattr(CheckpointStore, name, call)

    for name in ("save", "save_async", "delete"):
        spy(name)
    return sinks


def _fit(root, steps, plugin, ckpt_path=None, precision="32-true", width=32, **ck):
    pl.seed_everything(0)
    ck = {"save_top_k": 2, "monitor": "train_loss", "save_last": True, "every_n_train_steps": 1, **ck}
    trainer = pl.Trainer(
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=precision,
        default_root_dir=str(root),
        plugins=[plugin] if plugin is not None else None,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ck"), **ck)],
    )
    model = Tiny(hidden=64 if width == 32 else 512, width=width)
    trainer.fit(model, _data(width=width), ckpt_path=ckpt_path)
    return trainer, model


def test_second_names_and_removals_write_no_store_data(tmp_path, store_calls):
    """A save of a global step already stored (last.ckpt after the top-k file) only writes a
    pointer; overwriting last.ckpt and top-k removal never re-save or re-code stored steps: a step
    is deleted (without rebase) once no file names it."""
    io_ = Audit()
    store_calls.append(io_.log)
    _fit(tmp_path, 10, io_)
    ck = tmp_path / "ck"
    stored: set[int] = set()
    second = removes = 0
    for what, path, step, calls in io_.calls:
        writes = [c[:2] for c in calls if c[0] != "delete"]  # deletes: the step an overwritten name named
        if what == "save" and step in stored:
            assert writes == [], (path, step, calls)  # a pointer, nothing else
            second += 1
        elif what == "save":
            assert writes == [("save", step)], (path, step, calls)
            stored.add(step)
        else:
            assert writes == [], (path, calls)
            removes += 1
        for name, _s, kw in calls:
            assert name != "delete" or not kw.get("rebase"), calls  # never re-codes kept steps
    deleted = {s for *_, calls in io_.calls for name, s, _ in calls if name == "delete"}
    assert second >= 5 and removes >= 3 and deleted, io_.calls
    # store steps are the global steps the kept files name, and nothing else
    kept = sorted(n for n in os.listdir(ck) if n.endswith(".ckpt"))
    assert len(kept) == 3 and "last.ckpt" in kept
    named = {pointer.read(ck / n).step for n in kept}
    assert set(CheckpointStore(str(ck / ".s4w")).steps()) == named == stored - deleted
    for n in kept:  # each name loads back to exactly the dict Lightning handed over for it
        assert not diff(S4CheckpointIO().load_checkpoint(ck / n), io_.saved[str(ck / n)]), n
    assert s4w_lightning.last_checkpoint(ck) == str(ck / "last.ckpt")


def test_second_name_and_remove_touch_no_stored_file(tmp_path):
    """The same at the file level: the second name of a step and a remove whose step another
    file still names leave every file of the store as it was."""
    io_ = S4CheckpointIO()
    w = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w.mul_(0.5)  # trained: written in place, like parameters and optimizer state
    ck = {"state_dict": {"w": w}, "global_step": 7, "epoch": 0, "callbacks": {"best": "a"}}
    io_.save_checkpoint(ck, tmp_path / "epoch=0-step=7.ckpt")
    st = io_.store_for(tmp_path / "last.ckpt")
    st.wait()
    before = _files(st.url)
    io_.save_checkpoint({**ck, "callbacks": {"best": "b"}}, tmp_path / "last.ckpt")
    io_.remove_checkpoint(tmp_path / "epoch=0-step=7.ckpt")
    st.wait()
    assert _files(st.url) == before and st.steps() == [7]
    got = io_.load_checkpoint(tmp_path / "last.ckpt")
    assert got["callbacks"] == {"best": "b"} and torch.equal(got["state_dict"]["w"].view(torch.int16), w.view(torch.int16))
    assert len((tmp_path / "last.ckpt").read_bytes()) < 4096  # a pointer, not the tensor
    # a copy of a kept tensor: compared bit for bit, shared
    io_.save_checkpoint({**ck, "state_dict": {"w": w.clone()}}, tmp_path / "a.ckpt")
    assert len((tmp_path / "a.ckpt").read_bytes()) < 4096
    for n in ("a.ckpt", "last.ckpt"):  # the last name goes: the step goes
        assert st.steps() == [7]
        io_.remove_checkpoint(tmp_path / n)
    # fresh copies (what AsyncCheckpointIO hands over) are not held between saves, only
    # fingerprinted: a further name of their step with the same bits is a pointer, with other
    # bits it stores them itself; both load bit for bit
    clone = w.clone()
    gone = weakref.ref(clone)
    io_.save_checkpoint({**ck, "global_step": 8, "state_dict": {"w": clone}}, tmp_path / "c.ckpt")
    st.wait()
    del clone
    gc.collect()
    assert gone() is None, "a fresh copy was held after its save"
    io_.save_checkpoint({**ck, "global_step": 8, "state_dict": {"w": w.clone()}}, tmp_path / "d.ckpt")
    assert len((tmp_path / "d.ckpt").read_bytes()) < 4096 and st.steps() == [8]
    other = w.clone()
    other[0] += 1
    io_.save_checkpoint({**ck, "global_step": 8, "state_dict": {"w": other}}, tmp_path / "e.ckpt")
    assert len((tmp_path / "e.ckpt").read_bytes()) > 4096 and st.steps() == [8]
    assert torch.equal(io_.load_checkpoint(tmp_path / "d.ckpt")["state_dict"]["w"].view(torch.int16), w.view(torch.int16))
    assert torch.equal(io_.load_checkpoint(tmp_path / "e.ckpt")["state_dict"]["w"].view(torch.int16), other.view(torch.int16))
    io_.remove_checkpoint(tmp_path / "e.ckpt")
    io_.remove_checkpoint(tmp_path / "c.ckpt")
    io_.remove_checkpoint(tmp_path / "d.ckpt")
    assert st.steps() == [] and not (tmp_path / "last.ckpt").exists()


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_bytes_written_in_a_bf16_fit_vs_lightning_default(tmp_path):
    """save_last=True and save_top_k keeping the newest k (the framework benchmark's setting):
    Lightning writes two whole files per save; we write one step per global step (whole, the step
    below it re-coded as a delta where that pays) and a pointer for the second name, and removing
    the oldest kept checkpoint rewrites nothing (issue target: <= 0.6x).  (Top-k by a loss removes
    middle steps, whose delta below is then re-coded: not covered by this target.)"""
    newest = {"monitor": "step", "mode": "max"}
    w0 = _wchar()
    _fit(tmp_path / "torch", 12, None, precision="bf16-true", width=256, **newest)  # 132k parameters
    default = _wchar() - w0
    w0 = _wchar()
    _fit(tmp_path / "s4w", 12, S4CheckpointIO(), precision="bf16-true", width=256, **newest)
    ours = _wchar() - w0
    print(f"bytes written: Lightning default {default:,} B, s4weights {ours:,} B ({ours / default:.2f}x)")
    assert ours <= 0.6 * default, (ours, default)


def test_torch_load_and_load_from_checkpoint_say_how_in_one_line(tmp_path):
    t, m = _fit(tmp_path, 4, S4CheckpointIO())
    last = tmp_path / "ck" / "last.ckpt"
    want = ("s4w_lightning.load_from_checkpoint", "s4w restore last.ckpt --out plain.ckpt")
    for call in (
        lambda: torch.load(last),
        lambda: torch.load(last, weights_only=False),
        lambda: Tiny.load_from_checkpoint(last),
    ):
        with pytest.raises(RuntimeError) as e:
            call()
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in want), str(e.value)
    # what a user sees: the last line of the traceback says it all
    code = f"import torch; torch.load({str(last)!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 1 and all(w in out.stderr.strip().splitlines()[-1] for w in want), out.stderr
    # the two routes it names work
    m2 = s4w_lightning.load_from_checkpoint(Tiny, last)
    assert not diff(m2.state_dict(), m.state_dict())
    plain = tmp_path / "plain.ckpt"
    assert s4w_main(["restore", str(last), "--out", str(plain)]) == 0
    m3 = Tiny.load_from_checkpoint(plain)
    assert not diff(m3.state_dict(), m.state_dict())
    assert torch.load(plain, weights_only=True)["global_step"] == 4


def test_cli_restore_info_verify_follow_the_pointer(tmp_path, capsys):
    io_ = Audit()
    _fit(tmp_path, 6, io_)
    ck = tmp_path / "ck"
    last = ck / "last.ckpt"
    step = pointer.read(last).step
    assert step == 6
    # by global step from the store, and by the file Lightning shows
    assert s4w_main(["restore", str(ck / ".s4w"), "--step", "6", "--out", str(tmp_path / "a.pt")]) == 0
    assert s4w_main(["restore", str(last), "--out", str(tmp_path / "b.pt")]) == 0
    assert not diff(torch.load(tmp_path / "b.pt", weights_only=True), io_.saved[str(last)])
    capsys.readouterr()
    assert s4w_main(["info", str(last)]) == 0
    out = capsys.readouterr().out
    assert "step 6" in out and " 0 tensors" not in out
    n = s4w_core.CheckpointStore(str(ck / ".s4w")).container_info(6)["tensors"]
    assert n > 4 and f"{n} tensors" in out
    assert s4w_main(["verify", str(last)]) == 0
    # the step's data goes missing: verify fails (exit 1), naming what is missing
    st = CheckpointStore(str(ck / ".s4w"))
    for obj in st.info(6).objects:
        os.remove(os.path.join(st.url, obj))
    capsys.readouterr()
    assert s4w_main(["verify", str(last)]) == 1
    err = capsys.readouterr().err
    assert "FAIL" in err and "last.ckpt" in err
    # a pointer to a step the store does not hold: exit 1, saying the step's data was deleted
    _evil(ck / "gone.ckpt", ".s4w", 999)
    assert s4w_main(["verify", str(ck / "gone.ckpt")]) == 1
    assert "does not hold it" in capsys.readouterr().err


def test_pointer_copied_without_its_store(tmp_path, capsys):
    _fit(tmp_path / "run", 4, S4CheckpointIO())
    away = tmp_path / "away"
    away.mkdir()
    shutil.copy(tmp_path / "run" / "ck" / "last.ckpt", away / "last.ckpt")
    with pytest.raises(s4w_core.CheckpointNotFoundError, match=r"copy the \.s4w/ folder"):
        S4CheckpointIO().load_checkpoint(away / "last.ckpt")
    with pytest.raises(s4w_core.CheckpointNotFoundError, match=r"copy the \.s4w/ folder"):
        s4w_lightning.load_from_checkpoint(Tiny, away / "last.ckpt")
    assert s4w_main(["restore", str(away / "last.ckpt"), "--out", str(away / "x.pt")]) == 1  # bad input: one line, exit 1 (2 is a usage error)
    assert "copy the .s4w/ folder" in capsys.readouterr().err
    assert s4w_main(["verify", str(away / "last.ckpt")]) == 1
    assert s4w_lightning.last_checkpoint(away) is None
    assert sorted(os.listdir(away)) == ["last.ckpt"]  # nothing created


def _evil(path, store: str, step: int) -> None:
    pointer.write(path, pointer.encode(store, step, name=os.path.basename(path)))


def test_pointers_cannot_reach_another_store(tmp_path, capsys):
    other = tmp_path / "B" / "ck"
    _fit(tmp_path / "B", 4, S4CheckpointIO(), save_top_k=-1)
    b_store = other / ".s4w"
    b_steps = CheckpointStore(str(b_store)).steps()
    b_files = _files(b_store)
    mine = tmp_path / "A" / "ck"
    mine.mkdir(parents=True)
    link = tmp_path / "C" / "ck"
    link.mkdir(parents=True)
    os.symlink(b_store, link / ".s4w")  # a store "beside it" that is really B's
    cases = {
        "absolute": (mine / "abs.ckpt", str(b_store)),
        "dotdot": (mine / "up.ckpt", "../../B/ck/.s4w"),
        "url": (mine / "url.ckpt", f"file://{b_store}"),
        "symlink": (link / "link.ckpt", ".s4w"),
    }
    for why, (p, ref) in cases.items():
        _evil(p, ref, b_steps[-1])
        with pytest.raises(pointer.PointerError, match="may only name its own store"):
            S4CheckpointIO().load_checkpoint(p)
        with pytest.raises(pointer.PointerError):
            pointer.load(p)
        capsys.readouterr()
        assert s4w_main(["restore", str(p), "--out", str(tmp_path / "x.pt")]) == 1, why
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "may only name its own store" in err, why
        assert s4w_main(["verify", str(p)]) == 1, why
        # Lightning removing the file deletes it and nothing of B's
        io_ = S4CheckpointIO()
        io_.remove_checkpoint(p)
        assert not os.path.exists(p), why
        assert CheckpointStore(str(b_store)).steps() == b_steps and _files(b_store) == b_files, why
    assert not os.path.exists(tmp_path / "x.pt")
    # the identity check: a plugin configured with B's store reads (and removes through) its own
    _evil(mine / "abs.ckpt", str(b_store), b_steps[-1])
    assert S4CheckpointIO(store=str(b_store)).load_checkpoint(mine / "abs.ckpt")["global_step"] == b_steps[-1]


def test_malformed_pointers_raise_pointer_errors(tmp_path):
    good = pointer.encode(".s4w", 3, meta={"global_step": 3}, name="x.ckpt")
    assert pointer.parse(good, "x.ckpt").step == 3
    bad = [
        good[:20],  # truncated in the message
        good[:-5],  # truncated JSON
        good.replace(b'"step": 3', b'"step": -3'),
        good.replace(b'"step": 3', b'"step": "3"'),
        good.replace(b'"version": 1', b'"version": 9'),
        good.replace(b'"step": 3', b'"step": NaN'),
        good[:18] + b"\xff\xff\xff\xff" + good[22:],  # message length beyond the cap
    ]
    for i, data in enumerate(bad):
        (tmp_path / f"{i}.ckpt").write_bytes(data)
        with pytest.raises(pointer.PointerError):
            S4CheckpointIO().load_checkpoint(tmp_path / f"{i}.ckpt")
    with pytest.raises(pointer.PointerError):
        pointer.read(tmp_path / "0.ckpt")
    (tmp_path / "plain").write_bytes(b"PK\x03\x04 not a pointer")
    assert pointer.read(tmp_path / "plain") is None
    os.makedirs(tmp_path / "d.ckpt")
    assert pointer.read(tmp_path / "d.ckpt") is None


def test_resume_from_a_second_name_is_bit_exact_at_an_epoch_boundary(tmp_path):
    """last.ckpt at the end of epoch 1 is the second name of its step (a pointer with the
    callback's own state): resuming from it equals the run that never stopped."""
    ref = _fit(tmp_path / "ref", 3 * BATCHES, None)
    _fit(tmp_path / "a", 2 * BATCHES, S4CheckpointIO(), save_top_k=-1, monitor=None)
    last = tmp_path / "a" / "ck" / "last.ckpt"
    ptr = pointer.read(last)
    assert ptr.step == 2 * BATCHES and ptr.payload is not None  # the top-k file stored the step
    b = _fit(tmp_path / "b", 3 * BATCHES, S4CheckpointIO(), ckpt_path=str(last))
    for (t1, m1), (t2, m2) in [(ref, b)]:
        assert not diff(m1.state_dict(), m2.state_dict())
        assert not diff(t1.optimizers[0].state_dict(), t2.optimizers[0].state_dict())


def test_pointers_written_before_pointer_files_still_load(tmp_path):
    """A run checkpointed before pointer files: its .ckpt is a container {s4w_lightning_pointer:
    {store, step}}; it loads, and the same confinement applies."""
    st = CheckpointStore(str(tmp_path / ".s4w"))
    st.save({"state_dict": {"w": torch.arange(6.0)}, "global_step": 3}, 11)
    s4w_core.save({"s4w_lightning_pointer": {"version": 1, "store": ".s4w", "step": 11}}, str(tmp_path / "old.ckpt"))
    assert S4CheckpointIO().load_checkpoint(tmp_path / "old.ckpt")["state_dict"]["w"].tolist() == list(range(6))
    s4w_core.save({"s4w_lightning_pointer": {"version": 1, "store": "../x/.s4w", "step": 11}}, str(tmp_path / "bad.ckpt"))
    with pytest.raises(pointer.PointerError):
        S4CheckpointIO().load_checkpoint(tmp_path / "bad.ckpt")


def test_shared_store_keeps_a_step_another_folder_still_names(tmp_path):
    """Two ModelCheckpoint folders, one configured store: removing one folder's file keeps the step
    the other folder's file names."""
    io_ = S4CheckpointIO(store=str(tmp_path / "store"))
    w = torch.arange(64, dtype=torch.float32)
    w.add_(1)
    ck = {"state_dict": {"w": w}, "global_step": 5, "epoch": 0}
    io_.save_checkpoint(ck, tmp_path / "a" / "x.ckpt")
    io_.save_checkpoint(ck, tmp_path / "b" / "y.ckpt")
    io_.remove_checkpoint(tmp_path / "a" / "x.ckpt")
    assert CheckpointStore(str(tmp_path / "store")).steps() == [5]
    assert torch.equal(io_.load_checkpoint(tmp_path / "b" / "y.ckpt")["state_dict"]["w"], w)
    io_.remove_checkpoint(tmp_path / "b" / "y.ckpt")
    assert CheckpointStore(str(tmp_path / "store")).steps() == []


def _tensor_leaves(obj, path=""):
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _tensor_leaves(v, f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _tensor_leaves(v, f"{path}/{i}")]
    return []


@pytest.mark.gpu
def test_second_names_on_the_gpu(tmp_path):
    """On a GPU: last.ckpt after the top-k file of the same step is a small pointer; both load to
    exactly the dicts Lightning handed over; resume from last.ckpt is bit-exact."""
    io_ = Audit()
    pl.seed_everything(0)

    def trainer(root, steps, plugin):
        return pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=steps,
            precision="bf16-true",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            plugins=[plugin],
            callbacks=[pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=BATCHES,
                                                     save_top_k=-1, save_last=True)],
        )

    trainer(tmp_path / "a", 2 * BATCHES, io_).fit(Tiny(hidden=512, width=256), _data(width=256))
    ck = tmp_path / "a" / "ck"
    last = pointer.read(ck / "last.ckpt")
    assert last.step == 2 * BATCHES and last.payload is not None
    # no tensor stored again: CUDA's foreach AdamW leaves its moments at version 0, recognised
    # by their fingerprints (only Lightning's callback state and small values are in the payload)
    payload = s4w_core.load(last.payload, map_location="cpu")
    big = [k for k, t in _tensor_leaves(payload) if t.numel() > 1]
    assert not big and len(last.payload) < 64 << 10, (big[:5], len(last.payload))
    for n in ("last.ckpt", f"epoch=1-step={2 * BATCHES}.ckpt"):
        assert not diff(S4CheckpointIO().load_checkpoint(ck / n), io_.saved[str(ck / n)]), n
    pl.seed_everything(0)
    ref_t, ref_m = trainer(tmp_path / "r", 3 * BATCHES, S4CheckpointIO()), Tiny(hidden=512, width=256)
    ref_t.fit(ref_m, _data(width=256))
    pl.seed_everything(0)
    t, m = trainer(tmp_path / "b", 3 * BATCHES, S4CheckpointIO()), Tiny(hidden=512, width=256)
    t.fit(m, _data(width=256), ckpt_path=str(ck / "last.ckpt"))
    assert not diff(m.state_dict(), ref_m.state_dict())
    assert not diff(t.optimizers[0].state_dict(), ref_t.optimizers[0].state_dict())


def test_second_name_keeps_containers_it_cannot_share_from(tmp_path):
    """Tensors inside values the plugin serialises whole (here a dict with tuple keys) are stored
    with the pointer, and the container comes back as it was."""
    io_ = S4CheckpointIO()
    w = torch.arange(8.0)
    w.add_(1)
    ck = {"state_dict": {"w": w}, "global_step": 3, "extra": {(1, 2): w}}
    io_.save_checkpoint(ck, tmp_path / "a.ckpt")
    io_.save_checkpoint(ck, tmp_path / "last.ckpt")
    got = io_.load_checkpoint(tmp_path / "last.ckpt")
    assert list(got["extra"]) == [(1, 2)] and torch.equal(got["extra"][(1, 2)], w)
    assert torch.equal(got["state_dict"]["w"], w)

"""S4CheckpointIO with real Lightning Trainers (lightning and pytorch_lightning) on the CPU."""

from __future__ import annotations

import copy
import enum
import importlib
import os
import subprocess
import sys

import pytest
import torch

from tests.integrations._util import diff

pytest.importorskip("lightning")
import s4w_core  # noqa: E402
import s4w_lightning  # noqa: E402
from s4w_core import pointer  # noqa: E402
from s4w_core.store import CheckpointStore  # noqa: E402
from s4w_lightning import S4CheckpointIO  # noqa: E402

FLAVOURS = [f for f in ("lightning.pytorch", "pytorch_lightning") if importlib.util.find_spec(f.split(".")[0])]
BATCHES_PER_EPOCH = 4


def _pl(flavour: str):
    return importlib.import_module(flavour)


def _module_cls(pl):
    class Tiny(pl.LightningModule):
        def __init__(self, hidden: int = 16, lr: float = 0.05, **extra):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, i):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}

    return Tiny


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * BATCHES_PER_EPOCH, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


class Spy(S4CheckpointIO):
    """Records a deep copy of every checkpoint dict Lightning hands over, by path."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.saved: dict[str, dict] = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def _trainer(pl, root, steps, plugin, **ck):
    ck = {"save_top_k": -1, "save_last": True, "every_n_train_steps": 2, **ck}
    return pl.Trainer(
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        plugins=[plugin] if plugin is not None else None,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ck"), **ck)],
    )


def _state(trainer, model):
    return {
        "model": model.state_dict(),
        "optim": trainer.optimizers[0].state_dict(),
        "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
    }


def _fit(pl, root, steps, plugin, ckpt_path=None, seed=0, **ck):
    pl.seed_everything(seed)
    model = _module_cls(pl)()
    trainer = _trainer(pl, root, steps, plugin, **ck)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_save_resume_bit_exact(flavour, tmp_path):
    pl = _pl(flavour)
    ref_t, ref_m = _fit(pl, tmp_path / "ref", 8, None)
    spy = Spy()
    _fit(pl, tmp_path / "a", 8, spy)
    ck = tmp_path / "a" / "ck"
    names = sorted(n for n in os.listdir(ck) if n.endswith(".ckpt"))
    assert names == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=1-step=6.ckpt",
        "epoch=1-step=8.ckpt",
        "last.ckpt",
    ]
    # every file loads back to exactly the dict Lightning handed over (tensors bit for bit)
    for n in names:
        loaded = S4CheckpointIO().load_checkpoint(ck / n)
        assert not diff(loaded, spy.saved[str(ck / n)]), n
    # resume from the end of epoch 0 in a fresh process state: equals the run that never stopped
    t2, m2 = _fit(pl, tmp_path / "b", 8, S4CheckpointIO(), ckpt_path=str(ck / "epoch=0-step=4.ckpt"), seed=1)
    assert t2.global_step == 8
    assert not diff(_state(t2, m2), _state(ref_t, ref_m))
    # the newest step is whole; an older one is a delta only where that is smaller (here, 2 KB of
    # tensors under a 4 KB manifest, a delta never is: every step stays whole)
    recs = CheckpointStore(str(ck / ".s4w")).list()
    assert recs[-1].kind == "keyframe"
    assert all(r.object_bytes < 0.95 * recs[-1].object_bytes for r in recs if r.kind == "delta")


def test_mid_epoch_resume_matches_torch_checkpoint_io(tmp_path):
    """Mid-epoch resume with a plain DataLoader is Lightning's own (inexact) behaviour; ours must
    give the very same result as Lightning's TorchCheckpointIO."""
    pl = _pl(FLAVOURS[0])
    _fit(pl, tmp_path / "s4", 4, S4CheckpointIO())
    _fit(pl, tmp_path / "torch", 4, None)
    a = _fit(pl, tmp_path / "s4r", 8, S4CheckpointIO(), ckpt_path=str(tmp_path / "s4/ck/epoch=0-step=2.ckpt"), seed=3)
    b = _fit(pl, tmp_path / "tr", 8, None, ckpt_path=str(tmp_path / "torch/ck/epoch=0-step=2.ckpt"), seed=3)
    assert not diff(_state(*a), _state(*b))


@pytest.mark.parametrize("rebase", [True, False])
def test_top_k_removal_keeps_kept_deltas_loadable(tmp_path, rebase):
    pl = _pl(FLAVOURS[0])
    spy = Spy(rebase_on_delete=rebase, store_options={"keyframe_every": 100})
    _fit(pl, tmp_path, 16, spy, save_top_k=2, monitor="train_loss", every_n_train_steps=1)
    ck = tmp_path / "ck"
    kept = sorted(n for n in os.listdir(ck) if n.endswith(".ckpt"))
    assert len(kept) == 3 and "last.ckpt" in kept  # top-2 + last
    st = CheckpointStore(str(ck / ".s4w"))
    infos = st.list()
    assert len(infos) == 3, [i.extra["path"] for i in infos]  # removed checkpoints left the store too
    sizes = st.sizes()
    # removed checkpoints' data is gone at once, with or without rebase: a kept delta on a removed
    # step was re-coded against the next step up
    assert sizes["base_only_bytes"] == 0 and sizes["unreferenced_bytes"] == 0
    for n in kept:
        assert not diff(S4CheckpointIO().load_checkpoint(ck / n), spy.saved[str(ck / n)]), n
    assert s4w_lightning.last_checkpoint(ck) == str(ck / "last.ckpt")


@pytest.mark.parametrize("monitor", ["step", "train_loss"])
def test_a_rotation_by_step_holds_the_reencodings_it_would_discard(tmp_path, monitor):
    """ModelCheckpoint keeping the newest two (monitor="step", mode="max"): each save's step two
    below is removed after the next save, so the plugin announces it (expect_drop, then
    drop_pending before that save): no re-encoding reads a step that goes; the one left below the
    last save is re-encoded at the end (teardown). With a metric monitor nothing can be
    foreseen: re-encodings run behind the saves as before. Every kept file loads bit for bit."""
    from s4w_core import obs

    pl = _pl(FLAVOURS[0])
    spy = Spy(store_options={"profile": "portable"})
    events: list = []
    obs.subscribe(events.append)
    try:
        _fit(pl, tmp_path, 12, spy, save_top_k=2, monitor=monitor, mode="max" if monitor == "step" else "min")
    finally:
        obs.unsubscribe(events.append)
    ck = tmp_path / "ck"
    url = CheckpointStore(str(ck / ".s4w")).backend.url
    re = [(e.step, e.extra["outcome"], "read" in e.stages) for e in events if e.op == "reencode" and e.url == url]
    if monitor == "step":
        # the last one runs (this tiny model's delta may not pay: then the step stays whole, "skipped")
        assert re[:4] == [(2, "cancelled", False), (4, "cancelled", False), (6, "cancelled", False),
                          (8, "cancelled", False)], re  # fmt: skip
        assert len(re) == 5 and re[4][0] == 10 and re[4][1] in ("written", "skipped") and re[4][2], re
        assert sorted(n for n in os.listdir(ck) if n.endswith(".ckpt")) == [
            "epoch=2-step=10.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]  # fmt: skip
    else:
        assert any(read for _, _, read in re[:-1]), re  # (the checks above can fail)
    kept = sorted(n for n in os.listdir(ck) if n.endswith(".ckpt"))
    for n in kept:
        assert not diff(S4CheckpointIO().load_checkpoint(ck / n), spy.saved[str(ck / n)]), n


def test_lightnings_async_checkpoint_io_rotates_out_what_it_removes(tmp_path):
    """Lightning's AsyncCheckpointIO saves on its own thread and calls remove_checkpoint on the
    trainer's, so a remove can come while the save of that path is still queued (here every save
    is slowed): the removed files and store steps go all the same, a queued save of a removed path
    writes nothing, and what stays loads bit for bit."""
    import threading
    import time

    pl = _pl(FLAVOURS[0])
    saves: list[str] = []

    class Slow(Spy):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            assert threading.current_thread() is not threading.main_thread()
            time.sleep(0.3)
            saves.append(os.path.basename(os.fspath(path)))
            super().save_checkpoint(checkpoint, path, storage_options)

    spy = Slow(store_options={"profile": "portable"})
    _fit(pl, tmp_path, 8, pl.plugins.io.AsyncCheckpointIO(spy), save_top_k=2, monitor="step", mode="max")
    spy.wait()
    ck = tmp_path / "ck"
    kept = sorted(n for n in os.listdir(ck) if n.endswith(".ckpt"))
    assert kept == ["epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], (kept, saves)
    assert CheckpointStore(str(ck / ".s4w")).steps() == [6, 8]
    for n in kept:
        assert not diff(S4CheckpointIO().load_checkpoint(ck / n), spy.saved[str(ck / n)]), n


@pytest.mark.parametrize("mode", ["own_async", "lightning_async", "inline"])
def test_async_and_inline_resume_bit_exact(mode, tmp_path):
    pl = _pl(FLAVOURS[0])
    if mode == "own_async":
        plugin = S4CheckpointIO(async_save=True)
    elif mode == "lightning_async":
        plugin = pl.plugins.io.AsyncCheckpointIO(S4CheckpointIO())
    else:
        plugin = S4CheckpointIO(delta=False)
    ref = _fit(pl, tmp_path / "ref", 8, None)
    _fit(pl, tmp_path / "a", 4, plugin)
    if mode == "inline":
        assert not os.path.exists(tmp_path / "a" / "ck" / ".s4w")
        assert s4w_core.info(str(tmp_path / "a" / "ck" / "last.ckpt"))["tensors"] > 4
    b = _fit(
        pl,
        tmp_path / "b",
        8,
        S4CheckpointIO(delta=mode != "inline"),
        ckpt_path=str(tmp_path / "a/ck/last.ckpt"),
        seed=5,
    )
    assert not diff(_state(*b), _state(*ref))


class Color(enum.Enum):
    RED = 1


class Opaque:
    pass


def test_hyperparameters_with_objects(tmp_path):
    pl = _pl(FLAVOURS[0])
    io_ = S4CheckpointIO()
    ck = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"color": Color.RED, "n": 3}}
    torch.serialization.add_safe_globals([Color])
    try:
        io_.save_checkpoint(ck, tmp_path / "a.ckpt")
        out = io_.load_checkpoint(tmp_path / "a.ckpt")
        assert out["hyper_parameters"] == {"color": Color.RED, "n": 3}
    finally:
        torch.serialization.clear_safe_globals()
    with pytest.raises(s4w_core.UnsupportedTypeError, match="add_safe_globals"):
        io_.save_checkpoint({"hyper_parameters": {"thing": Opaque()}}, tmp_path / "b.ckpt")
    assert not os.path.exists(tmp_path / "b.ckpt")
    del pl


def test_load_from_checkpoint_and_torch_fallback(tmp_path):
    pl = _pl(FLAVOURS[0])
    t, m = _fit(pl, tmp_path / "a", 4, S4CheckpointIO())
    Tiny = _module_cls(pl)
    m2 = s4w_lightning.load_from_checkpoint(Tiny, tmp_path / "a/ck/last.ckpt", lr=0.5)
    assert m2.hparams.lr == 0.5 and m2.hparams.hidden == 16
    assert not diff(m2.state_dict(), m.state_dict())
    # a checkpoint written by Lightning's own TorchCheckpointIO still loads through the plugin
    _fit(pl, tmp_path / "t", 4, None)
    plain = S4CheckpointIO().load_checkpoint(tmp_path / "t/ck/last.ckpt")
    assert plain["global_step"] == 4


def test_missing_extra_fails_with_install_hint():
    code = (
        "import sys; sys.modules['lightning'] = None; sys.modules['pytorch_lightning'] = None\n"
        "try:\n    import s4w_lightning\nexcept ImportError as e:\n    print(e)\n"
    )
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "integrations")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "pip install 's4weights[lightning]'" in out.stdout, out.stdout + out.stderr


@pytest.mark.s3
def test_s3_store_and_s3_paths(s3_url, tmp_path):
    pl = _pl(FLAVOURS[0])
    ref = _fit(pl, tmp_path / "ref", 8, None)
    # local dirpath, data in an S3 store
    spy = Spy(store=f"{s3_url}/store")
    _fit(pl, tmp_path / "a", 4, spy)
    ck = tmp_path / "a" / "ck"
    assert not os.path.exists(ck / ".s4w")
    for n in ("epoch=0-step=2.ckpt", "last.ckpt"):
        assert not diff(S4CheckpointIO(store=f"{s3_url}/store").load_checkpoint(ck / n), spy.saved[str(ck / n)])
    b = _fit(pl, tmp_path / "b", 8, S4CheckpointIO(store=f"{s3_url}/store"), ckpt_path=str(ck / "last.ckpt"), seed=2)
    assert not diff(_state(*b), _state(*ref))
    # a plugin not configured with that store does not follow a pointer to it
    with pytest.raises(pointer.PointerError, match="may only name its own store"):
        S4CheckpointIO().load_checkpoint(ck / "last.ckpt")
    # s3:// checkpoint paths (what Lightning passes for an s3:// dirpath): pointer objects at exactly
    # those keys, the store beside them; last_checkpoint() does what ckpt_path="last" cannot on S3
    io_ = S4CheckpointIO()
    d = f"{s3_url}/run/checkpoints"
    for name in ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"):
        io_.save_checkpoint(spy.saved[str(ck / name)], f"{d}/{name}")
    io_.remove_checkpoint(f"{d}/epoch=0-step=2.ckpt")
    assert s4w_lightning.last_checkpoint(d) == f"{d}/last.ckpt"
    c = _fit(pl, tmp_path / "c", 8, S4CheckpointIO(), ckpt_path=f"{d}/last.ckpt", seed=3)
    assert not diff(_state(*c), _state(*ref))
    with pytest.raises(s4w_core.CheckpointNotFoundError):
        io_.load_checkpoint(f"{d}/epoch=0-step=2.ckpt")


def test_own_async_save_goes_through_the_store_non_blocking(tmp_path):
    """async_save=True with deltas: CheckpointStore.save_async (the caller may change the state as
    soon as save_checkpoint returns), pointers written in order, removes after saves, each path
    loads the bits it was saved with."""
    io_ = S4CheckpointIO(async_save=True)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(50_000, generator=g).to(torch.bfloat16)
    saved = {}
    for i in range(4):
        path = tmp_path / f"epoch={i}.ckpt"
        ck = {"state_dict": {"w": w}, "global_step": 10 * i, "epoch": i}
        io_.save_checkpoint(ck, path)
        saved[path] = w.clone()
        w.add_(torch.randn(50_000, generator=g).to(torch.bfloat16) * 1e-3)  # right after the call
        if i == 2:
            io_.remove_checkpoint(tmp_path / "epoch=0.ckpt")
    io_.teardown()
    st = io_.store_for(tmp_path / "epoch=1.ckpt")
    assert st.steps() == [10, 20, 30] and "delta" in {r.kind for r in st.list()}  # store steps: global steps
    # the newest step is whole; teardown waited for the step below it to become a delta against it
    assert st.info(30).kind == "keyframe" and st.info(20).kind == "delta" and st.info(20).base_step == 30
    assert not (tmp_path / "epoch=0.ckpt").exists()
    for path, want in saved.items():
        if path.exists():
            got = io_.load_checkpoint(path)["state_dict"]["w"]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), path
    assert io_.last_info.step == 30

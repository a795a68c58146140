"""The store subcommands of `s4w` (ls, info --step, restore, stats --plot, rm, gc, pin)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from s4w_core.cli import main
from s4w_core.store import CheckpointStore

from .helpers import bits_equal, make_run


@pytest.fixture
def filled(store_url: str) -> tuple[str, list]:
    run = make_run(4)
    st = CheckpointStore(store_url, keyframe_every=3, profile="portable")
    for i, s in enumerate(run):
        st.save(s, 10 * i)
    st.save({"a": torch.ones(3), "b": torch.arange(4.0).to(torch.bfloat16)}, 100)
    st.close()
    return store_url, run


def test_ls_and_json(filled, capsys) -> None:  # type: ignore[no-untyped-def]
    url, _ = filled
    assert main(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "5 committed steps" in out and "keyframe" in out and "delta" in out and "total:" in out
    assert main(["ls", url, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in d["steps"]] == [0, 10, 20, 30, 100]
    assert d["steps"][1]["kind"] == "delta" and d["steps"][1]["base_step"] == 20  # against the next step


def test_info_with_step(filled, capsys) -> None:  # type: ignore[no-untyped-def]
    url, _ = filled
    assert main(["info", url, "--step", "0"]) == 0
    out = capsys.readouterr().out
    assert "step 0: delta (depth 2, base step 10)" in out and "restoring from the chain reads 3 objects" in out
    assert main(["info", url, "--step", "0", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["step"]["step"] == 0 and d["container"]["delta_storages"] > 0
    assert main(["info", url, "--step", "21"]) == 1
    assert "no committed step 21" in capsys.readouterr().err


def test_info_on_a_file_still_works(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import s4w_core

    p = str(tmp_path / "x.s4w")
    s4w_core.save({"x": torch.ones(4)}, p)
    assert main(["info", p]) == 0
    assert "1 tensors" in capsys.readouterr().out


def test_restore_torch_safetensors_s4w(filled, tmp_path) -> None:  # type: ignore[no-untyped-def]
    url, run = filled
    out = str(tmp_path / "r.pt")
    assert main(["restore", url, "--step", "20", "--out", out, "--quiet"]) == 0
    assert bits_equal(torch.load(out, weights_only=False), run[2])
    st_out = str(tmp_path / "r.safetensors")
    assert main(["restore", url, "--out", st_out, "--quiet"]) == 0  # latest = flat dict
    from safetensors.torch import load_file

    got = load_file(st_out)
    assert torch.equal(got["a"], torch.ones(3)) and got["b"].dtype == torch.bfloat16
    assert main(["restore", url, "--step", "20", "--out", str(tmp_path / "bad.safetensors"), "--quiet"]) == 1
    s4 = str(tmp_path / "r.s4w")
    assert main(["restore", url, "--step", "10", "--out", s4, "--quiet"]) == 0
    import s4w_core

    assert bits_equal(s4w_core.load(s4), run[1])


def test_stats_table_and_plot(filled, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    url, _ = filled
    png = str(tmp_path / "s.png")
    assert main(["stats", url, "--plot", png]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "exp_avg_sq" in out and "all" in out
    assert os.path.getsize(png) > 10000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert main(["stats", url, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["totals"]["steps"] == 5 and "weights" in d["steps"][0]["groups"]


def test_rm_pin_gc_verify(filled, capsys) -> None:  # type: ignore[no-untyped-def]
    url, run = filled
    assert main(["pin", url, "--step", "0"]) == 0
    assert main(["rm", url, "--step", "10", "--rebase"]) == 0
    assert main(["gc", url, "--grace", "0"]) == 0
    assert main(["verify", url, "--step", "20"]) == 0
    st = CheckpointStore(url)
    assert st.steps() == [0, 20, 30, 100] and st.info(0).pinned
    assert bits_equal(st.load(20), run[2])
    assert main(["verify", url]) == 0


def test_rm_frees_the_data_before_it_returns(filled, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`s4w rm` of the oldest step (no re-coding): its data object, removed behind the store's delete
    (here made slow), is gone when the command returns."""
    import time

    from s4w_core.store import core
    from s4w_core.store.records import DATA

    slow = core.delete_quietly

    def later(dead):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        slow(dead)

    monkeypatch.setattr(core, "delete_quietly", later)
    url, run = filled
    st = CheckpointStore(url)
    old = st.info(0).object
    st.close()
    assert main(["rm", url, "--step", "0"]) == 0
    st = CheckpointStore(url)
    assert st.steps() == [10, 20, 30, 100]
    assert old not in {o.key for o in st.backend.list(DATA)}
    assert bits_equal(st.load(10), run[1])


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err.strip()


def test_restore_creates_missing_folders_with_open_modes(filled, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--out under folders that do not exist: created, as s4w_core.save does; the file gets the
    mode open() gives (0644 under umask 022) and no temporary stays behind."""
    url, run = filled
    for name in ("r.pt", "r.s4w"):
        out = tmp_path / "no" / "such" / name
        assert main(["restore", url, "--step", "20", "--out", str(out), "--quiet"]) == 0
        old = os.umask(0)
        os.umask(old)
        assert out.stat().st_mode & 0o777 == 0o666 & ~old
    assert bits_equal(torch.load(tmp_path / "no" / "such" / "r.pt", weights_only=False), run[2])
    assert sorted(os.listdir(tmp_path / "no" / "such")) == ["r.pt", "r.s4w"]


def test_restore_a_huge_broadcast_view(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A stride-0 view of shape [2**40] (4 bytes of storage): as safetensors it would take 4 TiB,
    so one line says so and points at the torch format, which keeps the view as it is."""
    url = str(tmp_path / "store")
    st = CheckpointStore(url)
    st.save({"big": torch.zeros(1).expand(2**40), "w": torch.ones(3)}, 1)
    st.close()
    out = tmp_path / "x.safetensors"
    assert main(["restore", url, "--out", str(out), "--quiet"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "'big'" in line and "4.0 TiB" in line and "--format torch" in line and not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert main(["restore", url, "--out", str(tmp_path / "x.pt"), "--quiet"]) == 0
    got = torch.load(tmp_path / "x.pt", weights_only=True)
    assert got["big"].shape == (2**40,) and got["big"].stride() == (0,)


def test_stats_plot_without_matplotlib_says_so_before_the_table(filled, tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    url, _ = filled
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    assert main(["stats", url, "--plot", str(tmp_path / "s.png")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "s4weights[plot]" in _one_line(err)


def test_plot_extra_is_declared() -> None:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(r.startswith("matplotlib") for r in extras["plot"])


def test_verify_a_delta_object_inside_its_store(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`s4w verify STORE/data/<delta object>`: verified with its chain through the store (no FAIL,
    no BaseMismatchError); the same bytes outside any store: one line saying how to verify it."""
    url = str(tmp_path / "store")
    run = make_run(3)
    st = CheckpointStore(url)
    for i, s in enumerate(run):
        st.save(s, i + 1)
    st.close()  # waits for step 2 to become a delta against step 3 (the newest step is whole)
    rec = st.info(2)
    assert rec.kind == "delta"
    obj = os.path.join(url, *rec.object.split("/"))
    assert main(["verify", obj, "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("OK ") and "step 2 of the store" in out and err == ""
    alone = tmp_path / "alone.s4w"
    alone.write_bytes(open(obj, "rb").read())
    assert main(["verify", str(alone), "--no-progress"]) == 1
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert out == "" and "FAIL" not in line and "BaseMismatchError" not in line and "through its store" in line

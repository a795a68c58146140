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
    assert main(["info", url, "--step", "21"]) == 2
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
    assert main(["restore", url, "--step", "20", "--out", str(tmp_path / "bad.safetensors"), "--quiet"]) == 2
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

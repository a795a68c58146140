"""Observability (s4w_core.obs): the JSON log line of real saves and loads, subscribers, failures
recorded and re-raised unchanged, the /metrics and /healthz endpoint over real HTTP, DCP events."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import s4w_core
from s4w_core import obs, pipeline
from s4w_core.store import CheckpointStore

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"op", "url", "step", "raw_bytes", "stored_bytes", "blocked_s", "total_s", "stages", "kind", "mode",
          "host_bytes", "ok", "error", "rank", "ratio", "GBps", "ts"}


@pytest.fixture
def events(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[obs.OpEvent]]:
    """Fresh metrics, INFO lines of s4w_core.ops captured, and every event recorded."""
    monkeypatch.delenv("S4W_LOG_FORMAT", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    obs.reset()
    caplog.set_level(logging.INFO, logger=obs.LOGGER_NAME)
    got: list[obs.OpEvent] = []
    obs.subscribe(got.append)
    yield got
    obs.unsubscribe(got.append)
    obs.reset()


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == obs.LOGGER_NAME]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": (torch.randn(4096, 16, generator=g) * 0.02).to(torch.bfloat16), "b": torch.randn(300, generator=g)}


def _check_line(d: dict[str, Any], op: str) -> None:
    assert FIELDS <= set(d), FIELDS - set(d)
    assert d["op"] == op and d["ok"] is True and d["error"] is None and d["rank"] == 0
    assert d["raw_bytes"] > 0 and d["stored_bytes"] > 0
    assert d["ratio"] == pytest.approx(d["raw_bytes"] / d["stored_bytes"], rel=1e-3)
    assert d["blocked_s"] > 0 and d["total_s"] >= d["blocked_s"] - 1e-9
    assert d["stages"] and set(d["GBps"]) == {k for k, v in d["stages"].items() if v >= 1e-3} | {"total"}
    for stage, secs in d["stages"].items():
        if secs >= 1e-3:
            assert d["GBps"][stage] == pytest.approx(d["raw_bytes"] / 1e9 / secs, rel=0.01, abs=1e-6)
    assert d["ts"].endswith("Z")


def test_api_save_and_load_log_one_json_line_each(tmp_path: Path, events: list[obs.OpEvent], caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "c.s4w"
    rep = s4w_core.save({"model": _state(), "step": 42}, p)
    out = s4w_core.load(p)
    assert torch.equal(out["model"]["b"], _state()["b"])
    save, load = _lines(caplog)
    _check_line(save, "save")
    _check_line(load, "load")
    assert save["url"] == load["url"] == str(p) and save["step"] == load["step"] == 42
    assert save["raw_bytes"] == rep.raw_bytes and save["stored_bytes"] == rep.file_bytes == p.stat().st_size
    assert set(save["stages"]) == {"encode", "write", "commit"} and save["mode"] == "blocking"
    assert set(load["stages"]) == {"open", "decode", "read"} and load["raw_bytes"] == rep.raw_bytes
    assert [e.op for e in events] == ["save", "load"] and events[0].rank == 0
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == obs.LOGGER_NAME)


def test_store_load_records_step_kind_and_sizes(tmp_path: Path, events: list[obs.OpEvent], caplog: pytest.LogCaptureFixture) -> None:
    st = CheckpointStore(tmp_path / "run", profile="portable")
    a = _state()
    st.save(a, step=10)
    b = {k: v.clone() for k, v in a.items()}
    b["w"][0, :8] += 1
    info = st.save(b, step=20)
    events.clear()
    caplog.clear()
    st.load(20)
    (d,) = [x for x in _lines(caplog) if x["op"] == "load"]
    _check_line(d, "load")
    assert d["step"] == 20 and d["kind"] == info.kind == "keyframe" and d["url"] == st.backend.url
    # the newest step is whole: one object read
    rec = st.info(20)
    assert d["extra"]["from"] == "chain" and d["extra"]["chain_objects"] == 1
    assert d["raw_bytes"] == info.raw_bytes and d["stored_bytes"] == rec.object_bytes
    assert {"list", "decode"} <= set(d["stages"]) and d["extra"]["depth"] == 0
    with pytest.raises(s4w_core.CheckpointNotFoundError):
        st.load(30)
    bad = events[-1]
    assert bad.op == "load" and bad.ok is False and bad.step == 30 and "CheckpointNotFoundError" in (bad.error or "")


def test_failed_save_is_recorded_and_reraised_as_a_store_error(
    tmp_path: Path, events: list[obs.OpEvent], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    boom = OSError(28, "No space left on device")

    def fail(*a: Any, **k: Any) -> Any:
        raise boom

    monkeypatch.setattr(pipeline, "encode", fail)
    with pytest.raises(s4w_core.StoreError) as exc:  # an OSError from storage: the store's error, the cause kept
        s4w_core.save({"x": torch.ones(3)}, tmp_path / "x.s4w", extra={"step": 7})
    assert isinstance(exc.value, OSError) and exc.value.__cause__ is boom and "ENOSPC" in str(exc.value)
    assert not (tmp_path / "x.s4w").exists()
    (e,) = events
    assert e.op == "save" and e.ok is False and e.step == 7 and e.error == f"StoreError: {exc.value}"
    (rec,) = [r for r in caplog.records if r.name == obs.LOGGER_NAME]
    assert rec.levelno == logging.ERROR and json.loads(rec.getMessage())["ok"] is False
    with pytest.raises(s4w_core.UnsupportedTypeError):  # a real failure, through the real encoder
        monkeypatch.undo()
        s4w_core.save({"f": lambda: 0}, tmp_path / "y.s4w")
    assert events[-1].ok is False and events[-1].error.startswith("UnsupportedTypeError")  # type: ignore[union-attr]


def test_bad_subscriber_and_broken_metrics_do_not_break_a_save(
    tmp_path: Path, events: list[obs.OpEvent], monkeypatch: pytest.MonkeyPatch
) -> None:
    def bad(e: obs.OpEvent) -> None:
        raise RuntimeError("subscriber bug")

    obs.subscribe(bad)
    try:
        s4w_core.save({"x": torch.ones(8)}, tmp_path / "a.s4w")
        assert len(events) == 1  # a later subscriber still got the event
        monkeypatch.setattr(obs._state, "update", bad)  # metrics themselves failing
        s4w_core.save({"x": torch.ones(8)}, tmp_path / "b.s4w")
        assert s4w_core.load(tmp_path / "b.s4w")["x"].sum() == 8
    finally:
        obs.unsubscribe(bad)


def test_text_format_and_derived_fields(events: list[obs.OpEvent], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S4W_LOG_FORMAT", "text")
    obs.record(obs.OpEvent("save", "s3://b/run", 5, 3_000_000_000, 1_500_000_000, 0.25, 2.0,
                           {"snapshot": 0.25, "encode": 1.0, "upload": 0.75}, kind="delta", mode="async-snapshot"))
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert msg.startswith("s4w save ok rank=0 step=5 s3://b/run") and "(2.000x)" in msg and "encode 1.000s 3 GB/s" in msg
    d = rec.s4w_event  # type: ignore[attr-defined]  # structured handlers get the dict too
    assert d["ratio"] == 2.0 and d["GBps"] == {"snapshot": 12.0, "encode": 3.0, "upload": 4.0, "total": 1.5}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_and_healthz_over_http(tmp_path: Path, events: list[obs.OpEvent], monkeypatch: pytest.MonkeyPatch) -> None:
    with obs.serve(port=0) as srv:
        assert srv.url == f"http://127.0.0.1:{srv.port}" and srv.port > 0
        s4w_core.save({"x": torch.ones(1000), "step": 3}, tmp_path / "a.s4w")
        code, body = _get(srv.url + "/metrics")
        assert code == 200
        assert 's4w_ops_total{ok="true",op="save"} 1.0' in body
        raw = events[0].raw_bytes
        assert f's4w_raw_bytes_total{{op="save"}} {float(raw)}' in body
        assert 's4w_blocked_seconds_count{op="save"} 1.0' in body and 's4w_last_step{op="save"} 3.0' in body
        code, body = _get(srv.url + "/healthz")
        h = json.loads(body)
        assert code == 200 and h["ok"] and h["last_success"]["step"] == 3 and h["saves_ok"] == 1

        def fail(*a: Any, **k: Any) -> Any:
            raise OSError("disk gone")

        monkeypatch.setattr(pipeline, "encode", fail)
        with pytest.raises(OSError):
            s4w_core.save({"x": torch.ones(4), "step": 4}, tmp_path / "b.s4w")
        code, body = _get(srv.url + "/healthz")
        h = json.loads(body)
        assert code == 503 and h["status"] == "failing" and "disk gone" in h["reason"] and h["last_error"]["step"] == 4
        assert 's4w_last_save_failed 1.0' in _get(srv.url + "/metrics")[1]
        monkeypatch.undo()
        s4w_core.save({"x": torch.ones(4), "step": 5}, tmp_path / "c.s4w")  # a good save heals it
        assert _get(srv.url + "/healthz")[0] == 200
        assert _get(srv.url + "/nope")[0] == 404
    with obs.serve(port=0, stale_after_s=0.5) as srv:
        s4w_core.save({"x": torch.ones(4), "step": 6}, tmp_path / "d.s4w")
        assert _get(srv.url + "/healthz")[0] == 200
        time.sleep(0.6)
        code, body = _get(srv.url + "/healthz")
        assert code == 503 and json.loads(body)["status"] == "stale"


def test_metrics_without_prometheus_client(events: list[obs.OpEvent], monkeypatch: pytest.MonkeyPatch) -> None:
    obs.record(obs.OpEvent("load", "x", 1, 100, 50, 0.01, 0.01, {"decode": 0.01}))
    with_lib, _ = obs.metrics_text()
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails from here on
    monkeypatch.setattr(obs, "_registry", None)
    body, ctype = obs.metrics_text()
    assert "version=0.0.4" in ctype
    assert 's4w_ops_total{op="load",ok="true"} 1.0' in body and 's4w_op_seconds_bucket{op="load",le="+Inf"} 1.0' in body
    norm = {tuple(sorted(line.split(" ")[0].replace("{", ",").replace("}", "").split(","))) for line in body.splitlines()
            if line and not line.startswith("#")}
    norm_lib = {tuple(sorted(line.split(" ")[0].replace("{", ",").replace("}", "").split(","))) for line in with_lib.splitlines()
                if line and not line.startswith("#") and "_created" not in line}
    assert norm == norm_lib  # the same series either way
    with pytest.raises(s4w_core.BackendUnavailableError, match="s4weights\\[metrics\\]"):
        obs.registry()


def test_registry_is_private_and_mergeable() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    reg = obs.registry()
    assert reg is not prometheus_client.REGISTRY and reg is obs.registry()
    assert not any(m.name.startswith("s4w_") for m in prometheus_client.REGISTRY.collect())
    mine = prometheus_client.CollectorRegistry()
    mine.register(reg)
    assert "s4w_ops" in {m.name for m in mine.collect()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_single_process_records_one_event_per_rank(tmp_path: Path, events: list[obs.OpEvent]) -> None:
    import torch.distributed.checkpoint as dcp

    from s4w_core.dcp import S4StorageReader, S4StorageWriter

    sd = {"w": torch.randn(64, 8), "n": torch.arange(10), "opt": {"lr": 0.1}}
    where = tmp_path / "step_300"
    dcp.save(sd, storage_writer=S4StorageWriter(where), no_dist=True)
    out = {"w": torch.zeros(64, 8), "n": torch.zeros(10, dtype=torch.long), "opt": {"lr": None}}
    dcp.load(out, storage_reader=S4StorageReader(where), no_dist=True)
    assert torch.equal(out["w"], sd["w"])
    save, load = events  # the rank files' own api.save / api.load events are folded in, not repeated
    assert (save.op, save.rank, save.mode, save.step, save.ok) == ("save", 0, "dcp", 300, True)
    assert (load.op, load.rank, load.mode, load.step, load.ok) == ("load", 0, "dcp", 300, True)
    assert save.raw_bytes >= 64 * 8 * 4 + 80 and load.raw_bytes == save.raw_bytes
    assert {"resolve", "encode", "write"} <= set(save.stages) and {"decode", "copy"} <= set(load.stages)
    assert save.url == load.url == str(where)
    s4w_core.save({"x": torch.ones(2)}, tmp_path / "after.s4w")  # nothing left suppressed
    assert len(events) == 3


def test_import_starts_nothing_and_env_switches_work(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import json, sys, threading, urllib.request
        import torch, s4w_core
        from s4w_core import obs
        assert "prometheus_client" not in sys.modules
        assert threading.active_count() == 1, threading.enumerate()  # importing starts nothing
        assert obs._env_server is None
        s4w_core.save({{"x": torch.ones(100), "step": 9}}, {str(tmp_path / "e.s4w")!r})
        srv = obs._env_server
        assert srv is not None and any(t.name.startswith("s4w-metrics") for t in threading.enumerate())
        body = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
        assert 's4w_last_step{{op="save"}} 9.0' in body, body
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "S4W_LOG": "info", "S4W_METRICS_PORT": "0"}
    env.pop("S4W_LOG_FORMAT", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
    lines = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    assert len(lines) == 1 and lines[0]["step"] == 9 and lines[0]["op"] == "save"

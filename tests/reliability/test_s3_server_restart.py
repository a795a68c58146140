"""Kill the S3 server (SIGKILL) in the middle of uploads and downloads, restart it on the same data
and ports: an interrupted save fails with a clear StoreError (or completes), an interrupted
re-encoding behind a save leaves its step whole (or re-encoded), an interrupted load fails clearly,
nothing committed is lost, and the store works again after the restart."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import pytest

from s4w_core.errors import S4WError
from s4w_core.store.store import CheckpointStore
from tests.fixtures.seaweedfs import start_seaweedfs, weed_path
from tests.reliability.crash_harness import make_state, state_bytes

pytestmark = pytest.mark.s3
NUMEL = 1 << 21  # ~10 MB a step: long enough on the wire to be killed mid-transfer


def _store(srv, prefix: str) -> CheckpointStore:  # type: ignore[no-untyped-def]
    return CheckpointStore(
        f"s3://{srv.bucket}/{prefix}", endpoint=srv.endpoint, region=srv.region, force_path_style=True,
        client_options={"max_attempts": 2}, keyframe_every=4,
    )


class _Uploads:
    """Wraps a store's backend; ``started`` is set once ``n`` data uploads have begun, ``reading``
    once a data object's download begins."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n, self.started, self.reading = inner, n, threading.Event(), threading.Event()

    def fetch(self, key: str) -> Any:
        self.reading.set()
        return self.inner.fetch(key)

    def open_range(self, key: str) -> Any:
        self.reading.set()
        return self.inner.open_range(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[Any]:
        if key.startswith("data/"):
            self.n -= 1
            if self.n <= 0:
                self.started.set()
        with self.inner.writer(key) as f:
            yield f


def _run_killing(srv, fn, delay: float, after: threading.Event | None = None):  # type: ignore[no-untyped-def]
    """Run fn() in a thread, SIGKILL the server ``delay`` s after the start (or after ``after`` is
    set); returns fn's result or exception."""
    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["err"] = e

    t = threading.Thread(target=target)
    t.start()
    if after is not None:
        assert after.wait(timeout=120), "the upload never started"
    time.sleep(delay)
    srv.kill()
    t.join(timeout=180)
    assert not t.is_alive(), "the interrupted operation hung"
    return out


def test_kill_and_restart_server_mid_upload_and_download(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("s3torchconnector")
    if weed_path() is None:
        pytest.skip("SeaweedFS not installed")
    srv = start_seaweedfs()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret_key)
    try:
        st = _store(srv, "restart")
        for step in (1, 2):
            st.save(make_state(step, NUMEL), step)
        st.close()

        # 1) kill during the upload of a save's data object
        st = _store(srv, "restart")
        up = _Uploads(st.backend, 1)
        st.backend = up  # type: ignore[assignment]
        state3 = make_state(3, NUMEL)
        out = _run_killing(srv, lambda: st.save(state3, 3), delay=0.01, after=up.started)
        assert "ok" in out or isinstance(out.get("err"), S4WError), repr(out.get("err"))
        print("S3RESTART upload:", "completed" if "ok" in out else f"{type(out['err']).__name__}: {out['err']}")
        srv = start_seaweedfs(restart_of=srv)
        st = _store(srv, "restart")
        listed = st.steps()
        assert listed[:2] == [1, 2] and set(listed) <= {1, 2, 3}, listed
        for step in listed:
            assert state_bytes(st.load(step)) == state_bytes(make_state(step, NUMEL)), step
        # 2) kill during the upload of the re-encoding behind a save (the step below becoming a delta)
        up = _Uploads(st.backend, 2)  # the save's own upload, then the re-encoding's
        st.backend = up  # type: ignore[assignment]
        below = max(listed)
        out = _run_killing(srv, lambda: (st.save(make_state(4, NUMEL), 4), st.wait()), delay=0.0, after=up.started)
        assert "ok" in out, repr(out.get("err"))  # a failed re-encoding is logged, never raised
        srv = start_seaweedfs(restart_of=srv)
        st = _store(srv, "restart")
        assert st.steps()[:2] == [1, 2] and st.steps()[-2:] == [below, 4], st.steps()
        print(f"S3RESTART re-encoding upload: step {below} is {st.info(below).kind}")
        for step in st.steps():
            assert state_bytes(st.load(step)) == state_bytes(make_state(step, NUMEL)), step
        assert st.info(4).kind == "keyframe"
        st.save(make_state(5, NUMEL), 5)  # works again
        st.delete(5)  # step 4 is the newest again (re-coded whole first)
        st.close()

        # 2) kill during a download
        st = _store(srv, "restart")
        up = _Uploads(st.backend, 1)
        st.backend = up  # type: ignore[assignment]
        out = _run_killing(srv, lambda: st.load(4), delay=0.0, after=up.reading)
        if "ok" in out:
            assert state_bytes(out["ok"]) == state_bytes(make_state(4, NUMEL))
        else:
            assert isinstance(out["err"], S4WError), repr(out["err"])
        print("S3RESTART download:", "completed" if "ok" in out else f"{type(out['err']).__name__}: {out['err']}")
        srv = start_seaweedfs(restart_of=srv)
        st = _store(srv, "restart")
        for step in st.steps():
            assert state_bytes(st.load(step)) == state_bytes(make_state(step, NUMEL)), step
        assert 4 in st.steps()
        st.close()
    finally:
        srv.stop()

"""S3 failure modes against the real server (SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from s4w_core.errors import CheckpointNotFoundError, StoreError
from s4w_core.store import CheckpointStore
from s4w_core.store._s3 import DEFAULT_DEADLINE_S, S3Backend, parse_s3_url

pytestmark = pytest.mark.s3


def test_parse_url() -> None:
    assert parse_s3_url("s3://b/p/q/") == ("b", "p/q/")
    assert parse_s3_url("s3://b") == ("b", "")
    with pytest.raises(ValueError):
        parse_s3_url("s3:///x")


def _dead_port() -> int:
    """A loopback port nothing listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """No AWS credentials anywhere the client looks (environment, files, instance metadata)."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _fails_fast(st: CheckpointStore, match: str, within: float) -> None:
    t = time.monotonic()
    with pytest.raises(StoreError, match=match):
        st.steps()
    assert time.monotonic() - t < within


def test_wrong_credentials(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    CheckpointStore(s3_url).save({"x": torch.ones(2)}, 1)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    st = CheckpointStore(s3_url)
    _fails_fast(st, "access denied", 15)
    with pytest.raises(StoreError, match="access denied"):
        st.save({"x": torch.ones(2)}, 2)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "no-such-key")
    _fails_fast(CheckpointStore(s3_url), "access denied", 15)


def test_missing_credentials_told_apart(s3_url: str, no_credentials: None) -> None:
    st = CheckpointStore(s3_url)
    _fails_fast(st, "no AWS credentials found", 15)
    # no credentials and nothing listening: the endpoint is named, not the credentials
    dead = CheckpointStore(s3_url, endpoint=f"http://127.0.0.1:{_dead_port()}")
    _fails_fast(dead, "cannot reach the S3 endpoint .*connection refused", 15)


def test_unreachable_endpoint_fails_within_the_default_deadline(s3_url: str) -> None:
    """Without the connection probe the client's retries take 43 s to say so."""
    st = CheckpointStore(s3_url, endpoint=f"http://127.0.0.1:{_dead_port()}")
    assert isinstance(st.backend, S3Backend) and st.backend.deadline == DEFAULT_DEADLINE_S <= 15
    _fails_fast(st, "cannot reach the S3 endpoint http://127.0.0.1:.*connection refused", 15)
    with pytest.raises(StoreError, match="cannot reach"):
        st.save({"x": torch.ones(2)}, 1)


def test_silent_endpoint_fails_at_the_deadline(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An endpoint that accepts connections and never answers: StoreError at the deadline (the knob
    as an argument and as S4W_S3_DEADLINE)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)  # the kernel completes the handshakes; nobody reads or answers
    try:
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        be = S3Backend(s3_url, endpoint=url, deadline=1.5)
        t = time.monotonic()
        with pytest.raises(StoreError, match="did not answer within 1.5 s"):
            be.list("commits/")
        assert 1.4 < time.monotonic() - t < 6
        monkeypatch.setenv("S4W_S3_DEADLINE", "1")
        st = CheckpointStore(s3_url, endpoint=url)
        assert isinstance(st.backend, S3Backend) and st.backend.deadline == 1.0
        _fails_fast(st, "did not answer within 1 s", 6)
        monkeypatch.setenv("S4W_S3_DEADLINE", "soon")
        with pytest.raises(StoreError, match="S4W_S3_DEADLINE"):
            S3Backend(s3_url, endpoint=url)
    finally:
        srv.close()


def test_deadline_in_client_options(s3_url: str) -> None:
    be = S3Backend(s3_url, client_options={"deadline": 3, "max_attempts": 2})
    assert be.deadline == 3.0
    be.put("k", b"v")  # the check passed, the client took max_attempts
    assert be.get("k") == b"v"
    with pytest.raises(ValueError, match="deadline"):
        S3Backend(s3_url, deadline=0)


def test_missing_bucket(seaweedfs, s3_url: str) -> None:  # type: ignore[no-untyped-def]
    st = CheckpointStore("s3://no-such-bucket-s4w/x")
    _fails_fast(st, "bucket 'no-such-bucket-s4w' at http://127.0.0.1:[0-9]+ does not exist", 15)
    with pytest.raises(StoreError, match="does not exist"):
        st.save({"x": torch.ones(2)}, 1)


@pytest.mark.parametrize("case", ["dead-endpoint", "no-bucket", "no-credentials"])
def test_cli_says_which_in_one_line(case: str, s3_url: str, seaweedfs, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                    no_credentials: None) -> None:
    """`s4w ls s3://...`: one line on stderr, exit 1, the cause named."""
    env = {k: v for k, v in os.environ.items() if k != "S4W_S3_DEADLINE"}
    args, want = {
        "dead-endpoint": (["ls", s3_url, "--endpoint", f"http://127.0.0.1:{_dead_port()}"], "connection refused"),
        "no-bucket": (["ls", "s3://no-such-bucket-s4w/run"], "does not exist"),
        "no-credentials": (["ls", s3_url], "no AWS credentials found"),
    }[case]
    if case == "no-bucket":
        env.update(AWS_ACCESS_KEY_ID=seaweedfs.access_key, AWS_SECRET_ACCESS_KEY=seaweedfs.secret_key)
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "s4w_core.cli", *args], capture_output=True, text=True, env=env, timeout=60)
    assert time.monotonic() - t < 30  # 15 s deadline + interpreter start
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr and want in r.stderr, r.stderr


def test_failed_upload_leaves_no_object_even_after_gc(s3_url: str, seaweedfs) -> None:  # type: ignore[no-untyped-def]
    """s3torchconnector's S3Writer completes an upload from its finalizer if it is garbage-collected
    unclosed; our backend must abort it instead."""
    be = S3Backend(s3_url)

    def failing() -> None:
        with be.writer("data/partial.bin") as f:
            f.write(b"x" * (6 << 20))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        failing()
    gc.collect()
    keys = [o["Key"] for o in seaweedfs.boto3().list_objects_v2(Bucket=seaweedfs.bucket).get("Contents", [])]
    assert not [k for k in keys if k.endswith("data/partial.bin")]
    with pytest.raises(CheckpointNotFoundError):
        be.get("data/partial.bin")


def test_ranged_reads_and_info(s3_url: str) -> None:
    st = CheckpointStore(s3_url, profile="portable")
    st.save({"w": torch.randn(100000)}, 3)
    d = st.container_info(3)
    assert d["tensors"] == 1 and d["path"].startswith("s3://")


@pytest.mark.parametrize("raw_stream", [True, False], ids=["crt-stream", "ranged-reader"])
def test_fetch_downloads_in_parallel_parts_bit_exact(s3_url: str, monkeypatch: pytest.MonkeyPatch, raw_stream: bool) -> None:
    """A load downloads each object as parallel ranged GETs; parts of 1 MiB over a ~5 MB object
    reassemble it byte for byte, and a store load is bit-exact (through the CRT client's GET
    streams, and through s3torchconnector's ranged reader where a client has no such stream)."""
    monkeypatch.setenv("S4W_S3_FETCH_PART", str(1 << 20))
    if not raw_stream:
        monkeypatch.setattr(S3Backend, "raw_stream", lambda self: None)
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(1_500_000, generator=g), "b": torch.arange(7)}
    st = CheckpointStore(s3_url, delta=False)
    info = st.save(state, 1)
    be = st.backend
    assert isinstance(be, S3Backend)
    whole = be.get(info.object)
    assert len(whole) > 4 << 20  # several parts, the last one short
    rr = be.fetch(info.object)
    assert rr.size == len(whole) and rr.read(0, rr.size) == whole
    assert rr.readinto is not None
    a, b = bytearray(1000), bytearray(len(whole))  # readinto fills buffers in turn, stops at the end
    assert rr.readinto(len(whole) - 1000, [memoryview(a), memoryview(b)]) == 1000 and bytes(a) == whole[-1000:]
    got = st.load(1)
    assert torch.equal(got["w"].view(torch.int32), state["w"].view(torch.int32)) and torch.equal(got["b"], state["b"])
    with pytest.raises(CheckpointNotFoundError):
        be.fetch("no/such/object")

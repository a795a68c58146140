"""S3 failure modes against the real server (SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

import gc
import socket

import pytest
import torch

from s4w_core.errors import CheckpointNotFoundError, StoreError
from s4w_core.store import CheckpointStore
from s4w_core.store._s3 import S3Backend, parse_s3_url

pytestmark = pytest.mark.s3


def test_parse_url() -> None:
    assert parse_s3_url("s3://b/p/q/") == ("b", "p/q/")
    assert parse_s3_url("s3://b") == ("b", "")
    with pytest.raises(ValueError):
        parse_s3_url("s3:///x")


def test_wrong_credentials(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    CheckpointStore(s3_url).save({"x": torch.ones(2)}, 1)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    st = CheckpointStore(s3_url, client_options={"max_attempts": 1})
    with pytest.raises(StoreError, match="access denied"):
        st.steps()
    with pytest.raises(StoreError, match="access denied"):
        st.save({"x": torch.ones(2)}, 2)
    monkeypatch.undo()


def test_unreachable_endpoint(s3_url: str) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    st = CheckpointStore(s3_url, endpoint=f"http://127.0.0.1:{port}", client_options={"max_attempts": 1})
    with pytest.raises(StoreError, match="cannot reach the S3 endpoint"):
        st.steps()
    with pytest.raises(StoreError):
        st.save({"x": torch.ones(2)}, 1)


def test_missing_bucket(seaweedfs, s3_url: str) -> None:  # type: ignore[no-untyped-def]
    st = CheckpointStore("s3://no-such-bucket-s4w/x", client_options={"max_attempts": 1})
    with pytest.raises(StoreError, match="does not exist"):
        st.save({"x": torch.ones(2)}, 1)


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
        monkeypatch.setattr(S3Backend, "_raw_stream", lambda self: None)
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

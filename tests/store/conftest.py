"""The store suite runs against every backend: a local directory, a real S3 server (SeaweedFS on
127.0.0.1, marker ``s3``) and memory."""

from __future__ import annotations

import uuid

import pytest

from s4w_core.store import api as store_api
from s4w_core.store._memory import MemoryBackend


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3), "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "s3":
        return request.getfixturevalue("s3_url")
    name = f"t-{uuid.uuid4().hex[:12]}"
    request.addfinalizer(lambda: MemoryBackend.drop(name))
    return f"memory://{name}"


@pytest.fixture(autouse=True)
def _fresh_module_stores():  # type: ignore[no-untyped-def]
    yield
    store_api.close_stores()

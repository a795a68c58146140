"""Shared pytest configuration: markers and the device/server fixtures.

Markers: ``gpu`` (needs CUDA; skipped without it), ``s3`` (starts a local SeaweedFS S3 server),
``slow`` (long; run by default, deselect with ``-m "not slow"``).
"""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ["tests.fixtures.seaweedfs"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device: see docs/DEVELOPING.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

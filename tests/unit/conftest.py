"""Fixtures shared by the unit tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rc() -> Any:
    """``examples/read_container.py``, the standalone reference reader, imported as a module."""
    spec = importlib.util.spec_from_file_location("read_container", ROOT / "examples" / "read_container.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["read_container"] = mod
    spec.loader.exec_module(mod)
    return mod

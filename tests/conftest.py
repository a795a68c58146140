"""Shared pytest configuration: markers, the long/short switch, parallel runs and the server fixtures.

Markers: ``gpu`` (needs CUDA; skipped without it), ``s3`` (starts a local SeaweedFS S3 server),
``slow`` (long; run by default, deselect with ``-m "not slow"``), ``xdist_group`` (tests that
must share one worker: pytest-xdist's marker, registered here too so it works without xdist).

Long runs: ``--long`` (or ``S4W_LONG_TESTS=1``) runs the fuzzing, soak and crash tests at their
full size; without it (CI) they run a short form of the same checks. Tests size themselves with
``tests.fixtures.sizes.scaled(short, long)``; hypothesis tests without their own ``max_examples``
get it from the ``long`` / ``ci`` settings profiles registered below.

Parallel runs: pyproject's ``addopts`` runs the suite on pytest-xdist workers (``--numprocesses=auto
--dist=loadgroup``, at most :data:`MAX_WORKERS`). ``S4W_TEST_WORKERS=N`` picks N workers
(``0``: one process); ``-n 0`` or ``-p no:xdist`` (then ``--numprocesses``/``--dist`` are accepted
and ignored) also run everything in one process. Each worker has its own session fixtures (its own
SeaweedFS server); ``torch`` runs one intra-op thread per worker so two workers do not fight over
the cores.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.fixtures.sizes import LONG_ENV, long_tests

pytest_plugins = ["tests.fixtures.seaweedfs"]

#: workers for ``-n auto``: more than this costs more in start-up (torch import, one S3 server
#: each) and memory than it saves on a big machine
MAX_WORKERS = 8

# hypothesis: tests without their own max_examples get the profile's; "long" for --long runs
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow])


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="run fuzzing, soak and crash tests at full size (also: S4W_LONG_TESTS=1); CI runs the short form",
    )
    if not pluginmanager.has_plugin("xdist"):
        # pyproject's addopts name xdist's options: without pytest-xdist (not installed, or -p no:xdist)
        # accept them and run in this one process
        group = parser.getgroup("xdist", "pytest-xdist absent: these are accepted and ignored")
        group.addoption("--numprocesses", dest="numprocesses", default=None, help="ignored (pytest-xdist absent)")
        group.addoption("--dist", dest="dist", default="no", help="ignored (pytest-xdist absent)")
        group.addoption("--maxprocesses", dest="maxprocesses", default=None, help="ignored (pytest-xdist absent)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: ``S4W_TEST_WORKERS`` if set, else one worker per core, at most :data:`MAX_WORKERS`."""
    env = os.environ.get("S4W_TEST_WORKERS")
    if env is not None:
        if not env.isdigit():
            raise pytest.UsageError(f"S4W_TEST_WORKERS={env!r}: expected a number of workers (0: one process)")
        return int(env)
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker (pytest-xdist)")
    if config.getoption("long"):
        os.environ[LONG_ENV] = "1"  # before the test modules are imported, and inherited by xdist workers
    settings.load_profile("long" if long_tests() else "ci")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one intra-op thread per worker: the workers already fill the cores
        torch.set_num_threads(1)


def pytest_report_header(config: pytest.Config) -> str:
    return f"s4weights tests: {'long' if long_tests() else 'short (CI)'} fuzz/soak/crash runs (--long for full size)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # on xdist workers (every worker sorts alike): the ``slow`` tests first, so that the long ones
        # (the examples at their default sizes) start at once on separate workers instead of being
        # the last ones a single worker runs while the others sit idle
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device: see docs/DEVELOPING.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

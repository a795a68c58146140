"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``, ``nox -s gpu``.

Every session installs torch *first* and pinned (``TORCH`` overrides the pin): an unpinned torch,
or a package that pulls one in, resolves to a multi-GB CUDA build on a machine without one.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

TORCH_CPU = os.environ.get("TORCH", "torch==2.13.0")


def _install_dev(session: nox.Session, torch_spec: str = TORCH_CPU, extras: str = "dev") -> None:
    session.install(torch_spec)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite (what CI runs). Extra arguments go to pytest: ``nox -s tests -- -k golden``."""
    _install_dev(session)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository (config in pyproject.toml)."""
    session.install("ruff")
    session.run("ruff", "check", ".", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over s4w_core and the adapters (config in pyproject.toml)."""
    _install_dev(session)
    session.run("mypy", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU tests (``pytest -m gpu``) on a CUDA machine: CUDA torch + nvCOMP + Triton.

    ``TORCH`` picks the torch build (default: the index's CUDA build); ``S4W_GPU_EXTRA`` picks
    ``gpu-cu12`` (default) or ``gpu-cu13``.
    """
    extra = os.environ.get("S4W_GPU_EXTRA", "gpu-cu12")
    session.install(os.environ.get("TORCH", "torch"))
    session.install("-e", f".[{extra}]", "pytest", "hypothesis", "safetensors")
    session.run("python", "-c", "import torch; assert torch.cuda.is_available(), 'no CUDA device'")
    session.run("s4w", "selftest", "--quick")
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs)

"""benchmarks/README.md names every script in benchmarks/ (what it measures, how to run it), and
every script it names exists: a benchmark added, renamed or removed without its line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _scripts() -> set[str]:
    return {p.name for p in BENCH.iterdir() if p.is_file() and p.suffix in (".py", ".sh")}


def _named(text: str) -> set[str]:
    """Scripts the page names: a backticked bare name (`bench_x.py ...`) or a benchmarks/ path."""
    bare = re.findall(r"`([A-Za-z0-9_]+\.(?:py|sh))\b", text)
    paths = re.findall(r"(?<![\w/])benchmarks/([A-Za-z0-9_]+\.(?:py|sh))\b", text)
    return set(bare) | set(paths)


def test_every_script_is_listed() -> None:
    text = (BENCH / "README.md").read_text()
    missing = _scripts() - _named(text)
    assert not missing, f"benchmarks/README.md does not name {sorted(missing)}"


def test_every_listed_script_exists() -> None:
    text = (BENCH / "README.md").read_text()
    # names with a folder of their own (tests/..., results/...) are not benchmarks/ scripts
    gone = _named(text) - _scripts()
    assert not gone, f"benchmarks/README.md names {sorted(gone)}, which benchmarks/ does not have"


def test_the_check_sees_the_scripts() -> None:
    assert {"bench_peers.py", "frameworks.py", "device_env.sh"} <= _scripts() & _named((BENCH / "README.md").read_text())

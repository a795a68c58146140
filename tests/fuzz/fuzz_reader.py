"""Coverage-guided fuzz target (atheris / libFuzzer) for the s4weights reader.

Run (long run, results in benchmarks/results/fuzz_reader_1M.txt)::

    python tests/fuzz/fuzz_reader.py -runs=1000000 -rss_limit_mb=3072 -timeout=20 -max_len=8192

The first byte picks the mode: mutate a seed container through :func:`harness.mutate` (structure-
aware: forged fields, splices, truncation) seeded by the remaining bytes, or feed the bytes to the
reader as they are (libFuzzer's own mutations, guided by coverage). Any exception other than an
``S4WError`` is a finding.
"""

from __future__ import annotations

import os
import sys

import atheris
import numpy  # noqa: F401  - imported before instrumentation: only our code is instrumented
import torch  # noqa: F401
import xxhash  # noqa: F401
import zstandard  # noqa: F401

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

with atheris.instrument_imports():
    import s4w_core  # noqa: F401
    from tests.fuzz import harness


def one_input(data: bytes) -> None:
    harness.run_one(data)


def main() -> None:
    harness.seeds()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

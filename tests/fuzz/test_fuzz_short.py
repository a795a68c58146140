"""Fuzz runs: hypothesis-driven structure-aware mutation, and atheris if installed. Short in CI;
``python -m pytest --long`` runs them at full size (tests/fixtures/sizes.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.sizes import scaled
from tests.fuzz import framework, harness

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_seeds_decode_ok() -> None:
    for blob in harness.seeds():
        assert harness.check_input(blob) == "ok"


def test_seeds_cover_every_transform_family() -> None:
    """The seeds hold storages of the plain, row/column (``rc-``) and nonzero (``nz-``) byte-plane
    transforms and of ``bytes``, so that mutations reach each family's decode and checks."""
    seen = set()
    for blob in harness.seeds():
        _prefix, manifest = harness.split(blob)
        seen |= {st.get("transform") for st in manifest["storages"]}
    assert {"bytes", "planes-rotl1", "rc-planes-rotl1"} <= seen, seen
    assert any(t.startswith("nz-") for t in seen if t), seen


@settings(max_examples=scaled(150, 4000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(harness.seeds()) - 1), st.integers(1, 3), st.binary(min_size=1, max_size=16))
def test_mutated_containers_fail_cleanly(seed_idx: int, rounds: int, salt: bytes) -> None:
    rng = random.Random(salt)
    blob = harness.seeds()[seed_idx]
    for _ in range(rounds):
        blob = harness.mutate(blob, rng)
    harness.check_input(blob)


@settings(max_examples=scaled(200, 4000), deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_fail_cleanly(data: bytes) -> None:
    assert harness.check_input(data) != "ok" or data in harness.seeds()


def test_every_mutation_kind_is_caught() -> None:
    """Each mutation that changes meaning must be detected (not decoded to different bytes)."""
    rng = random.Random(1)
    outcomes: dict[str, int] = {}
    n = scaled(150, 3000)
    for _ in range(n):
        blob = harness.mutate(harness.seeds()[1], rng)
        r = harness.check_input(blob)
        outcomes[r] = outcomes.get(r, 0) + 1
    # the bulk of mutations must be rejected, with several distinct, specific error classes
    assert sum(v for k, v in outcomes.items() if k != "ok") > 2 * n // 3, outcomes
    assert len([k for k in outcomes if k != "ok"]) >= 4, outcomes


REGRESSIONS = os.path.join(os.path.dirname(__file__), "regressions")


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(REGRESSIONS) if not n.endswith(".md")))
def test_fuzz_regressions(name: str) -> None:
    """Inputs the fuzzer once crashed on (each fixed with the commit that added it)."""
    with open(os.path.join(REGRESSIONS, name), "rb") as f:
        harness.run_one(f.read())


@pytest.mark.slow
def test_atheris_short_run(tmp_path: "os.PathLike[str]") -> None:
    pytest.importorskip("atheris")
    runs = scaled(3000, 200_000)
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "fuzz", "fuzz_reader.py"), f"-runs={runs}",
         "-rss_limit_mb=3072", "-timeout=30", "-max_len=4096", f"-artifact_prefix={tmp_path}/"],
        cwd=ROOT, capture_output=True, text=True, timeout=scaled(900, 7200),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"Done {runs} runs" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize(
    "where,key,value",
    [
        ("storage", "transform", {"a": 1}),  # was TypeError: unhashable (first atheris finding)
        ("storage", "device", "not-a-device"),  # was RuntimeError from torch.device
        ("tensor", "dtype", "qint8"),  # quantized dtypes cannot come from a save
        ("tensor", "dtype", "__class__"),
    ],
)
def test_fuzz_found_manifest_forgeries_are_manifest_errors(where: str, key: str, value: object) -> None:
    """Bugs the fuzzer found in the manifest checks, pinned: each forgery is a ManifestError."""
    from s4w_core.errors import ManifestError

    prefix, m = harness.split(harness.seeds()[0])
    (m["storages"] if where == "storage" else m["tensors"])[0][key] = value
    with pytest.raises(ManifestError):
        import s4w_core

        s4w_core.load(harness.rebuild(prefix, m), map_location=None if key == "device" else "cpu")


# ----------------------------------------------------------------------------- framework files
def test_framework_seeds_are_recognized() -> None:
    formats = [framework.check_framework_file(b, through_container=True) for b in framework.framework_seeds()]
    assert formats == ["torch-zip", "torch-zip", "torch-zip", "safetensors", "raw"], formats


@settings(max_examples=scaled(150, 4000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 4), st.integers(1, 3), st.binary(min_size=1, max_size=16))
def test_mutated_framework_files_round_trip(seed_idx: int, rounds: int, salt: bytes) -> None:
    """Any mutation of a framework file packs (falling back to raw bytes where it cannot parse)
    and unpacks to the same bytes: never an exception."""
    rng = random.Random(salt)
    blob = framework.framework_seeds()[seed_idx]
    for _ in range(rounds):
        blob = framework.mutate_framework(blob, rng)
    framework.check_framework_file(blob, through_container=rng.random() < 0.1)


@settings(max_examples=scaled(200, 4000), deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_pack_and_unpack(data: bytes) -> None:
    framework.check_framework_file(b"PK\x03\x04" + data)
    framework.check_framework_file(data)


def test_framework_mutations_reach_the_parsers() -> None:
    """The mutations are not all rejected at the door: many still parse as zips/safetensors
    (so the pickle scan and the region code see forged input), others fall back to raw."""
    rng = random.Random(7)
    seen: dict[str, int] = {}
    for i in range(300):
        blob = framework.framework_seeds()[i % 4]
        for _ in range(rng.randint(1, 2)):
            blob = framework.mutate_framework(blob, rng)
        f = framework.check_framework_file(blob)
        seen[f] = seen.get(f, 0) + 1
    assert seen.get("torch-zip", 0) > 30 and seen.get("raw", 0) > 30 and seen.get("safetensors", 0) > 10, seen

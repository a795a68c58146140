"""GPU-only storages (``nvcomp-ans``): what they claim is checked before the GPU allocates it
(docs/SECURITY.md, the ``gpu_claim_bytes`` limit; docs/FORMAT.md section 7)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import s4w_core
from s4w_core.codecs import CODECS
from s4w_core.errors import ManifestError
from s4w_core.format.container import HEADER_SIZE, ContainerReader
from s4w_core.format.limits import set_limits
from s4w_core.format.manifest import NVCOMP_ANS_MAX_CHUNK, validate_manifest
from tests.attacks.generators import container, gpu_only_claims, manifest_of, storage_entry, xxh

PIECE = bytes(range(256))


def _ans_storages(count: int, nbytes: int, chunks: int = 8, seg: int = 1 << 24) -> dict[str, Any]:
    return manifest_of([storage_entry(nbytes, [["nvcomp-ans", HEADER_SIZE + (chunks * i + k) * 256, 256, xxh(PIECE)]
                                        for k in range(chunks)], seg=seg) for i in range(count)], [], None)


def _validate(m: dict[str, Any], data_bytes: int) -> None:
    validate_manifest(m, HEADER_SIZE, HEADER_SIZE + data_bytes, set(CODECS), "f.s4w")


def test_total_unproven_claim_is_capped() -> None:
    _validate(_ans_storages(1, 1 << 27), 8 * 256)  # 128 MiB: under the default 256 MiB
    with pytest.raises(ManifestError, match=r"f\.s4w: .*storage 2 .*gpu_claim_bytes limit of 268435456.*S4W_LIMITS"):
        _validate(_ans_storages(3, 1 << 27), 24 * 256)  # 384 MiB over three storages


def test_the_limit_can_be_raised() -> None:
    old = set_limits(gpu_claim_bytes=1 << 30)
    try:
        _validate(_ans_storages(3, 1 << 27), 24 * 256)
    finally:
        set_limits(old)


def test_plausible_ans_storages_do_not_count() -> None:
    """A storage that claims at most 16x its stored bytes + 1 MiB is not an unproven claim: a
    fast-profile file of real weights never meets the limit, however large."""
    # 40 storages of 16 MiB claimed from 1 MiB each: 640 MiB in all, every one plausible
    chunk = 1 << 20
    storages = [storage_entry(1 << 24, [["nvcomp-ans", HEADER_SIZE + i * chunk, chunk, "0" * 16]], seg=1 << 24)
                for i in range(40)]
    _validate(manifest_of(storages, [], None), 40 * chunk)


def test_a_delta_is_bounded_by_its_base_not_the_limit() -> None:
    """A delta storage's claim must equal its base's size, which the reader resolves before it
    allocates the output: it does not count against gpu_claim_bytes (a fast store's delta of
    unchanged tensors is constant data)."""
    m = _ans_storages(3, 1 << 27)
    for s in m["storages"]:
        s["delta"] = {"op": "xor", "base": {"object": "data/x", "storage": 0}}
    _validate(m, 24 * 256)


def test_per_chunk_bound_is_nvcomps_largest_ans_chunk() -> None:
    big = NVCOMP_ANS_MAX_CHUNK * 2
    m = manifest_of([storage_entry(big, [["nvcomp-ans", HEADER_SIZE, 1024, "0" * 16]], seg=big)], [], None)
    with pytest.raises(ManifestError, match="more than the 16777216 an nvCOMP ANS chunk holds"):
        _validate(m, 1024)
    # the same claim in a CPU-decodable codec is only held to the codec's expansion
    m = manifest_of([storage_entry(big, [["zstd", HEADER_SIZE, 1024, "0" * 16]], seg=big)], [], None)
    _validate(m, 1024)


def test_load_refuses_before_asking_for_a_gpu() -> None:
    """On a machine without a GPU the refusal is the same ManifestError (validation runs first)."""
    case = next(c for c in gpu_only_claims() if c.name == "ans_one_byte_chunks_claim_4GB")
    with pytest.raises(ManifestError, match="gpu_claim_bytes"):
        s4w_core.load(io.BytesIO(case.payload), map_location="cpu")


@pytest.mark.gpu
def test_forged_ans_under_the_limit_costs_at_most_its_claim_on_the_gpu() -> None:
    """Under the limit the claim is allocated, nvCOMP is handed the forged bitstream and must
    refuse it: an S4WError, and the GPU's peak stays within the claim plus the staging."""
    payload = container(PIECE * 8, _ans_storages(1, 1 << 27))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with pytest.raises(s4w_core.S4WError):
        s4w_core.load(io.BytesIO(payload), map_location="cuda")
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= (1 << 27) + (256 << 20)


@pytest.mark.gpu
def test_constant_data_in_the_fast_profile_and_the_limit() -> None:
    """What an honest fast-profile file of constant data claims: ANS codes a zero plane to a few
    bytes per 512 KiB chunk (within the format's 65,536x and nvCOMP's 16 MiB per chunk), so a
    zero storage counts against ``gpu_claim_bytes``: 64 MiB loads, 320 MiB needs the limit
    raised (a clear ManifestError until then), and then loads bit-exact."""
    small = {"z": torch.zeros(32 << 20, dtype=torch.bfloat16, device="cuda")}
    buf = io.BytesIO()
    s4w_core.save(small, buf, profile="fast")
    m = ContainerReader.from_bytes(buf.getvalue()).manifest
    ans = [c for s in m["storages"] for c in s["chunks"] if c[0] == "nvcomp-ans"]
    assert ans, "the fast profile codes a zero bf16 plane with nvcomp-ans"
    seg = m["storages"][0]["segment_elems"]
    assert all(seg <= c[2] * 65536 + 64 and seg <= NVCOMP_ANS_MAX_CHUNK for c in ans)
    assert torch.equal(s4w_core.load(buf.getvalue(), map_location="cuda")["z"], small["z"])

    big = {"z": torch.zeros(160 << 20, dtype=torch.bfloat16, device="cuda")}
    buf = io.BytesIO()
    s4w_core.save(big, buf, profile="fast")
    with pytest.raises(ManifestError, match="gpu_claim_bytes"):
        s4w_core.load(buf.getvalue(), map_location="cuda")
    old = set_limits(gpu_claim_bytes=1 << 30)
    try:
        assert torch.equal(s4w_core.load(buf.getvalue(), map_location="cuda")["z"], big["z"])
    finally:
        set_limits(old)

"""The GPU reader's decoding first (s4w_core.gpu._prove) on the CPU, with the simulated GPU of
tests/parity/_interpret_checks.py (nvCOMP stood in for by raw deflate; Triton's interpreter runs
the merge kernels). Run by tests/attacks/test_gpu_claims.py in a subprocess, because
``TRITON_INTERPRET=1`` must be set before triton is imported:

    python -m tests.attacks.gpu_claims_sim [CHECK ...]
"""

from __future__ import annotations

import io
import struct
import sys
import zlib
from typing import Any, Callable

import torch

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def _deflate9(c: Any, src: torch.Tensor, so: Any, ln: Any, dst: torch.Tensor, do: Any, cap: Any) -> list[int]:
    """The simulated encoder with full deflate (the stand-in's Huffman-only streams code zeros at
    8:1 only): constant data then claims more than 16x its stored bytes, as ANS's does."""
    sizes = []
    for a, n, b, cp in zip(so, ln, do, cap):
        z = zlib.compressobj(9, zlib.DEFLATED, -15)
        out = z.compress(src[a : a + n].numpy().tobytes()) + z.flush()
        assert len(out) <= cp
        dst[b : b + len(out)] = torch.frombuffer(bytearray(out), dtype=torch.uint8)
        sizes.append(len(out))
    return sizes


def _raw_deflate(data: bytes) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    return z.compress(data) + z.flush()


class _Spy:
    """Records the nvCOMP decode calls made while the proof runs: (scratch bytes, raw lengths)."""

    def __init__(self) -> None:
        from s4w_core.gpu import _decode, _nvcomp

        self.proving = False
        self.proof_calls: list[tuple[int, list[int]]] = []
        self.other_calls = 0
        self.orig_dec = _nvcomp.decode_batch
        self.orig_prove = _decode.prove_claims
        _nvcomp.decode_batch = self.decode  # restored by simulated_gpu()
        _decode.prove_claims = self.prove  # type: ignore[assignment]

    def decode(self, c: Any, src: Any, so: Any, ln: Any, dst: torch.Tensor, do: Any, raw: Any) -> Any:
        if self.proving:
            self.proof_calls.append((dst.numel(), [int(x) for x in raw]))
        else:
            self.other_calls += 1
        return self.orig_dec(c, src, so, ln, dst, do, raw)

    def prove(self, *a: Any) -> None:
        self.proving = True
        try:
            self.orig_prove(*a)
        finally:
            self.proving = False

    def restore(self) -> None:
        from s4w_core.gpu import _decode

        _decode.prove_claims = self.orig_prove  # type: ignore[assignment]


@check
def constant_data_is_proven_then_loaded() -> None:
    """A fast-profile file whose constant tensor claims far more than 16x its stored bytes loads
    bit-exact; its chunks are decoded first in groups of at most PROOF_BYTES, one scratch buffer."""
    import s4w_core
    from s4w_core import api
    from s4w_core.gpu import _nvcomp, _prove, decode_storages
    from tests.parity._interpret_checks import simulated_gpu

    # constant, not zero: an all-zero tensor takes the nonzero transform (its own claim check)
    obj = {"z": torch.full((1 << 20,), 0.5, dtype=torch.bfloat16), "w": torch.randn(5000).to(torch.bfloat16)}
    buf = io.BytesIO()
    old = _prove.PROOF_BYTES
    with simulated_gpu(segment_elems=1 << 16):
        _nvcomp.encode_batch = _deflate9
        s4w_core.save(obj, buf, profile="fast")
        reader = api.open_reader(buf.getvalue())
        m = reader.manifest
        z = next(s for s in m["storages"] if s["nbytes"] == 2 << 20)
        assert z["transform"] == "planes-rotl1" and {c[0] for c in z["chunks"]} == {"nvcomp-ans"}, z["transform"]
        assert _prove.needs_proof(z), sum(c[2] for c in z["chunks"])
        assert not _prove.needs_proof(next(s for s in m["storages"] if s is not z))
        spy = _Spy()
        _prove.PROOF_BYTES = 256 << 10
        try:
            raws = decode_storages(reader, m["storages"], torch.device("cpu"), None)
        finally:
            _prove.PROOF_BYTES = old
            spy.restore()
    by_path = {s["path"]: r for s, r in zip(m["storages"], raws)}
    for k, t in obj.items():
        assert torch.equal(by_path[k].view(torch.bfloat16), t.view(-1)), k
    # 2 MiB proven in 8 groups of 256 KiB (4 chunks of 64 KiB each), one scratch of 256 KiB
    assert len(spy.proof_calls) == 8, spy.proof_calls
    assert all(sz == 256 << 10 and raw == [64 << 10] * 4 for sz, raw in spy.proof_calls), spy.proof_calls
    assert spy.other_calls >= 1  # then decoded as any other storage


def _forged(chunks: list[tuple[str, bytes, int]], *, delta: bool = False) -> bytes:
    """A container with one byte-transformed storage of ``chunks`` (codec, stored bytes, claimed
    raw bytes; every claim the same but the last's), hashes correct."""
    from tests.attacks.generators import HEADER_SIZE, container, manifest_of, storage_entry, xxh

    data = b""
    entries = []
    for codec, blob, _raw in chunks:
        entries.append([codec, HEADER_SIZE + len(data), len(blob), xxh(blob)])
        data += blob
    seg = chunks[0][2]
    nbytes = seg * (len(chunks) - 1) + chunks[-1][2]
    s = storage_entry(nbytes, entries, seg=seg)
    if delta:
        s["delta"] = {"op": "xor", "base": {"object": "x", "storage": 0}}
    return container(data, manifest_of([s], [], None))


def _refused(payload: bytes, err: type, *match: str) -> _Spy:
    from s4w_core import api
    from s4w_core.gpu import _decode, decode_storages
    from tests.parity._interpret_checks import simulated_gpu

    def no_stage(*a: Any) -> None:
        raise AssertionError("a storage was staged (its claim allocated) before its proof failed")

    with simulated_gpu():
        spy = _Spy()
        orig_stage = _decode.stage
        _decode.stage = no_stage  # type: ignore[assignment]
        try:
            reader = api.open_reader(payload)
            decode_storages(reader, reader.manifest["storages"], torch.device("cpu"), None)
        except err as e:
            for s in match:
                assert s in str(e), (s, str(e))
        else:
            raise AssertionError(f"expected {err.__name__}")
        finally:
            _decode.stage = orig_stage  # type: ignore[assignment]
            spy.restore()
    return spy


@check
def forged_claim_is_refused_before_allocation() -> None:
    """Real streams of 64 KiB of zeros, each claimed as 1 MiB (16 MiB in all): the proof's first
    group fails, naming the chunk, before anything of the claimed size is staged or allocated."""
    from s4w_core.errors import DecodeError

    blob = _raw_deflate(bytes(64 << 10))
    spy = _refused(_forged([("nvcomp-ans", blob, 1 << 20)] * 16), DecodeError,
                   "chunk 0 of tensor 'w'", "does not decode to the 1048576 bytes", "claims 16777216 bytes")
    assert len(spy.proof_calls) == 1 and spy.proof_calls[0][0] <= 64 << 20, spy.proof_calls
    assert spy.other_calls == 0


@check
def forged_last_chunk_is_named() -> None:
    """Every chunk honest but the last one, which decodes to less than it claims."""
    from s4w_core.errors import DecodeError

    good = _raw_deflate(bytes(1 << 20))
    bad = _raw_deflate(bytes(20000))
    _refused(_forged([("nvcomp-ans", good, 1 << 20)] * 39 + [("nvcomp-ans", bad, 1 << 20)]), DecodeError,
             "chunk 39 of tensor 'w'")


@check
def corrupt_chunk_never_reaches_the_decoder() -> None:
    from s4w_core.errors import ChecksumMismatchError
    from tests.attacks.generators import HEADER_SIZE

    payload = bytearray(_forged([("nvcomp-ans", _raw_deflate(bytes(1 << 20)), 1 << 20)] * 4))
    payload[HEADER_SIZE + 2] ^= 0x10
    spy = _refused(bytes(payload), ChecksumMismatchError, "chunk 0 of tensor 'w'", "corrupt")
    assert not spy.proof_calls and not spy.other_calls


@check
def lying_zstd_chunk_in_a_gpu_only_storage() -> None:
    """A zstd chunk (decoded on the host when staged, into a slot of its claimed size) among ANS
    chunks: proven on the host, one chunk at a time, before staging."""
    from s4w_core.errors import DecodeError
    # a frame by hand that declares 1 MiB but holds one raw block of one byte
    frame = b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", 1 << 20) + struct.pack("<I", (1 << 3) | 1)[:3] + b"\0"
    frame += b"\0" * (64 - len(frame))
    ans = _raw_deflate(bytes(1 << 20))
    _refused(_forged([("nvcomp-ans", ans, 1 << 20), ("zstd", frame, 1 << 20)] * 8), DecodeError,
             "chunk 1 of tensor 'w'", "zstd")


def main(names: list[str]) -> int:
    from tests.parity._interpret_checks import run_checks

    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""S3 under injected faults: a CheckpointStore talks to SeaweedFS through tests/reliability/s3proxy.py
(127.0.0.1 only), which throttles (503 SlowDown), resets connections and delays responses.

Each test prints one ``S3FAULTS`` line with the counts (run with ``-s`` to see them; the numbers in
benchmarks/results/s3_faults.txt come from there).  Counts vary a little from run to
run (the CRT client's parallel connections interleave), so the asserts are on lower bounds.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest

from s4w_core.errors import S4WError, StoreError
from s4w_core.store import CheckpointStore
from tests.reliability.crash_harness import make_state, state_bytes
from tests.reliability.s3proxy import FaultProxy

pytestmark = pytest.mark.s3

NUMEL = 1 << 16
FAULTS = ("throttle", "reset_req", "reset_resp", "delay")


#: the stores a test opened: closed (their background re-encodings finished or stopped) before the
#: proxy goes, so no S3 client is left working at interpreter exit
_OPEN: list[CheckpointStore] = []


@pytest.fixture
def proxy(seaweedfs: Any, s3_url: str) -> Iterator[FaultProxy]:
    px = FaultProxy(seaweedfs.endpoint, seed=1234)
    px.set(mode="clean")
    try:
        yield px
    finally:
        px.set(mode="clean")  # a re-encoding still running finishes against the real server
        while _OPEN:
            st = _OPEN.pop()
            try:
                st.close()
            except S4WError:
                pass  # a background failure this test provoked: it was seen (or not needed) by the test
        px.close()


def _store(url: str, px: FaultProxy, **opts: Any) -> CheckpointStore:
    st = CheckpointStore(
        url, endpoint=px.endpoint, force_path_style=True, client_options=opts or None, keyframe_every=3
    )
    _OPEN.append(st)
    return st


def _report(name: str, px: FaultProxy, **extra: Any) -> str:
    c = px.counts
    parts = [f"{k}={c[k]}" for k in ("requests", "pass", *FAULTS)] + [f"{k}={v}" for k, v in extra.items()]
    line = f"S3FAULTS {name}: " + " ".join(parts)
    print(line)
    return line


def _check_all(st: CheckpointStore, steps: list[int]) -> None:
    assert st.steps() == steps
    for s in steps:
        assert state_bytes(st.load(s)) == state_bytes(make_state(s, NUMEL)), f"step {s} differs"


def test_saves_and_loads_survive_throttling_and_resets(s3_url: str, proxy: FaultProxy) -> None:
    """~20 % 503 SlowDown, ~10 % resets (half before, half after the server acted), a few delays:
    the CRT client's retries (max_attempts = s3torchconnector's default, 10) absorb them all."""
    proxy.set(mode="faults", p_throttle=0.20, p_reset_req=0.05, p_reset_resp=0.05, p_delay=0.05, delay_s=0.05)
    st = _store(s3_url, proxy)
    t0 = time.monotonic()
    for step in range(1, 5):
        st.save(make_state(step, NUMEL), step)
    # a fresh store (no base cache, no record cache) loads every step through the faults
    _check_all(_store(s3_url, proxy), [1, 2, 3, 4])
    dt = time.monotonic() - t0
    c = proxy.counts
    _report("saves+loads", proxy, saves=4, loads=4, failures=0, seconds=f"{dt:.1f}")
    assert c["throttle"] >= 5 and c["reset_req"] + c["reset_resp"] >= 1, dict(c)
    proxy.set(mode="clean")
    _check_all(_store(s3_url, proxy), [1, 2, 3, 4])


@pytest.mark.parametrize("mode", ["fail_all", "fail_writes", "reset_all"])
def test_save_fails_cleanly_when_endpoint_is_down(s3_url: str, proxy: FaultProxy, mode: str) -> None:
    """Every request (or every write) refused: the save raises StoreError within a bounded time;
    the steps committed before are untouched and load bit-exactly once the endpoint is back."""
    st = _store(s3_url, proxy, max_attempts=3)
    for step in (1, 2):
        st.save(make_state(step, NUMEL), step)
    proxy.set(mode=mode)
    proxy.reset_counts()
    t0 = time.monotonic()
    with pytest.raises(StoreError) as ei:
        st.save(make_state(3, NUMEL), 3)
    dt = time.monotonic() - t0
    msg = str(ei.value)
    _report(f"down[{mode}]", proxy, save_failed=1, seconds=f"{dt:.2f}", error=type(ei.value).__name__)
    print(f"S3FAULTS down[{mode}] message: {msg[:200]}")
    assert dt < 20, dt
    assert s3_url.split("/", 2)[2].split("/")[1] in msg  # names the object / prefix
    assert "throttled" in msg.lower() or "cannot reach" in msg.lower(), msg
    proxy.set(mode="clean")
    fresh = _store(s3_url, proxy)
    _check_all(fresh, [1, 2])
    # and the store still works: the failed step can be saved now
    fresh.save(make_state(3, NUMEL), 3)
    _check_all(_store(s3_url, proxy), [1, 2, 3])


def test_load_under_heavy_faults_is_exact_or_a_clear_error(s3_url: str, proxy: FaultProxy) -> None:
    """Loads with max_attempts=3 while ~60 % of requests fail: each load returns the exact state
    or raises an S4WError; never wrong bytes."""
    st = _store(s3_url, proxy)
    for step in (1, 2, 3):
        st.save(make_state(step, NUMEL), step)
    want = {s: state_bytes(make_state(s, NUMEL)) for s in (1, 2, 3)}
    proxy.set(mode="faults", p_throttle=0.2, p_reset_req=0.2, p_reset_resp=0.2, p_delay=0.05, delay_s=0.05)
    ok = failed = 0
    errors: set[str] = set()
    for i in range(6):
        step = 1 + i % 3
        try:
            got = _store(s3_url, proxy, max_attempts=3).load(step)
        except S4WError as e:
            failed += 1
            errors.add(type(e).__name__)
            assert str(e), "empty error message"
            print(f"S3FAULTS loads-heavy error: {type(e).__name__}: {str(e)[:160]}")
            continue
        assert state_bytes(got) == want[step], f"load {i} of step {step}: wrong bytes"
        ok += 1
    _report("loads-heavy", proxy, loads=6, exact=ok, clear_errors=failed, error_types="/".join(sorted(errors)) or "-")
    assert proxy.counts["reset_resp"] >= 1
    proxy.set(mode="clean")
    _check_all(_store(s3_url, proxy), [1, 2, 3])


def test_truncated_data_responses_are_retried_or_reported(s3_url: str, proxy: FaultProxy) -> None:
    """Only the container GETs are hit, half of them reset mid-body (after the headers and half
    the bytes): a load must never return the truncated bytes."""
    st = _store(s3_url, proxy)
    for step in (1, 2, 3):
        st.save(make_state(step, NUMEL), step)
    want = {s: state_bytes(make_state(s, NUMEL)) for s in (1, 2, 3)}
    proxy.set(mode="faults", only="/data/", p_reset_resp=0.5, p_throttle=0.0)
    proxy.reset_counts()
    ok = failed = 0
    for i in range(6):
        step = 1 + i % 3
        try:
            got = _store(s3_url, proxy, max_attempts=3).load(step)
        except S4WError as e:
            failed += 1
            print(f"S3FAULTS truncated error: {type(e).__name__}: {str(e)[:160]}")
            continue
        assert state_bytes(got) == want[step], f"load {i} of step {step}: wrong bytes"
        ok += 1
    _report("truncated-data", proxy, loads=6, exact=ok, clear_errors=failed)
    assert proxy.counts["reset_resp"] >= 2

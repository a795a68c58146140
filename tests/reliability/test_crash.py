"""Crash consistency: SIGKILL during saves, the re-encoding behind them, deletes and overwrites
(short runs of ``crash_harness.py``; the long runs and their results are in
benchmarks/results/crash_*), and a disk that fills up during a save."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import subprocess
from typing import IO, Any, Iterator

import pytest

from s4w_core.errors import S4WError, StoreError
from s4w_core.store.store import CheckpointStore
from tests.fixtures.sizes import scaled
from tests.reliability import crash_harness as ch

NUMEL = 1 << 17  # a ~0.6 MB state


def _args(url: str, trials: int, seed: int, durable: bool = True) -> argparse.Namespace:
    return argparse.Namespace(
        url=url, trials=trials, seed=seed, numel=NUMEL, keep_last=3, keyframe_every=4, max_delay=0.5, durable=durable
    )


def _assert_clean(res: dict[str, Any]) -> None:
    assert not res["failures"], res["failures"]
    assert res["ops_completed"].get("save", 0) > 0 and res["reencodes"].get("written", 0) > 0, res
    # deletes (hidden, merging, of the newest step) and overwrites ran between the saves
    assert len(res["ops_completed"]) >= 3, res["ops_completed"]
    # kills landed in more than one stage (random delays, phase markers, operation windows), and
    # in the re-encoding behind a save
    assert len(res["kills_by_stage"]) >= 3, res["kills_by_stage"]
    assert set(res["kills_by_reencode_phase"]) - {"none"}, res["kills_by_reencode_phase"]


def test_sigkill_local(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _assert_clean(ch.run(_args(str(tmp_path / "store"), scaled(15, 300), seed=1)))


def test_sigkill_local_without_fsync(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``durable=False`` drops the fsyncs, not the temp files and renames: a killed process (the
    page cache survives it) still leaves every committed step loading bit-exactly."""
    _assert_clean(ch.run(_args(str(tmp_path / "store"), scaled(15, 300), seed=3, durable=False)))


@pytest.mark.s3
def test_sigkill_s3(s3_url: str) -> None:
    _assert_clean(ch.run(_args(s3_url, scaled(8, 100), seed=2)))


# ----------------------------------------------------------------------------- disk full
def _fill_until_error(st: CheckpointStore, start: int = 1, max_steps: int = 40) -> tuple[list[int], BaseException]:
    saved: list[int] = []
    for step in range(start, start + max_steps):
        try:
            st.save(ch.make_state(step, NUMEL), step)
        except OSError as e:  # StoreError is an OSError too
            return saved, e
        saved.append(step)
    raise AssertionError("the disk never filled up")


def _enospc(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return "No space left" in str(e)


def _check_after_full(st: CheckpointStore, saved: list[int]) -> None:
    assert st.steps() == saved
    for s in saved:
        assert ch.state_bytes(st.load(s)) == ch.state_bytes(ch.make_state(s, NUMEL))
    # the failed save removed its data (object or temp file): only live data is left
    live = {o for r in st.list() for o in r.live_objects}
    assert {o.key for o in st.backend.list("data/")} == live
    tmps = getattr(st.backend, "list_temporaries", None)
    assert tmps is None or tmps() == []
    # free space, and saving works again
    for s in saved[:-1]:
        st.delete(s)
    nxt = saved[-1] + 1
    st.save(ch.make_state(nxt, NUMEL), nxt)
    assert ch.state_bytes(st.load(nxt)) == ch.state_bytes(ch.make_state(nxt, NUMEL))


@pytest.fixture
def tiny_tmpfs(tmp_path) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A 2 MiB tmpfs (needs root and a sandbox that allows mounts; skipped otherwise)."""
    d = str(tmp_path / "tmpfs")
    os.makedirs(d)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", d], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=False)


def test_disk_full_real_tmpfs(tiny_tmpfs: str) -> None:
    """A real ENOSPC from the kernel, wherever in the save it lands (data stream, fsync, the
    commit record): earlier steps intact, no leftovers, saving works once space is freed."""
    st = CheckpointStore(os.path.join(tiny_tmpfs, "store"), keyframe_every=2)
    saved, err = _fill_until_error(st)
    assert saved, "not even one step fit"
    assert _enospc(err), repr(err)
    assert isinstance(err, StoreError), repr(err)  # wherever the kernel said ENOSPC
    _check_after_full(st, saved)


class _FullDisk:
    """Wraps a backend; after ``budget`` bytes every write raises OSError(ENOSPC) (a portable
    stand-in for the tmpfs test: no root needed)."""

    def __init__(self, inner: Any, budget: int, *, commits_fail: bool = False) -> None:
        self.inner = inner
        self.left = budget
        self.commits_fail = commits_fail

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _take(self, n: int) -> None:
        if n > self.left:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        self.left -= n

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        outer = self
        with self.inner.writer(key) as f:

            class W:
                def write(self, data: Any) -> int:
                    outer._take(len(memoryview(data).cast("B")))
                    return f.write(data)

            yield W()  # type: ignore[misc]

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._take(self.left + 1 if self.commits_fail and key.startswith("commits/") else len(data))
        self.inner.put(key, data, if_absent=if_absent)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


@pytest.mark.parametrize("where", ["data", "commit"])
def test_disk_full_simulated(tmp_path, where: str) -> None:  # type: ignore[no-untyped-def]
    st = CheckpointStore(str(tmp_path / "store"), keyframe_every=2)
    st.save(ch.make_state(1, NUMEL), 1)
    size = st.info(1).object_bytes
    # "data": full half-way through the next container; "commit": the container fits, its record not
    full = _FullDisk(st.backend, size // 2 if where == "data" else 1 << 40, commits_fail=where == "commit")
    st.backend = full  # type: ignore[assignment]
    saved, err = _fill_until_error(st, start=2)
    assert _enospc(err), (saved, repr(err))
    assert where == "data" or saved == []
    # the data stream's error is wrapped; the simulated put raises a bare OSError itself
    assert isinstance(err, StoreError if where == "data" else (OSError, S4WError)), repr(err)
    st.backend = full.inner  # "space freed"
    _check_after_full(st, [1, *saved])

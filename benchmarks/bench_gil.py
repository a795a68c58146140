"""What a thread that runs Python (a training loop) costs a background save's host work.

Every call that releases the GIL (python-xxhash, a file or S3 ``write``, a numpy copy) makes the
calling thread wait, when it wants the GIL back, up to the interpreter's switch interval (5 ms)
while another thread runs Python. A save that does that per 512 KiB chunk crawls beside a training
loop. This runs each piece of a save's host work alone and beside a thread spinning in Python, the
way it was done before (one xxhash call and one write per chunk) and the way s4weights does it now
(``checksum.xxh3_hex_holding_gil`` holds the GIL for chunks, ``ContainerWriter`` writes 16 MiB at a time), and
then whole ``CheckpointStore.save_async`` calls of a GPU state (with ``--gpu``).

Usage: python benchmarks/bench_gil.py [--mib 1024] [--s3] [--gpu]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from s4w_core import checksum as ck  # noqa: E402
from s4w_core.format.container import ContainerWriter  # noqa: E402

CHUNK = 512 << 10


class Busy:
    """A thread running Python while the block runs (when ``on``): all the time (``duty`` 1), or
    for ``duty`` of each 2 ms period and sleeping (GIL released) the rest, as a training loop that
    also waits in C++ (backward, a CUDA synchronize) does."""

    duty = 1.0

    def __init__(self, on: bool) -> None:
        self.on = on
        self.stop = threading.Event()
        self.th = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        x = 0
        period = 0.002
        while not self.stop.is_set():
            if self.duty >= 1.0:
                x += 1
                continue
            end = time.perf_counter() + period * self.duty
            while time.perf_counter() < end:
                x += 1
            time.sleep(period * (1.0 - self.duty))

    def __enter__(self) -> "Busy":
        if self.on:
            self.th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.on:
            self.th.join()


def row(label: str, nbytes: int, fn: Callable[[], Any]) -> None:
    out = []
    for busy in (False, True):
        os.sync()  # dirty pages of the run before must not throttle this one
        with Busy(busy):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    print(f"{label:58s} alone {out[0]:7.3f} s ({nbytes / out[0] / 1e9:6.2f} GB/s)   beside a busy thread "
          f"{out[1]:7.3f} s ({nbytes / out[1] / 1e9:6.2f} GB/s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--s3", action="store_true", help="also write to SeaweedFS S3 (needs `weed`)")
    ap.add_argument("--gpu", action="store_true", help="also time CheckpointStore.save_async of a GPU state")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--only-gpu", action="store_true", help="only the CheckpointStore.save_async rows")
    ap.add_argument(
        "--switch-intervals", default="", help="comma list of sys.setswitchinterval values to repeat the GPU rows with"
    )
    ap.add_argument("--duties", default="1", help="comma list of busy-thread duty cycles for the GPU rows (1: always)")
    a = ap.parse_args()
    size = a.mib << 20
    blob = memoryview(os.urandom(size))
    chunks = [blob[o : o + CHUNK] for o in range(0, size, CHUNK)]
    print(f"{len(chunks)} chunks of {CHUNK >> 10} KiB ({size / 1e9:.2f} GB); switch interval {sys.getswitchinterval()} s")
    if a.only_gpu:
        a.gpu = True
    else:
        _host_rows(a, size, chunks)
    srv = None
    if a.s3:
        from bench_peers import S3Server

        weed = S3Server.find_weed()
        if weed is None:
            print("no `weed`: S3 rows skipped")
        else:
            srv = S3Server(weed, a.dir)
            srv.start()
    try:
        if srv is not None and not a.only_gpu:
            _s3_rows(srv, size, chunks)
        if a.gpu:
            default = sys.getswitchinterval()
            for duty in (float(x) for x in a.duties.split(",")):
                Busy.duty = duty
                for iv in [default] + [float(x) for x in a.switch_intervals.split(",") if x]:
                    sys.setswitchinterval(iv)
                    print(f"-- busy thread runs Python {duty:.0%} of the time; switch interval {iv} s")
                    _gpu_saves(size, a.dir, srv)
            Busy.duty = 1.0
            sys.setswitchinterval(default)
    finally:
        if srv is not None:
            srv.stop()
    return 0


def _host_rows(a: Any, size: int, chunks: list[memoryview]) -> None:
    row("xxh3 per chunk, python-xxhash (releases the GIL)", size, lambda: [xxhash.xxh3_64_hexdigest(c) for c in chunks])
    row("xxh3 per chunk, checksum.xxh3_hex_holding_gil", size, lambda: [ck.xxh3_hex_holding_gil(c) for c in chunks])

    path = os.path.join(a.dir, "bench_gil.bin")

    def fresh_file() -> Any:
        # a new file each run: truncating the last run's file (freeing its cached pages) is not
        # the writer's cost
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return open(path, "wb")

    _write_rows("file", fresh_file, size, chunks)
    os.remove(path)


def _write_rows(where: str, opener: Callable[[], Any], size: int, chunks: list[memoryview]) -> None:
    """The chunks written through ``opener()``'s file object as a save did before this change (one
    write and one python-xxhash call per chunk) and as ``ContainerWriter`` does now."""

    def per_chunk() -> None:
        with opener() as f:
            for c in chunks:
                f.write(c)
                xxhash.xxh3_64_hexdigest(c)

    def container() -> None:
        with opener() as f:
            w = ContainerWriter(f)
            for c in chunks:
                w.add_chunk(c)
            w.finish({})

    row(f"{where}: one write + one xxhash per chunk (before)", size, per_chunk)
    row(f"{where}: ContainerWriter (now)", size, container)


def _s3_rows(srv: Any, size: int, chunks: list[memoryview]) -> None:
    from s4w_core.store._s3 import S3Backend

    be = S3Backend(srv.url("gil"))
    _write_rows("S3", lambda: be.writer("obj"), size, chunks)


def _gpu_saves(size: int, root: str, srv: Any) -> None:
    import shutil

    import torch

    from s4w_core.store import CheckpointStore

    g = torch.Generator(device="cuda").manual_seed(0)
    n = size // 2 // 64
    state = {f"w{i}": (torch.randn(n, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for i in range(64)}
    targets = [("local", os.path.join(root, "bench_gil_store"))]
    if srv is not None:
        targets.append(("S3", srv.url("gil_store")))
    for name, url in targets:
        st = CheckpointStore(url, keep_last=2)
        st.reserve(state, wait=True)
        step = [0]

        def save(st: CheckpointStore = st, step: list[int] = step) -> None:
            step[0] += 1
            for v in state.values():
                v.add_(1e-3)
            st.save_async(state, step[0]).result()

        save()  # compiles the kernels, allocates the second pinned generation
        row(f"{name}: CheckpointStore.save_async, save to durable (delta)", size, save)
        st.close()
        if name == "local":
            shutil.rmtree(url, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())

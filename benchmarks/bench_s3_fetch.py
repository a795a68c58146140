"""How fast one object comes back from S3 (SeaweedFS on 127.0.0.1) with each read pattern.

A load of ``CheckpointStore("s3://...")`` or of DCP + ``S4StorageReader`` downloads each
container with :meth:`s4w_core.store._s3.S3Backend.fetch` (parts fetched on threads while the
decoder reads the ones that arrived). This measures, on one object of ``--mib`` MiB of random
bytes: one GET stream read sequentially (s3torchconnector's default reader, as ``S3Checkpoint``
and ``S3StorageReader`` read), and ``fetch`` for each part size x threads, read front to back.

Usage: python benchmarks/bench_s3_fetch.py [--mib 1200] [--parts 8,16,32,64] [--threads 4,8,16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_peers import S3Server  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1200)
    ap.add_argument("--parts", default="8,16,32,64", help="part sizes (MiB) for fetch")
    ap.add_argument("--threads", default="4,8,16", help="thread counts for fetch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--load", action="store_true", help="also time loads of a container (GPU state) through fetch")
    ap.add_argument("--only-load", action="store_true", help="only the load section")
    ap.add_argument("--write", action="store_true", help="also time uploads written in pieces of several sizes")
    a = ap.parse_args()
    weed = S3Server.find_weed()
    if weed is None:
        print("no `weed` binary (set S4W_WEED)")
        return 2
    srv = S3Server(weed, a.dir)
    srv.start()
    try:
        from s4w_core.store._s3 import S3Backend

        be = S3Backend(srv.url("fetch"))
        size = a.mib << 20
        data = os.urandom(size)
        with be.writer("obj") as f:
            f.write(data)
        del data
        print(f"object: {size / 1e9:.2f} GB of random bytes on SeaweedFS (weed mini), 127.0.0.1")

        def one_stream() -> None:
            r = be.client.get_object(be.bucket, be.object_key("obj"))  # the default sequential reader
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                k = r.readinto(view[got:])
                if not k:
                    break
                got += k
            assert got == size

        def raw_stream(start: int = 0, end: int = size, into: memoryview | None = None) -> None:
            # the CRT's GET stream itself (what every s3torchconnector reader wraps): it fetches
            # the range as part_size requests in parallel and yields them in order
            view = memoryview(bytearray(size)) if into is None else into
            pos = start
            stream = be.raw_stream()
            assert stream is not None, "this s3torchconnector has no CRT GET stream"
            for chunk in stream(be.bucket, be.object_key("obj"), start, end):
                n = len(chunk)
                view[pos - (0 if into is None else start) :][:n] = chunk
                pos += n
            assert pos == end

        def raw_parts(part: int, threads: int) -> None:
            from concurrent.futures import ThreadPoolExecutor

            buf = memoryview(bytearray(size))
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda o: raw_stream(o, min(size, o + (part << 20)), buf[o : o + (part << 20)]), range(0, size, part << 20)))

        def fetched(part: int, threads: int) -> None:
            os.environ["S4W_S3_FETCH_PART"] = str(part << 20)
            os.environ["S4W_S3_FETCH_THREADS"] = str(threads)
            rr = be.fetch("obj")
            block = 16 << 20
            out = bytearray(block)
            for off in range(0, size, block):  # a decoder reading front to back
                rr.readinto(off, [memoryview(out)[: min(block, size - off)]])
            rr.close()

        def timed(label: str, fn, *args) -> None:  # type: ignore[no-untyped-def]
            ts = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                fn(*args)
                ts.append(time.perf_counter() - t)
            best = min(ts)
            print(f"{label:34s} {best:6.3f} s  {size / best / 1e9:5.2f} GB/s  (runs: {', '.join(f'{x:.3f}' for x in ts)})", flush=True)

        if a.write:
            _writes(be, size, a.repeats)
        if a.load or a.only_load:
            _loads(be, srv, a.repeats, size)
        if a.only_load:
            return 0
        timed("one GET stream, sequential", one_stream)
        timed("one raw CRT stream, whole object", raw_stream)
        for p in (64, 256):
            for t in (2, 4, 8):
                timed(f"raw CRT streams {p} MiB x {t} threads", raw_parts, p, t)
        for p in (int(x) for x in a.parts.split(",")):
            for t in (int(x) for x in a.threads.split(",")):
                timed(f"fetch part {p} MiB x {t} threads", fetched, p, t)
    finally:
        srv.stop()
    return 0


def _writes(be, size: int, repeats: int) -> None:  # type: ignore[no-untyped-def]
    """One object of ``size`` bytes uploaded through ``S3Backend.writer`` in pieces of 512 KiB (a
    container's chunks) to 64 MiB, alone and with a Python thread competing for the GIL (as a
    save's encode loop does)."""
    import threading

    data = memoryview(os.urandom(size))
    for busy in (False, True):
        stop = threading.Event()

        def spin(stop: threading.Event = stop) -> None:
            x = 0
            while not stop.is_set():
                x += 1

        th = threading.Thread(target=spin, daemon=True)
        if busy:
            th.start()
        try:
            for piece_kib in (512, 4096, 16384, 65536):
                piece = piece_kib << 10
                ts = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    with be.writer(f"w{piece_kib}") as w:
                        for off in range(0, size, piece):
                            w.write(data[off : off + piece])
                    ts.append(time.perf_counter() - t)
                best = min(ts)
                print(
                    f"upload in {piece_kib:6d} KiB pieces{' + busy thread' if busy else '':15s} {best:6.3f} s  "
                    f"{size / best / 1e9:5.2f} GB/s  (runs: {', '.join(f'{x:.3f}' for x in ts)})",
                    flush=True,
                )
        finally:
            stop.set()
            if busy:
                th.join()


def _loads(be, srv, repeats: int, size: int) -> None:  # type: ignore[no-untyped-def]
    """A bf16 state of ``size`` bytes saved with ``api.save`` (GPU codec) to one S3 object, then
    loaded through ``fetch`` + ``api.load`` onto the GPU: warm and cold (fresh client) backend,
    with the time to the manifest and the download's own pace."""
    import threading

    import torch

    from s4w_core import api
    from s4w_core.format.container import ContainerReader
    from s4w_core.store import _s3

    g = torch.Generator(device="cuda").manual_seed(0)
    n = size // 2 // 64
    state = {f"w{i}": (torch.randn(n, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for i in range(64)}
    with be.writer("ckpt") as f:
        rep = api.save(state, f)
    stored = be.fetch("ckpt").size
    print(f"container: {rep.raw_bytes / 1e9:.2f} GB raw, {stored / 1e9:.2f} GB stored")

    lock = threading.Lock()
    marks: dict[str, float] = {}
    orig = _s3.Download._one

    def one(self, i):  # type: ignore[no-untyped-def]
        orig(self, i)
        with lock:
            marks["last_part"] = time.perf_counter()
            if i == len(self._starts) - 1:
                marks["tail"] = time.perf_counter()

    _s3.Download._one = one  # type: ignore[method-assign]
    try:
        combos = [(64, 4, False), (64, 4, True), (32, 8, False), (16, 8, False), (128, 4, False)]
        for part, threads, fresh in combos:
            os.environ["S4W_S3_FETCH_PART"] = str(part << 20)
            os.environ["S4W_S3_FETCH_THREADS"] = str(threads)
            label = f"{part} MiB x {threads}, {'fresh' if fresh else 'warm'} client"
            for r in range(repeats):
                b = _s3.S3Backend(be.url) if fresh else be
                torch.cuda.synchronize()
                marks.clear()
                t = time.perf_counter()
                rr = b.fetch("ckpt")
                reader = ContainerReader(rr.read, rr.size, rr.name, readinto=rr.readinto)
                api.open_reader(reader)
                t_manifest = time.perf_counter() - t
                out = api.load(reader, map_location="cuda")
                torch.cuda.synchronize()
                total = time.perf_counter() - t
                rr.close()
                ok = all(torch.equal(out[k].view(torch.int16), state[k].view(torch.int16)) for k in state)
                print(
                    f"load ({label}, run {r}): {total:.3f} s = {stored / total / 1e9:.2f} GB/s stored; manifest at "
                    f"{t_manifest:.3f} s (tail part at {marks.get('tail', t) - t:.3f} s); download done at "
                    f"{marks.get('last_part', t) - t:.3f} s ({stored / max(1e-9, marks.get('last_part', t) - t) / 1e9:.2f} GB/s); exact {ok}",
                    flush=True,
                )
                del out
    finally:
        _s3.Download._one = orig  # type: ignore[method-assign]


if __name__ == "__main__":
    raise SystemExit(main())

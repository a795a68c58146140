"""Where a first ``CheckpointStore("s3://...")`` save loses against ``S3Checkpoint`` + ``torch.save``.

One process, one GPU state (``_train_gpt.py``), SeaweedFS (``weed mini``) on 127.0.0.1. Each round
runs every variant once, in order, each a *first* save (keyframe, fresh store, fresh prefix);
the report gives per variant the median of the rounds and the time the upload stream's ``write``
calls spent (``S3Writer.write``, which blocks while the CRT client's part buffers are full):

* ``store``: ``CheckpointStore(url).save(state, 0)`` as shipped;
* ``store_reserved``: the same after ``reserve(state, wait=True)`` outside the timer (the pinned
  base copy's allocation not paid);
* ``store_reserve_bg``: ``reserve(state)`` (background allocation) inside the timer, then save;
* ``store_nocache``: ``CheckpointStore(url, delta=False)``: encode and upload only, no base copy;
* ``store_queued``: the upload stream's writes handed to a thread of their own, ``--depth`` blocks
  ahead (the writer's host work no longer waits for the stream);
* ``upload``: the bytes of the same container (encoded before the timer) uploaded through
  ``S3Writer`` in 16 MiB pieces;
* ``encode_mem``: ``s4w_core.save(state, sink)``, the GPU encode and the container writer into a
  file object that drops the bytes (no upload);
* ``s3ckpt``: s3torchconnector ``S3Checkpoint`` + ``torch.save`` (the peer);
* ``local``, ``torch_save``: ``store`` into a local directory, and ``torch.save`` to a file
  there, fsynced (``--local``);
* ``store_pN``, ``up_pN``, ``s3ckpt_pN`` (``--parts 8,32``): ``store``, ``upload`` and ``s3ckpt``
  through a client whose multipart ``part_size`` is N MiB (s3torchconnector's default is 8).

Usage (device): ``S4W_WEED=/path/weed python benchmarks/diag_s3_save.py --rounds 3``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _train_gpt import MODELS, Trainer  # noqa: E402
from bench_peers import S3Server  # noqa: E402
from profile_store import _tensors  # noqa: E402

import s4w_core  # noqa: E402

PIECE = 16 << 20


class _Meter:
    """Seconds spent in ``S3Writer.write`` (all threads) while a variant runs."""

    def __init__(self) -> None:
        self.s = 0.0
        self.calls = 0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from s3torchconnector import S3Writer

        orig = S3Writer.write

        def write(w: Any, data: Any) -> int:
            t = time.perf_counter()
            try:
                return orig(w, data)  # type: ignore[no-any-return]
            finally:
                with self.lock:
                    self.s += time.perf_counter() - t
                    self.calls += 1

        S3Writer.write = write  # type: ignore[method-assign]
        try:
            yield
        finally:
            S3Writer.write = orig  # type: ignore[method-assign]


class _Queued(io.RawIOBase):
    """A writer that copies each write and hands it to ``w.write`` on a thread of its own."""

    def __init__(self, w: Any, depth: int) -> None:
        super().__init__()
        self.w = w
        self.q: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self.err: BaseException | None = None
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            b = self.q.get()
            if b is None:
                return
            if self.err is None:
                try:
                    self.w.write(b)
                except BaseException as e:  # noqa: BLE001
                    self.err = e

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.err is not None:
            raise self.err
        b = data if isinstance(data, bytes) else memoryview(data).tobytes()
        self.q.put(b)
        return len(b)

    def close(self) -> None:
        if not self.closed:
            self.q.put(None)
            self.t.join()
            super().close()
            if self.err is not None:
                raise self.err
            self.w.close()


@contextlib.contextmanager
def _queued_writers(depth: int) -> Iterator[None]:
    from s4w_core.store import _s3

    orig = _s3.S3Backend.writer

    @contextlib.contextmanager
    def writer(self: Any, key: str) -> Iterator[Any]:
        with orig(self, key) as w:
            q = _Queued(w, depth)
            yield q
            q.close()

    _s3.S3Backend.writer = writer  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _s3.S3Backend.writer = orig  # type: ignore[method-assign]


class _Sink(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", choices=sorted(MODELS))
    ap.add_argument("--variant", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depth", type=int, default=4, help="blocks the queued writer holds")
    ap.add_argument("--only", default=None, help="comma list of the variants above to run (--local, --parts add theirs)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--local", action="store_true", help="also first saves to a local directory, and torch.save")
    ap.add_argument("--parts", default=None, help="comma list of multipart part sizes (MiB) for up_pN / s3ckpt_pN")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tr = Trainer(args.variant, args.steps, device=dev.type, corpus_bytes=8 << 20, **MODELS[args.model])
    for _ in range(args.steps):
        tr.step()
    sd = tr.state()
    raw = sum(t.numel() * t.element_size() for t in _tensors(sd))
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, {args.model}/{args.variant}, state {raw / 1e9:.3f} GB", flush=True)
    weed = S3Server.find_weed()
    if weed is None:
        print("no `weed` (set S4W_WEED)")
        return 2
    work = tempfile.mkdtemp(prefix="s4w-diag-s3-", dir=args.dir)
    s3 = S3Server(weed, work)
    s3.start()
    from s3torchconnector import S3Checkpoint, S3ClientConfig


    def ck(**cfg: Any) -> Any:
        """A client for the server as it runs now (``ensure_space`` may restart it on new ports)."""
        return S3Checkpoint(s3.region, endpoint=s3.endpoint, s3client_config=S3ClientConfig(force_path_style=True, **cfg))
    n = [0]

    def url() -> str:
        n[0] += 1
        return s3.url(f"r{n[0]}")

    blob = io.BytesIO()
    s4w_core.save(sd, blob)
    pieces = [blob.getbuffer()[i : i + PIECE].tobytes() for i in range(0, blob.getbuffer().nbytes, PIECE)]
    print(f"container {sum(map(len, pieces)) / 1e9:.3f} GB in {len(pieces)} pieces", flush=True)

    def store(**kw: Any) -> Callable[[], None]:
        def run() -> None:
            st = s4w_core.CheckpointStore(url(), **kw)
            st.save(tr.state(), step=0)
            st.close()

        return run

    def store_reserved() -> Callable[[], None]:
        st = s4w_core.CheckpointStore(url())
        st.reserve(tr.state(), wait=True)

        def run() -> None:
            st.save(tr.state(), step=0)
            st.close()

        return run

    def store_bg() -> None:
        st = s4w_core.CheckpointStore(url())
        st.reserve(tr.state())
        st.save(tr.state(), step=0)
        st.close()

    def local() -> None:
        d = tempfile.mkdtemp(dir=work)
        st = s4w_core.CheckpointStore(d)
        st.save(tr.state(), step=0)
        st.close()
        shutil.rmtree(d)

    def torch_save() -> None:
        p = os.path.join(work, "x.pt")
        with open(p, "wb") as f:
            torch.save(tr.state(), f)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(p)

    def store_queued() -> None:
        with _queued_writers(args.depth):
            store()()

    def upload() -> None:
        with ck().writer(url() + "/x.s4w") as w:
            for p in pieces:
                w.write(p)

    def encode_mem() -> None:
        s4w_core.save(tr.state(), _Sink())

    def s3ckpt() -> None:
        with ck().writer(url() + "/x.pt") as w:
            torch.save(tr.state(), w)

    variants: dict[str, Callable[[], Any]] = {
        "store": lambda: store()(),
        "store_reserved": store_reserved,  # returns the timed part
        "store_reserve_bg": store_bg,
        "store_nocache": lambda: store(delta=False)(),
        "store_queued": store_queued,
        "upload": upload,
        "encode_mem": encode_mem,
        "s3ckpt": s3ckpt,
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
    if args.local:
        variants.update({"local": local, "torch_save": torch_save})
    for mib in [int(x) for x in args.parts.split(",")] if args.parts else []:

        def up(mib: int = mib) -> None:
            with ck(part_size=mib << 20).writer(url() + "/x.s4w") as w:
                for p in pieces:
                    w.write(p)

        def sc(mib: int = mib) -> None:
            with ck(part_size=mib << 20).writer(url() + "/x.pt") as w:
                torch.save(tr.state(), w)

        variants[f"store_p{mib}"] = store(client_options={"part_size": mib << 20})
        variants[f"up_p{mib}"] = up
        variants[f"s3ckpt_p{mib}"] = sc
    times: dict[str, list[float]] = {k: [] for k in variants}
    writes: dict[str, list[float]] = {k: [] for k in variants}
    try:
        store()()  # warm-up: Triton compiles, the CRT client starts
        for r in range(args.rounds):
            for name, fn in variants.items():
                s3.ensure_space(4 * raw)
                timed = fn() if name == "store_reserved" else fn
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                m = _Meter()
                with m.active():
                    t0 = time.perf_counter()
                    timed()
                    t = time.perf_counter() - t0
                times[name].append(t)
                writes[name].append(m.s)
                print(f"round {r} {name:17s} {t:6.3f} s   S3Writer.write {m.s:6.3f} s in {m.calls} calls", flush=True)
                s3.delete_prefix(s3.url(""))
        print("\nmedians over rounds (s), and against s3ckpt (local ones: against torch_save):")
        for name in variants:
            peer = "torch_save" if name in ("local", "torch_save") else "s3ckpt"
            ref = statistics.median(times[peer]) if times.get(peer) else None
            med = statistics.median(times[name])
            vs = f"  {ref / med:5.3f}x {peer}" if ref else ""
            print(f"  {name:17s} {med:6.3f}  write {statistics.median(writes[name]):6.3f}{vs}   runs "
                  + ", ".join(f"{x:.3f}" for x in times[name]))
    finally:
        s3.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

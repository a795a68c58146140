"""The CPU plane transform compiled with numba (optional: ``pip install "s4weights[numba]"``).

One pass over each element: split reads a word, XORs the base, rotates and writes one byte to each
plane; merge does the inverse. numpy needs 5-7 passes with temporaries for the same result
(~1.2-1.5 GB/s on one core, against 7-12 GB/s here: ``benchmarks/bench_cpu_core.py --planes``),
which left the transform as large as the entropy coding in a CPU load.

The numpy functions in :mod:`s4w_core.planes.reference` stay the oracle: these kernels must give
identical bytes (``tests/unit/test_planes_jit.py``), and they are used only when numba imports and
``S4W_NUMBA`` is not ``0``. They are loaded on a background thread once the CPU path has had
64 MiB of work (numpy works until they are ready), compiled the first time and cached on disk (numba's cache:
beside this file, or the user's cache directory when that is read-only); they release the GIL.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from s4w_core import config

__all__ = ["enabled", "split_into", "merge_into", "merge_range", "rowcol_hists", "rowcol_offsets"]

_lock = threading.Lock()
_kernels: dict[str, Any] | None = None


def _build() -> dict[str, Any]:
    import numba

    jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    u16, u32 = np.uint16, np.uint32

    @jit
    def split2(v, base, has_base, o0, o1):  # type: ignore[no-untyped-def]
        for i in range(v.size):
            x = v[i]
            if has_base:
                x ^= base[i]
            r = (x << u16(1)) | (x >> u16(15))
            o0[i] = np.uint8(r >> u16(8))
            o1[i] = np.uint8(r & u16(0xFF))

    @jit
    def split4(v, base, has_base, o0, o1, o2, o3):  # type: ignore[no-untyped-def]
        for i in range(v.size):
            x = v[i]
            if has_base:
                x ^= base[i]
            r = (x << u32(1)) | (x >> u32(31))
            o0[i] = np.uint8(r >> u32(24))
            o1[i] = np.uint8((r >> u32(16)) & u32(0xFF))
            o2[i] = np.uint8((r >> u32(8)) & u32(0xFF))
            o3[i] = np.uint8(r & u32(0xFF))

    @jit
    def merge2(p0, p1, base, has_base, out):  # type: ignore[no-untyped-def]
        for i in range(out.size):
            r = (u16(p0[i]) << u16(8)) | u16(p1[i])
            x = (r >> u16(1)) | (r << u16(15))
            if has_base:
                x ^= base[i]
            out[i] = x

    @jit
    def merge4(p0, p1, p2, p3, base, has_base, out):  # type: ignore[no-untyped-def]
        for i in range(out.size):
            r = (u32(p0[i]) << u32(24)) | (u32(p1[i]) << u32(16)) | (u32(p2[i]) << u32(8)) | u32(p3[i])
            x = (r >> u32(1)) | (r << u32(31))
            if has_base:
                x ^= base[i]
            out[i] = x

    @jit
    def rowcol_offsets(words, shift, cols, row, col):  # type: ignore[no-untyped-def]
        # rowcol.offsets_np of plane 0 (each word's byte at ``shift``), in one pass over the words
        rows = words.size // cols
        cs = np.zeros(cols, np.int64)
        total = np.int64(0)
        for r in range(rows):
            acc = np.int64(0)
            for c in range(cols):
                b = np.int64((words[r * cols + c] >> shift) & 0xFF)
                acc += b
                cs[c] += b
            m = (acc + cols // 2) // cols
            row[r] = np.uint8(m)
            total += m
        for c in range(cols):
            col[c] = np.uint8(((cs[c] - total + rows // 2) // rows) & 0xFF)

    @jit
    def rowcol_hists(words, shift, cols, hp, hq):  # type: ignore[no-untyped-def]
        # plane 0 of each word (its byte at ``shift``) counted in ``hp``, and plane 0 less its
        # row and column offsets (rowcol_offsets, modulo 256) in ``hq``
        rows = words.size // cols
        row = np.empty(rows, np.uint8)
        col = np.empty(cols, np.uint8)
        rowcol_offsets(words, shift, cols, row, col)
        for r in range(rows):
            rv = np.int64(row[r])
            for c in range(cols):
                b = np.int64((words[r * cols + c] >> shift) & 0xFF)
                hp[b] += 1
                hq[(b - rv - np.int64(col[c])) & 0xFF] += 1

    return {"split2": split2, "split4": split4, "merge2": merge2, "merge4": merge4, "rowcol_hists": rowcol_hists,
            "rowcol_offsets": rowcol_offsets}


def _warm() -> None:
    """Build the kernels and run each once per argument type the CPU path passes (planes decoded
    from ``bytes`` are read-only arrays, a different numba type): loads them from numba's disk
    cache, or compiles them the first time (~2 s)."""
    global _kernels
    try:
        k = _build()
        for w, u in ((2, np.uint16), (4, np.uint32)):
            words = np.zeros(4, dtype=u)
            planes = np.zeros((w, 4), dtype=np.uint8)
            ro = np.frombuffer(bytes(4 * w), dtype=np.uint8).reshape(w, 4)
            for base, has in ((_EMPTY[w], False), (words, True)):
                k[f"split{w}"](words, base, has, *planes)
                for src in (planes, ro):
                    k[f"merge{w}"](*src, base, has, words)
            k["rowcol_hists"](words, 8 * w - 9, 2, np.zeros(256, np.int64), np.zeros(256, np.int64))
            k["rowcol_offsets"](words, 8 * w - 9, 2, np.zeros(2, np.uint8), np.zeros(2, np.uint8))
        _kernels = k
    except Exception:  # noqa: BLE001 - numba missing or unusable here: numpy does the work
        pass
    finally:
        _ready.set()


_ready = threading.Event()
_started = False


def _after_fork_in_child() -> None:
    """A child forked while the kernels were loading (a DataLoader worker, say) has no loader
    thread, and locks that thread held (numba's, its imports') stay held there: the child uses
    numpy. One forked after they were loaded keeps them."""
    global _ready, _lock
    _lock = threading.Lock()
    if _started and not _ready.is_set():
        _ready = threading.Event()
        _ready.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: the CPU path starts loading the kernels once it has transformed this many bytes with numpy (a
#: process that only handles small files, a CLI call, a test or a small model's training run never
#: spends the 1.5-2 s of CPU, most of it Python holding the GIL while a training thread waits:
#: 1-3 s per run in the CPU runs of benchmarks/frameworks.py when this was 8 MiB; numba gains
#: ~0.7 ms per MB over numpy, so a few MB per save never win it back; a large checkpoint starts it
#: during its first save)
START_AFTER_BYTES = 64 << 20
#: only calls of at least this many bytes count toward :data:`START_AFTER_BYTES`: the encoder's
#: probes transform samples of <= 512 KiB of every storage (also in a GPU run, whose re-encodes
#: from host copies probe on the CPU), and those must not make a GPU training process load numba
#: (1.7 s of a save's foreground time measured on an H100, most of it holding the GIL)
COUNT_FROM_BYTES = 1 << 20
_seen = 0


def _get(wait: bool = False, nbytes: int = 0) -> dict[str, Any] | None:
    """The kernels, or None while they are not ready. Loading starts on a background thread
    (import numba, load or compile: 1.5-2 s of CPU once per process) when ``wait`` is set or once
    the CPU path has asked for :data:`START_AFTER_BYTES` of work; numpy does the work until then,
    so a small save or load never waits for numba."""
    global _started, _seen
    if not wait and not _started and nbytes < COUNT_FROM_BYTES and _seen < START_AFTER_BYTES:
        return None  # nothing to count or start (numpy does the work): no look at the environment
    if not config.get_bool("S4W_NUMBA"):
        return None
    if not _ready.is_set():
        if not _started:
            if nbytes >= COUNT_FROM_BYTES:
                _seen += nbytes
            if not wait and _seen < START_AFTER_BYTES:
                return None
            with _lock:
                if not _started:
                    _started = True
                    if importlib.util.find_spec("numba") is None:
                        _ready.set()
                    else:
                        # not a daemon: an interpreter that exits while LLVM compiles on a daemon
                        # thread aborts ("terminate called without an active exception"); exit
                        # joins this thread first, before atexit handlers and finalization (~2 s)
                        threading.Thread(target=_warm, name="s4w-numba", daemon=False).start()
        if not wait:
            return None
        _ready.wait()
    return _kernels


def enabled(wait: bool = True) -> bool:
    """numba is importable, not switched off (``S4W_NUMBA=0``) and its kernels are ready (waits for
    them by default; ``wait=False`` only asks). Reads ``S4W_NUMBA`` at every call."""
    return config.get_bool("S4W_NUMBA") and _get(wait) is not None


_UINT: dict[int, Any] = {2: np.uint16, 4: np.uint32}
_EMPTY: dict[int, np.ndarray] = {2: np.empty(0, np.uint16), 4: np.empty(0, np.uint32)}


def _words(a: np.ndarray, w: int) -> np.ndarray:
    return np.ascontiguousarray(a).view(_UINT[w])


def split_into(raw: np.ndarray, w: int, base: np.ndarray | None, out: np.ndarray) -> bool:
    """``out[j] = plane j`` of ``raw`` (uint8, ``n * w`` bytes; ``out``: ``(w, n)`` uint8, C order).
    Returns False (and does nothing) when the kernels are not available."""
    k = _get(nbytes=raw.size)
    if k is None or w not in _UINT:
        return False
    v = _words(raw, w)
    b = _EMPTY[w] if base is None else _words(base, w)
    # the kernels do not check bounds: every length is checked here
    if out.shape != (w, v.size) or not out.flags.c_contiguous or (base is not None and b.size != v.size):
        raise ValueError(f"split_into: {raw.size} bytes, planes {out.shape}, base {None if base is None else base.size}")
    if w == 2:
        k["split2"](v, b, base is not None, out[0], out[1])
    else:
        k["split4"](v, b, base is not None, out[0], out[1], out[2], out[3])
    return True


def _merge_args(
    parts: Sequence[np.ndarray], w: int, out: np.ndarray, base: np.ndarray | None
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The kernels' arguments for :func:`merge_into` (planes, output words, base words), every
    length checked (the kernels do not check bounds)."""
    ps = [np.ascontiguousarray(p) for p in parts]
    o = out.view(_UINT[w])
    n = o.size
    ok = len(ps) == w
    for p in ps if ok else ():
        if p.dtype != np.uint8 or p.size != n:
            ok = False
    if base is None:
        b = _EMPTY[w]
    else:
        b = _words(base, w)
        ok = ok and b.size == n
    if not ok:
        raise ValueError(f"merge_into: planes {[p.size for p in ps]}, out {out.size} bytes, base {None if base is None else base.size}")
    return ps, o, b


def _merge_kernel(w: int, nbytes: int) -> Any:
    """The compiled merge of ``w``-byte elements, or None while the kernels are not available."""
    k = _kernels if _ready.is_set() and config.get_bool("S4W_NUMBA") else _get(nbytes=nbytes)
    if k is None or w not in _UINT:
        return None
    return k["merge2"] if w == 2 else k["merge4"]


def merge_into(parts: Sequence[np.ndarray], w: int, out: np.ndarray, base: np.ndarray | None) -> bool:
    """Inverse of :func:`split_into` into ``out`` (uint8, ``n * w`` bytes, contiguous). Returns
    False (and does nothing) when the kernels are not available. (Called once per segment of a
    load, most of them small tensors: the checks are plain comparisons, no temporaries.)"""
    f = _merge_kernel(w, out.size)
    if f is None:
        return False
    ps, o, b = _merge_args(parts, w, out, base)
    f(*ps, b, base is not None, o)
    return True


def merge_range(
    parts: Sequence[np.ndarray], w: int, out: np.ndarray, base: np.ndarray | None
) -> Callable[[int, int], None] | None:
    """:func:`merge_into` by element ranges: the lengths are checked once, and the returned
    ``merge(a, z)`` merges elements ``[a, z)`` of ``out`` (for a caller that works on ``out``
    block by block). None when the kernels are not available."""
    f = _merge_kernel(w, out.size)
    if f is None:
        return None
    ps, o, b = _merge_args(parts, w, out, base)
    has = base is not None

    def merge(a: int, z: int) -> None:
        f(*[p[a:z] for p in ps], b[a:z] if has else b, has, o[a:z])

    return merge


def _rowcol_kernel(name: str, words: np.ndarray, shift: int, cols: int) -> Any:
    """The compiled row/column kernel ``name`` for ``words`` (None when the kernels are not
    available or the words are not a contiguous unsigned 2- or 4-byte array), every argument
    checked first (the kernels do not check bounds)."""
    k = _kernels if _ready.is_set() and config.get_bool("S4W_NUMBA") else _get(nbytes=words.nbytes)
    if k is None or words.dtype.itemsize not in _UINT or not words.flags.c_contiguous:
        return None
    if cols < 1 or words.size % cols or not 0 <= shift <= 8 * words.dtype.itemsize - 8:
        raise ValueError(f"{name}: {words.size} words, rows of {cols}, shift {shift}")
    return k[name]


def rowcol_hists(words: np.ndarray, shift: int, cols: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The histograms (256 int64 counts each) of plane 0 of ``words`` (unsigned, contiguous, whole
    rows of ``cols``; plane 0 is each word's byte at bit ``shift``) and of plane 0 less its
    row/column offsets (:func:`s4w_core.planes.rowcol.offsets_np`, modulo 256), in two passes;
    None when the kernels are not available."""
    f = _rowcol_kernel("rowcol_hists", words, shift, cols)
    if f is None:
        return None
    hp = np.zeros(256, np.int64)
    hq = np.zeros(256, np.int64)
    f(words, shift, cols, hp, hq)
    return hp, hq


def rowcol_offsets(words: np.ndarray, shift: int, cols: int) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`s4w_core.planes.rowcol.offsets_np` of plane 0 of ``words`` (unsigned, contiguous,
    whole rows of ``cols``; plane 0 is each word's byte at bit ``shift``) without making plane 0:
    one compiled pass; None when the kernels are not available."""
    f = _rowcol_kernel("rowcol_offsets", words, shift, cols)
    if f is None:
        return None
    row = np.empty(words.size // cols, np.uint8)
    col = np.empty(cols, np.uint8)
    f(words, shift, cols, row, col)
    return row, col

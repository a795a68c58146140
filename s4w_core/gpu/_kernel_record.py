"""Which of the codec's Triton kernels a warm-up loaded, recorded beside Triton's on-disk cache, so
that a later process loads exactly those again (Triton's ``JITFunction.preload``) instead of coding
synthetic steps to find them.

With a warm Triton cache the warm-up's work is mostly Python (the GPU writer and reader run on
synthetic states, on three threads), and Python on a background thread takes the GIL from the
training loop: in the framework benchmark the first steps of every run were slower by about as much as
the warm-up took. Loading the recorded kernels costs a small part of that.

A record is a JSON list of ``[module, name, specialization]`` entries, ``specialization`` being the
``specialization_data`` Triton hands its ``jit_post_compile_hook`` (each kernel compiled or loaded
from the disk cache, with its argument types, alignments and constants). Its file name carries a
digest of what makes it valid here: Triton's version, torch's CUDA version, the device's compute
capability and every kernel's source (``JITFunction.cache_key``), so a changed kernel or another
machine never finds an old record. Replaying looks each entry's kernel up by name among this
package's own kernels (nothing a file names is imported) and checks every entry before it loads any;
a record that does not check or load (a damaged file, another Triton) is ignored: the warm-up then
codes its synthetic steps as before and writes a new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Iterable

import torch
import triton
from triton.runtime.jit import JITFunction

from s4w_core._fsutil import atomic_write
from s4w_core.gpu import kernels as _gpu_kernels
from s4w_core.planes import triton_kernels as _plane_kernels

__all__ = ["Recorder", "cache_dir", "kernels", "kernels_digest", "preload", "record_path"]

_log = logging.getLogger("s4w_core.gpu")

#: the modules that define the codec's Triton kernels
_MODULES = (_gpu_kernels, _plane_kernels)
#: threads that make the kernels' launchers (each waits on a C compiler in a child process)
_LAUNCHER_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
#: a record larger than this is not read (a kernel's entry is ~2 KB; the codec has a few dozen)
_MAX_RECORD_BYTES = 4 << 20


def kernels() -> dict[tuple[str, str], JITFunction]:
    """The codec's Triton kernels by ``(module, name)``, as Triton's hooks name them."""
    out: dict[tuple[str, str], JITFunction] = {}
    for mod in _MODULES:
        for value in vars(mod).values():
            if isinstance(value, JITFunction):
                out[(value.fn.__module__, value.fn.__qualname__)] = value
    return out


def cache_dir() -> Path:
    """Triton's on-disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``)."""
    knob = getattr(getattr(triton, "knobs", None), "cache", None)
    where = getattr(knob, "dir", None) or os.environ.get("TRITON_CACHE_DIR") or ""
    return Path(where) if where else Path.home() / ".triton" / "cache"


def kernels_digest() -> str:
    """A digest of the codec's Triton kernels (each one's ``JITFunction.cache_key``: its source
    and what it calls)."""
    h = hashlib.sha256()
    for (module, name), fn in sorted(kernels().items()):
        h.update(f"{module}:{name}:{fn.cache_key}\n".encode())
    return h.hexdigest()


def record_path(device: torch.device, tag: str = "") -> Path:
    """The record for ``device`` under this Triton, CUDA and kernel sources; ``tag``: what else
    the warm-up's coverage depends on (the plane widths it warms)."""
    h = hashlib.sha256()
    h.update(repr((triton.__version__, torch.version.cuda, torch.cuda.get_device_capability(device), tag)).encode())
    h.update(kernels_digest().encode())
    return cache_dir() / f"s4w-warm-up-{h.hexdigest()[:32]}.json"


class Recorder:
    """``with Recorder() as rec:`` collects the specialization of each codec kernel Triton compiles
    or loads meanwhile (a ``jit_post_compile_hook`` that calls the one installed before it, and is
    taken out at exit unless something installed another over it); :meth:`write` stores them."""

    def __init__(self, loaded: Iterable[list[str]] = ()) -> None:
        self._ours = kernels()
        self._lock = threading.Lock()
        # ``loaded``: entries this process preloaded before the warm-up ran (Triton does not call the
        # hook again for a kernel it holds): the record keeps them
        self._entries: dict[str, list[str]] = {e[2]: list(e) for e in loaded}
        self._prev: Any = None

    def _hook(self, **kw: Any) -> Any:
        fn, compiled = kw.get("fn"), kw.get("compile")
        if fn is not None and isinstance(compiled, dict) and (fn.module, fn.name) in self._ours:
            data = compiled.get("specialization_data")
            if isinstance(data, str):
                with self._lock:
                    self._entries[data] = [fn.module, fn.name, data]
        return self._prev(**kw) if self._prev is not None else None

    def __enter__(self) -> Recorder:
        runtime = triton.knobs.runtime
        self._prev = runtime.jit_post_compile_hook
        runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        runtime = triton.knobs.runtime
        if runtime.jit_post_compile_hook == self._hook:
            runtime.jit_post_compile_hook = self._prev

    @property
    def entries(self) -> list[list[str]]:
        with self._lock:
            return sorted(self._entries.values())

    def write(self, path: Path) -> bool:
        """Store the entries at ``path`` (atomically; nothing when there are none). False when the
        folder is not writable (the next process then warms up in full again)."""
        entries = self.entries
        if not entries:
            return False
        try:
            with atomic_write(path, prefix=f".{path.name}.", durable=False) as f:  # (as Triton's cache: no fsync)
                f.write(json.dumps(entries).encode())
        except OSError as e:
            _log.debug("s4w_core.gpu: the warm-up record %s was not written: %s", path, e)
            return False
        return True


def _read(path: Path) -> list[tuple[JITFunction, str]] | None:
    """The record at ``path`` as ``(kernel, specialization)`` pairs, or None when there is none or
    any entry does not check (not a list of three strings, a kernel that is not the codec's)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_RECORD_BYTES + 1)
    except OSError:
        return None
    if len(raw) > _MAX_RECORD_BYTES:
        return None
    try:
        entries = json.loads(raw)
    except ValueError:
        return None
    ours = kernels()
    if not isinstance(entries, list) or not entries:
        return None
    out = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e)):
            return None
        fn = ours.get((e[0], e[1]))
        if fn is None:
            return None
        out.append((fn, e[2]))
    return out


def preload(device: torch.device, path: Path, loaded: list[list[str]] | None = None) -> bool:
    """Load every kernel of the record at ``path`` (:func:`record_path`) from Triton's disk cache
    into this process, on ``device``, ready to launch. False, having loaded nothing, when there is
    no record or it does not check; False too when Triton refuses an entry (the kernels loaded
    before it stay loaded, and are appended to ``loaded``: a :class:`Recorder` keeps them).

    Each kernel's binary is loaded and its launcher made now rather than at its first launch (in a
    save), through a method of Triton's own (absent: left lazy). Triton compiles each launcher
    signature's C stub once per cache (a C compiler in a child process, 0.1-0.3 s each): where they
    are not in the cache yet (kernels installed from a bundle), they are made on a few threads."""
    entries = _read(path)
    if entries is None:
        return False
    try:
        inits = []
        with torch.cuda.device(device):
            for fn, data in entries:
                kernel = fn.preload(data)
                if loaded is not None:
                    loaded.append([fn.fn.__module__, fn.fn.__qualname__, data])
                init = getattr(kernel, "_init_handles", None)
                if callable(init):
                    inits.append(init)
            if inits:
                inits[0]()  # the first alone: it makes the driver's own module, once per process

        def on_device(init: Any) -> None:
            with torch.cuda.device(device):
                init()

        with ThreadPoolExecutor(max_workers=_LAUNCHER_THREADS, thread_name_prefix="s4w-preload") as pool:
            list(pool.map(on_device, inits[1:]))
    except Exception as e:  # noqa: BLE001 - another Triton's format: the full warm-up instead
        _log.debug("s4w_core.gpu: the warm-up record for %s did not load: %s", device, e)
        return False
    return True

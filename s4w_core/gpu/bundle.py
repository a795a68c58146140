"""Kernels compiled ahead: the codec's Triton kernels shipped with the package for one Triton build
and GPU architecture, so that a process with an empty Triton cache does not compile them at its
first save (docs/PERFORMANCE.md, "A cold Triton cache").

A *bundle* (``bundles/triton-<version>-sm<arch>.zip``) holds what a warm-up left in an empty Triton
cache -- each kernel variant's entry (its metadata, its binary and source, as Triton stores them
with ``TRITON_STORE_BINARY_ONLY=1``) -- and the warm-up's record (:mod:`s4w_core.gpu._kernel_record`),
with an index: the fingerprint of the Triton that compiled them (:func:`fingerprint`: Triton's own
cache key of its sources and libraries, its backend's hash of the ptxas version and architecture,
its cache-invalidating environment variables), a digest of the codec's kernel sources, the warm-up
stages it covers, and the size and SHA-256 of every file.

:func:`install` runs where a warm-up finds no record of its own: when a bundle matches this
process's Triton (the same fingerprint: Triton then computes the same cache keys), the device's
architecture and the kernels' sources, its entries are copied into Triton's on-disk cache and its
record written; the warm-up then loads those kernels as it would after an earlier warm-up on the
machine. Any mismatch, or a bundle that does not check, installs nothing (logged at debug level) and
the warm-up compiles as before. Only the names the index lists are read from the zip, each checked
against its size and digest before it is written; names are checked before they become paths;
nothing in the cache is overwritten; every file is written under a temporary name and renamed.
Triton's group file of an entry (which names the entry's files by absolute path) is written last,
for the paths in this cache: an entry interrupted half way is one Triton does not see.

:func:`build` (``python -m s4w_core.gpu.bundle build --out DIR``, on a machine with the GPU) runs
the warm-up in a child process with an empty Triton cache and packs what it compiled (:func:`pack`).
The bundles in the package are built that way; a kernel changed since makes them not match (the
warm-up compiles as before): ``tests/unit/test_kernel_bundle.py`` fails until they are rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable

from s4w_core import config
from s4w_core._fsutil import atomic_write
from s4w_core.gpu import _kernel_record
from s4w_core.gpu._kernel_record import kernels_digest

__all__ = ["BUNDLES", "FORMAT", "build", "bundle_path", "fingerprint", "install", "pack", "read_index", "sources_digest"]

_log = logging.getLogger("s4w_core.gpu")

#: where the package's bundles are
BUNDLES = Path(__file__).parent / "bundles"
#: the index's format
FORMAT = 1
#: Triton's cache entry directories (base32 of a SHA-256) and file names
_DIR = re.compile(r"[A-Z2-7]{16,64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
#: what an index may declare: a file, all files, the index itself
_MAX_FILE = 16 << 20
_MAX_TOTAL = 128 << 20
_MAX_INDEX = 8 << 20
_GROUP = "__grp__"


def fingerprint(arch: int) -> str | None:
    """What Triton's cache keys depend on beyond a kernel's source and options, for architecture
    ``arch`` (e.g. 90): its own key of its sources and libraries, its backend's hash (the ptxas
    version and the architecture) and its cache-invalidating environment variables; None where this
    Triton does not offer them."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import triton_key

        backend = make_backend(GPUTarget("cuda", arch, 32))
        env = sorted(get_cache_invalidating_env_vars().items())
        return hashlib.sha256(repr((triton_key(), backend.hash(), env)).encode()).hexdigest()
    except Exception as e:  # noqa: BLE001 - another Triton: no bundle applies
        _log.debug("s4w_core.gpu: no Triton fingerprint for sm%s: %s", arch, e)
        return None


def sources_digest() -> str:
    """A digest of the kernels' source text alone (each ``JITFunction.src``), the same under every
    Triton: a test on a machine without the bundle's Triton checks a bundle against it."""
    h = hashlib.sha256()
    for (module, name), fn in sorted(_kernel_record.kernels().items()):
        h.update(f"{module}:{name}:{hashlib.sha256(fn.src.encode()).hexdigest()}\n".encode())
    return h.hexdigest()


def bundle_path(triton_version: str, arch: int, where: Path = BUNDLES) -> Path:
    """Where the bundle for Triton ``triton_version`` and architecture ``arch`` lies in ``where``."""
    return where / f"triton-{triton_version}-sm{arch}.zip"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(cache: Path, record: Path, arch: int, out: Path, keys: Iterable[Any]) -> Path:
    """A bundle at ``out`` of the Triton cache ``cache`` (one a warm-up on architecture ``arch``
    filled from empty) and the warm-up's ``record`` in it, covering the warm-up stage keys
    ``keys``. Only entries of the codec's kernels are packed. Raises ValueError where there is
    nothing to pack or the record names a kernel the cache does not hold."""
    import triton

    fp = fingerprint(arch)
    if fp is None:
        raise ValueError("this Triton offers no fingerprint: no bundle can be made for it")
    entries = json.loads(record.read_text())
    ours = {fn.fn.__name__ for fn in _kernel_record.kernels().values()}
    packed: list[dict[str, Any]] = []
    names: set[str] = set()
    files: dict[str, bytes] = {}
    for d in sorted(p for p in cache.iterdir() if p.is_dir() and _DIR.fullmatch(p.name)):
        for grp in sorted(d.glob(f"{_GROUP}*.json")):
            children = json.loads(grp.read_text())["child_paths"]
            meta_name = grp.name[len(_GROUP):]
            meta = json.loads((d / meta_name).read_text())
            if meta.get("name") not in ours:
                continue
            listed: dict[str, list[Any]] = {}
            for child in sorted(children):
                if not _NAME.fullmatch(child) or child.startswith(_GROUP):
                    raise ValueError(f"unexpected file {child!r} in the cache entry {d.name}")
                data = (d / child).read_bytes()
                listed[child] = [len(data), _sha(data)]
                files[f"cache/{d.name}/{child}"] = data
            packed.append({"dir": d.name, "group": grp.name, "files": listed})
            names.add(meta["name"])
    wanted = {json.loads(e[2])["name"].rsplit(".", 1)[-1] for e in entries}
    if not packed or not wanted <= names:
        raise ValueError(f"the cache {cache} lacks kernels its record names: {sorted(wanted - names)}")
    index = {
        "format": FORMAT,
        "triton": triton.__version__,
        "arch": arch,
        "fingerprint": fp,
        "kernels": kernels_digest(),
        "sources": sources_digest(),
        "keys": [str(k) for k in keys],
        "record": entries,
        "entries": packed,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr("index.json", json.dumps(index, indent=1, sort_keys=True))
        for name, data in sorted(files.items()):
            zf.writestr(name, data)
    os.replace(tmp, out)
    return out


def read_index(zf: zipfile.ZipFile) -> dict[str, Any]:
    """The bundle's index, checked for shape: ValueError where it is not one this code reads."""
    info = zf.getinfo("index.json")
    if info.file_size > _MAX_INDEX:
        raise ValueError("index.json too large")
    index = json.loads(zf.read(info))
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} index")
    for field, kind in (("triton", str), ("arch", int), ("fingerprint", str), ("kernels", str), ("sources", str),
                        ("keys", list), ("record", list), ("entries", list)):
        if not isinstance(index.get(field), kind):
            raise ValueError(f"index field {field!r} missing or not a {kind.__name__}")
    total = 0
    for e in index["entries"]:
        if not (isinstance(e, dict) and isinstance(e.get("dir"), str) and _DIR.fullmatch(e["dir"])
                and isinstance(e.get("group"), str) and e["group"].startswith(_GROUP) and _NAME.fullmatch(e["group"])
                and isinstance(e.get("files"), dict) and e["files"]):
            raise ValueError(f"malformed entry {str(e)[:200]}")
        if e["group"][len(_GROUP):] not in e["files"]:
            raise ValueError(f"entry {e['dir']}: its group names no metadata file")
        for name, spec in e["files"].items():
            if not (_NAME.fullmatch(name) and not name.startswith(_GROUP) and isinstance(spec, list) and len(spec) == 2
                    and isinstance(spec[0], int) and 0 <= spec[0] <= _MAX_FILE and isinstance(spec[1], str)):
                raise ValueError(f"entry {e['dir']}: malformed file {name!r}")
            total += spec[0]
    if total > _MAX_TOTAL:
        raise ValueError("the bundle declares more than 128 MiB")
    return index


def _write_new(path: Path, data: bytes) -> None:
    """``data`` at ``path`` unless something is there already: a temporary name, then a rename."""
    if path.exists():
        return
    with atomic_write(path, prefix=f".{path.name}.", durable=False) as f:  # (as Triton's cache: no fsync)
        f.write(data)


def install(arch: int, record: Path, keys: Iterable[Any], where: Path = BUNDLES) -> bool:
    """Where no ``record`` exists yet and the package has a bundle for this Triton and
    architecture ``arch`` covering the warm-up stage keys ``keys``: copy its kernels into Triton's
    cache and write its record at ``record``. True when the record was written; False, having
    written nothing or only entries Triton ignores without their group file, where there is no
    bundle, it does not match or does not check (``S4W_KERNEL_BUNDLE=0``: never)."""
    if record.exists() or not config.get_bool("S4W_KERNEL_BUNDLE"):
        return False
    try:
        import triton

        path = bundle_path(triton.__version__, arch, where)
        if not path.is_file():
            return False
        if getattr(getattr(triton.knobs, "cache", None), "manager_class", None) is not None:
            _log.debug("s4w_core.gpu: Triton has a cache manager of its own: the kernel bundle is not installed")
            return False
        with zipfile.ZipFile(path) as zf:
            index = read_index(zf)
            why = None
            if index["triton"] != triton.__version__ or index["arch"] != arch:
                why = f"built for Triton {index['triton']} sm{index['arch']}"
            elif not {str(k) for k in keys} <= set(index["keys"]):
                why = f"covers the stages {index['keys']}, not {sorted(str(k) for k in keys)}"
            elif index["kernels"] != kernels_digest():
                why = "its kernels are not this package's"
            elif index["fingerprint"] != fingerprint(arch):
                why = "another Triton build, ptxas or cache-invalidating environment compiled it"
            if why is not None:
                _log.debug("s4w_core.gpu: the kernel bundle %s does not apply: %s", path.name, why)
                return False
            cache = _kernel_record.cache_dir()
            for e in index["entries"]:
                d = cache / e["dir"]
                d.mkdir(parents=True, exist_ok=True)
                for name, (size, digest) in sorted(e["files"].items()):
                    info = zf.getinfo(f"cache/{e['dir']}/{name}")
                    if info.file_size != size:
                        raise ValueError(f"{e['dir']}/{name}: {info.file_size} bytes, the index says {size}")
                    data = zf.read(info)
                    if _sha(data) != digest:
                        raise ValueError(f"{e['dir']}/{name}: its digest is not the index's")
                    _write_new(d / name, data)
                group = {"child_paths": {name: str(d / name) for name in e["files"]}}
                _write_new(d / e["group"], json.dumps(group).encode())
        return _kernel_record.Recorder(index["record"]).write(record)
    except Exception as e:  # noqa: BLE001 - a bundle that does not check: compile as before
        _log.debug("s4w_core.gpu: the kernel bundle was not installed: %s", e)
        return False


#: the build's child: the warm-up, then the stage keys it covered (a line of JSON)
_CHILD = """
import json, sys, torch
from s4w_core.gpu import _warmup
_warmup.run(torch.device(sys.argv[1]))
print(json.dumps([str(k) for k in _warmup.stage_keys(_warmup.DEFAULT_DTYPES)]))
"""


def build(device: Any, out: Path) -> Path:
    """Run the warm-up on CUDA ``device`` in a child process with an empty Triton cache (no bundle
    installed, binaries only) and pack what it compiled into ``out`` (a directory): the bundle for
    this Triton and the device's architecture."""
    import torch

    dev = torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    arch = major * 10 + minor
    import triton

    with tempfile.TemporaryDirectory(prefix="s4w-bundle-") as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=tmp, TRITON_STORE_BINARY_ONLY="1", S4W_KERNEL_BUNDLE="0")
        done = subprocess.run([sys.executable, "-c", _CHILD, str(dev)], env=env, check=True, stdout=subprocess.PIPE, text=True)
        keys = json.loads(done.stdout.strip().splitlines()[-1])
        records = sorted(Path(tmp).glob("s4w-warm-up-*.json"))
        if len(records) != 1:
            raise RuntimeError(f"the warm-up left {len(records)} records in {tmp}")
        return pack(Path(tmp), records[0], arch, bundle_path(triton.__version__, arch, Path(out)), keys)


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m s4w_core.gpu.bundle", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the kernels on this machine's GPU into a bundle")
    b.add_argument("--out", type=Path, default=BUNDLES)
    b.add_argument("--device", default="cuda:0")
    s = sub.add_parser("show", help="a bundle's index, less its record and files")
    s.add_argument("path", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        print(build(args.device, args.out))
    else:
        with zipfile.ZipFile(args.path) as zf:
            index = read_index(zf)
        print(json.dumps({k: v for k, v in index.items() if k not in ("record", "entries")}
                         | {"kernels_packed": len(index["entries"]), "record_entries": len(index["record"])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_main())

"""s4w_core.gpu.bundle: the codec's kernels compiled ahead and shipped for a Triton build and GPU
architecture. On the CPU: one kernel compiled for sm_90 by this machine's Triton (no GPU: a driver
stand-in names the target, Triton's compiler needs no device) is packed, installed into an empty
cache and then found there by Triton (a cache hit, nothing compiled); a bundle that does not match
or does not check installs nothing Triton would use. The bundles in the package match today's kernel
sources. On the device, tests/parity/test_gpu_warmup.py checks a warm-up with the package's bundle."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from s4w_core.gpu import _kernel_record, _warmup, bundle  # noqa: E402
from s4w_core.gpu import kernels as gpu_kernels  # noqa: E402

ARCH = 90
KEYS = ["2", "4", "bytes"]
ROOT = Path(__file__).resolve().parents[2]


class _TargetOnly:
    """A driver stand-in: the device and target Triton's JIT asks for while it compiles (it
    launches nothing when warming up)."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@pytest.fixture
def on_sm90(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The fold64 kernel with a fresh per-device cache, compiling for sm_90 through the stand-in."""
    fn = gpu_kernels._fold64_batched_kernel
    monkeypatch.setattr(fn, "device_caches", defaultdict(fn.create_binder))
    before = getattr(driver, "_active", None)  # (None: Triton picks its default when asked; here none is usable)
    driver.set_active(_TargetOnly(ARCH))
    try:
        yield fn
    finally:
        driver.set_active(before)


def _compile(fn: Any) -> None:
    items = torch.zeros(64, dtype=torch.int64)
    acc = torch.zeros(64, dtype=torch.int64)
    fn.warmup(items, torch.zeros(64, dtype=torch.int32), acc, WORDS=True, BLOCK=1024, grid=(1,))


@pytest.fixture
def built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_sm90: Any) -> tuple[Path, list[list[str]]]:
    """A bundle of the fold64 kernel for sm_90 (in ``tmp_path / "bundles"``) and its record."""
    cache = tmp_path / "built"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("TRITON_STORE_BINARY_ONLY", "1")
    with _kernel_record.Recorder() as rec:
        _compile(on_sm90)
    assert len(rec.entries) == 1
    record = cache / "s4w-warm-up-test.json"
    assert rec.write(record)
    out = bundle.pack(cache, record, ARCH, bundle.bundle_path(triton.__version__, ARCH, tmp_path / "bundles"), KEYS)
    # a fresh, empty cache for what follows
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.delenv("TRITON_STORE_BINARY_ONLY")
    on_sm90.device_caches = defaultdict(on_sm90.create_binder)
    return out, rec.entries


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_a_bundle_installs_into_an_empty_cache_and_triton_finds_it(tmp_path: Path, built: Any, on_sm90: Any) -> None:
    out, entries = built
    with zipfile.ZipFile(out) as zf:
        index = bundle.read_index(zf)
    assert index["triton"] == triton.__version__ and index["arch"] == ARCH and index["keys"] == KEYS
    assert index["kernels"] == _kernel_record.kernels_digest() and index["sources"] == bundle.sources_digest()
    assert index["fingerprint"] == bundle.fingerprint(ARCH)
    assert len(index["entries"]) == 1 and any(n.endswith(".cubin") for n in index["entries"][0]["files"])
    fresh = tmp_path / "fresh"
    record = fresh / "s4w-warm-up-x.json"
    assert bundle.install(ARCH, record, ["2"], where=out.parent)
    assert json.loads(record.read_text()) == entries
    e = index["entries"][0]
    group = json.loads((fresh / e["dir"] / e["group"]).read_text())["child_paths"]
    assert group == {name: str(fresh / e["dir"] / name) for name in e["files"]}  # paths of this cache
    shutil.rmtree(tmp_path / "built")  # (what Triton finds is in the fresh cache)
    # Triton finds the kernel: a cache hit, nothing compiled
    seen: list[bool] = []
    triton.knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
    try:
        on_sm90.preload(entries[0][2])
        _compile(on_sm90)  # (the JIT's own lookup, as a save would launch it)
    finally:
        triton.knobs.compilation.listener = None
    assert seen == [True]
    before = _files(fresh)
    assert not bundle.install(ARCH, record, ["2"], where=out.parent)  # a record exists: nothing to do
    assert _files(fresh) == before


def test_processes_installing_at_once_leave_one_complete_copy(tmp_path: Path, built: Any) -> None:
    """Ranks of one node warm up together: four processes installing the same bundle into one empty
    cache fail in none (a process that finds the record written already installs nothing: False),
    and leave each file once, complete, and no temporary file."""
    out, entries = built
    fresh = tmp_path / "fresh"
    record = fresh / "s4w-warm-up-x.json"
    code = (
        "import logging, sys; from pathlib import Path; from s4w_core.gpu import bundle\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
        f"print(bundle.install({ARCH}, Path(sys.argv[1]), {KEYS!r}, where=Path(sys.argv[2])))\n"
    )
    env = dict(os.environ, TRITON_CACHE_DIR=str(fresh))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", code, str(record), str(out.parent)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    assert "True" in [r[0].strip() for r in results]
    assert not [r[1] for r in results if "not installed" in r[1] or "does not apply" in r[1]]  # no failure, no mismatch
    with zipfile.ZipFile(out) as zf:
        index = bundle.read_index(zf)
        want = {f"{e['dir']}/{name}": zf.read(f"cache/{e['dir']}/{name}") for e in index["entries"] for name in e["files"]}
    got = {f for f in _files(fresh) if "/" in f and "__grp__" not in f}
    assert got == set(want) and all((fresh / f).read_bytes() == want[f] for f in got)
    assert not [f for f in _files(fresh) if f.endswith(".tmp")]
    assert json.loads(record.read_text()) == entries


def _rewrite(src: Path, edit: Callable[[dict[str, Any], dict[str, bytes]], None]) -> None:
    """``src`` with its index and files changed by ``edit(index, files)``."""
    with zipfile.ZipFile(src) as zf:
        files = {n: zf.read(n) for n in zf.namelist()}
    index = json.loads(files.pop("index.json"))
    edit(index, files)
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("index.json", json.dumps(index))
        for n, data in files.items():
            zf.writestr(n, data)


def _entry(index: dict[str, Any]) -> dict[str, Any]:
    return index["entries"][0]


def _cubin(index: dict[str, Any]) -> str:
    return next(n for n in _entry(index)["files"] if n.endswith(".cubin"))


def _flip_a_byte(index: dict[str, Any], files: dict[str, bytes]) -> None:
    name = f"cache/{_entry(index)['dir']}/{_cubin(index)}"
    data = bytearray(files[name])
    data[len(data) // 2] ^= 1
    files[name] = bytes(data)


def _traversal(index: dict[str, Any], files: dict[str, bytes]) -> None:
    e = _entry(index)
    name = _cubin(index)
    e["files"]["../../escaped.cubin"] = e["files"].pop(name)
    files[f"cache/{e['dir']}/../../escaped.cubin"] = files.pop(f"cache/{e['dir']}/{name}")


def _set(field: str, value: Any) -> Callable[[dict[str, Any], dict[str, bytes]], None]:
    return lambda index, files: index.__setitem__(field, value)


@pytest.mark.parametrize("edit", [
    _set("kernels", "0" * 64),  # another package's kernels
    _set("fingerprint", "0" * 64),  # another Triton build, ptxas or environment
    _set("keys", ["2"]),  # does not cover the stages asked for
    _set("format", 99),
    _set("arch", 80),
    lambda index, files: _entry(index).__setitem__("dir", "../../up"),
    _traversal,
    _flip_a_byte,
    lambda index, files: _entry(index)["files"][_cubin(index)].__setitem__(0, 10 ** 9),  # declares more than it may
], ids=["kernels", "fingerprint", "keys", "format", "arch", "dir-traversal", "file-traversal", "digest", "size"])
def test_a_bundle_that_does_not_apply_or_check_installs_nothing_triton_uses(
        tmp_path: Path, built: Any, edit: Callable[[dict[str, Any], dict[str, bytes]], None]) -> None:
    out, _ = built
    _rewrite(out, edit)
    fresh = tmp_path / "fresh"
    record = fresh / "s4w-warm-up-x.json"
    before = _files(tmp_path)
    assert not bundle.install(ARCH, record, KEYS, where=out.parent)
    assert not record.exists()
    # nothing outside the cache; inside it no group file (Triton sees an entry only through it)
    new = sorted(set(_files(tmp_path)) - set(before))
    assert all(f.startswith("fresh/") for f in new), new
    assert not [f for f in new if "__grp__" in f], new


def test_no_bundle_switched_off_or_another_triton(tmp_path: Path, built: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = built
    record = tmp_path / "fresh" / "s4w-warm-up-x.json"
    assert not bundle.install(ARCH, record, KEYS, where=tmp_path / "nowhere")
    assert not bundle.install(86, record, KEYS, where=out.parent)  # no bundle for this architecture
    monkeypatch.setenv("S4W_KERNEL_BUNDLE", "0")
    assert not bundle.install(ARCH, record, KEYS, where=out.parent)
    monkeypatch.delenv("S4W_KERNEL_BUNDLE")
    monkeypatch.setattr(triton, "__version__", "0.0.0")  # the file name names the Triton it is for
    assert not bundle.install(ARCH, record, KEYS, where=out.parent)
    assert not (tmp_path / "fresh").exists()


def test_pack_refuses_a_record_the_cache_does_not_hold(tmp_path: Path, built: Any) -> None:
    fn = _kernel_record.kernels()[("s4w_core.planes.triton_kernels", "_split_kernel")]
    record = tmp_path / "other.json"
    record.write_text(json.dumps([[fn.fn.__module__, fn.fn.__qualname__, json.dumps({"name": fn.fn.__name__})]]))
    with pytest.raises(ValueError, match="lacks kernels"):
        bundle.pack(tmp_path / "built", record, ARCH, tmp_path / "x.zip", KEYS)


@pytest.mark.parametrize("path", sorted(bundle.BUNDLES.glob("*.zip")), ids=lambda p: p.name)
def test_the_packaged_bundles_hold_todays_kernels(path: Path) -> None:
    """A kernel changed since a bundle was built makes it useless (its cache keys differ): rebuild it
    on a GPU of its architecture (``python -m s4w_core.gpu.bundle build``, docs/DEVELOPING.md)."""
    with zipfile.ZipFile(path) as zf:
        index = bundle.read_index(zf)
        for e in index["entries"]:
            for name, (size, digest) in e["files"].items():
                data = zf.read(f"cache/{e['dir']}/{name}")
                assert len(data) == size and hashlib.sha256(data).hexdigest() == digest, (e["dir"], name)
    assert path == bundle.bundle_path(index["triton"], index["arch"])
    assert index["sources"] == bundle.sources_digest(), f"{path.name} was built from other kernel sources: rebuild it"
    assert {str(k) for k in _warmup.stage_keys(_warmup.DEFAULT_DTYPES)} <= set(index["keys"])
    ours = _kernel_record.kernels()
    assert index["record"] and all((e[0], e[1]) in ours for e in index["record"])

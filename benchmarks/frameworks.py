#!/usr/bin/env python3
"""Checkpointing inside real training, framework by framework: what s4weights costs a user.

Trains a GPT-2-shaped model (built from a config, byte vocabulary, never downloaded) on real text
(the Python standard library's sources, :func:`benchmarks._train_gpt.corpus`) with each framework,
the way docs/INTEGRATIONS.md tells users to, and runs side by side -- one process per run, so a
"cold" run really starts cold:

* ``none``    -- the same training without any checkpointing (the baseline of *overhead*);
* ``default`` -- the framework's own checkpointing: Lightning ``ModelCheckpoint(every_n_train_steps,
  save_last=True, save_top_k)``; HF ``Trainer(save_steps, save_total_limit)``; Accelerate
  ``save_state()`` every N steps (automatic naming, ``total_limit``); a plain loop with
  ``dcp.async_save`` and DCP's ``FileSystemWriter``;
* ``s4w``     -- the same plus s4weights as documented: ``Trainer(plugins=[S4CheckpointIO()])``,
  ``Trainer(callbacks=[S4Callback()])``, ``S4W_ACCELERATE=1`` + ``import s4w_accelerate``,
  ``dcp.async_save(state, storage_writer=S4StorageWriter(path))``; once with an empty
  ``TRITON_CACHE_DIR`` (``cold``) and once more with the cache the cold run filled (``warm``);
  with ``--async-saves`` also the adapters' ``async_save=True`` (``s4w-async-warm``);
* ``s4w-nofsync-*`` (``--no-fsync-runs``) -- the same with the default's durability: the store's
  ``durable=False`` (temp file + rename, no fsync), the like-for-like comparison with the
  frameworks' own files, which stay in the page cache.

Per run: whole wall time (framework objects built, ``fit``/``train``/the loop, pending saves
finished), checkpoint overhead (wall minus the ``none`` run's), time blocked in each save (inside
the framework's save call), bytes on disk at the end (everything the run left), bytes written
(``/proc/self/io``: ``write_bytes`` where the file system counts them, ``wchar`` always), fsync
calls and seconds (durability: the frameworks' defaults do not fsync; s4weights' store does), peak
host RSS and peak GPU memory (``torch.cuda.max_memory_allocated``), time to resume (the newest
checkpoint loaded into the model and optimizer the documented way, after both were zeroed; the
median of ``--resume-repeats`` resumes, each checked) and whether the resumed state is bit-identical, and for every run a sampling profile (every thread's
Python stack every ``--sample-ms``): where the main thread's time went, and what background
threads did, in s4weights code and overall.

Writes ``OUT/frameworks_<precision>.json`` and ``OUT/frameworks_<precision>.md`` (table + the
issue's targets as PASS/FAIL lines).  ``--smoke`` runs a tiny model on the CPU in one process
(``tests/test_frameworks_bench_smoke.py``).

Usage (GPU machine, one precision per call, within 10 minutes)::

    python benchmarks/frameworks.py --precision bf16 --out runs/fw
    python benchmarks/frameworks.py --precision fp32master --out runs/fw --only lightning,hf
    python benchmarks/frameworks.py --smoke --out /tmp/fw_smoke
    python benchmarks/frameworks.py --merge a/frameworks_bf16.json b/frameworks_bf16.json --out runs/fw
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import platform
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

FRAMEWORKS = ("lightning", "hf", "accelerate", "dcp")
#: runs per framework, in order: (mode, triton cache)
RUNS = (("none", ""), ("default", ""), ("s4w", "cold"), ("s4w", "warm"))

#: GPT-2 shapes (byte vocabulary): bf16 ~151 M parameters, fp32master ~303 M, smoke ~0.1 M.
SIZES: dict[str, dict[str, int]] = {
    "bf16": {"n_layer": 12, "n_embd": 1024, "n_head": 16, "ctx": 512, "batch": 8},
    "fp32master": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "ctx": 512, "batch": 8},
    "smoke": {"n_layer": 2, "n_embd": 64, "n_head": 2, "ctx": 64, "batch": 4},
    # the CPU model of issue #23 (~0.5 M parameters)
    "cpu-small": {"n_layer": 4, "n_embd": 96, "n_head": 2, "ctx": 64, "batch": 4},
}

DURABILITY = {
    ("lightning", "default"): "no fsync (torch.save through fsspec)",
    ("hf", "default"): "no fsync (safetensors + torch.save)",
    ("accelerate", "default"): "no fsync (safetensors + torch.save)",
    ("dcp", "default"): "fsync of each file (FileSystemWriter sync_files=True)",
    ("lightning", "s4w"): "store commit fsynced (temp file, fsync, rename)",
    ("hf", "s4w"): "store commit fsynced (no checkpoint folder written)",
    ("accelerate", "s4w"): "store commit fsynced (no checkpoint folder written)",
    ("dcp", "s4w"): "containers and metadata fsynced",
}


# ============================================================================ measurement helpers
class FsyncCounter:
    """Counts ``os.fsync``/``os.fdatasync`` calls and their seconds (installed before any import
    that could bind them)."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self._lock = threading.Lock()
        for name in ("fsync", "fdatasync"):
            orig = getattr(os, name, None)
            if orig is not None and not getattr(orig, "_fw_counted", False):
                setattr(os, name, self._wrap(orig))

    def _wrap(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        def counted(fd: Any) -> None:
            t = time.perf_counter()
            try:
                fn(fd)
            finally:
                with self._lock:
                    self.calls += 1
                    self.seconds += time.perf_counter() - t

        counted._fw_counted = True  # type: ignore[attr-defined]
        return counted

    def snapshot(self) -> tuple[int, float]:
        with self._lock:
            return self.calls, self.seconds


def proc_io() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def files_of(path: str) -> list[tuple[str, int]]:
    """Every file under ``path`` (relative path, size), largest first."""
    out = []
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out.append((os.path.relpath(p, path), st.st_size))
    return sorted(out, key=lambda x: -x[1])


class Sampler(threading.Thread):
    """Every ``interval`` seconds, every thread's Python stack: inclusive and leaf counts per
    function, split into the main thread and the others (a small py-spy without native frames)."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True, name="fw-sampler")
        self.interval = interval
        self.stop_ev = threading.Event()
        self.samples = 0
        self.incl: dict[str, collections.Counter[str]] = {"main": collections.Counter(), "other": collections.Counter()}
        self.leaf: dict[str, collections.Counter[str]] = {"main": collections.Counter(), "other": collections.Counter()}
        self.other_busy = 0  # samples with at least one non-idle background thread
        self.peak_gpu_used = 0  # device memory in use (all allocators, the context), sampled

    @staticmethod
    def _key(code: Any) -> str:
        return Sampler.key_of((code.co_filename, 0, code.co_name))

    @staticmethod
    def key_of(func: tuple[str, int, str]) -> str:
        """``file:function`` with the file relative to site-packages or the repository."""
        fn, _line, name = func
        for marker in ("site-packages/", "dist-packages/", "/lib/python"):
            i = fn.rfind(marker)
            if i >= 0:
                fn = fn[i + len(marker) :]
                break
        else:
            if fn.startswith(ROOT):
                fn = fn[len(ROOT) + 1 :]
        return f"{fn}:{name}"

    _IDLE = ("threading.py:wait", "threading.py:_wait_for_tstate_lock", "queue.py:get", "selectors.py:select",
             "concurrent/futures/thread.py:_worker", "threading.py:join")

    def run(self) -> None:
        main_id = threading.main_thread().ident
        me = threading.get_ident()
        torch = sys.modules.get("torch")
        while not self.stop_ev.wait(self.interval):
            if torch is not None and torch.cuda.is_initialized():
                free, total = torch.cuda.mem_get_info()
                self.peak_gpu_used = max(self.peak_gpu_used, total - free)
            frames = sys._current_frames()  # noqa: SLF001 - the sampling profiler's one source
            self.samples += 1
            busy = False
            for tid, frame in frames.items():
                if tid == me:
                    continue
                role = "main" if tid == main_id else "other"
                f = frame
                leaf = self._key(f.f_code)
                if role == "other" and leaf.endswith(self._IDLE):
                    continue
                if role == "other":
                    busy = True
                seen = set()
                while f is not None:
                    seen.add(self._key(f.f_code))
                    f = f.f_back
                self.incl[role].update(seen)
                self.leaf[role][leaf] += 1
            self.other_busy += busy

    def stop(self) -> dict[str, Any]:
        self.stop_ev.set()
        self.join(5)
        iv = self.interval

        def top(c: collections.Counter[str], n: int, pred: Callable[[str], bool] = lambda k: True) -> list:
            return [[k, round(v * iv, 3)] for k, v in c.most_common() if pred(k)][:n]

        def ours(k: str) -> bool:
            return k.startswith(("s4w_core/", "integrations/", "s4w_lightning/", "s4w_transformers/", "s4w_accelerate/"))

        def save_path(k: str) -> bool:
            return ours(k) or any(
                s in k
                for s in (
                    "torch/serialization.py:save", "safetensors/torch.py:save", "checkpoint_io.py:save",
                    "distributed/checkpoint/", "trainer.py:_save_checkpoint", "accelerator.py:save_state",
                    "model_checkpoint.py:", "checkpoint_connector.py:", "cloud_io.py:",
                )
            )

        return {
            "interval_s": iv,
            "samples": self.samples,
            "peak_gpu_used_bytes": self.peak_gpu_used,
            "other_threads_busy_s": round(self.other_busy * iv, 3),
            "main_save_path_s": top(self.incl["main"], 25, save_path),
            "main_s4w_s": top(self.incl["main"], 25, ours),
            "main_leaf_s": top(self.leaf["main"], 15),
            "other_s4w_s": top(self.incl["other"], 20, ours),
            "other_leaf_s": top(self.leaf["other"], 10),
        }


# ============================================================================ models, data, state
def gpt2(size: dict[str, int], precision: str, device: Any) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=256, n_positions=size["ctx"], n_embd=size["n_embd"], n_layer=size["n_layer"],
        n_head=size["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains (a 300 M model's init on the host takes seconds)
        model = GPT2LMHeadModel(cfg)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    return model


class TextDataset:
    """``n`` windows of ``ctx + 0`` bytes of real text, as HF-style ``{"input_ids", "labels"}``."""

    def __init__(self, n: int, ctx: int, seed: int = 0) -> None:
        import torch

        sys.path.insert(0, HERE)
        from _train_gpt import corpus

        data = corpus(8 << 20)
        g = torch.Generator().manual_seed(seed)
        ix = torch.randint(0, data.numel() - ctx - 1, (n,), generator=g)
        self.x = torch.stack([data[i : i + ctx] for i in ix.tolist()]).long()

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def live_state(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict()["state"]}


def tensors_of(tree: Any, prefix: str = "") -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(tensors_of(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(tensors_of(v, f"{prefix}/{i}"))
    return out


def cpu_snapshot(model: Any, opt: Any) -> dict[str, Any]:
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors_of(live_state(model, opt)).items()}


def state_bytes(model: Any, opt: Any) -> int:
    seen: set[int] = set()
    n = 0
    for t in tensors_of(live_state(model, opt)).values():
        p = t.untyped_storage().data_ptr()
        if p not in seen:
            seen.add(p)
            n += t.untyped_storage().nbytes()
    return n


def scramble(model: Any, opt: Any) -> None:
    """Zero every parameter and optimizer tensor in place, so a resume that loads nothing fails."""
    import torch

    with torch.no_grad():
        for t in tensors_of(live_state(model, opt)).values():
            t.zero_()


def compare(snap: dict[str, Any], model: Any, opt: Any) -> dict[str, Any]:
    import torch

    now = {k: t.detach().cpu() for k, t in tensors_of(live_state(model, opt)).items()}
    bad = [k for k, t in snap.items() if k not in now or now[k].dtype != t.dtype or now[k].shape != t.shape
           or not torch.equal(now[k].reshape(-1).view(torch.uint8) if t.numel() else now[k], t.reshape(-1).view(torch.uint8) if t.numel() else t)]
    return {"tensors": len(snap), "mismatched": len(bad), "first_mismatches": bad[:5], "bit_identical": not bad}


def sync(device: Any) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


# ============================================================================ one run per framework
class SaveTimer:
    """The time each save blocks training (``blocked``, with when it began: ``began``), and the end of
    every training step (``steps``, host clock, taken before that step's save): what the overhead
    decomposition (:func:`phases`) is made from."""

    def __init__(self) -> None:
        self.blocked: list[float] = []
        self.began: list[float] = []
        self.steps: list[float] = []
        self.t0: float | None = None  # the start of the run's wall time (set by the runner)

    def add(self, t: float) -> None:
        """A save that blocked from ``t`` (perf_counter) until now."""
        self.blocked.append(time.perf_counter() - t)
        self.began.append(t)

    def step(self) -> None:
        self.steps.append(time.perf_counter())

    def wrap(self, fn: Callable[..., Any], when: Callable[..., bool] = lambda *a, **k: True) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if when(*a, **k):
                    self.add(t)

        return timed


def phases(timer: SaveTimer, wall: float) -> dict[str, Any]:
    """A run's wall time in three parts that add up to it: ``setup_s`` (building the framework's
    objects up to the end of the first step), ``span_s`` (the first step's end to the last one's:
    the training steps, with the saves that block between them, ``blocked_in_span_s``) and
    ``end_s`` (the last step's end to the end of the wall time: the last save and every wait at the
    end of training). Host clock: the steps' ends are taken without a device synchronization (the
    host runs at most a few kernels' queue ahead of the GPU at a step's end)."""
    if not timer.steps or timer.t0 is None:
        return {}
    t0 = timer.t0
    first, last = timer.steps[0], timer.steps[-1]
    return {
        "steps": len(timer.steps),
        "setup_s": first - t0,
        "span_s": last - first,
        "blocked_in_span_s": sum(b for b, at in zip(timer.blocked, timer.began) if first <= at < last),
        "end_s": t0 + wall - last,
    }


def durable_run(name: str) -> bool:
    """Whether the s4weights run ``name`` keeps the store's fsyncs (all but ``s4w-nofsync-*``)."""
    return "nofsync" not in name


def _store_options(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The store settings a run adds to the README's: ``durable=False`` for the runs with the
    default's durability (``s4w-nofsync-*``), and those of ``--store-option`` (a diagnostic)."""
    opts = dict(spec.get("store_options") or {})
    if not spec.get("durable", True):
        opts["durable"] = False
    return opts or None


def parse_store_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items (the value as JSON where it parses, else the text) as a dict."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--store-option {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def run_lightning(spec: dict[str, Any], ds: TextDataset, device: Any, timer: SaveTimer) -> dict[str, Any]:
    import torch

    try:
        import lightning as L
        from lightning.pytorch.callbacks import ModelCheckpoint
        from lightning.pytorch.plugins.io import TorchCheckpointIO
    except ImportError:  # pragma: no cover - the other flavour
        import pytorch_lightning as L  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import ModelCheckpoint  # type: ignore[no-redef]
        from pytorch_lightning.plugins.io import TorchCheckpointIO  # type: ignore[no-redef]

    size, precision, mode = spec["size"], spec["precision"], spec["mode"]
    model = gpt2(size, precision, device)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, Any], _i: int) -> Any:
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

    module = Module()
    loader = torch.utils.data.DataLoader(ds, batch_size=size["batch"], shuffle=False, num_workers=0)
    run_dir = spec["run_dir"]
    if mode == "s4w":  # imported before the timed window, as a script's imports are
        from s4w_lightning import S4CheckpointIO
    t0 = time.perf_counter()
    class Marks(L.Callback):
        def on_train_batch_end(self, *a: Any, **k: Any) -> None:
            timer.step()  # before the save: Lightning runs checkpoint callbacks last

    callbacks: list[Any] = [Marks()]
    plugins: list[Any] = []
    if mode != "none":
        ckpt = ModelCheckpoint(dirpath=os.path.join(run_dir, "ckpts"), every_n_train_steps=spec["every"],
                               save_last=True, save_top_k=spec["keep"], monitor="step", mode="max")
        ckpt.on_train_batch_end = timer.wrap(  # type: ignore[method-assign]
            ckpt.on_train_batch_end, lambda trainer, *a, **k: trainer.global_step % spec["every"] == 0)
        callbacks.append(ckpt)
    if mode == "s4w":
        plugins.append(S4CheckpointIO(async_save=spec.get("async", False), store_options=_store_options(spec)))
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        precision="bf16-true" if precision == "bf16" else "bf16-mixed", max_steps=spec["steps"],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=mode != "none",
        callbacks=callbacks, plugins=plugins, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=run_dir,
    )
    trainer.fit(module, loader)
    sync(device)
    wall = time.perf_counter() - t0
    opt = trainer.optimizers[0]
    timer.t0 = t0

    def resume() -> None:
        path = os.path.join(run_dir, "ckpts", "last.ckpt")
        io = type(plugins[0])() if plugins else TorchCheckpointIO()  # a fresh plugin, as a new process has
        ck = io.load_checkpoint(path)
        module.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer_states"][0])
        sync(device)

    return {"wall": wall, "model": module, "opt": opt, "resume": resume if mode != "none" else None}


def run_hf(spec: dict[str, Any], ds: TextDataset, device: Any, timer: SaveTimer) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    size, precision, mode = spec["size"], spec["precision"], spec["mode"]
    model = gpt2(size, precision, device)
    run_dir = spec["run_dir"]
    every = spec["every"]

    # the save happens between on_step_end and the next step (or the end): S4Callback's in its own
    # on_step_begin / on_train_end, the Trainer's after every callback's on_step_end. The gap opens
    # in the first callback's on_step_end and closes in the last one's on_step_begin / on_train_end.
    gap: dict[str, Any] = {"t": None, "step": 0}

    class GapOpen(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            timer.step()
            gap["t"], gap["step"] = time.perf_counter(), state.global_step

    class GapClose(TrainerCallback):
        def _close(self) -> None:
            if gap["t"] is not None and gap["step"] % every == 0 and mode != "none":
                timer.add(gap["t"])
            gap["t"] = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._close()

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._close()

    if mode == "s4w":  # imported before the timed window, as a script's imports are
        from s4w_transformers import S4Callback
    t0 = time.perf_counter()
    callbacks: list[Any] = [GapOpen()]
    if mode == "s4w":
        callbacks.append(S4Callback(async_save=spec.get("async", False), store_options=_store_options(spec)))
    callbacks.append(GapClose())
    args = TrainingArguments(
        output_dir=os.path.join(run_dir, "out"), max_steps=spec["steps"], per_device_train_batch_size=size["batch"],
        learning_rate=3e-4, weight_decay=0.1, save_strategy="no" if mode == "none" else "steps", save_steps=every,
        save_total_limit=spec["keep"], logging_strategy="no", report_to=[], dataloader_num_workers=0,
        bf16=precision == "fp32master", use_cpu=device.type != "cuda", seed=0, disable_tqdm=True,
        optim="adamw_torch",
    )
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
    trainer.train()
    sync(device)
    wall = time.perf_counter() - t0
    opt = trainer.optimizer
    timer.t0 = t0

    def resume() -> None:
        from safetensors.torch import load_file

        if mode == "s4w":  # what resume_from_checkpoint=True does with S4Callback: the step into the live objects
            from s4w_core import CheckpointStore

            st = CheckpointStore(os.path.join(run_dir, "out", ".s4w"), base_cache_bytes=0)
            tree = st.load(map_location=device)
            model.load_state_dict(tree["model"], strict=False)
            opt.load_state_dict(tree["optimizer"])
            st.close()
            sync(device)
            return
        folder = os.path.join(run_dir, "out", f"checkpoint-{spec['steps']}")
        sd = load_file(os.path.join(folder, "model.safetensors"), device=str(device))
        model.load_state_dict(sd, strict=False)
        opt.load_state_dict(torch.load(os.path.join(folder, "optimizer.pt"), map_location=device, weights_only=True))
        sync(device)

    return {"wall": wall, "model": model, "opt": opt, "resume": resume if mode != "none" else None}


def run_accelerate(spec: dict[str, Any], ds: TextDataset, device: Any, timer: SaveTimer) -> dict[str, Any]:
    import torch

    size, precision, mode = spec["size"], spec["precision"], spec["mode"]
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    model = gpt2(size, precision, device)
    run_dir = spec["run_dir"]
    if mode == "s4w":  # the switch and the import before the timed window, as a launcher's and a script's are
        os.environ["S4W_ACCELERATE"] = "1"
        if spec.get("async"):
            os.environ["S4W_ACCELERATE_ASYNC"] = "1"
        if not spec.get("durable", True):
            os.environ["S4W_ACCELERATE_DURABLE"] = "0"
        import s4w_accelerate
    t0 = time.perf_counter()
    if mode == "s4w":
        s4w_accelerate.enable_from_env()  # the import did it in a fresh process; again in --smoke's

    acc = Accelerator(
        mixed_precision="bf16" if precision == "fp32master" else "no", cpu=device.type != "cuda",
        project_config=ProjectConfiguration(project_dir=run_dir, automatic_checkpoint_naming=True,
                                            total_limit=spec["keep"]),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(ds, batch_size=size["batch"], shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    step = 0
    for batch in loader:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        timer.step()
        if mode != "none" and step % spec["every"] == 0:
            timer.wrap(acc.save_state)()
        if step >= spec["steps"]:
            break
    if mode == "s4w":
        import s4w_accelerate

        s4w_accelerate.finish_pending()
    sync(device)
    wall = time.perf_counter() - t0
    timer.t0 = t0

    def resume() -> None:
        folder = os.path.join(run_dir, "checkpoints")
        newest = max(os.listdir(folder), key=lambda n: int(n.rsplit("_", 1)[-1]))
        acc.load_state(os.path.join(folder, newest))
        sync(device)

    def finish() -> None:
        if mode == "s4w":
            import s4w_accelerate

            s4w_accelerate.disable()
            os.environ.pop("S4W_ACCELERATE", None)
            os.environ.pop("S4W_ACCELERATE_ASYNC", None)
            os.environ.pop("S4W_ACCELERATE_DURABLE", None)

    return {"wall": wall, "model": model, "opt": opt, "resume": resume if mode != "none" else None, "finish": finish}


def run_dcp(spec: dict[str, Any], ds: TextDataset, device: Any, timer: SaveTimer) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    size, precision, mode = spec["size"], spec["precision"], spec["mode"]
    model = gpt2(size, precision, device)
    run_dir = spec["run_dir"]
    os.makedirs(run_dir, exist_ok=True)
    if not dist.is_initialized():  # DCP's async_save coordinates through a process group: gloo, one rank
        dist.init_process_group("gloo", store=dist.FileStore(run_dir.rstrip("/") + ".pg", 1), rank=0, world_size=1)
    if mode == "s4w":  # imported before the timed window, as a script's imports are
        from s4w_core import S4StorageWriter
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(ds, batch_size=size["batch"], shuffle=False)
    amp = precision == "fp32master"
    fut = None
    step = 0
    for batch in loader:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        timer.step()
        if mode != "none" and step % spec["every"] == 0:
            t = time.perf_counter()
            if fut is not None:
                fut.result()
            path = os.path.join(run_dir, "ckpt", f"step_{step}")
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            if mode == "s4w":
                fut = dcp.async_save(state, storage_writer=S4StorageWriter(path))
            else:
                fut = dcp.async_save(state, checkpoint_id=path)
            timer.add(t)
        if step >= spec["steps"]:
            break
    if fut is not None:
        fut.result()
    sync(device)
    wall = time.perf_counter() - t0
    timer.t0 = t0

    def resume() -> None:
        path = os.path.join(run_dir, "ckpt", f"step_{spec['steps']}")
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        if mode == "s4w":
            from s4w_core import S4StorageReader

            dcp.load(state, storage_reader=S4StorageReader(path))
        else:
            dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        sync(device)

    return {"wall": wall, "model": model, "opt": opt, "resume": resume if mode != "none" else None}


def profiled(fn: Callable[[], None], n: int = 12) -> dict[str, Any]:
    """Run ``fn`` under cProfile: the functions with the most own time and the most cumulative
    time (the resume's breakdown; the profiler adds ~10-30 % to what it measures)."""
    pr = cProfile.Profile()
    pr.enable()
    try:
        fn()
    finally:
        pr.disable()
    st = pstats.Stats(pr)
    rows = [(Sampler.key_of(func), tt, ct) for func, (_cc, _nc, tt, ct, _callers) in st.stats.items()]  # type: ignore[attr-defined]
    return {
        "own_s": [[k, round(tt, 4)] for k, tt, _ in sorted(rows, key=lambda x: -x[1])[:n]],
        "cumulative_s": [[k, round(ct, 4)] for k, _, ct in sorted(rows, key=lambda x: -x[2])[:n]],
    }


RUNNERS = {"lightning": run_lightning, "hf": run_hf, "accelerate": run_accelerate, "dcp": run_dcp}


def child(spec: dict[str, Any], fsyncs: FsyncCounter) -> dict[str, Any]:
    """One run; returns its measurements (JSON-able)."""
    import torch

    device = torch.device(spec["device"])
    if spec.get("torch_threads"):
        torch.set_num_threads(spec["torch_threads"])
    ds = TextDataset(spec["steps"] * spec["size"]["batch"], spec["size"]["ctx"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer = SaveTimer()
    io0, (f0, fs0) = proc_io(), fsyncs.snapshot()
    sampler = Sampler(spec["sample_ms"] / 1000.0)
    sampler.start()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    r = RUNNERS[spec["framework"]](spec, ds, device, timer)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    prof = sampler.stop()
    io1, (f1, fs1) = proc_io(), fsyncs.snapshot()
    out: dict[str, Any] = {
        "wall_s": r["wall"],
        # CPU seconds of every thread of the process (model built, training, saves): steadier than the
        # wall time on a shared machine
        "cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
        "blocked_s": timer.blocked,
        "saves": len(timer.blocked),
        "write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
        "wchar": io1.get("wchar", 0) - io0.get("wchar", 0),
        "fsync_calls": f1 - f0,
        "fsync_s": fs1 - fs0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
        "peak_gpu_used_bytes": prof["peak_gpu_used_bytes"],
        "cancelled_write_bytes": io1.get("cancelled_write_bytes", 0) - io0.get("cancelled_write_bytes", 0),
        "state_bytes": state_bytes(r["model"], r["opt"]),
        "profile": prof,
        "phases": phases(timer, r["wall"]),
        # each training step's end (host clock, seconds from the start of the wall time): the step
        # times around the saves, for the overhead's "training" part
        "step_ends_s": [round(t - timer.t0, 4) for t in timer.steps] if timer.t0 is not None else [],
    }
    left = files_of(spec["run_dir"])
    out["disk_bytes"] = sum(n for _p, n in left)
    out["disk_largest"] = left[:8]  # what the bytes on disk are (the JSON only)
    gpu_mod = sys.modules.get("s4w_core.gpu")
    if gpu_mod is not None:
        out["warm_up"] = gpu_mod.warm_up_status()
    t_post = time.perf_counter()
    if r["resume"] is not None:
        snap = cpu_snapshot(r["model"], r["opt"])
        times: list[float] = []
        try:
            # each resume after zeroing the state again; the first is profiled when asked; the
            # median is reported (one ~10 ms resume of a small state on a shared machine is noise)
            for i in range(max(1, int(spec.get("resume_repeats", 1)))):
                scramble(r["model"], r["opt"])
                sync(device)
                t = time.perf_counter()
                if spec.get("profile_resume") and i == 0:
                    out["resume_profile"] = profiled(r["resume"])
                else:
                    r["resume"]()
                times.append(time.perf_counter() - t)
                got = compare(snap, r["model"], r["opt"])
                if i == 0 or not got["bit_identical"]:
                    out["resume"] = got
            out["resume_s"] = statistics.median(times)
            out["resume_each_s"] = times
        except Exception as e:  # reported, not fatal: the table says FAIL
            out["resume_error"] = f"{type(e).__name__}: {e}"
        del snap
    if r.get("finish"):
        r["finish"]()
    out["resume_check_s"] = time.perf_counter() - t_post  # left out of the process time below
    return out


# ============================================================================ orchestration
def _child_main(spec_path: str, out_path: str) -> int:
    fsyncs = FsyncCounter()
    with open(spec_path) as f:
        spec = json.load(f)
    res = child(spec, fsyncs)
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


def _run_subprocess(spec: dict[str, Any], env: dict[str, str], timeout: float, log: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as td:
        sp, op = os.path.join(td, "spec.json"), os.path.join(td, "out.json")
        with open(sp, "w") as f:
            json.dump(spec, f)
        t = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", sp, op], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, text=True)
        except subprocess.TimeoutExpired as e:
            return {"error": f"timed out after {timeout:.0f} s", "log_tail": (e.stdout or "")[-2000:] if isinstance(e.stdout, str) else ""}
        proc_s = time.perf_counter() - t
        log.write(p.stdout)
        if p.returncode != 0 or not os.path.exists(op):
            return {"error": f"exit {p.returncode}", "log_tail": p.stdout[-3000:]}
        with open(op) as f:
            res = json.load(f)
        res["process_s"] = proc_s - res.get("resume_check_s", 0.0)
        return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=("bf16", "fp32master"), default="bf16")
    ap.add_argument("--out", default="runs/frameworks")
    ap.add_argument("--async-saves", action="store_true",
                    help="also an s4weights run (warm cache) with the adapters' async_save=True: Lightning, HF, Accelerate")
    ap.add_argument("--no-fsync-runs", action="store_true",
                    help="also s4weights runs (warm cache) with the default's durability, CheckpointStore(durable=False): "
                    "s4w-nofsync-warm, and s4w-nofsync-async-warm with --async-saves (Lightning, HF, Accelerate)")
    ap.add_argument("--throwaway-run", action=argparse.BooleanOptionalAction, default=None,
                    help="a short `none` run of the first framework before the reported ones, not reported (default: "
                    "on a GPU; the first process of a call sets up 1-1.5 s slower than the later ones)")
    ap.add_argument("--keep-runs", action="store_true",
                    help="leave each run's files (checkpoints, stores) under --work or the temp dir, to inspect them "
                    "(e.g. `s4w stats` on a store: stored bytes per step and tensor group); with --repeats, each "
                    "repeat's in FRAMEWORK_RUN_rN")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="write one table from the results of several calls (frameworks_*.json, on the same machine) into --out")
    ap.add_argument("--store-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a CheckpointStore option (JSON value) for every Lightning and HF s4weights run, as a "
                         "diagnostic against the README's settings, e.g. base_cache_bytes=0 (not for Accelerate, "
                         "whose runs take the environment switch)")
    ap.add_argument("--only", default="", help="frameworks and/or runs: e.g. lightning,hf or dcp:s4w-warm")
    ap.add_argument("--model", choices=sorted(SIZES), default=None, help="model shape (default: the precision's)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--keep", type=int, default=2, help="save_top_k / save_total_limit / total_limit")
    ap.add_argument("--work", default=None, help="where runs write their checkpoints (default: a temp dir)")
    ap.add_argument("--budget-s", type=float, default=560.0, help="runs not started by then are reported skipped")
    ap.add_argument("--sample-ms", type=float, default=20.0, help="profile sampling interval (every run, equally)")
    ap.add_argument("--profile-resume", action="store_true",
                    help="time each resume under cProfile and report its breakdown (the resume times then include the profiler)")
    ap.add_argument("--resume-repeats", type=int, default=3,
                    help="resumes per run, each after zeroing the state; their median is reported")
    ap.add_argument("--repeats", type=int, default=1,
                    help="every run this many times, round-robin (each run once, then again): the row reported is "
                    "the repeat with the median wall time, every repeat's wall time beside it (`walls_s`); for "
                    "machines whose run-to-run spread is the size of the defaults' overhead (a small model on a CPU)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 3 saves, all runs in this process")
    ap.add_argument("--device", default=None)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads in every run (default: 1 on the CPU, where more oversubscribe "
                    "a small shared machine; torch's own default on a GPU machine)")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _child_main(*a.child)
    if a.merge:
        return merge(a.merge, a.out)

    t_start = time.perf_counter()
    if a.smoke:
        a.steps, a.every = (a.steps if a.steps != 60 else 6), (a.every if a.every != 20 else 2)
    size = SIZES[a.model or ("smoke" if a.smoke else a.precision)]
    device = a.device or ("cpu" if a.smoke else "cuda")
    os.makedirs(a.out, exist_ok=True)
    work = a.work or tempfile.mkdtemp(prefix="s4w_fw_")
    only = [s for s in a.only.split(",") if s]
    store_options = parse_store_options(a.store_option)
    plan = []
    for fw in FRAMEWORKS:
        for mode, cache in RUNS:
            name = f"{mode}-{cache}" if cache else mode
            if a.smoke and cache == "warm":
                continue
            if only and not any(o == fw or o == f"{fw}:{name}" or o == name for o in only):
                continue
            plan.append((fw, mode, cache, name))
        extra = (["s4w-async-warm"] if a.async_saves else []) + (  # the adapters' async_save=True (DCP's runs are async)
            ["s4w-nofsync-warm"] + (["s4w-nofsync-async-warm"] if a.async_saves else []) if a.no_fsync_runs else [])
        for name in extra if fw != "dcp" else []:
            if a.smoke and "async" in name:
                continue
            if not only or any(o in (fw, f"{fw}:{name}") for o in only):
                plan.append((fw, "s4w", "warm", name))
    if store_options and any(fw not in ("lightning", "hf") and mode == "s4w" for fw, mode, _c, _n in plan):
        raise SystemExit("--store-option applies to Lightning's and HF's runs only: add --only lightning,hf")
    fsyncs = FsyncCounter() if a.smoke else None
    results: list[dict[str, Any]] = []
    throwaway: dict[str, Any] | None = None
    caches: dict[str, str] = {}
    tag = "smoke" if a.smoke else "_".join([a.precision] + ([a.model] if a.model else []) + (["cpu"] if device == "cpu" else []))
    log_path = os.path.join(a.out, f"frameworks_{tag}.log")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "integrations"), env.get("PYTHONPATH", "")])

    def spec_of(fw: str, mode: str, name: str, run_dir: str, steps: int) -> dict[str, Any]:
        return {"framework": fw, "mode": mode, "precision": a.precision, "size": size, "steps": steps,
                "every": a.every, "keep": a.keep, "device": device, "run_dir": run_dir, "sample_ms": a.sample_ms,
                "profile_resume": a.profile_resume, "resume_repeats": a.resume_repeats,
                "torch_threads": a.torch_threads or (1 if device == "cpu" else None),
                "async": name.endswith("async-warm"), "durable": durable_run(name),
                "store_options": store_options}

    with open(log_path, "w") as log:
        if plan and (a.throwaway_run if a.throwaway_run is not None else (not a.smoke and device.startswith("cuda"))):
            # the first process of a call set up 1-1.5 s slower than every later one (whichever
            # framework ran first; reading the libraries into the page cache first did not change
            # it): a short `none` run of the first framework goes first, and is not reported
            fw0 = plan[0][0]
            run_dir = os.path.join(work, f"{fw0}_throwaway")
            os.makedirs(run_dir, exist_ok=True)
            t = time.perf_counter()
            r0 = _run_subprocess(spec_of(fw0, "none", "none", run_dir, 5), env, 120.0, log)
            throwaway = {"framework": fw0, "steps": 5, "process_s": round(time.perf_counter() - t, 2),
                         "wall_s": r0.get("wall_s"), "error": r0.get("error")}
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"[frameworks] throwaway first run: {throwaway}", file=sys.stderr, flush=True)
        for rep, (fw, mode, cache, name) in [(r, p) for r in range(max(1, a.repeats)) for p in plan]:
            # (with --keep-runs and --repeats, each repeat's files in a folder of its own)
            run_dir = os.path.join(work, f"{fw}_{name}" + (f"_r{rep}" if a.keep_runs and a.repeats > 1 else ""))
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            spec = spec_of(fw, mode, name, run_dir, a.steps)
            left = a.budget_s - (time.perf_counter() - t_start)
            row: dict[str, Any] = {"framework": fw, "run": name, "mode": mode, "triton_cache": cache}
            # a run is started only with the time the longest one so far took -- of its own framework once
            # one of those ran (a run killed by the budget measures nothing; a framework's runs take
            # about as long as each other, and another framework's may take twice as long)
            took = [(r["framework"], r["process_s"] + r.get("resume_check_s", 0.0)) for r in results if "process_s" in r]
            own = [t for f, t in took if f == fw]
            need = max([20.0] + (own or [t for _f, t in took]))
            if left < need:
                row["error"] = f"skipped: over --budget-s ({left:.0f} s left, runs took up to {need:.0f} s)"
                results.append(row)
                continue
            run_env = dict(env)
            if cache:
                tc = caches.get(fw) if cache == "warm" else None
                if tc is None:
                    tc = tempfile.mkdtemp(prefix=f"triton_{fw}_", dir=work)
                    caches[fw] = tc
                    if cache == "warm" and not a.smoke:  # no cold run before it: fill the cache first
                        subprocess.run([sys.executable, "-c", "import s4w_core.gpu as g; g.warm_up(wait=True)"],
                                       env={**env, "TRITON_CACHE_DIR": tc}, timeout=max(10.0, left - 20), check=False)
                run_env["TRITON_CACHE_DIR"] = tc
            print(f"[frameworks] {fw} {name} ...", file=sys.stderr, flush=True)
            log.write(f"==== {fw} {name}\n")
            if a.smoke:
                assert fsyncs is not None
                t = time.perf_counter()
                try:
                    res = child(spec, fsyncs)
                    res["process_s"] = time.perf_counter() - t - res.get("resume_check_s", 0.0)
                except Exception as e:
                    import traceback

                    res = {"error": f"{type(e).__name__}: {e}", "log_tail": traceback.format_exc()[-3000:]}
            else:
                res = _run_subprocess(spec, run_env, max(20.0, left), log)
            row.update(res)
            results.append(row)
            print(f"[frameworks] {fw} {name}: " + (row.get("error") or f"wall {row['wall_s']:.2f} s, "
                  f"blocked {sum(row['blocked_s']):.2f} s over {row['saves']} saves"), file=sys.stderr, flush=True)
            if not a.keep_runs:
                shutil.rmtree(run_dir, ignore_errors=True)
    if a.keep_runs:
        print(f"[frameworks] every run's files are kept under {work} (e.g. `s4w stats` on a store)", file=sys.stderr)
    elif not a.work:
        shutil.rmtree(work, ignore_errors=True)
    results = median_repeats(results)
    meta = {"precision": a.precision, "smoke": a.smoke, "model": a.model, "size": size, "steps": a.steps, "every": a.every,
            "keep": a.keep, "device": device, "env": environment(device), "wall_s": time.perf_counter() - t_start,
            "command": " ".join(["python benchmarks/frameworks.py", *(sys.argv[1:] if argv is None else argv)]),
            "throwaway_run": throwaway, "repeats": max(1, a.repeats)}
    write_results(results, meta, a.out, tag)
    return 0


def median_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (framework, run), in first-run order: where a run was repeated (``--repeats``),
    the repeat with the median wall time (the lower of the two middle ones for an even count) among
    those that measured, with every measured repeat's wall time in ``walls_s`` (run order); a run
    none of whose repeats measured keeps its first error."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["framework"], r["run"]), []).append(r)
    out = []
    for reps in groups.values():
        ok = [r for r in reps if "error" not in r]
        if len(reps) == 1 or not ok:
            out.append(reps[0])
            continue
        pick = dict(sorted(ok, key=lambda r: r["wall_s"])[(len(ok) - 1) // 2])
        pick["walls_s"] = [round(r["wall_s"], 3) for r in ok]
        out.append(pick)
    return out


def write_results(results: list[dict[str, Any]], meta: dict[str, Any], out: str, tag: str) -> None:
    derive(results, meta["precision"])
    with open(os.path.join(out, f"frameworks_{tag}.json"), "w") as f:
        json.dump({"meta": meta, "runs": results}, f, indent=1)
    md = table(results, meta)
    with open(os.path.join(out, f"frameworks_{tag}.md"), "w") as f:
        f.write(md)
    print(md)


def merge(paths: list[str], out: str) -> int:
    """One table from several calls' results (the 10-minute limit of one command: e.g. Lightning
    and HF in one call, Accelerate in the next, on the same machine). Each framework's runs must
    come from one call: its ratios are against its own `none` and `default` runs."""
    runs: list[dict[str, Any]] = []
    metas: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        got = {r["framework"] for r in d["runs"]}
        if got & {r["framework"] for r in runs}:
            raise SystemExit(f"{p}: {sorted(got & {r['framework'] for r in runs})} already came from another call")
        runs += d["runs"]
        metas.append(d["meta"])
        calls.append({"frameworks": sorted(got), "command": d["meta"].get("command"), "git": d["meta"]["env"].get("git"),
                      "wall_s": d["meta"].get("wall_s"), "throwaway_run": d["meta"].get("throwaway_run")})
    keys = ("precision", "smoke", "model", "size", "steps", "every", "keep", "device")
    if any(tuple(m[k] for k in keys) != tuple(metas[0][k] for k in keys) for m in metas):
        raise SystemExit("the calls ran different settings: not one table")
    gpus = {m["env"].get("gpu") for m in metas}
    if len(gpus) > 1:
        raise SystemExit(f"the calls ran on different devices {sorted(map(str, gpus))}: not one table")
    meta = dict(metas[0])
    meta["command"] = " + ".join(m.get("command", "") for m in metas)
    meta["wall_s"] = sum(m.get("wall_s", 0.0) for m in metas)
    meta["merged_from"] = [os.path.basename(p) for p in paths]
    meta["calls"] = calls
    meta["throwaway_run"] = None  # per call, in ``calls``
    os.makedirs(out, exist_ok=True)
    tag = os.path.basename(paths[0])[len("frameworks_"):-len(".json")]
    write_results(runs, meta, out, tag)
    return 0


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    for m in ("lightning", "transformers", "accelerate", "triton", "numba"):
        try:
            import importlib.metadata as md

            env[m] = md.version(m)
        except Exception:
            env[m] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        env["git"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
    except Exception:
        env["git"] = None
    return env


# ============================================================================ derived figures, table
def derive(results: list[dict[str, Any]], precision: str) -> None:
    by = {(r["framework"], r["run"]): r for r in results if "error" not in r}
    for r in results:
        if "error" in r:
            continue
        r["durability"] = (
            "no fsync, as the default (CheckpointStore(durable=False): temp file + rename, no fsync)"
            if r["mode"] == "s4w" and not durable_run(r["run"]) else DURABILITY.get((r["framework"], r["mode"]), "no saves")
        )
        base = by.get((r["framework"], "none"))
        dflt = by.get((r["framework"], "default"))
        if base:
            r["overhead_s"] = r["wall_s"] - base["wall_s"]
            p, q = r.get("phases") or {}, base.get("phases") or {}
            if p and q:  # where the overhead lands: the four parts add up to overhead_s
                r["overhead_parts_s"] = {
                    "setup": p["setup_s"] - q["setup_s"],
                    "training": (p["span_s"] - p["blocked_in_span_s"]) - (q["span_s"] - q["blocked_in_span_s"]),
                    "blocked": p["blocked_in_span_s"] - q["blocked_in_span_s"],
                    "end": p["end_s"] - q["end_s"],
                }
            r["cpu_overhead_s"] = r["cpu_s"] - base["cpu_s"]
            if r.get("process_s") and base.get("process_s"):  # the whole process: imports, exit waits
                r["process_overhead_s"] = r["process_s"] - base["process_s"]
        if r["mode"] == "s4w" and dflt and base:
            d_over = dflt["wall_s"] - base["wall_s"]
            c_over = dflt["cpu_s"] - base["cpu_s"]
            r["vs_default"] = {
                "overhead_ratio": r["overhead_s"] / d_over if d_over > 0 else None,
                "cpu_overhead_ratio": r["cpu_overhead_s"] / c_over if c_over > 0 else None,
                "disk_ratio": r["disk_bytes"] / dflt["disk_bytes"] if dflt["disk_bytes"] else None,
                "written_ratio": _written(r) / _written(dflt) if _written(dflt) else None,
                "resume_ratio": r["resume_s"] / dflt["resume_s"] if r.get("resume_s") and dflt.get("resume_s") else None,
                "extra_rss_bytes": r["peak_rss_bytes"] - dflt["peak_rss_bytes"],
                "extra_gpu_bytes": r["peak_gpu_bytes"] - dflt["peak_gpu_bytes"],
            }


def _written(r: dict[str, Any]) -> int:
    return int(r.get("write_bytes") or r.get("wchar") or 0)


def _num(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 1e6:,.1f}"


def _spread(r: dict[str, Any]) -> str:
    """`` [min-max]`` of a repeated run's wall times (``--repeats``), else nothing."""
    walls = r.get("walls_s") or []
    return f" [{min(walls):.2f}-{max(walls):.2f}]" if len(walls) > 1 else ""


def table(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    env = meta["env"]
    lines = [
        f"# Checkpointing inside training: {meta['precision']}{' (smoke, CPU)' if meta['smoke'] else ''}",
        "",
        *([f"`{meta['command']}`", ""] if meta.get("command") else []),
        f"{env.get('gpu') or 'CPU'}; torch {env['torch']}, lightning {env.get('lightning')}, transformers "
        f"{env.get('transformers')}, accelerate {env.get('accelerate')}, triton {env.get('triton')}; git {env.get('git')}. "
        f"GPT-2 shape {meta['size']}, {meta['steps']} steps, a save every {meta['every']}, keep {meta['keep']}. "
        "wall = from building the framework's objects (imports before it, s4weights' adapters included) to the end of training with every save finished; process = the "
        "whole child process less the resume check (imports, model, training, waits at exit); "
        "overhead = wall - the `none` run's wall; written = /proc/self/io write_bytes (wchar where the file system "
        "counts none); resume = the median of the resumes run (each after zeroing the state); ratios against the same "
        "framework's `default`." + (
            f" Each run {meta['repeats']} times round-robin: the row is the repeat with the median wall time, "
            "[min-max] of every repeat's beside it." if (meta.get("repeats") or 1) > 1 else "") + (
            f" A 5-step `none` run of {meta['throwaway_run']['framework']} went first and is not reported (the first "
            "process of a call set up 1-1.5 s slower than the later ones)." if meta.get("throwaway_run") else "") + (
            " Merged from one call per framework group: " + "; ".join(
                f"{', '.join(c['frameworks'])} ({'after a throwaway 5-step `none` run' if c.get('throwaway_run') else 'no throwaway run first'})"
                for c in meta["calls"]) + "." if meta.get("calls") else ""),
        "",
        "| framework | run | wall s (process) | overhead s (process) | x default's overhead | CPU s (overhead, x) | blocked s/save (max) | disk MB (x) "
        "| written MB (x) | fsyncs (s) | peak RSS GB | peak GPU GB | resume s (x) | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['framework']} | {r['run']} | {r['error'].splitlines()[0][:80]} |" + " |" * 11)
            continue
        v = r.get("vs_default", {})
        bl = r["blocked_s"]
        res = r.get("resume") or {}

        def x(k: str, v: dict[str, Any] = v) -> str:
            return f" ({v[k]:.2f}x)" if v.get(k) is not None else ""

        lines.append(
            f"| {r['framework']} | {r['run']} | {r['wall_s']:.2f}{_spread(r)} ({_num(r.get('process_s'))}) | "
            f"{r.get('overhead_s', 0):.2f} ({_num(r.get('process_overhead_s'))}) | "
            f"{_num(v.get('overhead_ratio'))} | "
            f"{r['cpu_s']:.1f} ({r.get('cpu_overhead_s', 0):.1f}{x('cpu_overhead_ratio')}) | "
            f"{(sum(bl) / len(bl)) if bl else 0:.3f} ({max(bl) if bl else 0:.3f}) | {_mb(r['disk_bytes'])}{x('disk_ratio')} | "
            f"{_mb(_written(r))}{x('written_ratio')} | {r['fsync_calls']} ({r['fsync_s']:.2f}) | "
            f"{r['peak_rss_bytes'] / 1e9:.2f} | {r['peak_gpu_bytes'] / 1e9:.2f} | "
            f"{_num(r.get('resume_s'), 3) or r.get('resume_error', '')[:40]}{x('resume_ratio')} | "
            f"{'' if r['mode'] == 'none' else ('yes' if res.get('bit_identical') else 'NO')} |"
        )
    parts = [r for r in results if "error" not in r and r.get("overhead_parts_s") and r["mode"] != "none"]
    if parts:
        lines += [
            "", "## Where the overhead lands (seconds, against the `none` run)", "",
            "setup = building the framework's objects to the end of the first step; training = the steps after it "
            "slower (the saves that block between them left out: background work, the warm-up, memory traffic); "
            "blocked = the saves between the steps; end = the last step's end to the end of the wall time (the last "
            "save and every wait at the end of training). The four add up to the overhead; host clock.",
            "",
            "| framework | run | overhead | setup | training | blocked | end |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in parts:
            o = r["overhead_parts_s"]
            lines.append(f"| {r['framework']} | {r['run']} | {r['overhead_s']:.2f} | {o['setup']:.2f} | "
                         f"{o['training']:.2f} | {o['blocked']:.2f} | {o['end']:.2f} |")
    lines += ["", "## Targets (issue #23)", ""]
    lines += targets(results, meta)
    lines += ["", "## Durability", ""]
    seen = set()
    for r in results:
        if "error" in r or r["mode"] == "none" or (r["framework"], r["durability"]) in seen:
            continue
        seen.add((r["framework"], r["durability"]))
        lines.append(f"- {r['framework']} {r['mode']}: {r['durability']}; measured {r['fsync_calls']} fsync calls, "
                     f"{r['fsync_s']:.2f} s in fsync")
    lines += ["", "## Where the s4weights runs' time goes (sampling profile, seconds)", ""]
    for r in results:
        if "error" in r or r["mode"] != "s4w":
            continue
        p = r["profile"]
        lines.append(f"**{r['framework']} {r['run']}** ({p['samples']} samples every {p['interval_s'] * 1000:.0f} ms; "
                     f"background threads busy {p['other_threads_busy_s']:.2f} s)")
        lines.append("")
        lines.append("- main thread, save path: " + ", ".join(f"`{k}` {v:.2f}" for k, v in p["main_save_path_s"][:12]))
        lines.append("- main thread, leaves: " + ", ".join(f"`{k}` {v:.2f}" for k, v in p["main_leaf_s"][:8]))
        lines.append("- background, s4weights: " + ", ".join(f"`{k}` {v:.2f}" for k, v in p["other_s4w_s"][:10]))
        lines.append("")
    for r in results:
        rp = r.get("resume_profile")
        if "error" in r or not rp:
            continue
        lines.append(f"**{r['framework']} {r['run']}: resume** ({r.get('resume_s', 0):.2f} s, cProfile)")
        lines.append("")
        lines.append("- own time: " + ", ".join(f"`{k}` {v:.3f}" for k, v in rp["own_s"][:10]))
        lines.append("- cumulative: " + ", ".join(f"`{k}` {v:.3f}" for k, v in rp["cumulative_s"][:10]))
        lines.append("")
    return "\n".join(lines) + "\n"


def targets(results: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    by = {(r["framework"], r["run"]): r for r in results if "error" not in r}
    disk_lim = 0.5 if meta["precision"] == "bf16" else 0.8
    on_cpu = meta["device"] == "cpu"

    def line(ok: bool | None, text: str) -> None:
        out.append(f"- {'n/a ' if ok is None else ('PASS' if ok else 'FAIL')} {text}")

    for r in results:
        if r["mode"] != "s4w":
            continue
        tag = f"{r['framework']} {r['run']}"
        if "error" in r:
            line(False, f"{tag}: did not run ({r['error'].splitlines()[0][:100]})")
            continue
        v = r.get("vs_default") or {}
        dflt = by.get((r["framework"], "default"))
        ov = v.get("overhead_ratio")
        lim = 2.0 if on_cpu else 0.25  # the CPU target: a small model's overhead <= 2x the default's
        line(None if ov is None else ov <= lim, f"{tag}: overhead {ov if ov is None else round(ov, 2)}x the default's (<= {lim}x)")
        if on_cpu:  # on a shared CPU machine the wall time drifts: the same in CPU seconds
            co = v.get("cpu_overhead_ratio")
            line(None if co is None else co <= lim,
                 f"{tag}: overhead in CPU seconds {co if co is None else round(co, 2)}x the default's (<= {lim}x)")
        dr = v.get("disk_ratio")
        line(None if dr is None else dr <= disk_lim, f"{tag}: bytes on disk {dr if dr is None else round(dr, 2)}x the default's (<= {disk_lim}x)")
        if r["framework"] == "lightning" and meta["precision"] == "bf16":
            wr = v.get("written_ratio")
            line(None if wr is None else wr <= 0.6, f"{tag}: bytes written {wr if wr is None else round(wr, 2)}x the default's (<= 0.6x)")
        rr = v.get("resume_ratio")
        line(None if rr is None else rr <= 1.0, f"{tag}: resume {rr if rr is None else round(rr, 2)}x the default's (<= 1x)")
        line(bool((r.get("resume") or {}).get("bit_identical")), f"{tag}: resumed state bit-identical")
        if dflt and v:  # (no comparison without the framework's `none` run: `--only` left it out)
            sb = r["state_bytes"]
            line(v["extra_rss_bytes"] <= sb, f"{tag}: peak RSS +{v['extra_rss_bytes'] / 1e9:.2f} GB over the default's (<= state {sb / 1e9:.2f} GB)")
            if meta["device"].startswith("cuda"):
                line(v["extra_gpu_bytes"] <= 0.1 * sb, f"{tag}: peak GPU +{v['extra_gpu_bytes'] / 1e9:.3f} GB over the default's (<= 10% of state {sb / 1e9:.2f} GB)")
    return out


if __name__ == "__main__":
    sys.exit(main())

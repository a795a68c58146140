"""``S4Callback``: after each HF Trainer save, the checkpoint folder goes compressed into a store.

The Trainer keeps writing its checkpoint folders as usual (``model.safetensors``, ``optimizer.pt``,
``scheduler.pt``, ``rng_state*.pth``, ``trainer_state.json``, ...).  ``on_save`` fires after all of
them are written (and after ``save_total_limit`` rotation); then global rank 0 packs every file
of ``checkpoint-{global_step}`` (tensor regions typed, bytes verbatim, see
:mod:`s4w_core.filepack`) and saves it as step ``global_step`` of a
:class:`~s4w_core.store.CheckpointStore` (a delta on the previous step where that pays).

The store mirrors the Trainer's rotation: a step whose folder the Trainer deleted is deleted from
the store too, and the store keeps the data of a deleted step for as long as a kept step is a
delta on it.  :func:`restore_checkpoint` turns the store back into a folder for
``trainer.train(resume_from_checkpoint=...)``, byte for byte, and refuses when a file that resume
needs is missing (the Trainer itself would silently start with a fresh optimizer).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Any

from transformers import TrainerCallback

import s4w_core
from s4w_core import CheckpointNotFoundError
from s4w_core.store import CheckpointStore

__all__ = ["S4Callback", "restore_checkpoint", "MARKER_NAME", "STORE_DIRNAME"]

#: the store folder created in ``output_dir`` when no ``store=`` is given.
STORE_DIRNAME = ".s4w"
#: a small file left in a checkpoint folder whose raw files were dropped (``keep_local=False``).
MARKER_NAME = "s4w_checkpoint.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
#: files kept in the folder when ``keep_local=False`` (small, and what rotation/sorting reads).
_KEEP_SMALL = ("trainer_state.json", "config.json", "generation_config.json", MARKER_NAME)


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    d = _dist()
    if d is not None:
        d.barrier()


class S4Callback(TrainerCallback):
    """Store each HF Trainer checkpoint compressed, as deltas where they pay, locally or on S3.

    ``Trainer(..., callbacks=[S4Callback()])`` is the one-line change.

    Args:
        store: a local directory or ``s3://bucket/prefix``; default ``<output_dir>/.s4w``.
        profile: s4weights profile (``"auto"``, ``"portable"``, ``"fast"``).
        delta: code each checkpoint against the previous one where that pays.
        keyframe_every: a full checkpoint at least every that many saves.
        keep_local: keep the Trainer's raw files (default). ``False`` deletes them once the store
            has them, leaving ``trainer_state.json`` and a marker so rotation still works
            (incompatible with ``load_best_model_at_end``).
        mirror_rotation: delete store steps whose folder the Trainer's ``save_total_limit`` rotated
            away (default True).
        rebase_on_delete: when rotation deletes a step a kept step is a delta on, re-code the kept
            step so the deleted data is reclaimed at once (default); ``False`` keeps it until then.
        wait_timeout: seconds rank 0 waits for every rank's ``rng_state_{rank}.pth`` to appear.
        async_save: compress and write in the background (:meth:`CheckpointStore.save_async`):
            ``on_save`` returns once the packed folder is copied; dropping the raw files
            (``keep_local=False``) and mirroring rotation happen once that save is durable, at the
            next ``on_save`` or at the end of training, which also raise its error if it failed
            (the raw files are then kept).
        store_options: more :class:`~s4w_core.store.CheckpointStore` arguments (``endpoint``...).
    Example:
        >>> from s4w_transformers import S4Callback
        >>> S4Callback(keep_local=False).keep_local
        False
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | None = None,
        *,
        profile: str = "auto",
        delta: bool = True,
        keyframe_every: int = 10,
        keep_local: bool = True,
        mirror_rotation: bool = True,
        rebase_on_delete: bool = True,
        wait_timeout: float = 600.0,
        async_save: bool = False,
        store_options: dict[str, Any] | None = None,
    ) -> None:
        if profile not in s4w_core.PROFILES:
            raise ValueError(f"profile must be one of {s4w_core.PROFILES}, got {profile!r}")
        self.store_url = None if store is None else os.fspath(store)
        self.profile = profile
        self.delta = delta
        self.keyframe_every = keyframe_every
        self.keep_local = keep_local
        self.mirror_rotation = mirror_rotation
        self.rebase_on_delete = rebase_on_delete
        self.wait_timeout = wait_timeout
        self.store_options = dict(store_options or {})
        self.async_save = async_save
        self._store: CheckpointStore | None = None
        #: the background save not yet finished: (handle, args, folder, files)
        self._pending: tuple[Any, Any, str, list[str]] | None = None
        #: the :class:`~s4w_core.store.StepInfo` of the last save (ratio, kind, bytes).
        self.last_info: Any = None

    def _url(self, args: Any) -> str:
        if self.store_url is not None:
            return self.store_url if self.store_url.startswith("s3://") else os.path.abspath(self.store_url)
        return os.path.join(os.path.abspath(args.output_dir), STORE_DIRNAME)

    def store(self, args: Any) -> CheckpointStore:
        """The :class:`CheckpointStore` this callback writes for ``args`` (a TrainingArguments)."""
        url = self._url(args)
        if self._store is None or self._store.url != url:
            opts = {"profile": self.profile, "keyframe_every": self.keyframe_every if self.delta else 1}
            opts.update(self.store_options)
            self._store = CheckpointStore(url, **opts)
        return self._store

    # ---- events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.keep_local and getattr(args, "load_best_model_at_end", False):
            raise ValueError("S4Callback(keep_local=False) cannot be combined with load_best_model_at_end=True")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        _barrier()  # every rank has written its files (rng_state_{rank}.pth) before rank 0 reads
        if state.is_world_process_zero:
            self.finish_pending()
            self._store_folder(args, state, folder)
        _barrier()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.finish_pending()
            if self._store is not None:  # the last step's keyframe copy, written behind its save
                self._store.wait()

    def finish_pending(self) -> None:
        """Wait for the background save (``async_save=True``), then drop its raw files and mirror
        rotation; raises its error if it failed. A no-op when none is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        handle, args, folder, files = pending
        self.last_info = handle.result()
        self._after_durable(args, folder, files, self.last_info.step)

    def _store_folder(self, args: Any, state: Any, folder: str) -> None:
        world = int(getattr(args, "world_size", 1) or 1)
        if world > 1 and not getattr(args, "save_only_model", False):
            need = [os.path.join(folder, f"rng_state_{r}.pth") for r in range(world)]
            deadline = time.monotonic() + self.wait_timeout
            while not all(os.path.exists(p) for p in need):
                if time.monotonic() > deadline:
                    missing = [os.path.basename(p) for p in need if not os.path.exists(p)]
                    raise CheckpointNotFoundError(
                        f"{folder}: {missing} did not appear within {self.wait_timeout}s; S4Callback needs the "
                        "output_dir on a file system all ranks share"
                    )
                time.sleep(0.2)
        tree = s4w_core.pack_folder(folder, exclude=lambda rel: rel == MARKER_NAME)
        files = sorted(tree["files"])
        st = self.store(args)
        extra = {
            "writer": "s4w_transformers",
            "folder": os.path.basename(folder),
            "files": files,
            "save_only_model": bool(getattr(args, "save_only_model", False)),
            "world_size": world,
        }
        if self.async_save:
            self._pending = (st.save_async(tree, state.global_step, extra=extra, overwrite=True), args, folder, files)
            return
        self.last_info = st.save(tree, state.global_step, extra=extra, overwrite=True)
        self._after_durable(args, folder, files, state.global_step)

    def _after_durable(self, args: Any, folder: str, files: list[str], step: int) -> None:
        """Step ``step`` (from ``folder``) is committed: drop its raw files, mirror rotation."""
        st = self.store(args)
        if not self.keep_local:  # a folder rotation removed since is left alone
            s4w_core.replace_with_marker(
                folder, files, MARKER_NAME, {"store": st.url, "step": step, "files": files}, keep=_KEEP_SMALL
            )
        if self.mirror_rotation:
            self._mirror(args, st, step)

    def _mirror(self, args: Any, st: CheckpointStore, current: int) -> None:
        """Delete store steps whose checkpoint folder the Trainer rotated away."""
        try:
            present = {int(m.group(1)) for n in os.listdir(args.output_dir) if (m := _CKPT_RE.match(n))}
        except FileNotFoundError:
            return
        for info in st.list():
            if info.step != current and info.step not in present and info.extra.get("writer") == "s4w_transformers":
                st.delete(info.step, rebase=self.rebase_on_delete)


def _required(files: list[str], extra: dict[str, Any]) -> list[str]:
    """What ``trainer.train(resume_from_checkpoint=...)`` needs and would *not* complain about."""
    missing = []
    if "trainer_state.json" not in files:
        missing.append("trainer_state.json")
    if not any(w in files for w in _WEIGHTS) and not any(f.startswith("pytorch_model_fsdp") for f in files):
        missing.append("model weights (model.safetensors / pytorch_model.bin)")
    if not extra.get("save_only_model"):
        missing += [f for f in ("optimizer.pt", "scheduler.pt") if f not in files]
    return missing


def restore_checkpoint(
    store: str | os.PathLike[str],
    step: int | None = None,
    dest: str | os.PathLike[str] | None = None,
    *,
    require_optimizer: bool = True,
    **store_options: Any,
) -> str:
    """Rebuild a checkpoint folder from a store for ``trainer.train(resume_from_checkpoint=...)``.

    Args:
        store: the store :class:`S4Callback` wrote (``<output_dir>/.s4w`` by default, or the URL).
        step: the global step; default the newest one.
        dest: the folder to write (default: a new temporary directory ``.../checkpoint-{step}``).
            Files already there are replaced.
        require_optimizer: refuse when ``optimizer.pt``/``scheduler.pt`` are missing (the Trainer
            would silently resume with a fresh optimizer); ``False`` allows model-only checkpoints.
        **store_options: :class:`~s4w_core.store.CheckpointStore` arguments (``endpoint``...).
    Returns:
        The folder, every file byte-identical to what the Trainer wrote (SHA-256 checked).
    Raises:
        CheckpointNotFoundError: no such step, or the step lacks a file resume needs.
    Example:
        ``trainer.train(resume_from_checkpoint=s4w_transformers.restore_checkpoint("out/.s4w"))``
    """
    url = os.fspath(store)
    dist = _dist()
    rank = dist.get_rank() if dist is not None else 0
    st = CheckpointStore(url, **store_options)
    info = st.info(step)
    files = list(info.extra.get("files") or [])
    missing = _required(files, info.extra)
    if not require_optimizer:
        missing = [m for m in missing if m not in ("optimizer.pt", "scheduler.pt")]
    if missing:
        raise CheckpointNotFoundError(
            f"{url} step {info.step} lacks {missing}; trainer.train would not resume it faithfully "
            "(pass require_optimizer=False to restore a model-only checkpoint)"
        )
    if dest is None:
        base = tempfile.mkdtemp(prefix="s4w-restore-") if rank == 0 else None
        if dist is not None:
            holder = [base]
            dist.broadcast_object_list(holder, src=0)
            base = holder[0]
        dest = os.path.join(str(base), f"checkpoint-{info.step}")
    dest = os.fspath(dest)
    if rank == 0:
        tree = st.load(info.step, "cpu")
        got = sorted(tree.get("files", {})) if isinstance(tree, dict) else []
        if got != sorted(files):
            raise CheckpointNotFoundError(f"{url} step {info.step}: stored files {got} differ from its record {files}")
        os.makedirs(dest, exist_ok=True)
        marker = os.path.join(dest, MARKER_NAME)
        if os.path.exists(marker):
            os.remove(marker)
        s4w_core.unpack_folder(tree, dest)
    if dist is not None:
        dist.barrier()
    return dest

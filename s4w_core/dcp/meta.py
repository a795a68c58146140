"""The pieces of :mod:`s4w_core.dcp` that its writer and reader share: where a checkpoint's bytes live
(:class:`Folder`, local or S3 through the store's backend), DCP's ``Metadata`` as JSON (nothing
pickled; every name a file gives checked), and the keys, slices and steps of its items."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    WriteItem,
)

from s4w_core import api, obs
from s4w_core._fsutil import atomic_write, name_parts
from s4w_core.errors import CheckpointNotFoundError, ManifestError, UnsupportedTypeError
from s4w_core.skeleton import decode_tree, encode_tree

if TYPE_CHECKING:
    pass


__all__ = [
    "METADATA_NAME",
    "SCHEMA",
    "SUFFIX",
    "Folder",
    "FolderCheckpoint",
    "valid_id",
    "Prefix",
    "ItemInfo",
    "metadata_to_json",
    "metadata_from_json",
    "metadata_name",
    "item_key",
    "projection",
    "narrow",
    "step_from",
    "merge_stages",
]

#: name of the committed metadata file inside a checkpoint folder.
METADATA_NAME = ".s4w_metadata.json"
SCHEMA = "s4weights-dcp/1"
SUFFIX = ".s4w"


# ----------------------------------------------------------------------------- where bytes live
class Folder:
    """A checkpoint folder: local directory or ``s3://bucket/prefix`` (through s4w_core.store)."""

    def __init__(self, location: str | os.PathLike[str], s3_options: dict[str, Any] | None = None) -> None:
        self.location = os.fspath(location)
        self.is_s3 = self.location.startswith("s3://")
        self._s3_options = dict(s3_options or {})
        self._backend: Any = None

    def __repr__(self) -> str:
        return self.location

    # S3 goes through the store's object backend, so there is one S3 client implementation.
    def _s3(self) -> Any:
        if self._backend is None:
            from s4w_core.store import open_backend

            self._backend = open_backend(self.location, **self._s3_options)
        return self._backend

    def mkdir(self) -> None:
        if not self.is_s3:
            os.makedirs(self.location, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.location, name)

    def exists(self, name: str) -> bool:
        if self.is_s3:
            return any(o.key == name for o in self._s3().list(name))
        return os.path.exists(self.path(name))

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Atomic write (temp + fsync + rename locally; an S3 object appears only when complete)."""
        if self.is_s3:
            self._s3().put(name, bytes(data))
            return
        with atomic_write(self.path(name)) as f:
            f.write(data)

    def read_bytes(self, name: str) -> bytes:
        try:
            if self.is_s3:
                return bytes(self._s3().get(name))
            with open(self.path(name), "rb") as f:
                return f.read()
        except (FileNotFoundError, CheckpointNotFoundError):
            raise CheckpointNotFoundError(f"no {name} in DCP checkpoint {self.location}") from None

    def save_container(self, obj: Any, name: str, profile: str, threads: int | None) -> api.SaveReport:
        if self.is_s3:
            with self._s3().writer(name) as fp:
                return api.save(obj, fp, profile=profile, threads=threads)
        return api.save(obj, self.path(name), profile=profile, threads=threads)

    def load_container(self, name: str, map_location: Any, threads: int | None) -> Any:
        try:
            if self.is_s3:
                from s4w_core.format.container import ContainerReader

                rr = self._s3().fetch(name)
                try:
                    reader: Any = ContainerReader(rr.read, rr.size, rr.name, readinto=rr.readinto)  # api.load accepts a reader
                    return api.load(reader, map_location=map_location, threads=threads)
                finally:
                    rr.close()
            return api.load(self.path(name), map_location=map_location, threads=threads)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"no {name} in DCP checkpoint {self.location}") from None

    def list(self) -> list[str]:
        if self.is_s3:
            return [o.key for o in self._s3().list("") if "/" not in o.key]
        try:
            return os.listdir(self.location)
        except FileNotFoundError:
            return []

    def remove(self, name: str) -> None:
        if self.is_s3:
            self._s3().delete(name)
            return
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            pass


class FolderCheckpoint:
    """What the writer and the reader answer alike about their checkpoint folder (DCP's
    ``checkpoint_id`` and its validation): ``folder`` is None until DCP gives one."""

    folder: Folder | None

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.folder is None else self.folder.location

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return valid_id(checkpoint_id)


def valid_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    s = os.fspath(checkpoint_id)
    if s.startswith("s3://"):
        return len(s) > 5
    if "://" in s:
        return False
    return True


# ----------------------------------------------------------------------------- plan storage data
@dataclass(frozen=True)
class Prefix:
    """Per-rank file prefix chosen by the coordinator (shared save id)."""

    prefix: str


@dataclass(frozen=True)
class ItemInfo:
    """Where one write item lives: the rank file and the key inside its container."""

    file: str
    kind: str  # "t" (tensor) or "b" (bytes)
    key: str


# ----------------------------------------------------------------------------- metadata as JSON
def _size(v: Any) -> list[int]:
    return [int(x) for x in v]


def _enum_name(v: Any) -> str:
    return str(v).removeprefix("torch.")


def _torch_attr(name: Any, kind: type) -> Any:
    v = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(v, kind):
        raise ManifestError(f"DCP metadata: unknown torch attribute {name!r}")
    return v


def _no_tensors(t: torch.Tensor, path: str) -> int:
    raise UnsupportedTypeError(f"DCP planner_data holds a tensor at {path!r}; it must be plain values")


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    sdm: dict[str, Any] = {}
    for fqn, v in md.state_dict_metadata.items():
        if isinstance(v, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        elif isinstance(v, TensorStorageMetadata):
            p = v.properties
            sdm[fqn] = {
                "type": "tensor",
                "dtype": _enum_name(p.dtype),
                "layout": _enum_name(p.layout),
                "requires_grad": bool(p.requires_grad),
                "memory_format": _enum_name(p.memory_format),
                "pin_memory": bool(p.pin_memory),
                "size": _size(v.size),
                "chunks": [{"offsets": _size(c.offsets), "sizes": _size(c.sizes)} for c in v.chunks],
            }
        else:
            raise UnsupportedTypeError(f"DCP metadata: unknown storage metadata {type(v).__qualname__} for {fqn!r}")
    storage = []
    for idx, info in (md.storage_data or {}).items():
        storage.append(
            {
                "fqn": idx.fqn,
                "offset": None if idx.offset is None else _size(idx.offset),
                "index": idx.index,
                "file": info.file,
                "kind": info.kind,
                "key": info.key,
            }
        )
    sm = md.storage_meta
    return {
        "format": SCHEMA,
        "version": md.version,
        "state_dict_metadata": sdm,
        "planner_data": encode_tree(md.planner_data, _no_tensors),
        "storage_data": storage,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules),
        },
    }


def metadata_from_json(doc: Any, where: str) -> Metadata:
    try:
        if not isinstance(doc, dict) or doc.get("format") != SCHEMA:
            raise ManifestError(f"{where}: not an s4weights DCP metadata file (format {doc.get('format')!r})")
        sdm: dict[str, Any] = {}
        for fqn, v in doc["state_dict_metadata"].items():
            if v["type"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
            elif v["type"] == "tensor":
                props = TensorProperties(
                    dtype=_torch_attr(v["dtype"], torch.dtype),
                    layout=_torch_attr(v["layout"], torch.layout),
                    requires_grad=bool(v["requires_grad"]),
                    memory_format=_torch_attr(v["memory_format"], torch.memory_format),
                    pin_memory=bool(v["pin_memory"]),
                )
                chunks = [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in v["chunks"]]
                sdm[fqn] = TensorStorageMetadata(props, torch.Size(v["size"]), chunks)
            else:
                raise ManifestError(f"{where}: unknown storage type {v['type']!r}")
        storage = {
            MetadataIndex(e["fqn"], e["offset"], e["index"]): ItemInfo(
                "/".join(name_parts(e["file"], f"{where}: data file", ManifestError)), str(e["kind"]), str(e["key"])
            )
            for e in doc["storage_data"]
        }
        sm = doc.get("storage_meta")
        meta = (
            None
            if sm is None
            else StorageMeta(sm.get("checkpoint_id"), sm.get("save_id"), None, list(sm.get("modules", [])))
        )
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=decode_tree(doc.get("planner_data"), []),
            storage_data=storage,
            storage_meta=meta,
            version=doc.get("version"),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"{where}: malformed DCP metadata ({type(e).__name__}: {e})") from e


def metadata_name(rank: int | None) -> str:
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


# ----------------------------------------------------------------------------- helpers
def item_key(item: WriteItem) -> str:
    key = item.index.fqn.replace(".", "/")
    off = item.index.offset
    if off is not None and any(int(x) for x in off):
        key += "@" + ",".join(str(int(x)) for x in off)
    return key


def projection(t: torch.Tensor) -> torch.Tensor:
    """The tensor alone, dense and owning exactly its bytes (DCP: only the projection is saved)."""
    t = t.detach()
    if not t.is_contiguous():
        return t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        return t.clone()
    return t


def narrow(t: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (off, length) in enumerate(zip(offsets, lengths)):
        if off != 0 or length != t.size(dim):
            t = t.narrow(dim, int(off), int(length))
    return t



_STEP_RE = re.compile(r"(?:^|[^0-9a-z])(?:step|global_step|checkpoint|ckpt)[-_=]?(\d+)$", re.IGNORECASE)


def step_from(location: str) -> int | None:
    """The step for the log line, from a folder named like ``.../step_100`` (None otherwise)."""
    m = _STEP_RE.search(os.path.basename(location.rstrip("/")))
    return int(m.group(1)) if m else None


def merge_stages(into: dict[str, float], events: list[obs.OpEvent]) -> None:
    for e in events:
        for k, v in e.stages.items():
            into[k] = into.get(k, 0.0) + v



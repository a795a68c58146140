"""The storages of a checkpoint and how each is described: dtype names, the storage jobs a writer
codes (:class:`StorageJob`, gathered by :class:`Collector` the way ``torch.save`` shares storages),
and the transform (byte planes or bytes) a storage is coded with."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from s4w_core import delta
from s4w_core.errors import ManifestError, UnsupportedTypeError
from s4w_core.format.manifest import PLAIN, PLANE_TRANSFORMS, RC_PLAIN, RC_ROTL1, ROTL1
from s4w_core.planes import PLANE_DTYPES, plane_width, split_planes

__all__ = [
    "row_length_of",
    "row_lengths",
    "BaseLookup",
    "BaseResolver",
    "DTYPES",
    "TRANSFORMS",
    "Collector",
    "StorageJob",
    "check_views",
    "dtype_from_name",
    "dtype_name",
    "plane_rot",
    "row_length",
    "planes_of",
    "transform_for",
]

BaseLookup = Callable[[str, int, str], "tuple[torch.Tensor, dict[str, Any]] | None"]
BaseResolver = Callable[[dict[str, Any], int], torch.Tensor]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


#: every dtype a manifest may name, by the name :func:`dtype_name` writes: the ``torch.dtype``
#: attributes of the ``torch`` module itself (read from its namespace: a name is never looked up
#: with ``getattr``, which imports lazy submodules such as ``torch.onnx`` by name), less quantized
#: ones and those without dense tensors
DTYPES: dict[str, torch.dtype] = {}
for _n, _v in sorted(vars(torch).items()):
    if isinstance(_v, torch.dtype) and not _n.startswith(("_", "q")) and dtype_name(_v) == _n:
        try:
            with warnings.catch_warnings():  # complex32: "experimental"
                warnings.simplefilter("ignore")
                torch.empty((), dtype=_v)
        except (RuntimeError, TypeError):
            continue
        DTYPES[_n] = _v


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (as written by :func:`dtype_name`), from the allow-list
    :data:`DTYPES`; ManifestError otherwise."""
    dt = DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise ManifestError(f"manifest names unknown dtype {name!r}")
    return dt


def check_views(m: dict[str, Any], name: str) -> None:
    """Check every tensor view of a validated manifest against its storage before anything is
    decoded: a known dtype, and the view's last element inside the storage (docs/FORMAT.md 3.2).
    Raises ManifestError naming the tensor."""
    storages = m["storages"]
    for k, s in enumerate(storages):  # a storage's dtype too (the GPU reader trusts it for its planes)
        if not isinstance(s.get("dtype"), str) or s["dtype"] not in DTYPES:
            raise ManifestError(f"{name}: manifest: storage {k} names unknown dtype {s.get('dtype')!r}")
    for i, t in enumerate(m["tensors"]):
        dt = dtype_from_name(t["dtype"])
        nbytes = storages[t["storage"]]["nbytes"]
        if t["_extent"] * dt.itemsize > nbytes:
            raise ManifestError(
                f"{name}: manifest: tensor {i} ({t['path']!r}) reaches past the end of its storage "
                f"({t['_extent']} elements of {dt} in {nbytes} bytes)"
            )
        if t.get("requires_grad") and not (dt.is_floating_point or dt.is_complex):
            raise ManifestError(f"{name}: manifest: tensor {i} ({t['path']!r}) of dtype {dt} cannot require grad")


def row_length(t: torch.Tensor, nbytes: int) -> int | None:
    """The row length ``C`` a writer may use for the row/column transform of the storage of ``t``
    (``nbytes`` bytes): see :func:`row_length_of`."""
    return row_length_of(tuple(t.shape), t.stride(), int(t.storage_offset()), t.element_size(), nbytes)


def row_length_of(shape: Sequence[int], stride: Sequence[int], offset: int, itemsize: int, nbytes: int) -> int | None:
    """``prod(shape[1:])`` for a view of at least 2 dimensions, 2 rows and 2 columns that is
    contiguous (strides of size-1 dimensions aside, as torch counts them), starts at its storage's
    start and covers all of its ``nbytes``; else None."""
    if len(shape) < 2 or len(stride) != len(shape) or offset:
        return None
    expect = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expect:
            return None
        expect *= size
    if not expect or expect * itemsize != nbytes:
        return None
    cols = expect // shape[0]
    return cols if cols >= 2 and shape[0] >= 2 else None


def row_lengths(tensors: list[dict[str, Any]], nbytes: list[int]) -> list[int | None]:
    """:func:`row_length` per storage from a tensor table (manifest ``tensors`` entries: ``storage``,
    ``dtype``, ``shape``, ``stride``, ``offset``), the first tensor that views each storage as the
    collector took it: what a step rebuilt from its manifest (the store's re-encodings) codes with."""
    out: list[int | None] = [None] * len(nbytes)
    seen: set[int] = set()
    for t in tensors:
        i = t.get("storage")
        if type(i) is not int or not 0 <= i < len(nbytes) or i in seen:
            continue
        seen.add(i)
        dt = DTYPES.get(str(t.get("dtype")))
        if dt is not None:
            out[i] = row_length_of(list(t.get("shape") or []), list(t.get("stride") or []), int(t.get("offset") or 0),
                                   dt.itemsize, nbytes[i])
    return out


@dataclass
class StorageJob:
    """One storage to encode: its bytes as a 1-D uint8 tensor and how to interpret them."""

    raw: torch.Tensor  # 1-D uint8, contiguous, on its device
    dtype: torch.dtype
    path: str
    device: str
    base: torch.Tensor | None = None  # same shape as raw, same device
    base_ref: dict[str, Any] | None = None
    #: ``(transform, op)`` once :func:`choose_delta_ops` chose the delta op for this base
    delta_choice: tuple[str, str | None] | None = None
    #: row length in elements of a 2-D view of the whole storage (the row/column transform's ``C``,
    #: docs/FORMAT.md 4.5d), or None where no tensor views it that way
    cols: int | None = None


@dataclass
class Collector:
    """Gathers tensors while the tree is encoded; shares storages the way torch.save does."""

    tensors: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[StorageJob] = field(default_factory=list)
    _by_id: dict[int, int] = field(default_factory=dict)
    _storage_idx: dict[tuple[str, int], int] = field(default_factory=dict)
    _keep: list[Any] = field(default_factory=list)

    def add(self, t: torch.Tensor, path: str) -> int:
        if id(t) in self._by_id:
            return self._by_id[id(t)]
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedTypeError(
                f"{path}: tensor subclass {type(t).__qualname__} is not supported by s4w_core.save "
                "(for DTensor/sharded state use the torch.distributed.checkpoint integration)"
            )
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise UnsupportedTypeError(
                f"{path}: {t.layout} / quantized / meta tensors are not supported; only dense tensors"
            )
        src = t
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        st = t.untyped_storage()
        nbytes = st.nbytes()
        key = (str(t.device), st.data_ptr()) if nbytes else ("empty", id(st))
        sidx = self._storage_idx.get(key)
        if sidx is None:
            sidx = len(self.jobs)
            self._storage_idx[key] = sidx
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (nbytes,), (1,))
            self.jobs.append(StorageJob(raw, t.dtype, path, str(t.device), cols=row_length(t, nbytes)))
            self._keep.append(st)
        entry = {
            "path": path,
            "storage": sidx,
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "requires_grad": bool(src.requires_grad),
            "param": isinstance(src, torch.nn.Parameter),
        }
        self._by_id[id(src)] = len(self.tensors)
        self._keep.append(src)
        self.tensors.append(entry)
        return len(self.tensors) - 1



#: every transform (:data:`PLANE_TRANSFORMS`, defined with the format, apply to the dtypes of
#: :data:`~s4w_core.planes.PLANE_DTYPES`, with the same widths, segments, chunks and delta ops)
TRANSFORMS = (*PLANE_TRANSFORMS, "bytes")


def plane_rot(transform: str) -> bool:
    """Whether the byte-plane ``transform`` rotates each element left by one bit before the split:
    True for ``planes-rotl1`` (and ``rc-planes-rotl1``), False for ``planes`` (and ``rc-planes``;
    the ``rot`` argument of
    :func:`~s4w_core.planes.split_planes` and :func:`~s4w_core.planes.merge_planes`). Raises
    ValueError for any other transform.

    Example:
        >>> plane_rot("planes-rotl1"), plane_rot("planes")
        (True, False)
    """
    if transform == ROTL1 or transform == RC_ROTL1:
        return True
    if transform == PLAIN or transform == RC_PLAIN:
        return False
    raise ValueError(f"{transform!r} is not a byte-plane transform (one of {PLANE_TRANSFORMS})")


#: storages of fewer bytes (scalars) keep their bytes as they are by default (``bytes``: one
#: chunk): a plane split gains nothing there and multiplies chunks (each fp32 optimizer step
#: counter made four one-byte chunks, each checksummed and listed in the manifest)
PLANES_MIN_BYTES = 8


def transform_for(dtype: torch.dtype, nbytes: int, *, transform: str | None = None) -> tuple[str, int]:
    """The transform and plane width to store ``nbytes`` bytes of ``dtype`` with.

    ``transform=None``: the default choice, ``planes-rotl1`` for the plane dtypes (when ``nbytes``
    is a whole number of elements, at least :data:`PLANES_MIN_BYTES`), else ``bytes``. A transform named here is checked instead:
    a byte-plane transform (:data:`PLANE_TRANSFORMS`) needs a plane dtype and whole elements,
    ``bytes`` applies to anything; otherwise ValueError.

    Example:
        >>> transform_for(torch.bfloat16, 8), transform_for(torch.float32, 4), transform_for(torch.float32, 8, transform="planes")
        (('planes-rotl1', 2), ('bytes', 1), ('planes', 4))
    """
    if transform is None:
        if dtype in PLANE_DTYPES and nbytes >= PLANES_MIN_BYTES:
            w = plane_width(dtype)
            if nbytes % w == 0:
                return "planes-rotl1", w
        return "bytes", 1
    if transform == "bytes":
        return "bytes", 1
    if transform not in PLANE_TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}; one of {TRANSFORMS}")
    if dtype not in PLANE_DTYPES or nbytes % plane_width(dtype):
        raise ValueError(f"transform {transform!r} does not apply to {dtype_name(dtype)} x {nbytes} bytes")
    return transform, plane_width(dtype)


def planes_of(
    raw: torch.Tensor, dtype: torch.dtype, transform: str, base: torch.Tensor | None, op: str | None = "xor"
) -> torch.Tensor:
    """The planes (a ``(w, n)`` uint8 tensor; one row of bytes for ``bytes``) that ``transform``
    codes for the CPU bytes ``raw``, as the residual of delta ``op`` against ``base`` where given."""
    if base is not None and op not in (None, "xor"):
        raw, base = delta.forward(op, raw, base, dtype), None
    if transform in PLANE_TRANSFORMS:
        return split_planes(raw, dtype, base, rot=plane_rot(transform))
    x = raw if base is None else raw ^ base
    return x.view(1, -1)

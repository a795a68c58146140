"""The non-tensor part of a checkpoint ("skeleton") as tagged JSON, and back. No pickle.

Tensors are replaced by ``{"$t": k}`` (index into the manifest's tensor table).  Every value type
has one encoding (see docs/FORMAT.md, "tree"); anything else raises
:class:`~s4w_core.errors.UnsupportedTypeError` naming where it was found, instead of being pickled.
"""

from __future__ import annotations

import argparse
import base64
import collections
import importlib
import math
import re
import struct
import warnings
from typing import Any, Callable

import torch

from s4w_core.engine import DTYPES
from s4w_core.errors import ManifestError, UnsupportedTypeError

__all__ = ["encode_tree", "decode_tree", "register_dict_type", "numpy_dtype", "MAX_DEPTH"]

MAX_DEPTH = 200

# dict subclasses rebuilt by name on load (import by name only from this list: never arbitrary code)
_DICT_TYPES: dict[str, str | type] = {
    "lightning.fabric.utilities.data.AttributeDict": "lightning.fabric.utilities.data:AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict": "lightning_fabric.utilities.data:AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict": "pytorch_lightning.utilities.parsing:AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict": "lightning.pytorch.utilities.parsing:AttributeDict",
}


#: the numpy dtype strings a file may name (``dtype.str`` of every dtype a save writes: bool, ints,
#: floats, complex, bytes/str/void of up to 9 digits, datetime/timedelta with a plain unit and an
#: optional multiplier). Checked before numpy parses the string: numpy divides by a unit's
#: denominator (``m8[1Y/0]`` kills the process with SIGFPE) and accepts far more than it writes.
_NP_DTYPE = re.compile(
    r"[<>|=]?(?:[?]|b1|[iu][1248]|f(?:2|4|8|12|16)|c(?:8|16|24|32)|[SUV][0-9]{0,9}"
    r"|[mM]8(?:\[(?:[1-9][0-9]{0,5})?(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as|generic)\])?)"
)


def numpy_dtype(spec: Any) -> Any:
    """The ``numpy.dtype`` a file names by ``spec`` (a ``dtype.str``), checked against
    :data:`_NP_DTYPE` before numpy sees it; ManifestError for anything else (object dtypes too)."""
    if not isinstance(spec, str) or _NP_DTYPE.fullmatch(spec) is None:
        raise ManifestError(f"manifest tree: bad numpy dtype {spec!r}")
    np = _numpy()
    try:
        dt = np.dtype(spec)
    except (TypeError, ValueError):
        raise ManifestError(f"manifest tree: bad numpy dtype {spec!r}") from None
    if dt.hasobject:
        raise ManifestError("manifest tree: numpy object dtype")
    return dt


def register_dict_type(cls: type) -> None:
    """Allow ``load`` to rebuild instances of the ``dict`` subclass ``cls`` (by qualified name).

    ``load`` never imports a module because a file names it: a dict subclass comes back as its own
    class only if it was registered in this process, otherwise as a plain ``dict`` (with a warning).

    Args:
        cls: a subclass of ``dict`` whose ``cls()`` constructor takes no arguments.
    Returns:
        None.
    Raises:
        TypeError: ``cls`` is not a dict subclass.
    Example:
        >>> import io, torch, s4w_core
        >>> class Config(dict):
        ...     pass
        >>> s4w_core.register_dict_type(Config)
        >>> buf = io.BytesIO(); _ = s4w_core.save({"cfg": Config(lr=0.1)}, buf)
        >>> type(s4w_core.load(buf.getvalue())["cfg"]).__name__
        'Config'
    """
    if not issubclass(cls, dict):
        raise TypeError(f"{cls!r} is not a dict subclass")
    # the class itself: classes defined in __main__, a notebook or a function cannot be re-imported by name
    _DICT_TYPES[f"{cls.__module__}.{cls.__qualname__}"] = cls


def _float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"$f64": struct.pack("<d", x).hex()}


def encode_tree(
    obj: Any, add_tensor: Callable[[torch.Tensor, str], int]
) -> Any:
    """Encode ``obj``; ``add_tensor(t, path)`` registers a tensor and returns its index."""
    active: set[int] = set()

    def enc(o: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedTypeError(f"{path or '<root>'}: nesting deeper than {MAX_DEPTH}")
        if o is None or isinstance(o, (bool, str)):
            return o
        if isinstance(o, int) and type(o) is int:
            return o
        if isinstance(o, float) and type(o) is float:
            return _float(o)
        if isinstance(o, torch.Tensor):
            return {"$t": add_tensor(o, path)}
        if isinstance(o, (torch.dtype,)):
            return {"$dtype": str(o).removeprefix("torch.")}
        if isinstance(o, torch.device):
            return {"$device": str(o)}
        if isinstance(o, torch.Size):
            return {"$size": list(o)}
        oid = id(o)
        if isinstance(o, (list, tuple, dict, set, frozenset, argparse.Namespace)):
            if oid in active:
                raise UnsupportedTypeError(f"{path or '<root>'}: the object contains itself (a cycle)")
            active.add(oid)
        try:
            return _enc_container(o, path, depth, enc)
        finally:
            active.discard(oid)

    try:
        return enc(obj, "", 0)
    finally:
        # ``enc`` reaches itself through its closure cell: a reference cycle holding
        # ``add_tensor`` (a collector with every storage job and tensor of the state) until the
        # cyclic GC ran. Rebinding the cell breaks it, as decode_tree does.
        enc = None  # type: ignore[assignment]


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _enc_container(o: Any, path: str, depth: int, enc: Callable[[Any, str, int], Any]) -> Any:
    d = depth + 1
    if type(o) is list:
        return [enc(v, _join(path, i), d) for i, v in enumerate(o)]
    if type(o) is tuple:
        return {"$tuple": [enc(v, _join(path, i), d) for i, v in enumerate(o)]}
    if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple: keep the values
        raise UnsupportedTypeError(
            f"{path or '<root>'}: namedtuple {type(o).__qualname__} is not supported; convert it "
            "to a tuple or dict before saving"
        )
    if isinstance(o, dict):
        items = [[enc(k, _join(path, f"<key {i}>"), d), enc(v, _join(path, k), d)] for i, (k, v) in enumerate(o.items())]
        if type(o) is dict:
            if all(type(k) is str and not k.startswith("$") for k in o):
                return {k: v for (k, _), (_, v) in zip(o.items(), items)}
            return {"$dict": items}
        if type(o) is collections.OrderedDict:
            return {"$odict": items}
        if type(o) is collections.defaultdict:
            raise UnsupportedTypeError(
                f"{path or '<root>'}: defaultdict is not supported (its factory would need pickling); "
                "convert it with dict(...)"
            )
        return {"$dictsub": f"{type(o).__module__}.{type(o).__qualname__}", "items": items}
    if isinstance(o, (set, frozenset)):
        tag = "$set" if type(o) is set else "$frozenset"
        vals = list(o)
        try:
            vals = sorted(vals)
        except TypeError:
            pass
        return {tag: [enc(v, _join(path, i), d) for i, v in enumerate(vals)]}
    if isinstance(o, (bytes, bytearray)):
        return {"$bytes" if type(o) is bytes else "$bytearray": base64.b64encode(o).decode("ascii")}
    if type(o) is complex:
        return {"$complex": [_float(o.real), _float(o.imag)]}
    if type(o) is argparse.Namespace:
        return {"$namespace": {k: enc(v, _join(path, k), d) for k, v in vars(o).items()}}
    np = _numpy()
    if np is not None:
        if isinstance(o, np.ndarray):
            if o.dtype == object:
                raise UnsupportedTypeError(f"{path or '<root>'}: numpy object arrays are not supported")
            return {"$ndarray": enc(torch.from_numpy(np.ascontiguousarray(o)), path, d)}
        if isinstance(o, np.generic):
            a = np.asarray(o)
            return {"$npscalar": [a.dtype.str, base64.b64encode(a.tobytes()).decode("ascii")]}
        if isinstance(o, np.dtype):
            return {"$npdtype": o.str}
    raise UnsupportedTypeError(
        f"{path or '<root>'}: cannot store a {type(o).__module__}.{type(o).__qualname__} without "
        "pickling it, and s4weights never pickles (loading must not execute code). Convert it to "
        "plain Python values (dict, list, str, numbers) or a tensor"
    )


def _numpy() -> Any:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover
        return None


def decode_tree(node: Any, tensors: list[Any], name: str | None = None) -> Any:
    """Inverse of :func:`encode_tree`; ``tensors[k]`` is the loaded tensor for ``{"$t": k}``.
    ``name`` (the file) starts every error message."""
    where = f"{name}: manifest tree" if name else "manifest tree"

    def bad(msg: str) -> ManifestError:
        return ManifestError(f"{where}: {msg}")

    def f64(v: Any) -> float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, dict) and set(v) == {"$f64"} and isinstance(v["$f64"], str) and len(v["$f64"]) == 16:
            try:
                return float(struct.unpack("<d", bytes.fromhex(v["$f64"]))[0])
            except ValueError:
                pass
        raise bad(f"bad float {v!r}")

    def pairs(v: Any, depth: int) -> list[tuple[Any, Any]]:
        if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
            raise bad("mapping items must be [key, value] pairs")
        out = []
        for k, x in v:
            key = dec(k, depth)
            try:
                hash(key)
            except TypeError:
                raise bad(f"unhashable mapping key {key!r}") from None
            out.append((key, dec(x, depth)))
        return out

    def dec(n: Any, depth: int) -> Any:
        if depth > MAX_DEPTH + 2:
            raise bad("nesting too deep")
        d = depth + 1
        if n is None or isinstance(n, (bool, str, int, float)):
            return n
        if isinstance(n, list):
            return [dec(v, d) for v in n]
        if not isinstance(n, dict):
            raise bad(f"unexpected JSON value {type(n).__name__}")
        if len(n) >= 1 and any(k.startswith("$") for k in n):
            tag = next(k for k in n if k.startswith("$"))
            v = n[tag]
            if tag == "$t" and len(n) == 1:
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < len(tensors):
                    raise bad(f"tensor reference {v!r} out of range")
                return tensors[v]
            if tag == "$f64" and len(n) == 1:
                return f64(n)
            if tag == "$tuple" and isinstance(v, list):
                return tuple(dec(x, d) for x in v)
            if tag == "$dict":
                return dict(pairs(v, d))
            if tag == "$odict":
                return collections.OrderedDict(pairs(v, d))
            if tag == "$dictsub" and isinstance(v, str) and set(n) == {"$dictsub", "items"}:
                items = pairs(n["items"], d)
                cls = _dict_type(v)
                if cls is None:
                    warnings.warn(
                        f"s4weights: {v} is not a registered dict type; returning a plain dict "
                        "(register it with s4w_core.register_dict_type)",
                        stacklevel=4,
                    )
                    return dict(items)
                obj = cls()
                obj.update(items)
                return obj
            if tag in ("$set", "$frozenset") and isinstance(v, list):
                vals = [dec(x, d) for x in v]
                try:
                    return set(vals) if tag == "$set" else frozenset(vals)
                except TypeError:
                    raise bad("unhashable set member") from None
            if tag in ("$bytes", "$bytearray") and isinstance(v, str):
                try:
                    b = base64.b64decode(v, validate=True)
                except ValueError:
                    raise bad("bad base64") from None
                return b if tag == "$bytes" else bytearray(b)
            if tag == "$complex" and isinstance(v, list) and len(v) == 2:
                return complex(f64(v[0]), f64(v[1]))
            if tag == "$dtype" and isinstance(v, str):
                dt = DTYPES.get(v)  # an allow-list: never getattr(torch, name) (imports submodules)
                if dt is None:
                    raise bad(f"unknown dtype {v!r}")
                return dt
            if tag == "$device" and isinstance(v, str):
                try:
                    return torch.device(v)
                except RuntimeError:
                    raise bad(f"bad device {v!r}") from None
            if tag == "$size" and isinstance(v, list) and all(type(x) is int for x in v):
                if len(v) > 64 or not all(-(1 << 63) <= x < 1 << 63 for x in v):  # torch.Size holds int64
                    raise bad(f"bad torch.Size {v!r}")
                return torch.Size(v)
            if tag == "$namespace" and isinstance(v, dict):
                return argparse.Namespace(**{str(k): dec(x, d) for k, x in v.items()})
            if tag == "$ndarray":
                t = dec(v, d)
                if not isinstance(t, torch.Tensor):
                    raise bad("$ndarray must wrap a tensor")
                try:
                    return t.detach().cpu().numpy()
                except (TypeError, RuntimeError):
                    raise bad(f"$ndarray wraps a {t.dtype} tensor, which numpy cannot hold") from None
            if tag == "$npscalar" and isinstance(v, list) and len(v) == 2:
                np = _numpy()
                try:
                    dt = numpy_dtype(v[0])
                except ManifestError as e:
                    raise bad(str(e).removeprefix("manifest tree: ")) from None
                try:
                    if not isinstance(v[1], str):
                        raise TypeError
                    raw = base64.b64decode(v[1], validate=True)
                    if len(raw) != dt.itemsize:
                        raise ValueError
                    return np.frombuffer(raw, dtype=dt)[0]
                except (TypeError, ValueError):
                    raise bad(f"bad numpy scalar {v!r}") from None
            if tag == "$npdtype" and isinstance(v, str):
                try:
                    return numpy_dtype(v)
                except ManifestError as e:
                    raise bad(str(e).removeprefix("manifest tree: ")) from None
            raise bad(f"unknown or malformed tag {tag!r}")
        return {k: dec(v, d) for k, v in n.items()}

    try:
        return dec(node, 0)
    finally:
        # ``dec`` and ``pairs`` reach themselves through their closure cells: a reference cycle
        # holding ``tensors``, which kept every loaded tensor (a checkpoint's memory) alive after
        # the caller dropped it, until the cyclic GC ran. Rebinding the cells breaks the cycle.
        dec = pairs = None  # type: ignore[assignment]


def _dict_type(name: str) -> type | None:
    target = _DICT_TYPES.get(name)
    if target is None:
        return None
    if isinstance(target, type):
        return target
    mod, _, qual = target.partition(":")
    try:
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, dict) else None

"""The store's layout and commit records: object keys under a store's root, and
:class:`StepInfo`, one step's commit record (docs/STORE.md, "Layout").

    data/step_000000000100.<token>.s4w   one s4weights container per step (immutable)
    commits/step_000000000100.json       the commit record, written last: the step exists iff it does
    pins/step_000000000100               empty marker: the step is exempt from retention
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from s4w_core import pipeline
from s4w_core._fsutil import is_safe_name
from s4w_core.errors import ManifestError

__all__ = [
    "STORE_FORMAT",
    "STORE_VERSION",
    "READ_VERSIONS",
    "COMMITS",
    "DATA",
    "PINS",
    "STEP_RE",
    "StepInfo",
    "check_step",
    "commit_key",
    "data_key",
    "dict_or_empty",
    "parse_record",
    "pin_key",
    "replace_record",
    "step_of_object",
    "new_record",
    "count_ops",
    "visible",
    "needed_hidden",
    "deltas_into",
    "retained",
]

STORE_FORMAT = "s4weights-store"
STORE_VERSION = 2
#: record versions this code reads: 1 (forward deltas, keyframe copies), 2 (also reverse deltas)
READ_VERSIONS = (1, 2)
COMMITS = "commits/"
DATA = "data/"
PINS = "pins/"
STEP_RE = re.compile(r"^step_(\d{12})(?:\.json)?$")
_DATA_STEP_RE = re.compile(r"^data/step_(\d{12})\.")
_MAX_RECORD = 1 << 24


def commit_key(step: int) -> str:
    """The key of ``step``'s commit record."""
    return f"{COMMITS}step_{step:012d}.json"


def data_key(step: int) -> str:
    """A fresh data object key: the token differs for every save attempt."""
    return f"{DATA}step_{step:012d}.{uuid.uuid4().hex[:12]}.s4w"


def step_of_object(key: str) -> int | None:
    """The step a data object key was written for (``data/step_000000000100.<token>.s4w``)."""
    m = _DATA_STEP_RE.match(key)
    return int(m.group(1)) if m else None


def pin_key(step: int) -> str:
    """The key of ``step``'s pin marker."""
    return f"{PINS}step_{step:012d}"


def check_step(step: Any) -> int:
    """``step`` if it is a valid step number (ValueError otherwise)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**12:
        raise ValueError(f"step must be an integer in [0, 10**12), got {step!r}")
    return step


@dataclass(frozen=True)
class StepInfo:
    """One committed step, as its commit record describes it (no data is read)."""

    step: int
    kind: str  # "keyframe" | "delta"
    depth: int  # deltas since the last keyframe (0 for a keyframe)
    base_step: int | None
    object: str
    object_bytes: int
    raw_bytes: int
    stored_bytes: int
    objects: tuple[str, ...]
    created: str
    profile: str
    kinds: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    delta_ops: dict[str, int] = field(default_factory=dict)  # storages per delta op
    pinned: bool = False
    #: where the step is committed, for a store with a fast tier: ("fast",), ("slow",) or both;
    #: () for a store without tiers.  Not part of the commit record.
    tiers: tuple[str, ...] = ()
    #: a keyframe container of the same bytes, written after the step committed (the newest
    #: delta step has one: a load of it reads that one object instead of its chain); None if none
    copy: str | None = None
    copy_bytes: int = 0
    #: deleted, but kept (its record and data object) while a kept step is a delta against it;
    #: never listed, collected once no kept step's chain reaches it (docs/STORE.md, "Retention")
    hidden: bool = False

    @property
    def reverse(self) -> bool:
        """A delta against a newer step (the reverse layout): its chain is resolved through the
        base step's current commit record, not through ``objects``."""
        return self.base_step is not None and self.base_step > self.step

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.object_bytes if self.object_bytes else 1.0

    @property
    def live_objects(self) -> tuple[str, ...]:
        """The data objects this record keeps alive: its own (a forward delta of the first layout:
        its chain's) and a first-layout keyframe copy."""
        return (*self.objects, self.copy) if self.copy is not None else self.objects

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "depth": self.depth,
            "base_step": self.base_step,
            "object": self.object,
            "object_bytes": self.object_bytes,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.ratio, 4),
            "objects": list(self.objects),
            "created": self.created,
            "profile": self.profile,
            "kinds": self.kinds,
            "groups": self.groups,
            "extra": self.extra,
            "delta_ops": self.delta_ops,
            "pinned": self.pinned,
            **({"tiers": list(self.tiers)} if self.tiers else {}),
            **({"keyframe_copy": {"object": self.copy, "bytes": self.copy_bytes}} if self.copy is not None else {}),
            **({"hidden": True} if self.hidden else {}),
        }

    def record(self) -> dict[str, Any]:
        """The commit record's JSON object."""
        d = self.as_dict()
        d.pop("ratio")
        d.pop("pinned")
        d.pop("tiers", None)
        return {"format": STORE_FORMAT, "version": STORE_VERSION, **d}


def dict_or_empty(v: Any) -> dict[str, Any]:
    """``v`` if it is a dict, else an empty one (a record's optional mappings)."""
    return v if isinstance(v, dict) else {}


def parse_record(body: bytes, key: str, where: str) -> StepInfo:
    def bad(why: str) -> ManifestError:
        return ManifestError(f"{where}: commit record {key} is invalid: {why}")

    if len(body) > _MAX_RECORD:
        raise bad(f"{len(body)} bytes, larger than {_MAX_RECORD}")
    try:
        r = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise bad(f"not JSON ({e}): truncated or corrupt") from e
    if not isinstance(r, dict) or r.get("format") != STORE_FORMAT:
        raise bad("not an s4weights-store commit record")
    if r.get("version") not in READ_VERSIONS:
        raise bad(f"store version {r.get('version')!r}; this s4weights reads versions {READ_VERSIONS}")
    m = STEP_RE.match(key[len(COMMITS) :])
    try:
        step = check_step(r["step"])
        if m is None or int(m.group(1)) != step:
            raise bad(f"it names step {step}, but its key names another")
        obj, objects = r["object"], r["objects"]
        if not isinstance(obj, str) or not obj.startswith(DATA) or not is_safe_name(obj):
            raise bad(f"data object {obj!r} is not a safe object name under {DATA}")
        if not isinstance(objects, list) or not objects or objects[0] != obj or not all(
            isinstance(o, str) and o.startswith(DATA) and is_safe_name(o) for o in objects
        ):
            raise bad("'objects' must list the data objects of its chain, its own first")
        ints = {k: r[k] for k in ("depth", "object_bytes", "raw_bytes", "stored_bytes")}
        for k, v in ints.items():
            if type(v) is not int or v < 0:
                raise bad(f"{k} must be a non-negative integer, got {v!r}")
        base = r.get("base_step")
        if base is not None and (type(base) is not int or base == step or (r["version"] == 1 and base > step)):
            raise bad(f"base_step {base!r} must be another step (an earlier one in a version 1 record)")
        if r["kind"] not in ("keyframe", "delta"):
            raise bad(f"unknown kind {r['kind']!r}")
        copy, copy_bytes = None, 0
        if r.get("keyframe_copy") is not None:
            c = r["keyframe_copy"]
            if not isinstance(c, dict) or not isinstance(c.get("object"), str) or type(c.get("bytes")) is not int:
                raise bad(f"keyframe_copy must be {{'object': KEY, 'bytes': N}}, got {c!r}")
            copy, copy_bytes = c["object"], c["bytes"]
            if not copy.startswith(DATA) or not is_safe_name(copy) or copy in objects or copy_bytes < 0:
                raise bad(f"keyframe_copy {copy!r} ({copy_bytes} bytes) is not a data object of its own under {DATA}")
        hidden = r.get("hidden", False)
        if type(hidden) is not bool:
            raise bad(f"hidden must be true or false, got {hidden!r}")
        return StepInfo(
            step=step,
            kind=r["kind"],
            depth=r["depth"],
            base_step=base,
            object=obj,
            object_bytes=r["object_bytes"],
            raw_bytes=r["raw_bytes"],
            stored_bytes=r["stored_bytes"],
            objects=tuple(objects),
            created=str(r.get("created", "")),
            profile=str(r.get("profile", "")),
            kinds=dict_or_empty(r.get("kinds")),
            groups=dict_or_empty(r.get("groups")),
            extra=dict_or_empty(r.get("extra")),
            delta_ops=dict_or_empty(r.get("delta_ops")),
            copy=copy,
            copy_bytes=copy_bytes,
            hidden=hidden,
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ManifestError):
            raise
        raise bad(f"missing or malformed field ({e})") from e


def replace_record(rec: StepInfo, **kw: Any) -> StepInfo:
    """``rec`` with the fields ``kw`` changed."""
    return dataclasses.replace(rec, **kw)


def new_record(
    step: int,
    key: str,
    size: int,
    manifest: dict[str, Any],
    prof: str,
    base: StepInfo | None,
    extra: Mapping[str, Any] | None,
) -> StepInfo:
    """The commit record of a step whose container ``manifest`` was written to ``key``.  A delta
    against a newer ``base`` (the reverse layout) lists only its own object: its chain is found
    through ``base_step`` (:class:`Chain`); one against an older base lists its chain's objects."""
    groups, _dtypes, kinds, raw, stored, ndelta = pipeline.summarize(manifest)
    is_delta = ndelta > 0
    assert base is not None or not is_delta
    reverse = is_delta and base is not None and base.step > step
    return StepInfo(
        step=step,
        kind="delta" if is_delta else "keyframe",
        depth=base.depth + 1 if is_delta and base is not None else 0,
        base_step=base.step if is_delta and base is not None else None,
        object=key,
        object_bytes=size,
        raw_bytes=raw,
        stored_bytes=stored,
        objects=tuple([key, *(base.objects if is_delta and base is not None and not reverse else ())]),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        profile=prof,
        kinds={k: v.as_dict() for k, v in kinds.items()},
        groups={k: v.as_dict() for k, v in groups.items()},
        extra=dict(extra or {}),
        delta_ops=count_ops(manifest),
    )


def count_ops(manifest: Mapping[str, Any]) -> dict[str, int]:
    ops: dict[str, int] = {}
    for s in manifest["storages"]:
        if s.get("delta"):
            ops[s["delta"]["op"]] = ops.get(s["delta"]["op"], 0) + 1
    return ops


def visible(recs: Mapping[int, StepInfo]) -> dict[int, StepInfo]:
    """The committed steps of ``recs``: those not hidden."""
    return {s: r for s, r in recs.items() if not r.hidden}


def needed_hidden(recs: Mapping[int, StepInfo]) -> set[int]:
    """The hidden steps of ``recs`` that some visible step's chain of reverse deltas reaches
    (through other hidden steps too): those must stay."""
    needed: set[int] = set()
    for r in recs.values():
        if r.hidden:
            continue
        seen = {r.step}
        base = r.base_step if r.reverse else None
        while base is not None and base in recs and base not in seen:
            seen.add(base)
            r = recs[base]
            if r.hidden:
                needed.add(r.step)
            base = r.base_step if r.reverse else None
    return needed


def deltas_into(recs: Mapping[int, StepInfo], step: int) -> int:
    """The most reverse deltas of ``recs`` (hidden ones too) that a chain crosses before it
    reaches ``step``: 0 when no delta is against it.  A chain need not run through adjacent
    steps (a delta re-coded past an overwritten or deleted step skips it)."""
    most = 0
    for r in recs.values():
        n, seen = 0, {r.step}
        while r.reverse and r.base_step is not None and r.base_step in recs and r.base_step not in seen:
            n += 1
            if r.base_step == step:
                most = max(most, n)
                break
            seen.add(r.base_step)
            r = recs[r.base_step]
    return most


def retained(steps: Iterable[int], keep_last: int, pinned: Iterable[int]) -> set[int]:
    """The steps ``keep_last`` keeps of ``steps``: the newest ``keep_last`` and the pinned ones."""
    return set(sorted(steps)[-keep_last:]) | set(pinned)

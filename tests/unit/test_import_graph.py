"""The house stays tidy: no new import cycle, no new private name reached across modules.

Reads the source of the project's packages with ``ast`` (nothing is imported) and builds the graph of
imports between their modules. Imports inside functions and under ``if TYPE_CHECKING:`` count: a cycle
hidden behind either is still a cycle. Two kinds of finding:

- an import cycle: a strongly connected group of modules (edges from a package ``__init__`` to its own
  submodules, and from a module to the ``__init__`` of a package holding it, are re-exports, not cycles);
- a private name reached across modules: ``from m import _name`` or ``m._name`` where ``m`` is another
  module of the project (a ``_private`` *module* may be imported inside its own package).

Today's known offenders are listed in ``KNOWN_CYCLES`` and ``KNOWN_PRIVATE``; each entry is a TODO that
the redesign of issue #29 removes. A finding not on those lists fails the test, and so does an entry that
no longer matches anything (remove it: the list only shrinks).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (directory that holds the package, package name)
PACKAGES: tuple[tuple[Path, str], ...] = (
    (ROOT, "s4w_core"),
    (ROOT / "integrations", "s4w_lightning"),
    (ROOT / "integrations", "s4w_transformers"),
    (ROOT / "integrations", "s4w_accelerate"),
)

# No import cycle is known: never add one.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()

# (importing module, "module.private_name") -- TODO(#29): the redesign removes each of these; never add one.
KNOWN_PRIVATE: frozenset[tuple[str, str]] = frozenset(
    {
    }
)


@dataclass
class ImportGraph:
    """Modules of the scanned packages, the imports between them and the private names reached."""

    files: dict[str, Path]
    edges: dict[str, set[str]] = field(default_factory=dict)
    private: set[tuple[str, str]] = field(default_factory=set)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_files(packages: Iterable[tuple[Path, str]]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file under each package."""
    files: dict[str, Path] = {}
    for parent, pkg in packages:
        for path in sorted((parent / pkg).rglob("*.py")):
            parts = list(path.relative_to(parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _package_of(mod: str, path: Path) -> str:
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def _inside(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _private_module_outside(mod: str, target: str) -> bool:
    """True if ``target`` has a ``_private`` part and ``mod`` is outside the package that holds it."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _is_private(part) and not _inside(mod, ".".join(parts[:i])):
            return True
    return False


def build_graph(packages: Iterable[tuple[Path, str]]) -> ImportGraph:
    """Parse every module of ``packages`` and record imports and private names reached across modules."""
    graph = ImportGraph(module_files(packages))
    files = graph.files
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        pkg = _package_of(mod, path)
        deps: set[str] = set()
        aliases: dict[str, str] = {}  # local name -> project module it is bound to

        def reach(target: str, mod: str = mod) -> None:
            if target.rpartition(".")[0] != mod:
                graph.private.add((mod, target))

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    deps.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        root = a.name.partition(".")[0]
                        aliases[root] = root
                    if a.name in files and _private_module_outside(mod, a.name):
                        graph.private.add((mod, a.name))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                deps.add(base)
                if base in files and _private_module_outside(mod, base):
                    graph.private.add((mod, base))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in files:
                        deps.add(full)
                        aliases[a.asname or a.name] = full
                        if _private_module_outside(mod, full):
                            graph.private.add((mod, full))
                    elif _is_private(a.name) and base in files:
                        reach(full)
        # ``m._name`` where ``m`` (or a dotted path from it) names another project module
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = _dotted(node.value, aliases)
                if owner is None or owner not in files:
                    continue
                target = f"{owner}.{node.attr}"
                if target not in files:
                    reach(target)
                elif _private_module_outside(mod, target):
                    graph.private.add((mod, target))
        graph.edges[mod] = {d for d in deps if d in files and d != mod}
    return graph


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The dotted module path an expression like ``a.b.c`` stands for, via the import aliases."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value, aliases)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _runtime_edges(graph: ImportGraph, mod: str) -> Iterator[str]:
    files = graph.files
    for dep in graph.edges[mod]:
        reexport = files[mod].name == "__init__.py" and dep.startswith(mod + ".")
        own_package = files[dep].name == "__init__.py" and mod.startswith(dep + ".")
        if not (reexport or own_package):
            yield dep


def import_cycles(graph: ImportGraph) -> set[frozenset[str]]:
    """Every strongly connected group of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: set[frozenset[str]] = set()
    counter = 0
    for start in sorted(graph.edges):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(_runtime_edges(graph, start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(_runtime_edges(graph, nxt)))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: set[str] = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.add(m)
                    if m == node:
                        break
                if len(group) > 1:
                    found.add(frozenset(group))
    return found


def violations(
    graph: ImportGraph,
    known_cycles: frozenset[frozenset[str]] = KNOWN_CYCLES,
    known_private: frozenset[tuple[str, str]] = KNOWN_PRIVATE,
) -> tuple[list[str], list[str]]:
    """(new findings, stale allow-list entries), each as readable lines."""
    cycles = import_cycles(graph)
    new = [f"new import cycle: {' <-> '.join(sorted(c))}" for c in sorted(cycles - known_cycles, key=sorted)]
    new += [f"new private name across modules: {m} reaches {t}" for m, t in sorted(graph.private - known_private)]
    stale = [f"cycle gone, remove it from KNOWN_CYCLES: {sorted(c)}" for c in sorted(known_cycles - cycles, key=sorted)]
    stale += [f"gone, remove it from KNOWN_PRIVATE: {e}" for e in sorted(known_private - graph.private)]
    return new, stale


# ------------------------------------------------------------------------------------------- the repo


def test_no_new_import_cycle_or_private_reach() -> None:
    new, _ = violations(build_graph(PACKAGES))
    assert not new, (
        "\n".join(new) + "\nmake the name public (no leading underscore) or move the shared code; "
        "for a cycle, move what both modules need into a third module"
    )


def test_allow_lists_hold_no_stale_entry() -> None:
    _, stale = violations(build_graph(PACKAGES))
    assert not stale, "\n".join(stale)


def test_scan_sees_the_packages() -> None:
    files = module_files(PACKAGES)
    for mod in (
        "s4w_core",
        "s4w_core.api",
        "s4w_core.store.store",
        "s4w_lightning",
        "s4w_transformers",
        "s4w_accelerate",
    ):
        assert mod in files


# ----------------------------------------------------------------------- the check on a synthetic package


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")


CLEAN = {
    "pkg/__init__.py": "from pkg.a import public\nfrom . import b\n",
    "pkg/a.py": "def public():\n    return _own()\n\ndef _own():\n    return 1\n",
    "pkg/b.py": "from pkg.a import public\nfrom pkg import _impl\nfrom . import a\n\ndef f():\n    return a.public() + _impl.x\n",
    "pkg/_impl.py": "import pkg\nx = 1\n",
    "pkg/sub/__init__.py": "from ._deep import y\n",
    "pkg/sub/_deep.py": "from pkg.a import public\ny = public\n",
}


def test_synthetic_clean_package_has_no_finding(tmp_path: Path) -> None:
    _write(tmp_path, CLEAN)
    graph = build_graph([(tmp_path, "pkg")])
    assert set(graph.files) == {"pkg", "pkg.a", "pkg.b", "pkg._impl", "pkg.sub", "pkg.sub._deep"}
    assert graph.edges["pkg.b"] == {"pkg", "pkg.a", "pkg._impl"}
    assert violations(graph, frozenset(), frozenset()) == ([], [])


def test_synthetic_new_cycle_fails_even_behind_a_function_import(tmp_path: Path) -> None:
    _write(tmp_path, CLEAN)
    # a -> c at module level, c -> a inside a function: still a cycle
    (tmp_path / "pkg/a.py").write_text("from pkg.c import g\n\ndef public():\n    return g()\n")
    (tmp_path / "pkg/c.py").write_text("def g():\n    from pkg import a\n    return a\n")
    graph = build_graph([(tmp_path, "pkg")])
    assert import_cycles(graph) == {frozenset({"pkg.a", "pkg.c"})}
    new, _ = violations(graph, frozenset(), frozenset())
    assert new == ["new import cycle: pkg.a <-> pkg.c"]
    # listed, it passes; a third module joining the cycle is a new finding again
    known = frozenset({frozenset({"pkg.a", "pkg.c"})})
    assert violations(graph, known, frozenset()) == ([], [])
    (tmp_path / "pkg/c.py").write_text("import pkg.d\n\ndef g():\n    return 1\n")
    (tmp_path / "pkg/d.py").write_text("from .a import public\n")
    graph = build_graph([(tmp_path, "pkg")])
    new, stale = violations(graph, known, frozenset())
    assert new == ["new import cycle: pkg.a <-> pkg.c <-> pkg.d"]
    assert stale == ["cycle gone, remove it from KNOWN_CYCLES: ['pkg.a', 'pkg.c']"]


def test_synthetic_private_reach_fails(tmp_path: Path) -> None:
    _write(tmp_path, CLEAN)
    _write(
        tmp_path,
        {
            "pkg/c.py": "from pkg.a import _own\n",  # private name imported
            "pkg/d.py": "import pkg.a as alias\n\ndef h():\n    return alias._own()\n",  # module._name
            "pkg/e.py": "import pkg.a\n\ndef h():\n    return pkg.a._own()\n",  # dotted path
            "pkg/f.py": "from pkg.sub import _deep\n",  # a private module from outside its package
            "pkg/g.py": "from . import a\n\nclass K:\n    def m(self):\n        return self._x, a.public, a.__name__\n",
        },
    )
    graph = build_graph([(tmp_path, "pkg")])
    assert graph.private == {
        ("pkg.c", "pkg.a._own"),
        ("pkg.d", "pkg.a._own"),
        ("pkg.e", "pkg.a._own"),
        ("pkg.f", "pkg.sub._deep"),
    }
    new, stale = violations(graph, frozenset(), frozenset({("pkg.c", "pkg.a._own"), ("pkg.z", "pkg.a._gone")}))
    assert new == [
        "new private name across modules: pkg.d reaches pkg.a._own",
        "new private name across modules: pkg.e reaches pkg.a._own",
        "new private name across modules: pkg.f reaches pkg.sub._deep",
    ]
    assert stale == ["gone, remove it from KNOWN_PRIVATE: ('pkg.z', 'pkg.a._gone')"]

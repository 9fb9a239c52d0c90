"""No import cycles inside `keel/`, lazy imports included.

A cycle hidden behind an import inside a function still couples the two modules both ways: neither can be
understood, tested or moved without the other, and the order of first use decides whether it works at all. So
every `import` and `from ... import` in a file counts, wherever it sits, and the graph must have no strongly
connected component of more than one module.

Pure `ast`, no import of keel: fast, and it sees modules whose imports would fail (e.g. a missing optional
dependency) just the same.

An edge goes to the module an import names, not to the packages above it: `import keel.a.b` runs
`keel/__init__.py` and `keel/a/__init__.py` too, but counting those would make every package that re-exports
its own submodules (the usual `__init__.py`) a cycle with each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

KEEL = Path(__file__).resolve().parents[1] / "keel"

Graph = dict[str, dict[str, int]]  # module → {imported module: line of the first import}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every .py under `root` (a package directory); packages by `__init__`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(module: str, path: Path, known: set[str]) -> dict[str, int]:
    """The modules of `known` that `module`'s file imports anywhere, with the line of the first such import."""
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        if name in known and name != module:
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `.` is this file's package, each further dot one package up
                base = _package_of(module, path).split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                add(submodule if submodule in known else target, node.lineno)
    return found


def import_graph(root: Path) -> tuple[Graph, dict[str, Path]]:
    files = module_files(root)
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}, files


def strongly_connected(graph: Graph) -> list[set[str]]:
    """Tarjan's algorithm, iterative (no recursion limit to worry about)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def cycles(graph: Graph) -> list[set[str]]:
    return [c for c in strongly_connected(graph) if len(c) > 1]


def describe(component: set[str], graph: Graph, files: dict[str, Path], root: Path = KEEL) -> str:
    """The component's modules and every import between them, each with the file and line that makes it."""
    edges = [
        f"  {a} -> {b}  ({files[a].relative_to(root.parent)}:{graph[a][b]})"
        for a in sorted(component)
        for b in sorted(graph[a])
        if b in component
    ]
    return f"cycle among {sorted(component)}:\n" + "\n".join(edges)


def test_keel_has_no_import_cycles():
    graph, files = import_graph(KEEL)
    found = cycles(graph)
    report = "\n".join(describe(c, graph, files) for c in found)
    assert not found, f"import cycles in keel/ (lazy imports count too):\n{report}"


def test_checker_sees_lazy_relative_and_from_package_imports(tmp_path):
    """The checker itself: a cycle through a function-level import, a relative import and `from pkg import mod`."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from pkg import c\n")
    (pkg / "c.py").write_text("import os\nfrom . import a\n")
    (pkg / "d.py").write_text("from pkg.sub.b import x\n")  # only into the cycle, not part of it
    graph, files = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b": 2}
    assert graph["pkg.sub.b"] == {"pkg.c": 1}
    assert graph["pkg.c"] == {"pkg.a": 2}
    assert cycles(graph) == [{"pkg.a", "pkg.sub.b", "pkg.c"}]
    assert "pkg/sub/b.py:1" in describe({"pkg.a", "pkg.sub.b", "pkg.c"}, graph, files, pkg).replace(
        "\\", "/"
    )


# The house's layers, bottom to top (docs/architecture.md). A module may import its own layer's modules and any
# layer below; modules in one tuple are peers that may not import each other. The rules this encodes: config is
# plain data; the run dir's layout sits under everything that reads or writes it; an adapter wraps a dependency
# and holds no feature; primitives know no model; data knows no model (and the model reads no data); the engine
# is built before any loop exists; guards decide and the trainer acts; tools read files, never the loop; a rank
# reads its run dir, never the CLI.
LAYERS: list[tuple[str, ...]] = [
    ("keel.config",),
    ("keel.run_dir",),
    ("keel.adapters",),
    ("keel.parallel",),
    ("keel.data", "keel.model"),
    ("keel.engine",),
    ("keel.training.guards",),
    ("keel.training", "keel.tools"),
    ("keel.launcher",),
]


def room_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> tuple[int, str] | None:
    """(layer index, room) of `module`: the longest room prefix that names it; None for a module in no room."""
    best: tuple[int, str] | None = None
    for index, rooms in enumerate(layers):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (
                best is None or len(room) > len(best[1])
            ):
                best = (index, room)
    return best


def layer_violations(
    graph: Graph, files: dict[str, Path], root: Path = KEEL, layers: list[tuple[str, ...]] = LAYERS
) -> list[str]:
    """Every import that climbs a layer or crosses to a peer room, as `file:line: a -> b (why)`."""
    found = []
    for module in sorted(graph):
        here = room_of(module, layers)
        for target, line in sorted(graph[module].items()):
            there = room_of(target, layers)
            if here is None or there is None or here[1] == there[1]:
                continue
            if there[0] > here[0] or (there[0] == here[0] and not _inside(here[1], there[1])):
                why = "climbs" if there[0] > here[0] else "crosses to a peer"
                where = files[module].relative_to(root.parent)
                found.append(
                    f"{where}:{line}: {module} -> {target} ({why}: {here[1]} below {there[1]})"
                    if there[0] > here[0]
                    else f"{where}:{line}: {module} -> {target} ({why}: {here[1]} and {there[1]})"
                )
    return found


def _inside(room: str, other: str) -> bool:
    return room.startswith(other + ".") or other.startswith(room + ".")


def test_every_module_is_in_a_room():
    graph, _ = import_graph(KEEL)
    homeless = [m for m in graph if m != "keel" and room_of(m) is None]
    assert not homeless, f"modules in no layer of LAYERS (add their folder): {homeless}"


def test_imports_only_go_down_the_house():
    graph, files = import_graph(KEEL)
    found = layer_violations(graph, files)
    assert not found, "imports that climb the house (lazy imports count too):\n" + "\n".join(found)


def test_layer_check_fails_on_a_planted_upward_import(tmp_path):
    """The check itself: a lazy import from a primitive up into the loop, and one between peer rooms."""
    pkg = tmp_path / "keel"
    for folder in ("parallel", "training", "tools", "data", "model"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "training" / "trainer.py").write_text("import os\n")
    (pkg / "parallel" / "comm.py").write_text(
        "def f():\n    from keel.training.trainer import x\n    return x\n"
    )
    (pkg / "data" / "samples.py").write_text("from keel.model import llama\n")
    (pkg / "model" / "llama.py").write_text("from keel.parallel import comm\n")
    (pkg / "tools" / "report.py").write_text("from keel.parallel.comm import f\n")  # down: allowed
    graph, files = import_graph(pkg)
    found = layer_violations(graph, files, pkg)
    assert len(found) == 2, found
    assert found[0].startswith(
        "keel/data/samples.py:1: keel.data.samples -> keel.model.llama (crosses to a peer"
    )
    assert found[1].startswith(
        "keel/parallel/comm.py:2: keel.parallel.comm -> keel.training.trainer (climbs"
    )

"""The package's shape: no import cycle anywhere in ``src/loomrl``, and trainer and engines
never import each other (they meet only through ``loomrl.weights``). Imports inside
functions count too: a lazy import still ties two modules together."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src"


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (path, is_package)}`` of every module under src/loomrl."""
    mods = {}
    for path in (SRC / "loomrl").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return mods


def _imports(name: str, mods: dict[str, tuple[Path, bool]]) -> set[str]:
    """The loomrl modules ``name`` imports, anywhere in its body."""
    path, is_package = mods[name]
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in mods:
                    found.add(submodule)
                elif target in mods:
                    found.add(target)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, mods) for name in mods}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_walker_sees_imports_inside_functions_and_relative_ones():
    graph = import_graph()
    assert "loomrl.session" in graph["loomrl.job"]  # imported inside Job.run
    assert "loomrl.weights.transports.base" in graph["loomrl.weights.transports.inproc"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _subpackage(module: str) -> str:
    """``loomrl.training.executor`` -> ``training``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_training_and_generation_never_import_each_other():
    crossing = [
        f"{src} -> {dst}"
        for src, dsts in import_graph().items()
        for dst in dsts
        if {_subpackage(src), _subpackage(dst)} == {"training", "generation"}
    ]
    assert crossing == []


def test_transport_interface_knows_none_of_its_implementations():
    graph = import_graph()
    impls = {"inproc", "shm", "torch_dist", "files"}
    assert not {m.rsplit(".", 1)[-1] for m in graph["loomrl.weights.transports.base"]} & impls
    assert "loomrl.weights.transports.inproc" not in graph["loomrl.weights.transports.torch_dist"]


def test_ray_is_imported_only_by_the_ray_runtime_and_that_only_lazily():
    mods = _modules()
    importers, eager = [], []
    for name, (path, _) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
            )
            if any(n == "ray" or n.startswith("ray.") for n in names):
                importers.append(name)
        for node in tree.body:  # module-level statements: imported whenever the module is
            if isinstance(node, ast.ImportFrom) and node.module == "loomrl.runtime.ray":
                eager.append(name)
    assert sorted(set(importers)) == ["loomrl.runtime.ray"]
    assert eager == [] and "loomrl.runtime.ray" in import_graph()["loomrl.session.assembly"]

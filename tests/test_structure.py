"""The package's shape (docs/architecture.md draws it): no import cycle anywhere in
``src/loomrl``; trainer and engines never import each other (they meet only through
``loomrl.weights``), nor the scheduler (the device layer owns offload); weights never import
the loop nor the rollout types; the device layer never imports the runtime; a role imports
its config section from beside it, not through ``loomrl.config``; no executor call names its
method by a string; no file over 500 lines, no function over 50, the controller's file under
350. Imports inside functions count too: a lazy import still ties two modules together. Each check is shown to fail on a small made-up case."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

from conftest import ROOT

SRC = ROOT / "src"
PACKAGE = SRC / "loomrl"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 50  # from the ``def`` line to the last line of the body
MAX_CONTROLLER_LINES = 350


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


# -- arrows that must not exist --------------------------------------------------------------


def crossings(graph: dict[str, set[str]], sources: set[str], targets: set[str]) -> list[str]:
    """Every import from a module of a ``sources`` subpackage into one of ``targets``."""
    return sorted(
        f"{src} -> {dst}"
        for src, dsts in graph.items()
        for dst in dsts
        if _subpackage(src) in sources and _subpackage(dst) in targets
    )


def test_crossings_finds_a_forbidden_arrow():
    graph = {"loomrl.training.x": {"loomrl.scheduler.y", "loomrl.models"}, "loomrl.models": set()}
    assert crossings(graph, {"training"}, {"scheduler"}) == [
        "loomrl.training.x -> loomrl.scheduler.y"
    ]
    assert crossings(graph, {"generation"}, {"scheduler"}) == []


def test_generation_and_training_never_import_the_scheduler():
    """The roles ask the device layer for placement and offload; the scheduler only asks
    executors (through their endpoints) to offload."""
    assert crossings(import_graph(), {"generation", "training"}, {"scheduler"}) == []


def test_weights_never_import_the_loop():
    """Publisher, receiver and transports serve the loop; they never reach back into it."""
    assert crossings(import_graph(), {"weights"}, {"control", "controller"}) == []


def test_scoring_never_imports_envs():
    """The scoring role is whole in ``scoring/``; environments and episodes sit above it
    (an episode takes ``check_value`` from ``scoring/calls.py``), never below it."""
    assert crossings(import_graph(), {"scoring"}, {"envs"}) == []


def test_crossings_finds_an_arrow_into_a_top_level_module():
    graph = {
        "loomrl.weights.receiver": {"loomrl.types"},
        "loomrl.device.colocate": {"loomrl.runtime.supervision"},
    }
    assert crossings(graph, {"weights"}, {"types"}) == ["loomrl.weights.receiver -> loomrl.types"]
    assert crossings(graph, {"device"}, {"runtime"}) == [
        "loomrl.device.colocate -> loomrl.runtime.supervision"
    ]


def test_weights_never_import_the_rollout_types():
    """Weights know tensors, not rollouts: what a receiver reports (``WeightsApplied``)
    lives in ``weights/``, and ``types.py`` re-exports nothing of it."""
    graph = import_graph()
    assert crossings(graph, {"weights"}, {"types"}) == []
    assert not any(_subpackage(m) == "weights" for m in graph["loomrl.types"])


def test_the_device_layer_never_imports_the_runtime():
    """The device layer knows devices, not executors: which errors mean an executor was
    replaced is the runtime's to say (``ColocatedPhases(replaced=...)``)."""
    assert crossings(import_graph(), {"device"}, {"runtime"}) == []


# -- each role reads its own config section from beside it -----------------------------------

# The role packages whose modules import their sections from where they live (``scoring/`` and
# ``envs/`` join when the scoring role is gathered into ``scoring/``).
ROLES_READING_THEIR_OWN_CONFIG = (
    "generation",
    "training",
    "weights",
    "sandbox",
    "scheduler",
    "runtime",
    "device",
    "models",
    "scoring",
)


def sections_through_the_root(source: str) -> list[str]:
    """Config sections ``source`` imports through ``loomrl.config`` (the job's re-exports)."""
    return [
        f"line {node.lineno}: {alias.name}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module == "loomrl.config"
        for alias in node.names
        if alias.name.endswith("Config")
    ]


def test_sections_through_the_root_are_found_and_the_rest_are_not():
    bad = "def f():\n    from loomrl.config import SandboxConfig\n"
    assert sections_through_the_root(bad) == ["line 2: SandboxConfig"]
    good = (
        "from loomrl.sandbox.config import SandboxConfig\nfrom loomrl.config import load_config\n"
    )
    assert sections_through_the_root(good) == []


def test_each_role_imports_its_config_section_from_beside_it():
    """A role's section lives beside it (``training/config.py``); importing it through
    ``loomrl.config`` runs an arrow back up to the module that knows every role."""
    found = [
        f"{rel} {hit}"
        for rel, path in _source_files()
        if rel.split("/")[0] in ROLES_READING_THEIR_OWN_CONFIG
        for hit in sections_through_the_root(path.read_text())
    ]
    assert found == []


# -- executor calls are typed ----------------------------------------------------------------

# The forms that take an executor method's name: ``handle.call(name, ...)``,
# ``handle.call_then(post, name, ...)``, ``handle.submit(name, args, kwargs)``; the position
# of the name in each.
NAME_POSITION = {"call": 0, "call_then": 1, "submit": 0}
# Calls of those names that are no executor call (receiver as written, and why).
NOT_EXECUTOR_CALLS = {
    "self.daemon.call": "the scheduler daemon's route table (SchedulerDaemon.call(route, body))",
}


def _str_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = fn.args
    return {
        a.arg
        for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
        if a.annotation is not None and ast.unparse(a.annotation) in ("str", "str | None")
    }


def string_named_calls(source: str) -> list[str]:
    """Executor calls in ``source`` whose method is a string: a literal, an f-string, or a
    parameter typed ``str`` of an enclosing function (``def _all(self, method: str)``)."""
    tree = ast.parse(source)
    named_by: dict[int, set[str]] = {}  # id(call node) -> str parameters in scope
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                named_by.setdefault(id(node), set()).update(_str_params(fn))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        position = NAME_POSITION.get(node.func.attr)
        if position is None or len(node.args) <= position:
            continue
        if ast.unparse(node.func) in NOT_EXECUTOR_CALLS:
            continue
        name = node.args[position]
        if (
            (isinstance(name, ast.Constant) and isinstance(name.value, str))
            or isinstance(name, ast.JoinedStr)
            or (isinstance(name, ast.Name) and name.id in named_by.get(id(node), ()))
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_string_named_calls_are_found_and_typed_ones_are_not():
    bad = """
async def f(generator, post, requests):
    await generator.call_then(post, "generate", requests)
    await generator.call("offload")
    generator.submit(f"{'gen'}erate", (requests,), {})

class State:
    def _all(self, method: str):
        async def one(handle):
            return await handle.call(method)
"""
    assert len(string_named_calls(bad)) == 4
    good = """
async def f(generator, requests, build, pool, fn, route: str):
    await generator.generate.call(requests, then=build)
    await generator.offload()
    pool.submit(fn)
    self.daemon.call(route, {})
"""
    assert string_named_calls(good) == []


def _source_files() -> list[tuple[str, Path]]:
    """``(path under src/loomrl, path)`` of every module, in order."""
    return sorted((p.relative_to(PACKAGE).as_posix(), p) for p in PACKAGE.rglob("*.py"))


def test_no_executor_call_names_its_method_by_a_string():
    """A misspelt method must fail at start-up, and go-to-definition must work: callers use
    the handle's endpoints (``generator.generate.call(...)``). ``runtime/`` is exempt: it is
    the machinery that turns an endpoint into a call by name."""
    found = [
        f"{rel} {call}"
        for rel, path in _source_files()
        if not rel.startswith("runtime/")
        for call in string_named_calls(path.read_text())
    ]
    assert found == []


# -- size bars -------------------------------------------------------------------------------


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (lines)`` of every function in ``source`` longer than ``limit`` lines, counted
    from its ``def`` line to its last line (nested functions count on their own too)."""
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_long_functions_counts_from_def_to_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(48))
    fifty = f"def f():\n{body}\n    return x0\n"  # 1 + 48 + 1 lines
    assert long_functions(fifty) == []
    assert long_functions(fifty.replace("return x0", "y = 1\n    return x0")) == [
        "f (51 lines, line 1)"
    ]


def test_no_function_over_50_lines():
    """A function that long is doing two jobs: split it by job, not by size."""
    found = [
        f"{rel}: {fn}" for rel, path in _source_files() for fn in long_functions(path.read_text())
    ]
    assert found == []


def long_files(files: list[tuple[str, Path]], limit: int = MAX_FILE_LINES) -> list[str]:
    return [
        f"{rel} ({n} lines)"
        for rel, path in files
        if (n := len(path.read_text().splitlines())) > limit
    ]


def test_long_files_finds_a_file_over_the_bar(tmp_path):
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text("x = 1\n" * 500)
    long.write_text("x = 1\n" * 501)
    assert long_files([("short.py", short), ("long.py", long)]) == ["long.py (501 lines)"]


def test_no_file_over_500_lines():
    files = list(_source_files())
    assert long_files(files) == []


def test_the_controller_file_stays_short():
    """The loop's file is where a newcomer learns the algorithm: plumbing goes beside it."""
    controller = PACKAGE / "control" / "controller.py"
    if not controller.exists():
        pytest.skip("no control/ package yet")
    assert long_files([("control/controller.py", controller)], MAX_CONTROLLER_LINES) == []


def test_ray_is_imported_only_by_the_ray_runtime_and_that_only_lazily():
    # The ray runtime is three modules: the runtime (ray.py), the actor with its handle
    # (ray_actor.py) and the probes it runs on the cluster's nodes (ray_probe.py); only the
    # runtime imports the other two.
    ray_runtime = {"loomrl.runtime.ray", "loomrl.runtime.ray_actor", "loomrl.runtime.ray_probe"}
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
            if (
                isinstance(node, ast.ImportFrom)
                and node.module in ray_runtime
                and name not in ray_runtime
            ):
                eager.append(name)
    assert sorted(set(importers)) == sorted(ray_runtime)
    assert eager == [] and "loomrl.runtime.ray" in import_graph()["loomrl.session.assembly"]
    for inner in ("loomrl.runtime.ray_actor", "loomrl.runtime.ray_probe"):
        assert [m for m, deps in import_graph().items() if inner in deps] == ["loomrl.runtime.ray"]


# Capabilities declared on loomrl's own classes (``Sender.carries_tensors``,
# ``ExecutorHandle.restartable``, ``Policy.on_grant``, ...): read plainly, never probed
# with getattr/hasattr, which would hide a misspelling behind the default.
DECLARED_CAPABILITIES = frozenset(
    {"carries_tensors", "restartable", "on_grant", "last_snapshot", "peak_requests", "_swap"}
)


def capability_probes(source: str) -> list[str]:
    """``getattr(x, "name", ...)`` or ``hasattr(x, "name")`` calls on a declared capability."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in DECLARED_CAPABILITIES
        ):
            found.append(f"{node.func.id}(..., {node.args[1].value!r}) at line {node.lineno}")
    return found


def test_declared_capabilities_are_read_plainly():
    assert capability_probes('if getattr(sender, "carries_tensors", False): pass') != []
    assert capability_probes("if sender.carries_tensors: pass") == []
    probes = {
        rel: found
        for rel, path in _source_files()
        if (found := capability_probes(path.read_text()))
    }
    assert probes == {}


def hung_comments(source: str) -> list[int]:
    """Lines whose comment trails a bracket closing a construct opened on an earlier line
    (``)  # why``, ``):  # why``): where ``ruff format`` hangs a comment too long for its
    line, below the code it explains. Comments go on their own line above it (``noqa``, ``fmt:`` and
    ``type:`` markers stay where their tools read them)."""
    found, opened_at, last = [], [], []
    closes_multiline: dict[tuple[int, int], bool] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            opened_at.append(tok.start[0])
        elif tok.type == tokenize.OP and tok.string in ")]}":
            closes_multiline[tok.start] = opened_at.pop() < tok.start[0]
        if tok.type == tokenize.COMMENT and last and not tok.string.startswith(_MARKERS):
            close = last[-2] if last[-1].string in ",:" and len(last) > 1 else last[-1]
            if close.start[0] == tok.start[0] and closes_multiline.get(close.start):
                found.append(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            last = [*last[-1:], tok]
    return found


_MARKERS = ("# noqa", "# type:", "# fmt:")


def test_hung_comments_are_found_and_comments_above_are_not():
    hung = "x = f(\n    1,\n)  # why\nif (\n    x\n):  # why\n    y = [\n        1,\n    ]\n"
    above = "# why\nx = f(\n    1,  # this argument's why\n)\nx = f(1)  # short\n"
    assert hung_comments(hung) == [3, 6]
    assert hung_comments(above) == []


def test_no_comment_hangs_on_a_closing_bracket():
    files = [p for d in ("src", "tests", "bench", "examples") for p in (ROOT / d).rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in files for n in hung_comments(p.read_text())]
    assert found == []

"""The architecture holds: each tier imports only the tiers below it, and no module imports in a circle.

The tiers are the folders of ``clusterenv/`` (and its top-level modules). A rule is written per
folder, so a module added to a folder is held to it without editing this file.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "clusterenv"

# What each part of the package may import, at module level or inside a function.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    # The usable cores (affinity within cgroup quotas): one answer for every tier, so it imports nothing.
    "cores": set(),
    "wire": {"errors", "cores"},
    "stepping": {"errors", "cores", "wire"},
    "policy": {"errors", "cores", "wire"},
    "worker": {"errors", "cores", "wire", "policy", "stepping"},
    "launch": {"errors", "cores", "wire"},
    "learner": {"errors", "cores", "wire", "policy", "launch", "stepping"},
    "unit_factories": {"cores"},
    "make": {"cores", "launch", "learner", "unit_factories"},
    "pettingzoo": {"cores", "learner", "unit_factories"},
    "sb3": {"errors", "cores", "wire", "learner"},
    # The top tier: the benchmark command runs ClusterEnv and PolicyRunner; nothing imports it.
    "bench": {"errors", "cores", "wire", "policy", "launch", "learner", "make"},
    "__init__": {"errors", "cores", "wire", "policy", "launch", "learner", "make"},
}
# The one import allowed only inside a function: a Ray actor runs the worker in its own process.
INSIDE_A_FUNCTION_ONLY: dict[str, set[str]] = {"launch": {"worker"}}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted ("clusterenv.worker.process")
    target: str  # the imported clusterenv module, dotted
    in_function: bool
    type_checking: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def part_of(module: str) -> str:
    """``errors``, ``wire``, ``worker``... for ``clusterenv.<part>[.<module>]``; ``__init__`` for the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(module: str, path: Path, modules: set[str]) -> list[Import]:
    found: list[Import] = []

    def target(name: str) -> str:
        """The module a name from ``from X import name`` refers to, or X itself."""
        return name if name in modules else name.rsplit(".", 1)[0]

    def visit(nodes: list[ast.stmt], in_function: bool, type_checking: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "clusterenv":
                names = [target(f"{node.module}.{alias.name}") for alias in node.names]
                for name in names if node.module == "clusterenv" else [node.module]:
                    found.append(Import(module, name, in_function, type_checking))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "clusterenv":
                        found.append(Import(module, alias.name, in_function, type_checking))
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.body, in_function, True)
                visit(node.orelse, in_function, type_checking)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, True, type_checking)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([n for n in getattr(node, field, []) if isinstance(n, ast.AST)], in_function, type_checking)

    visit(ast.parse(path.read_text()).body, False, False)
    return [i for i in found if i.target != "clusterenv" or module != "clusterenv"]


def every_import() -> list[Import]:
    modules = all_modules()
    return [i for name, path in modules.items() for i in imports_of(name, path, set(modules))]


def test_every_part_has_a_rule() -> None:
    parts = {part_of(m) for m in all_modules()}
    assert parts <= set(MAY_IMPORT), f"add a rule for {sorted(parts - set(MAY_IMPORT))} to MAY_IMPORT"


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_each_part_imports_only_the_tiers_below_it(part: str) -> None:
    wrong = []
    for i in every_import():
        if part_of(i.module) != part or part_of(i.target) == part:
            continue
        allowed = MAY_IMPORT[part] | (INSIDE_A_FUNCTION_ONLY.get(part, set()) if i.in_function else set())
        if part_of(i.target) not in allowed:
            wrong.append(f"{i.module} imports {i.target}")
    assert not wrong, f"{part} may import only {sorted(MAY_IMPORT[part])}: " + "; ".join(wrong)


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first cycle in ``graph`` (module -> the modules it imports), as a path that ends where it starts."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                trail = [*path, node]
                return [*trail[trail.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [])):
            return cycle
    return None


def test_import_cycle_names_the_modules_in_order() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycle(graph) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_in_a_circle() -> None:
    """Every import that runs counts, at module level or inside a function (a deferred import is still a circle).

    Imports under ``TYPE_CHECKING`` never run and are left out; the package's ``__init__`` re-exports
    every public name, so a module that imports ``clusterenv`` itself is the one edge not followed.
    """
    graph: dict[str, set[str]] = {m: set() for m in all_modules()}
    for i in every_import():
        if not i.type_checking and i.target in graph and i.target != "clusterenv":
            graph[i.module].add(i.target)
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_a_worker_process_loads_neither_the_learner_nor_torch() -> None:
    code = "import sys, clusterenv.worker.process; print(' '.join(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    names = loaded.stdout.split()
    parts = {part_of(name) for name in names if name.startswith("clusterenv.")}
    assert not parts & {"learner", "launch", "make", "sb3"}, f"the worker loaded {sorted(parts)}"
    assert "torch" not in names, "a worker without a policy must not pay for importing torch"

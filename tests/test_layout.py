"""The architecture holds: the worker side never imports the learner side, and no module imports in a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "clusterenv"
WORKER_SIDE = ["worker", "worker_policy", "worker_procs", "env_process", "recording"]
LEARNER_SIDE = {
    "env",
    "pool",
    "make",
    "launch",
    "ray_launcher",
    "rollout",
    "batch",
    "buffers",
    "first_ready",
    "heartbeat_monitor",
}


def module_level_imports(module: str) -> set[str]:
    """``clusterenv`` modules imported at module level (outside ``if TYPE_CHECKING:`` and functions)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clusterenv"):
                if node.module == "clusterenv":
                    found.update(alias.name for alias in node.names)
                else:
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("clusterenv."))

    visit(tree.body)
    return found


def all_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", WORKER_SIDE)
def test_worker_side_never_imports_the_learner_side(module: str) -> None:
    reached, frontier = set(), [module]
    while frontier:  # the transitive closure: a shared module must not pull the learner in either
        for imported in module_level_imports(frontier.pop()):
            if imported not in reached:
                reached.add(imported)
                frontier.append(imported)
    assert not reached & LEARNER_SIDE, f"{module} reaches learner-side modules {sorted(reached & LEARNER_SIDE)}"


def test_no_import_cycles_at_module_level() -> None:
    graph = {m: module_level_imports(m) & set(all_modules()) for m in all_modules()}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != "open", f"import cycle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for module in graph:
        if module not in state:
            visit(module, [])


def test_a_worker_process_loads_no_learner_module() -> None:
    code = "import sys, clusterenv.worker; print(' '.join(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    names = loaded.stdout.split()
    modules = {name.split(".")[1] for name in names if name.startswith("clusterenv.")}
    assert not modules & LEARNER_SIDE, f"the worker loaded {sorted(modules & LEARNER_SIDE)}"
    assert "torch" not in names, "a worker without a policy must not pay for importing torch"

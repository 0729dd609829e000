"""The documentation's code runs, uses only the public API, and the API reference lists every public name.

Each page's ```python blocks run in order in one namespace, as a reader would paste them.
A block that needs what a test machine lacks (other hosts, Ray, a GPU) is preceded by
``<!-- not run: the reason -->``; it must still compile and import only public names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gymnasium as gym
import pytest

import clusterenv

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK = re.compile(r"(?P<marker><!-- not run: [^>]+ -->\n)?```python\n(?P<code>.*?)```", re.DOTALL)
PUBLIC_MODULES = {"clusterenv", "clusterenv.sb3", "clusterenv.pettingzoo"}
# Libraries of the integration pages (the `peers` and `test` extras): a page that imports one skips without it.
OPTIONAL = ("stable_baselines3", "skrl", "torchrl", "pettingzoo", "supersuit", "envpool")


def blocks(page: Path) -> list[tuple[str, bool]]:
    """``(code, runs)`` of each python block of ``page``."""
    return [(m["code"], m["marker"] is None) for m in BLOCK.finditer(page.read_text())]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in PAGES if any(runs for _, runs in blocks(p))], ids=page_id)
def test_the_code_of_each_page_runs(page, monkeypatch):
    code = "\n".join(code for code, runs in blocks(page) if runs)
    for library in OPTIONAL:
        if re.search(rf"^\s*(from|import) {library}\b", code, re.MULTILINE):
            pytest.importorskip(library)
    monkeypatch.chdir(ROOT)
    registered = set(gym.registry)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    try:
        for code, runs in blocks(page):
            if runs:
                exec(compile(code, str(page), "exec"), namespace)  # noqa: S102 (the docs' own code)
    finally:
        for env_id in set(gym.registry) - registered:  # a page's gym.register() stays with the page
            del gym.registry[env_id]
    for value in list(namespace.values()):
        if isinstance(value, clusterenv.ClusterEnv):
            assert value.closed, f"{page_id(page)} leaves a ClusterEnv open"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=page_id)
def test_the_docs_use_only_public_names(page):
    for code, _ in blocks(page):
        tree = ast.parse(code)  # a block that is not run must still be valid Python
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clusterenv"):
                assert node.module in PUBLIC_MODULES, f"{page_id(page)} imports from internal {node.module}"
                if node.module == "clusterenv":
                    missing = [a.name for a in node.names if a.name not in clusterenv.__all__]
                    assert not missing, f"{page_id(page)} imports unexported {missing}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "clusterenv":
                assert node.attr in clusterenv.__all__ or node.attr in ("sb3", "pettingzoo"), (
                    f"{page_id(page)} uses clusterenv.{node.attr}, which is not exported"
                )


def test_the_api_reference_documents_every_public_name():
    reference = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: clusterenv\.(\w+)", reference, re.MULTILINE))
    assert documented >= set(clusterenv.__all__), (
        f"missing from docs/api.md: {sorted(set(clusterenv.__all__) - documented)}"
    )

"""The package's layering, checked: the dependency rules docs/architecture.md draws.

Read from the source (ast), not by importing, except the torch check, which imports
each torch-free module in a fresh interpreter and looks at ``sys.modules``.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "eagle3flow"

# Modules that must run without torch: the workflow's operations and planning run at
# parse time and in the drain, where importing torch would cost seconds each time.
TORCH_FREE = ("eagle3flow.ops", "eagle3flow.config", "eagle3flow.layout", "eagle3flow.atomic", "eagle3flow.jsonl",
              "eagle3flow.progress", "eagle3flow.layers", "eagle3flow.procfs", "eagle3flow.target.config",
              "eagle3flow.target.shapes", "eagle3flow.target.remote_code",
              "eagle3flow.target.files")

# The model is computation only: what it may import from the package.
# target.config: the draft config reads the target's (nested) config dict through it.
MODEL_MAY_IMPORT = ("eagle3flow.model", "eagle3flow.layers", "eagle3flow.target.config")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def owning_module(dotted: str) -> str:
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted


def package_imports(name: str):
    """(imported module, imported names, line, at module level) for each eagle3flow import."""
    tree = ast.parse(MODULES[name].read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            top.update(ast.walk(node))
        top.add(node)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3flow"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in MODULES else owning_module(node.module)
                yield target, alias.name, node.lineno, node in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("eagle3flow"):
                    yield owning_module(alias.name), None, node.lineno, node in top


def graph() -> dict[str, set[str]]:
    edges = defaultdict(set)
    for name in MODULES:
        for target, _, _, _ in package_imports(name):
            if target and target != name and not name.startswith(target + "."):
                edges[name].add(target)
    return edges


def folder(name: str) -> str:
    """A module's folder in docs/architecture.md's graph: its package path under eagle3flow
    ("ops/plan"; model/kernels counts as model), or "" for the base (the top-level modules)."""
    parts = name.split(".")[1:]
    package = parts if MODULES[name].name == "__init__.py" else parts[:-1]
    return "model" if package[:1] == ["model"] else "/".join(package)


def drawn_folder_graph() -> list[tuple[str, set[str]]]:
    """docs/architecture.md's ```folders block: (folder, the folders it may import), top down."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("```folders\n", 1)[1].split("```", 1)[0]
    rows = []
    for line in block.strip().splitlines():
        name, _, targets = line.partition("──>")
        rows.append((name.strip(), {t.strip() for t in targets.split(",") if t.strip()}))
    return rows


def test_folder_graph_is_the_one_the_architecture_draws():
    actual = defaultdict(set)
    for name in MODULES:
        for target, _, line, _ in package_imports(name):
            if target and folder(target) and folder(target) != folder(name):
                actual[folder(name)].add(folder(target))
    rows = drawn_folder_graph()
    drawn = dict(rows)
    base_breaches = [f"{name} imports {target}" for name in MODULES if not folder(name)
                     for target, _, _, _ in package_imports(name) if target and folder(target)]
    assert not base_breaches, f"the base imports only the base: {base_breaches}"
    folders = {folder(name) for name in MODULES} - {""}
    assert folders == set(drawn), f"folders not drawn: {folders - set(drawn)}; drawn, gone: {set(drawn) - folders}"
    undrawn = {f"{a} -> {b}" for a, targets in actual.items() for b in targets if b not in drawn[a]}
    stale = {f"{a} -> {b}" for a, targets in drawn.items() for b in targets if b not in actual[a]}
    assert not undrawn and not stale, f"arrows not drawn: {sorted(undrawn)}; drawn, not imported: {sorted(stale)}"
    order = [name for name, _ in rows]
    upward = [f"{a} -> {b}" for a, targets in drawn.items() for b in targets if order.index(b) <= order.index(a)]
    assert not upward, f"arrows pointing up the list: {upward}"


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_name_imported_across_modules():
    found = [f"{name}:{line} imports {target}.{imported}"
             for name in MODULES for target, imported, line, _ in package_imports(name)
             if imported and imported.startswith("_") and target != name]
    assert not found, found


def test_package_imports_sit_at_module_level():
    """A function-level import of a sibling module hides a cycle or a layering breach."""
    found = [f"{name}:{line} imports {target} inside a function"
             for name in MODULES for target, _, line, top in package_imports(name)
             if not top and target != name]
    assert not found, found


def test_model_code_imports_only_the_model():
    found = [f"{name}:{line} imports {target}"
             for name in MODULES if name.startswith("eagle3flow.model")
             for target, _, line, _ in package_imports(name)
             if not target.startswith(MODEL_MAY_IMPORT)]
    assert not found, found


def torch_free_modules() -> list[str]:
    return [name for name in MODULES if name.startswith(TORCH_FREE) and not name.endswith("__main__")]


def test_layering_check_sees_the_torch_free_modules():
    names = torch_free_modules()
    assert "eagle3flow.ops.plan" in names and "eagle3flow.ops.drain.service" in names, names


@pytest.mark.parametrize("name", torch_free_modules())
def test_torch_free_module_imports_no_torch(name):
    code = (f"import sys, importlib; importlib.import_module({name!r}); "
            "heavy = sorted(m for m in ('torch', 'transformers', 'vllm', 'numpy') if m in sys.modules); "
            "print(','.join(heavy))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch" not in result.stdout.split(","), f"{name} pulls in {result.stdout.strip()}"

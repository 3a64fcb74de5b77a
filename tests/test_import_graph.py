"""The package imports in one direction: read statically from the source, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "megatron"
LEAVES = ("megatron.errors", "megatron.architecture", "megatron.optimizer_layout", "megatron.ranks")  # importable by every layer


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}


def imported_modules(name: str) -> set[str]:
    """The megatron modules ``name`` imports anywhere in its source (top level, functions, TYPE_CHECKING)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return {module for module in found if module in MODULES and module != name}


def area(module: str) -> str:
    """megatron.<subpackage> for modules of a subpackage, the module itself for top-level modules."""
    return ".".join(module.split(".")[:2])


GRAPH = {name: imported_modules(name) for name in MODULES}


def area_cycles() -> list[list[str]]:
    edges: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        edges.setdefault(area(module), set()).update(area(t) for t in targets if area(t) != area(module))
    cycles = []
    for start in edges:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for target in edges.get(node, ()):
                if target == start:
                    cycles.append(path)
                elif target not in path and target > start:  # each cycle once, from its smallest area
                    stack.append((target, path + [target]))
    return cycles


def test_the_graph_is_read():
    assert "megatron.architecture" in GRAPH["megatron.model.gpt_model"]
    assert "megatron.checkpointing.layout" in GRAPH["megatron.checkpointing.plan"]  # `from package import module`
    assert "megatron.checkpointing.client_state" in GRAPH["megatron.checkpointing.inventory"]


def test_no_import_cycles_between_subpackages():
    assert area_cycles() == []


def test_checkpointing_never_imports_hf():
    offenders = {module: sorted(t for t in targets if area(t) == "megatron.hf")
                 for module, targets in GRAPH.items() if area(module) == "megatron.checkpointing"}
    assert {module: targets for module, targets in offenders.items() if targets} == {}


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_of_the_package_but_the_error_base(leaf):
    assert GRAPH[leaf] <= {"megatron.errors"}


def test_load_plan_and_its_checks_do_not_import_each_other():
    plan, preflight = "megatron.checkpointing.plan", "megatron.checkpointing.preflight"
    assert not (plan in GRAPH[preflight] and preflight in GRAPH[plan])
    assert plan not in GRAPH[preflight]

"""The package imports in one direction: read statically from the source, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "megatron"
LEAVES = ("megatron.errors", "megatron.contract.architecture", "megatron.optim.optimizer_layout", "megatron.ranks")  # importable by every layer


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
    assert "megatron.contract.architecture" in GRAPH["megatron.model.gpt_model"]
    assert "megatron.checkpointing.ondisk.layout" in GRAPH["megatron.checkpointing.planning.plan"]  # `from package import module`
    assert "megatron.checkpointing.ondisk.client_state" in GRAPH["megatron.checkpointing.ondisk.inventory"]


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
    plan, preflight = "megatron.checkpointing.planning.plan", "megatron.checkpointing.planning.preflight"
    assert not (plan in GRAPH[preflight] and preflight in GRAPH[plan])
    assert plan not in GRAPH[preflight]


CHECKPOINT_STAGES = ("formats", "ondisk", "planning", "loading", "saving")  # each imports only stages before it
UNRELATED_STAGES = {("saving", "loading")}  # later in the order, yet never imports the other


def checkpoint_stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["megatron", "checkpointing"] or len(parts) < 3 or parts[2] not in CHECKPOINT_STAGES:
        return None
    return parts[2]


def test_checkpoint_stages_import_one_way():
    backwards = {}
    for module, targets in GRAPH.items():
        stage = checkpoint_stage(module)
        if stage is None:
            continue
        for target in targets:
            other = checkpoint_stage(target)
            if other is None:
                assert target != "megatron.checkpointing", f"{module} imports the front door"
                continue
            if (CHECKPOINT_STAGES.index(other) > CHECKPOINT_STAGES.index(stage)
                    or (stage, other) in UNRELATED_STAGES):
                backwards.setdefault(module, []).append(target)
    assert backwards == {}


ENTRY_POINTS = [path for pattern in ("*.py", "tools/**/*.py") for path in PACKAGE_ROOT.parent.glob(pattern)]


def imports_in(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_nothing_outside_the_checkpoint_package_reaches_past_its_front_door():
    outside = {MODULES[name]: imported_modules(name) for name in MODULES if area(name) != "megatron.checkpointing"}
    outside.update({path: imports_in(path) for path in ENTRY_POINTS})
    reaching = {str(path): sorted(t for t in targets
                                  if t.startswith("megatron.checkpointing."))
                for path, targets in outside.items()}
    assert {path: targets for path, targets in reaching.items() if targets} == {}
    assert ENTRY_POINTS and any(path.name == "inspect_checkpoint.py" for path in ENTRY_POINTS)


def test_the_root_holds_only_shared_infrastructure():
    root_modules = sorted(path.name for path in PACKAGE_ROOT.glob("*.py"))
    assert len(root_modules) <= 8, root_modules


def test_no_two_modules_share_a_name_for_different_jobs():
    # errors.py is each area's error class and __init__.py its front door: the same job everywhere
    names: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if path.name not in ("__init__.py", "errors.py"):
            names.setdefault(path.name, []).append(name)
    assert {name: modules for name, modules in names.items() if len(modules) > 1} == {}


def test_only_the_launcher_side_imports_launch():
    # launch/ is deepy.py's side: the ranks' runtime and the training loop never reach back into it
    importers = {module for module, targets in GRAPH.items()
                 if area(module) != "megatron.launch" and any(area(t) == "megatron.launch" for t in targets)}
    assert importers == set()


def test_the_training_loop_is_the_top_floor_of_a_rank():
    importers = {module for module, targets in GRAPH.items()
                 if area(module) not in ("megatron.training", "megatron.launch")
                 and any(area(t) == "megatron.training" for t in targets)}
    assert importers == set()


def test_no_function_is_longer_than_80_lines():
    # a function that long does several jobs: give each its name
    sources = [*PACKAGE_ROOT.rglob("*.py"), *ENTRY_POINTS]
    long_ones = {f"{path.relative_to(PACKAGE_ROOT.parent)}:{node.name}": node.end_lineno - node.lineno + 1
                 for path in sources for node in ast.walk(ast.parse(path.read_text(), str(path)))
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80}
    assert long_ones == {}

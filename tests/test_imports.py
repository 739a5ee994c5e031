"""fourfold's modules import only downward: layers as data, the import graph read with ast, no cycles.

Every import of a fourfold module counts, also one inside a function. A module may import modules of
its own layer or of lower layers; inside one layer the graph must still be acyclic. Top-layer packages
of the same layer stay apart except where ALLOWED_SIDEWAYS says so (the trainer prints the planner's
memory prediction; inference and the planner never import the trainer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fourfold"

# Lowest first. A module belongs to the layer of the longest prefix listed here.
LAYERS: list[tuple[str, ...]] = [
    ("fourfold", "fourfold.errors", "fourfold.units", "fourfold.settings"),
    ("fourfold.config", "fourfold.config_text", "fourfold.models.presets", "fourfold.preflight"),
    ("fourfold.models", "fourfold.precision", "fourfold.hardware", "fourfold.distributed", "fourfold.ops",
     "fourfold.optim", "fourfold.tokenizer", "fourfold.chat"),
    ("fourfold.layout", "fourfold.mesh", "fourfold.parallel", "fourfold.recompute", "fourfold.quant",
     "fourfold.checkpoint"),
    ("fourfold.train", "fourfold.infer", "fourfold.plan", "fourfold.serve"),
    ("fourfold.cli", "fourfold.__main__", "fourfold.testing"),
]
# Packages of one layer that may import each other, one way only.
ALLOWED_SIDEWAYS = {("fourfold.train", "fourfold.plan"), ("fourfold.serve", "fourfold.infer")}
# Function-level imports of fourfold modules are allowed only here: the command line loads each
# subcommand's modules on demand so that `fourfold config` does not start torch.
LAZY_IMPORTS_ALLOWED = {"fourfold.cli"}  # and its subcommand modules


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the prefix that placed it) for a fourfold module."""
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    assert best is not None, f"{module} is in no layer of tests/test_imports.py: add it to LAYERS"
    return best


def resolve(module: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> list[str]:
    """The fourfold modules an import statement names (submodules imported with `from pkg import mod` too)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("fourfold")]
    base = node.module or ""
    if node.level:
        parent = module.split(".") if is_package else module.split(".")[:-1]
        parent = parent[:len(parent) - (node.level - 1)]
        base = ".".join(parent + ([base] if base else []))
    if not base.startswith("fourfold"):
        return []
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
            (PACKAGE.parent / Path(*sub.split(".")) / "__init__.py").exists()
        found.append(sub if is_module else base)
    return found


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> fourfold modules it imports, list of 'module -> target' lines for function-level imports)."""
    graph, lazy = {}, []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        top = {id(n) for n in tree.body}
        # Imports under `if TYPE_CHECKING:` at module level count as top-level.
        for n in tree.body:
            if isinstance(n, ast.If):
                top.update(id(x) for x in ast.walk(n))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = resolve(module, node, path.name == "__init__.py")
                edges.update(t for t in targets if t != module)
                if targets and id(node) not in top and not any(module == m or module.startswith(m + ".") for m in LAZY_IMPORTS_ALLOWED):
                    lazy.extend(f"{module} -> {t} (line {node.lineno})" for t in targets)
        graph[module] = edges
    return graph, lazy


GRAPH, LAZY = import_graph()


def test_every_module_has_a_layer():
    for module in GRAPH:
        layer_of(module)


def test_imports_only_run_downward():
    upward = []
    for module, targets in GRAPH.items():
        own, own_prefix = layer_of(module)
        for target in targets:
            theirs, their_prefix = layer_of(target)
            if theirs > own:
                upward.append(f"{module} (layer {own}) imports {target} (layer {theirs})")
            elif theirs == own == len(LAYERS) - 2 and own_prefix != their_prefix \
                    and (own_prefix, their_prefix) not in ALLOWED_SIDEWAYS:
                upward.append(f"{module} imports {target}: {own_prefix} and {their_prefix} stay apart")
    assert not upward, "imports that do not run downward:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if nxt not in GRAPH:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_function_level_imports_of_fourfold():
    assert not LAZY, "import these at the top of the module (or explain in LAZY_IMPORTS_ALLOWED):\n" + "\n".join(LAZY)


def test_bench_and_fourfold_never_import_tests():
    offenders = []
    for path in [*sorted((ROOT / "bench").rglob("*.py")), *sorted(PACKAGE.rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not offenders, "bench/ and fourfold/ must not import the test suite:\n" + "\n".join(offenders)


@pytest.mark.parametrize("module, target", [("fourfold.parallel.data_parallel", "fourfold.train.optim"),
                                            ("fourfold.infer.generate", "fourfold.train.checkpoint")])
def test_the_checker_catches_an_upward_import(module, target):
    """The layer rule itself can fail: a parallel/ or infer/ module importing train/ is flagged."""
    own, own_prefix = layer_of(module)
    theirs, their_prefix = layer_of(target)
    assert theirs > own or (own_prefix, their_prefix) not in ALLOWED_SIDEWAYS

"""The package's shape, checked from its source (no imports, no GPU): no import circles, no op
borrowing another op's private names, and one module that reads the environment.

Every `.py` under ssmspec/, trees/, training/ and cli/ is parsed with `ast` and named as it
installs (pyproject's package-dir: trees/ is ssmspec.trees, and so on).

Import circles count every import, at module level and inside functions alike: a deferred
import hides a circle from Python's loader but not from a reader, who still has to know both
modules to understand either. An import of `a.b.c` is an edge to `a.b.c` only, not to the
packages above it (Python initialises those first, whatever they import).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"ssmspec": REPO / "ssmspec", "ssmspec.trees": REPO / "trees", "ssmspec.training": REPO / "training",
         "ssmspec.cli": REPO / "cli"}

ENV_MODULE = "ssmspec.ops.settings"
"""The one module that reads the environment: the code path's settings (ops/paths.py decides from them)."""
ENV_READERS_ALLOWED = {
    "ssmspec.cli.app": "SSMSPEC_DEBUG: whether the CLI's error boundary prints a traceback",
}
"""Other modules that may read the environment, each with its reason."""
CYCLES_BEING_REMOVED: list = []
"""Circles that a change in progress removes: delete each entry when it lands (none now)."""


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix] + parts)] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _package(name: str) -> str:
    """The package that relative imports in module `name` start from."""
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _resolve(name: str, node: ast.Import | ast.ImportFrom, alias: ast.alias) -> tuple[str, str | None]:
    """(imported module, the name taken from it or None) for one alias of an import statement
    of module `name`, relative imports resolved; `from pkg import mod` is an import of pkg.mod."""
    if isinstance(node, ast.Import):
        return alias.name, None
    base = node.module or ""
    if node.level:
        pkg = _package(name)
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    sub = f"{base}.{alias.name}"
    return (sub, None) if sub in MODULES else (base, alias.name)


def _imports(name: str):
    """(node, alias, imported module, name taken or None) for every import of module `name`."""
    for node in ast.walk(TREES[name]):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield (node, alias, *_resolve(name, node, alias))


def _graph() -> dict[str, set[str]]:
    return {name: {target for _, _, target, _ in _imports(name) if target in MODULES and target != name}
            for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _op(name: str) -> str | None:
    """The op folder (ssmspec.ops.<op>) a module belongs to, or None."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[:2] == ["ssmspec", "ops"] and (REPO / "ssmspec" / "ops" / parts[2]).is_dir():
        return parts[2]
    return None


def test_the_walk_sees_the_whole_package():
    for name in ("ssmspec.ops.dispatch", "ssmspec.ops.paths", "ssmspec.ops.settings", "ssmspec.trees", "ssmspec.cli.app",
                 "ssmspec.ops.gemv.triton", "ssmspec.training"):
        assert name in MODULES, name
    assert "ssmspec.ops.triton_common" in _graph()["ssmspec.ops.gemv.triton"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert [c for c in _cycles(_graph()) if c not in CYCLES_BEING_REMOVED] == []


def test_no_op_imports_another_ops_private_names():
    """Neither `from ..other_op.x import _name` nor `other_op_module._name` after importing it."""
    borrowed = []
    for name in MODULES:
        op = _op(name)
        if op is None:
            continue
        other_modules = set()  # local names bound to another op's module
        for node, alias, target, taken in _imports(name):
            target_op = _op(target if taken is None else f"{target}.{taken}")
            if target_op in (None, op):
                continue
            if taken is not None and taken.startswith("_"):
                borrowed.append(f"{name} imports {target}.{taken}")
            elif taken is None or f"{target}.{taken}" in MODULES:
                other_modules.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id in other_modules:
                borrowed.append(f"{name} uses {node.value.id}.{node.attr}")
    assert borrowed == []


def _reads_environment(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv", "environb") for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_reader_finds_environment_reads():
    assert _reads_environment(ast.parse("import os\nx = os.environ.get('A')\ny = os.getenv('B')")) == [2, 3]
    assert _reads_environment(ast.parse("from os import environ")) == [1]
    assert _reads_environment(ast.parse("import os\nos.path.join('a')")) == []


def test_only_the_path_module_reads_the_environment():
    readers = {name: lines for name in MODULES if (lines := _reads_environment(TREES[name]))}
    assert ENV_MODULE in readers  # the test looks where the reads are
    unexpected = {name: lines for name, lines in readers.items()
                  if name != ENV_MODULE and name not in ENV_READERS_ALLOWED}
    assert unexpected == {}

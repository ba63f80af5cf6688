"""The package's layers, read from its imports: data flows one way (HTTP -> request path
-> admission -> store -> settle -> drainer -> Redis), and the supervisor never loads the
request path. Imports inside a function (a child's code, loaded after the fork) and under
``TYPE_CHECKING`` load nothing at import time and are left out."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ankusa_shm"

# What each part may not import at module level.
ABOVE = {
    "shm": {"store", "fleet", "http", "admin", "supervisor", "worker", "cli", "config"},
    "store": {"fleet", "http", "admin", "supervisor", "worker", "cli"},
    "fleet": {"http", "admin", "supervisor", "worker", "cli"},
    "http": {"admin", "supervisor", "worker", "cli"},
    "supervisor": {"http", "admin", "worker", "cli"},
    "config": {"store", "fleet", "http", "admin", "supervisor", "worker", "cli"},
    "hooks": {"store", "fleet", "http", "admin", "supervisor", "worker", "cli"},
}


def _part(module: str) -> str:
    """The first name below ``ankusa_shm``: a subpackage or a top-level module."""
    return module.split(".")[1] if "." in module else module


def _top_level_imports(tree: ast.AST) -> Iterator[str]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ankusa_shm":
                yield from (f"ankusa_shm.{a.name}" for a in node.names)
            elif node.module.startswith("ankusa_shm."):
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("ankusa_shm."))
        else:
            yield from _top_level_imports(node)


def _edges() -> set[tuple[str, str, str]]:
    """(importing part, imported part, importing file) for every import across parts."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        source = _part("ankusa_shm." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        for module in _top_level_imports(ast.parse(path.read_text())):
            target = _part(module)
            if target != source:
                out.add((source, target, str(path.relative_to(PACKAGE))))
    return out


@pytest.mark.parametrize("part", sorted(ABOVE))
def test_a_part_imports_nothing_above_it(part: str) -> None:
    wrong = sorted(
        f"{file} imports {target}"
        for source, target, file in _edges()
        if source == part and target in ABOVE[part]
    )
    assert wrong == []


def test_only_the_entry_point_imports_the_commands() -> None:
    assert {s for s, t, _ in _edges() if t == "cli"} == {"__main__"}


def test_the_walk_sees_the_imports_it_judges() -> None:
    """Not vacuous: the request path's known imports are found."""
    edges = {(s, t) for s, t, _ in _edges()}
    assert {("http", "fleet"), ("http", "store"), ("fleet", "shm"), ("worker", "http")} <= edges

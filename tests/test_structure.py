"""The tree's structure, read from the source (no import runs): the installed import names, the
import graph's direction, and the size of files and functions (issue 51)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAPPED = ("models", "scheduler", "pallas_kernels")  # installed as pagedjax.<folder> (setup.py)
SOURCE = ("pagedjax", *MAPPED)


def python_files(*folders: str):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def imported_names(path: pathlib.Path):
    """(line, dotted name) of every absolute import in the file, in functions too."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_nothing_imports_the_folders_by_their_top_level_names():
    """`models`, `scheduler` and `pallas_kernels` are pagedjax.models, ... everywhere: a top-level
    import would load a second copy of a module (its classes unequal to the first's) from a
    checkout and fail in an install."""
    found = [f"{path.relative_to(ROOT)}:{line}: {name}"
             for path in python_files(*SOURCE, "tests", "benchmarks", "notebooks")
             for line, name in imported_names(path) if name.split(".")[0] in MAPPED]
    assert not found, "\n".join(found)

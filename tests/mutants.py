"""Mutation testing over a change: plants one small bug at a time in the lines a change added to
pagedjax/, models/ and scheduler/, runs the tests that import the mutated module, and lists the
mutants no test killed (each a behaviour the tests do not pin down).

    make mutants                   # the uncommitted change, against HEAD
    make mutants BASE=HEAD~3       # everything since BASE
    python tests/mutants.py --base HEAD~3 --max 30 --seconds 600

The mutations are the planted bugs an auditor tries: a comparison turned (== / !=, < / <=,
> / >=), `and` / `or` swapped, a `not` dropped, a small integer constant off by one, a boolean
constant flipped. A mutated file is written in place (its text regenerated from the mutated
tree) and restored after each run, whatever happens.
"""

from __future__ import annotations

import argparse
import ast
import copy
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ("pagedjax", "models", "scheduler")
COMPARE = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt,
           ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
           ast.In: ast.NotIn, ast.NotIn: ast.In}


def added_lines(base: str) -> dict[pathlib.Path, set[int]]:
    """The lines the change adds, by source file (git diff against base; new files whole)."""
    diff = subprocess.run(["git", "diff", "-U0", base, "--", *SOURCE], cwd=ROOT, text=True,
                          capture_output=True, check=True).stdout
    lines: dict[pathlib.Path, set[int]] = {}
    path = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            name = line[6:] if line.startswith("+++ b/") else None
            path = ROOT / name if name and name.endswith(".py") else None
        elif path is not None and line.startswith("@@"):
            start, _, count = re.match(r"@@ -\S+ \+(\d+)(,(\d+))? @@", line).groups()
            count = 1 if count is None else int(count)
            lines.setdefault(path, set()).update(range(int(start), int(start) + count))
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", *SOURCE],
                               cwd=ROOT, text=True, capture_output=True, check=True).stdout
    for name in untracked.split():
        if name.endswith(".py"):
            lines[ROOT / name] = set(range(1, len((ROOT / name).read_text().splitlines()) + 1))
    return lines


def mutations(tree: ast.AST, wanted: set[int]) -> list[tuple[int, str, object]]:
    """(line, description, how) of each mutation on a wanted line; how(node) mutates a copy."""
    found = []
    for index, node in enumerate(ast.walk(tree)):
        line = getattr(node, "lineno", None)
        if line not in wanted:
            continue
        if isinstance(node, ast.Compare):
            for k, op in enumerate(node.ops):
                if type(op) in COMPARE:
                    found.append((line, f"{type(op).__name__} -> {COMPARE[type(op)].__name__}",
                                  (index, "compare", k)))
        elif isinstance(node, ast.BoolOp):
            other = "Or" if isinstance(node.op, ast.And) else "And"
            found.append((line, f"{type(node.op).__name__} -> {other}", (index, "boolop", 0)))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            found.append((line, "not dropped", (index, "not", 0)))
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value < 8:
            found.append((line, f"{node.value} -> {node.value + 1}", (index, "int", 0)))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            found.append((line, f"{node.value} -> {not node.value}", (index, "bool", 0)))
    return found


def mutated_source(tree: ast.AST, how: tuple) -> str:
    index, kind, k = how
    tree = copy.deepcopy(tree)
    nodes = list(ast.walk(tree))
    node = nodes[index]
    if kind == "compare":
        node.ops[k] = COMPARE[type(node.ops[k])]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "int":
        node.value += 1
    elif kind == "bool":
        node.value = not node.value
    elif kind == "not":
        for parent in nodes:
            for field, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, field, node.operand)
                elif isinstance(value, list) and any(v is node for v in value):
                    value[[v is node for v in value].index(True)] = node.operand
    return ast.unparse(tree)


def covering_tests(path: pathlib.Path) -> list[str]:
    """The fast tests that name the module (its installed dotted name, or its last part with
    its package's)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    dotted = ".".join(parts if parts[0] == "pagedjax" else ["pagedjax", *parts])
    package, _, leaf = dotted.rpartition(".")
    pattern = re.compile(rf"{re.escape(dotted)}\b|from {re.escape(package)} import .*\b{leaf}\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if pattern.search(p.read_text()))


def run_tests(tests: list[str], timeout_s: float) -> str:
    """killed (a test failed), survived, or timeout (counted as killed: a hang is caught)."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m",
               "not slow and not clients", *tests]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if result.returncode == 0 else "killed"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the change is everything since BASE")
    parser.add_argument("--max", type=int, default=20, help="mutants at most (spread evenly)")
    parser.add_argument("--seconds", type=float, default=900, help="stop starting mutants then")
    parser.add_argument("--timeout", type=float, default=300, help="one mutant's test run")
    args = parser.parse_args(argv)
    plan = []
    for path, wanted in sorted(added_lines(args.base).items()):
        tests = covering_tests(path)
        tree = ast.parse(path.read_text())
        plan += [(path, tree, tests, *m) for m in mutations(tree, wanted)] if tests else []
    step = max(1, len(plan) // max(args.max, 1))
    plan = plan[::step][:args.max]
    print(f"{len(plan)} mutants over {len({p for p, *_ in plan})} files")
    deadline, survivors = time.monotonic() + args.seconds, []
    for path, tree, tests, line, what, how in plan:
        if time.monotonic() > deadline:
            print("time is up: the rest not run")
            break
        original = path.read_text()
        try:
            path.write_text(mutated_source(tree, how) + "\n")
            outcome = run_tests(tests, args.timeout)
        finally:
            path.write_text(original)
        print(f"{outcome:9} {path.relative_to(ROOT)}:{line} {what}", flush=True)
        if outcome == "survived":
            survivors.append(f"{path.relative_to(ROOT)}:{line} {what}")
    print(f"{len(survivors)} survived" + "".join(f"\n  {s}" for s in survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())

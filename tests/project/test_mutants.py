"""tests/mutants.py (make mutants): the mutations it plants on a change's lines, and the tests it
picks for a module."""

from __future__ import annotations

import ast

import mutants

SOURCE = """\
def f(x, flag):
    if x < 3 and not flag:
        return x == 0
    return True
"""


def test_each_mutation_on_the_wanted_lines_changes_what_the_code_does():
    tree = ast.parse(SOURCE)
    found = mutants.mutations(tree, {2})
    assert sorted(what for _, what, _ in found) == ["3 -> 4", "And -> Or", "Lt -> LtE",
                                                    "not dropped"]
    assert [what for _, what, _ in mutants.mutations(tree, {4})] == ["True -> False"]
    found += mutants.mutations(tree, {3, 4})
    namespaces = []
    for _, what, how in found:
        namespace = {}
        exec(mutants.mutated_source(tree, how), namespace)
        namespaces.append((what, namespace["f"]))
    original = {}
    exec(SOURCE, original)
    cases = [(x, flag) for x in range(6) for flag in (False, True)]
    for what, mutated in namespaces:  # every mutant answers some case otherwise
        assert any(mutated(*c) != original["f"](*c) for c in cases), what
    assert ast.unparse(tree) == ast.unparse(ast.parse(SOURCE))  # the tree itself untouched


def test_the_tests_of_a_module_are_those_that_name_it():
    tests = mutants.covering_tests(mutants.ROOT / "scheduler" / "host_tier.py")
    assert "tests/scheduler/test_host_tier.py" in tests and "tests/engine/test_tokenizer.py" not in tests

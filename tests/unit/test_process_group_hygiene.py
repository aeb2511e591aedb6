"""Every test that starts a process group ends it through `destroy_distributed`, which waits
for all ranks (a barrier) before tearing gloo down (issue 16: a rank that left while its peer
still sent aborted with SIGABRT and failed a CI run)."""

import os
import re

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_test_destroys_a_process_group_directly():
    offenders = []
    for folder, _, files in os.walk(TESTS):
        for name in files:
            if not name.endswith(".py") or name == os.path.basename(__file__):
                continue
            path = os.path.join(folder, name)
            text = open(path, encoding="utf-8").read()
            if re.search(r"\bdestroy_process_group\(", text):
                offenders.append(os.path.relpath(path, TESTS))
            if "init_process_group(" in text and "destroy_distributed(" not in text:
                offenders.append(os.path.relpath(path, TESTS) + " (never ends its group)")
    assert not offenders, offenders


def test_titanlab_waits_for_every_rank_before_destroying_a_group():
    """Each function of the package that destroys a process group also calls a barrier."""
    import ast

    package = os.path.join(os.path.dirname(TESTS), "titanlab")
    offenders = []
    for folder, _, files in os.walk(package):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                called = {
                    node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                    for node in ast.walk(fn)
                    if isinstance(node, ast.Call)
                    and isinstance(node.func, (ast.Attribute, ast.Name))
                }
                if "destroy_process_group" in called and "barrier" not in called:
                    offenders.append(f"{os.path.relpath(path, package)}:{fn.name}")
    assert not offenders, offenders

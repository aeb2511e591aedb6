"""Finding the places in titanlab that read a device's type (`x.is_cuda`, `x.device.type`,
`device.type`, `torch.cuda.is_available()`, a `device_type` compared), by function."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _reads_device_type(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
        return True
    if isinstance(node, ast.Attribute) and node.attr == "type":
        value = node.value
        name = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", "")
        return "device" in name
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        if (
            f.attr == "is_available"
            and isinstance(f.value, ast.Attribute)
            and f.value.attr == "cuda"
        ):
            return True
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return any(isinstance(s, ast.Name) and s.id == "device_type" for s in sides)
    return False


def _reads_in(tree: ast.AST) -> set[str]:
    """The qualified names of the functions (or "<module>") of `tree` that read a device's
    type."""
    found: set[str] = set()

    def walk(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if _reads_device_type(child):
                found.add(scope or "<module>")
            walk(child, inner)

    walk(tree, "")
    return found


def device_branches() -> set[tuple[str, str]]:
    """{(path from the repository root, enclosing function's qualified name)} of every read
    in titanlab/."""
    found: set[tuple[str, str]] = set()
    for folder, _, files in os.walk(os.path.join(REPO, "titanlab")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                rel = os.path.relpath(path, REPO)
                found |= {(rel, function) for function in _reads_in(tree)}
    return found

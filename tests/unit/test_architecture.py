"""The shape of the code, kept: titanlab's packages import one way (the layer order drawn in
docs/architecture.md), no module imports itself back through a cycle (in titanlab/ or tools/),
tools/ scripts share code only through tools/lib, and the top level of titanlab/ holds only
thin entry points.

The import graph is read from the source (`ast`, every import statement, including those inside
functions), so a lazy import that runs backwards fails here as well.
"""

from __future__ import annotations

import ast
import os
import re


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Lowest first: a package may import the packages before it, never one after it.
LAYERS = (
    "config",
    "models",
    "precision",
    "peft",
    "distributed",
    "data",
    "checkpoint",
    "generation",
    "components",
    "metrics",
    "observability",
    "resilience",
    "posttrain",
    "planning",
    "trainer",
    "ledger",
    "entry points",
)
ENTRY_POINTS = {"__init__", "train", "generate", "preflight", "launcher", "plan", "cli"}
# Files over ~400 lines, each with the reason it stays whole (docs/architecture.md lists them).
LONG_FILES: dict[str, str] = {}


def module_files(root: str) -> dict[str, str]:
    """{dotted module name: path} of every .py file under `REPO/root` (a package's name for its
    `__init__.py`)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(REPO, root)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def import_graph(root: str) -> dict[str, set[str]]:
    """{module: the modules of `root` it imports}. `from a import b` is an import of `a.b` when
    that is a module, else of `a`."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def layer_of(module: str) -> str:
    """The layer of a titanlab module: its package, or "entry points" at the top level."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] in ENTRY_POINTS):
        return "entry points"
    return parts[1]


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a later layer (or of a package missing from LAYERS), as text."""
    bad = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        for target in sorted(targets):
            there = layer_of(target)
            if here not in LAYERS or there not in LAYERS:
                bad.append(f"{module} -> {target}: {here if here not in LAYERS else there} "
                           "is not in LAYERS")  # fmt: skip
            elif LAYERS.index(there) > LAYERS.index(here):
                bad.append(f"{module} ({here}) -> {target} ({there})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_titanlab_imports_run_down_the_layers_without_cycles():
    graph = import_graph("titanlab")
    assert len(graph) > 100  # the walk found the package
    assert backward_imports(graph) == []
    assert cycles(graph) == []


def test_a_reversed_import_or_a_cycle_is_caught():
    """The checks can fail: data importing the trainer runs backwards, and a loop is a cycle."""
    graph = {m: set(t) for m, t in import_graph("titanlab").items()}
    graph["titanlab.data.loader"].add("titanlab.trainer.trainer")
    assert backward_imports(graph) == [
        "titanlab.data.loader (data) -> titanlab.trainer.trainer (trainer)"
    ]
    assert cycles(graph)  # the trainer imports the data loader
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert backward_imports({"titanlab.train": {"titanlab.newpkg.x"}}) == [
        "titanlab.train -> titanlab.newpkg.x: newpkg is not in LAYERS"
    ]


def test_tools_are_scripts_sharing_only_tools_lib():
    """A script imports titanlab and tools.lib, never another script; tools.lib imports no
    script (so nothing imports a script back)."""
    graph = import_graph("tools")
    assert cycles(graph) == []
    wrong = [f"{m} -> {t}" for m, ts in graph.items() for t in ts if not t.startswith("tools.lib")]
    assert wrong == []


def test_every_tools_script_imports():
    """Each script in tools/ (and tools.lib) imports: a name moved or removed elsewhere fails
    here, not when a user runs the script."""
    import importlib

    for module in sorted(import_graph("tools")):
        importlib.import_module(module)


def test_the_top_level_holds_thin_entry_points_and_every_package_says_what_it_holds():
    top = sorted(n[:-3] for n in os.listdir(os.path.join(REPO, "titanlab")) if n.endswith(".py"))
    assert set(top) <= ENTRY_POINTS and len(top) <= 7, top
    for name in top:
        with open(os.path.join(REPO, "titanlab", f"{name}.py"), encoding="utf-8") as f:
            assert name == "__init__" or len(f.read().splitlines()) <= 80, name
    packages = [m for m, p in module_files("titanlab").items() if p.endswith("__init__.py")]
    assert set(LAYERS) - {"entry points"} <= {m.split(".")[1] for m in packages if "." in m}
    for module in packages:
        with open(module_files("titanlab")[module], encoding="utf-8") as f:
            tree = ast.parse(f.read())
        assert ast.get_docstring(tree), f"{module}/__init__.py has no docstring"


def test_no_file_in_titanlab_is_over_about_400_lines_unless_named():
    long = {}
    for module, path in module_files("titanlab").items():
        with open(path, encoding="utf-8") as f:
            n = len(f.read().splitlines())
        if n > 420:
            long[os.path.relpath(path, REPO)] = n
    assert set(long) == set(LONG_FILES), long


def package_arrows(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{layer: the layers it imports directly}, without the arrows implied by a longer path
    (the transitive reduction, what the picture in docs/architecture.md draws)."""
    edges: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for module, targets in graph.items():
        for target in targets:
            if layer_of(target) != layer_of(module):
                edges[layer_of(module)].add(layer_of(target))

    def reachable(start: str, skip: str) -> set[str]:
        seen: set[str] = set()
        todo = [x for x in edges[start] if x != skip]
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo.extend(edges[x])
        return seen

    return {a: {b for b in bs if b not in reachable(a, b)} for a, bs in edges.items()}


def test_the_architecture_doc_draws_the_layers_and_arrows_the_code_has():
    """docs/architecture.md opens with the packages, top layer first, and the arrows between
    them, as a Mermaid diagram and as text; both must equal the import graph's."""
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    arrows = package_arrows(import_graph("titanlab"))
    drawn = re.search(r"```text\n(.*?)```", text, re.S)
    assert drawn, "docs/architecture.md draws the layers as text"
    rows = [line.split("──▶") for line in drawn.group(1).splitlines() if line.strip()]
    assert [r[0].strip() for r in rows] == list(reversed(LAYERS))
    in_text = {r[0].strip(): {x.strip() for x in r[1].split(",")} if len(r) > 1 else set()
               for r in rows}  # fmt: skip
    assert in_text == arrows
    mermaid = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert mermaid and text.index(mermaid.group(0)) < text.index(drawn.group(0))
    ids = {layer.replace(" ", "_"): layer for layer in LAYERS}
    in_mermaid: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for a, b in re.findall(r"^\s*(\w+)\s*-->\s*(\w+)", mermaid.group(1), re.M):
        in_mermaid[ids[a]].add(ids[b])
    assert in_mermaid == arrows
    for path in LONG_FILES:
        assert path in text


def test_every_test_module_has_a_basename_of_its_own():
    """`python -m pytest` from the root collects tests/unit and tests/integration in one run:
    without `__init__.py` files, pytest imports each test module by its basename, and two
    modules of the same name stop the collection (tests/unit/components/test_muon.py and
    tests/integration/test_muon.py did)."""
    seen: dict[str, str] = {}
    clashes = []
    for folder, _, files in os.walk(os.path.join(REPO, "tests")):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, name), REPO)
                if name in seen:
                    clashes.append((seen[name], path))
                seen.setdefault(name, path)
    assert not clashes, clashes

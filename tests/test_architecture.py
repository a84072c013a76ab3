"""The structure of src/ that ARCHITECTURE.md describes: an acyclic import graph, files of one idea.

The import graph is built from the source alone (``ast``, nothing imported), and every way one
module reaches another counts: imports at the top, inside functions, under ``TYPE_CHECKING``,
``importlib.import_module(...)`` with a literal or an f-string naming modules (resolved
against the strings of that file: a registry tuple of module names), and string constants that
are whole module names (``"-m modelcarve.commands.launching.worker"`` style launches). Moving an import
into a function does not hide a cycle from this test.

The layer rules themselves (spec -> plan -> runtime -> verify -> serve -> commands, no torch in
spec/ and plan/, the runtime's parallelisms independent of each other) are import-linter
contracts in pyproject.toml, run by ``make test`` before pytest.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "modelcarve"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings (not module references)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def _imports_of(name: str, path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """(imported internal module, line) for every reference of module ``name`` to another."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    docstrings = _docstring_nodes(tree)
    found: list[tuple[str, int]] = []

    def internal(target: str) -> str | None:
        # the longest prefix of ``target`` that is one of our modules (``a.b.func`` -> ``a.b``)
        parts = target.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in modules:
                return candidate
            parts.pop()
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := internal(alias.name)) is not None:
                    found.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = name.split(".") if is_package else name.split(".")[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in modules else internal(base)
                if target is not None:
                    found.append((target, node.lineno))
        elif isinstance(node, ast.Call) and _is_import_module_call(node) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if (target := internal(arg.value)) is not None:
                    found.append((target, node.lineno))
            elif isinstance(arg, ast.JoinedStr):
                prefix = "".join(v.value for v in arg.values[:1] if isinstance(v, ast.Constant))
                named = [m for m in modules if m.startswith(prefix) and m[len(prefix):] in strings]
                # a name built from strings this file does not hold: assume any module under the prefix
                for target in named or [m for m in modules if prefix and m.startswith(prefix)]:
                    found.append((target, node.lineno))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and node.value in modules and node.value != name):
            found.append((node.value, node.lineno))
    return [(target, line) for target, line in found if target != name]


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """{module: modules it imports} over src/, and the first line of each edge."""
    sources = _sources()
    modules = set(sources)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    lines: dict[tuple[str, str], int] = {}
    for name, path in sources.items():
        for target, line in _imports_of(name, path, modules):
            graph[name].add(target)
            lines.setdefault((name, target), line)
    return graph, lines


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def _describe(cycle: list[str], lines: dict[tuple[str, str], int]) -> str:
    sources = _sources()
    steps = [f"  {a} ({sources[a].relative_to(SRC.parent)}:{lines[(a, b)]}) imports {b}"
             for a, b in zip(cycle, cycle[1:])]
    return "import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The graph builder finds function-level, TYPE_CHECKING, import_module and f-string registry
    imports (so the acyclic test below cannot pass by not looking)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""p."""\n')
    for mod in ("a", "b", "c", "d", "e", "f"):
        (pkg / f"{mod}.py").write_text('"""m."""\n')
    (pkg / "a.py").write_text(
        '"""a."""\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import X\n'
        'def f():\n    from . import c\n    import importlib\n    importlib.import_module("pkg.d")\n'
        'NAMES = ("e",)\ndef g(n):\n    import importlib\n    return importlib.import_module(f"pkg.{n}")\n'
        'CMD = ["-m", "pkg.f"]\n'
    )
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f"}
    found = {target for target, _ in _imports_of("pkg.a", pkg / "a.py", modules)}
    assert found == {"pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f"}
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == ["x", "y", "z", "x"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_import_graph_is_acyclic():
    graph, lines = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # it did read the sources
    cycle = find_cycle(graph)
    assert cycle is None, _describe(cycle, lines)


def test_the_reference_model_knows_no_parallelism():
    """runtime/model/transformer.py and its layers import nothing of the runtime but each other."""
    graph, _ = import_graph()
    model_layers = {"modelcarve.runtime.model.transformer", "modelcarve.runtime.model.moe", "modelcarve.runtime.model.mlp", "modelcarve.runtime.model.rope"}
    for name in sorted(model_layers & set(graph)):
        runtime = {m for m in graph[name] if m.startswith("modelcarve.runtime.")}
        assert runtime <= model_layers, f"{name} imports {sorted(runtime - model_layers)}"


PARALLELISMS = {  # runtime module -> the parallelism it belongs to
    "tensor": "tp", "pipeline": "pp", "pipeline_split": "pp", "expert": "ep",
    "context": "cp", "ring_attention": "cp", "data_parallel": "dp",
}


def test_only_parallelize_brings_several_parallelisms_together():
    """No module but runtime/parallel/parallelize.py imports the modules of two parallelisms (the train
    step and verify/reference.py take what they need of them through parallelize.StepHooks)."""
    graph, lines = import_graph()
    offenders = {}
    for name, targets in sorted(graph.items()):
        if name == "modelcarve.runtime.parallel.parallelize":
            continue
        used = {PARALLELISMS[t.rsplit(".", 1)[1]]: t for t in targets
                if t.startswith("modelcarve.runtime.") and t.rsplit(".", 1)[1] in PARALLELISMS}
        if len(used) > 1:
            offenders[name] = sorted(f"{t} (line {lines[(name, t)]})" for t in used.values())
    assert not offenders, f"modules bringing several parallelisms together: {offenders}"
    assert len({PARALLELISMS[t.rsplit('.', 1)[1]] for t in graph["modelcarve.runtime.parallel.parallelize"]
                if t.rsplit(".", 1)[1] in PARALLELISMS}) == 5  # it did find parallelize's own


@pytest.mark.parametrize("name", sorted(_sources()))
def test_every_module_is_short_and_says_what_it_owns(name):
    path = _sources()[name]
    text = path.read_text()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines <= MAX_LINES, f"{path.relative_to(SRC.parent)} has {lines} lines (at most {MAX_LINES}): split it by idea"
    doc = ast.get_docstring(ast.parse(text))
    assert doc and doc.strip(), f"{path.relative_to(SRC.parent)} has no module docstring saying what it owns"

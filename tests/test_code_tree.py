"""The tree of src/ a newcomer reads at a glance (ARCHITECTURE.md): packages by idea, not flat folders.

Read from the files alone (``ast``, nothing imported):

* ``runtime/`` and ``plan/`` keep at most a handful of modules at their top; the rest is folders;
* no package holds more than 15 modules;
* no three sibling modules share a name prefix (``serve_a``, ``serve_b``, ``serve_c`` is a folder
  called ``serve``);
* no private ``_name`` is imported from another package (a name used across a package boundary is
  part of its interface: make it public, or move the code);
* no machine path (``/work/...``, ``/home/...``) in the source.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "modelcarve"
TOP_LIMIT = 5
PACKAGE_LIMIT = 15


def _packages() -> list[Path]:
    return sorted(p.parent for p in ROOT.rglob("__init__.py"))


def _modules(package: Path) -> list[str]:
    return sorted(p.stem for p in package.glob("*.py") if p.name != "__init__.py")


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@pytest.mark.parametrize("name", ["runtime", "plan"])
def test_runtime_and_plan_have_a_handful_of_modules_at_their_top(name):
    top = _modules(ROOT / name)
    assert len(top) <= TOP_LIMIT, f"{name}/ has {len(top)} modules at its top ({top}): put them in folders by idea"


def test_no_package_over_fifteen_modules():
    big = {str(p.relative_to(SRC)): len(_modules(p)) for p in _packages() if len(_modules(p)) > PACKAGE_LIMIT}
    assert not big, f"packages over {PACKAGE_LIMIT} modules: {big}"


def test_no_three_siblings_share_a_name_prefix():
    crowded = {}
    for package in _packages():
        prefixes = Counter(m.split("_")[0] for m in _modules(package) if "_" in m)
        # a module named exactly the prefix counts with its siblings (serve.py, serve_a.py, serve_b.py)
        for prefix in list(prefixes):
            prefixes[prefix] += prefix in _modules(package)
        many = sorted(p for p, n in prefixes.items() if n >= 3)
        if many:
            crowded[str(package.relative_to(SRC))] = many
    assert not crowded, f"three or more sibling modules share a prefix (make it a folder): {crowded}"


def test_no_private_name_imported_across_a_package_boundary():
    offences = []
    for path in sorted(ROOT.rglob("*.py")):
        here = _dotted(path)
        package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("modelcarve")):
                continue
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name.startswith("__"):
                    continue
                is_package = (SRC / node.module.replace(".", "/")).is_dir()
                target_package = node.module if is_package else node.module.rsplit(".", 1)[0]
                if target_package != package:
                    offences.append(f"{path.relative_to(SRC)}:{node.lineno} imports {node.module}.{alias.name}")
    assert not offences, "private names imported across a package boundary:\n" + "\n".join(offences)


def test_no_machine_path_in_the_source():
    pattern = re.compile(r"(?<![\w.])/(work|home|Users|root)/[\w.-]+")
    found = [f"{p.relative_to(SRC)}:{i}: {line.strip()[:100]}"
             for p in sorted(ROOT.rglob("*.py")) for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, "machine paths in src/:\n" + "\n".join(found)

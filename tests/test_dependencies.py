"""Every package a tidespec module imports at its top is installed by ``pip install tidespec``.

Why: ``tidespec bench`` once imported ``jsonschema`` (then a test extra) at the top of a bench
module, so the whole CLI failed on a machine with the package's own dependencies alone (seen on a
lent GPU). A module-level import is checked against the closure of ``[project] dependencies``
(what each of them requires in turn, as installed); ``tidespec/fleet`` may also use the ``fleet``
extra. Imports inside functions (optional back-ends: llama.cpp, Triton, Ray) are not checked.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    """'fastapi>=0.110' -> 'fastapi' (normalised as pip compares names)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0]).lower()


def _closure(names: set[str]) -> set[str]:
    """``names`` and every distribution they require (extras' requirements left out), as installed."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def _top_level_imports(path: Path) -> set[str]:
    """The top-level package of each absolute import among the module's own statements."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"tidespec", "__future__"}


def test_module_level_imports_are_installed_by_the_package_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _closure({_name(d) for d in project["dependencies"]})
    fleet = base | _closure({_name(d) for d in project["optional-dependencies"]["fleet"]})
    providers = md.packages_distributions()
    missing = []
    for path in sorted((ROOT / "tidespec").rglob("*.py")):
        allowed = fleet if "fleet" in path.relative_to(ROOT).parts else base
        for top in _top_level_imports(path):
            dists = {_name(d) for d in providers.get(top, [top])}
            if not dists & allowed:
                missing.append(f"{path.relative_to(ROOT)}: {top}")
    assert not missing, f"imported at module level but not a package dependency: {missing}"

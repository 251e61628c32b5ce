"""The package's shape: one-way layers, a light ``import tidespec``, one user-error base, small modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tidespec
from tidespec.errors import UserError

PACKAGE = Path(tidespec.__file__).parent
ROOT = PACKAGE.parent


def test_layers_contract_holds() -> None:
    """pyproject's import-linter contracts, every one kept: no module imports a layer above its own, no
    circles; models/'s sub-packages in their own layers; the serving process's online code and the
    trainer child's never import each other."""
    proc = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert contracts == 4 and f"{contracts} kept, 0 broken" in proc.stdout


def test_no_layer_above_models_names_a_model_family() -> None:
    """The engine, the drafters, online learning, the server and the benchmarks see a ``TargetModel``
    (``models/target.py``), never a family's model class (``DecoderModel``): a family is one module below."""
    named = [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
             if path.parent.relative_to(PACKAGE).parts[:1] != ("models",) and "DecoderModel" in path.read_text()]
    assert named == []


def test_import_tidespec_loads_no_online_server_or_plotting() -> None:
    code = ("import sys, tidespec; print(' '.join(m for m in sys.modules if m.startswith(("
            "'tidespec.online', 'tidespec.server', 'tidespec.bench', 'matplotlib', 'fastapi', 'uvicorn'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""
    assert {"LLM", "EngineConfig", "SamplingParams"} <= set(tidespec.__all__)


def _exception_classes() -> list[tuple[str, str, list[str]]]:
    """(module, class, base names) of every exception class defined in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if node.name.endswith("Error") or any(b.endswith(("Error", "Exception")) for b in bases):
                    found.append((str(path.relative_to(ROOT)), node.name, bases))
    return found


def test_every_user_facing_error_derives_from_user_error() -> None:
    """Errors a user can fix share ``UserError``; the few that do not are internal signals, named here."""
    internal = {"EngineRequestError", "EngineStoppedError", "ApiError", "ShardGone", "_BodyTooLarge"}
    classes = _exception_classes()
    assert len(classes) > 10
    for module, name, _ in classes:
        if name in internal or name == "UserError":
            continue
        mod = __import__(module[:-3].replace("/", "."), fromlist=[name])
        assert issubclass(getattr(mod, name), UserError), f"{module}: {name} does not derive from UserError"


def test_cli_catches_only_user_errors() -> None:
    """The command runner turns ``UserError`` into one line and lets anything else surface."""
    for rel in ("cli.py", "commands.py"):
        for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if isinstance(node, ast.ExceptHandler):
                assert node.type is not None, f"bare except in {rel}"
                assert ast.unparse(node.type) in ("UserError", "KeyboardInterrupt"), ast.unparse(node.type)


def test_no_source_module_over_600_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long

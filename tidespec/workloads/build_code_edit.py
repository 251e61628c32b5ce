"""How ``code_edit.jsonl`` was written: code edits for Predicted Outputs (``bench spec --predicted``).

Why this exists: the edit workload must be real code the project did not write, edited the way an
editor asks a model to (rename, add a parameter, fix a bug), with the file itself as the prediction.
This script picks functions of 40-70 lines from CPython's standard library (PSF-2.0) and from
PyTorch's C++ headers (BSD-3-Clause), both installed beside tidespec, and writes one record per
edit; the JSONL is committed, so the workload does not change with the Python or torch installed.
Run once: ``python -m tidespec.workloads.build_code_edit OUT.jsonl``.

Worked example of a record (fields beyond ``WorkloadRecord``'s usual ones: ``prediction``)::

    {"id": "edit-rename-textwrap-00", "domain": "code_edit", "kind": "chat",
     "system": "You are a careful programmer. ...", "prompt": "Rename the parameter `width` to ...",
     "prediction": "def fill(text, width=70, **kwargs):\\n ...", "source": "CPython 3.11 Lib/textwrap.py"}
"""

from __future__ import annotations

import ast
import json
import re
import sys
import sysconfig
from pathlib import Path

import torch

SYSTEM = ("You are a careful programmer. Apply the requested change and reply with the complete updated code "
          "only, in one code block, without any explanation.")
PY_MODULES = ["textwrap", "shlex", "difflib", "csv", "fractions", "statistics", "heapq", "bisect", "calendar",
              "string", "ipaddress", "argparse", "configparser", "tokenize", "inspect", "pprint", "json/encoder",
              "json/decoder", "email/utils", "urllib/parse", "http/cookies", "dataclasses", "functools", "random"]
CPP_DIR = "include/c10/util"
NEW_NAMES = ["value", "count", "result", "item", "source", "limit", "index", "buffer", "entry", "offset"]
BUGS = [("<=", "<"), (" + 1", " - 1"), (" == ", " != "), (" and ", " or "), ("[0]", "[1]")]


def python_functions(min_lines: int = 40, max_lines: int = 70) -> list[tuple[str, str, ast.FunctionDef]]:
    """(module, source text, node) of top-level functions and methods of ``min_lines``-``max_lines`` lines."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for mod in PY_MODULES:
        text = (lib / f"{mod}.py").read_text()
        lines = text.splitlines(keepends=True)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines:
                    body = "".join(lines[node.lineno - 1:node.end_lineno])
                    indent = len(body) - len(body.lstrip(" "))
                    body = "".join(line[indent:] if line.startswith(" " * indent) else line
                                   for line in body.splitlines(keepends=True))
                    out.append((mod, body, node))
    return out


def cpp_blocks(min_lines: int = 40, max_lines: int = 70, count: int = 8) -> list[tuple[str, str]]:
    """(header name, text) of the first ``max_lines`` lines after the license of PyTorch's c10 headers."""
    root = Path(torch.__file__).parent / CPP_DIR
    out = []
    for path in sorted(root.glob("*.h")):
        lines = path.read_text().splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.startswith("#include")), 0)
        block = lines[start:start + max_lines]
        if len(block) >= min_lines and re.search(r"\b(int|size_t|auto)\s+\w+\s*=", "".join(block)):
            out.append((path.name, "".join(block)))
        if len(out) == count:
            break
    return out


def record(kind: str, i: int, name: str, lang: str, instruction: str, code: str, source: str,
           license_: str) -> dict[str, str]:
    return {"id": f"edit-{kind}-{name}-{i:02d}", "domain": "code_edit", "kind": "chat", "system": SYSTEM,
            "prompt": f"{instruction}\n\n```{lang}\n{code}```", "prediction": code, "source": source,
            "license": license_}


def build() -> list[dict[str, str]]:
    """Up to 8 renames, 8 added parameters and 8 bug fixes in Python (one function per module), 8 renames
    in C++, interleaved."""
    funcs = python_functions()
    picked: dict[str, list[tuple[str, str, ast.FunctionDef]]] = {"rename": [], "param": [], "bug": []}
    used: set[str] = set()
    for mod, body, node in funcs:
        if mod in used:
            continue
        args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        bug = next((b for b in BUGS if b[0] in body), None)
        for kind in ("rename", "param", "bug"):
            ok = {"rename": bool(args), "param": True, "bug": bug is not None}[kind]
            if ok and len(picked[kind]) < 8:
                picked[kind].append((mod, body, node))
                used.add(mod)
                break
    version = f"CPython {sys.version_info.major}.{sys.version_info.minor}"
    out = []
    for kind, items in picked.items():
        for i, (mod, body, node) in enumerate(items):
            src = f"{version} Lib/{mod}.py, {node.name}()"
            name = mod.replace("/", "_")
            if kind == "rename":
                arg = next(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
                new = next(n for n in NEW_NAMES[i:] + NEW_NAMES if n not in body)
                text = f"Rename the parameter `{arg}` of `{node.name}` to `{new}` everywhere it is used."
            elif kind == "param":
                text = (f"Add a keyword-only parameter `strict: bool = False` to `{node.name}`; when it is true, "
                        f"raise `ValueError` at the start of the function if the first argument is empty.")
            else:
                correct, bugged = next(b for b in BUGS if b[0] in body)
                line = body[:body.index(correct)].count("\n") + 1
                body = body.replace(correct, bugged, 1)  # the bug the instruction asks to fix
                text = (f"There is a bug on line {line} of `{node.name}`: `{bugged.strip()}` should be "
                        f"`{correct.strip()}`. Fix it.")
            out.append(record(kind, i, name, "python", text, body, src, "PSF-2.0"))
    for i, (header, code) in enumerate(cpp_blocks()):
        var = re.search(r"\b(?:int|size_t|auto)\s+(\w+)\s*=", code).group(1)  # type: ignore[union-attr]
        new = next(n for n in NEW_NAMES[i:] + NEW_NAMES if n not in code)
        text = f"Rename the variable `{var}` to `{new}` everywhere in this code."
        out.append(record("cpp-rename", i, header.removesuffix(".h").lower(), "cpp", text, code,
                          f"PyTorch {torch.__version__.split('+')[0]} torch/{CPP_DIR}/{header}", "BSD-3-Clause"))
    groups: dict[str, list[dict[str, str]]] = {}
    for r in out:
        groups.setdefault(r["id"].split("-")[1], []).append(r)
    # round-robin over the kinds of edit, so that the first k records (--limit k) mix them
    return [g[i] for i in range(max(map(len, groups.values()))) for g in groups.values() if i < len(g)]


def main(path: str) -> None:
    records = build()
    with open(path, "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    print(f"wrote {len(records)} edits to {path}")


if __name__ == "__main__":
    main(sys.argv[1])

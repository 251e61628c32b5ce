"""Code-completion training prompts mined from Python sources on this machine, as a workload JSONL.

Why this exists: the code a drafter meets in completion traffic is "a function's signature and
docstring, write the body" (HumanEval's shape, our ``code_unseen`` benchmark); we ship ~220 such
prompts, and the head trained on them is data-limited. Every machine that runs tidespec holds
thousands more: the Python standard library and the installed packages are full of documented
functions. ``mine_functions`` turns each top-level function with a docstring into a prompt that
stops where the docstring ends; the target's own continuation of it (``train-drafter
--from-workload FILE``) is the training text, so what the source's body says is never used.

Held-out honesty: a prompt sharing ``ngram`` words in a row with a held-out workload (the prompts
a benchmark measures on) is dropped, as is a repeat.

Worked example (a file with one documented function)::

    # util.py
    def clamp(x: float, lo: float, hi: float) -> float:
        \"\"\"Limit x to [lo, hi].\"\"\"
        return max(lo, min(hi, x))

    prompts_from_source(Path("util.py").read_text())
    # -> ['def clamp(x: float, lo: float, hi: float) -> float:\\n    \"\"\"Limit x to [lo, hi].\"\"\"\\n']
"""

from __future__ import annotations

import ast
import logging
import random
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from tidespec.online.prompts.selfinstruct import OverlapFilter
from tidespec.online.training.config import MinePromptsConfig, TrainerConfigError
from tidespec.workloads.loader import WorkloadRecord, workload_texts

logger = logging.getLogger(__name__)


def default_sources() -> list[str]:
    """The Python standard library of the running interpreter (present wherever tidespec runs)."""
    return [sysconfig.get_paths()["stdlib"]]


def python_files(roots: list[str], skip_dirs: tuple[str, ...] = ()) -> Iterator[Path]:
    """Every ``*.py`` file under the roots (a root may be a file), in sorted order, except those
    below a directory named in ``skip_dirs``."""
    for root in roots:
        path = Path(root).expanduser()
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from sorted(p for p in path.rglob("*.py")
                              if p.is_file() and not set(p.relative_to(path).parts) & set(skip_dirs))
        else:
            raise TrainerConfigError(f"source {root} does not exist")


def prompts_from_source(text: str, *, min_doc_words: int = 5, max_chars: int = 1200) -> list[str]:
    """Top-level functions of one module that have a docstring of at least ``min_doc_words`` words:
    each one's source from ``def`` (decorators dropped) to the end of its docstring, plus a newline.
    A file that does not parse gives nothing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old sources
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out: list[str] = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(doc.value.value.split()) < min_doc_words or doc.end_lineno is None or len(node.body) < 2:
            continue
        prompt = "\n".join(lines[node.lineno - 1: doc.end_lineno]) + "\n"
        if len(prompt) <= max_chars:
            out.append(prompt)
    return out


def mine_functions(cfg: MinePromptsConfig) -> list[WorkloadRecord]:
    """Up to ``cfg.count`` prompts from the sources, a seeded sample of all that pass the filters."""
    roots = [s.strip() for s in cfg.source.split(",") if s.strip()]
    # the standard library's directory holds the installed packages too: the default is only the former
    skip = () if roots else ("site-packages", "dist-packages")
    gate = OverlapFilter(workload_texts(cfg.exclude_workload), cfg.exclusion_ngram)
    found: list[tuple[str, str]] = []  # (prompt, file)
    files = list(python_files(roots or default_sources(), skip))
    for path in tqdm(files, desc="mine functions", unit="file", disable=not cfg.progress, leave=False):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found += [(p, str(path)) for p in prompts_from_source(text, min_doc_words=cfg.min_doc_words,
                                                              max_chars=cfg.max_chars)]
    random.Random(cfg.seed).shuffle(found)
    kept: list[WorkloadRecord] = []
    for prompt, where in found:
        if len(kept) >= cfg.count:
            break
        if gate.admit(prompt):
            kept.append(WorkloadRecord(id=f"{cfg.domain}-{len(kept):05d}", domain=cfg.domain, kind="completion",
                                       prompt=prompt, source=f"mined from {where}",
                                       license="that of the source file"))
    logger.info("mined %d prompts from %d documented functions in %d files", len(kept), len(found), len(files))
    if len(kept) < cfg.count:
        logger.warning("only %d of %d prompts: add --source directories", len(kept), cfg.count)
    return kept

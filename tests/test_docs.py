"""The docs name only what exists: paths, links and anchors, and the code names of the architecture page.

Why this exists: the README and ``docs/`` point at files, headings and classes that move. A renamed
module or a removed method leaves the prose that names it wrong with nothing failing, and a reader
who follows it finds nothing (``tidespec/bench/load_analysis.py`` once outlived its move to
``tidespec/bench/load/analysis.py`` this way). These tests read the markdown and the package's
source as text and ``ast`` (nothing is imported), and every failure names the file, the line and
the stale item, so one look says what to fix.

What is checked:

- every ``tidespec/...`` path in README.md and docs/**/*.md exists (globs must match something);
  the paths in the "where" column of docs/status.md's table (under ``tidespec/`` unless they start
  with ``tests/``) and the source paths of docs/architecture.md too;
- every relative markdown link points at an existing file, and its ``#anchor`` at a heading there;
- the code names of docs/architecture.md resolve: ``Class.attribute`` and ``module.function``, a
  backticked ``path.py: Name`` (the name defined in that file), the bare identifiers and class names
  it quotes, and in the paragraph about one module (``**`llm.py`.**``) the names it says that
  module holds.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tidespec"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
STATUS = ROOT / "docs" / "status.md"


def doc_files() -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Line:
    """One line of a markdown file: where it is, its text, whether it is inside a ``` fence, the inline
    code spans that start on it (a span may run on to the next line) and its text with those spans blanked."""

    path: Path
    number: int
    text: str
    fenced: bool
    spans: tuple[str, ...] = ()
    prose: str = ""

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.number}"


# an inline code span: single backticks, within one paragraph (it may wrap, never across a blank line)
CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")


@cache
def lines_of(path: Path) -> tuple[Line, ...]:
    """The file's lines, numbered from 1, each marked fenced or not (the fence lines themselves are fenced)."""
    texts = path.read_text(encoding="utf-8").splitlines()
    fenced: list[bool] = []
    inside = False
    for text in texts:
        fence = text.lstrip().startswith("```")
        fenced.append(inside or fence)
        inside = inside != fence
    # the code spans of the text outside the fences (fenced lines left empty: no span runs into one)
    outside = "\n".join("" if f else t for t, f in zip(texts, fenced))
    spans: list[list[str]] = [[] for _ in texts]
    for match in CODE_SPAN.finditer(outside):
        spans[outside.count("\n", 0, match.start())].append(" ".join(match.group(1).split()))
    prose = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), outside).split("\n")
    return tuple(Line(path, i + 1, t, f, tuple(spans[i]), t if f else prose[i])
                 for i, (t, f) in enumerate(zip(texts, fenced)))


def backticked(text: str) -> list[str]:
    """The inline code spans of a piece of one line (a table cell)."""
    return re.findall(r"`([^`]+)`", text)


# --- a. paths ---------------------------------------------------------------------------------------

# a `tidespec/...` path, not preceded by what makes it somewhere else (`/nfs/tidespec/x`, `~/.cache/tidespec`)
TIDESPEC_PATH = re.compile(r"(?<![\w/.~$-])tidespec/[\w./*-]*")
# a source path in prose or code: lowercase folders, a file with a source extension or a folder ending in "/"
SOURCE_PATH = re.compile(r"(?<![\w/.~$-])((?:[a-z0-9_]+/)+(?:[a-z0-9_*]+\.(?:py|cpp|md|toml|sh))?)(?![\w/{-])")
SOURCE_FILE = re.compile(r"[a-z0-9_*]+\.(?:py|cpp)")


def exists(path: Path) -> bool:
    """The path exists; a glob (``eagle3*.py``) matches at least one file."""
    if "*" in str(path):
        return any(path.parent.glob(path.name))
    return path.exists()


def tidespec_paths(path: Path) -> Iterator[tuple[Line, str]]:
    """Every ``tidespec/...`` path the file names, with its line (trailing sentence punctuation dropped)."""
    for line in lines_of(path):
        for match in TIDESPEC_PATH.finditer(line.text):
            yield line, match.group(0).rstrip(".,;:")


def test_tidespec_paths_in_the_docs_exist() -> None:
    named = [(line, name) for doc in doc_files() for line, name in tidespec_paths(doc)]
    assert len(named) > 50, f"only {len(named)} tidespec/ paths found in the docs: is the pattern broken?"
    stale = [f"{line.where()}: `{name}` does not exist" for line, name in named if not exists(ROOT / name)]
    assert not stale, "paths named in the docs that are not in the repository:\n" + "\n".join(stale)


def status_where_cells() -> Iterator[tuple[Line, str]]:
    """The "where" cell of every row of docs/status.md's capability table."""
    column = -1
    for line in lines_of(STATUS):
        row = line.text.strip().strip("|")
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)] if line.text.startswith("|") else []  # not `a\|b`
        if "where" in cells:
            column = cells.index("where")
        elif cells and column >= 0 and not set(cells[0]) <= set("-: "):
            yield line, cells[column]
        elif not cells:
            column = -1


def test_status_table_paths_exist() -> None:
    """docs/status.md: "paths under `tidespec/` unless they start with `tests/`"; a bare file name
    (`graceful.py` after `server/guard.py`) is in the folder of the path before it in its cell."""
    stale: list[str] = []
    cells = list(status_where_cells())
    assert len(cells) > 20, "docs/status.md's table (a header row with a `where` column) was not found"
    for line, cell in cells:
        folder = ""
        for name in backticked(cell):
            part = name.split(":")[0].strip()  # `engine/engine.py: LLMEngine.step` names a file
            if part.startswith("tests/"):
                target = ROOT / part
            elif "/" in part.rstrip("/"):
                target = PACKAGE / part
                folder = part if part.endswith("/") else part.rsplit("/", 1)[0]
            else:  # a bare name: in the folder of the path before it, else at the top of tidespec/
                target = PACKAGE / folder / part if exists(PACKAGE / folder / part) else PACKAGE / part
            if not exists(target):
                tried = sorted({f"tidespec/{folder}/{part}".replace("//", "/"), str(target.relative_to(ROOT))})
                stale.append(f"{line.where()}: `{name}` (looked for {' and '.join(tried)})")
    assert not stale, "docs/status.md names paths that do not exist:\n" + "\n".join(stale)


@cache
def repository_paths() -> frozenset[str]:
    """Every file and folder of the package and tests, relative to the repository root, folders with a
    trailing "/"."""
    found: set[str] = set()
    for top in (PACKAGE, ROOT / "tests", ROOT / "docs"):
        for p in top.rglob("*"):
            if "__pycache__" not in p.parts:
                found.add(p.relative_to(ROOT).as_posix() + ("/" if p.is_dir() else ""))
    found.update(p.name for p in ROOT.iterdir())
    return frozenset(found)


def named_somewhere(name: str) -> bool:
    """Some file or folder of the repository ends with this path (``common/report.py`` is in
    ``tidespec/bench/``; the architecture page names a module relative to its package's paragraph)."""
    if "*" in name:
        return any(re.fullmatch(r"(?:.*/)?" + re.escape(name).replace(r"\*", "[^/]*"), p) for p in repository_paths())
    return any(p == name or p.endswith("/" + name) for p in repository_paths())


def test_architecture_source_paths_exist() -> None:
    """docs/architecture.md is the map of the code: every source path it names (`online/signals.py`,
    `models/kernels/csrc/`, `kv_paged.py`) is a file or folder of the repository."""
    named: list[tuple[Line, str]] = []
    for line in lines_of(ARCHITECTURE):
        names = {m.group(1) for m in SOURCE_PATH.finditer(line.text)}
        names |= {code for code in line.spans if SOURCE_FILE.fullmatch(code)}
        named += [(line, n) for n in sorted(names)]
    assert len(named) > 100, f"only {len(named)} source paths found in docs/architecture.md: is the pattern broken?"
    stale = [f"{line.where()}: `{n}`" for line, n in named if not named_somewhere(n)]
    assert not stale, "docs/architecture.md names source paths that do not exist:\n" + "\n".join(stale)


# --- b. links ---------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text as rendered (links become their text, code spans
    lose their backticks), lowercased, every character but letters, digits, "_", "-" and spaces
    dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a markdown file's headings (a repeated one gets "-1", "-2", ... as on GitHub)."""
    found: set[str] = set()
    count: dict[str, int] = {}
    for line in lines_of(path):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line.text)
        if match and not line.fenced:
            base = slug(match.group(1))
            n = count.get(base, 0)
            count[base] = n + 1
            found.add(f"{base}-{n}" if n else base)
    return frozenset(found)


def relative_links() -> Iterator[tuple[Line, str]]:
    """Every relative link target of the docs (not http(s)://, mailto:), with its line."""
    for doc in doc_files():
        for line in lines_of(doc):
            if not line.fenced:
                yield from ((line, t) for t in LINK.findall(line.text) if not re.match(r"[a-z]+:", t))


def test_relative_links_and_anchors_resolve() -> None:
    """A link's file is relative to the markdown file's folder; a `#anchor` (alone: this file) must be
    the GitHub anchor of a heading of the markdown file it leads to."""
    stale: list[str] = []
    links = list(relative_links())
    assert len(links) > 300, f"only {len(links)} relative links found in the docs: is the pattern broken?"
    for line, target in links:
        file_part, _, anchor = target.partition("#")
        linked = (line.path.parent / file_part).resolve() if file_part else line.path
        if not linked.exists():
            stale.append(f"{line.where()}: link `{target}`: no file {file_part}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            stale.append(f"{line.where()}: link `{target}`: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not stale, "links in the docs that lead nowhere:\n" + "\n".join(stale)


# --- c. code names ------------------------------------------------------------------------------------


@dataclass
class Module:
    """What one source file defines (top-level functions, classes, assignments) and imports."""

    path: Path
    defined: set[str] = field(default_factory=set)
    imported: dict[str, str] = field(default_factory=dict)  # name -> the module it comes from


@dataclass
class Class:
    """A class of the package: its own attributes (methods, fields, ``self.x = ...``) and its bases' names."""

    attributes: frozenset[str]
    bases: frozenset[str]


@dataclass
class Index:
    """The package's source as ``ast`` sees it, built once."""

    modules: dict[str, Module]  # by dotted name, ``tidespec.models.quant.quantize``
    classes: dict[str, list[Class]]  # by class name (two modules may define one name)
    names: frozenset[str]  # every top-level name, class attribute and C++ op (``exact_linear``) of the package


def bound_by(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment binds (``x = ...``, ``x: T = ...``, ``x += ...``); none for other nodes."""
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []


def class_of(node: ast.ClassDef) -> Class:
    """A class's attributes as its source shows them; inherited ones are looked up by ``has_attribute``."""
    attributes: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            attributes.add(stmt.name)
        attributes |= {t.id for t in bound_by(stmt) if isinstance(t, ast.Name)}
    for sub in ast.walk(node):
        attributes |= {t.attr for t in bound_by(sub)
                       if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    bases = frozenset(b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                      if isinstance(b, (ast.Name, ast.Attribute)))
    return Class(frozenset(attributes), bases)


@cache
def index() -> Index:
    """Parse every module of tidespec/ once; the C++ sources add the torch ops they define."""
    modules: dict[str, Module] = {}
    classes: dict[str, list[Class]] = {}
    names: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = Module(path)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module.defined.add(node.name)
            if isinstance(node, ast.ClassDef):
                cls = class_of(node)
                classes.setdefault(node.name, []).append(cls)
                names |= cls.attributes
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    source = (node.module or ".") if isinstance(node, ast.ImportFrom) else alias.name
                    module.imported[(alias.asname or alias.name).split(".")[0]] = source
            module.defined |= {n.id for t in bound_by(node) for n in ast.walk(t) if isinstance(n, ast.Name)}
        names |= module.defined
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = module
    for source in PACKAGE.rglob("*.cpp"):  # torch ops: m.def("exact_linear(Tensor x, ...) -> Tensor")
        names |= set(re.findall(r'm\.def\("(\w+)\(', source.read_text(encoding="utf-8")))
    return Index(modules, classes, frozenset(names))


def has_attribute(class_name: str, attribute: str, seen: frozenset[str] = frozenset()) -> bool:
    """Some class of that name in the package has the attribute, itself or through a base class of the package."""
    for cls in index().classes.get(class_name, []):
        if attribute in cls.attributes:
            return True
        if any(has_attribute(b, attribute, seen | {class_name}) for b in cls.bases - seen - {class_name}):
            return True
    return False


def module_for_path(path: str) -> Module | None:
    """The module a doc's path names: from the repository root, else under ``tidespec/``."""
    targets = {(ROOT / path).resolve(), (PACKAGE / path).resolve()}
    return next((m for m in index().modules.values() if m.path.resolve() in targets), None)


CAMEL = r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*"  # a class name: capitalised, with a lowercase letter (not `LATEST`)
CLASS_ATTRIBUTE = re.compile(rf"(?<![\w.])({CAMEL})\.(_*[a-z][a-z0-9_]*)(?![\w.])")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
PATH_NAME = re.compile(r"([\w/]+\.py): ([A-Za-z_][\w.]*)")


def check_dotted(name: str) -> str | None:
    """Why ``Class.attribute`` or ``module.function`` does not resolve: None when it does, and when the
    first part is nothing of the package's (``torch.empty``, ``F.linear``)."""
    head, _, attribute = name.rpartition(".")
    cls = head.rpartition(".")[2]
    if re.fullmatch(CAMEL, cls):
        if cls not in index().classes:
            return f"no class {cls} in tidespec/"
        return None if has_attribute(cls, attribute) else f"{cls} has no attribute {attribute}"
    found = [m for n, m in index().modules.items() if n == head or n.endswith("." + head)]
    if not found or any(attribute in m.defined or attribute in m.imported for m in found):
        return None
    return f"{attribute} is not in {head}"


def check_path_name(path: str, name: str) -> str | None:
    """Why ``path: Name`` does not hold: no such module, or ``Name`` (or ``Class.attr``) not defined in it."""
    module = module_for_path(path)
    if module is None:
        return f"no module {path}"
    head, _, attribute = name.partition(".")
    if head not in module.defined:
        return f"{head} is not defined in {module.path.relative_to(ROOT)}"
    return None if not attribute or has_attribute(head, attribute) else f"{head} has no attribute {attribute}"


def check_code(code: str) -> str | None | bool:
    """Why a backticked span that is a code name is stale; None when it resolves; False when it is no
    code name (a flag, a command, a file, a value, a plain word)."""
    if match := PATH_NAME.fullmatch(code):
        return check_path_name(match.group(1), match.group(2))
    name = re.sub(r"\([^()]*\)$", "", code)  # `OnlineTraining.state()`, `warm_up(gamma)`
    if SOURCE_FILE.fullmatch(name) or re.fullmatch(r"[\w.]+\.(?:md|toml|json|txt)", name):
        return False
    if DOTTED.fullmatch(name):
        return False if CLASS_ATTRIBUTE.fullmatch(name) else check_dotted(name)  # class.attr: found in the line
    if IDENTIFIER.fullmatch(name) and (re.fullmatch(CAMEL, name) or "_" in name.strip("_")):
        return None if name in index().names else f"{name} is defined nowhere in tidespec/"
    return False


# a class name outside backticks (in the diagrams, in prose): two capitalised humps, `SignalStore`
CLASS_WORD = re.compile(r"(?<![\w.-])[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+(?![\w-])(?!\.\w)")
PROPER_NAMES = frozenset({"EvoSpec", "FastAPI", "LoRA", "LongRoPE", "NoPE", "OpenAI", "OpenMP", "PyTorch", "SmolLM",
                          "SmolLM2", "SmolLM3"})
# the diagrams call objects by their role: `scheduler.admit()`, `engine._plan`, `drafter.propose`
INSTANCES = {"engine": "LLMEngine", "scheduler": "Scheduler", "runner": "ModelRunner", "drafter": "Drafter",
             "policy": "SpeculationPolicy"}
INSTANCE_ATTRIBUTE = re.compile(rf"(?<![\w/.])({'|'.join(INSTANCES)})\.(\w+)")
PRIVATE = re.compile(r"(?<![\w/.])_[a-z]\w*")  # `+- _reuse_prefixes ...`: the engine's step, drawn


def diagram_names(line: Line) -> Iterator[tuple[str, str | None]]:
    """The code names of a line of the diagrams: objects' methods by role, the engine's private steps."""
    for match in INSTANCE_ATTRIBUTE.finditer(line.text):
        cls = INSTANCES[match.group(1)]
        yield match.group(0), None if has_attribute(cls, match.group(2)) else f"{cls} has no attribute {match.group(2)}"
    for match in PRIVATE.finditer(line.text):
        yield match.group(0), None if has_attribute("LLMEngine", match.group(0)) else \
            f"LLMEngine has no attribute {match.group(0)}"


def architecture_code_names() -> Iterator[tuple[Line, str, str | None]]:
    """(line, quoted name, why it is stale or None) for every code name docs/architecture.md quotes:
    ``Class.attribute`` and class names anywhere (prose and the diagrams: ``Eagle3Drafter.load_state``,
    ``SignalStore``), objects' methods and the engine's private steps in the diagrams, and in backticks
    ``module.function``, ``path.py: Name``, identifiers with an underscore and class names."""
    for line in lines_of(ARCHITECTURE):
        for match in CLASS_ATTRIBUTE.finditer(line.text):
            yield line, match.group(0), check_dotted(match.group(0))
        for word in CLASS_WORD.findall(line.prose):
            if word not in PROPER_NAMES:
                yield line, word, None if word in index().classes else f"no class {word} in tidespec/"
        if line.fenced:
            yield from ((line, name, why) for name, why in diagram_names(line))
            continue
        for code in line.spans:
            why = check_code(code)
            if why is not False:
                yield line, code, why


def test_architecture_code_names_resolve() -> None:
    checked = list(architecture_code_names())
    assert len(checked) > 100, f"only {len(checked)} code names found in docs/architecture.md: is the parser broken?"
    stale = [f"{line.where()}: `{name}`: {why}" for line, name, why in checked if why]
    assert not stale, "docs/architecture.md names code that does not exist:\n" + "\n".join(stale)


def module_paragraphs() -> Iterator[tuple[list[Line], str]]:
    """The paragraphs of docs/architecture.md about one module, ``**`llm.py`.** ...``, with that module."""
    lines = lines_of(ARCHITECTURE)
    for i, line in enumerate(lines):
        if match := re.match(r"\*\*`([\w/]+\.py)`\.\*\*", line.text):
            end = next((j for j in range(i, len(lines)) if not lines[j].text.strip()), len(lines))
            yield list(lines[i:end]), match.group(1)


def test_module_paragraphs_name_what_the_module_defines() -> None:
    """In the paragraph about one module, every function name quoted is defined there; one the module
    only imports (a re-export) is named with its home, as `path.py: name`. (Class names there may be
    the types of arguments: `EngineConfig`.)"""
    stale: list[str] = []
    paragraphs = list(module_paragraphs())
    assert paragraphs, "no **`module.py`.** paragraph found in docs/architecture.md"
    for paragraph, path in paragraphs:
        module = module_for_path(path)
        if module is None:
            stale.append(f"{paragraph[0].where()}: `{path}` is not a module of tidespec/")
            continue
        codes = [(line, code) for line in paragraph for code in line.spans]
        homes = {m.group(2) for _, code in codes if (m := PATH_NAME.fullmatch(code))}
        for line, code in codes:
            if not re.fullmatch(r"[a-z_][a-z0-9_]*", code) or code in module.defined or code in homes:
                continue
            home = module.imported.get(code, "").removeprefix("tidespec.").replace(".", "/") + ".py"
            why = (f"{path} only imports it: name its home, `{home}: {code}`" if code in module.imported
                   else f"it is not in {path}")
            stale.append(f"{line.where()}: `{code}`: {why}")
    assert not stale, "docs/architecture.md says a module holds what it does not:\n" + "\n".join(stale)

"""Prompt workloads for the benchmarks: JSONL files -> validated records -> prompt token ids.

Why this exists: a benchmark number means nothing without knowing exactly which prompts, in
which order and with which template produced it. Every benchmark reads prompts through this
module, which accepts any JSONL of the shape described in ``../shared/workloads/README.md``::

    {"id": "code-0001", "domain": "code", "kind": "completion" | "chat", "prompt": "...",
     "source": "...", "license": "...", "system": "..." (optional), "schema": {...} (optional),
     "tools": [...] (optional), "prediction": "..." (optional)}

``completion`` prompts are tokenized as raw text (with the tokenizer's own special tokens,
e.g. Llama's BOS); ``chat`` prompts become one user message wrapped in the model's chat template
with the generation prompt appended. ``system`` (optional) is a text every request of a kind sends
first: a chat's system message, or the text before a completion's prompt (a few-shot block), so a
workload can share a long prefix between requests. ``schema`` (optional) is the JSON schema the
answer must follow (``extraction``: ``bench spec --structured``); ``tools`` (optional, chat) are
OpenAI function tools the chat template shows, whose call the answer is (``tool_use``); ``prediction``
(optional) is the output a client expects, sent as a Predicted Output (``code_edit``: ``bench spec
--predicted``). Order is the file's order;
``limit`` keeps the first N.

The names ``code``, ``chat``, ``code_unseen``, ``drafter_boot``, ``code_extra``, ``zh_chat``,
``multilingual``, ``shared_prefix``, ``extraction`` and ``tool_use`` resolve to small sets shipped in ``tidespec/workloads/`` (a file of that name in the
working directory wins; see its README).

Worked example::

    records = load_workload("code", limit=2)       # the shipped code set, first two records
    prompts = tokenize_workload(records, tokenizer)
    prompts[0].record.id, len(prompts[0].token_ids)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from tidespec.config import ConfigError
from tidespec.files import atomic_write

KINDS = ("completion", "chat")
REQUIRED_KEYS = ("id", "domain", "kind", "prompt")
BUILTIN_WORKLOADS = ("code", "chat", "code_unseen", "drafter_boot", "code_extra", "zh_chat", "multilingual",
                     "shared_prefix", "zh_topics", "ru_topics", "es_topics", "ar_topics", "extraction", "tool_use",
                     "code_edit", "sql_help", "cooking", "home_repair")


class WorkloadError(ConfigError):
    """A workload file cannot be used; the one-line message names the file and line."""


@dataclass(frozen=True)
class WorkloadRecord:
    id: str
    domain: str
    kind: str  # "completion" | "chat"
    prompt: str
    source: str = ""
    license: str = ""
    line: int = 0  # 1-based line in the file it came from
    system: str = ""  # sent before the prompt: a chat's system message, a completion's leading text
    # the JSON schema the answer must follow (a structured-output record: bench spec --structured)
    schema: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    # OpenAI tools the chat template shows (a tool-use record: its answer is a call of one of them)
    tools: list[dict[str, Any]] | None = field(default=None, compare=False, hash=False)
    # the output a client expects back (a Predicted Output: an edit's original file)
    prediction: str | None = None

    def messages(self) -> list[dict[str, str]]:
        """A chat record as OpenAI messages: the system message (when set), then the prompt."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.prompt}]

    @property
    def text(self) -> str:
        """A completion record's whole prompt text: ``system`` then ``prompt``."""
        return self.system + self.prompt


@dataclass(frozen=True)
class Prompt:
    """A record and its token ids as the engine and HF both receive them."""

    record: WorkloadRecord
    token_ids: list[int]


def resolve_workload_path(name_or_path: str | Path) -> Path:
    """A path as given when it exists; else a built-in workload name; else ``WorkloadError``."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if str(name_or_path) in BUILTIN_WORKLOADS:
        shipped = resources.files("tidespec") / "workloads" / f"{name_or_path}.jsonl"
        if shipped.is_file():
            return Path(str(shipped))
        raise WorkloadError(f"built-in workload {name_or_path!r} is missing from the installed package")
    if path.exists():
        raise WorkloadError(f"workload {path} is not a file")
    raise WorkloadError(f"workload {name_or_path} not found (give a JSONL path or one of "
                        f"{', '.join(BUILTIN_WORKLOADS)})")


def parse_record(obj: Any, where: str, line: int) -> WorkloadRecord:
    """Validate one decoded JSON value; ``where`` (``file:line``) prefixes every error."""
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise WorkloadError(f"{where}: missing key(s) {', '.join(missing)}")
    for key in (*REQUIRED_KEYS, "source", "license", "system"):
        if key in obj and not isinstance(obj[key], str):
            raise WorkloadError(f"{where}: {key!r} must be a string, got {type(obj[key]).__name__}")
    if obj["kind"] not in KINDS:
        raise WorkloadError(f"{where}: unknown kind {obj['kind']!r} (expected completion or chat)")
    if not obj["prompt"].strip():
        raise WorkloadError(f"{where}: empty prompt")
    if "schema" in obj and not isinstance(obj["schema"], dict):
        raise WorkloadError(f"{where}: 'schema' must be a JSON schema object, got {type(obj['schema']).__name__}")
    if not isinstance(obj.get("prediction", ""), str):
        raise WorkloadError(f"{where}: 'prediction' must be text, got {type(obj['prediction']).__name__}")
    tools = obj.get("tools")
    if tools is not None and (obj["kind"] != "chat" or not isinstance(tools, list) or not tools or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)):
        raise WorkloadError(f"{where}: 'tools' must be a non-empty list of OpenAI function tools, on a chat record")
    return WorkloadRecord(id=obj["id"], domain=obj["domain"], kind=obj["kind"], prompt=obj["prompt"],
                          source=obj.get("source", ""), license=obj.get("license", ""), line=line,
                          system=obj.get("system", ""), schema=obj.get("schema"), tools=tools,
                          prediction=obj.get("prediction"))


def load_workload(name_or_path: str | Path, limit: int | None = None) -> list[WorkloadRecord]:
    """All records of a workload in file order (blank lines skipped), the first ``limit`` if set.

    Raises ``WorkloadError`` naming the line for bad JSON, a missing key, an unknown kind, an
    empty prompt or a duplicate id, and for a file with no records.
    """
    if limit is not None and limit < 1:
        raise WorkloadError(f"limit must be >= 1, got {limit}")
    path = resolve_workload_path(name_or_path)
    records: list[WorkloadRecord] = []
    seen: dict[str, int] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc}") from None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: bad JSON ({exc.msg} at column {exc.colno})") from None
        rec = parse_record(obj, where, lineno)
        if rec.id in seen:
            raise WorkloadError(f"{where}: duplicate id {rec.id!r} (first on line {seen[rec.id]})")
        seen[rec.id] = lineno
        records.append(rec)
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise WorkloadError(f"workload {path} has no records")
    return records


def workload_texts(names: str) -> list[str]:
    """The prompt texts of comma-separated workloads (names or JSONL paths); none for ``""``."""
    return [r.prompt for name in names.split(",") if name.strip() for r in load_workload(name.strip())]


def write_workload(records: list[WorkloadRecord], path: str | Path) -> None:
    """Write records in this module's JSONL format (``files.atomic_write``: a reader never sees half
    a file, and an existing file is replaced only by a complete one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(json.dumps({"id": r.id, "domain": r.domain, "kind": r.kind, "prompt": r.prompt,
                                           "source": r.source, "license": r.license,
                                           **({"system": r.system} if r.system else {})}, ensure_ascii=False) + "\n"
                               for r in records).encode("utf-8"))


def prompt_token_ids(record: WorkloadRecord, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of one record: raw text for ``completion``, chat template for ``chat``."""
    if record.kind == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise WorkloadError(f"record {record.id!r} (line {record.line}) is a chat prompt but the "
                                "tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(record.messages(), add_generation_prompt=True, tokenize=True,
                                            return_dict=False, tools=record.tools)
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(record.text)]


def tokenize_workload(records: list[WorkloadRecord], tokenizer: PreTrainedTokenizerBase) -> list[Prompt]:
    """Tokenize every record, keeping the order."""
    return [Prompt(record=r, token_ids=prompt_token_ids(r, tokenizer)) for r in records]


def load_prompts(name_or_path: str | Path, tokenizer: PreTrainedTokenizerBase,
                 limit: int | None = None) -> list[Prompt]:
    """``load_workload`` then ``tokenize_workload``."""
    return tokenize_workload(load_workload(name_or_path, limit), tokenizer)


def lengthened(prompts: list[Prompt], length: int) -> list[Prompt]:
    """Each prompt exactly ``length`` tokens: its own tokens last, preceded by the workload's other
    prompts' tokens (the next ones first, cycled) as context, or its last ``length`` tokens when it is
    longer. For prefill at the lengths people send (a 512-token prompt: a document, a chat history)
    from a workload of short ones; the text is a concatenation, the cost is the length's.

    Example: prompts [1, 2], [3], [4, 5, 6] at length 4 -> [5, 6, 1, 2] (context: the others from the
    next one on, [3, 4, 5, 6]), [6, 1, 2, 3] (context [4, 5, 6, 1, 2]), [3, 4, 5, 6]."""
    out = []
    for i, p in enumerate(prompts):
        others = [t for q in prompts[i + 1:] + prompts[:i] for t in q.token_ids] or p.token_ids
        context: list[int] = []
        while len(context) + len(p.token_ids) < length:
            context.extend(others)
        out.append(replace(p, token_ids=(context + p.token_ids)[-length:]))
    return out


def prefix_text(names: str, tokenizer: PreTrainedTokenizerBase, tokens: int) -> str:
    """A text of about ``tokens`` tokens made of the prompts of ``names`` (comma-separated workloads)
    one after another: a long shared system prompt or few-shot block for prefix-caching workloads.

    Example: ``prefix_text("code_extra", tok, 1024)`` -> the first HumanEval prompts of
    ``code_extra``, blank-line separated, cut at the 1,024th token (re-tokenized: within a few tokens)."""
    if tokens < 1:
        raise WorkloadError(f"a shared prefix needs >= 1 token, got {tokens}")
    text, n = "", 0
    for body in workload_texts(names):
        text += body.rstrip() + "\n\n"
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if n >= tokens:
            break
    if n < tokens:
        raise WorkloadError(f"workloads {names!r} hold {n} tokens, fewer than the {tokens} asked for")
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return str(tokenizer.decode(ids)).rstrip() + "\n\n"

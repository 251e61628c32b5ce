"""Training prompts written by the target itself (Magpie self-instruct), as a workload JSONL.

Why this exists: a drafter learns what its target says on the prompts it is trained on, and the
prompts we ship are few (72 chat prompts survive excluding the benchmark's); the shipped head
accepts far less on chat than on code. An aligned chat model, given only its chat template up to
where a user's message starts, writes a user's message: Magpie (Xu et al. 2024, "Magpie:
Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing") builds instruction
sets that way. The queries come from the target's own idea of a user, as many as compute allows,
and no text leaves the machine; the target's answers to them are then captured like any workload's
(``train-drafter --from-workload FILE``).

``synth_prompts`` samples queries in batches through the plain engine, keeps those that ended with
the end of the user's turn (a query cut at ``max_query_tokens`` is dropped), drops near-duplicates
and every query sharing an ``ngram``-word run with a held-out workload (the prompts a benchmark
measures on), and stops at ``count`` queries or after ``max_attempts`` samples (4 x ``count`` by default).

Worked example (SmolLM2's template; the pre-query text ends at ``<|im_start|>user\\n``)::

    pre = pre_query_text(tok)            # '<|im_start|>system\\nYou are ...<|im_end|>\\n<|im_start|>user\\n'
    recs = synth_prompts(model, tok, SynthPromptsConfig(out="runs/q.jsonl", count=2))
    recs[0].prompt                       # e.g. "I'm organizing a wedding ... Do you have any recommendations?"
    write_workload(recs, "runs/q.jsonl")  # workloads.loader: one {"id", "domain", "kind": "chat", ...} per line
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

from tidespec.models.target import TargetModel
from tidespec.online.training.config import SynthPromptsConfig, TrainerConfigError
from tidespec.workloads.loader import Prompt, WorkloadRecord, workload_texts

logger = logging.getLogger(__name__)

_SENTINEL = "\x00tidespec-user-message\x00"


def pre_query_text(tokenizer: Any, system: str | None = None) -> str:
    """The chat template's text up to where a user's message starts (Magpie's pre-query template).

    ``system``: a system message to put first (``None``: whatever the template adds itself)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TrainerConfigError("the target's tokenizer has no chat template; self-instruct needs one")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if _SENTINEL not in text:
        raise TrainerConfigError("the chat template does not place the user's message verbatim; cannot find "
                                 "where a user's turn starts")
    return text[: text.index(_SENTINEL)]


def normalise(text: str) -> str:
    """Lower-case words only: ``"Hi,  there!"`` -> ``"hi there"`` (duplicate and overlap checks)."""
    return " ".join(re.findall(r"\w+", text.lower()))


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Every run of ``n`` words of ``normalise(text)`` (the whole text when it is shorter)."""
    words = normalise(text).split()
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}


class OverlapFilter:
    """Rejects a text that shares an ``n``-word run with any held-out text, or repeats a kept one.

    Example: with ``held=["Write a haiku about the sea at night"]`` and n=5, ``"Please write a haiku
    about the sea"`` is rejected ("write a haiku about the"), ``"Write a limerick"`` passes once and
    is rejected the second time (a duplicate)."""

    def __init__(self, held: Iterable[str], n: int) -> None:
        self.n = n
        self.held: set[tuple[str, ...]] = set()
        for t in held:
            self.held |= word_ngrams(t, n)
        self.seen: set[str] = set()

    def admit(self, text: str) -> bool:
        key = normalise(text)
        if not key or key in self.seen or word_ngrams(text, self.n) & self.held:
            return False
        self.seen.add(key)
        return True


def synth_prompts(model: TargetModel, tokenizer: Any, cfg: SynthPromptsConfig) -> list[WorkloadRecord]:
    """Sample user queries from the target's pre-query template until ``cfg.count`` pass the filters
    (or ``cfg.attempts`` samples were drawn; fewer records are returned then, with a warning)."""
    from tidespec.online.training.distill import bootstrap_engine
    from tidespec.sampling import SamplingParams

    pre = pre_query_text(tokenizer, cfg.system)
    pre_ids = list(tokenizer.encode(pre, add_special_tokens=False))
    gate = OverlapFilter(workload_texts(cfg.exclude_workload), cfg.exclusion_ngram)
    source = WorkloadRecord(id="pre-query", domain=cfg.domain, kind="completion", prompt=pre)
    engine = bootstrap_engine(model, tokenizer, [Prompt(source, pre_ids)], cfg.max_query_tokens, cfg.max_num_seqs)
    source_note = (f"self-instruct (Magpie) by {cfg.model or 'the embedded SmolLM2-135M-Instruct'}, temperature "
                   f"{cfg.temperature}, top-p {cfg.top_p}, seed {cfg.seed}"
                   + (f", system message {cfg.system!r}" if cfg.system else ""))
    kept: list[WorkloadRecord] = []
    drawn = 0
    counts = {"cut": 0, "short": 0, "overlap": 0}
    with tqdm(total=cfg.count, desc="self-instruct", unit="prompt", disable=not cfg.progress, leave=False) as bar:
        while len(kept) < cfg.count and (drawn < cfg.attempts or engine.has_unfinished_requests()):
            while drawn < cfg.attempts and len(engine.seqs) < cfg.max_num_seqs:
                params = SamplingParams(max_tokens=cfg.max_query_tokens, temperature=cfg.temperature,
                                        top_p=cfg.top_p, seed=cfg.seed * 1_000_003 + drawn)
                engine.add_request(pre_ids, params)
                drawn += 1
            for out in engine.step():
                if not out.finished or len(kept) >= cfg.count:
                    continue
                text = tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
                if out.finish_reason != "stop":
                    counts["cut"] += 1
                elif len(text.split()) < cfg.min_words:
                    counts["short"] += 1
                elif not gate.admit(text):
                    counts["overlap"] += 1
                else:
                    kept.append(WorkloadRecord(
                        id=f"{cfg.domain}-{len(kept):05d}", domain=cfg.domain, kind="chat", prompt=text,
                        source=source_note, license="generated by the target model"))
                    bar.update(1)
    for rid in list(engine.seqs):  # queries still in flight once enough were kept
        engine.abort_request(rid)
    logger.info("self-instruct: %d kept of %d sampled (%d cut at %d tokens, %d under %d words, %d duplicate or "
                "overlapping a held-out workload)", len(kept), len(kept) + sum(counts.values()), counts["cut"],
                cfg.max_query_tokens, counts["short"], cfg.min_words, counts["overlap"])
    if len(kept) < cfg.count:
        logger.warning("self-instruct: only %d of %d prompts after %d samples (raise --max-attempts)",
                       len(kept), cfg.count, drawn)
    return kept

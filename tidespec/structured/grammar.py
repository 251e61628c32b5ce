"""Grammars for constrained decoding on llguidance: compiled once per constraint, matched per sequence.

Why llguidance (measured on this project's 2-core CPU with the embedded SmolLM2 tokenizer, 49,152
tokens, a 20-field JSON schema): llguidance 1.9 compiles it in 3 ms and computes a token mask in
22 us on average (p99 152 us), from one 7.6 MB wheel with no dependencies; xgrammar 0.2.9 compiles
in 14 ms and masks in 3 us, but pulls triton (999 MB) and apache-tvm-ffi into the install, and the
install's time counts in ``make test``'s budget. Both can roll a matcher back and report the tokens
a grammar forces; a mask of 22 us is about 0.2 % of a decode step of the embedded model here.

What is hand-written here and why: ``llguidance.torch`` decorates its mask-applying function with
``torch.compile`` when imported, which imports inductor (2.7 s in every process that imports the
engine) and compiles for seconds at first use on a CPU; so its three helpers are redone here:
the bitmask allocated (``torch.full``), filled through the matcher's own
``unsafe_compute_mask_ptr`` (``_fill``), and unpacked into a boolean mask (``_unpack``).

Speculation. A draft tree's rows need the grammar's mask *after* each draft path, so ``masks``
walks the tree depth first, consuming each draft token the grammar allows, filling the mask of
the row after it, and rolling the matcher back on the way up (and in a ``finally``: whatever
happens, the matcher leaves ``masks`` in the state it entered). A draft token the grammar forbids
is never consumed: verification under the mask cannot accept it, so the rows below it are never
read (they stay all-allowed). The committed state advances only in ``advance``, over the tokens
verification emitted.

Worked example (choice ``["yes", "no"]``; ``y``, ``es``, ``no`` single tokens, draft chain ``[y, es]``)::

    m = compiler.matcher(StructuredOutputs(choice=("yes", "no")))
    rows = m.masks([y, es], None)   # [3, V]: row 0 allows {y, no, ...}, row 1 after "y" allows {es, ...},
                                    # row 2 after "yes" allows only EOS; m's state is unchanged
    m.advance([y, es])              # the target accepted both: the committed state is "yes"
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from tidespec.errors import UserError
from tidespec.sampling import StructuredOutputs

# llguidance's JSON options per ``StructuredConfig.json_whitespace``: compact is one line with the
# separators json.dumps writes (the grammar then forces each key with its quotes and separators)
JSON_OPTIONS = {"compact": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
                "flexible": {"whitespace_flexible": True}}
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
MAX_ERROR_CHARS = 300


class GrammarError(UserError, ValueError):
    """A constraint the grammar library refuses; one line, fit for an HTTP 400. ``param``: the
    request field it came from."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _fill(matcher: llguidance.LLMatcher, bits: torch.Tensor, row: int) -> None:
    """The matcher's mask for its next token into row ``row`` of ``bits`` [R, W] int32 (contiguous, CPU)."""
    target = bits[row]  # [W]
    matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask (bit ``t % 32`` of word ``t // 32`` = token t allowed) -> [R, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32)  # [32]
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab].bool()


@dataclass
class MaskClock:
    """Seconds spent computing masks, over every matcher of one compiler (``bench spec --structured``
    reports them as a share of the steps)."""

    seconds: float = 0.0
    rows: int = 0


class GrammarMatcher:
    """One sequence's position in its grammar: masks for verification rows, advanced over emitted tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, width: int, vocab: int, eos_ids: tuple[int, ...],
                 clock: MaskClock | None = None) -> None:
        self._m = matcher
        self._clock = clock if clock is not None else MaskClock()
        self._width = width  # the tokenizer's size in llguidance (>= vocab)
        self.vocab = vocab  # the target's logits width
        self._eos = list(eos_ids)
        self._eos_bits = torch.zeros((width + 31) // 32, dtype=torch.int32)  # [W]: the EOS tokens alone
        for t in eos_ids:
            self._eos_bits[t >> 5] |= torch.tensor(1 << (t & 31), dtype=torch.int64).to(torch.int32)

    def masks(self, tokens: list[int], parents: list[int] | None) -> torch.Tensor:
        """[n + 1, vocab] bool: row 0 the tokens allowed now, row j + 1 those allowed after the path
        to draft token j (``parents`` as ``SeqDraft.parent_indices``; None = a chain). The matcher is
        left as it was."""
        t0 = time.perf_counter()
        n = len(tokens)
        parents = parents if parents is not None else list(range(-1, n - 1))
        kids: list[list[int]] = [[] for _ in range(n + 1)]
        for j, p in enumerate(parents):
            kids[p + 1].append(j)
        bits = torch.full((n + 1, (self._width + 31) // 32), -1, dtype=torch.int32)  # [n + 1, W], all allowed
        eos_only = self._eos_bits
        consumed = 0

        def visit(row: int) -> None:
            nonlocal consumed
            if self._m.is_stopped():
                bits[row] = eos_only
            else:
                _fill(self._m, bits, row)
            for j in kids[row]:
                t = tokens[j]
                if not (int(bits[row, t >> 5]) >> (t & 31)) & 1:
                    continue
                if t in self._eos:  # past an end of sequence a stopped grammar allows only EOS again;
                    bits[j + 1] = eos_only  # not consumed: llguidance's rollback does not count an EOS
                elif self._m.consume_token(t):
                    consumed += 1
                    visit(j + 1)
                    self._m.rollback(1)
                    consumed -= 1

        try:
            visit(0)
        finally:
            if consumed:  # an exception mid-walk: back to the entry state all the same
                self._m.rollback(consumed)
        allowed = _unpack(bits, self.vocab)  # [n + 1, vocab]
        empty = ~allowed.any(-1)  # a matcher in error allows nothing: the request may still end
        if bool(empty.any()):
            allowed[empty.nonzero().flatten().unsqueeze(1), torch.tensor(self._eos)] = True
        self._clock.seconds += time.perf_counter() - t0
        self._clock.rows += n + 1
        return allowed

    def constrain(self, logits: torch.Tensor, tokens: list[int], parents: list[int] | None) -> torch.Tensor:
        """The target's verification rows [n + 1, V] with what the grammar forbids at each row set to
        -inf (a copy): greedy picks the argmax of these, sampling draws from their softmax, exactly as
        plain constrained decoding does at each position. ``tokens``, ``parents``: the draft (``masks``)."""
        allowed = self.masks(tokens, parents).to(logits.device)  # [n + 1, V]
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, tokens: Iterable[int]) -> None:
        """Commit emitted tokens (verification chose each under the mask, so each is allowed); after an
        EOS (``ignore_eos``) the grammar stays stopped and allows EOS alone."""
        for t in tokens:
            if self._m.is_stopped():
                return
            self._m.consume_token(t)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (the only continuation it allows, in the
        tokenizer's canonical tokenization): drafts that cost nothing to propose."""
        if limit <= 0 or self._m.is_stopped():
            return []
        return list(self._m.compute_ff_tokens()[:limit])

    @property
    def finished(self) -> bool:
        return self._m.is_stopped()


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` for one tokenizer, cached by the constraint's text; thread-safe,
    so the server compiles in a worker thread while the engine steps."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab: int, eos_ids: Iterable[int],
                 json_whitespace: str = "compact") -> None:
        self._hf = tokenizer
        self.json_options = JSON_OPTIONS[json_whitespace]  # llguidance's JSON options, for %json in grammars too
        self.vocab = vocab
        self.eos_ids = tuple(sorted(eos_ids))
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at first use (0.5 s for 49k tokens)
        self._tokenizer_error: str | None = None  # why llguidance cannot read the tokenizer, once it failed
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses)
        self.clock = MaskClock()  # mask time of every matcher it made

    def _ll_tokenizer(self, spec: StructuredOutputs) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it, built once; raises ``GrammarError`` for a tokenizer it
        cannot read (one without byte-level tokens, such as a word-level vocabulary)."""
        if self._tokenizer is None:
            if self._tokenizer_error is None:
                try:
                    width = max(self.vocab, len(self._hf))
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=width,
                                                                   eos_token=list(self.eos_ids))
                    return self._tokenizer
                except ValueError as exc:
                    self._tokenizer_error = str(exc)
            raise GrammarError(f"{spec.field}: cannot be enforced: this model's tokenizer cannot run a grammar "
                               f"({self._tokenizer_error})"[:MAX_ERROR_CHARS], spec.field)
        return self._tokenizer

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The compiled grammar of ``spec`` (a matcher at its start); raises ``GrammarError``."""
        key = spec.source
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            tok = self._ll_tokenizer(spec)
        try:
            if key[0] == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(key[1], defaults=self.json_options)
            else:
                grammar = llguidance.grammar_from(*key)
        except ValueError as exc:
            raise GrammarError(self._reason(spec, str(exc)), spec.field) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise GrammarError(self._reason(spec, error), spec.field)
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(self._reason(spec, matcher.get_error()), spec.field)
        with self._lock:
            self.compiles += 1
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A new sequence's matcher for ``spec``; raises ``GrammarError``."""
        template = self.compile(spec)
        with self._lock:
            copy = template.deep_copy()
        return GrammarMatcher(copy, max(self.vocab, len(self._hf)), self.vocab, self.eos_ids, self.clock)

    @staticmethod
    def _reason(spec: StructuredOutputs, error: str) -> str:
        lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
        reason = " ".join(lines[:2]) if lines else "the grammar does not compile"
        return f"{spec.field}: cannot be enforced: {reason}"[:MAX_ERROR_CHARS]

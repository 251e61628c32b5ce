"""Incremental detokenization for streaming.

Why this exists: decoding one token at a time breaks multi-byte characters and SentencePiece /
byte-level merges (a token may be half a UTF-8 character, or change how the previous token
renders). Like vLLM, we re-decode a short window and emit only text that is stable.

Worked example: tokens for "héllo" arrive as [h, \\xc3, \\xa9, llo]; after "\\xc3" the window
decodes to "h\\ufffd" so nothing new is emitted; after "\\xa9" it decodes to "hé" and "é" is
emitted.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_WINDOW = 6  # tokens of left context re-decoded with each new token


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text emitted so far

    def add(self, new_ids: list[int]) -> str:
        """Append token ids; return the newly stable text (may be empty)."""
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._trim()
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At finish: emit whatever remains, even an incomplete character."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        delta = full[len(prefix):]
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def _trim(self) -> None:
        # keep memory bounded: drop ids left of the window we still need
        if self.prefix_offset > 4 * _WINDOW:
            cut = self.prefix_offset
            self.ids = self.ids[cut:]
            self.prefix_offset -= cut
            self.read_offset -= cut

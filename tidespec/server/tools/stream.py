"""Streaming a chat answer that may call tools: text streams as it comes until it could be a call,
then the calls go out as OpenAI streams them once the output is complete.

Why this exists: a client reading a stream must never see the start of a ``<tool_call>`` as
content. Text is held back only while it could still become a call marker (as stop strings are);
once a marker appears the rest is kept until the request finishes, then parsed: each call is one
chunk with its index, id and name (arguments "") and one with its arguments, which is how OpenAI's
stream delivers them and how its SDK and LangChain put them back together. Text that turns out not
to be a call is sent as content at the end.

Worked example (hermes; deltas ``"Let me check. <tool"``, ``"_call>\\n{...}\\n</tool_call>"``)::

    s = ToolStream(HermesParser())
    s.feed("Let me check. <tool")     # -> "Let me check. " (the rest could start a marker)
    s.feed("_call>\\n{...}")          # -> "" (a call has started: held)
    s.finish()                        # -> ("", Parsed(content="Let me check.", calls=[...]))
"""

from __future__ import annotations

from tidespec.structured.tool_calls import Parsed, ToolCallParser


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolStream:
    """One request's stream: ``feed`` each delta (returns the content to send now), then ``finish``."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""  # everything generated so far
        self.sent = 0  # characters of ``text`` sent as content
        self.in_call = False  # a call has started: the rest is held until the end

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_call:
            return ""
        pending = self.text[self.sent:]
        if self.parser.at_start:
            head = self.text.lstrip()
            if not head or any(head.startswith(m) or m.startswith(head) for m in self.parser.markers):
                self.in_call = bool(head)
                return ""
            self.in_call = False
            out, self.sent = pending, len(self.text)
            return out
        hits = [i for i in (pending.find(m) for m in self.parser.markers) if i >= 0]
        if hits:
            self.in_call = True
            cut = min(hits)
        else:
            cut = len(pending) - _partial_marker(pending, self.parser.markers)
        out = pending[:cut]
        self.sent += cut
        return out

    def finish(self) -> tuple[str, Parsed]:
        """(content still to send, the parsed output): the calls, or the held text as content."""
        parsed = self.parser.parse(self.text)
        if parsed.calls:
            return "", parsed
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, Parsed(self.text or None)

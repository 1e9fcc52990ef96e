"""Token ids -> text deltas for streaming, with OpenAI ``stop`` strings.

Each step decodes the whole completion so far and emits what is new: decoding token by token would
break multi-byte characters and the tokenizer's space handling. Text that ends in an unfinished
character (U+FFFD) or that could be the start of a stop string is held back until it is settled.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already emitted
        self.stopped = False  # a stop string was found: the completion ends before it

    def add(self, token_id: int) -> str:
        """Append one token; return the text that can be emitted now."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.stopped = True
                text = text[:at]
        if self.stopped:
            return self._emit(text, len(text))
        end = len(text)
        if text.endswith("\ufffd"):
            end = len(text.rstrip("\ufffd"))
        hold = 0  # a tail that may still grow into a stop string waits
        for s in self.stop:
            hold = max([hold] + [k for k in range(1, min(len(s) - 1, end) + 1) if text[:end].endswith(s[:k])])
        return self._emit(text, end - hold)

    def flush(self) -> str:
        """At the end: whatever was held back (no stop string can complete any more)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._emit(text, len(text))

    def _emit(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out = text[self.sent:end]
        self.sent = end
        return out

"""Token ids -> text deltas for streaming, with OpenAI ``stop`` strings.

Decoding token by token would break multi-byte characters and the tokenizer's space handling, and
decoding the whole completion each step costs O(n) per token (O(n^2) per completion). So each step
decodes a short window: the tokens from ``prefix`` on, against the same window without the new
tokens; the difference is the new text (the incremental detokenizer of TGI and vLLM). Text that
ends in an unfinished character (U+FFFD) waits for the next token; text that could be the start of
a stop string is held back until it is settled.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it are settled text
        self.read = 0  # ids up to here are in self.text
        self.text = ""  # the completion's text so far
        self.sent = 0  # characters of the text already emitted
        self.stopped = False  # a stop string was found: the completion ends before it

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that can be emitted now."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            start = len(self.text)
            self.text += now[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            for s in self.stop:  # only where the new text can complete a stop string
                at = self.text.find(s, max(0, min(start, self.sent) - len(s) + 1))
                if at >= 0:
                    self.stopped = True
                    self.text = self.text[:at]
        if self.stopped:
            return self._emit(len(self.text))
        end = len(self.text)
        hold = 0  # a tail that may still grow into a stop string waits
        for s in self.stop:
            hold = max([hold] + [k for k in range(1, min(len(s) - 1, end) + 1) if self.text.endswith(s[:k])])
        return self._emit(end - hold)

    def flush(self) -> str:
        """At the end: whatever was held back (no stop string can complete any more)."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self.prefix :])[len(self._decode(self.ids[self.prefix : self.read])) :]
        self.text += tail
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out

"""Incremental detokenization with stop strings: text deltas per step, cut exactly before a stop string.

Each step decodes only a short window of the newest tokens (the text of ids[prefix:] minus the text of
ids[prefix:read]), so cost does not grow with the output length, and a byte sequence split across
tokens (an incomplete UTF-8 character decodes to U+FFFD) waits for the token that completes it. While
decoding runs steadily the windows hold one or two ids, so an engine shares a cache of their text
across requests (a decode is a pure function of the ids) and most tokens cost two dictionary lookups.
While the request runs, the last len(longest stop string) - 1 characters are held back, so text that
could still turn into a stop string is never sent: when a stop string appears, the output is cut just
before it and nothing after it was ever emitted.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
SHORT_WINDOW = 2
"""Windows of at most this many ids are looked up in the shared decode cache (a decode is a pure function)."""
CACHE_LIMIT = 1 << 16
"""Entries the shared cache holds before it is emptied and refilled."""


class IncrementalDetokenizer:
    """Per-request detokenization state: the text so far and how much of it has been emitted."""

    def __init__(self, tokenizer, stop: list[str], cache: dict | None = None):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.cache = cache
        """Decoded text of short id windows, shared by every request of one engine (None: always decode)."""
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Append one generated token; True when a stop string appeared (the text is then cut before it)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith(REPLACEMENT):
            return False  # wait for the rest of a multi-byte character
        new = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        old_len = len(self.text)
        self.text += new
        if self.stop:
            window_start = max(old_len - self.hold, 0)
            hits = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
                return True
        return False

    def _decode(self, window: list[int]) -> str:
        """tokenizer.decode(window), from the shared cache for short windows (steady decoding: one or two ids)."""
        if self.cache is None or len(window) > SHORT_WINDOW:
            return self.tokenizer.decode(window)
        key = tuple(window)
        text = self.cache.get(key)
        if text is None:
            if len(self.cache) >= CACHE_LIMIT:
                self.cache.clear()
            text = self.cache[key] = self.tokenizer.decode(window)
        return text

    def flush(self) -> None:
        """At the end: add the text of tokens still waiting for a character's last byte (unless a stop string cut it)."""
        if self.stopped or self.read == len(self.ids):
            return
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        self.text += self.tokenizer.decode(self.ids[self.prefix:])[len(before):]
        self.read = len(self.ids)

    def delta(self, finished: bool) -> str:
        """Text not yet emitted that is safe to emit now (all of it once finished)."""
        end = len(self.text) if finished else max(len(self.text) - self.hold, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

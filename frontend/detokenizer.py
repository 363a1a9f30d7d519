"""Incremental detokenization for streaming: text deltas that never split a UTF-8 character.

Each new token is decoded together with a few tokens before it (tokenizers that drop a word's
leading space at the start of a sequence need that context); the new text is released only once
it no longer ends in U+FFFD, the mark of an incomplete multi-byte character. A run of tokens that
still ends in one after ``MAX_PENDING`` tokens (the model sampled invalid bytes) is released as is.
"""

from __future__ import annotations

from kvpool.frontend.tokenizer import Tokenizer

CONTEXT_TOKENS = 5
MAX_PENDING = 6
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # ids[prefix:read] decoded to the text already released
        self.read = len(self.ids)
        self.text = ""  # everything released so far

    def add(self, token: int) -> str:
        """The text delta ``token`` completes ("" while a character is still incomplete)."""
        self.ids.append(token)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is still held back (at the end of the stream), replacement marks included."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        done = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        pending = len(self.ids) - self.read
        if pending == 0 or (full.endswith(REPLACEMENT) and not final and pending < MAX_PENDING):
            return ""
        delta = full[len(done):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

"""Incremental detokenization with stop strings.

Text is only released once it is stable: a token that ends inside a multi-byte
character decodes to U+FFFD until the next token completes it, and text that could
still become the start of a stop string is held back.

Every new token decodes two short spans, for every running request: at a batch of 64 that is
~130 decodes a step, so they go straight to the fast tokenizer's Rust decoder where
transformers' `decode` would add nothing to its text (no clean-up of spaces), which is a
third of the cost of going through it.
"""
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TextStream:
    tokenizer: object
    stop: list[str]
    ids: list[int] = field(default_factory=list)
    text: str = ""  # all stable text so far (cut at a stop string once one is seen)
    emitted: int = 0  # characters of text already handed out
    stopped: bool = False
    matched: str | None = None  # the stop string that ended the text
    _prefix: int = 0  # ids[_prefix:_read] decode to the tail of text already counted
    _read: int = 0
    _decoder: Callable[[list[int]], str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._decoder = decoder(self.tokenizer)

    def push(self, new_ids: list[int]) -> None:
        if self.stopped:
            return
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if hits:
            i, self.matched = min(hits)
            self.text = self.text[:i]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        """Text not handed out yet that can no longer turn into a stop string."""
        end = len(self.text)
        if not (final or self.stopped) and self.stop:
            end -= max(len(s) for s in self.stop) - 1
        piece = self.text[self.emitted:max(end, self.emitted)]
        self.emitted += len(piece)
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids) if ids else ""


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text as `tokenizer.decode(ids, skip_special_tokens=True)` gives it (module doc)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)

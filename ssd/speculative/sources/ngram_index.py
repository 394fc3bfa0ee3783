"""Where each short n-gram of a token list last occurred: prompt lookup's index, used by
draft-free speculation (ngram.py) and by the draft model's guesses of its own next tokens
(draft_engine.py)."""
from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """For n = 1..n_max, each n-gram of tokens[:seen + 1] that ends before position `seen`, and
    the index just past its latest occurrence (where what followed it starts)."""

    n_max: int
    seen: int = 0
    last: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams that end before position `upto` (what follows each is known)."""
        for end in range(max(self.seen, 1), upto):
            for n in range(1, min(self.n_max, end) + 1):
                self.last[tuple(tokens[end - n:end])] = end
        self.seen = max(self.seen, upto)

    def match(self, tokens: list[int], k: int, n_min: int = 1) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest indexed occurrence of tokens' newest n-gram,
        longest n first, and that n (0: none found, or k = 0)."""
        if k <= 0:
            return [], 0
        for n in range(min(self.n_max, len(tokens) - 1), n_min - 1, -1):
            start = self.last.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return tokens[start:start + k], n
        return [], 0

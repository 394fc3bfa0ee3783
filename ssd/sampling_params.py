import math
from dataclasses import dataclass

from ssd.checks import check_int, is_int, is_number
from ssd.errors import SamplingParamsError

MAX_SEED = 2**64  # torch generators take 64-bit seeds


def _list(value, kind: type, name: str, allowed: str) -> list:
    """None, one item or a list/tuple of items of `kind` (bool is not an int here) as a list."""
    items = [] if value is None else [value] if isinstance(value, kind) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, kind) and not isinstance(x, bool)
                                                        for x in items):
        raise SamplingParamsError(f"{name} must be {allowed}, got {value!r}")
    return list(items)


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1 mean no cut."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        self.stop = _list(self.stop, str, "stop", "a string or a list of strings")
        if "" in self.stop:
            raise SamplingParamsError("stop strings must not be empty: an empty stop string would end "
                                      "generation before the first token")
        self.stop_token_ids = _list(self.stop_token_ids, int, "stop_token_ids", "a list of token ids")
        # Written so that NaN fails every range check.
        if not is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise SamplingParamsError(f"temperature must be >= 0 and finite (0: greedy), got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1] (1: no cut), got {self.top_p!r}")
        check_int("top_k", self.top_k, 0, also="(0: no cut)", error=SamplingParamsError)
        check_int("max_tokens", self.max_tokens, 1, error=SamplingParamsError)
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise SamplingParamsError(f"seed must be None or an integer in 0..2**64-1, got {self.seed!r}")

    @property
    def greedy_decoding(self) -> bool:
        return self.temperature == 0

    @classmethod
    def greedy(cls, **kw) -> "SamplingParams":
        return cls(temperature=0.0, **kw)

    @classmethod
    def creative(cls, **kw) -> "SamplingParams":
        return cls(**{"temperature": 1.0, "top_p": 0.95, **kw})

    @classmethod
    def conservative(cls, **kw) -> "SamplingParams":
        return cls(**{"temperature": 0.3, "top_k": 40, "top_p": 0.9, **kw})

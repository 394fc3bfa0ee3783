from dataclasses import dataclass

from ssd.errors import SamplingParamsError


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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not self.temperature >= 0:  # also rejects NaN
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")

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

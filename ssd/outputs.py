"""What the engine hands back: finished outputs, stream chunks, and their metrics."""
from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # request arrival to first output token
    decode_s: float = 0.0  # first output token to last
    e2e_s: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens after the first over the time after the first."""
        return (self.output_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


@dataclass
class RequestOutput:
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def __getitem__(self, key: str):  # out["text"], as the reference engine's dicts allow
        return getattr(self, key)

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "metrics": self.metrics.as_dict()}


@dataclass
class StreamChunk:
    """New text and tokens from one engine step. The last chunk carries finish_reason
    and metrics; `from_draft[i]` tells whether token_ids[i] was a draft proposal the
    target accepted (always False in AR mode)."""

    text: str
    token_ids: list[int]
    from_draft: list[bool]
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None

import dataclasses
import time
from dataclasses import dataclass, field
from itertools import count

import torch

from ssd.outputs import RequestMetrics, TokenLogprob
from ssd.request.detokenizer import TextStream
from ssd.request.logits_process import LogitsProcessor
from ssd.request.noise import SharedNoise
from ssd.sampling_params import SamplingParams

_ids = count()


@dataclass(eq=False)  # one request is one object: `seq in running` compares identities, not every field
class Sequence:
    """One request: its tokens and its progress (how many of its tokens the target's KV cache
    holds is the cache's to say: PagedKVCache.cached)."""

    prompt: str  # the text the model reads (a chat rendered with the model's chat template)
    token_ids: list[int]  # prompt followed by the output so far
    params: SamplingParams
    detokenizer: TextStream = field(repr=False)  # the output's text
    generator: torch.Generator | None = field(default=None, repr=False)
    # A seeded sampled request's draws under "shared-noise" (ssd/request/noise.py): its tokens
    # are then drawn by it, not by the generator.
    noise: SharedNoise | None = field(default=None, repr=False)
    # Penalties, bias, min_tokens and a constraint (None: the model's logits as they are).
    processor: LogitsProcessor | None = field(default=None, repr=False)
    tools: object | None = field(default=None, repr=False)  # ssd.tools.Tools, read by the API layer (ssd/llm.py)
    # ssd.tools.CallStream where the request has tools whose calls are parsed: its content as it
    # streams, and its calls (ssd/llm.py).
    calls: object | None = field(default=None, repr=False)
    num_prompt_tokens: int = 0
    finish_reason: str | None = None
    # Per output token: where it came from if it was an accepted draft proposal, else None
    # (RequestOutput.sources), and the length of the output's text once it was decoded.
    sources: list[str | None] = field(default_factory=list)
    text_ends: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if params.logprobs is set
    # Per prompt token (the first None), if params.prompt_logprobs is set; filled as prefill runs.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    stats: RequestMetrics = field(default_factory=RequestMetrics)  # speculation counters
    seq_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def output_text(self) -> str:
        return self.detokenizer.text

    @property
    def from_draft(self) -> list[bool]:
        return [s is not None for s in self.sources]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def metrics(self) -> RequestMetrics:
        first, last = self.first_token_at or self.arrival, self.last_token_at or self.arrival
        return dataclasses.replace(
            self.stats, prompt_tokens=self.num_prompt_tokens, output_tokens=len(self.output_ids),
            ttft_s=first - self.arrival, decode_s=last - first, e2e_s=last - self.arrival)

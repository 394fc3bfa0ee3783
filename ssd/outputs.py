"""What the engine hands back: finished outputs, stream chunks, and their metrics."""
from dataclasses import asdict, dataclass, field


@dataclass
class TokenLogprob:
    """An output token's log-probability and the likeliest alternatives at its position
    (SamplingParams.logprobs of them, most likely first), from the model's logits after the
    request's penalties, bias and constraint, before temperature and the top-k/p cuts."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not computed)
    output_tokens: int = 0
    ttft_s: float = 0.0  # request arrival to first output token
    decode_s: float = 0.0  # first output token to last
    e2e_s: float = 0.0
    # Speculative rounds (SD/SSD); zero in AR mode.
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_hist: list[int] = field(default_factory=list)  # [k] = rounds that accepted k drafts
    accepted_by_position: list[int] = field(default_factory=list)  # [i] = rounds accepting draft i+1
    drafted_by_position: list[int] = field(default_factory=list)  # [i] = rounds proposing draft i+1
    k_hist: list[int] = field(default_factory=list)  # [k] = rounds that asked for k drafts (k=0: plain decoding)
    empty_rounds: int = 0  # rounds that asked for drafts and got none (prompt lookup without a match)
    draft_s: float = 0.0  # wall time the target spent getting proposals (SD: drafting; SSD: waiting for the reply)
    verify_s: float = 0.0  # same, of the target's verify passes
    # SSD: each round's speculation came from the cache (hit) or from a backup (miss).
    hits: int = 0
    misses: int = 0
    tokens_on_hit: int = 0  # tokens gained in hit rounds (accepted drafts + the target's token)
    tokens_on_miss: int = 0
    tree_s: float = 0.0  # draft worker: building the speculation cache (glue + fork + tree decode)
    backup_s: float = 0.0  # draft worker: answering misses (jit drafting)
    draft_idle_s: float = 0.0  # draft worker: waiting for the target's next request
    draft_failures: int = 0  # times the draft worker died or timed out and SD took over
    # SD with prompt lookup beside the draft: rounds that proposed the lookup's tokens, and
    # the tokens they gained (accepted lookup tokens + the target's token).
    lookup_rounds: int = 0
    tokens_on_lookup: int = 0
    # SD with branches off the chain (sibling leaves, a head's tree): rows verified beside the
    # drafts, and branch tokens taken (each a token gained over the chain).
    sibling_rows: int = 0
    rescues: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens after the first over the time after the first."""
        return (self.output_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per target verify pass: 1 + accepted drafts (and siblings) per round."""
        return 1 + (self.accepted + self.rescues) / self.rounds if self.rounds else 0.0

    @property
    def mean_k(self) -> float:
        """Draft tokens asked for per round (speculate_k, or auto-K's mean choice)."""
        return sum(k * n for k, n in enumerate(self.k_hist)) / self.rounds if self.rounds else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0

    @property
    def tokens_per_round_hit(self) -> float:
        return self.tokens_on_hit / self.hits if self.hits else 0.0

    @property
    def tokens_per_round_miss(self) -> float:
        return self.tokens_on_miss / self.misses if self.misses else 0.0

    def record(self, r) -> None:
        """One round of the request: r is its record, a Round (ssd/speculative/round.py; not
        imported here, since every layer imports this module)."""
        p, asked, drafted, accepted = r.proposal, r.k, r.drafted, r.accepted
        self.rounds += 1
        self.k_hist.extend([0] * (asked + 1 - len(self.k_hist)))
        self.k_hist[asked] += 1
        self.verify_s += r.times.verify_s
        if asked == 0 and not r.times.draft_s and not r.branches and p.hit is None:
            # A plain step (auto-K's K = 0, most rounds at a batch): nothing else to count.
            self.accepted_hist.extend([0] * (1 - len(self.accepted_hist)))
            self.accepted_hist[0] += 1
            return
        self.empty_rounds += asked > 0 and drafted == 0
        self.drafted += drafted
        self.accepted += accepted
        grow = lambda xs, n: xs.extend([0] * (n - len(xs)))  # noqa: E731
        grow(self.accepted_hist, drafted + 1)
        grow(self.accepted_by_position, drafted)
        grow(self.drafted_by_position, drafted)
        self.accepted_hist[accepted] += 1
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < accepted
        self.draft_s += r.times.draft_s
        self.tree_s += p.tree_s
        self.backup_s += p.backup_s
        self.draft_idle_s += p.idle_s
        self.draft_failures += p.failed_over
        self.sibling_rows += len(r.branches)
        self.rescues += r.rescued
        if p.lookup:
            self.lookup_rounds += 1
            self.tokens_on_lookup += accepted + 1
        if p.hit is not None:  # SSD
            self.hits += p.hit
            self.misses += not p.hit
            if p.hit:
                self.tokens_on_hit += accepted + 1
            else:
                self.tokens_on_miss += accepted + 1

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length, "mean_k": self.mean_k,
                "cache_hit_rate": self.cache_hit_rate, "tokens_per_round_hit": self.tokens_per_round_hit,
                "tokens_per_round_miss": self.tokens_per_round_miss}


@dataclass
class RequestOutput:
    prompt: str  # the text the model read (a chat rendered with the model's chat template)
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", or "tool_calls" (the model called tools)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    from_draft: list[bool] = field(default_factory=list)  # per token: an accepted draft proposal?
    logprobs: list[TokenLogprob] | None = None  # per token, where SamplingParams.logprobs asked for them
    tool_calls: list | None = None  # ssd.tools.ToolCall, where the request had tools and the model called them
    prompt_token_ids: list[int] = field(default_factory=list)
    # Per prompt token (the first None), where SamplingParams.prompt_logprobs asked for them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Per token: where an accepted draft proposal came from ("draft", "head", "lookup", "suffix";
    # DraftSource.kind), None for the target's own tokens.
    sources: list[str | None] = field(default_factory=list)

    def __getitem__(self, key: str):  # out["text"], as the reference engine's dicts allow
        return getattr(self, key)

    def as_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids,
               "finish_reason": self.finish_reason, "metrics": self.metrics.as_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [asdict(lp) for lp in self.logprobs]
        if self.tool_calls:
            out["tool_calls"] = [asdict(c) for c in self.tool_calls]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [lp and asdict(lp) for lp in self.prompt_logprobs]
        return out


@dataclass(frozen=True)
class StepInfo:
    """What one engine step did for one request: a speculative round (or a plain step, K 0)."""

    k: int = 0  # draft tokens asked for
    drafted: int = 0  # proposed
    accepted: int = 0  # of them (and branch tokens) the target kept
    tokens: int = 0  # tokens the request got (accepted ones and the target's own)
    source: str | None = None  # where the drafts came from (DraftSource.kind); None: no drafts asked
    at_s: float = 0.0  # seconds from the request's arrival to this step's tokens


@dataclass
class StreamChunk:
    """What one engine step made for one request: new text and tokens. The last chunk carries
    finish_reason ("stop", "length", "tool_calls", or "error" with `error` set) and metrics;
    `from_draft[i]` tells whether token_ids[i] was a draft proposal the target accepted
    (always False in AR mode), `sources[i]` where it came from (RequestOutput.sources).
    `pieces` cuts `text` by the tokens that wrote it, each piece with its tokens' source
    (None where the request has tools: its text is then the content between calls)."""

    text: str
    token_ids: list[int]
    from_draft: list[bool]
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[TokenLogprob] | None = None  # per token, where SamplingParams.logprobs asked for them
    tool_calls: list | None = None  # the last chunk of a request with tools: its calls (ssd.tools.ToolCall)
    error: str | None = None  # the request failed (the server's engine loop)
    sources: list[str | None] = field(default_factory=list)
    pieces: list[tuple[str, str | None]] | None = None
    step: StepInfo | None = None

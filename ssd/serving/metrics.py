"""The server's Prometheus metrics (GET /metrics), in a registry of its own."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ssd.llm import LLM
from ssd.outputs import RequestMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ssd_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("ssd_request_finish", "Generation requests ended, by reason "
                                "(stop, length, cancelled: the client went away, error)", ["reason"], registry=r)
        self.prompt_tokens = Counter("ssd_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.output_tokens = Counter("ssd_generation_tokens", "Output tokens of finished requests", registry=r)
        self.ttft = Histogram("ssd_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ssd_inter_token_latency_seconds", "Time between output tokens as the client gets "
                             "them (tokens of one speculative round share its gap)", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("ssd_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.rounds = Counter("ssd_spec_rounds", "Speculative rounds (one target verify pass each)", registry=r)
        self.drafted = Counter("ssd_spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("ssd_spec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.hits = Counter("ssd_spec_cache_hits", "SSD rounds whose speculation was in the cache", registry=r)
        self.misses = Counter("ssd_spec_cache_misses", "SSD rounds that needed a backup speculation", registry=r)
        self.acceptance = Gauge("ssd_spec_acceptance_rate", "Accepted / proposed draft tokens, since start",
                                registry=r)
        self.accepted_length = Gauge("ssd_spec_mean_accepted_length", "Tokens per verify pass, since start",
                                     registry=r)
        self.hit_rate = Gauge("ssd_spec_cache_hit_rate", "SSD cache hits / rounds, since start", registry=r)
        self.running = Gauge("ssd_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("ssd_requests_waiting", "Requests waiting for the batch", registry=r)
        self.kv_used = Gauge("ssd_kv_cache_blocks_used", "The target's KV cache blocks held by requests", registry=r)
        self.kv_total = Gauge("ssd_kv_cache_blocks_total", "The target's KV cache blocks", registry=r)
        self.prefix_queries = Counter("ssd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("ssd_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)",
                                   registry=r)
        self.prefix_blocks = Gauge("ssd_prefix_cache_blocks", "The target's KV cache blocks that hold a cached "
                                   "prefix, held by requests or kept for later ones", registry=r)
        self.draft_kv_used = Gauge("ssd_draft_kv_cache_blocks_used", "The SD draft's KV cache blocks held by "
                                   "requests (an SSD worker's are in its own process)", registry=r)
        self.suffix_tokens = Gauge("ssd_suffix_index_tokens", "Tokens of earlier requests held for suffix decoding "
                                   "(bounded by --suffix-tokens)", registry=r)
        self._totals = [0, 0, 0, 0, 0]  # rounds, drafted, accepted, hits, misses

    def engine_state(self, llm: LLM, queued: int) -> None:
        """After each engine step (engine thread)."""
        self.running.set(llm.num_running)
        self.waiting.set(queued)
        self.kv_used.set(llm.kv_blocks_in_use())
        self.kv_total.set(llm.kv_blocks_total)
        self.prefix_blocks.set(llm.kv_blocks_cached())
        self.draft_kv_used.set(llm.draft_kv_blocks_in_use() or 0)
        self.suffix_tokens.set(llm.suffix_index_tokens())

    def request_done(self, m: RequestMetrics, reason: str) -> None:
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        self.prefix_queries.inc(m.prompt_tokens)
        self.prefix_hits.inc(m.cached_tokens)
        self.output_tokens.inc(m.output_tokens)
        if m.output_tokens:
            self.ttft.observe(m.ttft_s)
            self.e2e.observe(m.e2e_s)
        if not m.rounds:
            return
        t = self._totals
        for i, (counter, value) in enumerate(((self.rounds, m.rounds), (self.drafted, m.drafted),
                                              (self.accepted, m.accepted), (self.hits, m.hits),
                                              (self.misses, m.misses))):
            counter.inc(value)
            t[i] += value
        self.acceptance.set(t[2] / t[1] if t[1] else 0.0)
        self.accepted_length.set(1 + t[2] / t[0])
        if t[3] + t[4]:
            self.hit_rate.set(t[3] / (t[3] + t[4]))

    def tokens_arrived(self, gap_s: float, n: int) -> None:
        """n tokens that came together, gap_s after the previous ones."""
        for _ in range(n):
            self.itl.observe(gap_s / n)

    def render(self) -> bytes:
        return generate_latest(self.registry)

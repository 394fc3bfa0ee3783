"""Which sequences run in the next forward pass, and how many of their tokens.

Every step is one forward pass over a token budget: sequences that are decoding feed
their one newest token, and the rest of the budget goes to prompt chunks of sequences
being prefilled (chunked prefill), so long prompts never stall decoding for long.
When the KV cache runs out, the most recently admitted sequence is preempted: everything
held for it is released (registry.py: its blocks, the draft's copy) and it is prefilled
again later from its tokens so far.

With prefix caching, an admitted sequence starts from the cached blocks its tokens begin
with (PagedKVCache.match), and one whose first block is being prefilled for another sequence
waits until that prefill is done, so that n choices of one prompt, or clients arriving
together with one system prompt, compute the shared part once.
"""
from collections import deque
from dataclasses import dataclass

from ssd.engine.registry import Registry
from ssd.request.sequence import Sequence
from ssd.runner.kv_cache import PagedKVCache


@dataclass
class Work:
    seq: Sequence
    start: int  # feed token_ids[start : start + num_new]: start is what the cache holds of seq
    num_new: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the newest token, so a next token is drawn after it."""
        return self.start + self.num_new == self.seq.num_tokens


class Scheduler:
    def __init__(self, cache: PagedKVCache, registry: Registry, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int = 0):
        """registry: where every holder of per-sequence state is, the cache among them."""
        self.cache, self.registry = cache, registry
        self.lookahead = lookahead  # extra slots a decoding sequence needs (K draft tokens in SD)
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Work]:
        while (self.waiting and len(self.running) < self.max_num_seqs
               and self.cache.can_reserve(self.waiting[0].seq_id, self.waiting[0].num_tokens + 1)
               and not self._shares_a_prefill(self.waiting[0])):
            seq = self.waiting.popleft()
            # (Scoring a prompt needs the logits of all its positions: none is read from the cache.)
            cached = self.cache.match(seq.seq_id, seq.token_ids, seq.params.cache_salt,
                                      reuse=seq.params.prompt_logprobs is None)
            if not seq.output_ids:
                seq.stats.cached_tokens = cached
            self.running.append(seq)
        if not self.running and self.waiting:
            seq = self.waiting[0]
            raise RuntimeError(f"KV cache too small for one sequence of {seq.num_tokens} tokens")

        work: list[Work] = []
        budget = self.budget
        for seq in list(self.running):
            if seq not in self.running or seq.num_tokens - self.cache.cached(seq.seq_id) != 1:
                continue
            need = seq.num_tokens + self.lookahead
            while not self.cache.can_reserve(seq.seq_id, need):
                victim = self.running[-1]
                self.preempt(victim)
                work = [w for w in work if w.seq is not victim]
                if victim is seq:
                    break
            if seq in self.running:
                self.cache.reserve(seq.seq_id, need)
                work.append(Work(seq, seq.num_tokens - 1, 1))
                budget -= 1
        for seq in self.running:
            start = self.cache.cached(seq.seq_id)
            remaining = seq.num_tokens - start
            if remaining <= 1 or budget <= 0:
                continue
            n = min(remaining, budget)
            if not self.cache.can_reserve(seq.seq_id, start + n):
                break
            self.cache.reserve(seq.seq_id, start + n)
            work.append(Work(seq, start, n))
            budget -= n
        if not work and len(self.running) > 1:
            # Admitted prompts overcommitted the cache: make room and try again.
            self.preempt(self.running[-1])
            return self.schedule()
        return work

    def _shares_a_prefill(self, seq: Sequence) -> bool:
        """Whether a running sequence is prefilling the first block of seq's tokens."""
        first = self.cache.first_block(seq.token_ids, seq.params.cache_salt)
        return first is not None and any(
            self.cache.cached(s.seq_id) < s.num_tokens - 1
            and self.cache.first_block(s.token_ids, s.params.cache_salt) == first
            for s in self.running)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.commit(seq.seq_id, seq.token_ids)
        self.registry.release(seq.seq_id)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.commit(seq.seq_id, seq.token_ids)
        self.registry.release(seq.seq_id)

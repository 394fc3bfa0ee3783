"""The draft model in synchronous speculative decoding: it proposes K tokens per sequence.

The draft keeps its own paged KV cache. Its first pass of a round feeds every token it
has not seen yet (the whole prompt the first time; after a round where all K drafts
were accepted, the last draft token and the target's bonus token), so it always
catches up; the next K-1 passes feed one proposed token each.
"""
from dataclasses import dataclass

import torch

from ssd.engine.kv_cache import PagedKVCache
from ssd.engine.model_runner import Chunk, ModelRunner
from ssd.engine.sampler import probs_from_logits, sample
from ssd.engine.sequence import Sequence
from ssd.models.decoder import DecoderLM


@dataclass
class Proposal:
    tokens: list[int]  # d_1..d_K
    q: torch.Tensor  # [K, V] the processed draft distributions each d_i was sampled from


class Drafter:
    def __init__(self, model: DecoderLM, cache: PagedKVCache, device: torch.device):
        self.model, self.cache = model, cache
        self.runner = ModelRunner(model, cache, device)
        self.cached: dict[int, int] = {}  # seq_id -> leading tokens whose K/V the draft holds

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """K_b proposals for each sequence b, drawn from the draft's processed distribution."""
        tokens: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(ks)):
            live = [b for b, k in enumerate(ks) if k > step]
            chunks = []
            for b in live:
                seq = seqs[b]
                if step == 0:
                    start = self.cached.get(seq.seq_id, 0)
                    new = seq.token_ids[start:]
                else:
                    start, new = seq.num_tokens + step - 1, [tokens[b][-1]]
                self.cache.reserve(seq.seq_id, start + len(new))
                chunks.append(Chunk(seq.seq_id, new, start, 1))
            logits = self.runner.forward(chunks)
            for row, b in enumerate(live):
                seq = seqs[b]
                q = probs_from_logits(logits[row:row + 1], seq.params)
                d = q.argmax(-1) if seq.params.greedy_decoding else sample(q, seq.generator)
                tokens[b].append(int(d))
                qs[b].append(q[0])
        for seq, k in zip(seqs, ks):  # fed: the sequence and d_1..d_{K-1}
            if k > 0:
                self.cached[seq.seq_id] = seq.num_tokens + k - 1
        vocab = self.model.config.vocab_size
        return [Proposal(t, torch.stack(q) if q else torch.empty(0, vocab)) for t, q in zip(tokens, qs)]

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Only the first num_valid tokens of seq are real (the rest were rejected)."""
        self.cached[seq.seq_id] = min(self.cached.get(seq.seq_id, 0), num_valid)
        self.cache.truncate(seq.seq_id, self.cached[seq.seq_id])

    def release(self, seq: Sequence) -> None:
        self.cached.pop(seq.seq_id, None)
        self.cache.release(seq.seq_id)

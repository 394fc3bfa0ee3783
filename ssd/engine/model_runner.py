"""Packs a step's work into tensors for one forward pass of a model over the paged cache."""
from dataclasses import dataclass

import torch

from ssd.engine.kv_cache import PagedKVCache
from ssd.layers.attention import AttentionBatch
from ssd.models.decoder import DecoderLM


@dataclass
class Chunk:
    """New tokens of one sequence, at positions start.., with logits wanted for the last
    `num_logits` of them."""

    owner: int
    tokens: list[int]
    start: int
    num_logits: int


class ModelRunner:
    def __init__(self, model: DecoderLM, cache: PagedKVCache, device: torch.device):
        self.model, self.cache, self.device = model, cache, device

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits [sum of num_logits, vocab] in chunk order."""
        lengths = [len(c.tokens) for c in chunks]
        input_ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long)
        positions = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(chunks, lengths)])
        slot_mapping = torch.cat([self.cache.slots(c.owner, c.start, c.start + n)
                                  for c, n in zip(chunks, lengths)])
        kv = [self.cache.slots(c.owner, 0, c.start + n) for c, n in zip(chunks, lengths)]
        b, q, s = len(chunks), max(lengths), max(len(x) for x in kv)
        kv_slots = torch.zeros(b, s, dtype=torch.long)
        for i, x in enumerate(kv):
            kv_slots[i, :len(x)] = x

        # Query i of chunk b sits at position start_b + i and sees keys at positions <= it.
        # Padding rows get position 0 (they see key 0 only, so softmax stays finite).
        q_pos = torch.zeros(b, q, dtype=torch.long)
        for i, (c, n) in enumerate(zip(chunks, lengths)):
            q_pos[i, :n] = torch.arange(c.start, c.start + n)
        if b == 1 and q == 1:
            mask, q_index = None, None
        else:
            mask = (torch.arange(s)[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
            q_index = None if b == 1 else torch.cat(
                [torch.arange(n) + i * q for i, n in enumerate(lengths)])

        row_ends = torch.tensor(lengths).cumsum(0)
        logits_index = torch.cat([torch.arange(end - c.num_logits, end)
                                  for c, end in zip(chunks, row_ends.tolist())])
        dev = self.device
        batch = AttentionBatch(
            slot_mapping=slot_mapping.to(dev), kv_slots=kv_slots.to(dev),
            q_index=None if q_index is None else q_index.to(dev), num_queries=q,
            mask=None if mask is None else mask.to(dev))
        return self.model(input_ids.to(dev), positions.to(dev), batch, self.cache.kv,
                          logits_index.to(dev))

"""The tree attention mask of SSD's draft tree, expressed as per-branch rows of KV slots.

B branches fork off one or more sequences. Branch b forks at depth j of its sequence's
speculation: it sees the shared prefix (the sequence's confirmed tokens and the glue tokens
d_1..d_j, all in the sequence's main cache) and, after that, only its own tokens, which live
in K slots of its own. Step i (0-based) feeds each branch's i-th token at position
fork_position + i; the token sees its prefix and its own slots 0..i:

    rows[b] = prefix_slots[b] ++ own_slots[b]        q_len[b] at step i = len(prefix_b) + i + 1

This is the tree mask without materialising it: the attention kernel reads each query's
keys through its row (ssd/layers/attention.py), so branches never see each other.
"""
import torch

from ssd.layers.attention import AttentionBatch


class DraftTree:
    def __init__(self, prefix_slots: list[torch.Tensor], own_slots: torch.Tensor,
                 fork_positions: torch.Tensor, device: torch.device):
        """prefix_slots[b]: cache slots of branch b's prefix (CPU LongTensor); own_slots
        [B, steps]: the slots its own tokens go to; fork_positions [B]: position of its
        first token."""
        b, steps = own_slots.shape
        self.steps = steps
        lens = torch.tensor([len(p) for p in prefix_slots], dtype=torch.long)
        rows = torch.zeros(b, int(lens.max()) + steps, dtype=torch.long)
        for i, p in enumerate(prefix_slots):
            rows[i, :len(p)] = p
            rows[i, len(p):len(p) + steps] = own_slots[i]
        self.rows, self.prefix_len = rows.to(device), lens.to(device)
        self.own_slots, self.fork_positions = own_slots.to(device), fork_positions.to(device)
        self.branch = torch.arange(b, device=device)

    def step(self, i: int, live: torch.Tensor | None = None) -> tuple[torch.Tensor, AttentionBatch]:
        """(positions, attention batch) for step i of the branches in `live` (all if None)."""
        idx = self.branch if live is None else live.to(self.branch.device)
        batch = AttentionBatch(slot_mapping=self.own_slots[idx, i], rows=self.rows,
                               q_row=idx, q_len=self.prefix_len[idx] + i + 1)
        return self.fork_positions[idx] + i, batch

"""SSD's draft tree: its branches' KV slots and the tree attention mask, as per-branch rows of
KV slots.

B branches fork off one or more sequences. Fork (s, j, t) is the outcome "j draft tokens of
s's speculation accepted, then the target's token t": its branch continues that text. It
sees the shared prefix (the sequence's confirmed tokens and the glue tokens d_1..d_j, all in
the sequence's main cache) and, after that, only its own tokens, which live in K slots of
its own (owned in the draft's cache by the sequence's `tree_owner`). Step i (0-based) feeds each
branch's i-th token at position fork_position + i; the token sees its prefix and its own
slots 0..i:

    rows[b] = prefix_slots[b] ++ own_slots[b]        q_len[b] at step i = len(prefix_b) + i + 1

This is the tree mask without materialising it: the attention kernel reads each query's
keys through its row (ssd/layers/attention.py), so branches never see each other.
"""
from collections import Counter
from dataclasses import dataclass

import torch

from ssd.layers.attention import AttentionBatch
from ssd.runner.kv_cache import PagedKVCache
from ssd.speculative.draft.draft_engine import DraftSeq


@dataclass
class Fork:
    seq: DraftSeq
    depth: int  # j: draft tokens of the speculation the branch keeps
    token: int  # t: the target's token it assumes next


class DraftTree:
    def __init__(self, kv: PagedKVCache, forks: list[Fork], steps: int, device: torch.device):
        """Reserves `steps` slots per branch in the draft's cache, each sequence's branches
        under its tree owner (freed by the next round's sync), and lays out the rows."""
        counts = Counter(f.seq.seq_id for f in forks)
        owners = {f.seq.seq_id: f.seq.tree_owner for f in forks}
        own_of: dict[int, torch.Tensor] = {}
        for seq_id, n in counts.items():
            kv.reserve(owners[seq_id], n * steps)
            own_of[seq_id] = kv.slots(owners[seq_id], 0, n * steps).view(n, steps)
        used = Counter()
        own = []
        for f in forks:
            own.append(own_of[f.seq.seq_id][used[f.seq.seq_id]])
            used[f.seq.seq_id] += 1
        # Each branch's prefix is a prefix of one row of its sequence's main slots.
        deepest: dict[int, int] = {}
        for f in forks:
            deepest[f.seq.seq_id] = max(deepest.get(f.seq.seq_id, 0), f.seq.confirmed + f.depth)
        main = {seq_id: kv.slots(seq_id, 0, n) for seq_id, n in deepest.items()}
        lens = torch.tensor([f.seq.confirmed + f.depth for f in forks], dtype=torch.long)
        rows = torch.zeros(len(forks), int(lens.max()) + steps, dtype=torch.long)
        for b, f in enumerate(forks):
            n = int(lens[b])
            rows[b, :n] = main[f.seq.seq_id][:n]
            rows[b, n:n + steps] = own[b]
        self.steps = steps
        self.rows, self.prefix_len = rows.to(device), lens.to(device)
        self.own_slots, self.fork_positions = torch.stack(own).to(device), lens.to(device)
        self.branch = torch.arange(len(forks), device=device)

    def step(self, i: int, live: torch.Tensor | None = None) -> tuple[torch.Tensor, AttentionBatch]:
        """(positions, attention batch) for step i of the branches in `live` (all if None)."""
        idx = self.branch if live is None else live.to(self.branch.device)
        batch = AttentionBatch(slot_mapping=self.own_slots[idx, i], rows=self.rows,
                               q_row=idx, q_len=self.prefix_len[idx] + i + 1)
        return self.fork_positions[idx] + i, batch

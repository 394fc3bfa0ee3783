"""A greedy draft chain's steps as one CUDA graph (ssd/runner/cuda_graphs.py captures one pass):
each step's token is the argmax of the step before, picked on the GPU and fed to the next, so
no step waits for the host to read a token and launch the next pass (docs/kernels.md, "GPU":
what a captured pass a step cost against what its bytes take). Used by an EAGLE-3 head
(ssd/speculative/sources/feature_head.py) and a draft model (ssd/speculative/draft/draft_engine.py)
for greedy requests whose logits nothing changes.

One graph per (bucket of sequences, number of steps). A sequence's step j (0-based) reads its
token at position start + j (and, for a head, the state its step before gave) and attends to
its keys up to there; its K/V go to that position's slot. The chain returns each step's token
(mapped to the target's ids) and its top-1 probability, which the draft's stopping rule reads
afterwards: the rule depends on those alone, so it cuts the chain where it would have stopped
it. On a CPU the same padded static inputs run eagerly (tests).
"""
from collections.abc import Callable

import numpy as np
import torch

from ssd.layers.attention import AttentionBatch
from ssd.runner.cuda_graphs import capture

CHAIN_ROWS = 8  # the most sequences whose chains run as one graph

# step(tokens [b], states [b, H] or None, positions [b], batch) -> (logits [b, V'], next states or None)
Step = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, AttentionBatch],
                tuple[torch.Tensor, torch.Tensor | None]]


class ChainSteps:
    def __init__(self, step: Step, to_target: torch.Tensor | None, kv: torch.Tensor, scratch_slot: int,
                 max_keys: int, buckets: list[int], steps: int, state: tuple[int, torch.dtype] | None = None):
        """to_target: each logits column's target token id (None: the column is the id); kv: the
        cache tensor the steps write (its device is the chain's); state: the width and dtype of
        the state a step hands the next (a head's), None for none (a draft model's)."""
        self.step, self.to_target, self.kv = step, to_target, kv
        self.scratch, self.max_keys = scratch_slot, max_keys
        self.buckets, self.steps = sorted(buckets), steps
        dev, b, pinned = kv.device, self.buckets[-1], kv.is_cuda
        # Rows: the first tokens, then per step the positions, the slots written, the keys read.
        self.host = torch.zeros(1 + 3 * steps, b, dtype=torch.long, pin_memory=pinned)
        self.static = torch.zeros(1 + 3 * steps, b, dtype=torch.long, device=dev)
        self.state = None if state is None else torch.zeros(b, state[0], device=dev, dtype=state[1])
        self.host_rows = torch.zeros(max_keys * b, dtype=torch.int32, pin_memory=pinned)  # key-major, as CapturedSteps'
        self.rows = {n: torch.zeros(max_keys * n, dtype=torch.int32, device=dev) for n in self.buckets}
        self.q_row = torch.arange(b, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, tuple | None]] = {}
        self.pool = None
        self.passes = 0  # chains run through here

    def fits(self, seqs: int, steps: int, keys: int) -> bool:
        return seqs <= self.buckets[-1] and 1 <= steps <= self.steps and keys <= self.max_keys

    def warm_up(self, keys: np.ndarray, state: torch.Tensor | None = None) -> None:
        """Every graph captured now (not in a request's round, whose time auto-K reads as what
        drafting costs), its steps writing the slots `keys` (a throw-away owner's, at least
        self.steps of them)."""
        for rows in self.buckets:
            for steps in range(1, self.steps + 1):
                self.run([0] * rows, None if state is None else state[:rows], [0] * rows, [keys] * rows, steps)

    def run(self, tokens: list[int], states: torch.Tensor | None, starts: list[int], keys: list[np.ndarray],
            steps: int) -> tuple[list[list[int]], list[list[float]]]:
        """tokens: each sequence's token at its `start`; states [n, H]: the state its step reads
        (a head's, else None); keys[i]: sequence i's key slots, positions 0..start + steps - 1
        (its steps' K/V are written to the last `steps` of them, which the caller made
        writable). Returns each sequence's `steps` drafted tokens (target ids) and their top-1
        probabilities; the caller checked fits()."""
        n, s, t = len(tokens), steps, self.steps
        b = next(x for x in self.buckets if x >= n)
        self.passes += 1
        h = self.host.numpy()
        h[:, :b] = 0
        h[0, :n] = tokens
        for i, (start, row) in enumerate(zip(starts, keys)):
            h[1:1 + s, i] = np.arange(start, start + s)  # positions
            h[1 + t:1 + t + s, i] = row[start:start + s]  # slots written
            h[1 + 2 * t:1 + 2 * t + s, i] = np.arange(start + 1, start + s + 1)  # keys read
        h[1 + t:1 + t + s, n:b] = self.scratch  # padding rows: the scratch slot alone
        h[1 + 2 * t:1 + 2 * t + s, n:b] = 1
        width = max(len(row) for row in keys)
        table = self.host_rows.numpy()[:self.max_keys * b].reshape(self.max_keys, b)
        for i, row in enumerate(keys):
            table[:len(row), i] = row
        table[0, n:b] = self.scratch
        if self.state is not None:
            self.state[:n].copy_(states)
            self.state[n:b].zero_()
        self.static.copy_(self.host, non_blocking=True)
        self.rows[b][:width * b].copy_(self.host_rows[:width * b], non_blocking=True)
        key = (b, s)
        if key not in self.graphs:  # its warm-up runs this very chain; the replay below writes the same K/V again
            self.graphs[key] = self._capture(b, s)
        graph, out = self.graphs[key]
        if graph is None:  # a CPU: the padded chain eagerly
            out = self._chain(b, s)
        else:
            graph.replay()
        picked, conf = out
        return picked[:, :n].t().tolist(), conf[:, :n].float().t().tolist()

    def _chain(self, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, t = self.static, self.steps
        rows = self.rows[b].view(self.max_keys, b).t()
        if not rows.is_cuda:  # the CPU kernels take contiguous int64 rows
            rows = rows.contiguous().long()
        token, state, picked, conf = x[0, :b], None if self.state is None else self.state[:b], [], []
        for j in range(s):
            batch = AttentionBatch(x[1 + t + j, :b], rows, self.q_row[:b], x[1 + 2 * t + j, :b])
            logits, state = self.step(token, state, x[1 + j, :b], batch)
            best = logits.argmax(-1)
            conf.append(torch.softmax(logits, -1).gather(-1, best[:, None])[:, 0])
            token = best if self.to_target is None else self.to_target[best]
            picked.append(token)
        return torch.stack(picked), torch.stack(conf)

    def _capture(self, b: int, s: int) -> tuple[torch.cuda.CUDAGraph | None, tuple | None]:
        if not self.kv.is_cuda:
            return None, None
        graph, out = capture(lambda: self._chain(b, s), self.pool)
        self.pool = graph.pool()
        return graph, out

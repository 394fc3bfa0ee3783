"""An EAGLE-3 head's passes as CUDA graphs (ssd/runner/cuda_graphs.py), for FeatureHead on a
GPU: eagerly, one decoder layer launches a few dozen kernels from Python and the GPU waits on
the host between them (on an H200 a drafted token cost 0.68 of an 8B target's step eagerly,
0.13 with each pass captured: bench/results/gpu-h200).

HeadPasses: any one pass (a first pass over the target's states, or one draft step over the
head's own), through CapturedSteps. HeadChain: a greedy chain's draft steps after the first,
S of them in one graph, each step's token picked on the GPU (the argmax, mapped to the
target's id) and fed to the next, so no step waits for the host; it returns every step's
token and top-1 probability, which the draft's stopping rule reads afterwards (the rule
depends on those alone, so it cuts the chain where it would have stopped it).

On a CPU both run the same padded static inputs eagerly (tests): the bits of the eager path,
the CPU kernels being batch-invariant.
"""
import numpy as np
import torch
from torch import nn

from ssd.layers.attention import AttentionBatch
from ssd.speculative.draft.eagle import EagleHead


class HeadPasses(nn.Module):
    """The head as CapturedSteps runs a model: the states a pass reads come from one of two
    static buffers, filled before each launch, the target's joined states (a first pass,
    CapturedSteps' `head` flag True) or the head's own output states (a draft step, False);
    the logits and output states leave as one tensor [T, Vd + H]."""

    def __init__(self, head: EagleHead, rows: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        cfg = head.config
        self.head = head
        self.target = torch.zeros(rows, 3 * cfg.target_hidden_size, device=device, dtype=dtype)
        self.own = torch.zeros(rows, cfg.hidden_size, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor,
                logits_index: torch.Tensor | None, first: bool, taps: tuple[int, ...] = ()) -> torch.Tensor:
        logits, out = self.head(tokens, (self.target if first else self.own)[:len(tokens)], positions, batch, kv)
        both = torch.cat([logits, out], dim=-1)
        return both if logits_index is None else both[logits_index]


class HeadChain:
    """Greedy draft steps of up to `rows` sequences, `steps` at most, as one graph per (bucket
    of sequences, number of steps). A sequence's step j (0-based) reads its token at position
    start + j beside the state before it and attends to its keys up to there."""

    def __init__(self, head: EagleHead, kv: torch.Tensor, scratch_slot: int, max_keys: int, buckets: list[int],
                 steps: int, dtype: torch.dtype):
        self.head, self.kv, self.scratch, self.max_keys = head, kv, scratch_slot, max_keys
        self.buckets, self.steps = sorted(buckets), steps
        dev, b, pinned = kv.device, self.buckets[-1], kv.is_cuda
        # Host side, then device side: the first tokens, positions, slots, key counts ([steps, b]).
        self.host = torch.zeros(1 + 3 * steps, b, dtype=torch.long, pin_memory=pinned)
        self.static = torch.zeros(1 + 3 * steps, b, dtype=torch.long, device=dev)
        self.state = torch.zeros(b, head.config.hidden_size, device=dev, dtype=dtype)
        self.host_rows = torch.zeros(max_keys * b, dtype=torch.int32, pin_memory=pinned)  # key-major, as CapturedSteps'
        self.rows = {n: torch.zeros(max_keys * n, dtype=torch.int32, device=dev) for n in self.buckets}
        self.q_row = torch.arange(b, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, tuple | None]] = {}
        self.pool = None
        self.passes = 0  # chains run through here

    def fits(self, seqs: int, steps: int, keys: int) -> bool:
        return seqs <= self.buckets[-1] and 1 <= steps <= self.steps and keys <= self.max_keys

    def run(self, tokens: list[int], states: torch.Tensor, starts: list[int], keys: list[np.ndarray],
            steps: int) -> tuple[list[list[int]], list[list[float]]]:
        """tokens: each sequence's token at its `start`; states [n, H]: the head's output state of
        the row before it; keys[i]: sequence i's key slots, positions 0..start + steps - 1 (its
        rows' K/V are written to the last `steps` of them). Returns each sequence's `steps`
        drafted tokens (target ids) and their top-1 probabilities; the caller checked fits()."""
        n = len(tokens)
        b = next(x for x in self.buckets if x >= n)
        self.passes += 1
        h, s = self.host.numpy(), steps
        h[:, :b] = 0
        h[0, :n] = tokens
        for i, (start, row) in enumerate(zip(starts, keys)):
            h[1:1 + s, i] = np.arange(start, start + s)  # positions
            h[1 + self.steps:1 + self.steps + s, i] = row[start:start + s]  # slots written
            h[1 + 2 * self.steps:1 + 2 * self.steps + s, i] = np.arange(start + 1, start + s + 1)  # keys read
        h[1 + self.steps:1 + self.steps + s, n:b] = self.scratch  # padding rows: the scratch slot alone
        h[1 + 2 * self.steps:1 + 2 * self.steps + s, n:b] = 1
        width = max(len(row) for row in keys)
        table = self.host_rows.numpy()[:self.max_keys * b].reshape(self.max_keys, b)
        for i, row in enumerate(keys):
            table[:len(row), i] = row
        table[0, n:b] = self.scratch
        self.state[:n].copy_(states)
        self.state[n:b].zero_()
        self.static.copy_(self.host, non_blocking=True)
        self.rows[b][:width * b].copy_(self.host_rows[:width * b], non_blocking=True)
        key = (b, s)
        if key not in self.graphs:
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
        token, state, picked, conf = x[0, :b], self.state[:b], [], []
        for j in range(s):
            batch = AttentionBatch(x[1 + t + j, :b], rows, self.q_row[:b], x[1 + 2 * t + j, :b])
            logits, state = self.head(token, state, x[1 + j, :b], batch, self.kv)
            best = logits.argmax(-1)
            conf.append(torch.softmax(logits, -1).gather(-1, best[:, None])[:, 0])
            token = self.head.draft_to_target[best]
            picked.append(token)
        return torch.stack(picked), torch.stack(conf)

    def _capture(self, b: int, s: int) -> tuple[torch.cuda.CUDAGraph | None, tuple | None]:
        if not self.kv.is_cuda:
            return None, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._chain(b, s)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._chain(b, s)
        self.pool = graph.pool()
        return graph, out

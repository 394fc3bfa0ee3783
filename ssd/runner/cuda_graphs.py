"""CUDA graphs of a model's small forward passes: decode steps, verify passes, draft-tree steps.

Why: eager PyTorch launches a dozen kernels a layer from Python, and at batch 1 the GPU waits
on the host (a few per cent of the memory's rate at batch 1: docs/kernels.md, "GPU"). A graph replays the whole pass in one launch.

A pass of T tokens runs in the graph of the smallest bucket B >= T: its tokens are padded to
B (a padding token writes its K/V to a scratch slot no sequence owns, and sees only that
slot), and its inputs (token ids, positions, slots, attention rows) are written with numpy into
pinned buffers and reach the graph's static inputs in two copies. Longer passes (prompt
chunks) run eagerly.

Exactness: cuBLAS picks its kernel, so its reduction order, by the row count, so a row's
logits depend on the bucket it ran in. The target's smallest bucket is therefore P rows
(EngineConfig.cuda_graph_rows), the next ones 2P, 4P, ... (llm_engine.target_buckets): a
decode step and a verify pass of up to P tokens give each token the same bits, and greedy SD
and SSD equal AR while a pass holds at most P tokens (batch x (K + 1)). The attention kernel
(kernels/attention_triton.py) is batch-invariant at any size. A draft's bits need not match
anything, so its runner gets buckets 1, 2, 4, ...
"""
from __future__ import annotations

import numpy as np
import torch

from ssd.layers.attention import AttentionBatch

INPUTS = 6  # token ids, positions, slots, q_row, q_len, the rows wanted out: P each
WANTED = 5  # the index of the last


def capture(forward, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """forward() captured as a CUDA graph in `pool` (None: a new one): warmed up on a side
    stream first (kernel builds, cuBLAS handles), as torch.cuda.graph asks; returns the graph
    and its static output. thread_local: an SSD worker thread (draft_thread) may run or capture
    its own passes meanwhile; "global" would fail its CUDA calls during this capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward()
    return graph, out


class CapturedSteps:
    def __init__(self, model: torch.nn.Module, kv: torch.Tensor, scratch_slot: int, max_keys: int,
                 buckets: list[int]):
        """kv: the cache tensor the graphs write; max_keys: the widest attention row a pass
        may bring (longer ones run eagerly)."""
        self.model, self.kv, self.scratch = model, kv, scratch_slot
        self.buckets, self.max_keys = sorted(buckets), max_keys
        p = self.rows_max = self.buckets[-1]
        pinned = kv.is_cuda
        self.host = torch.zeros(INPUTS * p, dtype=torch.long, pin_memory=pinned)
        self.static = torch.zeros(INPUTS * p, dtype=torch.long, device=kv.device)
        # The attention rows, int32, key-major ([keys, b] for bucket b): the first w keys of
        # every row are one contiguous run, so a step copies w * b slots, not the widest row's.
        self.host_rows = torch.zeros(max_keys * p, dtype=torch.int32, pin_memory=pinned)
        self.static_rows: dict[int, torch.Tensor] = {}
        # numpy views of the same memory: a numpy write costs a microsecond, torch's several.
        self.host_np, self.host_rows_np = self.host.numpy(), self.host_rows.numpy()
        self.copied = torch.cuda.Event() if kv.is_cuda else None  # the pinned buffers are free again
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.pool = None
        self.failed: str | None = None  # why capture failed (then every pass runs eagerly)
        self.passes = 0  # passes run through here

    def fits(self, tokens: int, rows: int, keys: int) -> bool:
        return self.failed is None and self._bucket(tokens, rows) is not None and keys <= self.max_keys

    def _bucket(self, tokens: int, rows: int) -> int | None:
        """The smallest bucket that holds the tokens and their rows, and a row for the padding
        tokens if there are any."""
        return next((b for b in self.buckets if b >= tokens and (b > rows or b == tokens >= rows)), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
            logits_index: torch.Tensor | None, head: bool, taps: tuple[int, ...] = ()
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The pass's logits (or hidden states) for logits_index (all its tokens if None), and
        with taps the states entering those layers at every token (DecoderLM.forward); the
        caller checked fits(). Inputs on any device (a draft tree keeps its own on the GPU)."""
        t = len(input_ids)
        host = [x.cpu().numpy() for x in (input_ids, positions, batch.slot_mapping, batch.q_row, batch.q_len,
                                          batch.rows)]
        wanted = np.arange(t) if logits_index is None else logits_index.cpu().numpy()
        return self._launch(*host[:5], wanted, host[5], head, taps)

    def run_chunks(self, chunks: list, cache, head: bool, taps: tuple[int, ...] = ()
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """ModelRunner.forward's causal chunks (one attention row each), their slots read from
        the cache's block tables as numpy: the decode step's host work is a few numpy writes."""
        rows = [cache.slot_array(c.owner, c.start + len(c.tokens)) for c in chunks]
        lengths = [len(c.tokens) for c in chunks]
        ends = np.cumsum(lengths)
        pos = np.concatenate([np.arange(c.start, c.start + n) for c, n in zip(chunks, lengths)])
        slots = np.concatenate([row[c.start:] for row, c in zip(rows, chunks)])
        wanted = np.concatenate([np.arange(end - c.num_logits, end) for c, end in zip(chunks, ends)])
        ids = np.fromiter((t for c in chunks for t in c.tokens), dtype=np.int64, count=int(ends[-1]))
        q_row = np.repeat(np.arange(len(chunks)), lengths)
        return self._launch(ids, pos, slots, q_row, pos + 1, wanted, rows, head, taps)

    def _launch(self, ids, pos, slots, q_row, q_len, wanted, rows, head: bool, taps: tuple[int, ...]
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        t, r = len(ids), len(rows)
        b = self._bucket(t, r)
        self.passes += 1
        if self.copied is not None:
            self.copied.synchronize()  # the last pass's copies have left the pinned buffers
        p, h = self.rows_max, self.host_np
        for i, (x, pad) in enumerate(((ids, 0), (pos, 0), (slots, self.scratch), (q_row, r), (q_len, 1))):
            h[i * p:i * p + t] = x
            h[i * p + t:i * p + b] = pad
        h[WANTED * p:WANTED * p + len(wanted)] = wanted
        width = max(len(row) for row in rows)
        table = self.host_rows_np[:self.max_keys * b].reshape(self.max_keys, b)
        for j, row in enumerate(rows):
            table[:len(row), j] = row
        if t < b:
            table[0, r] = self.scratch  # the padding tokens' row
        if b not in self.static_rows:
            self.static_rows[b] = torch.zeros(self.max_keys * b, dtype=torch.int32, device=self.kv.device)
        self.static.copy_(self.host, non_blocking=True)
        self.static_rows[b][:width * b].copy_(self.host_rows[:width * b], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        key = (b, head, taps)
        if key not in self.graphs:  # its warm-up runs this very pass; the replay below writes the same K/V again
            self.graphs[key] = self._capture(b, head, taps)
        graph, out = self.graphs[key]
        if graph is None:  # a CPU, or capture failed: the padded pass eagerly
            out = self._forward(b, head, taps)
        else:
            graph.replay()
        picked = self.static[WANTED * p:WANTED * p + len(wanted)]
        if not taps:
            return out[picked]
        # The states of the pass's own tokens, copied out of the graph's output (the next replay overwrites it).
        return out[0][picked], out[1][:, :t].clone()

    def _views(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        p, x = self.rows_max, self.static
        ids, pos, slots, q_row, q_len = (x[i * p:i * p + b] for i in range(WANTED))
        rows = self.static_rows[b].view(self.max_keys, b).t()  # [b, keys], strided
        if not rows.is_cuda:  # the CPU kernels (tests) take contiguous int64 rows
            rows = rows.contiguous().long()
        return ids, pos, AttentionBatch(slots, rows, q_row, q_len)

    def _forward(self, b: int, head: bool, taps: tuple[int, ...]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ids, pos, batch = self._views(b)
        return self.model(ids, pos, batch, self.kv, None, head, taps)

    def _capture(self, b: int, head: bool, taps: tuple[int, ...]) -> tuple[torch.cuda.CUDAGraph | None, object]:
        if not self.kv.is_cuda:  # a CPU (tests): the same padded static inputs, run eagerly
            return None, None
        try:
            graph, out = capture(lambda: self._forward(b, head, taps), self.pool)
        except RuntimeError as e:  # a host sync inside the model (e.g. a mixture's routing)
            self.failed = f"{type(e).__name__}: {e}".splitlines()[0]
            return None, None
        self.pool = graph.pool()
        return graph, out

"""Packs a step's work into tensors for one forward pass of a model over the paged cache."""
import time
from dataclasses import dataclass, field

import torch

from ssd.errors import SSDError
from ssd.layers.attention import AttentionBatch
from ssd.models.decoder import DecoderLM
from ssd.runner.cuda_graphs import CapturedSteps
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.threads import ThreadChooser


WARM_UP_OWNER = -(1 << 62)  # a cache owner id no sequence or draft tree uses


@dataclass
class Chunk:
    """New tokens of one sequence, at positions start.., with logits wanted for the last
    `num_logits` of them."""

    owner: int
    tokens: list[int]
    start: int
    num_logits: int
    # A tree: the last len(forks) tokens are branches off the chain (the tokens before them);
    # forks[i] is branch i's parent: a chain token's index in `tokens`, or an earlier branch's
    # (chain length + its index). A branch sits one position after its parent and sees its
    # parent's keys and itself (ssd/speculative/policy/siblings.py). Their K/V go to the slots
    # after the chain's.
    forks: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: DecoderLM, cache: PagedKVCache, device: torch.device,
                 graph_buckets: list[int] | None = None, max_keys: int = 0, threads: ThreadChooser | None = None):
        """graph_buckets: passes of up to max(graph_buckets) tokens, whose attention rows hold at
        most max_keys keys, run as CUDA graphs padded to the smallest bucket that holds them
        (cuda_graphs.py); None: every pass eagerly. threads: what chooses the CPU threads of
        each pass (threads.py); None: the process's count."""
        self.model, self.cache, self.device, self.threads = model, cache, device, threads
        if model.tp_group is not None:  # a captured step would not send the other ranks its inputs
            graph_buckets = None
        self.steps = None if not graph_buckets else CapturedSteps(model, cache.kv, cache.scratch_slot(), max_keys,
                                                                  graph_buckets)

    def warm_up(self, head: bool = True, taps: tuple[int, ...] = ()) -> None:
        """Throw-away forward passes: every kernel the model calls is built (or loaded) now, with
        its message on stderr, not inside the first request's time or streamed text; first-call
        allocations happen here too. With captured steps, one pass per bucket, so that each
        bucket's graph (of final hidden states with head=False: a draft's passes) is captured
        now: a capture inside a request's pass holds it up, and auto-K would take that time
        for what drafting costs (SD with auto K drafted nothing while the draft's graphs were
        captured in its first rounds: docs/kernels.md, "GPU")."""
        for rows in self.steps.buckets if self.steps is not None else [1]:
            self.timed_pass(rows, head=head, taps=taps)
        if self.steps is not None:
            # And one eager pass past them (a prompt's chunk, a draft's catch-up), whose kernels
            # Triton may build on first use: a first catch-up that built them, read by auto-K as
            # what every catch-up costs, is the likely reason SD with auto K drafted nothing for
            # its first requests on a GPU (docs/kernels.md, "GPU").
            self.timed_pass(self.steps.buckets[-1] + 1, head=head, taps=taps)
        # The thread count's first trial, on a decode step's pass, before any request's.
        while self.threads is not None and self.threads.trialling:
            self.timed_pass(1, head=head, taps=taps)

    @torch.inference_mode()
    def timed_pass(self, rows: int, repeat: int = 1, head: bool = True, taps: tuple[int, ...] = ()) -> float:
        """Seconds of a throw-away forward pass over `rows` tokens of one sequence, all with
        logits (as a verify pass of rows - 1 drafts; head=False: final hidden states; taps: with
        those layers' states, as a target read by a feature head runs); the fastest of `repeat`
        passes."""
        owner = WARM_UP_OWNER
        self.cache.reserve(owner, rows)
        try:
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                out = self.forward([Chunk(owner, [0] * rows, 0, rows)], head, taps)
                (out[0] if taps else out).cpu()  # .cpu(): waits for a GPU
                best = min(best, time.perf_counter() - t0)
            return best
        finally:
            self.cache.release(owner)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], head: bool = True, taps: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [sum of num_logits, vocab] in chunk order (head=False: final hidden states);
        with taps, also the residual stream entering those layers at every token of the pass,
        [len(taps), tokens, hidden] in chunk order (DecoderLM.forward)."""
        lengths = [len(c.tokens) for c in chunks]
        ends = [c.start + n for c, n in zip(chunks, lengths)]
        for c, end in zip(chunks, ends):
            self.cache.prepare_write(c.owner, c.start, end)
        if self.steps is not None and not any(c.forks for c in chunks) and \
                self.steps.fits(sum(lengths), len(chunks), max(ends)):
            out = self.steps.run_chunks(chunks, self.cache, head, taps)
            for c, end in zip(chunks, ends):
                self.cache.written(c.owner, end)
            return out
        input_ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long)
        kv = [self.cache.slots(c.owner, 0, end) for c, end in zip(chunks, ends)]  # every key, written ones last
        slot_mapping = torch.cat([x[c.start:] for c, x in zip(chunks, kv)])
        # Causal: token i of chunk b sits at position start_b + i and sees keys 0..start_b + i.
        # (Built for the whole batch at once: at a batch of 64 a few ops per chunk are a host cost.)
        sizes = torch.tensor(lengths)
        q_row = torch.repeat_interleave(torch.arange(len(chunks)), sizes)
        first = sizes.cumsum(0) - sizes  # each chunk's first row
        positions = torch.arange(len(input_ids)) + (torch.tensor([c.start for c in chunks]) - first)[q_row]
        q_len = positions + 1
        # A branch sees its parent's keys and, in a row of its own, its own slot.
        at, fork_rows = 0, []
        for c, n, x in zip(chunks, lengths, kv):
            chain = n - len(c.forks)
            branch_keys: list[torch.Tensor] = []
            for i, parent in enumerate(c.forks):
                t = at + chain + i
                keys = x[:c.start + parent + 1] if parent < chain else branch_keys[parent - chain]
                branch_keys.append(torch.cat([keys, x[c.start + chain + i:c.start + chain + i + 1]]))
                positions[t], q_row[t], q_len[t] = len(keys), len(chunks) + len(fork_rows), len(keys) + 1
                fork_rows.append(branch_keys[-1])
            at += n
        kv += fork_rows
        rows = torch.zeros(len(kv), max(len(x) for x in kv), dtype=torch.long)
        for i, x in enumerate(kv):
            rows[i, :len(x)] = x

        # Each chunk's last num_logits rows.
        want = torch.tensor([c.num_logits for c in chunks])
        picked = torch.repeat_interleave(torch.arange(len(chunks)), want)
        logits_index = torch.arange(int(want.sum())) + (first + sizes - want - (want.cumsum(0) - want))[picked]
        batch = AttentionBatch(slot_mapping, rows, q_row, q_len)
        out = self.run(input_ids, positions, batch, logits_index, head, taps)
        for c, n in zip(chunks, lengths):
            self.cache.written(c.owner, c.start + n)
        return out

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
            logits_index: torch.Tensor | None = None, head: bool = True, taps: tuple[int, ...] = ()
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One forward pass over tokens placed by an explicit attention batch (a draft tree)."""
        if self.steps is not None and self.steps.fits(len(input_ids), *batch.rows.shape):
            return self.steps.run(input_ids, positions, batch, logits_index, head, taps)
        if taps and self.model.tp_group is not None:
            raise SSDError("the hidden states of chosen layers (an EAGLE-3 head's features) are not read from a "
                           "tensor-parallel target yet")
        if self.model.tp_group is not None:  # the other ranks run this pass on their shards
            self.model.tp_group.send_pass(input_ids, positions, batch, logits_index, head)
        dev = self.device
        batch = AttentionBatch(*(t.to(dev) for t in (batch.slot_mapping, batch.rows, batch.q_row, batch.q_len)))
        args = (input_ids.to(dev), positions.to(dev), batch, self.cache.kv,
                None if logits_index is None else logits_index.to(dev), head, taps)
        if self.threads is None:
            return self.model(*args)
        n = self.threads.threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        t0 = time.perf_counter()
        out = self.model(*args)  # (on a CPU: done when it returns)
        self.threads.observe(len(input_ids), time.perf_counter() - t0)
        return out

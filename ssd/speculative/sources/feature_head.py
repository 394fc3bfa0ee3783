"""A draft source that reads the target: an EAGLE-3 head (ssd/speculative/draft/eagle.py) in
the target's process, drafting a chain from the target's own hidden states (docs/algorithm.md,
"EAGLE-3 heads").

The head's row at position t reads the token at t + 1 and the state before it: the target's
(its layers' states at t, joined) where the target has run position t, else the head's own
output of the row before. The target's states reach it from every pass the target runs:
prompt chunks and plain steps (`states`), and a round's verify pass, whose rows up to the
accepted drafts stand (`learn`, from the round's record). So a round feeds the head the rows
it has not read with the target's states (one pass), drafts K tokens with its own, and then
drops those draft rows from its KV cache: the next round reads those positions again with
the target's states. Proposals for a sampled request carry the head's distribution (over the
target's vocabulary, 0 outside the head's), so verification stays exact.

As a draft model in this process does, the head gives auto-K what its policies read: each
drafted token's runner-up where the plan asks for sibling leaves (siblings.py), its top-1
probability and a stop where the draft's stopping rule says the next token is not worth its
step (draft_stop.py: depth by the head's confidence, as EAGLE-2 sizes its trees), and its
steps' and catch-up's timings.

Where the plan asks for branches and the request is greedy (with its logits unchanged, no
logprobs), the head grows EAGLE-2's dynamic tree beside its chain: at each depth the chain's
node offers its likeliest other tokens as candidates, and the TREE_EXPAND likeliest
candidates of that depth are expanded in the same head pass as the chain's next row (each a
row of its own that reads its parent's output state and attends to its parent's keys and
itself), offering their likeliest tokens one depth down. Each candidate promises the product
of the head's probabilities along its path; the round takes the ones worth a verify row
(siblings.py) and greedy verification walks the tree. The candidates' rows leave the head's
KV cache with the chain's.

On a GPU the head's passes run as CUDA graphs (head_graphs.py), and a greedy chain's steps
after the first as one graph, its tokens picked on the GPU (ssd/runner/chain_graphs.py).
"""
import time
from dataclasses import dataclass, field, replace

import torch

from ssd.layers.attention import AttentionBatch
from ssd.models.config import ModelConfig
from ssd.request.sampler import probs_from_logits, sample
from ssd.request.sequence import Sequence
from ssd.runner.chain_graphs import CHAIN_ROWS, ChainSteps
from ssd.runner.cuda_graphs import CapturedSteps
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import WARM_UP_OWNER
from ssd.sampling_params import SamplingParams
from ssd.speculative.draft.drafting import Drafting, PassTimes
from ssd.speculative.draft.eagle import EagleHead
from ssd.speculative.plan import SeqPlan
from ssd.speculative.policy.siblings import eligible
from ssd.speculative.records import IN_PROCESS, Alternative, Branch, Proposal, Round, argmax_chain
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.head_graphs import HeadPasses

TREE_WIDTH = 3  # a tree node's likeliest tokens offered below it (the chain's node: its own, then others)
TREE_EXPAND = 3  # candidates expanded a depth (the likeliest of that depth), beside the chain's node
MIN_PROMISE = 1e-3  # a candidate less likely than this is not offered


@dataclass
class HeadSeq:
    """What the head holds of one sequence: its rows in the head's KV cache that read the
    target's states (positions < fed), and the target's states of the positions after them."""

    generator: torch.Generator | None
    fed: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)  # [rows, 3 x Ht] pieces, positions fed.. in order

    @property
    def known(self) -> int:
        """Positions whose target states the head has or holds."""
        return self.fed + sum(len(p) for p in self.pending)


@dataclass
class _Node:
    """One row of a head pass past the first: a token at `position`, reading `state` (its
    parent's output), attending to `keys` (slots, its own last)."""

    token: int
    position: int
    state: torch.Tensor
    keys: torch.Tensor


@dataclass
class _Tree:
    """A greedy sequence's tree as the head grows it (module doc)."""

    start: int  # its newest token's position: the chain's node at depth j is its row at start - 1 + j
    free: int  # the next head KV position for an expanded candidate's row (past the chain's)
    # Candidates: (parent, token, promise); a parent >= 0 is the chain's node at that depth (0:
    # the newest token), -1 - i the candidate i.
    candidates: list[tuple[int, int, float]] = field(default_factory=list)
    # The expanded candidates of the depth: (index, their row's output state, its keys, its logits).
    frontier: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    reach: float = 1.0  # the head's probability of its chain so far

    def branches(self, chain: int) -> list[Branch]:
        """The candidates as branches of a round's tree whose chain has `chain` drafts."""
        return [Branch(p if p >= 0 else chain + 1 + (-1 - p), t, w) for p, t, w in self.candidates]


class FeatureHead(DraftSource):
    kind = "head"

    def __init__(self, head: EagleHead, target_layers: int, cache_tokens: int, block_size: int,
                 device: torch.device, context: int, seed: int | None = None, dtype: torch.dtype = torch.float32,
                 graph_buckets: list[int] | None = None, max_keys: int = 0, chain_steps: int = 0):
        """graph_buckets: the head's passes of up to max(graph_buckets) rows, whose attention
        rows hold at most max_keys keys, run as CUDA graphs (on a CPU: padded, eagerly), and
        with chain_steps greedy chains of up to that many steps after the first (ChainSteps);
        None: every pass eagerly."""
        super().__init__(context)
        cfg = head.config
        self.head, self.device = head, device
        self.capabilities = replace(IN_PROCESS, taps=cfg.target_layers(target_layers))
        shape = ModelConfig("eagle3", cfg.draft_vocab_size, cfg.hidden_size, cfg.intermediate_size, 1,
                            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta,
                            context, False, cfg.attention_bias, cfg.qk_norm)
        self.kv = PagedKVCache(shape, cache_tokens, block_size, device, dtype)
        self.seqs: dict[int, HeadSeq] = {}
        self._seeds = torch.Generator().manual_seed(seed) if seed is not None else torch.Generator()
        if seed is None:
            self._seeds.seed()
        self.passes = self.steps = self.chain = None
        if graph_buckets:
            self.passes = HeadPasses(head, max(graph_buckets), device, dtype)
            self.steps = CapturedSteps(self.passes, self.kv.kv[0], self.kv.scratch_slot(), max_keys, graph_buckets)
            if chain_steps:
                kv = self.kv.kv[0]

                def step(tokens, states, positions, batch):  # one of the head's draft steps
                    return head(tokens, states, positions, batch, kv)
                self.chain = ChainSteps(step, head.draft_to_target, kv, self.kv.scratch_slot(), max_keys,
                                        [b for b in graph_buckets if b <= CHAIN_ROWS], chain_steps,
                                        (cfg.hidden_size, dtype))
            self._warm_up()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Each bucket's graphs captured now, a first pass's and a draft step's, not inside a
        request's rounds (whose time auto-K reads as what drafting costs)."""
        self.kv.reserve(WARM_UP_OWNER, max(self.steps.buckets[-1], self.chain.steps if self.chain else 0))
        try:
            for rows in self.steps.buckets:
                slots = self.kv.slots(WARM_UP_OWNER, 0, rows)
                batch = AttentionBatch(slots, slots.view(1, rows), torch.zeros(rows, dtype=torch.long),
                                       torch.arange(1, rows + 1))
                for first in (True, False):
                    states = (self.passes.target if first else self.passes.own)[:rows]
                    self._head(torch.zeros(rows, dtype=torch.long), states, torch.arange(rows), batch, first)
            if self.chain is not None:
                self.chain.warm_up(self.kv.slot_array(WARM_UP_OWNER, self.chain.steps), self.passes.own)
        finally:
            self.kv.release(WARM_UP_OWNER)

    def states(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        s = self._seq(seq)
        if start != s.known:  # a sequence prefilled again after preemption: start over
            self._forget(seq.seq_id)
            s = self._seq(seq)
            if start != 0:
                return
        s.pending.append(rows)

    def learn(self, rounds: list[Round]) -> None:
        for r in rounds:
            if r.states is not None and r.seq.seq_id in self.seqs:
                self.states(r.seq, r.seq.num_tokens - 1, r.states)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        """Each sequence's unread rows with the target's states, then K draft steps with the
        head's own, all sequences in one head pass a step. The proposals carry the passes'
        timings as a draft model's do (Proposal.step_s, .catchup): a first pass that reads more
        than two rows a sequence (rows missed while K was 0, or many accepted) is catch-up."""
        drafts = [Drafting(p.k if self._ready(s) else 0, p.stop if p.stop is not None and argmax_chain(s) else None)
                  for s, p in zip(seqs, plans)]
        drafting = [b for b, d in enumerate(drafts) if d.k]
        times, cands = PassTimes(), [[] for _ in seqs]
        if drafting:
            # First pass: rows fed..N - 2 of each drafting sequence (N tokens), with the target's
            # states; the last row (the newest token beside the state before it) drafts d_1.
            rows = []
            for b in drafting:
                seq = seqs[b]
                s = self.seqs[seq.seq_id]
                rows.append((seq.seq_id, s.fed, seq.token_ids[s.fed + 1:], torch.cat(s.pending)))
                s.fed, s.pending = seq.num_tokens - 1, []
            t0 = time.perf_counter()
            last = dict(zip(drafting, self._pass(rows)))
            times.timed_pass(time.perf_counter() - t0, [(first, len(ids)) for _, first, ids, _ in rows], 1)
            deepest = max(drafts[b].k for b in drafting)
            trees = {b: _Tree(seqs[b].num_tokens - 1, seqs[b].num_tokens - 1 + deepest) for b in drafting
                     if plans[b].alternatives and argmax_chain(seqs[b]) and eligible(seqs[b])}
            for b, t in trees.items():
                self.kv.reserve(seqs[b].seq_id, t.free + TREE_EXPAND * deepest)
            chain = self.chain is not None and not trees and self.chain.fits(
                len(drafting), deepest - 1, max(seqs[b].num_tokens for b in drafting) - 2 + deepest) and all(
                seqs[b].params.greedy_decoding and not plans[b].alternatives for b in drafting)
            if chain:
                times.step(*self._draft_chains(seqs, drafting, drafts, last))
            for step in range(0 if chain else deepest):
                picked = {}
                for b, (logits, _) in last.items():
                    picked[b] = self._pick(seqs[b], logits, drafts[b], plans[b].alternatives and b not in trees)
                going = [b for b in last if step + 1 < drafts[b].k]
                rows = {b: self._grow(t, seqs[b].seq_id, step, last[b], b in going) for b, t in trees.items()
                        if b in last}
                if not going:
                    break
                # Draft row at position N - 1 + step: the token just drafted beside the head's own state
                # (and the tree's expanded candidates of this depth, each beside its parent's).
                chain = []
                for b in going:
                    owner, at = seqs[b].seq_id, seqs[b].num_tokens - 1 + step
                    self.kv.reserve(owner, at + 1)
                    chain.append(_Node(picked[b], at, last[b][1], self.kv.slots(owner, 0, at + 1)))
                branch = [(b, i, node) for b in going for i, node in rows.get(b, [])]
                t0 = time.perf_counter()
                out = self._node_pass(chain + [node for *_, node in branch])
                times.step(time.perf_counter() - t0, 1)
                for b, node in zip(going, chain):
                    self.kv.written(seqs[b].seq_id, node.position + 1)
                last = dict(zip(going, out))
                for b in trees:
                    trees[b].frontier = []
                for (b, i, node), (logits, state) in zip(branch, out[len(chain):]):
                    trees[b].frontier.append((i, state, node.keys, logits))
            for b in drafting:  # the draft rows go: the next round reads them with the target's states
                self.kv.truncate(seqs[b].seq_id, self.seqs[seqs[b].seq_id].fed)
            for b, t in trees.items():
                cands[b] = t.branches(len(drafts[b].tokens))
        return [d.proposal(times, c) for d, c in zip(drafts, cands)]

    def _draft_chains(self, seqs: list[Sequence], drafting: list[int], drafts: list[Drafting],
                      last: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
        """Greedy chains (ChainSteps): each one's first token from the first pass's
        logits, the rest in one graph of as many steps as the longest asks; the stopping rule
        then cuts each where it would have stopped it. Returns the graph's seconds and steps."""
        for b in drafting:
            self._pick(seqs[b], last[b][0], drafts[b], False)
        going = [b for b in drafting if drafts[b].k > 1]
        if not going:
            return 0.0, 0
        n = max(drafts[b].k for b in going) - 1
        starts = [seqs[b].num_tokens - 1 for b in going]
        for b, start in zip(going, starts):
            self.kv.reserve(seqs[b].seq_id, start + n)
            self.kv.prepare_write(seqs[b].seq_id, start, start + n)
        keys = [self.kv.slot_array(seqs[b].seq_id, start + n) for b, start in zip(going, starts)]
        t0 = time.perf_counter()
        picked, conf = self.chain.run([drafts[b].tokens[-1] for b in going], torch.cat([last[b][1] for b in going]),
                                      starts, keys, n)
        took = time.perf_counter() - t0
        for i, (b, start) in enumerate(zip(going, starts)):
            self.kv.written(seqs[b].seq_id, start + n)
            drafts[b].take_chain(picked[i], conf[i])
        return took, n

    def _grow(self, tree: _Tree, owner: int, step: int, chain: tuple[torch.Tensor, torch.Tensor],
              expand: bool) -> list[tuple[int, _Node]]:
        """One depth of a sequence's tree: the candidates under the chain's node at depth `step`
        (its logits and output state `chain`, the chain's token there already picked: the
        likeliest) and under the expanded candidates of that depth; with `expand`, the rows of
        the likeliest new ones for the next head pass, as (candidate index, row)."""
        ids = self.head.draft_to_target
        start = len(tree.candidates)
        q = torch.softmax(chain[0][0].float(), -1)
        top = q.topk(TREE_WIDTH)
        for p, t in zip(top.values[1:].tolist(), top.indices[1:].tolist()):
            if tree.reach * p >= MIN_PROMISE:
                tree.candidates.append((step, int(ids[t]), tree.reach * p))
        tree.reach *= float(top.values[0])
        for i, _, _, logits in tree.frontier:
            top = torch.softmax(logits[0].float(), -1).topk(TREE_WIDTH)
            for p, t in zip(top.values.tolist(), top.indices.tolist()):
                if tree.candidates[i][2] * p >= MIN_PROMISE:
                    tree.candidates.append((-1 - i, int(ids[t]), tree.candidates[i][2] * p))
        if not expand:
            return []
        new = sorted(range(start, len(tree.candidates)), key=lambda i: -tree.candidates[i][2])[:TREE_EXPAND]
        parents = {i: (state, keys) for i, state, keys, _ in tree.frontier}
        rows = []
        for i in new:
            parent, token, _ = tree.candidates[i]
            if parent >= 0:  # under the chain's node at depth `step`: its row's keys, its output state
                keys, state = self.kv.slots(owner, 0, tree.start + step), chain[1]
            else:
                state, keys = parents[-1 - parent]
            own = self.kv.slots(owner, tree.free, tree.free + 1)
            tree.free += 1
            rows.append((i, _Node(token, tree.start + step, state, torch.cat([keys, own]))))
        return rows

    def _node_pass(self, nodes: list[_Node]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One head pass over single rows, each with its own keys (a chain's next row, a tree's
        expanded candidates); returns each row's logits and output state."""
        table = torch.zeros(len(nodes), max(len(n.keys) for n in nodes), dtype=torch.long)
        for i, n in enumerate(nodes):
            table[i, :len(n.keys)] = n.keys
        batch = AttentionBatch(torch.stack([n.keys[-1] for n in nodes]), table, torch.arange(len(nodes)),
                               torch.tensor([len(n.keys) for n in nodes]))
        logits, out = self._head(torch.tensor([n.token for n in nodes]), torch.cat([n.state for n in nodes]),
                                 torch.tensor([n.position for n in nodes]), batch, first=False)
        return [(logits[i:i + 1], out[i:i + 1]) for i in range(len(nodes))]

    def _head(self, tokens: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
              first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A head pass (first: over the target's states, else the head's own), captured where
        it fits, else eagerly with its host-built inputs on the head's device (a GPU's: the
        states are there). On a GPU it returns when the pass is done, so that its callers'
        timings (auto-K's price of a drafted token) hold the pass, not its launch."""
        dev = self.device
        if self.steps is not None and self.steps.fits(len(tokens), *batch.rows.shape):
            (self.passes.target if first else self.passes.own)[:len(tokens)].copy_(states)
            both = self.steps.run(tokens, positions, batch, None, first)
            out = both.split([self.head.config.draft_vocab_size, self.head.config.hidden_size], dim=-1)
        else:
            batch = AttentionBatch(*(t.to(dev) for t in (batch.slot_mapping, batch.rows, batch.q_row, batch.q_len)))
            out = self.head(tokens.to(dev), states, positions.to(dev), batch, self.kv.kv[0])
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        return out

    def _ready(self, seq: Sequence) -> bool:
        """Whether the head has the target's states of every position before the newest token."""
        s = self.seqs.get(seq.seq_id)
        return s is not None and s.known == seq.num_tokens - 1 and seq.num_tokens >= 2

    def _pass(self, rows: list[tuple[int, int, list[int], torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One head pass over (owner, first position, tokens, input states) per sequence;
        returns each one's last row's logits and output state."""
        tokens = torch.tensor([t for _, _, ids, _ in rows for t in ids], dtype=torch.long)
        positions = torch.cat([torch.arange(start, start + len(ids)) for _, start, ids, _ in rows])
        for owner, start, ids, _ in rows:
            self.kv.reserve(owner, start + len(ids))
        slots = torch.cat([self.kv.writable(owner, start, start + len(ids)) for owner, start, ids, _ in rows])
        keys = [self.kv.slots(owner, 0, start + len(ids)) for owner, start, ids, _ in rows]
        table = torch.zeros(len(keys), max(len(k) for k in keys), dtype=torch.long)
        for i, k in enumerate(keys):
            table[i, :len(k)] = k
        q_row = torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, (_, _, ids, _) in enumerate(rows)])
        batch = AttentionBatch(slots, table, q_row, positions + 1)
        logits, out = self._head(tokens, torch.cat([states for *_, states in rows]), positions, batch, first=True)
        for owner, start, ids, _ in rows:
            self.kv.written(owner, start + len(ids))
        ends = torch.tensor([len(ids) for _, _, ids, _ in rows]).cumsum(0) - 1
        return [(logits[e:e + 1], out[e:e + 1]) for e in ends.tolist()]

    def _pick(self, seq: Sequence, logits: torch.Tensor, d: Drafting, alternative: bool) -> int:
        """The head's next token for seq (argmax, or drawn from its distribution), as a target
        id, taken into its draft `d`; with `alternative` its runner-up too (the likeliest other
        token of the distribution it was picked from: a fair one-hot candidate, siblings.py),
        and where d's stopping rule reads it, its top-1 probability."""
        ids = self.head.draft_to_target
        greedy = seq.params.greedy_decoding
        # A greedy pick needs no distribution unless a policy reads it (runner-up, confidence).
        q = probs_from_logits(logits, seq.params) if not greedy else \
            torch.softmax(logits, -1) if alternative or d.rule is not None else None
        if not greedy:
            whole = torch.zeros(self.head.config.vocab_size, device=q.device)
            whole[ids] = q[0]
            d.qs.append(whole)
        if seq.noise is not None:  # the target's noise on q over the whole vocabulary (noise.py)
            position = seq.num_tokens + len(d.tokens)
            if alternative:
                token, second = seq.noise.ranked(whole, position, 2)
                d.alternatives.append(Alternative(second, float(whole[token]), float(whole[second])))
            else:
                token = seq.noise.choose(whole.unsqueeze(0), [position])[0]
        else:
            picked = logits.argmax(-1) if greedy else sample(q, self.seqs[seq.seq_id].generator)
            if alternative:
                second = q.scatter(-1, picked.view(1, 1), -1.0).argmax(-1)
                d.alternatives.append(Alternative(int(ids[second]), float(q[0, picked]), float(q[0, second])))
            token = int(ids[picked])
        d.tokens.append(token)
        if d.rule is not None:
            d.judge([float(q.amax())])
        return token

    def _seq(self, seq: Sequence) -> HeadSeq:
        s = self.seqs.get(seq.seq_id)
        if s is None:
            s = self.seqs[seq.seq_id] = HeadSeq(self._generator(seq.params))
        return s

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy_decoding:
            return None
        gen = torch.Generator(self.device)
        gen.manual_seed(params.seed ^ 0x5D5D if params.seed is not None else
                        int(torch.randint(2**62, (1,), generator=self._seeds)))
        return gen

    def _forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.kv.release(seq_id)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._forget(seq_id)

    def held(self) -> dict[str, int]:
        return {**super().held(), "head sequences": len(self.seqs),
                **{f"head KV {k}": n for k, n in self.kv.held().items()}}

    def kv_blocks_in_use(self) -> int | None:
        return self.kv.blocks_in_use

"""The draft side of speculative decoding, shared by SD (in the target's process) and SSD
(in the draft worker, on its own hardware).

For each sequence the engine keeps the tokens the target has confirmed, followed by the
speculation it proposed last, and the draft's own paged KV cache. One round:

  step()   apply the target's outcome of the last round (k accepted, then token t), look
           (k, t) up in the speculation cache, and answer with the next K draft tokens:
           the cached ones on a hit; on a miss, drafted on the spot ("jit") or placeholders
           that the target verifies as one-hot proposals ("fast").
  build()  SSD only, while the target verifies what step() returned: a glue decode over
           that speculation gives the draft's distribution at every depth j = 0..K; the
           top-F_j tokens there (d_{j+1} excluded) are the likely outcomes; every outcome
           becomes a branch, and all branches are decoded K tokens deep together, as one
           tree (ssd/spec/tree.py), into the speculation cache (ssd/spec/spec_cache.py).

SD is step() with an always-empty cache and the jit backup.
"""
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ssd.engine.kv_cache import PagedKVCache
from ssd.engine.model_runner import Chunk, ModelRunner
from ssd.engine.sampler import probs_from_logits, sample, saguaro
from ssd.errors import SSDError
from ssd.models.decoder import DecoderLM
from ssd.sampling_params import SamplingParams
from ssd.spec.fanout import MAX_RANK, FanOut
from ssd.spec.spec_cache import Branch, SpeculationCache
from ssd.spec.tree import DraftTree

BACKUPS = ("jit", "fast")


@dataclass
class SpecRequest:
    """The target's word on one sequence at the start of a round."""

    seq_id: int
    num_valid: int  # leading tokens of what the draft holds (confirmed + speculation) that are right
    new_tokens: list[int]  # the target's tokens after those (its recovery/bonus token; a prompt at first)
    k: int  # draft tokens wanted
    params: SamplingParams | None = None  # with a sequence's first request


@dataclass
class SpecReply:
    tokens: list[int]
    q: torch.Tensor | None  # [len(tokens), V] distributions the tokens were drawn from; None: verify one-hot
    hit: bool | None  # the speculation came from the cache; None when no tokens were asked for


@dataclass
class DraftSeq:
    seq_id: int
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # confirmed tokens, then the current speculation
    confirmed: int = 0
    cached: int = 0  # leading tokens whose K/V are in the main cache
    after_hit: bool = False  # the current speculation came from the cache
    candidates: list[list[int]] = field(default_factory=list)  # per depth of the last tree: forks by rank

    @property
    def spec(self) -> list[int]:
        return self.tokens[self.confirmed:]


@dataclass
class BuildStats:
    branches: int = 0
    seconds: float = 0.0


def check_options(backup: str, saguaro_c: float | None) -> None:
    if backup not in BACKUPS:
        raise SSDError(f"backup must be one of {', '.join(BACKUPS)}, got {backup!r}")
    if saguaro_c is not None and not 0 < saguaro_c < 1:
        raise SSDError(f"saguaro_c must be in (0, 1), got {saguaro_c}")


class DraftEngine:
    def __init__(self, model: DecoderLM, device: torch.device, *, k: int, cache_tokens: int,
                 block_size: int = 16, fan_out: FanOut | None = None, backup: str = "jit",
                 saguaro_c: float | None = None, seed: int | None = None):
        check_options(backup, saguaro_c)
        cfg = model.config
        self.k, self.backup, self.saguaro_c, self.device = k, backup, saguaro_c, device
        self.fan_out = fan_out or FanOut(k)
        self.max_len = cfg.max_position_embeddings
        self.vocab = cfg.vocab_size
        self.kv = PagedKVCache(cfg, cache_tokens, block_size, device, next(model.parameters()).dtype)
        self.runner = ModelRunner(model, self.kv, device)
        self.cache = SpeculationCache()
        self.seqs: dict[int, DraftSeq] = {}
        self._pending: list[int] = []  # sequences whose speculation build() should fork from
        self._seeds = torch.Generator().manual_seed(seed) if seed is not None else torch.Generator()
        if seed is None:
            self._seeds.seed()

    # ---- a round ------------------------------------------------------------------------
    def step(self, requests: list[SpecRequest]) -> list[SpecReply]:
        replies: list[SpecReply | None] = []
        misses: list[tuple[int, DraftSeq, int, list[Branch]]] = []
        for i, r in enumerate(requests):
            s, k, branch, same_depth = self._sync(r)
            if k == 0:
                replies.append(SpecReply([], None, None))
            elif branch is not None:
                s.tokens += branch.tokens[:k]
                s.after_hit = True
                replies.append(SpecReply(branch.tokens[:k], None if branch.q_rows is None else torch.stack(branch.q_rows[:k]), True))
            else:
                replies.append(None)
                misses.append((i, s, k, same_depth))
        if misses:
            seqs, ks = [m[1] for m in misses], [m[2] for m in misses]
            if self.backup == "jit":
                drafted = self._draft(seqs, ks)
            else:
                drafted = [self._placeholders(s, k, near) for _, s, k, near in misses]
            for (i, s, _, _), (tokens, q) in zip(misses, drafted):
                s.after_hit = False
                replies[i] = SpecReply(tokens, q, False)
        self._pending = [r.seq_id for r, reply in zip(requests, replies) if reply.tokens]
        return replies

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
            self.cache.drop(seq_id)
            self.kv.release(seq_id)
            self.kv.release(_tree_owner(seq_id))
        self._pending = [i for i in self._pending if i in self.seqs]

    def _sync(self, r: SpecRequest) -> tuple[DraftSeq, int, Branch | None, list[Branch]]:
        """Apply the target's outcome; return the sequence, the tokens it can draft, the
        cache entry for the real outcome (None: a miss) and the entries forked at the same
        depth, most likely first."""
        s = self.seqs.get(r.seq_id)
        if s is None:
            if r.params is None:
                raise SSDError(f"draft protocol: first request for sequence {r.seq_id} carries no params")
            s = self.seqs[r.seq_id] = DraftSeq(r.seq_id, r.params, self._generator(r.params))
        if not 0 <= r.num_valid <= len(s.tokens) or not (r.new_tokens or r.num_valid):
            raise SSDError(f"draft protocol: sequence {r.seq_id} keeps {r.num_valid} of {len(s.tokens)} "
                           f"tokens and adds {len(r.new_tokens)}")
        entries = self.cache.pop_round(r.seq_id)
        branch, same_depth = None, []
        if s.spec and s.confirmed <= r.num_valid and len(r.new_tokens) == 1:
            depth, t = r.num_valid - s.confirmed, r.new_tokens[0]
            branch = entries.get((depth, t))
            same_depth = [b for (j, _), b in entries.items() if j == depth]
            if s.candidates:
                cands = s.candidates[depth]
                self.fan_out.observe(s.after_hit, depth, cands.index(t) if t in cands else None)
        del s.tokens[r.num_valid:]
        s.tokens += r.new_tokens
        s.confirmed = len(s.tokens)
        s.cached = min(s.cached, r.num_valid)
        s.candidates = []
        self.kv.truncate(s.seq_id, s.cached)
        self.kv.release(_tree_owner(s.seq_id))
        # Positions must stay inside the draft's context (drafting token i feeds position len + i - 1).
        k = max(0, min(r.k, self.k, self.max_len - len(s.tokens)))
        return s, k, branch, same_depth

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy_decoding:
            return None
        gen = torch.Generator(self.device)
        if params.seed is not None:  # a seeded request drafts reproducibly too
            gen.manual_seed(params.seed ^ 0x5D5D)
        else:
            gen.manual_seed(int(torch.randint(2**62, (1,), generator=self._seeds)))
        return gen

    # ---- drafting -----------------------------------------------------------------------
    def _draft(self, seqs: list[DraftSeq], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """K_b tokens for each sequence, one batched forward pass per token. The first pass
        feeds whatever the draft has not seen (a prompt, the target's token)."""
        tokens: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(ks)):
            live = [b for b, k in enumerate(ks) if k > step]
            chunks = []
            for b in live:
                s = seqs[b]
                s.cached = min(s.cached, len(s.tokens) - 1)  # feed at least the newest token
                self.kv.reserve(s.seq_id, len(s.tokens))
                chunks.append(Chunk(s.seq_id, s.tokens[s.cached:], s.cached, 1))
                s.cached = len(s.tokens)
            logits = self.runner.forward(chunks)
            picked, q = self._pick(logits, [seqs[b] for b in live], [1] * len(live))
            for row, b in enumerate(live):
                seqs[b].tokens.append(picked[row])
                tokens[b].append(picked[row])
                if q[row] is not None:
                    qs[b].append(q[row][0])
        return [(t, torch.stack(q) if q else None) for t, q in zip(tokens, qs)]

    def _placeholders(self, s: DraftSeq, k: int, same_depth: list[Branch]) -> tuple[list[int], None]:
        """Fast backup: K tokens without a forward pass, verified as one-hot proposals (so
        still exact). The branch forked at the same depth on the most likely token is a
        better guess than noise; with no tree yet, the newest token repeated."""
        tokens = (same_depth[0].tokens if same_depth else [])[:k]
        tokens += [s.tokens[-1]] * (k - len(tokens))
        s.tokens += tokens
        return tokens, None

    def _pick(self, logits: torch.Tensor, seqs: list[DraftSeq], rows: list[int]
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draw one token per logits row; seqs[i] owns the next rows[i] rows. Returns the
        tokens and, per sequence, the distributions drawn from (None for greedy rows)."""
        out, qs, start = [], [], 0
        greedy = logits.argmax(-1).tolist()
        for s, n in zip(seqs, rows):
            if s.params.greedy_decoding:
                out += greedy[start:start + n]
                qs.append(None)
            else:
                q = probs_from_logits(logits[start:start + n], s.params)
                if self.saguaro_c is not None:
                    q = saguaro(q, self.saguaro_c, min(self.fan_out.max_size, MAX_RANK) + 1)
                out += sample(q, s.generator).tolist()
                qs.append(q)
            start += n
        return out, qs

    # ---- the speculation cache (SSD) ----------------------------------------------------
    @torch.inference_mode()
    def build(self) -> BuildStats:
        """Fill the speculation cache for the outcomes of the speculations step() returned."""
        t0 = time.perf_counter()
        seqs = [self.seqs[i] for i in self._pending]
        self._pending = []
        # Branches of sequence s go k_s tokens deep, inside the draft's context.
        depth = {s.seq_id: min(self.k, self.max_len - len(s.tokens)) for s in seqs}
        seqs = [s for s in seqs if depth[s.seq_id] > 0]
        if not seqs:
            return BuildStats()
        forks = self._forks(seqs)
        if not forks:
            return BuildStats()

        # All branches of all sequences decode together: one forward pass per depth.
        owners: dict[int, torch.Tensor] = {}
        counts = Counter(s.seq_id for s, _, _ in forks)
        for s in seqs:
            n = counts[s.seq_id]
            self.kv.reserve(_tree_owner(s.seq_id), n * self.k)
            owners[s.seq_id] = self.kv.slots(_tree_owner(s.seq_id), 0, n * self.k).view(n, self.k)
        own, used = [], {s.seq_id: 0 for s in seqs}
        for s, _, _ in forks:
            own.append(owners[s.seq_id][used[s.seq_id]])
            used[s.seq_id] += 1
        # Each branch attends to its sequence's confirmed tokens and j more: prefixes of one index.
        deepest: dict[int, int] = {}
        for s, j, _ in forks:
            deepest[s.seq_id] = max(deepest.get(s.seq_id, 0), s.confirmed + j)
        prefix = {sid: self.kv.slots(sid, 0, n) for sid, n in deepest.items()}
        tree = DraftTree([prefix[s.seq_id][:s.confirmed + j] for s, j, _ in forks],
                         torch.stack(own), torch.tensor([s.confirmed + j for s, j, _ in forks]), self.device)
        inputs = torch.tensor([t for _, _, t in forks], device=self.device)
        tokens: list[list[int]] = [[] for _ in forks]
        qs: list[list[torch.Tensor]] = [[] for _ in forks]
        for i in range(self.k):
            live = [b for b, (s, _, _) in enumerate(forks) if depth[s.seq_id] > i]
            if not live:
                break
            live_t = torch.tensor(live, device=self.device)
            positions, batch = tree.step(i, live_t)
            logits = self.runner.run(inputs[live_t], positions, batch)
            groups = _runs([forks[b][0] for b in live])
            picked, q = self._pick(logits, [s for s, _ in groups], [n for _, n in groups])
            inputs[live_t] = torch.tensor(picked, device=self.device)
            row = 0
            for (s, n), qg in zip(groups, q):
                for r in range(n):
                    b = live[row + r]
                    tokens[b].append(picked[row + r])
                    if qg is not None:
                        qs[b].append(qg[r])
                row += n
        for b, (s, j, t) in enumerate(forks):
            self.cache.put(s.seq_id, j, t, Branch(tokens[b], qs[b] or None))
        return BuildStats(len(forks), time.perf_counter() - t0)

    def _forks(self, seqs: list[DraftSeq]) -> list[tuple[DraftSeq, int, int]]:
        """Glue decode over each speculation, then the fork tokens per depth: (seq, j, t)."""
        chunks = []
        for s in seqs:
            s.cached = min(s.cached, s.confirmed - 1)  # re-feed from the target's newest token
            self.kv.truncate(s.seq_id, s.cached)
            self.kv.reserve(s.seq_id, len(s.tokens))
            chunks.append(Chunk(s.seq_id, s.tokens[s.cached:], s.cached, len(s.spec) + 1))
            s.cached = len(s.tokens)
        logits = self.runner.forward(chunks)
        forks, row = [], 0
        for s in seqs:
            spec, n = s.spec, len(s.spec) + 1
            rows = logits[row:row + n]
            row += n
            if not s.params.greedy_decoding:
                rows = probs_from_logits(rows, s.params)
            sizes = self.fan_out.sizes(n, s.after_hit)
            top = rows.topk(min(MAX_RANK + 1, rows.shape[-1]), dim=-1).indices.tolist()
            s.candidates = [[t for t in top[j] if j == n - 1 or t != spec[j]][:MAX_RANK] for j in range(n)]
            forks += [(s, j, t) for j in range(n) for t in s.candidates[j][:sizes[j]]]
        return forks


def _tree_owner(seq_id: int) -> int:
    """The KV-cache owner id of a sequence's tree slots (main slots use the sequence id)."""
    return -1 - seq_id


def _runs(seqs: list[DraftSeq]) -> list[tuple[DraftSeq, int]]:
    """Consecutive equal sequences as (seq, count)."""
    out: list[tuple[DraftSeq, int]] = []
    for s in seqs:
        if out and out[-1][0] is s:
            out[-1] = (s, out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out

"""SSD's draft side, run by the draft worker on its own hardware:

  step()   apply the target's outcome of the last round (k accepted, then token t), look
           (k, t) up in the speculation cache (spec_cache.py), and answer with the next K
           draft tokens: the cached ones on a hit; on a miss, drafted on the spot ("jit")
           or placeholders that the target verifies as one-hot proposals ("fast").
  build()  while the target verifies what step() returned: a glue decode over that
           speculation gives the draft's distribution at every depth j = 0..K; the top-F_j
           tokens there (d_{j+1} excluded) are the likely outcomes (fanout.py); every
           outcome becomes a branch, and all branches are decoded K tokens deep together, as
           one tree (tree.py), into the speculation cache.
"""
import time
from collections import Counter

import torch

from ssd.request.sampler import probs_from_logits
from ssd.speculative.draft.draft_engine import DraftEngine, DraftSeq
from ssd.speculative.draft.fanout import MAX_RANK, FanOut
from ssd.speculative.draft.spec_cache import Branch, Lookup
from ssd.speculative.draft.tree import DraftTree, Fork
from ssd.speculative.link.protocol import SpecRequest
from ssd.speculative.options import DraftConfig
from ssd.speculative.records import Proposal, round_k


class SSDDraft:
    def __init__(self, engine: DraftEngine, fan_out: FanOut, backup: str = "jit", fit_tree: bool = True):
        self.engine, self.fan_out, self.backup, self.fit_tree = engine, fan_out, backup, fit_tree
        self._pending: list[int] = []  # sequences whose speculation build() forks from
        self._built: tuple[int, float] | None = None  # the last build's branches and seconds

    @classmethod
    def from_config(cls, cfg: DraftConfig, device: torch.device) -> "SSDDraft":
        fan_out = FanOut(cfg.k_max, cfg.fan_out, cfg.fan_out_miss, cfg.tree_budget)
        # Saguaro scales the draft's top tokens: as many as the tree can fork on, and one more.
        saguaro = None if cfg.saguaro_c is None else (cfg.saguaro_c, min(fan_out.max_size, MAX_RANK) + 1)
        return cls(DraftEngine.from_config(cfg, device, saguaro), fan_out, cfg.backup, cfg.fit_tree)

    def step(self, requests: list[SpecRequest]) -> list[Proposal]:
        engine = self.engine
        replies: list[Proposal | None] = []
        misses: list[tuple[int, DraftSeq, int, list[Branch]]] = []
        for i, r in enumerate(requests):
            known = engine.seqs.get(r.seq_id)
            end = known.outcome(r.num_valid, r.new_tokens) if known else None
            if end is not None and known.candidates:
                self._observe(known, *end)
            found = known.speculations.lookup(end) if known else Lookup(None, [])
            s = engine.sync(r.seq_id, r.num_valid, r.new_tokens, r.params, r.k)
            engine.kv.release(s.tree_owner)  # last round's branches
            k = r.k
            if k == 0:
                replies.append(Proposal([]))
            elif found.branch is not None:
                tokens = found.branch.tokens[:k]
                s.tokens += tokens
                s.after_hit = True
                q = None if found.branch.q_rows is None else torch.stack(found.branch.q_rows[:k])
                replies.append(Proposal(tokens, q, True))
            else:
                replies.append(None)
                misses.append((i, s, k, found.same_depth))
        if misses:
            start = time.perf_counter()
            seqs, ks = [m[1] for m in misses], [m[2] for m in misses]
            if self.backup == "jit":
                drafted = [(p.tokens, p.q) for p in engine.draft(seqs, ks)]
            else:
                drafted = [self._placeholders(s, k, near) for _, s, k, near in misses]
            seconds = time.perf_counter() - start
            for (i, s, k, _), (tokens, q) in zip(misses, drafted):
                s.after_hit = False
                replies[i] = Proposal(tokens, q, False, backup_s=seconds * k / sum(ks))
        self._pending = [r.seq_id for r, reply in zip(requests, replies) if reply.tokens]
        return replies

    def _observe(self, s: DraftSeq, depth: int, token: int) -> None:
        """The fan-out learns where s's round ended and how the tree had ranked the target's token."""
        candidates = s.candidates[depth]
        self.fan_out.observe(s.after_hit, depth, candidates.index(token) if token in candidates else None)

    def fit_tree_to(self, wait_s: float) -> None:
        """The target's request came wait_s after the last build ended (about 0: the target had
        waited for the build): the fan-out fits the next trees to the target's verification."""
        built, self._built = self._built, None
        if built is not None and self.fit_tree:
            self.fan_out.fit(*built, wait_s)

    def release(self, seq_id: int) -> None:
        self.engine.release(seq_id)
        self._pending = [i for i in self._pending if i != seq_id]

    def held(self) -> dict[str, int]:
        """What the worker holds per sequence (the worker link's "held" message)."""
        return {**self.engine.held(), "tree builds pending": len(self._pending)}

    @staticmethod
    def _placeholders(s: DraftSeq, k: int, same_depth: list[Branch]) -> tuple[list[int], None]:
        """Fast backup: K tokens without a forward pass, verified as one-hot proposals (so
        still exact). The branch forked at the same depth on the most likely token is a
        better guess than noise; with no tree yet, the newest token repeated."""
        tokens = (same_depth[0].tokens if same_depth else [])[:k]
        tokens += [s.tokens[-1]] * (k - len(tokens))
        s.tokens += tokens
        return tokens, None

    @torch.inference_mode()
    def build(self) -> dict[int, float]:
        """Fill the speculation cache for the outcomes of the speculations step() returned.
        Returns each sequence's share of the build time (by its number of branches)."""
        start = time.perf_counter()
        engine = self.engine
        seqs = [engine.seqs[i] for i in self._pending]
        self._pending = []
        # Branches of sequence s go k_s tokens deep, inside the draft's context.
        depth = {s.seq_id: round_k(engine.k_max, len(s.tokens), engine.max_len) for s in seqs}
        seqs = [s for s in seqs if depth[s.seq_id] > 0]
        forks = self._forks(seqs) if seqs else []
        if not forks:
            return {}
        tree = DraftTree(engine.kv, forks, engine.k_max, engine.device)
        # All branches of all sequences decode together: one forward pass per depth.
        inputs = torch.tensor([f.token for f in forks], device=engine.device)
        tokens: list[list[int]] = [[] for _ in forks]
        qs: list[list[torch.Tensor]] = [[] for _ in forks]
        for i in range(engine.k_max):
            live = [b for b, f in enumerate(forks) if depth[f.seq.seq_id] > i]
            if not live:
                break
            live_t = torch.tensor(live, device=engine.device)
            positions, batch = tree.step(i, live_t)
            hidden = engine.runner.run(inputs[live_t], positions, batch, head=False)
            groups = _runs([forks[b].seq for b in live])
            # (A branch's row drafts the position after its fork's token and the steps before.)
            at = [forks[b].seq.offset + forks[b].seq.confirmed + forks[b].depth + 1 + i for b in live]
            picked, q, _, _ = engine.pick(hidden, [s for s, _ in groups], [n for _, n in groups], positions=at)
            inputs[live_t] = torch.tensor(picked, device=engine.device)
            row = 0
            for (_, n), q_group in zip(groups, q):
                for r in range(n):
                    b = live[row + r]
                    tokens[b].append(picked[row + r])
                    if q_group is not None:
                        qs[b].append(q_group[r])
                row += n
        for b, f in enumerate(forks):
            f.seq.speculations.put(f.depth, f.token, Branch(tokens[b], qs[b] or None))
        seconds = time.perf_counter() - start
        self._built = (len(forks), seconds)
        counts = Counter(f.seq.seq_id for f in forks)
        return {seq_id: seconds * n / len(forks) for seq_id, n in counts.items()}

    def _forks(self, seqs: list[DraftSeq]) -> list[Fork]:
        """Glue decode over each speculation, then the fork tokens per depth."""
        forks = []
        for s, (rows, extra_ids) in zip(seqs, self.engine.score_speculations(seqs)):
            spec, n = s.spec, len(s.spec) + 1
            if not s.params.greedy_decoding:  # rank by the processed distribution (top-k/top-p cut)
                rows = probs_from_logits(rows, s.params)
            sizes = self.fan_out.sizes(n, s.after_hit, trees=len(seqs))
            width = min(MAX_RANK + 1, rows.shape[-1])
            if s.noise is not None:  # the target's token at depth j is its own draw there: rank by the draft's
                whole = self.engine.head.over_vocabulary(rows, extra_ids)
                top = [s.noise.ranked(whole[j], s.offset + s.confirmed + j, width) for j in range(n)]
            else:
                top = self.engine.head.token_ids(rows.topk(width, dim=-1).indices, extra_ids).tolist()
            s.candidates = [[t for t in top[j] if j == n - 1 or t != spec[j]][:MAX_RANK] for j in range(n)]
            forks += [Fork(s, j, t) for j in range(n) for t in s.candidates[j][:sizes[j]]]
        return forks


def _runs(seqs: list[DraftSeq]) -> list[tuple[DraftSeq, int]]:
    """Consecutive equal sequences as (seq, count)."""
    out: list[tuple[DraftSeq, int]] = []
    for s in seqs:
        if out and out[-1][0] is s:
            out[-1] = (s, out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out

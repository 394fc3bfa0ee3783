"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft-free speculation from an index of
the request's own tokens and of earlier requests' text, proposing the continuation that most
often followed the sequence's longest matched suffix.

A match starts from the sequence's last ANCHOR tokens: every indexed occurrence of them (the
request's own earlier tokens, then earlier requests' newest first, up to MAX_CANDIDATES) is
extended backwards while it agrees with the sequence, up to MAX_MATCH tokens. The occurrences
of the longest suffix matched (length p) vote on the continuation token by token: each step
takes the token most of the still-agreeing occurrences continue with, and the chain stops
where the product of those shares falls below MIN_PROB, or at SPEC_FACTOR x p tokens (a short
match earns a short proposal), or at the round's K. The other continuations at least as
frequent are candidate branches off that chain (`tree`, SuffixDecoding's speculation tree):
each promises the share of the occurrences that follow it, and the round takes those worth
a verify row (siblings.py) for greedy requests. Structured text that repeats (tool calls,
code, agents' loops over the same schema) matches long and proposes long; a fresh engine has
only the request's own tokens, as prompt lookup.

Earlier requests' text joins the index when they end (their prompt and answer), per tenant:
requests share it only with requests of the same cache_salt (docs/algorithm.md, "KV
caches"). The index holds at most `limit` tokens over all tenants, the oldest request's out
first. Proposals are one-hot (q = None), verified exactly like prompt lookup's. With
`suffix_keep` the engine saves the index into the store when it closes and loads it when it
starts (per target tokenizer: `index_file`), so a restarted server keeps what it learnt.
"""
import hashlib
import json
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ssd.request.sequence import Sequence
from ssd.speculative.plan import SeqPlan
from ssd.speculative.records import Branch, Capabilities, Proposal, argmax_chain
from ssd.speculative.sources.base import DraftSource

ANCHOR = 2  # tokens a match starts from
MAX_MATCH = 32  # the longest suffix compared
MAX_CANDIDATES = 64  # occurrences of the anchor examined, newest first
SPEC_FACTOR = 1.0  # a proposal's most tokens per token of matched suffix (vLLM's default)
MIN_PROB = 0.1  # stop where the chain's estimated probability falls below this (vLLM's default)
DEFAULT_LIMIT = 500_000  # tokens of earlier requests kept


def _key(tokens, i: int) -> int:
    """The anchor before position i (the ANCHOR tokens ending there) as one int."""
    key = 0
    for t in tokens[i - ANCHOR:i]:
        key = key << 32 | t
    return key


@dataclass
class _Texts:
    """One tenant's earlier texts and where each anchor occurs in them. Packed: a text's
    tokens in an int32 array, each anchor's occurrences in an int64 array (text id << 32 |
    position after it): as Python lists of ints and tuples, 500k tokens held ~220 MB."""

    texts: dict[int, array] = field(default_factory=dict)  # text id -> tokens
    where: dict[int, array] = field(default_factory=dict)  # anchor -> text id << 32 | position after it
    dead: int = 0  # entries of `where` whose text is gone

    def add(self, text_id: int, tokens: list[int]) -> None:
        self.texts[text_id] = text = array("i", tokens)
        self._index(text_id, text)

    def _index(self, text_id: int, text: array) -> None:
        for i in range(ANCHOR, len(text)):
            key = _key(text, i)
            at = self.where.get(key)
            if at is None:
                at = self.where[key] = array("q")
            at.append(text_id << 32 | i)

    def drop(self, text_id: int) -> None:
        self.dead += max(0, len(self.texts.pop(text_id)) - ANCHOR)
        if self.dead > sum(map(len, self.where.values())) // 2:  # mostly dead: index the living again
            self.where, self.dead = {}, 0
            for i, text in self.texts.items():
                self._index(i, text)

    def occurrences(self, anchor: int):
        for entry in reversed(self.where.get(anchor, ())):
            tokens = self.texts.get(entry >> 32)
            if tokens is not None:
                yield tokens, entry & 0xFFFFFFFF


class SuffixIndex:
    """Earlier requests' text, per tenant, bounded in tokens (oldest out first)."""

    def __init__(self, limit: int = DEFAULT_LIMIT):
        self.limit = limit
        self.tenants: dict[str | None, _Texts] = {}
        self.order: deque[tuple[str | None, int, int]] = deque()  # (tenant, text id, tokens), oldest first
        self.tokens = 0
        self.next_id = 0

    def add(self, tenant: str | None, tokens: list[int]) -> None:
        if len(tokens) <= ANCHOR or len(tokens) > self.limit:
            return
        self.tenants.setdefault(tenant, _Texts()).add(self.next_id, list(tokens))
        self.order.append((tenant, self.next_id, len(tokens)))
        self.next_id += 1
        self.tokens += len(tokens)
        while self.tokens > self.limit:
            old, text_id, n = self.order.popleft()
            self.tenants[old].drop(text_id)
            self.tokens -= n
            if not self.tenants[old].texts:
                del self.tenants[old]

    def occurrences(self, tenant: str | None, anchor: int):
        texts = self.tenants.get(tenant)
        return texts.occurrences(anchor) if texts is not None else iter(())

    def save(self, path: Path) -> None:
        """Every text with its tenant, oldest first, into `path` (written whole, then renamed)."""
        names = sorted({t for t, _, _ in self.order}, key=lambda t: (t is not None, t or ""))
        texts = [self.tenants[t].texts[i] for t, i, _ in self.order]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, tokens=np.concatenate([np.frombuffer(t, dtype=np.int32) for t in texts] or
                                              [np.zeros(0, np.int32)]),
                     lengths=np.array([len(t) for t in texts], dtype=np.int64),
                     tenants=np.array([names.index(t) for t, _, _ in self.order], dtype=np.int64),
                     names=np.array(json.dumps(names)))
        tmp.replace(path)

    def load(self, path: Path) -> None:
        """The texts save() wrote, added oldest first (the bound holds: the oldest go first)."""
        with np.load(path) as f:
            names = json.loads(str(f["names"]))
            tokens, lengths, tenants = f["tokens"], f["lengths"], f["tenants"]
        ends = np.cumsum(lengths)
        for end, n, tenant in zip(ends.tolist(), lengths.tolist(), tenants.tolist()):
            self.add(names[tenant], tokens[end - n:end].tolist())


def index_file(root: Path, model: Path) -> Path:
    """Where a target's index is kept: token ids mean the same under the same tokenizer."""
    source = next((model / f for f in ("tokenizer.json", "tokenizer.model", "config.json") if (model / f).exists()),
                  None)
    digest = hashlib.sha256(source.read_bytes() if source else str(model.resolve()).encode()).hexdigest()[:16]
    return root / "suffix" / f"{model.name}-{digest}.npz"


@dataclass
class _Own:
    """A sequence's own tokens seen so far, and where each anchor occurs in them."""

    seq: Sequence
    seen: int = 0
    where: dict[int, list[int]] = field(default_factory=dict)  # anchor (_key) -> positions after it

    def extend(self) -> None:
        """Index the anchors whose next token is known (all but the newest position)."""
        tokens = self.seq.token_ids
        for i in range(max(self.seen, ANCHOR), len(tokens)):
            self.where.setdefault(_key(tokens, i), []).append(i)
        self.seen = max(self.seen, len(tokens))


class SuffixLookup(DraftSource):
    """draft="suffix"; beside a draft model, auto-K's lookup (adaptive_k.py) takes its `match`
    as it takes prompt lookup's."""

    capabilities = Capabilities(offers_trees=True)
    kind = "suffix"

    @property
    def suffix_index(self) -> SuffixIndex:
        return self.index

    def __init__(self, index: SuffixIndex | None = None):
        super().__init__()
        self.index = index if index is not None else SuffixIndex()
        self.own: dict[int, _Own] = {}

    def propose(self, seqs: list[Sequence], plans: list[SeqPlan]) -> list[Proposal]:
        out = []
        for seq, p in zip(seqs, plans):
            chain, _, tree = self.tree(seq, p.k, branches=p.alternatives and argmax_chain(seq))
            out.append(Proposal(chain, candidates=tree))
        return out

    def match(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing the sequence's longest matched suffix (module doc), and the
        match's length class for auto-K's per-class acceptance (1..4: 4 for 4 or more)."""
        return self.tree(seq, k, branches=False)[:2]

    def tree(self, seq: Sequence, k: int, branches: bool = True) -> tuple[list[int], int, list[Branch]]:
        """match(), and (with `branches`) the other continuations as candidate branches off its
        chain (module doc), each promising the share of the matched occurrences that follow it."""
        own = self.own.get(seq.seq_id)
        if own is None:
            own = self.own[seq.seq_id] = _Own(seq)
        own.seq = seq
        tokens = seq.token_ids
        if k <= 0 or len(tokens) <= ANCHOR:
            return [], 0, []
        own.extend()
        anchor = _key(tokens, len(tokens))
        mine = ((tokens, after) for after in reversed(own.where.get(anchor, ())) if after < len(tokens))
        found = []
        for source in (mine, self.index.occurrences(seq.params.cache_salt, anchor)):
            for text, after in source:
                found.append((_matched(tokens, text, after), text, after))
                if len(found) >= MAX_CANDIDATES:
                    break
        if not found:
            return [], 0, []
        p = max(m for m, _, _ in found)
        chain, tree = _grow([(text, after) for m, text, after in found if m == p], min(k, max(1, int(SPEC_FACTOR * p))),
                            branches)
        return chain, min(p - ANCHOR + 1, 4) if chain else 0, tree if chain else []

    def release(self, seq_id: int) -> None:
        """A request that ended: its text joins the index for later requests of its tenant."""
        own = self.own.pop(seq_id, None)
        if own is not None:
            self.index.add(own.seq.params.cache_salt, own.seq.token_ids)

    def held(self) -> dict[str, int]:
        return {"suffix sequences": len(self.own)}  # per sequence; the index's size: SuffixIndex.tokens


def _grow(alive: list[tuple[array | list[int], int]], depth: int, branches: bool) -> tuple[list[int], list[Branch]]:
    """The trie of what the matched occurrences continue with, up to `depth` tokens: its chain
    takes at each node the token most of them continue with (ties: the newest occurrence's)
    while that node's share of them is at least MIN_PROB; with `branches`, every other node with
    that share hangs off it as a candidate branch (parents as in records.Branch), promising its
    share (without, only the chain's nodes are walked)."""
    total = len(alive)
    chain: list[int] = []
    nodes: list[tuple[tuple[str, int], int, float]] = []  # (parent: ("chain", depth) or ("node", i), token, share)
    level = [(("chain", 0), alive)]
    for step in range(depth):
        below = []
        for parent, occurrences in level:
            groups: dict[int, list] = {}
            for text, after in occurrences:
                if after + step < len(text):
                    groups.setdefault(text[after + step], []).append((text, after))
            for rank, (token, group) in enumerate(sorted(groups.items(), key=lambda g: -len(g[1]))):
                share = len(group) / total
                if share < MIN_PROB:
                    break
                if parent == ("chain", step) and rank == 0:
                    chain.append(token)
                    below.append((("chain", step + 1), group))
                elif branches:
                    nodes.append((parent, token, share))
                    below.append((("node", len(nodes) - 1), group))
        if len(chain) == step:  # the chain ends here: a branch goes no deeper than it
            break
        level = below
    n = len(chain)
    return chain, [Branch(at if kind == "chain" else n + 1 + at, token, share) for (kind, at), token, share in nodes]


def _matched(tokens: list[int], text: list[int], after: int) -> int:
    """How many tokens before `after` in `text` agree with the end of `tokens` (at most MAX_MATCH)."""
    n = 0
    while n < MAX_MATCH and n < after and n < len(tokens) and text[after - 1 - n] == tokens[-1 - n]:
        n += 1
    return n

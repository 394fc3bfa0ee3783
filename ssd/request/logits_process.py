"""What a request changes about the model's logits before a token is drawn: repetition,
presence and frequency penalties, logit_bias, min_tokens and its constraint (constraint.py).

These depend on the tokens before the scored position, so one definition serves every path:
`process(logits, tokens, drafts)` takes rows scored after `tokens` and then after each draft
token in turn (AR: one row, no drafts; a verify pass: K+1 rows; a draft step: one row), and
row i sees the history tokens + drafts[:i], exactly as plain decoding would have had it. The
target's processed rows are "the distribution" (sampler.py turns them into probabilities);
the SD draft proposes from its own copy (`fork`), so it never proposes a token the grammar
forbids, and verification stays exact whatever the draft did.
"""
from collections.abc import Iterator

import torch

from ssd.request.constraint import Constraint
from ssd.sampling_params import SamplingParams


class LogitsProcessor:
    def __init__(self, params: SamplingParams, num_prompt_tokens: int, end_ids: set[int],
                 constraint: Constraint | None):
        self.params, self.num_prompt_tokens, self.constraint = params, num_prompt_tokens, constraint
        self.end_ids = sorted(end_ids | set(params.stop_token_ids))  # what min_tokens bans
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        # Only tokens are banned (a constraint, min_tokens): a row's argmax that is allowed stays its argmax.
        self.bans_only = not (params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
                              or params.logit_bias)

    def fork(self) -> "LogitsProcessor":
        """The same request's processor with a constraint state of its own (the SD draft's)."""
        return LogitsProcessor(self.params, self.num_prompt_tokens, set(self.end_ids),
                               self.constraint.fork() if self.constraint else None)

    def process(self, logits: torch.Tensor, tokens: list[int], drafts: list[int] = ()) -> torch.Tensor:
        """Rows [n, V] -> the request's logits (float32, a new tensor). Row i was scored after
        `tokens` (prompt and output) and drafts[:i]. Under a constraint, the rows after a draft
        token the grammar forbids are left unconstrained: that draft is rejected (its
        probability is 0), so they are never used."""
        p, out = self.params, logits.float().clone()
        n, V = out.shape
        ends = len(tokens) + torch.arange(n, device=out.device)  # row i sees the history before ends[i]
        start = self.num_prompt_tokens
        if p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty:
            history = torch.tensor(list(tokens) + list(drafts[:n - 1]), dtype=torch.long, device=out.device)
            pos = torch.arange(len(history), device=out.device)
            rows = (pos.unsqueeze(0) < ends.unsqueeze(1)) & (history < V)  # [n, len]: in row i's history
            index = history.clamp(max=V - 1).expand(n, -1)
            if p.repetition_penalty != 1:
                seen = torch.zeros(n, V, device=out.device).scatter_add_(1, index, rows.float())
                r = p.repetition_penalty
                out = torch.where(seen > 0, torch.where(out > 0, out / r, out * r), out)
            if p.presence_penalty or p.frequency_penalty:
                counts = torch.zeros(n, V, device=out.device).scatter_add_(1, index, (rows & (pos >= start)).float())
                out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids, values = self._bias_tensors(out.device)
            keep = ids < V
            out[:, ids[keep]] += values[keep]
        short, end_ids = self._short(tokens, n, V, out.device)
        if self.constraint is not None:
            for i, allowed in self._allowed(tokens, drafts, n, V, short, end_ids):
                _ban(out[i], allowed)
        elif any(short):
            out[torch.tensor(short, device=out.device).nonzero()[:, :1], end_ids] = float("-inf")
        return out

    def argmax(self, logits: torch.Tensor, tokens: list[int], drafts: list[int] = (),
               raw: list[int] | None = None) -> list[int]:
        """Each row's argmax after process(logits, tokens, drafts), where the request only bans
        tokens (bans_only) without processing the rows whose own argmax (`raw`, if known) is
        allowed: a ban can only lower tokens, so an allowed argmax stays the first maximum.
        Greedy verification and drafting take this: a row over the whole vocabulary costs a
        copy, a mask and a search a row."""
        if not self.bans_only:
            return self.process(logits, tokens, drafts).argmax(-1).tolist()
        n, V = logits.shape
        raw = logits.argmax(-1).tolist() if raw is None else list(raw)
        short, end_ids = self._short(tokens, n, V, logits.device)
        states = self._allowed(tokens, drafts, n, V, short, end_ids) if self.constraint is not None else (
            (i, None) for i in range(n) if short[i])
        for i, allowed in states:
            if allowed is None:  # min_tokens alone
                allowed = torch.ones(V, dtype=torch.bool, device=logits.device)
                allowed[end_ids] = False
            if raw[i] < allowed.numel() and allowed[raw[i]]:
                continue
            row = logits[i].float().clone()
            _ban(row, allowed)
            raw[i] = int(row.argmax())
        return raw

    def _short(self, tokens: list[int], n: int, V: int, device: torch.device) -> tuple[list[bool], torch.Tensor]:
        """Per row of n scored after `tokens` (and the drafts before it): whether min_tokens bans
        the end tokens there (its token would come before the min_tokens-th); the end tokens."""
        p = self.params
        ends = len(tokens) + torch.arange(n)
        short = ((ends - self.num_prompt_tokens) < p.min_tokens).tolist() if p.min_tokens else [False] * n
        return short, torch.tensor([t for t in self.end_ids if t < V], dtype=torch.long, device=device)

    def _allowed(self, tokens: list[int], drafts: list[int], n: int, V: int, short: list[bool],
                 end_ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Under the constraint, row i's allowed tokens (at most V; min_tokens's ban in), the
        constraint led through drafts[:i]. It stops after a draft the row forbids: the rows
        after that draft are left unconstrained, since it is rejected (probability 0)."""
        c = self.constraint
        c.follow(self._output(tokens))
        for i in range(n):
            allowed = c.allowed()[:V]
            if short[i]:
                unended = allowed.clone()
                unended[end_ids] = False
                # Where the grammar allows only an end token, it wins over min_tokens.
                allowed = unended if unended.any() else allowed
            yield i, allowed
            if i >= len(drafts) or i + 1 == n:
                return
            d = drafts[i]
            if not (0 <= d < allowed.numel() and allowed[d]):
                return
            c.advance(d)

    def forced(self, tokens: list[int]) -> int | None:
        """The one token the constraint allows after `tokens`, if it allows exactly one (the
        draft emits it without a forward pass); None otherwise or without a constraint."""
        if self.constraint is None:
            return None
        self.constraint.follow(self._output(tokens))
        allowed = self.constraint.allowed()
        if int(allowed.sum()) != 1:
            return None
        return int(allowed.nonzero()[0, 0])

    def complete(self, tokens: list[int]) -> bool:
        """Whether the constraint is satisfied and allows nothing more after `tokens` (the
        request then stops, as at an end token)."""
        if self.constraint is None:
            return False
        self.constraint.follow(self._output(tokens))
        return self.constraint.stopped

    def _output(self, tokens: list[int]) -> list[int]:
        return list(tokens[self.num_prompt_tokens:])

    def _bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bias is None:
            bias = self.params.logit_bias
            self._bias = (torch.tensor(list(bias), dtype=torch.long, device=device),
                          torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
        return self._bias


def _ban(row: torch.Tensor, allowed: torch.Tensor) -> None:
    """-inf, in place, at every token of row [V] that `allowed` (a bool row of at most V, the
    tokens past it banned too) leaves out."""
    row[:allowed.numel()].masked_fill_(~allowed, float("-inf"))
    row[allowed.numel():] = float("-inf")

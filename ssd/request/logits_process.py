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
import torch

from ssd.request.constraint import Constraint
from ssd.sampling_params import SamplingParams


class LogitsProcessor:
    def __init__(self, params: SamplingParams, num_prompt_tokens: int, end_ids: set[int],
                 constraint: Constraint | None):
        self.params, self.num_prompt_tokens, self.constraint = params, num_prompt_tokens, constraint
        self.end_ids = sorted(end_ids | set(params.stop_token_ids))  # what min_tokens bans
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

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
        # min_tokens: the rows whose token would come before the min_tokens-th ban the end tokens.
        short = ((ends - start) < p.min_tokens).tolist() if p.min_tokens else [False] * n
        end_ids = torch.tensor([t for t in self.end_ids if t < V], dtype=torch.long, device=out.device)
        if self.constraint is not None:
            self._constrain(out, tokens, drafts, short, end_ids)
        elif any(short):
            out[torch.tensor(short, device=out.device).nonzero()[:, :1], end_ids] = float("-inf")
        return out

    def _constrain(self, out: torch.Tensor, tokens: list[int], drafts: list[int], short: list[bool],
                   end_ids: torch.Tensor) -> None:
        c, V = self.constraint, out.shape[1]
        c.follow(self._output(tokens))
        for i in range(out.shape[0]):
            allowed = c.allowed()[:V]
            if short[i]:
                unended = allowed.clone()
                unended[end_ids] = False
                # Where the grammar allows only an end token, it wins over min_tokens.
                allowed = unended if unended.any() else allowed
            out[i, :allowed.numel()].masked_fill_(~allowed, float("-inf"))
            out[i, allowed.numel():] = float("-inf")
            if i >= len(drafts) or i + 1 == out.shape[0]:
                break
            d = drafts[i]
            if not (0 <= d < allowed.numel() and allowed[d]):
                break
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

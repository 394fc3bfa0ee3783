"""Turning logits into the processed distribution and drawing tokens from it.

`probs_from_logits` is the single definition of "the distribution" for a request:
the verifier applies the same function to the target's and the draft's logits.
"""
import torch

from ssd.outputs import TokenLogprob
from ssd.request.noise import SharedNoise, first_argmax, keyed_race
from ssd.sampling_params import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of logits [N, V] (after the request's own changes, logits_process.py) ->
    probabilities after temperature, top-k, min-p and top-p, in that order (float32).

    Greedy (temperature 0) gives a one-hot row on the argmax."""
    logits = logits.float()
    if params.greedy_decoding:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        # Drop what is less likely than min_p times the likeliest token (which always stays).
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass
        # before it already does.
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def saguaro(probs: torch.Tensor, c: float, n: int) -> torch.Tensor:
    """Saguaro sampling's draft distribution (docs/algorithm.md, "Saguaro sampling"): the n
    most likely tokens of each row scaled by c in (0, 1), renormalised. Drafting from it and
    using it as q in the ratio test keeps verification exact, and pushes the residual
    max(0, p - q) onto those tokens, which are the ones the speculation cache forks on."""
    top = probs.topk(min(n, probs.shape[-1]), dim=-1).indices
    scaled = probs.scatter(-1, top, probs.gather(-1, top) * c)
    return scaled / scaled.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [N, V], by the exponential race (argmax p / E, E ~ Exp(1)),
    which draws exactly from p. Each row's exponentials are the shared noise's hash (noise.py)
    under a 32-bit key the generator draws for it: one hash over the vocabulary, where the
    generator's own exponential_ costs several times as much on a CPU (docs/decision-log.md,
    "One seed, one answer")."""
    keys = (torch.randint(2**32, (probs.shape[0],), generator=generator, device=probs.device) - 2**31).int()
    race = keyed_race(probs, keys)
    if race.shape[0] == 1:
        return torch.tensor([first_argmax(race[0])], device=probs.device)
    return race.argmax(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               noise: SharedNoise | None, position: int) -> int:
    """The token at `position` from one row of logits [1, V]: the argmax for a greedy request, the
    shared noise's draw for a request that has it, else a draw by the generator."""
    if params.greedy_decoding:
        return int(logits.argmax(-1)[0])
    probs = probs_from_logits(logits, params)
    return noise.choose(probs, [position])[0] if noise is not None else int(sample(probs, generator)[0])


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's token's log-probability under the log-softmax of the row (logits [n, V], the
    request's processed logits), with the `top` likeliest alternatives."""
    logp = logits[:len(tokens)].float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
    if top:
        values, ids = logp.topk(top, dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alts = [[] for _ in tokens]
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens, chosen, alts)]

"""Exact verification of K draft tokens against the target (the rule of speculative sampling).

At each scored position i = 0..K-1 the draft proposed d_i from q_i; p_i is the target's
processed distribution there, and p has one more row, p_K, for the bonus token:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
    at the first rejection i:  t ~ norm(max(0, p_i - q_i))      (the recovery token)
    if all K are accepted:     t ~ p_K                          (the bonus token)

Every emitted token is then distributed exactly as the target's. With one-hot (greedy) rows
the same formula accepts exactly the prefix where d_i == argmax p_i and gives t = argmax p_i,
whether q is one-hot, soft, or None.
"""
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssd.request.sampler import sample
from ssd.speculative.records import Branch


@dataclass
class Verdict:
    accepted: int  # k: how many draft tokens were accepted (0..K)
    token: int  # t: the recovery token (k < K) or the bonus token (k == K)


def verify(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
           generator: torch.Generator | None) -> Verdict:
    """One round. p [K+1, V]: the target's processed distributions at the scored positions;
    draft [K]: the proposed tokens; q [K, V]: the processed draft distributions they were
    sampled from, or None when they were not sampled from any q (placeholders, a greedy draft
    for a sampled target): each is then verified as if q were one-hot on it.

    Draws K uniforms, then one `sample` row's key from the generator, whatever the outcome, so
    a seeded request is reproducible."""
    k, t = verify_many(p.unsqueeze(0), draft.unsqueeze(0), None if q is None else q.unsqueeze(0), generator)
    return Verdict(accepted=int(k[0]), token=int(t[0]))


def greedy_tree(best: Sequence[int], drafts: list[int], branches: list[Branch]) -> tuple[int, list[int], int]:
    """Greedy verification of a draft tree (the chain `drafts`, and `branches` off it) from the
    argmax of its rows `best` (the newest token's, the chain's, then one per branch; or a seeded
    request's draws there under shared noise, read as needed: round.py): from the
    newest token, step to the child that holds the target's token there, while there is one.
    Returns the chain's drafts accepted, the branches taken after them (indices, in path
    order) and the target's token after the last node reached. Without branches: verify()'s
    verdict for a greedy request, read from the argmax alone (p one-hot on each row's argmax
    accepts the prefix where d_i == argmax p_i, then t is the first other row's argmax; no
    one-hot rows built, no exponentials drawn); with a branch (a sibling leaf) at the first
    rejected depth that holds the target's token, the round gains its token and the one its
    row gives."""
    n, accepted, taken = len(drafts), 0, []
    node = 0
    while True:
        token = best[node]
        if not taken and node == accepted < n and drafts[node] == token:
            accepted = node = node + 1
            continue
        child = next((i for i, b in enumerate(branches) if b.parent == node and b.token == token), None)
        if child is None:
            return accepted, taken, token
        taken.append(child)
        node = n + 1 + child


def verify_with_siblings(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, siblings: dict[int, int],
                         generator: torch.Generator | None) -> tuple[Verdict, bool]:
    """verify() where some depths j (0-based) have a sibling leaf s_j (ssd/speculative/policy/siblings.py):
    a second candidate for d_j's place, proposed one-hot. At the first rejected depth k the token must be
    drawn from the residual r = norm(max(0, p_k - q_k)); with a sibling there, s_k is taken with
    probability r(s_k) and otherwise the token is drawn from r without s_k: the multi-candidate
    rule (recursive rejection sampling) for a one-hot second candidate, whose result is again
    distributed as r. Returns the verdict and whether the sibling was taken (then `token` is s_k).

    Draws K uniforms, then one more uniform where the first rejected depth has a sibling, then
    one `sample` row's key unless the sibling was taken."""
    K, V = draft.shape[0], p.shape[-1]
    draft = draft.to(p.device)
    q = F.one_hot(draft, V).to(p.dtype) if q is None else q
    u = torch.rand(K, generator=generator, device=p.device, dtype=torch.float32)
    accepted = u.double() * q[torch.arange(K), draft].double() < p[torch.arange(K), draft].double()
    k = int(torch.cat([~accepted, accepted.new_ones(1)]).byte().argmax())
    residual = (p[k] - q[k]).clamp_min(0) if k < K else p[k]
    residual = residual if residual.sum() > 0 else p[k]  # as in verify_many: rounding only
    s = siblings.get(k) if k < K else None
    if s is not None:
        v = torch.rand(1, generator=generator, device=p.device, dtype=torch.float32)
        if v.double() * residual.sum().double() < residual[s].double():
            return Verdict(k, s), True
        residual = residual.clone()
        residual[s] = 0
    return Verdict(k, int(sample(residual.unsqueeze(0), generator)[0])), False


def verify_many(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """N rounds at once that share one generator: p [N, K+1, V], draft [N, K], q [N, K, V] or
    None. Returns (accepted [N], token [N])."""
    N, K = draft.shape
    V = p.shape[-1]
    assert p.shape == (N, K + 1, V) and (q is None or q.shape == (N, K, V)), (p.shape, draft.shape)
    draft = draft.to(p.device)
    if q is None:
        q = F.one_hot(draft, V).to(p.dtype)
    p_d = p[:, :K].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)

    # u in [0, 1); accept iff u < p/q, written u·q < p. A product of two float32 values is
    # exact in float64, so p(d) == q(d) always accepts and p(d) == 0 never does.
    u = torch.rand(N, K, generator=generator, device=p.device, dtype=torch.float32)
    accepted = u.double() * q_d.double() < p_d.double()

    # k = the first rejected position; the appended True column stands for "all K accepted".
    k = torch.cat([~accepted, accepted.new_ones(N, 1)], dim=1).byte().argmax(dim=1)

    # With a zero row appended to q, the bonus p_K = max(0, p_K - 0) is the k == K case of the
    # residual. For q = None, max(0, p - onehot(d)) is p with d removed.
    q = torch.cat([q, q.new_zeros(N, 1, V)], dim=1)
    rows = torch.arange(N, device=p.device)
    p_k, q_k = p[rows, k], q[rows, k]
    residual = (p_k - q_k).clamp_min(0)
    # A rejection implies p_k(d) < q_k(d), so in exact arithmetic the residual has mass. In
    # float it can round to all zeros only where p_k and q_k agree to within rounding (there a
    # rejection has probability ~1e-7); p_k is the natural limit.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_k)
    # `sample` draws from a row up to scale, so the residual needs no normalising.
    return k, sample(residual, generator)

"""What a draft that stops by its own confidence could gain over a fixed K, before building it
(ssd/speculative/policy/draft_stop.py), replayed offline on real text.

For each prompt the target's greedy output is computed, then the draft reads prompt + output
in one teacher-forced pass: at every position its top-1 token and that token's probability c.
A greedy round from position p drafting n tokens accepts them while top-1 equals the target's
token. Policies: a fixed K; stop after the first token with c below tau; stop once the product
of the drafted tokens' c falls below theta; and the engine's rule (draft_stop.py: calibrated
c, one more token while S x a >= r x (d + V(j + 2) - V(j + 1)), r the policy's own rate, found
by iterating). Past a rejected token the draft's real c is unknown (its context holds its own
wrong token); the teacher-forced one stands in for it, which only moves where a round stops.
With a draft step of d seconds and a verify pass of T(M) seconds over M rows (measured here),
the estimate is tokens / sum of the rounds' (n d + T(n + 1)).

    python bench/studies/draft_stop_headroom.py --sets humaneval,gsm8k,mtbench --num-prompts 8
"""
from tree_headroom import Chunk, replay_costs

BINS = 10


def simulate(top1: list[int], conf: list[float], truth: list[int], policy, d: float, T: dict[int, float]
             ) -> tuple[int, float]:
    """Greedy rounds over one output: (tokens, seconds). policy(conf, pos, most) -> n drafted."""
    pos, tokens, seconds = 0, 0, 0.0
    while pos < len(truth):
        n = policy(conf, pos, len(truth) - pos - 1)
        j = next((j for j in range(n) if top1[pos + j] != truth[pos + j]), n)
        tokens, pos = tokens + j + 1, pos + j + 1
        seconds += n * d + T[min(max(T), n + 1)]
    return tokens, seconds


def fixed(k: int):
    return lambda conf, pos, most: min(k, most)


def below(tau: float, k_max: int):
    def policy(conf, pos, most):
        n = 0
        while n < min(k_max, most):
            n += 1
            if conf[pos + n - 1] < tau:
                break
        return n
    return policy


def product(theta: float, k_max: int, f=lambda c: c, floor=None):
    """Draft while the product of f(c) stays at or above theta (or floor(n), the n-th floor)."""
    def policy(conf, pos, most):
        n, s = 0, 1.0
        while n < min(k_max, most):
            s *= f(conf[pos + n])
            n += 1
            if s < (theta if floor is None else floor(n)):
                break
        return n
    return policy


def calibration(runs) -> tuple[list[float], float]:
    """Acceptance by bin of c, over every position of the replayed outputs (prior f(c) = c),
    and over all of them (the rule's a, as the engine counts it: hits over positions)."""
    hits, seen = [2.0 * (i + 0.5) / BINS for i in range(BINS)], [2.0] * BINS
    for top1, conf, truth in runs:
        for t in range(len(truth)):
            b = min(BINS - 1, int(conf[t] * BINS))
            seen[b] += 1
            hits[b] += top1[t] == truth[t]
    return [h / s for h, s in zip(hits, seen)], sum(hits) / sum(seen)


def main() -> None:
    _, outputs, draft, T, d = replay_costs(__doc__.split("\n\n")[0], "humaneval,gsm8k,mtbench")
    by_set: dict[str, list] = {}
    for name, prompt, out in outputs:
        top = draft.forward([Chunk(0, prompt + out[:-1], 0, len(out))]).float().softmax(-1).max(-1)
        by_set.setdefault(name, []).append((top.indices.tolist(), top.values.tolist(), out))
    cal, mean = calibration([r for runs in by_set.values() for r in runs])
    f = lambda c: cal[min(BINS - 1, int(c * BINS))]  # noqa: E731
    print("calibration (acceptance by top-1 probability, tenths): " + " ".join(f"{a:.2f}" for a in cal)
          + f"; over all positions {mean:.2f}")
    print("set        policy                        tok/s   vs best fixed K")
    for name, runs in by_set.items():
        def rate(policy) -> float:
            tokens = seconds = 0.0
            for top1, conf, truth in runs:
                t, s = simulate(top1, conf, truth, policy, d, T)
                tokens, seconds = tokens + t, seconds + s
            return tokens / seconds
        best_k = max(range(1, 9), key=lambda k: rate(fixed(k)))
        base = rate(fixed(best_k))
        rule_rate = base
        for _ in range(3):  # the rule's rate r is its own: iterate to the fixed point
            floors = [rule_rate * (d + T[j + 2] - T[j + 1]) / mean for j in range(1, 16)]
            rule_rate = rate(product(0.0, 12, f, lambda n: floors[n - 1]))
        rows = [(f"fixed K = {best_k}", base), ("the engine's rule, k_max 12", rule_rate)]
        rows += [(f"c below {tau}, k_max {k}", rate(below(tau, k))) for tau in (0.4, 0.6, 0.8) for k in (8, 12)]
        rows += [(f"product below {th}, k_max {k}", rate(product(th, k))) for th in (0.3, 0.5, 0.6) for k in (8, 12)]
        for label, r in rows:
            print(f"{name:10} {label:29} {r:6.1f}   {r / base:.3f}x")


if __name__ == "__main__":
    main()

"""Auto-K's inputs and choices on a real run, written to a file and replayed through the policy
as it is now (tests/test_policy_trace.py): a change to the policy that is meant to keep its
choices must give the same plan, round by round, on the recorded inputs.

What the policy reads is recorded as it read it: the start-up timings and any taken again, the
draft's timed steps, prompt lookup's answers, the clock around planning (the hold rule), each
plan's sequences, and each round's record. Record a trace with the default pair (a few
minutes on two cores; each engine's first request alone, then a batch):

    python tests/policy_trace.py tests/data/policy_trace.json.gz
"""
import gzip
import json
import sys
from collections.abc import Callable
from types import SimpleNamespace

import ssd.speculative.policy.adaptive_k as adaptive_k
from ssd.sampling_params import SamplingParams
from ssd.speculative.policy.draft_stop import DraftStop
from ssd.speculative.records import Branch, Capabilities, Proposal, Round, RoundTimes


def _seq(s) -> dict:
    return {"id": s.seq_id, "n": s.num_tokens, "out": len(s.output_ids), "max": s.params.max_tokens,
            "t": s.params.temperature, "lp": s.params.logprobs, "proc": s.processor is not None}


def _round(r: Round) -> dict:
    p = r.proposal
    return {"seq": _seq(r.seq), "k": r.k, "drafts": p.tokens, "lookup": p.lookup, "conf": p.confidences,
            "acc": r.accepted, "tokens": r.tokens, "draft_s": r.times.draft_s, "verify_s": r.times.verify_s,
            "step_s": r.times.step_s, "catchup": r.times.catchup, "rescued": r.rescued, "timed": r.times.timed,
            "branches": [[b.parent, b.token, b.promise] for b in r.branches]}


def _plan(plan) -> dict:
    return {"ks": plan.ks, "lookups": [p.lookup for p in plan.seqs], "stop": [p.stop is not None for p in plan.seqs]}


def _times(r: dict) -> RoundTimes:
    catchup = tuple(r["catchup"]) if r["catchup"] else None
    return RoundTimes(r["draft_s"], r["verify_s"], r["timed"], r["step_s"], catchup)


def _branches(rows) -> list[Branch]:
    return [Branch(*b) for b in rows]


class _Clock:
    """adaptive_k's `time` module as planning reads it: the real clock, each reading recorded on
    `tape` (source given), or the tape's readings given back in order (replaying)."""

    def __init__(self, tape: list, source: Callable[[], float] | None = None):
        self.tape, self.source = tape, source

    def perf_counter(self) -> float:
        if self.source is None:
            return self.tape.pop(0)
        self.tape.append(self.source())
        return self.tape[-1]


class _Lookup:
    """Prompt lookup recording its answers (or, replaying, giving them back in order)."""

    def __init__(self, inner=None, tape: list | None = None, trees: bool = False):
        self.inner, self.tape = inner, tape if tape is not None else []
        trees = trees or (inner is not None and inner.capabilities.offers_trees)
        self.capabilities = Capabilities(offers_trees=trees)

    def match(self, seq, k: int):
        if self.inner is None:
            tokens, n = self.tape.pop(0)
            return tokens, n
        out = self.inner.match(seq, k)
        self.tape.append([list(out[0]), out[1]])
        return out

    def tree(self, seq, k: int):
        if self.inner is None:
            tokens, n, branches = self.tape.pop(0)
            return tokens, n, _branches(branches)
        tokens, n, branches = self.inner.tree(seq, k)
        self.tape.append([list(tokens), n, [[b.parent, b.token, b.promise] for b in branches]])
        return tokens, n, branches


def _taped(fn: Callable | None, tape: list) -> Callable | None:
    def call(*args):
        tape.append(fn(*args))
        return tape[-1]
    return None if fn is None else call


class Recording(adaptive_k.AutoK):
    """AutoK writing what it reads and what it plans to `Recording.trace` (one per engine)."""

    traces: list[dict] = []

    def __init__(self, k_max, verify_time, draft_step_s, steps_measured=False, lookup=None, window=None,
                 siblings=False, stop=None, lookup_trees=False):
        t = {"k_max": k_max, "steps_measured": steps_measured, "window": window, "siblings": siblings,
             "stop": stop is not None, "lookup": lookup is not None, "lookup_trees": lookup_trees,
             "verify_time": [], "draft_time": [] if callable(draft_step_s) else draft_step_s, "lookups": [],
             "clock": [], "events": []}
        Recording.traces.append(t)
        self.trace = t
        lookup = None if lookup is None else _Lookup(lookup, t["lookups"])
        timed = _taped(verify_time, t["verify_time"])
        super().__init__(k_max, timed, _taped(draft_step_s, t["draft_time"]) if callable(draft_step_s)
                         else draft_step_s, steps_measured, lookup, window, siblings, stop, lookup_trees)

    def plan(self, seqs, filling=False, waiting=False):
        real = adaptive_k.time
        adaptive_k.time = _Clock(self.trace["clock"], real.perf_counter)
        try:
            plan = super().plan(seqs, filling, waiting)
        finally:
            adaptive_k.time = real
        self.trace["events"].append(["plan", [_seq(s) for s in seqs], filling, waiting, _plan(plan)])
        return plan

    def learn(self, rounds):
        self.trace["events"].append(["learn", [_round(r) for r in rounds]])
        super().learn(rounds)

    def release(self, seq_id):
        self.trace["events"].append(["release", seq_id])
        super().release(seq_id)


def _as_seq(d: dict):
    params = SamplingParams(max_tokens=d["max"], temperature=d["t"], logprobs=d["lp"])
    return SimpleNamespace(seq_id=d["id"], num_tokens=d["n"], output_ids=[0] * d["out"], params=params,
                           processor=object() if d["proc"] else None, token_ids=[])


def replay(trace: dict, policy_class=adaptive_k.AutoK) -> list[tuple[dict, dict]]:
    """Each plan's recorded choices beside the ones `policy_class` makes on the same inputs."""
    verify_tape, draft = list(trace["verify_time"]), trace["draft_time"]
    if isinstance(draft, list):  # timed by a callable: its timings in order
        draft = lambda tape=list(draft): tape.pop(0)  # noqa: E731
    lookup = _Lookup(tape=list(trace["lookups"]), trees=trace["lookup_trees"]) if trace["lookup"] else None
    policy = policy_class(trace["k_max"], lambda rows: verify_tape.pop(0), draft, trace["steps_measured"], lookup,
                          trace["window"], trace["siblings"], DraftStop() if trace["stop"] else None,
                          trace["lookup_trees"])
    out = []
    real, adaptive_k.time = adaptive_k.time, _Clock(list(trace["clock"]))
    try:
        for event in trace["events"]:
            if event[0] == "plan":
                _, seqs, filling, waiting, recorded = event
                out.append((recorded, _plan(policy.plan([_as_seq(s) for s in seqs], filling, waiting))))
            elif event[0] == "learn":
                policy.learn([Round(_as_seq(r["seq"]), r["k"],
                                    Proposal(r["drafts"], lookup=r["lookup"], confidences=r["conf"]), r["acc"],
                                    r["tokens"], _times(r), branches=_branches(r["branches"]), rescued=r["rescued"])
                              for r in event[1]])
            else:
                policy.release(event[1])
    finally:
        adaptive_k.time = real
    return out


def record(path: str) -> None:
    import ssd.engine.llm_engine as llm_engine
    from ssd import LLM
    from ssd.bench.prompts import load_prompt_set

    llm_engine.AutoK = Recording
    params = SamplingParams(temperature=0, max_tokens=96)
    sampled = SamplingParams(temperature=0.8, max_tokens=96, seed=1)
    prompts = [[{"role": "user", "content": p.text}] for p in load_prompt_set("humaneval")[:3]
               + load_prompt_set("mtbench")[:2]]
    with LLM("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", mode="sd") as llm:
        for p in prompts[:3]:
            llm.generate([p], params)
        llm.generate(prompts[3:], [params, sampled])
        llm.generate(prompts[:4], params)
    with gzip.open(path, "wt") as f:
        json.dump(Recording.traces, f)
    print(f"{path}: {sum(len(t['events']) for t in Recording.traces)} events")


if __name__ == "__main__":
    record(sys.argv[1])

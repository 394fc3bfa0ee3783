"""Seeded requests under the two schemes (docs/exactness.md, "Seeds and generators"): shared
noise (the same tokens in every mode) against rejection sampling (the most acceptance), the
same seeded requests through both, prompt by prompt in alternating order (ABBA), so that both
see the same machine. Per prompt set, temperature and draft source: acceptance, tokens a
target pass, decode tok/s. Then the noise's cost a position against a target decode step.

    python bench/seeded_schemes.py                                   # the default pair, suffix
    python bench/seeded_schemes.py --sources draft --temperatures 0.7 --num-prompts 2
"""
import argparse
import statistics
import time

import torch

from ssd.bench.prompts import load_prompt_set
from ssd.bench.script_args import script_parser

SCHEMES = ("shared-noise", "rejection")


def run(args: argparse.Namespace) -> None:
    from ssd import LLM, SamplingParams

    sources = {"draft": dict(draft=args.draft), "suffix": dict(draft="suffix")}
    print("| source | set | T | scheme | accept | tokens / pass | tok/s | shared / rejection tok/s |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for source in args.sources.split(","):
        engines = {s: LLM(args.model, mode="sd", speculate_k=args.k, seeded_sampling=s, **sources[source])
                   for s in SCHEMES}
        try:
            for llm in engines.values():  # warm-up
                llm.generate([[{"role": "user", "content": "Hello."}]], SamplingParams(temperature=0.7, max_tokens=8))
            for name in args.sets.split(","):
                prompts = load_prompt_set(name, args.num_prompts)
                for temperature in map(float, args.temperatures.split(",")):
                    got = {s: [] for s in SCHEMES}
                    for i, p in enumerate(prompts):
                        order = SCHEMES if i % 2 == 0 else SCHEMES[::-1]
                        for seed in range(args.seeds):
                            params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                                    seed=1000 + seed, ignore_eos=True)
                            for s in order:
                                [o] = engines[s].generate([[{"role": "user", "content": p.text}]], params)
                                got[s].append(o.metrics)
                    tps = {}
                    for s in SCHEMES:
                        ms = got[s]
                        drafted, accepted = sum(m.drafted for m in ms), sum(m.accepted for m in ms)
                        tokens, rounds = sum(m.output_tokens - 1 for m in ms), sum(m.rounds for m in ms)
                        tps[s] = sum(m.output_tokens - 1 for m in ms) / sum(m.decode_s for m in ms)
                        ratio = f"{tps[SCHEMES[0]] / tps[s]:.2f}x" if s == SCHEMES[1] else ""
                        print(f"| {source} | {name} | {temperature} | {s} | {accepted / max(drafted, 1):.0%} | "
                              f"{tokens / max(rounds, 1):.2f} | {tps[s]:.1f} | {ratio} |", flush=True)
        finally:
            for llm in engines.values():
                llm.close()
    noise_cost(args)


def noise_cost(args: argparse.Namespace) -> None:
    """The shared noise's draw at one position over the target's whole vocabulary, against one
    AR decode step of the target (and the generator's exponential race, rejection sampling's
    draw of the same row)."""
    from ssd import LLM, SamplingParams
    from ssd.request.noise import SharedNoise
    from ssd.request.sampler import probs_from_logits, sample

    with LLM(args.model) as llm:
        [o] = llm.generate([[{"role": "user", "content": "Write a story about a lighthouse."}]],
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        step = o.metrics.decode_s / (o.metrics.output_tokens - 1)
        vocab = llm.engine.runner.model.config.vocab_size
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=0.7)
    noise, gen = SharedNoise(1), torch.Generator().manual_seed(1)

    def timed(fn) -> float:
        times = []
        for i in range(200):
            t = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t)
        return statistics.median(times[20:])
    shared = timed(lambda i: noise.choose(probs_from_logits(logits, params), [i]))
    race = timed(lambda i: sample(probs_from_logits(logits, params), gen))
    print(f"\nthreads {torch.get_num_threads()}, vocabulary {vocab}: a target decode step {1e3 * step:.1f} ms; a draw "
          f"with shared noise {1e3 * shared:.2f} ms ({shared / step:.1%} of a step), with the generator's "
          f"exponentials {1e3 * race:.2f} ms ({race / step:.1%}); each including the row's softmax at T = 0.7")


if __name__ == "__main__":
    p = script_parser(__doc__, draft=True, sets="humaneval,mtbench,gsm8k,aclsum", num_prompts=2, max_tokens=96)
    p.add_argument("--sources", default="draft,suffix", help="comma-separated among draft, suffix")
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--seeds", type=int, default=1, help="seeded requests per prompt")
    p.add_argument("--k", default="auto")
    run(p.parse_args())

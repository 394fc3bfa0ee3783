"""How steady SD with auto-K is from one fresh engine to the next: the same prompts, each engine
started in a process of its own (nothing measured carries over), decode tok/s per engine and
the slowest against the median, per prompt. Auto-K's choices follow measured time, so a policy
that a noisy clock can fool shows here as a spread.

    python bench/steadiness.py --engines 6                 # SD, auto-K, the default pair
    python bench/steadiness.py --engines 6 --mode ar       # the machine's own noise, for scale
"""
import argparse
import json
import statistics
import subprocess
import sys

from ssd.bench.script_args import script_parser

PROMPTS = {
    "code": "Write a Python function that checks whether a number is prime.",
    "chat": "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
            "experiences and must-see attractions.",
}


def one_engine(args: argparse.Namespace) -> None:
    """In a fresh process: one engine, every prompt once (a warm-up first), tok/s as JSON."""
    from ssd import LLM, SamplingParams

    options = dict(mode=args.mode) if args.mode == "ar" else dict(mode=args.mode, draft=args.draft)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out = {}
    with LLM(args.model, **options) as llm:
        llm.generate([[{"role": "user", "content": "Hello."}]], SamplingParams(temperature=0, max_tokens=8))
        for name, prompt in PROMPTS.items():
            [o] = llm.generate([[{"role": "user", "content": prompt}]], params)
            m = o.metrics
            out[name] = {"tok_s": m.tokens_per_second, "k0_rounds": m.k_hist[0] if m.k_hist else 0,
                         "rounds": m.rounds, "draft_s": m.draft_s, "verify_s": m.verify_s,
                         "other_s": m.decode_s - m.draft_s - m.verify_s, "mean_k": m.mean_k,
                         "ms_per_pass": 1e3 * m.verify_s / max(m.rounds, 1)}
    print(json.dumps(out))


def main() -> None:
    p = script_parser(__doc__, whole_doc=True, draft=True, max_tokens=128)
    p.add_argument("--engines", type=int, default=6)
    p.add_argument("--mode", default="sd", choices=("ar", "sd"))
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (the child's part)
    args = p.parse_args()
    if args.one:
        return one_engine(args)
    child = [sys.executable, __file__, "--one", "--mode", args.mode, "--model", args.model, "--draft", args.draft,
             "--max-tokens", str(args.max_tokens)]
    runs = []
    for i in range(args.engines):
        line = subprocess.run(child, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        runs.append(json.loads(line))
        print(f"engine {i + 1}: " + "  ".join(
            f"{n} {r['tok_s']:.1f} tok/s ({r['rounds']} rounds, mean K {r['mean_k']:.1f}, K 0 in {r['k0_rounds']}, "
            f"{r['ms_per_pass']:.0f} ms a pass, draft {r['draft_s']:.2f} s, other {r['other_s']:.2f} s)"
            for n, r in runs[-1].items()), flush=True)
    for name in PROMPTS:
        speeds = [r[name]["tok_s"] for r in runs]
        median = statistics.median(speeds)
        print(f"{name}: median {median:.1f} tok/s, range {min(speeds):.1f}-{max(speeds):.1f}, "
              f"slowest / median {min(speeds) / median:.3f}")


if __name__ == "__main__":
    main()

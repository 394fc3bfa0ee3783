"""The host's share of a decode step at a batch: a step's wall time against the target's pass in
it (on a GPU synchronised, so it counts the device's time too), over the steps that decode every
request at once, for AR and SD at K = 0 (every round plain decoding: what auto-K does where
drafting does not pay), and with --profile the host's functions that cost most (cProfile, the
whole run: prompts too).

    python bench/gpu/host_profile.py --model M [--draft D] [--batch 64] [--tokens 48] [--profile 20]

Speed runs are `ssd bench`'s; this says where the host's time goes in them.
"""
import argparse
import cProfile
import pstats
import time

import torch

from ssd import LLM, SamplingParams

PROMPT = "Write a short story about the number {}."


def measure(model: str, draft: str | None, batch: int, tokens: int, top: int, **options) -> None:
    sd = draft is not None
    llm = LLM(model, **options, **({"mode": "sd", "draft": draft, "speculate_k": 1} if sd else {}))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([PROMPT.format(i) for i in range(min(batch, 4))], params)  # warm-up
    engine = llm.engine
    if sd:
        engine.set_speculate_k(0)
    cuda = engine.config.device.type == "cuda"
    passes: list[tuple[float, bool]] = []  # (seconds, whether it was one token of each of `batch` requests)
    forward = engine.runner.forward

    def timed_forward(chunks, *args, **kwargs):
        t = time.perf_counter()
        out = forward(chunks, *args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        passes.append((time.perf_counter() - t, len(chunks) == batch and all(len(c.tokens) == 1 for c in chunks)))
        return out

    steps: list[tuple[float, float]] = []  # (wall, its pass) of each step that decoded the whole batch
    step = engine.step

    def timed_step():
        t, n = time.perf_counter(), len(passes)
        out = step()
        if len(passes) == n + 1 and passes[n][1]:
            steps.append((time.perf_counter() - t, passes[n][0]))
        return out

    engine.runner.forward, engine.step = timed_forward, timed_step
    prof = cProfile.Profile() if top else None
    if prof:
        prof.enable()
    llm.generate([PROMPT.format(i) for i in range(batch)], params)
    if prof:
        prof.disable()
    if not steps:
        raise SystemExit(f"no step decoded all {batch} requests at once (a KV cache too small for them?)")
    wall = sum(s[0] for s in steps) / len(steps)
    device = sum(s[1] for s in steps) / len(steps)
    print(f"{'SD K=0' if sd else 'AR'}: batch {batch}, a step {1e3 * wall:.2f} ms, its pass {1e3 * device:.2f} ms, "
          f"host {1e3 * (wall - device):.2f} ms ({len(steps)} steps decoding every request)", flush=True)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", help="also SD at K = 0 with this draft")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the host's N costliest functions")
    ap.add_argument("--device")
    args = ap.parse_args()
    options = {"max_num_seqs": args.batch, **({"device": args.device} if args.device else {})}
    for draft in [None] + ([args.draft] if args.draft else []):
        measure(args.model, draft, args.batch, args.tokens, args.profile, **options)


if __name__ == "__main__":
    main()

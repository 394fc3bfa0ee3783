"""The host's share of a decode step at a batch: a step's wall time against the target's passes
in it (on a GPU each pass is synchronised, so it counts the device's time too), for AR and SD
at K = 0 (every round plain decoding: what auto-K does where drafting does not pay), and with
--profile the host's functions that cost most (cProfile, decode steps only).

    python bench/host_profile.py --model M [--draft D] [--batch 64] [--tokens 48] [--profile 20]

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
    passes: list[float] = []
    forward = engine.runner.forward

    def timed_forward(*args, **kwargs):
        t = time.perf_counter()
        out = forward(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        passes.append(time.perf_counter() - t)
        return out

    steps: list[tuple[float, float]] = []  # (wall, passes) of each step
    step = engine.step

    def timed_step():
        t, n = time.perf_counter(), len(passes)
        out = step()
        steps.append((time.perf_counter() - t, sum(passes[n:])))
        return out

    engine.runner.forward, engine.step = timed_forward, timed_step
    prof = cProfile.Profile() if top else None
    llm.generate([PROMPT.format(i) for i in range(batch)], params)  # prompts first, untimed below
    decode = steps[-(tokens - 8):]  # the last steps, where every request decodes
    steps.clear()
    if prof:
        prof.enable()
        llm.generate([PROMPT.format(i) for i in range(batch)], params)
        prof.disable()
        decode = steps[-(tokens - 8):]
    wall = sum(s[0] for s in decode) / len(decode)
    device = sum(s[1] for s in decode) / len(decode)
    print(f"{'SD K=0' if sd else 'AR'}: batch {batch}, a step {1e3 * wall:.2f} ms, its passes {1e3 * device:.2f} ms, "
          f"host {1e3 * (wall - device):.2f} ms ({len(decode)} decode steps)", flush=True)
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

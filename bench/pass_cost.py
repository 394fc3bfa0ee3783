"""Cost of one forward pass of a model as a function of the tokens it scores: T(M) for
M = K+1 (a verify pass) against T(1) (a decode step), on 1 or more threads, in one run.
These are the inputs of the speed-up model in docs/cost-model.md, "The speed-up model"
(T_target(K+1)/T_target(1), c = T_draft(1)/T_target(1), the draft tree's T(B)).

    python bench/pass_cost.py --model qwen2.5-coder-1.5b-instruct --m 1,2,3,4,5,6,7,8,9,16 --threads 2,1
    python bench/pass_cost.py --model qwen2.5-coder-0.5b-instruct --weights int8 --m 1,5,10,15,20 --threads 2,1
    python bench/pass_cost.py --model qwen2.5-coder-0.5b-instruct --m 1,5 --threads 2 --layers op,loop

Each pass scores M new tokens after a 200-token context; the configurations are
interleaved within each repeat, and the best repeat is reported (the host is shared).
"""
import os
import time

import torch

from ssd.bench.script_args import script_parser
from ssd.models.loader import load_model
from ssd.models.names import WEIGHTS
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.store import resolve_model

CONTEXT = 200


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--weights", choices=WEIGHTS, default="auto", help="as LLM(weights=...): auto is the GGUF "
                    "blocks for a GGUF model")
    ap.add_argument("--m", default="1,2,3,4,5,6,7,8,9", help="tokens per pass")
    ap.add_argument("--threads", default="2,1", help="thread counts (pinned to the first cores)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", default="op", help="op: the decoder layers as one CPU op where it applies "
                    "(the engine's default), loop: the Python loop over the layers; op,loop: both, interleaved")
    args = ap.parse_args()
    ms, threads = [int(x) for x in args.m.split(",")], [int(x) for x in args.threads.split(",")]
    layers = args.layers.split(",")
    if not set(layers) <= {"op", "loop"}:
        ap.error("--layers takes op, loop or both")
    model = load_model(resolve_model(args.model), torch.device("cpu"), torch.float32, args.weights)
    cache = PagedKVCache(model.config, CONTEXT + max(ms) + 16, 16, torch.device("cpu"), torch.float32)
    cache.reserve(0, CONTEXT + max(ms))
    runner = ModelRunner(model, cache, torch.device("cpu"))
    runner.forward([Chunk(0, list(range(100, 100 + CONTEXT)), 0, 1)])
    cores = sorted(os.sched_getaffinity(0))

    def timed(m: int, n_threads: int, how: str) -> float:
        os.sched_setaffinity(0, cores[:n_threads])
        torch.set_num_threads(n_threads)
        model.fused_layers = how == "op"
        start = time.perf_counter()
        runner.forward([Chunk(0, list(range(500, 500 + m)), CONTEXT, m)])
        return time.perf_counter() - start

    configs = [(t, how) for t in threads for how in layers]
    best = {(m, c): float("inf") for m in ms for c in configs}
    for _ in range(args.repeats):
        for c in configs:
            timed(1, *c)  # warm the thread pool after a change
            for m in ms:
                best[m, c] = min(best[m, c], timed(m, *c))
    os.sched_setaffinity(0, cores)
    name = f"{args.model} (weights {args.weights})"
    print(f"{name}: one forward pass after {CONTEXT} tokens, best of {args.repeats}, ms (and T(M)/T(1))")
    print("M        " + "".join(f"{t} thread{'s' if t > 1 else '':1} {how:<5}  " for t, how in configs))
    for m in ms:
        print(f"{m:<8} " + "".join(f"{best[m, c] * 1e3:8.1f} ({best[m, c] / best[1, c]:4.2f})" for c in configs))


if __name__ == "__main__":
    main()

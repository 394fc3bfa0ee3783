"""How fast the quantised matmul streams a real model's weights: every matrix of the model on
its GGUF blocks (as the engine loads it), grouped by kind (qkv, o, gate_up, down, lm_head) and
type, each kind timed over all its layers in turn, as a pass reads them; GB/s of packed weights.
A single-token pass is bound by these bytes, so this is what to compare with the machine's
streaming bandwidth (bench/results/README.md, "Weight streaming on AMD").

    python bench/matmul_bandwidth.py --model qwen2.5-coder-1.5b-instruct --m 1,5 --threads 1,2
    python bench/matmul_bandwidth.py --model qwen2.5-coder-0.5b-instruct --weights q4_0

Rows of x are random; the best of --repeats is reported (the host is shared).
"""
import collections
import time

import torch

from ssd.bench.script_args import script_parser
from ssd.layers.linear import QuantLinear
from ssd.models.loader import load_model
from ssd.models.names import WEIGHTS
from ssd.store import resolve_model


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--weights", choices=WEIGHTS, default="auto")
    ap.add_argument("--m", default="1", help="rows of x per call")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model = load_model(resolve_model(args.model), torch.device("cpu"), torch.float32, args.weights)
    kinds: dict[str, list[QuantLinear]] = collections.defaultdict(list)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            kinds[f"{name.rsplit('.', 1)[-1]} {'+'.join(p.qtype.name for p in module.parts)}"].append(module)
    if not kinds:
        ap.error(f"{args.model} has no matrices on GGUF blocks with weights={args.weights}")
    print(f"{args.model} (weights {args.weights}): GB/s of packed weights, best of {args.repeats}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for m in [int(v) for v in args.m.split(",")]:
            total_bytes = total_s = 0.0
            for kind, modules in sorted(kinds.items()):
                x = torch.randn(m, modules[0].in_features)
                s = best_of(args.repeats, lambda: [mod.stack(x) for mod in modules])
                nbytes = sum(p.nbytes for mod in modules for p in mod.parts)
                total_bytes, total_s = total_bytes + nbytes, total_s + s
                print(f"  {threads} thr  M={m:<2} {kind:30} x{len(modules):<3} {s * 1e3:7.2f} ms  {nbytes / s / 1e9:5.1f} GB/s")
            print(f"  {threads} thr  M={m:<2} {'all':30} {total_bytes / 1e9:.3f} GB {total_s * 1e3:6.2f} ms  "
                  f"{total_bytes / total_s / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()

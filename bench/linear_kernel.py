"""The batch-invariant CPU linear kernels on real layer shapes, for the small M of decode
(M=1), verify (M=K+1) and draft trees (M = branches):

    --compare fp32  our fp32 kernel vs F.linear on Qwen2.5-1.5B shapes (the target);
                    needs ~6.5 GB of RAM with the defaults
    --compare int8  our weight-only int8 kernel vs our fp32 one on Qwen2.5-0.5B shapes
                    (the draft); needs ~2.6 GB

Each per-layer shape gets `--layers` separate weight copies (default: the model's layer
count) and a timing cycles through all of them, so the last-level cache does not flatter;
the lm_head is one matrix. "model" is one pass of every layer (qkv, o, gate_up, down) plus
the lm_head, i.e. the matrix part of one forward step. Implementations and M are
interleaved within each repeat; the table gives the best repeat (--stat median for the
median).

    python bench/linear_kernel.py [--compare fp32|int8] [--threads 2] [--repeats 7]
                                  [--m 1,2,3,4] [--variant avx512|avx2|portable]
"""
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssd.bench.script_args import script_parser
from ssd.kernels import linear_cpu, linear_int8_cpu


@dataclass(frozen=True)
class Shapes:
    hidden: int
    inter: int
    kv_dim: int
    layers: int
    vocab: int = 151936

    def per_layer(self) -> dict[str, tuple[int, int]]:  # name: (N, K_in)
        return {"qkv": (self.hidden + 2 * self.kv_dim, self.hidden),
                "o_proj": (self.hidden, self.hidden),
                "gate_up": (2 * self.inter, self.hidden),
                "down": (self.hidden, self.inter)}


# per comparison: model shapes, default M list, default repeats
SETUPS = {"fp32": (Shapes(1536, 8960, 256, 28), "1,2,3,4,5,6,7,8", 7),
          "int8": (Shapes(896, 4864, 128, 24), "1,2,4,5,8,16,24,32", 5)}


def implementations(compare: str, variant: str) -> dict:
    """name: (prepare(fp32 W) -> weight object, call(x, weight object), bytes per weight)."""
    fp32_op = linear_cpu.get_op(variant)
    assert fp32_op is not None, f"fp32 kernel ({variant}) unavailable"
    ours_fp32 = (lambda w: w, lambda x, w: fp32_op(x, w, None), 4)
    if compare == "fp32":
        return {"ours": ours_fp32, "F.linear": (lambda w: w, F.linear, 4)}
    int8_op = linear_int8_cpu.get_op(variant)
    assert int8_op is not None, f"int8 kernel ({variant}) unavailable"
    # 1 byte per weight (+ 4 B of scale per row: noise)
    return {"int8": (linear_int8_cpu.quantize, lambda x, w: int8_op(x, *w, None), 1),
            "fp32": ours_fp32}


def main() -> None:
    ap = script_parser(None, model=None, threads=None)
    ap.add_argument("--compare", choices=list(SETUPS), default="fp32")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="weight copies per layer shape")
    ap.add_argument("--m", default=None, help="comma-separated M values")
    ap.add_argument("--stat", choices=["best", "median"], default="best")
    ap.add_argument("--variant", choices=linear_cpu.VARIANTS, default=None,
                    help="kernel build (default: the best this CPU runs)")
    args = ap.parse_args()
    shapes, default_m, default_repeats = SETUPS[args.compare]
    repeats = args.repeats or default_repeats
    copies = args.layers or shapes.layers
    ms = [int(m) for m in (args.m or default_m).split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    t = time.perf_counter()
    variant = args.variant or linear_cpu.default_variant()
    impls = implementations(args.compare, variant)
    print(f"kernels: {variant}, ready in {time.perf_counter() - t:.1f} s (build or load); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    gen = torch.Generator().manual_seed(0)
    per_layer = shapes.per_layer()

    def weights(n, k, count):  # {impl: [prepared weight per copy]}
        ws = [torch.empty(n, k).uniform_(-0.05, 0.05, generator=gen) for _ in range(count)]
        return {impl: [prep(w) for w in ws] for impl, (prep, _, _) in impls.items()}

    W = {name: weights(n, k, copies) for name, (n, k) in per_layer.items()}
    W["lm_head"] = weights(shapes.vocab, shapes.hidden, 1)
    xs = {(k, m): torch.randn(m, k, generator=gen)
          for k in (shapes.hidden, shapes.inter) for m in ms}

    def run_shape(impl, name, m):
        call, ws = impls[impl][1], W[name][impl]
        x = xs[(per_layer.get(name, (0, shapes.hidden))[1], m)]
        t = time.perf_counter()
        for w in ws:
            call(x, w)
        return (time.perf_counter() - t) / len(ws)

    def run_model(impl, m):
        call = impls[impl][1]
        t0 = time.perf_counter()
        for i in range(copies):
            for name, (_, k) in per_layer.items():
                call(xs[(k, m)], W[name][impl][i])
        t1 = time.perf_counter()
        call(xs[(shapes.hidden, m)], W["lm_head"][impl][0])
        # the layers scaled to the model's count, plus the lm_head once
        return (t1 - t0) * shapes.layers / copies + time.perf_counter() - t1

    names = [*per_layer, "lm_head", "model"]
    times = {}
    with torch.inference_mode():
        for impl in impls:  # warm up (page in)
            run_model(impl, 1)
        for _ in range(repeats):
            for name in names:
                for m in ms:
                    for impl in impls:
                        dt = run_model(impl, m) if name == "model" else run_shape(impl, name, m)
                        times.setdefault((name, m, impl), []).append(dt)

    agg = min if args.stat == "best" else statistics.median
    T = {key: agg(v) for key, v in times.items()}
    elems = {name: n * k for name, (n, k) in per_layer.items()}
    elems["lm_head"] = shapes.vocab * shapes.hidden
    elems["model"] = shapes.layers * sum(elems[s] for s in per_layer) + elems["lm_head"]
    first, second = impls

    print(f"\ntime per call in ms ({args.stat} of {repeats}); GB/s = weight bytes / T; "
          f"T/T1 = T(M)/T(1); {second}/{first} = speed-up of {first}")
    print(f"{'shape':9}{'':13}" + "".join(f"{'M=' + str(m):>8}" for m in ms))

    def row(label, values, fmt):
        print(f"{'':9}{label:13}" + "".join(format(v, fmt) for v in values))

    for name in names:
        n, k = per_layer.get(name, (shapes.vocab, shapes.hidden))
        what = f"{shapes.layers} layers + lm_head" if name == "model" else f"N={n} K={k}"
        print(f"{name} ({what}, {elems[name] / 1e6:.1f} M weights)")
        for impl, (_, _, width) in impls.items():
            t = [T[(name, m, impl)] for m in ms]
            row(impl + " ms", [v * 1e3 for v in t], "8.3f")
            row(impl + " GB/s", [elems[name] * width / v / 1e9 for v in t], "8.1f")
        if 1 in ms:
            for impl in impls:
                row(impl + " T/T1", [T[(name, m, impl)] / T[(name, 1, impl)] for m in ms], "8.2f")
        row(f"{second}/{first}", [T[(name, m, second)] / T[(name, m, first)] for m in ms], "8.2f")


if __name__ == "__main__":
    main()

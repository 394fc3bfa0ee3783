"""The weight-only int8 CPU linear kernel vs the fp32 one (both batch-invariant) on
Qwen2.5-0.5B shapes (the draft model), for the small M of decode (1), verify (K+1) and
draft trees (B branches at once).

Each per-layer shape gets `--layers` separate weight copies (default 24, as in the model)
and a timing cycles through all of them, so the last-level cache does not flatter; the
lm_head is one matrix. "model" is one pass of 24 layers (qkv, o, gate_up, down) plus the
lm_head, i.e. the matrix part of one draft step. Implementations and M are interleaved
within each repeat; the table gives the best repeat (--stat median for the median).
Needs ~2.6 GB of RAM with the defaults.

    python bench/linear_int8.py [--threads 2] [--repeats 5] [--m 1,2,4,5,8,16,24,32]
                                [--variant avx512|avx2|portable]
"""
import argparse
import statistics
import time

import torch

from ssd.kernels import linear_cpu, linear_int8_cpu

HIDDEN, INTER, VOCAB, LAYERS = 896, 4864, 151936, 24
SHAPES = {  # name: (N, K_in)
    "qkv": (HIDDEN + 2 * 128, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=LAYERS, help="weight copies per layer shape")
    ap.add_argument("--m", default="1,2,4,5,8,16,24,32")
    ap.add_argument("--stat", choices=["best", "median"], default="best")
    ap.add_argument("--variant", choices=linear_int8_cpu.VARIANTS, default=None,
                    help="kernel builds (default: the best this CPU runs)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ms = [int(m) for m in args.m.split(",")]

    variant = args.variant or linear_int8_cpu.default_variant()
    int8_op, fp32_op = linear_int8_cpu.get_op(variant), linear_cpu.get_op(variant)
    assert int8_op is not None and fp32_op is not None, f"kernels ({variant}) unavailable"
    print(f"kernels: {variant}; torch {torch.__version__}, {torch.get_num_threads()} threads")

    gen = torch.Generator().manual_seed(0)

    def weights(n, k, copies):  # (fp32 W, int8 Wq, scale) per copy
        out = []
        for _ in range(copies):
            w = torch.empty(n, k).uniform_(-0.05, 0.05, generator=gen)
            out.append((w, *linear_int8_cpu.quantize(w)))
        return out

    W = {name: weights(n, k, args.layers) for name, (n, k) in SHAPES.items()}
    W["lm_head"] = weights(VOCAB, HIDDEN, 1)
    xs = {(k, m): torch.randn(m, k, generator=gen) for k in (HIDDEN, INTER) for m in ms}
    impls = {"int8": lambda x, w: int8_op(x, w[1], w[2], None),
             "fp32": lambda x, w: fp32_op(x, w[0], None)}

    def run_shape(fn, name, m):
        ws = W[name]
        x = xs[(ws[0][0].shape[1], m)]
        t = time.perf_counter()
        for w in ws:
            fn(x, w)
        return (time.perf_counter() - t) / len(ws)

    def run_model(fn, m):
        t0 = time.perf_counter()
        for i in range(args.layers):
            for name in SHAPES:
                fn(xs[(SHAPES[name][1], m)], W[name][i])
        t1 = time.perf_counter()
        fn(xs[(HIDDEN, m)], W["lm_head"][0])
        return (t1 - t0) * LAYERS / args.layers + time.perf_counter() - t1  # 24 layers

    names = [*SHAPES, "lm_head", "model"]
    times = {}
    with torch.inference_mode():
        for fn in impls.values():  # warm up (page in)
            run_model(fn, 1)
        for _ in range(args.repeats):
            for name in names:
                for m in ms:
                    for impl, fn in impls.items():
                        dt = run_model(fn, m) if name == "model" else run_shape(fn, name, m)
                        times.setdefault((name, m, impl), []).append(dt)

    agg = min if args.stat == "best" else statistics.median
    T = {key: agg(v) for key, v in times.items()}
    elems = {name: n * k for name, (n, k) in SHAPES.items()}
    elems["lm_head"] = VOCAB * HIDDEN
    elems["model"] = LAYERS * sum(elems[s] for s in SHAPES) + elems["lm_head"]
    width = {"int8": 1, "fp32": 4}  # weight bytes per element (+ 4 B per row of scale: noise)

    print(f"\ntime per call in ms ({args.stat} of {args.repeats}); GB/s = weight bytes / T; "
          "T/T1 = T(M)/T(1); fp32/int8 = speed-up")
    head = "".join(f"{'M=' + str(m):>8}" for m in ms)
    print(f"{'shape':9}{'':11}{head}")

    def row(label, values, fmt):
        print(f"{'':9}{label:11}" + "".join(format(v, fmt) for v in values))

    for name in names:
        n_k = f"N={SHAPES[name][0]} K={SHAPES[name][1]}" if name in SHAPES else (
            f"N={VOCAB} K={HIDDEN}" if name == "lm_head" else f"{LAYERS} layers + lm_head")
        print(f"{name} ({n_k}, {elems[name] / 1e6:.1f} M weights)")
        for impl in impls:
            t = [T[(name, m, impl)] for m in ms]
            row(impl + " ms", [v * 1e3 for v in t], "8.3f")
            row(impl + " GB/s", [elems[name] * width[impl] / v / 1e9 for v in t], "8.1f")
        for impl in impls:
            if 1 in ms:
                row(impl + " T/T1", [T[(name, m, impl)] / T[(name, 1, impl)] for m in ms], "8.2f")
        row("fp32/int8", [T[(name, m, "fp32")] / T[(name, m, "int8")] for m in ms], "8.2f")


if __name__ == "__main__":
    main()

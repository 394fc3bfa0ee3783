"""The batch-invariant CPU linear kernel vs F.linear on Qwen2.5-1.5B shapes, fp32, for the
small M of decode (M=1) and verify (M=K+1), on weights large enough to be DRAM-bound.

Each per-layer shape gets `--layers` separate weight copies (default 28, as in the model)
and a timing cycles through all of them, so the 32 MiB L3 does not flatter; the lm_head
(0.93 GB) is one matrix. "model" is one pass of 28 layers (qkv, o, gate_up, down) plus the
lm_head, i.e. the matrix part of one decode/verify step. Implementations and M are
interleaved within each repeat; the table gives the best repeat (--stat median for the
median). Needs ~6.5 GB of RAM with the defaults.

    python bench/linear_kernel.py [--threads 2] [--repeats 7] [--m 1,2,3,4,5,6,7,8]
                                  [--variant avx512|avx2|portable]
"""
import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from ssd.kernels import linear_cpu

HIDDEN, INTER, VOCAB, LAYERS = 1536, 8960, 151936, 28
SHAPES = {  # name: (N, K_in)
    "qkv": (HIDDEN + 2 * 256, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=LAYERS, help="weight copies per layer shape")
    ap.add_argument("--m", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--stat", choices=["best", "median"], default="best")
    ap.add_argument("--variant", choices=linear_cpu.VARIANTS, default=None,
                    help="kernel build (default: the best this CPU runs)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ms = [int(m) for m in args.m.split(",")]

    t = time.perf_counter()
    variant = args.variant or linear_cpu.default_variant()
    assert linear_cpu.get_op(variant) is not None, f"kernel {variant} unavailable"
    print(f"kernel: {variant}, ready in {time.perf_counter() - t:.1f} s "
          f"(build or load); torch {torch.__version__}, {torch.get_num_threads()} threads")

    gen = torch.Generator().manual_seed(0)

    def weights(n, k, copies):
        return [torch.empty(n, k).uniform_(-0.05, 0.05, generator=gen) for _ in range(copies)]

    W = {name: weights(n, k, args.layers) for name, (n, k) in SHAPES.items()}
    W["lm_head"] = weights(VOCAB, HIDDEN, 1)
    xs = {(k, m): torch.randn(m, k, generator=gen) for k in (HIDDEN, INTER) for m in ms}
    impls = {"ours": functools.partial(linear_cpu.linear, variant=variant), "F.linear": F.linear}

    def run_shape(fn, name, m):
        ws = W[name]
        x = xs[(ws[0].shape[1], m)]
        t = time.perf_counter()
        for w in ws:
            fn(x, w)
        return (time.perf_counter() - t) / len(ws)

    def run_model(fn, m):
        t = time.perf_counter()
        for i in range(args.layers):
            for name in SHAPES:
                fn(xs[(SHAPES[name][1], m)], W[name][i])
        fn(xs[(HIDDEN, m)], W["lm_head"][0])
        return (time.perf_counter() - t) * LAYERS / args.layers  # scaled to 28 layers

    names = [*SHAPES, "lm_head", "model"]
    times = {}
    with torch.inference_mode():
        for fn in impls.values():  # warm up (page in, build)
            run_model(fn, 1)
        for _ in range(args.repeats):
            for name in names:
                for m in ms:
                    for impl, fn in impls.items():
                        dt = run_model(fn, m) if name == "model" else run_shape(fn, name, m)
                        times.setdefault((name, m, impl), []).append(dt)

    agg = min if args.stat == "best" else statistics.median
    T = {key: agg(v) for key, v in times.items()}
    bytes_ = {name: n * k * 4 for name, (n, k) in SHAPES.items()}
    bytes_["lm_head"] = VOCAB * HIDDEN * 4
    bytes_["model"] = LAYERS * sum(bytes_[s] for s in SHAPES) + bytes_["lm_head"]

    print(f"\ntime per call in ms ({args.stat} of {args.repeats}); ratio = T(M)/T(1); "
          "GB/s = weight bytes / T(1)")
    head = "".join(f"{'M=' + str(m):>8}" for m in ms)
    print(f"{'shape':9}{'impl':9}{head}{'GB/s@1':>9}")
    for name in names:
        n_k = f"N={SHAPES[name][0]} K={SHAPES[name][1]}" if name in SHAPES else (
            f"N={VOCAB} K={HIDDEN}" if name == "lm_head" else f"{LAYERS} layers + lm_head")
        print(f"{name} ({n_k}, {bytes_[name] / 1e6:.0f} MB)")
        for impl in impls:
            row = [T[(name, m, impl)] for m in ms]
            gbs = bytes_[name] / T[(name, 1, impl)] / 1e9 if 1 in ms else float("nan")
            print(f"{'':9}{impl:9}" + "".join(f"{t * 1e3:8.2f}" for t in row) + f"{gbs:9.1f}")
        for impl in impls:
            if 1 in ms:
                t1 = T[(name, 1, impl)]
                ratios = [T[(name, m, impl)] / t1 for m in ms]
                print(f"{'':9}{'T/T1 ' + impl[:4]:9}" + "".join(f"{r:8.2f}" for r in ratios))
        ratios = [T[(name, m, "ours")] / T[(name, m, "F.linear")] for m in ms]
        print(f"{'':9}{'ours/F':9}" + "".join(f"{r:8.2f}" for r in ratios))


if __name__ == "__main__":
    main()

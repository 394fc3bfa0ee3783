"""The batch-invariant CPU attention kernel (ssd/kernels/attention_cpu.py) vs torch SDPA as the
engine's fallback calls it (Attention._sdpa: gather of the keys and values through the slot
rows, padded queries, boolean mask), fp32, on the head shapes of SmolLM2-135M (H=9, G=3,
D=64) and Qwen2.5-1.5B (H=12, G=2, D=128).

Cases:
  prefill T      one sequence, a causal chunk of T new tokens at the start of the context
  chunk T+P      a causal chunk of T tokens after P cached ones (chunked prefill)
  decode BxS     B sequences, one query each, over S keys
  verify TxS     one sequence, T causal queries (K+1 of a verification) ending at key S

The KV cache is paged (blocks of 16 slots in a shuffled order), as in the engine. The
attention-mask bookkeeping (AttentionBatch.padded) is computed once outside the timing, as
the engine does once per step for all layers. Implementations and cases are interleaved
within each repeat; the table gives the fastest single call over all repeats (a call that
had to wait for a busy core is noise, not kernel time).

    python bench/attention_kernel.py [--threads 2] [--repeats 5] [--quick]
                                     [--variant avx512|avx2|portable] [--cases prefill,decode]
"""
import time
import types

import torch

from ssd.bench.script_args import script_parser
from ssd.kernels import attention_cpu
from ssd.kernels.build import VARIANTS, default_variant
from ssd.layers.attention import Attention, AttentionBatch

HEADS = {"smollm": (9, 3, 64), "qwen1.5b": (12, 2, 128)}
BLOCK = 16


def make_case(kind: str, n: int, s: int, heads: tuple[int, int, int], seed: int = 0):
    """Tensors for one case: (q, k_cache, v_cache, batch)."""
    h, g, d = heads
    gen = torch.Generator().manual_seed(seed)
    if kind in ("prefill", "chunk", "verify"):  # one row, n causal queries ending at key s
        lens = [s]
        q_row = torch.zeros(n, dtype=torch.long)
        q_len = torch.arange(s - n + 1, s + 1)
    else:  # decode: n rows of s keys, one query each
        lens = [s] * n
        q_row = torch.arange(n)
        q_len = torch.full((n,), s, dtype=torch.long)
    blocks = [(x + BLOCK - 1) // BLOCK for x in lens]
    nslots = (sum(blocks) + 1) * BLOCK
    perm = torch.randperm(nslots // BLOCK, generator=gen)
    rows = torch.zeros(len(lens), max(blocks) * BLOCK, dtype=torch.long)
    i = 0
    for r, nb in enumerate(blocks):
        bl = perm[i:i + nb]
        i += nb
        rows[r, :nb * BLOCK] = (bl[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
    rows = rows[:, :max(lens)].contiguous()
    k_cache = torch.randn(nslots, g, d, generator=gen)
    v_cache = torch.randn(nslots, g, d, generator=gen)
    q = torch.randn(n, h, d, generator=gen)
    batch = AttentionBatch(torch.zeros(n, dtype=torch.long), rows, q_row, q_len)
    batch.padded  # noqa: B018 (cached, once per step in the engine)
    return q, k_cache, v_cache, batch


def sdpa_fn(heads):
    h, _, d = heads
    layer = types.SimpleNamespace(num_heads=h, head_dim=d)
    return lambda q, kc, vc, b: Attention._sdpa(layer, q, kc, vc, b)


def ours_fn(heads, variant):
    d = heads[2]
    return lambda q, kc, vc, b: attention_cpu.attention(q, kc, vc, b.rows, b.q_row, b.q_len,
                                                        d ** -0.5, variant=variant)


def cases(args):
    out = []
    for hname, heads in HEADS.items():
        if "prefill" in args.cases:
            for t in ((148, 512) if args.quick else (148, 512, 1024, 2048)):
                out.append((f"prefill {t}", hname, heads, ("prefill", t, t)))
            if not args.quick:
                out.append(("chunk 512+1536", hname, heads, ("chunk", 512, 2048)))
        if "decode" in args.cases:
            for b, s in ((1, 512), (1, 2000), (1, 4096), (4, 2000)):
                out.append((f"decode {b}x{s}", hname, heads, ("decode", b, s)))
            for t, s in ((5, 2000), (8, 4096)):
                out.append((f"verify {t}x{s}", hname, heads, ("verify", t, s)))
    return out


def timeit(fn, data, budget=0.03, min_calls=3):
    """Seconds of the fastest single call among those made within `budget` seconds (at
    least min_calls): on shared cores a call that waited for its second thread is noise."""
    best, n, t_end = float("inf"), 0, time.perf_counter() + budget
    while n < min_calls or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn(*data)
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def main() -> None:
    ap = script_parser(None, model=None, threads=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer prefill lengths")
    ap.add_argument("--cases", default="prefill,decode")
    ap.add_argument("--variant", choices=VARIANTS, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variant = args.variant or default_variant()
    t = time.perf_counter()
    assert attention_cpu.available(variant), f"kernel {variant} unavailable"
    print(f"kernel: {variant}, ready in {time.perf_counter() - t:.1f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")

    todo = cases(args)
    data = {i: make_case(*c[3][:1], c[3][1], c[3][2], c[2]) for i, c in enumerate(todo)}
    impls = {i: {"ours": ours_fn(c[2], variant), "sdpa": sdpa_fn(c[2])} for i, c in enumerate(todo)}
    times: dict = {}
    with torch.inference_mode():
        for i in data:  # warm up, and check the two agree
            a, b = (impls[i][k](*data[i]) for k in ("ours", "sdpa"))
            err = (a - b).abs().max().item()
            assert err < 1e-4, (todo[i][:2], err)
        for _ in range(args.repeats):
            for i in data:
                for name, fn in impls[i].items():
                    times.setdefault((i, name), []).append(timeit(fn, data[i]))
    print(f"\nms per call (fastest call, {args.repeats} repeats); ratio = ours / sdpa")
    print(f"{'case':16}{'heads (H,G,D)':18}{'ours':>9}{'sdpa':>9}{'ratio':>8}")
    for i, (name, hname, heads, _) in enumerate(todo):
        o, s = min(times[(i, 'ours')]), min(times[(i, 'sdpa')])
        print(f"{name:16}{hname + ' ' + str(heads):18}{o * 1e3:9.3f}{s * 1e3:9.3f}{o / s:8.2f}")


if __name__ == "__main__":
    main()

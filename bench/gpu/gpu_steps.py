"""Decode and verify steps of a random-weight Llama-3.1-8B-shaped model on one GPU: eager
against captured (CUDA graphs), the bandwidth ceiling, host time per step, batch invariance
and greedy exactness. Random weights: speed does not depend on their values, and greedy
equality holds for any weights (the GPU goals are stated on these shapes).

    python bench/gpu/gpu_steps.py [--layers 32] [--context 512] [--out DIR]

Prints a table last; writes results.json under --out.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ssd.kernels import attention_triton
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner

from shapes import SHAPES

DEV = "cuda"  # --device cpu: a smoke run of this script's code on a CPU (no figures)



def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


class Event:
    """torch.cuda.Event(enable_timing=True), or a host clock on the CPU."""

    def __init__(self):
        self.cuda = torch.cuda.Event(enable_timing=True) if DEV == "cuda" else None
        self.t = 0.0

    def record(self):
        self.cuda.record() if self.cuda else setattr(self, "t", time.perf_counter())

    def synchronize(self):
        if self.cuda:
            self.cuda.synchronize()

    def elapsed_time(self, end: "Event") -> float:
        return self.cuda.elapsed_time(end.cuda) if self.cuda else (end.t - self.t) * 1e3


def sync_time(fn, repeat: int) -> list[float]:
    """Wall seconds of fn() with the GPU drained before and after each call."""
    out = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes read plus written per second of a device-to-device copy."""
    a = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    a.random_()
    b.copy_(a)
    start, end = Event(), Event()
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * gib * 2**30 / statistics.median(times)


def build(shape: str, layers: int | None = None) -> DecoderLM:
    """A random model of SHAPES[shape] (with `layers` layers if given) on DEV, bf16 on CUDA."""
    cfg = ModelConfig.from_dict({**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16 if DEV == "cuda" else torch.float32)
    with torch.device(DEV):
        model = DecoderLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = model.to(DEV).eval()
    with torch.no_grad():  # logits with a spread: a random model's greedy path then has few near-ties
        model.embed_tokens.weight.normal_(0, 1)
    return model


def weight_bytes(model: DecoderLM) -> int:
    """Bytes a decode step must read: every matrix, and one embedding row."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return total + model.config.hidden_size * 2


def attention_check() -> dict:
    """The Triton kernel against SDPA in float64 on the CPU, bf16 and fp32 on the GPU."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        slots, kvh, group, d = 4096, 8, 4, 128
        kc, vc = (torch.randn(slots, kvh, d, generator=g) for _ in range(2))
        rows = torch.stack([torch.randperm(slots, generator=g)[:3000] for _ in range(4)])
        q_row = torch.tensor([0, 0, 1, 2, 3, 3, 3])
        q_len = torch.tensor([1, 700, 3000, 64, 65, 2999, 1500])
        q = torch.randn(len(q_row), kvh * group, d, generator=g)
        dev = lambda x: x.to(DEV) if x.is_floating_point() is False else x.to(DEV, dtype)  # noqa: E731
        o = attention_triton.attention(dev(q), dev(kc), dev(vc), rows.to(DEV), q_row.to(DEV), q_len.to(DEV), d ** -0.5)
        ref = []
        for t in range(len(q_row)):
            sl = rows[q_row[t], :q_len[t]]
            k = kc[sl].double().repeat_interleave(group, 1)
            v = vc[sl].double().repeat_interleave(group, 1)
            x = torch.einsum("hd,nhd->hn", q[t].double(), k) * d ** -0.5
            ref.append(torch.einsum("hn,nhd->hd", x.softmax(-1), v))
        ref = torch.stack(ref)
        out[str(dtype)] = ((o.double().cpu() - ref).norm() / ref.norm()).item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512, help="tokens in the cache before the timed steps")
    ap.add_argument("--long-context", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("bench-out/gpu-steps"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    global DEV
    DEV = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke run)", "torch": torch.__version__,
                 "triton": getattr(attention_triton.triton, "__version__", None), "layers": args.layers}
    res["copy_bytes_per_s"] = bw = copy_bandwidth(4.0 if DEV == "cuda" else 0.1)
    res["attention_rel_err"] = attention_check() if DEV == "cuda" else {}
    print("attention rel err", res["attention_rel_err"], flush=True)

    model = build("llama3.1-8b", args.layers)
    res["weight_bytes"] = wb = weight_bytes(model)
    res["floor_s"] = floor = wb / bw
    cfg = model.config
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    cache = PagedKVCache(cfg, 16384, 16, torch.device(DEV), dtype)
    dev = torch.device(DEV)
    eager = ModelRunner(model, cache, dev)
    exact = ModelRunner(model, cache, dev, [16], max_keys=8192)  # the engine's default target
    fast = ModelRunner(model, cache, dev, [1, 2, 4, 8, 16, 32], max_keys=8192)  # a bucket per size
    gen = torch.Generator().manual_seed(2)
    ctx = args.context
    prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=gen).tolist()
    cache.reserve(0, 8192)
    logits = eager.forward([Chunk(0, prompt, 0, 1)])
    first = int(logits.argmax())

    def step(runner: ModelRunner, rows: int, at: int = ctx, read: bool = True):
        def fn():
            out = runner.forward([Chunk(0, [first] * rows, at, rows)])
            if read:
                out.argmax(-1).tolist()  # what an engine does with each step's logits
        return fn

    table = []

    def timed(name: str, fn, rows: int) -> float:
        fn()
        fn()  # capture, warm-up
        t = statistics.median(sync_time(fn, args.repeat))
        table.append((name, rows, t))
        print(f"{name:32s} rows {rows:3d}  {t * 1e3:8.3f} ms", flush=True)
        return t

    t_eager = timed("eager decode", step(eager, 1), 1)
    t_fast1 = timed("graph decode (bucket 1)", step(fast, 1), 1)
    t_exact1 = timed("graph decode (bucket 16, exact)", step(exact, 1), 1)
    verify = {}
    for k in range(1, 8):
        verify[k] = timed(f"graph verify K={k} (bucket {k + 1}+)", step(fast, k + 1), k + 1)
    timed("graph verify K=7 (bucket 16, exact)", step(exact, 8), 8)
    timed("graph 16 rows (bucket 16)", step(exact, 16), 16)
    timed("graph 32 rows (bucket 32)", step(fast, 32), 32)
    timed("eager 16 rows", step(eager, 16), 16)

    # Device time of one replay (no host work) and the host's share of a step.
    graph = exact.steps.graphs[(16, True)][0]
    replay_once = graph.replay if graph is not None else lambda: exact.steps._forward(16, True)  # noqa: SLF001
    start, end = Event(), Event()
    start.record()
    for _ in range(args.repeat):
        replay_once()
    end.record()
    end.synchronize()
    replay = start.elapsed_time(end) / 1e3 / args.repeat
    res["replay_s_bucket16"] = replay
    host = statistics.median([t for t in sync_time(lambda: exact.forward([Chunk(0, [first], ctx, 1)]), args.repeat)])
    res["host_s_bucket16"] = host - replay
    print(f"replay (bucket 16) {replay * 1e3:.3f} ms; step wall {host * 1e3:.3f} ms; host share "
          f"{(host - replay) * 1e6:.0f} us", flush=True)
    long = args.long_context
    cache.reserve(0, long + 64)
    fill = torch.randint(0, cfg.vocab_size, (long - ctx,), generator=gen).tolist()
    for i in range(0, len(fill), 512):
        eager.forward([Chunk(0, fill[i:i + 512], ctx + i, 1)])
    t_long = timed(f"graph decode at {long} (bucket 16)", step(exact, 1, at=long), 1)

    # Batch invariance: a token's logits in a decode step and in a verify pass of 8 rows.
    def logits_at(runner, tokens, at):
        return runner.forward([Chunk(0, tokens, at, len(tokens))]).float().cpu()
    toks = torch.randint(0, cfg.vocab_size, (8,), generator=gen).tolist()
    cache.truncate(0, ctx)
    cache.reserve(0, ctx + 16)
    inv = {}
    for name, runner in (("exact bucket 16", exact), ("bucket per size", fast), ("eager", eager)):
        together = logits_at(runner, toks, ctx)
        alone = torch.cat([logits_at(runner, [t], ctx + i) for i, t in enumerate(toks)])
        inv[name] = {"bit_equal": bool(torch.equal(together, alone)),
                     "max_abs_diff": float((together - alone).abs().max()),
                     "argmax_equal": bool(torch.equal(together.argmax(-1), alone.argmax(-1)))}
    # Across buckets: the same 8 tokens beside another sequence's 20, 56 or 120 (buckets 32, 64,
    # 128): does cuBLAS give them the bits of the 16-row bucket? (Not promised: other row counts.)
    multi = ModelRunner(model, cache, dev, [16, 32, 64, 128], max_keys=8192)
    cache.reserve(1, 256)
    base = logits_at(multi, toks, ctx)
    for extra in (20, 56, 120):
        other = Chunk(1, torch.randint(0, cfg.vocab_size, (extra,), generator=gen).tolist(), 0, extra)
        both = multi.forward([Chunk(0, toks, ctx, 8), other]).float().cpu()[:8]
        inv[f"bucket 16 vs {8 + extra} rows"] = {"bit_equal": bool(torch.equal(both, base)),
                                                 "max_abs_diff": float((both - base).abs().max()),
                                                 "argmax_equal": bool(torch.equal(both.argmax(-1), base.argmax(-1)))}
    cache.release(1)
    res["invariance"] = inv
    print("invariance", inv, flush=True)

    # Greedy AR with each runner, then SD-style verify passes of 5 rows fed AR's own tokens
    # (forced acceptance): every row's argmax must be AR's next token.
    def ar(runner, n=64):
        cache.truncate(0, ctx)
        cache.reserve(0, ctx + n + 8)
        out, tok = [], first
        for i in range(n):
            tok = int(runner.forward([Chunk(0, [tok], ctx + i, 1)]).argmax())
            out.append(tok)
        return out
    ref = ar(eager)
    greedy = {"eager==graph exact": ar(exact) == ref, "eager==graph bucket 1": ar(fast) == ref}
    path = ar(exact)
    cache.truncate(0, ctx)
    cache.reserve(0, ctx + 72)
    seq = [first] + path
    sd = []
    for i in range(0, 60, 5):
        sd += runner_argmax(exact, seq[i:i + 5], ctx + i)
    greedy["sd(verify 5, exact)==ar(exact)"] = sd == path[:60]
    res["greedy"] = greedy
    print("greedy", greedy, flush=True)

    res["steps"] = [{"name": n, "rows": r, "seconds": t} for n, r, t in table]
    res["summary"] = {
        "eager_tok_s": 1 / t_eager, "graph_bucket1_tok_s": 1 / t_fast1, "graph_exact_tok_s": 1 / t_exact1,
        "bandwidth_share_bucket1": floor / t_fast1, "bandwidth_share_exact": floor / t_exact1,
        "exact_over_bucket1": t_exact1 / t_fast1,
        "verify_over_decode": {k: v / t_fast1 for k, v in verify.items()},
        "decode_long_over_short": t_long / t_exact1}
    (args.out / "results.json").write_text(json.dumps(res, indent=2))
    s = res["summary"]
    print(f"\n{res['gpu']}, {args.layers} layers of Llama-3.1-8B's shapes, bf16, context {ctx}")
    print(f"copy {bw / 1e12:.2f} TB/s, weights {wb / 1e9:.2f} GB, floor {floor * 1e3:.2f} ms/step")
    print(f"eager {s['eager_tok_s']:.1f} tok/s | graph bucket 1 {s['graph_bucket1_tok_s']:.1f} tok/s "
          f"({s['bandwidth_share_bucket1']:.0%} of the floor) | exact bucket 16 {s['graph_exact_tok_s']:.1f} tok/s "
          f"({s['bandwidth_share_exact']:.0%}; {s['exact_over_bucket1']:.3f}x bucket 1's step)")
    print("verify(K+1)/decode(1): " + ", ".join(f"K={k} {v:.3f}" for k, v in s["verify_over_decode"].items()))
    print(f"host share of an exact step {res['host_s_bucket16'] * 1e6:.0f} us;"
          f" decode at {long} / at {ctx}: {s['decode_long_over_short']:.3f}")


def runner_argmax(runner: ModelRunner, tokens: list[int], at: int) -> list[int]:
    return runner.forward([Chunk(0, tokens, at, len(tokens))]).argmax(-1).tolist()


if __name__ == "__main__":
    main()

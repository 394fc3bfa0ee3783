"""Where a captured step's time goes on a GPU, for the shapes the GPU runs use (bench/gpu/shapes.py):
a replay's device time, an engine-like step's wall (the pass, then its argmax read on the host),
the kernels a step launches and their device time by name, and the host's calls
(torch.profiler). Random bf16 weights: speed does not depend on their values.

    python bench/gpu/gpu_profile.py [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--out DIR]

Prints a table last; writes results.json and one profiler table per shape under --out.
"""
import argparse
import gc
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import gpu_steps
from gpu_steps import Event, build, copy_bandwidth, sync, sync_time, weight_bytes
from ssd.kernels import fused_triton
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner


def fused_add_check() -> dict | None:
    """The fused residual add + RMSNorm against torch's add and the plain norm kernel, bf16."""
    if not hasattr(fused_triton, "add_rms_norm"):
        return None  # code from before it
    g = torch.Generator(device="cuda").manual_seed(5)
    x, h = (torch.randn(16, 4096, generator=g, device="cuda").bfloat16() for _ in range(2))
    w = torch.randn(4096, generator=g, device="cuda")
    total, y = fused_triton.add_rms_norm(x, h * 0.01, w, 1e-5)
    return {"sum_bits_equal": bool(torch.equal(total, x + h * 0.01)),
            "norm_bits_equal": bool(torch.equal(y, fused_triton.rms_norm(x + h * 0.01, w, 1e-5)))}


def measure(shape: str, bandwidth: float, ctx: int, repeat: int, out: Path) -> dict:
    model = build(shape)
    cfg = model.config
    cache = PagedKVCache(cfg, 8192, 16, torch.device("cuda"), torch.bfloat16)
    runner = ModelRunner(model, cache, torch.device("cuda"), [1, 2, 4, 8, 16], max_keys=4096)
    eager = ModelRunner(model, cache, torch.device("cuda"))
    prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=torch.Generator().manual_seed(2)).tolist()
    cache.reserve(0, ctx + 80)
    first = int(eager.forward([Chunk(0, prompt, 0, 1)]).argmax())
    res = {"shape": shape, "weight_bytes": weight_bytes(model), "layers": cfg.num_layers}
    res["floor_s"] = res["weight_bytes"] / bandwidth

    def step(rows: int):
        return lambda: runner.forward([Chunk(0, [first] * rows, ctx, rows)]).argmax(-1).tolist()

    for rows in (1, 16):
        step(rows)()
        step(rows)()  # capture, warm-up
        res[f"step_s_{rows}"] = statistics.median(sync_time(step(rows), repeat))
        graph = runner.steps.graphs[(rows, True)][0]
        start, end = Event(), Event()
        start.record()
        for _ in range(repeat):
            graph.replay()
        end.record()
        end.synchronize()
        res[f"replay_s_{rows}"] = start.elapsed_time(end) / 1e3 / repeat
    res["host_s_1"] = res["step_s_1"] - res["replay_s_1"]

    # The engine's greedy AR pattern on its target's one bucket of 16 rows: a pass, its argmax
    # read on the host, the next pass fed that token. Wall per token over the replay's device time.
    exact = ModelRunner(model, cache, torch.device("cuda"), [16], max_keys=4096)
    exact.forward([Chunk(0, [first], ctx, 1)])  # capture

    def ar_loop(n: int = 64):
        cache.truncate(0, ctx)
        cache.reserve(0, ctx + 80)
        tok = first
        for i in range(n):
            tok = int(exact.forward([Chunk(0, [tok], ctx + i, 1)]).argmax())
    ar_loop(8)
    res["ar_token_s"] = statistics.median(sync_time(ar_loop, 3)) / 64
    res["ar_host_s"] = res["ar_token_s"] - res["replay_s_16"]

    # Kernels: a profile of 10 engine-like decode steps through the graph, and of one eager pass.
    n = 10
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step(1)()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    res["kernels_per_step"] = len(kernels) / n
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_eager:
        eager.forward([Chunk(0, [first], ctx, 1)]).argmax(-1).tolist()
        sync()
    res["eager_kernels_per_step"] = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof_eager.events())
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    res["kernels"] = sorted(({"name": k, "per_step": len(v) / n, "us_per_step": sum(v) / n} for k, v in by_name.items()),
                            key=lambda r: -r["us_per_step"])
    (out / f"profile-{shape}.txt").write_text(
        "graph decode steps, by host time:\n"
        + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
        + "\n\nby device time:\n"
        + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        + "\n\none eager pass, by device time:\n"
        + prof_eager.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,llama3.2-1b,llama3.1-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("bench-out/gpu-profile"))
    args = ap.parse_args()
    gpu_steps.DEV = "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "fused_add": fused_add_check()}
    res["copy_bytes_per_s"] = bw = copy_bandwidth(4.0)
    print("fused add check", res["fused_add"], flush=True)
    res["shapes"] = []
    for shape in args.shapes.split(","):
        r = measure(shape, bw, args.context, args.repeat, args.out)
        res["shapes"].append(r)
        gc.collect()  # the last shape's model, cache and graphs went with measure()'s frame
        torch.cuda.empty_cache()
        print(f"{shape}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in r.items() if k.endswith("_s") or "_s_" in k)
              + f", kernels/step {r['kernels_per_step']:.0f} (eager {r['eager_kernels_per_step']})", flush=True)
        for k in r["kernels"][:8]:
            print(f"    {k['us_per_step']:8.1f} us  x{k['per_step']:5.1f}  {k['name']}", flush=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=2))
    print(f"\n{res['gpu']}, copy {bw / 1e12:.2f} TB/s, bf16, batch 1, {args.context} tokens cached")
    print("| shape | GB | floor ms | replay 1 ms | replay 16 ms | step 1 ms | host ms | AR token ms | AR host ms | "
          "kernels/step | floor/replay 1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["shapes"]:
        print(f"| {r['shape']} | {r['weight_bytes'] / 1e9:.2f} | {r['floor_s'] * 1e3:.3f} | {r['replay_s_1'] * 1e3:.3f} | "
              f"{r['replay_s_16'] * 1e3:.3f} | {r['step_s_1'] * 1e3:.3f} | {r['host_s_1'] * 1e3:.3f} | "
              f"{r['ar_token_s'] * 1e3:.3f} | {r['ar_host_s'] * 1e3:.3f} | "
              f"{r['kernels_per_step']:.0f} | {r['floor_s'] / r['replay_s_1']:.0%} |")


if __name__ == "__main__":
    main()

"""One model file, this engine against llama.cpp at equal threads: load time, peak memory, decode
speed (AR) and the cost of a verify pass, T(5)/T(1) and T(9)/T(1), beside llama.cpp's own
pp5 / tg ratio (what scoring 5 tokens costs it against one).

    python bench/models_vs_llamacpp.py --model gemma3-270m --llama-bin DIR --out bench-out/models/gemma3-270m.json
    python bench/models_vs_llamacpp.py --model /tmp/qwen3-30b-a3b-shapes.gguf --llama-bin DIR --tokens 32

Each side runs in a process of its own (its peak RSS is its own); ours decodes --tokens tokens
after a short prompt (decode rate: tokens after the first over the decode time), llama-bench
runs tg and pp5 at depth 0, --repeats times (each side's best run is reported); our T(M) is a pass of M tokens from position 0
(ModelRunner.timed_pass), so both ratios are at the same depth. Load times are with the file in the page cache
unless --cold (drops the page cache before each side: needs root).
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from ssd.bench.script_args import script_parser

PROMPT = "The history of the city of Rome"


def ours(model: str, threads: int, tokens: int) -> dict:
    from ssd import LLM, SamplingParams
    from ssd.models import pack_cache
    t0 = time.perf_counter()
    llm = LLM(model, threads=threads)
    load = time.perf_counter() - t0
    writing = pack_cache.writing()  # a first load: its packed matrices are being kept
    pack_cache.wait()  # (not timed: the load is done; the decode below should not share the disk)
    llm.generate(PROMPT, SamplingParams.greedy(max_tokens=4, ignore_eos=True))
    rates = []
    for _ in range(2):
        m = llm.generate(PROMPT, SamplingParams.greedy(max_tokens=tokens, ignore_eos=True))[0].metrics
        rates.append((m.output_tokens - 1) / m.decode_s)
    runner = llm.engine.runner
    passes = {m: runner.timed_pass(m, repeat=3) for m in (1, 5, 9)}
    llm.close()
    return {"load_s": load, "packed_cache": "written" if writing else "read or off", "decode_tok_s": max(rates), "T1_s": passes[1], "T5_over_T1": passes[5] / passes[1],
            "T9_over_T1": passes[9] / passes[1], "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def llamacpp(binary: Path, file: Path, threads: int, tokens: int, repeats: int) -> dict:
    t0 = time.perf_counter()
    subprocess.run([binary, "-m", file, "-t", str(threads), "-p", "0", "-n", "1", "-r", "1"], check=True,
                   capture_output=True)
    load = time.perf_counter() - t0  # loading the file and one token
    out = subprocess.run(["/usr/bin/time", "-f", "%M", binary, "-m", file, "-t", str(threads), "-p", "5", "-n",
                          str(tokens), "-r", str(repeats), "-o", "json"], check=True, capture_output=True, text=True)
    rows = json.loads(out.stdout)
    # The best repetition, as ours is the best of its runs (the host is shared).
    rate = {("pp" if r["n_prompt"] else "tg"): max(r["samples_ts"]) for r in rows}
    return {"load_and_one_token_s": load, "tg_tok_s": rate["tg"], "pp5_tok_s": rate["pp"],
            "pp5_over_tg_time": 5 / rate["pp"] / (1 / rate["tg"]),
            "peak_rss_gb": int(out.stderr.strip().splitlines()[-1]) / 1e6}


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> None:
    ap = script_parser(__doc__, whole_doc=True, model=None, threads=2, out=True)
    ap.add_argument("--model", required=True, help="a store name or a .gguf file")
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's bin folder (../shared/tools/build-llamacpp.sh)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--side", choices=["ours"], help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.side == "ours":
        print(json.dumps(ours(args.model, args.threads, args.tokens)))
        return
    from ssd.store import REGISTRY, gguf_path
    file = gguf_path(args.model) if args.model in REGISTRY else Path(args.model)
    if args.cold:
        drop_caches()
    child = subprocess.run([sys.executable, __file__, "--side", "ours", "--model", args.model, "--llama-bin",
                            str(args.llama_bin), "--threads", str(args.threads), "--tokens", str(args.tokens)],
                           check=True, capture_output=True, text=True)
    result = {"model": args.model, "file_gb": file.stat().st_size / 1e9, "threads": args.threads,
              "cold": args.cold, "ours": json.loads(child.stdout.strip().splitlines()[-1])}
    if args.cold:
        drop_caches()
    result["llamacpp"] = llamacpp(args.llama_bin / "llama-bench", file, args.threads, args.tokens, args.repeats)
    o, c = result["ours"], result["llamacpp"]
    result["decode_ratio"] = o["decode_tok_s"] / c["tg_tok_s"]
    result["load_ratio"] = o["load_s"] / c["load_and_one_token_s"]
    result["rss_over_file"] = o["peak_rss_gb"] / result["file_gb"]
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

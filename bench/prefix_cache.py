"""What prefix caching saves: a 10-turn chat, and 8 requests sharing a long system prompt,
each with prefix caching on and off (same outputs: the cache changes no bit), in AR and SD
on the default pair; and llama-server (its prompt cache, slot reuse) on the same chat.

    python bench/prefix_cache.py --threads 2 --out bench-out/prefix \\
        --llama-bin "$(bash ../shared/tools/build-llamacpp.sh)"

Chat: the same 10 user turns; each turn's prompt is the whole conversation so far (the
assistant turns are the engine's own greedy answers, so every run reads the same history).
Per turn: prompt tokens, tokens read from the cache, TTFT. llama-server gets the same
histories as chat messages, streamed, and its TTFT is measured the same way (client side).
Shared prompt: ACLSum introductions cut to --system-tokens (1,500) as the system prompt and
8 GSM8K questions, all submitted at once; TTFT p50 and output tok/s (all output tokens over the batch's wall time).
"""
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.bench.report import machine_info
from ssd.bench.script_args import script_parser
from ssd.bench.serving import ServerProcess, _free_port
from ssd.store import gguf_path

TURNS = ["Explain what a hash table is.", "How are collisions handled?", "Show a short Python example.",
         "What is the load factor and why does it matter?", "How does Python's dict differ from that?",
         "When would you pick a balanced tree instead?", "Give the time complexity of each operation.",
         "What goes wrong with a poor hash function?", "How would you test a hash table implementation?",
         "Summarize our whole conversation in three bullet points."]


def chat_run(llm: LLM, max_tokens: int, answers: list[str] | None) -> tuple[list[dict], list[str]]:
    """The 10 turns; answers: the assistant turns to use (None: the engine's own)."""
    chat, rows, own = [], [], []
    for i, turn in enumerate(TURNS):
        chat.append({"role": "user", "content": turn})
        out = llm.generate([chat], SamplingParams.greedy(max_tokens=max_tokens))[0]
        m = out.metrics
        rows.append({"turn": i + 1, "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens,
                     "ttft_s": m.ttft_s, "tok_s": m.tokens_per_second})
        own.append(out.text)
        chat.append({"role": "assistant", "content": answers[i] if answers else out.text})
    return rows, own


def shared_run(llm: LLM, system: str, questions: list[str], max_tokens: int) -> dict:
    """All at once, stepped here to see the most KV blocks the batch held at a time."""
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    start = time.perf_counter()
    seqs = [llm.new_request(c, SamplingParams.greedy(max_tokens=max_tokens)) for c in chats]
    for seq in seqs:
        llm.add_request(seq)
    peak = 0
    while llm.unfinished():
        llm.step()
        peak = max(peak, llm.kv_blocks_in_use())
    wall = time.perf_counter() - start
    m = [s.metrics() for s in seqs]
    return {"prompt_tokens": m[0].prompt_tokens, "ttft_p50": statistics.median(x.ttft_s for x in m),
            "cached_tokens": [x.cached_tokens for x in m], "peak_blocks": peak,
            "output_tok_s": sum(x.output_tokens for x in m) / wall, "wall_s": wall,
            "token_ids": [s.output_ids for s in seqs]}


def llama_chat(url: str, answers: list[str], max_tokens: int, cache: bool) -> list[dict]:
    chat, rows = [], []
    for i, turn in enumerate(TURNS):
        chat.append({"role": "user", "content": turn})
        body = {"messages": chat, "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_prompt": cache}
        start, first, timings = time.perf_counter(), None, {}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                timings = msg.get("timings") or timings
                if first is None and any((c.get("delta") or {}).get("content") for c in msg.get("choices") or []):
                    first = time.perf_counter()
        rows.append({"turn": i + 1, "prompt_tokens": timings.get("prompt_n", 0) + timings.get("cache_n", 0),
                     "cached_tokens": timings.get("cache_n", 0), "ttft_s": (first or time.perf_counter()) - start,
                     "tok_s": timings.get("predicted_per_second")})
        chat.append({"role": "assistant", "content": answers[i]})
    return rows


def main() -> None:
    ap = script_parser(__doc__, draft=True, threads=2, out=True)
    ap.add_argument("--modes", default="ar,sd")
    ap.add_argument("--chat-tokens", type=int, default=160, help="most tokens per chat answer")
    ap.add_argument("--shared-tokens", type=int, default=64, help="most tokens per shared-prompt answer")
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--parts", default="chat,shared", help="which runs: chat, shared (default: both)")
    ap.add_argument("--llama-bin", type=Path, help="folder with llama-server (leave out: no llama.cpp rows)")
    args = ap.parse_args()
    docs = [p.text for p in load_prompt_set("aclsum", 8)]
    questions = [p.text for p in load_prompt_set("gsm8k", 8)]
    results = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "chat": {}, "shared": {}}
    answers = None
    for mode in args.modes.split(","):
        for caching in (False, True):
            kw = {} if mode == "ar" else {"draft": args.draft}
            with LLM(args.model, mode=mode, threads=args.threads, enable_prefix_caching=caching, **kw) as llm:
                llm.generate(["Hello"], SamplingParams.greedy(max_tokens=2))  # warm-up
                ids = llm.tokenizer.encode("\n\n".join(docs))[:args.system_tokens]
                system = "Answer using this document where it helps.\n\n" + llm.tokenizer.decode(ids)
                label = f"{mode} {'cache' if caching else 'cold'}"
                if "chat" in args.parts:
                    rows, own = chat_run(llm, args.chat_tokens, answers)
                    answers = answers or own
                    results["chat"][label] = rows
                    print(f"{label}: chat turn 10 TTFT {rows[-1]['ttft_s']:.2f} s", file=sys.stderr, flush=True)
                if "shared" in args.parts:
                    results["shared"][label] = shared_run(llm, system, questions, args.shared_tokens)
                    print(f"{label}: shared TTFT p50 {results['shared'][label]['ttft_p50']:.2f} s", file=sys.stderr,
                          flush=True)
    if args.llama_bin and answers:
        argv = [str(args.llama_bin / "llama-server"), "-m", str(gguf_path(args.model)), "-t", str(args.threads),
                "-tb", str(args.threads), "-np", "1", "-c", "8192", "--jinja", "--port", str(port := _free_port())]
        server = ServerProcess("llama-server", argv, port, Path("/tmp") / f"llama-server-{port}.log", "/health",
                               {"LD_LIBRARY_PATH": str(args.llama_bin)})
        try:
            llama_chat(server.url, answers, 4, True)  # warm-up
            for cache in (False, True):
                results["chat"][f"llama-server {'cache' if cache else 'cold'}"] = llama_chat(
                    server.url, answers, args.chat_tokens, cache)
        finally:
            server.stop()
    table = format_tables(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "table.md").write_text(table + "\n")


def format_tables(results: dict) -> str:
    chat = results["chat"]
    lines = ["| run | turn 1 TTFT s | turn 5 TTFT s | turn 10 TTFT s | turn 10 prompt / cached tokens | turn 10 vs cold |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, rows in chat.items():
        cold = chat.get(label.rsplit(" ", 1)[0] + " cold")
        ratio = f"{rows[-1]['ttft_s'] / cold[-1]['ttft_s']:.2f}x" if cold else "-"
        lines.append(f"| {label} | {rows[0]['ttft_s']:.2f} | {rows[4]['ttft_s']:.2f} | {rows[-1]['ttft_s']:.2f} | "
                     f"{rows[-1]['prompt_tokens']} / {rows[-1]['cached_tokens']} | {ratio} |")
    lines += ["", "| run (8 requests, one system prompt) | prompt tokens | cached per request | most KV blocks held | "
              "TTFT p50 s | output tok/s | TTFT vs cold | tok/s vs cold | same tokens as cold |",
              "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    shared = results["shared"]
    for label, r in shared.items():
        cold = shared.get(label.rsplit(" ", 1)[0] + " cold")
        lines.append(f"| {label} | {r['prompt_tokens']} | {','.join(map(str, r['cached_tokens']))} | "
                     f"{r['peak_blocks']} | {r['ttft_p50']:.2f} | "
                     f"{r['output_tok_s']:.1f} | {r['ttft_p50'] / cold['ttft_p50']:.2f}x | "
                     f"{r['output_tok_s'] / cold['output_tok_s']:.2f}x | {r['token_ids'] == cold['token_ids']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""`ssd bench serve`: N concurrent clients over HTTP against `ssd serve` (AR, SD, SSD) and
llama.cpp's OpenAI servers on the same GGUF at the same threads.

Each engine runs as its users run it: `ssd serve`; `python -m llama_cpp.server` (one request
at a time, as llama-cpp-python serves); `llama-server` (llama.cpp's own server, with as many
parallel slots as there are clients: its continuous batching), and `llama-server-spec` (the
same with the draft GGUF as its speculative draft, `-md --spec-type draft-simple`, at its
default draft settings).
Every client streams chat completions, greedy, one prompt after another from a shared list;
a prompt set with a schema (json-math, json-code) sends it as `response_format` json_schema
to every server, and the table counts the answers that parse and validate. Per run: requests/s,
output tok/s (completion tokens over the run's wall time), TTFT and time per output token
(a request's (last - first token) / (tokens - 1)) at p50/p90/p99, and whether each output
equals ssd's AR output at concurrency 1.
"""
import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from ssd.bench.prompts import PROMPT_SETS, load_prompt_set
from ssd.bench.report import check_out, machine_info
from ssd.bench.runner import follows
from ssd.distributed.placement import engine_threads
from ssd.errors import SSDError
from ssd.store import DEFAULT_DRAFT, DEFAULT_TARGET, gguf_path

PEERS = ("llamacpp", "llama-server", "llama-server-spec")


@dataclass
class RequestResult:
    prompt_id: str
    text: str
    completion_tokens: int
    ttft_s: float
    tpot_s: float | None  # None for a one-token answer
    error: str | None = None
    valid: bool | None = None  # the answer parses and follows the prompt's schema; None: no schema
    drafted: tuple[int, int] | None = None  # llama-server's timings: (draft tokens, accepted)


@dataclass
class Run:
    engine: str  # "ssd ar", "ssd sd", "llama.cpp (llama_cpp.server)", ...
    concurrency: int
    threads: int
    wall_s: float
    requests: list[RequestResult] = field(default_factory=list)
    same_as_ar: int | None = None  # outputs equal to ssd AR's at concurrency 1
    in_process: float | None = None  # ssd: LLM.generate's mean decode tok/s on the same prompts, one at a time
    drafted: tuple[int, int] | None = None  # ssd sd/ssd: the run's (draft tokens, accepted) from /metrics

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.error is None]
        tokens = sum(r.completion_tokens for r in ok)
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
        ttft = [r.ttft_s for r in ok]
        tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
        checked = [r.valid for r in ok if r.valid is not None]
        drafted = [r.drafted for r in ok if r.drafted is not None and r.drafted[0]]
        if self.drafted is not None and self.drafted[0]:
            drafted.append(self.drafted)
        return {"engine": self.engine, "concurrency": self.concurrency, "threads": self.threads,
                "requests": len(self.requests), "errors": len(self.requests) - len(ok),
                "req_per_s": len(ok) / self.wall_s, "output_tok_per_s": tokens / self.wall_s,
                "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
                "tpot_p50": pct(tpot, 50), "tpot_p90": pct(tpot, 90), "tpot_p99": pct(tpot, 99),
                "decode_tok_per_s": float(np.mean([1 / t for t in tpot])) if tpot else None,
                "in_process_decode_tok_per_s": self.in_process, "same_as_ar": self.same_as_ar,
                "valid": sum(checked) if checked else None,
                "acceptance": sum(a for _, a in drafted) / sum(d for d, _ in drafted) if drafted else None}


def spec_counts(url: str) -> tuple[int, int] | None:
    """ssd serve's draft tokens and accepted tokens since it started (Prometheus counters)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    if "ssd_spec_draft_tokens_total" not in values:
        return None
    return int(float(values["ssd_spec_draft_tokens_total"])), int(float(values["ssd_spec_accepted_tokens_total"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started as its users start it; stopped with SIGTERM, then killed."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, ready_path: str, env: dict | None = None):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                         start_new_session=True)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SSDError(f"{name} exited with {self.proc.returncode} before it was ready; see {log}")
            try:
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SSDError(f"{name} was not ready after 600 s; see {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def request_body(model: str, prompt: dict, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt["text"]}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if prompt.get("schema") is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": prompt["schema"], "strict": True}}
    return body


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: dict, max_tokens: int) -> RequestResult:
    body = request_body(model, prompt, max_tokens)
    start, first, last, pieces, tokens, drafted = time.perf_counter(), None, None, [], 0, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(prompt["id"], "", 0, 0.0, None, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if msg.get("usage"):
                    tokens = msg["usage"]["completion_tokens"]
                if "draft_n" in (msg.get("timings") or {}):  # llama-server's own count
                    drafted = (msg["timings"]["draft_n"], msg["timings"]["draft_n_accepted"])
                for choice in msg.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        pieces.append(text)
    except httpx.HTTPError as e:
        return RequestResult(prompt["id"], "".join(pieces), 0, 0.0, None, f"{type(e).__name__}: {e}")
    tokens = tokens or len(pieces)  # a server without usage in streams: one token per chunk
    ttft = (first or time.perf_counter()) - start
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    text = "".join(pieces)
    return RequestResult(prompt["id"], text, tokens, ttft, tpot, valid=follows(text, prompt.get("schema")),
                         drafted=drafted)


async def _drive(url: str, model: str, prompts: list[dict], concurrency: int, max_tokens: int
                 ) -> tuple[list[RequestResult], float]:
    queue = list(enumerate(prompts))
    results: list[RequestResult | None] = [None] * len(prompts)

    async def client_loop(client):
        while queue:
            i, p = queue.pop(0)
            results[i] = await _one(client, url, model, p, max_tokens)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=concurrency)) as c:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall


async def _warm_up(url: str, model: str, prompt: dict) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as c:
        await _one(c, url, model, prompt, 8)


def in_process_decode(model: str, mode: str, draft: str, k: str, threads: int, prompts: list[dict],
                      max_tokens: int) -> float:
    """LLM.generate's mean decode tok/s over the prompts one at a time (the same figure the
    server's clients see as 1 / time per output token), in a child process."""
    from ssd.llm import LLM
    from ssd.sampling_params import SamplingParams
    from ssd.speculative.options import parse_k

    kw = {} if mode == "ar" else dict(draft=draft, speculate_k=parse_k(k))
    with LLM(model, mode=mode, threads=threads, **kw) as llm:
        llm.generate([{"role": "user", "content": prompts[0]["text"]}], SamplingParams.greedy(max_tokens=8))
        rates = [llm.generate([{"role": "user", "content": p["text"]}], SamplingParams.greedy(max_tokens=max_tokens)
                              )[0].metrics.tokens_per_second for p in prompts]
    return float(np.mean(rates))


def _in_child(fn, *args):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def run_serving_bench(args: argparse.Namespace) -> list[Run]:
    out = Path(args.out) if args.out else None
    if out:
        check_out(out, args.overwrite)
        out.mkdir(parents=True, exist_ok=True)
    logs = out or Path(os.environ.get("TMPDIR", "/tmp"))
    threads = engine_threads(args.threads)
    prompts = [{"id": p.id, "text": p.text, "schema": p.schema} for p in load_prompt_set(args.set, args.num_prompts)]
    levels = sorted({int(x) for x in args.concurrency.split(",")})
    gguf = gguf_path(args.model) if args.peers else None
    servers: list[tuple[str, list[str], str, dict]] = []
    for mode in args.modes.split(","):
        argv = [sys.executable, "-m", "ssd.cli", "serve", "--model", args.model, "--mode", mode, "--threads",
                str(threads), "--max-num-seqs", str(max(levels)), "--served-model-name", "m"]
        if mode != "ar":
            argv += ["--draft", args.draft, "--k", str(args.k)]
        servers.append((f"ssd {mode}", argv, "/health", {}))
    for peer in [p for p in args.peers.split(",") if p]:
        if peer == "llamacpp":
            servers.append(("llama.cpp (llama_cpp.server)", [
                # interrupt_requests False: queue concurrent requests (its default drops the running one)
                sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "m",
                "--interrupt_requests", "False",
                "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096"], "/v1/models", {}))
        elif peer in ("llama-server", "llama-server-spec"):
            binary = Path(args.llama_bin) / "llama-server"
            if not binary.exists():
                raise SSDError(f"no llama-server in {args.llama_bin}: build it with bench/llamacpp.sh")
            argv = [str(binary), "-m", str(gguf), "-a", "m", "-t", str(threads), "-tb", str(threads),
                    "-np", str(max(levels)), "-c", str(4096 * max(levels)), "--jinja"]
            name = f"llama.cpp (llama-server -np {max(levels)})"
            if peer == "llama-server-spec":
                argv += ["-md", str(gguf_path(args.draft)), "--spec-type", "draft-simple", "-td", str(threads),
                         "-tbd", str(threads)]
                name = f"llama.cpp (llama-server -np {max(levels)} -md draft)"
            servers.append((name, argv, "/health", {"LD_LIBRARY_PATH": str(Path(args.llama_bin))}))
        else:
            raise SSDError(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")
    runs: list[Run] = []
    reference: dict[str, str] | None = None
    for name, argv, ready, env in servers:
        reference_rate = None
        if args.reference and name.startswith("ssd "):
            print(f"{name}: LLM.generate in process, one prompt at a time", file=sys.stderr, flush=True)
            reference_rate = _in_child(in_process_decode, args.model, name.split()[1], args.draft, args.k, threads,
                                       prompts, args.max_tokens)
        port = _free_port()
        argv = argv + ["--port", str(port)]
        print(f"{name}: starting", file=sys.stderr, flush=True)
        server = ServerProcess(name, argv, port, logs / f"server-{name.split()[0]}-{port}.log", ready, env)
        try:
            for c in levels:
                asyncio.run(_warm_up(server.url, "m", prompts[0]))
                before = spec_counts(server.url) if name.startswith("ssd ") else None
                results, wall = asyncio.run(_drive(server.url, "m", prompts, c, args.max_tokens))
                run = Run(name, c, threads, wall, results, in_process=reference_rate if c == 1 else None)
                after = spec_counts(server.url) if before is not None else None
                if after is not None:
                    run.drafted = (after[0] - before[0], after[1] - before[1])
                if name == "ssd ar" and c == levels[0]:
                    reference = {r.prompt_id: r.text for r in results}
                if reference is not None:
                    run.same_as_ar = sum(r.text == reference.get(r.prompt_id) for r in results)
                runs.append(run)
                s = run.summary()
                print(f"{name} c={c}: {s['output_tok_per_s']:.1f} tok/s, {s['req_per_s']:.2f} req/s, "
                      f"errors {s['errors']}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    print(format_serving_table(runs))
    if out:
        summaries = [r.summary() for r in runs]
        (out / "results.json").write_text(json.dumps(
            {"machine": machine_info(), "args": vars(args), "set": args.set, "prompts": len(prompts),
             "summary": summaries, "runs": [asdict(r) for r in runs]}, indent=1, default=str))
        (out / "table.md").write_text(format_serving_table(runs, markdown=True) + "\n")
        plot_serving(runs, out / "serving.png")
        print(f"wrote {out}/results.json, table.md, serving.png", file=sys.stderr)
    return runs


def format_serving_table(runs: list[Run], markdown: bool = False) -> str:
    head = ["engine", "clients", "threads", "req/s", "output tok/s", "decode tok/s (in process)",
            "TTFT p50/p90/p99 s", "TPOT p50/p90/p99 ms", "errors", "same text as ssd AR"]
    schema = any(r.summary()["valid"] is not None for r in runs)
    head += ["JSON ok", "acceptance"] if schema else ["acceptance"]
    fmt = lambda x, scale=1.0, d=2: "-" if x is None else f"{x * scale:.{d}f}"  # noqa: E731
    rows = []
    for r in runs:
        s = r.summary()
        rows.append([s["engine"], str(s["concurrency"]), str(s["threads"]), fmt(s["req_per_s"]),
                     fmt(s["output_tok_per_s"], d=1), fmt(s["decode_tok_per_s"], d=1)
                     + ("" if s["in_process_decode_tok_per_s"] is None else f" ({s['in_process_decode_tok_per_s']:.1f})"),
                     "/".join(fmt(s[f"ttft_p{q}"]) for q in (50, 90, 99)),
                     "/".join(fmt(s[f"tpot_p{q}"], 1000, 0) for q in (50, 90, 99)), str(s["errors"]),
                     "-" if s["same_as_ar"] is None else f"{s['same_as_ar']}/{s['requests']}"]
                    + ([fmt(s["valid"], d=0) + f"/{s['requests']}"] if schema else [])
                    + [fmt(s["acceptance"], 100, 0) + ("" if s["acceptance"] is None else " %")])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *rows])


def plot_serving(runs: list[Run], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for engine in dict.fromkeys(r.engine for r in runs):
        mine = [r for r in runs if r.engine == engine]
        xs = [r.concurrency for r in mine]
        axes[0].plot(xs, [r.summary()["output_tok_per_s"] for r in mine], marker="o", label=engine)
        axes[1].plot(xs, [r.summary()["ttft_p50"] for r in mine], marker="o", label=engine)
    axes[0].set(xlabel="concurrent clients", ylabel="output tok/s", title="throughput")
    axes[1].set(xlabel="concurrent clients", ylabel="TTFT p50 (s)", title="time to first token")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"ssd bench serve, {runs[0].threads} threads" if runs else "ssd bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_serve_bench_arguments(b: argparse.ArgumentParser) -> None:
    """`ssd bench serve`'s arguments, on its subparser (ssd/cli.py, COMMANDS)."""
    b.description = __doc__
    b.add_argument("set", nargs="?", default="humaneval", choices=list(PROMPT_SETS), help="prompt set (default: humaneval)")
    b.add_argument("--num-prompts", type=int, default=16, help="requests per run (default: 16)")
    b.add_argument("--concurrency", default="1,8", help="concurrent clients, comma-separated (default: 1,8)")
    b.add_argument("--modes", default="ar,sd", help="ssd serve modes (default: ar,sd)")
    b.add_argument("--peers", default="", help=f"llama.cpp servers on the same GGUF: {', '.join(PEERS)} (default: none)")
    b.add_argument("--llama-bin", default=str(Path.home() / ".cache/llamacpp-peer/build/bin"),
                   help="folder with llama-server (bench/llamacpp.sh builds it)")
    b.add_argument("--model", default=DEFAULT_TARGET)
    b.add_argument("--draft", default=DEFAULT_DRAFT)
    b.add_argument("--k", default="4", help="draft tokens per round for sd/ssd (default: 4)")
    b.add_argument("--threads", type=int, help="threads for every server (default: all cores)")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--reference", action="store_true",
                   help="also time LLM.generate in process on the same prompts, one at a time, for each ssd mode "
                        "(the server at 1 client should match it)")
    b.add_argument("--out", help="folder for results.json, table.md and serving.png")
    b.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
    b.set_defaults(func=run_serving_bench)

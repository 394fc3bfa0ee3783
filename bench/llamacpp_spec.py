"""llama.cpp's own speculative decoding (`llama-speculative`, native build from
bench/llamacpp.sh) on the bench's prompt sets, at the engine's thread count: the peer row that
`ssd bench --peers llamacpp` cannot give, since llama-cpp-python has no binding for it (its
`llamacpp-spec` row goes through the package's Python draft hook, with logits for every
position, which is not how llama.cpp's users speculate).

    python bench/llamacpp_spec.py --bin "$(bash bench/llamacpp.sh)" --all --num-prompts 4 --k 3,5,8 --threads 2

With --lookup, llama.cpp's prompt lookup instead (`llama-lookup`, n-gram drafting from the
context, no draft model; bench/llamacpp.sh builds it), its dynamic n-gram cache (`-lcd`) kept
across the run's prompts in order, one per K, as the engine's suffix index is kept across the
prompts of an `ssd bench` run. With --requests FILE (written by
bench/suffix_decoding.py --requests-out), the requests of that run in its order, as rendered
there, through llama-lookup with its dynamic n-gram cache (`-lcd`) kept across them as its
users keep it (one cache per group of sets the engine run served with the same engines, so
it learns what the suffix index learns); tok/s over the requests marked measured.

    python bench/llamacpp_spec.py --bin DIR --requests requests.jsonl --k 3,5,8

Each prompt is rendered with the target's chat template, as `ssd bench` renders it, and
decoded greedily for --max-tokens tokens; the figures are llama-speculative's own "decoded N
tokens in S seconds" and its acceptance. Per set and K: all decoded tokens / all seconds.
"""
import json
import re
import subprocess
import tempfile
from pathlib import Path

from ssd.bench.prompts import PROMPT_SETS, load_prompt_set
from ssd.bench.script_args import script_parser
from ssd.models.loader import load_tokenizer
from ssd.store import gguf_path, resolve_model

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ACCEPT = re.compile(r"n_drafted\s*=\s*(\d+).*?n_accept\s*=\s*(\d+)", re.S)


def run(binary: Path, target: Path, draft: Path | None, prompt: str, k: int, max_tokens: int, threads: int,
        cache: Path | None = None) -> tuple[int, float, int, int]:
    """One prompt through llama-speculative, or llama-lookup where draft is None (with `cache`,
    its dynamic n-gram cache: read, updated with this prompt's text and output, written)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        model = ["llama-lookup"] if draft is None else [
            "llama-speculative", "-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        cmd = [str(binary / model[0]), *model[1:], "-m", str(target), "-f", f.name, "-n", str(max_tokens),
               "-t", str(threads), "-tb", str(threads), "--temp", "0", "-c", "4096", "--spec-draft-n-max", str(k)]
        cmd += ["-lcd", str(cache)] if cache is not None else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    (n, s), (drafted, accepted) = DECODED.search(log).groups(), ACCEPT.search(log).groups()
    return int(n), float(s), int(drafted), int(accepted)


def main() -> None:
    ap = script_parser(__doc__, draft=True, num_prompts=4, max_tokens=128, threads=2)
    ap.add_argument("--bin", required=True, type=Path, help="the folder with llama-speculative")
    ap.add_argument("sets", nargs="*")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--k", default="3,5,8", help="draft tokens per round (--spec-draft-n-max), one run each")
    ap.add_argument("--lookup", action="store_true", help="llama-lookup (prompt lookup) instead of a draft model")
    ap.add_argument("--requests", type=Path, help="replay these requests through llama-lookup with -lcd (doc)")
    args = ap.parse_args()
    if args.requests:
        return replay(args)
    tok = load_tokenizer(resolve_model(args.model))
    target, draft = gguf_path(args.model), None if args.lookup else gguf_path(args.draft)
    tool = "llama-lookup" if args.lookup else "llama-speculative"
    sets = list(PROMPT_SETS) if args.all else args.sets or ["humaneval"]
    print("| set | config | thr | n | tok/s all | accept |\n|---|---|---:|---:|---:|---:|")
    caches = tempfile.TemporaryDirectory()
    tool += " -lcd" if args.lookup else ""
    for name in sets:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                           tokenize=False) for p in load_prompt_set(name, args.num_prompts)]
        for k in map(int, args.k.split(",")):
            cache = Path(caches.name) / f"k{k}.bin" if args.lookup else None
            runs = [run(args.bin, target, draft, p, k, args.max_tokens, args.threads, cache) for p in prompts]
            tokens, seconds = sum(r[0] for r in runs), sum(r[1] for r in runs)
            drafted, accepted = sum(r[2] for r in runs), sum(r[3] for r in runs)
            print(f"| {name} | {tool} k={k} | {args.threads} | {len(runs)} | {tokens / seconds:.1f} | "
                  f"{accepted / max(drafted, 1):.0%} |", flush=True)


def replay(args) -> None:
    """--requests: each K over the whole file, a fresh dynamic cache per group (module doc)."""
    requests = [json.loads(line) for line in args.requests.read_text().splitlines() if line.strip()]
    target = gguf_path(args.model)
    print("| set | config | thr | n | tok/s | accept |\n|---|---|---:|---:|---:|---:|")
    for k in map(int, args.k.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            totals: dict[str, list[float]] = {}
            for r in requests:
                n, s, drafted, accepted = run(args.bin, target, None, r["text"], k, args.max_tokens, args.threads,
                                              Path(tmp) / f"group{r['group']}.bin")
                if r["measured"]:
                    t = totals.setdefault(r["set"], [0, 0.0, 0, 0, 0])
                    for i, v in enumerate((n, s, drafted, accepted, 1)):
                        t[i] += v
        for name, (n, s, drafted, accepted, count) in totals.items():
            print(f"| {name} | llama-lookup -lcd k={k} | {args.threads} | {count} | {n / s:.1f} | "
                  f"{accepted / max(drafted, 1):.0%} |", flush=True)


if __name__ == "__main__":
    main()

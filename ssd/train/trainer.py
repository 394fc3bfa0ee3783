"""`ssd train-draft`: an EAGLE-3 head for a target, trained on this machine's CPU.

A run lives in the user's cache (store_root()/train/<target>/): the target's answers, the
feature shards and a checkpoint of the head, its optimiser and its learning curve, written
every few minutes and at the end. Running the command again goes on from there (a run stopped
by Ctrl-C, SIGTERM, SIGHUP, a closed laptop or a time budget loses at most the minutes since
the last checkpoint); `--restart` starts the head over and keeps the answers and feature
shards (they depend only on the target and the prompts). The budget (`--hours`) is split: answering first
(`--answer-share` of it, until every prompt is answered), then the feature pass over new
answers, then over the user's texts (`--text`, data.py; at most half of what is left), then
training for the rest; each later call spends its own budget the same way.
The head is written to --out (config.json and model.safetensors in the EAGLE-3 authors'
layout, which `draft=` takes) at every checkpoint, with train.json: the command's settings,
the data, and validation acceptance against tokens trained.
"""
import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ssd.errors import SSDError
from ssd.models.config import ModelConfig
from ssd.speculative.draft.eagle import load_eagle
from ssd.store import resolve_model, store_root
from ssd.train import data
from ssd.train.head import HeadShape, TrainHead

CHECKPOINT_S = 300.0  # seconds between checkpoints
STEP_WEIGHT = 0.8  # the loss of step s weighs STEP_WEIGHT ** s (EAGLE-3's later steps count less)
VALIDATION = 0.05  # share of the sequences held out (at least one)


@dataclass
class TrainSettings:
    model: str
    out: Path
    hours: float = 1.0
    files: list[Path] = field(default_factory=list)  # prompts to answer
    texts: list[Path] = field(default_factory=list)  # texts to read as they are (data.py)
    answer_share: float = 0.5
    answer_draft: str | None = None  # a draft model to answer with SD (the same outputs; data.answer: slower)
    answer_tokens: int = 256
    max_len: int = 768
    steps: int = 3  # training-time-test depth
    draft_vocab: int = 16384
    intermediate: int | None = None  # default: the target's hidden size x 2
    lr: float = 3e-4
    accumulate: int = 4
    seed: int = 0
    restart: bool = False
    init: Path | None = None  # a head to start from (its shape and vocabulary), instead of a new one
    precision: str = "auto"  # training passes' arithmetic: "bf16", "fp32", or auto (bf16 where the CPU has it)
    # What a row learns: "hard", the target's choice, or "soft", its distribution (EAGLE-3's loss;
    # measured a little behind hard for greedy chains: docs/algorithm.md, "EAGLE-3 heads").
    labels: str = "hard"


def run(s: TrainSettings, progress: bool = True) -> dict:
    from ssd import LLM
    folder = resolve_model(s.model)
    home = store_root() / "train" / folder.name
    home.mkdir(parents=True, exist_ok=True)
    if s.restart:
        (home / "checkpoint.pt").unlink(missing_ok=True)
    s = replace(s, precision=training_precision(s.precision, ModelConfig.from_folder(folder).hidden_size))
    budget, start = s.hours * 3600, time.perf_counter()
    prompts = data.training_prompts(s.files, s.seed)
    speculation = {"draft": s.answer_draft, "mode": "sd"} if s.answer_draft else {}
    with LLM(folder, **speculation) as llm:
        data.answer(llm, prompts, home / "answers.jsonl", s.answer_tokens, budget * s.answer_share, progress=progress)
        model = llm.engine.runner.model
        cfg = model.config
        taps = (2, cfg.num_layers // 2, cfg.num_layers - 3)
        data.extract(model, taps, home / "answers.jsonl", home / "features", s.max_len, progress)
        if data.read_texts(s.texts, llm.tokenizer, home / "texts.jsonl", s.max_len):
            left = budget - (time.perf_counter() - start)
            data.extract(model, taps, home / "texts.jsonl", home / "features", s.max_len, progress, "text-", left / 2)
        paths = data.shards(home / "features")
        if s.init is not None:
            shape, ids, init = start_head(s.init, cfg, taps)
        else:
            ids, init = draft_ids(folder, paths, s.draft_vocab, cfg.vocab_size, llm.engine.eos_ids), None
            shape = HeadShape(cfg.hidden_size, s.intermediate or 2 * cfg.hidden_size, cfg.num_heads,
                              cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, len(ids), cfg.rms_norm_eps,
                              cfg.rope_theta)
        left = budget - (time.perf_counter() - start)
        return train(model, shape, ids, paths, home / "checkpoint.pt", s, left, progress, init)


def training_precision(asked: str, width: int = 1536) -> str:
    """auto: bf16 passes where they are faster on this CPU than fp32's, timed on a matmul of the
    head's width under autocast, as training runs them: a CPU that reports AVX512-BF16 may
    still run a bf16 matmul slower than fp32's (docs/decision-log.md). The weights, their gradients' sums and
    AdamW's state are fp32 either way (torch.autocast)."""
    if asked not in ("auto", "bf16", "fp32"):
        raise SSDError(f"precision {asked!r}: auto, bf16 or fp32")
    if asked != "auto":
        return asked
    return "bf16" if _matmul_s(width, bf16=True) < 0.9 * _matmul_s(width, bf16=False) else "fp32"


def _matmul_s(width: int, bf16: bool, repeat: int = 5) -> float:
    x, w = torch.randn(256, width), torch.randn(2 * width, width)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        x @ w.T  # (a first call sets up the kernel)
        start = time.perf_counter()
        for _ in range(repeat):
            x @ w.T
        return time.perf_counter() - start


def start_head(folder: Path, target, taps: tuple[int, ...]) -> tuple[HeadShape, torch.Tensor, dict]:
    """A head to go on training (--init): its shape, vocabulary and weights, checked against
    the target as any head is, and against what this trainer's layer computes."""
    w = load_eagle(folder, target)
    c = w.config
    unlike = [what for what, on in (("attention biases", c.attention_bias), ("q/k norms", c.qk_norm),
                                    ("an embedding of its own", w.embedding is not None),
                                    ("the normed residual", c.norm_before_residual),
                                    ("a width other than the target's", c.hidden_size != target.hidden_size),
                                    (f"target layers other than {taps}", c.target_layers(target.num_layers) != taps))
              if on]
    if unlike:
        raise SSDError(f"{folder}: train-draft trains the EAGLE-3 authors' layer; this head has {', '.join(unlike)}")
    shape = HeadShape(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
                      c.draft_vocab_size, c.rms_norm_eps, c.rope_theta)
    return shape, w.draft_to_target, w.tensors


def draft_ids(folder: Path, paths: list[Path], size: int, vocab: int, always: set[int]) -> torch.Tensor:
    """The head's vocabulary: the `size` tokens the target chooses most in the training data
    (and its end tokens), ascending."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for p in paths:
        counts += torch.bincount(data.load(p).choice, minlength=vocab)
    keep = set(always)
    for t in torch.argsort(counts, descending=True, stable=True).tolist():  # ties (unseen) by id
        if len(keep) >= size:
            break
        keep.add(t)
    return torch.tensor(sorted(keep))


def train(target, shape: HeadShape, ids: torch.Tensor, paths: list[Path], checkpoint: Path, s: TrainSettings,
          budget_s: float, progress: bool, init: dict | None = None) -> dict:
    """Train (or go on training) the head for budget_s seconds; returns its learning state."""
    t = Trainer(target, shape, ids, paths, checkpoint, s, init)
    total = t.state["trained_s"] + max(budget_s, 0.0)
    begin, last_save = time.perf_counter(), time.perf_counter()
    with tqdm(total=int(total), initial=int(t.state["trained_s"]), unit="s", disable=not progress,
              dynamic_ncols=True, desc="train-draft") as bar, _stops_as_interrupts():
        try:
            while time.perf_counter() - begin < budget_s:
                loss, rate = t.step(total)
                bar.update(int(t.state["trained_s"]) - bar.n)
                curve = t.state["curve"]
                bar.set_postfix_str(f"loss {loss:.3f} | {rate:.0f} tok/s | val acc len "
                                    f"{curve[-1].get('answer_acc_len', '-') if curve else '-'}")
                if time.perf_counter() - last_save > CHECKPOINT_S:
                    t.save()
                    last_save = time.perf_counter()
        finally:
            t.save()
    return t.state


@contextmanager
def _stops_as_interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP (`kill`, a closed terminal) stop training as Ctrl-C does, after a
    checkpoint; a run in the background, where Ctrl-C's SIGINT is ignored, is stopped so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class Trainer:
    """The head, its optimiser and its learning state, from the checkpoint where there is one,
    else from `init` (a head's weights), else a head whose output side is the target's
    (TrainHead.start_from)."""

    def __init__(self, target, shape: HeadShape, ids: torch.Tensor, paths: list[Path], checkpoint: Path,
                 s: TrainSettings, init: dict | None = None):
        torch.manual_seed(s.seed)
        saved = torch.load(checkpoint, weights_only=False) if checkpoint.exists() else None
        if saved is not None:
            if saved["shape"] != asdict(shape):
                raise SSDError(f"{checkpoint} holds a head of another shape: run with --restart to start over")
            # A run going on keeps its head's vocabulary: answers added since change the counts
            # `ids` came from (draft_ids), not what the head was trained to predict.
            ids = saved["ids"]
        self.embed, self.shape, self.ids, self.checkpoint, self.s = target.embed_tokens, shape, ids, checkpoint, s
        self.head = TrainHead(shape, ids, s.max_len + s.steps + 1)
        if saved is None:
            self.head.load(init) if init is not None else self.head.start_from(target)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=s.lr, weight_decay=0.0)
        self.state = {"tokens": 0, "trained_s": 0.0, "curve": [], "step": 0}
        if saved is not None:
            self.head.load_state_dict(saved["head"])
            self.opt.load_state_dict(saved["opt"])
            self.state = saved["state"]
        # The held-out sequences are chosen once, at the run's start: sequences answered later
        # train, so the learning curve stays on the same held-out text.
        names = set(self.state.get("validation") or [p.name for p in paths[:max(1, int(len(paths) * VALIDATION))]])
        self.val = [p for p in paths if p.name in names] or paths[:1]
        self.fit = [p for p in paths if p.name not in names] or paths
        self.state["validation"] = [p.name for p in self.val]
        self.starts = data.prompt_lengths(checkpoint.parent / "answers.jsonl")
        self.to_draft = torch.full((shape.vocab_size,), -100, dtype=torch.long)
        self.to_draft[ids] = torch.arange(len(ids))
        self.order = data.epochs(self.fit, s.seed + self.state["step"])

    def step(self, total_s: float) -> tuple[float, float]:
        """One optimiser step over `accumulate` sequences; returns the last loss and tokens/s."""
        t0 = time.perf_counter()
        tokens, loss = 0, torch.zeros(())
        for _ in range(self.s.accumulate):
            seq = data.load(next(self.order))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.s.precision == "bf16"):
                loss = _loss(self.head, self.embed, seq, self.to_draft, self.s.steps, self.s.labels == "soft")
            (loss / self.s.accumulate).backward()
            tokens += len(seq.tokens)
        for g in self.opt.param_groups:
            g["lr"] = _lr(self.s.lr, self.state["step"], self.state["trained_s"] / total_s)
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        took = time.perf_counter() - t0
        self.state["step"] += 1
        self.state["tokens"] += tokens
        self.state["trained_s"] += took
        return float(loss.detach()), tokens / took

    def save(self) -> None:
        """The checkpoint (atomically), the head in --out, and a point of the learning curve."""
        s = self.s
        answers, whole = accepted_length(self.head, self.embed, self.val, self.to_draft, s.steps, self.starts)
        self.state["curve"].append({"tokens": self.state["tokens"], "trained_s": round(self.state["trained_s"], 1),
                                    "answer_acc_len": round(answers, 3), "acc_len": round(whole, 3)})
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "state": self.state,
                    "shape": asdict(self.shape), "ids": self.ids}, tmp)
        tmp.rename(self.checkpoint)
        self.head.save(s.out)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items()
                    if k not in ("files", "texts")}
        (s.out / "train.json").write_text(json.dumps({
            "settings": settings, "files": [str(f) for f in s.files], "texts": [str(f) for f in s.texts],
            "sequences": {"train": len(self.fit), "validation": len(self.val)}, "curve": self.state["curve"]},
            indent=2) + "\n")


def _lr(base: float, step: int, done: float) -> float:
    """Warm-up over 20 steps, then cosine down to a tenth over the run's whole time budget."""
    return base * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def _loss(head: TrainHead, embed, seq: data.Sequence, to_draft: torch.Tensor, steps: int,
          soft: bool = False) -> torch.Tensor:
    """The training-time test's loss over one sequence. A row whose target choice is in the
    head's vocabulary learns the choice, or, soft, the target's distribution over that
    vocabulary (its likeliest TOP_K tokens there, renormalised: EAGLE-3's loss; a shard
    without the distribution: the choice)."""
    with torch.no_grad():
        embeds = embed(seq.tokens).float()
    outs = head(embeds, seq.states, steps)
    total = torch.zeros(())
    for s, logits in enumerate(outs):
        rows = slice(s + 1, s + 1 + len(logits))
        labels = to_draft[seq.choice[rows]]
        kept = labels >= 0
        if not kept.any():
            continue
        if soft and seq.top_ids is not None:
            ids = to_draft[seq.top_ids[rows]][kept]  # [rows, TOP_K] in the head's vocabulary, -100 outside
            p = seq.top_p[rows][kept] * (ids >= 0)
            p = p / p.sum(-1, keepdim=True)  # (each row holds its choice: the sum is > 0)
            logp = logits[kept].float().log_softmax(-1).gather(-1, ids.clamp_min(0))
            loss = -(p * logp).sum(-1).mean()
        else:
            loss = F.cross_entropy(logits, labels, ignore_index=-100)
        total = total + STEP_WEIGHT ** s * loss
    return total


@torch.no_grad()
def accepted_length(head: TrainHead, embed, paths: list[Path], to_draft: torch.Tensor, steps: int,
                    starts: dict[str, int] | None = None) -> tuple[float, float]:
    """Tokens per target pass a greedy chain of `steps` drafts would give on these sequences:
    1 + the mean number of leading steps whose choice is the target's, over the rounds of
    decoding their answers (bases from the prompt's last token on: `starts`, a shard's prompt
    length by name; a text's every position), and over every position, prompts included.
    Only the first is what SD sees: prompts share a chat template and a system prompt that a
    head learns by heart (docs/algorithm.md, "EAGLE-3 heads", has the gap measured)."""
    starts = starts or {}
    chains, bases, answer_chains, answer_bases = 0.0, 0, 0.0, 0
    for p in paths:
        seq = data.load(p)
        outs = head(embed(seq.tokens).float(), seq.states, steps)
        n = len(outs[-1])
        first = min(n, max(0, starts.get(p.name, 0) - 1))  # base P - 1 drafts the answer's second token
        alive = torch.ones(n, dtype=torch.bool)
        for s, logits in enumerate(outs):
            right = to_draft[seq.choice[s + 1:s + 1 + n]] == logits[:n].argmax(-1)
            alive &= right
            chains += float(alive.sum())
            answer_chains += float(alive[first:].sum())
        bases += n
        answer_bases += n - first
    return 1.0 + answer_chains / max(answer_bases, 1), 1.0 + chains / max(bases, 1)

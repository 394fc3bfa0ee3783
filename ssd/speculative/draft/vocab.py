"""The draft's vocabulary: the check that a draft can draft for a target at all, and the
reduced-vocabulary head (as in FR-Spec): the draft's output layer keeps only the V' tokens the
target writes most, so each draft step reads a fraction of that layer. The draft then proposes
only those tokens and its q is 0 elsewhere; verification needs nothing else to stay exact.

Which tokens: counts of the target's own greedy outputs on held-out prompts and of those
prompts (`ssd vocab`, ssd/bench/vocab.py), kept in the store as vocab/<target>.json (the
default target's ship in ssd/speculative/draft/counts/, made so); the most frequent V' tokens and
the end-of-turn tokens are kept, ranked ties and unseen tokens by id (BPE merge order).

No count covers the words of one request: a name in a code prompt, a city in a question,
which answers copy. So each sequence's own tokens (its prompt, then what the target wrote)
join its head (DraftHead), their rows read from the whole output layer (`full_head`, set by
the loader: the tied input embedding, or a GGUF file's output layer, read from its pages
row by row): a sequence's few dozen rows in memory and a small matmul per step.
"""
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ssd.errors import SSDError, VocabularyMismatchError
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM
from ssd.speculative.options import AUTO_DRAFT_VOCAB
from ssd.store import store_root

MIN_DRAFT_VOCAB = 1
# A token outside a reduced head, as a logit (DraftHead.whole): finite, so that a constraint's
# mask can still leave it, and far below any logit a model gives (after penalties and bias too).
OUTSIDE_HEAD = -1e30


SHIPPED = Path(__file__).parent / "counts"


def counts_path(target_folder: Path) -> Path:
    """Where `ssd vocab` writes a target's counts."""
    return store_root() / "vocab" / f"{Path(target_folder).name}.json"


def known_counts(target_folder: Path) -> Path | None:
    """A target's counts: the store's, else those shipped for it, else None."""
    for path in (counts_path(target_folder), SHIPPED / f"{Path(target_folder).name}.json"):
        if path.is_file():
            return path
    return None


def head_tokens(target_folder: Path, draft_vocab: int | str | None, vocab_size: int, always: set[int]
                ) -> tuple[int, ...] | None:
    """The token ids of the draft head SpecOptions.draft_vocab asks for; None: the full head."""
    if draft_vocab in (None, "full"):
        return None
    if draft_vocab == "auto":
        if known_counts(target_folder) is None or AUTO_DRAFT_VOCAB >= vocab_size:
            return None
        draft_vocab = AUTO_DRAFT_VOCAB
    return reduced_vocabulary(target_folder, draft_vocab, vocab_size, always)


def reduced_vocabulary(target_folder: Path, size: int, vocab_size: int, always: set[int]) -> tuple[int, ...]:
    """The `size` token ids a reduced draft head keeps, ascending."""
    if not MIN_DRAFT_VOCAB <= size <= vocab_size:
        raise SSDError(f"draft_vocab must be in {MIN_DRAFT_VOCAB}..{vocab_size} for this model, got {size}")
    path = known_counts(target_folder) or counts_path(target_folder)
    try:
        counts = {int(k): int(v) for k, v in json.loads(path.read_text())["counts"].items()}
    except FileNotFoundError:
        raise SSDError(f"draft_vocab needs the token counts of {Path(target_folder).name}: run `ssd vocab --model "
                       f"{Path(target_folder).name}` first (it writes {path})") from None
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise SSDError(f"cannot read token counts {path}: {e}") from None
    ranked = sorted(counts, key=lambda t: (-counts[t], t)) + [t for t in range(vocab_size) if t not in counts]
    keep = {t for t in always if 0 <= t < vocab_size}
    for t in ranked:
        if len(keep) >= size:
            break
        if 0 <= t < vocab_size:
            keep.add(t)
    return tuple(sorted(keep))


def check_same_vocabulary(target_tok, draft_tok, target_cfg: ModelConfig, draft_cfg: ModelConfig) -> None:
    """Draft and target must map the same strings to the same ids, with the same special
    tokens. The target's embedding table may be padded larger than the draft's."""
    problems = []
    if target_tok.get_vocab() != draft_tok.get_vocab():
        t, d = target_tok.get_vocab(), draft_tok.get_vocab()
        diff = sorted(set(t.items()) ^ set(d.items()), key=str)[:3]
        problems.append(f"token tables differ ({len(t)} vs {len(d)} entries; e.g. {diff})")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(target_tok, attr) != getattr(draft_tok, attr):
            problems.append(f"{attr} {getattr(target_tok, attr)} vs {getattr(draft_tok, attr)}")
    if draft_cfg.vocab_size > target_cfg.vocab_size:
        problems.append(f"the draft's output layer ({draft_cfg.vocab_size}) is larger than the "
                        f"target's ({target_cfg.vocab_size})")
    if problems:
        raise VocabularyMismatchError("the draft model cannot draft for this target: " + "; ".join(problems))


@dataclass
class ExtraTokens:
    """A sequence's own tokens outside the reduced head, and their output-layer rows (each
    sequence's own: ssd/speculative/draft/draft_engine.py DraftSeq)."""

    known: set[int] = field(default_factory=set)
    ids: torch.Tensor | None = None  # [E] token ids
    weight: torch.Tensor | None = None  # [E, hidden] their output-layer rows


class DraftHead:
    """The draft's output layer: the model's head over the whole vocabulary, or a reduced
    head's V' rows plus each sequence's own tokens outside them (where the model has a
    `full_head` to read their rows from). Logits come as [rows, V' + E]: the
    head's V' columns, then E columns for the extra tokens of the row's sequence (-inf
    where a sequence has fewer than the batch's widest)."""

    def __init__(self, model: DecoderLM, vocab_ids: tuple[int, ...] | None, device: torch.device):
        self.model, self.vocab = model, model.config.vocab_size
        self.ids = None if vocab_ids is None else torch.tensor(vocab_ids, dtype=torch.long, device=device)
        self.extends = self.ids is not None and model.full_head is not None
        self.in_head = set(vocab_ids or ())

    def extend(self, e: ExtraTokens, tokens: list[int]) -> None:
        """A sequence's new tokens (a prompt, the target's tokens) join its extra tokens `e`."""
        if not self.extends:
            return
        new = [t for t in dict.fromkeys(tokens) if t not in self.in_head and t not in e.known and 0 <= t < self.vocab]
        if new:
            ids = torch.tensor(new, device=self.ids.device)
            rows = self.model.full_head(ids).float()
            e.ids = ids if e.ids is None else torch.cat([e.ids, ids])
            e.weight = rows if e.weight is None else torch.cat([e.weight, rows])
            e.known.update(new)

    def __call__(self, hidden: torch.Tensor, extras: list[ExtraTokens], rows: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for final hidden states; the sequence of extras[i] owns the next rows[i] rows.
        Returns the logits [R, V' + E] and the extra columns' token ids [R, E] (None: no extra
        columns)."""
        logits = self.model.logits(hidden)
        width = max((len(e.known) for e in extras), default=0)
        if not width:
            return logits, None
        extra = logits.new_full((hidden.shape[0], width), float("-inf"))
        # Pads point at token 0 with probability 0: adding nothing there keeps q exact.
        extra_ids = torch.zeros(hidden.shape[0], width, dtype=torch.long, device=hidden.device)
        start = 0
        for e, n in zip(extras, rows):
            if e.known:
                m = len(e.known)
                extra[start:start + n, :m] = (hidden[start:start + n].float() @ e.weight.T).to(logits.dtype)
                extra_ids[start:start + n, :m] = e.ids
            start += n
        return torch.cat([logits, extra], dim=-1), extra_ids

    def token_ids(self, index: torch.Tensor, extra_ids: torch.Tensor | None) -> torch.Tensor:
        """Token ids of columns `index` [R] or [R, k] of the logits (extra_ids: their rows')."""
        if self.ids is None:
            return index
        v = self.ids.numel()
        out = self.ids[index.clamp(max=v - 1)]
        if extra_ids is None:
            return out
        flat = index.unsqueeze(-1) if index.dim() == 1 else index
        ext = extra_ids.gather(1, (flat - v).clamp(min=0))
        return torch.where(index < v, out, ext.view_as(index))

    def whole(self, logits: torch.Tensor, extra_ids: torch.Tensor | None) -> torch.Tensor:
        """Logits over the columns as logits over the whole vocabulary, OUTSIDE_HEAD elsewhere:
        below every column's, so a request's constraint that allows no column of a row (a JSON
        key's one spelling, say) still has the draft propose a token it allows, the lowest id
        (a greedy row) or any of them alike (a sampled one), where -inf would leave none."""
        if self.ids is None:
            return logits
        v = self.ids.numel()
        out = logits.new_full((logits.shape[0], self.vocab), OUTSIDE_HEAD).index_copy_(1, self.ids, logits[:, :v])
        # Pads in the extra columns are -inf on token 0: the larger value wins.
        return out if extra_ids is None else out.scatter_reduce_(1, extra_ids, logits[:, v:], "amax")

    def over_vocabulary(self, q: torch.Tensor, extra_ids: torch.Tensor | None) -> torch.Tensor:
        """A distribution over the logits' columns as one over the whole vocabulary (0 elsewhere)."""
        if self.ids is None:
            return q
        v = self.ids.numel()
        out = q.new_zeros(q.shape[0], self.vocab).index_copy_(1, self.ids, q[:, :v])
        return out if extra_ids is None else out.scatter_add_(1, extra_ids, q[:, v:])

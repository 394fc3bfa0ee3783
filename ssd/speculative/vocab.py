"""The draft's vocabulary: the check that a draft can draft for a target at all, and the
reduced-vocabulary head (as in FR-Spec): the draft's output layer keeps only the V' tokens the
target writes most, so each draft step reads a fraction of that layer. The draft then proposes
only those tokens and its q is 0 elsewhere; verification needs nothing else to stay exact.

Which tokens: counts of the target's own greedy outputs on held-out prompts (`ssd vocab`,
ssd/bench/vocab.py), kept in the store as vocab/<target>.json; the most frequent V' tokens
and the end-of-turn tokens are kept, ranked ties and unseen tokens by id (BPE merge order).
"""
import json
from pathlib import Path

from ssd.errors import SSDError, VocabularyMismatchError
from ssd.models.config import ModelConfig
from ssd.store import store_root

MIN_DRAFT_VOCAB = 1


def counts_path(target_folder: Path) -> Path:
    return store_root() / "vocab" / f"{Path(target_folder).name}.json"


def reduced_vocabulary(target_folder: Path, size: int, vocab_size: int, always: set[int]) -> tuple[int, ...]:
    """The `size` token ids a reduced draft head keeps, ascending."""
    if not MIN_DRAFT_VOCAB <= size <= vocab_size:
        raise SSDError(f"draft_vocab must be in {MIN_DRAFT_VOCAB}..{vocab_size} for this model, got {size}")
    path = counts_path(target_folder)
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

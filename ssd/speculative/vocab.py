from ssd.errors import VocabularyMismatchError
from ssd.models.config import ModelConfig


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

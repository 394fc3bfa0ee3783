"""The reduced-vocabulary draft head: the draft proposes only the V' tokens a target writes
most, with q 0 elsewhere; outputs stay exact (greedy equal to AR; sampling follows the target)."""
import json

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.exactness import pooled_p_value
from ssd.request.logits_process import LogitsProcessor
from ssd.speculative.draft.vocab import OUTSIDE_HEAD, counts_path, reduced_vocabulary
from chance import fits
from tiny_pair import NEW, PROMPT, V, exact_joint, drafter

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea."]


@pytest.fixture
def counts_for(tmp_path, monkeypatch):
    """Writes a token-count file for a target into a store of its own (for the counts alone: a
    new SSD_HOME would build every kernel again, ~40 s a test)."""
    monkeypatch.setattr("ssd.speculative.draft.vocab.store_root", lambda: tmp_path)

    def write(target_folder, counts: dict[int, int]):
        path = counts_path(target_folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"counts": {str(t): n for t, n in counts.items()}}))
    return write


def test_kept_ids_are_the_most_frequent_then_by_id(counts_for, smollm_dir):
    counts_for(smollm_dir, {900: 50, 7: 40, 40000: 40, 3: 1})
    assert reduced_vocabulary(smollm_dir, 5, 49152, {2}) == (2, 3, 7, 900, 40000)  # 3 was seen once: before unseen 0
    with pytest.raises(SSDError, match="draft_vocab must be"):
        reduced_vocabulary(smollm_dir, 49153, 49152, set())


def test_ssd_vocab_counts_answers_and_prompts(counts_for, smollm_dir):
    from ssd.bench.prompts import load_prompt_set
    from ssd.bench.vocab import count_outputs
    r = count_outputs(str(smollm_dir), ["gsm8k"], per_set=2, skip=32, max_tokens=6, batch=2)
    data = json.loads(counts_path(smollm_dir).read_text())
    with LLM(smollm_dir) as llm:
        prompt_ids = [t for p in load_prompt_set("gsm8k")[32:34] for t in llm.encode(p.text)]
    assert r["prompts"] == 2 and data["prompt_tokens"] == len(prompt_ids)
    assert len(prompt_ids) + 2 <= data["tokens"] <= len(prompt_ids) + 12  # and 1..6 answer tokens each
    counts = {int(t): n for t, n in data["counts"].items()}
    assert all(counts[t] >= prompt_ids.count(t) for t in set(prompt_ids))
    top = max(counts, key=lambda t: (counts[t], -t))
    assert top in reduced_vocabulary(smollm_dir, 1, 49152, set())


def test_missing_counts_say_how_to_make_them(tmp_path, monkeypatch, smollm_dir, truncated_draft):
    monkeypatch.setattr("ssd.speculative.draft.vocab.store_root", lambda: tmp_path)
    with pytest.raises(SSDError, match="ssd vocab --model"):
        LLM(smollm_dir, draft=truncated_draft, mode="sd", draft_vocab=1000)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_reduced_head_greedy_equals_ar(counts_for, smollm_dir, truncated_draft, ar_outputs, mode):
    tok_counts = {}
    with LLM(smollm_dir) as ar:  # count the target's own tokens, as `ssd vocab` does
        for o in ar.generate(PROMPTS, SamplingParams.greedy(max_tokens=24)):
            for t in o.token_ids:
                tok_counts[t] = tok_counts.get(t, 0) + 1
    counts_for(smollm_dir, tok_counts)
    params = SamplingParams.greedy(max_tokens=32, ignore_eos=True)
    with LLM(smollm_dir, draft=truncated_draft, mode=mode, speculate_k=3, draft_vocab=4096) as llm:
        engine = drafter(llm).engine if mode == "sd" else None
        outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ar_outputs(PROMPTS, params)
    assert sum(o.metrics.accepted for o in outs) > 0
    if engine is not None:
        assert engine.head.ids.numel() == 4096
        assert engine.runner.model.lm_head.out_features == 4096


def test_reduced_head_under_a_constraint_that_allows_none_of_it(counts_for, smollm_dir, truncated_draft, ar_outputs,
                                                               monkeypatch):
    """A head of 64 tokens and constraints whose tokens are mostly outside it: where a row
    allows no column of the head, the draft proposes a token the constraint allows (the lowest
    id, DraftHead.whole), never one it forbids, with its guesses too; SD's output is AR's."""
    counts_for(smollm_dir, {t: 1 for t in range(100, 164)})
    outside = []
    argmax = LogitsProcessor.argmax

    def watched(self, logits, tokens, drafts=(), raw=None):
        out = argmax(self, logits, tokens, drafts, raw)
        outside.append(sum(bool(logits[i, t] == OUTSIDE_HEAD) for i, t in enumerate(out)))  # (in float32)
        return out
    monkeypatch.setattr(LogitsProcessor, "argmax", watched)
    params = [SamplingParams.greedy(max_tokens=40, json_schema={
                  "type": "object", "required": ["language", "year"], "additionalProperties": False,
                  "properties": {"language": {"type": "string"}, "year": {"type": "integer"}}}),
              SamplingParams.greedy(max_tokens=24, regex=r"[0-9]{3}-(yes|no|maybe) [A-Z][a-z]+")]
    prompts = ["Python as JSON:", "Answer:"]
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=4, draft_vocab=64, draft_guesses=True) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [ar_outputs([p], q)[0] for p, q in zip(prompts, params)]
    assert sum(outside) > 0  # rows whose allowed tokens were all outside the head


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.long), True])
def test_reduced_head_sampling_follows_the_target(counts_for, tiny_pair, tiny_tied_pair, tied):
    """Untied: the draft proposes the kept 2, 3, 5, 6 and eos (1). Tied: the head keeps 1, 2
    and 6, and each sequence adds its own tokens (the prompt's 5 and 3, then the target's)."""
    target, draft = tiny_tied_pair if tied else tiny_pair
    counts_for(target, {2: 9, 6: 8} if tied else {2: 9, 3: 8, 5: 7, 6: 6})
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft=draft, mode="sd", speculate_k=2, max_num_seqs=500, seed=4,
             draft_vocab=3 if tied else 5) as llm:
        head = drafter(llm).engine.head
        assert head.ids.tolist() == ([1, 2, 6] if tied else [1, 2, 3, 5, 6]) and head.extends == tied
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    accepted, drafted = sum(o.metrics.accepted for o in outs), sum(o.metrics.drafted for o in outs)
    assert 0.05 < accepted / drafted < 0.95
    joint = exact_joint(target, prompt_ids, temperature)
    for i in range(NEW):
        marginal = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert fits(pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal)), i


def test_a_sequences_own_tokens_join_a_tied_head(tiny_tied_pair):
    """Columns past V' are the sequence's tokens outside the head, scored with the input
    embedding's rows (the tied output layer's); other sequences' rows get -inf there."""
    from ssd.models.loader import load_model
    from ssd.speculative.draft.vocab import DraftHead, ExtraTokens
    model = load_model(tiny_tied_pair[1], torch.device("cpu"), torch.float32)
    head = DraftHead(load_model(tiny_tied_pair[1], torch.device("cpu"), torch.float32, head_rows=(1, 2, 6)),
                     (1, 2, 6), torch.device("cpu"))
    seven, eight = ExtraTokens(), ExtraTokens()  # two sequences' own tokens
    head.extend(seven, [2, 5, 3, 5])  # 2 is in the head; 5 and 3 join, once each
    head.extend(seven, [4, 3])
    hidden = torch.randn(3, model.config.hidden_size)
    logits, extra_ids = head(hidden, [seven, eight], [2, 1])
    full = model.lm_head(hidden)
    assert torch.allclose(logits[:2], full[:2, [1, 2, 6, 5, 3, 4]], atol=1e-4)
    assert torch.allclose(logits[2, :3], full[2, [1, 2, 6]], atol=1e-4) and logits[2, 3:].isneginf().all()
    assert extra_ids[:2].tolist() == [[5, 3, 4]] * 2
    index = torch.tensor([0, 4, 2])
    assert head.token_ids(index, extra_ids).tolist() == [1, 3, 6]
    q = logits.softmax(-1)
    full_q = head.over_vocabulary(q, extra_ids)
    assert torch.allclose(full_q.sum(-1), torch.ones(3)) and full_q[:, [0, 7]].eq(0).all()
    assert torch.equal(full_q[0, [1, 2, 6, 5, 3, 4]], q[0])
    assert head(hidden, [eight], [3])[1] is None  # no sequence with extra tokens: no extra columns


def test_an_untied_gguf_head_reads_any_row_from_the_file(tiny_pair, tmp_path):
    """A GGUF draft with its own output layer (as Qwen2.5-0.5B's Q8_0 one): a reduced head
    keeps V' rows in the kernel's layout, and a request's other tokens are read from the
    file's blocks, the values the dequantised model has."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    from ssd.models.loader import load_model
    folder = quantized_copy(tiny_pair[1], tmp_path, GGML.Q8_0)
    cpu = torch.device("cpu")
    reduced = load_model(folder, cpu, torch.float32, head_rows=(1, 2, 6))
    plain = load_model(folder, cpu, torch.float32, weights="dequantized")
    assert not plain.config.tie_word_embeddings and reduced.lm_head.out_features == 3
    ids = torch.tensor([5, 3, 0])
    assert torch.equal(reduced.full_head(ids), plain.lm_head.weight[ids])


def test_auto_takes_a_reduced_head_where_counts_are_known(counts_for, smollm_dir, truncated_draft):
    from ssd.speculative.options import AUTO_DRAFT_VOCAB
    with LLM(smollm_dir, draft=truncated_draft, mode="sd") as llm:  # no counts for SmolLM2: the full head
        assert drafter(llm).engine.head.ids is None
    counts_for(smollm_dir, {5: 3, 9: 1})
    with LLM(smollm_dir, draft=truncated_draft, mode="sd") as llm:
        assert drafter(llm).engine.head.ids.numel() == AUTO_DRAFT_VOCAB < 49152
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", draft_vocab="full") as llm:
        assert drafter(llm).engine.head.ids is None
    with pytest.raises(SSDError, match="draft_vocab must be an integer, 'auto', 'full' or None"):
        LLM(smollm_dir, draft=truncated_draft, mode="sd", draft_vocab="half")


def test_the_default_targets_counts_ship_with_the_engine(tmp_path, monkeypatch):
    from ssd.store import REGISTRY
    from ssd.speculative.draft.vocab import known_counts
    monkeypatch.setenv("SSD_HOME", str(tmp_path))  # an empty store
    path = known_counts(tmp_path / "qwen2.5-coder-1.5b-instruct")
    assert path is not None and "qwen2.5-coder-1.5b-instruct" in REGISTRY
    data = json.loads(path.read_text())
    assert data["model"] == "qwen2.5-coder-1.5b-instruct" and len(data["counts"]) == data["distinct"] > 5000
    assert known_counts(tmp_path / "smollm2-135m-instruct") is None

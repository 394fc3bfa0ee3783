"""`ssd train-draft` (ssd/train/): the trained head is the engine's EAGLE-3 head in the authors'
layout, its training-time test computes what the engine computes when it drafts, a run goes on
from its checkpoint, and SD with the trained head equals AR."""
import json
import os
import signal
import threading
from dataclasses import replace

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.bench.prompts import load_prompt_set
from ssd.errors import SSDError
from ssd.layers.attention import AttentionBatch
from ssd.models.config import ModelConfig
from ssd.speculative.draft.eagle import EagleHead, load_eagle
from ssd.train import data
from ssd.train.head import HeadShape, TrainHead
from ssd.train.trainer import (TrainSettings, Trainer, _loss, accepted_length, draft_ids, start_head, train,
                               training_precision)

PROMPTS = ["def add(a, b):", "The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Explain recursion in one sentence."]


@pytest.fixture(scope="module")
def smollm_config(smollm_dir):
    return ModelConfig.from_folder(smollm_dir)


def _shape(cfg: ModelConfig, vd: int) -> HeadShape:
    return HeadShape(cfg.hidden_size, 64, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, vd,
                     cfg.rms_norm_eps, cfg.rope_theta)


def _random_head(cfg: ModelConfig, vd: int = 48) -> TrainHead:
    ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:vd].sort().values
    head = TrainHead(_shape(cfg, vd), ids, 64)
    with torch.no_grad():  # norms away from 1, so a swapped one shows
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return head


def test_the_trained_layer_is_the_engines_head(tmp_path, smollm_config):
    """Saved in the authors' layout, the head loads as any head people bring, and the engine's
    EagleHead gives the training's logits: step 0 from the target's states, and step 1 (a
    drafted row reading the head's own state, attending to the target rows before it)."""
    cfg = smollm_config
    trained = _random_head(cfg)
    trained.save(tmp_path / "head")
    weights = load_eagle(tmp_path / "head", cfg)
    assert torch.equal(weights.draft_to_target, trained.draft_to_target)
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    engine = EagleHead(weights, torch.nn.Embedding.from_pretrained(table), max_positions=64)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (6,), generator=g)
    states = torch.randn(6, 3 * cfg.hidden_size, generator=g)
    with torch.no_grad():
        out = trained(table[tokens], states, steps=2)
        kv = torch.zeros(2, 16, cfg.num_kv_heads, cfg.head_dim)
        rows = torch.arange(16)[None]

        def batch(positions):
            return AttentionBatch(positions.clone(), rows, torch.zeros(len(positions), dtype=torch.long),
                                  positions + 1)
        # step 0, bases 0..3: row t reads token t + 1 and the target's states at t
        first = torch.arange(4)
        logits, own = engine(tokens[1:5], states[:4], first, batch(first), kv)
        assert torch.allclose(logits, out[0][:4], atol=1e-4, rtol=1e-4)
        # step 1 for base 3: position 4, token 5, the head's own state of base 3
        step, _ = engine(tokens[5:6], own[3:4], torch.tensor([4]), batch(torch.tensor([4])), kv)
        assert torch.allclose(step[0], out[1][3], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def features(smollm_dir, tmp_path_factory):
    """The target's answers to a few prompts and their feature shards, as a run makes them."""
    home = tmp_path_factory.mktemp("train")
    with LLM(smollm_dir) as llm:
        data.answer(llm, PROMPTS, home / "answers.jsonl", max_tokens=24, budget_s=600, batch=2)
        model = llm.engine.runner.model
        taps = (2, model.config.num_layers // 2, model.config.num_layers - 3)
        assert data.extract(model, taps, home / "answers.jsonl", home / "features", max_len=64) == len(PROMPTS)
        data.answer(llm, PROMPTS, home / "answers.jsonl", max_tokens=24, budget_s=600)  # all there: nothing new
        yield home, model, llm.engine.eos_ids
    assert len((home / "answers.jsonl").read_text().splitlines()) == len(PROMPTS)


def test_a_shard_holds_the_targets_states_and_choices(features):
    home, model, _ = features
    seq = data.load(data.shards(home / "features")[0])
    rec = json.loads((home / "answers.jsonl").read_text().splitlines()[0])
    assert seq.tokens.tolist() == (rec["prompt_ids"] + rec["answer_ids"])[:64]
    assert seq.states.shape == (len(seq.tokens), 3 * model.config.hidden_size)
    # greedy answers: the target's choice after each answer token but the last is the next token
    n = len(rec["prompt_ids"])
    assert seq.choice[n - 1:len(seq.tokens) - 1].tolist() == seq.tokens[n:].tolist()
    # the target's likeliest next tokens, its choice first, with their probabilities
    assert seq.top_ids.shape == seq.top_p.shape == (len(seq.tokens), data.TOP_K)
    assert torch.equal(seq.top_ids[:, 0], seq.choice)
    assert (seq.top_p[:, :-1] >= seq.top_p[:, 1:]).all() and (seq.top_p.sum(-1) <= 1.001).all()


def test_soft_labels_are_the_targets_distribution_over_the_heads_vocabulary(features, smollm_dir):
    """EAGLE-3's loss: where the target is sure (its choice has all the probability) it is the
    hard labels' cross-entropy; where it is not, the runners-up weigh in, renormalised over
    the head's vocabulary (a token outside it takes nothing)."""
    home, model, eos = features
    seq = data.load(data.shards(home / "features")[0])
    cfg = model.config
    ids = draft_ids(smollm_dir, data.shards(home / "features"), 256, cfg.vocab_size, eos)
    head = TrainHead(_shape(cfg, len(ids)), ids, 128)
    to_draft = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
    to_draft[ids] = torch.arange(len(ids))
    embed = model.embed_tokens
    hard = _loss(head, embed, seq, to_draft, 2, soft=False)
    sure = replace(seq, top_p=torch.zeros_like(seq.top_p).index_fill_(1, torch.tensor([0]), 1.0))
    assert torch.equal(_loss(head, embed, seq, to_draft, 2), hard)  # hard: the default
    assert torch.allclose(_loss(head, embed, sure, to_draft, 2, soft=True), hard, rtol=1e-5)
    assert not torch.allclose(_loss(head, embed, seq, to_draft, 2, soft=True), hard, rtol=1e-3)
    # the same mass on a token outside the head's vocabulary changes nothing
    outside = next(t for t in range(cfg.vocab_size) if to_draft[t] < 0)
    split = replace(seq, top_ids=seq.top_ids.clone().index_fill_(1, torch.tensor([1]), outside))
    moved = replace(split, top_p=split.top_p.clone().index_fill_(1, torch.tensor([1]), 0.5))
    assert torch.allclose(_loss(head, embed, split, to_draft, 2, soft=True),
                          _loss(head, embed, moved, to_draft, 2, soft=True))
    assert torch.allclose(_loss(head, embed, replace(seq, top_ids=None, top_p=None), to_draft, 2, soft=True), hard)


def test_texts_are_read_as_they_are_and_once(features, tmp_path, smollm_dir):
    """--text: a folder's text files (a binary and a hidden folder's left out), JSONL lines of
    text or of a whole conversation in the chat template, pieces of at most max_len tokens;
    read again, nothing new; their shards hold the target's states and choices over the text."""
    from transformers import AutoTokenizer
    home, model, _ = features
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    corpus = tmp_path / "corpus"
    (corpus / ".git").mkdir(parents=True)
    (corpus / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (corpus / "image.png").write_bytes(bytes(range(256)))
    code = "def add(a, b):\n    return a + b\n\n" * 20
    (corpus / "add.py").write_text(code)
    chat = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"}]
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps({"text": "The sea is calm tonight."}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    out = tmp_path / "texts.jsonl"
    pieces = data.read_texts([corpus, lines], tok, out, max_len=64)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    code_ids = tok(code, add_special_tokens=False).input_ids
    assert len(code_ids) > 64 and pieces == len(records) == -(-len(code_ids) // 64) + 2
    assert [i for r in records[:-2] for i in r["answer_ids"]] == code_ids
    assert all(len(r["answer_ids"]) <= 64 and r["prompt_ids"] == [] for r in records)
    assert records[-1]["answer_ids"] == tok(tok.apply_chat_template(chat, tokenize=False),
                                            add_special_tokens=False).input_ids
    assert data.read_texts([lines, corpus], tok, out, max_len=64) == pieces  # read before: nothing new
    taps = (2, model.config.num_layers // 2, model.config.num_layers - 3)
    assert data.extract(model, taps, out, tmp_path / "features", 64, prefix="text-", budget_s=0.0) == 0
    assert data.extract(model, taps, out, tmp_path / "features", 64, prefix="text-") == pieces
    seq = data.load(tmp_path / "features" / "text-00000.pt")
    assert seq.tokens.tolist() == records[0]["answer_ids"]
    assert seq.states.shape == (64, 3 * model.config.hidden_size)
    # the target's choices over code it did not write: mostly the text's own next token
    assert (seq.choice[:-1] == seq.tokens[1:]).float().mean() > 0.5
    lines.write_text('{"prompt": "no text here"}\n')
    with pytest.raises(SSDError, match="line 1"):
        data.read_texts([lines], tok, tmp_path / "other.jsonl", max_len=64)


def test_training_goes_on_from_its_checkpoint(features, tmp_path, smollm_dir):
    home, model, eos = features
    paths = data.shards(home / "features")
    ids = draft_ids(smollm_dir, paths, 256, model.config.vocab_size, eos)
    assert len(ids) == 256 and set(eos) <= set(ids.tolist()) and ids.tolist() == sorted(ids.tolist())
    cfg = model.config
    shape = HeadShape(cfg.hidden_size, 128, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, len(ids),
                      cfg.rms_norm_eps, cfg.rope_theta)
    s = TrainSettings(str(smollm_dir), tmp_path / "head", max_len=64, accumulate=2, lr=1e-3)
    checkpoint = tmp_path / "checkpoint.pt"
    first = train(model, shape, ids, paths, checkpoint, s, budget_s=2.0, progress=False)
    steps, tokens = first["step"], first["tokens"]
    assert steps >= 1 and len(first["curve"]) == 1 and (tmp_path / "head" / "model.safetensors").exists()
    again = Trainer(model, shape, ids, paths, checkpoint, s)
    assert again.state["step"] == steps and again.state["tokens"] == tokens
    before = accepted_length(again.head, model.embed_tokens, again.fit, again.to_draft, 3)[1]
    for _ in range(30):  # the training sequences themselves: their loss falls, their chains grow
        again.step(total_s=1e9)
    assert again.state["step"] == steps + 30
    assert accepted_length(again.head, model.embed_tokens, again.fit, again.to_draft, 3)[1] > before
    again.save()
    assert len(json.loads((tmp_path / "head" / "train.json").read_text())["curve"]) == 2
    # SD with the trained head as the draft: every token AR's
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    with LLM(smollm_dir) as ar, LLM(smollm_dir, draft=tmp_path / "head", mode="sd", speculate_k=3) as sd:
        assert [o.token_ids for o in sd.generate(PROMPTS[:2], params)] == \
            [o.token_ids for o in ar.generate(PROMPTS[:2], params)]


def test_a_new_head_starts_from_the_targets_output_layer(features, tmp_path, smollm_dir):
    """Its final norm is the target's and its logits are the target's on its vocabulary."""
    home, model, eos = features
    paths = data.shards(home / "features")
    ids = draft_ids(smollm_dir, paths, 128, model.config.vocab_size, eos)
    t = Trainer(model, _shape(model.config, len(ids)), ids, paths, tmp_path / "c.pt",
                TrainSettings(str(smollm_dir), tmp_path / "head", max_len=64))
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(t.head.norm.weight, model.norm.weight.float())
        a, b = t.head.lm_head(x), model.lm_head(x)[:, ids]
        # the target's GGUF kernel rounds x to 8 bits, the head's plain matmul does not
        assert torch.allclose(a, b, atol=0.01 * float(b.abs().max()))


def test_a_head_goes_on_from_another_heads_weights(features, tmp_path, smollm_dir):
    """--init: a saved head (here a trained one's folder) is where a new run starts: its shape,
    its vocabulary and its weights; a head this trainer's layer cannot compute is refused."""
    home, model, eos = features
    paths = data.shards(home / "features")
    cfg = model.config
    taps = (2, cfg.num_layers // 2, cfg.num_layers - 3)
    before = _random_head(cfg)
    before.save(tmp_path / "before")
    shape, ids, init = start_head(tmp_path / "before", cfg, taps)
    assert shape == before.shape and torch.equal(ids, before.draft_to_target)
    t = Trainer(model, shape, ids, paths, tmp_path / "c.pt", TrainSettings(str(smollm_dir), tmp_path / "head",
                                                                          max_len=64), init)
    assert all(torch.equal(a, b) for a, b in zip(t.head.tensors().values(), before.tensors().values()))
    with pytest.raises(SSDError, match="target layers other than"):
        start_head(tmp_path / "before", cfg, (1, 2, 3))


def test_training_prompts_take_each_family_in_turn_past_the_benchmarks():
    """The user's prompts first; then code, math, science (long input: ACLSum has none past
    the benchmarks') and writing in turn; none of the prompts a benchmark takes (each set's
    first HELD_BACK, MT-Bench's every question)."""
    prompts = data.training_prompts([])
    benchmark = {p.text for name in ("humaneval", "gsm8k", "aclsum", "mtbench")
                 for p in load_prompt_set(name, data.HELD_BACK)}
    assert not benchmark & set(prompts) and len(prompts) == len(set(prompts))
    gsm8k = {p.text for p in load_prompt_set("gsm8k")}
    code = {p.text for p in load_prompt_set("humaneval")} | set(data.stdlib_tasks())
    writing = {t.format(s) for t in data.WRITING for s in data.SUBJECTS}
    assert prompts[0] in code and prompts[1] in gsm8k and prompts[2] not in code | gsm8k | writing
    assert prompts[3] in writing and prompts[4] in code and len(writing & set(prompts)) == len(writing) == 800
    assert any(p.startswith("Write a Python function `") for p in prompts[:40])


def test_sigterm_stops_training_with_a_checkpoint(features, tmp_path, smollm_dir):
    """kill (SIGTERM) ends a run as Ctrl-C does: the checkpoint holds the steps made, and the
    process's own handler is back afterwards."""
    home, model, eos = features
    paths = data.shards(home / "features")
    cfg = model.config
    ids = draft_ids(smollm_dir, paths, 128, cfg.vocab_size, eos)
    s = TrainSettings(str(smollm_dir), tmp_path / "head", max_len=64, accumulate=1)
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(KeyboardInterrupt):
        train(model, _shape(cfg, len(ids)), ids, paths, tmp_path / "c.pt", s, budget_s=600.0, progress=False)
    assert signal.getsignal(signal.SIGTERM) is before
    assert Trainer(model, _shape(cfg, len(ids)), ids, paths, tmp_path / "c.pt", s).state["step"] >= 1


def test_a_checkpoint_refuses_another_shape_and_keeps_its_vocabulary(features, tmp_path, smollm_dir):
    home, model, eos = features
    paths = data.shards(home / "features")
    cfg = model.config
    s = TrainSettings(str(smollm_dir), tmp_path / "head", max_len=64)
    ids = draft_ids(smollm_dir, paths, 128, cfg.vocab_size, eos)
    train(model, _shape(cfg, len(ids)), ids, paths, tmp_path / "c.pt", s, budget_s=0.0, progress=False)
    with pytest.raises(SSDError, match="--restart"):
        Trainer(model, replace(_shape(cfg, len(ids)), intermediate_size=32), ids, paths,
                tmp_path / "c.pt", s)
    # More answers since: other counts, another top 128; the run goes on with its own vocabulary.
    other = draft_ids(smollm_dir, paths[:1], 128, cfg.vocab_size, eos)
    assert not torch.equal(other, ids)
    assert torch.equal(Trainer(model, _shape(cfg, len(ids)), other, paths, tmp_path / "c.pt", s).ids, ids)


def test_sequences_answered_later_train_and_the_held_out_ones_stay(features, tmp_path, smollm_dir):
    """A run going on after more answers keeps its held-out sequences (the learning curve stays
    on the same text); the new ones train."""
    home, model, eos = features
    paths = data.shards(home / "features")
    cfg = model.config
    ids = draft_ids(smollm_dir, paths, 128, cfg.vocab_size, eos)
    s = TrainSettings(str(smollm_dir), tmp_path / "head", max_len=64, accumulate=1)
    first = Trainer(model, _shape(cfg, len(ids)), ids, paths[3:], tmp_path / "c.pt", s)
    assert first.val == paths[3:4]
    first.save()
    later = Trainer(model, _shape(cfg, len(ids)), ids, paths, tmp_path / "c.pt", s)
    assert later.val == paths[3:4] and later.fit == paths[:3] + paths[4:]


def test_validation_counts_the_rounds_that_decode_answers(tmp_path):
    """Validation's chains in the answers start at the prompt's last token (the round after the
    prefill drafts the answer's second token); a text's shard counts every position; prompt
    lengths come from answers.jsonl by shard name."""
    tokens, prompt, vocab = 10, 5, 20
    choice = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    (tmp_path / "features").mkdir()
    torch.save({"tokens": torch.arange(tokens), "states": torch.zeros(tokens, 3).half(), "choice": choice},
               tmp_path / "features" / "00000.pt")
    (tmp_path / "answers.jsonl").write_text(json.dumps({"prompt_ids": list(range(prompt)),
                                                        "answer_ids": list(range(tokens - prompt))}) + "\n")

    def head(embeds, states, steps):  # step s, base t: right from base prompt - 1 on, but at the last base
        out = []
        for s in range(steps):
            rows = torch.arange(tokens - 1 - s)
            right = (rows >= prompt - 1) & (rows != tokens - 4)
            guess = torch.where(right, choice[s + 1 + rows], (choice[s + 1 + rows] + 1) % vocab)
            out.append(torch.nn.functional.one_hot(guess, vocab).float())
        return out
    starts = data.prompt_lengths(tmp_path / "answers.jsonl")
    assert starts == {"00000.pt": prompt}
    paths = data.shards(tmp_path / "features")
    answers, whole = accepted_length(head, lambda t: torch.zeros(len(t), 3), paths, torch.arange(vocab), 3, starts)
    # bases 0..6 (a chain of 3 needs 3 tokens after its base); in the answer 4, 5 (3 right) and 6 (none)
    assert answers == pytest.approx(1 + 6 / 3) and whole == pytest.approx(1 + 6 / 7)
    assert accepted_length(head, lambda t: torch.zeros(len(t), 3), paths, torch.arange(vocab), 3) == (whole, whole)


def test_bf16_passes_train_fp32_weights(features, tmp_path, smollm_dir):
    """--precision bf16: the passes under autocast, the weights and AdamW's state fp32, and the
    training sequences' chains grow as with fp32."""
    home, model, eos = features
    paths = data.shards(home / "features")
    cfg = model.config
    ids = draft_ids(smollm_dir, paths, 128, cfg.vocab_size, eos)
    s = TrainSettings(str(smollm_dir), tmp_path / "head", max_len=64, accumulate=2, lr=1e-3, precision="bf16")
    t = Trainer(model, _shape(cfg, len(ids)), ids, paths, tmp_path / "c.pt", s)
    before = accepted_length(t.head, model.embed_tokens, t.fit, t.to_draft, 3)[1]
    for _ in range(30):
        t.step(total_s=1e9)
    assert accepted_length(t.head, model.embed_tokens, t.fit, t.to_draft, 3)[1] > before
    assert {p.dtype for p in t.head.parameters()} == {torch.float32}
    assert {v.dtype for st in t.opt.state.values() for v in st.values() if v.dim()} == {torch.float32}
    assert training_precision("fp32") == "fp32" and training_precision("auto") in ("bf16", "fp32")
    with pytest.raises(SSDError, match="fp16"):
        training_precision("fp16")


def test_the_cli_passes_the_learning_rate_and_refuses_a_bad_one(monkeypatch, tmp_path, capsys):
    import ssd.train.trainer as trainer
    from ssd.cli import main
    got = []

    def run(settings):
        got.append(settings)
        return {"tokens": 0, "curve": [{"trained_s": 0.0, "answer_acc_len": 1.0, "acc_len": 1.0}]}
    monkeypatch.setattr(trainer, "run", run)
    assert main(["train-draft", "--model", "m", "--out", str(tmp_path), "--lr", "1e-3"]) == 0
    assert got[0].lr == 1e-3
    assert main(["train-draft", "--model", "m", "--out", str(tmp_path)]) == 0 and got[1].lr == TrainSettings.lr
    for bad in ("0", "-1e-3", "2"):
        assert main(["train-draft", "--model", "m", "--out", str(tmp_path), f"--lr={bad}"]) == 2
        assert "--lr in (0, 1)" in capsys.readouterr().err
    assert len(got) == 2

"""Per-sequence state has one owner on each side and is all released: after a few hundred
requests, some cancelled while running or waiting and some preempted by a small KV cache,
nothing is held for any of them, in AR, SD (auto-K, a reduced draft head), prompt lookup and
SSD (its worker asked over the link). The requests that ran to the end equal AR's."""
import json
import random
import threading
import time

import pytest

from ssd import LLM, SamplingParams
from ssd.serving.engine_loop import EngineLoop

N = 240
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Write a haiku about the sea.",
           "Once upon a time", "import numpy as np\n", "The three primary colours are", "Dear Sir,",
           # Two blocks and more, shared by a thirtieth of the requests (prefix caching).
           "Here is a list of the planets of the solar system in order from the sun: Mercury, Venus, Earth, "
           "Mars, Jupiter, Saturn, Uranus and Neptune. The largest of them is"]


def _params(i: int) -> SamplingParams:
    return SamplingParams.greedy(max_tokens=4 + i % 13, ignore_eos=True)


def _run_with_cancellations(llm: LLM, seed: int) -> dict[int, list[int]]:
    """All N requests, a fifth of them cancelled at random steps; the others' tokens by index."""
    rng = random.Random(seed)
    seqs = [llm.new_request(PROMPTS[i % len(PROMPTS)], _params(i)) for i in range(N)]
    for seq in seqs:
        llm.add_request(seq)
    doomed = set(rng.sample(range(N), N // 5))
    steps = 0
    while llm.unfinished():
        llm.step()
        steps += 1
        if steps % 3 == 0:  # some of the doomed, wherever they are: running, waiting, preempted
            live = [i for i in doomed if not seqs[i].finished]
            llm.abort([seqs[i] for i in rng.sample(live, min(len(live), 4))])
    return {i: s.output_ids for i, s in enumerate(seqs) if s.finish_reason == "length"}


@pytest.fixture
def reduced_head(smollm_dir, tmp_path, monkeypatch):
    """Token counts for SmolLM2 where the engine looks for shipped ones: draft_vocab can cut the head."""
    from ssd.speculative.draft import vocab
    (tmp_path / f"{smollm_dir.name}.json").write_text(json.dumps({"counts": {str(t): 1000 - t for t in range(900)}}))
    monkeypatch.setattr(vocab, "SHIPPED", tmp_path)


@pytest.mark.parametrize("options", [
    dict(),
    dict(mode="sd", speculate_k="auto", k_max=4, draft_vocab=1024),
    dict(mode="sd", draft="ngram", speculate_k=3),
    pytest.param(dict(mode="ssd", speculate_k=3, fan_out=2), marks=pytest.mark.long),
], ids=["ar", "sd-auto-k-reduced-head", "prompt-lookup", "ssd"])
def test_nothing_is_held_after_requests_end(smollm_dir, truncated_draft, reduced_head, ar_outputs, options):
    options = {"draft": truncated_draft, **options} if options.get("mode") else options
    with LLM(smollm_dir, max_num_seqs=24, kv_cache_tokens=512, seed=0, **options) as llm:
        done = _run_with_cancellations(llm, seed=len(options))
        held = llm.sequence_state()
        assert held and not any(held.values()), held
        assert llm.engine.cache.prefix.hits > 0 and llm.kv_blocks_cached() > 0  # kept, and no longer held
        if options.get("mode") == "ssd":
            assert any("worker's" in k for k in held), held  # the worker was asked
            assert llm.draft_failures == 0
    assert N // 2 < len(done) < N
    want = ar_outputs([PROMPTS[i % len(PROMPTS)] for i in done], [_params(i) for i in done])
    assert list(done.values()) == want


def test_a_serving_loop_routes_nothing_after_cancellations(smollm_dir, truncated_draft):
    """Through the serving loop: a quarter of the clients go away after their first tokens and
    are cancelled; afterwards no sink and no per-sequence state is left."""
    llm = LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=3, max_num_seqs=8)
    loop = EngineLoop(llm, max_queue=N)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    ended, lock, all_ended = set(), threading.Lock(), threading.Event()
    seqs: dict[int, object] = {}

    def end(i: int) -> None:
        with lock:
            ended.add(i)
            if len(ended) == N:
                all_ended.set()

    def sink_for(i: int):
        def sink(event) -> None:  # in the engine thread
            if event.finish_reason:
                end(i)
            elif i % 4 == 0 and i in seqs:
                loop.cancel(seqs[i])
                end(i)
        return sink
    try:
        for i in range(N):
            seqs[i] = loop.submit(PROMPTS[i % len(PROMPTS)], SamplingParams.greedy(max_tokens=6 + i % 9), sink_for(i))
        assert all_ended.wait(300), f"{len(ended)} of {N} requests ended"
        for _ in range(200):  # the last cancellations take effect before the engine's next step
            if loop.tracked() == 0 and not llm.unfinished():
                break
            time.sleep(0.05)
        assert loop.tracked() == 0 and not llm.unfinished()
        held = llm.sequence_state()
        assert held and not any(held.values()), held
    finally:
        loop.stop()
        runner.join(30)

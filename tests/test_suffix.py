"""Suffix decoding (ssd/speculative/sources/suffix.py): proposals from the request's own tokens
and earlier requests' text, the longest matched suffix voting on the continuation; the index
bounded, tenants apart; exact greedy and sampled output, alone and beside a draft model."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from chance import fits
from serving import start_server
from ssd import LLM, SamplingParams
from ssd.exactness import pooled_p_value
from ssd.speculative.policy.siblings import cut
from ssd.speculative.records import Branch
from ssd.speculative.sources.suffix import SuffixIndex, SuffixLookup
from test_siblings import Flat
from tiny_pair import NEW, PROMPT, V, exact_joint


class _Seq:
    def __init__(self, seq_id, tokens, salt=None):
        self.seq_id, self.token_ids = seq_id, tokens
        self.params = SamplingParams(cache_salt=salt)


def test_the_longest_matched_suffix_votes_on_the_continuation():
    index = SuffixIndex()
    for tail in ([7, 8, 9], [7, 8, 9], [7, 5, 5], [6, 6, 6]):
        index.add(None, [1, 2, 3] + tail)
    index.add(None, [9, 2, 3, 4, 4, 4])  # "2 3" matches, but "1 2 3" matches longer elsewhere
    lookup = SuffixLookup(index)
    tokens, n = lookup.match(_Seq(0, [0, 1, 2, 3]), 8)
    # p = 3 (1 2 3): 4 occurrences; 7 wins 3 of 4, then 8 wins 2 of 3 (0.5 in all), then 9 (0.5 >= MIN_PROB);
    # SPEC_FACTOR x p = 3 tokens at most
    assert tokens == [7, 8, 9] and n == 2
    assert lookup.match(_Seq(1, [0, 1, 2, 3]), 2)[0] == [7, 8]  # the round's K caps it
    assert lookup.match(_Seq(2, [5, 9, 2, 3]), 8)[0] == [4, 4, 4]  # "9 2 3" is the longest there
    assert lookup.match(_Seq(3, [4, 6]), 8) == ([], 0)  # no occurrence of the anchor


def test_the_other_continuations_are_a_tree_of_branches_off_the_chain():
    """SuffixDecoding's tree: every continuation followed by at least MIN_PROB of the matched
    occurrences, each promising its share; cut to a shorter chain, the same tree as asked for
    one that short."""
    index = SuffixIndex()
    for tail in ([7, 8, 9], [7, 8, 9], [7, 5, 5], [6, 6, 6]):
        index.add(None, [1, 2, 3] + tail)
    lookup = SuffixLookup(index)
    chain, n, tree = lookup.tree(_Seq(0, [0, 1, 2, 3]), 8)
    assert chain == [7, 8, 9] and n == 2
    # 6 under the newest token, 5 under 7; under them (nodes 4 and 5) their own continuations
    assert [(b.parent, b.token, b.promise) for b in tree] == [(0, 6, 0.25), (1, 5, 0.25), (4, 6, 0.25),
                                                              (5, 5, 0.25), (6, 6, 0.25)]
    short = lookup.tree(_Seq(1, [0, 1, 2, 3]), 2)
    assert short[0] == [7, 8] and short[2] == cut(tree, 3, 2) == [Branch(0, 6, 0.25), Branch(1, 5, 0.25),
                                                                  Branch(3, 6, 0.25)]


def test_greedy_rounds_take_the_trees_branches_where_the_majority_was_wrong(smollm_dir, ar_outputs):
    """Earlier text holding this answer once and twice with one token changed: the chain follows
    the majority, the branch off it holds the answer's token, and the rounds take it; every
    output token AR's."""
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    chat = [{"role": "user", "content": "List three primary colors as a JSON array."}]
    want = ar_outputs([chat], params)[0]
    with LLM(smollm_dir, draft="suffix", mode="sd") as llm:
        prompt = llm.encode(chat)
        for j in (12, 25):
            wrong = want[:j] + [want[j] + 1] + want[j + 1:]
            for answer in (wrong, want, wrong):
                llm.engine.source.index.add(None, prompt + answer)
        llm.engine.k_policy.verify = Flat()
        out = llm.generate([chat], params)[0]
    assert out.token_ids == want
    assert out.metrics.rescues >= 2, out.metrics


def test_the_requests_own_tokens_are_matched_and_its_text_joins_when_it_ends():
    lookup = SuffixLookup(SuffixIndex())
    own = _Seq(0, [1, 2, 3, 4, 1, 2])
    assert lookup.match(own, 2)[0] == [3, 4]  # as prompt lookup
    lookup.release(0)
    assert lookup.index.tokens == 6 and lookup.match(_Seq(1, [9, 3, 4, 1]), 3)[0] == [2]  # "3 4 1" -> 2, the end


def test_the_index_keeps_its_bound_oldest_out():
    index = SuffixIndex(limit=50)
    for i in range(30):
        index.add(None, [100 + i] * 3 + [1, 2, i])
        assert index.tokens <= 50
    lookup = SuffixLookup(index)
    assert lookup.match(_Seq(0, [7, 1, 2]), 1)[0] == [29]  # the newest texts only ...
    assert not any(text[0] == 100 for t in index.tenants.values() for text in t.texts.values())
    kept = sum(len(v) for t in index.tenants.values() for v in t.where.values())
    assert kept <= 2 * 50  # ... and their anchors (dead entries are dropped as they pile up)


def test_a_tenant_never_gets_another_tenants_text():
    index = SuffixIndex()
    index.add("alice", [1, 2, 3, 4, 5])
    lookup = SuffixLookup(index)
    assert lookup.match(_Seq(0, [0, 1, 2], "bob"), 3) == ([], 0)
    assert lookup.match(_Seq(1, [0, 1, 2]), 3) == ([], 0)  # nor an unsalted request
    assert lookup.match(_Seq(2, [0, 1, 2], "alice"), 3)[0] == [3, 4]  # SPEC_FACTOR x p = 2


def test_suffix_greedy_equals_ar_and_reuses_earlier_answers(smollm_dir, ar_outputs):
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    chat = [{"role": "user", "content": "List three primary colors as a JSON array."}]
    want = ar_outputs([chat], params)
    with LLM(smollm_dir, draft="suffix", mode="sd", speculate_k=8) as llm:
        first = llm.generate([chat], params)[0]
        again = llm.generate([chat], params)[0]
        assert llm.engine.source.index.tokens > 0 and not llm.engine.source.own  # every request let go
    assert first.token_ids == again.token_ids == want[0]
    assert again.metrics.accepted >= 30 and again.metrics.rounds < first.metrics.rounds  # the first answer, reused


def test_suffix_beside_a_draft_model_equals_ar(smollm_dir, truncated_draft, ar_outputs):
    params = SamplingParams.greedy(max_tokens=32, ignore_eos=True)
    prompts = ["def fibonacci(n):", "The capital of France is"]
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", prompt_lookup="suffix") as llm:
        for _ in range(2):
            assert [o.token_ids for o in llm.generate(prompts, params)] == ar_outputs(prompts, params)
        assert llm.engine.suffix_index.tokens > 0


def test_suffix_sampling_follows_the_target(tiny_pair):
    """The index seeded with one continuation of the prompt, many times: its proposals are
    confident and wrong for most samples. Verified, the samples follow the exact marginals;
    taken as they are (the foil: a rule that accepts what it is given), they would not."""
    target, _ = tiny_pair
    n, temperature = 3000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft="suffix", mode="sd", speculate_k=3, max_num_seqs=500, seed=5) as llm:
        prompt_ids = llm.encode(PROMPT)
        seeded = [int(t) for t in torch.randint(0, V, (NEW,), generator=torch.Generator().manual_seed(1))]
        for _ in range(200):
            llm.engine.source.index.add(None, prompt_ids + seeded)
        outs = llm.generate([PROMPT] * n, params)
    assert sum(o.metrics.accepted for o in outs) > 100  # the path is really taken
    tokens = torch.tensor([o.token_ids for o in outs])
    joint = exact_joint(target, prompt_ids, temperature)
    marginal = joint.sum(dim=list(range(1, NEW)))
    assert fits(pooled_p_value(tokens[:, 0].bincount(minlength=V).double(), marginal))
    for i in range(1, NEW):
        m = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert fits(pooled_p_value(tokens[:, i].bincount(minlength=V).double(), m)), i
    foil = torch.full((n,), seeded[0])  # every sample the seeded token
    assert pooled_p_value(foil.bincount(minlength=V).double(), marginal) < 1e-6


def test_many_requests_leave_the_index_at_its_bound(smollm_dir):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=0)
    with LLM(smollm_dir, draft="suffix", mode="sd", suffix_tokens=300) as llm:
        for i in range(6):
            llm.generate([f"Story {i}: once upon a time"] * 8, params)
            assert 0 < llm.suffix_index_tokens() <= 300


@pytest.mark.stress
def test_ten_thousand_requests_through_the_server_leave_the_index_at_its_bound(smollm_dir, tmp_path):
    """10,000 distinct requests through `ssd serve` (a quarter of them in 50 tenants): the index
    the server reports in /metrics stays at most its bound throughout, ends near it (the oldest
    out as the newest come in, not emptied), and the server's memory does not grow with the
    requests once the index is full (a leak per request or per tenant would). Minutes."""
    bound = 20_000
    server = start_server("--model", str(smollm_dir), "--mode", "sd", "--draft", "suffix",
                          "--suffix-tokens", str(bound), "--max-num-seqs", "16", tmp_path=tmp_path)
    sizes, rss = [], {}

    def one(i: int) -> None:
        prompt = f"Note {i}: the {i % 97}th lamp in row {i // 97} burns {i * 7 % 13} hours."
        body = {"model": str(smollm_dir), "prompt": prompt, "max_tokens": 4, "temperature": 0}
        if i % 4 == 0:
            body["cache_salt"] = f"tenant-{i % 50}"
        r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text

    try:
        with ThreadPoolExecutor(8) as pool:
            for start in range(0, 10_000, 500):
                list(pool.map(one, range(start, start + 500)))
                sizes.append(server.wait_idle()["ssd_suffix_index_tokens"])
                rss[start + 500] = _rss_mb(server.proc.pid)
    finally:
        server.stop()
    print(f"index tokens after each 500 requests: {sizes}; server RSS MB: {rss}")
    assert max(sizes) <= bound and sizes[-1] > 0.9 * bound, sizes
    assert rss[10_000] - rss[2_000] < 50, rss  # MB, from the first 2,000 requests (the index full by then) on


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_the_index_is_kept_across_restarts_in_the_store(smollm_dir, truncated_draft, tmp_path, monkeypatch,
                                                          ar_outputs):
    """suffix_keep: the engine's index (alone or beside a draft) saved at close into one file per
    target tokenizer, tenants apart, and loaded by the next engine: its first request reuses the
    earlier answer; a damaged file is a warning and an empty index, not a failed start."""
    monkeypatch.setattr("ssd.engine.llm_engine.store_root", lambda: tmp_path)
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    chat = [{"role": "user", "content": "List three primary colors as a JSON array."}]
    want = ar_outputs([chat], params)[0]
    salted = SamplingParams.greedy(max_tokens=8, ignore_eos=True, cache_salt="alice")
    with LLM(smollm_dir, draft="suffix", mode="sd", suffix_keep=True) as llm:
        first = llm.generate([chat], params)[0]
        llm.generate(["alice's own words, twice: alice's own words"], salted)
        kept = llm.suffix_index_tokens()
    (path,) = (tmp_path / "suffix").iterdir()
    assert path.name.startswith(smollm_dir.name)
    with LLM(smollm_dir, draft="suffix", mode="sd", suffix_keep=True, speculate_k=8) as llm:
        assert llm.suffix_index_tokens() == kept and set(llm.engine.suffix_index.tenants) == {None, "alice"}
        again = llm.generate([chat], params)[0]
    assert first.token_ids == again.token_ids == want
    assert again.metrics.accepted >= 30  # the answer of the engine before, reused
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", suffix_keep=True) as llm:  # beside a draft: the same file
        assert llm.suffix_index_tokens() >= kept
    path.write_bytes(b"not an index")
    with pytest.warns(UserWarning, match="not loaded"):
        with LLM(smollm_dir, draft="suffix", mode="sd", suffix_keep=True) as llm:
            assert llm.suffix_index_tokens() == 0

"""Prefix caching: full blocks of shared prefixes are computed once, shared read-only, copied
before a write, evicted least recently used; and a request that starts from cached blocks
gives the same tokens and logprob bits as on a cold engine, in every mode."""
from types import SimpleNamespace

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.runner.kv_cache import PagedKVCache

from tiny_pair import drafter

BS = 4
SYSTEM = "You are a careful assistant who answers in short sentences. " * 8


def cache(blocks: int, prefix: bool = True) -> PagedKVCache:
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
    return PagedKVCache(cfg, blocks * BS, BS, torch.device("cpu"), torch.float32, "m" if prefix else None)


def fill(kv: PagedKVCache, owner: int, tokens: list[int]) -> None:
    """As a forward pass over all of `tokens` would: K/V = the token id, then confirm them."""
    kv.reserve(owner, len(tokens))
    start = kv.cached(owner)
    kv.kv[0, 0, kv.writable(owner, start, len(tokens)), 0, 0] = torch.tensor(tokens[start:], dtype=torch.float32)
    kv.written(owner, len(tokens))
    kv.commit(owner, tokens)


def values(kv: PagedKVCache, owner: int) -> list[int]:
    return kv.kv[0, 0, kv.slots(owner, 0, kv.cached(owner)), 0, 0].int().tolist()


def test_a_new_owner_maps_the_cached_blocks_its_tokens_begin_with():
    kv = cache(16)
    fill(kv, 1, list(range(10)))  # two full blocks and a partial one
    assert kv.cached_blocks == 2
    assert kv.match(2, list(range(10)) + [99]) == 8  # the full blocks only
    assert kv.tables[2] == kv.tables[1][:2] and values(kv, 2) == list(range(8))
    assert kv.match(3, list(range(8))) == 4  # never the last token: its logits are needed
    assert kv.match(4, [0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4  # the same first block, another second
    assert kv.match(5, [1, 1, 2, 3, 4, 5, 6, 7, 8]) == 0  # a block is named by all before it
    assert kv.blocks_in_use == 3  # owners 2, 3 and 4 share owner 1's blocks


def test_a_write_never_changes_a_block_another_owner_reads():
    kv = cache(16)
    fill(kv, 1, list(range(9)))
    kv.match(2, list(range(9)))
    kv.truncate(2, 6)  # rollback into the shared second block, then other tokens there
    fill(kv, 2, [0, 1, 2, 3, 4, 5, 50, 51, 52])
    assert values(kv, 1) == list(range(9))
    assert values(kv, 2) == [0, 1, 2, 3, 4, 5, 50, 51, 52]
    assert kv.tables[2][0] == kv.tables[1][0] and kv.tables[2][1] != kv.tables[1][1]  # copied on write
    kv.release(1)
    kv.truncate(2, 6)
    fill(kv, 2, [0, 1, 2, 3, 4, 5, 60, 61, 62])  # now its block alone: written in place, renamed
    assert kv.match(3, [0, 1, 2, 3, 4, 5, 60, 61, 62]) == 8
    assert kv.match(4, [0, 1, 2, 3, 4, 5, 50, 51, 52]) == 4  # that content is gone
    assert kv.match(5, [0, 1, 2, 3, 4, 5, 6, 7, 8]) == 8  # owner 1's, unheld, is still cached


def test_unheld_blocks_stay_cached_until_their_slots_are_needed_oldest_first():
    kv = cache(4)
    fill(kv, 1, [1] * 5)
    fill(kv, 2, [2] * 5)
    kv.release(1)
    kv.release(2)
    assert kv.blocks_in_use == 0 and kv.cached_blocks == 2 and kv.can_reserve(3, 16)
    kv.reserve(3, 12)  # 3 blocks: the 2 free ones and the least recently used cached one
    assert kv.cached_blocks == 1
    assert kv.match(4, [1] * 5) == 0 and kv.match(5, [2] * 5) == 4
    kv.release(3)
    kv.release(5)
    assert kv.held() == {"owners": 0, "blocks": 0}


def test_without_prefix_caching_nothing_is_shared():
    kv = cache(8, prefix=False)
    fill(kv, 1, list(range(9)))
    assert kv.match(2, list(range(9))) == 0 and kv.cached_blocks == 0


CHATS = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
         for q in ("Name three colours.", "What is a prime number?", "Say hello in French.")]


def run(llm: LLM, params: SamplingParams) -> list:
    """Each chat alone, then all at once twice (the blocks then shared by running requests)."""
    return [llm.generate([c], params)[0] for c in CHATS] + llm.generate(CHATS * 2, params)


GREEDY = SamplingParams.greedy(max_tokens=24, logprobs=2)
SAMPLED = SamplingParams(temperature=0.8, seed=7, max_tokens=24, logprobs=2)


@pytest.mark.parametrize("mode", ["ar", "sd", "ngram", pytest.param("ssd", marks=pytest.mark.long)])
def test_cached_prefixes_change_no_bit(mode, smollm_dir, truncated_draft):
    """The same requests on a cold engine (prefix caching off) and on one so small that blocks
    are evicted while others are shared: the same tokens and logprob bits, greedy and with a
    seed (SSD greedy only: which speculation a sampled SSD round verifies depends on timing)."""
    draft = {"ar": None, "sd": truncated_draft, "ngram": "ngram", "ssd": truncated_draft}[mode]
    kw = {} if draft is None else dict(draft=draft, mode="ssd" if mode == "ssd" else "sd", speculate_k=3)
    params = [GREEDY] if mode == "ssd" else [GREEDY, SAMPLED]
    with LLM(smollm_dir, enable_prefix_caching=False, **kw) as llm:
        cold = [run(llm, p) for p in params]
    with LLM(smollm_dir, kv_cache_tokens=480, **kw) as llm:
        for want, p in zip(cold, params):
            outs = run(llm, p)
            for o, w in zip(outs, want):
                assert o.token_ids == w.token_ids and o.logprobs == w.logprobs, (mode, o.text, w.text)
            assert all(o.metrics.cached_tokens > 0 for o in outs[1:]), [o.metrics.cached_tokens for o in outs]
        assert llm.engine.cache.held()["blocks"] == 0


def test_the_sd_draft_reads_a_cached_prompt_too(smollm_dir, truncated_draft):
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=3) as llm:
        draft = drafter(llm).engine
        first = llm.generate([CHATS[0]], SamplingParams.greedy(max_tokens=8))[0]
        fed = draft.kv.prefix.hits
        second = llm.generate([CHATS[1]], SamplingParams.greedy(max_tokens=8))[0]
    assert first.metrics.cached_tokens == 0 and second.metrics.cached_tokens >= 64
    assert draft.kv.prefix.hits - fed == second.metrics.cached_tokens  # the draft found what the target did


def test_n_choices_share_their_prompt(smollm):
    outs = smollm.generate([CHATS[2]] * 3, SamplingParams(temperature=1.0, seed=3, max_tokens=4))
    cached = [o.metrics.cached_tokens for o in outs]
    assert cached[0] in (0, cached[1]) and cached[1] == cached[2] >= (outs[1].metrics.prompt_tokens - 1) // 16 * 16


def test_tenants_share_no_block():
    """Blocks are named per cache_salt: another tenant's identical text is never found, the
    same tenant's is, and unsalted requests share only among themselves."""
    kv = cache(32)
    tokens = list(range(10))
    fill(kv, 1, tokens)  # unsalted
    kv.match(2, tokens + [99], "alice")
    assert kv.cached(2) == 0
    fill(kv, 2, tokens)  # alice's own blocks now
    assert kv.match(3, tokens + [99], "bob") == 0
    assert kv.match(4, tokens + [99], "alice") == 8 and kv.tables[4][:2] == kv.tables[2][:2]
    assert kv.match(5, tokens + [99]) == 8 and kv.tables[5][:2] == kv.tables[1][:2]
    assert kv.first_block(tokens, "alice") != kv.first_block(tokens, "bob") != kv.first_block(tokens)
    kv.release(4)
    assert 4 not in kv.tenants


def test_a_salted_request_is_not_served_from_another_tenants_prompt(smollm_dir, truncated_draft):
    """Through the engine, on the target and on SD's draft: the same chat under another
    cache_salt computes its whole prompt again, under its own salt it reads the cache."""
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", speculate_k=3) as llm:
        draft = drafter(llm).engine
        ask = lambda salt: llm.generate([CHATS[0]], SamplingParams.greedy(max_tokens=4, cache_salt=salt))[0]  # noqa: E731
        first, other, same, plain = ask("tenant-a"), ask("tenant-b"), ask("tenant-a"), ask(None)
        hits = draft.kv.prefix.hits
        assert first.metrics.cached_tokens == other.metrics.cached_tokens == plain.metrics.cached_tokens == 0
        assert same.metrics.cached_tokens >= 64 and same.token_ids == first.token_ids == other.token_ids
        assert ask("tenant-b").metrics.cached_tokens >= 64 and draft.kv.prefix.hits > hits
    with pytest.raises(Exception, match="cache_salt"):
        SamplingParams(cache_salt="")

"""The draft-source seam (ssd/speculative/sources/): a source is one module behind
DraftSource.propose, reached by name once it is in sources/named.py. The toy source here
(the newest token, K times) is what the seam asks of a new draft: one class, one entry."""
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from ssd.speculative.records import Proposal
from ssd.speculative.sources.base import DraftSource
from ssd.speculative.sources.named import NAMED
from chance import fits
from tiny_pair import NEW, PROMPT, exact_joint, marginal_p_values


class RepeatLast(DraftSource):
    def propose(self, seqs, plans):
        return [Proposal([s.token_ids[-1]] * p.k) for s, p in zip(seqs, plans)]


@pytest.fixture
def repeat(monkeypatch):
    monkeypatch.setitem(NAMED, "repeat", lambda opts: RepeatLast())


def test_a_new_source_is_exact_greedy(repeat, smollm_dir, ar_outputs):
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    prompts = ["Say hello hello hello hello", "def add(a, b):"]
    with LLM(smollm_dir, draft="repeat", mode="sd", speculate_k=3) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert all(o.metrics.drafted > 0 for o in outs) and sum(o.metrics.accepted for o in outs) > 0


def test_a_new_source_samples_the_target(repeat, tiny_pair):
    target, _ = tiny_pair
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    with LLM(target, draft="repeat", mode="sd", speculate_k=2, max_num_seqs=500, seed=3) as llm:
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    assert sum(o.metrics.accepted for o in outs) > 100  # the path is really taken
    assert all(map(fits, marginal_p_values(tokens, exact_joint(target, prompt_ids, temperature))))


def test_a_named_source_runs_in_sd_only(repeat, smollm_dir):
    with pytest.raises(SSDError, match="runs in mode 'sd', not 'ssd'"):
        LLM(smollm_dir, draft="repeat", mode="ssd")

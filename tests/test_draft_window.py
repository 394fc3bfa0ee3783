"""draft_window: a draft that reads at most the last W tokens of what it has not seen (issue
33, lever 4). The target verifies every token, so the output stays AR's."""
import pytest

from ssd import LLM, SamplingParams
from ssd.errors import SSDError
from test_auto_k import _EveryOtherLookup
from test_ngram import REPEATING
from tiny_pair import drafter

WINDOW = 16
LONG = "Summarise: " + " ".join(f"item {i} is {'red' if i % 3 else 'blue'}." for i in range(40))


def fed(engine) -> list[int]:
    """Records the tokens of each chunk the draft engine's runner is fed."""
    sizes = []
    forward = engine.runner.forward

    def spy(chunks, head=True):
        sizes.extend(len(c.tokens) for c in chunks)
        return forward(chunks, head)
    engine.runner.forward = spy
    return sizes


def test_sd_with_a_draft_window_is_exact_and_reads_at_most_the_window(smollm_dir, truncated_draft, ar_outputs):
    """A long prompt, and lookup rounds every other round that leave the draft behind: every
    catch-up reads at most W tokens, the draft's context is cut (its offset), and the output is AR's."""
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    prompts = [LONG, REPEATING]
    with LLM(smollm_dir, draft=truncated_draft, mode="sd", draft_window=WINDOW) as llm:
        llm.engine.k_policy = _EveryOtherLookup(k_max=4)
        draft = drafter(llm).engine
        sizes = fed(draft)
        offsets = []
        release = draft.release
        draft.release = lambda seq_id: (offsets.append(draft.seqs[seq_id].offset), release(seq_id))[1]
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar_outputs(prompts, params)
    assert sizes and max(sizes) <= WINDOW
    assert all(o > 0 for o in offsets), offsets  # both contexts outgrew the window
    assert outs[1].metrics.lookup_rounds > 0


def test_ssd_with_a_draft_window_is_exact(smollm_dir, truncated_draft, ar_outputs):
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=3, fan_out=2, draft_window=WINDOW) as llm:
        outs = llm.generate([LONG], params)
    assert [o.token_ids for o in outs] == ar_outputs([LONG], params)
    assert outs[0].metrics.rounds > 0


def test_draft_window_option(smollm_dir):
    with pytest.raises(SSDError, match="draft_window must be an integer >= 16"):
        LLM(smollm_dir, draft=smollm_dir, mode="sd", draft_window=4)

"""`ssd check` (ssd/exactness.py): the user's speculative configuration against plain decoding,
on the tiny pair: it passes for the real engine and fails for foils a biased rule would make."""
from collections import Counter

import pytest
import torch

import ssd.speculative.round
from ssd.cli import main
from ssd.exactness import check, homogeneity, power
from ssd.sampling_params import SamplingParams
from ssd.speculative.verifier import Verdict
from tiny_pair import PROMPT


def test_homogeneity_of_one_distribution_and_of_two():
    same = Counter({"a": 500, "b": 300, "c": 200})
    assert homogeneity(same, same)[2] == pytest.approx(1.0)
    # A 2 x 2 table worked by hand: rows (a, b), columns (x, y) = (30, 10), (20, 40).
    stat, df, p = homogeneity(Counter(a=30, b=20), Counter(a=10, b=40))
    assert df == 1 and stat == pytest.approx(16.6667, rel=1e-4) and p == pytest.approx(4.46e-5, rel=1e-2)
    # Outcomes too rare to test alone are pooled into one cell.
    assert homogeneity(Counter(a=100, x=1, y=1), Counter(a=100, z=2))[1] == 1
    # Power: near the level for one distribution, near 1 for two far apart.
    assert power(same, same, 400, 0.01) < 0.05
    assert power(same, Counter({"a": 300, "b": 300, "c": 400}), 400, 0.01) > 0.95


def _accept_every_draft(p, draft, q, generator):
    """A biased rule: every draft token accepted, the bonus token from the target."""
    return Verdict(accepted=len(draft), token=int(torch.multinomial(p[-1], 1, generator=generator)))


def test_check_passes_sd_and_rejects_a_rule_that_accepts_every_draft(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    kw = dict(mode="sd", spec=dict(speculate_k=2), params=SamplingParams(temperature=1.0, ignore_eos=True),
              greedy_tokens=8, samples=400, sample_tokens=4, alpha=0.01)
    report = check(target, draft, [PROMPT], **kw)
    assert report.passed, report.lines()
    assert report.greedy[0].first_difference is None and report.greedy[0].tokens == 8
    (s,) = report.sampled
    # The foil (the draft alone) is far enough from the target for the test to tell them apart.
    assert s.foil_p < 1e-4 and s.foil_power > 0.5, report.lines()

    monkeypatch.setattr(ssd.speculative.round, "verify", _accept_every_draft)
    biased = check(target, draft, [PROMPT], foil=False, **kw)
    assert not biased.passed and biased.sampled[0].p < biased.threshold, biased.lines()
    assert "FAIL" in biased.lines()[-1]


def test_check_compares_seeded_runs_token_for_token(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    kw = dict(mode="sd", spec=dict(speculate_k=2), params=SamplingParams(temperature=0.8, ignore_eos=True),
              greedy_tokens=12, samples=40, sample_tokens=2, foil=False, seed=5)
    report = check(target, draft, [PROMPT], **kw)
    assert report.passed and [(g.tokens, g.first_difference) for g in report.seeded] == [(12, None)]
    assert any(line.startswith("seeded   prompt 0: 12 tokens, equal") for line in report.lines())
    # A rule that accepts every draft token changes the seeded tokens.
    monkeypatch.setattr(ssd.speculative.round, "greedy_tree",
                        lambda best, drafts, branches: (len(drafts), [], best[len(drafts)]))
    biased = check(target, draft, [PROMPT], **kw)
    assert not biased.passed and biased.seeded[0].first_difference is not None


def test_check_finds_a_greedy_difference(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    monkeypatch.setattr(ssd.speculative.round, "greedy_tree",
                        lambda best, drafts, branches: (len(drafts), [], best[len(drafts)]))
    report = check(target, draft, [PROMPT], spec=dict(speculate_k=3), params=SamplingParams(temperature=0.0),
                   greedy_tokens=12)
    assert not report.passed and report.greedy[0].first_difference is not None and not report.sampled


def test_the_check_command(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(f'{{"prompt": "{PROMPT}"}}\n{{"prompt": "w3 w3"}}\n')
    assert main(["check", "--model", str(target), "--draft", str(draft), "--prompts", str(prompts), "--k", "2",
                 "--max-tokens", "8", "--samples", "200", "--ignore-eos", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("greedy   prompt") == out.count("seeded   prompt") == out.count("sampled  prompt") == 2
    assert out.count("equal") == 4 and "verdict: PASS" in out
    assert main(["check", "--model", str(target), "--mode", "ar"]) == 2
    assert "compares --mode sd or --mode ssd" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    assert main(["check", "--model", str(target), "--draft", str(draft), "--prompts", str(tmp_path / "bad.jsonl")]) == 2
    assert "line 1" in capsys.readouterr().err

"""The thread count that follows the machine's load (ssd/runner/threads.py), driven by synthetic
pass times: nothing here reads this machine's clock or load."""
import random

import pytest

from ssd import LLM, SamplingParams
from ssd.config import EngineConfig
from ssd.speculative.policy.estimators import LowQuantile
from ssd.runner.threads import ABANDON, CALM_WAIT, FIRST_WAIT, MAX_WAIT, TRIAL_PASSES, ThreadChooser

# A decode step's seconds by thread count: quiet, two threads are 1.45x as fast as one; with one
# of two cores busy, a pass at two threads waits for the thread whose core is taken.
QUIET = {1: 0.0145, 2: 0.010}
BUSY = {1: 0.015, 2: 0.026}


def _run(chooser: ThreadChooser, passes: int, times, rng: random.Random, rows=lambda i: 1) -> list[int]:
    """Passes through `chooser`, each taking times(i)[threads] with 5 % noise and now and then a
    spike; the thread count of each."""
    counts = []
    for i in range(passes):
        n = chooser.threads()
        seconds = times(i)[n] * rng.uniform(1.0, 1.05) * (3.0 if rng.random() < 0.03 else 1.0)
        chooser.observe(rows(i), seconds)
        counts.append(n)
    return counts


def test_a_quiet_machine_keeps_every_thread_and_checks_less_and_less_often():
    rng, chooser = random.Random(0), ThreadChooser(2, LowQuantile)
    counts = _run(chooser, 4000, lambda i: QUIET, rng, rows=lambda i: rng.choice([1, 1, 1, 5, 300]))
    assert chooser.count == 2
    # The trials' passes at one thread: the first at start-up, then rarer (waits 32, 128, 512, ...).
    assert counts.count(1) <= 6 * TRIAL_PASSES
    assert counts[-MAX_WAIT // 2:].count(1) <= TRIAL_PASSES
    # Their cost in pass time: under 1 % of 4000 passes.
    extra = counts.count(1) * (QUIET[1] - QUIET[2])
    assert extra < 0.01 * 4000 * QUIET[2]


def test_a_machine_busy_from_the_start_runs_one_thread_from_the_first_request():
    rng, chooser = random.Random(1), ThreadChooser(2, LowQuantile)
    _run(chooser, 2 * TRIAL_PASSES + 1, lambda i: BUSY, rng)  # the warm-up's passes: the first trial
    assert not chooser.trialling and chooser.count == 1
    counts = _run(chooser, 1000, lambda i: BUSY, rng)
    assert counts.count(2) <= (1000 // CALM_WAIT + 2) * TRIAL_PASSES  # trials that find it still busy


def test_load_that_comes_is_followed_within_a_few_dozen_passes_and_calm_that_returns_too():
    rng, chooser = random.Random(2), ThreadChooser(2, LowQuantile)
    busy = range(1000, 2000)
    counts = _run(chooser, 3000, lambda i: BUSY if i in busy else QUIET, rng)
    first_one = counts.index(1, 1000)
    assert all(c == 1 for c in counts[first_one + 2 * TRIAL_PASSES:1000 + 200] if c != 2) and first_one < 1000 + 40
    # Trials of two threads after waits of 32, 128, then CALM_WAIT passes.
    assert counts[1000 + 60:2000].count(2) <= (2 + 1000 // CALM_WAIT) * TRIAL_PASSES
    # Calm again: two threads within the longest wait at one thread.
    back = counts.index(2, 2000)
    assert back < 2000 + CALM_WAIT + 2 * TRIAL_PASSES and counts[back + MAX_WAIT // 4:].count(1) <= 2 * TRIAL_PASSES


def test_a_trial_that_loses_at_once_costs_one_pass():
    """Under load at one thread, each trial of two threads ends after its first pass (twice as
    slow); on a quiet machine no trial of one thread against two is cut short, its passes
    being within ABANDON of two threads'."""
    def trials(chooser: ThreadChooser) -> list[int]:
        """Filled, as trials end with the current count kept, with their passes at the other."""
        lengths, keep = [], chooser._keep
        chooser._keep = lambda: lengths.append(len(chooser.trial.ratios[1])) or keep()
        return lengths

    assert QUIET[1] / QUIET[2] * 1.05 < ABANDON < BUSY[2] / BUSY[1]
    rng, chooser = random.Random(5), ThreadChooser(2, LowQuantile)
    _run(chooser, 2 * TRIAL_PASSES + 1, lambda i: BUSY, rng)
    busy = trials(chooser)
    counts = _run(chooser, 3000, lambda i: BUSY, rng)
    assert len(busy) >= 8 and busy.count(1) >= len(busy) - 1  # (a spike may let one run whole)
    assert counts.count(2) <= len(busy) + TRIAL_PASSES
    rng, chooser = random.Random(6), ThreadChooser(2, LowQuantile)
    quiet = trials(chooser)
    _run(chooser, 4000, lambda i: QUIET, rng)
    assert len(quiet) >= 4 and quiet.count(TRIAL_PASSES) >= len(quiet) - 1  # (but where a spike fell first)


def test_a_slowdown_that_hits_every_count_alike_changes_nothing():
    """Passes twice as slow at any count (a slower clock, a thermal limit): no count is faster."""
    rng, chooser = random.Random(3), ThreadChooser(2, LowQuantile)
    counts = _run(chooser, 2000, lambda i: QUIET if i < 500 else {n: 2 * s for n, s in QUIET.items()}, rng)
    assert chooser.count == 2 and counts[500:].count(1) <= 4 * TRIAL_PASSES


def test_many_cores_settle_near_the_count_that_runs_fastest():
    """Eight threads, four of the cores busy: a pass's time is its work over the threads' speed,
    a thread on a busy core running at a third of its speed and the pass waiting for it."""
    def seconds(n: int) -> float:
        slowest = 1 / 3 if n > 4 else 1.0
        return 0.08 / n / slowest

    rng, chooser = random.Random(4), ThreadChooser(8, LowQuantile)
    _run(chooser, 600, lambda i: {n: seconds(n) for n in (1, 2, 4, 8)}, rng)
    assert chooser.count == 4


def test_one_thread_is_never_tried_against_itself():
    chooser = ThreadChooser(1, LowQuantile)
    assert not chooser.trialling and chooser.threads() == 1
    for _ in range(FIRST_WAIT * 4):
        chooser.observe(1, 0.01)
    assert not chooser.trialling and chooser.threads() == 1


@pytest.mark.parametrize("options, follows", [({}, True), ({"threads": 2}, False), ({"threads": 1}, False)])
def test_threads_given_by_the_user_are_left_alone(smollm_dir, options, follows):
    assert EngineConfig(smollm_dir, **options).follow_load is follows


def test_a_count_changed_between_passes_changes_no_output(smollm_dir):
    """A row's bits do not depend on the thread count: an engine whose chooser is forced to
    alternate counts every pass gives AR's tokens and logprob bits at a fixed count."""
    params = SamplingParams.greedy(max_tokens=24, logprobs=2)
    fixed = LLM(smollm_dir, threads=2).generate(["def quicksort(arr):"], params)[0]
    llm = LLM(smollm_dir)
    chooser = llm.engine.runner.threads
    turns = iter(range(10**6))
    chooser.threads = lambda: 1 + next(turns) % 2
    moving = llm.generate(["def quicksort(arr):"], params)[0]
    assert moving.token_ids == fixed.token_ids
    assert [lp.logprob for lp in moving.logprobs] == [lp.logprob for lp in fixed.logprobs]

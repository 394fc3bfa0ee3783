"""Auto-K's choices on a recorded run (tests/policy_trace.py): the default pair's inputs to the
policy, one request at a time then batches, greedy and sampled, with prompt lookup and the
draft's stopping rule, replayed through the policy as it is now. A change meant to keep the
policy's choices keeps every plan; one meant to change them records the trace again (the
command in tests/policy_trace.py) and says what changed in its commit."""
import gzip
import json
from pathlib import Path

from policy_trace import replay

TRACE = Path(__file__).parent / "data" / "policy_trace.json.gz"


def test_the_recorded_runs_plans_are_made_again():
    with gzip.open(TRACE, "rt") as f:
        traces = json.load(f)
    plans = [p for t in traces for p in replay(t)]
    assert len(plans) > 100 and any(sum(r["ks"]) == 0 for r, _ in plans) and any(len(r["ks"]) > 1 for r, _ in plans)
    assert any(any(lk for lk in r["lookups"]) for r, _ in plans)  # (lookup rounds in it)
    changed = [(i, recorded, now) for i, (recorded, now) in enumerate(plans) if recorded != now]
    assert not changed, changed[:5]

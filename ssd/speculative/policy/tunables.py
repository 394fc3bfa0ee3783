"""Every tunable of the speculation policies, in one place, with its meaning. Each rule that
reads one is stated in docs/cost-model.md with its reason; the measurements behind the values
are in docs/decision-log.md.
"""

# ---- Reading the clock (estimators.py) -------------------------------------------------------
TIME_WINDOW = 16  # measurements a time is read over
TIME_QUANTILE = 0.25  # ... as this quantile of them (a slowdown is taken once it holds 3/4 of the window)
SIZE_EVIDENCE = 8  # a size's passes rounds must have measured before they, not its start-up timing, price it
SPIKE = 1.5  # a time this many times what the model expects of it was caught in a spike (start-up
#               timings, a catch-up, a round of the draft's stopping rule)
RETAKES = 2  # times the start-up timings are taken again, at most, where rounds find them spiked

# ---- Acceptance (adaptive_k.py) --------------------------------------------------------------
PRIOR_RATE = 0.6  # acceptance assumed at every position before anything is measured
PRIOR_ROUNDS = 2.0  # ... worth this many rounds in the engine-wide rates
SEQ_ROUNDS = 4.0  # a sequence's own rates are shrunk towards the engine-wide ones by this many rounds
SEQ_DECAY = 0.9  # per round, a sequence's counts: its recent text counts most
ENGINE_DECAY = 0.995  # per round, the engine-wide counts
ENGINE_EVIDENCE = 8  # decayed rounds at the first position before the rates may refuse a catch-up
# Prompt lookup's acceptance assumed before any is measured, by match length 1, 2, 3, 4+
# (a 1-token match is rarely a copy: bench/studies/lookup_headroom.py).
LOOKUP_PRIOR = (0.2, 0.4, 0.6, 0.75)
WITHOUT_EMA = 0.2  # a sequence's time a token without the draft, over plain decoding's: a round's weight

# ---- The cost model (costs.py, model.py) -----------------------------------------------------
CATCHUP_DECAY = 0.9  # per catch-up measured, in the catch-up's fit
CATCHUP_RIDGE = 0.01  # ... and its diagonal's relative ridge (alike sizes alone: a stable fit)
WORTH_FLOOR = 0.25  # a token's worth is at least this share of the batch's average (its user waits)

# ---- Rules (rules.py) ------------------------------------------------------------------------
PROBE_K = 2  # tokens a probe drafts
PROBE_BUDGET = 0.05  # share of plain decoding time spent on probes, at most
PROBE_BACKOFF = 16  # a probe that gains nothing doubles the wait before the next, up to this factor
EXPLORE_GAP = 4  # a drafting sequence tries one token deeper than chosen every this many rounds ...
EXPLORE_EVIDENCE = 1.0  # ... while its own (decayed) rounds that reached that position are fewer
HOLD_SHARE = 0.03  # planning's share of the rounds where a plan that drafts nothing holds
HOLD_MIN_S = 0.5e-3  # a plan quicker than this never holds
HOLD_MAX = 32  # rounds a plan holds for at most

# ---- The draft's stopping rule (draft_stop.py) -----------------------------------------------
STOP_BINS = 10  # the draft's calibration, by its top-1 probability in this many bins
STOP_PRIOR_TOKENS = 2.0  # the prior f(c) = c, worth this many tokens per bin
STOP_DECAY = 0.998  # per round, the calibration's counts
STOP_RATE_EMA = 0.2  # the rule's rounds' tokens and seconds: a round's weight

# ---- Branches off the chain (siblings.py) ----------------------------------------------------
MAX_PER_SEQUENCE = 12  # branch rows a sequence's round may add
BRANCH_DECAY = 0.98  # per round with branches: the calibration follows the recent text
BRANCH_PRIOR_RESCUES = 2.0  # expected rescues' worth of the prior calibration 1

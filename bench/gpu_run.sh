#!/usr/bin/env bash
# Issue 34's GPU measurements in one device call (the machine is lent for minutes at a time):
#   [OLD=DIR] bash bench/gpu_run.sh LIKE PROMPTS OUT [profile] [steps] [e2e] [e2e8b]
# LIKE holds target/ and draft/: config and tokenizer files of a real pair (no weights; e.g.
# qwen2.5-coder-1.5b-instruct and -0.5b-instruct), PROMPTS a JSONL of {"prompt": ...}.
# OLD: a folder holding another commit's ssd/ package (`git archive REV ssd | tar -x -C DIR`):
#      profile, e2e and e2e8b then run it too, in the same call (before/after on one machine).
# profile: bench/gpu_profile.py, captured steps of the pairs' shapes: replay, step wall, kernels.
# steps: bench/gpu_steps.py, Llama-3.1-8B-shaped steps, eager vs captured, invariance, exactness.
# e2e: a random-weight pair of LIKE's shapes with a planted acceptance of 0.8
#      (synthetic_models.py), then `ssd bench` AR / SD / SSD at batch 1 (BATCHES="1 4": and 4),
#      256 tokens, greedy (=AR checked).
# e2e8b: the same with Llama-3.1-8B's and Llama-3.2-1B's shapes (LIKE's vocabulary), batch 1,
#      K = 4 and auto.
# Every part runs when none is named.
set -uo pipefail
LIKE=$1 PROMPTS=$2 OUT=$3
PARTS=" ${*:4} "
[ "$PARTS" = "  " ] && PARTS=" profile steps e2e e2e8b "
export PYTHONUNBUFFERED=1
BASE=${PYTHONPATH:-}
SSD=(python3 -c "import sys; from ssd.cli import main; sys.argv[0] = 'ssd'; sys.exit(main())")
CODES="new"
[ -n "${OLD:-}" ] && CODES="old new"
use() {  # the ssd package of this commit (new) or OLD's (old)
    if [ "$1" = old ]; then export PYTHONPATH=$OLD:$PWD:$BASE; else export PYTHONPATH=$PWD:$BASE; fi
}
bench() {  # bench NAME MODELS_DIR [batches] [ssd bench options]
    for b in ${3:-1}; do
        timeout 240 "${SSD[@]}" bench --model "$2/target" --draft "$2/draft" --prompts "$PROMPTS" \
            --max-tokens 256 --ignore-eos --modes ar,sd,ssd --f 2 --batch-size $b --no-progress \
            --out "$OUT/$1-b$b" ${4:---k 4} 2>&1 | grep -v "incorrect regex" | tail -8
        rm -f "$OUT"/$1-b$b/*.png
    done
}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
use new
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ $PARTS == *" profile "* ]]; then
    for c in $CODES; do
        use $c
        echo "== profile ($c)"
        timeout 200 python3 bench/gpu_profile.py --out "$OUT/profile-$c" ${PROFILE_SHAPES:+--shapes $PROFILE_SHAPES} \
            2>&1 | tee "$OUT/profile-$c.log" | tail -7
    done
fi
use new
if [[ $PARTS == *" e2e8b "* ]]; then
    timeout 180 python3 bench/synthetic_models.py --target-like "$LIKE/target" --draft-like "$LIKE/draft" \
        --target-shape llama3.1-8b --draft-shape llama3.2-1b --out /tmp/synth8b --accept 0.8 2>&1 | tail -3
    for c in $CODES; do
        use $c
        echo "== e2e8b ($c)"
        bench e2e8b-$c /tmp/synth8b 1 "--sweep k=4,auto"
    done
    use new
    rm -rf /tmp/synth8b
fi
if [[ $PARTS == *" steps "* ]]; then
    timeout 180 python3 bench/gpu_steps.py --out "$OUT/steps" 2>&1 | tee "$OUT/steps.log" | tail -6
fi
if [[ $PARTS == *" e2e "* ]]; then
    timeout 100 python3 bench/synthetic_models.py --target-like "$LIKE/target" --draft-like "$LIKE/draft" \
        --out /tmp/synth --accept 0.8 2>&1 | tail -3
    for c in $CODES; do
        use $c
        echo "== e2e ($c)"
        bench e2e-$c /tmp/synth "${BATCHES:-1}"
    done
fi

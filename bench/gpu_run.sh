#!/usr/bin/env bash
# Issue 34's GPU measurements in one device call (the machine is lent for minutes at a time):
#   bash bench/gpu_run.sh LIKE PROMPTS OUT [steps] [e2e]
# LIKE holds target/ and draft/: config and tokenizer files of a real pair (no weights; e.g.
# qwen2.5-coder-1.5b-instruct and -0.5b-instruct), PROMPTS a JSONL of {"prompt": ...}.
# steps: bench/gpu_steps.py, Llama-3.1-8B-shaped steps, eager vs captured, invariance, exactness.
# e2e: a random-weight pair of LIKE's shapes with a planted acceptance of 0.8
#      (synthetic_models.py), then `ssd bench` AR / SD / SSD at batch 1 and 4, 256 tokens,
#      greedy (=AR checked). Both parts when none is named.
set -uo pipefail
LIKE=$1 PROMPTS=$2 OUT=$3
PARTS=" ${*:4} "
[ "$PARTS" = "  " ] && PARTS=" steps e2e "
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
SSD=(python3 -c "import sys; from ssd.cli import main; sys.argv[0] = 'ssd'; sys.exit(main())")
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ $PARTS == *" steps "* ]]; then
    timeout 180 python3 bench/gpu_steps.py --out "$OUT/steps" 2>&1 | tee "$OUT/steps.log"
fi
if [[ $PARTS == *" e2e "* ]]; then
    timeout 100 python3 bench/synthetic_models.py --target-like "$LIKE/target" --draft-like "$LIKE/draft" \
        --out /tmp/synth --accept 0.8 2>&1 | tail -3
    for b in ${BATCHES:-1 4}; do
        timeout 150 "${SSD[@]}" bench --model /tmp/synth/target --draft /tmp/synth/draft --prompts "$PROMPTS" \
            --max-tokens 256 --ignore-eos --modes ar,sd,ssd --k 4 --f 2 --batch-size $b --no-progress \
            --out "$OUT/e2e-b$b" 2>&1 | grep -v "incorrect regex" | tail -40
        rm -f "$OUT"/e2e-b$b/*.png
    done
fi

#!/usr/bin/env bash
# Every GPU measurement the open GPU work asks for, in one device call (a session is lent a
# machine for minutes): random weights of real shapes (bench/gpu/synthetic_models.py), a planted
# acceptance of 0.8, greedy, every row checked token-identical to AR.
#
#   [OLD=DIR] bash bench/gpu/gpu_run.sh LIKE PROMPTS OUT [PART ...]
#
# LIKE holds target/ and draft/: the config and tokenizer files of a real pair (no weights;
# e.g. qwen2.5-coder-1.5b-instruct and -0.5b-instruct), PROMPTS a JSONL of {"prompt": ...}.
# Each prompt is sent as plain text with a keyword of its own at its end: a planted model's answer
# follows from the last token alone, so prompts that end alike (as every chat template does) get the
# same answer, which suffix decoding's index over earlier requests would then predict whole.
# OLD: a folder holding an earlier commit's ssd/ package (`git archive REV ssd | tar -x -C DIR`),
# run beside this one's in the parts `owed` and `head` (before/after on one machine, in one call).
# OUT gets run.log (everything printed) and results.tgz (each run's results.json and table.md).
# Parts, in the order they run (all when none is named; each under its own time limit):
#   ssd32     SSD with a small draft (45M weights of body, a 32,000-token output layer) on the host's
#             cores beside a target of Qwen2.5-32B's shapes on the GPU (its layers made at load:
#             bench/gpu/synthetic_load.py), against SD and SSD with that draft on the GPU, K = 4 and 6;
#             where each round's time goes and SSD's bound (bench/round_costs.py)
#   cpudraft  SSD with the draft on the host's CPU cores (--draft-device cpu: all but the
#             first) beside the target on the GPU, against SD and SSD with the draft on the GPU;
#             Llama-3.1-8B's shapes, a draft of Qwen2.5-0.5B's shapes; and the CPU draft's pass
#             cost on the host (bench/pass_cost.py), the kernels' parallel build time
#   head      SD with an EAGLE-3 head of the 8B's layer shape (a 32,000-token vocabulary, planted as the
#             1B draft is: bench/gpu/synthetic_models.py --head) beside SD with the 1B draft, K = 4, 6 and auto,
#             the target's passes captured with the layers the head reads (bench/draft_compare.py:
#             interleaved, a drafted token's cost in target steps)
#   owed      AR, SD and SSD at K = 4 and auto (auto-K after the start-up captures); 8B / 1B shapes
#   seeded    AR, SD and SSD sampled at T = 0.8 with a seed (shared noise: =AR must say yes), K auto
#   thread    SSD's worker as a thread of the target's process against a process, one GPU
#   batches   64, 16 and 4 concurrent requests, AR / SD / SSD with K = auto, 128 tokens each
#   host      where a decode step's host time goes at a batch of 64 (bench/gpu/host_profile.py: AR and
#             SD at K = 0 with the 1B draft, each step's wall against its synchronised passes, cProfile)
#   profile   captured steps of Qwen2.5-32B's shapes (no files: 65 GB built on the GPU):
#             a verify pass's time V for the SSD bound 1 + K*d/V
set -uo pipefail
LIKE=$1 PROMPTS=$2 OUT=$3
PARTS=" ${*:4} "
[ "$PARTS" = "  " ] && PARTS=" ssd32 cpudraft head owed seeded thread batches host profile "
BATCHES=${BATCHES:-64 16 4}  # the part batches' sizes
# The part ssd32's target shape and the SSD draft's devices (a dry run on a CPU: qwen2.5-0.5b and cpu)
SHAPE32=${SHAPE32:-qwen2.5-32b} DDEVS=${DDEVS:-cuda:0,cpu}
export PYTHONUNBUFFERED=1
BASE=${PYTHONPATH:-}
START=$SECONDS BUDGET=${BUDGET:-540}  # seconds; a part that might not end within it is skipped
RES=/tmp/gpu-results SYN=/tmp/synth8b SYN32=/tmp/synth32b
SSD=(python3 bench/gpu/synthetic_load.py ssd)  # `ssd` (the package is not installed there), with layers made at load
mkdir -p "$OUT" "$RES"
exec > >(tee "$OUT/run.log") 2>&1
use() {  # the ssd package of this commit (new) or OLD's (old)
    if [ "$1" = old ]; then export PYTHONPATH=$OLD:$PWD:$BASE; else export PYTHONPATH=$PWD:$BASE; fi
}
part() {  # part NAME LIMIT_S: whether NAME was asked for and fits in what is left of BUDGET
    [[ $PARTS == *" $1 "* ]] || return 1
    tar czf "$OUT/results.tgz" -C "$RES" .  # what is done so far comes back whatever happens next
    if [ $((SECONDS - START + $2)) -gt "$BUDGET" ]; then
        echo "== $1 skipped: $((SECONDS - START)) s gone, it may take $2 s of the $BUDGET s budget"
        return 1
    fi
    echo "== $1 (at $((SECONDS - START)) s)"
}
bench() {  # bench NAME LIMIT_S [ssd bench options]: target $TARGET, greedy, 128 or 256 tokens
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "${SSD[@]}" bench --model "$TARGET" --prompts "$PROMPTS" --ignore-eos --no-progress \
        --chat-template off \
        --out "$RES/$name" "$@" >"$RES/$name.log" 2>&1
    local rc=$?
    sed -n '/^set /,/^$/p' "$RES/$name.log"
    [ $rc = 0 ] || { echo "($name: exit $rc)"; grep -v "incorrect regex" "$RES/$name.log" | tail -6; }
    rm -f "$RES/$name"/*.png
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node0|L3"
use new
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The CPU draft's kernels build side by side (ssd/kernels/prebuild.py) while the models are written.
BUILD=
if [[ $PARTS == *" cpudraft "* || $PARTS == *" ssd32 "* ]]; then
    ( t=$SECONDS; python3 -c "from ssd.kernels.prebuild import prebuild; prebuild()" 2>&1 | tail -3
      echo "CPU kernels built in $((SECONDS - t)) s" ) &
    BUILD=$!
fi
TARGET=$SYN/target
if [[ $PARTS == *" "@(cpudraft|head|owed|seeded|thread|batches|host)" "* ]]; then
    timeout 150 python3 bench/gpu/synthetic_models.py --target-like "$LIKE/target" --draft-like "$LIKE/draft" \
        --target-shape llama3.1-8b --draft-shape llama3.2-1b --out $SYN --accept 0.8 \
        $([[ $PARTS == *" cpudraft "* ]] && echo --cpu-draft-shape qwen2.5-0.5b) \
        $([[ $PARTS == *" head "* ]] && echo --head) 2>&1 | tail -2
fi
if [[ $PARTS == *" ssd32 "* ]]; then  # 3 GB written: the 32B's layers are made when it loads
    timeout 100 python3 bench/gpu/synthetic_models.py --target-like "$LIKE/target" --draft-like "$LIKE/draft" \
        --target-shape $SHAPE32 --draft-shape qwen2.5-0.5b-3l --subset 32000 --target-layers-at-load \
        --out $SYN32 --target-name qwen32b --accept 0.8 2>&1 | tail -2
fi
[ -z "$BUILD" ] || wait $BUILD
python3 - "$PROMPTS" <<'EOF'  # the given prompts with a keyword each (above), 64 for the batches
import json, sys
base = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
words = ("apple river stone cloud tiger piano rocket garden silver window bridge candle forest marble orange pepper "
         "violet winter summer castle dragon falcon harbor island jungle kettle ladder meadow needle ocean palace "
         "quartz rabbit saddle temple umbrella valley wagon yellow zebra anchor basket copper desert engine feather "
         "glacier hammer iron jacket kitten lemon mirror nickel oyster pillow quiver ribbon shadow thunder velvet "
         "walnut crystal meteor").split()  # each a last token of its own in Qwen2.5's tokenizer
lines = [json.dumps({"prompt": f"{base[i % len(base)]['prompt']} Keyword: {w}"}) + "\n" for i, w in enumerate(words)]
open("/tmp/prompts64.jsonl", "w").writelines(lines)
open("/tmp/prompts.jsonl", "w").writelines(lines[:len(base)])
EOF
PROMPTS=/tmp/prompts.jsonl

if part ssd32 260; then
    # The draft's reduced output layer (its 32,000 rows: the target's counts) on both devices.
    for k in 4 6; do
        TARGET=$SYN32/qwen32b bench ssd32-k$k 125 --draft $SYN32/draft --modes ar,sd,ssd --k $k --max-tokens 128 \
            --sweep ddev=$DDEVS
        python3 bench/round_costs.py "$RES/ssd32-k$k/results.json"
    done
fi
if part cpudraft 200; then
    timeout 60 python3 bench/pass_cost.py --model $SYN/draft-cpu --weights int8 --m 1,4,8,16 --threads 15,8 \
        --repeats 3 2>&1 | tail -6
    bench cpudraft 150 --draft $SYN/draft-cpu --modes ar,sd,ssd --k 4 --max-tokens 256 --sweep ddev=cuda:0,cpu
fi
compare() {  # compare NAME: SD with the 1B draft and with the head beside AR (bench/draft_compare.py)
    timeout 160 python3 bench/draft_compare.py --model $SYN/target --drafts $SYN/draft,$SYN/head --ks 4,6,auto \
        --sets none --prompts "$PROMPTS" --chat-template off --max-tokens 256 --ignore-eos --out "$RES/$1.json" \
        >"$RES/$1.log" 2>&1
    echo "($1: exit $?)"
    grep -v "incorrect regex" "$RES/$1.log" | tail -9
}
if part head 160; then
    compare head
fi
if part owed 100; then
    bench owed-new 100 --draft $SYN/draft --modes ar,sd,ssd --max-tokens 256 --sweep k=4,auto
fi
if part seeded 70; then
    bench seeded 70 --draft $SYN/draft --modes ar,sd,ssd --k auto --max-tokens 128 --temperature 0.8 --seed 1
fi
if part thread 90; then
    bench thread 90 --draft $SYN/draft --modes ar,ssd --k 4 --max-tokens 256 --sweep thread=on,off
fi
if part batches 180; then
    for b in $BATCHES; do
        PROMPTS=/tmp/prompts64.jsonl bench batch$b 60 --draft $SYN/draft --modes ar,sd,ssd --k auto \
            --max-tokens 128 --batch-size $b --num-prompts $b
    done
fi
if part host 90; then
    timeout 90 python3 bench/gpu/host_profile.py --model $SYN/target --draft $SYN/draft --batch 64 --profile 25 \
        >"$RES/host.log" 2>&1
    echo "(host: exit $?)"
    grep -E "^(AR|SD)" "$RES/host.log"
fi
if part profile 90; then
    timeout 90 python3 bench/gpu/gpu_profile.py --shapes qwen2.5-32b --repeat 10 --out "$RES/profile" \
        2>&1 | grep -v Warning | tail -5
fi
if [ -n "${OLD:-}" ] && part owed 100; then
    use old
    echo "(old: $OLD)"
    bench owed-old 100 --draft $SYN/draft --modes ar,sd,ssd --max-tokens 256 --sweep k=4,auto
    use new
fi
if [ -n "${OLD:-}" ] && part head 160; then
    use old
    echo "(old: $OLD)"
    compare head-old
    use new
fi
rm -rf $SYN $SYN32
tar czf "$OUT/results.tgz" -C "$RES" .
echo "== done at $((SECONDS - START)) s"

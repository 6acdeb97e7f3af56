#!/usr/bin/env bash
# bench/mtp_prompts.sh: drafting with the default model's MTP block over eight prompts, against plain
# decoding. For each draft count K (default 0 1 2 3), runs
#   ./nemoh -m weights -n 256 FLAGS --mtp K PROMPT
# for every prompt below, PASSES times (the counts alternate within a pass, so a busy machine slows
# them alike), and prints decoded tokens / decode seconds over all runs, the ratio to the first count,
# and the acceptance length (tokens a drafting step emits) over all steps.
#   bench/mtp_prompts.sh PASSES "K..." FLAGS...    e.g. bench/mtp_prompts.sh 2 "0 1 2 3" --cpu -t 0
set -eu
cd "$(dirname "$0")/.."
passes=${1:-2} counts=${2:-0 1 2 3}
shift 2 || shift $#
prompts=("Once upon a time" "The man walked into the room and" "In 1962, the government"
         "She looked at the letter for a long time before" "The results of the experiment showed that"
         "When the war ended, many families" "It was a cold morning in the small town of" "The committee decided to")
declare -A tok sec steps acc
for k in $counts; do tok[$k]=0 sec[$k]=0 steps[$k]=0 acc[$k]=0; done
for _ in $(seq "$passes"); do
    for p in "${prompts[@]}"; do
        for k in $counts; do
            err=$(./nemoh -m weights -n 256 "$@" --mtp "$k" "$p" 2>&1 >/dev/null) || { echo "$err" >&2; exit 1; }
            read -r n r < <(sed -n 's/.*decode \([0-9]*\) tokens in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1 \2/p' <<< "$err")
            read -r st a < <(sed -n 's/.* \([0-9]*\) steps, acceptance length [0-9.]* (\([0-9]*\) of.*/\1 \2/p' <<< "$err"; echo 0 0)
            tok[$k]=$((tok[$k] + n)) steps[$k]=$((steps[$k] + st)) acc[$k]=$((acc[$k] + a))
            sec[$k]=$(awk "BEGIN { print ${sec[$k]} + $n / $r }")   # the rate's digits: seconds print to 1 ms
        done
    done
done
first=
for k in $counts; do
    rate=$(awk "BEGIN { printf \"%.1f\", ${tok[$k]} / ${sec[$k]} }")
    first=${first:-$rate}
    al=$(awk "BEGIN { if (${steps[$k]}) printf \", acceptance length %.2f\", (${steps[$k]} + ${acc[$k]}) / ${steps[$k]} }")
    echo "--mtp $k: $rate tok/s, $(awk "BEGIN { printf \"%.2f\", $rate / $first }")x$al"
done

#!/usr/bin/env bash
# bench/run.sh: every GPU row of bench/RESULTS.md in one go, as one Markdown table.
#
#   bench/run.sh [OTHER_NEMOH]      # from the repository root, after make, on a GPU machine
#
# Runs each row's --bench command with ./nemoh and, when OTHER_NEMOH is given (say a build of an
# older commit), with it too, right after, on the same machine: machines of one kind differ by about
# 1%, so only figures from one call compare. ROWS='8b-2048 moe' picks rows by name; with BENCH_HF=1
# the transformers baselines (tools/bench_hf.py) follow. Full --bench tables go to stderr.
set -u
cd "$(dirname "$0")/.." || exit 1
ALL=(
    "8b-2048|--random nemotron-h-8b -P 2048 -n 128"
    "8b-512|--random nemotron-h-8b -P 512 -n 256"
    "8b-nofuse|--random nemotron-h-8b -P 512 -n 256 --no-fuse"
    "4b|--random nemotron-h-4b -P 512 -n 256"
    "nano9b|--random nemotron-nano-9b-v2 -P 512 -n 256"
    "56b|--random nemotron-h-56b -P 512 -n 64 -c 4096"
    "moe|--random nemotron-3-nano-30b-a3b -P 512 -n 256"
    "moe-2048|--random nemotron-3-nano-30b-a3b -P 2048 -n 16"
    "nano9b-32k|--random nemotron-nano-9b-v2 -P 32768 -n 64"
    "nano9b-128k|--random nemotron-nano-9b-v2 -P 131072 -n 64 -c 131136"
    "8b-fp8|--random nemotron-h-8b-fp8 -P 2048 -n 128"
    "8b-nvfp4|--random nemotron-h-8b-nvfp4 -P 2048 -n 128"
    "moe-fp8|--random nemotron-3-nano-30b-a3b-fp8 -P 512 -n 256"
    "moe-nvfp4|--random nemotron-3-nano-30b-a3b-nvfp4 -P 512 -n 256"
    "super-nvfp4|--random nemotron-3-super-120b-a12b-nvfp4 -P 512 -n 128"
    "super-fp8|--random nemotron-3-super-120b-a12b-fp8 -P 512 -n 64"
    "default-mtp|-m weights -P 512 -n 256 --mtp 3"
    "super-nvfp4-mtp|--random nemotron-3-super-120b-a12b-nvfp4 -P 512 -n 64 --mtp 3"
)
HF=(
    "nemotron-h-8b 512 256"
    "nemotron-3-nano-30b-a3b 512 256"
    "nemotron-nano-9b-v2 32768 64"
)
bins=(./nemoh ${1:+"$1"})
[ -x ./nemoh ] || { echo "bench/run.sh: ./nemoh not built (run make)" >&2; exit 1; }
[ $# -lt 1 ] || [ -x "$1" ] || { echo "bench/run.sh: $1: not an executable" >&2; exit 1; }

# one Markdown row from a --bench table: decode ms/token, % of copy bandwidth, prefill tok/s, memory
row() {
    awk -F'|' -v bin="$1" -v cmd="$2" '
        /^\| prefill / { split($3, a, ": "); pre = a[2] }
        /^\| decode / { split($3, a, ": "); split(a[2], b, " ms"); ms = b[1] }
        /^\| achieved / { match($3, /[0-9.]+%/); pct = substr($3, RSTART, RLENGTH) }
        /^\| GPU memory / { mem = $3 }
        /^\| device / { split($3, a, ","); dev = a[1] }
        END { printf "| `%s %s` |%s| %s | %s | %s |%s|\n", bin, cmd, dev, ms, pct, pre, mem }'
}

echo "| command | device | decode ms/token | % of copy bandwidth | prefill | GPU memory |"
echo "|---|---|---:|---:|---:|---:|"
for entry in "${ALL[@]}"; do
    name=${entry%%|*} cmd=${entry#*|}
    [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $name "* ]] && continue
    for bin in "${bins[@]}"; do
        # shellcheck disable=SC2086  # cmd is a list of flags
        if out=$("$bin" $cmd --bench 2>&1); then printf '%s\n' "$out" >&2; row "$bin" "$cmd" <<< "$out"
        else echo "| \`$bin $cmd\` | failed: $(tail -1 <<< "$out") | | | | |"; fi
    done
done
if [ "${BENCH_HF:-0}" = 1 ]; then
    for h in "${HF[@]}"; do
        # shellcheck disable=SC2086  # preset, prompt and decode lengths
        python3 tools/bench_hf.py $h 2>/dev/null || echo "| tools/bench_hf.py $h | failed |"
    done
fi

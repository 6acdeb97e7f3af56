#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz (clang -fsanitize=fuzzer,address,undefined), seeds
# their corpora from the fixtures, and runs all five at once, each for SECONDS, under nice -n 19.
# A crash, a sanitizer report, a leak, a hang (-timeout) or a failed property ends a harness
# early; its input is kept under build/fuzz/ (FUZZ_OUT), with each harness's log and corpus.
# One line a harness:
#   fuzz NAME: clean for S s, N executions, cov C, ft F, corpus K inputs
# then "N passed, M failed"; "skipped: <reason>" (exit 0) where clang with libFuzzer is missing.
#   tests/fuzz/run.sh SECONDS
set -u
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:?usage: tests/fuzz/run.sh SECONDS}
CC=${FUZZ_CC:-$(command -v clang || command -v clang-14)}
OUT=${FUZZ_OUT:-build/fuzz}
NAMES="config safetensors tokenizer roundtrip decode"
mkdir -p "$OUT"
if [ -z "$CC" ] || ! echo 'int LLVMFuzzerTestOneInput(const char *d, long n) { return 0; }' |
        "$CC" -fsanitize=fuzzer -x c - -o "$OUT/probe" 2>/dev/null; then
    echo "skipped: fuzzing (no clang with libFuzzer: clang -fsanitize=fuzzer fails)"
    exit 0
fi
for h in $NAMES; do
    "$CC" -g -O1 -std=c11 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Wall -Wextra \
        -Wno-unused-function -o "$OUT/fuzz_$h" "tests/fuzz/fuzz_$h.c" -lm -lpthread || { echo "FAIL build fuzz_$h"; exit 1; }
done

# seeds: the fixtures' config.json files, safetensors headers, small tokenizers, texts, id lists,
# and tests/fuzz/regress/NAME: every input a harness once failed on, replayed first on every run
S=$OUT/seeds
rm -rf "$S" && mkdir -p "$S/config" "$S/safetensors" "$S/tokenizer" "$S/roundtrip" "$S/decode"
for f in weights/config.json tests/fixtures/*/config.json; do cp "$f" "$S/config/$(echo "$f" | tr / _)"; done
for f in tests/fixtures/*/*.safetensors; do   # padded with 0, 8, .. 184 spaces: fuzz_safetensors reads its size
    hlen=$(od -An -t u8 -N8 "$f" | tr -d ' ') name=$S/safetensors/$(echo "$f" | tr / _)
    tail -c +9 "$f" | head -c "$hlen" > "$name"
    for pad in $(seq 8 8 184); do { cat "$name"; printf "%${pad}s" ""; } > "$name.$pad"; done
done
cp tests/fuzz/*.tokenizer.json "$S/tokenizer/"
for h in $NAMES; do cp tests/fuzz/regress/$h/* "$S/$h/" 2>/dev/null; done   # inputs that once failed
i=0
grep -v '^#' tests/fixtures/tokenizer/corpus.txt | while IFS= read -r line; do printf '%s' "$line" > "$S/roundtrip/$i"; i=$((i + 1)); done
head -c 4000 tests/fixtures/default-ref/text.txt > "$S/roundtrip/default-ref"
for id in $(cat tests/fixtures/default-ref/ids.txt); do
    printf "\\x$(printf %02x $((id & 255)))\\x$(printf %02x $((id >> 8 & 255)))\\x$(printf %02x $((id >> 16 & 255)))\\x00"
done > "$S/decode/default-ref"

declare -A maxlen=([config]=4096 [safetensors]=32768 [tokenizer]=8192 [roundtrip]=4096 [decode]=4096)
for h in $NAMES; do
    mkdir -p "$OUT/corpus/$h"
    nice -n 19 "$OUT/fuzz_$h" -max_total_time="$SECONDS_EACH" -timeout=60 -rss_limit_mb=4096 -max_len="${maxlen[$h]}" \
        -close_fd_mask=2 -print_final_stats=1 -artifact_prefix="$OUT/$h-" "$OUT/corpus/$h" "$S/$h" > "$OUT/$h.log" 2>&1 &
done
wait
passed=0 failed=0
for h in $NAMES; do
    log=$OUT/$h.log
    execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$')
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
    if [ -n "$done_line" ] && ! grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error|fuzz: ' "$log"; then
        cov=$(grep -o 'cov: [0-9]*' <<< "$done_line" | cut -d' ' -f2) ft=$(grep -o 'ft: [0-9]*' <<< "$done_line" | cut -d' ' -f2)
        echo "fuzz $h: clean for $SECONDS_EACH s, $execs executions, cov $cov, ft $ft, corpus $(ls "$OUT/corpus/$h" | wc -l) inputs"
        passed=$((passed + 1))
    else
        echo "FAIL fuzz $h: see $log"
        grep -E 'ERROR|runtime error|fuzz: |SUMMARY|Test unit written' "$log" | head -5 | sed 's/^/        /'
        failed=$((failed + 1))
    fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]

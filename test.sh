#!/usr/bin/env bash
# nemoh's tests. Builds from scratch; runs everything that needs no GPU, the CPU engine also under
# AddressSanitizer + UndefinedBehaviorSanitizer; runs the GPU tests where a GPU exists (prints
# `skipped: <reason>` elsewhere); ends with the line `N passed, M failed`.
set -u
cd "$(dirname "$0")"
PASS=0 FAIL=0
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export ASAN_OPTIONS=exitcode=99 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=99

pass() { PASS=$((PASS + 1)); echo "ok      $1"; }
fail() { FAIL=$((FAIL + 1)); echo "FAILED  $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/        /'; }
# check NAME CMD...: passes when CMD exits 0; shows its output when it does not
check() { local name=$1 out; shift; if out=$("$@" 2>&1); then pass "$name"; else fail "$name" "$out"; fi; }
finish() { echo "$PASS passed, $FAIL failed"; [ "$FAIL" -eq 0 ]; exit; }

# ---- build ----
make clean >/dev/null
if out=$(make 2>&1); then pass "make"; else fail "make" "$out"; finish; fi
ASAN="$T/nemoh-asan"
check "build CPU engine with -fsanitize=address,undefined" \
    cc -std=c11 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -Wall -Wextra nemoh.c -o "$ASAN" -lm -lpthread
cc -O2 -o "$T/compare_logits" tests/compare_logits.c -lm && cc -O2 -o "$T/make_bad" tests/make_bad.c || fail "build test helpers"

# ---- Hugging Face fixtures: per-position logits and greedy tokens ----
# fixture_run BIN DIR OUT [args...]: greedy continuation of the fixture's prompt, logits dumped to OUT
fixture_run() {
    local bin=$1 d=$2 out=$3; shift 3
    "$bin" -m "$d" --ids "$(cat "$d/prompt.txt")" -n "$(wc -w < "$d/greedy.txt")" -t 0 --dump-logits "$out" "$@" 2>"$out.err"
}
fixture_check() {
    local bin=$1 d=$2 tag=$3; shift 3
    local tol; tol=$(grep -o '"tolerance": [0-9.e-]*' "$d/ref.json" | cut -d' ' -f2)
    local got; got=$(fixture_run "$bin" "$d" "$T/$tag.bin" "$@")
    if [ "$got" = "$(cat "$d/greedy.txt")" ]; then pass "$tag: greedy tokens identical to HF"
    else fail "$tag: greedy tokens identical to HF" "got:      $got"$'\n'"expected: $(cat "$d/greedy.txt")"$'\n'"$(cat "$T/$tag.bin.err")"; fi
    check "$tag: logits at every position within $tol of HF" "$T/compare_logits" "$T/$tag.bin" "$d/ref_logits.bin" "$tol"
}
for d in tests/fixtures/tiny-*; do
    f=$(basename "$d")
    fixture_check ./nemoh "$d" "cpu $f"
    fixture_check "$ASAN" "$d" "asan $f"
done
check "default model: held-out logits within 1e-4 of HF" sh -c \
    "./nemoh -m weights --ids \"\$(cat tests/fixtures/default-ref/ids.txt)\" -n 1 -t 0 --dump-logits $T/def.bin >/dev/null 2>&1 &&
     $T/compare_logits $T/def.bin tests/fixtures/default-ref/ref_logits.bin 1e-4"

# ---- sampling ----
d=tests/fixtures/tiny-bf16
s1=$(./nemoh -m $d --ids "$(cat $d/prompt.txt)" -n 40 -t 1.0 -p 0.9 -s 7 2>/dev/null)
s2=$(./nemoh -m $d --ids "$(cat $d/prompt.txt)" -n 40 -t 1.0 -p 0.9 -s 7 2>/dev/null)
s3=$(./nemoh -m $d --ids "$(cat $d/prompt.txt)" -n 40 -t 1.0 -p 0.9 -s 8 2>/dev/null)
[ -n "$s1" ] && [ "$s1" = "$s2" ] && pass "seeded sampling repeats exactly" || fail "seeded sampling repeats exactly" "$s1"$'\n'"$s2"
[ "$s1" != "$s3" ] && pass "another seed samples another continuation" || fail "another seed samples another continuation"
[ "$s1" != "$(cat $d/greedy.txt)" ] && pass "temperature 1 does not decode greedily" || fail "temperature 1 does not decode greedily"

# ---- tensor parallelism on the CPU: ranks as threads, host all-reduce ----
for d in tests/fixtures/tiny-*; do
    f=$(basename "$d")
    fixture_run ./nemoh "$d" "$T/$f-tp1.bin" --tp 1 >/dev/null
    for n in 2 4; do
        if ./nemoh -m "$d" --ids 1 -n 1 --tp $n >/dev/null 2>&1; then
            got=$(fixture_run ./nemoh "$d" "$T/$f-tp$n.bin" --tp $n)
            [ "$got" = "$(cat "$d/greedy.txt")" ] && pass "$f --tp $n: greedy tokens identical" || fail "$f --tp $n: greedy tokens identical" "$got"
            check "$f --tp $n: logits within 1e-5 of --tp 1" "$T/compare_logits" "$T/$f-tp$n.bin" "$T/$f-tp1.bin" 1e-5
            fixture_run ./nemoh "$d" "$T/$f-nf$n.bin" --tp $n --no-fuse >/dev/null
            check "$f --tp $n --no-fuse: logits equal to fused" "$T/compare_logits" "$T/$f-nf$n.bin" "$T/$f-tp$n.bin" 0
        fi
    done
done
fixture_run "$ASAN" tests/fixtures/tiny-f32 "$T/asan-tp4.bin" --tp 4 >/dev/null
check "asan tiny-f32 --tp 4: logits within 1e-5 of --tp 1" "$T/compare_logits" "$T/asan-tp4.bin" "$T/tiny-f32-tp1.bin" 1e-5

# ---- bad input: exit status 1 and one line on stderr naming the problem, never a crash ----
# refuse NAME EXPECT CMD...: CMD must exit 1 with exactly one stderr line containing EXPECT
refuse() {
    local name=$1 expect=$2 err rc; shift 2
    err=$("$@" 2>&1 >/dev/null); rc=$?
    if [ $rc -eq 1 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] && [[ "$err" == *"$expect"* ]]; then pass "$name"
    else fail "$name" "exit $rc, expected 1 and one line containing \"$expect\":"$'\n'"$err"; fi
}
"$T/make_bad" tests/fixtures/tiny-bf16 "$T/bad"
for bin in ./nemoh "$ASAN"; do
    tag=$([ "$bin" = ./nemoh ] && echo cpu || echo asan)
    check "$tag bad input: the unmodified control model loads" "$bin" -m "$T/bad/good" --ids "1 2" -n 1
    for d in "$T"/bad/*; do
        [ "$(basename "$d")" = good ] && continue
        refuse "$tag bad input: $(basename "$d")" "$(cat "$d/expect")" "$bin" -m "$d" --ids "1 2" -n 1
    done
    refuse "$tag bad input: missing model directory" "no such model directory" "$bin" -m "$T/nonexistent" --ids 1
    refuse "$tag bad input: token id >= vocab" "outside the vocabulary" "$bin" -m tests/fixtures/tiny-bf16 --ids "5 1200"
    refuse "$tag bad input: prompt longer than the context" "more than the context" "$bin" -m tests/fixtures/tiny-bf16 --ids "1 2 3 4 5" -c 4
    refuse "$tag bad input: unknown flag" "unknown option" "$bin" --frobnicate
    refuse "$tag bad input: bad number" "-n: expected an integer" "$bin" -n many
    refuse "$tag bad input: missing flag value" "-m: missing value" "$bin" -m
    refuse "$tag bad input: bad token id list" "--ids: bad token id" "$bin" -m tests/fixtures/tiny-bf16 --ids "1 x"
    refuse "$tag bad input: --tp that does not divide the model" "valid: 1 2" "$bin" -m tests/fixtures/tiny-bf16 --ids 1 --tp 3
    refuse "$tag bad input: unwritable --dump-logits" "--dump-logits" "$bin" -m tests/fixtures/tiny-bf16 --ids 1 --dump-logits /nonexistent/x.bin
done

finish

#!/usr/bin/env bash
# nemoh's tests. Builds from scratch; runs everything that needs no GPU, the CPU engine also under
# AddressSanitizer + UndefinedBehaviorSanitizer; runs the GPU tests where a GPU exists (prints
# `skipped: <reason>` elsewhere); ends with the line `N passed, M failed`. `./test.sh quick` leaves
# out the sanitizer build and its runs and the fuzzing (CI runs ./test.sh, all of it).
set -u
case ${1:-} in "") QUICK= ;; quick) QUICK=1 ;; *) echo "usage: ./test.sh [quick]" >&2; exit 2 ;; esac
# full: 0 (true) unless ./test.sh quick
full() { [ -z "$QUICK" ]; }
cd "$(dirname "$0")"
PASS=0 FAIL=0
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export ASAN_OPTIONS=exitcode=99 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=99

pass() { PASS=$((PASS + 1)); echo "ok      $1"; }
fail() { FAIL=$((FAIL + 1)); echo "FAILED  $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/        /'; }
# check NAME CMD...: passes when CMD exits 0; shows its output when it does not
check() { local name=$1 out; shift; if out=$("$@" 2>&1); then pass "$name"; else fail "$name" "$out"; fi; }
# same NAME GOT WANT: passes when GOT is WANT; shows both when it is not
same() { if [ "$2" = "$3" ]; then pass "$1"; else fail "$1" "got:      $2"$'\n'"expected: $3"; fi; }
# refuse NAME EXPECT CMD...: CMD must exit 1 with exactly one stderr line containing EXPECT
refuse() {
    local name=$1 expect=$2 err rc; shift 2
    err=$("$@" 2>&1 >/dev/null); rc=$?
    if [ $rc -eq 1 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] && [[ "$err" == *"$expect"* ]]; then pass "$name"
    else fail "$name" "exit $rc, expected 1 and one line containing \"$expect\":"$'\n'"$err"; fi
}
finish() { echo "$PASS passed, $FAIL failed"; [ "$FAIL" -eq 0 ]; exit; }

# ---- build ----
make clean >/dev/null
if out=$(make 2>&1); then pass "make"; else fail "make" "$out"; finish; fi
# where a GPU is visible, the kernel tests build while the CPU tests run
KBUILD=
nvidia-smi -L >/dev/null 2>&1 && { make -s tests/test_kernels >"$T/test_kernels.build" 2>&1 & KBUILD=$!; }
ASAN="$T/nemoh-asan"
full && check "build CPU engine with -fsanitize=address,undefined" \
    cc -std=c11 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -Wall -Wextra nemoh.c -o "$ASAN" -lm -lpthread
# the CPU engine alone (a C compiler, no CUDA): what a machine without nvcc builds; it also starts
# without loading the CUDA libraries, for the tests that run nemoh hundreds of times
check "build the CPU engine with cc alone" cc -std=c11 -O2 -Wall -Wextra nemoh.c -o "$T/nemoh-cpu" -lm -lpthread
check "build test helpers" sh -c "cc -O2 -o $T/compare_logits tests/compare_logits.c -lm && cc -O2 -o $T/make_bad tests/make_bad.c"
check "make broken variants (and accepted ones) of a good model" "$T/make_bad" tests/fixtures/tiny-bf16 "$T/bad"
check "make broken variants of a good MoE model" "$T/make_bad" tests/fixtures/tiny-moe-latent-f32 "$T/bad-moe"
check "make broken variants of a quantized model (NVFP4, MoE)" "$T/make_bad" tests/fixtures/tiny-q-nvfp4-moe "$T/bad-nvfp4"
check "make broken variants of a quantized model (FP8, both configs; and one accepted)" "$T/make_bad" tests/fixtures/tiny-q-fp8 "$T/bad-fp8"
check "make broken variants of a model with an MTP block" "$T/make_bad" tests/fixtures/tiny-mtp-latent-f32 "$T/bad-mtp"

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
    fixture_check ./nemoh "$d" "cpu $f" --cpu
    full && fixture_check "$ASAN" "$d" "asan $f"
done
./nemoh --cpu -m weights --ids "$(cat tests/fixtures/default-ref/ids.txt)" -n 1 -t 0 --dump-logits "$T/def.bin" >/dev/null 2>&1
check "default model: held-out logits within 1e-4 of HF" "$T/compare_logits" "$T/def.bin" tests/fixtures/default-ref/ref_logits.bin 1e-4

# ---- accepted layouts: the older embedding name; eos_token_id as a list ----
d=tests/fixtures/tiny-bf16
got=$(./nemoh --cpu -m "$T/bad/good-embedding-name" --ids "$(cat $d/prompt.txt)" -n 5 -t 0 2>/dev/null)
same "backbone.embedding.weight (older checkpoints) loads and decodes the same" "$got" "$(cut -d' ' -f1-5 $d/greedy.txt)"
mkdir -p "$T/eos-list" && cp $d/model.safetensors "$T/eos-list/"
stop=$(cut -d' ' -f3 $d/greedy.txt)
sed "s/\"eos_token_id\": 2,/\"eos_token_id\": [2, $stop],/" $d/config.json > "$T/eos-list/config.json"
got=$(./nemoh --cpu -m "$T/eos-list" --ids "$(cat $d/prompt.txt)" -n 20 -t 0 2>/dev/null)
same "eos_token_id as a list: generation stops at any of them" "$got" "$(cut -d' ' -f1-3 $d/greedy.txt)"

# ---- sampling ----
d=tests/fixtures/tiny-bf16
s1=$(./nemoh --cpu -m $d --ids "$(cat $d/prompt.txt)" -n 40 -t 1.0 -p 0.9 -s 7 2>/dev/null)
s2=$(./nemoh --cpu -m $d --ids "$(cat $d/prompt.txt)" -n 40 -t 1.0 -p 0.9 -s 7 2>/dev/null)
s3=$(./nemoh --cpu -m $d --ids "$(cat $d/prompt.txt)" -n 40 -t 1.0 -p 0.9 -s 8 2>/dev/null)
[ -n "$s1" ] && [ "$s1" = "$s2" ] && pass "seeded sampling repeats exactly" || fail "seeded sampling repeats exactly" "$s1"$'\n'"$s2"
[ "$s1" != "$s3" ] && pass "another seed samples another continuation" || fail "another seed samples another continuation"
[ "$(cut -d' ' -f1-"$(wc -w < $d/greedy.txt)" <<< "$s1")" != "$(cat $d/greedy.txt)" ] && pass "temperature 1 does not decode greedily" \
    || fail "temperature 1 does not decode greedily" "$s1"

# ---- tensor parallelism on the CPU: ranks as threads, host all-reduce ----
# every N that divides a fixture's heads and groups (tiny-hf-f16 has one group: --tp 1 only), against
# the --tp 1 run of the fixture checks above. On MoE fixtures every rank holds a slice of every expert
# and the ranks check that they chose the same experts (a disagreement stops nemoh).
for c in tiny-bf16:2 tiny-f32:2 tiny-f32:4 tiny-moe-bf16:2 tiny-moe-bf16:4 tiny-moe-hf-f16:2 tiny-moe-hf-f16:4 \
         tiny-moe-latent-f32:2 tiny-moe-latent-f32:4 tiny-q-fp8:2 tiny-q-nvfp4-moe:2 tiny-q-mixed-latent:2 tiny-q-w4a16:2; do
    f=${c%:*} n=${c#*:} d=tests/fixtures/${c%:*}
    got=$(fixture_run ./nemoh "$d" "$T/$f-tp$n.bin" --cpu --tp $n)
    same "$f --tp $n: greedy tokens identical" "$got" "$(cat "$d/greedy.txt")"
    check "$f --tp $n: logits within 1e-5 of --tp 1" "$T/compare_logits" "$T/$f-tp$n.bin" "$T/cpu $f.bin" 1e-5
    fixture_run ./nemoh "$d" "$T/$f-nf$n.bin" --cpu --tp $n --no-fuse >/dev/null
    check "$f --tp $n --no-fuse: logits equal to fused" "$T/compare_logits" "$T/$f-nf$n.bin" "$T/$f-tp$n.bin" 0
done
for f in $(full && echo tiny-f32 tiny-moe-latent-f32); do
    fixture_run "$ASAN" tests/fixtures/$f "$T/asan-$f-tp4.bin" --tp 4 >/dev/null
    check "asan $f --tp 4: logits within 1e-5 of --tp 1" "$T/compare_logits" "$T/asan-$f-tp4.bin" "$T/cpu $f.bin" 1e-5
done

# ---- the MoE router: grouped biased top-k and its ties against a float64 reference ----
for san in "" "-fsanitize=address,undefined -fno-sanitize-recover=all"; do
    [ -n "$san" ] && ! full && continue
    tag=$([ -z "$san" ] && echo cpu || echo asan)
    if out=$(cc -std=c11 -O1 -g $san -o "$T/test_router" tests/test_router.c -lm -lpthread 2>&1 && "$T/test_router" 2>&1); then
        pass "$tag MoE router against a float64 reference ($(tail -1 <<< "$out"))"
    else fail "$tag MoE router against a float64 reference" "$(grep -v '^ok' <<< "$out" | tail -20)"; fi
done

# ---- the CPU matrix product: every format at awkward sizes against a float64 reference, and T tokens
# equal to each alone; bf16 goes to the tile unit (AMX) in the -march=native builds on a CPU that has
# one, to dot_rows in the plain build; both also under the sanitizers; and an x86-64-v3 build where
# the CPU has AVX2, for dot_rows' AVX2 lanes (a -march=native build takes AVX-512's where it can).
# And the host's e^x ----
native=$(cc -march=native -E -x c /dev/null >/dev/null 2>&1 && echo -march=native)
omp=$(echo 'int main(void){return 0;}' | cc -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
fpc=$(cc -ffp-contract=fast -E -x c /dev/null >/dev/null 2>&1 && echo -ffp-contract=fast)   # as the Makefile builds
sanflags="-fsanitize=address,undefined -fno-sanitize-recover=all"
avx2=$(grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw f16c /proc/cpuinfo && cc -march=x86-64-v3 -E -x c /dev/null >/dev/null 2>&1 && echo -march=x86-64-v3)
builds=("cpu $native|-O2 $native $fpc $omp")   # tag|flags
[ -n "$avx2" ] && builds+=("cpu $avx2|-O2 $avx2 $fpc $omp")
full && builds+=("asan|-O1 -g $sanflags")
full && [ -n "$native" ] && builds+=("asan $native|-O1 -g $native $fpc $omp $sanflags")
for b in "${builds[@]}"; do
    tag=${b%%|*} flags=${b#*|}
    if out=$(cc -std=c11 $flags -o "$T/test_matmul" tests/test_matmul.c -lm -lpthread 2>&1 && "$T/test_matmul" 2>&1); then
        pass "$tag matrix products and e^x against a float64 reference ($(grep '^bf16:' <<< "$out"); $(grep '^dot_rows:' <<< "$out"); $(tail -1 <<< "$out"))"
    else fail "$tag matrix products and e^x against a float64 reference" "$(grep -v '^ok' <<< "$out" | tail -20)"; fi
done

# ---- quantized checkpoints (ModelOpt FP8, NVFP4, MIXED_PRECISION): nemoh's dequantization of every
# quantized matrix against the fixture generator's own (dequant.safetensors), bit for bit ----
for san in "" "-fsanitize=address,undefined -fno-sanitize-recover=all"; do
    [ -n "$san" ] && ! full && continue
    tag=$([ -z "$san" ] && echo cpu || echo asan)
    if out=$(cc -std=c11 -O1 -g $san -o "$T/test_quant" tests/test_quant.c -lm -lpthread 2>&1 && "$T/test_quant" tests/fixtures/tiny-q-* 2>&1); then
        pass "$tag quantized matrices dequantized as the generator does, bit for bit ($(tail -1 <<< "$out"))"
    else fail "$tag quantized matrices dequantized as the generator does, bit for bit" "$(grep -v '^ok' <<< "$out" | tail -20)"; fi
done
refuse "bad input: --mtp on a model without an MTP block" "has no multi-token prediction block" ./nemoh --cpu -m tests/fixtures/tiny-f32 --ids 1 --mtp 2
refuse "bad input: --mtp past the most drafts a step" "--mtp: expected an integer in [0, 8]" ./nemoh --cpu -m tests/fixtures/tiny-moe-bf16 --ids 1 --mtp 9
refuse "bad input: a --tp that cuts an NVFP4 block" "cuts a 16-element block" ./nemoh --cpu -m tests/fixtures/tiny-q-mixed-latent --ids "1 2" -n 1 --tp 4

# ---- multi-token prediction: drafts verified in one forward emit exactly the plain stream ----
# Every fixture with an MTP block: greedy --mtp K with drafts forced from the recorded plain run, the
# one at (step mod (K + 1)) corrupted (NEMOH_TEST_DRAFTS), so that every accepted count 0..K occurs and
# the Mamba state rewinds to every offset, equals --mtp 0 token for token and logits bit for bit.
mtp_steps() { grep -o 'steps by accepted:[0-9 ]*' "$1" | cut -d: -f2; }
for d in $(grep -l '"num_nextn_predict_layers": [1-9]' tests/fixtures/tiny-*/config.json | xargs -n1 dirname); do
    f=$(basename "$d") ids=$(cat "$d/prompt.txt")
    for tp in 1 2; do
        plain=$(./nemoh --cpu -m "$d" --ids "$ids" -n 48 -t 0 --mtp 0 --tp $tp --dump-logits "$T/$f-m0.bin" 2>/dev/null)
        for k in 1 3 8; do
            got=$(NEMOH_TEST_DRAFTS="$plain" ./nemoh --cpu -m "$d" --ids "$ids" -n 48 -t 0 --mtp $k --tp $tp --dump-logits "$T/$f-m$k.bin" 2>"$T/$f-m$k.err")
            h=$(mtp_steps "$T/$f-m$k.err")
            if [ "$got" = "$plain" ] && [ -n "$h" ] && ! grep -qw 0 <<< "$h"; then pass "$f --mtp $k --tp $tp: forced drafts, every accepted count 0..$k ($h), tokens equal --mtp 0"
            else fail "$f --mtp $k --tp $tp: forced drafts, every accepted count 0..$k, tokens equal --mtp 0" "got:      $got"$'\n'"expected: $plain"$'\n'"$(cat "$T/$f-m$k.err")"; fi
            check "$f --mtp $k --tp $tp: logits of every position equal --mtp 0" "$T/compare_logits" "$T/$f-m$k.bin" "$T/$f-m0.bin" 0
        done
    done
    sampled=$(./nemoh --cpu -m "$d" --ids "$ids" -n 48 -t 0.9 -s 5 --mtp 0 2>/dev/null)
    got=$(NEMOH_TEST_DRAFTS="$sampled" ./nemoh --cpu -m "$d" --ids "$ids" -n 48 -t 0.9 -s 5 --mtp 3 2>"$T/$f-s.err")
    h=$(mtp_steps "$T/$f-s.err")
    if [ "$got" = "$sampled" ] && [ -n "$h" ] && ! grep -qw 0 <<< "$h"; then pass "$f -t 0.9 --mtp 3: drafts forced from the sampled run, every accepted count ($h), tokens equal --mtp 0"
    else fail "$f -t 0.9 --mtp 3: drafts forced from the sampled run, every accepted count, tokens equal --mtp 0" "got:      $got"$'\n'"expected: $sampled"$'\n'"$(cat "$T/$f-s.err")"; fi
    same "$f -t 0.9 --mtp 3: sampled tokens with the block's own drafts equal --mtp 0's" \
        "$(./nemoh --cpu -m "$d" --ids "$ids" -n 48 -t 0.9 -s 5 --mtp 3 2>/dev/null)" "$sampled"
    full && check "asan $f --mtp 3 --tp 2: forced drafts, tokens equal --mtp 0" \
        sh -c "[ \"\$(NEMOH_TEST_DRAFTS='$plain' $ASAN -m $d --ids '$ids' -n 48 -t 0 --mtp 3 --tp 2 2>&1 >/dev/null | grep -c mtp:)\" = 1 ] &&
               [ \"\$(NEMOH_TEST_DRAFTS='$plain' $ASAN -m $d --ids '$ids' -n 48 -t 0 --mtp 3 --tp 2 2>/dev/null)\" = '$plain' ]"
done
# Sampling: speculative sampling draws from plain sampling's distribution. 400 seeds each, the first
# three tokens at temperature 0.2 with the greedy run as drafts (some accepted, some not): same seeds
# give the same tokens, and the total-variation distance between drafting's tokens and plain
# sampling's on other seeds stays under 0.2, a bound that a sampler at temperature 0.3, or a rule that
# accepted every draft (the greedy tokens always), exceeds.
d=tests/fixtures/tiny-moe-bf16 ids=$(cat tests/fixtures/tiny-moe-bf16/prompt.txt)
greedy=$(./nemoh --cpu -m $d --ids "$ids" -n 6 -t 0 --mtp 0 2>/dev/null)
draws() {   # draws FIRST LAST TEMP MTP: the first 3 tokens for seeds FIRST..LAST
    for s in $(seq "$1" "$2"); do
        NEMOH_TEST_DRAFTS="$greedy" "$T/nemoh-cpu" -m $d --ids "$ids" -n 4 -t "$3" -s "$s" --mtp "$4" 2>/dev/null | cut -d' ' -f1-3
    done
}
tv() { awk 'FNR == NR { a[$0]++; n++; next } { b[$0]++; m++ }
            END { for (k in a) s[k]; for (k in b) s[k]; for (k in s) { d = a[k] / n - b[k] / m; t += d < 0 ? -d : d } printf "%.3f", t / 2 }' "$1" "$2"; }
draws 1 400 0.2 0 > "$T/plain"; draws 1 400 0.2 3 > "$T/spec"; draws 401 800 0.2 3 > "$T/spec2"; draws 1 400 0.3 0 > "$T/hot"
for i in $(seq 400); do cut -d' ' -f1-3 <<< "$greedy"; done > "$T/always"
same "speculative sampling: the same 400 seeds give the same tokens as plain sampling" "$(cat "$T/spec")" "$(cat "$T/plain")"
v=$(tv "$T/spec2" "$T/plain") hot=$(tv "$T/hot" "$T/plain") always=$(tv "$T/always" "$T/plain")
check "speculative sampling: TV to plain sampling $v < 0.2 (temperature 0.3: $hot, accepting every draft: $always, both > 0.2)" \
    awk "BEGIN { exit !($v < 0.2 && $hot > 0.2 && $always > 0.2) }"
# The block's own logits at every position (the token after it known) against the oracle: transformers'
# NemotronHBlocks with the MTP tensors, behind enorm, hnorm and eh_proj (tools/nemotron_h.py); for the
# default model's distilled block, tools/distill_mtp.py's float64 forward (checked against transformers')
# (--mtp-vocab N: the logits of ids below N, the only ones a pass computes; N past a rank's slice at --tp 2)
vocab_of() { grep -o '"vocab_size": [0-9]*' "$1/config.json" | grep -o '[0-9]*$'; }
for c in tiny-mtp-latent-f32:1 tiny-mtp-latent-f32:2 tiny-mtp-f32:1 tiny-mtp-f32:2; do
    f=${c%:*} n=${c#*:} d=tests/fixtures/${c%:*}
    V=$(vocab_of "$d")
    for nv in $V $((V / 2 + 3)); do
        fixture_run ./nemoh "$d" "$T/$f-mtp-tp$n.bin" --cpu --tp $n --mtp 3 --mtp-vocab $nv --dump-mtp "$T/$f-mtp-tp$n.mtp" >/dev/null
        check "$f --tp $n --mtp-vocab $nv: MTP logits of those ids at every position within 1e-4 of the oracle" \
            "$T/compare_logits" "$T/$f-mtp-tp$n.mtp" "$d/mtp_logits.bin" 1e-4 $nv $V
    done
done
./nemoh --cpu -m weights --ids "$(cat tests/fixtures/default-ref/ids.txt)" -n 1 -t 0 --mtp 3 --dump-mtp "$T/defm.bin" >/dev/null 2>&1
check "default model: its trained MTP block's logits on held-out text (its default 1024 ids) within 1e-4 of the oracle" \
    "$T/compare_logits" "$T/defm.bin" tests/fixtures/default-ref/mtp_logits.bin 1e-4 1024 8192
V=$(vocab_of tests/fixtures/tiny-mtp-latent-f32)
full && fixture_run "$ASAN" tests/fixtures/tiny-mtp-latent-f32 "$T/asan-mtp.bin" --tp 2 --mtp 3 --dump-mtp "$T/asan-mtp.mtp" >/dev/null
full && check "asan tiny-mtp-latent-f32 --tp 2: MTP logits of its default $(((V + 7) / 8)) ids within 1e-4 of the oracle" \
    "$T/compare_logits" "$T/asan-mtp.mtp" tests/fixtures/tiny-mtp-latent-f32/mtp_logits.bin 1e-4 $(((V + 7) / 8)) $V
# --mtp-vocab 1: every draft is id 0, which none of the plain tokens is, so none is accepted; the tokens
# still equal --mtp 0's
d=tests/fixtures/tiny-mtp-f32 ids=$(cat tests/fixtures/tiny-mtp-f32/prompt.txt)
plain=$(./nemoh --cpu -m $d --ids "$ids" -n 48 -t 0 --mtp 0 2>/dev/null)
got=$(./nemoh --cpu -m $d --ids "$ids" -n 48 -t 0 --mtp 2 --mtp-vocab 1 2>"$T/nv1.err")
if ! grep -qw 0 <<< "$plain" && [ "$got" = "$plain" ] && grep -q 'among ids below 1;.* (0 of [0-9]* drafts accepted' "$T/nv1.err"; then
    pass "tiny-mtp-f32 --mtp 2 --mtp-vocab 1: every draft id 0, none accepted, tokens equal --mtp 0"
else fail "tiny-mtp-f32 --mtp 2 --mtp-vocab 1: every draft id 0, none accepted, tokens equal --mtp 0" "$got"$'\n'"$plain"$'\n'"$(cat "$T/nv1.err")"; fi
refuse "bad input: --mtp-vocab past the vocabulary" "--mtp-vocab 1201: the vocabulary has 1200 tokens" ./nemoh --cpu -m $d --ids 1 --mtp 2 --mtp-vocab 1201
refuse "bad input: --mtp-vocab 0" "--mtp-vocab: expected an integer in [1," ./nemoh --cpu -m $d --ids 1 --mtp 2 --mtp-vocab 0
refuse "bad input: --mtp-vocab without drafting" "--mtp-vocab: needs drafting" ./nemoh --cpu -m $d --ids 1 --mtp 0 --mtp-vocab 8
n=$(./nemoh --cpu -m tests/fixtures/tiny-moe-bf16 --ids 1 -n 1 --mtp 0 2>&1 | grep -c 'mtp\.\* tensors (multi-token prediction heads) are not used')
same "tiny-moe-bf16 --mtp 0: its mtp.* tensors named once on stderr as unused" "$n" 1

# ---- bad input: exit status 1 and one line on stderr naming the problem, never a crash ----
# refuse_run NAME EXPECT STDOUT CMD...: the same for an error while generating, after the "loaded"
# line, with CMD's stdout sent to the file STDOUT ("-": closed)
refuse_run() {
    local name=$1 expect=$2 out=$3; shift 3
    refuse "$name" "$expect" bash -c 'o=$1; shift; if [ "$o" = - ]; then "$@" 2>&1 >&-; else "$@" 2>&1 >"$o"; fi |
        grep -v "^nemoh: loaded " >&2; exit ${PIPESTATUS[0]}' bash "$out" "$@"
}
for bin in ./nemoh $(full && echo "$ASAN"); do
    tag=$([ "$bin" = ./nemoh ] && echo cpu || echo asan)
    for set in bad bad-moe bad-nvfp4 bad-fp8 bad-mtp; do
        extra=(); [ $set = bad-mtp ] && extra=(--mtp 1)   # drafting reads the MTP block
        check "$tag $set input: the unmodified control model loads" "$bin" -m "$T/$set/good" --ids "1 2" -n 1 "${extra[@]}"
        for d in "$T/$set"/*; do
            [[ $(basename "$d") == good* ]] && continue
            if [ -e "$d/at-run" ]; then   # the CPU backend names the layer (the GPU's check: below)
                refuse_run "$tag bad input: $(basename "$d")" "$(cat "$d/expect")" /dev/null "$bin" -m "$d" --ids "1 2" -n 1 --cpu
            else
                refuse "$tag bad input: $(basename "$d")" "$(cat "$d/expect")" "$bin" -m "$d" --ids "1 2" -n 1 "${extra[@]}"
            fi
        done
    done
    for d in "$T"/bad-mtp/mtp-no-* "$T"/bad-mtp/mtp-enorm-length; do
        check "$tag $(basename "$d") with --mtp 0: the model runs without drafting" "$bin" -m "$d" --ids "1 2" -n 2 --mtp 0
    done
    d="$T/bad-mtp/good-nan-mtp"
    got=$("$bin" -m "$d" --ids "1 2" -n 12 -t 0 --mtp 3 2>"$T/nan-mtp.err")
    if [ "$got" = "$("$bin" -m "$d" --ids "1 2" -n 12 -t 0 --mtp 0 2>/dev/null)" ] && grep -q "no drafting step ran" "$T/nan-mtp.err"; then
        pass "$tag: an MTP block whose logits are NaN drafts nothing; the tokens equal --mtp 0's"
    else fail "$tag: an MTP block whose logits are NaN drafts nothing; the tokens equal --mtp 0's" "$got"$'\n'"$(cat "$T/nan-mtp.err")"; fi
    check "$tag: 100000 empty tensors (an index naming them all) load within 20 s" timeout 20 "$bin" -m "$T/bad/good-many-empty" --ids "1 2" -n 1
    check "$tag: an FP8 model with config.json's quantization_config alone (no hf_quant_config.json) loads" \
        "$bin" -m "$T/bad-fp8/good-config-json-only" --ids "1 2" -n 1
    refuse "$tag bad input: missing model directory" "no such model directory" "$bin" -m "$T/nonexistent" --ids 1
    refuse "$tag bad input: token id >= vocab" "outside the vocabulary" "$bin" -m tests/fixtures/tiny-bf16 --ids "5 1200"
    refuse "$tag bad input: prompt longer than the context" "more than the context" "$bin" -m tests/fixtures/tiny-bf16 --ids "1 2 3 4 5" -c 4
    refuse "$tag bad input: unknown flag" "unknown option" "$bin" --frobnicate
    refuse "$tag bad input: bad number" "-n: expected an integer" "$bin" -n many
    refuse "$tag bad input: missing flag value" "-m: missing value" "$bin" -m
    refuse "$tag bad input: bad token id list" "--ids: bad token id" "$bin" -m tests/fixtures/tiny-bf16 --ids "1 x"
    refuse "$tag bad input: --tp that does not divide the model" "valid: 1 2" "$bin" -m tests/fixtures/tiny-bf16 --ids 1 --tp 3
    refuse "$tag bad input: --tp 3 on an NVFP4 model" "--tp 3: the rank count must divide mamba heads and n_groups; valid: 1 2" \
        "$bin" -m tests/fixtures/tiny-q-nvfp4-moe --ids 1 --tp 3
    refuse "$tag bad input: --tp 4 on an FP8 model" "--tp 4: the rank count must divide mamba heads and n_groups; valid: 1 2" \
        "$bin" -m tests/fixtures/tiny-q-fp8 --ids 1 --tp 4
    refuse "$tag bad input: --tp 3 on a MIXED_PRECISION model" "valid: 1 2 4" "$bin" -m tests/fixtures/tiny-q-mixed-latent --ids 1 --tp 3
    refuse "$tag bad input: a --tp that cuts an NVFP4 block (--tp 4)" "which cuts a 16-element block" \
        "$bin" --cpu -m tests/fixtures/tiny-q-mixed-latent --ids "1 2" -n 1 --tp 4
    refuse "$tag bad input: unwritable --dump-logits" "--dump-logits" "$bin" -m tests/fixtures/tiny-bf16 --ids 1 --dump-logits /nonexistent/x.bin
done

# ---- tokenizer: HF tokenizers' own ids on the committed corpora, refusals, the CLI ----
out=$(bash tests/tokenizer.sh 2>&1)
last=$(printf '%s\n' "$out" | tail -1)
if [[ $last =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]] && [ "${BASH_REMATCH[2]}" -eq 0 ]; then
    pass "tokenizer: tests/tokenizer.sh ($last, plain and under ASan/UBSan)"
else
    fail "tokenizer: tests/tokenizer.sh" "$(printf '%s\n' "$out" | grep -v '^ok' | tail -20)"
fi
got=$(./nemoh -m weights --encode -f tests/fixtures/default-ref/text.txt 2>&1 | cut -d' ' -f1-64)
same "nemoh --encode -f: HF tokenizers' ids for the held-out text" "$got" "$(cat tests/fixtures/default-ref/ids.txt)"
refuse "bad input: text prompt without a tokenizer" "tokenizer.json: cannot open" ./nemoh -m tests/fixtures/tiny-f32 "hello"
refuse "bad input: missing -f file" "-f $T/none: cannot open" ./nemoh -f "$T/none"
for extra in "--ids 1" "--dump-logits $T/bench.bin" "--trace"; do   # flags --bench would ignore (and truncate)
    refuse "bad input: --bench with ${extra%% *}" "--bench: times a prompt of -P random tokens" ./nemoh --cpu -m tests/fixtures/tiny-f32 --bench $extra
done
refuse "bad input: --encode without a tokenizer" "--encode needs a tokenizer" ./nemoh --encode --random synthetic-100m --ids "1 2"

# ---- chat: the formats against @huggingface/jinja + HF tokenizers, the kept state, stdin, tmux ----
C=tests/fixtures/chat
# chat_encode BIN [tokenizer]: every rendering of expected.tsv (of that tokenizer); prints mismatches
chat_encode() {
    local bin=$1 only=${2:-} n=0 bad=0 fmt sw cas tk ids args got
    while IFS=$'\t' read -r fmt sw cas tk ids; do
        [[ $fmt == \#* ]] || { [ -n "$only" ] && [ "$tk" != "$only" ]; } && continue
        args=(-m "$C/$fmt" --chat -f "$C/cases/$cas.json" --encode)
        [ "$sw" != - ] && args+=("$sw")
        [ "$tk" = tekken ] && args+=(--tokenizer tests/fixtures/tokenizer/tekken/tokenizer.json)
        got=$("$bin" "${args[@]}" 2>&1); n=$((n + 1))
        [ "$got" = "$ids" ] || { bad=$((bad + 1)); echo "$fmt $sw $cas ($tk tokenizer): got $got"; }
    done < "$C/expected.tsv"
    echo "$n renderings, $bad differ"; [ "$bad" -eq 0 ]
}
check "chat: --chat --encode equals HF's apply_chat_template ids (Nano v2, Nemotron 3, ChatML; fixture and Tekken vocabularies)" chat_encode ./nemoh
full && check "asan chat: --chat --encode equals HF's ids (fixture vocabulary)" chat_encode "$ASAN" chat
# chat_turns BIN FORMAT TAG TOL SWITCH [args...]: a scripted 3-turn conversation on stdin (SWITCH:
# --think, --no-think or -), its logits at every position, then the same ids prefilled from
# scratch: equal within TOL; turns 2 and 3 prefill less than their whole rendering
chat_turns() {
    local bin=$1 dir=$C/$2 tag=$3 tol=$4 sw=(); [ "$5" != - ] && sw=("$5")
    [[ $2 == /* ]] && dir=$2   # a model directory of its own
    shift 5
    printf 'Hello there\nTell me a joke.\\\nA short one.\nWhy?\n' |
        "$bin" -m "$dir" --chat -t 0 -n 12 --dump-logits "$T/$tag.bin" "${sw[@]}" "$@" >/dev/null 2>"$T/$tag.err"
    local ids; ids=$(sed -n 's/^nemoh: conversation ids: //p' "$T/$tag.err")
    "$bin" -m "$dir" --ids "$ids" -n 0 --dump-logits "$T/$tag-scratch.bin" "$@" >/dev/null 2>&1
    check "$tag: 3 turns on stdin = the whole conversation prefilled from scratch (logits within $tol, $(wc -w <<< "$ids") positions)" \
        "$T/compare_logits" "$T/$tag.bin" "$T/$tag-scratch.bin" "$tol"
    local rep; rep=$(grep '^nemoh: turn' "$T/$tag.err")
    if [ "$(wc -l <<< "$rep")" -eq 3 ] && awk '/turn [23]:/ { if ($5 >= $7) bad = 1 } END { exit bad }' <<< "$rep"; then
        pass "$tag: turns 2 and 3 prefill fewer tokens than their rendering ($(awk '{ printf "%s%s/%s", (NR > 1 ? ", " : ""), $5, $7 }' <<< "$rep"))"
    else fail "$tag: turns 2 and 3 prefill fewer tokens than their rendering" "$rep"; fi
}
for fmt in nano-v2 nemotron-3 chatml; do chat_turns ./nemoh $fmt "cpu chat $fmt" 0 - --cpu; done
chat_turns ./nemoh nemotron-3 "cpu chat nemotron-3 --no-think" 0 --no-think --cpu
chat_turns ./nemoh nemotron-3 "cpu chat nemotron-3 --tp 2" 0 - --cpu --tp 2
full && chat_turns "$ASAN" nano-v2 "asan chat nano-v2" 0 -
# with drafting: the Nemotron 3 format on tiny-mtp-f32 (its MTP block; the chat vocabulary): each
# turn's drafts are verified, rewound and stopped mid-step; the conversation is --mtp 0's
mkdir -p "$T/chat-mtp"
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do ln -sf "$PWD/$C/nemotron-3/$f" "$T/chat-mtp/$f"; done
for f in config.json model.safetensors; do ln -sf "$PWD/tests/fixtures/tiny-mtp-f32/$f" "$T/chat-mtp/$f"; done
for tp in 1 2; do
    chat_turns ./nemoh "$T/chat-mtp" "cpu chat --mtp 3 --tp $tp" 0 - --cpu --mtp 3 --tp $tp
    printf 'Hello there\nWhy?\n' | ./nemoh -m "$T/chat-mtp" --chat -t 0 -n 12 --mtp 0 --tp $tp --dump-logits /dev/null >/dev/null 2>"$T/chat-mtp0.err"
    same "chat --mtp 3 --tp $tp: the conversation's ids equal --mtp 0's" "$(printf 'Hello there\nWhy?\n' |
        ./nemoh -m "$T/chat-mtp" --chat -t 0 -n 12 --mtp 3 --tp $tp --dump-logits /dev/null 2>&1 >/dev/null | grep '^nemoh: conversation ids')" \
        "$(grep '^nemoh: conversation ids' "$T/chat-mtp0.err")"
done
got=$(printf 'Hi\n' | ./nemoh -m $C/nano-v2 --chat -t 0 -n 8 --cpu --no-think 2>/dev/null)
same "chat --hide-think: a reply without reasoning prints the same" "$(printf 'Hi\n' | ./nemoh -m $C/nano-v2 --chat -t 0 -n 8 --cpu --no-think --hide-think 2>/dev/null)" "$got"
got=$(printf 'Hi\n' | ./nemoh -m $C/nano-v2 --chat -t 0 -n 8 --cpu 2>/dev/null)
[ -n "$got" ] && [ -z "$(printf 'Hi\n' | ./nemoh -m $C/nano-v2 --chat -t 0 -n 8 --cpu --hide-think 2>/dev/null | tr -d '\n')" ] \
    && pass "chat --hide-think: reasoning that never closes prints nothing (shown without the flag)" \
    || fail "chat --hide-think: reasoning that never closes prints nothing (shown without the flag)" "$got"
one=$(./nemoh -m $C/chatml --chat "Hello there" -t 0 -n 8 --cpu 2>/dev/null)
same "chat: --chat PROMPT replies as the first stdin turn does" "$one" "$(printf 'Hello there\n' | ./nemoh -m $C/chatml --chat -t 0 -n 8 --cpu 2>/dev/null)"
got=$(printf 'Why?\n' | ./nemoh -m $C/chatml -i "Hello there" -t 0 -n 8 --cpu 2>&1 >/dev/null | grep -c '^nemoh: turn')
same "chat: -i PROMPT replies to PROMPT, then to each stdin line (turns)" "$got $(printf 'Why?\n' | ./nemoh -m $C/chatml -i "Hello there" -t 0 -n 8 --cpu 2>/dev/null | head -1)" "2 $one"
if ! command -v tmux >/dev/null; then
    echo "skipped: chat under tmux (tmux not installed)"
else
    # a server of its own (-L): sessions here never meet another run's; killed at the end
    X=(tmux -L nemoh-chat-$$)
    # wait_pane S TEXT: up to 30 s (a loaded machine) for TEXT to show in session S's pane
    wait_pane() { for _ in $(seq 300); do "${X[@]}" capture-pane -p -t $1 | grep -qF -- "$2" && return 0; sleep 0.1; done; return 1; }
    "${X[@]}" new-session -d -s talk -x 160 -y 20 "./nemoh -m $C/chatml -i -t 0 -n 8 --cpu 2>/dev/null; echo EXITED \$?; sleep 60"
    wait_pane talk ">" && "${X[@]}" send-keys -t talk "Hello there" Enter
    wait_pane talk "${one:0:8}" && pass "chat under tmux: the reply appears after the message" \
        || fail "chat under tmux: the reply appears after the message" "$("${X[@]}" capture-pane -p -t talk)"
    "${X[@]}" send-keys -t talk "/exit" Enter
    wait_pane talk "EXITED 0" && pass "chat under tmux: /exit ends nemoh (status 0)" \
        || fail "chat under tmux: /exit ends nemoh (status 0)" "$("${X[@]}" capture-pane -p -t talk)"
    "${X[@]}" new-session -d -s stop -x 160 -y 20 "./nemoh -m $C/chatml --chat -t 0 -n 8 --cpu 2>/dev/null; echo EXITED \$?; sleep 60"
    wait_pane stop ">" && "${X[@]}" send-keys -t stop C-c
    wait_pane stop "EXITED 130" && pass "chat under tmux: Ctrl-C at the prompt ends nemoh (status 130)" \
        || fail "chat under tmux: Ctrl-C at the prompt ends nemoh (status 130)" "$("${X[@]}" capture-pane -p -t stop)"
    # a reply of thousands of tokens (the context raised to let it run: "Hi" gets 15,458, seconds on this
    # CPU; a reply that ended before the Ctrl-C arrived would leave it to end nemoh at the prompt), stopped
    # by Ctrl-C once it shows
    "${X[@]}" new-session -d -s long -x 160 -y 20 "./nemoh -m $C/nano-v2 --chat -t 0 -c 30000 --cpu 2>$T/long.err; echo EXITED \$?; sleep 60"
    wait_pane long ">" && "${X[@]}" send-keys -t long "Hi" Enter
    # its first run of letters as the pane shows it (the reply goes on in other scripts)
    wait_pane long "$(./nemoh -m $C/nano-v2 --chat "Hi" -t 0 -n 4 --cpu 2>/dev/null | sed 's/^[^A-Za-z]*//; s/[^A-Za-z].*//')" \
        && "${X[@]}" send-keys -t long C-c
    for _ in $(seq 300); do [ "$("${X[@]}" capture-pane -p -t long | grep . | tail -1)" = ">" ] && break; sleep 0.1; done
    "${X[@]}" send-keys -t long "/exit" Enter
    wait_pane long "EXITED 0"; ok=$?
    n=$(sed -n 's/.*turn 1: .* decoded \([0-9]*\) tokens.*/\1/p' "$T/long.err")
    [ $ok = 0 ] && [ -n "$n" ] && [ "$n" -lt 15458 ] \
        && pass "chat under tmux: Ctrl-C stops a reply (after $n of its 15,458 tokens) and returns to the prompt; /exit then ends" \
        || fail "chat under tmux: Ctrl-C stops a reply and returns to the prompt; /exit then ends" "$("${X[@]}" capture-pane -p -t long; cat "$T/long.err")"
    "${X[@]}" kill-server 2>/dev/null
fi
refuse "chat bad input: a model without a chat template" "has no chat template" ./nemoh -m weights --chat "hi"
refuse "chat bad input: --think with a format without a switch" "has no reasoning switch" ./nemoh -m $C/chatml --chat --think "hi"
printf 'one\\\ntwo\\\n' | ./nemoh -m $C/chatml --chat -n 2 --cpu >/dev/null 2>"$T/continued.err"
rc=$? last=$(tail -1 "$T/continued.err")
[ $rc -eq 1 ] && [[ $last == *"ended inside a continued message"* ]] && pass "chat bad input: a continued line at the end of stdin (exit 1: $last)" \
    || fail "chat bad input: a continued line at the end of stdin" "exit $rc: $(cat "$T/continued.err")"
printf '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]' > "$T/conv.json"
refuse "chat bad input: a conversation that does not end with a user message" "must end with a user message" ./nemoh -m $C/chatml --chat -f "$T/conv.json" --encode
mkdir -p "$T/odd" && printf '{"chat_template": "{{ messages }}"}' > "$T/odd/tokenizer_config.json"
refuse "chat bad input: a template of another format" "none of the formats" ./nemoh -m "$T/odd" --tokenizer $C/tokenizer.json --chat --encode "hi"
refuse "chat bad input: --think without --chat" "need --chat" ./nemoh -m $C/chatml --think "hi"
refuse "chat bad input: --print-ids with --chat" "--chat: prints the replies as text" ./nemoh -m $C/chatml --chat --print-ids "hi"
refuse "chat bad input: a tokenizer without the format's special tokens" "not have as one token" \
    ./nemoh -m $C/nano-v2 --tokenizer tests/fixtures/tokenizer/gpt2/tokenizer.json --chat --encode "hi"

# ---- hostile input: streams, stdout, signals, the context, padded vocabularies (README: Reliability) ----
d=tests/fixtures/tiny-bf16
cat /proc/version > "$T/version"
want=$(./nemoh -m weights --encode -f "$T/version" 2>&1)
same "-f /proc/version: read to its end like a regular file" "$(./nemoh -m weights --encode -f /proc/version 2>&1)" "$want"
same "-f /dev/stdin: a pipe read to its end" "$(cat "$T/version" | ./nemoh -m weights --encode -f /dev/stdin 2>&1)" "$want"
mkfifo "$T/fifo" && { cat "$T/version" > "$T/fifo" & }
same "-f FIFO: read to its end" "$(./nemoh -m weights --encode -f "$T/fifo" 2>&1)" "$want"
refuse "bad input: -f a directory" "$T: is a directory" ./nemoh -f "$T"
refuse "bad input: --tokenizer a directory" "$T: is a directory" ./nemoh --tokenizer "$T" --encode hi
refuse "bad input: -f /dev/zero (endless) stops at the context's worth of text" "more than the context" timeout 20 ./nemoh -f /dev/zero
yes "Once upon a time there was a tokenizer." | head -c 100000000 > "$T/big.txt"
refuse "bad input: a 100 MB -f prompt is refused within 5 s, unencoded" "more than the context" timeout 5 ./nemoh -f "$T/big.txt"
refuse "bad input: a text prompt past -c stops encoding" "more than the context" ./nemoh "Once upon a time there was a little girl" -c 4
rm -f "$T/big.txt"
refuse "bad input: -m naming a file, text prompt" "config.json: not a directory" ./nemoh -m weights/config.json "hello"
refuse "bad input: -m naming no directory, text prompt" "$T/none: no such model directory" ./nemoh -m "$T/none" "hello"
refuse "bad input: -m naming no directory, --encode" "$T/none: no such model directory" ./nemoh -m "$T/none" --encode "hello"
refuse "bad input: an error line escapes control characters it echoes" '-f x\x0Anemoh: ok\x1B[2J: cannot open' ./nemoh -f $'x\nnemoh: ok\e[2J'
out=$(./nemoh --cpu -m $d --ids "1 2" -n 100 -c 8 -t 0 2>&1 >/dev/null); rc=$?
[ $rc -eq 0 ] && grep -q "stopped at the end of the context (8 tokens" <<< "$out" && pass "generation that fills the context says so" \
    || fail "generation that fills the context says so" "exit $rc: $out"
out=$(printf 'hello there\n' | ./nemoh --cpu -m tests/fixtures/chat/nano-v2 --chat -c 40 -t 0 2>&1 >/dev/null); rc=$?
[ $rc -eq 0 ] && grep -q "reply stopped at the end of the context (40 tokens" <<< "$out" && pass "a chat reply that fills the context says so" \
    || fail "a chat reply that fills the context says so" "exit $rc: $out"

# stdout: a full disk, a closed stdout, a broken pipe (SIGPIPE ignored: one line; as it comes: the signal)
refuse_run "bad input: stdout on a full disk (/dev/full)" "stdout: write failed: No space left on device" /dev/full ./nemoh --cpu -m $d --ids "1 2" -n 5
refuse_run "bad input: stdout closed" "stdout is closed" - ./nemoh --cpu -m $d --ids "1 2" -n 5
./nemoh -m tests/fixtures/chat/chatml --chat "Hello there" -t 0 -n 8 --cpu </dev/null >/dev/full 2>"$T/chatfull.err"; rc=$?
err=$(grep -v '^nemoh: \(loaded\|turn\)' "$T/chatfull.err")
[ $rc -eq 1 ] && [ "$err" = "nemoh: stdout: write failed: No space left on device" ] && pass "bad input: a chat reply to a full disk: one line, exit 1" \
    || fail "bad input: a chat reply to a full disk: one line, exit 1" "exit $rc: $err"
{ sleep 0.5; trap '' PIPE; ./nemoh --cpu -m $d --ids "1 2" -n 1000 -c 2000 -t 1 -s 1 2>"$T/pipe.err"; echo $? > "$T/pipe.rc"; } | true
err=$(grep -v '^nemoh: \(loaded\|note\):\? ' "$T/pipe.err")
[ "$(cat "$T/pipe.rc")" = 1 ] && [ "$err" = "nemoh: stdout: write failed: Broken pipe" ] && pass "bad input: a broken pipe with SIGPIPE ignored ends generation with one line" \
    || fail "bad input: a broken pipe with SIGPIPE ignored ends generation with one line" "exit $(cat "$T/pipe.rc"): $err"
{ sleep 0.5; ./nemoh --cpu -m $d --ids "1 2" -n 1000 -c 2000 -t 1 -s 1 2>/dev/null; echo $? > "$T/pipe.rc"; } | true
same "a broken pipe with SIGPIPE as it comes ends nemoh by the signal (exit 141)" "$(cat "$T/pipe.rc")" 141

# the checkpoint truncated while nemoh runs: nemoh waits on a FIFO (--dump-logits) after mapping it
mkdir -p "$T/sigbus" && cp $d/config.json $d/model.safetensors "$T/sigbus/" && mkfifo "$T/sigbus.fifo"
./nemoh --cpu -m "$T/sigbus" --ids "1 2" -n 1 --dump-logits "$T/sigbus.fifo" >/dev/null 2>"$T/sigbus.err" & pid=$!
for i in $(seq 200); do grep -q sigbus/model.safetensors /proc/$pid/maps 2>/dev/null && break; sleep 0.05; done
truncate -s 4096 "$T/sigbus/model.safetensors"
cat "$T/sigbus.fifo" > /dev/null &
wait $pid; rc=$?
err=$(cat "$T/sigbus.err")
[ $rc -eq 1 ] && [ "$err" = "nemoh: $T/sigbus/model.safetensors: cannot read: the file was truncated or replaced while nemoh ran" ] \
    && pass "bad input: the checkpoint truncated while mapped: one line naming it, exit 1" \
    || fail "bad input: the checkpoint truncated while mapped: one line naming it, exit 1" "exit $rc: $err"

# a tokenizer smaller than the model's vocabulary (real checkpoints pad vocab_size): accepted with one
# warning naming both sizes; a sampled id past the tokenizer prints as <id N>, never as nothing
mkdir -p "$T/padded" && cp $d/config.json $d/model.safetensors "$T/padded/" && cp tests/fuzz/bytes.tokenizer.json "$T/padded/tokenizer.json"
ids=$(./nemoh --cpu -m "$T/padded" --ids "1 2" -n 200 -t 1 -s 5 --print-ids 2>/dev/null)
./nemoh --cpu -m "$T/padded" --ids "1 2" -n 200 -t 1 -s 5 > "$T/padded.out" 2>"$T/padded.err"; rc=$?
want=$(tr ' ' '\n' <<< "$ids" | awk '$1 >= 256' | tr '\n' ' ')
got=$(grep -o '<id [0-9]*>' "$T/padded.out" | tr -dc '0-9\n' | tr '\n' ' ')
warn=$(grep -c "warning: $T/padded/tokenizer.json has 256 ids, the model 1200: .* print as <id N>" "$T/padded.err")
[ $rc -eq 0 ] && [ -n "$want" ] && [ "$got" = "$want" ] && [ "$warn" -eq 1 ] \
    && pass "tokenizer of 256 ids, model of 1200: one warning; the $(wc -w <<< "$want") sampled ids past it print as <id N>" \
    || fail "tokenizer of 256 ids, model of 1200: one warning; sampled ids past it print as <id N>" "exit $rc, ids past it: $want"$'\n'"shown: $got"$'\n'"$(cat "$T/padded.err")"

# ---- the default model: `./nemoh "Once upon a time"` prints English ----
out=$(./nemoh "Once upon a time" -n 40 -s 3 2>/dev/null)
words=$(printf '%s' "$out" | wc -w)
[[ $out == "Once upon a time"* ]] && [ "$words" -ge 15 ] && pass "./nemoh \"Once upon a time\" prints a continuation ($words words)" \
    || fail "./nemoh \"Once upon a time\" prints a continuation" "$out"

# drafting by default where it measured faster (mtp_default): on the CPU when greedy, two drafts a step
# where the AMX tile unit runs the bf16 products (make builds for it where the CPU has it), else none;
# none when sampling; the tokens are plain decoding's either way
g0=$(./nemoh --cpu "Once upon a time" -n 40 -t 0 --mtp 0 2>/dev/null)
gd=$(./nemoh --cpu "Once upon a time" -n 40 -t 0 2>"$T/gd.err")
if grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null; then kw="4 drafts a step"; grep -q "^nemoh: mtp: 4 drafts a step among ids below 1024;" "$T/gd.err"
else kw="no drafting"; ! grep -q 'mtp:' "$T/gd.err"; fi && [ "$gd" = "$g0" ] \
    && pass "default model, CPU, -t 0: $kw by default (AMX: $(grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null && echo yes || echo no)), the tokens of --mtp 0" \
    || fail "default model, CPU, -t 0: $kw by default, the tokens of --mtp 0" "$gd"$'\n'"$g0"$'\n'"$(cat "$T/gd.err")"
./nemoh --cpu "Once upon a time" -n 8 -s 3 2>"$T/gs.err" >/dev/null
grep -q 'mtp:' "$T/gs.err" && fail "default model, CPU, sampled: no drafting by default" "$(cat "$T/gs.err")" \
    || pass "default model, CPU, sampled: no drafting by default"

# ---- the first five minutes: what a new user sees ----
# the line at load: layers by kind, parameters (the safetensors headers' element counts; with MoE the
# active ones: of the routed experts only top_k), storage format, context, backend, sampling
for c in "weights:9 layers (4 M, 1 *, 4 -), 14.6M parameters, bf16, context 2048; backend cpu, 1 rank; greedy, seed 1" \
         "tests/fixtures/tiny-f32:10 layers (4 M, 3 *, 3 -), 365088 parameters, f32, context 256; backend cpu, 1 rank; greedy, seed 1" \
         "tests/fixtures/tiny-moe-bf16:7 layers (2 M, 1 *, 1 -, 3 E), 159892 parameters (108052 active per token), bf16, context 256; backend cpu, 2 ranks; temperature 0.7, top-p 0.9, seed 1"; do
    m=${c%%:*} want=${c#*:}
    args=(-t 0); [[ $m == *moe* ]] && args=(-t 0.7 -p 0.9 --tp 2)
    got=$(./nemoh --cpu -m "$m" --ids "1 2" -n 1 -s 1 "${args[@]}" 2>&1 >/dev/null | sed -n 's/^nemoh: loaded [^:]*: //p')
    same "the line at load ($m): layers, parameters, format, context, backend, sampling" "$got" "$want"
done
# Ctrl-C while generating (a model without eos_token_id: nothing ends it sooner): the line finished,
# the figures of what was done, exit 130
mkdir -p "$T/no-eos" && cp $C/tokenizer.json tests/fixtures/tiny-bf16/model.safetensors "$T/no-eos/"
sed '/"eos_token_id"/d' tests/fixtures/tiny-bf16/config.json > "$T/no-eos/config.json"
# (the signal goes once text is streaming: one that comes while the model loads ends nemoh at once, as it should)
./nemoh --cpu -m "$T/no-eos" "Hello" -n 1000000 -c 100000 -t 1 -s 1 >"$T/int.out" 2>"$T/int.err" & pid=$!
for i in $(seq 200); do [ "$(wc -c < "$T/int.out")" -gt 200 ] && break; sleep 0.05; done
kill -INT $pid; wait $pid; rc=$?
if [ $rc -eq 130 ] && [ "$(tail -c 1 "$T/int.out" | od -An -c | tr -d ' ')" = '\n' ] \
    && grep -q '^nemoh: prefill [0-9]* tokens in .*; decode [1-9][0-9]* tokens in ' "$T/int.err" && grep -q '^nemoh: interrupted (Ctrl-C)' "$T/int.err"; then
    pass "Ctrl-C while generating: the line ends, prefill and decode figures printed, exit 130"
else fail "Ctrl-C while generating: the line ends, prefill and decode figures printed, exit 130" "exit $rc: $(cat "$T/int.err")"; fi
# --trace starts on a line of its own, not glued to the text on stdout
n=$(./nemoh --cpu -m $C/chatml "Hi" -n 3 -t 0 --trace 2>&1 | grep -c '^layer   0 ')
same "--trace: its first line starts a line (not after the prompt's text)" "$n" 1
mkdir -p "$T/empty"
refuse "bad input: -m a directory without config.json: why, and that it is not a model directory" \
    "$T/empty/config.json: cannot open: No such file or directory ($T/empty is not a model directory" ./nemoh -m "$T/empty" "hi"
n=$(./nemoh --cpu -m tests/fixtures/tiny-bf16 --ids "1 2" -n 1 -c 1000 2>&1 >/dev/null | grep -c '^nemoh: note: -c 1000 is more than the 256 positions the model was trained on')
same "-c past the model's context: accepted with one note" "$n $(./nemoh --cpu -m tests/fixtures/tiny-bf16 --ids "1 2" -n 1 -c 100 2>&1 | grep -c note)" "1 0"
out=$(./nemoh -n 4 -s 1 "" 2>&1 >/dev/null); rc=$?
[ $rc -eq 0 ] && [ "$(grep -c '^nemoh: note: the prompt is empty: generating from the tokenizer.s BOS alone' <<< "$out")" -eq 1 ] \
    && grep -q '^nemoh: prefill 1 token in ' <<< "$out" && pass "an empty prompt: one note, generated from BOS (prefill 1 token)" \
    || fail "an empty prompt: one note, generated from BOS (prefill 1 token)" "exit $rc: $out"
out=$(printf 'Hi\nYo\n' | ./nemoh --cpu -m $C/chatml --chat -n 8 -t 0 2>&1 >/dev/null | grep -cE '^nemoh: turn [12]: prefilled [0-9]+ of [0-9]+ tokens in .*; decoded [0-9]+ tokens? in [0-9.]+ s \([0-9.]+ tok/s\)$')
same "chat: each turn's line gives its decode speed too" "$out" 2

# ---- the README's option list is what -h prints ----
help=$(./nemoh -h); at=$(grep -n '^usage: nemoh' README.md | cut -d: -f1)
doc=$([ -n "$at" ] && sed -n "$at,$((at + $(wc -l <<< "$help") - 1))p" README.md)
[ "$doc" = "$help" ] && pass "README: the option list is nemoh -h" || fail "README: the option list is nemoh -h" "$(diff <(echo "$doc") <(echo "$help"))"

# ---- --trace shows the protocol: a plain norm first, then every entry fused, one plain all-reduce ----
tr=$(./nemoh -m tests/fixtures/tiny-f32 --ids "1 2 3" -n 2 --tp 2 --trace --cpu 2>&1 >/dev/null)
nl=$(grep -c '^layer' <<< "$tr"); nf=$(grep -c 'fused all-reduce' <<< "$tr")
[ "$nl" -eq 10 ] && [ "$nf" -eq 9 ] && grep -q '^final .*plain all-reduce' <<< "$tr" && pass "--trace: 10 layers, 9 fused entries, one final all-reduce" \
    || fail "--trace: 10 layers, 9 fused entries, one final all-reduce" "$tr"
# tiny-moe-bf16 is E-M*EME: three moe layers, the first with a plain norm, the others reduced at entry
tr=$(./nemoh -m tests/fixtures/tiny-moe-bf16 --ids "1 2 3" -n 2 --tp 2 --trace --cpu 2>&1 >/dev/null)
got=$(grep '^layer' <<< "$tr" | awk '{print $3}' | tr '\n' ' ')
nm=$(grep -c '^layer .* moe .*fused all-reduce' <<< "$tr")
[ "$got" = "moe mlp mamba attention moe mamba moe " ] && [ "$nm" -eq 2 ] && grep -q '^final .*plain all-reduce' <<< "$tr" \
    && pass "--trace on an MoE model: every layer's kind, moe partial sums reduced at the next entry" \
    || fail "--trace on an MoE model: every layer's kind, moe partial sums reduced at the next entry" "$tr"
# and its MTP block ("*E"): a pass of its own, the same protocol, then its final_layernorm
tr=$(./nemoh -m tests/fixtures/tiny-moe-bf16 --ids "1 2 3" -n 2 --tp 2 --trace --cpu --mtp 2 2>&1 >/dev/null)
got=$(grep -A3 '^final .*norm_f' <<< "$tr" | tail -3 | awk '{print $1, $2, $3, $4}' | tr '\n' ' ')
same "--trace: the MTP block's sublayers, moe reduced at its entry, then final_layernorm" "$got" \
    "mtp 0 attention rmsnorm mtp 1 moe fused final plain all-reduce, then "

# ---- fuzzing: the five libFuzzer harnesses of tests/fuzz, 20 s each, at once (make fuzz runs longer) ----
out=$(if full; then tests/fuzz/run.sh 20 2>&1; else echo "skipped: fuzzing (./test.sh quick)"; fi)
if grep -q '^skipped:' <<< "$out"; then grep '^skipped:' <<< "$out"
else
    while IFS= read -r line; do
        case $line in
        "fuzz "*) pass "$line (ASan + UBSan + LeakSanitizer)" ;;
        "FAIL "*) fail "${line#FAIL }" "$(grep -A5 -F -- "$line" <<< "$out" | grep '^        ')" ;;
        esac
    done <<< "$out"
    grep -qE '^(fuzz|FAIL) ' <<< "$out" || fail "fuzzing: tests/fuzz/run.sh" "$(tail -20 <<< "$out")"
fi

# ---- GPU: kernels one by one, the fixtures end to end, graphs, prefill vs steps, the fused all-reduce ----
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: GPU tests (no NVIDIA GPU visible: nvidia-smi -L fails)"
elif ! ./nemoh -m tests/fixtures/tiny-f32 --ids 1 -n 1 2>&1 >/dev/null | grep -q "backend cuda"; then
    fail "GPU: nemoh picks the CUDA backend" "$(./nemoh -m tests/fixtures/tiny-f32 --ids 1 -n 1 2>&1)"
else
    echo "# GPU tests from ${SECONDS} s"
    if ! wait "$KBUILD"; then fail "GPU kernels: build tests/test_kernels" "$(tail -20 "$T/test_kernels.build")"
    elif out=$(tests/test_kernels 2>&1); then pass "GPU kernels against float64 host references ($(tail -1 <<< "$out"))"
    else fail "GPU kernels against float64 host references" "$(grep '^# seed\|^FAILED' <<< "$out" | head -15; tail -3 <<< "$out")"; fi
    for d in tests/fixtures/tiny-*; do
        f=$(basename "$d")
        # fp32 weights (f32, f16 fixtures) stay fp32 on the GPU; bf16 ones meet bf16 prompt activations:
        # the CPU with every prompt product's input rounded to bf16 as the GPU does moves tiny-moe-bf16's
        # logits by up to 0.058 (0.015 typical a row) from HF's, with every expert choice the same
        tol=$(grep -q '"torch_dtype": "bfloat16"' "$d/config.json" && echo 1e-1 || echo 2e-4)
        got=$(fixture_run ./nemoh "$d" "$T/gpu-$f.bin")
        same "GPU $f: greedy tokens identical to HF" "$got" "$(cat "$d/greedy.txt")"
        check "GPU $f: logits within $tol of HF" "$T/compare_logits" "$T/gpu-$f.bin" "$d/ref_logits.bin" "$tol"
        fixture_run ./nemoh "$d" "$T/gpu-$f-steps.bin" --chunk 1 >/dev/null
        check "GPU $f: prompt in one chunk = one token at a time (within $tol)" "$T/compare_logits" "$T/gpu-$f-steps.bin" "$T/gpu-$f.bin" "$tol"
        fixture_run ./nemoh "$d" "$T/gpu-$f-eager.bin" --no-graph >/dev/null
        check "GPU $f: CUDA-graph replay = eager steps (bitwise)" "$T/compare_logits" "$T/gpu-$f-eager.bin" "$T/gpu-$f.bin" 0
        fixture_run ./nemoh "$d" "$T/gpu-$f-nofuse.bin" --no-fuse >/dev/null
        check "GPU $f: --no-fuse = fused (within 1e-5)" "$T/compare_logits" "$T/gpu-$f-nofuse.bin" "$T/gpu-$f.bin" 1e-5
        check "GPU $f: = CPU at TP 1 (within $tol)" "$T/compare_logits" "$T/gpu-$f.bin" "$T/cpu $f.bin" "$tol"
    done
    # drafting on the GPU: a verify forward decodes its few tokens with the one-token kernels, so drafts
    # forced from the plain run give its tokens and logits bit for bit; graphs (one a pass) = eager
    for d in $(grep -l '"num_nextn_predict_layers": [1-9]' tests/fixtures/tiny-*/config.json | xargs -n1 dirname); do
        f=$(basename "$d") ids=$(cat "$d/prompt.txt")
        plain=$(./nemoh -m "$d" --ids "$ids" -n 48 -t 0 --mtp 0 --dump-logits "$T/gpu-$f-m0.bin" 2>/dev/null)
        for k in 1 3 8; do
            got=$(NEMOH_TEST_DRAFTS="$plain" ./nemoh -m "$d" --ids "$ids" -n 48 -t 0 --mtp $k --dump-logits "$T/gpu-$f-m$k.bin" 2>"$T/gpu-$f-m$k.err")
            h=$(mtp_steps "$T/gpu-$f-m$k.err")
            if [ "$got" = "$plain" ] && [ -n "$h" ] && ! grep -qw 0 <<< "$h"; then pass "GPU $f --mtp $k: forced drafts, every accepted count 0..$k ($h), tokens equal --mtp 0"
            else fail "GPU $f --mtp $k: forced drafts, every accepted count 0..$k, tokens equal --mtp 0" "got:      $got"$'\n'"expected: $plain"$'\n'"$(cat "$T/gpu-$f-m$k.err")"; fi
            check "GPU $f --mtp $k: logits of every position equal --mtp 0 (bitwise)" "$T/compare_logits" "$T/gpu-$f-m$k.bin" "$T/gpu-$f-m0.bin" 0
        done
        NEMOH_TEST_DRAFTS="$plain" ./nemoh -m "$d" --ids "$ids" -n 48 -t 0 --mtp 3 --no-graph --dump-logits "$T/gpu-$f-m3e.bin" >/dev/null 2>&1
        check "GPU $f --mtp 3: CUDA graphs = eager (bitwise)" "$T/compare_logits" "$T/gpu-$f-m3e.bin" "$T/gpu-$f-m3.bin" 0
        tol=$(grep -q '"torch_dtype": "bfloat16"' "$d/config.json" && echo 1e-1 || echo 2e-4)
        if [ -e "$d/mtp_logits.bin" ]; then
            fixture_run ./nemoh "$d" "$T/gpu-$f-mtp.bin" --mtp 3 --dump-mtp "$T/gpu-$f.mtp" >/dev/null
            check "GPU $f: MTP logits at every position within $tol of the oracle" "$T/compare_logits" "$T/gpu-$f.mtp" "$d/mtp_logits.bin" "$tol"
        fi
    done
    # a prompt of 3 tokens (a chunk no longer than a verify forward) runs as a prompt with and without --mtp
    plain=$(./nemoh -m tests/fixtures/tiny-moe-bf16 --ids "5 6 7" -n 24 -t 0 --mtp 0 --dump-logits "$T/gpu-short-m0.bin" 2>/dev/null)
    got=$(NEMOH_TEST_DRAFTS="$plain" ./nemoh -m tests/fixtures/tiny-moe-bf16 --ids "5 6 7" -n 24 -t 0 --mtp 3 --dump-logits "$T/gpu-short-m3.bin" 2>/dev/null)
    same "GPU tiny-moe-bf16, a 3-token prompt, --mtp 3 (forced drafts): tokens equal --mtp 0" "$got" "$plain"
    check "GPU tiny-moe-bf16, a 3-token prompt, --mtp 3: logits equal --mtp 0 (bitwise)" "$T/compare_logits" "$T/gpu-short-m3.bin" "$T/gpu-short-m0.bin" 0
    ./nemoh -m weights --ids "$(cat tests/fixtures/default-ref/ids.txt)" -n 1 -t 0 --mtp 3 --dump-mtp "$T/gdefm.bin" >/dev/null 2>&1
    check "GPU default model: MTP logits on held-out text within 5e-2 of the oracle" "$T/compare_logits" "$T/gdefm.bin" \
        tests/fixtures/default-ref/mtp_logits.bin 5e-2
    g0=$(./nemoh -m weights -n 64 -t 0 --mtp 0 "Once upon a time" 2>/dev/null)
    same "GPU default model: greedy with its trained drafts (--mtp 3) = without" "$(./nemoh -m weights -n 64 -t 0 --mtp 3 "Once upon a time" 2>/dev/null)" "$g0"
    ./nemoh -m weights -n 8 -t 0 "Once upon a time" 2>"$T/gpu-gd.err" >/dev/null
    grep -q 'mtp: 2 drafts a step' "$T/gpu-gd.err" && pass "GPU default model, greedy: 2 drafts a step by default (fastest there)" \
        || fail "GPU default model, greedy: 2 drafts a step by default (fastest there)" "$(cat "$T/gpu-gd.err")"
    chat_turns ./nemoh "$T/chat-mtp" "GPU chat --mtp 3" 2e-4 - --mtp 3
    # --mtp-vocab N on the GPU: each pass computes lm_head's rows of ids below N and drafts among them
    for f in tiny-mtp-f32 tiny-mtp-latent-f32; do
        d=tests/fixtures/$f V=$(vocab_of "$d")
        nv=$((V / 2 + 3))
        fixture_run ./nemoh "$d" "$T/gpu-$f-nv.bin" --mtp 3 --mtp-vocab $nv --dump-mtp "$T/gpu-$f-nv.mtp" >/dev/null
        check "GPU $f --mtp-vocab $nv: MTP logits of those ids at every position within 2e-4 of the oracle" \
            "$T/compare_logits" "$T/gpu-$f-nv.mtp" "$d/mtp_logits.bin" 2e-4 $nv $V
    done
    d=tests/fixtures/tiny-mtp-f32 ids=$(cat tests/fixtures/tiny-mtp-f32/prompt.txt)
    plain=$(./nemoh -m $d --ids "$ids" -n 48 -t 0 --mtp 0 2>/dev/null)
    got=$(./nemoh -m $d --ids "$ids" -n 48 -t 0 --mtp 2 --mtp-vocab 1 2>"$T/gpu-nv1.err")
    if ! grep -qw 0 <<< "$plain" && [ "$got" = "$plain" ] && grep -q 'among ids below 1;.* (0 of [0-9]* drafts accepted' "$T/gpu-nv1.err"; then
        pass "GPU tiny-mtp-f32 --mtp 2 --mtp-vocab 1: every draft id 0, none accepted, tokens equal --mtp 0"
    else fail "GPU tiny-mtp-f32 --mtp 2 --mtp-vocab 1: every draft id 0, none accepted, tokens equal --mtp 0" "$got"$'\n'"$plain"$'\n'"$(cat "$T/gpu-nv1.err")"; fi
    ./nemoh -m weights --ids "$(cat tests/fixtures/default-ref/ids.txt)" -n 1 -t 0 --mtp 3 --mtp-vocab 1024 --dump-mtp "$T/gdefm-nv.bin" >/dev/null 2>&1
    check "GPU default model --mtp-vocab 1024: MTP logits of those ids within 5e-2 of the oracle" "$T/compare_logits" "$T/gdefm-nv.bin" \
        tests/fixtures/default-ref/mtp_logits.bin 5e-2 1024 8192
    same "GPU default model: greedy drafting among 1024 ids (--mtp 3 --mtp-vocab 1024) = without drafts" \
        "$(./nemoh -m weights -n 64 -t 0 --mtp 3 --mtp-vocab 1024 "Once upon a time" 2>/dev/null)" "$g0"
    # --chat on the GPU: snapshots are device-to-device copies the replayed decode graph then reads
    for fmt in nano-v2 nemotron-3; do chat_turns ./nemoh $fmt "GPU chat $fmt" 5e-2 -; done
    chat_turns ./nemoh nemotron-3 "GPU chat nemotron-3 --no-graph" 5e-2 --no-think --no-graph
    ./nemoh -m weights --ids "$(cat tests/fixtures/default-ref/ids.txt)" -n 1 -t 0 --dump-logits "$T/gdef.bin" >/dev/null 2>&1
    check "GPU default model: held-out logits within 5e-2 of HF" "$T/compare_logits" "$T/gdef.bin" tests/fixtures/default-ref/ref_logits.bin 5e-2
    g1=$(./nemoh -m tests/fixtures/tiny-bf16 --ids "$(cat tests/fixtures/tiny-bf16/prompt.txt)" -n 40 -t 1 -p 0.9 -s 7 2>/dev/null)
    g2=$(./nemoh -m tests/fixtures/tiny-bf16 --ids "$(cat tests/fixtures/tiny-bf16/prompt.txt)" -n 40 -t 1 -p 0.9 -s 7 2>/dev/null)
    [ -n "$g1" ] && [ "$g1" = "$g2" ] && pass "GPU seeded sampling repeats exactly" || fail "GPU seeded sampling repeats exactly" "$g1 / $g2"
    for h in 1000 4096 8192; do
        check "GPU --bench-allreduce --hidden $h: fused and NCCL paths match the host reference (1, 2, 4, 7, 8 .. 2048 tokens, 300 graph-replayed calls)" \
            ./nemoh --bench-allreduce --hidden $h
    done
    refuse "GPU bad input: a model larger than the GPU" "free" ./nemoh --random nemotron-h-8b -c 16000000 --ids 1
    # a GPU the build has no kernels for (its capability faked): one line says why, then the CPU runs
    d=tests/fixtures/tiny-f32
    got=$(NEMOH_FAKE_CC=8.0 ./nemoh -m $d --ids "$(cat $d/prompt.txt)" -n "$(wc -w < $d/greedy.txt)" -t 0 2>"$T/fake.err")
    if [ "$(grep -c 'compute capability 8.0.*running on the CPU' "$T/fake.err")" -eq 1 ] && grep -q "backend cpu" "$T/fake.err" \
        && [ "$got" = "$(cat $d/greedy.txt)" ]; then
        pass "GPU of capability 8.0 (NEMOH_FAKE_CC): one line says why, the CPU backend decodes the fixture as HF"
    else
        fail "GPU of capability 8.0 (NEMOH_FAKE_CC): one line says why, the CPU backend decodes the fixture as HF" \
            "got: $got"$'\n'"$(cat "$T/fake.err")"
    fi
    refuse "GPU bad input: NEMOH_FAKE_CC not MAJOR.MINOR" "NEMOH_FAKE_CC=ampere: expected MAJOR.MINOR" \
        env NEMOH_FAKE_CC=ampere ./nemoh -m tests/fixtures/tiny-f32 --ids 1 -n 1
    for d in "$T"/bad/*; do   # NaN / Inf weights: the sampler kernel flags the logits
        [ -e "$d/at-run" ] && refuse_run "GPU bad input: $(basename "$d")" "non-finite logits" /dev/null ./nemoh -m "$d" --ids "1 2" -n 1
    done
    d="$T/bad-mtp/good-nan-mtp"
    plain=$(./nemoh -m "$d" --ids "1 2" -n 12 -t 0 --mtp 0 2>/dev/null)
    got=$(./nemoh -m "$d" --ids "1 2" -n 12 -t 0 --mtp 3 2>"$T/nan-mtp-gpu.err")
    if [ -n "$plain" ] && [ "$got" = "$plain" ]; then pass "GPU: an MTP block whose logits are NaN drafts nothing; the tokens equal --mtp 0's"
    else fail "GPU: an MTP block whose logits are NaN drafts nothing; the tokens equal --mtp 0's" "$got"$'\n'"$plain"$'\n'"$(cat "$T/nan-mtp-gpu.err")"; fi
    echo "# GPU tests until ${SECONDS} s"
fi

finish

#!/usr/bin/env bash
# Every tokenizer test: the HF-oracle fixtures of tests/fixtures/tokenizer (test_tokenizer built
# plain, then with AddressSanitizer and UBSan), and the refusal of tokenizer.json files nemoh
# does not implement. Needs only a C compiler. Last line: "N passed, M failed".
set -u
cd "$(dirname "$0")/.."
CC=${CC:-cc}
FIX=tests/fixtures/tokenizer
OUT=build/tests
mkdir -p "$OUT"
passed=0 failed=0

# Test binaries include all of nemoh.c, whose other sections' helpers they leave unused.
FLAGS=(-std=c11 -Wall -Wextra -Wno-unused-function)
$CC -O2 "${FLAGS[@]}" -o "$OUT/test_tokenizer" tests/test_tokenizer.c -lm -lpthread || exit 1
$CC -O1 -g "${FLAGS[@]}" -fsanitize=address,undefined -fno-sanitize-recover=all \
    -o "$OUT/test_tokenizer_san" tests/test_tokenizer.c -lm -lpthread || exit 1

# The fixtures: each run ends with "tokenizer NAME: N passed, M failed".
for bin in test_tokenizer test_tokenizer_san; do
    for name in tekken gpt2 edge; do
        log=$("$OUT/$bin" "$name" "$FIX/$name/tokenizer.json" "$FIX/$name.expected.json" 2>&1)
        echo "$log" | grep -v '^tokenizer .*passed' | head -20
        summary=$(echo "$log" | tail -1)
        if [[ $summary =~ ^tokenizer\ .*:\ ([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
            echo "$bin: $summary"
            passed=$((passed + BASH_REMATCH[1])) failed=$((failed + BASH_REMATCH[2]))
        else
            echo "FAIL $bin $name: did not finish"
            failed=$((failed + 1))
        fi
    done
done

# Refusals: each file, an edit of a fixture, must stop `test_tokenizer --load` with exit status 1
# and one line on stderr naming the file and the problem.
refuse() {   # refuse NAME SOURCE SED-EXPRESSION EXPECTED-TEXT
    local file="$OUT/refuse-$1.json"
    sed "$3" "$2" > "$file"
    if cmp -s "$file" "$2"; then echo "FAIL refusal $1: the edit changed nothing"; failed=$((failed + 1)); return; fi
    local err rc
    err=$("$OUT/test_tokenizer" --load "$file" 2>&1 >/dev/null)
    rc=$?
    if [[ $rc -eq 1 && $(echo "$err" | wc -l) -eq 1 && $err == *"$file"* && $err == *"$4"* ]]; then
        passed=$((passed + 1))
    else
        echo "FAIL refusal $1: exit $rc, stderr: $err"
        failed=$((failed + 1))
    fi
}
E=$FIX/edge/tokenizer.json G=$FIX/gpt2/tokenizer.json
refuse normalizer "$E" 's/"normalizer":null/"normalizer":{"type":"NFC"}/' 'unsupported normalizer NFC'
refuse metaspace "$E" 's/"pre_tokenizer":{"type":"Sequence"/"pre_tokenizer":{"type":"Metaspace","x":{"type":"Sequence"/; s/,"post_processor"/},"post_processor"/' 'unsupported pre_tokenizer Metaspace'
refuse split-behavior "$E" 's/"behavior":"Isolated"/"behavior":"Removed"/' 'unsupported pre_tokenizer Sequence'
refuse split-regex "$E" 's/ ?\\\\p{N}+/ ?\\\\p{N}{1,3}/' "Split regex is neither Tekken's nor GPT-2's"
refuse prefix-space "$E" 's/"add_prefix_space":false/"add_prefix_space":true/' 'without add_prefix_space'
refuse bytelevel-regex "$G" 's/"add_prefix_space":false,/"add_prefix_space":false,"use_regex":false,/' 'unsupported pre_tokenizer ByteLevel'
refuse decoder "$E" 's/"decoder":{"type":"ByteLevel"/"decoder":{"type":"WordPiece"/' 'unsupported decoder WordPiece'
refuse post-processor "$E" 's/"post_processor":{"type":"TemplateProcessing"/"post_processor":{"type":"RobertaProcessing"/' 'unsupported post_processor RobertaProcessing'
refuse model "$E" 's/"model":{"type":"BPE"/"model":{"type":"Unigram"/' 'unsupported model Unigram'
refuse dropout "$E" 's/"dropout":null/"dropout":0.1/' 'model uses dropout, continuing_subword_prefix or end_of_word_suffix (unsupported)'
refuse truncation "$E" 's/"truncation":null/"truncation":{"max_length":512}/' 'truncation or padding is set'
refuse lstrip "$E" '0,/"lstrip":false/s//"lstrip":true/' 'added token <bos> uses single_word, lstrip or rstrip'
refuse added-id "$E" 's/"id":3259,"content":"<bos>"/"id":5000,"content":"<bos>"/' 'added token <bos> has id 5000, but HF tokenizers gives it id 3259'
refuse merge-form "$G" 's/"Ġ t"/"Ġ t x"/' 'merge 1 is not two tokens'
refuse merge-vocab "$G" 's/"Ġ a"/"Ġ ≠"/' 'merge 2 (Ġ ≠) has a token not in the vocab'
refuse byte-missing "$G" 's/"Ā":188,//' 'vocab has no token for byte 0x00'
refuse malformed "$G" 's/"vocab":{/"vocab":{{/' 'malformed JSON at byte'
refuse vocab-nan "$G" 's/"Ā":188/"Ā":NaN/' 'vocab entry Ā: id must be an integer'
refuse vocab-1e400 "$G" 's/"Ā":188/"Ā":1e400/' 'vocab entry Ā: id must be an integer'
refuse vocab-hex "$G" 's/"Ā":188/"Ā":0xBC/' 'malformed JSON at byte'
refuse vocab-minus-inf "$G" 's/"Ā":188/"Ā":-inf/' 'malformed JSON at byte'
refuse post-negative "$E" 's/"ids":\[3259\]/"ids":[-1000000]/' 'post_processor special token ids malformed'
refuse post-past-vocab "$E" 's/"ids":\[3259\]/"ids":[1000000]/' 'post_processor special token id is not in the vocab'
refuse added-not-utf8 "$E" 's/"content":"<bos>"/"content":"\xC3<bos>"/' 'invalid UTF-8 in string'
refuse vocab-not-utf8 "$G" 's/"Ā":188/"\xE9":188/' 'invalid UTF-8 in string'

# Accepted (under the sanitizers too): edits found by fuzzing that once tripped UBSan.
accept() {   # accept NAME SOURCE SED-EXPRESSION
    local file="$OUT/accept-$1.json" err
    sed "$3" "$2" > "$file"
    if err=$("$OUT/test_tokenizer_san" --load "$file" 2>&1); then passed=$((passed + 1))
    else echo "FAIL accept $1: $err" | head -5; failed=$((failed + 1)); fi
}
accept empty-vocab-key "$G" 's/"vocab":{/"vocab":{"":50257,/'

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]

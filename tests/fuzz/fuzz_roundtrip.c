/* fuzz_roundtrip: encode then decode with the default tokenizer (weights/tokenizer.json) and the
 * GPT-2 fixture. The input is text: every id must be in the vocabulary; for valid UTF-8, decoding
 * the ids between the post-processor's special tokens gives the text back byte for byte (as
 * HF's decode does); for any input, streaming the ids writes what the whole decode gives, and
 * valid UTF-8. */
#include "fuzz.h"

static Tokenizer *tok[2];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    tok[0] = tok_load("weights/tokenizer.json");
    tok[1] = tok_load("tests/fixtures/tokenizer/gpt2/tokenizer.json");
    fuzz_keep();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FUZZ_BEGIN();
    for (int k = 0; k < 2; k++) {
        const Tokenizer *t = tok[k];
        int n, *ids = tok_encode(t, (const char *)data, size, 0, &n);
        FUZZ_ASSERT(n >= t->n_pre + t->n_post, "the special tokens are missing");
        for (int i = 0; i < n; i++) FUZZ_ASSERT(ids[i] >= 0 && ids[i] < t->n_vocab, "id outside the vocabulary");
        size_t len;
        char *text = tok_decode(t, ids + t->n_pre, n - t->n_pre - t->n_post, &len);
        if (fuzz_utf8(data, size)) FUZZ_ASSERT(len == size && !memcmp(text, data, size), "decode(encode(s)) != s");
        FUZZ_ASSERT(fuzz_utf8((const unsigned char *)text, len), "decode is not UTF-8");
        fuzz_check_stream(t, ids + t->n_pre, n - t->n_pre - t->n_post, text, len);
        free(text);
        free(ids);
    }
    return 0;
}

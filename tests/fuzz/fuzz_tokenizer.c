/* fuzz_tokenizer: loading tokenizer.json. The input is a tokenizer.json; when it loads, a few
 * texts are encoded and every id decoded, whole and streamed. */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char *texts[] = {"Hello, world!", " \t\n  x  ", "\xC3\xA9t\xC3\xA9 \xE2\x82\xAC 12345", "<bos><s>[INST]", "\xFF\xC3"};
    FUZZ_BEGIN();
    Tokenizer *t = tok_parse((const char *)data, size, "tokenizer.json");
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        int n, *ids = tok_encode(t, texts[k], strlen(texts[k]), 0, &n);
        for (int i = 0; i < n; i++) FUZZ_ASSERT(ids[i] >= 0 && ids[i] < t->n_vocab, "encode made an id outside the vocabulary");
        size_t len;
        free(tok_decode(t, ids, n, &len));
        free(ids);
    }
    int all[64];
    for (int i = 0; i < 64; i++) all[i] = i * (t->n_vocab / 64 + 1) % (t->n_vocab + 2) - 1;
    size_t len;
    free(tok_decode(t, all, 64, &len));
    tok_free(t);
    return 0;
}

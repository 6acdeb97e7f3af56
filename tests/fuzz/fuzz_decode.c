/* fuzz_decode: decoding arbitrary ids (negative, past the vocabulary: they decode to nothing)
 * with the default tokenizer. The input is little-endian int32 ids: the whole decode and the
 * streamed one agree, are valid UTF-8, and no streamed write ends inside a character. */
#include "fuzz.h"

static Tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    tok = tok_load("weights/tokenizer.json");
    fuzz_keep();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FUZZ_BEGIN();
    int n = (int)(size / 4), *ids = malloc((size_t)n * sizeof(int) + 1);
    for (int i = 0; i < n; i++) {
        memcpy(&ids[i], data + 4 * i, 4);
        if (data[4 * i + 3] == 0x40) ids[i] &= 0xFFFF;   /* often an id inside the vocabulary */
    }
    size_t len, slen;
    char *text = tok_decode(tok, ids, n, &len), *streamed;
    FUZZ_ASSERT(fuzz_utf8((const unsigned char *)text, len), "decode is not UTF-8");
    FILE *f = open_memstream(&streamed, &slen);
    TokStream s = {0};
    for (int i = 0; i < n; i++) {
        tok_stream_put(tok, &s, ids[i], f);
        long at = ftell(f);
        FUZZ_ASSERT(at >= 0 && ((size_t)at >= len || ((unsigned char)text[at] & 0xC0) != 0x80), "a streamed write ended inside a character");
    }
    tok_stream_end(tok, &s, f);
    fclose(f);
    FUZZ_ASSERT(slen == len && !memcmp(streamed, text, len), "streamed decode != decode");
    free(streamed);
    free(text);
    free(ids);
    return 0;
}

/* fuzz_decode: decoding arbitrary ids (negative, past the vocabulary: shown as "<id N>")
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
    size_t len;
    char *text = tok_decode(tok, ids, n, &len);
    FUZZ_ASSERT(fuzz_utf8((const unsigned char *)text, len), "decode is not UTF-8");
    fuzz_check_stream(tok, ids, n, text, len);
    free(text);
    free(ids);
    return 0;
}

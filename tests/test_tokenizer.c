/* test_tokenizer: nemoh's tokenizer against what Hugging Face tokenizers answered.
 *
 *   test_tokenizer NAME TOKENIZER.json EXPECTED.json   check every case of EXPECTED.json (written by
 *                                                      tools/tokenizer_oracle.js), one line per failure
 *   test_tokenizer --load TOKENIZER.json               only load it (the refusal tests)
 *
 * For each "encode" case: the pre-tokenizer split of the text gives HF's pieces, encode(text)
 * gives HF's ids, decode(ids) gives what HF's decode gave ("decoded", or the text itself), and
 * streaming those ids one at a time writes the same bytes. A "hex" case gives the input as bytes
 * that are not UTF-8 (and has no pieces).
 * For each "decode" case (many of them invalid UTF-8): decode and streaming give HF's text. A
 * stream must never split a character across writes: no write may end inside one. */
#define NEMOH_NO_MAIN
#include "../nemoh.c"

/* Prints one failure of case i, on one line (control characters escaped); returns 0 so that
 * callers can write `ok = fail(...)`. */
static int fail(const char *name, int i, const char *what, const char *text) {
    printf("FAIL tokenizer %s case %d: %s (text \"", name, i, what);
    const unsigned char *c = (const unsigned char *)text;
    for (int k = 0; c[k] && k < 60; k++) printf(c[k] < 0x20 || c[k] == 0x7F ? "\\x%02X" : "%c", c[k]);
    printf("%s\")\n", strlen(text) > 60 ? "..." : "");
    return 0;
}

/* Streams ids through tok_stream_put into memory; returns the bytes (NUL-terminated) and checks
 * that no write ends inside a character: the byte after every write boundary must not be a
 * continuation byte (the output is valid UTF-8, so that is exactly the condition). */
static char *stream(const Tokenizer *t, const int *ids, int n, size_t *len, int *split_char) {
    char *out;
    FILE *f = open_memstream(&out, len);
    size_t *ends = xmalloc(((size_t)n + 1) * sizeof(size_t));
    TokStream s = {0};
    for (int i = 0; i <= n; i++) {
        if (i < n) tok_stream_put(t, &s, ids[i], f);
        else tok_stream_end(t, &s, f);
        ends[i] = (size_t)ftell(f);
    }
    fclose(f);
    *split_char = 0;
    for (int i = 0; i <= n; i++)
        if (ends[i] < *len && ((unsigned char)out[ends[i]] & 0xC0) == 0x80) *split_char = 1;
    free(ends);
    return out;
}

/* Decode and streaming checks of ids against the expected text. */
static int check_decode(const char *name, int i, const Tokenizer *t, const int *ids, int n,
                        const Json *want) {
    size_t len, slen;
    int split, ok = 1;
    char *d = tok_decode(t, ids, n, &len), *s = stream(t, ids, n, &slen, &split);
    if (len != (size_t)want->len || memcmp(d, want->str, len))
        ok = fail(name, i, "decode differs from HF", want->str);
    if (slen != (size_t)want->len || memcmp(s, want->str, slen))
        ok = fail(name, i, "streamed decode differs from HF", want->str);
    if (split) ok = fail(name, i, "stream split a character across writes", want->str);
    free(d);
    free(s);
    return ok;
}

/* The pre-tokenizer split of the whole text against HF's piece lengths. */
static int check_split(const char *name, int i, const Tokenizer *t, const Json *text,
                       const Json *pieces) {
    const unsigned char *s = (const unsigned char *)text->str;
    size_t at = 0, n = (size_t)text->len;
    for (const Json *p = pieces->child; p; p = p->next) {
        size_t end = at < n ? t->split(s, n, at) : at;
        if (end - at != (size_t)p->num)
            return fail(name, i, "pre-tokenizer split differs from HF", text->str);
        at = end;
    }
    return at == n ? 1 : fail(name, i, "pre-tokenizer split goes on past HF's", text->str);
}

static int *json_ids(const Json *a, int *n) {
    int *ids = xmalloc((size_t)a->n * sizeof(int) + 1);
    *n = 0;
    for (const Json *e = a->child; e; e = e->next) ids[(*n)++] = (int)e->num;
    return ids;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--load")) {
        tok_free(tok_load(argv[2]));
        return 0;
    }
    if (argc != 4) die("usage: test_tokenizer NAME TOKENIZER.json EXPECTED.json | --load FILE");
    const char *name = argv[1];
    Tokenizer *t = tok_load(argv[2]);
    size_t flen;
    char *text = read_text(argv[3], &flen, 1 << 29);
    if (!text) die("%s: cannot open", argv[3]);
    JsonDoc doc = json_parse(text, flen, argv[3]);
    const Json *enc = json_get(doc.nodes, "encode"), *dec = json_get(doc.nodes, "decode");
    if (!enc || !dec || !enc->n || !dec->n) die("%s: no encode or decode cases", argv[3]);

    int i = 0, passed = 0, failed = 0;
    for (const Json *c = enc->child; c; c = c->next, i++) {
        const Json *txt = json_get(c, "text"), *hex = json_get(c, "hex"), *want = json_get(c, "decoded");
        char *in = hex ? xmalloc((size_t)hex->len / 2 + 1) : (char *)txt->str;
        size_t len = hex ? (size_t)hex->len / 2 : (size_t)txt->len;
        for (size_t k = 0; hex && k < len; k++)   /* two hex digits a byte */
            in[k] = (char)(hexval(hex->str[2 * k]) << 4 | hexval(hex->str[2 * k + 1]));
        const char *shown = hex ? hex->str : txt->str;
        int nw, n, k = 0, ok = hex ? 1 : check_split(name, i, t, txt, json_get(c, "pieces"));
        int *w = json_ids(json_get(c, "ids"), &nw), *ids = tok_encode(t, in, len, 0, &n);
        while (k < n && k < nw && ids[k] == w[k]) k++;
        if (k < n || k < nw) {
            char msg[160];
            snprintf(msg, sizeof msg, "ids differ from HF at %d of %d/%d: nemoh %d, HF %d", k, n, nw,
                     k < n ? ids[k] : -1, k < nw ? w[k] : -1);
            ok = fail(name, i, msg, shown);
        }
        ok &= check_decode(name, i, t, w, nw, want ? want : txt);
        passed += ok, failed += !ok;
        if (hex) free(in);
        free(w);
        free(ids);
    }
    for (const Json *c = dec->child; c; c = c->next, i++) {
        int n, *ids = json_ids(json_get(c, "ids"), &n);
        int ok = check_decode(name, i, t, ids, n, json_get(c, "text"));
        passed += ok, failed += !ok;
        free(ids);
    }
    printf("tokenizer %s: %d passed, %d failed\n", name, passed, failed);
    json_free(&doc);
    free(text);
    tok_free(t);
    return failed != 0;
}

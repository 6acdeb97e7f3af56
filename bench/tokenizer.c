/* bench/tokenizer: how fast nemoh's tokenizer encodes, on one core.
 *
 *   cc -O2 -std=c11 -o build/bench_tokenizer bench/tokenizer.c -lm -lpthread
 *   build/bench_tokenizer TOKENIZER.json TEXT_FILE
 *
 * Times tok_encode (best of 5) on TEXT_FILE repeated to 1 MiB, then on 1 MiB of random lowercase
 * letters: a single pre-token, in no vocabulary, that BPE must merge from its 1048576 bytes. */
#define NEMOH_NO_MAIN
#include "../nemoh.c"

enum { MIB = 1 << 20 };

static void bench(const Tokenizer *t, const char *what, const char *text, size_t len) {
    double best = 1e9;
    int n = 0;
    for (int run = 0; run < 5; run++) {
        double t0 = now_s();
        int *ids = tok_encode(t, text, len, &n);
        double dt = now_s() - t0;
        free(ids);
        if (dt < best) best = dt;
    }
    printf("%-40s %8zu bytes -> %7d ids in %.3f s (%.1f MB/s)\n", what, len, n, best, len / best / 1e6);
}

int main(int argc, char **argv) {
    if (argc != 3) die("usage: bench_tokenizer TOKENIZER.json TEXT_FILE");
    double t0 = now_s();
    Tokenizer *t = tok_load(argv[1]);
    printf("%-40s %.3f s\n", "load", now_s() - t0);
    size_t n;
    char *file = read_file(argv[2], &n);
    if (!file || !n) die("%s: cannot read, or empty", argv[2]);
    char *text = xmalloc(MIB + n);
    for (size_t k = 0; k <= MIB; k += n) memcpy(text + k, file, n);
    size_t len = MIB;
    while (len > 0 && ((unsigned char)text[len] & 0xC0) == 0x80) len--;   /* end on a character */
    bench(t, argv[2], text, len);
    uint32_t x = 1;
    for (size_t k = 0; k < MIB; k++) {   /* a 32-bit LCG */
        x = x * 1664525u + 1013904223u;
        text[k] = (char)('a' + (x >> 24) % 26);
    }
    bench(t, "random lowercase letters (one pre-token)", text, MIB);
    free(text);
    free(file);
    tok_free(t);
    return 0;
}

/* fuzz.h: nemoh.c as the libFuzzer harnesses in this directory see it.
 *
 * die() is made catchable: it longjmps back to the harness (FUZZ_BEGIN), so a refusal is an
 * answer, not a crash. Every allocation nemoh.c makes is tracked, so that a refused input's
 * half-built tables are freed on that path (FUZZ_BEGIN's branch); the table stores the pointers
 * XOR-ed, so LeakSanitizer does not count it as a reference: whatever an accepted input leaves
 * allocated after the harness frees it is reported as the leak it is. */
#define _GNU_SOURCE
/* every header nemoh.c includes, before the allocator macros below rename anything */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static jmp_buf fuzz_jmp;
#define NEMOH_DIE_EXIT() longjmp(fuzz_jmp, 1)
#define NEMOH_NO_MAIN

static uintptr_t *fuzz_live;    /* [fuzz_n] live allocations, each XOR-ed with FUZZ_KEY */
static size_t fuzz_n, fuzz_cap;
#define FUZZ_KEY ((uintptr_t)0x5A5A5A5A5A5A5A5Aull)

static void fuzz_track(void *p) {
    if (!p) return;
    if (fuzz_n == fuzz_cap) {
        fuzz_cap = fuzz_cap ? 2 * fuzz_cap : 1024;
        fuzz_live = (realloc)(fuzz_live, fuzz_cap * sizeof *fuzz_live);
        if (!fuzz_live) abort();
    }
    fuzz_live[fuzz_n++] = (uintptr_t)p ^ FUZZ_KEY;
}

static void fuzz_untrack(void *p) {
    for (size_t i = fuzz_n; p && i-- > 0;)
        if (fuzz_live[i] == ((uintptr_t)p ^ FUZZ_KEY)) { fuzz_live[i] = fuzz_live[--fuzz_n]; return; }
}

static void *fuzz_malloc(size_t n) { void *p = (malloc)(n); fuzz_track(p); return p; }
static void *fuzz_calloc(size_t n, size_t s) { void *p = (calloc)(n, s); fuzz_track(p); return p; }
static char *fuzz_strdup(const char *s) { char *p = (strdup)(s); fuzz_track(p); return p; }
static void fuzz_free(void *p) { fuzz_untrack(p); (free)(p); }
static void *fuzz_realloc(void *p, size_t n) {
    void *q = (realloc)(p, n);
    if (q) fuzz_untrack(p), fuzz_track(q);
    return q;
}
#define malloc fuzz_malloc
#define calloc fuzz_calloc
#define realloc fuzz_realloc
#define strdup fuzz_strdup
#define free fuzz_free

#include "../../nemoh.c"

/* Frees everything a refused input had allocated. */
static void fuzz_release(void) {
    while (fuzz_n) (free)((void *)(fuzz_live[--fuzz_n] ^ FUZZ_KEY));
}

/* Starts an input: a die() inside it comes back here, frees what it allocated and returns 0. */
#define FUZZ_BEGIN() do { if (setjmp(fuzz_jmp)) { fuzz_release(); return 0; } } while (0)

/* What the harness keeps across inputs (a tokenizer loaded once) is not the input's to free. */
static void fuzz_keep(void) { fuzz_n = 0; }

/* The text of a fixture file the harness needs (run from the repository root). */
static char *fuzz_fixture(const char *path, size_t *len) {
    char *text = read_file(path, len, (size_t)1 << 30);
    if (!text) { fprintf(stderr, "%s: cannot open (run from the repository root)\n", path); exit(2); }
    return text;
}

/* 1 if s[0..n) is valid UTF-8. */
static int fuzz_utf8(const unsigned char *s, size_t n) {
    unsigned cp;
    for (size_t i = 0; i < n;) {
        int r = utf8_check(s + i, n - i, &cp);
        if (r <= 0) return 0;
        i += (size_t)r;
    }
    return 1;
}

/* A failed property: print it and abort, which libFuzzer reports with the input. */
#define FUZZ_ASSERT(cond, what) do { if (!(cond)) { fprintf(stderr, "fuzz: %s\n", what); abort(); } } while (0)

/* Streams ids[0..n) through tok_stream_put into memory: the result must equal the whole decode
 * text[0..len), and no streamed write may end inside a character. */
static void fuzz_check_stream(const Tokenizer *t, const int *ids, int n, const char *text, size_t len) {
    char *streamed;
    size_t slen;
    FILE *f = open_memstream(&streamed, &slen);
    TokStream s = {0};
    for (int i = 0; i < n; i++) {
        tok_stream_put(t, &s, ids[i], f);
        long at = ftell(f);
        FUZZ_ASSERT(at >= 0 && ((size_t)at >= len || ((unsigned char)text[at] & 0xC0) != 0x80), "a streamed write ended inside a character");
    }
    tok_stream_end(t, &s, f);
    fclose(f);
    FUZZ_ASSERT(slen == len && !memcmp(streamed, text, len), "streamed decode != decode");
    free(streamed);
}

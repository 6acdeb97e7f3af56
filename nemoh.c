/* nemoh.c: a compact inference engine for NVIDIA Nemotron-H hybrid models (Mamba2 + attention + MLP).
 *
 * Read top to bottom: errors and files, JSON, safetensors, config, weights and sharding, the
 * tokenizer, the CPU backend (the readable reference), the one layer loop every backend runs,
 * tensor-parallel ranks, the sampler, generation and the command line. nemoh.cu holds the CUDA
 * backend; without it (a plain C compiler) this file builds the CPU engine alone. */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nemoh.h"

/* ------------------------------------------------------------------------------------------------
 * Errors, memory and files
 * ---------------------------------------------------------------------------------------------- */

/* Every user-facing failure ends here: one line on stderr, exit status 1. */
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("nemoh: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) die("out of memory allocating %zu bytes", n);
    return p;
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) die("out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Reads a whole file into a NUL-terminated buffer; returns NULL if it cannot be opened. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) != 0) die("%s: cannot seek", path);
    long n = ftell(f);
    if (n < 0) die("%s: cannot read (is it a directory?)", path);
    rewind(f);
    char *buf = xmalloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) die("%s: read failed", path);
    fclose(f);
    buf[n] = 0;
    if (len) *len = (size_t)n;
    return buf;
}

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* ------------------------------------------------------------------------------------------------
 * JSON: a small DOM parser (config.json, safetensors headers, tokenizer.json)
 * ---------------------------------------------------------------------------------------------- */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } JType;

typedef struct Json Json;
struct Json {
    JType type;                 /* kind of value */
    double num;                 /* J_NUM value, J_BOOL 0/1 (accepts Infinity, -Infinity, NaN) */
    const char *str;            /* J_STR: decoded UTF-8, NUL-terminated */
    int len;                    /* J_STR: bytes in str (may contain NUL) */
    const char *key;            /* member key when this value sits in an object, else NULL */
    int klen;                   /* bytes in key */
    Json *child;                /* J_ARR / J_OBJ: first element */
    Json *next;                 /* next element of the enclosing array or object */
    int n;                      /* J_ARR / J_OBJ: number of elements */
};

typedef struct {
    char *buf;                  /* mutable copy of the text; strings are decoded in place */
    size_t len, pos;            /* text length, parse position */
    const char *what;           /* file name for error messages */
    Json *pool;                 /* [cap] node storage, grown by doubling during the parse */
    size_t used, cap;
    int depth;
} JsonParser;

typedef struct {
    char *buf;                  /* text storage the nodes point into */
    Json *nodes;                /* [count] all nodes; nodes[0] is the root */
} JsonDoc;

static void json_fail(JsonParser *p, const char *msg) {
    die("%s: malformed JSON at byte %zu: %s", p->what, p->pos, msg);
}

static void json_ws(JsonParser *p) {
    while (p->pos < p->len && p->buf[p->pos] && strchr(" \t\r\n", p->buf[p->pos])) p->pos++;
}

/* Nodes live in one growing array and are linked by index while parsing (the array may move). */
static size_t json_node(JsonParser *p) {
    if (p->used == p->cap) {
        p->cap = p->cap ? 2 * p->cap : 1024;
        Json *q = realloc(p->pool, p->cap * sizeof(Json));
        if (!q) die("%s: out of memory parsing JSON", p->what);
        p->pool = q;
    }
    memset(&p->pool[p->used], 0, sizeof(Json));
    return p->used++;
}

static int hexval(int ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static unsigned json_hex4(JsonParser *p) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int h = p->pos < p->len ? hexval((unsigned char)p->buf[p->pos]) : -1;
        if (h < 0) json_fail(p, "bad \\u escape");
        v = v * 16 + (unsigned)h;
        p->pos++;
    }
    return v;
}

static int utf8_put(char *out, unsigned cp) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 63)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12); out[1] = (char)(0x80 | ((cp >> 6) & 63));
        out[2] = (char)(0x80 | (cp & 63)); return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18); out[1] = (char)(0x80 | ((cp >> 12) & 63));
    out[2] = (char)(0x80 | ((cp >> 6) & 63)); out[3] = (char)(0x80 | (cp & 63)); return 4;
}

/* Decodes the string at p->pos (just past its opening quote) in place; the output never outgrows
 * the input, so writing behind the read position is safe. */
static char *json_string(JsonParser *p, int *len) {
    char *out = p->buf + p->pos, *w = out;
    for (;;) {
        if (p->pos >= p->len) json_fail(p, "unterminated string");
        unsigned char ch = (unsigned char)p->buf[p->pos++];
        if (ch == '"') break;
        if (ch < 0x20) json_fail(p, "control character in string");
        if (ch != '\\') { *w++ = (char)ch; continue; }
        if (p->pos >= p->len) json_fail(p, "unterminated string");
        ch = (unsigned char)p->buf[p->pos++];
        switch (ch) {
        case '"': *w++ = '"'; break;
        case '\\': *w++ = '\\'; break;
        case '/': *w++ = '/'; break;
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
            unsigned cp = json_hex4(p);
            if (cp >= 0xD800 && cp < 0xDC00 && p->pos + 1 < p->len && p->buf[p->pos] == '\\' &&
                p->buf[p->pos + 1] == 'u') {
                size_t save = p->pos;
                p->pos += 2;
                unsigned lo = json_hex4(p);
                if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                else p->pos = save;
            }
            if (cp >= 0xD800 && cp < 0xE000) cp = 0xFFFD;  /* lone surrogate */
            w += utf8_put(w, cp);
            break;
        }
        default: json_fail(p, "bad escape");
        }
    }
    *len = (int)(w - out);
    *w = 0;  /* the closing quote (or an earlier byte) becomes the terminator */
    return out;
}

static int json_word(JsonParser *p, const char *word) {
    size_t n = strlen(word);
    if (p->pos + n <= p->len && memcmp(p->buf + p->pos, word, n) == 0) { p->pos += n; return 1; }
    return 0;
}

static size_t json_value(JsonParser *p);

/* Parses the elements of an array or object; nodes are linked by index (p->pool may move). */
static void json_elements(JsonParser *p, size_t self, char close, int is_obj) {
    size_t prev = 0;
    int first = 1;
    json_ws(p);
    if (p->pos < p->len && p->buf[p->pos] == close) { p->pos++; return; }
    for (;;) {
        const char *key = NULL;
        int klen = 0;
        if (is_obj) {
            json_ws(p);
            if (p->pos >= p->len || p->buf[p->pos] != '"') json_fail(p, "expected a string key");
            p->pos++;
            key = json_string(p, &klen);
            json_ws(p);
            if (p->pos >= p->len || p->buf[p->pos] != ':') json_fail(p, "expected ':'");
            p->pos++;
        }
        size_t v = json_value(p);
        p->pool[v].key = key;
        p->pool[v].klen = klen;
        if (first) p->pool[self].child = (Json *)(uintptr_t)(v + 1);
        else p->pool[prev].next = (Json *)(uintptr_t)(v + 1);
        first = 0;
        prev = v;
        p->pool[self].n++;
        json_ws(p);
        if (p->pos < p->len && p->buf[p->pos] == ',') { p->pos++; continue; }
        if (p->pos < p->len && p->buf[p->pos] == close) { p->pos++; return; }
        json_fail(p, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static size_t json_value(JsonParser *p) {
    json_ws(p);
    if (p->pos >= p->len) json_fail(p, "unexpected end of input");
    if (++p->depth > 64) json_fail(p, "nested too deeply");
    size_t self = json_node(p);
    char ch = p->buf[p->pos];
    if (ch == '{' || ch == '[') {
        p->pos++;
        p->pool[self].type = ch == '{' ? J_OBJ : J_ARR;
        json_elements(p, self, ch == '{' ? '}' : ']', ch == '{');
    } else if (ch == '"') {
        p->pos++;
        int n;
        char *s = json_string(p, &n);
        p->pool[self].type = J_STR;
        p->pool[self].str = s;
        p->pool[self].len = n;
    } else if (json_word(p, "true")) {
        p->pool[self].type = J_BOOL;
        p->pool[self].num = 1;
    } else if (json_word(p, "false")) {
        p->pool[self].type = J_BOOL;
    } else if (json_word(p, "null")) {
        p->pool[self].type = J_NULL;
    } else if (json_word(p, "Infinity")) {   /* not JSON, but Python writes it: config.json has it */
        p->pool[self].type = J_NUM;
        p->pool[self].num = INFINITY;
    } else if (json_word(p, "-Infinity")) {
        p->pool[self].type = J_NUM;
        p->pool[self].num = -INFINITY;
    } else if (json_word(p, "NaN")) {
        p->pool[self].type = J_NUM;
        p->pool[self].num = NAN;
    } else if (ch == '-' || (ch >= '0' && ch <= '9')) {
        char *end;
        p->pool[self].type = J_NUM;
        p->pool[self].num = strtod(p->buf + p->pos, &end);
        if (end == p->buf + p->pos) json_fail(p, "bad number");
        p->pos = (size_t)(end - p->buf);
    } else {
        json_fail(p, "unexpected character");
    }
    p->depth--;
    return self;
}

/* Parses text[0..len) (copied; text itself is not modified). Dies naming `what` on malformed input. */
static JsonDoc json_parse(const char *text, size_t len, const char *what) {
    JsonParser p = {0};
    p.buf = xmalloc(len + 1);
    memcpy(p.buf, text, len);
    p.buf[len] = 0;
    p.len = len;
    p.what = what;
    json_value(&p);
    json_ws(&p);
    if (p.pos != p.len) json_fail(&p, "trailing characters");
    for (size_t i = 0; i < p.used; i++) {   /* indices + 1 -> pointers, now that the pool is final */
        Json *j = &p.pool[i];
        if (j->child) j->child = &p.pool[(uintptr_t)j->child - 1];
        if (j->next) j->next = &p.pool[(uintptr_t)j->next - 1];
    }
    return (JsonDoc){p.buf, p.pool};
}

static void json_free(JsonDoc *d) {
    free(d->buf);
    free(d->nodes);
    d->buf = NULL;
    d->nodes = NULL;
}

/* Member `key` of object o, or NULL (also when o is NULL or not an object). */
static const Json *json_get(const Json *o, const char *key) {
    if (!o || o->type != J_OBJ) return NULL;
    size_t n = strlen(key);
    for (const Json *m = o->child; m; m = m->next)
        if ((size_t)m->klen == n && memcmp(m->key, key, n) == 0) return m;
    return NULL;
}

/* Element i of array a, or NULL. */
static const Json *json_at(const Json *a, int i) {
    if (!a || a->type != J_ARR || i < 0 || i >= a->n) return NULL;
    const Json *e = a->child;
    while (i--) e = e->next;
    return e;
}

/* ------------------------------------------------------------------------------------------------
 * Safetensors: mmapped checkpoint files and their tensor tables
 * ---------------------------------------------------------------------------------------------- */

/* ------------------------------------------------------------------------------------------------
 * Tokenizer: Hugging Face tokenizer.json, byte-level BPE (Tekken and GPT-2 splits)
 * ---------------------------------------------------------------------------------------------- */

/* What nemoh reads of a tokenizer.json, each part exact to HF tokenizers 0.23: no normalizer; the
 * added tokens, found in the text first; a pre-tokenizer that is the Tekken or the GPT-2 regex
 * split (written out by hand below, over the Unicode classes of nemoh_unicode.h) then the
 * byte-level mapping; a BPE model; a TemplateProcessing or ByteLevel post-processor; the ByteLevel
 * decoder. Anything else is refused when loading. Token strings stay in the file's byte-level
 * alphabet, as HF keeps them; each id also knows the bytes it decodes to. */
#include "nemoh_unicode.h"

typedef struct { int off, len, id; } TokKey;   /* a string in Tokenizer.bytes, and its id */
typedef struct { TokKey *slot; size_t mask; } TokMap;   /* hash: string -> id, -1 in an empty slot */
typedef struct { uint64_t pair; int rank, id; } TokMerge;   /* left id << 32 | right id -> rank, id */

typedef struct {                /* the added tokens matched in one pass over the text */
    TokMap map;                 /* content -> id */
    int *lens, n_lens;          /* the distinct content lengths, longest first */
    unsigned char first[256];   /* 1 for each byte some content starts with */
} TokAdded;

typedef struct Tokenizer {
    char *bytes;                /* token strings and what they decode to, back to back */
    size_t n_bytes, cap_bytes;  /* used and allocated size of bytes */
    int n_vocab;                /* ids are 0..n_vocab-1 */
    int *off, *len;             /* [n_vocab] what each id decodes to: bytes + off[id], len[id] bytes */
    TokMap vocab;               /* the model's tokens by their strings (byte-level characters) */
    TokMerge *merges;           /* hash table of the merges; rank and id -1 in an empty slot */
    size_t merge_mask;          /* its size - 1 (a power of two) */
    TokAdded added[2];          /* added tokens with normalized=false, then those with true */
    int byte_id[256];           /* the token of each single byte */
    unsigned byte_char[256];    /* the byte-level character (code point) of each byte */
    short char_byte[0x144];     /* and back: the byte of byte-level character cp, -1 for none */
    int ignore_merges;          /* a pre-token that is itself in the vocabulary is not merged */
    size_t (*split)(const unsigned char *s, size_t n, size_t i);  /* end of the pre-token at s[i] */
    int pre[8], n_pre;          /* ids the post-processor puts before the text */
    int post[8], n_post;        /* and after it */
} Tokenizer;

/* Array p of *cap items of `size` bytes, grown (by doubling) to hold at least `need` items. */
static void *tok_grow(void *p, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return p;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    if (!(p = realloc(p, c * size))) die("out of memory allocating %zu bytes", c * size);
    *cap = c;
    return p;
}

/* ---- UTF-8 ---- */

/* The UTF-8 sequence at b[0..n): its length (> 0) with its code point in *cp when valid; 0 when b
 * is a valid but unfinished start of one; else minus the length of its maximal invalid subpart. */
static int utf8_check(const unsigned char *b, size_t n, unsigned *cp) {
    unsigned c = b[0];
    if (c < 0x80) { *cp = c; return 1; }
    int len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!len) return -1;
    /* the second byte's range rules out overlong forms, surrogates and code points past U+10FFFF */
    unsigned lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
    unsigned hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
    *cp = c & (0x3Fu >> (len - 1));
    for (int k = 1; k < len; k++) {
        if ((size_t)k >= n) return 0;
        if (b[k] < lo || b[k] > hi) return -k;
        *cp = *cp << 6 | (b[k] & 0x3F);
        lo = 0x80, hi = 0xBF;
    }
    return len;
}

/* Writes b[0..n) to f with each maximal invalid subpart replaced by U+FFFD, as Rust's
 * String::from_utf8_lossy does (HF's decode ends with it). Unless final, an unfinished character
 * at the end is held back. Returns the number of bytes consumed. */
static size_t utf8_lossy(const unsigned char *b, size_t n, int final, FILE *f) {
    size_t i = 0, done = 0;
    while (i < n) {
        unsigned cp;
        int r = utf8_check(b + i, n - i, &cp);
        if (r > 0) { i += (size_t)r; continue; }
        if (r == 0 && !final) break;
        fwrite(b + done, 1, i - done, f);
        fputs("\xEF\xBF\xBD", f);
        i += r ? (size_t)-r : n - i;
        done = i;
    }
    fwrite(b + done, 1, i - done, f);
    return i;
}

/* ---- The pre-tokenizer splits ---- */

static int uclass(unsigned cp) {
    size_t lo = 0, hi = sizeof uc_ranges / sizeof uc_ranges[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp > uc_ranges[mid].hi) lo = mid + 1;
        else if (cp < uc_ranges[mid].lo) hi = mid;
        else return (int)uc_ranges[mid].cls;
    }
    return UC_OTHER;
}

enum {                          /* sets of classes, as the regexes name them */
    C_L = 1 << UC_UPPER | 1 << UC_LOWER | 1 << UC_LETTER,      /* \p{L} */
    C_N = 1 << UC_NUMBER,                                       /* \p{N} */
    C_S = 1 << UC_SPACE,                                        /* \s */
    C_P = 1 << UC_OTHER | 1 << UC_MARK,                         /* [^\s\p{L}\p{N}] */
    C_U = 1 << UC_UPPER | 1 << UC_LETTER | 1 << UC_MARK,        /* [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] */
    C_W = 1 << UC_LOWER | 1 << UC_LETTER | 1 << UC_MARK,        /* [\p{Ll}\p{Lm}\p{Lo}\p{M}] */
};

/* The class (as a set bit) of the character at s[i] of valid UTF-8 s[0..n), its length in *len;
 * 0, in no set, past the end. */
static int cls_at(const unsigned char *s, size_t n, size_t i, int *len) {
    unsigned cp;
    if (i >= n) return 0;
    *len = utf8_check(s + i, n - i, &cp);
    return 1 << uclass(cp);
}

/* End of the run of characters in class set `set` from s[i]. */
static size_t run(const unsigned char *s, size_t n, size_t i, int set) {
    int l;
    while (cls_at(s, n, i, &l) & set) i += (size_t)l;
    return i;
}

/* \s+(?!\S)|\s+ at whitespace s[i]: the whitespace run, less its last character when a
 * non-space follows and the run has more than one. */
static size_t space_run(const unsigned char *s, size_t n, size_t i) {
    size_t k = i, last = i;
    int l;
    while (cls_at(s, n, k, &l) & C_S) last = k, k += (size_t)l;
    return k < n && last > i ? last : k;
}

/* [U]*[W]+ from s[j] (U, W as C_U, C_W), as a backtracking engine matches it: U* takes the longest
 * run, then gives characters back until W+ can start (U and W share Lm, Lo and marks); W+ is
 * greedy. Returns j when there is no match. */
static size_t upper_lower(const unsigned char *s, size_t n, size_t j) {
    size_t i = j, w = SIZE_MAX;
    int l, c;
    while ((c = cls_at(s, n, i, &l)) & C_U) {
        if (c & C_W) w = i;
        i += (size_t)l;
    }
    if (c & C_W) w = i;
    return w == SIZE_MAX ? j : run(s, n, w, C_W);
}

/* The Tekken pre-tokenizer regex at s[i]; its alternatives are tried in order and the first that
 * matches wins (Oniguruma is a leftmost-first backtracking engine):
 *   [^\r\n\p{L}\p{N}]?U*W+ | [^\r\n\p{L}\p{N}]?U+W* | \p{N} | ?[^\s\p{L}\p{N}]+[\r\n/]*
 *   | \s*[\r\n]+ | \s+(?!\S) | \s+
 * Every character starts some alternative, so the match is never empty. */
static size_t split_tekken(const unsigned char *s, size_t n, size_t i) {
    int l, c = cls_at(s, n, i, &l);
    size_t e, j = (c & (C_L | C_N)) || s[i] == '\r' || s[i] == '\n' ? i : i + (size_t)l;
    /* the two letter alternatives, each with the optional leading character (j > i), then without */
    if (j > i && (e = upper_lower(s, n, j)) > j) return e;
    if ((e = upper_lower(s, n, i)) > i) return e;
    if (j > i && (e = run(s, n, j, C_U)) > j) return run(s, n, e, C_W);
    if ((e = run(s, n, i, C_U)) > i) return run(s, n, e, C_W);
    if (c & C_N) return i + (size_t)l;
    /* ' ?[^\s\p{L}\p{N}]+[\r\n/]*': the optional leading character is an ASCII space only */
    j = s[i] == ' ' ? i + 1 : i;
    if ((e = run(s, n, j, C_P)) > j) {
        while (e < n && (s[e] == '\r' || s[e] == '\n' || s[e] == '/')) e++;
        return e;
    }
    /* \s*[\r\n]+: \s* gives back the run down to its last CR or LF */
    for (j = i, e = i; cls_at(s, n, j, &l) & C_S; j += (size_t)l)
        if (s[j] == '\r' || s[j] == '\n') e = j + 1;
    return e > i ? e : space_run(s, n, i);
}

/* The GPT-2 pre-tokenizer regex at s[i], alternatives in order as above:
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t split_gpt2(const unsigned char *s, size_t n, size_t i) {
    if (s[i] == '\'' && i + 1 < n) {
        unsigned char a = s[i + 1], b = i + 2 < n ? s[i + 2] : 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
    size_t e, j = s[i] == ' ' ? i + 1 : i;
    if ((e = run(s, n, j, C_L)) > j || (e = run(s, n, j, C_N)) > j || (e = run(s, n, j, C_P)) > j)
        return e;
    return space_run(s, n, i);
}

/* ---- Hash tables ---- */

static uint64_t tok_hash(const void *p, size_t n) {   /* FNV-1a */
    const unsigned char *s = p;
    uint64_t h = 14695981039346656037ull;
    while (n--) h = (h ^ *s++) * 1099511628211ull;
    return h;
}

static void map_init(TokMap *m, size_t count) {
    size_t cap = 16;
    while (2 * cap < 3 * count) cap *= 2;   /* load at most 2/3 */
    m->slot = xmalloc(cap * sizeof *m->slot);
    for (size_t i = 0; i < cap; i++) m->slot[i].id = -1;
    m->mask = cap - 1;
}

/* The slot holding bytes s[0..n), or the empty slot where they would go. */
static TokKey *map_slot(const TokMap *m, const char *bytes, const void *s, size_t n) {
    for (size_t i = tok_hash(s, n) & m->mask;; i = (i + 1) & m->mask) {
        TokKey *k = &m->slot[i];
        if (k->id < 0 || ((size_t)k->len == n && memcmp(bytes + k->off, s, n) == 0)) return k;
    }
}

static int map_get(const TokMap *m, const char *bytes, const void *s, size_t n) {
    return map_slot(m, bytes, s, n)->id;
}

static TokMerge *merge_slot(const Tokenizer *t, int a, int b) {
    uint64_t pair = (uint64_t)a << 32 | (uint32_t)b;
    for (size_t i = tok_hash(&pair, 8) & t->merge_mask;; i = (i + 1) & t->merge_mask)
        if (t->merges[i].rank < 0 || t->merges[i].pair == pair) return &t->merges[i];
}

/* ---- Encoding ---- */

typedef struct { int id, prev, next; } TokSym;   /* BPE symbol: token (-1: merged away), neighbours */
typedef struct { int rank, pos, id; } TokPair;   /* queued merge of symbol pos and its next into id */

typedef struct {                /* one tok_encode call: its output and BPE scratch space */
    int *ids;                   /* the ids so far */
    size_t n, cap;
    TokSym *sym;                /* symbols of the pre-token being merged */
    TokPair *heap;              /* min-heap of queued merges by (rank, pos) */
    char *word;                 /* the pre-token in byte-level characters */
    size_t cap_sym, cap_heap, cap_word;
} TokEnc;

static void enc_push(TokEnc *e, int id) {
    e->ids = tok_grow(e->ids, &e->cap, e->n + 1, sizeof(int));
    e->ids[e->n++] = id;
}

static int pair_before(TokPair a, TokPair b) {
    return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

/* Queues the merge of symbol pos with its next one, if the vocabulary has it. */
static void bpe_queue(const Tokenizer *t, TokEnc *e, size_t *nh, int pos) {
    int next = e->sym[pos].next;
    if (next < 0) return;
    const TokMerge *m = merge_slot(t, e->sym[pos].id, e->sym[next].id);
    if (m->rank < 0) return;
    TokPair x = {m->rank, pos, m->id};
    size_t i = (*nh)++;
    for (; i && pair_before(x, e->heap[(i - 1) / 2]); i = (i - 1) / 2) e->heap[i] = e->heap[(i - 1) / 2];
    e->heap[i] = x;
}

static TokPair bpe_pop(TokEnc *e, size_t *nh) {
    TokPair top = e->heap[0], x = e->heap[--*nh];
    size_t i = 0, c;
    while ((c = 2 * i + 1) < *nh) {
        if (c + 1 < *nh && pair_before(e->heap[c + 1], e->heap[c])) c++;
        if (!pair_before(e->heap[c], x)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    e->heap[i] = x;
    return top;
}

/* BPE on one pre-token w[0..n), as HF's BPE model: with ignore_merges, a pre-token that is in
 * the vocabulary is that token. Else, as Word::merge_all, from single bytes: every adjacent pair
 * that has a merge is queued by (merge rank, position), lowest first; the top is applied unless
 * stale (its symbols changed since it was queued), and the merged symbol's pairs with its
 * neighbours are queued. */
static void bpe_word(const Tokenizer *t, TokEnc *e, const unsigned char *w, size_t n) {
    if (t->ignore_merges) {
        size_t k = 0;
        int id;
        e->word = tok_grow(e->word, &e->cap_word, 2 * n, 1);
        for (size_t i = 0; i < n; i++) k += (size_t)utf8_put(e->word + k, t->byte_char[w[i]]);
        if ((id = map_get(&t->vocab, t->bytes, e->word, k)) >= 0) { enc_push(e, id); return; }
    }
    e->sym = tok_grow(e->sym, &e->cap_sym, n, sizeof(TokSym));
    e->heap = tok_grow(e->heap, &e->cap_heap, 3 * n, sizeof(TokPair));   /* n - 1 pairs, 2 per merge */
    for (size_t i = 0; i < n; i++)
        e->sym[i] = (TokSym){t->byte_id[w[i]], (int)i - 1, i + 1 < n ? (int)i + 1 : -1};
    size_t nh = 0;
    for (size_t i = 0; i + 1 < n; i++) bpe_queue(t, e, &nh, (int)i);
    while (nh) {
        TokPair p = bpe_pop(e, &nh);
        TokSym *a = &e->sym[p.pos];
        if (a->id < 0 || a->next < 0) continue;
        TokSym *b = &e->sym[a->next];
        if (merge_slot(t, a->id, b->id)->id != p.id) continue;
        a->id = p.id;
        a->next = b->next;
        b->id = -1;
        if (a->next >= 0) e->sym[a->next].prev = p.pos;
        if (a->prev >= 0) bpe_queue(t, e, &nh, a->prev);
        bpe_queue(t, e, &nh, p.pos);
    }
    for (int i = 0; i >= 0; i = e->sym[i].next) enc_push(e, e->sym[i].id);
}

/* Encodes s[0..n) around the added tokens of pass k (leftmost match first, then the longest, as
 * HF's Aho-Corasick matcher); the text between them goes to pass k + 1, and after the last pass
 * through the pre-tokenizer split to BPE. HF matches normalized=false tokens first, then the
 * others: with no normalizer both passes see the text itself. */
static void encode_part(const Tokenizer *t, TokEnc *e, const unsigned char *s, size_t n, int k) {
    if (k == 2) {
        for (size_t i = 0, j; i < n; i = j) {
            j = t->split(s, n, i);
            bpe_word(t, e, s + i, j - i);
        }
        return;
    }
    const TokAdded *a = &t->added[k];
    size_t from = 0, i = 0;
    while (i < n) {
        int id = -1, m = 0;
        for (int x = 0; a->first[s[i]] && x < a->n_lens && id < 0; x++)
            if ((size_t)(m = a->lens[x]) <= n - i) id = map_get(&a->map, t->bytes, s + i, (size_t)m);
        if (id < 0) { i++; continue; }
        encode_part(t, e, s + from, i - from, k + 1);
        enc_push(e, id);
        from = i += (size_t)m;
    }
    encode_part(t, e, s + from, n - from, k + 1);
}

/* The ids of text[0..len), with the post-processor's special tokens (the BOS); caller frees.
 * HF encodes Rust strings, valid UTF-8: invalid input is read as from_utf8_lossy reads it. */
static int *tok_encode(const Tokenizer *t, const char *text, size_t len, int *n_out) {
    char *s;
    size_t n;
    FILE *f = open_memstream(&s, &n);
    if (!f) die("out of memory");
    utf8_lossy((const unsigned char *)text, len, 1, f);
    fclose(f);
    TokEnc e = {0};
    e.ids = tok_grow(e.ids, &e.cap, 1 + n / 3, sizeof(int));
    for (int i = 0; i < t->n_pre; i++) enc_push(&e, t->pre[i]);
    encode_part(t, &e, (const unsigned char *)s, n, 0);
    for (int i = 0; i < t->n_post; i++) enc_push(&e, t->post[i]);
    free(s);
    free(e.sym);
    free(e.heap);
    free(e.word);
    *n_out = (int)e.n;
    return e.ids;
}

/* ---- Decoding ---- */

static void tok_check_id(const Tokenizer *t, int id) {
    if (id < 0 || id >= t->n_vocab) die("token id %d outside the vocabulary (0..%d)", id, t->n_vocab - 1);
}

/* Whole-sequence decode, as HF's decode(ids, skip_special_tokens=False) with the ByteLevel
 * decoder: the tokens' bytes, with invalid UTF-8 shown as U+FFFD. NUL-terminated; caller frees. */
static char *tok_decode(const Tokenizer *t, const int *ids, int n, size_t *len) {
    size_t total = 0, k = 0;
    for (int i = 0; i < n; i++) tok_check_id(t, ids[i]), total += (size_t)t->len[ids[i]];
    unsigned char *raw = xmalloc(total);
    for (int i = 0; i < n; k += (size_t)t->len[ids[i++]])
        memcpy(raw + k, t->bytes + t->off[ids[i]], (size_t)t->len[ids[i]]);
    char *out;
    size_t out_len;
    FILE *f = open_memstream(&out, &out_len);
    if (!f) die("out of memory");
    utf8_lossy(raw, total, 1, f);
    fclose(f);
    free(raw);
    if (len) *len = out_len;
    return out;
}

typedef struct {                /* streaming decode state; start from {0} */
    unsigned char held[4];      /* the start of a character whose other bytes have not come yet */
    int n;                      /* bytes in held (at most 3) */
} TokStream;

/* Writes token id to f as soon as its bytes complete characters: what the tokens so far decode
 * to, less an unfinished character at the end, which is held for the next token. */
static void tok_stream_put(const Tokenizer *t, TokStream *s, int id, FILE *f) {
    tok_check_id(t, id);
    size_t n = (size_t)s->n + (size_t)t->len[id];
    unsigned char *b = xmalloc(n);
    memcpy(b, s->held, (size_t)s->n);
    memcpy(b + s->n, t->bytes + t->off[id], (size_t)t->len[id]);
    size_t used = utf8_lossy(b, n, 0, f);
    s->n = (int)(n - used);
    memcpy(s->held, b + used, (size_t)s->n);
    free(b);
    fflush(f);
}

/* Ends a stream: an unfinished character left is written as U+FFFD, as whole decode does. */
static void tok_stream_end(const Tokenizer *t, TokStream *s, FILE *f) {
    (void)t;
    utf8_lossy(s->held, (size_t)s->n, 1, f);
    s->n = 0;
    fflush(f);
}

static int tok_vocab_size(const Tokenizer *t) { return t->n_vocab; }

/* ---- Loading tokenizer.json ---- */

static const char TEKKEN_RE[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char GPT2_RE[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static const char *jtype(const Json *o) {
    const Json *t = json_get(o, "type");
    return t && t->type == J_STR ? t->str : o && o->type != J_NULL ? "(untyped)" : "(none)";
}

static int jflag(const Json *o, const char *key, int dflt) {
    const Json *j = json_get(o, key);
    return j && j->type == J_BOOL ? j->num != 0 : dflt;
}

static int jempty(const Json *j) { return !j || j->type == J_NULL || (j->type == J_STR && j->len == 0); }

/* GPT-2's bytes_to_unicode: the byte-level character of each byte. Bytes 0x21-0x7E, 0xA1-0xAC
 * and 0xAE-0xFF stand for themselves, the other 68 for U+0100 + n, in byte order. */
static void byte_level_chars(Tokenizer *t) {
    memset(t->char_byte, -1, sizeof t->char_byte);
    for (int b = 0, n = 0; b < 256; b++) {
        int self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        t->byte_char[b] = self ? (unsigned)b : 0x100u + (unsigned)n++;
        t->char_byte[t->byte_char[b]] = (short)b;
    }
}

/* Appends s[0..n) to t->bytes; returns its offset. */
static int tok_put(Tokenizer *t, const char *s, int n) {
    t->bytes = tok_grow(t->bytes, &t->cap_bytes, t->n_bytes + (size_t)n, 1);
    memcpy(t->bytes + t->n_bytes, s, (size_t)n);
    t->n_bytes += (size_t)n;
    return (int)(t->n_bytes - (size_t)n);
}

/* Sets what id decodes to from its token string s[0..n), as HF's ByteLevel decoder maps it: the
 * bytes its characters stand for if all are byte-level characters, else the string as it is. */
static void tok_decodes_to(Tokenizer *t, int id, const char *s, int n) {
    int off = tok_put(t, s, n), k = 0;
    for (int i = 0, r; i < n; i += r) {
        unsigned cp;
        r = utf8_check((const unsigned char *)s + i, (size_t)(n - i), &cp);
        if (r <= 0 || cp >= 0x144 || t->char_byte[cp] < 0) { t->off[id] = off, t->len[id] = n; return; }
        t->bytes[off + k++] = (char)t->char_byte[cp];
    }
    t->off[id] = off, t->len[id] = k;
}

/* Refuses a pipeline stage nemoh does not implement. */
static void tok_refuse(int bad, const char *path, const char *stage, const Json *j, const char *ok) {
    if (bad) die("%s: unsupported %s %s; nemoh implements %s", path, stage, jtype(j), ok);
}

/* Normalizer, pre-tokenizer, post-processor, decoder, truncation, padding. */
static void tok_pipeline(Tokenizer *t, const Json *root, const char *path) {
    const Json *norm = json_get(root, "normalizer"), *pre = json_get(root, "pre_tokenizer");
    const Json *post = json_get(root, "post_processor"), *dec = json_get(root, "decoder");
    tok_refuse(!jempty(norm), path, "normalizer", norm, "none (null)");
    tok_refuse(strcmp(jtype(dec), "ByteLevel") != 0, path, "decoder", dec, "ByteLevel");
    if (!jempty(json_get(root, "truncation")) || !jempty(json_get(root, "padding")))
        die("%s: truncation or padding is set; nemoh implements neither", path);

    /* ByteLevel with its built-in GPT-2 regex, or Split(regex) then ByteLevel(use_regex=false) */
    const Json *split = NULL, *bl = pre, *list = json_get(pre, "pretokenizers");
    if (!strcmp(jtype(pre), "Sequence"))
        split = json_at(list, 0), bl = list && list->n == 2 ? json_at(list, 1) : NULL;
    const Json *re = json_get(json_get(split, "pattern"), "Regex"), *beh = json_get(split, "behavior");
    int split_ok = !split || (!strcmp(jtype(split), "Split") && re && re->type == J_STR && beh &&
                              beh->type == J_STR && !strcmp(beh->str, "Isolated") &&
                              !jflag(split, "invert", 0));
    tok_refuse(!split_ok || strcmp(jtype(bl), "ByteLevel") || jflag(bl, "add_prefix_space", 1) ||
               jflag(bl, "use_regex", 1) != !split, path, "pre_tokenizer", pre,
               "ByteLevel, or Sequence[Split(Tekken or GPT-2 regex, Isolated), "
               "ByteLevel(use_regex=false)], without add_prefix_space");
    t->split = !split || !strcmp(re->str, GPT2_RE) ? split_gpt2
               : !strcmp(re->str, TEKKEN_RE)        ? split_tekken
                                                    : NULL;
    if (!t->split) die("%s: pre_tokenizer Split regex is neither Tekken's nor GPT-2's: %s", path, re->str);

    /* TemplateProcessing: the special tokens around $A in "single" */
    if (jempty(post) || !strcmp(jtype(post), "ByteLevel")) return;
    tok_refuse(strcmp(jtype(post), "TemplateProcessing") != 0, path, "post_processor", post,
               "TemplateProcessing and ByteLevel");
    const Json *single = json_get(post, "single"), *specials = json_get(post, "special_tokens");
    int after = 0;
    for (const Json *p = single ? single->child : NULL; p; p = p->next) {
        const Json *seq = json_get(p, "Sequence"), *sp = json_get(json_get(p, "SpecialToken"), "id");
        if (seq) {
            const Json *sid = json_get(seq, "id");
            if (after || !sid || sid->type != J_STR || strcmp(sid->str, "A"))
                die("%s: post_processor template is not one $A sequence", path);
            after = 1;
            continue;
        }
        const Json *ids = json_get(sp && sp->type == J_STR ? json_get(specials, sp->str) : NULL, "ids");
        if (!ids || ids->type != J_ARR) die("%s: post_processor names an unknown special token", path);
        for (const Json *i = ids->child; i; i = i->next) {
            int *n = after ? &t->n_post : &t->n_pre;
            if (*n == 8 || i->type != J_NUM) die("%s: post_processor special token ids malformed", path);
            (after ? t->post : t->pre)[(*n)++] = (int)i->num;
        }
    }
    if (!after) die("%s: post_processor template has no $A sequence", path);
}

/* The model's vocabulary and merges, and the added tokens. */
static void tok_model(Tokenizer *t, const Json *root, const char *path) {
    const Json *model = json_get(root, "model"), *added = json_get(root, "added_tokens");
    const Json *vocab = json_get(model, "vocab"), *merges = json_get(model, "merges");
    const Json *drop = json_get(model, "dropout");
    tok_refuse(strcmp(jtype(model), "BPE") && strcmp(jtype(model), "(untyped)"), path, "model", model,
               "BPE");
    if (!vocab || vocab->type != J_OBJ || !merges || merges->type != J_ARR)
        die("%s: model has no vocab or merges", path);
    if ((drop && drop->type == J_NUM && drop->num > 0) ||
        !jempty(json_get(model, "continuing_subword_prefix")) ||
        !jempty(json_get(model, "end_of_word_suffix")))
        die("%s: model uses dropout, continuing_subword_prefix or end_of_word_suffix (unsupported)", path);
    if (added && added->type != J_ARR) die("%s: added_tokens is not an array", path);
    t->ignore_merges = jflag(model, "ignore_merges", 0);

    for (const Json *v = vocab->child; v; v = v->next) {
        if (v->type != J_NUM || v->num < 0 || v->num >= 1 << 30)
            die("%s: vocab entry %s: bad id", path, v->key);
        if ((int)v->num >= t->n_vocab) t->n_vocab = (int)v->num + 1;
    }
    for (const Json *a = added ? added->child : NULL; a; a = a->next) {
        const Json *id = json_get(a, "id"), *c = json_get(a, "content");
        if (!id || id->type != J_NUM || id->num < 0 || id->num >= 1 << 30 || !c || c->type != J_STR ||
            !c->len)
            die("%s: added token without an id or content", path);
        if ((int)id->num >= t->n_vocab) t->n_vocab = (int)id->num + 1;
    }
    t->off = xcalloc((size_t)t->n_vocab, sizeof(int));
    t->len = xcalloc((size_t)t->n_vocab, sizeof(int));

    /* The vocabulary, keyed by token string as in the file (byte-level characters). */
    byte_level_chars(t);
    map_init(&t->vocab, (size_t)vocab->n);
    for (const Json *v = vocab->child; v; v = v->next) {
        int off = tok_put(t, v->key, v->klen);
        *map_slot(&t->vocab, t->bytes, v->key, (size_t)v->klen) = (TokKey){off, v->klen, (int)v->num};
        tok_decodes_to(t, (int)v->num, v->key, v->klen);
    }
    for (int b = 0; b < 256; b++) {
        char c[4];
        if ((t->byte_id[b] = map_get(&t->vocab, t->bytes, c, (size_t)utf8_put(c, t->byte_char[b]))) < 0)
            die("%s: vocab has no token for byte 0x%02X", path, b);
    }

    /* Merges: "a b" strings (a "#version" line skipped) or ["a", "b"] pairs; the rank is the
     * position, and a pair listed twice keeps its last. */
    size_t cap = 16, buf_cap = 0;
    while (2 * cap < 3 * (size_t)merges->n) cap *= 2;
    t->merges = xmalloc(cap * sizeof(TokMerge));
    t->merge_mask = cap - 1;
    for (size_t i = 0; i < cap; i++) t->merges[i] = (TokMerge){0, -1, -1};
    char *ab = NULL;
    int rank = 0;
    for (const Json *m = merges->child; m; m = m->next, rank++) {
        const char *a, *b, *sp;
        int na, nb;
        if (m->type == J_STR && m->len >= 8 && !memcmp(m->str, "#version", 8)) { rank--; continue; }
        if (m->type == J_STR && (sp = memchr(m->str, ' ', (size_t)m->len)) &&
            !memchr(sp + 1, ' ', (size_t)(m->str + m->len - sp - 1)))
            a = m->str, na = (int)(sp - a), b = sp + 1, nb = m->len - na - 1;
        else if (m->type == J_ARR && m->n == 2 && m->child->type == J_STR &&
                 m->child->next->type == J_STR)
            a = m->child->str, na = m->child->len, b = m->child->next->str, nb = m->child->next->len;
        else
            die("%s: merge %d is not two tokens", path, rank + 1);
        ab = tok_grow(ab, &buf_cap, (size_t)(na + nb), 1);
        memcpy(ab, a, (size_t)na);
        memcpy(ab + na, b, (size_t)nb);
        int ia = map_get(&t->vocab, t->bytes, a, (size_t)na);
        int ib = map_get(&t->vocab, t->bytes, b, (size_t)nb);
        int ic = map_get(&t->vocab, t->bytes, ab, (size_t)(na + nb));
        if (ia < 0 || ib < 0 || ic < 0)
            die("%s: merge %d (%.*s %.*s) has a token not in the vocab", path, rank + 1, na, a, nb, b);
        *merge_slot(t, ia, ib) = (TokMerge){(uint64_t)ia << 32 | (uint32_t)ib, rank, ic};
    }
    free(ab);

    /* Added tokens, matched by content. HF ignores the ids in the file: a token takes its id in
     * the model vocab, else the next one after the vocab and the added tokens so far; a file
     * whose ids differ from those is refused. */
    int max_id = -1;
    map_init(&t->added[0].map, added ? (size_t)added->n : 0);
    map_init(&t->added[1].map, added ? (size_t)added->n : 0);
    for (const Json *a = added ? added->child : NULL; a; a = a->next) {
        const Json *c = json_get(a, "content");
        int id = (int)json_get(a, "id")->num, hf = map_get(&t->vocab, t->bytes, c->str, (size_t)c->len);
        if (hf < 0) hf = max_id >= vocab->n ? max_id + 1 : vocab->n;
        if (id != hf)
            die("%s: added token %s has id %d, but HF tokenizers gives it id %d", path, c->str, id, hf);
        if (id > max_id) max_id = id;
        if (jflag(a, "single_word", 0) || jflag(a, "lstrip", 0) || jflag(a, "rstrip", 0))
            die("%s: added token %s uses single_word, lstrip or rstrip (not implemented)", path, c->str);
        TokAdded *set = &t->added[jflag(a, "normalized", 1)];
        int off = tok_put(t, c->str, c->len);
        *map_slot(&set->map, t->bytes, c->str, (size_t)c->len) = (TokKey){off, c->len, id};
        tok_decodes_to(t, id, c->str, c->len);
        set->first[(unsigned char)c->str[0]] = 1;
        int k = 0;   /* keep the distinct lengths, longest first */
        while (k < set->n_lens && set->lens[k] > c->len) k++;
        if (k < set->n_lens && set->lens[k] == c->len) continue;
        set->lens = realloc(set->lens, (size_t)(set->n_lens + 1) * sizeof(int));
        if (!set->lens) die("out of memory");
        memmove(set->lens + k + 1, set->lens + k, (size_t)(set->n_lens++ - k) * sizeof(int));
        set->lens[k] = c->len;
    }
}

/* Loads a Hugging Face tokenizer.json; dies naming the file on anything malformed or unsupported. */
static Tokenizer *tok_load(const char *path) {
    size_t n;
    char *text = read_file(path, &n);
    if (!text) die("%s: cannot open: %s", path, strerror(errno));
    JsonDoc doc = json_parse(text, n, path);
    free(text);
    if (doc.nodes[0].type != J_OBJ) die("%s: not a tokenizer.json (not a JSON object)", path);
    Tokenizer *t = xcalloc(1, sizeof *t);
    tok_pipeline(t, doc.nodes, path);
    tok_model(t, doc.nodes, path);
    json_free(&doc);
    for (int k = 0; k < t->n_pre + t->n_post; k++)
        if ((k < t->n_pre ? t->pre[k] : t->post[k - t->n_pre]) >= t->n_vocab)
            die("%s: post_processor special token id is not in the vocab", path);
    return t;
}

static void tok_free(Tokenizer *t) {
    if (!t) return;
    free(t->bytes);
    free(t->off);
    free(t->len);
    free(t->vocab.slot);
    free(t->merges);
    for (int k = 0; k < 2; k++) free(t->added[k].map.slot), free(t->added[k].lens);
    free(t);
}

/* ------------------------------------------------------------------------------------------------
 * CPU backend: the plain-C reference, fp32 arithmetic on the stored weights
 * ---------------------------------------------------------------------------------------------- */

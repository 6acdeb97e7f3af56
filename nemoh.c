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

/* ------------------------------------------------------------------------------------------------
 * CPU backend: the plain-C reference, fp32 arithmetic on the stored weights
 * ---------------------------------------------------------------------------------------------- */

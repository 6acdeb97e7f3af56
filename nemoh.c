/* nemoh.c: a compact inference engine for NVIDIA Nemotron-H hybrid models (Mamba2 + attention + MLP,
 * and Nemotron 3's mixture of experts).
 *
 * Read top to bottom. The model first: how the model is split over tensor-parallel ranks, the CPU
 * backend (the readable reference of every mixer), the one layer loop every backend runs, the ranks
 * that run it, the sampler. Then reading a model from disk: JSON, config.json, safetensors, each
 * rank's weight views, the tokenizer, and synthetic models. Last, chat formats, generation and the
 * command line. nemoh.cu holds the CUDA backend; without it (a plain C compiler) this file builds the
 * CPU engine alone. */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
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

static int utf8_check(const unsigned char *b, size_t n, unsigned *cp);   /* in the tokenizer section */

/* s[0..n) as it may appear in an error line: control characters (C0, DEL, C1) and bytes that are not
 * UTF-8 become \xNN (\u00NN for C1), so that no file or argument can forge lines or send terminal
 * codes. Writes at most cap - 1 bytes and a NUL; returns the bytes written. Async-signal-safe. */
static size_t escape_text(char *out, size_t cap, const char *s, size_t n) {
    static const char hex[] = "0123456789ABCDEF";
    const unsigned char *b = (const unsigned char *)s;
    size_t k = 0;
    for (size_t i = 0; i < n && k + 7 < cap;) {
        unsigned cp;
        int r = utf8_check(b + i, n - i, &cp);
        if (r > 0 && cp >= 0x20 && cp != 0x7F && (cp < 0x80 || cp > 0x9F)) {
            for (int j = 0; j < r; j++) out[k++] = (char)b[i + j];
            i += (size_t)r;
            continue;
        }
        const char *esc = r > 0 && cp >= 0x80 ? "\\u00" : "\\x";
        unsigned v = r > 0 ? cp : b[i];
        while (*esc) out[k++] = *esc++;
        out[k++] = hex[v >> 4 & 15];
        out[k++] = hex[v & 15];
        i += r > 0 ? (size_t)r : 1;
    }
    out[k] = 0;
    return k;
}

/* The fuzz harnesses (tests/fuzz) define this to return to themselves instead. */
#ifndef NEMOH_DIE_EXIT
#define NEMOH_DIE_EXIT() exit(1)
#endif

/* Every user-facing failure ends here: one line on stderr (escaped: see escape_text), exit status 1. */
__attribute__((noreturn)) static void die(const char *fmt, ...) {
    char msg[2048], line[4 * sizeof msg];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    escape_text(line, sizeof line, msg, n < 0 ? 0 : (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    fprintf(stderr, "nemoh: %s\n", line);
    NEMOH_DIE_EXIT();
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) die("out of memory allocating %zu bytes", n);
    return p;
}

static char *xstrdup(const char *str) {
    char *p = strdup(str);
    if (!p) die("out of memory copying a %zu-byte string", strlen(str));
    return p;
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) die("out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

/* Flushes stdout and dies if any write to it failed (a full disk, a closed stdout, a broken pipe
 * with SIGPIPE ignored; with SIGPIPE as it comes, a broken pipe ends nemoh by the signal). */
static void check_stdout(void) {
    if (fflush(stdout) != 0 || ferror(stdout)) die("stdout: write failed: %s", strerror(errno));
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Reads a file into a NUL-terminated buffer with read() until EOF, so pipes, FIFOs, /dev/stdin and
 * /proc files read as they are; but never more than max + 1 bytes: *len > max says there was more.
 * Returns NULL if the file cannot be opened (errno says why); dies on a directory or a read error. */
static char *read_file(const char *path, size_t *len, size_t max) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) die("%s: cannot stat: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) die("%s: is a directory", path);
    size_t n = 0, cap = S_ISREG(st.st_mode) && (size_t)st.st_size <= max ? (size_t)st.st_size + 1 : max < 65536 ? max + 1 : 65536;
    char *buf = xmalloc(cap + 1);
    for (;;) {
        if (n == cap) {
            cap = cap > max / 2 ? max + 1 : 2 * cap;
            char *grown = realloc(buf, cap + 1);
            if (!grown) die("%s: out of memory reading %zu bytes", path, cap);
            buf = grown;
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) die("%s: read failed: %s", path, strerror(errno));
        n += (size_t)r;
        if (r == 0 || n > max) break;
    }
    close(fd);
    buf[n] = 0;
    *len = n;
    return buf;
}

/* A whole text file of at most max bytes (config.json, tokenizer.json, ...); NULL if it cannot be opened. */
static char *read_text(const char *path, size_t *len, size_t max) {
    char *text = read_file(path, len, max);
    if (text && *len > max) die("%s: larger than %zu bytes", path, max);
    return text;
}

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* ------------------------------------------------------------------------------------------------
 * Sharding: each rank's share of the model, as vLLM and sglang split it
 * ---------------------------------------------------------------------------------------------- */

/* Tensor-parallel sizes; returns NULL if n ranks can split the model, else the reason. */
static const char *shard_sizes(Shard *s, const Config *c, int rank, int n) {
    int has_m = has_kind(c, K_MAMBA), has_a = has_kind(c, K_ATTN), has_f = has_kind(c, K_MLP), has_e = has_kind(c, K_MOE);
    if (has_m && (c->m_heads % n || c->n_groups % n)) return "mamba heads and n_groups";
    if (has_a && (c->n_heads % n || (c->n_kv % n && n % c->n_kv))) return "attention heads (and kv heads, or be a multiple of them)";
    if (has_f && c->mlp % n) return "the MLP size";
    if (has_e && (c->moe % n || c->shared % n)) return "the routed and shared expert sizes";
    if (c->vocab % n) return "the vocabulary";
    memset(s, 0, sizeof *s);
    s->rank = rank;
    s->n = n;
    if (has_m) {
        s->m_heads = c->m_heads / n;
        s->groups = c->n_groups / n;
        s->d_inner = s->m_heads * c->m_hdim;
        s->conv = s->d_inner + 2 * s->groups * c->d_state;
        s->in_proj = s->d_inner + s->conv + s->m_heads;
    }
    if (has_a) {
        s->q = c->n_heads / n;
        s->q0 = rank * s->q;
        s->kv = c->n_kv >= n ? c->n_kv / n : 1;  /* more ranks than kv heads: replicate */
        s->kv0 = s->q0 / (c->n_heads / c->n_kv);
    }
    s->mlp = has_f ? c->mlp / n : 0;
    /* every rank holds every expert: 1/n of each one's up rows and down columns (vLLM's fused-MoE TP);
       the router and the latent projections are replicated */
    s->moe = has_e ? c->moe / n : 0;
    s->shared = has_e ? c->shared / n : 0;
    s->vocab = c->vocab / n;
    return NULL;
}

/* ------------------------------------------------------------------------------------------------
 * CPU backend: the plain-C reference, fp32 arithmetic on the stored weights (bf16 products on the
 * AMX tile unit where the build has one: exact products, fp32 sums)
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    int n;                      /* ranks */
    pthread_barrier_t bar;      /* all ranks meet here around every host all-reduce */
    float **pend;               /* [n] each rank's pending buffer, read by every rank */
    int **route;                /* [n] each rank's chosen experts, compared with rank 0's (MoE) */
    float *logits;              /* [logit_rows, vocab] gathered logits: rank r writes columns of its slice */
    int rows;                   /* rows of logits the last forward wrote; the sampler reads the last */
    int bad;                    /* where the residual stream first stopped being finite (rank 0
                                   watches): -1 nowhere yet, n_layers the embedding, else a layer */
} CpuShared;

typedef struct {
    float *res;                 /* [t_max, hidden] residual stream (identical on every rank) */
    float *x;                   /* [t_max, hidden] normed input of the current mixer */
    float *pend;                /* [t_max, hidden] partial sums the current layer still owes */
    float *sum;                 /* [t_max, hidden] scratch for the all-reduce */
    float *proj;                /* [t_max, proj_w] input projections: [z|x|B|C|dt], [q|k|v] or up */
    float *xbc;                 /* [t_max, conv] conv1d + SiLU output */
    float *y;                   /* [t_max, max(d_inner, q*head_dim)] mixer output before out_proj */
    float *att;                 /* [q heads, ctx] attention weights of one query, a row a head */
    float **conv;               /* [n_all] Mamba: [d_conv-1, conv] last inputs, oldest first */
    float **convw;              /* [n_all] Mamba: [d_conv, conv] the conv weights by tap, a token's channels in lanes */
    float **ssm;                /* [n_all] Mamba: [spec + 1, m_heads, m_hdim, d_state] fp32 states in slots:
                                   the state in slot at[l]; a forward run with r->keep leaves token t's in
                                   slot (at + t) % (spec + 1), so a rewind moves at[l] and copies nothing */
    int *at, *base;             /* [n_all] Mamba: the state's slot; the slot of the last keep forward's token 0 */
    float **k, **v;             /* [n_all] attention: [ctx, kv*head_dim] cache */
    float **keep;               /* [n_all] Mamba, with drafting: [spec, d_conv-1, conv] conv windows after
                                   each token but the last of a forward run with r->keep */
    float *eh;                  /* [t_max, 2 * hidden] MTP: [enorm(embed) ; hnorm(h)] */
    float *snap;                /* [SNAPSHOT_SLOTS, snap_n] saved conv windows + SSM states, made at first save */
    size_t snap_n;              /* floats of one snapshot: every Mamba layer's conv then ssm */
    int proj_w;                 /* columns of proj */
    /* mixture of experts; d = latent size, or hidden */
    int *route;                 /* [t_max, top_k] the experts each token chose */
    float *route_w;             /* [t_max, top_k] their weights */
    float *escore;              /* [2 * n_experts + n_group] one token's router scratch */
    float *ez;                  /* [t_max, d] the experts' input fc1_latent_proj(x) (latent MoE) */
    float *eacc;                /* [t_max, max(d, hidden)] routed sum, then the shared expert's output */
    float *ein, *eout;          /* [t_max, d] inputs and outputs of the tokens one expert serves */
    int *etok;                  /* [t_max] those tokens */
    float *ew;                  /* [t_max] their weights for that expert */
    int draft[SPEC_MAX];        /* the drafts made this step (cpu_draft) */
    int drafted;                /* ... the last one's index */
    int acc[SPEC_MAX + 2];      /* the last accept's n, t_0..t_{T-1} */
    int accepted;               /* 1: the next MTP pass fed no tokens reads t_0.. (else the last draft) */
} CpuState;

static int cpu_threads = 1;     /* OpenMP threads per rank: the cores shared among the ranks */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define NEMOH_AVX512
#define NEMOH_LANES
/* V16: 16 fp32 lanes, one AVX-512 register (a build with -march=native on such a machine), or two
 * AVX2 registers below; dot_lanes is written once over it. Without either, dot_groups decodes one
 * element at a time. */
typedef __m512 V16;
static inline V16 v_zero(void) { return _mm512_setzero_ps(); }
static inline V16 v_set(float f) { return _mm512_set1_ps(f); }
static inline V16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, V16 a) { _mm512_storeu_ps(p, a); }
static inline V16 v_fma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline V16 v_scale(V16 a, float s) { return _mm512_mul_ps(a, _mm512_set1_ps(s)); }
static inline float v_sum(V16 a, V16 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
static inline V16 v_bf16(const uint16_t *p) {   /* bf16 is the top half of an fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline V16 v_half(__m256i h) { return _mm512_cvtph_ps(h); }   /* 16 f16, exactly */
static inline __m128i bytes16(const uint8_t *p, int n) { return _mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p); }   /* n <= 16, zeros after */
static inline V16 v_nan_where(V16 a, __m128i m) { return _mm512_mask_mov_ps(a, (__mmask16)_mm_movemask_epi8(m), v_set(NAN)); }
/* E2M1 codes (an index's low four bits) to their values: a permutation of the 16 values. */
static inline V16 v_e2m1(__m128i n) { return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(n), _mm512_loadu_ps(e2m1_values)); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NEMOH_LANES
/* V16 as two AVX2 registers, lanes 0-7 and 8-15: most x86 CPUs without AVX-512. On one core of the
 * 2-core AMD EPYC, a build without AVX-512, 8192 x 384, dot_groups' arrays against these: bf16 1 token
 * 386 to 413 us against 146 to 154, 4 tokens 1,129 to 1,161 against 466 to 500; FP8 1 token 1,420
 * against 271 to 279; NVFP4 1 token 1,455 to 1,507 against 439 to 451. */
typedef struct { __m256 lo, hi; } V16;
static inline V16 v_zero(void) { return (V16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 v_set(float f) { return (V16){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline V16 v_load(const float *p) { return (V16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_store(float *p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
static inline V16 v_fma(V16 a, V16 b, V16 c) { return (V16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V16 v_scale(V16 a, float s) { __m256 m = _mm256_set1_ps(s); return (V16){_mm256_mul_ps(a.lo, m), _mm256_mul_ps(a.hi, m)}; }
static inline float v_sum(V16 a, V16 b) {
    __m256 v = _mm256_add_ps(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
static inline V16 v_bf16(const uint16_t *p) {
    __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8)));
    return (V16){_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
static inline V16 v_half(__m256i h) { return (V16){_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))}; }
static inline __m128i bytes16(const uint8_t *p, int n) {
    if (n == 16) return _mm_loadu_si128((const __m128i *)p);
    uint8_t b[16] = {0};
    for (int j = 0; j < n; j++) b[j] = p[j];
    return _mm_loadu_si128((const __m128i *)b);
}
static inline V16 v_nan_where(V16 a, __m128i m) {   /* m: a byte of 0xFF a lane */
    __m256 n = _mm256_set1_ps(NAN);
    return (V16){_mm256_blendv_ps(a.lo, n, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(m))),
                 _mm256_blendv_ps(a.hi, n, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(m, 8))))};
}
/* The magnitude by a permutation of 8 (an index's low three bits), the sign from bit 3. */
static inline V16 v_e2m1(__m128i n) {
    __m256 mag = _mm256_loadu_ps(e2m1_values);
    __m256i lo = _mm256_cvtepu8_epi32(n), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(n, 8)), sign = _mm256_set1_epi32((int)0x80000000);
    return (V16){_mm256_or_ps(_mm256_permutevar8x32_ps(mag, lo), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(lo, 28), sign))),
                 _mm256_or_ps(_mm256_permutevar8x32_ps(mag, hi), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(hi, 28), sign)))};
}
#endif

#ifdef NEMOH_LANES
/* 16 FP8 or NVFP4 elements as fp32, mat_at's values bit for bit.
 * FP8: an E4M3 code sign-extended to 16 bits and shifted left by 7 has its seven low bits under an
 * f16's exponent (bias 15 against 7) and its sign on top (the mask drops the sign's copy at bit 14):
 * the value times 2^-8, subnormals included; the hardware widens f16 to fp32 exactly. One product
 * by 2^8 * scale (exact: a power of two) rounds value * scale once, as mat_at does. The NaN codes
 * 0x7F and 0xFF come out finite: fp8_bytes makes them NaN, dot_lanes a row's sums (fewer steps a
 * weight: 1 token of a 4096 x 2048 product on one core of the 2-core AMD EPYC took 553 to 598 us
 * with NaN made in the lanes, 398 to 424 so). */
static inline V16 fp8_finite(__m128i bytes, float scale) {
    return v_scale(v_half(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16((short)0xBF80))), 256.0f * scale);
}
static inline V16 fp8_bytes(__m128i bytes, float scale) {
    __m128i low7 = _mm_set1_epi8(0x7F);
    return v_nan_where(fp8_finite(bytes, scale), _mm_cmpeq_epi8(_mm_and_si128(bytes, low7), low7));
}
/* fp8_finite of 16 codes at p; top: the largest of their seven low bits so far (0x7F: a NaN among them). */
static inline V16 fp8_lanes(const uint8_t *p, float scale, __m128i *top) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    *top = _mm_max_epu8(*top, _mm_and_si128(b, _mm_set1_epi8(0x7F)));
    return fp8_finite(b, scale);
}

/* NVFP4: 8 bytes, the 16 E2M1 codes in element order (low nibble first), times the block's scale.
 * v_e2m1 reads an index's low four bits only, so neither nibble needs masking: each byte, and each
 * byte shifted right by 4, goes as it is. */
static inline V16 nvfp4_lanes(const uint8_t *p, float sc) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return v_scale(v_e2m1(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4))), sc);
}
#endif

#ifndef NEMOH_LANES
/* e4m3_to_f32 of every byte, made once (pthread_once: the ranks' threads share it). */
static float fp8_tab[256];
static void fp8_tab_fill(void) { for (int b = 0; b < 256; b++) fp8_tab[b] = e4m3_to_f32((uint8_t)b); }
static pthread_once_t fp8_once = PTHREAD_ONCE_INIT;

/* acc[t][j] = sum W[i][k + j] * x[t][k + j] over k = 0, 16, .. < n16, j < 16, t < NT: each group of 16
 * weights dequantized once (as mat_at() does) for NT tokens, dotted in 16 lanes (a build with
 * neither AVX-512 nor AVX2; dot_lanes below otherwise). Compiled once for each NT (dot_groupsRNT, not inlined) and each
 * format, the lanes of each in arrays of 8 of its own:
 * so gcc keeps them in registers. With one [4][16] array for every format, inlined into dot_rows,
 * it kept them on the stack, a store and a load a group: 4 tokens of an 8192 x 384 bf16 product took
 * 760 to 800 us on one core of the 2-core Xeon, 550 us now (1 token: 300 us either way;
 * bench/cpu_matmul.c). */
#define DOT_GROUPS(LOAD)                                                                          \
    {                                                                                             \
        float lo[4][8] = {{0}}, hi[4][8] = {{0}};                                                 \
        for (int k = 0; k < n16; k += 16) {                                                       \
            float w[16];                                                                          \
            LOAD;                                                                                 \
            for (int t = 0; t < NT; t++) {                                                        \
                for (int j = 0; j < 8; j++) lo[t][j] += w[j] * x[(size_t)t * ldx + k + j];        \
                for (int j = 0; j < 8; j++) hi[t][j] += w[8 + j] * x[(size_t)t * ldx + k + 8 + j]; \
            }                                                                                     \
        }                                                                                         \
        for (int t = 0; t < 4; t++) {                                                             \
            memcpy(acc[t], lo[t], sizeof lo[t]);                                                  \
            memcpy(acc[t] + 8, hi[t], sizeof hi[t]);                                              \
        }                                                                                         \
    }
static inline __attribute__((always_inline)) void dot_groups(const Mat *W, size_t i, const float *restrict x, size_t ldx, int n16,
                                                             const int NT, float acc[4][16]) {
    if (W->dtype == DT_F32) {
        const float *p = (const float *)W->data + i * W->ld;
        DOT_GROUPS(memcpy(w, p + k, sizeof w))
    } else if (W->dtype == DT_BF16) {   /* bf16 is the top half of an fp32 (bf16_to_f32), 16 at once */
        const uint16_t *p = (const uint16_t *)W->data + i * W->ld;
        DOT_GROUPS(uint32_t u[16]; for (int j = 0; j < 16; j++) u[j] = (uint32_t)p[k + j] << 16; memcpy(w, u, sizeof w))
    } else if (W->dtype == DT_FP8) {
        const uint8_t *p = (const uint8_t *)W->data + i * W->ld;
        DOT_GROUPS(for (int j = 0; j < 16; j++) w[j] = fp8_tab[p[k + j]] * W->scale)
    } else if (W->dtype == DT_NVFP4) {   /* two elements a byte, a block scale per 16 */
        const uint8_t *p = (const uint8_t *)W->data + i * W->ld / 2;
        DOT_GROUPS(float sc = nvfp4_block_scale(W, i, (size_t)k);
                   for (int j = 0; j < 16; j++) w[j] = e2m1_to_f32(p[k / 2 + j / 2] >> 4 * (j & 1)) * sc)
    }
}
#undef DOT_GROUPS
#endif

#ifdef NEMOH_LANES
/* dot_groups in V16 registers for R rows i0 .. i0 + R - 1 (R <= 2): 16 weights of a row a register
 * (v_bf16, fp8_lanes, nvfp4_lanes), registers of sums a row and token, each x read once for both
 * rows; the sum of their lanes then by a fixed tree (the same for every T and R). With AVX-512, two
 * registers of sums, the even and the odd groups: one chain of FMAs waits out each FMA's latency,
 * which bound one token's product (1 token of a 4096 x 2048 bf16 product on one core of the 2-core AMD
 * EPYC: 513 to 645 us, an FMA every 4 cycles; two chains, 345 to 407); with AVX2 a V16's two halves
 * are two chains already, and 16 registers hold no more.
 * From dot_groups' arrays gcc made 8 scalar sums of hi[] for one token. Two rows at a time ask for the
 * same columns of two rows PREFETCH_BYTES or more ahead: 4 tokens of a 16384 x 2048 bf16 product on
 * both cores took 3.66 ms a row at a time, 2.07 two at a time asking for 1 KB ahead in each row, 1.44
 * asking for the next rows; of 32768 x 768, 1.44, 1.44 and 1.05 (best of five). Rows of 768 bytes
 * want more than the next two: 3 tokens of a 65536 x 384 bf16 product (50 MB) on both cores of the
 * AMD EPYC took 1.73 ms asking 2 rows ahead, 1.22 at 4 KB, 1.02 at 8 KB, 1.10 at 16 KB. The default
 * model's lm_head (8192 x 384) for 1 and 4 tokens on one core of the 2-core AMD EPYC (no AMX;
 * bench/cpu_matmul.c, the better of two runs): bf16 457 and 447 us with dot_groups, 163 and 259 in
 * AVX-512 registers; FP8 981 and 1068 (a table read a byte), 268 and 400; NVFP4 1095 and 1264, 382
 * and 436. */
enum { PREFETCH_BYTES = 8192 };
#ifdef NEMOH_AVX512
#define ODD u
#else
#define ODD s
#endif
#define DOT_STEP(DEC, ACC)                                                   \
    {                                                                        \
        V16 w[2];                                                            \
        for (int r = 0; r < R && R > 1; r++) _mm_prefetch(p[r] + ahead + k * bytes2 / 2, _MM_HINT_T0); \
        for (int r = 0; r < R; r++) w[r] = DEC(r);                           \
        for (int t = 0; t < NT; t++) {                                       \
            V16 xt = v_load(x + (size_t)t * ldx + k);                        \
            for (int r = 0; r < R; r++) ACC[r][t] = v_fma(w[r], xt, ACC[r][t]); \
        }                                                                    \
    }
#define DOT_LANES(DEC, K0, K1)                                               \
    for (int k2 = K0; k2 < K1; k2 += 32) {                                   \
        { int k = k2; DOT_STEP(DEC, s) }                                     \
        if (k2 + 16 < K1) { int k = k2 + 16; DOT_STEP(DEC, ODD) }            \
    }
static inline __attribute__((always_inline)) void dot_lanes(const Mat *W, size_t i0, const int R, const float *restrict x, size_t ldx,
                                                            int n16, const int NT, float sum[2][4]) {
    const size_t i[2] = {i0, i0 + 1};
    V16 s[2][4], u[2][4];   /* [row][token] sums of the even groups of 16, of the odd ones (AVX-512) */
    for (int t = 0; t < 4; t++) s[0][t] = s[1][t] = u[0][t] = u[1][t] = v_zero();
    const char *p[2];
    size_t bytes2 = W->dtype == DT_F32 ? 8 : W->dtype == DT_BF16 ? 4 : W->dtype == DT_FP8 ? 2 : 1;   /* twice an element's */
    size_t row_bytes = W->ld * bytes2 / 2, ahead = row_bytes * (PREFETCH_BYTES / row_bytes < 2 ? 2 : PREFETCH_BYTES / row_bytes);
    for (int r = 0; r < R; r++) p[r] = (const char *)W->data + i[r] * row_bytes;
    if (W->dtype == DT_F32) {
#define F32_16(r) v_load((const float *)p[r] + k)
        DOT_LANES(F32_16, 0, n16)
    } else if (W->dtype == DT_BF16) {
#define BF16_16(r) v_bf16((const uint16_t *)p[r] + k)
        DOT_LANES(BF16_16, 0, n16)
    } else if (W->dtype == DT_FP8) {
        __m128i top[2] = {_mm_setzero_si128(), _mm_setzero_si128()}, low7 = _mm_set1_epi8(0x7F);
#define FP8_16(r) fp8_lanes((const uint8_t *)p[r] + k, W->scale, &top[r])
        DOT_LANES(FP8_16, 0, n16)
        for (int r = 0; r < R; r++)   /* a NaN weight: the row's sums are NaN, as they would be in the lanes */
            if (_mm_movemask_epi8(_mm_cmpeq_epi8(top[r], low7)))
                for (int t = 0; t < NT; t++) s[r][t] = u[r][t] = v_set(NAN);
    } else if (W->dtype == DT_NVFP4) {
        /* the block scales of 256 columns at a time (fp8_bytes: e4m3 times the tensor's scale,
           nvfp4_block_scale's values), then one a group */
        for (int k0 = 0; k0 < n16; k0 += 256) {
            int k1 = k0 + 256 < n16 ? k0 + 256 : n16;
            float bsc[2][16];
            for (int r = 0; r < R; r++) v_store(bsc[r], fp8_bytes(bytes16(W->bs + i[r] * W->bld + k0 / 16, (k1 - k0) / 16), W->scale));
#define NVFP4_16(r) nvfp4_lanes((const uint8_t *)p[r] + k / 2, bsc[r][(k - k0) / 16])
            DOT_LANES(NVFP4_16, k0, k1)
        }
    }
#undef F32_16
#undef BF16_16
#undef FP8_16
#undef NVFP4_16
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) sum[r][t] = v_sum(s[r][t], u[r][t]);
}
#undef DOT_LANES
#undef DOT_STEP
#undef ODD
#endif

/* sum[j][t]: the first n16 columns of row i0 + j (j < nr, R rows at a time, R <= 2) dotted with
 * x[t * ldx] (t < NT), the lanes of dot_groups added in order (dot_lanes: its registers' sums);
 * compiled once for each R and NT (not inlined), a call for DOT_ROWS rows: a call a row cost the
 * default model's lm_head (8192 x 384, 1 token, one core of the 2-core AMD EPYC) 142 to 153 us
 * against 122 to 127. */
enum { DOT_ROWS = 16 };
#define DOT_GROUPS_NT(R, NT)                                                                                             \
    static __attribute__((noinline)) void dot_groups##R##NT(const Mat *W, size_t i0, int nr, const float *x, size_t ldx, \
                                                            int n16, float sum[][4]) {                                   \
        for (int j = 0; j < nr; j += R) {                                                                                \
            size_t i = i0 + (size_t)j;                                                                                   \
            float(*sm)[4] = sum + j;                                                                                     \
            DOT_ROWS_NT(R, NT)                                                                                           \
        }                                                                                                                \
    }
#ifdef NEMOH_LANES
#define DOT_ROWS_NT(R, NT) dot_lanes(W, i, R, x, ldx, n16, NT, sm);
#else
#define DOT_ROWS_NT(R, NT)                                                     \
    for (int r = 0; r < R; r++) {                                              \
        float acc[4][16] = {{0}};                                              \
        dot_groups(W, i + (size_t)r, x, ldx, n16, NT, acc);                    \
        for (int t = 0; t < NT; t++) {                                         \
            sm[r][t] = 0;                                                      \
            for (int j = 0; j < 16; j++) sm[r][t] += acc[t][j];                \
        }                                                                      \
    }
#endif
DOT_GROUPS_NT(1, 1)
DOT_GROUPS_NT(1, 2)
DOT_GROUPS_NT(1, 3)
DOT_GROUPS_NT(1, 4)
DOT_GROUPS_NT(2, 1)
DOT_GROUPS_NT(2, 2)
DOT_GROUPS_NT(2, 3)
DOT_GROUPS_NT(2, 4)
#undef DOT_GROUPS_NT
#undef DOT_ROWS_NT

/* out[t * ldo + r] = row i + r of W dotted with x[t * ldx], for r < n (n <= DOT_ROWS) and t < T: sum_k
 * W[i + r][k] * x[t][k] in fp32, the groups of 16 in lanes (dot_groupsRNT), then the elements past
 * them: the same sums for every T and pairing, so a drafting step's verify forward gives each token
 * what a forward of its own would. Tokens go 4 at a time (the weights read once for them), rows i + 2j
 * and i + 2j + 1 together for several tokens. F16 goes element by element. */
static void dot_rows(const Mat *W, int i, int n, const float *x, size_t ldx, int T, float *out, size_t ldo) {
    int cols = W->cols, n16 = W->dtype == DT_F16 ? 0 : W->dtype == DT_NVFP4 ? cols : cols - cols % 16;
    int R = T > 1 ? 2 : 1, paired = n - n % R;
#ifndef NEMOH_LANES
    if (W->dtype == DT_FP8) pthread_once(&fp8_once, fp8_tab_fill);
#endif
    for (int t0 = 0; t0 < T; t0 += 4) {
        int nt = T - t0 < 4 ? T - t0 : 4;
        float sum[DOT_ROWS][4];
        const float *xt = x + (size_t)t0 * ldx;
        static void (*const groups[2][4])(const Mat *, size_t, int, const float *, size_t, int, float[][4]) = {
            {dot_groups11, dot_groups12, dot_groups13, dot_groups14}, {dot_groups21, dot_groups22, dot_groups23, dot_groups24}};
        if (paired) groups[R - 1][nt - 1](W, (size_t)i, paired, xt, ldx, n16, sum);
        if (paired < n) groups[0][nt - 1](W, (size_t)(i + paired), 1, xt, ldx, n16, sum + paired);
        for (int r = 0; r < n; r++)
            for (int t = 0; t < nt; t++) {
                float s = sum[r][t];
                for (int k = n16; k < cols; k++) s += mat_at(W, (size_t)(i + r), (size_t)k) * xt[(size_t)t * ldx + k];
                out[(size_t)(t0 + t) * ldo + r] = s;
            }
    }
}

/* Row i of W dotted with x (the router's). */
static float dot_row(const Mat *W, int i, const float *x) {
    float s;
    dot_rows(W, i, 1, x, 0, 1, &s, 0);
    return s;
}

#define MATMUL_MAX 5            /* matrices one matmul_n takes: Mamba's in_proj segments */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#define NEMOH_AMX
/* AMX, the tile unit of Intel Xeons since Sapphire Rapids, for bf16 products (a build with
 * -march=native on such a machine). dot_rows pays arithmetic for every token: 4 tokens of the
 * default model's lm_head cost 1.8 times one. One tile instruction does 16 rows x 32 columns for 16
 * outputs, so a product of 5 tokens costs what one token's does, the weights' bytes: a drafting
 * step's verify forward and a prompt get cheap. The unit multiplies bf16 by bf16 only, so each x is
 * split exactly into three bf16 parts, x = hi + mid + lo (fp32's 24 mantissa bits, 8 each, by
 * truncation; parts below fp32's normal range flush to 0): each product of a bf16 weight and a part is
 * exact in fp32, and the unit sums them in fp32 in its own fixed order, each part in a column of its
 * own, the three added at the end. A column's sum depends on that column alone: the same for every T
 * (the rounding differs from dot_rows', by about as much as dot_rows' differs from float64). */
#define AMX_TOK 5               /* tokens one tile of x holds: 16 columns, 3 parts each */
#define AMX_PACK (1 << 19)      /* uint16 a thread packs x into: 16 * K for every AMX_TOK tokens */

typedef struct {                /* ldtilecfg's 64 bytes (palette 1) */
    uint8_t palette, start_row, pad[14];
    uint16_t colsb[16];         /* bytes of a row of each tile */
    uint8_t rows[16];           /* rows of each tile */
} AmxTiles;

static _Thread_local uint16_t amx_x[AMX_PACK];   /* [groups][K32 / 32][16 pairs][16 columns * 2] parts of x */
static int amx_granted;                          /* Linux gave this process the tile registers */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
/* Linux gives a process the tiles' 8 KB of state only when asked: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) */
static void amx_ask(void) { amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
/* Whether this process may use the tiles (asked once). */
static int amx_on(void) {
    pthread_once(&amx_once, amx_ask);
    return amx_granted;
}

/* bf16 products of 32768 weights or more (on the 2-core Xeon, 256 x 128 and up run faster here, a
 * product of 96 x 80 slower: the tiles' setup costs about a microsecond). */
static int amx_fits(const Mat *W) {
    return amx_on() && W->dtype == DT_BF16 && W->rows >= 16 && W->cols >= 32 && (size_t)W->rows * W->cols >= 32768 &&
           (size_t)(W->cols - W->cols % 32) * 16 <= AMX_PACK;
}

/* v = hi + mid + lo, each part's top 16 bits (bf16) in b: hi = v's top 16 bits, mid the top 16 bits of
 * v - hi, lo the rest (exact) */
static inline void amx_split(float v, uint32_t b[3]) {
    uint32_t u;
    float part;
    memcpy(&u, &v, 4), b[0] = u >> 16, u &= 0xFFFF0000u, memcpy(&part, &u, 4);
    v -= part;
    memcpy(&u, &v, 4), b[1] = u >> 16, u &= 0xFFFF0000u, memcpy(&part, &u, 4);
    v -= part;
    memcpy(&u, &v, 4), b[2] = u >> 16;
}

/* x in the tile layout: token t of a group is column t of hi, 5 + t of mid, 10 + t of lo; a tile row is
 * the pair of x's columns 2q, 2q + 1, a 32-bit word a tile column. */
static void amx_pack(const float *x, size_t ldx, int T, int K32) {
    /* every thread packs x for itself (no barrier; x is small beside W); columns no token fills keep
       what they held: they only feed sums that are not read */
    uint32_t *w = (uint32_t *)amx_x;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * ldx;
        uint32_t *o = w + (size_t)(t / AMX_TOK) * K32 * 8 + t % AMX_TOK;
        for (int q = 0; q < K32 / 2; q++) {
            uint32_t a[3], b[3];
            amx_split(xt[2 * q], a);
            amx_split(xt[2 * q + 1], b);
            for (int j = 0; j < 3; j++) o[16 * q + j * AMX_TOK] = a[j] | b[j] << 16;
        }
    }
}

/* matmul_n() on the tile unit: the rows of every matrix that fits 16 at a time, tokens AMX_TOK at a
 * time; the rest (a matrix's last rows % 16, a matrix that does not fit) by dot_rows. */
static void matmul_amx(float *out, int ldo, const float *x, int ldx, int T, const Mat *W, int n) {
    int K = W[0].cols, K32 = K - K % 32, chunk = AMX_PACK / (K32 * 16) * AMX_TOK, blocks = 0, rest = 0;
    int first[MATMUL_MAX];   /* matrix m's rows from first[m] on go by dot_rows */
    for (int m = 0; m < n; m++) {
        first[m] = amx_fits(&W[m]) ? W[m].rows - W[m].rows % 16 : 0;
        blocks += first[m] / 16, rest += W[m].rows - first[m];
    }
    AmxTiles cfg = {.palette = 1};
    for (int j = 0; j < 3; j++) cfg.rows[j] = 16, cfg.colsb[j] = 64;   /* 0: 16 rows of W x 32 columns (bf16);
        1: x's same 32 columns, 16 pairs x 16 columns; 2: the sums, 16 rows x 16 columns (fp32) */
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int nt = T - t0 < chunk ? T - t0 : chunk;
        const float *xt = x + (size_t)t0 * ldx;
        float *ot = out + (size_t)t0 * ldo;
#pragma omp parallel num_threads(cpu_threads)
        {
            amx_pack(xt, (size_t)ldx, nt, K32);
            _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
            for (int b = 0; b < blocks; b++) {
                int m = 0, i = 16 * b, off = 0;   /* block b: rows i.. of matrix m, out's columns off + i.. */
                for (; i >= first[m]; m++) i -= first[m], off += W[m].rows;
                const uint16_t *w = W[m].data;
                for (int g = 0; g * AMX_TOK < nt; g++) {
                    float c[16][16];
                    _tile_zero(2);
                    for (int k = 0; k < K32; k += 32) {
                        _tile_loadd(0, w + (size_t)i * W[m].ld + k, (long)W[m].ld * 2);
                        _tile_loadd(1, amx_x + (size_t)g * K32 * 16 + (size_t)k * 16, 64);
                        _tile_dpbf16ps(2, 0, 1);
                    }
                    _tile_stored(2, c, 64);
                    for (int r = 0; r < 16; r++)
                        for (int t = g * AMX_TOK; t < nt && t < (g + 1) * AMX_TOK; t++) {
                            int j = t % AMX_TOK;
                            float s = c[r][2 * AMX_TOK + j] + c[r][AMX_TOK + j] + c[r][j];
                            for (int k = K32; k < K; k++) s += bf16_to_f32(w[(size_t)(i + r) * W[m].ld + k]) * xt[(size_t)t * ldx + k];
                            ot[(size_t)t * ldo + off + i + r] = s;
                        }
                }
            }
            _tile_release();
#pragma omp for schedule(static)
            for (int q = 0; q < rest; q++) {
                int m = 0, i = q, off = 0;
                for (; i >= W[m].rows - first[m]; m++) i -= W[m].rows - first[m], off += W[m].rows;
                dot_rows(&W[m], first[m] + i, 1, xt, (size_t)ldx, nt, ot + off + first[m] + i, (size_t)ldo);
            }
        }
    }
}
#endif

static int row_blocks(int rows) { return (rows + DOT_ROWS - 1) / DOT_ROWS; }

/* out[t][i] = sum_k W[i][k] * x[t][k] for T rows of x, for n matrices of the same input at once, matrix
 * m's rows in out's columns after those of the matrices before it (one pass over the rank's threads:
 * Mamba's in_proj segments, attention's q, k, v); blocks of DOT_ROWS rows split over the threads. */
static void matmul_n(float *out, int ldo, const float *x, int ldx, int T, const Mat *W, int n) {
#ifdef NEMOH_AMX
    for (int m = 0; m < n; m++)
        if (amx_fits(&W[m])) {
            matmul_amx(out, ldo, x, ldx, T, W, n);
            return;
        }
#endif
    int blocks = 0;
    for (int m = 0; m < n; m++) blocks += row_blocks(W[m].rows);
#pragma omp parallel for num_threads(cpu_threads) schedule(static)
    for (int b = 0; b < blocks; b++) {   /* DOT_ROWS rows of a matrix */
        int m = 0, i = b, q = 0;
        for (; i >= row_blocks(W[m].rows); m++) i -= row_blocks(W[m].rows), q += W[m].rows;
        i *= DOT_ROWS;
        dot_rows(&W[m], i, W[m].rows - i < DOT_ROWS ? W[m].rows - i : DOT_ROWS, x, (size_t)ldx, T, out + q + i, (size_t)ldo);
    }
}

static void matmul(float *out, int ldo, const float *x, int ldx, int T, const Mat *W) { matmul_n(out, ldo, x, ldx, T, W, 1); }

/* sum a[i] * b[i] over n elements in fp32: in 8 lanes (a float sum in order is a chain the compiler
 * cannot vectorize), then the rest, then the lanes */
static float dot(const float *a, const float *b, int n) {
    float lane[8] = {0}, s = 0;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += a[i + j] * b[i + j];
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 8; j++) s += lane[j];
    return s;
}

/* out = x * rsqrt(mean(x^2) + eps) * w over n elements */
static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    float ss = dot(x, x, n);
    float scale = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

static void cpu_init(Rank *r) {
    const Config *c = r->c;
    const Shard *s = &r->s;
    CpuState *st = xcalloc(1, sizeof *st);
    size_t hidden = (size_t)c->hidden, T = (size_t)r->t_max;
    st->proj_w = proj_width(c, s);
    int yw = y_width(c, s);
    st->res = xcalloc(T * hidden, sizeof(float));
    st->x = xcalloc(T * hidden, sizeof(float));
    st->pend = xcalloc(T * hidden, sizeof(float));
    st->sum = xcalloc(T * hidden, sizeof(float));
    st->proj = xcalloc(T * (size_t)st->proj_w, sizeof(float));
    st->xbc = xcalloc(T * (size_t)(s->conv ? s->conv : 1), sizeof(float));
    st->y = xcalloc(T * (size_t)(yw ? yw : 1), sizeof(float));
    st->att = xcalloc((size_t)(s->q ? s->q : 1) * (size_t)r->ctx, sizeof(float));
    size_t nl = (size_t)n_all(c), nc = (size_t)s->conv * (size_t)(c->d_conv - 1), ns = (size_t)s->d_inner * (size_t)c->d_state;
    st->conv = xcalloc(nl, sizeof(float *));
    st->convw = xcalloc(nl, sizeof(float *));
    st->ssm = xcalloc(nl, sizeof(float *));
    st->at = xcalloc(nl, sizeof(int));
    st->base = xcalloc(nl, sizeof(int));
    st->k = xcalloc(nl, sizeof(float *));
    st->v = xcalloc(nl, sizeof(float *));
    st->keep = xcalloc(nl, sizeof(float *));
    if (c->n_mtp) st->eh = xcalloc(T * 2 * hidden, sizeof(float));
    for (int l = 0; l < n_all(c); l++) {
        if (c->kind[l] == K_MAMBA) {
            st->conv[l] = xcalloc(nc, sizeof(float));
            st->convw[l] = xcalloc((size_t)c->d_conv * (size_t)s->conv, sizeof(float));
            for (int ch = 0; ch < s->conv; ch++)
                for (int j = 0; j < c->d_conv; j++) st->convw[l][(size_t)j * s->conv + ch] = r->w.layer[l].conv_w[(size_t)ch * c->d_conv + j];
            st->ssm[l] = xcalloc((size_t)(r->spec + 1) * ns, sizeof(float));
            if (r->spec) st->keep[l] = xcalloc((size_t)r->spec * nc, sizeof(float));
        } else if (c->kind[l] == K_ATTN) {
            st->k[l] = xcalloc((size_t)r->ctx * (size_t)(s->kv * c->head_dim), sizeof(float));
            st->v[l] = xcalloc((size_t)r->ctx * (size_t)(s->kv * c->head_dim), sizeof(float));
        }
    }
    if (has_kind(c, K_MOE)) {
        size_t d = (size_t)(c->latent ? c->latent : c->hidden), K = (size_t)c->top_k;
        st->route = xcalloc(T * K, sizeof(int));
        st->route_w = xcalloc(T * K, sizeof(float));
        st->escore = xcalloc(2 * (size_t)c->n_experts + (size_t)c->n_group, sizeof(float));
        st->ez = xcalloc(T * d, sizeof(float));
        st->eacc = xcalloc(T * (d > hidden ? d : hidden), sizeof(float));
        st->ein = xcalloc(T * d, sizeof(float));
        st->eout = xcalloc(T * d, sizeof(float));
        st->etok = xcalloc(T, sizeof(int));
        st->ew = xcalloc(T, sizeof(float));
    }
    r->st = st;
    CpuShared *sh = r->sh;
    sh->pend[s->rank] = st->pend;
    sh->route[s->rank] = st->route;
}

static void cpu_free(Rank *r) {
    CpuState *st = r->st;
    for (int l = 0; l < n_all(r->c); l++) { free(st->conv[l]); free(st->convw[l]); free(st->ssm[l]); free(st->k[l]); free(st->v[l]); free(st->keep[l]); }
    free(st->conv); free(st->convw); free(st->ssm); free(st->k); free(st->v); free(st->keep); free(st->at); free(st->base); free(st->eh);
    free(st->res); free(st->x); free(st->pend); free(st->sum); free(st->proj); free(st->xbc); free(st->y);
    free(st->att); free(st->snap);
    free(st->route); free(st->route_w); free(st->escore); free(st->ez); free(st->eacc); free(st->ein); free(st->eout);
    free(st->etok); free(st->ew);
    free(st);
    r->st = NULL;
}

/* residual[t] = embedding[tok[t]] */
static void cpu_embed(Rank *r, const int *tok, int T) {
    CpuState *st = r->st;
    int hidden = r->c->hidden;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < hidden; i++) st->res[(size_t)t * hidden + i] = mat_at(&r->w.embed, (size_t)tok[t], (size_t)i);
}

/* sum = pend_0 + pend_1 + ... in rank order, so every rank gets bit-identical sums; returns sum (at
 * one rank, pend_0 itself). The barriers: before, every rank has written its partial sums; after,
 * none overwrites them while others read. */
static const float *host_allreduce(Rank *r, float *sum, int T) {
    CpuShared *sh = r->sh;
    size_t n = (size_t)T * r->c->hidden;
    if (sh->n == 1) return sh->pend[0];   /* alone: the sum is what this rank owes */
    pthread_barrier_wait(&sh->bar);
    memcpy(sum, sh->pend[0], n * sizeof(float));
    for (int k = 1; k < sh->n; k++)
        for (size_t i = 0; i < n; i++) sum[i] += sh->pend[k][i];
    pthread_barrier_wait(&sh->bar);
    return sum;
}

static void cpu_allreduce(Rank *r, int T) {
    CpuState *st = r->st;
    const float *sum = host_allreduce(r, st->sum, T);
    if (sum != st->pend) memcpy(st->pend, sum, (size_t)T * r->c->hidden * sizeof(float));
}

static void cpu_norm(Rank *r, int l, int how, int T) {
    CpuState *st = r->st;
    int hidden = r->c->hidden;
    const float *w = l == NORM_F ? r->w.norm_f : l == NORM_MTP_F ? r->w.mtp_norm : r->w.layer[l].norm;
    const float *add = how == NORM_PLAIN ? NULL : st->pend;
    if (how == NORM_FUSED) add = host_allreduce(r, st->sum, T);   /* the deferred all-reduce, then add + norm */
    CpuShared *sh = r->sh;
    for (int t = 0; t < T; t++) {
        float *res = st->res + (size_t)t * hidden;
        if (add) for (int i = 0; i < hidden; i++) res[i] += add[(size_t)t * hidden + i];
        rmsnorm(st->x + (size_t)t * hidden, res, w, hidden, r->c->eps);
        /* the first non-finite residual names the layer whose output was just added (the sampler
           reports it: NaN or Inf weights otherwise decode as garbage); the MTP block's own are
           the draft's concern: a non-finite draft is no draft */
        for (int i = 0; sh->bad < 0 && r->s.rank == 0 && r->pass == PASS_MAIN && i < hidden; i++)
            if (!isfinite(res[i])) sh->bad = how == NORM_PLAIN ? r->c->n_layers : l == NORM_F ? r->c->n_layers - 1 : l - 1;
    }
}

/* One row of a head's state, N wide: So = dA * Si + dtx * B (So is Si, in place, or another slot);
 * returns So.C. With AVX-512, a register of 16 sums: on the 2-core AMD EPYC the default model's
 * scan took 15-17 us a layer and token through the compiler's loops (the sum in 8 lanes, a chain), 10
 * here; a 3-token verify forward's 60, 30-37. */
static inline float scan_row(float *So, const float *Si, const float *B, const float *C, float dA, float dtx, int N) {
#ifdef NEMOH_AVX512
    if (N % 16 == 0) {
        __m512 a = _mm512_set1_ps(dA), d = _mm512_set1_ps(dtx), acc = _mm512_setzero_ps();
        for (int n = 0; n < N; n += 16) {
            __m512 v = _mm512_fmadd_ps(a, _mm512_loadu_ps(Si + n), _mm512_mul_ps(d, _mm512_loadu_ps(B + n)));
            _mm512_storeu_ps(So + n, v);
            acc = _mm512_fmadd_ps(v, _mm512_loadu_ps(C + n), acc);
        }
        return _mm512_reduce_add_ps(acc);
    }
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC ivdep   /* So is Si (in place) or another slot: gcc's overlap check sent in place to scalar code */
#endif
    for (int n = 0; n < N; n++) So[n] = dA * Si[n] + dtx * B[n];
    return dot(So, C, N);
}

/* Mamba2 mixer over T tokens at positions pos.. (the state carries everything before pos). */
static void cpu_mamba(Rank *r, int l, int T, int pos) {
    (void)pos;
    const Config *c = r->c;
    const Shard *s = &r->s;
    const Layer *L = &r->w.layer[l];
    CpuState *st = r->st;
    int hidden = c->hidden, di = s->d_inner, cv = s->conv, in = s->in_proj, K = c->d_conv;
    int m_heads = s->m_heads, hdim = c->m_hdim, N = c->d_state, groups = s->groups, gsize = di / groups;
    size_t nc = (size_t)cv * (size_t)(K - 1), ns = (size_t)di * N;

    /* [z | x | B | C | dt] = in_proj(x), each segment from its own row slice */
    matmul_n(st->proj, in, st->x, hidden, T, L->in_proj, 5);

    /* xbc[t] = silu(bias + sum_j w[j] * in[t - (K-1) + j]): causal depthwise conv over x|B|C, a token
     * at a time with its channels in lanes; the window of the last K - 1 inputs then shifts by one */
    float *win = st->conv[l];
    const float *w = st->convw[l];
    for (int t = 0; t < T; t++) {
        const float *in_t = st->proj + (size_t)t * in + di;
        float *out = st->xbc + (size_t)t * cv;
        memcpy(out, L->conv_b, (size_t)cv * sizeof(float));
        for (int j = 0; j < K - 1; j++)
            for (int ch = 0; ch < cv; ch++) out[ch] += w[(size_t)j * cv + ch] * win[(size_t)j * cv + ch];
        for (int ch = 0; ch < cv; ch++) out[ch] = silu(out[ch] + w[(size_t)(K - 1) * cv + ch] * in_t[ch]);
        if (K > 1) {
            memmove(win, win + cv, (size_t)(K - 2) * cv * sizeof(float));
            memcpy(win + (size_t)(K - 2) * cv, in_t, (size_t)cv * sizeof(float));
        }
        if (r->keep && t < T - 1) memcpy(st->keep[l] + (size_t)t * nc, win, nc * sizeof(float));
    }

    /* the selective scan, per head h of group g = h / (heads per group):
     * dt = softplus(dt + dt_bias); S = exp(dt*A) * S + dt * x (x) B; y = S.C + D * x
     * The heads are independent: the rank's threads take whole heads, each through every step. Token t
     * reads the state from the slot token t - 1 wrote and writes its own, slot at + t with r->keep (a
     * forward of at most spec + 1 tokens), else the same slot again. */
    int slots = r->spec + 1, at = st->at[l];
#pragma omp parallel for num_threads(cpu_threads) schedule(static)
    for (int h = 0; h < m_heads; h++) {
        int g = h / (m_heads / groups);
        size_t hs = (size_t)h * hdim * N;   /* the head's state: [hdim, N] */
        for (int t = 0; t < T; t++) {
            const float *xt = st->xbc + (size_t)t * cv, *Bt = xt + di, *Ct = Bt + groups * N;
            float dt = softplus(st->proj[(size_t)t * in + di + cv + h] + L->dt_bias[h]);
            float dA = expf(dt * L->A[h]);
            const float *Sin = st->ssm[l] + (size_t)(r->keep ? (at + (t ? t - 1 : 0)) % slots : at) * ns + hs;
            float *Sout = st->ssm[l] + (size_t)(r->keep ? (at + t) % slots : at) * ns + hs;
            for (int p = 0; p < hdim; p++) {
                float xv = xt[h * hdim + p];
                st->y[(size_t)t * di + h * hdim + p] =
                    scan_row(Sout + (size_t)p * N, Sin + (size_t)p * N, Bt + g * N, Ct + g * N, dA, dt * xv, N) + L->D[h] * xv;
            }
        }
    }
    if (r->keep) st->base[l] = at, st->at[l] = (at + T - 1) % slots;

    /* u = y * silu(z), then RMSNorm over each group of d_inner/groups channels, times norm.weight */
    for (int t = 0; t < T; t++) {
        float *y = st->y + (size_t)t * di;
        const float *z = st->proj + (size_t)t * in;
        for (int i = 0; i < di; i++) y[i] *= silu(z[i]);
        for (int g = 0; g < groups; g++) rmsnorm(y + g * gsize, y + g * gsize, L->gnorm + g * gsize, gsize, c->eps);
    }
    matmul(st->pend, hidden, st->y, di, T, &L->out);  /* row-parallel: partial sums, reduced later */
}

/* Causal GQA attention with no positional encoding; keys and values cached per position. */
static void cpu_attention(Rank *r, int l, int T, int pos) {
    const Config *c = r->c;
    const Shard *s = &r->s;
    const Layer *L = &r->w.layer[l];
    CpuState *st = r->st;
    int hidden = c->hidden, hd = c->head_dim, qw = s->q * hd, kw = s->kv * hd, qkv_w = qw + 2 * kw;
    int q_per_kv = c->n_heads / c->n_kv;
    float scale = 1.0f / sqrtf((float)hd);
    Mat qkv[3] = {L->wq, L->wk, L->wv};
    matmul_n(st->proj, qkv_w, st->x, hidden, T, qkv, 3);
    for (int t = 0; t < T; t++) {
        memcpy(st->k[l] + (size_t)(pos + t) * kw, st->proj + (size_t)t * qkv_w + qw, (size_t)kw * sizeof(float));
        memcpy(st->v[l] + (size_t)(pos + t) * kw, st->proj + (size_t)t * qkv_w + qw + kw, (size_t)kw * sizeof(float));
    }
    /* the heads are independent: the rank's threads take whole heads, each with its own row of att */
#pragma omp parallel for num_threads(cpu_threads) schedule(static)
    for (int h = 0; h < s->q; h++) {
        int kvh = (s->q0 + h) / q_per_kv - s->kv0;
        float *att = st->att + (size_t)h * r->ctx;
        for (int t = 0; t < T; t++) {
            int n = pos + t + 1;  /* keys 0..pos+t */
            const float *q = st->proj + (size_t)t * qkv_w + h * hd;
            /* a_j = softmax_j(q . k_j / sqrt(head_dim)); out = sum_j a_j v_j */
            float mx = -INFINITY, sum = 0;
            for (int j = 0; j < n; j++) {
                att[j] = dot(q, st->k[l] + (size_t)j * kw + kvh * hd, hd) * scale;
                if (att[j] > mx) mx = att[j];
            }
            for (int j = 0; j < n; j++) att[j] = fast_exp(att[j] - mx);
            for (int j = 0; j < n; j++) sum += att[j];
            float *out = st->y + (size_t)t * qw + h * hd;
            memset(out, 0, (size_t)hd * sizeof(float));
            for (int j = 0; j < n; j++) {
                const float *v = st->v[l] + (size_t)j * kw + kvh * hd;
                float a = att[j] / sum;
                for (int i = 0; i < hd; i++) out[i] += a * v[i];
            }
        }
    }
    matmul(st->pend, hidden, st->y, qw, T, &L->wo);
}

/* a = relu(a)^2 over n elements: the activation of the MLP and of every expert */
static void relu2(float *a, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float u = a[i] > 0 ? a[i] : 0;
        a[i] = u * u;
    }
}

/* MLP: down(relu(up(x))^2) */
static void cpu_mlp(Rank *r, int l, int T) {
    const Layer *L = &r->w.layer[l];
    CpuState *st = r->st;
    int hidden = r->c->hidden, m = r->s.mlp;
    matmul(st->proj, m, st->x, hidden, T, &L->up);
    relu2(st->proj, (size_t)T * m);
    matmul(st->pend, hidden, st->proj, m, T, &L->down);
}

/* The router for one token x, in fp32, as transformers' NemotronH (DeepSeek-V3) router: s = sigmoid(W_gate x);
 * experts are chosen by s + bias: the topk_group groups with the largest sum of their two best, then the
 * top_k best experts inside them; their weights are s (no bias), / (sum + 1e-20) if norm_topk_prob, then
 * * routed_scaling_factor. Equal candidates go to the lower index. scratch: [2 * n_experts + n_group]. */
static void moe_route(const Config *c, const Layer *L, const float *x, float *scratch, int *idx, float *w) {
    int E = c->n_experts, G = c->n_group, per = E / G;
    float *s = scratch, *choice = scratch + E, *gscore = scratch + 2 * E, sum = 0;
    Mat gate = {L->gate, DT_F32, E, c->hidden, (size_t)c->hidden, NULL, 0, 1.0f};
    for (int e = 0; e < E; e++) {
        s[e] = 1.0f / (1.0f + expf(-dot_row(&gate, e, x)));
        choice[e] = s[e] + L->gate_bias[e];
    }
    if (G > 1) {
        /* group score = its best + its second best choice value; keep topk_group groups, mask the rest */
        for (int g = 0; g < G; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++)
                if (choice[e] > b1) { b2 = b1; b1 = choice[e]; } else if (choice[e] > b2) b2 = choice[e];
            gscore[g] = b1 + b2;
        }
        for (int k = 0; k < c->topk_group; k++) {
            int best = -1;
            for (int g = 0; g < G; g++) if (gscore[g] < INFINITY && (best < 0 || gscore[g] > gscore[best])) best = g;
            if (best < 0) die("the MoE router's group scores are not finite");
            gscore[best] = INFINITY;  /* kept */
        }
        for (int g = 0; g < G; g++)
            if (gscore[g] < INFINITY) for (int e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
    }
    for (int k = 0; k < c->top_k; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) if (choice[e] > -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
        if (best < 0) die("the MoE router's scores are not finite");
        choice[best] = -INFINITY;
        idx[k] = best;
        sum += w[k] = s[best];
    }
    for (int k = 0; k < c->top_k; k++) w[k] = (c->norm_topk ? w[k] / (sum + 1e-20f) : w[k]) * c->routed_scale;
}

/* Mixture of experts: pending = fc2_latent(sum_i w_i down_i(relu(up_i z)^2)) + down_s(relu(up_s x)^2), with
 * z = fc1_latent(x) (latent MoE) or z = x and no fc2. Each rank holds 1/n of every expert's and of the
 * shared expert's intermediate rows, so its sums are partial; fc2 is linear, so each rank applies it to
 * its own partial sum. The pending buffer then owes one all-reduce, like any other layer's. */
static void cpu_moe(Rank *r, int l, int T) {
    const Config *c = r->c;
    const Shard *s = &r->s;
    const Layer *L = &r->w.layer[l];
    CpuState *st = r->st;
    CpuShared *sh = r->sh;
    int hidden = c->hidden, d = c->latent ? c->latent : hidden, K = c->top_k;
    for (int t = 0; t < T; t++)
        moe_route(c, L, st->x + (size_t)t * hidden, st->escore, st->route + (size_t)t * K, st->route_w + (size_t)t * K);
    if (sh->n > 1) {
        /* every rank routed the same reduced input; a rank that chose otherwise would sum other experts'
           slices. No barrier after: rank 0 rewrites its choices only past the next layer's all-reduce. */
        pthread_barrier_wait(&sh->bar);
        for (size_t i = 0; i < (size_t)T * K; i++)
            if (st->route[i] != sh->route[0][i])
                die("layer %d: rank %d chose expert %d where rank 0 chose %d", l, s->rank, st->route[i], sh->route[0][i]);
    }
    const float *z = st->x;
    if (c->latent) { matmul(st->ez, d, st->x, hidden, T, &L->lat_in); z = st->ez; }
    /* acc[t] = sum over its chosen experts e, in expert order, of w * down_e(relu(up_e z[t])^2) */
    memset(st->eacc, 0, (size_t)T * d * sizeof(float));
    for (int e = 0; e < c->n_experts; e++) {
        int n = 0;
        for (size_t i = 0; i < (size_t)T * K; i++)
            if (st->route[i] == e) {
                st->etok[n] = i / K;
                st->ew[n] = st->route_w[i];
                memcpy(st->ein + (size_t)n++ * d, z + (size_t)(i / K) * d, (size_t)d * sizeof(float));
            }
        if (!n) continue;
        matmul(st->proj, s->moe, st->ein, d, n, &L->eup[e]);
        relu2(st->proj, (size_t)n * s->moe);
        matmul(st->eout, d, st->proj, s->moe, n, &L->edown[e]);
        for (int j = 0; j < n; j++)
            for (int i = 0; i < d; i++) st->eacc[(size_t)st->etok[j] * d + i] += st->ew[j] * st->eout[(size_t)j * d + i];
    }
    if (c->latent) matmul(st->pend, hidden, st->eacc, d, T, &L->lat_out);
    else memcpy(st->pend, st->eacc, (size_t)T * hidden * sizeof(float));
    /* the shared expert on x itself, added to the routed sum */
    matmul(st->proj, s->shared, st->x, hidden, T, &L->sup);
    relu2(st->proj, (size_t)T * s->shared);
    matmul(st->eacc, hidden, st->proj, s->shared, T, &L->sdown);
    for (size_t i = 0; i < (size_t)T * hidden; i++) st->pend[i] += st->eacc[i];
}

/* Logits of the last row (or all T rows): each rank fills its vocabulary slice of the shared rows; the
 * MTP pass only the columns of ids below draft_vocab. */
static void cpu_logits(Rank *r, int T, int all) {
    CpuState *st = r->st;
    CpuShared *sh = r->sh;
    int hidden = r->c->hidden, V = r->c->vocab, rows = all ? T : 1;
    const float *x = st->x + (size_t)(all ? 0 : T - 1) * hidden;
    Mat W = r->w.lm_head;
    if (r->pass == PASS_MTP) {
        int mine = r->draft_vocab - r->s.rank * r->s.vocab;
        W.rows = mine < 0 ? 0 : mine < W.rows ? mine : W.rows;
    }
    matmul(sh->logits + (size_t)r->s.rank * r->s.vocab, V, x, hidden, rows, &W);
    if (r->s.rank == 0) sh->rows = rows;   /* the same on every rank: one writer */
    pthread_barrier_wait(&sh->bar);
}

static int sample_logits(const float *logits, int V, float temp, float topp, uint64_t seed, uint64_t step);

static void cpu_sample(Rank *r, int n, float temp, float topp, uint64_t seed, uint64_t step, int *out) {
    CpuShared *sh = r->sh;
    const Config *c = r->c;
    int V = r->pass == PASS_MTP ? r->draft_vocab : c->vocab;
    for (int j = 0; j < n; j++) {
        out[j] = sample_logits(sh->logits + (size_t)(sh->rows - n + j) * c->vocab, V, temp, topp, seed, step + (uint64_t)j);
        if (out[j] >= 0 || r->s.rank || r->pass != PASS_MAIN) continue;   /* one rank speaks; the others wait for the exit */
        if (sh->bad < 0) die("non-finite logits: the final norm or lm_head made them (every layer's output is finite)");
        if (sh->bad == c->n_layers) die("non-finite logits: the embedding of a prompt token is not finite");
        die("non-finite logits: layer %d (%s) is the first whose output is not finite", sh->bad, kind_name(c->kind[sh->bad]));
    }
}

/* residual[t] = eh_proj([enorm(embed[tok[t]]) ; hnorm(x[row + t])]): the MTP block's input. No tok:
 * the accepted tokens, or the last draft; a token of -1 (a non-finite row's) gives zeros (that pass's
 * draft is not used, and a router must not see the row's NaN) */
static void cpu_mtp_in(Rank *r, const int *tok, int T, int row) {
    CpuState *st = r->st;
    int H = r->c->hidden;
    if (!tok) tok = st->accepted ? st->acc + 1 : &st->draft[st->drafted];
    st->accepted = 0;
    for (int t = 0; t < T; t++) {
        float *eh = st->eh + (size_t)t * 2 * H;
        if (tok[t] < 0) {
            memset(eh, 0, 2 * (size_t)H * sizeof(float));
            continue;
        }
        for (int i = 0; i < H; i++) eh[i] = mat_at(&r->w.embed, (size_t)tok[t], (size_t)i);
        rmsnorm(eh, eh, r->w.enorm, H, r->c->eps);
        rmsnorm(eh + H, st->x + (size_t)(row + t) * H, r->w.hnorm, H, r->c->eps);
    }
    matmul(st->res, H, st->eh, 2 * H, T, &r->w.eh_proj);
}

/* Every Mamba layer's conv window and SSM state := those after token t of the last forward with r->keep
 * (t below its last token, whose state is the state itself: no conv window is kept for it). */
static void cpu_rewind(Rank *r, int t) {
    CpuState *st = r->st;
    const Config *c = r->c;
    size_t nc = (size_t)r->s.conv * (size_t)(c->d_conv - 1);
    for (int l = 0; l < n_all(c); l++) {
        if (c->kind[l] != K_MAMBA) continue;
        memcpy(st->conv[l], st->keep[l] + (size_t)t * nc, nc * sizeof(float));
        st->at[l] = (st->base[l] + t) % (r->spec + 1);
    }
}

/* The verify step (be->accept), on the host: n is known at once. */
static int cpu_accept(Rank *r, const int *tok, int T, float temp, float topp, uint64_t seed, uint64_t step) {
    CpuState *st = r->st;
    int n = 0;
    cpu_sample(r, T, temp, topp, seed, step, st->acc + 1);
    while (n < T - 1 && tok[n + 1] == st->acc[n + 1]) n++;
    if (n < T - 1) cpu_rewind(r, n);
    st->acc[0] = n;
    st->accepted = 1;
    return n;
}

/* The pass ran with the accepted count known: its drafting token's row is the last. */
static void cpu_draft(Rank *r, int j) {
    CpuState *st = r->st;
    cpu_sample(r, 1, 0, 1, 0, 0, &st->draft[j]);
    st->drafted = j;
}

static void cpu_outcome(Rank *r, int T, int k, int *out) {
    CpuState *st = r->st;
    if (T) memcpy(out, st->acc, (size_t)(T + 1) * sizeof(int));
    memcpy(out + (T ? T + 1 : 0), st->draft, (size_t)k * sizeof(int));
}

static const float *cpu_host_logits(Rank *r, int rows) {
    (void)rows;
    return ((CpuShared *)r->sh)->logits;
}

static void *cpu_setup(const Config *c, int n, int t_max, int logit_rows) {
    CpuShared *sh = xcalloc(1, sizeof *sh);
    sh->n = n;
    pthread_barrier_init(&sh->bar, NULL, (unsigned)n);
    sh->pend = xcalloc((size_t)n, sizeof(float *));
    sh->route = xcalloc((size_t)n, sizeof(int *));
    (void)t_max;
    sh->logits = xcalloc((size_t)logit_rows * (size_t)c->vocab, sizeof(float));
    sh->bad = -1;
    return sh;
}

static void cpu_teardown(void *p) {
    CpuShared *sh = p;
    pthread_barrier_destroy(&sh->bar);
    free(sh->pend);
    free(sh->route);
    free(sh->logits);
    free(sh);
}

/* Copies every Mamba layer's conv window and SSM state into snapshot slot `slot` (save) or back. */
static void cpu_snapshot(Rank *r, int slot, int save) {
    CpuState *st = r->st;
    const Config *c = r->c;
    size_t nc = (size_t)r->s.conv * (size_t)(c->d_conv - 1), ns = (size_t)r->s.d_inner * (size_t)c->d_state;
    if (!st->snap) {
        for (int l = 0; l < c->n_layers; l++) st->snap_n += c->kind[l] == K_MAMBA ? nc + ns : 0;
        st->snap = xcalloc(SNAPSHOT_SLOTS * st->snap_n + 1, sizeof(float));
    }
    float *p = st->snap + (size_t)slot * st->snap_n;
    for (int l = 0; l < c->n_layers; l++) {
        if (c->kind[l] != K_MAMBA) continue;
        memcpy(save ? p : st->conv[l], save ? st->conv[l] : p, nc * sizeof(float));
        float *ssm = st->ssm[l] + (size_t)st->at[l] * ns;
        memcpy(save ? p + nc : ssm, save ? ssm : p + nc, ns * sizeof(float));
        p += nc + ns;
    }
}

static const Backend cpu_backend = {
    .name = "cpu", .setup = cpu_setup, .teardown = cpu_teardown, .init = cpu_init, .free = cpu_free, .embed = cpu_embed, .norm = cpu_norm,
    .mamba = cpu_mamba, .attention = cpu_attention, .mlp = cpu_mlp, .moe = cpu_moe, .allreduce = cpu_allreduce,
    .logits = cpu_logits, .sample = cpu_sample, .host_logits = cpu_host_logits,
    .snapshot = cpu_snapshot, .mtp_in = cpu_mtp_in, .accept = cpu_accept, .rewind = cpu_rewind, .draft = cpu_draft,
    .outcome = cpu_outcome,
};

/* ------------------------------------------------------------------------------------------------
 * The layer loop: one forward step, the same for every backend and every rank
 * ---------------------------------------------------------------------------------------------- */

/* --trace: what layer l's entry does with the partial sums the layer before it left. */
static void trace_layer(const Rank *r, int l, int how) {
    if (!r->trace || r->s.rank != 0) return;
    int i = l - r->c->n_layers;   /* the MTP block's sublayer i */
    char name[16];
    snprintf(name, sizeof name, i < 0 ? "layer %3d" : "mtp   %3d", i < 0 ? l : i);
    fprintf(stderr, "%s  %-9s %-44s pending in: %s\n", name, kind_name(r->c->kind[l]),
            how == NORM_PLAIN ? "rmsnorm" : how == NORM_FUSED ? "fused all-reduce + add + rmsnorm" : "add + rmsnorm",
            how == NORM_PLAIN ? "no" : how == NORM_FUSED ? "yes (reduced here)" : "yes (reduced at last layer's end)");
}

/* Layers l0..l1-1 over T tokens at positions pos..: each mixer leaves partial sums in `pending` (its
 * output projection is row-parallel); the next layer's entry settles them with one fused all-reduce +
 * residual add + RMSNorm (be->norm with NORM_FUSED: host_allreduce in cpu_norm;
 * fused_allreduce_norm_kernel in nemoh.cu), and only after the last layer is there a plain
 * all-reduce; then the final norm `fin` and lm_head. With fuse off, every layer all-reduces at its
 * end instead. */
static void run_layers(Rank *r, int l0, int l1, int fin, int T, int pos, int all_logits) {
    const Backend *be = r->be;
    const Config *c = r->c;
    for (int l = l0; l < l1; l++) {
        /* x = pending ? fused_allreduce_add_rmsnorm(pending, residual, norm[l]) : rmsnorm(residual, norm[l]) */
        int how = l == l0 ? NORM_PLAIN : r->fuse ? NORM_FUSED : NORM_ADD;
        trace_layer(r, l, how);
        be->norm(r, l, how, T);
        /* pending = mixer_l(x): row-parallel partial sums */
        if (c->kind[l] == K_MAMBA) be->mamba(r, l, T, pos);
        else if (c->kind[l] == K_ATTN) be->attention(r, l, T, pos);
        else if (c->kind[l] == K_MLP) be->mlp(r, l, T);
        else be->moe(r, l, T);
        if (!r->fuse) be->allreduce(r, T);
    }
    /* allreduce(pending); residual += pending; x = rmsnorm(residual, norm_f); logits = lm_head(x) */
    if (r->trace && r->s.rank == 0)
        fprintf(stderr, "final      %s all-reduce, then add + rmsnorm(%s), lm_head\n", r->fuse ? "plain" : "no",
                fin == NORM_F ? "norm_f" : "final_layernorm");
    if (r->fuse) be->allreduce(r, T);
    be->norm(r, fin, NORM_ADD, T);
    be->logits(r, T, all_logits);
    if (be->end) be->end(r, T);
}

/* T tokens at positions pos..pos+T-1 through the model on one rank; with r->keep, every Mamba layer
 * also keeps its state after each token (be->rewind goes back to one). */
static void forward(Rank *r, const int *tok, int T, int pos, int all_logits) {
    r->pass = PASS_MAIN, r->all = all_logits, r->row = 0;
    if (r->be->replay && r->be->replay(r, tok, T, pos)) return;   /* a captured CUDA graph ran it all */
    if (r->be->begin) r->be->begin(r, tok, T, pos);
    r->be->embed(r, tok, T);                                      /* residual = embed[tok] */
    run_layers(r, 0, r->c->n_layers, NORM_F, T, pos, all_logits);
}

/* The MTP block over T positions pos..: token tok[t] is the one after position pos + t, and x row
 * row + t the hidden state the last forward left for that position (the model's after norm_f, or
 * the block's own output, for a draft of a draft). tok NULL: the tokens are on the rank (be->mtp_in),
 * and pos and row may be -1: only the rank knows them (a GPU's accepted count, be->accept).
 *   g = final_layernorm(block(eh_proj([enorm(embed[tok]) ; hnorm(h)]))); logits = lm_head(g)
 * Its attention keeps its own cache, positions as the model's. */
static void mtp_forward(Rank *r, const int *tok, int T, int row, int pos, int all_logits) {
    r->pass = PASS_MTP, r->all = all_logits, r->row = row;
    if (r->be->replay && r->be->replay(r, tok, T, pos)) return;
    if (r->be->begin) r->be->begin(r, tok, T, pos);
    r->be->mtp_in(r, tok, T, row);
    run_layers(r, r->c->n_layers, n_all(r->c), NORM_MTP_F, T, pos, all_logits);
}

/* ------------------------------------------------------------------------------------------------
 * Ranks: one host thread per tensor-parallel rank, each running the layer loop on its shard
 * ---------------------------------------------------------------------------------------------- */

/* Each rank's weights are views into one checkpoint (read further down, with the file formats). */
typedef struct Checkpoint Checkpoint;
static void build_weights(Weights *w, const Checkpoint *ck, const Config *c, const Shard *s);
static void free_weights(Weights *w, const Config *c);

typedef struct Engine Engine;
struct Engine {
    Config c;                   /* model configuration */
    const Backend *be;          /* backend of every rank */
    int n;                      /* ranks */
    Rank *rank;                 /* [n] */
    void *sh;                   /* backend state shared by the ranks */
    pthread_t *thread;          /* [n] workers; with one rank the caller runs it */
    pthread_barrier_t go, done; /* n + 1 parties: the workers and the caller */
    void (*job)(Rank *, void *);  /* what every rank runs next */
    void *arg;                  /* its argument */
    int quit;                   /* workers exit at the next go */
};

typedef struct { Engine *e; int i; } Worker;

static void *worker_main(void *p) {
    Worker w = *(Worker *)p;
    free(p);
    for (;;) {
        pthread_barrier_wait(&w.e->go);
        if (w.e->quit) return NULL;
        w.e->job(&w.e->rank[w.i], w.e->arg);
        pthread_barrier_wait(&w.e->done);
    }
}

/* Runs job on every rank, each on its own thread, and waits for all. */
static void run_ranks(Engine *e, void (*job)(Rank *, void *), void *arg) {
    if (e->n == 1) { job(&e->rank[0], arg); return; }
    e->job = job;
    e->arg = arg;
    pthread_barrier_wait(&e->go);
    pthread_barrier_wait(&e->done);
}

static void job_init(Rank *r, void *arg) { (void)arg; r->be->init(r); }
static void job_free(Rank *r, void *arg) { (void)arg; r->be->free(r); }

typedef struct { const int *tok; int T, pos, all, keep, mtp, row; } FwdArgs;
static void job_forward(Rank *r, void *arg) {
    FwdArgs *a = arg;
    r->keep = a->keep;
    if (a->mtp) mtp_forward(r, a->tok, a->T, a->row, a->pos, a->all);
    else forward(r, a->tok, a->T, a->pos, a->all);
}

typedef struct { int n; float temp, topp; uint64_t seed, step; int *out; } SampleArgs;
static void job_sample(Rank *r, void *arg) {
    SampleArgs *a = arg;
    r->be->sample(r, a->n, a->temp, a->topp, a->seed, a->step, a->out + r->s.rank * a->n);
}

static void job_rewind(Rank *r, void *arg) { r->be->rewind(r, *(int *)arg); }

/* Loads the shards, starts one thread per rank and lets the backend set up each rank. */
static void build_engine(Engine *e, const Checkpoint *ck, const Backend *be, int n, int t_max, int ctx, int fuse, int logit_rows, int graph,
                         int spec) {
    e->be = be;
    e->n = n;
    e->sh = be->setup(&e->c, n, t_max, logit_rows);
    e->rank = xcalloc((size_t)n, sizeof(Rank));
    for (int i = 0; i < n; i++) {
        Rank *r = &e->rank[i];
        shard_sizes(&r->s, &e->c, i, n);
        build_weights(&r->w, ck, &e->c, &r->s);
        r->c = &e->c;
        r->be = be;
        r->sh = e->sh;
        r->t_max = t_max;
        r->ctx = ctx;
        r->fuse = fuse;
        r->gpu = i;
        r->graph = graph;
        r->spec = spec;
    }
    if (n > 1) {
        e->thread = xcalloc((size_t)n, sizeof(pthread_t));
        pthread_barrier_init(&e->go, NULL, (unsigned)n + 1);
        pthread_barrier_init(&e->done, NULL, (unsigned)n + 1);
        for (int i = 0; i < n; i++) {
            Worker *w = xmalloc(sizeof *w);
            *w = (Worker){e, i};
            if (pthread_create(&e->thread[i], NULL, worker_main, w) != 0) die("cannot start rank thread %d", i);
        }
    }
    run_ranks(e, job_init, NULL);
}

static void free_engine(Engine *e) {
    run_ranks(e, job_free, NULL);
    if (e->n > 1) {
        e->quit = 1;
        pthread_barrier_wait(&e->go);
        for (int i = 0; i < e->n; i++) pthread_join(e->thread[i], NULL);
        pthread_barrier_destroy(&e->go);
        pthread_barrier_destroy(&e->done);
        free(e->thread);
    }
    for (int i = 0; i < e->n; i++) free_weights(&e->rank[i].w, &e->c);
    e->be->teardown(e->sh);
    free(e->rank);
}

/* One forward step on all ranks: each rank's thread runs forward(), the layer loop above; keep: every
 * token's recurrent state is kept for engine_rewind. */
static void engine_forward(Engine *e, const int *tok, int T, int pos, int all, int keep) {
    FwdArgs a = {tok, T, pos, all, keep, 0, 0};
    run_ranks(e, job_forward, &a);
}

/* The MTP block on all ranks (mtp_forward): tokens tok[0..T) after positions pos.., on x rows row..
 * (tok NULL: those on the rank, be->mtp_in; pos and row -1: the rank's own). */
static void engine_mtp(Engine *e, const int *tok, int T, int row, int pos, int all) {
    FwdArgs a = {tok, T, pos, all, 0, 1, row};
    run_ranks(e, job_forward, &a);
}

/* Every rank's recurrent state back to the one after token t of the last forward that kept them. */
static void engine_rewind(Engine *e, int t) { run_ranks(e, job_rewind, &t); }

/* Every rank saves (or restores) its own shard of the recurrent state in snapshot slot `slot`. */
typedef struct { int slot, save; } SnapArgs;
static void job_snapshot(Rank *r, void *arg) { SnapArgs *a = arg; r->be->snapshot(r, a->slot, a->save); }
static void engine_snapshot(Engine *e, int slot, int save) { SnapArgs a = {slot, save}; run_ranks(e, job_snapshot, &a); }

/* Every rank's n tokens, out[i * n + j] of rank i, must equal rank 0's (what names them). */
static void ranks_agree(const Engine *e, const int *out, int n, const char *what) {
    for (int j = 0; j < n; j++)
        for (int i = 1; i < e->n; i++)
            if (out[i * n + j] != out[j]) die("ranks disagree on %s %d (rank 0: %d, rank %d: %d)", what, j, out[j], i, out[i * n + j]);
}

/* n tokens the model sampled: one that is -1 (a row not finite) is an error. */
static void model_tokens(const Engine *e, const int *tok, int n) {
    for (int j = 0; j < n; j++)
        if (tok[j] < 0 || tok[j] >= e->c.vocab) die("non-finite logits (run with --cpu to find the first layer that made them)");
}

/* Every rank samples the last n rows of the model's gathered logits (row j with coin step + j); they
 * must agree (model_tokens). */
static void engine_sample_rows(Engine *e, int n, float temp, float topp, uint64_t seed, uint64_t step, int *tok) {
    int out[64 * (SPEC_MAX + 1)];
    SampleArgs a = {n, temp, topp, seed, step, out};
    run_ranks(e, job_sample, &a);
    ranks_agree(e, out, n, "sampled token");
    model_tokens(e, out, n);
    memcpy(tok, out, (size_t)n * sizeof(int));
}

/* Every rank accepts the drafts of the verify forward just run, fed tok[0..T) (be->accept): n, or -1
 * where it stays on the device until engine_outcome. */
typedef struct { const int *tok; int T; float temp, topp; uint64_t seed, step; int n[64]; } AcceptArgs;
static void job_accept(Rank *r, void *arg) {
    AcceptArgs *a = arg;
    a->n[r->s.rank] = r->be->accept(r, a->tok, a->T, a->temp, a->topp, a->seed, a->step);
}
static int engine_accept(Engine *e, const int *tok, int T, float temp, float topp, uint64_t seed, uint64_t step) {
    AcceptArgs a = {tok, T, temp, topp, seed, step, {0}};
    run_ranks(e, job_accept, &a);
    ranks_agree(e, a.n, 1, "accepted drafts");
    return a.n[0];
}

/* Every rank makes draft j from its drafting row's logits and keeps it (be->draft). */
static void job_draft(Rank *r, void *arg) { r->be->draft(r, *(int *)arg); }
static void engine_draft(Engine *e, int j) { run_ranks(e, job_draft, &j); }

/* out = [n, t_0..t_{T-1}] of the last accept (none where T = 0), then k drafts (-1 where a row was not
 * finite): every rank's (be->outcome), which must agree; t_i as model_tokens checks them. */
typedef struct { int T, k, w, *out; } OutcomeArgs;   /* w: ints of a rank's outcome */
static void job_outcome(Rank *r, void *arg) {
    OutcomeArgs *a = arg;
    r->be->outcome(r, a->T, a->k, a->out + r->s.rank * a->w);
}
static void engine_outcome(Engine *e, int T, int k, int *out) {
    int w = T + !!T + k, all[64 * (2 * SPEC_MAX + 2)];
    OutcomeArgs a = {T, k, w, all};
    run_ranks(e, job_outcome, &a);
    ranks_agree(e, all, w, "step outcome");
    if (T && (all[0] < 0 || all[0] >= T)) die("accepted %d drafts of %d", all[0], T - 1);
    model_tokens(e, all + 1, T);
    for (int j = w - k; j < w; j++)
        if (all[j] >= e->c.vocab) die("draft %d is token %d, past the vocabulary (%d)", j - (w - k), all[j], e->c.vocab);
    memcpy(out, all, (size_t)w * sizeof(int));
}

static int engine_sample(Engine *e, float temp, float topp, uint64_t seed, uint64_t step) {
    int tok;
    engine_sample_rows(e, 1, temp, topp, seed, step, &tok);
    return tok;
}

/* ------------------------------------------------------------------------------------------------
 * Sampler
 * ---------------------------------------------------------------------------------------------- */

/* temp 0: the argmax (the first, on ties). Otherwise p_i ~ exp((l_i - max) / temp); top-p keeps every
 * token whose probability reaches a threshold, the highest one whose kept mass is still >= topp
 * (found by bisection, so no sort), and draws among them in index order with coin(seed, step).
 * -1 when a logit is NaN or infinite: there is nothing to sample from. */
static int sample_logits(const float *l, int V, float temp, float topp, uint64_t seed, uint64_t step) {
    /* the largest logit, in 16 lanes (a loop the compiler vectorizes: 7x faster), then its first index */
    float lane[16], mx = -INFINITY;
    int finite = 1, i = 0, best = 0;
    for (int j = 0; j < 16; j++) lane[j] = -INFINITY;
    for (; i + 16 <= V; i += 16)
        for (int j = 0; j < 16; j++) finite &= fabsf(l[i + j]) <= FLT_MAX, lane[j] = l[i + j] > lane[j] ? l[i + j] : lane[j];
    for (; i < V; i++) finite &= fabsf(l[i]) <= FLT_MAX, mx = l[i] > mx ? l[i] : mx;
    for (int j = 0; j < 16; j++) mx = lane[j] > mx ? lane[j] : mx;
    if (!finite) return -1;
    while (l[best] != mx) best++;
    if (temp <= 0) return best;
    float *p = xmalloc(2 * (size_t)V * sizeof(float)), *cand = p + V;
    double total = 0;
    for (int i = 0; i < V; i++) total += p[i] = expf((l[i] - l[best]) / temp);
    float lo = 0, hi = 1;  /* mass(lo) >= topp * total always holds; mass(th) = sum of p_i >= th */
    if (topp < 1) {
        /* Every threshold tried lies above (1 - topp) total / (2V) (nemoh.cu's sample_kernel says why),
         * so only p_i >= a quarter of (1 - topp) total / V ever count: gathered once, they are what
         * the 40 passes read. */
        float tau = (float)((1 - topp) * total / V / 4);
        int n = 0;
        for (int i = 0; i < V; i++)
            if (p[i] >= tau) cand[n++] = p[i];
        for (int it = 0; it < 40; it++) {
            /* the mass in 8 lanes: a loop the compiler vectorizes */
            float mid = 0.5f * (lo + hi);
            double mass = 0, ml[8] = {0};
            int i = 0;
            for (; i + 8 <= n; i += 8)
                for (int j = 0; j < 8; j++) ml[j] += (cand[i + j] >= mid) * (double)cand[i + j];
            for (; i < n; i++) mass += cand[i] >= mid ? cand[i] : 0;
            for (int j = 0; j < 8; j++) mass += ml[j];
            if (mass >= topp * total) lo = mid; else hi = mid;
        }
    }
    double kept = 0;
    for (int i = 0; i < V; i++) kept += p[i] >= lo ? p[i] : 0;
    double target = coin(seed, step) * kept, cum = 0;
    int pick = best;
    for (int i = 0; i < V; i++) {
        if (p[i] < lo) continue;
        cum += p[i];
        pick = i;
        if (cum > target) break;
    }
    free(p);
    return pick;
}

/* ------------------------------------------------------------------------------------------------
 * Decoding: one token a forward, or drafts of the MTP block verified in one forward
 * ---------------------------------------------------------------------------------------------- */

/* Self-speculative decoding (--mtp K). A step feeds the last token and K drafts d_1..d_K in one forward
 * (positions pos..pos+K), samples every row i with the coin plain decoding uses at its position,
 * t_0..t_K, and accepts while d_i == t_{i-1}. With n accepted it emits t_0..t_n: exactly the tokens
 * plain decoding emits, greedy or sampled (each t_i is drawn from the model's own distribution with
 * its position's coin, so the rule is lossless). The recurrent state rewinds to its value after d_n;
 * attention caches need nothing (positions past it are rewritten). Then the MTP block runs over
 * positions pos..pos+n (tokens t_0..t_n, the model's hidden states), and K - 1 more times on its own
 * output; each draft is the argmax of its logits among the first draft_vocab token ids (--mtp-vocab).
 * A BPE vocabulary numbers its tokens in merge order, the most frequent first, so those ids hold
 * nearly every token a draft gets right, and a pass computes only their rows of lm_head (FR-Spec's
 * frequency-ranked draft vocabulary, with the merge order as the ranking). */
typedef struct {
    Engine *e;
    int k;                      /* drafts a step (0: one token a forward) */
    float temp, topp;           /* sampling temperature (0: greedy), top-p */
    uint64_t seed;              /* sampling seed */
    int ctx;                    /* positions the caches hold */
    int left;                   /* tokens the caller may still take (drafts past them are not made) */
    int pos;                    /* tokens the model's state has consumed */
    int tok[SPEC_MAX + 1];      /* the tokens the last step emitted */
    int n_tok, next;            /* how many, how many handed out */
    int base;                   /* position of the last step's row 0 */
    int draft[SPEC_MAX], n_draft;  /* drafts for the next step */
    const int *ids;             /* the prompt whose last chunk's MTP pass waits for the first token */
    int mtp_from;               /* that chunk's first position, -1: none waits */
    int gen0;                   /* position of the first token sampled after a prefill */
    const int *force;           /* test hook (NEMOH_TEST_DRAFTS): drafts from a recorded run */
    int n_force;                /* its tokens, for positions gen0.. */
    long steps, fed, accepted;  /* verify steps, drafts fed, drafts accepted */
    long hist[SPEC_MAX + 1];    /* steps by drafts accepted */
    float *rows, *mtp_rows;     /* --dump-logits, --dump-mtp: [positions, vocab] each position's logits */
    size_t rows_cap, mtp_cap;   /* allocated floats */
    int dump, dump_mtp;         /* keep rows, mtp_rows */
} Decoder;

/* Drafts a step when the model has an MTP block and --mtp is not given: the count that measured
 * fastest on the default model (its trained block; bench/RESULTS.md, "Drafting with the MTP block").
 * On a GPU, greedy, 2 (over eight prompts, one H100: 1.30x; 3, 1.29x). On the CPU, greedy:
 * 4 where the AMX tile unit runs the bf16 products, whose several tokens cost what one does (over
 * eight prompts on the 2-core Xeon, 1.56x and 1.58x; 2 gives 1.50x, 3 1.52x, 5 1.30x); none without
 * it, where a verify forward's products pay every token's FMAs (the 2-core AMD EPYC, with the block
 * before its second distillation: one draft 0.95x to 0.99x, two 0.97x).
 * Sampled, a greedy draft is accepted only when the draw equals it (acceptance length 1.27 at one
 * draft, 0.91x): none. */
static int mtp_default(int gpu, float temp) {
    if (temp > 0) return 0;
    if (gpu) return 2;
#ifdef NEMOH_AMX
    if (amx_on()) return 4;
#endif
    return 0;
}

static void *tok_grow(void *p, size_t *cap, size_t need, size_t size);
static int *parse_ids(const char *s, int *n);

/* Writes rows 0..rows-1 of a logits dump (--dump-logits, --dump-mtp). */
static void dump_rows(const float *l, int rows, int vocab, FILE *f, const char *flag) {
    if (fwrite(l, sizeof(float), (size_t)rows * vocab, f) != (size_t)rows * vocab) die("%s: write failed", flag);
}

/* The first rows of the logits the engine just made, as those of positions pos..pos+rows-1: the
 * first w columns of each (the model's: the vocabulary; the MTP block's: its draft vocabulary). */
static void dec_keep_rows(Decoder *d, float **buf, size_t *cap, int pos, int rows, int w) {
    size_t V = (size_t)d->e->c.vocab;
    const float *l = d->e->be->host_logits(&d->e->rank[0], rows);
    *buf = tok_grow(*buf, cap, ((size_t)pos + rows) * w, sizeof(float));
    for (int t = 0; t < rows; t++) memcpy(*buf + ((size_t)pos + t) * w, l + t * V, (size_t)w * sizeof(float));
}

/* Where the token handed out last would be fed: the tokens consumed so far, as plain decoding counts. */
static int dec_at(const Decoder *d) { return d->pos - (d->n_tok - d->next); }

/* Feeds ids[from..to) at their positions, in chunks of t_max. With drafting, each chunk's MTP pass
 * follows it (fills the block's cache); the last one's waits for the token after ids[n_ids - 1]. */
static void dec_prefill(Decoder *d, const int *ids, int from, int to, int n_ids) {
    Engine *e = d->e;
    d->mtp_from = -1;
    for (int pos = from, T; pos < to; pos += T) {
        T = to - pos < e->rank[0].t_max ? to - pos : e->rank[0].t_max;
        engine_forward(e, ids + pos, T, pos, d->dump, 0);
        if (d->dump) dec_keep_rows(d, &d->rows, &d->rows_cap, pos, T, d->e->c.vocab);
        if (d->k && pos + T < n_ids) {
            engine_mtp(e, ids + pos + 1, T, 0, pos, d->dump_mtp);
            if (d->dump_mtp) dec_keep_rows(d, &d->mtp_rows, &d->mtp_cap, pos, T, d->e->rank[0].draft_vocab);
        }
        d->mtp_from = d->k && pos + T == n_ids ? pos : -1;
    }
    d->ids = ids;
    d->pos = to;
    d->n_tok = d->next = 0;
}

/* The MTP pass over positions from..from+T-1 (the token after each in tok; NULL: the accepted ones,
 * on the rank), on the hidden states in rows 0..T-1, then the drafts for the next step: the argmax at
 * its drafting row, at, and K - 1 more of the block's own, each pass fed the draft before it on the
 * rank. at = -1: only the rank knows it (the accepted count; the pass makes every row's logits, and
 * later passes' positions are the rank's). The drafts are bounded by the context after position
 * from + T - 1 and by the tokens left once the step has handed out `made` (at most, where at = -1);
 * they come back with engine_outcome. */
static int dec_draft(Decoder *d, const int *tok, int T, int from, int at, int made) {
    Engine *e = d->e;
    engine_mtp(e, tok, T, 0, from, d->dump_mtp || at < 0);
    if (d->dump_mtp) dec_keep_rows(d, &d->mtp_rows, &d->mtp_cap, from, T, d->e->rank[0].draft_vocab);
    int k = d->k, room = d->ctx - 1 - (from + T), want = d->left - made - 1;
    k = k < room ? k : room;
    k = k < want ? k : want;
    for (int j = 0; j < k; j++) {
        if (j) engine_mtp(e, NULL, 1, j == 1 ? at : 0, at < 0 ? -1 : from + at + j, 0);
        engine_draft(e, j);
    }
    return k > 0 ? k : 0;
}

/* The drafts the step made (k of them), from its outcome's tail, up to the block's first non-finite
 * row; with the test hook, the recorded tokens, one corrupted at draft (steps mod (k + 1)), so that
 * every accepted count 0..k occurs and the state rewinds across every kind of layer. */
static void dec_take_drafts(Decoder *d, const int *draft, int k) {
    for (d->n_draft = 0; d->n_draft < k && draft[d->n_draft] >= 0; d->n_draft++) d->draft[d->n_draft] = draft[d->n_draft];
    if (!d->force) return;
    for (int j = 0; j < d->n_draft; j++) {
        int at = d->pos + j + 1 - d->gen0;
        d->draft[j] = at >= 0 && at < d->n_force ? d->force[at] : d->draft[j];
        if (j == d->steps % (d->k + 1)) d->draft[j] = (d->draft[j] + 1) % d->e->c.vocab;
    }
}

/* The next token: handed out from the last step, or made by a new step, which first feeds the last
 * token handed out (and the drafts). A drafting step runs on the ranks from the verify forward to
 * the next drafts, and its outcome comes back at the end (one round trip on a GPU). */
static int dec_next(Decoder *d) {
    Engine *e = d->e;
    int out[2 * SPEC_MAX + 2];
    if (d->next < d->n_tok) return d->left--, d->tok[d->next++];
    if (!d->n_tok) {   /* just prefilled: the prompt's last logits give the first token */
        d->gen0 = d->pos;
        d->tok[0] = engine_sample(e, d->temp, d->topp, d->seed, (uint64_t)d->pos);
        d->n_tok = 1;
        if (d->mtp_from >= 0) {
            int T = d->pos - d->mtp_from, *t = xmalloc((size_t)T * sizeof(int));
            memcpy(t, d->ids + d->mtp_from + 1, (size_t)(T - 1) * sizeof(int));
            t[T - 1] = d->tok[0];
            int k = dec_draft(d, t, T, d->mtp_from, T - 1, 1);
            free(t);
            engine_outcome(e, 0, k, out);
            dec_take_drafts(d, out, k);
        }
    } else if (!d->k) {   /* plain decoding */
        engine_forward(e, &d->tok[d->n_tok - 1], 1, d->pos, d->dump, 0);
        engine_sample_rows(e, 1, d->temp, d->topp, d->seed, (uint64_t)d->pos + 1, d->tok);
        if (d->dump) dec_keep_rows(d, &d->rows, &d->rows_cap, d->pos, 1, d->e->c.vocab);
        d->base = d->pos++;
        d->n_tok = 1;
    } else {
        int feed[SPEC_MAX + 1], K = d->n_draft, T = K + 1;
        feed[0] = d->tok[d->n_tok - 1];
        memcpy(feed + 1, d->draft, (size_t)K * sizeof(int));
        engine_forward(e, feed, T, d->pos, 1, K > 0);
        int n = engine_accept(e, feed, T, d->temp, d->topp, d->seed, (uint64_t)d->pos + 1);
        if (n < 0 && (d->dump || d->dump_mtp)) engine_outcome(e, T, 0, out), n = out[0];   /* the dumps keep n + 1 rows */
        if (d->dump) dec_keep_rows(d, &d->rows, &d->rows_cap, d->pos, n + 1, d->e->c.vocab);
        d->base = d->pos;
        int made = n < 0 ? T : n + 1;   /* at most */
        int k = dec_draft(d, NULL, made, d->base, n, made);
        engine_outcome(e, T, k, out);
        n = out[0];
        memcpy(d->tok, out + 1, (size_t)(n + 1) * sizeof(int));
        if (K) d->steps++, d->fed += K, d->accepted += n, d->hist[n]++;
        d->pos = d->base + n + 1;
        d->n_tok = n + 1;
        dec_take_drafts(d, out + T + 1, k);
    }
    d->next = 0;
    return dec_next(d);
}

/* The caller takes no more tokens: the state goes back to having consumed all it was handed but
 * the last (as plain decoding leaves it: the last sampled token is not fed). */
static void dec_stop(Decoder *d) {
    if (d->next == d->n_tok) return;
    engine_rewind(d->e, d->next - 1);
    d->pos = d->base + d->next;
    d->n_tok = d->next;
}

/* ------------------------------------------------------------------------------------------------
 * JSON: a small DOM parser (config.json, safetensors headers, tokenizer.json)
 * ---------------------------------------------------------------------------------------------- */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } JType;

/* A document may hold at most 1 GiB of text (so every length fits an int) and 4M values (72 bytes
 * each: a flat array cannot make a small file cost gigabytes). The largest tokenizer.json nemoh
 * reads, Tekken's, has 0.95M. */
enum { JSON_MAX_BYTES = 1 << 30, JSON_MAX_NODES = 1 << 22 };

typedef struct Json Json;
struct Json {
    JType type;                 /* kind of value */
    double num;                 /* J_NUM value (also Infinity, -Infinity, NaN, as Python writes them), J_BOOL 0/1 */
    const char *str;            /* J_STR: decoded, valid UTF-8, NUL-terminated */
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
        if (p->used == JSON_MAX_NODES) json_fail(p, "more than 4194304 values");
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
 * the input, so writing behind the read position is safe. Raw bytes must be UTF-8 (RFC 8259): a
 * token or name that is not would split characters wherever it matched. */
static char *json_string(JsonParser *p, int *len) {
    char *out = p->buf + p->pos, *w = out;
    for (;;) {
        if (p->pos >= p->len) json_fail(p, "unterminated string");
        unsigned char ch = (unsigned char)p->buf[p->pos++];
        if (ch == '"') break;
        if (ch < 0x20) json_fail(p, "control character in string");
        if (ch >= 0x80) {
            unsigned cp;
            int r = utf8_check((const unsigned char *)p->buf + p->pos - 1, p->len - p->pos + 1, &cp);
            if (r <= 0) json_fail(p, "invalid UTF-8 in string");
            memmove(w, p->buf + p->pos - 1, (size_t)r);
            w += r;
            p->pos += (size_t)r - 1;
            continue;
        }
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

/* A number exactly as JSON writes it, -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, converted by
 * strtod (which alone would also take hex, "inf" and "nan"). Too large a magnitude gives +-inf. */
static double json_number(JsonParser *p) {
    const char *b = p->buf;
    size_t i = p->pos + (b[p->pos] == '-'), d;
    if (b[i] == '0') i++;
    else if (b[i] >= '1' && b[i] <= '9') while (b[i] >= '0' && b[i] <= '9') i++;
    else json_fail(p, "bad number");
    if (b[i] == '.') {
        for (d = ++i; b[i] >= '0' && b[i] <= '9'; i++) {}
        if (i == d) json_fail(p, "bad number");
    }
    if (b[i] == 'e' || b[i] == 'E') {
        i += b[i + 1] == '+' || b[i + 1] == '-' ? 2 : 1;
        for (d = i; b[i] >= '0' && b[i] <= '9'; i++) {}
        if (i == d) json_fail(p, "bad number");
    }
    char save = p->buf[i];   /* the text is NUL-terminated at len, so b[i] never reads past it */
    p->buf[i] = 0;
    double v = strtod(b + p->pos, NULL);
    p->buf[i] = save;
    p->pos = i;
    return v;
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
        p->pool[self].type = J_NUM;
        p->pool[self].num = json_number(p);
    } else {
        json_fail(p, "unexpected character");
    }
    p->depth--;
    return self;
}

/* Parses text[0..len) (copied; text itself is not modified). Dies naming `what` on malformed input. */
static JsonDoc json_parse(const char *text, size_t len, const char *what) {
    if (len > JSON_MAX_BYTES) die("%s: larger than %d bytes of JSON", what, JSON_MAX_BYTES);
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

/* 1 if j is a number with an integer value in [lo, hi] (|hi| <= 2^53, where doubles are exact),
 * stored in *v. Every integer nemoh reads from a file comes through here. */
static int json_int(const Json *j, int64_t lo, int64_t hi, int64_t *v) {
    if (!j || j->type != J_NUM || !(j->num >= (double)lo && j->num <= (double)hi) || j->num != floor(j->num))
        return 0;
    *v = (int64_t)j->num;
    return 1;
}

/* Element i of array a, or NULL. */
static const Json *json_at(const Json *a, int i) {
    if (!a || a->type != J_ARR || i < 0 || i >= a->n) return NULL;
    const Json *e = a->child;
    while (i--) e = e->next;
    return e;
}

/* ------------------------------------------------------------------------------------------------
 * Config: config.json in NVIDIA's form (hybrid_override_pattern) or transformers' (layers_block_type)
 * ---------------------------------------------------------------------------------------------- */

/* An integer config value; `need`: die if absent, else return `def`. */
static int cfg_int(const Json *root, const char *path, const char *key, int need, int def) {
    const Json *v = json_get(root, key);
    int64_t x;
    if (!v || v->type == J_NULL) {
        if (need) die("%s: missing key %s", path, key);
        return def;
    }
    if (!json_int(v, 0, 1000000000, &x)) die("%s: %s must be an integer from 0 to 10^9", path, key);
    return (int)x;
}

/* A boolean config value (true or false: a string "true" is refused, not read as anything). */
static int cfg_bool(const Json *root, const char *path, const char *key, int def) {
    const Json *v = json_get(root, key);
    if (!v || v->type == J_NULL) return def;
    if (v->type != J_BOOL) die("%s: %s must be true or false", path, key);
    return v->num != 0;
}

/* A boolean that nemoh only supports in one state (biases, for instance). */
static void cfg_require(const Json *root, const char *path, const char *key, int want) {
    if (cfg_bool(root, path, key, want) != want) die("%s: %s = %s is not supported", path, key, want ? "false" : "true");
}

/* Sizes the engine forms from the config, computed in 64 bits and held to explicit limits, so that
 * no int arithmetic on them (nor a chunk of up to 65536 tokens times one, in size_t) can overflow. */
enum { WIDTH_MAX = 1 << 24, CTX_MAX = 1 << 24, CONV_MAX = 64 };
static void cfg_limit(const char *path, const char *what, int64_t v, int64_t max) {
    if (v > max) die("%s: %s = %lld, more than nemoh's limit of %lld", path, what, (long long)v, (long long)max);
}

static void cfg_act(const Json *root, const char *path, const char *key, const char *want) {
    const Json *v = json_get(root, key);
    if (v && (v->type != J_STR || strcmp(v->str, want) != 0))
        die("%s: %s must be \"%s\"", path, key, want);
}

/* The mixture-of-experts keys (Nemotron 3): experts, the router's grouped top-k, latent and shared
 * experts. A router transformers would run with fewer candidates than it picks is refused. */
static void config_moe(Config *c, const Json *root, const char *path) {
    c->n_experts = cfg_int(root, path, "n_routed_experts", 1, 0);
    c->top_k = cfg_int(root, path, "num_experts_per_tok", 1, 0);
    c->n_group = cfg_int(root, path, "n_group", 0, 1);
    c->topk_group = cfg_int(root, path, "topk_group", 0, 1);
    c->moe = cfg_int(root, path, "moe_intermediate_size", 1, 0);
    c->shared = cfg_int(root, path, "moe_shared_expert_intermediate_size", 1, 0);
    c->latent = cfg_int(root, path, "moe_latent_size", 0, 0);
    /* transformers adds exactly one shared expert whatever n_shared_experts says; vLLM multiplies */
    if (cfg_int(root, path, "n_shared_experts", 0, 1) != 1) die("%s: n_shared_experts must be 1", path);
    const Json *scale = json_get(root, "routed_scaling_factor");
    c->norm_topk = cfg_bool(root, path, "norm_topk_prob", 1);  /* transformers' default */
    if (scale && (scale->type != J_NUM || !(fabs(scale->num) < 1e6)))
        die("%s: routed_scaling_factor must be a number", path);
    c->routed_scale = scale ? (float)scale->num : 1.0f;
    if (!c->n_experts || !c->moe || !c->shared)
        die("%s: n_routed_experts, moe_intermediate_size, moe_shared_expert_intermediate_size must be positive", path);
    if (c->top_k < 1 || c->top_k > c->n_experts)
        die("%s: num_experts_per_tok = %d must be from 1 to n_routed_experts = %d", path, c->top_k, c->n_experts);
    if (c->n_group < 1 || c->n_experts % c->n_group)
        die("%s: n_group = %d must divide n_routed_experts = %d", path, c->n_group, c->n_experts);
    if (c->topk_group < 1 || c->topk_group > c->n_group)
        die("%s: topk_group = %d must be from 1 to n_group = %d", path, c->topk_group, c->n_group);
    int per = c->n_experts / c->n_group;
    if (c->n_group > 1 && per < 2) die("%s: with n_group > 1 every group needs 2 experts (it scores by its top two)", path);
    if (c->top_k > c->topk_group * per)
        die("%s: num_experts_per_tok = %d is more than the %d experts of topk_group = %d groups", path, c->top_k,
            c->topk_group * per, c->topk_group);
    cfg_act(root, path, "mlp_hidden_act", "relu2");
    cfg_require(root, path, "mlp_bias", 0);
}

/* Dies unless dir is a directory (before any file in it is named in an error). */
static void model_dir(const char *dir) {
    struct stat st;
    if (stat(dir, &st) != 0) die("%s: no such model directory", dir);
    if (!S_ISDIR(st.st_mode)) die("%s: not a directory (-m names the model directory)", dir);
}

/* The config from the text of config.json (path: for messages). */
/* A layer pattern into kind[0..max): the string `pat_key` ("M*-E", one letter a layer) or the list
 * `list_key` (["mamba", "attention", ...], transformers' names). Returns the number of layers. */
static int config_kinds(char *kind, int max, const Json *root, const char *path, const char *pat_key, const char *list_key) {
    const Json *pat = json_get(root, pat_key), *types = json_get(root, list_key);
    int n = 0;
    if (types && types->type == J_ARR) {
        for (const Json *e = types->child; e; e = e->next) {
            if (n == max) die("%s: more than %d layers", path, MAX_LAYERS);
            const char *s = e->type == J_STR ? e->str : "";
            char k = !strcmp(s, "mamba") || !strcmp(s, "linear_attention") ? K_MAMBA
                   : !strcmp(s, "attention") || !strcmp(s, "full_attention") ? K_ATTN
                   : !strcmp(s, "mlp") ? K_MLP : !strcmp(s, "moe") ? K_MOE : '?';
            if (k == '?') die("%s: %s: layer %d has unknown block type \"%s\"", path, list_key, n, s);
            kind[n++] = k;
        }
    } else if (pat && pat->type == J_STR) {
        if (pat->len > max) die("%s: more than %d layers", path, MAX_LAYERS);
        for (int i = 0; i < pat->len; i++) {
            char k = pat->str[i];
            if (!strchr("M*-E", k) || !k) die("%s: layer %d has unknown block type '%c' in %s", path, i, k, pat_key);
            kind[n++] = k;
        }
    } else {
        die("%s: missing key %s (or %s)", path, pat_key, list_key);
    }
    return n;
}

static void config_parse(Config *c, const char *text, size_t len, const char *path) {
    JsonDoc doc = json_parse(text, len, path);
    const Json *root = &doc.nodes[0];
    if (root->type != J_OBJ) die("%s: not a JSON object", path);
    memset(c, 0, sizeof *c);

    /* The layer pattern: one character per layer, 'M' Mamba2, '*' attention, '-' MLP, 'E' MoE. */
    c->n_layers = config_kinds(c->kind, MAX_LAYERS, root, path, "hybrid_override_pattern", "layers_block_type");
    if (c->n_layers == 0) die("%s: the model has no layers", path);
    int nl = cfg_int(root, path, "num_hidden_layers", 0, c->n_layers);
    if (nl != c->n_layers) die("%s: num_hidden_layers is %d but the pattern has %d layers", path, nl, c->n_layers);
    /* The multi-token prediction block, its sublayers after the blocks; every release has one block */
    int nextn = cfg_int(root, path, "num_nextn_predict_layers", 0, 0);
    if (nextn > 1) die("%s: num_nextn_predict_layers is %d; nemoh runs one MTP block (the published models have one)", path, nextn);
    if (nextn) {
        c->n_mtp = config_kinds(c->kind + c->n_layers, MAX_LAYERS - c->n_layers, root, path, "mtp_hybrid_override_pattern",
                                "mtp_layers_block_type");
        if (!c->n_mtp) die("%s: num_nextn_predict_layers is 1 but the MTP pattern is empty", path);
        if (memchr(c->kind + c->n_layers, K_MAMBA, (size_t)c->n_mtp))
            die("%s: the MTP block has a Mamba sublayer; nemoh's drafts need attention, MLP or MoE ones (as published)", path);
    }
    int has_m = has_kind(c, K_MAMBA), has_a = has_kind(c, K_ATTN), has_f = has_kind(c, K_MLP);

    c->vocab = cfg_int(root, path, "vocab_size", 1, 0);
    c->hidden = cfg_int(root, path, "hidden_size", 1, 0);
    const Json *eps = json_get(root, "rms_norm_eps");
    if (!eps) eps = json_get(root, "layer_norm_epsilon");
    if (eps && (eps->type != J_NUM || !(eps->num >= FLT_MIN && eps->num < 1)))   /* 0 as a float below */
        die("%s: the norm epsilon must be a number from %g (a normal float) to 1", path, FLT_MIN);
    c->eps = eps ? (float)eps->num : 1e-5f;  /* transformers' default */
    c->ctx = cfg_int(root, path, "max_position_embeddings", 0, 4096);
    if (has_a) {
        c->n_heads = cfg_int(root, path, "num_attention_heads", 1, 0);
        c->n_kv = cfg_int(root, path, "num_key_value_heads", 0, c->n_heads);
        int hd = cfg_int(root, path, "head_dim", 0, 0);
        c->head_dim = hd ? hd : cfg_int(root, path, "attention_head_dim", 0, c->n_heads ? c->hidden / c->n_heads : 0);
        if (!c->n_heads || !c->n_kv || !c->head_dim || c->n_heads % c->n_kv)
            die("%s: num_attention_heads must be a positive multiple of num_key_value_heads", path);
        cfg_require(root, path, "attention_bias", 0);
    }
    if (has_f) {
        c->mlp = cfg_int(root, path, "intermediate_size", 1, 0);
        cfg_act(root, path, "mlp_hidden_act", "relu2");
        cfg_require(root, path, "mlp_bias", 0);
    }
    if (has_m) {
        c->m_heads = cfg_int(root, path, "mamba_num_heads", 1, 0);
        c->m_hdim = cfg_int(root, path, "mamba_head_dim", 1, 0);
        c->n_groups = cfg_int(root, path, "n_groups", 1, 0);
        c->d_state = cfg_int(root, path, "ssm_state_size", 1, 0);
        c->d_conv = cfg_int(root, path, "conv_kernel", 1, 0);
        c->conv_bias = cfg_bool(root, path, "use_conv_bias", 1);
        if (!c->m_heads || !c->m_hdim || !c->n_groups || !c->d_state || !c->d_conv || c->m_heads % c->n_groups)
            die("%s: mamba_num_heads must be a positive multiple of n_groups (and sizes positive)", path);
        cfg_act(root, path, "mamba_hidden_act", "silu");
        cfg_require(root, path, "mamba_proj_bias", 0);
        cfg_require(root, path, "use_bias", 0);
    }
    if (has_kind(c, K_MOE)) config_moe(c, root, path);
    if (!c->vocab || !c->hidden || !c->ctx) die("%s: vocab_size, hidden_size and max_position_embeddings must be positive", path);
    int64_t di = (int64_t)c->m_heads * c->m_hdim, gn = (int64_t)c->n_groups * c->d_state;
    int64_t q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv * c->head_dim;
    cfg_limit(path, "vocab_size", c->vocab, WIDTH_MAX);
    cfg_limit(path, "hidden_size", c->hidden, WIDTH_MAX);
    cfg_limit(path, "intermediate_size", c->mlp, WIDTH_MAX);
    cfg_limit(path, "max_position_embeddings", c->ctx, CTX_MAX);
    cfg_limit(path, "num_attention_heads * head_dim + 2 * num_key_value_heads * head_dim", q + 2 * kv, WIDTH_MAX);
    cfg_limit(path, "mamba in_proj rows (2 * heads * head_dim + 2 * n_groups * state + heads)", 2 * di + 2 * gn + c->m_heads, WIDTH_MAX);
    cfg_limit(path, "conv_kernel", c->d_conv, CONV_MAX);
    cfg_limit(path, "n_routed_experts", c->n_experts, 1 << 16);
    cfg_limit(path, "moe_intermediate_size", c->moe, WIDTH_MAX);
    cfg_limit(path, "moe_shared_expert_intermediate_size", c->shared, WIDTH_MAX);
    cfg_limit(path, "moe_latent_size", c->latent, WIDTH_MAX);

    /* eos_token_id: an id or a list of ids, each an integer */
    const Json *eos = json_get(root, "eos_token_id");
    int n_eos = eos && eos->type == J_ARR ? eos->n : eos && eos->type != J_NULL ? 1 : 0;
    if (n_eos > MAX_EOS) die("%s: eos_token_id lists more than %d ids", path, MAX_EOS);
    for (int i = 0; i < n_eos; i++) {
        int64_t id;
        if (!json_int(eos->type == J_ARR ? json_at(eos, i) : eos, 0, c->vocab - 1, &id))
            die("%s: eos_token_id must be a token id (an integer from 0 to vocab_size - 1) or a list of them", path);
        c->eos[c->n_eos++] = (int)id;
    }
    json_free(&doc);
}

static void config_load(Config *c, const char *dir) {
    char path[4096];
    size_t len;
    model_dir(dir);
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = read_text(path, &len, 1 << 20);
    if (!text) die("%s: cannot open: %s (%s is not a model directory: -m names one)", path, strerror(errno), dir);
    config_parse(c, text, len, path);
    free(text);
}

/* ------------------------------------------------------------------------------------------------
 * Safetensors: mmapped checkpoint files and their tensor tables
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    char *name;                 /* tensor name as stored */
    int dtype;                  /* DT_F32 / DT_BF16 / DT_F16 / DT_FP8 (F8_E4M3) / DT_U8 */
    int ndim;                   /* number of dimensions (<= 4) */
    long shape[4];              /* [ndim] */
    const void *data;           /* first byte, inside the file's mapping */
    const char *file;           /* the file it came from, for messages */
} Tensor;

typedef struct {
    char *path;                 /* file path */
    void *map;                  /* mmapped contents */
    size_t size;                /* file size in bytes */
} MappedFile;

/* What a ModelOpt quantization config says (hf_quant_config.json, or config.json's
 * quantization_config): which projections are stored quantized, and how. Each matrix's format is read
 * from its own tensors (load_mat); this is the cross-check that refuses a disagreement. */
enum { Q_MIXED = -1, Q_ANY = -2 };   /* algo beside 0 (none), DT_FP8, DT_NVFP4 */
typedef struct {
    int algo;                   /* 0: no config; DT_FP8 / DT_NVFP4: every projection not excluded;
                                   Q_MIXED: those in quantized_layers; Q_ANY: as stored (--random) */
    char **exclude;             /* [n_exclude] exclude_modules / ignore: fnmatch patterns of modules */
    int n_exclude;
    char **mod;                 /* [n_mod] MIXED_PRECISION quantized_layers' modules, sorted */
    int *mod_fmt;               /* [n_mod] their formats, DT_FP8 or DT_NVFP4 */
    int n_mod;
    char src[4200];             /* which file says it, for messages */
} QuantCfg;

struct Checkpoint {
    const char *dir;            /* checkpoint directory */
    QuantCfg q;                 /* its quantization config */
    MappedFile file[256];       /* [n_files] safetensors files */
    int n_files;
    Tensor *t;                  /* [n] all tensors of all files, sorted by name once loaded */
    int n, cap;
    int owned;                  /* 1: tensor data is malloc'ed (a synthetic checkpoint), not mapped */
};

static const char *dtype_name[] = {"F32", "BF16", "F16", "F8_E4M3", "U8", "NVFP4"};
static const int dtype_size[] = {4, 2, 2, 1, 1};   /* bytes an element, of the dtypes a file holds */

/* A new tensor slot at the end of ck->t, the array doubled when full. */
static Tensor *ck_add(Checkpoint *ck) {
    if (ck->n == ck->cap) {
        ck->cap = ck->cap ? 2 * ck->cap : 256;
        if (!(ck->t = realloc(ck->t, (size_t)ck->cap * sizeof(Tensor)))) die("out of memory");
    }
    return &ck->t[ck->n++];
}

typedef struct { size_t begin, end; const char *name; } Span;

static int span_cmp(const void *a, const void *b) {
    const Span *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* The tensor table of one .safetensors file in memory, [u64 header length][JSON header][data]:
 * every tensor's dtype, shape and byte range checked against the file before anything reads it. */
static void st_parse(Checkpoint *ck, const char *path, const char *file, size_t size) {
    uint64_t hlen;
    if (size < 8) die("%s: truncated: %zu bytes, shorter than the 8-byte header length", path, size);
    memcpy(&hlen, file, 8);  /* little-endian, as is every machine nemoh runs on */
    if (hlen > size - 8) die("%s: header length %llu exceeds the file size %zu", path, (unsigned long long)hlen, size);
    if (hlen > 100000000) die("%s: header of %llu bytes, more than the format's 100 MB", path, (unsigned long long)hlen);
    const char *data = file + 8 + hlen;
    size_t data_size = size - 8 - hlen;
    JsonDoc doc = json_parse(file + 8, hlen, path);
    const Json *root = &doc.nodes[0];
    if (root->type != J_OBJ) die("%s: header is not a JSON object", path);
    Span *spans = xcalloc((size_t)root->n, sizeof(Span));
    int n_spans = 0;
    for (const Json *e = root->child; e; e = e->next) {
        if (e->klen == 12 && memcmp(e->key, "__metadata__", 12) == 0) continue;
        if (memchr(e->key, 0, (size_t)e->klen)) die("%s: a tensor name holds a NUL character", path);
        const Json *dt = json_get(e, "dtype"), *shape = json_get(e, "shape"), *off = json_get(e, "data_offsets");
        if (!dt || dt->type != J_STR || !shape || shape->type != J_ARR || !off || off->type != J_ARR || off->n != 2)
            die("%s: tensor %s: header entry needs dtype, shape and data_offsets", path, e->key);
        Tensor t = {0};
        t.dtype = -1;
        for (int i = 0; i <= DT_U8; i++) if (strcmp(dt->str, dtype_name[i]) == 0) t.dtype = i;
        if (t.dtype < 0) die("%s: tensor %s has dtype %s; nemoh reads F32, BF16, F16, F8_E4M3 and U8", path, e->key, dt->str);
        if (shape->n > 4) die("%s: tensor %s has %d dimensions (at most 4)", path, e->key, shape->n);
        uint64_t numel = 1;
        for (const Json *d = shape->child; d; d = d->next) {
            int64_t v;
            if (!json_int(d, 0, (int64_t)1 << 40, &v) || __builtin_mul_overflow(numel, (uint64_t)v, &numel))
                die("%s: tensor %s: bad shape", path, e->key);
            t.shape[t.ndim++] = (long)v;
        }
        int64_t b, en;
        if (!json_int(json_at(off, 0), 0, (int64_t)data_size, &b) || !json_int(json_at(off, 1), b, (int64_t)data_size, &en))
            die("%s: tensor %s: data_offsets [%.0f, %.0f] lie outside the file's %zu data bytes", path, e->key,
                json_at(off, 0)->num, json_at(off, 1)->num, data_size);
        if (numel > (uint64_t)data_size || (uint64_t)(en - b) != numel * (uint64_t)dtype_size[t.dtype])
            die("%s: tensor %s: %lld bytes for %llu %s elements", path, e->key, (long long)(en - b),
                (unsigned long long)numel, dtype_name[t.dtype]);
        if ((8 + hlen + (uint64_t)b) % (uint64_t)dtype_size[t.dtype] != 0)
            die("%s: tensor %s is not aligned to its element size", path, e->key);
        t.name = xstrdup(e->key);
        t.data = data + b;
        t.file = path;
        if (en > b) spans[n_spans++] = (Span){(size_t)b, (size_t)en, t.name};   /* empty ones overlap nothing */
        *ck_add(ck) = t;
    }
    qsort(spans, (size_t)n_spans, sizeof(Span), span_cmp);
    for (int i = 1; i < n_spans; i++)
        if (spans[i].begin < spans[i - 1].end)
            die("%s: tensors %s and %s overlap", path, spans[i - 1].name, spans[i].name);
    free(spans);
    json_free(&doc);
}

/* A read from a mapped file that was truncated while nemoh ran raises SIGBUS: say which file (any
 * other bus error is left to the default action, once the handler returns). */
static const Checkpoint *mapped_ck;
static void on_sigbus(int sig, siginfo_t *si, void *ctx) {
    (void)ctx;
    const char *path = NULL;
    for (int i = 0; mapped_ck && i < mapped_ck->n_files; i++) {
        const MappedFile *f = &mapped_ck->file[i];
        if ((const char *)si->si_addr >= (const char *)f->map && (const char *)si->si_addr < (const char *)f->map + f->size)
            path = f->path;
    }
    if (!path) { signal(sig, SIG_DFL); return; }
    static const char pre[] = "nemoh: ", post[] = ": cannot read: the file was truncated or replaced while nemoh ran\n";
    char name[1024];
    size_t n = escape_text(name, sizeof name, path, strlen(path));
    if (write(2, pre, sizeof pre - 1) < 0 || write(2, name, n) < 0 || write(2, post, sizeof post - 1) < 0) _exit(1);
    _exit(1);
}

/* Maps one .safetensors file and reads its tensor table. */
static void st_open(Checkpoint *ck, const char *path) {
    if (ck->n_files == (int)(sizeof ck->file / sizeof ck->file[0])) die("%s: too many shard files", path);
    int fd = open(path, O_RDONLY);
    if (fd < 0) die("%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) die("%s: not a regular file", path);
    size_t size = (size_t)st.st_size;
    if (size < 8) die("%s: truncated: %zu bytes, shorter than the 8-byte header length", path, size);
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) die("%s: mmap failed: %s", path, strerror(errno));
    close(fd);
    MappedFile *mf = &ck->file[ck->n_files++];
    mf->path = xstrdup(path);
    mf->map = map;
    mf->size = size;
    mapped_ck = ck;
    struct sigaction sa = {.sa_sigaction = on_sigbus, .sa_flags = SA_SIGINFO};
    sigaction(SIGBUS, &sa, NULL);
    st_parse(ck, mf->path, map, size);
}

static int tensor_cmp(const void *a, const void *b) { return strcmp(((const Tensor *)a)->name, ((const Tensor *)b)->name); }

static const Tensor *st_lookup(const Checkpoint *ck, const char *name) {
    Tensor key = {0};
    key.name = (char *)name;
    return ck->n ? bsearch(&key, ck->t, (size_t)ck->n, sizeof(Tensor), tensor_cmp) : NULL;
}

/* Sorts the tensors by name, so that lookups are binary searches (a checkpoint with one tensor per
 * expert has tens of thousands), and refuses a name that appears twice. */
static void st_sort(Checkpoint *ck) {
    if (ck->n) qsort(ck->t, (size_t)ck->n, sizeof(Tensor), tensor_cmp);   /* a table may be empty (t NULL) */
    for (int i = 1; i < ck->n; i++)
        if (!strcmp(ck->t[i].name, ck->t[i - 1].name))
            die("%s: tensor %s appears twice (%s and %s)", ck->dir, ck->t[i].name, ck->t[i - 1].file, ck->t[i].file);
}

/* ---- The quantization config (ModelOpt) ---- */

static int str_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* A quant_algo value as a format (upper-cased first, as vLLM does: ModelOpt may write lowercase):
 * FP8 (per tensor) and NVFP4 / W4A16_NVFP4 (the same tensors, run weight-only either way), or
 * MIXED_PRECISION where allowed. Any other algorithm is refused by name. */
static int quant_algo(const Json *v, const char *path, int mixed_ok) {
    char a[64] = "";
    if (!v || v->type != J_STR) die("%s: quant_algo must be a string", path);
    for (int i = 0; i < v->len && i < 63; i++) a[i] = (char)toupper((unsigned char)v->str[i]);
    if (!strcmp(a, "FP8")) return DT_FP8;
    if (!strcmp(a, "NVFP4") || !strcmp(a, "W4A16_NVFP4")) return DT_NVFP4;
    if (mixed_ok && !strcmp(a, "MIXED_PRECISION")) return Q_MIXED;
    die("%s: quant_algo \"%s\" is not supported (nemoh reads FP8, NVFP4, W4A16_NVFP4%s)", path, v->str,
        mixed_ok ? " and MIXED_PRECISION" : "");
    return 0;
}

/* group_size, where given, must be NVFP4's 16 (FP8 per tensor has none). */
static void quant_group(const Json *o, int fmt, const char *path) {
    const Json *g = json_get(o, "group_size");
    int64_t v;
    if (g && g->type != J_NULL && fmt == DT_NVFP4 && (!json_int(g, 0, 1 << 30, &v) || v != 16))
        die("%s: group_size must be 16 for NVFP4 (blocks of 16 elements)", path);
}

/* One config object: hf_quant_config.json's "quantization" (exclude_modules) or config.json's
 * quantization_config (ignore), both with quant_algo and, for MIXED_PRECISION, quantized_layers. */
static void quant_parse(QuantCfg *q, const Json *o, const char *path, const char *exclude_key) {
    if (!o || o->type != J_OBJ) die("%s: the quantization config must be a JSON object", path);
    q->algo = quant_algo(json_get(o, "quant_algo"), path, 1);
    snprintf(q->src, sizeof q->src, "%s", path);
    if (q->algo != Q_MIXED) quant_group(o, q->algo, path);
    const Json *ex = json_get(o, exclude_key);
    if (ex && ex->type != J_NULL && ex->type != J_ARR) die("%s: %s must be a list of module names", path, exclude_key);
    q->n_exclude = ex && ex->type == J_ARR ? ex->n : 0;
    q->exclude = xcalloc((size_t)q->n_exclude, sizeof(char *));
    for (int i = 0; i < q->n_exclude; i++) {
        const Json *e = json_at(ex, i);
        if (e->type != J_STR) die("%s: %s must be a list of module names", path, exclude_key);
        q->exclude[i] = xstrdup(e->str);
    }
    const Json *ql = json_get(o, "quantized_layers");
    if (q->algo != Q_MIXED) return;
    if (!ql || ql->type != J_OBJ) die("%s: MIXED_PRECISION needs a quantized_layers object", path);
    q->n_mod = ql->n;
    q->mod = xcalloc((size_t)q->n_mod, sizeof(char *));
    q->mod_fmt = xcalloc((size_t)q->n_mod, sizeof(int));
    int i = 0;
    for (const Json *e = ql->child; e; e = e->next, i++) {
        if (e->type != J_OBJ) die("%s: quantized_layers entry %s must be an object", path, e->key);
        q->mod[i] = xstrdup(e->key);
    }
    qsort(q->mod, (size_t)q->n_mod, sizeof(char *), str_cmp);
    for (const Json *e = ql->child; e; e = e->next) {
        char **at = bsearch(&e->key, q->mod, (size_t)q->n_mod, sizeof(char *), str_cmp);
        int fmt = quant_algo(json_get(e, "quant_algo"), path, 0);
        quant_group(e, fmt, path);
        q->mod_fmt[at - q->mod] = fmt;
    }
    for (int k = 1; k < q->n_mod; k++)
        if (!strcmp(q->mod[k], q->mod[k - 1])) die("%s: quantized_layers names %s twice", path, q->mod[k]);
}

static void quant_free(QuantCfg *q) {
    for (int i = 0; i < q->n_exclude; i++) free(q->exclude[i]);
    for (int i = 0; i < q->n_mod; i++) free(q->mod[i]);
    free(q->exclude);
    free(q->mod);
    free(q->mod_fmt);
    memset(q, 0, sizeof *q);
}

/* The directory's quantization config: hf_quant_config.json (ModelOpt always writes it) and/or
 * config.json's quantization_config (newer exports; quant_method "modelopt"). Both: they must agree. */
static void quant_load(QuantCfg *q, const char *dir) {
    char path[4096];
    size_t len;
    memset(q, 0, sizeof *q);
    snprintf(path, sizeof path, "%s/hf_quant_config.json", dir);
    char *text = read_text(path, &len, 256u << 20);
    if (text) {
        JsonDoc doc = json_parse(text, len, path);
        quant_parse(q, json_get(&doc.nodes[0], "quantization"), path, "exclude_modules");
        json_free(&doc);
        free(text);
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!(text = read_text(path, &len, 1 << 20))) return;
    JsonDoc doc = json_parse(text, len, path);
    const Json *qc = json_get(&doc.nodes[0], "quantization_config"), *m = qc ? json_get(qc, "quant_method") : NULL;
    if (qc && qc->type != J_NULL) {
        if (!m || m->type != J_STR || strcmp(m->str, "modelopt")) {
            /* the name copied and the text freed first: nothing live points at the text when die() exits,
               and LeakSanitizer would count it lost */
            char method[128] = "(missing)";
            if (m && m->type == J_STR) snprintf(method, sizeof method, "\"%s\"", m->str);
            json_free(&doc);
            free(text);
            die("%s: quantization_config's quant_method %s is not supported (nemoh reads ModelOpt's FP8 and NVFP4 checkpoints)",
                path, method);
        }
        QuantCfg c = {0};
        quant_parse(&c, qc, path, "ignore");
        if (q->algo && c.algo != q->algo) die("%s: quantization_config's quant_algo disagrees with %s", path, q->src);
        if (!q->algo) { *q = c; c = (QuantCfg){0}; }
        quant_free(&c);
    }
    json_free(&doc);
    free(text);
}

/* The format the config gives module `name` (a weight's tensor name less ".weight"): 0 unquantized,
 * DT_FP8 or DT_NVFP4; Q_ANY: whatever is stored. Exclude entries are fnmatch patterns, or a parent module. */
static int quant_expect(const QuantCfg *q, const char *name) {
    if (q->algo == Q_ANY || q->algo == 0) return q->algo;
    if (q->algo == Q_MIXED) {
        char **at = bsearch(&name, q->mod, (size_t)q->n_mod, sizeof(char *), str_cmp);
        return at ? q->mod_fmt[at - q->mod] : 0;
    }
    for (int i = 0; i < q->n_exclude; i++) {
        size_t n = strlen(q->exclude[i]);
        if (!fnmatch(q->exclude[i], name, 0) || (!strncmp(name, q->exclude[i], n) && name[n] == '.')) return 0;
    }
    return q->algo;
}

/* A checkpoint directory: model.safetensors, or the shards that model.safetensors.index.json names. */
static void build_checkpoint(Checkpoint *ck, const char *dir) {
    char path[4096];
    memset(ck, 0, sizeof *ck);
    ck->dir = dir;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    size_t len;
    char *text = read_text(path, &len, 1 << 28);
    if (text) {
        JsonDoc doc = json_parse(text, len, path);
        const Json *map = json_get(&doc.nodes[0], "weight_map");
        if (!map || map->type != J_OBJ || map->n == 0) die("%s: no weight_map object", path);
        for (const Json *e = map->child; e; e = e->next) {
            if (e->type != J_STR || strchr(e->str, '/')) die("%s: bad file name for %s", path, e->key);
            char shard[4096];
            snprintf(shard, sizeof shard, "%s/%s", dir, e->str);
            int seen = 0;
            for (int i = 0; i < ck->n_files; i++) seen |= strcmp(ck->file[i].path, shard) == 0;
            if (!seen) st_open(ck, shard);
        }
        st_sort(ck);
        for (const Json *e = map->child; e; e = e->next)  /* every indexed tensor must exist */
            if (!st_lookup(ck, e->key)) die("%s: tensor %s is indexed but missing from %s", path, e->key, e->str);
        json_free(&doc);
        free(text);
    } else {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (!file_exists(path)) die("%s: no model.safetensors or model.safetensors.index.json", dir);
        st_open(ck, path);
        st_sort(ck);
    }
    quant_load(&ck->q, dir);
}

static void free_checkpoint(Checkpoint *ck) {
    quant_free(&ck->q);
    for (int i = 0; i < ck->n; i++) {
        free(ck->t[i].name);
        if (ck->owned) free((void *)ck->t[i].data);
    }
    free(ck->t);
    for (int i = 0; i < ck->n_files; i++) {
        munmap(ck->file[i].map, ck->file[i].size);
        free(ck->file[i].path);
    }
    if (mapped_ck == ck) mapped_ck = NULL;
    memset(ck, 0, sizeof *ck);
}

/* Finds a tensor under NVIDIA's `backbone.` prefix or transformers' `model.` prefix (or none). */
static const Tensor *st_find(const Checkpoint *ck, const char *name) {
    static const char *prefix[] = {"backbone.", "model.", ""};
    char full[640];
    for (int p = 0; p < 3; p++) {
        snprintf(full, sizeof full, "%s%s", prefix[p], name);
        const Tensor *t = st_lookup(ck, full);
        if (t) return t;
    }
    return NULL;
}

/* Dies: tensor t does not have the shape the config implies (`want`, e.g. "12,20,48"). */
static void st_bad_shape(const Tensor *t, const char *want) {
    char have[96] = "", *p = have;
    for (int i = 0; i < t->ndim; i++) p += sprintf(p, "%s%ld", i ? "," : "", t->shape[i]);
    die("%s: tensor %s has shape [%s], config implies [%s]", t->file, t->name, have, want);
}

/* The tensor `name`, which must exist. */
static const Tensor *st_need(const Checkpoint *ck, const char *name) {
    const Tensor *t = st_find(ck, name);
    if (!t) die("%s: tensor %s not found (looked for backbone.%s, model.%s and %s)", ck->dir, name, name, name, name);
    return t;
}

/* Dies unless tensor t holds plain numbers (F32, BF16, F16): norms, conv, A_log, D, dt_bias, routers
 * and stacked experts are never quantized. */
static void st_float(const Tensor *t) {
    if (t->dtype > DT_F16) die("%s: tensor %s has dtype %s; nemoh reads it as F32, BF16 or F16", t->file, t->name, dtype_name[t->dtype]);
}

/* The tensor `name`, which must exist with exactly the shape the config implies (d1 = 0: 1-D), in F32, BF16 or F16. */
static const Tensor *st_get(const Checkpoint *ck, const char *name, long d0, long d1) {
    const Tensor *t = st_need(ck, name);
    st_float(t);
    /* conv1d.weight is stored [channels, 1, width]: drop the unit middle dimension */
    long s0 = t->shape[0], s1 = t->ndim == 3 && t->shape[1] == 1 ? t->shape[2] : t->ndim >= 2 ? t->shape[1] : 0;
    int ndim = t->ndim == 3 && t->shape[1] == 1 ? 2 : t->ndim;
    if (ndim != (d1 ? 2 : 1) || s0 != d0 || s1 != d1) {
        char want[64];
        snprintf(want, sizeof want, d1 ? "%ld,%ld" : "%ld", d0, d1);
        st_bad_shape(t, want);
    }
    return t;
}

/* A layer's ("layers.L", "mtp.layers.I") routed experts' `proj` ("up_proj" [moe, d] or "down_proj"
 * [d, moe]) stacked in one [n_experts, rows, cols] tensor, as transformers' module holds them; NULL when the checkpoint has one
 * tensor per expert instead (NVIDIA's layout, layers.L.mixer.experts.E.up_proj.weight). */
static const Tensor *st_experts_stacked(const Checkpoint *ck, const char *layer, const char *proj, long E, long rows, long cols) {
    char name[128], want[64];
    snprintf(name, sizeof name, "%s.mixer.experts.%s", layer, proj);
    const Tensor *t = st_find(ck, name);
    snprintf(want, sizeof want, "%ld,%ld,%ld", E, rows, cols);
    if (t && (t->ndim != 3 || t->shape[0] != E || t->shape[1] != rows || t->shape[2] != cols)) st_bad_shape(t, want);
    if (t) st_float(t);   /* ModelOpt writes quantized experts one tensor per expert */
    return t;
}

/* Refuses routed-expert tensors the model does not read (an expert index past n_routed_experts, experts
 * in a layer that is not 'E', both layouts at once, an unknown projection); returns how many mtp.*
 * tensors (multi-token prediction heads, which nemoh does not run) the checkpoint carries. */
static int st_check_extra(const Checkpoint *ck, const Config *c) {
    int mtp = 0;
    for (int i = 0; i < ck->n; i++) {
        const char *name = ck->t[i].name, *rest = name, *tail = NULL;
        if (!strncmp(name, "mtp.", 4)) { mtp++; continue; }
        if (!strncmp(rest, "backbone.", 9)) rest += 9;
        else if (!strncmp(rest, "model.", 6)) rest += 6;
        int l, e = -1, n = 0;
        if (sscanf(rest, "layers.%d.mixer.experts.%n", &l, &n) != 1 || !n) continue;
        tail = rest + n;
        if (isdigit((unsigned char)*tail)) {
            char *end;
            e = (int)strtol(tail, &end, 10);
            tail = end;
        }
        /* one expert's projection: its weight, and a quantized one's scales */
        static const char *part[] = {"weight", "weight_scale", "weight_scale_2", "input_scale"};
        int up = e < 0 && !strcmp(tail, "up_proj"), down = e < 0 && !strcmp(tail, "down_proj");
        for (int k = 0; e >= 0 && k < 4; k++) {
            char a[32], b[32];
            snprintf(a, sizeof a, ".up_proj.%s", part[k]);
            snprintf(b, sizeof b, ".down_proj.%s", part[k]);
            up |= !strcmp(tail, a);
            down |= !strcmp(tail, b);
        }
        if (l < 0 || l >= c->n_layers || c->kind[l] != K_MOE)
            die("%s: tensor %s: layer %d is not a mixture-of-experts layer", ck->t[i].file, name, l);
        if (!up && !down) die("%s: tensor %s: not a routed expert's up_proj or down_proj", ck->t[i].file, name);
        if (e >= c->n_experts) die("%s: tensor %s: expert %d, but n_routed_experts is %d", ck->t[i].file, name, e, c->n_experts);
        char stacked[128];
        snprintf(stacked, sizeof stacked, "layers.%d.mixer.experts.%s", l, up ? "up_proj" : "down_proj");
        if (e >= 0 && st_find(ck, stacked))
            die("%s: tensor %s: the layer's experts are also stored stacked (%s)", ck->t[i].file, name, st_find(ck, stacked)->name);
    }
    return mtp;
}

/* ------------------------------------------------------------------------------------------------
 * Weights: each rank's views into the checkpoint, sliced as shard_sizes() says
 * ---------------------------------------------------------------------------------------------- */

/* Rows [r0, r0+rows) and columns [c0, c0+cols) of a 3-D tensor of stacked experts read as [d0*d1, d2], as a view. */
static Mat mat_view(const Tensor *t, long r0, long rows, long c0, long cols) {
    long ld = t->shape[t->ndim - 1];
    const char *p = t->data ? (const char *)t->data + ((size_t)r0 * (size_t)ld + (size_t)c0) * (size_t)dtype_size[t->dtype] : NULL;
    return (Mat){p, t->dtype, (int)rows, (int)cols, (size_t)ld, NULL, 0, 1.0f};
}

/* A scale beside a weight: one F32 value (shape [] or [1]), finite and >= 0. */
static float st_scale(const Tensor *t) {
    float v;
    if (t->dtype != DT_F32 || t->ndim > 1 || (t->ndim == 1 && t->shape[0] != 1))
        die("%s: tensor %s must be one F32 value (shape [] or [1]); per-channel and block scales are not supported", t->file, t->name);
    memcpy(&v, t->data, 4);
    if (!(v >= 0 && v < INFINITY)) die("%s: tensor %s is %g, not a finite scale >= 0", t->file, t->name, v);
    /* fp8_finite multiplies by 2^8 * scale, which must be finite */
    if (v >= 0x1p120f) die("%s: tensor %s is %g, past the largest scale nemoh takes (below 2^120)", t->file, t->name, v);
    return v;
}

/* Tensor `module.part` (the weight's companions: "weight_scale", ...), or NULL. */
static const Tensor *st_part(const Checkpoint *ck, const char *module, const char *part) {
    char name[600];
    snprintf(name, sizeof name, "%s.%s", module, part);
    return st_lookup(ck, name);
}

static const char *quant_name(int fmt) { return fmt == DT_FP8 ? "FP8" : fmt == DT_NVFP4 ? "NVFP4" : "unquantized"; }

/* Module `name` ("layers.3.mixer.in_proj"; d0 x d1 as the config implies) in the format its own
 * tensors give it, as ModelOpt stores them: a BF16, F16 or F32 weight is plain; an F8_E4M3 weight
 * beside one F32 weight_scale is FP8; a U8 weight [d0, d1/2] beside an F8_E4M3 weight_scale
 * [d0, d1/16] and one F32 weight_scale_2 is NVFP4 (see Mat). An input_scale is checked and not
 * used: activations stay bf16/fp32 (weight-only, as every engine runs these files on Hopper). A
 * projection (proj) must have the format the quantization config gives it. Rows [r0, r0+rows) and
 * columns [c0, c0+cols) of it, as a view; every NVFP4 block scale of the view is checked for NaN. */
static Mat load_mat(const Checkpoint *ck, const char *name, long d0, long d1, long r0, long rows, long c0, long cols, int proj) {
    char wname[512], mod[512], want[64];
    snprintf(wname, sizeof wname, "%s.weight", name);
    const Tensor *t = st_need(ck, wname);
    snprintf(mod, sizeof mod, "%.*s", (int)strlen(t->name) - 7, t->name);
    const Tensor *ws = st_part(ck, mod, "weight_scale"), *ws2 = st_part(ck, mod, "weight_scale_2"), *in = st_part(ck, mod, "input_scale");
    if (st_part(ck, mod, "pre_quant_scale")) die("%s: tensor %s.pre_quant_scale: AWQ's pre-quantization scales are not supported", t->file, mod);
    if (in) st_scale(in);
    int fmt = t->dtype == DT_U8 ? DT_NVFP4 : t->dtype;
    long sd1 = fmt == DT_NVFP4 ? d1 / 2 : d1;
    if (fmt == DT_NVFP4 && d1 % 16) die("%s: tensor %s is NVFP4, in blocks of 16, but its rows have %ld elements", t->file, t->name, d1);
    snprintf(want, sizeof want, "%ld,%ld", d0, sd1);
    if (t->ndim != 2 || t->shape[0] != d0 || t->shape[1] != sd1) st_bad_shape(t, want);
    Mat m = {NULL, fmt, (int)rows, (int)cols, (size_t)d1, NULL, 0, 1.0f};
    if (fmt <= DT_F16 && (ws || ws2)) die("%s: tensor %s is %s, yet %s is stored beside it", t->file, t->name, dtype_name[fmt], (ws ? ws : ws2)->name);
    if (fmt >= DT_FP8 && !ws) die("%s: tensor %s is %s but %s.weight_scale is missing", t->file, t->name, dtype_name[t->dtype], mod);
    if (fmt == DT_FP8 && ws2) die("%s: tensor %s: an FP8 weight with a weight_scale_2 is not per-tensor FP8", ws2->file, ws2->name);
    if (fmt == DT_FP8) m.scale = st_scale(ws);
    if (fmt == DT_NVFP4) {
        if (!ws2) die("%s: tensor %s is U8 (NVFP4) but %s.weight_scale_2 is missing", t->file, t->name, mod);
        if (ws->dtype != DT_FP8) die("%s: tensor %s has dtype %s; NVFP4 block scales are F8_E4M3", ws->file, ws->name, dtype_name[ws->dtype]);
        snprintf(want, sizeof want, "%ld,%ld", d0, d1 / 16);
        if (ws->ndim != 2 || ws->shape[0] != d0 || ws->shape[1] != d1 / 16) st_bad_shape(ws, want);
        m.scale = st_scale(ws2);
    }
    int have = fmt >= DT_FP8 ? fmt : 0, expect = proj ? quant_expect(&ck->q, mod) : Q_ANY;
    if (expect != Q_ANY && expect != have) {
        if (!ck->q.algo) die("%s: tensor %s is %s but the checkpoint has no quantization config (hf_quant_config.json, "
                             "or quantization_config in config.json)", t->file, t->name, dtype_name[t->dtype]);
        die("%s: tensor %s is %s but %s makes %s %s", t->file, t->name, have ? quant_name(have) : dtype_name[fmt], ck->q.src, mod,
            quant_name(expect));
    }
    if (fmt == DT_NVFP4 && (c0 % 16 || cols % 16))
        die("%s: tensor %s is NVFP4: this --tp gives a rank its columns %ld..%ld, which cuts a 16-element block; "
            "choose a --tp that keeps them whole", t->file, t->name, c0, c0 + cols - 1);
    if (t->data) m.data = (const char *)t->data + (fmt == DT_NVFP4 ? ((size_t)r0 * d1 + c0) / 2 : ((size_t)r0 * d1 + c0) * dtype_size[fmt]);
    if (fmt == DT_NVFP4) m.bld = (size_t)d1 / 16;
    if (fmt == DT_NVFP4 && ws->data) {   /* (no data: a --random matrix the GPU draws) */
        m.bs = (const uint8_t *)ws->data + (size_t)r0 * m.bld + c0 / 16;
        for (long i = 0; i < rows; i++)
            for (long b = 0; b < cols / 16; b++)
                if ((m.bs[i * m.bld + b] & 0x7F) == 0x7F)
                    die("%s: tensor %s: block scale [%ld, %ld] is 0x%02X, a NaN", ws->file, ws->name, r0 + i, c0 / 16 + b, m.bs[i * m.bld + b]);
    }
    return m;
}

/* An fp32 copy of elements [i0, i0+n) of a small tensor (norms, conv, A_log, D, dt_bias). */
static float *small_f32(const Tensor *t, size_t i0, size_t n) {
    float *out = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) out[i] = load_f32(t->data, t->dtype, i0 + i);
    return out;
}

/* Rank `s->rank`'s share of one layer, of kind k, whose tensors are named `pre`.* ("layers.L", or
 * "mtp.layers.I" for the MTP block's sublayers). */
static void build_layer(Layer *L, char k, const char *pre, const Checkpoint *ck, const Config *c, const Shard *s) {
    char name[256];
    int H = c->hidden, r = s->rank;
#define T2(field, d0, d1) (snprintf(name, sizeof name, "%s.%s", pre, field), st_get(ck, name, d0, d1))
#define M2(field, d0, d1, r0, rows, c0, cols) (snprintf(name, sizeof name, "%s.mixer.%s", pre, field), \
                                              load_mat(ck, name, d0, d1, r0, rows, c0, cols, 1))
    L->kind = k;
    L->norm = small_f32(T2("norm.weight", H, 0), 0, (size_t)H);
    if (L->kind == K_MAMBA) {
        int di = c->m_heads * c->m_hdim, gn = c->n_groups * c->d_state, conv = di + 2 * gn, gl = s->groups * c->d_state;
        /* each segment of [z | x | B | C | dt] is split contiguously, so heads and groups stay whole */
        long seg0[5] = {0, di, 2L * di, 2L * di + gn, 2L * di + 2L * gn};
        long rows[5] = {s->d_inner, s->d_inner, gl, gl, s->m_heads};
        for (int k = 0; k < 5; k++) L->in_proj[k] = M2("in_proj", 2 * di + 2 * gn + c->m_heads, H, seg0[k] + r * rows[k], rows[k], 0, H);
        const Tensor *cw = T2("mixer.conv1d.weight", conv, c->d_conv);
        size_t K = (size_t)c->d_conv;
        L->conv_w = xmalloc((size_t)s->conv * K * sizeof(float));
        L->conv_b = xcalloc((size_t)s->conv, sizeof(float));
        const Tensor *cb = c->conv_bias ? T2("mixer.conv1d.bias", conv, 0) : NULL;
        /* local conv channels: this rank's x, then its B, then its C */
        long ch0[3] = {(long)r * s->d_inner, di + (long)r * gl, di + gn + (long)r * gl};
        long nch[3] = {s->d_inner, gl, gl};
        for (int k = 0, o = 0; k < 3; o += (int)nch[k], k++)
            for (long i = 0; i < nch[k]; i++) {
                for (size_t j = 0; j < K; j++) L->conv_w[(o + i) * K + j] = load_f32(cw->data, cw->dtype, (ch0[k] + i) * K + j);
                if (cb) L->conv_b[o + i] = load_f32(cb->data, cb->dtype, (size_t)(ch0[k] + i));
            }
        size_t h0 = (size_t)r * s->m_heads, m_heads = (size_t)s->m_heads;
        L->A = small_f32(T2("mixer.A_log", c->m_heads, 0), h0, m_heads);
        for (size_t i = 0; i < m_heads; i++) L->A[i] = -expf(L->A[i]);  /* A = -exp(A_log) */
        L->D = small_f32(T2("mixer.D", c->m_heads, 0), h0, m_heads);
        L->dt_bias = small_f32(T2("mixer.dt_bias", c->m_heads, 0), h0, m_heads);
        L->gnorm = small_f32(T2("mixer.norm.weight", di, 0), (size_t)r * s->d_inner, (size_t)s->d_inner);
        L->out = M2("out_proj", H, di, 0, H, (long)r * s->d_inner, s->d_inner);
    } else if (L->kind == K_ATTN) {
        int hd = c->head_dim;
        L->wq = M2("q_proj", c->n_heads * hd, H, (long)s->q0 * hd, s->q * hd, 0, H);
        L->wk = M2("k_proj", c->n_kv * hd, H, (long)s->kv0 * hd, s->kv * hd, 0, H);
        L->wv = M2("v_proj", c->n_kv * hd, H, (long)s->kv0 * hd, s->kv * hd, 0, H);
        L->wo = M2("o_proj", H, c->n_heads * hd, 0, H, (long)s->q0 * hd, s->q * hd);
        /* an FP8 KV cache's scales: read and checked; the cache stays bf16 (or fp32) */
        static const char *kv_scale[] = {"mixer.k_proj.k_scale", "mixer.v_proj.v_scale"};
        for (int k = 0; k < 2; k++)
            if (snprintf(name, sizeof name, "%s.%s", pre, kv_scale[k]), st_find(ck, name)) st_scale(st_find(ck, name));
    } else if (L->kind == K_MLP) {
        L->up = M2("up_proj", c->mlp, H, (long)r * s->mlp, s->mlp, 0, H);
        L->down = M2("down_proj", H, c->mlp, 0, H, (long)r * s->mlp, s->mlp);
    } else {
        int E = c->n_experts, d = c->latent ? c->latent : H, m = c->moe;
        L->gate = small_f32(T2("mixer.gate.weight", E, H), 0, (size_t)E * H);
        L->gate_bias = small_f32(T2("mixer.gate.e_score_correction_bias", E, 0), 0, (size_t)E);
        /* expert e: this rank's rows of up [moe, d] and columns of down [d, moe], stacked or not */
        const Tensor *up = st_experts_stacked(ck, pre, "up_proj", E, m, d), *down = st_experts_stacked(ck, pre, "down_proj", E, d, m);
        L->eup = xcalloc((size_t)E, sizeof(Mat));
        L->edown = xcalloc((size_t)E, sizeof(Mat));
        for (int e = 0; e < E; e++) {
            char f[64];
            L->eup[e] = up ? mat_view(up, (long)e * m + (long)r * s->moe, s->moe, 0, d)
                           : (snprintf(f, sizeof f, "experts.%d.up_proj", e), M2(f, m, d, (long)r * s->moe, s->moe, 0, d));
            L->edown[e] = down ? mat_view(down, (long)e * d, d, (long)r * s->moe, s->moe)
                               : (snprintf(f, sizeof f, "experts.%d.down_proj", e), M2(f, d, m, 0, d, (long)r * s->moe, s->moe));
        }
        L->sup = M2("shared_experts.up_proj", c->shared, H, (long)r * s->shared, s->shared, 0, H);
        L->sdown = M2("shared_experts.down_proj", H, c->shared, 0, H, (long)r * s->shared, s->shared);
        if (c->latent) {
            L->lat_in = M2("fc1_latent_proj", c->latent, H, 0, c->latent, 0, H);
            L->lat_out = M2("fc2_latent_proj", H, c->latent, 0, H, 0, c->latent);
        }
    }
#undef T2
#undef M2
}

/* Rank `s->rank`'s weights: views for the matrices, fp32 copies of the small vectors. */
static void build_weights(Weights *w, const Checkpoint *ck, const Config *c, const Shard *s) {
    char name[64];
    int H = c->hidden;
    memset(w, 0, sizeof *w);
    /* the embedding table (backbone.embedding in older NVIDIA checkpoints) is no projection: its
       format is not checked against the config, whose exclude lists leave it out */
    const char *emb = st_find(ck, "embeddings.weight") || !st_find(ck, "embedding.weight") ? "embeddings" : "embedding";
    w->embed = load_mat(ck, emb, c->vocab, H, 0, c->vocab, 0, H, 0);
    w->lm_head = load_mat(ck, "lm_head", c->vocab, H, (long)s->rank * s->vocab, s->vocab, 0, H, 1);
    w->norm_f = small_f32(st_get(ck, "norm_f.weight", H, 0), 0, (size_t)H);
    for (int l = 0; l < n_all(c); l++) {
        int i = l - c->n_layers;   /* the MTP block's sublayer i */
        if (i < 0) snprintf(name, sizeof name, "layers.%d", l);
        else snprintf(name, sizeof name, "mtp.layers.%d", i);
        build_layer(&w->layer[l], c->kind[l], name, ck, c, s);
    }
    if (c->n_mtp) {   /* its input norms and projection on sublayer 0, its final norm on the last */
        int last = c->n_mtp - 1;
        w->enorm = small_f32(st_get(ck, "mtp.layers.0.enorm.weight", H, 0), 0, (size_t)H);
        w->hnorm = small_f32(st_get(ck, "mtp.layers.0.hnorm.weight", H, 0), 0, (size_t)H);
        w->eh_proj = load_mat(ck, "mtp.layers.0.eh_proj", H, 2L * H, 0, H, 0, 2L * H, 1);
        snprintf(name, sizeof name, "mtp.layers.%d.final_layernorm.weight", last);
        w->mtp_norm = small_f32(st_get(ck, name, H, 0), 0, (size_t)H);
    }
}

static void free_weights(Weights *w, const Config *c) {
    free(w->norm_f); free(w->enorm); free(w->hnorm); free(w->mtp_norm);
    for (int l = 0; l < n_all(c); l++) {
        Layer *L = &w->layer[l];
        free(L->norm); free(L->conv_w); free(L->conv_b); free(L->A); free(L->D); free(L->dt_bias); free(L->gnorm);
        free(L->gate); free(L->gate_bias); free(L->eup); free(L->edown);
    }
}

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
    int max_piece;              /* the longest token string in bytes: no token covers more text */
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
    *len = 0;
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
    size_t max;                 /* stop once there are more ids than this (0: never) */
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
        for (size_t i = 0, j; i < n && !(e->max && e->n > e->max); i = j) {
            j = t->split(s, n, i);
            bpe_word(t, e, s + i, j - i);
        }
        return;
    }
    const TokAdded *a = &t->added[k];
    size_t from = 0, i = 0;
    while (i < n && !(e->max && e->n > e->max)) {
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
 * HF encodes Rust strings, valid UTF-8: invalid input is read as from_utf8_lossy reads it.
 * With max > 0 it stops soon after the ids pass max (then *n_out > max, the rest not encoded). */
static int *tok_encode(const Tokenizer *t, const char *text, size_t len, size_t max, int *n_out) {
    char *s;
    size_t n;
    FILE *f = open_memstream(&s, &n);
    if (!f) die("out of memory");
    utf8_lossy((const unsigned char *)text, len, 1, f);
    fclose(f);
    TokEnc e = {0};
    e.max = max;
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

/* The bytes id decodes to, at *p. An id the tokenizer has no token for (past a tokenizer smaller
 * than the model's padded vocabulary) is shown as "<id N>", written to buf, so that a sampled id
 * is seen rather than lost (HF's decode skips it). */
static size_t tok_piece(const Tokenizer *t, int id, char buf[24], const char **p) {
    if (id >= 0 && id < t->n_vocab) return *p = t->bytes + t->off[id], (size_t)t->len[id];
    *p = buf;
    return (size_t)snprintf(buf, 24, "<id %d>", id);
}

/* Whole-sequence decode, as HF's decode(ids, skip_special_tokens=False) with the ByteLevel
 * decoder: the tokens' bytes, with invalid UTF-8 shown as U+FFFD. NUL-terminated; caller frees. */
static char *tok_decode(const Tokenizer *t, const int *ids, int n, size_t *len) {
    char *raw, *out, buf[24];
    size_t raw_len, out_len;
    FILE *f = open_memstream(&raw, &raw_len);
    if (!f) die("out of memory");
    for (int i = 0; i < n; i++) {
        const char *p;
        size_t k = tok_piece(t, ids[i], buf, &p);
        fwrite(p, 1, k, f);
    }
    fclose(f);
    FILE *g = open_memstream(&out, &out_len);
    if (!g) die("out of memory");
    utf8_lossy((const unsigned char *)raw, raw_len, 1, g);
    fclose(g);
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
    char buf[24];
    const char *p;
    size_t k = tok_piece(t, id, buf, &p), n = (size_t)s->n + k;
    unsigned char *b = xmalloc(n);
    memcpy(b, s->held, (size_t)s->n);
    if (k) memcpy(b + s->n, p, k);
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
    t->bytes = tok_grow(t->bytes, &t->cap_bytes, t->n_bytes + (size_t)n + 1, 1);   /* + 1: never NULL */
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
        if (r <= 0 || cp >= 0x144 || t->char_byte[cp] < 0) {   /* undo the bytes written so far */
            memcpy(t->bytes + off, s, (size_t)n);
            t->off[id] = off, t->len[id] = n;
            return;
        }
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
            int64_t id;
            if (*n == 8 || !json_int(i, 0, INT32_MAX, &id)) die("%s: post_processor special token ids malformed", path);
            (after ? t->post : t->pre)[(*n)++] = (int)id;
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

    /* ids within the largest vocab_size nemoh takes (the tables below have one entry an id) */
    int64_t id;
    for (const Json *v = vocab->child; v; v = v->next) {
        if (!json_int(v, 0, WIDTH_MAX - 1, &id))
            die("%s: vocab entry %s: id must be an integer from 0 to %d", path, v->key, WIDTH_MAX - 1);
        if (id >= t->n_vocab) t->n_vocab = (int)id + 1;
        if (v->klen > t->max_piece) t->max_piece = v->klen;
    }
    for (const Json *a = added ? added->child : NULL; a; a = a->next) {
        const Json *c = json_get(a, "content");
        if (!json_int(json_get(a, "id"), 0, WIDTH_MAX - 1, &id) || !c || c->type != J_STR || !c->len)
            die("%s: added token without an id (an integer from 0 to %d) or content", path, WIDTH_MAX - 1);
        if (id >= t->n_vocab) t->n_vocab = (int)id + 1;
        if (c->len > t->max_piece) t->max_piece = c->len;
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

/* A tokenizer from the text of a tokenizer.json (path: for messages); dies naming it on anything
 * malformed or unsupported. */
static Tokenizer *tok_parse(const char *text, size_t n, const char *path) {
    JsonDoc doc = json_parse(text, n, path);
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

/* Loads a Hugging Face tokenizer.json of at most 512 MiB (its strings, stored twice, keep int offsets). */
static Tokenizer *tok_load(const char *path) {
    size_t n;
    char *text = read_text(path, &n, 1 << 29);
    if (!text) die("%s: cannot open: %s", path, strerror(errno));
    Tokenizer *t = tok_parse(text, n, path);
    free(text);
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
 * Synthetic models: the published shapes with random weights, for bring-up and benchmarks
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    int hidden, n_heads, n_kv, head_dim, mlp, m_heads, m_hdim, n_groups, d_state, vocab, ctx;
    const char *pattern;
} Preset;

/* The experts of the presets with MoE layers (their routers: one group, weights normalised). */
typedef struct {
    const char *name;
    int n_experts, top_k, moe, shared, latent;
    float routed_scale;
    const char *mtp;            /* the MTP block's pattern, NULL: none */
} MoePreset;

/* Shapes from the published config.json files (Megatron-Bridge's nemotron_h_provider.py agrees). */
#define NH8B_PATTERN "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
static const Preset presets[] = {
    {"nemotron-h-8b", 4096, 32, 8, 128, 21504, 128, 64, 8, 128, 131072, 8192, NH8B_PATTERN},
    {"nemotron-h-4b", 3072, 32, 8, 128, 12288, 112, 64, 8, 128, 131072, 8192, NH8B_PATTERN},
    {"nemotron-h-47b", 8192, 64, 8, 128, 30720, 256, 64, 8, 256, 131072, 8192,
     "M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---M-M*-M-M-M-M-M-"},
    {"nemotron-h-56b", 8192, 64, 8, 128, 32768, 256, 64, 8, 256, 131072, 8192,
     "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-"
     "M-M-M-M-M*-M-M-M-M-M-"},
    {"nemotron-nano-9b-v2", 4480, 40, 8, 128, 15680, 128, 80, 8, 128, 131072, 131072,
     "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"},
    {"nemotron-nano-12b-v2", 5120, 40, 8, 128, 20480, 128, 80, 8, 128, 131072, 131072,
     "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-"},
    {"nemotron-3-nano-4b", 3136, 40, 8, 128, 12544, 96, 80, 8, 128, 131072, 262144,
     "M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-"},
    {"nemotron-3-nano-30b-a3b", 2688, 32, 2, 128, 0, 64, 64, 8, 128, 131072, 262144,
     "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"},
    {"nemotron-3-super-120b-a12b", 4096, 32, 2, 128, 0, 128, 64, 8, 128, 131072, 262144,
     "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"},
    {"synthetic-100m", 768, 6, 2, 128, 3072, 24, 64, 8, 128, 32768, 4096, "M-M-M*-M-M-M*-"},
};
static const MoePreset moe_presets[] = {
    {"nemotron-3-nano-30b-a3b", 128, 6, 1856, 3712, 0, 2.5f, NULL},
    {"nemotron-3-super-120b-a12b", 512, 22, 2688, 5376, 1024, 5.0f, "*E"},
};

/* A preset by name; a suffix -fp8 or -nvfp4 asks for the quantized release's layout (*quant: DT_FP8,
 * DT_NVFP4; else 0). */
static const Preset *find_preset(const char *name, int *quant) {
    size_t n = strlen(name);
    *quant = n > 4 && !strcmp(name + n - 4, "-fp8") ? DT_FP8 : n > 6 && !strcmp(name + n - 6, "-nvfp4") ? DT_NVFP4 : 0;
    n -= *quant == DT_FP8 ? 4 : *quant ? 6 : 0;
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (strlen(presets[i].name) == n && !strncmp(presets[i].name, name, n)) return &presets[i];
    char list[512] = "";
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) strcat(strcat(list, " "), presets[i].name);
    die("--random %s: unknown preset; known:%s (each also as NAME-fp8 or NAME-nvfp4)", name, list);
    return NULL;
}

static void preset_config(Config *c, const Preset *p) {
    memset(c, 0, sizeof *c);
    c->n_layers = (int)strlen(p->pattern);
    memcpy(c->kind, p->pattern, (size_t)c->n_layers);
    c->vocab = p->vocab; c->hidden = p->hidden; c->eps = 1e-5f; c->ctx = p->ctx;
    c->n_heads = p->n_heads; c->n_kv = p->n_kv; c->head_dim = p->head_dim; c->mlp = p->mlp;
    c->m_heads = p->m_heads; c->m_hdim = p->m_hdim; c->n_groups = p->n_groups; c->d_state = p->d_state;
    c->d_conv = 4; c->conv_bias = 1; c->eos[0] = 2; c->n_eos = 1;
    for (size_t i = 0; i < sizeof moe_presets / sizeof moe_presets[0]; i++) {
        const MoePreset *m = &moe_presets[i];
        if (strcmp(m->name, p->name)) continue;
        c->n_experts = m->n_experts; c->top_k = m->top_k; c->moe = m->moe; c->shared = m->shared; c->latent = m->latent;
        c->n_group = c->topk_group = 1; c->norm_topk = 1; c->routed_scale = m->routed_scale;
        c->n_mtp = m->mtp ? (int)strlen(m->mtp) : 0;
        if (m->mtp) memcpy(c->kind + c->n_layers, m->mtp, (size_t)c->n_mtp);
    }
}

enum { W_MAT, W_ONE, W_ALOG, W_DTB, W_CONV, W_BIAS, W_CODE, W_SCALE };  /* how a synthetic tensor is drawn */

/* Adds one synthetic tensor: matrices uniform with std fan_in^-0.5, fp32 vectors as a trained model
 * has them (norms near 1, A in [-16, -1], dt = softplus(dt_bias) log-uniform in [1e-3, 0.1]); for
 * quantized matrices random codes (W_CODE: FP8 bytes but the NaNs, packed E2M1 pairs) in blocks of
 * scale 1 (W_SCALE); d0 = 0: one F32 value, v. */
static void add_random(Checkpoint *ck, const char *name, int dtype, long d0, long d1, int what, uint64_t seed, int host) {
    Tensor *t = ck_add(ck);
    size_t numel = (size_t)(d0 ? d0 : 1) * (size_t)(d1 ? d1 : 1);
    *t = (Tensor){xstrdup(name), dtype, d0 ? d1 ? 2 : 1 : 0, {d0, d1}, NULL, ck->dir};
    if ((what == W_MAT || what >= W_CODE) && dtype != DT_F32 && !host) return;  /* data NULL: the GPU backend draws it */
    void *buf = xmalloc(numel * (size_t)dtype_size[dtype]);
    float a = d1 ? sqrtf(3.0f / (float)d1) : 0;
    for (size_t k = 0; k < numel; k++) {
        float u = coin(seed + (uint64_t)ck->n * 0x9E3779B9u, k), v;
        switch (what) {
        case W_MAT: v = (2 * u - 1) * a; break;
        case W_ONE: v = 1.0f + 0.1f * (u - 0.5f); break;
        case W_ALOG: v = logf(1.0f + 15.0f * u); break;
        case W_DTB: { float dt = expf(logf(1e-3f) + u * logf(100.0f)); v = dt + logf(-expm1f(-dt)); break; }
        case W_CONV: v = (2 * u - 1) * 0.5f; break;
        case W_CODE: ((uint8_t *)buf)[k] = (uint8_t)(u * 256) ^ (dtype == DT_FP8 && ((uint8_t)(u * 256) & 0x7F) == 0x7F); continue;
        case W_SCALE: ((uint8_t *)buf)[k] = 0x38; continue;   /* e4m3 1.0 */
        default: v = 0.1f * (2 * u - 1);
        }
        if (dtype == DT_F32) { ((float *)buf)[k] = v; continue; }
        uint32_t b;  /* round to nearest even bf16 */
        memcpy(&b, &v, 4);
        ((uint16_t *)buf)[k] = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1)) >> 16);
    }
    t->data = buf;
}

/* Root mean square of the values of every code of a format (FP8 less its NaNs; E2M1), for the scale
 * that gives random codes the std of a bf16 matrix. */
static float code_rms(int fmt) {
    double ss = 0;
    int n = fmt == DT_FP8 ? 256 : 16, k = 0;
    for (int b = 0; b < n; b++) {
        float v = fmt == DT_FP8 ? e4m3_to_f32((uint8_t)b) : e2m1_to_f32((unsigned)b);
        if (v == v) { ss += (double)v * v; k++; }
    }
    return (float)sqrt(ss / k);
}

/* A synthetic matrix `name`.weight [d0, d1] in format fmt (DT_BF16, DT_FP8, DT_NVFP4), with std
 * d1^-0.5 as add_random draws a bf16 one; a quantized one's scales as ModelOpt stores them. */
static void add_matrix(Checkpoint *ck, const char *name, int fmt, long d0, long d1, uint64_t seed, int host) {
    char nm[160];
    float sd = 1.0f / sqrtf((float)d1);
    snprintf(nm, sizeof nm, "%s.weight", name);
    if (fmt == DT_BF16) { add_random(ck, nm, DT_BF16, d0, d1, W_MAT, seed, host); return; }
    add_random(ck, nm, fmt == DT_FP8 ? DT_FP8 : DT_U8, d0, fmt == DT_FP8 ? d1 : d1 / 2, W_CODE, seed, host);
    if (fmt == DT_NVFP4) {
        snprintf(nm, sizeof nm, "%s.weight_scale", name);
        add_random(ck, nm, DT_FP8, d0, d1 / 16, W_SCALE, seed, host);
    }
    snprintf(nm, sizeof nm, "%s.weight_scale%s", name, fmt == DT_NVFP4 ? "_2" : "");
    add_random(ck, nm, DT_F32, 0, 0, W_ONE, seed, 1);
    float v = sd / code_rms(fmt);
    memcpy((void *)ck->t[ck->n - 1].data, &v, 4);
}

/* The format --random gives a matrix of layer l (what: "in_proj", "out_proj", "q_proj", "o_proj",
 * "up_proj", "experts", "shared", "fc1", "fc2"; mamba, moe, attn: the layer's rank among its kind,
 * n_attn of them), quant being DT_FP8 or DT_NVFP4, as NVIDIA's releases quantize (notes: quantized
 * checkpoints, section 6): dense models every projection; Nemotron 3 Nano the experts and the Mamba
 * layers but those feeding attention; Super FP8 the experts and every Mamba layer; Super NVFP4 its
 * published mix (NVFP4 routed experts, FP8 shared experts, FP8 in_proj on 28 of 40 Mamba layers and
 * out_proj on 29, FP8 fc1 on 3 MoE layers and fc2 on 1, FP8 o_proj on 2 attention layers). */
static int preset_fmt(const Config *c, int quant, int l, const char *what, int mamba, int moe, int attn, int n_attn) {
    int mam = !strcmp(what, "in_proj") || !strcmp(what, "out_proj"), ex = !strcmp(what, "experts") || !strcmp(what, "shared");
    if (!quant) return DT_BF16;
    if (!has_kind(c, K_MOE)) return quant;
    if (!c->latent) return ex || (mam && !(l + 1 < c->n_layers && c->kind[l + 1] == K_ATTN)) ? quant : DT_BF16;
    if (quant == DT_FP8) return ex || mam ? DT_FP8 : DT_BF16;
    if (!strcmp(what, "experts")) return DT_NVFP4;
    int fp8 = !strcmp(what, "shared") || (!strcmp(what, "in_proj") && mamba < 28) || (!strcmp(what, "out_proj") && mamba < 29) ||
              (!strcmp(what, "fc1") && moe < 3) || (!strcmp(what, "fc2") && moe < 1) || (!strcmp(what, "o_proj") && attn >= n_attn - 2);
    return fp8 ? DT_FP8 : DT_BF16;
}

/* Drawing takes a while on the CPU (nemotron-h-4b's 8 GB: about 45 s): past its first second, a
 * progress line on stderr, redrawn in place on a terminal, else a plain line every 10 s. */
static void draw_progress(int done, int total, double t0, double *shown) {
    double t = now_s() - t0;
    int tty = isatty(2), last = done == total;
    if (t < 1 || (!last && t - *shown < (tty ? 0.25 : 10)) || (last && !*shown)) return;
    fprintf(stderr, "%snemoh: drawing random weights: %d of %d layers, %.0f s%s", tty ? "\r" : "", done, total, t, tty && !last ? "" : "\n");
    *shown = t;
}

/* A checkpoint held in memory with every tensor the config names, in NVIDIA's layout (one tensor per
 * expert), its matrices quantized as preset_fmt says for quant (0: none); with host 0 the matrices
 * are left for the GPU backend to draw (an 8B model's 16 GB is quicker made on the device). The fp32
 * router weight is always drawn here: the host reads it. */
static void build_random_checkpoint(Checkpoint *ck, const Config *c, uint64_t seed, int host, int quant) {
    memset(ck, 0, sizeof *ck);
    ck->dir = "(random)";
    ck->owned = 1;
    ck->q.algo = Q_ANY;
    int H = c->hidden, di = c->m_heads * c->m_hdim, gn = c->n_groups * c->d_state, q = c->n_heads * c->head_dim,
        kv = c->n_kv * c->head_dim, mamba = 0, moe = 0, attn = 0, n_attn = 0;
    for (int l = 0; l < c->n_layers; l++) n_attn += c->kind[l] == K_ATTN;
    char nm[128];
    double t0 = now_s(), shown = 0;
    add_random(ck, "backbone.embeddings.weight", DT_BF16, c->vocab, H, W_MAT, seed, host);
    add_random(ck, "backbone.norm_f.weight", DT_F32, H, 0, W_ONE, seed, host);
    add_random(ck, "lm_head.weight", DT_BF16, c->vocab, H, W_MAT, seed, host);
    /* the blocks, then the MTP block's sublayers, which the quantized releases keep in bf16 */
    for (int l = 0; l < n_all(c); l++) {
        char pre[32];
        int mtp = l >= c->n_layers;
        snprintf(pre, sizeof pre, mtp ? "mtp.layers.%d" : "backbone.layers.%d", mtp ? l - c->n_layers : l);
#define ADD(field, dt, d0, d1, what) (snprintf(nm, sizeof nm, "%s.%s", pre, field), add_random(ck, nm, dt, d0, d1, what, seed, host))
#define MAT(field, what, d0, d1) (snprintf(nm, sizeof nm, "%s.mixer.%s", pre, field), \
                                  add_matrix(ck, nm, preset_fmt(c, mtp ? 0 : quant, l, what, mamba, moe, attn, n_attn), d0, d1, seed, host))
        ADD("norm.weight", DT_F32, H, 0, W_ONE);
        if (c->kind[l] == K_MAMBA) {
            MAT("in_proj", "in_proj", 2 * di + 2 * gn + c->m_heads, H);
            ADD("mixer.conv1d.weight", DT_F32, di + 2 * gn, c->d_conv, W_CONV);
            ADD("mixer.conv1d.bias", DT_F32, di + 2 * gn, 0, W_BIAS);
            ADD("mixer.A_log", DT_F32, c->m_heads, 0, W_ALOG);
            ADD("mixer.D", DT_F32, c->m_heads, 0, W_ONE);
            ADD("mixer.dt_bias", DT_F32, c->m_heads, 0, W_DTB);
            ADD("mixer.norm.weight", DT_F32, di, 0, W_ONE);
            MAT("out_proj", "out_proj", H, di);
            mamba++;
        } else if (c->kind[l] == K_ATTN) {
            MAT("q_proj", "q_proj", q, H);
            MAT("k_proj", "q_proj", kv, H);
            MAT("v_proj", "q_proj", kv, H);
            MAT("o_proj", "o_proj", H, q);
            attn++;
        } else if (c->kind[l] == K_MLP) {
            MAT("up_proj", "up_proj", c->mlp, H);
            MAT("down_proj", "up_proj", H, c->mlp);
        } else {
            int d = c->latent ? c->latent : H;
            char f[64];
            ADD("mixer.gate.weight", DT_F32, c->n_experts, H, W_MAT);
            ADD("mixer.gate.e_score_correction_bias", DT_F32, c->n_experts, 0, W_BIAS);
            for (int e = 0; e < c->n_experts; e++) {
                snprintf(f, sizeof f, "experts.%d.up_proj", e);
                MAT(f, "experts", c->moe, d);
                snprintf(f, sizeof f, "experts.%d.down_proj", e);
                MAT(f, "experts", d, c->moe);
            }
            MAT("shared_experts.up_proj", "shared", c->shared, H);
            MAT("shared_experts.down_proj", "shared", H, c->shared);
            if (c->latent) {
                MAT("fc1_latent_proj", "fc1", c->latent, H);
                MAT("fc2_latent_proj", "fc2", H, c->latent);
            }
            moe++;
        }
#undef ADD
#undef MAT
        draw_progress(l + 1, n_all(c), t0, &shown);
    }
    if (c->n_mtp) {
        add_random(ck, "mtp.layers.0.enorm.weight", DT_F32, H, 0, W_ONE, seed, host);
        add_random(ck, "mtp.layers.0.hnorm.weight", DT_F32, H, 0, W_ONE, seed, host);
        add_matrix(ck, "mtp.layers.0.eh_proj", DT_BF16, H, 2 * H, seed, host);
        snprintf(nm, sizeof nm, "mtp.layers.%d.final_layernorm.weight", c->n_mtp - 1);
        add_random(ck, nm, DT_F32, H, 0, W_ONE, seed, host);
    }
    st_sort(ck);
}

/* ------------------------------------------------------------------------------------------------
 * Chat: the instruct checkpoints' own formats, and a conversation that keeps its state
 * ---------------------------------------------------------------------------------------------- */

/* nemoh renders the chat templates NVIDIA ships (the .jinja files in tools/chat) in C, byte for
 * byte what transformers' apply_chat_template(..., add_generation_prompt=True) gives, without a
 * Jinja interpreter: the template's text only tells which format a checkpoint uses. */
enum { FMT_NANO2, FMT_NEMOTRON3, FMT_CHATML };
static const char *const fmt_name[] = {"Nemotron-Nano v2 / Nemotron-H", "Nemotron 3", "ChatML"};

typedef struct { char role; char *text; size_t len; } ChatMsg;   /* role 's', 'u' or 'a'; text owned */

typedef struct {
    int format;                 /* FMT_* */
    char where[4200];           /* the file the template came from, for messages */
    int think;                  /* -1: the template's default, 0: --no-think, 1: --think */
    ChatMsg *msg;               /* [n_msg] the conversation so far */
    int n_msg;
    size_t cap_msg;             /* allocated messages */
    int end_turn;               /* the token that ends an assistant turn */
    int think_end;              /* the token "</think>", or -1 when it is not one token */
} Chat;

typedef struct {
    int n;                      /* most tokens a reply may have */
    float temp, topp;           /* sampling temperature (0: greedy), top-p */
    uint64_t seed;              /* sampling seed */
    int hide_think;             /* --hide-think: print no reasoning */
    FILE *dump;                 /* --dump-logits: every position's logits as last computed, at exit */
    int mtp;                    /* --mtp: drafts a step (0: none) */
} ChatOpts;

typedef struct {
    int *ids, n;                /* the tokens the engine has consumed, in order */
    size_t cap;                 /* allocated ids */
    int snap;                   /* position snapshot slot 1 holds (a turn boundary), -1: none */
    Decoder d;                  /* the decoder, which keeps each position's logits for --dump-logits */
} ChatState;

static int is_eos(const Config *c, int id);

/* Python's str.isspace(), which str.strip() and Jinja's trim strip. */
static int py_space(unsigned cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* s[0..*n) with Python's strip(): returns the new start, *n the new length. */
static const char *py_strip(const char *s, size_t *n) {
    const unsigned char *b = (const unsigned char *)s;
    size_t i = 0, j = *n;
    unsigned cp;
    int k;
    while (i < j && (k = utf8_check(b + i, j - i, &cp)) > 0 && py_space(cp)) i += (size_t)k;
    while (j > i) {
        size_t h = j - 1;
        while (h > i && (b[h] & 0xC0) == 0x80) h--;
        if (utf8_check(b + h, j - h, &cp) != (int)(j - h) || !py_space(cp)) break;
        j = h;
    }
    *n = j - i;
    return s + i;
}

static const char *find(const char *s, size_t n, const char *w) { return memmem(s, n, w, strlen(w)); }

/* s with every w removed (Python's s.replace(w, '')), written to a new buffer; *n in and out. */
static char *remove_all(const char *s, size_t *n, const char *w) {
    char *out = xmalloc(*n + 1);
    size_t k = 0, wl = strlen(w);
    for (size_t i = 0; i < *n;) {
        if (*n - i >= wl && !memcmp(s + i, w, wl)) i += wl;
        else out[k++] = s[i++];
    }
    *n = k;
    return out;
}

/* Nano v2's message text: s.replace('/think', '').replace('/no_think', '').strip() */
static void put_no_keywords(FILE *f, const char *s, size_t n) {
    char *a = remove_all(s, &n, "/think"), *b = remove_all(a, &n, "/no_think");
    const char *t = py_strip(b, &n);
    fwrite(t, 1, n, f);
    free(a);
    free(b);
}

static void put_stripped(FILE *f, const char *s, size_t n) {
    const char *t = py_strip(s, &n);
    fwrite(t, 1, n, f);
}

/* The conversation in the format's template, as text; with gen, the generation prompt after it
 * (and *open, the start of the reply it opens: "<think>\n", "<think></think>" or ""). */
static char *chat_render(const Chat *ch, int gen, const char **open, size_t *len) {
    char *out;
    FILE *f = open_memstream(&out, len);
    if (!f) die("out of memory");
    int n = ch->n_msg, sys = n && ch->msg[0].role == 's';
    static const char *const role[] = {['s'] = "system", ['u'] = "user", ['a'] = "assistant"};
    const char *opening = "";
    if (ch->format == FMT_NANO2) {
        /* --think / --no-think: that keyword on a line after the system message (or as one) */
        ChatMsg s0 = {'s', "", 0};
        const ChatMsg **v = xmalloc(((size_t)n + 1) * sizeof *v);
        int nv = 0;
        if (ch->think >= 0) {
            const char *kw = sys ? ch->think ? "\n/think" : "\n/no_think" : ch->think ? "/think" : "/no_think";
            size_t l0 = sys ? ch->msg[0].len : 0;
            s0.text = xmalloc(l0 + strlen(kw) + 1);
            if (sys) memcpy(s0.text, ch->msg[0].text, l0);
            memcpy(s0.text + l0, kw, strlen(kw) + 1);
            s0.len = l0 + strlen(kw);
            v[nv++] = &s0;
        }
        for (int i = ch->think >= 0 && sys; i < n; i++) v[nv++] = &ch->msg[i];
        /* the reasoning switch: /think or /no_think in a system or user message, the last one wins */
        int think = 1, sv = nv && v[0]->role == 's';
        for (int i = 0; i < nv; i++)
            if (v[i]->role != 'a' && find(v[i]->text, v[i]->len, "/think")) think = 1;
            else if (v[i]->role != 'a' && find(v[i]->text, v[i]->len, "/no_think")) think = 0;
        fputs("<SPECIAL_10>System\n", f);
        if (sv) put_no_keywords(f, v[0]->text, v[0]->len);
        fputs("\n", f);
        for (int i = sv; i < nv; i++) {
            const ChatMsg *m = v[i];
            if (m->role == 'u') {
                fputs("<SPECIAL_11>User\n", f);
                put_no_keywords(f, m->text, m->len);
                fputs("\n", f);
            } else if (m->role == 'a') {
                /* content.split('</think>')[1].strip(): the reply after its reasoning */
                const char *c = m->text, *e = find(c, m->len, "</think>");
                size_t cl = m->len;
                if (e) {
                    c = e + 8, cl = m->len - (size_t)(c - m->text);
                    const char *e2 = find(c, cl, "</think>");
                    if (e2) cl = (size_t)(e2 - c);
                }
                fputs("<SPECIAL_11>Assistant\n", f);
                put_stripped(f, c, cl);
                fputs("\n<SPECIAL_12>\n", f);
            }
        }
        if (gen) fputs("<SPECIAL_11>Assistant\n", f), opening = think ? "<think>\n" : "<think></think>";
        if (ch->think >= 0) free(s0.text);
        free(v);
    } else if (ch->format == FMT_NEMOTRON3) {
        /* always a system turn; earlier replies' reasoning dropped (truncate_history_thinking): every
           assistant turn before the last user message keeps only what follows its last </think> */
        int last_user = -1;
        for (int i = sys; i < n; i++) if (ch->msg[i].role == 'u') last_user = i;
        fputs("<|im_start|>system\n", f);
        if (sys) fwrite(ch->msg[0].text, 1, ch->msg[0].len, f);
        fputs("<|im_end|>\n", f);
        for (int i = sys; i < n; i++) {
            const ChatMsg *m = &ch->msg[i];
            if (m->role != 'a') {
                fprintf(f, "<|im_start|>%s\n", role[(int)m->role]);
                fwrite(m->text, 1, m->len, f);
                fputs("<|im_end|>\n", f);
                continue;
            }
            int has_open = find(m->text, m->len, "<think>") != NULL, has_close = find(m->text, m->len, "</think>") != NULL;
            const char *c = m->text, *prefix = !has_open && !has_close ? "<think></think>" : "";
            size_t cl = m->len;
            if (i < last_user && has_open && has_close) {
                for (const char *e; (e = find(c, cl, "</think>"));) cl -= (size_t)(e + 8 - c), c = e + 8;
                prefix = "<think></think>";
            }
            /* (prefix + c).strip(); a prefix is never whitespace, so strip c's end only when it has one
               (and of a c all whitespace nothing is left) */
            size_t pl = strlen(prefix), sl = cl;
            const char *st = py_strip(c, &sl);
            if (pl) sl = sl ? (size_t)(st + sl - c) : 0, st = c;
            fprintf(f, "<|im_start|>assistant\n%s", prefix);
            fwrite(st, 1, sl, f);
            fputs("<|im_end|>\n", f);
        }
        if (gen) fputs("<|im_start|>assistant\n", f), opening = ch->think ? "<think>\n" : "<think></think>";
    } else {
        for (int i = 0; i < n; i++) {
            fprintf(f, "<|im_start|>%s\n", role[(int)ch->msg[i].role]);
            fwrite(ch->msg[i].text, 1, ch->msg[i].len, f);
            fputs("<|im_end|>\n", f);
        }
        if (gen) fputs("<|im_start|>assistant\n", f);
    }
    fputs(opening, f);
    fclose(f);
    if (open) *open = opening;
    return out;
}

/* The ids of the rendered conversation, as apply_chat_template gives them: the tokenizer's
 * post-processor adds nothing (add_special_tokens=False), so its BOS is taken off again. */
static int *chat_ids(const Chat *ch, const Tokenizer *tok, int gen, const char **open, int *n) {
    size_t len;
    char *text = chat_render(ch, gen, open, &len);
    int *ids = tok_encode(tok, text, len, 0, n);
    free(text);
    *n -= tok->n_pre + tok->n_post;
    memmove(ids, ids + tok->n_pre, (size_t)*n * sizeof(int));
    return ids;
}

/* The id of a text that is one token, else -1. */
static int tok_single(const Tokenizer *tok, const char *s) {
    int n, *ids = tok_encode(tok, s, strlen(s), 0, &n), id = n == tok->n_pre + tok->n_post + 1 ? ids[tok->n_pre] : -1;
    free(ids);
    return id;
}

static void chat_add(Chat *ch, char role, const char *text, size_t len) {
    ch->msg = tok_grow(ch->msg, &ch->cap_msg, (size_t)ch->n_msg + 1, sizeof(ChatMsg));
    char *t = xmalloc(len + 1);
    memcpy(t, text, len);
    t[len] = 0;
    ch->msg[ch->n_msg++] = (ChatMsg){role, t, len};
}

/* The format of the checkpoint in dir, from its template (tokenizer_config.json's chat_template,
 * else chat_template.jinja) and the special tokens it needs; one line and exit 1 when there is
 * none or it is none of the three. */
static void chat_detect(Chat *ch, const char *dir, const Tokenizer *tok) {
    char path[4200];
    size_t n;
    char *text, *tmpl = NULL;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if ((text = read_text(path, &n, 1 << 24))) {
        JsonDoc doc = json_parse(text, n, path);
        const Json *t = json_get(doc.nodes, "chat_template");
        if (t && t->type == J_ARR)   /* [{"name", "template"}]: the one named "default" */
            for (const Json *e = t->child; e; e = e->next) {
                const Json *nm = json_get(e, "name");
                if (nm && nm->type == J_STR && !strcmp(nm->str, "default")) t = json_get(e, "template");
            }
        if (t && t->type == J_STR && t->len) tmpl = xstrdup(t->str);
        json_free(&doc);
        free(text);
    }
    if (tmpl) snprintf(ch->where, sizeof ch->where, "%s", path);
    else {
        snprintf(ch->where, sizeof ch->where, "%s/chat_template.jinja", dir);
        tmpl = read_text(ch->where, &n, 1 << 24);
    }
    if (!tmpl)
        die("--chat: %s has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja): "
            "a base model, not an instruct one", dir);
    int nano = strstr(tmpl, "<SPECIAL_11>Assistant") && strstr(tmpl, "/no_think");
    int im = strstr(tmpl, "<|im_start|>") != NULL, thinks = strstr(tmpl, "think") != NULL;
    int n3 = im && strstr(tmpl, "enable_thinking") && strstr(tmpl, "truncate_history_thinking");
    ch->format = nano ? FMT_NANO2 : n3 ? FMT_NEMOTRON3 : im && !thinks ? FMT_CHATML : -1;
    if (ch->format < 0) {
        for (char *p = tmpl; *p; p++) if (*p == '\n' || *p == '\t') *p = ' ';
        die("--chat: %s: the chat template is none of the formats nemoh renders (%s, %s, %s); it begins \"%.48s\"",
            ch->where, fmt_name[0], fmt_name[1], fmt_name[2], tmpl);
    }
    free(tmpl);
    static const char *const need[][3] = {{"<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"},
                                          {"<|im_start|>", "<|im_end|>", "<|im_end|>"},
                                          {"<|im_start|>", "<|im_end|>", "<|im_end|>"}};
    for (int k = 0; k < 3; k++)
        if (tok_single(tok, need[ch->format][k]) < 0)
            die("--chat: the %s template (%s) needs %s, which the tokenizer does not have as one token",
                fmt_name[ch->format], ch->where, need[ch->format][k]);
    ch->end_turn = tok_single(tok, need[ch->format][2]);
    ch->think_end = tok_single(tok, "</think>");
    if (ch->think >= 0 && ch->format == FMT_CHATML)
        die("--%s: the %s template (%s) has no reasoning switch", ch->think ? "think" : "no-think", fmt_name[ch->format], ch->where);
}

/* A conversation file: a JSON array of {"role": "system" | "user" | "assistant", "content": text}. */
static void chat_load(Chat *ch, const char *path) {
    size_t n;
    char *text = read_text(path, &n, 1 << 28);
    if (!text) die("-f %s: cannot open: %s", path, strerror(errno));
    JsonDoc doc = json_parse(text, n, path);
    free(text);
    if (doc.nodes->type != J_ARR) die("-f %s: a conversation is a JSON array of messages", path);
    for (const Json *m = doc.nodes->child; m; m = m->next) {
        const Json *r = json_get(m, "role"), *c = json_get(m, "content");
        if (!r || r->type != J_STR || !c || c->type != J_STR ||
            (strcmp(r->str, "system") && strcmp(r->str, "user") && strcmp(r->str, "assistant")))
            die("-f %s: message %d is not {\"role\": system, user or assistant, \"content\": text}", path, ch->n_msg + 1);
        chat_add(ch, r->str[0], c->str, (size_t)c->len);
    }
    json_free(&doc);
    if (!ch->n_msg || ch->msg[ch->n_msg - 1].role != 'u') die("-f %s: the conversation must end with a user message", path);
}

static int common_prefix(const int *a, int na, const int *b, int nb) {
    int k = 0;
    while (k < na && k < nb && a[k] == b[k]) k++;
    return k;
}

static volatile sig_atomic_t sigint_armed, sigint_stop;

/* Ctrl-C stops the reply (--chat) or continuation being written, whose figures are still printed;
 * a second one, or one while nothing is being written (the chat prompt), ends nemoh at once. */
static void on_sigint(int sig) {
    (void)sig;
    if (!sigint_armed || sigint_stop) _exit(130);
    sigint_stop = 1;
}

/* One assistant turn: render the whole conversation, resume from the longest prefix of it the
 * engine can reach (its live state when the rendering extends what it consumed; else the snapshot
 * taken at the last turn boundary, when that lies before the first changed token; else the
 * start), prefill the rest, then sample, stream and feed back the reply, which joins the
 * conversation. Mamba state cannot be rewound, so the snapshot is what makes the second case cheap:
 * the Nemotron 3 and Nano v2 templates re-render the previous reply without its reasoning. */
static void chat_turn(Engine *e, Chat *ch, ChatState *cs, const Tokenizer *tok, const ChatOpts *o, int turn) {
    int n, nb, ctx = e->rank[0].ctx;
    const char *opening;
    int *ids = chat_ids(ch, tok, 1, &opening, &n), *before = chat_ids(ch, tok, 0, NULL, &nb);
    int bound = common_prefix(ids, n, before, nb);   /* where the generation prompt starts */
    free(before);
    if (n >= ctx) die("--chat: the conversation has %d tokens, more than the context of %d (-c)", n, ctx);
    int same = common_prefix(ids, n, cs->ids, cs->n), start;
    const char *from;
    if (same == cs->n && cs->n && cs->n < n) start = cs->n, from = "the live state";
    else if (cs->snap >= 0 && cs->snap <= same) engine_snapshot(e, 1, 0), start = cs->snap, from = "the turn-boundary snapshot";
    else engine_snapshot(e, 0, 0), start = 0, from = "the start";
    cs->ids = tok_grow(cs->ids, &cs->cap, (size_t)ctx, sizeof(int));
    memcpy(cs->ids, ids, (size_t)n * sizeof(int));
    double t0 = now_s();
    if (start <= bound) {
        dec_prefill(&cs->d, ids, start, bound, n);
        engine_snapshot(e, 1, 1), cs->snap = bound;
    }
    dec_prefill(&cs->d, ids, start > bound ? start : bound, n, n);
    double prefill_s = now_s() - t0;

    /* the reply: reasoning (until </think>) dimmed on a terminal, or not shown with --hide-think */
    int made = 0, *reply = xmalloc((size_t)(ctx - n + 1) * sizeof(int));
    int thinking = !strcmp(opening, "<think>\n") && ch->think_end >= 0, tty = isatty(1);
    TokStream ts = {0};
    if (thinking && tty && !o->hide_think) fputs("\033[2m", stdout);
    sigint_armed = 1, sigint_stop = 0;
    cs->d.left = o->n;
    for (int i = 0; i < o->n && !sigint_stop; i++) {
        int next = dec_next(&cs->d);
        if (next == ch->end_turn || is_eos(&e->c, next)) break;
        reply[made++] = next;
        if (!thinking || !o->hide_think) tok_stream_put(tok, &ts, next, stdout);
        check_stdout();
        if (thinking && next == ch->think_end) {
            thinking = 0;
            if (tty && !o->hide_think) fputs("\033[0m", stdout);
        }
        if (dec_at(&cs->d) + 1 >= ctx) { fprintf(stderr, "nemoh: the reply stopped at the end of the context (%d tokens; -c sets it)\n", ctx); break; }
        if (i == o->n - 1) break;
        cs->ids[dec_at(&cs->d)] = next;   /* fed by the next step */
    }
    dec_stop(&cs->d);
    free(ids);
    sigint_armed = 0;
    tok_stream_end(tok, &ts, stdout);
    if (thinking && tty && !o->hide_think) fputs("\033[0m", stdout);
    fputs("\n", stdout);
    check_stdout();
    double decode_s = now_s() - t0 - prefill_s;
    fprintf(stderr, "nemoh: turn %d: prefilled %d of %d tokens in %.3f s (from %s); decoded %d token%s in %.3f s (%.1f tok/s)\n",
            turn, n - start, n, prefill_s, from, made, made == 1 ? "" : "s", decode_s, made / decode_s);
    cs->n = cs->d.pos;
    size_t len;
    char *text = tok_decode(tok, reply, made, &len), *content = xmalloc(strlen(opening) + len + 1);
    memcpy(content, opening, strlen(opening));
    memcpy(content + strlen(opening), text, len);
    chat_add(ch, 'a', content, strlen(opening) + len);
    free(content);
    free(text);
    free(reply);
}

/* Reads one user message from stdin: a line, or lines joined while they end in a backslash.
 * NULL at EOF or /exit. */
static char *chat_read(size_t *len) {
    char *line = NULL, *msg = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (isatty(0)) fputs(msg ? ". " : "> ", stdout), fflush(stdout);
        ssize_t k = getline(&line, &cap, stdin);
        if (k < 0) {
            free(line);
            if (msg) die("stdin: the input ended inside a continued message (its last line ends in \\)");
            return NULL;
        }
        if (k && line[k - 1] == '\n') line[--k] = 0;
        if (k && line[k - 1] == '\r') line[--k] = 0;
        int more = k && line[k - 1] == '\\';
        if (more) line[--k] = '\n', k++;
        msg = realloc(msg, n + (size_t)k + 1);
        if (!msg) die("out of memory");
        memcpy(msg + n, line, (size_t)k + 1);
        n += (size_t)k;
        if (more) continue;
        if (!strcmp(msg, "/exit")) { free(msg); free(line); return NULL; }
        if (n) { free(line); *len = n; return msg; }
        free(msg), msg = NULL;
    }
}

/* --chat: the reply to PROMPT or to the conversation in -f FILE, then (interactive) a conversation
 * on stdin. With --dump-logits, the logits of every position of the conversation as the engine last
 * computed them, and its ids on stderr. */
static void chat_run(Engine *e, Chat *ch, const Tokenizer *tok, const ChatOpts *o, int interactive) {
    ChatState cs = {.snap = -1, .d = {.e = e, .k = o->mtp, .temp = o->temp, .topp = o->topp, .seed = o->seed,
                                      .ctx = e->rank[0].ctx, .dump = o->dump != NULL}};
    engine_snapshot(e, 0, 1);   /* slot 0: the empty state, for "from the start" */
    int turn = 1;
    if (interactive) signal(SIGINT, on_sigint);
    if (ch->n_msg && ch->msg[ch->n_msg - 1].role == 'u') chat_turn(e, ch, &cs, tok, o, turn++);
    size_t len;
    for (char *m; interactive && (m = chat_read(&len)); free(m)) {
        chat_add(ch, 'u', m, len);
        chat_turn(e, ch, &cs, tok, o, turn++);
    }
    if (o->dump) {
        dump_rows(cs.d.rows, cs.n, e->c.vocab, o->dump, "--dump-logits");
        fprintf(stderr, "nemoh: conversation ids:");
        for (int i = 0; i < cs.n; i++) fprintf(stderr, " %d", cs.ids[i]);
        fprintf(stderr, "\n");
    }
    free(cs.ids);
    free(cs.d.rows);
}

static void chat_free(Chat *ch) {
    for (int i = 0; i < ch->n_msg; i++) free(ch->msg[i].text);
    free(ch->msg);
}

/* ------------------------------------------------------------------------------------------------
 * Generation, benchmarks and the command line
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    int n;                      /* most tokens to generate */
    float temp, topp;           /* sampling temperature (0: greedy), top-p */
    uint64_t seed;              /* sampling seed */
    FILE *dump;                 /* --dump-logits file, or NULL */
    FILE *dump_mtp;             /* --dump-mtp file, or NULL */
    int mtp;                    /* --mtp: drafts a step (0: none) */
    int trace;                  /* --trace */
    int quiet;                  /* print nothing (--bench) */
    const Tokenizer *tok;       /* stream generated text through it; NULL: print token ids */
} GenOpts;

typedef struct {
    double prefill_s, decode_s; /* wall time of the prompt's forwards, of the generated tokens' */
    int prefilled;              /* prompt tokens run (fewer than the prompt's after Ctrl-C) */
    int made;                   /* tokens generated */
    int full;                   /* 1: stopped because the context was full */
    long steps, fed, accepted;  /* drafting: verify steps, drafts fed, drafts accepted */
    long hist[SPEC_MAX + 1];    /* steps by drafts accepted */
} GenStats;

static int is_eos(const Config *c, int id) {
    for (int i = 0; i < c->n_eos; i++) if (c->eos[i] == id) return 1;
    return 0;
}

/* Prefill the prompt (in chunks of t_max), then sample, print and feed back one token at a time, or
 * a step's accepted tokens at a time with drafting (Decoder); Ctrl-C (on_sigint) stops either at the
 * next step. */
static GenStats generate(Engine *e, const int *prompt, int n_prompt, const GenOpts *o) {
    int ctx = e->rank[0].ctx;
    GenStats st = {0};
    TokStream ts = {0};
    Decoder d = {.e = e, .k = o->mtp, .temp = o->temp, .topp = o->topp, .seed = o->seed, .ctx = ctx, .left = o->n,
                 .dump = o->dump != NULL, .dump_mtp = o->dump_mtp != NULL};
    const char *force = getenv("NEMOH_TEST_DRAFTS");
    int *forced = force && o->mtp ? parse_ids(force, &d.n_force) : NULL;
    d.force = forced;
    double t0 = now_s();
    sigint_armed = 1;
    while (d.pos < n_prompt && !sigint_stop) {   /* one chunk at a time, so that Ctrl-C stops between them */
        int T = n_prompt - d.pos < e->rank[0].t_max ? n_prompt - d.pos : e->rank[0].t_max;
        dec_prefill(&d, prompt, d.pos, d.pos + T, n_prompt);
    }
    st.prefilled = d.pos;
    for (int i = 0; i < o->n && !sigint_stop; i++) {
        for (int k = 0; k < e->n; k++) e->rank[k].trace = o->trace && i == 1;
        if (o->trace && i == 1 && !o->quiet) fflush(stdout), fputc('\n', stderr);   /* the trace on a line of its own */
        int next = dec_next(&d);
        if (i == 0) st.prefill_s = now_s() - t0;  /* includes the first token's sampling */
        int eos = is_eos(&e->c, next);
        if (!o->quiet && o->tok && !eos) tok_stream_put(o->tok, &ts, next, stdout);  /* flushes whole characters */
        if (!o->quiet && !o->tok) printf("%s%d", st.made ? " " : "", next);
        if (!o->quiet) check_stdout();
        st.made++;
        st.full = !eos && i < o->n - 1 && dec_at(&d) == ctx;
        if (eos || i == o->n - 1 || dec_at(&d) == ctx) break;
    }
    for (int k = 0; k < e->n; k++) e->rank[k].trace = 0;
    if (o->dump) dump_rows(d.rows, st.made ? dec_at(&d) : d.pos, e->c.vocab, o->dump, "--dump-logits");
    if (o->dump_mtp && st.made) dump_rows(d.mtp_rows, dec_at(&d), e->rank[0].draft_vocab, o->dump_mtp, "--dump-mtp");
    st.steps = d.steps, st.fed = d.fed, st.accepted = d.accepted;
    memcpy(st.hist, d.hist, sizeof st.hist);
    free(d.rows);
    free(d.mtp_rows);
    free(forced);
    if (!o->quiet && o->tok) tok_stream_end(o->tok, &ts, stdout);
    if (!o->quiet) {
        printf("\n");
        check_stdout();
    }
    if (!st.made) st.prefill_s = now_s() - t0;
    st.decode_s = now_s() - t0 - st.prefill_s;
    sigint_armed = 0;
    return st;
}

/* Bytes a matrix element takes as stored (NVFP4: half a byte and its share of a block scale); the
 * GPU keeps f16 as fp32. */
static double elem_bytes(const Mat *m, int gpu) {
    return m->dtype == DT_NVFP4 ? 0.5 + 1.0 / 16 : m->dtype == DT_F16 && gpu ? 4 : dtype_size[m->dtype];
}

/* Bytes one decode step moves through memory on one rank: every weight matrix once (one row of the
 * embedding; of the routed experts only the top_k a token chooses, with the router, the shared expert
 * and the latent projections), the Mamba conv and SSM state read and written, the KV cache read up to pos. */
static double decode_bytes(const Rank *r, int pos, int gpu) {
    const Config *c = r->c;
    const Shard *s = &r->s;
    double b = 0;
#define MB(m, rows) ((double)(rows) * (m).cols * elem_bytes(&(m), gpu))
    b += MB(r->w.embed, 1) + MB(r->w.lm_head, s->vocab);
    for (int l = 0; l < c->n_layers; l++) {
        const Layer *L = &r->w.layer[l];
        if (L->kind == K_MAMBA)
            b += MB(L->in_proj[0], s->in_proj) + MB(L->out, c->hidden) +
                 2.0 * 4 * ((double)s->d_inner * c->d_state + (double)s->conv * (c->d_conv - 1));
        else if (L->kind == K_ATTN)
            b += MB(L->wq, (s->q + 2 * s->kv) * c->head_dim) + MB(L->wo, c->hidden) +   /* the GPU's cache is bf16 for bf16 weights */
                 2.0 * (gpu && L->wq.dtype == DT_BF16 ? 2 : 4) * pos * s->kv * c->head_dim;
        else if (L->kind == K_MLP)
            b += MB(L->up, s->mlp) + MB(L->down, c->hidden);
        else
            b += 4.0 * c->n_experts * c->hidden + c->top_k * (MB(L->eup[0], s->moe) + MB(L->edown[0], L->edown[0].rows)) +
                 MB(L->sup, s->shared) + MB(L->sdown, c->hidden) + (c->latent ? MB(L->lat_in, c->latent) + MB(L->lat_out, c->hidden) : 0);
    }
#undef MB
    return b;
}

/* Host memory copy bandwidth, bytes read + written, GB/s: the CPU backend's ceiling. */
static double host_copy_gbps(void) {
    size_t n = 256u << 20;
    void *(*volatile copy)(void *, const void *, size_t) = memcpy;  /* opaque: not moved past the clock */
    char *a = xmalloc(n), *b = xmalloc(n);
    memset(a, 1, n);
    copy(b, a, n);
    double t0 = now_s();
    for (int i = 0; i < 4; i++) copy(i & 1 ? a : b, i & 1 ? b : a, n);
    double gbps = 2.0 * n * 4 / (now_s() - t0) / 1e9;
    free(a);
    free(b);
    return gbps;
}

/* The end-of-run line of drafting: steps, acceptance length (tokens a step emits), drafts accepted. */
static void print_drafting(const GenStats *st, int k, int vocab) {
    if (!st->steps) { fprintf(stderr, "nemoh: mtp: no drafting step ran (the first token comes from the prompt)\n"); return; }
    fprintf(stderr, "nemoh: mtp: %d draft%s a step among ids below %d; %ld steps, acceptance length %.2f (%ld of %ld drafts accepted; steps by accepted:",
            k, k == 1 ? "" : "s", vocab, st->steps, (double)(st->steps + st->accepted) / st->steps, st->accepted, st->fed);
    for (int i = 0; i <= k; i++) fprintf(stderr, " %ld", st->hist[i]);
    fprintf(stderr, ")\n");
}

/* --bench: a prompt of prompt_len (-P) random tokens, then n greedy tokens; one table. */
static void bench(Engine *e, const char *model, int prompt_len, int n, int gpu) {
    Rank *r = &e->rank[0];
    if (prompt_len < 1 || prompt_len + n > r->ctx) die("--bench: -P %d plus -n %d tokens exceed the context of %d (-c)", prompt_len, n, r->ctx);
    if (e->c.vocab < 4) die("--bench: vocab_size %d: the random prompt draws ids from 3 up (0 to 2 are special)", e->c.vocab);
    int *prompt = xmalloc((size_t)prompt_len * sizeof(int));
    for (int i = 0; i < prompt_len; i++) prompt[i] = 3 + (int)(coin(99, (uint64_t)i) * (e->c.vocab - 3));
    GenOpts o = {.n = n, .temp = 0, .topp = 1, .quiet = 1}, warm = o;
    warm.n = 4 + 2 * r->spec;
    warm.mtp = r->spec;
    /* warm-up, the same prompt: libraries load the kernels for these shapes and the decode graphs are
       captured here, not in the timed run (the state it leaves behind changes the numbers, not the work) */
    generate(e, prompt, prompt_len, &warm);
    GenStats st = generate(e, prompt, prompt_len, &o), sd = {0};
    if (r->spec) o.mtp = r->spec, sd = generate(e, prompt, prompt_len, &o);   /* the same, drafting */
    double copy = gpu ? 0 : host_copy_gbps(), ms = st.made > 1 ? st.decode_s * 1e3 / (st.made - 1) : 0;
    double bytes = decode_bytes(r, prompt_len + st.made / 2, gpu), gbps = ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0;
    const char *device = "CPU", *path = r->fuse ? "fused" : "all-reduce at layer end (--no-fuse)";
    double used = 0;
#ifdef NEMOH_CUDA
    if (gpu) {
        copy = cuda_copy_gbps();
        device = cuda_device_name();
        path = cuda_fuse_path(r);
        for (int i = 0; i < e->n; i++) used = fmax(used, (double)cuda_used_bytes(&e->rank[i]));
    }
#endif
    printf("| nemoh --bench | |\n|---|---|\n");
    if (copy > 0) printf("| device | %s%s, copy bandwidth %.0f GB/s (read + write, measured now) |\n", device, gpu ? "" : " (host memory)", copy);
    else printf("| device | %s, copy bandwidth not measured (the model leaves under 128 MB free) |\n", device);
    printf("| model | %s |\n| tensor parallel | %d rank%s, %s |\n", model, e->n, e->n > 1 ? "s" : "", path);
    printf("| prefill | %d tokens in %.3f s: %.0f tok/s |\n", prompt_len, st.prefill_s, prompt_len / st.prefill_s);
    printf("| decode | %d tokens: %.3f ms/token, %.1f tok/s%s |\n", st.made, ms, ms > 0 ? 1e3 / ms : 0, r->spec ? " (no drafts)" : "");
    if (r->spec && sd.made > 1 && sd.steps) {
        double dms = sd.decode_s * 1e3 / (sd.made - 1), step = sd.decode_s * 1e3 / sd.steps, al = (double)(sd.steps + sd.accepted) / sd.steps;
        printf("| decode, %d draft%s a step among ids below %d (--mtp, --mtp-vocab) | %d tokens: %.3f ms/token, %.1f tok/s, %.2fx; acceptance length %.2f |\n",
               r->spec, r->spec == 1 ? "" : "s", r->draft_vocab, sd.made, dms, 1e3 / dms, ms / dms, al);
        printf("| one drafting step | %.3f ms (verify %d tokens, %d MTP passes): drafting pays from acceptance length %.2f |\n", step,
               r->spec + 1, r->spec, step / ms);
    }
    printf("| bytes per decoded token | %.3f GB per rank (weights%s, Mamba state read + write, KV cache) |\n", bytes / 1e9,
           has_kind(&e->c, K_MOE) ? " with the chosen routed experts only" : "");
    printf("| achieved | %.0f GB/s per rank, %.1f%% of the copy bandwidth |\n", gbps, copy > 0 ? 100 * gbps / copy : 0);
    if (gpu) printf("| GPU memory in use | %.2f GB (largest rank) |\n", used / 1e9);
    free(prompt);
}

/* How rank 0's weight matrices are stored: the formats among them, quantized ones first ("bf16",
 * "nvfp4+bf16", "nvfp4+fp8+bf16"), into buf. */
static const char *weights_format(const Rank *r, char *buf, size_t cap) {
    static const int order[] = {DT_NVFP4, DT_FP8, DT_BF16, DT_F16, DT_F32};
    static const char *const name[] = {"f32", "bf16", "f16", "fp8", "", "nvfp4"};
    unsigned seen = 0;
#define SEEN(m) ((m).rows && (m).cols ? seen |= 1u << (m).dtype : 0)
    SEEN(r->w.embed), SEEN(r->w.lm_head);
    for (int l = 0; l < r->c->n_layers; l++) {
        const Layer *L = &r->w.layer[l];
        for (int k = 0; k < 5; k++) SEEN(L->in_proj[k]);
        SEEN(L->out), SEEN(L->wq), SEEN(L->wk), SEEN(L->wv), SEEN(L->wo), SEEN(L->up), SEEN(L->down);
        SEEN(L->sup), SEEN(L->sdown), SEEN(L->lat_in), SEEN(L->lat_out);
        for (int e = 0; L->eup && e < r->c->n_experts; e++) SEEN(L->eup[e]), SEEN(L->edown[e]);
    }
#undef SEEN
    buf[0] = 0;
    for (int k = 0; k < 5; k++)
        if (seen & 1u << order[k]) snprintf(buf + strlen(buf), cap - strlen(buf), "%s%s", buf[0] ? "+" : "", name[order[k]]);
    return buf;
}

/* The parameters every tensor the config names holds, and those one token uses: of the routed
 * experts only the top_k it chooses (everything else: embeddings, norms, router, shared expert). */
static void count_params(const Config *c, double *total, double *active) {
    double H = c->hidden, di = (double)c->m_heads * c->m_hdim, gn = (double)c->n_groups * c->d_state;
    double q = (double)c->n_heads * c->head_dim, kv = (double)c->n_kv * c->head_dim, d = c->latent ? c->latent : H;
    double all = 2.0 * c->vocab * H + H, unused = 0;   /* embedding, lm_head, norm_f */
    for (int l = 0; l < c->n_layers; l++) {
        all += H;                                       /* the layer's norm */
        if (c->kind[l] == K_MAMBA)   /* in_proj, conv (+ bias), A_log, D, dt_bias, gated norm, out_proj */
            all += (2 * di + 2 * gn + c->m_heads) * H + (di + 2 * gn) * (c->d_conv + c->conv_bias) + 3.0 * c->m_heads + di + H * di;
        else if (c->kind[l] == K_ATTN)
            all += (q + 2 * kv) * H + H * q;
        else if (c->kind[l] == K_MLP)
            all += 2.0 * c->mlp * H;
        else {   /* router + bias, routed experts, shared expert, latent projections */
            all += c->n_experts * (H + 1) + c->n_experts * 2.0 * c->moe * d + 2.0 * c->shared * H + 2.0 * c->latent * H;
            unused += (c->n_experts - c->top_k) * 2.0 * c->moe * d;
        }
    }
    *total = all;
    *active = all - unused;
}

/* n in a short form: 14.6M, 31.6B. */
static const char *human(char buf[16], double n) {
    if (n >= 1e9) snprintf(buf, 16, "%.1fB", n / 1e9);
    else if (n >= 1e6) snprintf(buf, 16, "%.1fM", n / 1e6);
    else snprintf(buf, 16, "%.0f", n);
    return buf;
}

/* One line, as llama-cli prints at load: the layers by kind, the parameters (active ones with MoE),
 * the storage format, the context, the backend and ranks, and the sampling settings. */
static void print_loaded(const Engine *e, const char *model, double secs, const GenOpts *o) {
    const Config *c = &e->c;
    char kinds[64] = "", b1[16], b2[16], active_s[48] = "", sampling[96], fmt[48];
    for (const char *k = "M*-E"; *k; k++) {
        int n = 0;
        for (int l = 0; l < c->n_layers; l++) n += c->kind[l] == *k;
        if (n) snprintf(kinds + strlen(kinds), sizeof kinds - strlen(kinds), "%s%d %c", *kinds ? ", " : "", n, *k);
    }
    double total, active;
    count_params(c, &total, &active);
    if (active < total) snprintf(active_s, sizeof active_s, " (%s active per token)", human(b2, active));
    if (o->temp > 0) snprintf(sampling, sizeof sampling, "temperature %g, top-p %g", o->temp, o->topp);
    else snprintf(sampling, sizeof sampling, "greedy");
    fprintf(stderr, "nemoh: loaded %s in %.2f s: %d layers (%s), %s parameters%s, %s, context %d; backend %s, %d rank%s; %s, seed %llu\n",
            model, secs, c->n_layers, kinds, human(b1, total), active_s, weights_format(&e->rank[0], fmt, sizeof fmt), e->rank[0].ctx,
            e->be->name, e->n, e->n > 1 ? "s" : "", sampling, (unsigned long long)o->seed);
}

static void usage(void) {
    fputs("usage: nemoh [options] [PROMPT]\n"
          "  -m DIR             model directory: config.json, *.safetensors (default: weights)\n"
          "  -n N               tokens to generate (default 256)\n"
          "  -t TEMP            sampling temperature, 0 = greedy (default 0.8)\n"
          "  -p TOPP            top-p (default 0.95)\n"
          "  -s SEED            sampling seed (default: from the clock, printed on stderr)\n"
          "  -c CTX             context length (default: the config's max_position_embeddings)\n"
          "  --cpu              run on the CPU even when a GPU is present\n"
          "  -f FILE            read the prompt from FILE\n"
          "  --tokenizer FILE   tokenizer.json to use (default: DIR/tokenizer.json)\n"
          "  --encode           print the prompt's token ids as the model receives them, and exit\n"
          "  --ids \"1 2 3\"      the prompt as token ids (spaces or commas)\n"
          "  --print-ids        print generated token ids instead of text (the default without a tokenizer)\n"
          "  --dump-logits FILE float32 logits, one row of vocab_size per forward position\n"
          "  --mtp K            draft K tokens a step with the model's multi-token prediction block and verify\n"
          "                     them in one forward (0..8; default at -t 0: 2 on a GPU, 4 on an AMX CPU; else 0)\n"
          "  --mtp-vocab N      draft among the first N token ids only (BPE's most frequent; default on the CPU:\n"
          "                     vocab_size / 8 rounded up, on a GPU: all); each MTP pass computes N rows of lm_head\n"
          "  --dump-mtp FILE    float32 logits of the MTP block, one row per position (the token after it known),\n"
          "                     of the --mtp-vocab ids\n"
          "  --tp N|all         tensor-parallel ranks (default 1; all: every visible GPU)\n"
          "  --no-fuse          all-reduce at each layer's end instead of fused into the next norm\n"
          "  --trace            print what each layer of the first decode step runs\n"
          "  --chunk N          prompt tokens per forward step (default on a GPU: 2048, 8192 for prompts longer than\n"
          "                     2048 tokens unless logits are dumped; 128 on the CPU)\n"
          "                     (a larger step reads long prompts faster and takes more GPU memory)\n"
          "  --no-graph         run decode steps eagerly instead of replaying a CUDA graph\n"
          "  --random PRESET    random weights at a published shape (no files needed):\n"
          "                     nemotron-h-4b, nemotron-h-8b, nemotron-h-47b, nemotron-h-56b, nemotron-nano-9b-v2,\n"
          "                     nemotron-nano-12b-v2, nemotron-3-nano-4b, nemotron-3-nano-30b-a3b (MoE),\n"
          "                     nemotron-3-super-120b-a12b (latent MoE), synthetic-100m; NAME-fp8, NAME-nvfp4:\n"
          "                     quantized as NVIDIA's releases are (nemotron-3-super-120b-a12b-nvfp4: its mix)\n"
          "  --bench            time a prompt of -P tokens (default 512) and -n decoded tokens; print a table\n"
          "  -P N               prompt length for --bench\n"
          "  --bench-allreduce  time the fused all-reduce + add + RMSNorm against ncclAllReduce + add + RMSNorm\n"
          "                     for 1..2048 tokens over --tp GPUs (no weights needed)\n"
          "  --hidden N         hidden size for --bench-allreduce (default 4096)\n"
          "  --chat             chat in the model's own format (its tokenizer_config.json chat_template or\n"
          "                     chat_template.jinja): reply to PROMPT, to -f FILE (a JSON list of messages),\n"
          "                     or without either hold a conversation on stdin: a message a line (a line\n"
          "                     ending in \\ continues it), /exit or EOF ends, Ctrl-C stops a reply; with\n"
          "                     --encode, print the rendered conversation's ids; -n: most tokens a reply\n"
          "                     (default: until its end-of-turn token)\n"
          "  -i                 a conversation on stdin (--chat; after the reply to PROMPT or -f FILE)\n"
          "  --system TEXT      the system message (--chat)\n"
          "  --think, --no-think  the format's reasoning switch (--chat; default: the template's)\n"
          "  --hide-think       do not print the reasoning (--chat; printed dimmed on a terminal otherwise)\n"
          "  -h, --help         this help\n", stdout);
}

/* Parses "1 2 3" or "1,2,3". */
static int *parse_ids(const char *s, int *n) {
    int *ids = xmalloc((strlen(s) / 2 + 1) * sizeof(int)), k = 0;
    const char *p = s;
    while (*p) {
        while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > 0x7FFFFFFF) die("--ids: bad token id near \"%.16s\"", p);
        ids[k++] = (int)v;
        p = end;
    }
    *n = k;
    return ids;
}

static int arg_int(const char *flag, const char *v, long lo, long hi) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) die("%s: expected an integer in [%ld, %ld], got \"%s\"", flag, lo, hi, v);
    return (int)x;
}

static float arg_float(const char *flag, const char *v, float lo, float hi) {
    char *end;
    float x = strtof(v, &end);
    if (!*v || *end || !(x >= lo && x <= hi)) die("%s: expected a number in [%g, %g], got \"%s\"", flag, lo, hi, v);
    return x;
}

/* Refuses a rank count that does not split the model, listing the counts that do. */
static void check_tp(const Config *c, int n) {
    Shard s;
    const char *why = shard_sizes(&s, c, 0, n);
    if (!why) return;
    char valid[256] = "";
    for (int k = 1; k <= 64; k++)
        if (!shard_sizes(&s, c, 0, k)) snprintf(valid + strlen(valid), sizeof valid - strlen(valid), " %d", k);
    die("--tp %d: the rank count must divide %s; valid:%s", n, why, valid);
}

#ifndef NEMOH_NO_MAIN
int main(int argc, char **argv) {
    const char *dir = "weights", *ids_arg = NULL, *prompt = NULL, *dump_path = NULL, *preset = NULL, *tp_arg = "1";
    const char *mtp_path = NULL;
    const char *tok_path = NULL, *prompt_file = NULL;
    int ctx = 0, use_cpu = 0, have_seed = 0, fuse = 1, graph = 1, chunk = 0, do_bench = 0, bench_ar = 0, P = 512;
    int hidden = 4096, n_set = 0, encode = 0, print_ids = 0, chat = 0, interactive = 0, hide_think = 0, rc = 0, mtp = -1, mtp_vocab = 0;
    const char *system = NULL;
    Chat ch = {.think = -1};
    GenOpts o = {.n = 256, .temp = 0.8f, .topp = 0.95f};
    if (fcntl(STDOUT_FILENO, F_GETFD) < 0) die("stdout is closed");   /* else a file opened later would take its place */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
#define VALUE() (more ? argv[++i] : (die("%s: missing value", a), ""))
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); check_stdout(); return 0; }
        else if (!strcmp(a, "-m")) dir = VALUE();
        else if (!strcmp(a, "-n")) { o.n = arg_int(a, VALUE(), 0, 1 << 30); n_set = 1; }
        else if (!strcmp(a, "-t")) o.temp = arg_float(a, VALUE(), 0, 100);
        else if (!strcmp(a, "-p")) o.topp = arg_float(a, VALUE(), 0, 1);
        else if (!strcmp(a, "-s")) { o.seed = (uint64_t)arg_int(a, VALUE(), 0, 0x7FFFFFFF); have_seed = 1; }
        else if (!strcmp(a, "-c")) ctx = arg_int(a, VALUE(), 1, 1 << 24);
        else if (!strcmp(a, "--cpu")) use_cpu = 1;
        else if (!strcmp(a, "--ids")) ids_arg = VALUE();
        else if (!strcmp(a, "-f")) prompt_file = VALUE();
        else if (!strcmp(a, "--tokenizer")) tok_path = VALUE();
        else if (!strcmp(a, "--encode")) encode = 1;
        else if (!strcmp(a, "--print-ids")) print_ids = 1;
        else if (!strcmp(a, "--dump-logits")) dump_path = VALUE();
        else if (!strcmp(a, "--dump-mtp")) mtp_path = VALUE();
        else if (!strcmp(a, "--mtp")) mtp = arg_int(a, VALUE(), 0, SPEC_MAX);
        else if (!strcmp(a, "--mtp-vocab")) mtp_vocab = arg_int(a, VALUE(), 1, 1 << 30);
        else if (!strcmp(a, "--random")) preset = VALUE();
        else if (!strcmp(a, "--tp")) tp_arg = VALUE();
        else if (!strcmp(a, "--no-fuse")) fuse = 0;
        else if (!strcmp(a, "--trace")) o.trace = 1;
        else if (!strcmp(a, "--chunk")) chunk = arg_int(a, VALUE(), 1, 1 << 16);
        else if (!strcmp(a, "--no-graph")) graph = 0;
        else if (!strcmp(a, "--bench")) do_bench = 1;
        else if (!strcmp(a, "-P")) P = arg_int(a, VALUE(), 1, 1 << 24);
        else if (!strcmp(a, "--bench-allreduce")) bench_ar = 1;
        else if (!strcmp(a, "--hidden")) hidden = arg_int(a, VALUE(), 8, 1 << 16);
        else if (!strcmp(a, "--chat")) chat = 1;
        else if (!strcmp(a, "-i")) chat = interactive = 1;
        else if (!strcmp(a, "--system")) system = VALUE();
        else if (!strcmp(a, "--think")) ch.think = 1;
        else if (!strcmp(a, "--no-think")) ch.think = 0;
        else if (!strcmp(a, "--hide-think")) hide_think = 1;
        else if (a[0] == '-' && a[1]) die("%s: unknown option (see nemoh -h)", a);
        else if (prompt) die("%s: only one prompt argument is allowed (quote it)", a);
        else prompt = a;
#undef VALUE
    }
    if (!have_seed) o.seed = (uint64_t)time(NULL) & 0x7FFFFFFF;
    int gpus = 0;
#ifdef NEMOH_CUDA
    if (!use_cpu) gpus = cuda_devices();
#endif
    int tp_all = !strcmp(tp_arg, "all");
    if (tp_all && (!gpus || gpus > 64)) die("--tp all: %d GPUs visible; give --tp N (1 to 64)", gpus);
    int tp = tp_all ? gpus : arg_int("--tp", tp_arg, 1, 64);
    if (bench_ar) {
        if (!gpus) die("--bench-allreduce: needs a GPU (none visible%s)", use_cpu ? ", --cpu given" : "");
        if (hidden % 4) die("--hidden %d: must be a multiple of 4", hidden);
#ifdef NEMOH_CUDA
        return cuda_bench_allreduce(tp, hidden) ? 1 : 0;
#endif
    }

    if ((prompt != NULL) + (prompt_file != NULL) + (ids_arg != NULL) > 1) die("give one prompt: text, -f FILE or --ids");
    if (!chat && (system || ch.think >= 0 || hide_think)) die("--system, --think, --no-think and --hide-think need --chat");
    if (chat && (ids_arg || preset || do_bench)) die("--chat: takes a model directory and a text prompt (not --ids, --random or --bench)");
    if (chat && (print_ids || o.trace)) die("--chat: prints the replies as text (not with --print-ids or --trace)");
    if (do_bench && (prompt || prompt_file || ids_arg || dump_path || o.trace))
        die("--bench: times a prompt of -P random tokens (not with a prompt, -f, --ids, --dump-logits or --trace)");

    /* the config first: the model directory is checked before any file in it is named, and the
       context bounds the prompt (--encode needs no model, only its directory's tokenizer.json) */
    double t0 = now_s();
    Engine e = {0};
    int quant = 0;   /* --random NAME-fp8 / NAME-nvfp4 */
    if (preset) preset_config(&e.c, find_preset(preset, &quant));
    else if (!encode) config_load(&e.c, dir);
    else if (!tok_path) model_dir(dir);
    if (ctx == 0) ctx = e.c.ctx;
    if (mtp > 0 && !e.c.n_mtp && !encode)
        die("--mtp %d: %s has no multi-token prediction block (num_nextn_predict_layers)", mtp, preset ? preset : dir);
    int mtp_in_config = e.c.n_mtp > 0;
    if (mtp < 0) mtp = e.c.n_mtp ? mtp_default(gpus > 0, do_bench ? 0 : o.temp) : 0;
    if (!mtp) e.c.n_mtp = 0;   /* the block is not read: --mtp 0 runs a model whose MTP tensors are broken */
    if (mtp_path && !mtp) die("--dump-mtp: needs drafting (a model with an MTP block, and --mtp K where it is not on by default)");
    if (mtp_vocab && !mtp) die("--mtp-vocab: needs drafting (a model with an MTP block, and --mtp K where it is not on by default)");
    if (mtp_vocab > e.c.vocab) die("--mtp-vocab %d: the vocabulary has %d tokens", mtp_vocab, e.c.vocab);

    /* the tokenizer: --tokenizer FILE, else the model directory's tokenizer.json when there is one */
    char tpath[4096];
    int need_tok = encode || ((prompt || prompt_file || !ids_arg) && !do_bench);
    if (!tok_path && !preset) {
        snprintf(tpath, sizeof tpath, "%s/tokenizer.json", dir);
        if (file_exists(tpath) || need_tok) tok_path = tpath;
    }
    if (need_tok && !tok_path) die(encode ? "--encode needs a tokenizer: give --tokenizer FILE or -m DIR with tokenizer.json"
                                          : "a text prompt needs a tokenizer: give --tokenizer FILE, or --ids");
    Tokenizer *tok = tok_path ? tok_load(tok_path) : NULL;
    int n_prompt = 0, *tokens = NULL;
    const char *prompt_text = "";
    char *file_text = NULL;
    if (chat) {   /* the conversation: --system, then -f FILE's messages or PROMPT; stdin after that */
        chat_detect(&ch, dir, tok);
        if (system) chat_add(&ch, 's', system, strlen(system));
        if (prompt_file) chat_load(&ch, prompt_file);
        if (system && ch.n_msg > 1 && ch.msg[1].role == 's') die("--system: -f %s has a system message already", prompt_file);
        if (prompt) chat_add(&ch, 'u', prompt, strlen(prompt));
        interactive |= !prompt && !prompt_file;
        if (encode && !prompt && !prompt_file) die("--chat --encode: give the conversation (PROMPT or -f FILE)");
        if (encode) tokens = chat_ids(&ch, tok, 1, NULL, &n_prompt);
    } else if (ids_arg) {
        tokens = parse_ids(ids_arg, &n_prompt);
    } else if (!do_bench) {
        /* text longer than ctx times the longest token has more than ctx tokens: refused unread
           (-f reads until EOF: pipes, FIFOs, /proc files), and encoding stops past the context */
        size_t cap = encode ? (size_t)1 << 30 : (size_t)ctx * (size_t)tok->max_piece;
        size_t len = prompt ? strlen(prompt) : 0;
        file_text = prompt_file ? read_file(prompt_file, &len, cap) : NULL;
        if (prompt_file && !file_text) die("-f %s: cannot open: %s", prompt_file, strerror(errno));
        if (len > cap && encode) die("-f %s: larger than %zu bytes", prompt_file, cap);
        if (len > cap) die("the prompt is more than the context of %d tokens (-c)", ctx);
        prompt_text = file_text ? file_text : prompt ? prompt : "";
        tokens = tok_encode(tok, prompt_text, len, encode ? 0 : (size_t)ctx, &n_prompt);
    }
    if (encode) {
        for (int i = 0; i < n_prompt; i++) printf("%s%d", i ? " " : "", tokens[i]);
        printf("\n");
        check_stdout();
        free(tokens);
        free(file_text);
        chat_free(&ch);
        tok_free(tok);
        return 0;
    }
    o.tok = print_ids ? NULL : tok;
    if (chat && !n_set) o.n = 1 << 30;   /* a reply ends at its end-of-turn token, or the context */

    const Backend *be = &cpu_backend;
#ifdef NEMOH_CUDA
    if (gpus) be = &cuda_backend;
#endif
    if (!mtp_vocab) mtp_vocab = be == &cpu_backend ? (e.c.vocab + 7) / 8 : e.c.vocab;
    if (has_kind(&e.c, K_MOE) && !be->moe)
        die("%s: the %s backend does not run mixture-of-experts layers yet; run it with --cpu", preset ? preset : dir, be->name);
    Checkpoint ck;
    int n_mtp = 0;
    if (preset) {
        build_random_checkpoint(&ck, &e.c, 1234, gpus == 0, quant);
    } else {
        build_checkpoint(&ck, dir);
        n_mtp = st_check_extra(&ck, &e.c);
    }
    check_tp(&e.c, tp);
    if (tok && tok_vocab_size(tok) > e.c.vocab)
        die("%s: %d tokens, more than the model's vocab_size %d", tok_path, tok_vocab_size(tok), e.c.vocab);
    if (tok && tok_vocab_size(tok) < e.c.vocab)   /* checkpoints pad vocab_size past their tokenizer: accepted */
        fprintf(stderr, "nemoh: warning: %s has %d ids, the model %d: ids from %d up have no text and print as <id N>\n",
                tok_path, tok_vocab_size(tok), e.c.vocab, tok_vocab_size(tok));
    if (!do_bench && !chat && n_prompt == 0) die("the prompt is empty (and the tokenizer adds no BOS)");
    for (int i = 0; i < n_prompt; i++)
        if (tokens[i] >= e.c.vocab) die("--ids: token id %d is outside the vocabulary (vocab_size %d)", tokens[i], e.c.vocab);
    if (n_prompt > ctx) die("the prompt is more than the context of %d tokens (-c)", ctx);
    if (dump_path && !(o.dump = fopen(dump_path, "wb"))) die("--dump-logits %s: cannot open for writing", dump_path);
    if (mtp_path && !(o.dump_mtp = fopen(mtp_path, "wb"))) die("--dump-mtp %s: cannot open for writing", mtp_path);
    o.mtp = mtp;

    /* on a GPU a prompt past 2048 tokens goes 8192 a step: its attention and expert products run on
       larger tiles of work (a 32k-token prompt on nemotron-3-nano-30b-a3b: 20% faster, bench/RESULTS.md);
       not where logits are dumped, whose buffers hold a step's rows of the vocabulary */
    int longp = (do_bench ? P : n_prompt) > 2048 && !o.dump && !o.dump_mtp, t_max = chunk ? chunk : gpus ? (longp ? 8192 : 2048) : 128;
    if (t_max < mtp + 1) t_max = mtp + 1;   /* a step verifies the last token and its drafts in one forward */
    if (t_max > ctx) t_max = ctx;
    cpu_threads = (int)sysconf(_SC_NPROCESSORS_ONLN) / tp;
    if (cpu_threads < 1) cpu_threads = 1;
    build_engine(&e, &ck, be, tp, t_max, ctx, fuse, o.dump || o.dump_mtp ? t_max : mtp + 1, graph, mtp);
    for (int i = 0; i < e.n; i++) e.rank[i].draft_vocab = mtp_vocab;
    GenOpts shown = o;
    if (do_bench) shown.temp = 0;   /* --bench decodes greedily */
    print_loaded(&e, preset ? preset : dir, now_s() - t0, &shown);
    if (n_mtp && !mtp)
        fprintf(stderr, "nemoh: %d mtp.* tensors (multi-token prediction heads) are not used%s\n", n_mtp,
                mtp_in_config ? " (--mtp K drafts K tokens a step with them)" : "");
    if (ctx > e.c.ctx)
        fprintf(stderr, "nemoh: note: -c %d is more than the %d positions the model was trained on (max_position_embeddings)\n",
                ctx, e.c.ctx);
    if (!chat && !do_bench && !ids_arg && !*prompt_text)
        fprintf(stderr, "nemoh: note: the prompt is empty: generating from the tokenizer's BOS alone\n");
    if (do_bench) {
        bench(&e, preset ? preset : dir, P, n_set ? o.n : 256, gpus > 0);
    } else if (chat) {
        ChatOpts co = {o.n, o.temp, o.topp, o.seed, hide_think, o.dump, mtp};
        chat_run(&e, &ch, tok, &co, interactive);
    } else {
        if (o.tok) {  /* the prompt first (ids as the tokenizer decodes them), then the continuation */
            size_t len = 0;
            char *text = ids_arg ? tok_decode(tok, tokens, n_prompt, &len) : NULL;
            if (text) fwrite(text, 1, len, stdout);
            else fputs(prompt_text, stdout);
            free(text);
        }
        signal(SIGINT, on_sigint);
        GenStats st = generate(&e, tokens, n_prompt, &o);
        fprintf(stderr, "nemoh: prefill %d token%s in %.3f s (%.1f tok/s); decode %d token%s in %.3f s (%.1f tok/s)\n",
                st.prefilled, st.prefilled == 1 ? "" : "s", st.prefill_s, st.prefilled ? st.prefilled / st.prefill_s : 0.0,
                st.made, st.made == 1 ? "" : "s", st.decode_s, st.made > 1 ? (st.made - 1) / st.decode_s : 0.0);
        if (mtp) print_drafting(&st, mtp, e.rank[0].draft_vocab);
        if (st.full) fprintf(stderr, "nemoh: stopped at the end of the context (%d tokens; -c sets it)\n", ctx);
        if (sigint_stop) fprintf(stderr, "nemoh: interrupted (Ctrl-C)\n"), rc = 130;
    }
    check_stdout();
    if (o.dump && fclose(o.dump) != 0) die("--dump-logits %s: write failed", dump_path);
    if (o.dump_mtp && fclose(o.dump_mtp) != 0) die("--dump-mtp %s: write failed", mtp_path);
    free_engine(&e);
    free_checkpoint(&ck);
    free(tokens);
    free(file_text);
    chat_free(&ch);
    tok_free(tok);
    return rc;
}
#endif

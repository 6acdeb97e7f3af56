/* nemoh.h: the structs every part of nemoh shares, and the backend interface.
 *
 * nemoh.c holds the host side (the sharding, the plain-C CPU backend, the one layer loop, the ranks,
 * the sampler; then JSON, config, safetensors, the tokenizer, chat, the CLI); nemoh.cu holds the
 * CUDA backend. Both implement `Backend`, the handful of operations the layer loop in nemoh.c calls. */
#ifndef NEMOH_H
#define NEMOH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define NEMOH_HD __host__ __device__
#else
#define NEMOH_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------
 * Model configuration (from config.json) and one rank's share of it
 * ---------------------------------------------------------------------------------------------- */

/* Element formats. A tensor on disk is F32, BF16, F16, F8_E4M3 or U8; a matrix (Mat) is one of the
 * first four or DT_NVFP4, whose weight is a U8 tensor of packed E2M1 pairs beside its block scales. */
enum { DT_F32, DT_BF16, DT_F16, DT_FP8, DT_U8, DT_NVFP4 };
enum { MAX_LAYERS = 512, MAX_EOS = 8 };
enum { SNAPSHOT_SLOTS = 2 };        /* saved recurrent states a rank keeps for --chat */
enum { SPEC_MAX = 8 };              /* most draft tokens one step verifies (--mtp) */

/* Layer kinds: the letters of the layer pattern, so a kind compares equal to its character literal. */
enum { K_MAMBA = 'M', K_ATTN = '*', K_MLP = '-', K_MOE = 'E' };

typedef struct {
    int vocab;                  /* vocab_size */
    int hidden;                 /* hidden_size */
    int n_layers;               /* number of blocks */
    int n_mtp;                  /* sublayers of the multi-token prediction block (0: none) */
    char kind[MAX_LAYERS];      /* [n_layers + n_mtp] K_MAMBA, K_ATTN, K_MLP or K_MOE: the blocks, then
                                   the MTP block's sublayers (attention, MLP or MoE) */
    float eps;                  /* RMSNorm epsilon (all norms) */
    int n_heads, n_kv, head_dim;  /* attention: query heads, key/value heads, head size */
    int mlp;                    /* MLP intermediate size */
    int m_heads, m_hdim;        /* Mamba2 heads and head size; d_inner = m_heads * m_hdim */
    int n_groups, d_state;      /* Mamba2 B/C groups and state size N */
    int d_conv;                 /* causal conv1d kernel width */
    int conv_bias;              /* 1 if conv1d has a bias */
    int ctx;                    /* max_position_embeddings */
    int eos[MAX_EOS], n_eos;    /* eos_token_id (int or list) */
    /* mixture of experts (K_MOE) */
    int n_experts, top_k;       /* n_routed_experts, num_experts_per_tok */
    int n_group, topk_group;    /* router groups, groups kept before the top-k (1, 1: plain top-k) */
    int moe;                    /* moe_intermediate_size: rows of each routed expert's up_proj */
    int shared;                 /* moe_shared_expert_intermediate_size (> 0: one shared expert) */
    int latent;                 /* moe_latent_size; 0: experts work on the hidden state itself */
    int norm_topk;              /* norm_topk_prob: chosen weights divided by their sum (+ 1e-20) */
    float routed_scale;         /* routed_scaling_factor, applied after that */
} Config;

/* Sizes of one tensor-parallel rank's slice; at n = 1 they are the full sizes. */
typedef struct {
    int rank, n;                /* this rank, number of ranks */
    int m_heads, groups;        /* local Mamba heads, local groups (whole groups) */
    int d_inner, conv;          /* local m_heads*m_hdim, local conv channels d_inner + 2*groups*N */
    int in_proj;                /* local in_proj rows: d_inner (z) + conv (x|B|C) + m_heads (dt) */
    int q, kv;                  /* local query heads, local kv heads (replicated when n > n_kv) */
    int q0, kv0;                /* first global query head, first global kv head */
    int mlp;                    /* local MLP intermediate rows */
    int moe, shared;            /* local rows of each routed expert's up_proj, of the shared expert's */
    int vocab;                  /* local lm_head rows (vocab / n) */
} Shard;

/* Columns of the per-token scratch both backends keep: proj, a layer's input projections
 * ([z|x|B|C|dt], [q|k|v], up, or an expert's up); y, a mixer's output before its out projection. */
static inline int proj_width(const Config *c, const Shard *s) {
    int qkv = (s->q + 2 * s->kv) * c->head_dim, w = s->in_proj > qkv ? s->in_proj : qkv;
    if (s->mlp > w) w = s->mlp;
    if (s->moe > w) w = s->moe;
    return s->shared > w ? s->shared : w;
}

static inline int y_width(const Config *c, const Shard *s) {
    return s->d_inner > s->q * c->head_dim ? s->d_inner : s->q * c->head_dim;
}

/* ------------------------------------------------------------------------------------------------
 * Weights: 2-D views into the mmapped checkpoint (never copied on the CPU)
 * ---------------------------------------------------------------------------------------------- */

/* A matrix that knows its format (ModelOpt's quantized ones as NVIDIA publishes them):
 *   DT_F32, DT_BF16, DT_F16  W[i][k] = data[i][k]
 *   DT_FP8                   W[i][k] = e4m3(data[i][k]) * scale                 (weight_scale)
 *   DT_NVFP4                 W[i][k] = e2m1(nibble k of row i) * (e4m3(bs[i][k / 16]) * scale)
 * with data[i][k] the element i * ld + k; an NVFP4 byte holds element 2j in its low nibble, 2j + 1
 * in its high one, and scale is weight_scale_2. mat_at() below is the one definition of the formats. */
typedef struct {
    const void *data;           /* first element of the view, inside the mmapped file (NVFP4: its byte) */
    int dtype;                  /* DT_F32 / DT_BF16 / DT_F16 / DT_FP8 / DT_NVFP4 */
    int rows, cols;             /* shape of the view */
    size_t ld;                  /* elements between the starts of consecutive rows */
    const uint8_t *bs;          /* DT_NVFP4: [rows, bld] E4M3 block scales, from the view's first block */
    size_t bld;                 /* DT_NVFP4: block scales between the starts of consecutive rows */
    float scale;                /* DT_FP8, DT_NVFP4: the per-tensor scale; 1 otherwise */
} Mat;

typedef struct {
    char kind;                  /* K_MAMBA, K_ATTN, K_MLP or K_MOE */
    float *norm;                /* [hidden] fp32 pre-mixer RMSNorm weight */
    /* Mamba2 (K_MAMBA) */
    Mat in_proj[5];             /* in_proj row slices, local: z [d_inner], x [d_inner], B [groups*N],
                                   C [groups*N], dt [m_heads]; projected side by side they give the
                                   rank's [z | x | B | C | dt] exactly as an unsharded model would */
    float *conv_w;              /* [conv, d_conv] fp32 depthwise conv1d weight (local channels) */
    float *conv_b;              /* [conv] fp32 conv1d bias (zeros when the config has none) */
    float *A;                   /* [m_heads] fp32 A = -exp(A_log) */
    float *D;                   /* [m_heads] fp32 skip */
    float *dt_bias;             /* [m_heads] fp32 */
    float *gnorm;               /* [d_inner] fp32 gated group-norm weight */
    Mat out;                    /* [hidden, d_inner] out_proj, column slice (row-parallel) */
    /* attention (K_ATTN) */
    Mat wq, wk, wv;             /* [q*head_dim, hidden], [kv*head_dim, hidden] x2 (local heads) */
    Mat wo;                     /* [hidden, q*head_dim] o_proj, column slice (row-parallel) */
    /* MLP (K_MLP) */
    Mat up;                     /* [mlp, hidden] up_proj rows (column-parallel) */
    Mat down;                   /* [hidden, mlp] down_proj, column slice (row-parallel) */
    /* mixture of experts (K_MOE); d = latent size, or hidden without latent projections */
    float *gate;                /* [n_experts, hidden] fp32 router weight, replicated */
    float *gate_bias;           /* [n_experts] fp32 e_score_correction_bias (chooses, never weighs) */
    Mat *eup, *edown;           /* [n_experts] up [moe/n, d] rows, down [d, moe/n] column slice */
    Mat sup, sdown;             /* shared expert: up [shared/n, hidden] rows, down [hidden, shared/n] */
    Mat lat_in, lat_out;        /* fc1_latent_proj [latent, hidden], fc2_latent_proj [hidden, latent],
                                   replicated; rows 0 when the model has none */
} Layer;

typedef struct {
    Mat embed;                  /* [vocab, hidden] embedding table, full on every rank */
    Mat lm_head;                /* [vocab/n, hidden] this rank's rows */
    float *norm_f;              /* [hidden] fp32 final norm weight */
    Layer layer[MAX_LAYERS];    /* [n_layers + n_mtp]: the blocks, then the MTP block's sublayers */
    /* multi-token prediction (n_mtp > 0); embed and lm_head are the model's own */
    float *enorm, *hnorm;       /* [hidden] fp32 RMSNorm weights: on a token's embedding, on a hidden state */
    Mat eh_proj;                /* [hidden, 2 * hidden] on [enorm(embed) ; hnorm(h)], replicated */
    float *mtp_norm;            /* [hidden] fp32 final_layernorm weight, the block's last */
} Weights;

/* ------------------------------------------------------------------------------------------------
 * Ranks and the backend interface
 * ---------------------------------------------------------------------------------------------- */

/* How the layer loop asks for the norm at a layer's entry (see forward() in nemoh.c). */
enum {
    NORM_PLAIN,                 /* x = rmsnorm(residual) * w                                   */
    NORM_ADD,                   /* residual += pending (already reduced); x = rmsnorm(residual)*w */
    NORM_FUSED                  /* residual += allreduce(pending); x = rmsnorm(residual) * w   */
};

/* The norms that are not a layer's own, as be->norm's layer argument. */
enum { NORM_F = -1, NORM_MTP_F = -2 };

/* Which forward runs: the model's, or the MTP block's (a backend may keep a CUDA graph for each). */
enum { PASS_MAIN, PASS_MTP };

typedef struct Rank Rank;

typedef struct {
    const char *name;
    void *(*setup)(const Config *c, int n, int t_max, int logit_rows);  /* shared state, made first */
    void (*teardown)(void *sh);
    void (*init)(Rank *r);                              /* allocate state, upload weights */
    void (*free)(Rank *r);
    /* Optional: 1 if the backend ran this forward by itself (a replayed CUDA graph). */
    int (*replay)(Rank *r, const int *tok, int T, int pos);
    void (*begin)(Rank *r, const int *tok, int T, int pos);  /* optional: before the layer loop */
    void (*end)(Rank *r, int T);                        /* optional: after the layer loop */
    void (*embed)(Rank *r, const int *tok, int T);      /* residual[t] = embed[tok[t]] */
    void (*norm)(Rank *r, int l, int how, int T);       /* layer l's, or NORM_F, NORM_MTP_F */
    void (*mamba)(Rank *r, int l, int T, int pos);      /* pending = out_proj(...) partial sums */
    void (*attention)(Rank *r, int l, int T, int pos);
    void (*mlp)(Rank *r, int l, int T);
    void (*allreduce)(Rank *r, int T);                  /* pending = sum over ranks of pending */
    void (*logits)(Rank *r, int T, int all);            /* last (or every) row's logits, gathered */
    /* out[j] = a token drawn from the j-th of the last n logits rows with coin(seed, step + j);
     * -1 where a row is not finite */
    void (*sample)(Rank *r, int n, float temp, float topp, uint64_t seed, uint64_t step, int *out);
    const float *(*host_logits)(Rank *r, int rows);     /* the logits rows, readable on the host */
    void (*moe)(Rank *r, int l, int T);                 /* routed + shared experts' partial sums; NULL:
                                                           this backend has no mixture-of-experts layers */
    /* Every Mamba layer's conv window and SSM state into slot (< SNAPSHOT_SLOTS), or back, on the
     * state's own device; the KV cache needs no copy: positions past the resumed one are rewritten. */
    void (*snapshot)(Rank *r, int slot, int save);      /* recurrent state to snapshot slot, or back */
    /* Multi-token prediction. mtp_in: residual[t] = eh_proj([enorm(embed[tok[t]]) ; hnorm(x[row + t])])
     * for t < T, x as the last forward's final norm left it (the model's h, or the block's own output).
     * tok NULL: after an accept, its t_0..t_{T-1}; else the last draft made (after a non-finite row's,
     * zeros in both halves: that pass's draft is unused).
     * accept, after a verify forward fed tok[0..T) with r->keep: t_i := a draw from its logits row i
     * with coin(seed, step + i); n := how many of tok[1..T) equal t_0, t_1, ... in a row; every Mamba
     * layer's state := the one after token n. Returns n, or -1 where n stays on the device (a GPU: the
     * MTP pass and drafts that follow read it there, so the step makes one round trip, at its end).
     * rewind: state := the one after token t of that forward (t below its last token).
     * draft: draft j (< r->spec) := the argmax of the logits row of the last pass's drafting token
     * (its last, or after an accept token n), kept where the logits are.
     * outcome: out = [n, t_0..t_{T-1}] of the last accept (none where T = 0), then drafts 0..k-1, -1
     * where a row was not finite. */
    void (*mtp_in)(Rank *r, const int *tok, int T, int row);
    int (*accept)(Rank *r, const int *tok, int T, float temp, float topp, uint64_t seed, uint64_t step);
    void (*rewind)(Rank *r, int t);
    void (*draft)(Rank *r, int j);
    void (*outcome)(Rank *r, int T, int k, int *out);
} Backend;

struct Rank {
    const Config *c;            /* model configuration */
    Shard s;                    /* this rank's sizes */
    Weights w;                  /* this rank's weight views */
    const Backend *be;          /* the backend running this rank */
    void *st;                   /* backend-private state and buffers */
    void *sh;                   /* backend-private state shared by all ranks (host buffers, NCCL) */
    int t_max;                  /* most tokens per forward call (prefill chunk) */
    int ctx;                    /* context length the caches hold */
    int fuse;                   /* 1: fused all-reduce at the next layer's entry; 0: at layer end */
    int trace;                  /* print what each layer of the next single-token step runs */
    int gpu;                    /* device index (CUDA backend) */
    int graph;                  /* capture each kind of decoded forward once as a CUDA graph and replay it */
    int spec;                   /* most draft tokens one step verifies (0: none); states for spec + 1 */
    int keep;                   /* 1: the next forward records each token's recurrent state (rewind) */
    int pass;                   /* PASS_MAIN or PASS_MTP: the forward now running */
    int all;                    /* ... makes every token's logits (else the last's) */
    int row;                    /* ... (MTP) reads the x rows from this one on (mtp_in's row) */
    int draft_vocab;            /* the MTP pass's logits and drafts: token ids below it (--mtp-vocab) */
};

/* ------------------------------------------------------------------------------------------------
 * The CUDA backend (nemoh.cu), present when nemoh is built with nvcc
 * ---------------------------------------------------------------------------------------------- */

#ifdef NEMOH_CUDA
extern const Backend cuda_backend;
int cuda_devices(void);                         /* usable GPUs; 0 when there is no driver or device */
const char *cuda_device_name(void);             /* GPU 0's name */
double cuda_copy_gbps(void);                    /* GPU 0 device-to-device copy, bytes read + written, GB/s (0: no room) */
size_t cuda_used_bytes(Rank *r);                /* device memory in use on this rank's GPU */
const char *cuda_fuse_path(Rank *r);            /* which all-reduce path the layer loop's NORM_FUSED takes */
int cuda_bench_allreduce(int n, int hidden);    /* --bench-allreduce; returns the number of failed checks */
#endif

/* ------------------------------------------------------------------------------------------------
 * Small math shared by host and device
 * ---------------------------------------------------------------------------------------------- */

/* The blocks and the MTP block's sublayers: the layers every backend keeps weights and state for. */
static inline int n_all(const Config *c) { return c->n_layers + c->n_mtp; }
/* 1 if some layer of the model is of kind k (K_MAMBA, ...). */
static inline int has_kind(const Config *c, char k) { return memchr(c->kind, k, (size_t)n_all(c)) != NULL; }
/* A layer kind's name, in messages and --trace. */
static inline const char *kind_name(char k) { return k == K_MAMBA ? "mamba" : k == K_ATTN ? "attention" : k == K_MLP ? "mlp" : "moe"; }

/* Stored elements to fp32: bf16 is the top half of an fp32; f16 is widened by its fields. */
static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, u;
    if (exp == 31) u = sign | 0x7F800000u | man << 13;                  /* inf, nan */
    else if (exp) u = sign | (exp + 112) << 23 | man << 13;              /* normal */
    else if (!man) u = sign;                                             /* zero */
    else { float f = ldexpf((float)man, -24); memcpy(&u, &f, 4); u |= sign; }  /* subnormal */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* FP8 E4M3 (OCP "fn": no infinities; 0x7F and 0xFF are NaN): sign, 4 exponent bits (bias 7), 3
 * mantissa bits; e = 0: m * 2^-9, else (1 + m / 8) * 2^(e - 7). Exact in fp32. */
static inline float e4m3_to_f32(uint8_t b) {
    uint32_t e = (b >> 3) & 15, m = b & 7, u;
    float f;
    if ((b & 0x7F) == 0x7F) return NAN;
    if (e) { u = (uint32_t)(b >> 7) << 31 | (e + 120) << 23 | m << 20; memcpy(&f, &u, 4); return f; }
    f = (float)m * 0.001953125f;
    return b >> 7 ? -f : f;
}

/* FP4 E2M1: bit 3 the sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}. */
static const float e2m1_values[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static inline float e2m1_to_f32(unsigned n) { return e2m1_values[n & 15]; }

/* Element i of a stored row of a plain (unscaled) dtype, as fp32. */
static inline float load_f32(const void *p, int dtype, size_t i) {
    if (dtype == DT_F32) { float f; memcpy(&f, (const char *)p + 4 * i, 4); return f; }
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    return dtype == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* NVFP4 block scale of element (i, k): e4m3(bs[i][k / 16]) * weight_scale_2, one fp32 rounding. */
static inline float nvfp4_block_scale(const Mat *W, size_t i, size_t k) {
    return e4m3_to_f32(W->bs[i * W->bld + k / 16]) * W->scale;
}

/* W[i][k] as fp32: the dequantization, in ModelOpt's order (bit for bit its formula). */
static inline float mat_at(const Mat *W, size_t i, size_t k) {
    const uint8_t *p = (const uint8_t *)W->data;
    if (W->dtype == DT_FP8) return e4m3_to_f32(p[i * W->ld + k]) * W->scale;
    if (W->dtype == DT_NVFP4) {
        uint8_t b = p[(i * W->ld + k) / 2];
        return e2m1_to_f32(k & 1 ? b >> 4 : b & 15) * nvfp4_block_scale(W, i, k);
    }
    return load_f32(W->data, W->dtype, i * W->ld + k);
}

/* e^x: the GPU's fast approximation (__expf, a few ulp) in kernels; on the host, without branches so
 * that loops over it run in lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
 * (truncation under 1e-8, relative), 2^n made in the exponent bits, for x in [-87.3, 88.3], where 2^n
 * stays a normal float; below it 0, above it infinity; NaN stays NaN. */
static inline NEMOH_HD float fast_exp(float x) {
#ifdef __CUDA_ARCH__
    return __expf(x);
#else
    float x0 = x;
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    float t = x * 1.44269504f + 12582912.0f;   /* 1.5 * 2^23: n = round(x / ln2) lands in t's low bits */
    float n = t - 12582912.0f;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-6f;   /* ln2 in two parts: n * hi is exact */
    float p = 1 + r * (1 + r * (1.0f / 2 + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r * (1.0f / 5040)))))));
    uint32_t u;
    memcpy(&u, &t, 4);
    u = (u - 0x4B400000u + 127u) << 23;        /* (n + 127) << 23: 2^n */
    float s;
    memcpy(&s, &u, 4);
    p *= s;
    p = x0 < -87.3f ? 0.0f : p;
    return x0 > 88.3f ? INFINITY : p;
#endif
}

/* silu(x) = x * sigmoid(x) = x / (1 + e^-x) */
static inline NEMOH_HD float silu(float x) { return x / (1.0f + fast_exp(-x)); }

/* softplus(x) = log(1 + e^x), linear above 20 as torch and the Mamba kernels do */
static inline NEMOH_HD float softplus(float x) { return x > 20.0f ? x : log1pf(fast_exp(x)); }

/* A counter-based uniform draw in [0,1): the same (seed, step) gives the same coin on CPU and GPU. */
static inline NEMOH_HD float coin(uint64_t seed, uint64_t step) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (step + 1);      /* splitmix64 */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

#ifdef __cplusplus
}
#endif
#endif

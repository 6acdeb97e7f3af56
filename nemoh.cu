/* nemoh.cu: the CUDA backend. The same forward pass as the CPU reference in nemoh.c, on one GPU per
 * tensor-parallel rank: weights kept in the format they were stored in (bf16 stays bf16, FP8 and
 * NVFP4 stay quantized, f32 and f16 become f32), the KV cache in bf16 (fp32 for an fp32 model), fp32
 * activations, residual and SSM state. Matrix-vector
 * products for one token are our own bandwidth-bound kernels; for a prompt chunk they go through cuBLAS,
 * and with a bf16 model its attention and scan run on the tensor cores too (flash attention, the
 * chunked SSD scan). A speculative step's few tokens (multi-token prediction) run as decode does, each
 * token's rows what a one-token step computes, bit for bit (decoded). Ranks talk through NCCL; the
 * all-reduce a layer owes is fused into the next layer's entry with NCCL 2.28's device API (symmetric
 * window + LSA barrier).
 *
 * Sections: error checks, device structs, kernels (elementwise and norms, the fused all-reduce, the
 * speed devices and decode-only fusions, the matrix-vector product, Mamba2, the prompt's SSD scan,
 * attention, prompt attention, mixture of experts, sampling), matrix products, the backend operations
 * (the mixture-of-experts layer last), setup and teardown, benchmarks. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <thread>
#include <vector>

#include "nemoh.h"

/* ------------------------------------------------------------------------------------------------
 * Error checks: every call and every launch; file:line, the call and the error string, then exit
 * ---------------------------------------------------------------------------------------------- */

#define CUDA_CHECK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "nemoh: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CUBLAS_CHECK(call) do { cublasStatus_t s_ = (call); if (s_ != CUBLAS_STATUS_SUCCESS) { \
    fprintf(stderr, "nemoh: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cublasGetStatusString(s_)); exit(1); } } while (0)
#define NCCL_CHECK(call) do { ncclResult_t r_ = (call); if (r_ != ncclSuccess) { \
    fprintf(stderr, "nemoh: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, ncclGetErrorString(r_)); exit(1); } } while (0)

static __host__ __device__ int cdiv(long a, long b) { return (int)((a + b - 1) / b); }

/* Every kernel is launched through LAUNCH(grid, block, smem, stream, kernel, args...): checked, and
 * with programmatic dependent launch, so the GPU may start a kernel while the one before it drains
 * (a decode step is ~250 kernels in a row; this hides the launch gaps between them). Every kernel
 * therefore begins with pdl_wait(), which returns once the previous kernel has finished and its
 * writes are visible. Before it a kernel may read only what the kernel just before it cannot be
 * writing (every earlier one has finished: each waits for its predecessor before letting the next
 * start): weights; the SSM state, which only the scan writes, never twice in a row; and, in the scan
 * at decode, z, which in_proj wrote before the conv kernel between them. */
template <typename... P, typename... A>
static void launch(const char *file, int line, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   void (*kernel)(P...), A... args) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {grid, block, smem, stream, &attr, 1};
    cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, (P)args...);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) { fprintf(stderr, "nemoh: %s:%d: kernel launch: %s\n", file, line, cudaGetErrorString(e)); exit(1); }
}
#define LAUNCH(...) launch(__FILE__, __LINE__, __VA_ARGS__)

/* Wait for the previous kernel (see LAUNCH), then let the next one be scheduled. Before Hopper there
 * is no programmatic dependent launch: kernels run one after the other and there is nothing to do. */
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

/* ------------------------------------------------------------------------------------------------
 * Device structs
 * ---------------------------------------------------------------------------------------------- */

typedef __nv_bfloat16 bf16;

/* A weight matrix on the device, in the format it was stored in (see Mat in nemoh.h): fp32 (f16 is
 * widened), bf16, FP8 E4M3 bytes or NVFP4's packed E2M1 pairs with their block scales. A quantized
 * matrix keeps its per-tensor scale per row, since one matrix may stack several tensors (q, k, v). */
typedef struct {
    void *w;                    /* [rows, ld] row-major elements of fmt */
    int fmt;                    /* DT_F32, DT_BF16, DT_FP8 or DT_NVFP4 */
    int rows, cols;             /* logical shape */
    int ld;                     /* row stride in elements: 16-byte rows (a multiple of fmt_per) */
    uint8_t *bs;                /* DT_NVFP4: [rows, ld / 16] E4M3 block scales */
    float *rs;                  /* DT_FP8, DT_NVFP4: [rows] the scale of the tensor each row came from */
} GMat;

/* Elements in 16 bytes of a format: fp32 4, bf16 8, FP8 16, NVFP4 32. */
static __host__ __device__ constexpr int fmt_per(int fmt) { return fmt == DT_F32 ? 4 : fmt == DT_BF16 ? 8 : fmt == DT_FP8 ? 16 : 32; }

/* Bytes of a row of ld elements (ld a multiple of fmt_per). */
static __host__ __device__ size_t row_bytes(int fmt, size_t ld) { return ld / fmt_per(fmt) * 16; }

/* A prompt's activations meet W on the tensor cores in bf16, unless W is fp32 (then fp32, exact). */
static int lowp(const GMat *W) { return W->fmt != DT_F32; }

/* Quantized: read with a row scale (and NVFP4's block scales). */
static __host__ __device__ int quantized(int fmt) { return fmt == DT_FP8 || fmt == DT_NVFP4; }

/* Bytes of W's elements (not of its scales). */
static size_t gmat_bytes(const GMat *W) { return (size_t)W->rows * row_bytes(W->fmt, W->ld); }

/* n rounded up to a multiple of 8 elements: rows that start 16-byte aligned (bf16) */
static __host__ __device__ int pad8(int n) { return (n + 7) / 8 * 8; }

typedef struct {
    float *norm;                /* [hidden] pre-mixer RMSNorm weight */
    GMat in_proj;               /* [in_proj, hidden] rows z | x | B | C | dt of this rank */
    float *conv_w, *conv_b;     /* [conv, 4], [conv] */
    float *A, *D, *dt_bias;     /* [m_heads] each; A = -exp(A_log) */
    float *gnorm;               /* [d_inner] gated group-norm weight */
    GMat out;                   /* [hidden, d_inner] out_proj columns of this rank */
    GMat qkv;                   /* [(q + 2 kv) * head_dim, hidden] q, k, v rows of this rank */
    GMat o;                     /* [hidden, q * head_dim] */
    GMat up, down;              /* [mlp, hidden], [hidden, mlp] */
    float *gate, *gate_bias;    /* [n_experts, hidden] fp32 router, [n_experts] its choice bias */
    GMat eup;                   /* [n_experts * moe, d] every expert's up rows of this rank, expert e's from row e * moe */
    GMat edown;                 /* [n_experts * d, moe] every expert's down columns, expert e's from row e * d */
    GMat sup, sdown;            /* [shared, hidden], [hidden, shared] the shared expert's rows and columns */
    GMat lat_in, lat_out;       /* [latent, hidden] fc1, [hidden, latent] fc2 (latent MoE; rows 0 without) */
    float *conv_st;             /* [conv, 3] last conv inputs, oldest first (in GpuRank.state) */
    float *ssm;                 /* [m_heads, m_hdim, d_state] fp32 state (in GpuRank.state) */
    void *k, *v;                /* [ctx, kv * head_dim] cache: bf16 if lowp(qkv), else fp32 */
} GLayer;

/* Memory the fused all-reduce reads from every rank: NCCL symmetric memory registered as a window,
 * with a device communicator of FUSED_BLOCKS LSA barriers, when NCCL allows it (devapi); else plain
 * device memory for the ncclAllReduce fallback. Made by symmetric_window_create(). */
typedef struct {
    float *buf;                 /* the buffer, zeroed */
    int nccl_mem;               /* buf came from ncclMemAlloc (else cudaMalloc) */
    ncclWindow_t win;           /* buf registered as a symmetric window; NULL: not registered */
    ncclDevComm dev;            /* device communicator with LSA barriers (valid when devapi) */
    int devapi;                 /* 1: every rank's buf is reachable by load/store through win and dev */
} SymWindow;

typedef struct {
    int n;                      /* ranks */
    ncclComm_t comm[64];        /* [n] one communicator per rank, made together */
    int t_max, logit_rows;      /* sizes every rank allocates */
} GpuShared;

/* Most tokens a forward runs as decode does while drafting (r->spec > 0), each token's rows computed as
 * a one-token step computes them, bit for bit: a speculative step verifies up to spec + 1 tokens, and so
 * its greedy choices are plain decoding's. More tokens run as a prompt does. */
enum { DECODE_T = 9 };

/* A decoded forward is captured as a CUDA graph once and replayed, one for each kind: pass, T (up to
 * DECODE_T), states kept or not (r->keep), all rows' logits or the last's (r->all). Its inputs are
 * read from device memory (tokens, position, the MTP pass's x row), so one graph serves every step. */
enum { GRAPHS = 2 * (DECODE_T + 1) * 2 * 2 };

/* A forward's inputs on the device: [position, x row, drafting row, tokens] (pos). The host sends them
 * in one copy, from a ring of pinned entries, so that no forward waits for the one before it; an entry
 * is reused once its copy is done (an event each; a step syncs more often than the ring wraps, so that
 * wait is rare). A prompt's chunk longer than an entry waits for the stream, then goes from host_io's
 * start. Within a drafting step the device makes them itself (accept_kernel, draft_kernel): the
 * verify forward, its acceptance, the MTP pass and the draft passes are queued together, and the
 * step's outcome comes back in one copy at its end. */
enum { IO_RING = SPEC_MAX + 1, IO_ENTRY = 3 + DECODE_T };

/* A drafting step's outcome on the device (step): the accepted count n, the model's tokens t_0..t_K,
 * the drafts; then accept_kernel's count of finished blocks. */
enum { STEP_T = 1, STEP_D = SPEC_MAX + 2, STEP_DONE = 2 * SPEC_MAX + 2, STEP_INTS = 2 * SPEC_MAX + 3 };

typedef struct {
    cudaStream_t stream;        /* everything of this rank runs in order on it */
    cublasHandle_t blas;        /* prefill matrix products */
    void *blas_ws;              /* cuBLAS workspace */
    GLayer L[MAX_LAYERS];       /* [n_layers + n_mtp] weights and state: the blocks, then the MTP block's sublayers */
    GMat embed;                 /* [vocab, hidden] */
    GMat lm_head;               /* [vocab / n, hidden] */
    float *norm_f;              /* [hidden] */
    float *enorm, *hnorm;       /* [hidden] MTP: RMSNorm weights on a token's embedding, on a hidden state */
    GMat eh_proj;               /* [hidden, 2 * hidden] MTP: the block's input projection, replicated */
    float *mtp_norm;            /* [hidden] MTP: the block's final norm */
    float *eh;                  /* [t_max, 2 * hidden] MTP: [enorm(embed[tok]) ; hnorm(h)], eh_proj's input */
    float *res;                 /* [t_max, hidden] residual stream */
    float *x;                   /* [t_max, hidden] normed mixer input */
    bf16 *x16;                  /* [t_max, hidden] x in bf16, written with it for a prompt: its bf16 products' input */
    /* The pending protocol: a mixer's partial sums on their way into the residual (all named pend_*).
     *   mixer           writes pend's slot pend_slot;  pend_owed = that slot
     *   NORM_FUSED      res += every rank's slot (fused kernel), or pend_allreduce, NORM_ADD;  pend_slot ^= 1
     *   allreduce       pend_allreduce when n > 1;  pend_slot ^= 1
     *   NORM_ADD        res += pend_owed
     *   pend_allreduce  pend_sum = sum over ranks of pend_owed;  pend_owed = pend_sum */
    SymWindow pend;             /* buf: [2, t_max, hidden] partial sums, two alternating slots */
    int pend_slot;              /* the slot the current mixer writes; 0 at each step's start */
    const float *pend_owed;     /* what NORM_ADD adds: a slot of pend, or pend_sum */
    float *pend_sum;            /* [t_max, hidden] ncclAllReduce's output */
    float *proj;                /* [t_max, proj_w] projections */
    float *xbc;                 /* [t_max, conv] conv1d + SiLU output */
    float *y;                   /* [t_max, y_w] mixer output before its out projection */
    bf16 *act16;                /* [t_max, act_w] bf16 copy of a GEMM input */
    bf16 *deq;                  /* [DEQ_BYTES / 2] some rows of a quantized matrix, dequantized for a prompt's product */
    float *part;                /* [dec_t, q, splits, head_dim + 2] decode attention partials */
    float *gss;                 /* [dec_t, m_heads, scan blocks a head] decode: each scan block's sum of u^2 */
    float *logits_local;        /* [logit_rows, vocab / n] */
    float *logits;              /* [logit_rows, vocab] gathered (aliases logits_local at n = 1) */
    float *host_logits;         /* [logit_rows, vocab] pinned copy for --dump-logits */
    float *probs;               /* [sample_rows, vocab] sampling scratch */
    int sample_rows;            /* most logits rows one sample call draws from: min(logit_rows, spec + 1) */
    int *pos;                   /* [3 + t_max] position of the forward's first token; the MTP pass's first x row
                                   (r->row); its drafting row (whose logits make the draft, and whose
                                   position the next pass follows); then the forward's token ids, tok */
    int *tok;                   /* pos + 3 */
    int *sampled;               /* [sample_rows] the sampled tokens */
    int *step;                  /* [STEP_INTS] the drafting step's outcome (gpu_accept, gpu_draft) */
    int *host_io;               /* [io_ring] pinned staging: a prompt chunk's inputs in, sampled tokens and
                                   a step's outcome out; then IO_RING entries of IO_ENTRY, a decoded forward's inputs */
    int io_ring, ring;          /* where the entries start; the next entry */
    cudaEvent_t io_done[IO_RING];  /* each entry's copy done */
    int *moe_idx;               /* [t_max, top_k] chosen experts of each token, best first */
    float *moe_w;               /* [t_max, top_k] their weights */
    float *moe_logits;          /* [t_max, n_experts] router logits */
    unsigned *moe_done;         /* [1] decode router blocks finished (the last one chooses, then resets it) */
    int *moe_off;               /* [n_experts + 1] prompt: first row of each expert's (token, slot) pairs */
    int *moe_tile;              /* [n_experts + 1] prompt: first row tile (MG_BM rows) of each expert's pairs */
    int *moe_tok, *moe_row;     /* [t_max * top_k] a row's token; a pair's row */
    float *moe_h;               /* [t_max * top_k, pad8(moe)] relu(up)^2 in the up input's dtype (decoded: fp32
                                   [T, top_k * pad8(moe) + shared]) */
    float *moe_y;               /* [t_max * top_k, d] routed outputs, a row a pair (bf16 where the experts are) */
    float *moe_z, *moe_ylat;    /* [t_max, latent] fc1 output; weighted routed sum before fc2 */
    float *moe_part;            /* [MOE_SPLITS, dec_t, max(hidden, latent)] a split down product's sums */
    unsigned *moe_cnt;          /* [max(hidden, latent) / QROWS] its row tiles' finished blocks */
    int rows;                   /* logits rows the last step wrote */
    int proj_w, y_w, act_w;     /* columns of proj, y (proj_width, y_width) and act16 (the widest input) */
    int splits;                 /* decode attention splits a head (attn_splits) */
    int dec_t;                  /* most tokens a forward may run as decode does: 1, or while drafting
                                   min(spec + 1, DECODE_T) (the decode buffers hold that many) */
    int dec_now;                /* ... the forward running now (decoded): dec_t for a verify forward or an
                                   MTP pass, else 1, so that a prompt's chunk runs as with --mtp 0 */
    int gemv_slots;             /* gemv_kernel blocks the GPU holds at once (per SM x SMs) */
    cudaGraphExec_t graph[GRAPHS];  /* [graph_at] the captured decoded forwards: NULL until one runs */
    cudaGraphExec_t *capturing; /* the graph the stream is capturing now, or NULL */
    char *state;                /* [snap_bytes] every Mamba layer's conv_st then ssm (mamba_state_bytes a layer) */
    size_t snap_bytes;          /* bytes of state */
    char *snap;                 /* [SNAPSHOT_SLOTS, snap_bytes] saved copies of state (--chat) */
    char *kept;                 /* [spec + 1, snap_bytes] state after each token of a forward run with r->keep */
    int kept_n;                 /* tokens of the last forward run with r->keep: rewind's slots (0: none valid) */
    int kept_live;              /* the slot state equals (rewind copies nothing to it) */
} GpuRank;

enum { FUSED_BLOCKS = 1024, NORM_THREADS = 1024, NORM_PER = 8, FUSED_PROMPT = 64 };

/* Whether a forward of T tokens runs as decode does (else as a prompt: cuBLAS, the chunked scan, flash
 * attention). */
static int decoded(const GpuRank *g, int T) { return T == 1 || T <= g->dec_now; }

/* ------------------------------------------------------------------------------------------------
 * Kernels: the stored formats, decoded (Mat in nemoh.h defines them; the host's mat_at is the reference)
 * ---------------------------------------------------------------------------------------------- */

/* An E4M3 byte as fp32 (Hopper converts FP8 in hardware; exact). */
__device__ __forceinline__ float e4m3f(unsigned b) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
}

/* An E2M1 code as fp32: its sign and three bits placed as an f16's (bit 15; exponent and mantissa
 * at bits 9-11) make the value times 2^-14, subnormal 0.5 included. */
__device__ __forceinline__ float e2m1f(unsigned n) {
    return __half2float(__ushort_as_half((unsigned short)((n & 8) << 12 | (n & 7) << 9))) * 16384.0f;
}

/* Element k of a stored row (bs: the row's NVFP4 block scales), before the row's scale. */
template <int FMT> __device__ __forceinline__ float stored_elem(const char *row, const uint8_t *bs, int k) {
    if (FMT == DT_F32) return ((const float *)row)[k];
    if (FMT == DT_BF16) return __bfloat162float(((const bf16 *)row)[k]);
    if (FMT == DT_FP8) return e4m3f((uint8_t)row[k]);
    unsigned b = (uint8_t)row[k / 2];
    return e2m1f(k & 1 ? b >> 4 : b & 15) * e4m3f(bs[k / 16]);
}

/* W[row][k], dequantized. */
__device__ __forceinline__ float mat_elem(const GMat &W, size_t row, int k) {
    const char *p = (const char *)W.w + row * row_bytes(W.fmt, W.ld);
    const uint8_t *bs = W.bs ? W.bs + row * (W.ld / 16) : NULL;
    switch (W.fmt) {
    case DT_F32: return stored_elem<DT_F32>(p, bs, k);
    case DT_BF16: return stored_elem<DT_BF16>(p, bs, k);
    case DT_FP8: return stored_elem<DT_FP8>(p, bs, k) * W.rs[row];
    default: {   /* e2m1 * (e4m3 * scale), in mat_at's order: the same value, bit for bit */
        unsigned b = (uint8_t)p[k / 2];
        return e2m1f(k & 1 ? b >> 4 : b & 15) * (e4m3f(bs[k / 16]) * W.rs[row]);
    }
    }
}

/* 8 E2M1 codes (a 32-bit word, element i in bits 4i..4i+3) dotted with x[0..7], times 2^-14. The
 * codes at the top of each 16-bit half become two f16 at once (Marlin's bit trick): sign kept, the
 * three bits shifted into the exponent and mantissa; then the next pair is shifted to the top. */
__device__ __forceinline__ float e2m1_dot8(uint32_t q, const float *x) {
    const float4 a = *(const float4 *)x, b = *(const float4 *)(x + 4);
    const float xl[4] = {a.w, a.z, a.y, a.x}, xh[4] = {b.w, b.z, b.y, b.x};   /* elements 3-j and 7-j */
    float acc = 0;
#pragma unroll
    for (int j = 0; j < 4; j++, q <<= 4) {
        uint32_t h = (q & 0x80008000u) | ((q & 0x70007000u) >> 3);
        float2 f = __half22float2(*(const __half2 *)&h);
        acc += f.x * xl[j] + f.y * xh[j];
    }
    return acc;
}

/* d[16x8] += a[16x16] b[16x8], bf16 operands, fp32 accumulators */
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* E2M1 codes I and I + 4 of a 32-bit word as a bf16 pair (code I in the low half): each code's sign
 * and three bits placed as a bf16's (bit 15; exponent and mantissa at bits 6-8) make the value times
 * 2^-126 (0.5 a bf16 subnormal, which bf16 multiplies keep). The two codes alone (codes 2, 3, 6, 7
 * shifted down to 0, 1, 4, 5 first), one multiply adds a copy shifted for the three bits to one
 * shifted for the sign (they do not overlap), and a mask keeps those: three instructions a pair
 * where two shifts and two masks took four. */
template <int I> __device__ __forceinline__ uint32_t e2m1_pair(uint32_t w) {
    uint32_t n = (I <= 1 ? w : w >> 8) & (0x000F000Fu << 4 * (I & 1));
    return n * (I & 1 ? (1u << 2) + (1u << 8) : (1u << 6) + (1u << 12)) & 0x81C081C0u;
}

/* a * b, bf16 pairs */
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
    __nv_bfloat162 r = __hmul2(*(const __nv_bfloat162 *)&a, *(const __nv_bfloat162 *)&b);
    return *(uint32_t *)&r;
}

/* 16 bytes of a row (fmt_per(FMT) elements) dotted with the matching x, before the row's scale; s:
 * NVFP4's two E4M3 block scales of those 32 elements, the first in the low byte. x is 16-byte aligned. */
template <int FMT> __device__ __forceinline__ float dot16(uint4 w, uint32_t s, const float *x) {
    uint32_t u[4] = {w.x, w.y, w.z, w.w};
    if (FMT == DT_F32) {
        const float4 a = *(const float4 *)x;
        return __uint_as_float(u[0]) * a.x + __uint_as_float(u[1]) * a.y + __uint_as_float(u[2]) * a.z + __uint_as_float(u[3]) * a.w;
    }
    float acc = 0;
    if (FMT == DT_BF16) {
        const float4 a = *(const float4 *)x, b = *(const float4 *)(x + 4);
        float lo[4], hi[4];
        for (int k = 0; k < 4; k++) { lo[k] = __uint_as_float(u[k] << 16); hi[k] = __uint_as_float(u[k] & 0xffff0000u); }
        return lo[0] * a.x + hi[0] * a.y + lo[1] * a.z + hi[1] * a.w + lo[2] * b.x + hi[2] * b.y + lo[3] * b.z + hi[3] * b.w;
    }
    if (FMT == DT_FP8) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float4 a = *(const float4 *)(x + 4 * q);
            float2 lo = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(u[q] & 0xffffu), __NV_E4M3)));
            float2 hi = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(u[q] >> 16), __NV_E4M3)));
            acc += lo.x * a.x + lo.y * a.y + hi.x * a.z + hi.y * a.w;
        }
        return acc;
    }
    acc = (e2m1_dot8(u[0], x) + e2m1_dot8(u[1], x + 8)) * e4m3f(s & 255) +
          (e2m1_dot8(u[2], x + 16) + e2m1_dot8(u[3], x + 24)) * e4m3f(s >> 8 & 255);
    return acc * 16384.0f;
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: embedding, norms, elementwise
 * ---------------------------------------------------------------------------------------------- */

/* Sum over the warp (a butterfly); every lane gets the result. */
template <typename T> __device__ T warp_sum(T v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Maximum over the warp; every lane gets the result. */
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim a multiple of 32, at most 1024) in a fixed order (within each warp,
 * then over the warps' sums), so the same inputs give the same sum, bit for bit, on every thread. */
template <typename T> __device__ T block_sum(T v) {
    __shared__ T part[32];
    __shared__ T total;
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        T s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : T(0);
        s = warp_sum(s);
        if (threadIdx.x == 0) total = s;
    }
    __syncthreads();
    T r = total;
    __syncthreads();
    return r;
}

/* res[t] = embedding[tok[t]]; one thread per element */
__global__ void embed_kernel(float *res, const GMat emb, const int *tok, int H) {
    pdl_wait();
    int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < H) res[(size_t)t * H + i] = mat_elem(emb, tok[t], i);
}

/* o[0..3] = (a, b, c, d): 16 bytes of fp32, or 8 of bf16, at once (o aligned to that) */
__device__ __forceinline__ void store4(float *o, float a, float b, float c, float d) { *(float4 *)o = make_float4(a, b, c, d); }
__device__ __forceinline__ void store4(bf16 *o, float a, float b, float c, float d) {
    __nv_bfloat162 h[2] = {__floats2bfloat162_rn(a, b), __floats2bfloat162_rn(c, d)};
    *(uint2 *)o = *(const uint2 *)h;
}

/* The norm kernels below hold a row in registers, PER (a multiple of 4, at most NORM_PER for
 * NORM_THREADS threads) elements a thread, four consecutive ones a turn (element norm_at(k); hidden
 * <= PER * blockDim, a multiple of 4), so its loads are all in flight together, 16 bytes each: a norm
 * costs a couple of memory round trips, not one per element. Tuned on H200: 1024 threads of 8 decode
 * faster than 512 of 16. The elements past PER are zeros, which add nothing to any sum: a row's
 * result is the same, bit for bit, for every PER that holds it (with the same blockDim). */
__device__ __forceinline__ int norm_at(int k) { return (threadIdx.x + (k >> 2) * blockDim.x) * 4 + (k & 3); }

/* v[k] += row[norm_at(k)] (row 16-byte aligned, H a multiple of 4; zeros past H) */
template <int PER> __device__ __forceinline__ void norm_add(float (&v)[PER], const float *row, int H) {
#pragma unroll
    for (int k = 0; k < PER; k += 4) {
        int i = norm_at(k);
        float4 q = i < H ? *(const float4 *)(row + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        v[k] += q.x, v[k + 1] += q.y, v[k + 2] += q.z, v[k + 3] += q.w;
    }
}

/* This thread's part of the norm weight w (read before the wait, off the critical path). */
template <int PER> __device__ __forceinline__ void norm_weight(float (&wv)[PER], const float *w, int H) {
#pragma unroll
    for (int k = 0; k < PER; k++) wv[k] = 0.0f;
    norm_add(wv, w, H);
}

/* Row t: x[t] = v * rsqrt(mean(v^2) + eps) * wv, where this thread holds its part of the row in v
 * (ss: its sum of v^2), and in bf16 into x16[t] (if x16: a prompt's products read it, with no
 * conversion pass of their own); the row itself into r (row t of the residual) as well, if keep. */
template <int PER>
__device__ __forceinline__ void norm_store(float *x, bf16 *x16, float *r, int keep, size_t t, const float (&v)[PER], float ss,
                                           const float (&wv)[PER], int H, float eps) {
    float scale = rsqrtf(block_sum(ss) / H + eps);
#pragma unroll
    for (int k = 0; k < PER; k += 4) {
        int i = norm_at(k);
        if (i >= H) continue;
        float o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) o[j] = v[k + j] * scale * wv[k + j];
        if (keep) store4(r + i, v[k], v[k + 1], v[k + 2], v[k + 3]);
        store4(x + t * H + i, o[0], o[1], o[2], o[3]);
        if (x16) store4(x16 + t * H + i, o[0], o[1], o[2], o[3]);
    }
}

/* res[t] += add[t] (if add); x[t] = res[t] * rsqrt(mean(res[t]^2) + eps) * w (and x16[t], if x16) */
__global__ void __launch_bounds__(NORM_THREADS) rmsnorm_kernel(float *x, bf16 *x16, float *res, const float *add, const float *w,
                                                              int H, float eps) {
    float wv[NORM_PER];
    norm_weight(wv, w, H);
    pdl_wait();
    float *r = res + (size_t)blockIdx.x * H, v[NORM_PER] = {}, ss = 0;
    norm_add(v, r, H);
    if (add) norm_add(v, add + (size_t)blockIdx.x * H, H);
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) ss += v[k] * v[k];
    norm_store(x, x16, r, add != NULL, blockIdx.x, v, ss, wv, H, eps);
}

/* The MTP block's input before its projection, block (t, half) (x: the rows the last forward's final
 * norm left; the step reads them from row *row on, a device value so that one graph serves every row;
 * a token of -1, a draft from a non-finite row, reads zeros):
 *   half 0: eh[t][0, H) = rmsnorm(embed[tok[t]]) * enorm;  half 1: eh[t][H, 2H) = rmsnorm(x[*row + t]) * hnorm */
__global__ void __launch_bounds__(NORM_THREADS) mtp_in_kernel(float *eh, const GMat emb, const int *tok, const float *x, const int *row,
                                                             const float *enorm, const float *hnorm, int H, float eps) {
    int t = blockIdx.x, half = blockIdx.y;
    float wv[NORM_PER], v[NORM_PER], ss = 0;
    norm_weight(wv, half ? hnorm : enorm, H);
    pdl_wait();
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        int i = norm_at(k);
        v[k] = i >= H || tok[t] < 0 ? 0.0f : half ? x[(size_t)(*row + t) * H + i] : mat_elem(emb, tok[t], i);   /* -1: zeros (nemoh.h) */
        ss += v[k] * v[k];
    }
    norm_store(eh + ((size_t)t * 2 + half) * H, NULL, NULL, 0, 0, v, ss, wv, H, eps);
}

/* The fused all-reduce + residual add + RMSNorm, at a layer's entry:
 *   res[t] += sum over ranks r (in rank order) of pend_r[t];  x[t] = rmsnorm(res[t]) * w
 * One LSA barrier at entry: every rank's partial sums (written by its previous kernels) are complete
 * and visible. There is no exit barrier: the next mixer writes the other pend slot, and a rank can
 * only come back to this slot after every peer has passed the next call's entry barrier, i.e. after
 * it finished reading here. The grid, min(T, FUSED_BLOCKS) blocks, is the same on every rank (T is
 * rank-invariant): ranks launching different grids would wait on each other's barriers forever. */
typedef struct {
    ncclDevComm dev;            /* device communicator: the LSA team and its barriers */
    ncclWindow_t win;           /* every rank's pend, as a symmetric window */
    size_t offset;              /* bytes into the window of the slot to reduce */
    float *x, *res;             /* [T, hidden] normed output; residual, updated */
    bf16 *x16;                  /* [T, hidden] the normed output in bf16 as well (NULL: not) */
    const float *w;             /* [hidden] norm weight */
    int T, hidden;
    float eps;
} FusedArgs;

template <int THREADS, int PER>
__global__ void __launch_bounds__(THREADS, THREADS == NORM_THREADS ? NORM_PER / PER : PER <= 12 ? 4 : 3) fused_allreduce_norm_kernel(
    const __grid_constant__ FusedArgs a) {
    const ncclDevComm &dev = a.dev;
    float *res = a.res;
    int T = a.T, H = a.hidden;
    __shared__ const float *peer[64];   /* each rank's slot, as this GPU addresses it (fixed: before the wait) */
    int n = dev.lsaSize;
    for (int p = threadIdx.x; p < n; p += blockDim.x) peer[p] = (const float *)ncclGetLsaPointer(a.win, a.offset, p);
    float wv[PER];
    if (THREADS == NORM_THREADS) norm_weight(wv, a.w, H);   /* a decoded step's: before the wait, off its critical path */
    pdl_wait();
    if (n > 1) {   /* alone, there is nobody to wait for: the barrier would be pure cost */
        ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dev, ncclTeamLsa(dev), dev.lsaBarrier, blockIdx.x);
        bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);   /* also orders the peer[] writes above */
    } else {
        __syncthreads();
    }
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        float *r = res + (size_t)t * H, v[PER] = {}, rv[PER] = {}, ss = 0;
        norm_add(rv, r, H);
        for (int p = 0; p < n; p++) norm_add(v, peer[p] + (size_t)t * H, H);   /* rank order: identical on every rank */
#pragma unroll
        for (int k = 0; k < PER; k++) {
            v[k] += rv[k];   /* res + (sum of the ranks), as ncclAllReduce then an add would give */
            ss += v[k] * v[k];
        }
        if (THREADS != NORM_THREADS) norm_weight(wv, a.w, H);   /* a prompt's: here, fewer registers held, more blocks an SM */
        norm_store(a.x, a.x16, r, 1, t, v, ss, wv, H, a.eps);
    }
}

/* Launches the fused kernel on min(T, FUSED_BLOCKS) blocks: the same grid on every rank (T and hidden
 * are rank-invariant, and so is the choice of block). A prompt's rows are latency-bound, a block's one
 * after another: up to 4096 channels they go to blocks of 256 threads, three or four an SM, so each
 * SM has that many rows in flight, not the two of 1024-thread blocks. A decoded step's few rows keep
 * 1024 threads, a row's loads spread over more of them. */
static void fused_allreduce_norm(cudaStream_t stream, const FusedArgs &a) {
    auto k = a.hidden <= 4 * NORM_THREADS ? fused_allreduce_norm_kernel<NORM_THREADS, 4> : fused_allreduce_norm_kernel<NORM_THREADS, NORM_PER>;
    int threads = NORM_THREADS;
    if (a.T >= FUSED_PROMPT && a.hidden <= 4096) {
        k = a.hidden <= 3072 ? fused_allreduce_norm_kernel<256, 12> : fused_allreduce_norm_kernel<256, 16>;
        threads = 256;
    }
    LAUNCH(a.T < FUSED_BLOCKS ? a.T : FUSED_BLOCKS, threads, 0, stream, k, a);
}

/* out = bf16(f(in)), f(v) = v or (RELU2) relu(v)^2, a block a row: [T, cols] with row strides ldi,
 * ldo; 8 elements a thread where both rows are 16-byte aligned. relu^2 is applied here, in fp32, as
 * a bf16 model's prompt hands up's output to down: no pass of its own over the fp32 rows. */
template <int RELU2> __global__ void to_bf16_kernel(bf16 *out, int ldo, const float *in, int ldi, int cols) {
    pdl_wait();
    const float *src = in + (size_t)blockIdx.x * ldi;
    bf16 *dst = out + (size_t)blockIdx.x * ldo;
    auto f = [](float v) {
        if (RELU2) { v = fmaxf(v, 0.0f); v *= v; }
        return v;
    };
    int done = 0;
    if (((uintptr_t)src | (uintptr_t)dst) % 16 == 0) {
        done = cols / 8 * 8;
        for (int i = threadIdx.x * 8; i < done; i += blockDim.x * 8) {
            float4 a = *(const float4 *)(src + i), b = *(const float4 *)(src + i + 4);
            __nv_bfloat162 r[4] = {__floats2bfloat162_rn(f(a.x), f(a.y)), __floats2bfloat162_rn(f(a.z), f(a.w)),
                                   __floats2bfloat162_rn(f(b.x), f(b.y)), __floats2bfloat162_rn(f(b.z), f(b.w))};
            *(uint4 *)(dst + i) = *(const uint4 *)r;
        }
    }
    for (int i = done + threadIdx.x; i < cols; i += blockDim.x) dst[i] = __float2bfloat16(f(src[i]));
}

/* x = relu(x)^2 */
__global__ void relu2_kernel(float *x, size_t n) {
    pdl_wait();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = fmaxf(x[i], 0.0f); x[i] = v * v; }
}

/* Deterministic fill for synthetic weights (the same coin() as the host): n elements uniform(-a, a)
 * (fp32, bf16), or n random code bytes (FP8 but its NaNs; NVFP4 pairs), as the host's add_random. */
__global__ void fill_kernel(void *p, int fmt, size_t n, float a, uint64_t seed) {
    pdl_wait();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float u = coin(seed, i), v = (2.0f * u - 1.0f) * a;
        uint8_t b = (uint8_t)(u * 256);
        if (fmt == DT_BF16) ((bf16 *)p)[i] = __float2bfloat16(v);
        else if (fmt == DT_F32) ((float *)p)[i] = v;
        else ((uint8_t *)p)[i] = b ^ (fmt == DT_FP8 && (b & 0x7F) == 0x7F);
    }
}

/* ------------------------------------------------------------------------------------------------
 * Speed devices and decode-only fusions: what some kernels below add to their math to go faster.
 * None changes what a kernel computes; each says what it saves.
 * ---------------------------------------------------------------------------------------------- */

__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

/* Four 8x8 matrices of 16-bit elements from shared memory (lane l gives row l % 8 of matrix l / 8;
 * a row is 16 bytes: 8 bf16, or 4 fp32 read as pairs), optionally transposed (16-bit elements only).
 * Thread lane holds element (lane / 4, 2 (lane % 4)) and the next of each: of 4 fp32, (lane / 4, lane % 4). */
template <bool TRANS> __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
/* The same, two matrices (lanes 0..15 give the rows). */
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}

/* cp.async staging: a kernel copies its next inputs from global into shared memory while it computes
 * on the current ones (the scan: the next chunk of steps), so the loads overlap the math. */
__device__ __forceinline__ void cp_async4(float *dst, const float *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
/* Copies `bytes` (0..16) of src into the 16 bytes at dst, the rest zeros. */
__device__ __forceinline__ void cp_async16z(void *dst, const void *src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int n> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory"); }

/* Decode-only: the L2 warm. A product cannot start before the kernel ahead of it has finished, but
 * its first WARM_BYTES can be on their way to L2 while the kernels ahead of it run: the draining last
 * wave of the product before it, and a Mamba layer's conv and scan or an attention layer's cache
 * append, attention and combine (chains of small kernels that leave HBM mostly idle). That last wave,
 * the scan and the decode attention kernel ask for them (prefetch: no register, no wait), spread over
 * their threads. It saves part of each product's first memory round trips. Tuned on H200: 8 MB
 * measured best of 4, 8, 16, 24 and 32. */
enum { WARM_BYTES = 8 << 20 };

/* Block `block` of `blocks` asks L2 for its share of the n bytes at p. */
__device__ __forceinline__ void l2_warm(const void *p, size_t n, size_t block, size_t blocks) {
    size_t t = block * blockDim.x + threadIdx.x, step = blocks * blockDim.x * 128;
    for (size_t off = t * 128; off < n; off += step) asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p + off));
}

/* The bytes of W that l2_warm asks for (none without W). */
static size_t warm_bytes(const GMat *W) {
    size_t b = W ? gmat_bytes(W) : 0;
    return b < WARM_BYTES ? b : WARM_BYTES;
}

/* Decode-only: the gated norm folded into the scan and out_proj. A Mamba layer's gated group norm,
 *   u = y * silu(z);  y' = u * rsqrt(mean over u's group of u^2 + eps) * w,
 * then out = W_out y', is at decode no kernel of its own (gated_norm_kernel): the scan writes u * w
 * and each block's sum of u^2 (scan_gate), and out_proj scales group g's columns by the group's
 * rsqrt (EPI_GNORM, group_scales): W (s_g u w) = s_g W (u w). It saves a kernel and a round trip of
 * y through memory a Mamba layer. gnorm_folds() says when it applies.
 *
 * What a one-token product does besides the dot products: nothing; relu^2 on each output; or that
 * group scale, mean(u^2) = (sum of ss[g * parts .. (g + 1) * parts)) / gsize from the scan's sums. */
enum { EPI_NONE, EPI_RELU2, EPI_GNORM, GNORM_PARTS = 512 /* most partial sums EPI_GNORM takes */ };
typedef struct {
    const float *ss;            /* [T, groups, parts] partial sums of u^2 */
    int parts, gsize;           /* partial sums and channels per group */
    float eps;
    size_t step;                /* floats between two tokens' partial sums */
} GroupScale;

/* The scan's side of the fold, for one output: u = y * gate (gate = silu(z)); uu += u^2; y' = u * w. */
__device__ __forceinline__ float scan_gate(float y, float gate, float w, float &uu) {
    float u = y * gate;
    uu += u * u;
    return u * w;
}

/* out_proj's side: the partial sums of tokens t0 .. t0 + nt - 1 (nt <= NT) in one round trip (a block
 * of THREADS threads), then token t's group g scale rsqrt(mean(u^2) + eps) into
 * gsum[t * GNORM_PARTS + g * parts] (gsum: NT * GNORM_PARTS floats, shared). */
template <int THREADS, int NT>
__device__ __forceinline__ void group_scales(float *gsum, const GroupScale &gs, int cols, int t0, int nt) {
    constexpr int PER = GNORM_PARTS / THREADS;
    int groups = cols / gs.gsize, n = groups * gs.parts;
    float v[NT][PER];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int k = 0; k < PER; k++) {
            int i = threadIdx.x + k * THREADS;
            v[t][k] = t < nt && i < n ? gs.ss[(t0 + t) * gs.step + i] : 0.0f;
        }
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int k = 0; k < PER; k++) gsum[t * GNORM_PARTS + threadIdx.x + k * THREADS] = v[t][k];
    __syncthreads();
    for (int j = threadIdx.x; j < nt * groups; j += blockDim.x) {
        float *g = gsum + j / groups * GNORM_PARTS + j % groups * gs.parts, s = 0;
        for (int p = 0; p < gs.parts; p++) s += g[p];
        g[0] = rsqrtf(s / gs.gsize + gs.eps);
    }
    __syncthreads();
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: the matrix-vector product for one token, at the memory-bandwidth limit
 * ---------------------------------------------------------------------------------------------- */

/* 16-byte weight load that streams past L1 (weights are read once per token). */
__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

/* A lane's 16-byte piece of a row and, for NVFP4, the two block scales its 32 elements span. */
struct Piece {
    uint4 w;
    uint32_t s;
};

/* Piece c of a row (bs: the row's block scales). */
template <int FMT> __device__ __forceinline__ Piece piece_load(const uint4 *w, const uint8_t *bs, int c) {
    Piece p = {ld_stream(w + c), 0};
    if (FMT == DT_NVFP4) p.s = __ldg((const unsigned short *)bs + c);
    return p;
}

/* A lane's four pieces c, c + st, c + 2 st, c + 3 st of a row; zeros from nvec on. */
template <int FMT> __device__ __forceinline__ void row_load(Piece (&v)[4], const uint4 *w, const uint8_t *bs, int c, int st, int nvec) {
#pragma unroll
    for (int k = 0; k < 4; k++) v[k] = c + k * st < nvec ? piece_load<FMT>(w, bs, c + k * st) : Piece{make_uint4(0, 0, 0, 0), 0};
}

/* The elements of a row past its last whole 16-byte piece, k = from, from + st, ..., each times x[k] sc(k). */
template <int FMT, typename Scale>
__device__ __forceinline__ float row_tail(const char *row, const uint8_t *bs, const float *x, int from, int cols, int st, Scale sc) {
    float acc = 0;
    for (int k = from; k < cols; k += st) acc += stored_elem<FMT>(row, bs, k) * x[k] * sc(k);
    return acc;
}

/* Several tokens at once (decode of a few tokens: a speculative step's verify): a lane's pieces of a
 * row, once loaded, are dotted with NT rows of x (token t's at x + t * ldx; the first nt of them, nt <=
 * NT), each in exactly the order one token's product takes, so token t's result is the one-token
 * kernel's, bit for bit. At NT = 1 these are the one-token forms. */

/* This lane's part of row . x_t over `cols` elements of format FMT (before the row's scale), element k
 * of token t weighed by sc(t, k), into acc[t]: its 16-byte pieces c, c + st, ..., v holding the first
 * four (row_load). Whole fours: the next four go out before this four's math; the last, partial four
 * too, so none of its pieces waits alone (a row of 2688 bf16 is 10.5 pieces a lane). Then the elements
 * past the last whole piece. row and x are 16-byte aligned. */
template <int FMT, int NT, typename Scale>
__device__ __forceinline__ void row_dot(float (&acc)[NT], const char *row, const uint8_t *bs, const float *x, size_t ldx, int nt, int cols,
                                        int c, int st, Piece (&v)[4], Scale sc) {
    constexpr int per = fmt_per(FMT);
    const uint4 *w = (const uint4 *)row;
    int nvec = cols / per, first = c;
    float a[NT] = {};
    for (; c + 3 * st < nvec; c += 4 * st) {
        Piece u0 = v[0], u1 = v[1], u2 = v[2], u3 = v[3];
        if (c + 7 * st < nvec) {
            v[0] = piece_load<FMT>(w, bs, c + 4 * st); v[1] = piece_load<FMT>(w, bs, c + 5 * st);
            v[2] = piece_load<FMT>(w, bs, c + 6 * st); v[3] = piece_load<FMT>(w, bs, c + 7 * st);
        } else {
            row_load<FMT>(v, w, bs, c + 4 * st, st, nvec);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float *xt = x + t * ldx;
            if (NT == 1 || t < nt)
                a[t] += sc(t, c * per) * dot16<FMT>(u0.w, u0.s, xt + c * per) + sc(t, (c + st) * per) * dot16<FMT>(u1.w, u1.s, xt + (c + st) * per) +
                        sc(t, (c + 2 * st) * per) * dot16<FMT>(u2.w, u2.s, xt + (c + 2 * st) * per) +
                        sc(t, (c + 3 * st) * per) * dot16<FMT>(u3.w, u3.s, xt + (c + 3 * st) * per);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const float *xt = x + t * ldx;
        if (NT > 1 && t >= nt) continue;
#pragma unroll
        for (int k = 0; k < 3; k++)
            if (c + k * st < nvec) a[t] += sc(t, (c + k * st) * per) * dot16<FMT>(v[k].w, v[k].s, xt + (c + k * st) * per);
        acc[t] = a[t] + row_tail<FMT>(row, bs, xt, nvec * per + first, cols, st, [&](int k) { return sc(t, k); });
    }
}

/* The same, unweighed, for the expert kernels' rows (whose addresses a lane learns after the wait):
 * four loads in flight, then one at a time. On H200 the pipelined form above made the MoE down
 * product slower (42.3 against 31.2 us a layer of nemotron-3-nano-30b-a3b, 2026-12-03). */
template <int FMT, int NT>
__device__ __forceinline__ void row_dot(float (&acc)[NT], const char *row, const uint8_t *bs, const float *x, size_t ldx, int nt, int cols,
                                        int c, int st) {
    constexpr int per = fmt_per(FMT);
    const uint4 *w = (const uint4 *)row;
    int nvec = cols / per, first = c;
    float a[NT] = {};
    for (; c + 3 * st < nvec; c += 4 * st) {
        Piece p = piece_load<FMT>(w, bs, c), b = piece_load<FMT>(w, bs, c + st), d = piece_load<FMT>(w, bs, c + 2 * st),
              e = piece_load<FMT>(w, bs, c + 3 * st);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float *xt = x + t * ldx;
            if (NT == 1 || t < nt)
                a[t] += dot16<FMT>(p.w, p.s, xt + c * per) + dot16<FMT>(b.w, b.s, xt + (c + st) * per) +
                        dot16<FMT>(d.w, d.s, xt + (c + 2 * st) * per) + dot16<FMT>(e.w, e.s, xt + (c + 3 * st) * per);
        }
    }
    for (; c < nvec; c += st) {
        Piece p = piece_load<FMT>(w, bs, c);
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (NT == 1 || t < nt) a[t] += dot16<FMT>(p.w, p.s, x + t * ldx + c * per);
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
        if (NT == 1 || t < nt) acc[t] = a[t] + row_tail<FMT>(row, bs, x + t * ldx, nvec * per + first, cols, st, [](int) { return 1.0f; });
}

/* The class of formats an expert kernel is compiled for: one format, or FMT_ANY. The expert kernels
 * read matrices of several formats in one launch (NVFP4 experts beside an FP8 shared expert and a bf16
 * fc2); a model of one format keeps kernels that decode only it (the others' code costs registers). */
enum { FMT_ANY = 99 };

/* Quantized rows are read QROWS a warp, each piece's x once for all of them: a warp a row is bound
 * by its x reads there, not by the weights (a lane's 16 bytes of FP8 meet 64 bytes of x, NVFP4's
 * 128, read lane-strided, a cache line a lane: on H200 FP8 rows streamed at 1.6 TB/s, NVFP4 at 0.5). */
enum { QROWS = 4 };

/* The first pieces (c) of R rows (row[q], their block scales bs[q]); zeros past nvec. */
template <int FMT, int R>
__device__ __forceinline__ void rows_load(Piece (&v)[R], const char *const (&row)[R], const uint8_t *const (&bs)[R], int c, int nvec) {
#pragma unroll
    for (int q = 0; q < R; q++) v[q] = c < nvec ? piece_load<FMT>((const uint4 *)row[q], bs[q], c) : Piece{make_uint4(0, 0, 0, 0), 0};
}

/* This lane's part of R rows' dots with x_t of `cols` elements (before the rows' scales), element k
 * of token t weighed by sc(t, k), added to acc[t][q] (tokens as row_dot's): pieces c, c + st, ...,
 * v holding the first (rows_load). Each row's next piece is in flight while this one's math runs. */
template <int FMT, int R, int NT, typename Scale>
__device__ __forceinline__ void rows_dot(float (&acc)[NT][R], const char *const (&row)[R], const uint8_t *const (&bs)[R], const float *x,
                                         size_t ldx, int nt, int cols, int c, int st, Piece (&v)[R], Scale sc) {
    constexpr int per = fmt_per(FMT);
    int nvec = cols / per, first = c;
    for (; c < nvec; c += st) {
        Piece u[R];
#pragma unroll
        for (int q = 0; q < R; q++) {
            u[q] = v[q];
            if (c + st < nvec) v[q] = piece_load<FMT>((const uint4 *)row[q], bs[q], c + st);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (NT > 1 && t >= nt) continue;
            float s = sc(t, c * per);
#pragma unroll
            for (int q = 0; q < R; q++) acc[t][q] += s * dot16<FMT>(u[q].w, u[q].s, x + t * ldx + c * per);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int q = 0; q < R; q++)
            if (NT == 1 || t < nt)
                acc[t][q] += row_tail<FMT>(row[q], bs[q], x + t * ldx, nvec * per + first, cols, st, [&](int k) { return sc(t, k); });
}

/* rows_load and rows_dot for a run-time format of a kernel compiled for the quantized class F. */
template <int F, int R, int NT>
__device__ __forceinline__ void rows_dot_fmt(int fmt, float (&acc)[NT][R], const char *const (&row)[R], const uint8_t *const (&bs)[R],
                                             const float *x, size_t ldx, int nt, int cols, int c, int st) {
    Piece v[R];
    auto one = [](int, int) { return 1.0f; };
    if (F == FMT_ANY && fmt == DT_BF16) {
        rows_load<DT_BF16, R>(v, row, bs, c, cols / fmt_per(DT_BF16));
        rows_dot<DT_BF16, R, NT>(acc, row, bs, x, ldx, nt, cols, c, st, v, one);
    } else if (F == DT_FP8 || (F == FMT_ANY && fmt == DT_FP8)) {
        rows_load<DT_FP8, R>(v, row, bs, c, cols / fmt_per(DT_FP8));
        rows_dot<DT_FP8, R, NT>(acc, row, bs, x, ldx, nt, cols, c, st, v, one);
    } else {
        rows_load<DT_NVFP4, R>(v, row, bs, c, cols / fmt_per(DT_NVFP4));
        rows_dot<DT_NVFP4, R, NT>(acc, row, bs, x, ldx, nt, cols, c, st, v, one);
    }
}

/* The format class an expert kernel is compiled for, given the formats fmt[0..n) of the matrices it reads. */
static int fmt_class(const int *fmt, int n) {
    for (int i = 1; i < n; i++) if (fmt[i] != fmt[0]) return FMT_ANY;
    return fmt[0];
}

/* Blocks an SM holds of a one-token product's kernel: the quantized ones read QROWS rows a warp and
 * need more registers than 16 blocks of two warps leave (64), so the expert kernels take 8 and the
 * dense one (gemv_q_kernel) 12, with one piece of each row in flight: on one H100 (--bench, two
 * calls) the 8B FP8 decode took 3.34, 3.34 and 3.33, 3.30 ms/token that way against 3.38, 3.38 and
 * 3.34, 3.36 at 8 blocks with two pieces in flight (12 blocks with two: 3.42, 3.43). Waves are still
 * counted at 8 blocks an SM (gemv_blocks): counting 12 measured the same. */
__host__ __device__ constexpr int gemv_min_blocks(int fmt) { return fmt == DT_F32 || fmt == DT_BF16 ? 16 : 8; }
enum { GEMV_Q_BLOCKS = 12 };

/* Blocks of two warps: as a product's last blocks drain, the next kernel's blocks take the freed
 * slots in small steps. Tuned on H200: blocks of 8, 4 and 1 warps are slower, and so is the code the
 * compiler makes for launch bounds of 256 threads instead of 16 blocks of 64. */
enum { GEMV_WARPS = 2 };

/* Tokens a product's kernel dots each loaded piece with: a few tokens' product (decode of a verify
 * step) runs in rounds of GEMV_TOKENS, a warp's rows read again (from L2) each round. */
enum { GEMV_TOKENS = 4 };

/* ... except products of at most TOKENS_Y_BYTES, whose rows L2 holds for every token anyway: the
 * one-token kernel there, a token a row of blocks (blockIdx.y), fills the GPU a token's worth of
 * blocks at a time. On one H200 the default model's drafting at K = 2 went from 1.14x to 1.25x with
 * 4 MB (every product of that model but lm_head), 1.17x with 16 MB (lm_head too). */
enum { TOKENS_Y_BYTES = 4 << 20 };

/* The sums of QROWS rows a warp holds spread over its lanes (acc[t][q]): over the warp into lane q's
 * mine[t], then, where wpr warps share the rows, over those into the first one's, in order (red:
 * shared memory of the block that no thread still reads). */
template <int NT>
__device__ __forceinline__ void rows_sum(float (&mine)[NT], const float (&acc)[NT][QROWS], float (&red)[GEMV_WARPS][NT][QROWS], int wpr) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int q = 0; q < QROWS; q++) {
            float s = warp_sum(acc[t][q]);
            if (lane == q) mine[t] = s;
        }
    if (wpr == 1) return;
    if (lane < QROWS)
        for (int t = 0; t < NT; t++) red[warp][t][lane] = mine[t];
    __syncthreads();
    for (int k = 1; k < wpr && warp % wpr == 0 && lane < QROWS; k++)
        for (int t = 0; t < NT; t++) mine[t] += red[warp + k][t][lane];
}

typedef struct {
    float *out;                 /* [T, ldo] out[t][i] for rows i */
    GMat W;                     /* the matrix, of the kernel's FMT */
    const float *x;             /* [T, ldx] x[t][k] for columns k, each row 16-byte aligned */
    int T;                      /* tokens (the one-token kernels: 1, or one a row of blocks, blockIdx.y) */
    int ldx, ldo;               /* floats between two tokens' x, out */
    int wpr;                    /* warps a row: 1 or 2 (gemv_wpr) */
    const void *warm;           /* decode-only: the next product, warmed in L2 (l2_warm) */
    size_t warm_n;              /* bytes of it to warm (0: none) */
    int warm_from;              /* the first block that warms: the last wave's */
    GroupScale gs;              /* EPI_GNORM: the scan's partial sums of u^2 */
} GemvArgs;

/* out[t][i] = epi(sum_k W[i][k] x[t][k]) for fp32 and bf16 W; wpr warps per row, four to eight 16-byte
 * loads in flight per lane (row_dot), the first four before the wait; NT tokens a round (NT = 1: the
 * one-token kernel: token blockIdx.y). Blocks from warm_from on (the last wave, of the last token) then
 * warm L2 for the next product. */
template <int FMT, int EPI, int NT>
__global__ void __launch_bounds__(32 * GEMV_WARPS, NT == 1 ? 16 : 8) gemv_kernel(const __grid_constant__ GemvArgs a) {
    const GroupScale gs = a.gs;
    int rows = a.W.rows, cols = a.W.cols, wpr = a.wpr, T = NT == 1 ? 1 : a.T, ty = blockIdx.y;   /* ty: the token of a grid of several (NT = 1) */
    __shared__ float red[GEMV_WARPS][NT];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, part = warp % wpr;
    int row = blockIdx.x * (GEMV_WARPS / wpr) + warp / wpr, r = row < rows ? row : 0;
    const char *wrow = (const char *)a.W.w + (size_t)r * row_bytes(FMT, a.W.ld);
    const uint8_t *brow = NULL;
    int st = 32 * wpr, c = part * 32 + lane, nvec = cols / fmt_per(FMT);
    Piece v[4] = {};
    if (row < rows) row_load<FMT>(v, (const uint4 *)wrow, brow, c, st, nvec);   /* fetched while the previous kernel finishes */
    pdl_wait();
    __shared__ float gsum[EPI == EPI_GNORM ? NT * GNORM_PARTS : 1];
    for (int t0 = 0; t0 < T; t0 += NT) {
        int nt = min(NT, T - t0);
        if (t0) {   /* the round before is done with red and gsum; its pieces were all used */
            __syncthreads();
            if (row < rows) row_load<FMT>(v, (const uint4 *)wrow, brow, c, st, nvec);
        }
        if (EPI == EPI_GNORM) group_scales<32 * GEMV_WARPS, NT>(gsum, gs, cols, t0 + ty, nt);
        auto sc = [&](int t, int k) { return EPI == EPI_GNORM ? gsum[t * GNORM_PARTS + k / gs.gsize * gs.parts] : 1.0f; };
        float acc[NT] = {};
        if (row < rows) row_dot<FMT, NT>(acc, wrow, brow, a.x + (size_t)(t0 + ty) * a.ldx, a.ldx, nt, cols, c, st, v, sc);
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
        if (t0 + NT >= T && ty == (int)gridDim.y - 1 && (int)blockIdx.x >= a.warm_from) l2_warm(a.warm, a.warm_n, blockIdx.x - a.warm_from, gridDim.x - a.warm_from);
        if (wpr > 1) {
            if (lane == 0)
                for (int t = 0; t < NT; t++) red[warp][t] = acc[t];
            __syncthreads();
            for (int k = 1; k < wpr && !part; k++)
                for (int t = 0; t < NT; t++) acc[t] += red[warp + k][t];
        }
        if (lane == 0 && row < rows && !part)
            for (int t = 0; t < nt; t++) {
                float o = acc[t];
                if (EPI == EPI_RELU2) { o = fmaxf(o, 0.0f); o *= o; }
                a.out[(size_t)(t0 + ty + t) * a.ldo + row] = o;
            }
    }
}

/* The same for FP8 W, out[t][i] = epi(s_i sum_k W[i][k] x[t][k]) with s_i the row's scale: a
 * warp takes QROWS rows (rows_dot), wpr warps the same rows (each every wpr-th piece, summed through
 * shared memory: matrices of few rows fill the GPU); their first pieces before the wait. */
template <int FMT, int EPI, int NT>
__global__ void __launch_bounds__(32 * GEMV_WARPS, NT == 1 ? GEMV_Q_BLOCKS : 4) gemv_q_kernel(const __grid_constant__ GemvArgs a) {
    const GroupScale gs = a.gs;
    int rows = a.W.rows, cols = a.W.cols, lane = threadIdx.x & 31, T = NT == 1 ? 1 : a.T, nvec = cols / fmt_per(FMT), ty = blockIdx.y;
    int warp = threadIdx.x >> 5, wpr = a.wpr, part = warp % wpr, c = part * 32 + lane;
    int row0 = (blockIdx.x * (GEMV_WARPS / wpr) + warp / wpr) * QROWS;
    __shared__ float red[GEMV_WARPS][NT][QROWS];
    const char *wr[QROWS];
    const uint8_t *br[QROWS] = {};   /* FP8: no block scales */
    Piece v[QROWS];
#pragma unroll
    for (int q = 0; q < QROWS; q++) wr[q] = (const char *)a.W.w + (size_t)min(row0 + q, rows - 1) * row_bytes(FMT, a.W.ld);
    rows_load<FMT, QROWS>(v, wr, br, c, nvec);
    pdl_wait();
    __shared__ float gsum[EPI == EPI_GNORM ? NT * GNORM_PARTS : 1];
    for (int t0 = 0; t0 < T; t0 += NT) {
        int nt = min(NT, T - t0);
        if (t0) {   /* the round before is done with gsum and red; its pieces were all used */
            __syncthreads();
            rows_load<FMT, QROWS>(v, wr, br, c, nvec);
        }
        if (EPI == EPI_GNORM) group_scales<32 * GEMV_WARPS, NT>(gsum, gs, cols, t0 + ty, nt);
        auto sc = [&](int t, int k) { return EPI == EPI_GNORM ? gsum[t * GNORM_PARTS + k / gs.gsize * gs.parts] : 1.0f; };
        float acc[NT][QROWS] = {}, mine[NT] = {};   /* lane q keeps row q's sums */
        rows_dot<FMT, QROWS, NT>(acc, wr, br, a.x + (size_t)(t0 + ty) * a.ldx, a.ldx, nt, cols, c, 32 * wpr, v, sc);
        if (t0 + NT >= T && ty == (int)gridDim.y - 1 && (int)blockIdx.x >= a.warm_from) l2_warm(a.warm, a.warm_n, blockIdx.x - a.warm_from, gridDim.x - a.warm_from);
        rows_sum<NT>(mine, acc, red, wpr);
        if (lane < QROWS && row0 + lane < rows && !part)
            for (int t = 0; t < nt; t++) {
                float o = mine[t] * a.W.rs[row0 + lane];
                if (EPI == EPI_RELU2) { o = fmaxf(o, 0.0f); o *= o; }
                a.out[(size_t)(t0 + ty + t) * a.ldo + row0 + lane] = o;
            }
    }
}

/* NVFP4 rows on the tensor cores (an NVFP4 product's decode, one to E2M1_TOKENS tokens a round):
 * decoding E2M1 pairs for the mma costs fewer instructions an element than converting each code to
 * fp32 (gemv_q_kernel's form ran NVFP4 rows at 1.1 to 1.5 TB/s, bound by that math). A block takes
 * E2M1_ROWS rows and its warps every warps-th span of E2M1_SPAN elements of them. In a span, lane
 * (g, t) = (lane / 4, lane % 4) holds 16 bytes (32 codes) of rows g and g + 8 at elements span + 32 t
 * and token g's x there; mma m16n8k16 (bf16, fp32 sums) takes codes i and i + 4 of a 32-bit word as
 * one k pair (e2m1_pair), times the block's scale times 2^112 (exact: at most 6 significant bits, at
 * least 2^-24), with x rounded to bf16 (W4A16, as a prompt's products), so a span's sum comes out
 * times 2^-14. Each span's sums are added, weighed by the group scale of EPI_GNORM (a group is whole
 * spans, gnorm_folds), into the row's; column n of the mma is token n, the same sums whatever the
 * others. A one-token block first stages its x in shared memory as bf16 pairs (e2m1_stage; the dense
 * and up products up to E2M1_XS columns, the down product its range), every column the token's: a
 * lane then reads a span's pairs in four loads, where converting them cost a warp 24 instructions
 * with four lanes of 32 at work (the kernels issue instructions on about 55% of cycles: Nsight
 * Compute, bench/RESULTS.md). */
enum { E2M1_ROWS = 16, E2M1_SPAN = 128, E2M1_TOKENS = 8 };

/* Elements of a row a decoded product of format fmt weighs by one group scale (EPI_GNORM): a 16-byte
 * piece, an NVFP4 span. */
static int gnorm_unit(int fmt) { return fmt == DT_NVFP4 ? E2M1_SPAN : fmt_per(fmt); }

/* Two block scales (E4M3, the first in the low byte; at most 448 = 1.75 2^8) each times 2^112 as a
 * bf16 pair (exact and finite; 2^120 would overflow past 256), converted together. */
__device__ __forceinline__ void e2m1_scales(uint32_t (&s)[2], unsigned b) {
    float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)b, __NV_E4M3)));
    s[0] = pack_bf16(f.x * 0x1p112f, f.x * 0x1p112f), s[1] = pack_bf16(f.y * 0x1p112f, f.y * 0x1p112f);
}

/* Row i of a matrix on the device: its bytes, its block scales (NVFP4) and its scale (1 unquantized). */
typedef struct {
    const char *w;
    const uint8_t *bs;
    float scale;
} GRow;

__device__ __forceinline__ GRow gmat_row(const GMat &W, size_t i) {
    int q = quantized(W.fmt);
    return GRow{(const char *)W.w + i * row_bytes(W.fmt, W.ld), W.bs ? W.bs + i * (W.ld / 16) : NULL, q ? W.rs[i] : 1.0f};
}

/* gmat_row of an NVFP4 matrix, for the tensor-core kernels: no branch on the format. */
__device__ __forceinline__ GRow e2m1_row(const GMat &W, size_t i) {
    return GRow{(const char *)W.w + i * row_bytes(DT_NVFP4, W.ld), W.bs + i * (W.ld / 16), W.rs[i]};
}

/* A lane's part of a span: 16 bytes of each of its two rows and their two block scales each. */
struct E2m1Chunk {
    uint4 a, b;
    uint32_t sa, sb;
};

/* Lane t's part of rows a and b at element e = a span's start + 32 t: zeros past the row's cols
 * (whole 16-element blocks). */
__device__ __forceinline__ E2m1Chunk e2m1_load(const GRow &a, const GRow &b, int e, int cols) {
    E2m1Chunk c = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), 0, 0};
    if (e + 32 <= cols) {
        c.a = ld_stream((const uint4 *)(a.w + e / 2)), c.b = ld_stream((const uint4 *)(b.w + e / 2));
        c.sa = __ldg((const unsigned short *)(a.bs + e / 16)), c.sb = __ldg((const unsigned short *)(b.bs + e / 16));
    } else if (e + 16 <= cols) {
        uint2 x = *(const uint2 *)(a.w + e / 2), y = *(const uint2 *)(b.w + e / 2);
        c.a = make_uint4(x.x, x.y, 0, 0), c.b = make_uint4(y.x, y.y, 0, 0);
        c.sa = a.bs[e / 16], c.sb = b.bs[e / 16];
    }
    return c;
}

/* x[e .. e + 31] as the mma's bf16 k pairs: word m's pairs (i, i + 4) at 4 m + i; zeros past cols. */
__device__ __forceinline__ void e2m1_x(uint32_t (&xb)[16], const float *x, int e, int cols) {
    if (e + 16 > cols) return;
#pragma unroll
    for (int m = 0; m < 4; m++) {
        if (m >= 2 && e + 32 > cols) break;
        float4 p = *(const float4 *)(x + e + 8 * m), q = *(const float4 *)(x + e + 8 * m + 4);
        xb[4 * m] = pack_bf16(p.x, q.x), xb[4 * m + 1] = pack_bf16(p.y, q.y);
        xb[4 * m + 2] = pack_bf16(p.z, q.z), xb[4 * m + 3] = pack_bf16(p.w, q.w);
    }
}

/* The widest x the dense and up kernels stage (8 KB of bf16 pairs); the most spans of a down
 * product's range, whose staged x then fits the 48 KB of shared memory a launch gets unasked. */
enum { E2M1_XS = 4096, E2M1_RANGE = 192 };

/* Spans [lo, hi) of one token's x as e2m1_x lays them out, staged for a block's warps: span s's 64
 * words at xs + 64 (s - lo), chunk c's 16 of them at 16 c; at(s, &x, &e, &cols) gives the x span s
 * reads, its first element and its row's end (zeros past it; whole 16-element blocks). */
template <typename At> __device__ __forceinline__ void e2m1_stage(uint32_t *xs, int lo, int hi, At at) {
    for (int q = threadIdx.x; q < (hi - lo) * 16; q += blockDim.x) {   /* 8 elements: 4 words */
        const float *x;
        int e, cols;
        at(lo + q / 16, x, e, cols);
        e += 8 * (q % 16);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (e < cols) {
            float4 p = *(const float4 *)(x + e), r = *(const float4 *)(x + e + 4);
            v = make_uint4(pack_bf16(p.x, r.x), pack_bf16(p.y, r.y), pack_bf16(p.z, r.z), pack_bf16(p.w, r.w));
        }
        ((uint4 *)xs)[q] = v;
    }
    __syncthreads();
}

/* xb of element e (a chunk's start) from a staged x, every column the same token's. */
__device__ __forceinline__ void e2m1_xs(uint32_t (&xb)[16], const uint32_t *xs, int e) {
    const uint4 *p = (const uint4 *)(xs + e / 2);
#pragma unroll
    for (int m = 0; m < 4; m++) {
        uint4 v = p[m];
        xb[4 * m] = v.x, xb[4 * m + 1] = v.y, xb[4 * m + 2] = v.z, xb[4 * m + 3] = v.w;
    }
}

/* d += a span's 16 rows (each lane's chunk: rows g and g + 8) times its x (xb, column n = token n),
 * times 2^-14 (see gemv_e2m1_kernel). */
__device__ __forceinline__ void e2m1_mma(float (&d)[4], const E2m1Chunk &c, const uint32_t (&xb)[16]) {
    uint32_t sa[2], sb[2];
    e2m1_scales(sa, c.sa), e2m1_scales(sb, c.sb);
    uint32_t wa4[4] = {c.a.x, c.a.y, c.a.z, c.a.w}, wb4[4] = {c.b.x, c.b.y, c.b.z, c.b.w};
#pragma unroll
    for (int m = 0; m < 4; m++) {   /* a: row g k pairs 2 t, 2 t + 8, then row g + 8's */
        uint32_t p[4] = {mul_bf16x2(e2m1_pair<0>(wa4[m]), sa[m / 2]), mul_bf16x2(e2m1_pair<0>(wb4[m]), sb[m / 2]),
                         mul_bf16x2(e2m1_pair<1>(wa4[m]), sa[m / 2]), mul_bf16x2(e2m1_pair<1>(wb4[m]), sb[m / 2])};
        mma_bf16(d, p, xb[4 * m], xb[4 * m + 1]);
        uint32_t q[4] = {mul_bf16x2(e2m1_pair<2>(wa4[m]), sa[m / 2]), mul_bf16x2(e2m1_pair<2>(wb4[m]), sb[m / 2]),
                         mul_bf16x2(e2m1_pair<3>(wa4[m]), sa[m / 2]), mul_bf16x2(e2m1_pair<3>(wb4[m]), sb[m / 2])};
        mma_bf16(d, q, xb[4 * m + 2], xb[4 * m + 3]);
    }
}

/* The warps' sums of a block into warp 0's acc, in warp order. */
template <int WARPS> __device__ __forceinline__ void e2m1_warps_sum(float (&acc)[4], float (&red)[WARPS][32][4], int warp, int lane) {
    if (WARPS == 1) return;
    for (int j = 0; j < 4; j++) red[warp][lane][j] = acc[j];
    __syncthreads();
    for (int w = 1; w < WARPS && !warp; w++)
        for (int j = 0; j < 4; j++) acc[j] += red[w][lane][j];
}

template <int EPI, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 16 / WARPS) gemv_e2m1_kernel(const __grid_constant__ GemvArgs a) {
    const GroupScale gs = a.gs;
    int rows = a.W.rows, cols = a.W.cols, T = a.T, spans = cdiv(cols, E2M1_SPAN);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3, r0 = blockIdx.x * E2M1_ROWS;
    GRow ra = e2m1_row(a.W, min(r0 + g, rows - 1)), rb = e2m1_row(a.W, min(r0 + g + 8, rows - 1));
    auto load = [&](int s) { return s < spans ? e2m1_load(ra, rb, s * E2M1_SPAN + 32 * t, cols) : E2m1Chunk{}; };
    E2m1Chunk cur = load(warp);   /* fetched while the previous kernel finishes */
    pdl_wait();
    __shared__ float gsum[EPI == EPI_GNORM ? E2M1_TOKENS * GNORM_PARTS : 1];
    __shared__ float red[WARPS][32][4];
    __shared__ __align__(16) uint32_t xs[E2M1_XS / 2];
    int staged = T == 1 && cols <= E2M1_XS;
    if (staged) e2m1_stage(xs, 0, spans, [&](int s, const float *&x, int &e, int &c) { x = a.x, e = s * E2M1_SPAN, c = cols; });
    for (int t0 = 0; t0 < T; t0 += E2M1_TOKENS) {
        int nt = min((int)E2M1_TOKENS, T - t0);
        if (t0) {   /* the round before is done with gsum and red */
            __syncthreads();
            cur = load(warp);
        }
        if (EPI == EPI_GNORM) group_scales<32 * WARPS, E2M1_TOKENS>(gsum, gs, cols, t0, nt);
        const float *x = a.x + (size_t)(t0 + min(g, nt - 1)) * a.ldx;
        float acc[4] = {0, 0, 0, 0};   /* rows g, g, g + 8, g + 8; tokens 2 t, 2 t + 1 */
        for (int s = warp; s < spans; s += WARPS) {
            E2m1Chunk nxt = load(s + WARPS);
            uint32_t xb[16] = {};
            if (staged) e2m1_xs(xb, xs, s * E2M1_SPAN + 32 * t);
            else if (g < nt) e2m1_x(xb, x, s * E2M1_SPAN + 32 * t, cols);
            float d[4] = {0, 0, 0, 0};
            e2m1_mma(d, cur, xb);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int n = 2 * t + (j & 1);
                float sc = EPI == EPI_GNORM && n < nt ? gsum[n * GNORM_PARTS + s * E2M1_SPAN / gs.gsize * gs.parts] : 1.0f;
                acc[j] += sc * d[j];
            }
            cur = nxt;
        }
        if (t0 + E2M1_TOKENS >= T && (int)blockIdx.x >= a.warm_from) l2_warm(a.warm, a.warm_n, blockIdx.x - a.warm_from, gridDim.x - a.warm_from);
        e2m1_warps_sum<WARPS>(acc, red, warp, lane);
        for (int j = 0; j < 4 && !warp; j++) {
            int n = 2 * t + (j & 1), row = r0 + g + (j >> 1) * 8;
            if (n >= nt || row >= rows) continue;
            float o = acc[j] * 16384.0f * (j >> 1 ? rb : ra).scale;
            if (EPI == EPI_RELU2) { o = fmaxf(o, 0.0f); o *= o; }
            a.out[(size_t)(t0 + n) * a.ldo + row] = o;
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: Mamba2
 * ---------------------------------------------------------------------------------------------- */

/* Causal depthwise conv1d (width 4) + SiLU:
 *   out[t] = silu(b + w0 in[t-3] + w1 in[t-2] + w2 in[t-1] + w3 in[t]),
 * where in[-3..-1] are the three inputs before this step, kept in `state` (oldest first). A thread
 * slides along CONV_STEPS steps of one channel, so each input is read once. A step of at most
 * CONV_STEPS tokens (decode, a verify forward) leaves the state here, its thread the only reader of
 * its channel's; a longer one leaves that to conv_state_kernel. With keep, the window
 * after step t (in[t-2..t]) goes to keep + t * keep_step as well, laid out as state. */
enum { CONV_STEPS = 8 };

__global__ void conv_kernel(float *out, const float *in, int ldi, float *state, const float *w, const float *b,
                            int T, int C, float *keep, size_t keep_step) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, t0 = blockIdx.y * CONV_STEPS;
    float w0 = 0, w1 = 0, w2 = 0, w3 = 0, bias = 0;
    if (c < C) { w0 = w[c * 4]; w1 = w[c * 4 + 1]; w2 = w[c * 4 + 2]; w3 = w[c * 4 + 3]; bias = b[c]; }
    pdl_wait();
    if (c >= C) return;
    float h[3];
    for (int k = 0; k < 3; k++) {
        int j = t0 - 3 + k;
        h[k] = j >= 0 ? in[(size_t)j * ldi + c] : state[c * 3 + 3 + j];
    }
#pragma unroll
    for (int s = 0; s < CONV_STEPS; s++) {
        int t = t0 + s;
        if (t >= T) break;
        float cur = in[(size_t)t * ldi + c], a = bias;
        a += w0 * h[0];
        a += w1 * h[1];
        a += w2 * h[2];
        a += w3 * cur;
        out[(size_t)t * C + c] = silu(a);
        h[0] = h[1]; h[1] = h[2]; h[2] = cur;
        if (keep)
            for (int k = 0; k < 3; k++) keep[(size_t)t * keep_step + c * 3 + k] = h[k];
    }
    if (gridDim.y == 1)
        for (int k = 0; k < 3; k++) state[c * 3 + k] = h[k];
}

/* After a step of more than CONV_STEPS tokens: the state keeps its last three inputs. */
__global__ void conv_state_kernel(float *state, const float *in, int ldi, int T, int C) {
    pdl_wait();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int k = 0; k < 3; k++) state[c * 3 + k] = in[(size_t)(T - 3 + k) * ldi + c];
}

/* The selective scan over T steps, for head h and channel (row) p:
 *   dt = softplus(dt_raw + dt_bias[h]);  S = exp(dt A[h]) S + dt x[h,p] B[g];  y = S . C[g] + D[h] x[h,p]
 * with g = h / (heads per group). A group of LR lanes holds four rows; each lane keeps E = N / LR of
 * their state entries (n = sub, sub + LR, ...) in registers for all T steps. Four rows per lane let
 * one read of B and C serve four rows (shared-memory bandwidth is what bounds a scan like this), and
 * the four row sums are reduce-scattered over the LR lanes (scan_rows). The block copies the inputs
 * of the next `chunk` steps (its group's B and C, its rows' x, the raw dt) into shared memory with
 * cp.async while it computes the current ones (stage). T = 1 is the decode step; there (MODE
 * SCAN_GATE) the scan also gates (scan_gate, the gated norm fold): y = u * gw with u = y * silu(z), z
 * the first d_inner columns of proj, and gss[h * gridDim.y + blockIdx.y] = the sum of u^2 over the
 * block's rows. SCAN_EACH is for a few tokens run as decode runs them one by one (a speculative
 * step's verify): each step gates as SCAN_GATE does, with sums of its own (gss, where given: token t's
 * at gss + t * gridDim.x * gridDim.y), and the state after step t goes to keep + t * keep_step
 * (where given). MODE is a template argument, not a test of gss in the step loop: nvcc 13 does not
 * split that loop into a gated and a plain copy when the arguments come as one struct, and the
 * 2048-step scan then took 12% longer on H200. */
enum { SCAN_STEPS = 16, SCAN_THREADS = 256 };
enum { SCAN_PLAIN, SCAN_GATE, SCAN_EACH };

/* The inputs of a scan over T steps (ssm_scan_kernel; ssd_scan_kernel reads the fields up to d_inner). */
typedef struct {
    float *y;                   /* [T, d_inner] output: y, or u * gw where the scan gates */
    float *ssm;                 /* [heads, hdim, N] fp32 state: read at the start, written back at the end */
    const float *xbc;           /* [T, conv] conv output: x [d_inner] | B [groups * N] | C [groups * N] */
    const float *proj;          /* [T, ld_proj] in_proj output: z from column 0, the raw dt from column dt_off */
    int ld_proj, dt_off;
    const float *A, *D, *dt_bias;   /* [heads] each; A = -exp(A_log) */
    int T, heads, hdim, groups, d_inner;   /* steps; local heads, head size, local groups; heads * hdim */
    int chunk;                  /* steps a stage of shared memory holds (ssm_scan sets it) */
    const void *warm;           /* decode-only: out_proj, warmed in L2 (l2_warm) */
    size_t warm_n;              /* bytes of it to warm (0: none) */
    const float *gw;            /* [d_inner] gated norm weight: the scan gates (NULL: not; see ssm_scan) */
    float *gss;                 /* [T, heads, scan blocks a head] each block's sum of u^2, where it gates */
    float *keep;                /* [T] slots laid out as ssm, from this layer's in slot 0: the state after
                                   each step (NULL: not kept) */
    size_t keep_step;           /* floats between two slots */
} ScanArgs;

/* Lanes per group of four rows: 16 (8 at N = 8). N is a power of two, 8..256. */
__host__ __device__ constexpr int scan_lanes(int N) { return N >= 16 ? 16 : N; }

/* The row of four (0..3) whose sum lane sub carries after scan_rows; one lane of LR / 4 writes it. */
template <int LR> __device__ __forceinline__ int scan_row(int sub) { return 2 * ((sub & (LR / 2)) != 0) + ((sub & (LR / 4)) != 0); }

/* The four rows' sums v over the LR lanes, reduce-scattered: rows {0,1} | {2,3}, then one row each,
 * then the rest; after two exchanges each lane carries one row (scan_row), so a step costs a handful
 * of shuffles, not four full reductions. */
template <int LR> __device__ __forceinline__ float scan_rows(const float (&v)[4], int sub) {
    int o = LR / 2, hi = (sub & o) != 0, hi2 = (sub & (o / 2)) != 0;
    float k0 = (hi ? v[2] : v[0]) + __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[2], o);
    float k1 = (hi ? v[3] : v[1]) + __shfl_xor_sync(0xffffffffu, hi ? v[1] : v[3], o);
    float r = (hi2 ? k1 : k0) + __shfl_xor_sync(0xffffffffu, hi2 ? k0 : k1, o / 2);
    for (o /= 4; o; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
    return r;
}

template <int N, int MODE>
__global__ void __launch_bounds__(SCAN_THREADS) ssm_scan_kernel(const __grid_constant__ ScanArgs sa) {
    float *y = sa.y, *ssm = sa.ssm, *gss = sa.gss, *keep = sa.keep;
    const float *xbc = sa.xbc, *proj = sa.proj, *A = sa.A, *D = sa.D, *dt_bias = sa.dt_bias, *gw = sa.gw;
    int ld_proj = sa.ld_proj, dt_off = sa.dt_off, T = sa.T, chunk = sa.chunk, heads = sa.heads, hdim = sa.hdim, groups = sa.groups,
        d_inner = sa.d_inner;
    constexpr int LR = scan_lanes(N), E = N / LR;   /* compile-time: shared-memory offsets become immediates */
    extern __shared__ float4 sm4[];
    float *sm = (float *)sm4;
    int rpb = blockDim.x / LR * 4, sub = threadIdx.x % LR, q = threadIdx.x / LR;
    int h = blockIdx.x, p0 = blockIdx.y * rpb, g = h / (heads / groups), cv = d_inner + 2 * groups * N;
    int buf_len = chunk * (2 * N + rpb + 1);   /* per buffer: B [chunk][N], C [chunk][N], x [chunk][rpb], dt [chunk] */
    float *sdt = sm + 2 * buf_len, *sdA = sdt + SCAN_STEPS;
    float a = A[h], d = D[h], bias = dt_bias[h];
    float S[4][E];   /* the state, read before the wait (see LAUNCH): at decode, most of what this reads */
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int p = p0 + q * 4 + k;
        const float *st = ssm + ((size_t)h * hdim + (p < hdim ? p : 0)) * N + sub;
#pragma unroll
        for (int e = 0; e < E; e++) S[k][e] = p < hdim ? st[e * LR] : 0.0f;
    }
    l2_warm(sa.warm, sa.warm_n, (size_t)blockIdx.y * gridDim.x + blockIdx.x, (size_t)gridDim.x * gridDim.y);
    /* the row this lane writes (see scan_rows); its z and gw are ready (see LAUNCH) */
    int row = scan_row<LR>(sub), pw = p0 + q * 4 + row;
    int writer = (sub & (LR / 4 - 1)) == 0 && pw < hdim;
    float gate = 0, gww = 0, uu = 0;   /* silu(z), gw of that row; sum of u^2 */
    if (MODE == SCAN_GATE && writer) gate = silu(proj[h * hdim + pw]);
    if ((MODE == SCAN_GATE || (MODE == SCAN_EACH && gss)) && writer) gww = gw[h * hdim + pw];
    pdl_wait();
    auto stage = [&](int t0, int buf) {   /* the inputs of steps t0 .. t0 + chunk - 1 into buffer buf */
        int steps = min(chunk, T - t0);
        float *sB = sm + buf * buf_len, *sC = sB + chunk * N, *sx = sC + chunk * N, *sraw = sx + chunk * rpb;
        for (int s = 0; s < steps; s++) {
            const float *r = xbc + (size_t)(t0 + s) * cv + d_inner + g * N;
            for (int k = threadIdx.x; k < N; k += blockDim.x) {
                cp_async4(sB + s * N + k, r + k);
                cp_async4(sC + s * N + k, r + groups * N + k);
            }
        }
        for (int i = threadIdx.x; i < steps * rpb; i += blockDim.x) {
            int s = i / rpb, pp = p0 + i % rpb;
            if (pp < hdim) cp_async4(sx + i, xbc + (size_t)(t0 + s) * cv + h * hdim + pp); else sx[i] = 0;
        }
        for (int s = threadIdx.x; s < steps; s += blockDim.x) cp_async4(sraw + s, proj + (size_t)(t0 + s) * ld_proj + dt_off + h);
        cp_async_commit();
    };
    stage(0, 0);
    for (int t0 = 0, buf = 0; t0 < T; t0 += chunk, buf ^= 1) {
        int steps = min(chunk, T - t0);
        if (t0 + chunk < T) { stage(t0 + chunk, buf ^ 1); cp_async_wait<1>(); } else cp_async_wait<0>();
        __syncthreads();   /* this chunk's inputs have landed, for every thread */
        const float *sB = sm + buf * buf_len, *sC = sB + chunk * N, *sx = sC + chunk * N, *sraw = sx + chunk * rpb;
        if (threadIdx.x < steps) {
            float dt = softplus(sraw[threadIdx.x] + bias);
            sdt[threadIdx.x] = dt;
            sdA[threadIdx.x] = __expf(dt * a);
        }
        __syncthreads();
#pragma unroll 2
        for (int s = 0; s < steps; s++) {   /* two steps interleaved: more independent work per warp */
            float dt = sdt[s], dA = sdA[s], b[E], c[E], v[4];
            const float *xs = sx + s * rpb + q * 4;
#pragma unroll
            for (int e = 0; e < E; e++) { b[e] = sB[s * N + e * LR + sub]; c[e] = sC[s * N + e * LR + sub]; }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float dx = dt * xs[k], acc = 0;
#pragma unroll
                for (int e = 0; e < E; e++) {
                    S[k][e] = fmaf(dA, S[k][e], dx * b[e]);
                    acc = fmaf(S[k][e], c[e], acc);
                }
                v[k] = acc;
            }
            float r = scan_rows<LR>(v, sub);
            if (writer) {
                float yv = r + d * xs[row];
                if (MODE == SCAN_GATE) yv = scan_gate(yv, gate, gww, uu);
                if (MODE == SCAN_EACH && gss) yv = scan_gate(yv, silu(proj[(size_t)(t0 + s) * ld_proj + h * hdim + pw]), gww, uu);
                y[(size_t)(t0 + s) * d_inner + h * hdim + pw] = yv;
            }
            if (MODE == SCAN_EACH && keep) {
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    int p = p0 + q * 4 + k;
                    float *out = keep + (size_t)(t0 + s) * sa.keep_step + ((size_t)h * hdim + p) * N + sub;
#pragma unroll
                    for (int e = 0; e < E; e++) if (p < hdim) out[e * LR] = S[k][e];
                }
            }
            if (MODE == SCAN_EACH && gss) {   /* every thread is here: steps is the block's */
                float total = block_sum(uu);
                uu = 0;
                if (threadIdx.x == 0) gss[(size_t)(t0 + s) * gridDim.x * gridDim.y + h * gridDim.y + blockIdx.y] = total;
            }
        }
        __syncthreads();   /* this buffer and sdt are free for the next chunk */
    }
    if (MODE == SCAN_GATE) {
        float total = block_sum(uu);
        if (threadIdx.x == 0) gss[h * gridDim.y + blockIdx.y] = total;
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int p = p0 + q * 4 + k;
        if (p < hdim) {
            float *out = ssm + ((size_t)h * hdim + p) * N + sub;
#pragma unroll
            for (int e = 0; e < E; e++) out[e * LR] = S[k][e];
        }
    }
}

/* The scan's block: groups of four rows, at most SCAN_THREADS threads. */
static int scan_threads(int hdim, int N) { return std::min((int)SCAN_THREADS, ((hdim + 3) / 4 * scan_lanes(N) + 31) / 32 * 32); }

/* The scan's blocks per head (each leaves one partial sum of u^2 when it gates). */
static int scan_blocks(int hdim, int N) { return cdiv(hdim, scan_threads(hdim, N) / scan_lanes(N) * 4); }

/* Whether a step over `heads` heads folds the gated norm into the scan and out_proj (see the
 * decode-only fusions): a decoded one (dec), where a group of gsize channels is whole 16-byte pieces of
 * out_proj's rows (per elements a piece) and all the scan's partial sums fit. */
static int gnorm_folds(int dec, int heads, int hdim, int N, int gsize, int per) {
    return dec && gsize % per == 0 && heads * scan_blocks(hdim, N) <= GNORM_PARTS;
}

/* The scan kernel for state size N and a mode. */
template <int MODE> static void (*ssm_scan_for(int N))(const ScanArgs) {
    return N == 8 ? ssm_scan_kernel<8, MODE> : N == 16 ? ssm_scan_kernel<16, MODE> : N == 32 ? ssm_scan_kernel<32, MODE>
         : N == 64 ? ssm_scan_kernel<64, MODE> : N == 128 ? ssm_scan_kernel<128, MODE> : ssm_scan_kernel<256, MODE>;
}

/* Launches the scan of a (state size N): gated where a.gss is given (with a.gw), the states kept where
 * a.keep is. Half the chunk at N = 256 to stay under 48 KB of shared memory. */
static void ssm_scan(cudaStream_t stream, ScanArgs a, int N) {
    int threads = scan_threads(a.hdim, N), rpb = threads / scan_lanes(N) * 4;
    a.chunk = N > 128 ? SCAN_STEPS / 2 : SCAN_STEPS;
    size_t smem = (size_t)(2 * a.chunk * (2 * N + rpb + 1) + 2 * SCAN_STEPS) * sizeof(float);
    auto k = a.keep || (a.gss && a.T > 1) ? ssm_scan_for<SCAN_EACH>(N) : a.gss ? ssm_scan_for<SCAN_GATE>(N) : ssm_scan_for<SCAN_PLAIN>(N);
    LAUNCH(dim3(a.heads, scan_blocks(a.hdim, N)), threads, smem, stream, k, a);
}

/* u = y * silu(z), then RMSNorm over each group of gsize channels, times w, into out (fp32: y itself;
 * bf16: the input of a bf16 out_proj): one block per (t, group), its gsize <= PER * blockDim values
 * held in registers (see gated_norm), four consecutive channels a thread a turn (as the norms above),
 * so the loads of y, z and w are all in flight together: 16 bytes each where every row starts
 * 16-byte aligned, else one float at a time. */
enum { GN_PER = 8 };

/* v[k] = row[norm_at(k)]: the thread's four channels of turn k / 4 (zeros from n on), by float4 where vec */
template <int PER> __device__ __forceinline__ void gn_load(float (&v)[PER], const float *row, int n, bool vec) {
#pragma unroll
    for (int k = 0; k < PER; k += 4) {
        int i = norm_at(k);
        if (vec) {
            float4 q = i < n ? *(const float4 *)(row + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            v[k] = q.x, v[k + 1] = q.y, v[k + 2] = q.z, v[k + 3] = q.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) v[k + j] = i + j < n ? row[i + j] : 0.0f;
        }
    }
}

template <typename OT, int PER>
__global__ void __launch_bounds__(1024, GN_PER / PER) gated_norm_kernel(OT *out, int ldo, const float *y, const float *z, int ldz,
                                                                        const float *w, int di, int gsize, float eps) {
    int t = blockIdx.x / (di / gsize), g = blockIdx.x % (di / gsize);
    bool vec = ((gsize | ldz | ldo) % 4 == 0) && ((uintptr_t)y | (uintptr_t)z | (uintptr_t)w | (uintptr_t)out) % 16 == 0;
    float wv[PER], u[PER], zv[PER], ss = 0;
    gn_load(wv, w + g * gsize, gsize, vec);
    pdl_wait();
    OT *o = out + (size_t)t * ldo + g * gsize;
    gn_load(u, y + (size_t)t * di + g * gsize, gsize, vec);
    gn_load(zv, z + (size_t)t * ldz + g * gsize, gsize, vec);
#pragma unroll
    for (int k = 0; k < PER; k++) {
        u[k] *= silu(zv[k]);
        ss += u[k] * u[k];
    }
    float scale = rsqrtf(block_sum(ss) / gsize + eps);
#pragma unroll
    for (int k = 0; k < PER; k += 4) {
        int i = norm_at(k);
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = u[k + j] * scale * wv[k + j];
        if (vec && i < gsize) {
            store4(o + i, v[0], v[1], v[2], v[3]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (i + j < gsize) o[i + j] = (OT)v[j];
        }
    }
}

/* The gated norm of T tokens' groups: four channels a thread up to 4096 a group, more blocks in
 * flight than eight (nemotron-h-8b's prompt, H200: 4% faster), and then half the registers, so
 * sixteen blocks of 128 threads (Nano's 512-channel groups) fit an SM; groups of up to GN_PER * 1024
 * channels (checked at setup). */
template <typename OT>
static void gated_norm(cudaStream_t stream, OT *out, int ldo, const float *y, const float *z, int ldz, const float *w, int T, int di,
                       int gsize, float eps) {
    int threads = std::min(1024, (cdiv(gsize, 4) + 31) / 32 * 32);
    LAUNCH(T * (di / gsize), threads, 0, stream, gsize <= 4 * 1024 ? gated_norm_kernel<OT, 4> : gated_norm_kernel<OT, GN_PER>, out, ldo,
           y, z, ldz, w, di, gsize, eps);
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: the prompt's Mamba2 scan as the chunked state-space-duality (SSD) algorithm
 * ---------------------------------------------------------------------------------------------- */

/* Over a chunk of L steps from state S0 ([hdim, N] per head), with a_s = dt_s A and cs_t = a_0 + .. + a_t,
 * the recurrence S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t unrolls to
 *   y_t = sum_{s<=t} exp(cs_t - cs_s) (C_t . B_s) dt_s x_s + exp(cs_t) S0 C_t + D x_t
 *   S_L = exp(cs_{L-1}) S0 + sum_s exp(cs_{L-1} - cs_s) dt_s x_s B_s^T
 * four matrix products a chunk (M = (C B^T) masked and decayed, M (dt x), (e^cs C) S0^T, (w x)^T B),
 * done on the tensor cores in TF32 (fp32 operands rounded to 10 mantissa bits, fp32 accumulators);
 * the state stays fp32 in shared memory, and the chunks follow each other in fp32. Block (head h,
 * SSD_ROWS channels of it), its warps each taking 16x8 output tiles of a product in turn; chunk
 * inputs past the last step are zeros (dt = 0 too, so they neither decay nor add). A chunk's inputs
 * come by cp.async, all of them in flight at once: loaded batch by batch, their round trips took most
 * of the scan's time (the math of a chunk is ~2 MFLOP a block). Fragments of C, B, M and the state
 * come by ldmatrix (a 16-byte row: 4 fp32), one instruction for what took four loads. The state is read
 * at the start and written back at the end: the next prompt chunk, or the decode's step-by-step scan,
 * continues from it. L = 64 keeps the chunk's B, C, M and the state within shared memory up to
 * N = 256. 32 channels a block, not a head's 64: two blocks an SM (at N = 128) hide more of every
 * product's latency, and a head's blocks each redo only C B^T. Where the blocks are no more than the
 * SMs, one an SM, 16 warps a block instead of 8 hide it. */
enum { SSD_L = 64, SSD_ROWS = 32 };

/* x rounded to TF32, to nearest with ties away from zero (cvt.rna's rounding): half a TF32 unit added
 * to the magnitude's bits, the 13 below TF32's mantissa then ignored by the tensor cores. An integer add,
 * where the scan's ~6 conversions a product made cvt the bottleneck. */
__device__ __forceinline__ uint32_t tf32(float x) { return __float_as_uint(x) + 0x1000u; }
template <int n> __device__ __forceinline__ void tf32(uint32_t (&r)[n]) {
#pragma unroll
    for (int i = 0; i < n; i++) r[i] += 0x1000u;
}

/* d[16x8] += a[16x8] b[8x8], TF32 operands, fp32 accumulators */
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* acc[0] + acc[1] += A B^T over k < N for a 16 x 8 tile: A's 16 and B's 8 rows in shared memory, N
 * long (16-byte aligned), read by ldmatrix and rounded to TF32; a and b this lane's row addresses (an
 * A fragment's, see arow; B's row lane % 8 at column 4 (lane / 8)). Even and odd steps of 8 go to
 * the two chains of products, to halve the wait. */
template <int N> __device__ __forceinline__ void ssd_rows_dot(float (&acc)[2][4], const float *a, const float *b) {
#pragma unroll 2
    for (int k = 0; k < N; k += 16) {
        uint32_t af[4], bf[4];
        ldsm_x4<false>(af, a + k);
        tf32(af);
        if constexpr (N > 8) {   /* B's fragments of both steps in one load */
            ldsm_x4<false>(bf, b + k);
            tf32(bf);
            mma_tf32(acc[0], af, bf[0], bf[1]);
            ldsm_x4<false>(af, a + k + 8);
            tf32(af);
            mma_tf32(acc[1], af, bf[2], bf[3]);
        } else {
            uint32_t b2[2];
            ldsm_x2(b2, b + k);
            tf32(b2);
            mma_tf32(acc[0], af, b2[0], b2[1]);
        }
    }
}

/* Shared memory of ssd_scan_kernel<N>, in floats: X [L][SSD_ROWS + 8], B and C [L][N + 4], M [L][L + 4],
 * S [SSD_ROWS][N + 4], dt, cs and w [L] (the pads spread a fragment's rows over the banks). */
static constexpr int ssd_smem_floats(int N) {
    return SSD_L * (SSD_ROWS + 8) + 2 * SSD_L * (N + 4) + SSD_L * (SSD_L + 4) + SSD_ROWS * (N + 4) + 3 * SSD_L;
}

template <int N>
__global__ void __launch_bounds__(512, 1) ssd_scan_kernel(const __grid_constant__ ScanArgs sa) {
    float *y = sa.y, *ssm = sa.ssm;
    const float *xbc = sa.xbc, *proj = sa.proj;
    int ld_proj = sa.ld_proj, dt_off = sa.dt_off, T = sa.T, heads = sa.heads, hdim = sa.hdim, groups = sa.groups, d_inner = sa.d_inner;
    constexpr int L = SSD_L, PB = SSD_ROWS, LX = PB + 8, LB = N + 4, LM = L + 4;
    static_assert(L == 64, "the decay scan takes two steps a lane");
    extern __shared__ float4 ssd_sm4[];
    float *Xs = (float *)ssd_sm4, *Bs = Xs + L * LX, *Cs = Bs + L * LB, *Ms = Cs + L * LB, *Ss = Ms + L * LM;
    float *dts = Ss + PB * LB, *cs = dts + L, *ws = cs + L;   /* dt_s; cs_s; w_s = exp(cs_{L-1} - cs_s) dt_s */
    int h = blockIdx.x, p0 = blockIdx.y * PB, g = h / (heads / groups), cv = d_inner + 2 * groups * N;
    int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, c = lane & 3;
    int arow = (lane & 7) + 8 * (lane >> 3 & 1), acol = 4 * (lane >> 4);   /* this lane's row address of an A fragment (ldsm_x4) */
    float a = sa.A[h], d = sa.D[h], bias = sa.dt_bias[h];
    pdl_wait();
    for (int i = threadIdx.x; i < PB * N; i += blockDim.x) {
        int p = i / N, n = i % N;
        Ss[p * LB + n] = p0 + p < hdim ? ssm[((size_t)h * hdim + p0 + p) * N + n] : 0.0f;
    }
    for (int t0 = 0; t0 < T; t0 += L) {
        int len = min(L, T - t0);
        __syncthreads();   /* the previous chunk is done with X, B, C, M, dt, cs, w; its state is written */
        for (int i = threadIdx.x; i < L * PB; i += blockDim.x) {
            int t = i / PB, p = i % PB;
            if (t < len && p0 + p < hdim) cp_async4(&Xs[t * LX + p], xbc + (size_t)(t0 + t) * cv + h * hdim + p0 + p);
            else Xs[t * LX + p] = 0.0f;
        }
        const float *bc = xbc + (size_t)t0 * cv + d_inner + g * N;   /* B of step t0; its C is groups * N on */
        if (d_inner % 4 == 0)   /* rows start 16-byte aligned: four floats a copy */
            for (int i = threadIdx.x; i < L * N / 4; i += blockDim.x) {
                int t = i / (N / 4), n = i % (N / 4) * 4, in = t < len ? 16 : 0;
                cp_async16z(&Bs[t * LB + n], in ? bc + (size_t)t * cv + n : xbc, in);
                cp_async16z(&Cs[t * LB + n], in ? bc + (size_t)t * cv + n + groups * N : xbc, in);
            }
        else
            for (int i = threadIdx.x; i < L * N; i += blockDim.x) {
                int t = i / N, n = i % N;
                if (t < len) {
                    cp_async4(&Bs[t * LB + n], bc + (size_t)t * cv + n);
                    cp_async4(&Cs[t * LB + n], bc + (size_t)t * cv + n + groups * N);
                } else Bs[t * LB + n] = Cs[t * LB + n] = 0.0f;
            }
        cp_async_commit();
        if (warp == 0) {   /* dt = softplus(raw + bias), then cs: an inclusive scan over the lanes' pairs of steps */
            float dt[2], la[2];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                int t = 2 * lane + k;
                float raw = t < len ? proj[(size_t)(t0 + t) * ld_proj + dt_off + h] + bias : 0.0f;
                dt[k] = t < len ? softplus(raw) : 0.0f;
                la[k] = dt[k] * a;
            }
            float run = la[0] + la[1];
            for (int o = 1; o < 32; o <<= 1) {
                float v = __shfl_up_sync(0xffffffffu, run, o);
                if (lane >= o) run += v;
            }
            float c0 = run - la[1], last = __shfl_sync(0xffffffffu, run, 31);
            cs[2 * lane] = c0;
            cs[2 * lane + 1] = run;
            dts[2 * lane] = dt[0];
            dts[2 * lane + 1] = dt[1];
            ws[2 * lane] = __expf(last - c0) * dt[0];
            ws[2 * lane + 1] = __expf(last - run) * dt[1];
        }
        cp_async_wait<0>();
        __syncthreads();
        /* M[t][s] = (C_t . B_s) exp(cs_t - cs_s) for s <= t, else 0: the 16x8 tiles on or below the diagonal,
           (rt + 1) * 2 of them in row tile rt, numbered row by row and dealt round the warps */
        for (int tile = warp; tile < (L / 16) * (L / 16 + 1); tile += nw) {
            int rt = 0;
            while ((rt + 1) * (rt + 2) <= tile) rt++;
            int nt = tile - rt * (rt + 1);
            float acc[2][4] = {};
            const float *ca = Cs + (rt * 16 + arow) * LB + acol, *bb = Bs + (nt * 8 + (lane & 7)) * LB + 4 * (lane >> 3);
            ssd_rows_dot<N>(acc, ca, bb);
#pragma unroll
            for (int e = 0; e < 4; e++) {   /* stored as TF32 values: the next products read them as they are */
                int t = rt * 16 + gr + (e >> 1) * 8, s = nt * 8 + 2 * c + (e & 1);
                Ms[t * LM + s] = s <= t ? __uint_as_float(tf32((acc[0][e] + acc[1][e]) * __expf(cs[t] - cs[s])) & 0xFFFFE000u) : 0.0f;
            }
        }
        __syncthreads();
        /* y_t = M[t] (dt x) + (e^cs_t C_t) S0^T + D x_t: 16x8 tiles of [steps, channels] */
        for (int tile = warp; tile < (L / 16) * (PB / 8); tile += nw) {
            int rt = tile / (PB / 8), nt = tile % (PB / 8), t = rt * 16 + gr, p = nt * 8 + gr;
            /* (e^cs_t C_t) S0^T as e^cs_t (C_t S0^T): C's rows as stored, the row's factor on the result */
            float acc[2][4] = {}, sc[2][4] = {}, e0 = __expf(cs[t]), e1 = __expf(cs[t + 8]);
            const float *ma = Ms + (rt * 16 + arow) * LM + acol, *ca = Cs + (rt * 16 + arow) * LB + acol;
            const float *sb = Ss + (nt * 8 + (lane & 7)) * LB + 4 * (lane >> 3);
            auto step_m = [&](float (&d)[4], int k) {   /* M is TF32 already */
                uint32_t af[4];
                ldsm_x4<false>(af, ma + k);
                mma_tf32(d, af, tf32(Xs[(k + c) * LX + p] * dts[k + c]), tf32(Xs[(k + c + 4) * LX + p] * dts[k + c + 4]));
            };
            for (int k = 0; k < rt * 16 + 16; k += 16) {   /* steps s <= the tile's last t */
                step_m(acc[0], k);
                step_m(acc[1], k + 8);
            }
            ssd_rows_dot<N>(sc, ca, sb);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int tt = rt * 16 + gr + (e >> 1) * 8, pp = nt * 8 + 2 * c + (e & 1);
                if (tt < len && p0 + pp < hdim)
                    y[(size_t)(t0 + tt) * d_inner + h * hdim + p0 + pp] =
                        acc[0][e] + acc[1][e] + (sc[0][e] + sc[1][e]) * (e < 2 ? e0 : e1) + d * Xs[tt * LX + pp];
            }
        }
        __syncthreads();   /* every read of S0 is done */
        /* S = exp(cs_{L-1}) S0 + (w x)^T B: 16x8 tiles of [channels, N], each warp's own */
        float el = __expf(cs[L - 1]);
        for (int tile = warp; tile < (PB / 16) * (N / 8); tile += nw) {
            int pt = tile / (N / 8), nt = tile % (N / 8), p = pt * 16 + gr, n = nt * 8 + 2 * c;
            float *s0 = Ss + p * LB + n, *s1 = s0 + 8 * LB;
            float acc[2][4] = {{s0[0] * el, s0[1] * el, s1[0] * el, s1[1] * el}, {}};
            auto step = [&](float (&d)[4], int k) {
                float w0 = ws[k + c], w1 = ws[k + c + 4];
                const float *x0 = Xs + (k + c) * LX + p, *x1 = Xs + (k + c + 4) * LX + p;
                uint32_t af[4] = {tf32(x0[0] * w0), tf32(x0[8] * w0), tf32(x1[0] * w1), tf32(x1[8] * w1)};
                mma_tf32(d, af, tf32(Bs[(k + c) * LB + nt * 8 + gr]), tf32(Bs[(k + c + 4) * LB + nt * 8 + gr]));
            };
#pragma unroll
            for (int k = 0; k < L; k += 16) {
                step(acc[0], k);
                step(acc[1], k + 8);
            }
            s0[0] = acc[0][0] + acc[1][0]; s0[1] = acc[0][1] + acc[1][1]; s1[0] = acc[0][2] + acc[1][2]; s1[1] = acc[0][3] + acc[1][3];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < PB * N; i += blockDim.x) {
        int p = i / N, n = i % N;
        if (p0 + p < hdim) ssm[((size_t)h * hdim + p0 + p) * N + n] = Ss[p * LB + n];
    }
}

/* Launches the SSD scan of a (state size N). */
static void ssd_scan(cudaStream_t stream, const ScanArgs &a, int N) {
    auto k = N == 8 ? ssd_scan_kernel<8> : N == 16 ? ssd_scan_kernel<16> : N == 32 ? ssd_scan_kernel<32>
           : N == 64 ? ssd_scan_kernel<64> : N == 128 ? ssd_scan_kernel<128> : ssd_scan_kernel<256>;
    size_t smem = ssd_smem_floats(N) * sizeof(float);
    int gpu, sms, blocks = a.heads * cdiv(a.hdim, SSD_ROWS);
    CUDA_CHECK(cudaGetDevice(&gpu));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, gpu));
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    LAUNCH(dim3(a.heads, cdiv(a.hdim, SSD_ROWS)), blocks <= sms ? 512 : 256, smem, stream, k, a);
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: attention (no positional encoding, causal, GQA): the cache, decode from an fp32 cache
 * ---------------------------------------------------------------------------------------------- */

/* A cache element from fp32: KT is float or bf16 (round to nearest even). */
template <typename KT> __device__ __forceinline__ KT to_kt(float v) { return (KT)v; }
template <> __device__ __forceinline__ bf16 to_kt<bf16>(float v) { return __float2bfloat16(v); }

/* cache[pos + t] = k[t], v[t], in the cache's dtype KT */
template <typename KT>
__global__ void kv_append_kernel(KT *kc, KT *vc, const float *qkv, int ld, int qw, int kw, const int *pos) {
    pdl_wait();
    int t = blockIdx.x;
    size_t dst = (size_t)(*pos + t) * kw;
    for (int i = threadIdx.x; i < kw; i += blockDim.x) {
        kc[dst + i] = to_kt<KT>(qkv[(size_t)t * ld + qw + i]);
        vc[dst + i] = to_kt<KT>(qkv[(size_t)t * ld + qw + kw + i]);
    }
}

/* Decode attention splits the keys 0..pos of each head over a fixed grid of `splits` blocks (fixed so
 * the captured step serves every position): split s takes the keys from s * len, len =
 * ceil((pos + 1) / splits), so all blocks share the work at any length and none walks a long chain
 * of dependent loads. At most ATTN_SPLITS, about one wave of blocks for 32 heads; fewer for short
 * contexts, at least ATTN_MIN_KEYS keys a split at full context. A lane holds NC = ceil(head_dim / 32)
 * elements of a row (dimension lane + 32 c). */
enum { ATTN_SPLITS = 32, ATTN_MIN_KEYS = 64 };
static int attn_splits(int ctx) { return std::min((int)ATTN_SPLITS, cdiv(ctx, ATTN_MIN_KEYS)); }
__device__ __forceinline__ int attn_len(int n, int splits) { return (n + splits - 1) / splits; }

template <typename KT> struct AttnArgs {
    float *part;                /* [T, q heads, splits, head_dim + 2] each split's (max, sum, weighted v) */
    const float *q;             /* [T, ldq] this rank's queries, q heads * head_dim a token */
    int ldq;                    /* floats between two tokens' queries */
    const KT *kc, *vc;          /* [ctx, kw] the caches, in the cache's dtype */
    const int *pos;             /* [1] the first query's position: token t's sees keys 0..pos + t */
    int kw, hd;                 /* cache row (kv heads * head_dim), head_dim */
    int group, q0, kv0;         /* query heads a kv head; this rank's first global query and kv head */
    float scale;                /* 1 / sqrt(head_dim) */
    int splits;                 /* splits a head (attn_splits) */
    const void *warm;           /* decode-only: o_proj, warmed in L2 (l2_warm) */
    size_t warm_n;              /* bytes of it to warm */
};

/* Decode: block (head, split, t) of a grid whose z is the tokens, the whole block's index. */
__device__ __forceinline__ size_t block_index() { return ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x; }

/* One query (decode; token t = blockIdx.z of a few) against keys 0..pos + t: block (head, split, t)
 * keeps an online softmax over its keys
 *   m = max_j s_j,  l = sum_j e^(s_j - m),  acc = sum_j e^(s_j - m) v_j,  s_j = scale q . k_j
 * and writes (m, l, acc) for combine; a split past the last key writes (-inf, 0, 0). A warp takes
 * four keys at a time and issues all their K and V loads before any math. Token t's block does what a
 * one-token step at position pos + t does. */
template <int NC>
__global__ void __launch_bounds__(128) attn_decode_kernel(const __grid_constant__ AttnArgs<float> a) {
    l2_warm(a.warm, a.warm_n, block_index(), (size_t)gridDim.x * gridDim.y * gridDim.z);
    pdl_wait();
    const float *kc = a.kc, *vc = a.vc;
    int kw = a.kw, hd = a.hd, splits = a.splits, t = blockIdx.z;
    float scale = a.scale;
    int h = blockIdx.x, s = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int n = *a.pos + t + 1, len = attn_len(n, splits), j0 = s * len, j1 = min(n, j0 + len);
    float *out = a.part + (((size_t)t * gridDim.x + h) * splits + s) * (hd + 2);
    const float *qh = a.q + (size_t)t * a.ldq + h * hd;
    int kvh = (a.q0 + h) / a.group - a.kv0;
    float m = -INFINITY, l = 0, acc[NC] = {0}, qv[NC];
#pragma unroll
    for (int c = 0; c < NC; c++) qv[c] = lane + 32 * c < hd ? qh[lane + 32 * c] : 0.0f;
    for (int j = j0 + 4 * warp; j < j1; j += 16) {        /* keys j .. j + 3 */
        float kv[4][NC], vv[4][NC], sc[4], e[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float *k = kc + (size_t)(j + u) * kw + kvh * hd, *v = vc + (size_t)(j + u) * kw + kvh * hd;
#pragma unroll
            for (int c = 0; c < NC; c++) {
                bool in = j + u < j1 && lane + 32 * c < hd;
                kv[u][c] = in ? k[lane + 32 * c] : 0.0f;
                vv[u][c] = in ? v[lane + 32 * c] : 0.0f;
            }
        }
        float mn = m;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float d = 0;
#pragma unroll
            for (int c = 0; c < NC; c++) d += qv[c] * kv[u][c];
            sc[u] = j + u < j1 ? warp_sum(d) * scale : -INFINITY;
            mn = fmaxf(mn, sc[u]);
        }
        float f = __expf(m - mn);
        l *= f;
#pragma unroll
        for (int u = 0; u < 4; u++) { e[u] = __expf(sc[u] - mn); l += e[u]; }
#pragma unroll
        for (int c = 0; c < NC; c++) acc[c] = acc[c] * f + e[0] * vv[0][c] + e[1] * vv[1][c] + e[2] * vv[2][c] + e[3] * vv[3][c];
        m = mn;
    }
    __shared__ float sm[4], sl[4], sacc[4][256];
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
    for (int c = 0; c < NC; c++) if (lane + 32 * c < hd) sacc[warp][lane + 32 * c] = acc[c];
    __syncthreads();
    float M = fmaxf(fmaxf(sm[0], sm[1]), fmaxf(sm[2], sm[3]));
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0;
        for (int w = 0; w < 4; w++) if (sm[w] > -INFINITY) a += sacc[w][i] * __expf(sm[w] - M);
        out[2 + i] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0;
        for (int w = 0; w < 4; w++) if (sm[w] > -INFINITY) L += sl[w] * __expf(sm[w] - M);
        out[0] = M;
        out[1] = L;
    }
}

/* Launches attn_decode_kernel for n_q query heads of T tokens (see there); a bf16 cache has its own
 * kernel below. */
static void attn_decode(cudaStream_t stream, const AttnArgs<float> &a, int n_q, int T) {
    int hd = a.hd;
    auto k = hd <= 32 ? attn_decode_kernel<1> : hd <= 64 ? attn_decode_kernel<2> : hd <= 128 ? attn_decode_kernel<4>
                                                                               : attn_decode_kernel<8>;
    LAUNCH(dim3(n_q, a.splits, T), 128, 0, stream, k, a);
}

/* y[t][h] = sum over splits of e^(m_s - M) acc_s / sum over splits of e^(m_s - M) l_s (splits with
 * keys), block (h, t). Warp 0 turns the splits' (m_s, l_s), a lane each, into weights e^(m_s - M) / L;
 * then each element adds its splits' terms with all their loads in flight. */
static_assert(ATTN_SPLITS <= 32, "attn_combine_kernel: a lane per split");
__global__ void __launch_bounds__(128) attn_combine_kernel(float *y, const float *part, const int *pos, int hd, int splits) {
    pdl_wait();
    __shared__ float wt[ATTN_SPLITS];
    int h = blockIdx.x, t = blockIdx.y, n = *pos + t + 1, len = attn_len(n, splits), used = (n + len - 1) / len;
    const float *p = part + ((size_t)t * gridDim.x + h) * splits * (hd + 2);
    y += (size_t)t * gridDim.x * hd;
    if (threadIdx.x < 32) {
        int s = threadIdx.x;
        float ms = s < used ? p[s * (hd + 2)] : -INFINITY, ls = s < used ? p[s * (hd + 2) + 1] : 0.0f;
        float w = __expf(ms - warp_max(ms));
        float L = warp_sum(ls * w);
        if (s < ATTN_SPLITS) wt[s] = w / L;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0;
#pragma unroll
        for (int s = 0; s < ATTN_SPLITS; s++) if (s < used) a += wt[s] * p[s * (hd + 2) + 2 + i];
        y[h * hd + i] = a;
    }
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: attention on the tensor cores: a prompt (flash attention, no score matrix in memory), and
 * one query from a bf16 cache
 * ---------------------------------------------------------------------------------------------- */

/* A prompt chunk of T tokens at positions pos .. pos+T-1 attends to the cache's keys 0 .. pos+t (its own
 * keys appended first). A block takes FA_ROWS query rows of one kv head: row r is token r / gl, local
 * query head kvh * gl + r % gl, so the gl heads of a GQA group share every K and V tile the block loads.
 * It walks the keys FA_KEYS at a time: S = Q K^T and O += P V as mma.sync m16n8k16 (bf16 operands, fp32
 * accumulators), with an online softmax in fp32 between them (scores scaled by log2(e) / sqrt(head_dim),
 * so exp2 serves). A warp owns 16 rows; its S tile never leaves registers: its accumulators are, in
 * the same lane order, the A operand of P V. Head dimensions are zero-padded to HD (a multiple of 16);
 * keys past the last one are zero rows, and a key after a row's own position is masked (-inf) only in
 * the tiles that cross the block's first position. Blocks of the last rows (the most keys) start first.
 * K and V tiles come in two stages (cp.async: the next tile loads while this one is used). 128 rows a
 * block, not 64: each K and V tile read from L2 serves twice the queries (2048 queries against 32k
 * keys: 255 TFLOP/s, 83 at 64 rows with one stage; bench/RESULTS.md). FA_THREADS: the decode
 * kernel's block. */
enum { FA_ROWS = 128, FA_KEYS = 64, FA_PTHREADS = FA_ROWS * 2, FA_THREADS = 128 };

template <typename KT> struct PromptAttnArgs {
    float *y;                   /* [T, ldy] output, heads side by side */
    const float *q;             /* [T, ldq] queries, heads side by side */
    const KT *kc, *vc;          /* [ctx, kw] the caches, the chunk's keys already appended */
    int ldy, ldq, kw, hd;       /* row strides, cache row (kv heads * head_dim), head_dim */
    int gl, T, pos;             /* query heads a kv head; the chunk's tokens and first position */
    float scale;                /* 1 / sqrt(head_dim) */
};

/* Eight elements src[0 .. 7] as bf16, those at n and beyond zero; vec: all eight present and src
 * 16-byte aligned, one or two vector loads. */
__device__ __forceinline__ uint4 load8_bf16(const float *src, int n, bool vec) {
    float f[8];
    if (vec) {
        float4 a = *(const float4 *)src, b = *(const float4 *)(src + 4);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
        for (int i = 0; i < 8; i++) f[i] = i < n ? src[i] : 0.0f;
    }
    return make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
}
__device__ __forceinline__ uint4 load8_bf16(const bf16 *src, int n, bool vec) {
    if (vec) return *(const uint4 *)src;
    uint16_t h[8];
    for (int i = 0; i < 8; i++) h[i] = i < n ? __bfloat16_as_ushort(src[i]) : 0;
    return make_uint4(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16, h[4] | (uint32_t)h[5] << 16, h[6] | (uint32_t)h[7] << 16);
}

/* y[t][h] = sum_j softmax_j(q[t][h] . k_j / sqrt(hd)) v_j over keys j <= pos + t (see above), from a
 * bf16 cache. Shared memory: a Q tile, then two stages of K and V tiles, rows of HD + 8 bf16 (the
 * 16-byte pad puts the 8 rows an ldmatrix reads in different banks). */
template <int HD>
__global__ void __launch_bounds__(FA_PTHREADS, HD <= 128 ? 2 : 1) flash_attn_kernel(const __grid_constant__ PromptAttnArgs<bf16> a) {
    constexpr int LDS = HD + 8, NT = FA_KEYS / 8, DT = HD / 8, STAGE = 2 * FA_KEYS * LDS;
    const bf16 *kc = a.kc, *vc = a.vc;
    int kw = a.kw, hd = a.hd, gl = a.gl, T = a.T, pos = a.pos;
    float scale_log2 = a.scale * 1.4426950408889634f;
    extern __shared__ uint4 fa_sm[];
    bf16 *Qs = (bf16 *)fa_sm, *tiles = Qs + FA_ROWS * LDS;   /* stage st: K rows at tiles + st STAGE, then V rows */
    int kvh = blockIdx.y, r0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    int t_first = r0 / gl, t_last = min(T - 1, (r0 + FA_ROWS - 1) / gl), n_keys = pos + t_last + 1;
    bool vec = hd % 8 == 0;   /* rows of whole 16-byte pieces (and 32-byte ones of fp32): vector loads */
    pdl_wait();
    static_assert(FA_ROWS * DT % FA_PTHREADS == 0 && FA_KEYS * DT % FA_PTHREADS == 0, "tile loads: whole rounds of the block");
#pragma unroll
    for (int k = 0; k < FA_ROWS * DT / FA_PTHREADS; k++) {   /* Q rows; past the last token, zeros */
        int i = threadIdx.x + k * FA_PTHREADS, r = i / DT, d = i % DT * 8, t = (r0 + r) / gl, h = kvh * gl + (r0 + r) % gl;
        uint4 v = t < T ? load8_bf16(a.q + (size_t)t * a.ldq + h * hd + d, hd - d, vec && d < hd) : make_uint4(0, 0, 0, 0);
        *(uint4 *)&Qs[r * LDS + d] = v;
    }
    int ra = r0 + warp * 16 + g, rb = ra + 8;                         /* this lane's two rows */
    int qa = pos + min(ra / gl, T - 1), qb = pos + min(rb / gl, T - 1);   /* their positions (past T: the last) */
    float o[DT][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};
    auto stage = [&](int st, int j0) {   /* keys j0 .. j0 + FA_KEYS - 1 into stage st; rows of 16-byte pieces by cp.async */
        bf16 *Ks = tiles + st * STAGE, *Vs = Ks + FA_KEYS * LDS;
#pragma unroll
        for (int k = 0; k < FA_KEYS * DT / FA_PTHREADS; k++) {
            int i = threadIdx.x + k * FA_PTHREADS, r = i / DT, d = i % DT * 8, j = j0 + r;
            size_t at = (size_t)j * kw + kvh * hd + d;
            bool in = j < n_keys && d < hd;
            if (vec) {
                cp_async16z(&Ks[r * LDS + d], in ? kc + at : kc, in ? 16 : 0);
                cp_async16z(&Vs[r * LDS + d], in ? vc + at : vc, in ? 16 : 0);
            } else {
                *(uint4 *)&Ks[r * LDS + d] = in ? load8_bf16(kc + at, hd - d, false) : make_uint4(0, 0, 0, 0);
                *(uint4 *)&Vs[r * LDS + d] = in ? load8_bf16(vc + at, hd - d, false) : make_uint4(0, 0, 0, 0);
            }
        }
    };
    stage(0, 0);
    cp_async_commit();
    for (int j0 = 0, st = 0; j0 < n_keys; j0 += FA_KEYS, st ^= 1) {
        if (j0 + FA_KEYS < n_keys) stage(st ^ 1, j0 + FA_KEYS);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();   /* this tile has landed for every thread */
        const bf16 *Ks = tiles + st * STAGE, *Vs = Ks + FA_KEYS * LDS;
        /* S = Q K^T for this warp's 16 rows and the tile's keys */
        float s[NT][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < HD; k0 += 16) {
            uint32_t qa[4];
            ldsm_x4<false>(qa, &Qs[(warp * 16 + (lane & 15)) * LDS + k0 + (lane >> 4) * 8]);
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                uint32_t b[4];
                ldsm_x4<false>(b, &Ks[(n * 8 + (lane >> 4) * 8 + (lane & 7)) * LDS + k0 + (lane >> 3 & 1) * 8]);
                mma_bf16(s[n], qa, b[0], b[1]);
                mma_bf16(s[n + 1], qa, b[2], b[3]);
            }
        }
        /* online softmax: m = running max (log2 units), l = running sum of this lane's terms */
        bool full = j0 + FA_KEYS - 1 <= pos + t_first;   /* every row of the block sees every key of the tile */
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int j = j0 + n * 8 + 2 * c + (e & 1);
                float v = s[n][e] * scale_log2;
                if (!full && j > (e < 2 ? qa : qb)) v = -INFINITY;
                s[n][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        float f[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {   /* a row's four lanes agree on its max; key 0 is in every row's first tile */
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            f[i] = exp2f(m[i] - mx[i]);
            m[i] = mx[i];
            l[i] *= f[i];
        }
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[n][e] = exp2f(s[n][e] - m[e >> 1]);
                l[e >> 1] += s[n][e];
            }
#pragma unroll
        for (int d = 0; d < DT; d++) { o[d][0] *= f[0]; o[d][1] *= f[0]; o[d][2] *= f[1]; o[d][3] *= f[1]; }
        /* O += P V: S tiles 2kk, 2kk+1 are the A operand of keys 16kk .. 16kk+15 */
#pragma unroll
        for (int kk = 0; kk < FA_KEYS / 16; kk++) {
            uint32_t pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int d = 0; d < DT; d += 2) {
                uint32_t b[4];
                ldsm_x4<true>(b, &Vs[(kk * 16 + (lane >> 3 & 1) * 8 + (lane & 7)) * LDS + d * 8 + (lane >> 4) * 8]);
                mma_bf16(o[d], pa, b[0], b[1]);
                mma_bf16(o[d + 1], pa, b[2], b[3]);
            }
        }
        __syncthreads();   /* every warp is done with this stage before it is refilled */
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {   /* the row's sum over its four lanes */
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = i ? rb : ra, t = r / gl, h = kvh * gl + r % gl;
        if (t >= T) continue;
        float *out = a.y + (size_t)t * a.ldy + h * hd, inv = 1.0f / l[i];
#pragma unroll
        for (int d = 0; d < DT; d++) {
            int col = d * 8 + 2 * c;
            if (col < hd) out[col] = o[d][2 * i] * inv;
            if (col + 1 < hd) out[col + 1] = o[d][2 * i + 1] * inv;
        }
    }
}

/* One query (decode; token t = blockIdx.z of a few) from a bf16 cache, on the tensor cores: block (kv
 * head k, tile of up to 16 of its query heads, split s, t) writes each head's split partial (m, l,
 * acc) as attn_decode_kernel does, for
 * attn_combine_kernel. The heads are the 16 rows of mma.sync m16n8k16 tiles, so a GQA group reads each
 * K and V row once. The block stages FA_KEYS keys at a time in shared memory (cp.async, two stages: the
 * next tile loads while this one is used); warp w takes keys 16w .. 16w + 15 of a tile with its own
 * online softmax (log2 units), and the four warps' (m, l, acc) merge at the end. Keys past the split's
 * last are zero rows, masked. */
template <int HD>
__global__ void __launch_bounds__(FA_THREADS) attn_decode_bf16_kernel(const __grid_constant__ AttnArgs<bf16> a, int qpk) {
    constexpr int LDS = HD + 8, DT = HD / 8, STAGE = 2 * FA_KEYS * LDS;
    extern __shared__ uint4 fa_sm[];
    __shared__ __align__(16) bf16 Qs[16 * LDS];
    bf16 *tiles = (bf16 *)fa_sm;   /* stage st: K rows at tiles + st * STAGE, V rows FA_KEYS * LDS after */
    l2_warm(a.warm, a.warm_n, block_index(), (size_t)gridDim.x * gridDim.y * gridDim.z);
    int qt = (qpk + 15) / 16, kvh = blockIdx.x / qt, r_first = blockIdx.x % qt * 16, nh = min(16, qpk - r_first);
    int h0 = kvh * qpk + r_first, s = blockIdx.y, splits = a.splits, hd = a.hd, kw = a.kw, t = blockIdx.z;
    const float *q = a.q + (size_t)t * a.ldq;
    float *part = a.part + (size_t)t * (gridDim.x / qt * qpk) * splits * (hd + 2);   /* token t's: all its heads' */
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    bool vec = hd % 8 == 0;   /* rows of whole 16-byte pieces: cp.async */
    pdl_wait();
    int n = *a.pos + t + 1, len = attn_len(n, splits), j0 = s * len, j1 = min(n, j0 + len);
    for (int i = threadIdx.x; i < 16 * DT; i += FA_THREADS) {   /* Q rows as bf16; rows past the tile's heads, zeros */
        int r = i / DT, d = i % DT * 8;
        *(uint4 *)&Qs[r * LDS + d] = r < nh ? load8_bf16(q + (size_t)(h0 + r) * hd + d, hd - d, vec && d < hd) : make_uint4(0, 0, 0, 0);
    }
    auto stage = [&](int st, int jt) {   /* keys jt .. jt + FA_KEYS - 1 into stage st */
        bf16 *Ks = tiles + st * STAGE, *Vs = Ks + FA_KEYS * LDS;
        for (int i = threadIdx.x; i < FA_KEYS * DT; i += FA_THREADS) {
            int r = i / DT, d = i % DT * 8, j = jt + r;
            size_t at = (size_t)j * kw + kvh * hd + d;
            if (j < j1 && vec && d < hd) {
                cp_async16(&Ks[r * LDS + d], a.kc + at);
                cp_async16(&Vs[r * LDS + d], a.vc + at);
            } else {
                *(uint4 *)&Ks[r * LDS + d] = j < j1 ? load8_bf16(a.kc + at, hd - d, false) : make_uint4(0, 0, 0, 0);
                *(uint4 *)&Vs[r * LDS + d] = j < j1 ? load8_bf16(a.vc + at, hd - d, false) : make_uint4(0, 0, 0, 0);
            }
        }
        cp_async_commit();
    };
    float o[DT][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0}, scale_log2 = a.scale * 1.4426950408889634f;
    if (j0 < j1) stage(0, j0);
    for (int jt = j0, st = 0; jt < j1; jt += FA_KEYS, st ^= 1) {
        if (jt + FA_KEYS < j1) {
            stage(st ^ 1, jt + FA_KEYS);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16 *Ks = tiles + st * STAGE, *Vs = Ks + FA_KEYS * LDS;
        /* S = Q K^T: the 16 heads against this warp's 16 keys */
        float sc[2][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < HD; k0 += 16) {
            uint32_t qa[4], b[4];
            ldsm_x4<false>(qa, &Qs[(lane & 15) * LDS + k0 + (lane >> 4) * 8]);
            ldsm_x4<false>(b, &Ks[(warp * 16 + (lane >> 4) * 8 + (lane & 7)) * LDS + k0 + (lane >> 3 & 1) * 8]);
            mma_bf16(sc[0], qa, b[0], b[1]);
            mma_bf16(sc[1], qa, b[2], b[3]);
        }
        /* online softmax; a warp whose keys are all past the split's end keeps (m, l, o) as they are */
        float mx[2] = {m[0], m[1]}, f[2];
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v = jt + warp * 16 + t * 8 + 2 * c + (e & 1) < j1 ? sc[t][e] * scale_log2 : -INFINITY;
                sc[t][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            float ref = mx[i] == -INFINITY ? 0.0f : mx[i];
            f[i] = exp2f(m[i] - ref);
            m[i] = mx[i];
            mx[i] = ref;
            l[i] *= f[i];
        }
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                sc[t][e] = exp2f(sc[t][e] - mx[e >> 1]);
                l[e >> 1] += sc[t][e];
            }
        /* O = O f + P V over the warp's 16 keys: its S accumulators are the A operand */
        uint32_t pa[4] = {pack_bf16(sc[0][0], sc[0][1]), pack_bf16(sc[0][2], sc[0][3]), pack_bf16(sc[1][0], sc[1][1]),
                          pack_bf16(sc[1][2], sc[1][3])};
#pragma unroll
        for (int d = 0; d < DT; d += 2) {
            uint32_t b[4];
            ldsm_x4<true>(b, &Vs[(warp * 16 + (lane >> 3 & 1) * 8 + (lane & 7)) * LDS + d * 8 + (lane >> 4) * 8]);
#pragma unroll
            for (int u = 0; u < 2; u++) {
                o[d + u][0] *= f[0]; o[d + u][1] *= f[0]; o[d + u][2] *= f[1]; o[d + u][3] *= f[1];
            }
            mma_bf16(o[d], pa, b[0], b[1]);
            mma_bf16(o[d + 1], pa, b[2], b[3]);
        }
        __syncthreads();   /* every warp is done with this stage before the next iteration refills it */
    }
    /* merge the warps: M = max_w m_w; L = sum_w l_w 2^(m_w - M); acc = sum_w o_w 2^(m_w - M) */
    float *wm = (float *)fa_sm, *wl = wm + 64, *wo = wl + 64;   /* [4][16], [4][16], [4][16][HD] */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (c == 0) { wm[warp * 16 + g + 8 * i] = m[i]; wl[warp * 16 + g + 8 * i] = l[i]; }
#pragma unroll
        for (int d = 0; d < DT; d++) {
            wo[(warp * 16 + g + 8 * i) * HD + d * 8 + 2 * c] = o[d][2 * i];
            wo[(warp * 16 + g + 8 * i) * HD + d * 8 + 2 * c + 1] = o[d][2 * i + 1];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * (hd + 1); i += FA_THREADS) {
        int r = i / (hd + 1), d = i % (hd + 1) - 1;   /* d = -1: the head's (m, l) */
        float M = fmaxf(fmaxf(wm[r], wm[16 + r]), fmaxf(wm[32 + r], wm[48 + r])), sum = 0;
        for (int w = 0; w < 4; w++)
            if (wm[w * 16 + r] > -INFINITY) sum += exp2f(wm[w * 16 + r] - M) * (d < 0 ? wl[w * 16 + r] : wo[(w * 16 + r) * HD + d]);
        float *out = part + ((size_t)(h0 + r) * splits + s) * (hd + 2);
        if (d >= 0) out[2 + d] = sum;
        else { out[0] = M * 0.6931471805599453f; out[1] = sum; }   /* m back in natural-log units for combine */
    }
}

/* Launches attn_decode_bf16_kernel for n_q local query heads over kw / hd local kv heads, T tokens. */
template <int HD> static void attn_decode_bf16_launch(cudaStream_t stream, const AttnArgs<bf16> &a, int n_q, int T) {
    int qpk = n_q / (a.kw / a.hd);
    size_t smem = (size_t)2 * 2 * FA_KEYS * (HD + 8) * sizeof(bf16);
    CUDA_CHECK(cudaFuncSetAttribute(attn_decode_bf16_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    LAUNCH(dim3(a.kw / a.hd * cdiv(qpk, 16), a.splits, T), FA_THREADS, smem, stream, attn_decode_bf16_kernel<HD>, a, qpk);
}

static void attn_decode(cudaStream_t stream, const AttnArgs<bf16> &a, int n_q, int T) {
    int hd = a.hd;
    auto launch = hd <= 32 ? attn_decode_bf16_launch<32> : hd <= 64 ? attn_decode_bf16_launch<64> : hd <= 96 ? attn_decode_bf16_launch<96>
                : hd <= 128 ? attn_decode_bf16_launch<128> : attn_decode_bf16_launch<256>;
    launch(stream, a, n_q, T);
}

/* The same for fp32 checkpoints (fp32 cache), in fp32: their tests hold the GPU to 2e-4 of
 * transformers. Block (token t, query head h), warp w takes keys w, w + 4, ... with an online softmax,
 * a lane holding NC = ceil(hd / 32) elements of a row; the four warps' (max, sum, acc) merge at the end. */
template <int NC>
__global__ void __launch_bounds__(128) attn_prompt_f32_kernel(const __grid_constant__ PromptAttnArgs<float> a) {
    pdl_wait();
    const float *kc = a.kc, *vc = a.vc;
    int kw = a.kw, hd = a.hd, t = blockIdx.x, h = blockIdx.y, kvh = h / a.gl, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int n = a.pos + t + 1;
    float scale = a.scale;
    const float *qh = a.q + (size_t)t * a.ldq + h * hd;
    float qv[NC], acc[NC] = {}, m = -INFINITY, l = 0;
#pragma unroll
    for (int i = 0; i < NC; i++) qv[i] = lane + 32 * i < hd ? qh[lane + 32 * i] : 0.0f;
    for (int j = warp; j < n; j += 4) {
        const float *k = kc + (size_t)j * kw + kvh * hd, *v = vc + (size_t)j * kw + kvh * hd;
        float d = 0;
#pragma unroll
        for (int i = 0; i < NC; i++) d += lane + 32 * i < hd ? qv[i] * k[lane + 32 * i] : 0.0f;
        float sc = warp_sum(d) * scale, mn = fmaxf(m, sc), f = __expf(m - mn), e = __expf(sc - mn);
        l = l * f + e;
#pragma unroll
        for (int i = 0; i < NC; i++) acc[i] = acc[i] * f + (lane + 32 * i < hd ? e * v[lane + 32 * i] : 0.0f);
        m = mn;
    }
    __shared__ float sm[4], sl[4], sacc[4][256];
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
    for (int i = 0; i < NC; i++) if (lane + 32 * i < hd) sacc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float M = fmaxf(fmaxf(sm[0], sm[1]), fmaxf(sm[2], sm[3])), L = 0;
    for (int w = 0; w < 4; w++) if (sm[w] > -INFINITY) L += sl[w] * __expf(sm[w] - M);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = 0;
        for (int w = 0; w < 4; w++) if (sm[w] > -INFINITY) o += sacc[w][i] * __expf(sm[w] - M);
        a.y[(size_t)t * a.ldy + h * hd + i] = o / L;
    }
}

/* Prompt attention for a.T tokens from a.pos over n_kv local kv heads of a.gl query heads each: the
 * flash kernel from a bf16 cache, the fp32 one from an fp32 cache. */
template <int HD> static void flash_attn_launch(cudaStream_t stream, const PromptAttnArgs<bf16> &a, int n_kv) {
    size_t smem = (size_t)(FA_ROWS + 4 * FA_KEYS) * (HD + 8) * sizeof(bf16);
    CUDA_CHECK(cudaFuncSetAttribute(flash_attn_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    LAUNCH(dim3(cdiv((long)a.T * a.gl, FA_ROWS), n_kv), FA_PTHREADS, smem, stream, flash_attn_kernel<HD>, a);
}

static void attn_prompt(cudaStream_t stream, const PromptAttnArgs<bf16> &a, int n_kv) {
    int hd = a.hd;
    auto launch = hd <= 32 ? flash_attn_launch<32> : hd <= 64 ? flash_attn_launch<64> : hd <= 96 ? flash_attn_launch<96>
                : hd <= 128 ? flash_attn_launch<128> : flash_attn_launch<256>;
    launch(stream, a, n_kv);
}

static void attn_prompt(cudaStream_t stream, const PromptAttnArgs<float> &a, int n_kv) {
    int hd = a.hd;
    auto k = hd <= 32 ? attn_prompt_f32_kernel<1> : hd <= 64 ? attn_prompt_f32_kernel<2> : hd <= 128 ? attn_prompt_f32_kernel<4>
                                                                                       : attn_prompt_f32_kernel<8>;
    LAUNCH(dim3(a.T, n_kv * a.gl), 128, 0, stream, k, a);
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: mixture of experts (the router, the chosen experts' products for one token, a prompt's
 * tokens grouped by expert)
 * ---------------------------------------------------------------------------------------------- */

/* What the kernels below hold in shared memory (checked at setup). */
enum { MOE_MAX_EXPERTS = 1024, MOE_MAX_TOPK = 32, MOE_SEGS = MOE_MAX_TOPK + 2, ROUTE_THREADS = 256, ROUTE_PER = 4, MOE_SPLITS = 32 };

/* The router's rule, as transformers' NemotronHMoE.route_tokens_to_experts applies it. */
typedef struct {
    int E, K;                   /* routed experts, experts chosen per token */
    int n_group, topk_group;    /* groups of E / n_group consecutive experts, groups kept */
    int norm;                   /* 1: the chosen weights are divided by their sum + 1e-20 */
    float scale;                /* routed_scaling_factor, applied last */
} MoeRoute;

/* A float's bits as an unsigned integer in the float's order (-0 as +0; NaNs past the infinities). */
__device__ __forceinline__ unsigned order_key(float f) {
    unsigned u = __float_as_uint(f == 0.0f ? 0.0f : f);
    return u >> 31 ? ~u : u | 0x80000000u;
}

/* Whether this block is the last of n blocks to arrive (every thread gets the answer): a counter in
 * global memory, which the last one resets for the next launch. The blocks' writes before the call
 * are visible to the last one after it. */
__device__ __forceinline__ bool last_block(unsigned *counter, unsigned n) {
    __shared__ int last;
    __threadfence();   /* this block's writes are visible before its count says so */
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1u) == n - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

/* Whether key a at expert ea beats key b at eb: the choice's total order (the lower index on ties). */
__device__ __forceinline__ bool key_beats(unsigned ka, int ea, unsigned kb, int eb) { return ka > kb || (ka == kb && ea < eb); }

/* The choice of warp 0's lanes (moe_select) among c[E] (as order keys, a total order), lane l reading
 * experts l, l + 32, ... from shared memory. t = the K-th largest of the lanes' largest keys is at or
 * below the K-th largest key (K lanes hold a key at or above it), so the K chosen are among the n keys
 * at or above t; each is ranked among them (by shuffles for up to 64, two a lane; else from shared
 * memory). Lane k ends with pick k: idx, wt as moe_select says. On one H100 (clock64 around the
 * choice, one block): 128 experts top 6 3.3k cycles, 512 top 22 6.5k, 300 top 31 9.2k; as K rounds of
 * the largest key left, 3.1k, 10.8k and 14.2k. */
__device__ __forceinline__ void moe_pick(int *idx, float *wt, const float *s, const float *c, MoeRoute rt) {
    __shared__ unsigned ck[MOE_MAX_EXPERTS];
    __shared__ int ce[MOE_MAX_EXPERTS], pick[MOE_MAX_TOPK];
    int lane = threadIdx.x;
    unsigned lm = 0;   /* the lane's largest key */
#pragma unroll 4
    for (int e = lane; e < rt.E; e += 32) lm = max(lm, order_key(c[e]));
    int r = 0;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        unsigned o = __shfl_sync(~0u, lm, j);
        r += o > lm || (o == lm && j < lane);
    }
    unsigned t = __shfl_sync(~0u, lm, __ffs(__ballot_sync(~0u, r == rt.K - 1)) - 1);
    int n = 0;   /* the candidates, keys at or above t, into ck and ce */
    for (int e0 = 0; e0 < rt.E; e0 += 32) {
        int e = e0 + lane;
        unsigned k = e < rt.E ? order_key(c[e]) : 0;
        int in = e < rt.E && k >= t;
        unsigned m = __ballot_sync(~0u, in);
        if (in) {
            int at = n + __popc(m & ((1u << lane) - 1));
            ck[at] = k, ce[at] = e;
        }
        n += __popc(m);
    }
    __syncwarp();
    if (n <= 64) {
        unsigned k0 = lane < n ? ck[lane] : 0, k1 = lane + 32 < n ? ck[lane + 32] : 0;   /* none: below all, never ranked */
        int e0 = lane < n ? ce[lane] : INT_MAX, e1 = lane + 32 < n ? ce[lane + 32] : INT_MAX, r0 = 0, r1 = 0;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            unsigned o = __shfl_sync(~0u, k0, j);
            int f = __shfl_sync(~0u, e0, j);
            r0 += key_beats(o, f, k0, e0), r1 += key_beats(o, f, k1, e1);
        }
        if (n > 32) {
#pragma unroll
            for (int j = 0; j < 32; j++) {
                unsigned o = __shfl_sync(~0u, k1, j);
                int f = __shfl_sync(~0u, e1, j);
                r0 += key_beats(o, f, k0, e0), r1 += key_beats(o, f, k1, e1);
            }
        }
        if (lane < n && r0 < rt.K) pick[r0] = e0;
        if (lane + 32 < n && r1 < rt.K) pick[r1] = e1;
    } else {
        for (int i = lane; i < n; i += 32) {
            unsigned k = ck[i];
            int e = ce[i], rank = 0;
            for (int j = 0; j < n; j++) rank += key_beats(ck[j], ce[j], k, e);
            if (rank < rt.K) pick[rank] = e;
        }
    }
    __syncwarp();
    int mine = lane < rt.K ? pick[lane] : 0;
    float w = lane < rt.K ? s[mine] : 0.0f, sum = warp_sum(w);
    if (lane < rt.K) {
        if (rt.norm) w /= sum + 1e-20f;
        idx[lane] = mine;
        wt[lane] = w * rt.scale;
    }
}

/* One token's choice, by the whole block of ROUTE_THREADS (then its first warp), from its router
 * logits l[E]:
 *   s = sigmoid(l);  c = s + bias;  a group scores the sum of its two largest c;  the topk_group best
 *   groups stay, the others' experts compete as -inf;  idx = the K largest c, best first;
 *   wt = s[idx] (/ (sum + 1e-20) if norm) * scale.
 * Ties go to the lower index (a NaN orders by its bits, so every slot is filled once), so the choice
 * is a function of the logits alone: every tensor-parallel rank, given the same reduced input, picks
 * the same experts in the same order. */
__device__ __forceinline__ void moe_select(int *idx, float *wt, const float *l, const float *bias, MoeRoute rt) {
    __shared__ float s[MOE_MAX_EXPERTS], c[MOE_MAX_EXPERTS];
    enum { PER_T = MOE_MAX_EXPERTS / ROUTE_THREADS };
    int per = rt.E / rt.n_group;
    float lv[PER_T], bv[PER_T];   /* a thread's logits and biases, all loads out before the first is used */
#pragma unroll
    for (int i = 0; i < PER_T; i++) {
        int e = threadIdx.x + i * ROUTE_THREADS;
        if (e < rt.E) lv[i] = __ldcg(l + e), bv[i] = bias[e];   /* __ldcg: other blocks may have written l (see moe_route_kernel) */
    }
#pragma unroll
    for (int i = 0; i < PER_T; i++) {
        int e = threadIdx.x + i * ROUTE_THREADS;
        if (e < rt.E) {
            float v = 1.0f / (1.0f + expf(-lv[i]));
            s[e] = v;
            c[e] = v + bv[i];
        }
    }
    __syncthreads();
    if (rt.n_group > 1) {   /* (with one group, every expert competes) */
        __shared__ float gs[MOE_MAX_EXPERTS];
        __shared__ int kept[MOE_MAX_EXPERTS];
        for (int g = threadIdx.x; g < rt.n_group; g += blockDim.x) {
            float m1 = -INFINITY, m2 = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                if (c[e] > m1) { m2 = m1; m1 = c[e]; } else if (c[e] > m2) m2 = c[e];
            }
            gs[g] = per > 1 ? m1 + m2 : m1;
        }
        __syncthreads();
        for (int g = threadIdx.x; g < rt.n_group; g += blockDim.x) {
            int rank = 0;
            for (int h = 0; h < rt.n_group; h++) rank += gs[h] > gs[g] || (gs[h] == gs[g] && h < g);
            kept[g] = rank < rt.topk_group;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < rt.E; e += blockDim.x) if (!kept[e / per]) c[e] = -INFINITY;
        __syncthreads();
    }
    if (threadIdx.x >= 32) return;
    moe_pick(idx, wt, s, c, rt);
}

/* Decode's router in one launch, for T tokens: block e dots gate row e (fp32, its whole row in flight
 * before the wait) with each token's x; the last block to finish (last_block) chooses, token by token,
 * from all E logits. The choice stays on the GPU: the step needs no host round trip and stays one
 * graph. */
__global__ void __launch_bounds__(ROUTE_THREADS) moe_route_kernel(int *idx, float *wt, float *logits, unsigned *done,
                                                                 const float *gate, const float *bias, const float *x, int H, int T,
                                                                 MoeRoute rt) {
    const uint4 *w = (const uint4 *)(gate + (size_t)blockIdx.x * H);
    int nvec = H / 4;   /* H is a multiple of 8 (setup) */
    uint4 a[ROUTE_PER];
#pragma unroll
    for (int k = 0; k < ROUTE_PER; k++) {
        int v = threadIdx.x + k * ROUTE_THREADS;
        a[k] = v < nvec ? ld_stream(w + v) : make_uint4(0, 0, 0, 0);
    }
    pdl_wait();
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * H;
        float acc = 0;
#pragma unroll
        for (int k = 0; k < ROUTE_PER; k++) {
            int v = threadIdx.x + k * ROUTE_THREADS;
            if (v < nvec) acc += dot16<DT_F32>(a[k], 0, xt + 4 * v);
        }
        for (int v = threadIdx.x + ROUTE_PER * ROUTE_THREADS; v < nvec; v += ROUTE_THREADS) acc += dot16<DT_F32>(ld_stream(w + v), 0, xt + 4 * v);
        acc = block_sum(acc);
        if (threadIdx.x == 0) logits[(size_t)t * gridDim.x + blockIdx.x] = acc;
    }
    if (!last_block(done, gridDim.x)) return;
    for (int t = 0; t < T; t++) {
        moe_select(idx + (size_t)t * rt.K, wt + (size_t)t * rt.K, logits + (size_t)t * gridDim.x, bias, rt);
        __syncthreads();   /* the choice is read before the next token's overwrites its scratch */
    }
}

/* A prompt's choices, a block per token, from logits cuBLAS computed. */
__global__ void __launch_bounds__(ROUTE_THREADS) moe_select_kernel(int *idx, float *wt, const float *logits, const float *bias,
                                                                  MoeRoute rt) {
    pdl_wait();
    size_t t = blockIdx.x;
    moe_select(idx + t * rt.K, wt + t * rt.K, logits + t * rt.E, bias, rt);
}

/* Asks L2 for the n bytes at p, lane `first` of `st` taking every st-th 128-byte line: all of a row's
 * lines on their way at once, while the lanes' loads take them in order. */
__device__ __forceinline__ void l2_row(const char *p, size_t n, int first, int st) {
    const char *a = (const char *)((uintptr_t)p & ~(uintptr_t)127);
    n += p - a;
    for (size_t off = (size_t)first * 128; off < n; off += (size_t)st * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(a + off));
}

/* A matrix a one-token expert product reads, with its input. */
typedef struct {
    GMat W;                     /* routed: every expert's rows, stacked, erows each */
    const float *x;             /* [cols] input, 16-byte aligned; routed down: slot j's at x + j * xstep */
    int ldx;                    /* floats between two tokens' inputs (several tokens) */
} MoeIn;

typedef struct {
    MoeIn routed;               /* every expert's up_proj rows of this rank, stacked, on z */
    int m, K;                   /* rows of one expert's (this rank's intermediate size), chosen slots */
    MoeIn shared;               /* the shared expert's up_proj rows of this rank, on x */
    int S;                      /* its rows */
    int T, ldh;                 /* tokens; floats between two tokens' h */
} MoeUp;

/* Virtual row r of moe_up_kernel: its matrix, row, input and place in h (token 0's, for a shared row),
 * and its slot's weight. */
typedef struct {
    const GMat *W;
    GRow row;
    const float *x;
    int at;
    float wt;
} MoeUpRow;

__device__ __forceinline__ MoeUpRow moe_up_row(const MoeUp &u, const int *idx, const float *wt, int r) {
    if (r < u.S) return MoeUpRow{&u.shared.W, gmat_row(u.shared.W, r), u.shared.x, u.K * pad8(u.m) + r, 1.0f};
    int p = (r - u.S) / u.m, i = (r - u.S) - p * u.m, t = p / u.K, j = p - t * u.K;   /* token t's slot j */
    return MoeUpRow{&u.routed.W, gmat_row(u.routed.W, (size_t)idx[p] * u.m + i), u.routed.x + (size_t)t * u.routed.ldx,
                    t * u.ldh + j * pad8(u.m) + i, wt[p]};
}

/* moe_up_kernel's quantized form: virtual rows r0 .. r0 + QROWS - 1, read together (rows_dot) where
 * they share an input (the shared expert's rows, or one slot's expert), else one by one; a shared row
 * for every token, NT a round. Unlike the bf16 form, a routed row is not asked of L2 after the wait:
 * QROWS rows' loads are already in flight together, and the requests only slowed them (FP8). */
template <int F, int NT>
__device__ __forceinline__ void moe_up_rows(float *h, const int *idx, const float *wt, const MoeUp &u, int r0, int lane) {
    int end = u.S + u.T * u.K * u.m;
    for (int q = 0; q < QROWS && r0 + q < u.S; q++) l2_row(gmat_row(u.shared.W, r0 + q).w, row_bytes(u.shared.W.fmt, u.shared.W.cols), lane, 32);
    pdl_wait();
    if (r0 >= end) return;
    int last = min(r0 + QROWS, end) - 1, together = last == r0 + QROWS - 1 &&
        (last < u.S || (r0 >= u.S && (r0 - u.S) / u.m == (last - u.S) / u.m));
    for (int g = 0; g <= last - r0; g += together ? QROWS : 1) {
        MoeUpRow vr[QROWS];
        const char *w[QROWS];
        const uint8_t *bs[QROWS];
#pragma unroll
        for (int q = 0; q < QROWS; q++) {
            vr[q] = moe_up_row(u, idx, wt, r0 + g + (together ? q : 0));
            w[q] = vr[q].row.w;
            bs[q] = vr[q].row.bs;
        }
        int n = NT > 1 && r0 + g < u.S ? u.T : 1;   /* tokens: every one for a shared row */
        for (int t0 = 0; t0 < n; t0 += NT) {
            int nt = min(NT, n - t0);
            const float *x = vr[0].x + (size_t)t0 * u.shared.ldx;
            float acc[NT][QROWS] = {}, mine[NT] = {};
            if (together) rows_dot_fmt<F, QROWS, NT>(vr[0].W->fmt, acc, w, bs, x, u.shared.ldx, nt, vr[0].W->cols, lane, 32);
            else {
                float one[NT][1] = {};
                const char *w1[1] = {w[0]};
                const uint8_t *b1[1] = {bs[0]};
                rows_dot_fmt<F, 1, NT>(vr[0].W->fmt, one, w1, b1, x, u.shared.ldx, nt, vr[0].W->cols, lane, 32);
#pragma unroll
                for (int t = 0; t < NT; t++) acc[t][0] = one[t][0];
            }
            int at = 0;
#pragma unroll
            for (int q = 0; q < QROWS; q++)
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float v = fmaxf(warp_sum(acc[t][q]) * vr[q].row.scale, 0.0f);
                    if (lane == q) { mine[t] = vr[q].wt * v * v; at = vr[q].at; }
                }
            if (lane < (together ? QROWS : 1))
                for (int t = 0; t < nt; t++) h[at + (size_t)(t0 + t) * u.ldh] = mine[t];
        }
    }
}

/* Decode, every chosen expert's up product and the shared expert's in one launch, for T tokens.
 * Virtual row r of [S | T K m] (S shared rows, m rows of each routed expert on this rank) is shared
 * row r, on every token's x, or row i = (r - S) % m of the expert in token t's slot j, (t K + j) =
 * (r - S) / m, on its z (x, or fc1's latent):
 *   h[t][K mp + r] = relu(sup[r] . x_t)^2,   h[t][j mp + i] = wt[t][j] relu(up_{idx[t][j]}[i] . z_t)^2
 * (mp: m rounded up to 8, so each slot's part of h starts 16-byte aligned for moe_down_kernel).
 * A warp a row. The shared rows, first, ask L2 for their weights before the wait; the routed rows
 * learn their expert after it (the router may be the kernel just before). */
template <int F, int NT>
__global__ void __launch_bounds__(32 * GEMV_WARPS, NT == 1 ? gemv_min_blocks(F) : 4) moe_up_kernel(float *h, const int *idx,
                                                                                                  const float *wt,
                                                                                                  const __grid_constant__ MoeUp u) {
    int lane = threadIdx.x & 31, S = u.S, m = u.m;
    if constexpr (F != DT_F32 && F != DT_BF16) {   /* quantized: QROWS rows a warp (moe_up_rows) */
        moe_up_rows<F, NT>(h, idx, wt, u, (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * QROWS, lane);
    } else {
        int r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
        if (r < S) l2_row(gmat_row(u.shared.W, r).w, row_bytes(u.shared.W.fmt, u.shared.W.cols), lane, 32);
        pdl_wait();
        if (r >= S + u.T * u.K * m) return;
        MoeUpRow v = moe_up_row(u, idx, wt, r);
        if (r >= S) l2_row(v.row.w, row_bytes(v.W->fmt, v.W->cols), lane, 32);
        int n = NT > 1 && r < S ? u.T : 1;   /* tokens: every one for a shared row */
        for (int t0 = 0; t0 < n; t0 += NT) {
            int nt = min(NT, n - t0);
            float acc[NT];
            row_dot<F, NT>(acc, v.row.w, v.row.bs, v.x + (size_t)t0 * u.shared.ldx, u.shared.ldx, nt, v.W->cols, lane, 32);
            for (int t = 0; t < nt; t++) {
                float a = fmaxf(warp_sum(acc[t]) * v.row.scale, 0.0f);
                if (lane == 0) h[v.at + (size_t)(t0 + t) * u.ldh] = v.wt * a * a;
            }
        }
    }
}

/* The inputs of a one-token down product: row i of it is the rows i of several matrices (MoeIn) side
 * by side (the chosen experts', then the fixed ones), dotted with their inputs side by side. */
typedef struct {
    MoeIn routed;               /* the chosen experts' down_proj columns of this rank */
    int k, erows, xstep;        /* slots used (0: none), rows of one expert's matrix, see MoeIn.x */
    MoeIn fixed[2];             /* matrices every token uses: the shared expert's down, fc2_latent_proj */
    int nfixed;
    int T, ldo;                 /* tokens; floats between two tokens' outputs */
    int splits;                 /* ranges a row's segments are cut into, a block each (1: none) */
    float *part;                /* [splits, T, rows] each range's sums (splits > 1) */
    unsigned *cnt;              /* [row tiles] blocks of a tile done (the last one adds, then resets it) */
} MoeDown;

/* A split product's end (md.splits > 1): every block of row tile `tile` (rows r0 .. r0 + n - 1) left
 * its range's sums in md.part; the tile's last block to finish adds them in the order of the ranges
 * into out, so each token's sums are the same however many tokens the step has. */
__device__ void split_sum(const MoeDown &md, float *out, int rows, int tile, int r0, int n) {
    if (!last_block(md.cnt + tile, md.splits)) return;
    for (int i = threadIdx.x; i < md.T * n; i += blockDim.x) {
        int t = i / n, r = r0 + i % n;
        if (r >= rows) continue;
        float s = 0;
        for (int y = 0; y < md.splits; y++) s += __ldcg(md.part + ((size_t)y * md.T + t) * rows + r);
        out[(size_t)t * md.ldo + r] = s;
    }
}

/* A token's row of a down product as its segments side by side, in units of unit(fmt) elements
 * (16-byte pieces, NVFP4 spans): at[j] = segment j's first unit, at[k + nfixed] = all of them
 * (thread 0 writes them, the block waits); [lo, hi) = range y of md.splits. */
template <typename Unit> __device__ void seg_starts(int *at, int &lo, int &hi, const MoeDown &md, int y, Unit unit) {
    int n = md.k + md.nfixed;
    if (threadIdx.x == 0) {
        at[0] = 0;
        for (int j = 0; j < n; j++) {
            const GMat &W = j < md.k ? md.routed.W : md.fixed[j - md.k].W;
            at[j + 1] = at[j] + cdiv(W.cols, unit(W.fmt));
        }
    }
    __syncthreads();
    lo = (int)((long)at[n] * y / md.splits), hi = (int)((long)at[n] * (y + 1) / md.splits);
}

/* Segment j (< k + nfixed) of a token's row: its matrix, the first row of it that is the segment's,
 * and its input. */
typedef struct {
    const GMat *W;
    size_t r0;
    const float *x;
} MoeSeg;

/* out[t][i] = sum over the segments s of scale_s W_s[i] . x_{t,s} (the up kernel already weighed the
 * routed inputs), the segments in order. wpr warps a row, as gemv_kernel. Quantized rows may be cut
 * into md.splits ranges of their 16-byte pieces (all segments' side by side): block b takes row tile
 * b % tiles and range b / tiles, and split_sum adds the ranges. The router ran two kernels
 * back, so the weights a row reads are known before the wait: its first segment is asked of L2 then;
 * after it, each segment's lines are asked for while the one before is dotted (one segment ahead,
 * not the whole row: a wave's rows of every chosen expert would not fit in L2). Several tokens: a
 * round's tokens' routed segments one token after the other, then the fixed ones, each row dotted with
 * all of the round's inputs. Blocks from warm_from on warm L2 for the next product, as gemv_kernel's
 * last wave does. */
template <int F, int NT>
__global__ void __launch_bounds__(32 * GEMV_WARPS, NT == 1 ? gemv_min_blocks(F) : 4) moe_down_kernel(float *out, int rows, const int *idx,
                                                                                                    const __grid_constant__ MoeDown md,
                                                                                                    int wpr, const void *warm,
                                                                                                    size_t warm_n, int warm_from) {
    __shared__ const GMat *mat[MOE_SEGS];
    __shared__ const float *xs[MOE_SEGS];
    __shared__ size_t r0[MOE_SEGS];
    __shared__ int ld[MOE_SEGS];
    __shared__ float red[GEMV_WARPS][NT][QROWS];   /* the row's (QROWS rows') sums of each warp */
    int n = md.k + md.nfixed, T = NT == 1 ? 1 : md.T;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {   /* token 0's segments */
        const MoeIn *in = j < md.k ? &md.routed : &md.fixed[j - md.k];
        mat[j] = &in->W;
        r0[j] = j < md.k ? (size_t)idx[j] * md.erows : 0;
        xs[j] = j < md.k ? in->x + (size_t)j * md.xstep : in->x;
        ld[j] = in->ldx;
    }
    __syncthreads();
    auto moe_seg = [&](int t, int j) {   /* token t's segment j */
        if (NT == 1) t = 0;
        return MoeSeg{mat[j], j < md.k && t ? (size_t)idx[t * md.k + j] * md.erows : r0[j], xs[j] + (size_t)t * ld[j]};
    };
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, part = warp % wpr, first = part * 32 + lane, st = 32 * wpr;
    if constexpr (F != DT_F32 && F != DT_BF16) {   /* quantized: QROWS output rows a warp, x read once a piece */
        /* block b: row tile b % tiles, and range y = b / tiles of the row's 16-byte pieces, all segments' side by side */
        int per_tile = GEMV_WARPS / wpr * QROWS, tiles = cdiv(rows, per_tile), tile = blockIdx.x % tiles, y = blockIdx.x / tiles;
        int row0 = tile * per_tile + warp / wpr * QROWS;
        __shared__ int pre[MOE_SEGS + 1];   /* the first piece of each segment */
        int lo, hi;
        seg_starts(pre, lo, hi, md, y, [](int fmt) { return fmt_per(fmt); });
        /* segment j's part of this block's range: columns c0 .. c1 - 1 (none where c0 >= c1) */
        auto range = [&](int j, int &c0, int &c1) {
            int per = fmt_per(mat[j]->fmt);
            c0 = (max(lo, pre[j]) - pre[j]) * per, c1 = min((min(hi, pre[j + 1]) - pre[j]) * per, mat[j]->cols);
        };
        auto rows_of = [&](const MoeSeg &sg, int c0, const char *(&w)[QROWS], const uint8_t *(&bs)[QROWS], float (&sc)[QROWS]) {
#pragma unroll
            for (int q = 0; q < QROWS; q++) {
                GRow s = gmat_row(*sg.W, sg.r0 + min(row0 + q, rows - 1));
                w[q] = s.w + row_bytes(sg.W->fmt, c0), bs[q] = s.bs ? s.bs + c0 / 16 : NULL, sc[q] = s.scale;
            }
        };
        const char *w[QROWS];
        const uint8_t *bs[QROWS];
        float sc[QROWS];
        int j0 = 0;   /* the first segment of the range */
        while (j0 + 1 < n && pre[j0 + 1] <= lo) j0++;
        if (row0 < rows && n) {
            int c0, c1;
            range(j0, c0, c1);
            MoeSeg s0 = moe_seg(0, j0);
            rows_of(s0, c0, w, bs, sc);
            for (int q = 0; q < QROWS && c0 < c1; q++) l2_row(w[q], row_bytes(s0.W->fmt, c1 - c0), first, st);
        }
        pdl_wait();
        for (int t0 = 0; t0 < T; t0 += NT) {
            int nt = min(NT, T - t0);
            float acc[NT][QROWS] = {}, mine[NT] = {};
            for (int t = 0; row0 < rows && t < nt; t++)   /* the routed segments, token by token (one token: all) */
                for (int j = j0; j < (NT == 1 ? n : md.k); j++) {
                    int c0, c1;
                    range(j, c0, c1);
                    if (c0 >= c1) break;
                    MoeSeg sg = moe_seg(t0 + t, j);
                    float part_acc[1][QROWS] = {};
                    rows_of(sg, c0, w, bs, sc);
                    rows_dot_fmt<F, QROWS, 1>(sg.W->fmt, part_acc, w, bs, sg.x + c0, 0, 1, c1 - c0, first, st);
#pragma unroll
                    for (int q = 0; q < QROWS; q++) acc[t][q] += part_acc[0][q] * sc[q];
                }
            for (int j = max(j0, md.k); NT > 1 && row0 < rows && j < n; j++) {   /* the fixed ones, for every token of the round */
                int c0, c1;
                range(j, c0, c1);
                if (c0 >= c1) break;
                MoeSeg sg = moe_seg(t0, j);
                float part_acc[NT][QROWS] = {};
                rows_of(sg, c0, w, bs, sc);
                rows_dot_fmt<F, QROWS, NT>(sg.W->fmt, part_acc, w, bs, sg.x + c0, ld[j], nt, c1 - c0, first, st);
#pragma unroll
                for (int t = 0; t < NT; t++)
#pragma unroll
                    for (int q = 0; q < QROWS; q++) acc[t][q] += part_acc[t][q] * sc[q];
            }
            if (t0 + NT >= T && (int)blockIdx.x >= warm_from) l2_warm(warm, warm_n, blockIdx.x - warm_from, gridDim.x - warm_from);
            if (wpr > 1 && t0) __syncthreads();   /* the round before has read red */
            rows_sum<NT>(mine, acc, red, wpr);
            float *o = md.splits > 1 ? md.part + (size_t)y * md.T * rows : out;
            int ldo = md.splits > 1 ? rows : md.ldo;
            if (lane < QROWS && row0 + lane < rows && !part)
                for (int t = 0; t < nt; t++) o[(size_t)(t0 + t) * ldo + row0 + lane] = mine[t];
        }
        if (md.splits > 1) split_sum(md, out, rows, tile, tile * per_tile, per_tile);
    } else {
        int row = blockIdx.x * (GEMV_WARPS / wpr) + warp / wpr;
        auto seg_row = [&](const MoeSeg &sg) { return gmat_row(*sg.W, sg.r0 + row); };
        auto seg_bytes = [&](const MoeSeg &sg) { return row_bytes(sg.W->fmt, sg.W->cols); };
        auto ahead = [&](int t, int j) {   /* asks L2 for segment j + 1's row */
            MoeSeg a = moe_seg(t, j + 1);
            l2_row(seg_row(a).w, seg_bytes(a), first, st);
        };
        if (row < rows && n) { MoeSeg s0 = moe_seg(0, 0); l2_row(seg_row(s0).w, seg_bytes(s0), first, st); }
        pdl_wait();
        for (int t0 = 0; t0 < T; t0 += NT) {
            int nt = min(NT, T - t0);
            float acc[NT] = {};
            if (row < rows) {
                for (int t = 0; t < nt; t++)   /* the routed segments, token by token (one token: all) */
                    for (int j = 0; j < (NT == 1 ? n : md.k); j++) {
                        if (j + 1 < n) ahead(t0 + t, j);
                        MoeSeg sg = moe_seg(t0 + t, j);
                        GRow s = seg_row(sg);
                        float d[1];
                        row_dot<F, 1>(d, s.w, s.bs, sg.x, 0, 1, sg.W->cols, first, st);
                        acc[t] += d[0] * s.scale;
                    }
                for (int j = md.k; NT > 1 && j < n; j++) {   /* the fixed ones, for every token of the round */
                    if (j + 1 < n) ahead(t0, j);
                    MoeSeg sg = moe_seg(t0, j);
                    GRow s = seg_row(sg);
                    float d[NT];
                    row_dot<F, NT>(d, s.w, s.bs, sg.x, ld[j], nt, sg.W->cols, first, st);
                    for (int t = 0; t < nt; t++) acc[t] += d[t] * s.scale;
                }
            }
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
            if (t0 + NT >= T && (int)blockIdx.x >= warm_from) l2_warm(warm, warm_n, blockIdx.x - warm_from, gridDim.x - warm_from);
            if (wpr > 1) {
                if (t0) __syncthreads();   /* the round before has read red */
                if (lane == 0)
                    for (int t = 0; t < NT; t++) red[warp][t][0] = acc[t];
                __syncthreads();
                for (int k = 1; k < wpr && !part; k++)
                    for (int t = 0; t < NT; t++) acc[t] += red[warp + k][t][0];
            }
            if (lane == 0 && row < rows && !part)
                for (int t = 0; t < nt; t++) out[(size_t)(t0 + t) * md.ldo + row] = acc[t];
        }
    }
}

/* A decoded step's NVFP4 expert products on the tensor cores, in gemv_e2m1_kernel's spans, each
 * token's sums the same however many tokens the step has. Up: block b is a tile of E2M1_ROWS rows of
 * one matrix, the shared expert's (the first cdiv(S, 16) tiles: every token, E2M1_TOKENS a round, a
 * token a column) or the expert in token t's slot j (cdiv(m, 16) tiles for each (t, j): column 0), as
 * moe_up_kernel's virtual rows: h[t][K mp + r] = relu(sup[r] . x_t)^2, h[t][j mp + i] = wt[t][j]
 * relu(up[i] . z_t)^2. The shared tiles fetch their first span before the wait; the routed ones learn
 * their expert after it (the router may be the kernel just before). */
template <int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 16 / WARPS) moe_up_e2m1_kernel(float *h, const int *idx, const float *wt,
                                                                             const __grid_constant__ MoeUp u) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int ts = cdiv(u.S, E2M1_ROWS), tm = cdiv(u.m, E2M1_ROWS), b = blockIdx.x, shared = b < ts, p = shared ? 0 : (b - ts) / tm;
    int tok = p / u.K, j = p % u.K, n = shared ? u.S : u.m, i0 = (shared ? b : b - ts - p * tm) * E2M1_ROWS;
    const MoeIn &in = shared ? u.shared : u.routed;
    int cols = in.W.cols, spans = cdiv(cols, E2M1_SPAN);
    GRow ra, rb;
    auto at = [&](size_t base) {   /* rows base + i0 + g, base + i0 + g + 8 of the stacked matrix */
        ra = e2m1_row(in.W, base + min(i0 + g, n - 1)), rb = e2m1_row(in.W, base + min(i0 + g + 8, n - 1));
    };
    auto load = [&](int s) { return s < spans ? e2m1_load(ra, rb, s * E2M1_SPAN + 32 * t, cols) : E2m1Chunk{}; };
    E2m1Chunk cur = {};
    if (shared) {
        at(0);
        cur = load(warp);
    }
    pdl_wait();
    if (!shared) {
        at((size_t)idx[p] * u.m);
        cur = load(warp);
    }
    float w = shared ? 1.0f : wt[p];
    __shared__ float red[WARPS][32][4];
    __shared__ __align__(16) uint32_t xs[E2M1_XS / 2];
    int staged = (!shared || u.T == 1) && cols <= E2M1_XS;
    if (staged) {
        const float *xt = in.x + (size_t)(shared ? 0 : tok) * in.ldx;
        e2m1_stage(xs, 0, spans, [&](int s, const float *&x, int &e, int &c) { x = xt, e = s * E2M1_SPAN, c = cols; });
    }
    for (int t0 = 0; t0 < (shared ? u.T : 1); t0 += E2M1_TOKENS) {
        int nt = shared ? min((int)E2M1_TOKENS, u.T - t0) : 1;
        if (t0) {   /* the round before is done with red */
            __syncthreads();
            cur = load(warp);
        }
        const float *x = in.x + (size_t)(shared ? t0 + min(g, nt - 1) : tok) * in.ldx;
        float acc[4] = {0, 0, 0, 0};   /* rows g, g, g + 8, g + 8; columns 2 t, 2 t + 1 */
        for (int s = warp; s < spans; s += WARPS) {
            E2m1Chunk nxt = load(s + WARPS);
            uint32_t xb[16] = {};
            if (staged) e2m1_xs(xb, xs, s * E2M1_SPAN + 32 * t);
            else if (g < nt) e2m1_x(xb, x, s * E2M1_SPAN + 32 * t, cols);
            e2m1_mma(acc, cur, xb);
            cur = nxt;
        }
        e2m1_warps_sum<WARPS>(acc, red, warp, lane);
        for (int q = 0; q < 4 && !warp; q++) {
            int c = 2 * t + (q & 1), i = i0 + g + (q >> 1) * 8;
            if (c >= nt || i >= n) continue;
            float v = fmaxf(acc[q] * 16384.0f * (q >> 1 ? rb : ra).scale, 0.0f);
            h[(size_t)(shared ? t0 + c : tok) * u.ldh + (shared ? u.K * pad8(u.m) : j * pad8(u.m)) + i] = w * v * v;
        }
    }
}

/* Down: block b is output rows 16 i .. 16 i + 15 (i = b % tiles), token by token (column 0), over
 * range b / tiles of md.splits of the spans of a token's segments side by side (each segment's spans
 * from its start: seg[j] is segment j's first; split_sum adds the ranges); its warps take every
 * WARPS-th span of the range, each span's sums weighed by its rows' scale. Segments may end within a span.
 * Token 0's rows are known before the wait (the router ran two kernels back). Blocks from warm_from
 * on warm L2 for the next product. */
template <int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 16 / WARPS) moe_down_e2m1_kernel(float *out, int rows, const int *idx,
                                                                               const __grid_constant__ MoeDown md, const void *warm,
                                                                               size_t warm_n, int warm_from) {
    int tiles = cdiv(rows, E2M1_ROWS), tile = blockIdx.x % tiles, y = blockIdx.x / tiles, lo, hi;   /* [lo, hi): this block's spans */
    __shared__ int seg[MOE_SEGS + 1];
    seg_starts(seg, lo, hi, md, y, [](int) { return (int)E2M1_SPAN; });
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3, r0 = tile * E2M1_ROWS;
    int ra = min(r0 + g, rows - 1), rb = min(r0 + g + 8, rows - 1), tk = 0;
    struct View {   /* token tk's segment as this lane sees it: its rows and width */
        GRow a, b;
        int cols;
    };
    auto view = [&](int j) {
        const MoeIn &in = j < md.k ? md.routed : md.fixed[j - md.k];
        size_t base = j < md.k ? (size_t)idx[tk * md.k + j] * md.erows : 0;
        return View{e2m1_row(in.W, base + ra), e2m1_row(in.W, base + rb), in.W.cols};
    };
    int lj = 0, cj = 0;   /* the segments of the span loaded next and of the span dotted */
    View lv = view(0), cv = lv;
    auto load = [&](int s) {
        if (s >= hi) return E2m1Chunk{};
        if (s >= seg[lj + 1]) {
            while (s >= seg[lj + 1]) lj++;
            lv = view(lj);
        }
        return e2m1_load(lv.a, lv.b, (s - seg[lj]) * E2M1_SPAN + 32 * t, lv.cols);
    };
    E2m1Chunk cur = load(lo + warp);
    pdl_wait();
    __shared__ float red[WARPS][32][4];
    extern __shared__ __align__(16) uint32_t xs_down[];
    for (; tk < md.T; tk++) {
        if (tk) {   /* the token before is done with red and xs_down */
            __syncthreads();
            lj = cj = 0, lv = cv = view(0), cur = load(lo + warp);
        }
        int sj = 0;   /* the segment of the span staged */
        e2m1_stage(xs_down, lo, hi, [&](int s, const float *&x, int &e, int &c) {
            while (s >= seg[sj + 1]) sj++;
            const MoeIn &in = sj < md.k ? md.routed : md.fixed[sj - md.k];
            x = in.x + (size_t)tk * in.ldx + (sj < md.k ? (size_t)sj * md.xstep : 0), e = (s - seg[sj]) * E2M1_SPAN, c = in.W.cols;
        });
        float acc[4] = {0, 0, 0, 0};
        for (int s = lo + warp; s < hi; s += WARPS) {
            E2m1Chunk nxt = load(s + WARPS);
            if (s >= seg[cj + 1]) {
                while (s >= seg[cj + 1]) cj++;
                cv = view(cj);
            }
            uint32_t xb[16] = {};
            e2m1_xs(xb, xs_down, (s - lo) * E2M1_SPAN + 32 * t);
            float d[4] = {0, 0, 0, 0};
            e2m1_mma(d, cur, xb);
            acc[0] += d[0] * cv.a.scale, acc[2] += d[2] * cv.b.scale;
            cur = nxt;
        }
        if (tk == md.T - 1 && (int)blockIdx.x >= warm_from) l2_warm(warm, warm_n, blockIdx.x - warm_from, gridDim.x - warm_from);
        e2m1_warps_sum<WARPS>(acc, red, warp, lane);
        float *o = md.splits > 1 ? md.part + ((size_t)y * md.T + tk) * rows : out + (size_t)tk * md.ldo;
        for (int k = 0; k < 2 && !warp && t == 0; k++)
            if (r0 + g + 8 * k < rows) o[r0 + g + 8 * k] = acc[2 * k] * 16384.0f;
    }
    if (md.splits > 1) split_sum(md, out, rows, tile, r0, E2M1_ROWS);
}

/* Rows of a row tile of the grouped expert products (moe_gemm_kernel): a tile holds one expert's rows. */
enum { MG_BM = 128 };

/* A prompt's TK = T K (token, slot) pairs p = t K + k, grouped by expert and in p order within one:
 * off[e] = the first row of expert e's pairs (off[E] = TK), tile[e] = its first row tile (tile[E]:
 * all of them), tok[row] = the pair's token, row_of[p] = its row. One block; warp w owns the w-th
 * contiguous range of pairs: it counts them by expert (shared-memory atomics), a scan over (expert,
 * warp) gives each warp its first row in each expert, then each warp places its pairs 32 at a time, in
 * order (lanes with the same expert find their order among themselves with __match_any_sync). */
__global__ void __launch_bounds__(1024) moe_sort_kernel(int *off, int *tile, int *tok, int *row_of, const int *idx, int TK, int K,
                                                        int E) {
    extern __shared__ int at[];           /* [warps][E] counts, then each warp's next free row in each expert */
    __shared__ int first[MOE_MAX_EXPERTS];   /* each expert's first row */
    int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, *mine = at + warp * E;
    int p0 = (int)((int64_t)TK * warp / nw), p1 = (int)((int64_t)TK * (warp + 1) / nw);
    pdl_wait();
    for (int i = threadIdx.x; i < nw * E; i += blockDim.x) at[i] = 0;
    __syncthreads();
    for (int p = p0 + lane; p < p1; p += 32) atomicAdd(&mine[idx[p]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int n = 0;
        for (int w = 0; w < nw; w++) n += at[w * E + e];
        first[e] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0, tiles = 0;
        for (int e = 0; e < E; e++) {
            int n = first[e];
            off[e] = first[e] = run;
            tile[e] = tiles;
            run += n;
            tiles += cdiv(n, MG_BM);
        }
        off[E] = run;
        tile[E] = tiles;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        for (int w = 0, run = first[e]; w < nw; w++) {
            int n = at[w * E + e];
            at[w * E + e] = run;
            run += n;
        }
    __syncthreads();
    for (int q = p0; q < p1; q += 32) {
        int p = q + lane, e = p < p1 ? idx[p] : -1;
        unsigned same = __match_any_sync(0xffffffffu, e);
        int before = __popc(same & ((1u << lane) - 1)), row = e >= 0 ? mine[e] + before : 0;
        __syncwarp();   /* every lane has read its expert's next row before the first of them moves it */
        if (e >= 0) {
            tok[row] = p / K;
            row_of[p] = row;
            if (!before) mine[e] += __popc(same);
        }
        __syncwarp();
    }
}

/* out[t] = (add ? out[t] : 0) + sum over slots k of wt[t][k] y[row_of[t K + k]], the slots in order
 * (y: fp32, or bf16 as a bf16 model's down product writes it); V columns a thread: 16 bytes of each
 * row at once where the rows allow (V = 16 / sizeof(YT)), else 1. */
template <typename YT, int V>
__global__ void moe_combine_kernel(float *out, int ldo, int add, const YT *y, int ldy, const int *row_of, const float *wt,
                                   int K, int cols) {
    struct alignas(V * sizeof(YT)) Piece { YT v[V]; };
    pdl_wait();
    int t = blockIdx.y, i = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= cols) return;
    float acc[V] = {};
#pragma unroll 4   /* four rows' loads in flight at once, not one round trip after another */
    for (int k = 0; k < K; k++) {
        float w = wt[(size_t)t * K + k];
        Piece p = *(const Piece *)(y + (size_t)row_of[(size_t)t * K + k] * ldy + i);
#pragma unroll
        for (int j = 0; j < V; j++) acc[j] += w * (float)p.v[j];
    }
    float *o = out + (size_t)t * ldo + i;
    if constexpr (V == 1) {
        *o = add ? *o + acc[0] : acc[0];
    } else {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            if (add) {
                float4 b = *(const float4 *)(o + j);
                acc[j] += b.x, acc[j + 1] += b.y, acc[j + 2] += b.z, acc[j + 3] += b.w;
            }
            store4(o + j, acc[j], acc[j + 1], acc[j + 2], acc[j + 3]);
        }
    }
}

/* A 16-byte piece of a quantized row (FP8: 16 elements, NVFP4: 32 with their two block scales bs) as
 * bf16, times the row's scale s, in mat_elem's order (the same value before rounding): fmt_per / 8
 * pieces of 8 bf16 into o; the elements from `valid` on are zeros. */
template <int FMT> __device__ __forceinline__ void dequant_piece(uint4 w, const uint8_t *bs, float s, int valid, uint4 *o) {
    constexpr int per = fmt_per(FMT);
    uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j0 = 0; j0 < per; j0 += 8) {
        float v[8];
#pragma unroll
        for (int j = j0; j < j0 + 8; j++) {
            unsigned b = u[j * 16 / per / 4] >> (j * 16 / per % 4 * 8) & 0xFF;   /* the byte holding element j */
            float x = FMT == DT_FP8 ? e4m3f(b) * s : e2m1f(j & 1 ? b >> 4 : b & 15) * (e4m3f(bs[j / 16]) * s);
            v[j - j0] = j < valid ? x : 0.0f;
        }
        __nv_bfloat162 h[4] = {__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3]),
                               __floats2bfloat162_rn(v[4], v[5]), __floats2bfloat162_rn(v[6], v[7])};
        o[j0 / 8] = *(const uint4 *)h;
    }
}

/* A prompt's product with a quantized matrix runs on the tensor cores in bf16: rows r0 .. r0 +
 * gridDim.y of W, dequantized (scale included), out[i][k] = bf16(W[r0 + i][k]) (ldo a multiple of 8).
 * A thread a 16-byte piece of a row: one load, 16-byte stores. */
template <int FMT> __global__ void dequant_kernel(bf16 *out, int ldo, const GMat W, int r0) {
    constexpr int per = fmt_per(FMT);
    pdl_wait();
    size_t row = (size_t)r0 + blockIdx.y;
    int c = blockIdx.x * blockDim.x + threadIdx.x, k0 = c * per;
    if (k0 >= W.cols) return;
    const char *p = (const char *)W.w + row * row_bytes(FMT, W.ld);
    const uint8_t *bs = FMT == DT_NVFP4 ? W.bs + row * (W.ld / 16) : NULL;
    bf16 *o = out + (size_t)blockIdx.y * ldo + k0;
    if (k0 + per > W.cols) {   /* the row's last, partial piece */
        for (int k = k0; k < W.cols; k++) o[k - k0] = __float2bfloat16(mat_elem(W, row, k));
        return;
    }
    dequant_piece<FMT>(*((const uint4 *)p + c), bs ? bs + k0 / 16 : NULL, W.rs[row], per, (uint4 *)o);
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: a prompt's expert products, every expert in one grouped product
 * ---------------------------------------------------------------------------------------------- */

/* A block computes one tile: MG_BM rows of the inputs (pairs of one expert) by MG_BN rows of that
 * expert's matrix, walking K MG_BK elements (128 bytes of bf16) a step. On Hopper, wgmma multiplies
 * the tiles from shared memory: each of the two warpgroups 64 rows of the inputs by the 128 W rows
 * (m64n128k16, fp32 accumulators in registers); other builds run mma.sync on the same tiles, each warp
 * 16 rows by 128, with the accumulators laid out the same. cp.async copies step s + MG_STAGES - 1
 * while step s computes, pieces past K or past the last row zero-filled; the inputs' rows are gathered
 * by token (tok) as they are copied. Tiles lie as wgmma's 128-byte swizzle reads them (sw128), which
 * also keeps ldmatrix's 8 rows in different banks. FP8 and NVFP4 rows are copied as stored (64 or 32
 * bytes a row a step) and dequantized into one bf16 tile before the step's products. */
enum { MG_BN = 128, MG_BK = 64, MG_THREADS = 256, MG_STAGES = 3 };

/* The grouped product: out[r][j] = epi(sum_k a[src r][k] W[e n + j][k]) for the rows r of every
 * expert e (off[e] .. off[e + 1] - 1) and j < n, src r = tok[r] (tok NULL: r); epi: relu(.)^2 (relu2)
 * or nothing, written in a's dtype: bf16 (a bf16 prompt's up and down products), fp32 for fp32 W. */
typedef struct {
    GMat W;                     /* [E * n, cols] every expert's matrix, expert e's rows from e * n */
    const void *a;              /* [., lda] inputs: bf16, or fp32 for fp32 W */
    const int *tok;             /* [pairs] the input row of each row of the product, or NULL */
    void *out;                  /* [pairs, ldo] */
    int lda, ldo;               /* row strides, elements (bf16 a: lda a multiple of 8) */
    int n, relu2;               /* rows of one expert's matrix; the epilogue */
    const int *off, *tile;      /* [E + 1] each expert's first row of a, its first row tile (moe_sort_kernel) */
    int E;
} MoeGemm;

/* Stored bytes of a W row a step, and shared memory of moe_gemm_kernel<F>: the stages (inputs, then
 * W's rows), for quantized W the bf16 tile it is dequantized into, and room to align to 1024 bytes. */
static __host__ __device__ constexpr int mg_wstep(int F) { return F == DT_BF16 ? 128 : F == DT_FP8 ? 64 : 32; }
static __host__ __device__ constexpr size_t mg_stage(int F) { return (size_t)MG_BM * 128 + (size_t)MG_BN * mg_wstep(F); }
static constexpr size_t mg_smem(int F) { return MG_STAGES * mg_stage(F) + (F != DT_BF16) * (size_t)MG_BN * 128 + 1024; }

/* Makes this thread's shared-memory writes (cp.async's too) visible to wgmma's reads (the async proxy). */
__device__ __forceinline__ void fence_async_smem() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

/* Byte offset of 16-byte piece c of row r in a tile of 128-byte rows, 128-byte swizzled: the pieces
 * of each row permuted by its index mod 8 (the tile 1024-byte aligned). */
__device__ __forceinline__ int sw128(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

/* The expert of row tile bt: the last e with tile[e] <= bt. */
__device__ __forceinline__ int tile_expert(const MoeGemm &p, int bt) {
    int e = 0;
    for (int hi = p.E; hi - e > 1;) {
        int mid = (e + hi) / 2;
        if (p.tile[mid] <= bt) e = mid; else hi = mid;
    }
    return e;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* wgmma's descriptor of a tile of 128-byte rows, 128-byte swizzled: start address, groups of 8 rows
 * 1024 bytes apart, swizzle mode 1. A k16 slice further along the rows starts 32 bytes on. */
__device__ __forceinline__ uint64_t wg_desc(const void *p) {
    return (uint64_t)(smem_u32(p) >> 4 & 0x3FFF) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

/* d[64x128] += a[64x16] b[128x16]^T, both from shared memory (descriptors), a warpgroup's. */
__device__ __forceinline__ void wgmma_m64n128(float (&d)[64], uint64_t a, uint64_t b) {
    asm volatile("{.reg .pred p; setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(a), "l"(b), "r"(1));
}

/* Keeps the compiler from moving accumulator reads or writes across the asynchronous products. */
__device__ __forceinline__ void wg_fence_acc(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}
#endif

template <int F> __global__ void __launch_bounds__(MG_THREADS, 2) moe_gemm_kernel(const __grid_constant__ MoeGemm p) {
    constexpr int Q = F != DT_BF16, WS = mg_wstep(F), PQ = Q ? MG_BN * WS / 16 / MG_THREADS : 0;   /* stored pieces a thread */
    constexpr size_t STAGE = mg_stage(F);
    extern __shared__ char mg_raw[];
    char *sm = (char *)(((uintptr_t)mg_raw + 1023) & ~(uintptr_t)1023);
    int tid = threadIdx.x, wg = tid >> 7, warp = tid >> 5 & 3, lane = tid & 31, pc = tid & 7;
    pdl_wait();
    int bt = blockIdx.y;
    if (bt >= p.tile[p.E]) return;
    int e = tile_expert(p, bt), r0 = p.off[e] + (bt - p.tile[e]) * MG_BM, rend = p.off[e + 1], j0 = blockIdx.x * MG_BN, K = p.W.cols;
    const GMat &W = p.W;
    size_t wb = row_bytes(F, W.ld);
    const char *w0 = (const char *)W.w + ((size_t)e * p.n + j0) * wb;   /* the tile's first row */
    /* this thread copies piece pc of rows tid / 8 + 32 i (i < 4) of the inputs and, bf16, of W; their
       addresses once (NULL: past the last row) */
    const bf16 *arow[4];
    const char *wrow[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = r0 + (tid >> 3) + 32 * i, j = (tid >> 3) + 32 * i;
        arow[i] = r < rend ? (const bf16 *)p.a + (size_t)(p.tok ? p.tok[r] : r) * p.lda : NULL;
        wrow[i] = j0 + j < p.n ? w0 + j * wb : NULL;
    }
    /* quantized: this thread copies and dequantizes stored pieces qh PQ .. qh PQ + PQ - 1 of row qr
       (FP8 16 elements a piece, NVFP4 32), with the row's scale and (NVFP4) the step's block scales */
    int qr = tid >> 1, qh = tid & 1;
    const char *qrow = Q && j0 + qr < p.n ? w0 + qr * wb : NULL;
    float rs = qrow ? W.rs[(size_t)e * p.n + j0 + qr] : 0.0f;
    const uint8_t *bsrow = F == DT_NVFP4 && qrow ? W.bs + ((size_t)e * p.n + j0 + qr) * (W.ld / 16) : NULL;
    auto copy = [&](int s) {
        char *st = sm + (s % MG_STAGES) * STAGE, *sw = st + MG_BM * 128;
        int k = s * MG_BK + pc * 8, nb = max(0, min(16, 2 * (K - k)));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = (tid >> 3) + 32 * i;
            cp_async16z(st + sw128(r, pc), arow[i] && nb ? arow[i] + k : p.a, arow[i] ? nb : 0);
            if constexpr (!Q) cp_async16z(sw + sw128(r, pc), wrow[i] && nb ? wrow[i] + 2 * k : W.w, wrow[i] ? nb : 0);
        }
        if constexpr (Q) {
#pragma unroll
            for (int q = 0; q < PQ; q++) {
                int pi = qh * PQ + q, kq = s * MG_BK + pi * fmt_per(F);
                bool in = qrow && kq < K;
                cp_async16z(sw + qr * WS + pi * 16, in ? qrow + kq / fmt_per(F) * 16 : W.w, in ? 16 : 0);
            }
        }
    };
    float acc[64] = {};   /* element j * 4 + h: row 16 warp + lane / 4 + 8 (h / 2), column 8 j + 2 (lane % 4) + h % 2 */
    int steps = cdiv(K, MG_BK);
    for (int s = 0; s < MG_STAGES - 1; s++) {
        if (s < steps) copy(s);
        cp_async_commit();
    }
    for (int s = 0; s < steps; s++) {
        uint8_t bsv[2] = {0, 0};
        int kb = s * MG_BK + qh * 32;   /* NVFP4: the first element of this thread's piece */
        if (F == DT_NVFP4 && bsrow && kb < K) bsv[0] = bsrow[kb / 16], bsv[1] = bsrow[kb / 16 + 1];
        cp_async_wait<MG_STAGES - 2>();
        fence_async_smem();
        __syncthreads();   /* step s has landed for every thread; every warp is done with step s - 1 */
        if (s + MG_STAGES - 1 < steps) copy(s + MG_STAGES - 1);
        cp_async_commit();
        const char *st = sm + (s % MG_STAGES) * STAGE, *sw = st + MG_BM * 128;
        if constexpr (Q) {   /* W's stored bytes of this step into the bf16 tile after the stages */
            char *wq = sm + MG_STAGES * STAGE;
#pragma unroll
            for (int q = 0; q < PQ; q++) {
                int pi = qh * PQ + q, k = s * MG_BK + pi * fmt_per(F);
                uint4 o[fmt_per(F) / 8];
                dequant_piece<F>(*(const uint4 *)(sw + qr * WS + pi * 16), bsv, rs, qrow ? K - k : 0, o);
#pragma unroll
                for (int c = 0; c < fmt_per(F) / 8; c++) *(uint4 *)(wq + sw128(qr, pi * fmt_per(F) / 8 + c)) = o[c];
            }
            fence_async_smem();
            __syncthreads();
            sw = wq;
        }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        uint64_t da = wg_desc(st + wg * 64 * 128), db = wg_desc(sw);
        wg_fence_acc(acc);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int k = 0; k < MG_BK / 16; k++) wgmma_m64n128(acc, da + 2 * k, db + 2 * k);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        wg_fence_acc(acc);
#else
        int ar = wg * 64 + warp * 16 + (lane & 15);
#pragma unroll
        for (int k = 0; k < MG_BK / 16; k++) {
            uint32_t af[4];
            ldsm_x4<false>(af, (const bf16 *)(st + sw128(ar, 2 * k + (lane >> 4))));
#pragma unroll
            for (int n = 0; n < 8; n++) {
                uint32_t bf[4];
                ldsm_x4<false>(bf, (const bf16 *)(sw + sw128(n * 16 + (lane >> 4) * 8 + (lane & 7), 2 * k + (lane >> 3 & 1))));
                mma_bf16(*(float(*)[4])&acc[8 * n], af, bf[0], bf[1]);
                mma_bf16(*(float(*)[4])&acc[8 * n + 4], af, bf[2], bf[3]);
            }
        }
#endif
    }
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++) {
            int r = r0 + wg * 64 + warp * 16 + (lane >> 2) + 8 * h2, c = j0 + 8 * j + 2 * (lane & 3);
            if (r >= rend || c >= p.n) continue;
            float v0 = acc[4 * j + 2 * h2], v1 = acc[4 * j + 2 * h2 + 1];
            bool two = c + 1 < p.n;
            if (p.relu2) v0 = fmaxf(v0, 0.0f) * fmaxf(v0, 0.0f), v1 = fmaxf(v1, 0.0f) * fmaxf(v1, 0.0f);
            bf16 *o = (bf16 *)p.out + (size_t)r * p.ldo + c;
            if (two) *(__nv_bfloat162 *)o = __floats2bfloat162_rn(v0, v1); else *o = __float2bfloat16(v0);
        }
}

/* The same for fp32 W (fp32 checkpoints: the test fixtures), in fp32: a thread an output column j. */
__global__ void __launch_bounds__(MG_BN) moe_gemm_f32_kernel(const __grid_constant__ MoeGemm p) {
    pdl_wait();
    int bt = blockIdx.y, j = blockIdx.x * MG_BN + threadIdx.x;
    if (bt >= p.tile[p.E] || j >= p.n) return;
    int e = tile_expert(p, bt), r0 = p.off[e] + (bt - p.tile[e]) * MG_BM, rend = min(r0 + MG_BM, p.off[e + 1]);
    const float *w = (const float *)p.W.w + ((size_t)e * p.n + j) * p.W.ld;
    for (int r = r0; r < rend; r++) {
        const float *a = (const float *)p.a + (size_t)(p.tok ? p.tok[r] : r) * p.lda;
        float v = 0;
        for (int k = 0; k < p.W.cols; k++) v += a[k] * w[k];
        if (p.relu2) v = fmaxf(v, 0.0f) * fmaxf(v, 0.0f);
        ((float *)p.out)[(size_t)r * p.ldo + j] = v;
    }
}

/* ------------------------------------------------------------------------------------------------
 * Kernels: sampling on the GPU, so only the token id crosses to the host
 * ---------------------------------------------------------------------------------------------- */

/* The top-p bisection's candidates that shared memory holds (dynamic, 160 KB); with more, it reads
 * the whole vocabulary on each of its 40 passes. */
enum { SAMPLE_CAND = 40960 };

/* The first maximum of l[0..V) (max: its value), over a block of 1024 threads; -1 where a logit is NaN
 * or infinite. */
__device__ int block_argmax(const float *l, int V, float *max) {
    __shared__ float sv[1024];
    __shared__ int si[1024];
    int tid = threadIdx.x, bi = V, bad = 0;
    float best = -INFINITY;
    for (int i = tid; i < V; i += 1024) {
        bad |= !isfinite(l[i]);
        if (l[i] > best) { best = l[i]; bi = i; }
    }
    sv[tid] = best; si[tid] = bi;
    if (__syncthreads_or(bad)) return -1;
    for (int o = 512; o; o >>= 1) {
        if (tid < o && (sv[tid + o] > sv[tid] || (sv[tid + o] == sv[tid] && si[tid + o] < si[tid]))) {
            sv[tid] = sv[tid + o]; si[tid] = si[tid + o];
        }
        __syncthreads();
    }
    *max = sv[0];
    return si[0];
}

/* The same rule as sample_logits() in nemoh.c: argmax at temp 0 (first on ties); else probabilities
 * p_i ~ exp((l_i - max) / temp), the top-p threshold by bisection, and a draw in index order with
 * coin(seed, step). Block j of 1024 threads draws from row j: out[j] from l[j], with scratch p[j] and
 * coin(seed, step + j). Passes where order does not matter are strided over
 * the vocabulary; where it does (gathering candidates, the draw), warp w owns the w-th contiguous
 * range and walks it 32 elements at a time, a lane each, so the loads stay coalesced.
 * Every threshold the bisection tries lies above (1 - topp) total / (2V): at or below
 * tau0 = (1 - topp) total / V, the tokens under it hold less than (1 - topp) total, so the test
 * passes there, and a tried threshold is at least half of one that failed. So only p_i >= tau0 / 4
 * ever count; they are gathered into shared memory, in index order, once, and the 40 passes read
 * those instead of the vocabulary. */
__global__ void __launch_bounds__(1024) sample_kernel(int *out, const float *l, float *p, int V, float temp, float topp,
                                                     uint64_t seed, uint64_t step) {
    pdl_wait();
    out += blockIdx.x;
    l += (size_t)blockIdx.x * V;
    p += (size_t)blockIdx.x * V;
    step += blockIdx.x;
    extern __shared__ float cand[];   /* [SAMPLE_CAND] */
    __shared__ double sd[32];
    __shared__ int sn[33];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int span = (V + 31) / 32, w0 = min(V, warp * span), w1 = min(V, w0 + span);   /* this warp's range */
    float mx;
    int arg = block_argmax(l, V, &mx);
    if (arg < 0 || temp <= 0) { if (tid == 0) *out = arg; return; }   /* -1: a NaN or Inf logit, the host stops */
    double tot = 0;
    for (int i = tid; i < V; i += 1024) tot += p[i] = expf((l[i] - mx) / temp);
    double total = block_sum(tot);   /* its barriers also make p visible to the whole block */
    float lo = 0, hi = 1;
    if (topp < 1) {
        const float *q = p;   /* what the bisection reads: the vocabulary, or the candidates */
        int n = V;
        float tau = (float)((1 - topp) * total / V / 4);
        int cnt = 0;
        for (int i = w0 + lane; i < w1; i += 32) cnt += p[i] >= tau;
        cnt = warp_sum(cnt);
        if (lane == 0) sn[warp] = cnt;
        __syncthreads();
        if (tid == 0) {   /* exclusive prefix of the warps' counts; sn[32] = all */
            int run = 0;
            for (int k = 0; k < 32; k++) { int c = sn[k]; sn[k] = run; run += c; }
            sn[32] = run;
        }
        __syncthreads();
        if (sn[32] <= SAMPLE_CAND) {
            int at = sn[warp];
            for (int i0 = w0; i0 < w1; i0 += 32) {
                int i = i0 + lane, keep = i < w1 && p[i] >= tau;
                unsigned m = __ballot_sync(0xffffffffu, keep);
                if (keep) cand[at + __popc(m & ((1u << lane) - 1))] = p[i];
                at += __popc(m);
            }
            __syncthreads();
            q = cand;
            n = sn[32];
        }
        for (int it = 0; it < 40; it++) {
            float mid = 0.5f * (lo + hi);
            double m = 0;
            for (int i = tid; i < n; i += 1024) m += q[i] >= mid ? q[i] : 0;
            if (block_sum(m) >= topp * total) lo = mid; else hi = mid;
        }
    }
    /* the draw: the kept mass of each warp's range, then the warp whose range holds the target
       walks it with a running sum, 32 at a time */
    double mine = 0;
    for (int i = w0 + lane; i < w1; i += 32) mine += p[i] >= lo ? p[i] : 0;
    mine = warp_sum(mine);
    if (lane == 0) sd[warp] = mine;
    __syncthreads();
    double before = 0, kept = 0;
    for (int k = 0; k < 32; k++) { if (k == warp) before = kept; kept += sd[k]; }
    double target = coin(seed, step) * kept, after = before + sd[warp];
    if (tid == 0) *out = arg;
    __syncthreads();
    if (sd[warp] > 0 && before <= target && target < after) {  /* none (rounding at the very end): the argmax stays */
        double cum = before;
        int pick = -1;
        for (int i0 = w0; i0 < w1; i0 += 32) {
            int i = i0 + lane;
            double v = i < w1 && p[i] >= lo ? p[i] : 0, run = v;
            for (int o = 1; o < 32; o <<= 1) {
                double u = __shfl_up_sync(0xffffffffu, run, o);
                if (lane >= o) run += u;
            }
            unsigned hit = __ballot_sync(0xffffffffu, v > 0 && cum + run > target), has = __ballot_sync(0xffffffffu, v > 0);
            if (hit) { pick = i0 + __ffs(hit) - 1; break; }
            if (has) pick = i0 + 31 - __clz(has);
            cum += __shfl_sync(0xffffffffu, run, 31);
        }
        if (lane == 0 && pick >= 0) *out = pick;
    }
}

/* A drafting step's acceptance, on the device, once sample_kernel has put the model's tokens t_0..t_{T-1}
 * in step[STEP_T..]: n := how many of the fed tokens tok[1..T) equal t_0, t_1, ... in a row, and the
 * recurrent state := kept slot n (words of it; the grid shares the copy). The last block to finish
 * (when every block has read tok) writes step[0] = n and the next MTP pass's inputs in io: tokens
 * t_0..t_{T-1} at the verify forward's position, x rows from 0, drafting row n. */
__global__ void accept_kernel(int *step, int *io, int T, unsigned *state, const unsigned *kept, size_t words) {
    pdl_wait();
    const int *tok = io + 3;
    int n = 0;
    while (n < T - 1 && tok[n + 1] == step[STEP_T + n]) n++;
    if (n < T - 1)
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
            state[i] = kept[n * words + i];
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd((unsigned *)&step[STEP_DONE], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    for (int i = threadIdx.x; i < T; i += blockDim.x) io[3 + i] = step[STEP_T + i];
    if (threadIdx.x == 0) step[0] = n, io[1] = 0, io[2] = n, step[STEP_DONE] = 0;
}

/* A draft (greedy: the first maximum of the drafting row's logits among ids below n, the last pass's
 * row at where it made every row's; -1 where those logits are not finite; rows V apart), and the
 * inputs of the pass after it in io: the drafting row's position + 1, x row that row, the draft as token:
 *   d = argmax l[all ? at : 0][0..n);  pos += at + 1;  row = at;  at = 0;  tok[0] = d */
__global__ void __launch_bounds__(1024) draft_kernel(int *draft, const float *l, int V, int n, int *io, int all) {
    pdl_wait();
    float mx;
    int at = io[2], d = block_argmax(l + (size_t)(all ? at : 0) * V, n, &mx);
    if (threadIdx.x) return;
    *draft = d;
    io[0] += at + 1, io[1] = at, io[2] = 0, io[3] = d;
}

/* ------------------------------------------------------------------------------------------------
 * Matrix products: our GEMV for one token, cuBLAS for a chunk of tokens
 * ---------------------------------------------------------------------------------------------- */

static int gemv_slots(int gpu) {
    int sms, per_sm;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, gpu));
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_kernel<DT_BF16, EPI_NONE, 1>, 32 * GEMV_WARPS, 0));
    return sms * per_sm;
}

/* Blocks of a one-token product over `rows` rows (quantized, q: QROWS rows a warp), wpr warps a
 * row, and how many the GPU holds at once (quantized: half, at 8 blocks an SM). */
static int gemv_blocks(const GpuRank *g, int rows, int q, int wpr, int *slots) {
    *slots = q ? g->gemv_slots / 2 : g->gemv_slots;
    return cdiv(rows, GEMV_WARPS / wpr * (q ? QROWS : 1));
}

/* Warps per row of a one-token product over `rows` rows of `bytes` each (q: quantized). Its blocks
 * run in waves, all the same work, so a last wave that is mostly empty leaves most SMs idle while it
 * runs; more warps a row make more, smaller blocks, but shorter streams, which are slower. Estimated
 * time, relative:
 *   (1 + idle / (2 waves)) * 1.08^log2(wpr),  idle = the empty part of the last wave
 * (both constants tuned on H200, on test_kernels' timings: for blocks of 2 warps they pick the
 * faster of 1 and 2 warps a row, or one within 2%, at every model shape measured); at least 8 KB a
 * warp. */
static int gemv_wpr(const GpuRank *g, int rows, size_t bytes, int q) {
    int best = 1;
    double best_t = INFINITY;
    for (int wpr = 1; wpr <= GEMV_WARPS; wpr *= 2) {
        if (wpr > 1 && bytes * (q ? QROWS : 1) / wpr < 8192) break;
        int slots, blocks = gemv_blocks(g, rows, q, wpr, &slots);
        double waves = (double)blocks / slots;
        double t = (1 + (ceil(waves) - waves) / (2 * waves)) * pow(1.08, log2(wpr));
        if (t < best_t) { best_t = t; best = wpr; }
    }
    return best;
}
static int gemv_wpr(const GpuRank *g, const GMat *W) { return gemv_wpr(g, W->rows, row_bytes(W->fmt, W->cols), quantized(W->fmt)); }

/* out[n][rows] = act[n][cols] W^T over n rows, act already in W's dtype (bf16 or fp32), fp32 out;
 * beta 1 adds to out. Row-major out[n][rows] = act[n][cols] W^T is column-major out^T = W^T(op T of
 * W's storage) act^T. */
static void blas_gemm(GpuRank *g, float *out, int ldo, const void *act, int lda, int n, const void *W, int bf, int rows, int cols,
                      int ld, float beta) {
    const float one = 1.0f;
    cudaDataType t = bf ? CUDA_R_16BF : CUDA_R_32F;
    CUBLAS_CHECK(cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one, W, t, ld, act, t, lda, &beta, out, CUDA_R_32F,
                              ldo, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* A prompt's input to a product with W: x itself for fp32 W; else bf16 (cuBLAS multiplies bf16 by
 * bf16): the norm's x16 if x is the norm's output, else x converted into act16. Its row stride into
 * *lda. */
static const void *gemm_input(GpuRank *g, const float *x, int ldx, int T, const GMat *W, int *lda) {
    *lda = ldx;
    if (!lowp(W)) return x;
    if (x == g->x) return g->x16;
    LAUNCH(T, 256, 0, g->stream, to_bf16_kernel<0>, g->act16, g->act_w, x, ldx, W->cols);
    *lda = g->act_w;
    return g->act16;
}

/* What deq holds: rows of a quantized matrix in bf16, dequantized for a prompt's products (64 MB:
 * the largest matrix of the published models in at most a few passes, and no full copy of any). */
enum { DEQ_BYTES = 64 << 20 };

/* out[n][rows] = act[n][cols] W[r0 .. r0 + rows)^T (beta 1: added to out) for n rows of act, which
 * gemm_input made (bf16, or fp32 for fp32 W): cuBLAS on the stored rows, or on a quantized
 * matrix's rows dequantized into deq, DEQ_BYTES at a time (weight-only: W8A16, W4A16). */
static void gemm_rows(GpuRank *g, float *out, int ldo, const void *act, int lda, int n, const GMat *W, int r0, int rows, float beta) {
    if (W->fmt == DT_F32 || W->fmt == DT_BF16) {
        blas_gemm(g, out, ldo, act, lda, n, (const char *)W->w + (size_t)r0 * row_bytes(W->fmt, W->ld), W->fmt == DT_BF16, rows,
                  W->cols, W->ld, beta);
        return;
    }
    int ldd = pad8(W->cols), step = std::max(1, (int)(DEQ_BYTES / 2 / ldd)), pieces = cdiv(W->cols, fmt_per(W->fmt));
    for (int i = 0; i < rows; i += step) {
        int nr = std::min(step, rows - i);
        LAUNCH(dim3(cdiv(pieces, 128), nr), 128, 0, g->stream, W->fmt == DT_FP8 ? dequant_kernel<DT_FP8> : dequant_kernel<DT_NVFP4>,
               g->deq, ldd, *W, r0 + i);
        blas_gemm(g, out + i, ldo, act, lda, n, g->deq, 1, nr, W->cols, ldd, beta);
    }
}

/* out = act W^T for T rows of act (see gemm_rows). */
static void gemm(GpuRank *g, float *out, int ldo, const void *act, int lda, int T, const GMat *W) {
    gemm_rows(g, out, ldo, act, lda, T, W, 0, W->rows, 0.0f);
}

/* The one-token product's kernel for a format and an epilogue, NT tokens a round. */
template <int FMT, int NT> static void (*gemv_for(int epi))(const GemvArgs) {
    if constexpr (FMT == DT_FP8)
        return epi == EPI_RELU2 ? gemv_q_kernel<FMT, EPI_RELU2, NT> : epi == EPI_GNORM ? gemv_q_kernel<FMT, EPI_GNORM, NT>
                                                                                     : gemv_q_kernel<FMT, EPI_NONE, NT>;
    else return epi == EPI_RELU2 ? gemv_kernel<FMT, EPI_RELU2, NT> : epi == EPI_GNORM ? gemv_kernel<FMT, EPI_GNORM, NT> : gemv_kernel<FMT, EPI_NONE, NT>;
}
/* ... for one token, or (several) for a few. */
template <int NT> static void (*gemv_for(int fmt, int epi))(const GemvArgs) {
    return fmt == DT_F32 ? gemv_for<DT_F32, NT>(epi) : fmt == DT_BF16 ? gemv_for<DT_BF16, NT>(epi) : gemv_for<DT_FP8, NT>(epi);
}
static void (*gemv_for(int fmt, int epi, int several))(const GemvArgs) {
    return several ? gemv_for<GEMV_TOKENS>(fmt, epi) : gemv_for<1>(fmt, epi);
}

/* Warps of an NVFP4 product's block (gemv_e2m1_kernel, the expert kernels) for rows of `spans` spans:
 * 8, or 2 for fewer than 32 (dense products: e2m1_gemv_warps). The Nano NVFP4 decode, whose
 * 2688-column rows (21 spans) took 10.5 to 11.8 us alone at 8, 4 or 2 warps on one H100, ran 2.10
 * to 2.12 ms/token at 2 against 2.18 to 2.19 at 4: in a decode step, small blocks fill the GPU
 * beside the kernels before and after them. */
static int e2m1_warps(int spans) { return spans >= 32 ? 8 : 2; }
/* Blocks of `warps` warps the GPU holds at once: as many warps an SM as the quantized kernels. */
static int e2m1_slots(const GpuRank *g, int warps) { return g->gemv_slots / 2 * GEMV_WARPS / warps; }
/* Warps of a dense NVFP4 product's block: e2m1_warps, but 4 for rows of fewer than 64 spans that fill
 * the GPU at 4 warps a block. On one H100 (--bench, twice, alternating) the 8B NVFP4, its in_proj and
 * up products (32 spans) at 4 instead of 8, decodes at 2.93 and 2.94 ms/token against 3.09 and 3.10;
 * Nano NVFP4, its in_proj (21 spans, 644 blocks) at 4 instead of 2, at 2.00 and 2.00 against 2.03 and
 * 2.03; with every product of 32 spans at 4, Nano NVFP4 (a 4096-column out_proj of 2688 rows, 168
 * blocks) slowed from 2.02 to 2.07: few blocks keep their 2 or 8 warps. */
static int e2m1_gemv_warps(const GpuRank *g, int rows, int spans) {
    return spans < 64 && cdiv(rows, E2M1_ROWS) >= e2m1_slots(g, 4) ? 4 : e2m1_warps(spans);
}
/* The tensor-core kernels for a block of `warps` warps (e2m1_warps; 4 as well for gemv,
 * e2m1_gemv_warps): the launch's 32 * warps threads must be the kernel's WARPS. */
static void (*e2m1_for(int epi, int warps))(const GemvArgs) {
    if (warps == 8) return epi == EPI_RELU2 ? gemv_e2m1_kernel<EPI_RELU2, 8> : epi == EPI_GNORM ? gemv_e2m1_kernel<EPI_GNORM, 8> : gemv_e2m1_kernel<EPI_NONE, 8>;
    if (warps == 4) return epi == EPI_RELU2 ? gemv_e2m1_kernel<EPI_RELU2, 4> : epi == EPI_GNORM ? gemv_e2m1_kernel<EPI_GNORM, 4> : gemv_e2m1_kernel<EPI_NONE, 4>;
    return epi == EPI_RELU2 ? gemv_e2m1_kernel<EPI_RELU2, 2> : epi == EPI_GNORM ? gemv_e2m1_kernel<EPI_GNORM, 2> : gemv_e2m1_kernel<EPI_NONE, 2>;
}
static void (*moe_up_e2m1_for(int warps))(float *, const int *, const float *, const MoeUp) {
    return warps == 8 ? moe_up_e2m1_kernel<8> : moe_up_e2m1_kernel<2>;
}
static void (*moe_down_e2m1_for(int warps))(float *, int, const int *, const MoeDown, const void *, size_t, int) {
    return warps == 8 ? moe_down_e2m1_kernel<8> : moe_down_e2m1_kernel<2>;
}

/* out[t][i] = sum_k W[i][k] x[t][k] for T rows (row strides ldo, ldx); epi applies relu^2, or in a
 * decoded step the group scale gs (EPI_GNORM). A decoded step's tokens (decoded) take the one-token
 * kernels, every row of out the one a one-token step computes; their last wave then warms L2 for
 * `next`, the product that follows. */
static void matmul(GpuRank *g, float *out, int ldo, const float *x, int ldx, int T, const GMat *W, int epi, const GMat *next,
                   const GroupScale *gs) {
    if (decoded(g, T) && (T == 1 || ldx % 4 == 0)) {   /* each token's x row 16-byte aligned, as the kernel reads it */
        int e2m1 = W->fmt == DT_NVFP4, warps = e2m1 ? e2m1_gemv_warps(g, W->rows, cdiv(W->cols, E2M1_SPAN)) : GEMV_WARPS, wpr = e2m1 ? 1 : gemv_wpr(g, W), slots;
        int blocks = e2m1 ? cdiv(W->rows, E2M1_ROWS) : gemv_blocks(g, W->rows, quantized(W->fmt), wpr, &slots);
        if (e2m1) slots = e2m1_slots(g, warps);
        GemvArgs a = {.out = out, .W = *W, .x = x, .T = T, .ldx = ldx, .ldo = ldo, .wpr = wpr, .warm = next ? next->w : NULL,
                      .warm_n = warm_bytes(next), .warm_from = blocks > slots ? blocks - slots : 0,
                      .gs = gs ? *gs : GroupScale{NULL, 0, 1, 0.0f, 0}};
        int rows_of_tokens = !e2m1 && T > 1 && gmat_bytes(W) <= TOKENS_Y_BYTES;   /* small: the one-token kernel, a token a row of blocks */
        LAUNCH(dim3(blocks, rows_of_tokens ? T : 1), 32 * warps, 0, g->stream,
               e2m1 ? e2m1_for(epi, warps) : gemv_for(W->fmt, epi, T > 1 && !rows_of_tokens), a);
        return;
    }
    int lda;
    const void *act = gemm_input(g, x, ldx, T, W, &lda);
    gemm(g, out, ldo, act, lda, T, W);
    if (epi == EPI_RELU2) {  /* over the T dense rows (only asked for with ldo == rows) */
        LAUNCH(cdiv((long)T * W->rows, 256), 256, 0, g->stream, relu2_kernel, out, (size_t)T * W->rows);
    }
}

/* ------------------------------------------------------------------------------------------------
 * The backend operations (see Backend in nemoh.h)
 * ---------------------------------------------------------------------------------------------- */

static GpuRank *gpu_rank(Rank *r) { return (GpuRank *)r->st; }

/* Whether this forward keeps each token's recurrent state (r->keep; only the model's own layers have one). */
static int keeping(const Rank *r) { return r->keep && r->pass == PASS_MAIN; }
static GpuShared *gpu_shared(Rank *r) { return (GpuShared *)r->sh; }

/* Most tokens a forward of this kind runs as decode does: a verify forward's (states kept) and an MTP
 * pass's dec_t, others 1 (a prompt's chunk runs as with --mtp 0). */
static int dec_limit(Rank *r) { return keeping(r) || r->pass == PASS_MTP ? gpu_rank(r)->dec_t : 1; }

/* The graph slot of this forward of T tokens, or NULL where it is not captured (graphs off, or a prompt). */
static cudaGraphExec_t *graph_at(Rank *r, int T) {
    if (!r->graph || (T > 1 && T > dec_limit(r))) return NULL;
    return &gpu_rank(r)->graph[((r->pass * (DECODE_T + 1) + T) * 2 + keeping(r)) * 2 + (r->all != 0)];
}

/* The forward's inputs onto the device (a graph reads them there) and the host's bookkeeping of it. No
 * tokens: the device has the inputs (accept_kernel or draft_kernel wrote them). */
static void step_start(Rank *r, const int *tok, int T, int pos) {
    GpuRank *g = gpu_rank(r);
    CUDA_CHECK(cudaSetDevice(r->gpu));
    if (keeping(r) && (r->spec < 1 || T > r->spec + 1)) {
        fprintf(stderr, "nemoh: keep: %d tokens, states kept for %d\n", T, r->spec > 0 ? r->spec + 1 : 0);
        exit(1);
    }
    if (tok) {
        int *io = g->host_io + g->io_ring + IO_ENTRY * g->ring;
        cudaEvent_t done = g->io_done[g->ring];
        g->ring = (g->ring + 1) % IO_RING;
        if (T > DECODE_T) {   /* a prompt's chunk: host_io's start, once the copy that last read it is done */
            CUDA_CHECK(cudaStreamSynchronize(g->stream));
            io = g->host_io;
        } else {
            CUDA_CHECK(cudaEventSynchronize(done));
        }
        io[0] = pos;
        io[1] = r->pass == PASS_MTP ? r->row : 0;
        io[2] = T - 1;
        memcpy(io + 3, tok, (size_t)T * sizeof(int));
        CUDA_CHECK(cudaMemcpyAsync(g->pos, io, (3 + T) * sizeof(int), cudaMemcpyHostToDevice, g->stream));
        CUDA_CHECK(cudaEventRecord(done, g->stream));
    }
    g->pend_slot = 0;
    g->dec_now = dec_limit(r);
    if (r->pass == PASS_MAIN) {   /* a main forward moves the states on: what was kept before is stale */
        g->kept_n = keeping(r) ? T : 0;
        g->kept_live = T - 1;
    }
}

/* Eager, or captured where this kind of forward has no graph yet (gpu_end then runs it). */
static void gpu_begin(Rank *r, const int *tok, int T, int pos) {
    GpuRank *g = gpu_rank(r);
    step_start(r, tok, T, pos);
    cudaGraphExec_t *e = graph_at(r, T);
    if (!e) return;
    CUDA_CHECK(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal));
    g->capturing = e;
}

static void gpu_end(Rank *r, int T) {
    (void)T;
    GpuRank *g = gpu_rank(r);
    if (!g->capturing) return;
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamEndCapture(g->stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(g->capturing, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaGraphLaunch(*g->capturing, g->stream));  /* the capture recorded the forward; now run it */
    g->capturing = NULL;
}

/* Replays this kind of forward's graph, if it has one. */
static int gpu_replay(Rank *r, const int *tok, int T, int pos) {
    GpuRank *g = gpu_rank(r);
    cudaGraphExec_t *e = graph_at(r, T);
    if (!e || !*e) return 0;
    step_start(r, tok, T, pos);
    CUDA_CHECK(cudaGraphLaunch(*e, g->stream));
    g->rows = r->all ? T : 1;
    return 1;
}

static void gpu_embed(Rank *r, const int *tok, int T) {
    (void)tok;  /* already on the device (gpu_begin), so a captured step reads the current token */
    GpuRank *g = gpu_rank(r);
    LAUNCH(dim3(cdiv(r->c->hidden, 256), T), 256, 0, g->stream, embed_kernel, g->res, (const GMat)g->embed, (const int *)g->tok, r->c->hidden);
}

/* pend_sum = sum over ranks of pend_owed; the next NORM_ADD adds it. */
static void pend_allreduce(Rank *r, int T) {
    GpuRank *g = gpu_rank(r);
    NCCL_CHECK(ncclAllReduce(g->pend_owed, g->pend_sum, (size_t)T * r->c->hidden, ncclFloat, ncclSum, gpu_shared(r)->comm[r->s.rank],
                             g->stream));
    g->pend_owed = g->pend_sum;
}

static void gpu_norm(Rank *r, int l, int how, int T) {
    GpuRank *g = gpu_rank(r);
    const Config *c = r->c;
    const float *w = l >= 0 ? g->L[l].norm : l == NORM_F ? g->norm_f : g->mtp_norm;
    bf16 *x16 = decoded(g, T) ? NULL : g->x16;   /* a prompt's products read x in bf16 */
    if (how == NORM_FUSED && g->pend.devapi) {
        size_t off = (size_t)g->pend_slot * r->t_max * c->hidden * sizeof(float);
        FusedArgs a = {.dev = g->pend.dev, .win = g->pend.win, .offset = off, .x = g->x, .res = g->res, .x16 = x16, .w = w, .T = T,
                       .hidden = c->hidden, .eps = c->eps};
        fused_allreduce_norm(g->stream, a);
        g->pend_slot ^= 1;
        return;
    }
    if (how == NORM_FUSED) {  /* fallback: a plain all-reduce, then the add and the norm */
        pend_allreduce(r, T);
        g->pend_slot ^= 1;
    }
    LAUNCH(T, NORM_THREADS, 0, g->stream, rmsnorm_kernel, g->x, x16, g->res, how == NORM_PLAIN ? NULL : g->pend_owed, w, c->hidden,
           c->eps);
}

static void gpu_allreduce(Rank *r, int T) {
    if (r->s.n > 1) pend_allreduce(r, T);
    gpu_rank(r)->pend_slot ^= 1;
}

/* Layer l's first product: what the product before it warms L2 for. */
static const GMat *first_product(GpuRank *g, const Config *c, int l) {
    return c->kind[l] == K_MAMBA ? &g->L[l].in_proj : c->kind[l] == K_ATTN ? &g->L[l].qkv : c->kind[l] == K_MOE ? &g->L[l].sup : &g->L[l].up;
}

/* The product after layer l's: the next layer's first, or lm_head after the last block and after the
 * MTP block's last sublayer. */
static const GMat *next_product(GpuRank *g, const Config *c, int l) {
    return l + 1 == c->n_layers || l + 1 >= n_all(c) ? &g->lm_head : first_product(g, c, l + 1);
}

/* Where the current mixer writes its partial sums: slot pend_slot, which the next norm adds. */
static float *pend_out(Rank *r) {
    GpuRank *g = gpu_rank(r);
    float *p = g->pend.buf + (size_t)g->pend_slot * r->t_max * r->c->hidden;
    g->pend_owed = p;
    return p;
}

/* residual[t] = eh_proj([enorm(embed[tok[t]]) ; hnorm(x[row + t])]): x as the last forward's final
 * norm left it, read before anything of this step writes it (stream order). */
static void gpu_mtp_in(Rank *r, const int *tok, int T, int row) {
    GpuRank *g = gpu_rank(r);
    const Config *c = r->c;
    int H = c->hidden;
    /* the tokens are on the device (step_start); fed none, so is the row (at most spec: accept_kernel, draft_kernel) */
    if (tok && (row < 0 || row + T > r->t_max)) { fprintf(stderr, "nemoh: mtp_in: rows %d..%d of %d\n", row, row + T - 1, r->t_max); exit(1); }
    LAUNCH(dim3(T, 2), NORM_THREADS, 0, g->stream, mtp_in_kernel, g->eh, (const GMat)g->embed, (const int *)g->tok, (const float *)g->x,
           (const int *)g->pos + 1, (const float *)g->enorm, (const float *)g->hnorm, H, c->eps);
    matmul(g, g->res, H, g->eh, 2 * H, T, &g->eh_proj, EPI_NONE, first_product(g, c, c->n_layers), NULL);
}

/* Where the state at `live` (a layer's conv_st or ssm) is kept after token 0 with r->keep; the slot
 * of token t is snap_bytes further on per token. */
static float *kept_at(GpuRank *g, float *live) { return (float *)(g->kept + ((char *)live - g->state)); }

static void gpu_mamba(Rank *r, int l, int T, int pos) {
    (void)pos;
    GpuRank *g = gpu_rank(r);
    GLayer *L = &g->L[l];
    const Config *c = r->c;
    const Shard *s = &r->s;
    int H = c->hidden, di = s->d_inner, cv = s->conv, in = s->in_proj, N = c->d_state;
    size_t slot = g->snap_bytes / sizeof(float);   /* floats between two kept states */
    matmul(g, g->proj, in, g->x, H, T, &L->in_proj, EPI_NONE, &L->out, NULL);
    LAUNCH(dim3(cdiv(cv, 128), cdiv(T, CONV_STEPS)), 128, 0, g->stream, conv_kernel, g->xbc, g->proj + di, in, L->conv_st, L->conv_w,
           L->conv_b, T, cv, keeping(r) ? kept_at(g, L->conv_st) : NULL, slot);
    if (T > CONV_STEPS) {
        LAUNCH(cdiv(cv, 128), 128, 0, g->stream, conv_state_kernel, L->conv_st, g->proj + di, in, T, cv);
    }
    int gsize = di / s->groups, dec = decoded(g, T), fold = gnorm_folds(dec, s->m_heads, c->m_hdim, N, gsize, gnorm_unit(L->out.fmt));
    ScanArgs sa = {.y = g->y, .ssm = L->ssm, .xbc = g->xbc, .proj = g->proj, .ld_proj = in, .dt_off = di + cv, .A = L->A, .D = L->D,
                   .dt_bias = L->dt_bias, .T = T, .heads = s->m_heads, .hdim = c->m_hdim, .groups = s->groups, .d_inner = di,
                   .chunk = 0, .warm = L->out.w, .warm_n = dec ? warm_bytes(&L->out) : 0, .gw = fold ? L->gnorm : NULL,
                   .gss = fold ? g->gss : NULL, .keep = keeping(r) ? kept_at(g, L->ssm) : NULL, .keep_step = slot};
    /* a prompt of a bf16 model: the chunked scan; fp32 models, decoded steps and steps whose states are
       kept, the exact one */
    if (!dec && lowp(&L->in_proj) && !keeping(r)) ssd_scan(g->stream, sa, N);
    else ssm_scan(g->stream, sa, N);
    GroupScale gs = {g->gss, s->m_heads / s->groups * scan_blocks(c->m_hdim, N), gsize, c->eps,
                     (size_t)s->m_heads * scan_blocks(c->m_hdim, N)};
    if (!dec && lowp(&L->out)) {   /* a bf16 prompt: the gated norm writes out_proj's bf16 input itself */
        gated_norm(g->stream, g->act16, g->act_w, g->y, g->proj, in, L->gnorm, T, di, gsize, c->eps);
        gemm(g, pend_out(r), H, g->act16, g->act_w, T, &L->out);
        return;
    }
    if (!fold) {
        gated_norm(g->stream, g->y, di, g->y, g->proj, in, L->gnorm, T, di, gsize, c->eps);
    }
    matmul(g, pend_out(r), H, g->y, di, T, &L->out, fold ? EPI_GNORM : EPI_NONE, next_product(g, c, l), &gs);
}

/* The attention after the qkv product, on the cache of dtype KT: append, then a query a token
 * (decoded) or a prompt chunk (local query heads k * gl .. (k + 1) * gl - 1 read local kv head k). */
template <typename KT> static void attend(Rank *r, GLayer *L, KT *kc, KT *vc, int T, int pos) {
    GpuRank *g = gpu_rank(r);
    const Config *c = r->c;
    const Shard *s = &r->s;
    int hd = c->head_dim, qw = s->q * hd, kw = s->kv * hd, w = qw + 2 * kw, group = c->n_heads / c->n_kv;
    float scale = 1.0f / sqrtf((float)hd);
    LAUNCH(T, 256, 0, g->stream, kv_append_kernel<KT>, kc, vc, g->proj, w, qw, kw, g->pos);
    if (decoded(g, T)) {   /* token t as a one-token step at pos + t */
        AttnArgs<KT> a = {.part = g->part, .q = g->proj, .ldq = w, .kc = kc, .vc = vc, .pos = g->pos, .kw = kw, .hd = hd, .group = group,
                          .q0 = s->q0, .kv0 = s->kv0, .scale = scale, .splits = g->splits, .warm = L->o.w,
                          .warm_n = warm_bytes(&L->o)};
        attn_decode(g->stream, a, s->q, T);
        LAUNCH(dim3(s->q, T), 128, 0, g->stream, attn_combine_kernel, g->y, g->part, g->pos, hd, g->splits);
    } else {
        PromptAttnArgs<KT> a = {.y = g->y, .q = g->proj, .kc = kc, .vc = vc, .ldy = qw, .ldq = w, .kw = kw, .hd = hd,
                                .gl = s->q / s->kv, .T = T, .pos = pos, .scale = scale};
        attn_prompt(g->stream, a, s->kv);
    }
}

static void gpu_attention(Rank *r, int l, int T, int pos) {
    GpuRank *g = gpu_rank(r);
    GLayer *L = &g->L[l];
    const Config *c = r->c;
    int H = c->hidden, qw = r->s.q * c->head_dim, w = qw + 2 * r->s.kv * c->head_dim;
    matmul(g, g->proj, w, g->x, H, T, &L->qkv, EPI_NONE, &L->o, NULL);
    if (lowp(&L->qkv)) attend(r, L, (bf16 *)L->k, (bf16 *)L->v, T, pos);
    else attend(r, L, (float *)L->k, (float *)L->v, T, pos);
    matmul(g, pend_out(r), H, g->y, qw, T, &L->o, EPI_NONE, next_product(g, c, l), NULL);
}

/* out = down relu(up x)^2 for T tokens of x (an MLP layer, a shared expert); decoded, down's last
 * wave warms L2 for `next`. A bf16 prompt applies relu^2 as it converts up's output for down. */
static void relu2_mlp(GpuRank *g, float *out, int ldo, const float *x, int ldx, int T, const GMat *up, const GMat *down,
                      const GMat *next) {
    if (!decoded(g, T) && lowp(up)) {
        int lda;
        const void *a = gemm_input(g, x, ldx, T, up, &lda);
        gemm(g, g->proj, up->rows, a, lda, T, up);
        LAUNCH(T, 256, 0, g->stream, to_bf16_kernel<1>, g->act16, g->act_w, (const float *)g->proj, up->rows, up->rows);
        gemm(g, out, ldo, g->act16, g->act_w, T, down);
        return;
    }
    matmul(g, g->proj, up->rows, x, ldx, T, up, EPI_RELU2, down, NULL);
    matmul(g, out, ldo, g->proj, up->rows, T, down, EPI_NONE, next, NULL);
}

static void gpu_mlp(Rank *r, int l, int T) {
    GpuRank *g = gpu_rank(r);
    GLayer *L = &g->L[l];
    relu2_mlp(g, pend_out(r), r->c->hidden, g->x, r->c->hidden, T, &L->up, &L->down, next_product(g, r->c, l));
}

/* ---- the mixture-of-experts layer ---- */

/* One MoE layer's sizes on this rank. */
typedef struct {
    int E, K;                   /* routed experts, chosen a token */
    int m, S;                   /* this rank's rows of each routed expert's up_proj, of the shared expert's */
    int H, lat, d;              /* hidden; latent (0: none); the routed experts' input width (lat or H) */
} MoeShape;

static MoeShape moe_shape(const Rank *r) {
    const Config *c = r->c;
    MoeShape ms = {c->n_experts, c->top_k, r->s.moe, r->s.shared, c->hidden, c->latent, c->latent ? c->latent : c->hidden};
    return ms;
}

/* moe_idx, moe_w = the choice for each of the T tokens of x: decoded, one launch; for a prompt the
 * logits by cuBLAS (fp32), then a block a token. */
static void moe_choose(GpuRank *g, const GLayer *L, const MoeShape *ms, MoeRoute rt, int T) {
    if (decoded(g, T)) {
        LAUNCH(ms->E, ROUTE_THREADS, 0, g->stream, moe_route_kernel, g->moe_idx, g->moe_w, g->moe_logits, g->moe_done,
               (const float *)L->gate, (const float *)L->gate_bias, (const float *)g->x, ms->H, T, rt);
        return;
    }
    blas_gemm(g, g->moe_logits, ms->E, g->x, ms->H, T, L->gate, 0, ms->E, ms->H, ms->H, 0.0f);
    LAUNCH(T, ROUTE_THREADS, 0, g->stream, moe_select_kernel, g->moe_idx, g->moe_w, (const float *)g->moe_logits,
           (const float *)L->gate_bias, rt);
}

/* The routed sum of a prompt's pairs y (fp32, or bf16) in token order: added to out, or the latent sum. */
template <typename YT> static void moe_combine(GpuRank *g, const MoeShape *ms, int T, const YT *y, float *out) {
    constexpr int V = 16 / sizeof(YT);
    float *o = ms->lat ? g->moe_ylat : out;
    int vec = ms->d % V == 0 && ((uintptr_t)o | (uintptr_t)y) % 16 == 0;
    LAUNCH(dim3(cdiv(ms->d, 128 * (vec ? V : 1)), T), 128, 0, g->stream, vec ? moe_combine_kernel<YT, V> : moe_combine_kernel<YT, 1>, o,
           ms->d, ms->lat ? 0 : 1, y, ms->d, (const int *)g->moe_row, (const float *)g->moe_w, ms->K, ms->d);
}

/* The expert kernels for a format class, NT tokens a round (NVFP4 alone: moe_up_e2m1_kernel and
 * moe_down_e2m1_kernel; with other formats, FMT_ANY's). */
template <int NT> static void (*moe_up_for(int f))(float *, const int *, const float *, const MoeUp) {
    return f == DT_F32 ? moe_up_kernel<DT_F32, NT> : f == DT_BF16 ? moe_up_kernel<DT_BF16, NT> : f == DT_FP8 ? moe_up_kernel<DT_FP8, NT>
         : moe_up_kernel<FMT_ANY, NT>;
}
template <int NT> static void (*moe_down_for(int f))(float *, int, const int *, const MoeDown, int, const void *, size_t, int) {
    return f == DT_F32 ? moe_down_kernel<DT_F32, NT> : f == DT_BF16 ? moe_down_kernel<DT_BF16, NT> : f == DT_FP8 ? moe_down_kernel<DT_FP8, NT>
         : moe_down_kernel<FMT_ANY, NT>;
}

/* Launches the grouped product over every expert's pairs (MoeGemm): out = epi(a W_e^T), TK pairs. */
static void moe_gemm(GpuRank *g, const GMat &W, const void *a, const int *tok, int lda, void *out, int ldo, int n, int relu2, int TK,
                     int E) {
    MoeGemm mg = {W, a, tok, out, lda, ldo, n, relu2, g->moe_off, g->moe_tile, E};
    /* the row tiles of all experts together: at most one partial tile for each expert with pairs */
    dim3 grid(cdiv(n, MG_BN), cdiv(TK, MG_BM) + std::min(E, TK));
    if (W.fmt == DT_F32) {
        LAUNCH(grid, MG_BN, 0, g->stream, moe_gemm_f32_kernel, mg);
        return;
    }
    auto kernel = W.fmt == DT_BF16 ? moe_gemm_kernel<DT_BF16> : W.fmt == DT_FP8 ? moe_gemm_kernel<DT_FP8> : moe_gemm_kernel<DT_NVFP4>;
    size_t smem = mg_smem(W.fmt);
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    LAUNCH(grid, MG_THREADS, smem, g->stream, kernel, mg);
}

/* Launches moe_up_kernel, compiled for the format class f, over u's S + T K m virtual rows into h. */
static void moe_up(GpuRank *g, float *h, const MoeUp &u, int f) {
    LAUNCH(cdiv(u.S + u.T * u.K * u.m, GEMV_WARPS * (f == DT_F32 || f == DT_BF16 ? 1 : QROWS)), 32 * GEMV_WARPS, 0, g->stream,
           u.T > 1 ? moe_up_for<GEMV_TOKENS>(f) : moe_up_for<1>(f), h, (const int *)g->moe_idx, (const float *)g->moe_w, u);
}

/* Ranges a one-token quantized down product's rows are cut into (MoeDown.splits): a product of
 * `blocks` that fill at most half of the GPU's `slots` takes enough ranges to fill them about twice.
 * On one H100 (tests/test_kernels' time_moe) a Super layer with FP8 experts, whose routed down product
 * over the latent 1024 rows filled half the slots, took 105.8 us instead of 129.4; Nano's FP8
 * products cut into 2 to 4 decoded slower (--bench, 2.33 to 2.38 against 2.26 ms/token), so they
 * stay whole. */
static int down_splits(int blocks, int slots) { return blocks * 2 <= slots ? std::min((int)MOE_SPLITS, 2 * slots / blocks) : 1; }

/* The same for the NVFP4 tensor-core form, `tiles` row tiles of `spans` spans a row: of the cuts whose
 * blocks (e2m1_warps of their ranges' spans) fit in one wave, the fewest that keep the most warps
 * busy, and at least enough that no range has more than E2M1_RANGE spans. On one H100 (--bench)
 * Nano's, 168 tiles of 119 spans, takes 6 ranges of 2 warps (1008 blocks for 1056 slots): 2.05
 * ms/token against 2.10 whole, 2.13 at 4 ranges, 2.15 at 8. Super's routed one, 64 tiles of 462
 * spans, takes 4 of 8 warps: 7.07 ms/token against 7.22 at 8 ranges (down_splits' count). */
static int e2m1_splits(const GpuRank *g, int tiles, int spans) {
    int best = std::min((int)MOE_SPLITS, cdiv(spans, E2M1_RANGE)), fill = 0;   /* each range's x fits a block */
    for (int s = best; s <= std::min((int)MOE_SPLITS, spans); s++) {
        int warps = e2m1_warps(spans / s);
        if (tiles * s <= e2m1_slots(g, warps) && tiles * s * warps > fill) best = s, fill = tiles * s * warps;
    }
    return best;
}

/* Launches moe_down_kernel (or moe_down_e2m1_kernel) for `rows` output rows, cut into down_splits
 * (e2m1_splits) ranges (warps a row as gemv_wpr picks for the bytes of the whole width); the last
 * wave warms L2 for `next`. */
static void moe_down(GpuRank *g, float *out, int rows, MoeDown md, const GMat *next) {
    md.part = g->moe_part, md.cnt = g->moe_cnt;
    size_t bytes = md.k ? md.k * row_bytes(md.routed.W.fmt, md.routed.W.cols) : 0;
    for (int j = 0; j < md.nfixed; j++) bytes += row_bytes(md.fixed[j].W.fmt, md.fixed[j].W.cols);
    int fmts[3] = {0}, nf = 0;
    if (md.k) fmts[nf++] = md.routed.W.fmt;
    for (int j = 0; j < md.nfixed; j++) fmts[nf++] = md.fixed[j].W.fmt;
    int f = fmt_class(fmts, nf), q = f != DT_F32 && f != DT_BF16, slots;
    if (f == DT_NVFP4) {   /* on the tensor cores */
        int spans = md.k * cdiv(md.routed.W.cols, E2M1_SPAN), warps, blocks = cdiv(rows, E2M1_ROWS);
        for (int j = 0; j < md.nfixed; j++) spans += cdiv(md.fixed[j].W.cols, E2M1_SPAN);
        md.splits = e2m1_splits(g, blocks, spans);
        blocks *= md.splits;
        warps = e2m1_warps(spans / md.splits), slots = e2m1_slots(g, warps);
        int range = cdiv(spans, md.splits);   /* the most spans of a block, its x staged */
        if (range > E2M1_RANGE) {
            fprintf(stderr, "nemoh: an MoE down product of %d spans of %d a row: more than %d ranges of %d\n", spans, (int)E2M1_SPAN,
                    (int)MOE_SPLITS, (int)E2M1_RANGE);
            exit(1);
        }
        LAUNCH(blocks, 32 * warps, (size_t)range * E2M1_SPAN * sizeof(bf16), g->stream, moe_down_e2m1_for(warps), out, rows,
               (const int *)g->moe_idx, md, next ? (const void *)next->w : NULL, warm_bytes(next), blocks > slots ? blocks - slots : 0);
        return;
    }
    int wpr = gemv_wpr(g, rows, bytes, q), blocks = gemv_blocks(g, rows, q, wpr, &slots);
    md.splits = q ? down_splits(blocks, slots) : 1;
    blocks *= md.splits;
    LAUNCH(blocks, 32 * GEMV_WARPS, 0, g->stream, md.T > 1 ? moe_down_for<GEMV_TOKENS>(f) : moe_down_for<1>(f), out, rows,
           (const int *)g->moe_idx, md, wpr, next ? (const void *)next->w : NULL, warm_bytes(next), blocks > slots ? blocks - slots : 0);
}

/* out = the layer's partial sums for T tokens of x, given the choice in moe_idx, moe_w:
 *   out = [fc2] sum_k w_k down_{idx_k}(relu(up_{idx_k}(z))^2) + sdown(relu(sup(x))^2),  z = [fc1] x
 * Each rank holds 1/n of every expert's intermediate rows, so this is a row-parallel partial sum like
 * any mixer's (fc2 is linear: applied to the rank's own partial latent sum). Decoded tokens: the
 * shared and chosen experts' up products in one launch, their down products in one more (two for
 * latent MoE, whose fc2 shares the second with the shared expert's down). A prompt: its (token, slot) pairs
 * grouped by expert on the GPU, then one grouped product for every expert's up and one for the downs,
 * their group sizes read on the GPU (no sync with the host), then the slots summed in token order. */
static void moe_experts(GpuRank *g, const GLayer *L, const MoeShape *ms, float *out, int T, const GMat *next) {
    int bf = lowp(&L->eup), mp = pad8(ms->m), K = ms->K, m = ms->m, d = ms->d;
    const float *z = g->x;
    if (ms->lat) {
        matmul(g, g->moe_z, ms->lat, g->x, ms->H, T, &L->lat_in, EPI_NONE, NULL, NULL);
        z = g->moe_z;
    }
    if (decoded(g, T)) {   /* h: [T, ldh], a token's slots then its shared expert's rows (16-byte rows) */
        int ldh = pad8(K * mp + ms->S);
        MoeUp up = {.routed = {L->eup, z, ms->lat ? ms->lat : ms->H}, .m = m, .K = K, .shared = {L->sup, g->x, ms->H}, .S = ms->S,
                    .T = T, .ldh = ldh};
        int fmts[2] = {L->eup.fmt, L->sup.fmt}, f = fmt_class(fmts, 2);
        if (L->eup.fmt == DT_NVFP4) {   /* the experts on the tensor cores, the shared expert too where it is NVFP4 */
            MoeUp eu = up, su = up;
            int alone = f != DT_NVFP4;   /* alone: the shared expert's own kernel beside */
            eu.S = alone ? 0 : ms->S, su.K = 0;
            int warps = e2m1_warps(cdiv(std::max(L->eup.cols, alone ? 0 : L->sup.cols), E2M1_SPAN));
            LAUNCH(cdiv(eu.S, E2M1_ROWS) + T * K * cdiv(m, E2M1_ROWS), 32 * warps, 0, g->stream, moe_up_e2m1_for(warps), g->moe_h,
                   (const int *)g->moe_idx, (const float *)g->moe_w, eu);
            if (alone) moe_up(g, g->moe_h + (size_t)K * mp, su, L->sup.fmt);
        } else {
            moe_up(g, g->moe_h, up, f);
        }
        MoeIn routed = {L->edown, g->moe_h, ldh}, shared = {L->sdown, g->moe_h + (size_t)K * mp, ldh};
        if (ms->lat) {
            MoeIn fc2 = {L->lat_out, g->moe_ylat, ms->lat};
            moe_down(g, g->moe_ylat, ms->lat, MoeDown{routed, K, ms->lat, mp, {}, 0, T, ms->lat}, NULL);
            moe_down(g, out, ms->H, MoeDown{{}, 0, 0, 0, {fc2, shared}, 2, T, ms->H}, next);
        } else {
            moe_down(g, out, ms->H, MoeDown{routed, K, ms->H, mp, {shared}, 1, T, ms->H}, next);
        }
        return;
    }
    int TK = T * K;
    int nw = std::max(1, std::min(32, 8192 / ms->E));   /* warps: their counts in at most 32 KB */
    LAUNCH(1, 32 * nw, (size_t)nw * ms->E * sizeof(int), g->stream, moe_sort_kernel, g->moe_off, g->moe_tile, g->moe_tok, g->moe_row,
           (const int *)g->moe_idx, TK, K, ms->E);
    /* a: z in bf16 with 16-byte rows (the norm's x16 when it can be), fp32 for fp32 W; the up product
       reads row tok[r] of it for its row r */
    const void *a = z;
    int lda = d;
    if (bf && z == g->x && d % 8 == 0) {
        a = g->x16;
    } else if (bf) {
        LAUNCH(T, 256, 0, g->stream, to_bf16_kernel<0>, g->act16, g->act_w, z, d, d);
        a = g->act16, lda = g->act_w;
    }
    /* h = relu(up a)^2, y = down h, in a's dtype, a pair a row */
    moe_gemm(g, L->eup, a, g->moe_tok, lda, g->moe_h, mp, m, 1, TK, ms->E);
    moe_gemm(g, L->edown, g->moe_h, NULL, mp, g->moe_y, d, d, 0, TK, ms->E);
    /* the shared expert: out = sdown relu(sup x)^2; the routed sum is added to it */
    relu2_mlp(g, out, ms->H, g->x, ms->H, T, &L->sup, &L->sdown, NULL);
    if (bf) moe_combine(g, ms, T, (const bf16 *)g->moe_y, out);
    else moe_combine(g, ms, T, (const float *)g->moe_y, out);
    if (ms->lat) {   /* out += fc2(routed latent sum) */
        int lda;
        const void *a = gemm_input(g, g->moe_ylat, ms->lat, T, &L->lat_out, &lda);
        gemm_rows(g, out, ms->H, a, lda, T, &L->lat_out, 0, ms->H, 1.0f);
    }
}

static void gpu_moe(Rank *r, int l, int T) {
    GpuRank *g = gpu_rank(r);
    const Config *c = r->c;
    MoeShape ms = moe_shape(r);
    MoeRoute rt = {c->n_experts, c->top_k, c->n_group, c->topk_group, c->norm_topk, c->routed_scale};
    moe_choose(g, &g->L[l], &ms, rt, T);
    moe_experts(g, &g->L[l], &ms, pend_out(r), T, next_product(g, c, l));
}

static void gpu_logits(Rank *r, int T, int all) {
    GpuRank *g = gpu_rank(r);
    const Config *c = r->c;
    int H = c->hidden, Vl = r->s.vocab, rows = all ? T : 1;
    const float *x = g->x + (size_t)(all ? 0 : T - 1) * H;
    /* the next forward's first product: while drafting, the MTP block's input projection */
    const GMat *next = c->n_mtp && (r->pass == PASS_MTP || r->spec) ? &g->eh_proj : first_product(g, c, 0);
    GMat W = g->lm_head;   /* an MTP pass: the rows of ids below draft_vocab only (of this rank's slice) */
    if (r->pass == PASS_MTP) W.rows = std::max(0, std::min(W.rows, r->draft_vocab - r->s.rank * Vl));
    if (W.rows) matmul(g, g->logits_local, Vl, x, H, rows, &W, EPI_NONE, next, NULL);
    if (r->s.n > 1) {  /* row t of the gathered logits: [rank 0 slice | rank 1 slice | ...] */
        NCCL_CHECK(ncclGroupStart());
        for (int t = 0; t < rows; t++)
            NCCL_CHECK(ncclAllGather(g->logits_local + (size_t)t * Vl, g->logits + (size_t)t * c->vocab, Vl, ncclFloat,
                                     gpu_shared(r)->comm[r->s.rank], g->stream));
        NCCL_CHECK(ncclGroupEnd());
    }
    g->rows = rows;
}

/* out[j] = a draw from logits row rows - n + j (j < n): a block a row, one copy back, one sync. */
static void gpu_sample(Rank *r, int n, float temp, float topp, uint64_t seed, uint64_t step, int *out) {
    GpuRank *g = gpu_rank(r);
    int V = r->c->vocab;
    if (n < 1 || n > g->rows || n > g->sample_rows) {
        fprintf(stderr, "nemoh: sample: %d rows asked, %d written, room for %d\n", n, g->rows, g->sample_rows);
        exit(1);
    }
    LAUNCH(n, 1024, SAMPLE_CAND * sizeof(float), g->stream, sample_kernel, g->sampled, g->logits + (size_t)(g->rows - n) * V, g->probs,
           V, temp, topp, seed, step);
    CUDA_CHECK(cudaMemcpyAsync(g->host_io, g->sampled, n * sizeof(int), cudaMemcpyDeviceToHost, g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    memcpy(out, g->host_io, n * sizeof(int));
}

/* The verify step after a forward fed T tokens (be->accept), on the device: the model's tokens (one
 * block a row), then accept_kernel. n stays there: the MTP pass and drafts that follow read it. */
static int gpu_accept(Rank *r, const int *tok, int T, float temp, float topp, uint64_t seed, uint64_t step) {
    (void)tok;   /* the device has them: the verify forward's */
    GpuRank *g = gpu_rank(r);
    int V = r->c->vocab;
    if (T < 1 || T > g->rows || T > g->sample_rows || T > r->spec + 1) {
        fprintf(stderr, "nemoh: accept: %d rows, %d written, room for %d\n", T, g->rows, std::min(g->sample_rows, r->spec + 1));
        exit(1);
    }
    LAUNCH(T, 1024, SAMPLE_CAND * sizeof(float), g->stream, sample_kernel, g->step + STEP_T, (const float *)g->logits + (size_t)(g->rows - T) * V,
           g->probs, V, temp, topp, seed, step);
    size_t words = g->snap_bytes / sizeof(unsigned);
    LAUNCH(std::max(1, std::min(cdiv((long)words, 256), 256)), 256, 0, g->stream, accept_kernel, g->step, g->pos, T,
           (unsigned *)g->state, (const unsigned *)g->kept, words);
    g->kept_live = -1;   /* the state is slot n's, which only the device knows */
    return -1;
}

/* Draft j, on the device, with the inputs of the pass after it (draft_kernel). */
static void gpu_draft(Rank *r, int j) {
    GpuRank *g = gpu_rank(r);
    if (j < 0 || j >= std::max(r->spec, 1)) { fprintf(stderr, "nemoh: draft %d, room for %d\n", j, r->spec); exit(1); }
    LAUNCH(1, 1024, 0, g->stream, draft_kernel, g->step + STEP_D + j, (const float *)g->logits, r->c->vocab, r->draft_vocab, g->pos,
           (int)(g->rows > 1));
}

/* The step's outcome to the host (be->outcome): one copy back, one sync. */
static void gpu_outcome(Rank *r, int T, int k, int *out) {
    GpuRank *g = gpu_rank(r);
    CUDA_CHECK(cudaMemcpyAsync(g->host_io, g->step, STEP_INTS * sizeof(int), cudaMemcpyDeviceToHost, g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    if (T) memcpy(out, g->host_io, (size_t)(T + 1) * sizeof(int));
    memcpy(out + (T ? T + 1 : 0), g->host_io + STEP_D, (size_t)k * sizeof(int));
}

static const float *gpu_host_logits(Rank *r, int rows) {
    GpuRank *g = gpu_rank(r);
    CUDA_CHECK(cudaSetDevice(r->gpu));
    CUDA_CHECK(cudaMemcpyAsync(g->host_logits, g->logits, (size_t)rows * r->c->vocab * sizeof(float), cudaMemcpyDeviceToHost,
                               g->stream));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    return g->host_logits;
}

/* ------------------------------------------------------------------------------------------------
 * Setup: communicators, memory check, weights onto the device, buffers; teardown
 * ---------------------------------------------------------------------------------------------- */

/* Whether this build's kernels run on a GPU of compute capability major.minor: the architectures
 * CUDA_ARCH compiled (__CUDA_ARCH_LIST__, e.g. 900 for the default sm_90a) run on their own major
 * version at that minor or above (sm_90a: 9.0, Hopper, only). */
static int built_for(int major, int minor) {
    static const int archs[] = {__CUDA_ARCH_LIST__};
    for (int a : archs)
        if (a / 100 == major && a / 10 % 10 <= minor) return 1;
    return 0;
}

/* Usable GPUs: 0 without a driver or device, and 0 (with one line saying why) when the build has no
 * kernels for them, so nemoh runs on the CPU. NEMOH_FAKE_CC=MAJOR.MINOR stands in for every GPU's
 * compute capability (to test that fallback on any machine with a GPU). */
int cuda_devices(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
    const char *fake = getenv("NEMOH_FAKE_CC");
    for (int i = 0; i < n; i++) {
        cudaDeviceProp p;
        CUDA_CHECK(cudaGetDeviceProperties(&p, i));
        if (fake && sscanf(fake, "%d.%d", &p.major, &p.minor) != 2) {
            fprintf(stderr, "nemoh: NEMOH_FAKE_CC=%s: expected MAJOR.MINOR, e.g. 8.0\n", fake);
            exit(1);
        }
        if (!built_for(p.major, p.minor)) {
            fprintf(stderr, "nemoh: GPU %d (%s) has compute capability %d.%d, which this build's kernels do not run on "
                            "(CUDA_ARCH; the default, sm_90a, needs Hopper, 9.0): running on the CPU\n", i, p.name, p.major, p.minor);
            return 0;
        }
    }
    return n;
}

static void *gpu_setup(const Config *c, int n, int t_max, int logit_rows) {
    GpuShared *sh = (GpuShared *)calloc(1, sizeof(GpuShared));
    if (!sh) { fprintf(stderr, "nemoh: out of memory\n"); exit(1); }
    int have = cuda_devices();
    if (n > have) { fprintf(stderr, "nemoh: --tp %d: only %d GPU%s visible\n", n, have, have == 1 ? "" : "s"); exit(1); }
    if (has_kind(c, K_MAMBA)) {
        int N = c->d_state;
        if (c->d_conv != 4 || N < 8 || N > 256 || (N & (N - 1))) {
            fprintf(stderr, "nemoh: the CUDA backend needs conv_kernel 4 and ssm_state_size a power of two in 8..256 "
                            "(have %d, %d); use --cpu\n", c->d_conv, c->d_state);
            exit(1);
        }
    }
    if (has_kind(c, K_MAMBA) && c->m_heads * c->m_hdim / c->n_groups > GN_PER * 1024) {
        fprintf(stderr, "nemoh: the CUDA backend needs mamba groups of at most %d channels; use --cpu\n", GN_PER * 1024);
        exit(1);
    }
    if (has_kind(c, K_MOE) && (c->n_experts > MOE_MAX_EXPERTS || c->top_k > MOE_MAX_TOPK)) {
        fprintf(stderr, "nemoh: the CUDA backend needs at most %d routed experts and %d chosen a token (have %d, %d); use --cpu\n",
                MOE_MAX_EXPERTS, MOE_MAX_TOPK, c->n_experts, c->top_k);
        exit(1);
    }
    if (c->head_dim > 256) { fprintf(stderr, "nemoh: the CUDA backend needs head_dim <= 256; use --cpu\n"); exit(1); }
    if (c->latent % 4) {   /* a decoded step's latent rows are read 16 bytes at a time */
        fprintf(stderr, "nemoh: the CUDA backend needs moe_latent_size a multiple of 4; use --cpu\n");
        exit(1);
    }
    if (c->hidden > NORM_PER * NORM_THREADS || c->hidden % 8) {
        fprintf(stderr, "nemoh: the CUDA backend needs hidden_size a multiple of 8, at most %d; use --cpu\n", NORM_PER * NORM_THREADS);
        exit(1);
    }
    int devs[64];
    for (int i = 0; i < n; i++) devs[i] = i;
    NCCL_CHECK(ncclCommInitAll(sh->comm, n, devs));
    sh->n = n;
    sh->t_max = t_max;
    sh->logit_rows = logit_rows;
    return sh;
}

static void gpu_teardown(void *p) {
    GpuShared *sh = (GpuShared *)p;
    for (int i = 0; i < sh->n; i++) {
        CUDA_CHECK(cudaSetDevice(i));
        NCCL_CHECK(ncclCommDestroy(sh->comm[i]));
    }
    free(sh);
}

/* A zeroed buffer of `bytes` for the fused all-reduce on this rank of n (see SymWindow). */
static SymWindow symmetric_window_create(ncclComm_t comm, size_t bytes, int n) {
    SymWindow s = {};
    s.nccl_mem = ncclMemAlloc((void **)&s.buf, bytes) == ncclSuccess;
    if (!s.nccl_mem) CUDA_CHECK(cudaMalloc(&s.buf, bytes));
    if (s.nccl_mem && ncclCommWindowRegister(comm, s.buf, bytes, &s.win, NCCL_WIN_COLL_SYMMETRIC) != ncclSuccess) s.win = NULL;
    if (s.win) {
        ncclDevCommRequirements req;
        memset(&req, 0, sizeof req);  /* NCCL 2.28 has no initializer macro */
        req.lsaBarrierCount = FUSED_BLOCKS;
        if (ncclDevCommCreate(comm, &req, &s.dev) == ncclSuccess) {
            s.devapi = s.dev.lsaSize == n;   /* a rank outside load/store reach: the fallback, for every rank */
            if (!s.devapi) NCCL_CHECK(ncclDevCommDestroy(comm, &s.dev));
        }
    }
    CUDA_CHECK(cudaMemset(s.buf, 0, bytes));
    return s;
}

static void symmetric_window_free(ncclComm_t comm, SymWindow *s) {
    if (s->devapi) NCCL_CHECK(ncclDevCommDestroy(comm, &s->dev));
    if (s->win) NCCL_CHECK(ncclCommWindowDeregister(comm, s->win));
    if (s->nccl_mem) NCCL_CHECK(ncclMemFree(s->buf)); else CUDA_CHECK(cudaFree(s->buf));
}

static uint64_t synth_seed = 0x5eed;

/* W's format on the device: as stored, but f16 becomes fp32. */
static int gpu_fmt(const Mat *W) { return W->dtype == DT_F16 ? DT_F32 : W->dtype; }

/* Uploads host views, stacked by rows, into one device matrix [sum rows, cols] with 16-byte rows, in
 * the format they were stored in (gpu_fmt): NVFP4 with its block scales, a quantized matrix with each
 * part's per-tensor scale for the part's rows. Views without data are synthetic: drawn here. */
static GMat upload_mat(const Mat *parts, int n_parts) {
    GMat m = {0};
    m.fmt = gpu_fmt(&parts[0]);
    m.cols = parts[0].cols;
    m.ld = cdiv(m.cols, fmt_per(m.fmt)) * fmt_per(m.fmt);
    for (int k = 0; k < n_parts; k++) {
        if (gpu_fmt(&parts[k]) != m.fmt) {
            fprintf(stderr, "nemoh: the CUDA backend stacks q, k and v in one matrix, which needs them in one format; use --cpu\n");
            exit(1);
        }
        m.rows += parts[k].rows;
    }
    size_t rb = row_bytes(m.fmt, m.ld), bytes = gmat_bytes(&m), nb = (size_t)m.ld / 16;
    CUDA_CHECK(cudaMalloc(&m.w, bytes));
    CUDA_CHECK(cudaMemset(m.w, 0, bytes));
    if (m.fmt == DT_NVFP4) {
        CUDA_CHECK(cudaMalloc(&m.bs, (size_t)m.rows * nb));
        CUDA_CHECK(cudaMemset(m.bs, 0, (size_t)m.rows * nb));
    }
    if (quantized(m.fmt)) {
        std::vector<float> rs;
        for (int k = 0; k < n_parts; k++) rs.insert(rs.end(), (size_t)parts[k].rows, parts[k].scale);
        CUDA_CHECK(cudaMalloc(&m.rs, rs.size() * sizeof(float)));
        CUDA_CHECK(cudaMemcpy(m.rs, rs.data(), rs.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    if (!parts[0].data) {   /* pad included: harmless; NVFP4 blocks of scale 1 (e4m3 0x38) */
        size_t n = m.fmt == DT_F32 ? bytes / 4 : m.fmt == DT_BF16 ? bytes / 2 : bytes;
        LAUNCH(1024, 256, 0, 0, fill_kernel, m.w, m.fmt, n, sqrtf(3.0f / m.cols), synth_seed++);
        if (m.bs) CUDA_CHECK(cudaMemset(m.bs, 0x38, (size_t)m.rows * nb));
        return m;
    }
    std::vector<float> row(m.cols);
    size_t r0 = 0;
    for (int k = 0; k < n_parts; k++) {
        const Mat *p = &parts[k];
        size_t pitch = p->dtype == DT_NVFP4 ? p->ld / 2 : p->ld * (p->dtype == DT_F32 ? 4 : p->dtype == DT_FP8 ? 1 : 2);
        if (p->dtype == DT_F16) {   /* widened a row at a time */
            for (int i = 0; i < p->rows; i++) {
                for (int j = 0; j < m.cols; j++) row[j] = load_f32((const char *)p->data + i * pitch, DT_F16, (size_t)j);
                CUDA_CHECK(cudaMemcpy((char *)m.w + (r0 + i) * rb, row.data(), (size_t)m.cols * 4, cudaMemcpyHostToDevice));
            }
        } else {   /* as stored: one strided copy from the mapping */
            CUDA_CHECK(cudaMemcpy2D((char *)m.w + r0 * rb, rb, p->data, pitch, (size_t)m.cols * 16 / fmt_per(m.fmt), p->rows,
                                    cudaMemcpyHostToDevice));
            if (m.bs) CUDA_CHECK(cudaMemcpy2D(m.bs + r0 * nb, nb, p->bs, p->bld, (size_t)m.cols / 16, p->rows, cudaMemcpyHostToDevice));
        }
        r0 += p->rows;
    }
    return m;
}

static void free_mat(GMat *m) {
    CUDA_CHECK(cudaFree(m->w));
    CUDA_CHECK(cudaFree(m->bs));
    CUDA_CHECK(cudaFree(m->rs));
}

static float *upload_f32(const float *h, size_t n) {
    float *d;
    CUDA_CHECK(cudaMalloc(&d, n * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

static float *zeros(size_t n) {
    float *d;
    CUDA_CHECK(cudaMalloc(&d, (n ? n : 1) * sizeof(float)));
    CUDA_CHECK(cudaMemset(d, 0, (n ? n : 1) * sizeof(float)));
    return d;
}

/* Device bytes of `rows` rows of m as upload_mat stores them (scales included); *quant |= whether
 * m is quantized. */
static size_t mat_bytes(const Mat *m, int rows, int *quant) {
    GMat d = {NULL, gpu_fmt(m), rows, m->cols, cdiv(m->cols, fmt_per(gpu_fmt(m))) * fmt_per(gpu_fmt(m)), NULL, NULL};
    int q = quantized(d.fmt);
    *quant |= q;
    return gmat_bytes(&d) + (d.fmt == DT_NVFP4 ? (size_t)rows * d.ld / 16 : 0) + (q ? (size_t)rows * 4 : 0);
}

/* Bytes of one Mamba layer's part of GpuRank.state: its conv window, then its SSM state, each from a
 * 256-byte boundary. */
static size_t conv_state_bytes(const Rank *r) { return ((size_t)r->s.conv * 3 * sizeof(float) + 255) / 256 * 256; }
static size_t mamba_state_bytes(const Rank *r) {
    return conv_state_bytes(r) + ((size_t)r->s.d_inner * r->c->d_state * sizeof(float) + 255) / 256 * 256;
}

/* Device bytes this rank needs, counted before anything large is allocated; *quant: whether some
 * matrix is quantized (a prompt then needs deq). */
static size_t bytes_needed(const Rank *r, const GpuRank *g, int *quant) {
    const Config *c = r->c;
    const Shard *s = &r->s;
    const Weights *w = &r->w;
    size_t H = c->hidden, T = r->t_max, f = sizeof(float), b = 0;
    b += mat_bytes(&w->embed, c->vocab, quant) + mat_bytes(&w->lm_head, s->vocab, quant) + H * f;
    for (int l = 0; l < n_all(c); l++) {
        const Layer *L = &w->layer[l];
        b += H * f;
        if (L->kind == K_MAMBA)   /* weights; the state (mamba_state_bytes), once live and spec + 1 times kept */
            b += mat_bytes(&L->in_proj[0], s->in_proj, quant) + mat_bytes(&L->out, (int)H, quant) +
                 ((size_t)s->conv * 5 + 3 * s->m_heads + 2 * s->d_inner) * f + (r->spec > 0 ? r->spec + 2 : 1) * mamba_state_bytes(r);
        else if (L->kind == K_ATTN)
            b += mat_bytes(&L->wq, (s->q + 2 * s->kv) * c->head_dim, quant) + mat_bytes(&L->wo, (int)H, quant) +
                 2 * (size_t)r->ctx * s->kv * c->head_dim * (gpu_fmt(&L->wq) == DT_F32 ? 4 : 2);   /* the cache: see GLayer */
        else if (L->kind == K_MLP)
            b += mat_bytes(&L->up, s->mlp, quant) + mat_bytes(&L->down, (int)H, quant);
        else
            b += (size_t)c->n_experts * (H + 1) * f + mat_bytes(&L->eup[0], c->n_experts * s->moe, quant) +
                 mat_bytes(&L->edown[0], c->n_experts * (c->latent ? c->latent : (int)H), quant) + mat_bytes(&L->sup, s->shared, quant) +
                 mat_bytes(&L->sdown, (int)H, quant) +
                 (c->latent ? mat_bytes(&L->lat_in, c->latent, quant) + mat_bytes(&L->lat_out, (int)H, quant) : 0);
    }
    if (has_kind(c, K_MOE)) {   /* moe_alloc's buffers */
        size_t TK = T * c->top_k, d = c->latent ? c->latent : H;
        b += TK * (3 + pad8(s->moe) + d) * f + T * ((size_t)c->n_experts + 2 * c->latent) * f +
             (size_t)g->dec_t * pad8(c->top_k * pad8(s->moe) + s->shared) * f +
             ((size_t)MOE_SPLITS * g->dec_t + 1) * std::max((size_t)H, (size_t)c->latent) * f;   /* moe_part, moe_cnt */
    }
    b += T * H * (f * 5 + 2) + T * (size_t)(g->proj_w + s->conv + g->y_w) * f + T * (size_t)g->act_w * 2;
    b += (size_t)gpu_shared((Rank *)r)->logit_rows * (c->vocab + s->vocab) * f + (64u << 20);  /* + cuBLAS workspace */
    b += (size_t)g->sample_rows * c->vocab * f;
    /* decoded steps' scratch: attention's split partials (part), the scan's group sums (gss) */
    b += (size_t)g->dec_t * ((s->q ? s->q : 1) * (size_t)g->splits * (c->head_dim + 2) +
                             (s->m_heads ? s->m_heads * scan_blocks(c->m_hdim, c->d_state) : 1)) * f;
    if (c->n_mtp) b += 3 * H * f + mat_bytes(&w->eh_proj, (int)H, quant) + T * 2 * H * f;   /* norms, eh_proj, eh */
    return b + (*quant ? DEQ_BYTES : 0);
}

/* The MoE buffers for steps of up to t tokens (gpu_init, and the kernel tests). */
static void moe_alloc(GpuRank *g, const MoeShape *ms, int t) {
    size_t TK = (size_t)t * ms->K;
    CUDA_CHECK(cudaMalloc(&g->moe_idx, TK * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&g->moe_done, sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(g->moe_done, 0, sizeof(unsigned)));
    CUDA_CHECK(cudaMalloc(&g->moe_off, (ms->E + 1) * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&g->moe_tile, (ms->E + 1) * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&g->moe_tok, TK * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&g->moe_row, TK * sizeof(int)));
    g->moe_w = zeros(TK);
    g->moe_logits = zeros((size_t)t * ms->E);
    g->moe_h = zeros(std::max(TK * pad8(ms->m), (size_t)std::min(t, std::max(g->dec_t, 1)) * pad8(ms->K * pad8(ms->m) + ms->S)));
    g->moe_y = zeros(TK * ms->d);
    g->moe_z = zeros((size_t)t * ms->lat);
    g->moe_ylat = zeros((size_t)t * ms->lat);
    int rows = std::max(ms->H, ms->lat);
    g->moe_part = zeros((size_t)MOE_SPLITS * std::max(1, std::min(t, g->dec_t)) * rows);
    CUDA_CHECK(cudaMalloc(&g->moe_cnt, cdiv(rows, QROWS) * sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(g->moe_cnt, 0, cdiv(rows, QROWS) * sizeof(unsigned)));
}

static void moe_free(GpuRank *g) {
    void *ptrs[] = {g->moe_idx, g->moe_done, g->moe_off, g->moe_tile, g->moe_tok, g->moe_row, g->moe_w, g->moe_logits,
                    g->moe_h, g->moe_y, g->moe_z, g->moe_ylat, g->moe_part, g->moe_cnt};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) CUDA_CHECK(cudaFree(ptrs[i]));
}

/* A forward's inputs (pos, tok; host_io's ring and its events) for forwards of up to T tokens, and
 * host_io's start for copies back of up to `back` ints. */
static void build_io(GpuRank *g, size_t T, int back) {
    CUDA_CHECK(cudaMalloc(&g->pos, (3 + T) * sizeof(int)));
    g->tok = g->pos + 3;
    g->io_ring = (int)std::max(3 + T, (size_t)back);
    CUDA_CHECK(cudaMallocHost(&g->host_io, (g->io_ring + IO_ENTRY * IO_RING) * sizeof(int)));
    for (cudaEvent_t &e : g->io_done) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

static void free_io(GpuRank *g) {
    CUDA_CHECK(cudaFree(g->pos));
    CUDA_CHECK(cudaFreeHost(g->host_io));
    for (cudaEvent_t e : g->io_done) CUDA_CHECK(cudaEventDestroy(e));
}

static void gpu_init(Rank *r) {
    const Config *c = r->c;
    const Shard *s = &r->s;
    const Weights *w = &r->w;
    GpuShared *sh = gpu_shared(r);
    GpuRank *g = (GpuRank *)calloc(1, sizeof(GpuRank));
    if (!g) { fprintf(stderr, "nemoh: out of memory\n"); exit(1); }
    r->st = g;
    CUDA_CHECK(cudaSetDevice(r->gpu));
    size_t H = c->hidden, T = r->t_max;
    int hd = c->head_dim;
    g->proj_w = proj_width(c, s);
    g->y_w = y_width(c, s);
    g->act_w = pad8(std::max({(int)H, g->proj_w, c->latent, c->n_mtp ? 2 * (int)H : 0}));   /* MTP: eh_proj's input */
    g->splits = attn_splits(r->ctx);
    g->dec_t = r->spec > 0 ? std::min(r->spec + 1, (int)DECODE_T) : 1;
    g->sample_rows = std::max(1, std::min(sh->logit_rows, r->spec + 1));
    g->gemv_slots = gemv_slots(r->gpu);
    CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SAMPLE_CAND * sizeof(float)));

    int quant = 0;
    size_t free_b, total_b, need = bytes_needed(r, g, &quant);
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (need > free_b) {
        fprintf(stderr, "nemoh: GPU %d: the model needs %.2f GB on this rank, %.2f GB are free (try a larger --tp, a "
                        "smaller -c or --chunk, or --cpu)\n", r->gpu, need / 1e9, free_b / 1e9);
        exit(1);
    }

    CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&g->blas));
    CUBLAS_CHECK(cublasSetStream(g->blas, g->stream));
    CUBLAS_CHECK(cublasSetMathMode(g->blas, CUBLAS_DEFAULT_MATH));  /* fp32 products stay fp32: no TF32 */
    CUDA_CHECK(cudaMalloc(&g->blas_ws, 32u << 20));
    CUBLAS_CHECK(cublasSetWorkspace(g->blas, g->blas_ws, 32u << 20));

    /* weights */
    g->embed = upload_mat(&w->embed, 1);
    if (quant) CUDA_CHECK(cudaMalloc(&g->deq, DEQ_BYTES));
    g->lm_head = upload_mat(&w->lm_head, 1);
    g->norm_f = upload_f32(w->norm_f, H);
    int n_mamba = 0;   /* the recurrent state, zeros: Mamba layer i's from i * mamba_state_bytes */
    for (int l = 0; l < n_all(c); l++) n_mamba += c->kind[l] == K_MAMBA;
    CUDA_CHECK(cudaMalloc(&g->state, n_mamba * mamba_state_bytes(r) + 1));
    CUDA_CHECK(cudaMemset(g->state, 0, n_mamba * mamba_state_bytes(r) + 1));
    if (c->n_mtp) {
        g->enorm = upload_f32(w->enorm, H);
        g->hnorm = upload_f32(w->hnorm, H);
        g->eh_proj = upload_mat(&w->eh_proj, 1);
        g->mtp_norm = upload_f32(w->mtp_norm, H);
        g->eh = zeros(T * 2 * H);
    }
    for (int l = 0; l < n_all(c); l++) {
        const Layer *L = &w->layer[l];
        GLayer *gl = &g->L[l];
        gl->norm = upload_f32(L->norm, H);
        if (L->kind == K_MAMBA) {
            gl->in_proj = upload_mat(L->in_proj, 5);
            gl->conv_w = upload_f32(L->conv_w, (size_t)s->conv * 4);
            gl->conv_b = upload_f32(L->conv_b, (size_t)s->conv);
            gl->A = upload_f32(L->A, (size_t)s->m_heads);
            gl->D = upload_f32(L->D, (size_t)s->m_heads);
            gl->dt_bias = upload_f32(L->dt_bias, (size_t)s->m_heads);
            gl->gnorm = upload_f32(L->gnorm, (size_t)s->d_inner);
            gl->out = upload_mat(&L->out, 1);
            gl->conv_st = (float *)(g->state + g->snap_bytes);
            gl->ssm = (float *)(g->state + g->snap_bytes + conv_state_bytes(r));
            g->snap_bytes += mamba_state_bytes(r);
        } else if (L->kind == K_ATTN) {
            Mat qkv[3] = {L->wq, L->wk, L->wv};
            gl->qkv = upload_mat(qkv, 3);
            gl->o = upload_mat(&L->wo, 1);
            size_t n = (size_t)r->ctx * s->kv * hd, room = lowp(&gl->qkv) ? (n + 1) / 2 : n;   /* in floats: bf16 takes half */
            gl->k = zeros(room);
            gl->v = zeros(room);
        } else if (L->kind == K_MLP) {
            gl->up = upload_mat(&L->up, 1);
            gl->down = upload_mat(&L->down, 1);
        } else {
            gl->gate = upload_f32(L->gate, (size_t)c->n_experts * H);
            gl->gate_bias = upload_f32(L->gate_bias, (size_t)c->n_experts);
            gl->eup = upload_mat(L->eup, c->n_experts);
            gl->edown = upload_mat(L->edown, c->n_experts);
            gl->sup = upload_mat(&L->sup, 1);
            gl->sdown = upload_mat(&L->sdown, 1);
            if (c->latent) {
                gl->lat_in = upload_mat(&L->lat_in, 1);
                gl->lat_out = upload_mat(&L->lat_out, 1);
            }
            int lp = lowp(&gl->eup);   /* a prompt's expert products take one activation type (bf16, or fp32) */
            if (lowp(&gl->edown) != lp || lowp(&gl->sup) != lp || lowp(&gl->sdown) != lp || (c->latent && lowp(&gl->lat_out) != lp)) {
                fprintf(stderr, "nemoh: layer %d: the CUDA backend needs the experts' matrices (and fc2_latent_proj) all fp32 or "
                                "none; use --cpu\n", l);
                exit(1);
            }
        }
    }
    if (has_kind(c, K_MOE)) {
        MoeShape ms = moe_shape(r);
        moe_alloc(g, &ms, (int)T);
    }
    if (r->spec > 0) CUDA_CHECK(cudaMalloc(&g->kept, (r->spec + 1) * g->snap_bytes + 1));

    /* buffers */
    g->pend = symmetric_window_create(sh->comm[s->rank], 2 * T * H * sizeof(float), s->n);
    if (!g->pend.devapi && r->fuse && s->rank == 0)
        fprintf(stderr, "nemoh: NCCL device API unavailable (no symmetric window or no load/store access between all "
                        "GPUs): the fused all-reduce falls back to ncclAllReduce + add + RMSNorm\n");
    g->res = zeros(T * H);
    g->x = zeros(T * H);
    CUDA_CHECK(cudaMalloc(&g->x16, T * H * sizeof(bf16)));
    g->pend_sum = zeros(T * H);
    g->proj = zeros(T * g->proj_w);
    g->xbc = zeros(T * (s->conv ? s->conv : 1));
    g->y = zeros(T * g->y_w);
    CUDA_CHECK(cudaMalloc(&g->act16, T * g->act_w * sizeof(bf16)));
    g->part = zeros((size_t)g->dec_t * (s->q ? s->q : 1) * g->splits * (hd + 2));
    g->gss = zeros((size_t)g->dec_t * (s->m_heads ? s->m_heads * scan_blocks(c->m_hdim, c->d_state) : 1));
    g->logits_local = zeros((size_t)sh->logit_rows * s->vocab);
    g->logits = s->n > 1 ? zeros((size_t)sh->logit_rows * c->vocab) : g->logits_local;
    CUDA_CHECK(cudaMallocHost(&g->host_logits, (size_t)sh->logit_rows * c->vocab * sizeof(float)));
    g->probs = zeros((size_t)g->sample_rows * c->vocab);
    build_io(g, T, std::max(g->sample_rows, (int)STEP_INTS));
    CUDA_CHECK(cudaMalloc(&g->sampled, g->sample_rows * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&g->step, STEP_INTS * sizeof(int)));
    CUDA_CHECK(cudaMemset(g->step, 0, STEP_INTS * sizeof(int)));
    CUDA_CHECK(cudaDeviceSynchronize());
}

static void gpu_free(Rank *r) {
    GpuRank *g = gpu_rank(r);
    const Config *c = r->c;
    CUDA_CHECK(cudaSetDevice(r->gpu));
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    for (cudaGraphExec_t e : g->graph)
        if (e) CUDA_CHECK(cudaGraphExecDestroy(e));
    symmetric_window_free(gpu_shared(r)->comm[r->s.rank], &g->pend);
    for (int l = 0; l < n_all(c); l++) {
        GLayer *gl = &g->L[l];
        void *ptrs[] = {gl->norm, gl->conv_w, gl->conv_b, gl->A, gl->D, gl->dt_bias, gl->gnorm, gl->k, gl->v, gl->gate, gl->gate_bias};
        for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) CUDA_CHECK(cudaFree(ptrs[i]));
        for (GMat *m : {&gl->in_proj, &gl->out, &gl->qkv, &gl->o, &gl->up, &gl->down, &gl->eup, &gl->edown, &gl->sup, &gl->sdown,
                        &gl->lat_in, &gl->lat_out})
            free_mat(m);
    }
    free_mat(&g->embed);
    free_mat(&g->lm_head);
    free_mat(&g->eh_proj);
    void *ptrs[] = {g->deq, g->norm_f, g->enorm, g->hnorm, g->mtp_norm, g->eh, g->res, g->x, g->x16, g->pend_sum, g->proj, g->xbc, g->y, g->act16, g->part,
                    g->gss, g->logits_local, g->probs, g->sampled, g->step, g->blas_ws,
                    r->s.n > 1 ? g->logits : NULL};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) CUDA_CHECK(cudaFree(ptrs[i]));
    moe_free(g);
    CUDA_CHECK(cudaFree(g->state));
    CUDA_CHECK(cudaFree(g->snap));
    CUDA_CHECK(cudaFree(g->kept));
    CUDA_CHECK(cudaFreeHost(g->host_logits));
    free_io(g);
    CUBLAS_CHECK(cublasDestroy(g->blas));
    CUDA_CHECK(cudaStreamDestroy(g->stream));
    free(g);
    r->st = NULL;
}

/* --chat's snapshots: a device-to-device copy, in stream order, of every Mamba layer's conv window
 * and SSM state (state) into a slot of one buffer made at the first save, or back. The decode graph
 * reads state itself, so a restored state is what its next replay sees. */
static void gpu_snapshot(Rank *r, int slot, int save) {
    GpuRank *g = gpu_rank(r);
    CUDA_CHECK(cudaSetDevice(r->gpu));
    if (!g->snap) CUDA_CHECK(cudaMalloc(&g->snap, SNAPSHOT_SLOTS * g->snap_bytes + 1));
    char *p = g->snap + slot * g->snap_bytes;
    CUDA_CHECK(cudaMemcpyAsync(save ? p : g->state, save ? g->state : p, g->snap_bytes, cudaMemcpyDeviceToDevice, g->stream));
    if (!save) g->kept_n = 0;   /* the states kept for rewind are not this state's */
}

/* Every Mamba layer's state := the one after token t of the last forward run with r->keep: one copy in
 * stream order, none where the live state is that one already (after the forward, its last token's). */
static void gpu_rewind(Rank *r, int t) {
    GpuRank *g = gpu_rank(r);
    if (t < 0 || t >= g->kept_n) { fprintf(stderr, "nemoh: rewind to token %d of %d kept\n", t, g->kept_n); exit(1); }
    if (t == g->kept_live) return;
    CUDA_CHECK(cudaSetDevice(r->gpu));
    CUDA_CHECK(cudaMemcpyAsync(g->state, g->kept + t * g->snap_bytes, g->snap_bytes, cudaMemcpyDeviceToDevice, g->stream));
    g->kept_live = t;
}

/* Designated initialisers, in the order Backend declares its fields (C++ wants that order). */
extern "C" const Backend cuda_backend = {
    .name = "cuda",
    .setup = gpu_setup,
    .teardown = gpu_teardown,
    .init = gpu_init,
    .free = gpu_free,
    .replay = gpu_replay,
    .begin = gpu_begin,
    .end = gpu_end,
    .embed = gpu_embed,
    .norm = gpu_norm,
    .mamba = gpu_mamba,
    .attention = gpu_attention,
    .mlp = gpu_mlp,
    .allreduce = gpu_allreduce,
    .logits = gpu_logits,
    .sample = gpu_sample,
    .host_logits = gpu_host_logits,
    .moe = gpu_moe,
    .snapshot = gpu_snapshot,
    .mtp_in = gpu_mtp_in,
    .accept = gpu_accept,
    .rewind = gpu_rewind,
    .draft = gpu_draft,
    .outcome = gpu_outcome,
};

/* ------------------------------------------------------------------------------------------------
 * Benchmarks: what the machine does (copy bandwidth, the fused all-reduce against NCCL's)
 * ---------------------------------------------------------------------------------------------- */

extern "C" const char *cuda_device_name(void) {
    static cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    return prop.name;
}

extern "C" double cuda_copy_gbps(void) {
    size_t free_b, total_b, bytes, step = 64 << 20;
    void *a, *b;
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaSetDevice(0));
    /* two buffers of 1 GB, or of what a model that fills the GPU leaves (0: too little to measure) */
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    bytes = std::min((size_t)1 << 30, free_b / 2 / step * step);
    if (bytes < step) return 0;
    CUDA_CHECK(cudaMalloc(&a, bytes));
    CUDA_CHECK(cudaMalloc(&b, bytes));
    CUDA_CHECK(cudaMemset(a, 1, bytes));
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    CUDA_CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));  /* warm-up */
    CUDA_CHECK(cudaEventRecord(e0));
    for (int i = 0; i < 10; i++) CUDA_CHECK(cudaMemcpyAsync(i & 1 ? a : b, i & 1 ? b : a, bytes, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CUDA_CHECK(cudaFree(a));
    CUDA_CHECK(cudaFree(b));
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    return 2.0 * bytes * 10 / (ms * 1e-3) / 1e9;
}

extern "C" size_t cuda_used_bytes(Rank *r) {
    size_t free_b, total_b;
    CUDA_CHECK(cudaSetDevice(r->gpu));
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return total_b - free_b;
}

extern "C" const char *cuda_fuse_path(Rank *r) {
    if (!r->fuse) return "all-reduce at layer end (--no-fuse)";
    if (r->s.n == 1 && gpu_rank(r)->pend.devapi) return "fused, NCCL device API (1 rank)";
    return gpu_rank(r)->pend.devapi ? "fused, NCCL device API" : "fused, ncclAllReduce fallback";
}

/* One rank of --bench-allreduce: for T = 1, 2, 4 .. 2048 rows of `hidden`, the fused kernel and
 * ncclAllReduce + add + RMSNorm, each checked against a host reference, then timed as ITERS calls
 * captured in a CUDA graph (median of REPS replays). */
typedef struct {
    int rank, n, hidden;
    ncclComm_t comm;
    float fused_us[13], nccl_us[13];    /* per size, this rank's median */
    int bad[13];                        /* per size, failed checks */
} ArBench;

enum { AR_SIZES = 13, AR_ITERS = 20, AR_REPS = 15 };
static const int ar_tokens[AR_SIZES] = {1, 2, 4, 7, 8, 16, 32, 64, 128, 256, 512, 1024, 2048};  /* 7: not a power of two */

static double host_check(const float *got_x, const float *got_res, const std::vector<float> &res0,
                         const std::vector<float> &sum, const std::vector<float> &w, int T, int H, int calls, float eps,
                         int *res_exact) {
    double worst = 0;
    *res_exact = 1;
    for (int t = 0; t < T; t++) {
        std::vector<float> r(H);
        double ss = 0;
        for (int i = 0; i < H; i++) {
            float v = res0[(size_t)t * H + i];
            for (int k = 0; k < calls; k++) v += sum[(size_t)t * H + i];   /* what the kernel does, call after call */
            r[i] = v;
            ss += (double)v * v;
            if (v != got_res[(size_t)t * H + i]) *res_exact = 0;
        }
        double scale = 1.0 / sqrt(ss / H + eps);
        for (int i = 0; i < H; i++) {
            double ref = r[i] * scale * w[i], d = fabs(ref - got_x[(size_t)t * H + i]) / (fabs(ref) + 1e-3);
            if (isnan(d) || d > worst) worst = d;   /* a NaN stays the worst: the check fails */
        }
    }
    return worst;
}

static void ar_rank(ArBench *b) {
    int H = b->hidden, n = b->n, Tmax = 2048;
    CUDA_CHECK(cudaSetDevice(b->rank));
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    size_t slot = (size_t)Tmax * H, bytes = 2 * slot * sizeof(float);
    SymWindow sw = symmetric_window_create(b->comm, bytes, n);
    float *pend = sw.buf, *res, *x, *red, *w;
    if (!sw.devapi && b->rank == 0) fprintf(stderr, "nemoh: NCCL device API unavailable: timing the fallback twice\n");
    CUDA_CHECK(cudaMalloc(&res, slot * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&x, slot * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&red, slot * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&w, H * sizeof(float)));
    std::vector<float> hp((size_t)Tmax * H), hres((size_t)Tmax * H), hw(H), gx((size_t)Tmax * H), gres((size_t)Tmax * H);
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    for (int si = 0; si < AR_SIZES; si++) {
        int T = ar_tokens[si];
        size_t cnt = (size_t)T * H;
        /* fresh inputs: this rank's partial sums, and the residual and weight every rank shares */
        for (size_t i = 0; i < cnt; i++) { hp[i] = 2 * coin(77 + b->rank * 1000 + si, i) - 1; hres[i] = 2 * coin(5 + si, i) - 1; }
        for (int i = 0; i < H; i++) hw[i] = 0.5f + coin(9, i);
        std::vector<float> sum(cnt, 0.0f);
        for (int r = 0; r < n; r++)    /* the reference sum in rank order, as the kernel adds */
            for (size_t i = 0; i < cnt; i++) sum[i] += 2 * coin(77 + r * 1000 + si, i) - 1;
        CUDA_CHECK(cudaMemcpy(w, hw.data(), H * sizeof(float), cudaMemcpyHostToDevice));
        for (int path = 0; path < 2; path++) {
            float *times = path ? b->nccl_us : b->fused_us;
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CUDA_CHECK(cudaMemcpy(pend, hp.data(), cnt * sizeof(float), cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(pend + slot, hp.data(), cnt * sizeof(float), cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(res, hres.data(), cnt * sizeof(float), cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaDeviceSynchronize());   /* pageable copies may return before they land; st does not wait */
            CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int it = 0; it < AR_ITERS; it++) {
                int s = it & 1;  /* alternate the two slots, as the layer loop does */
                if (path == 0 && sw.devapi) {
                    FusedArgs a = {.dev = sw.dev, .win = sw.win, .offset = s * slot * sizeof(float), .x = x, .res = res, .w = w,
                                   .T = T, .hidden = H, .eps = 1e-5f};
                    fused_allreduce_norm(st, a);
                } else {
                    NCCL_CHECK(ncclAllReduce(pend + s * slot, red, cnt, ncclFloat, ncclSum, b->comm, st));
                    LAUNCH(T, NORM_THREADS, 0, st, rmsnorm_kernel, x, (bf16 *)NULL, res, red, w, H, 1e-5f);
                }
            }
            CUDA_CHECK(cudaStreamEndCapture(st, &graph));
            CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            std::vector<float> ms(AR_REPS);
            for (int rep = 0; rep < AR_REPS; rep++) {
                CUDA_CHECK(cudaEventRecord(e0, st));
                CUDA_CHECK(cudaGraphLaunch(exec, st));
                CUDA_CHECK(cudaEventRecord(e1, st));
                CUDA_CHECK(cudaEventSynchronize(e1));
                CUDA_CHECK(cudaEventElapsedTime(&ms[rep], e0, e1));
            }
            std::sort(ms.begin(), ms.end());
            times[si] = ms[AR_REPS / 2] * 1000.0f / AR_ITERS;
            /* after AR_REPS replays of AR_ITERS calls: res must equal the host's call-by-call sum exactly,
               x its RMSNorm within fp32 rounding */
            CUDA_CHECK(cudaMemcpy(gx.data(), x, cnt * sizeof(float), cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(gres.data(), res, cnt * sizeof(float), cudaMemcpyDeviceToHost));
            int exact;
            double err = host_check(gx.data(), gres.data(), hres, sum, hw, T, H, AR_REPS * AR_ITERS, 1e-5f, &exact);
            if (!(err <= 1e-4) || !exact) {   /* NaN fails too */
                b->bad[si]++;
                fprintf(stderr, "nemoh: rank %d: %s at %d tokens: residual %s, norm error %.2g\n", b->rank,
                        path ? "ncclAllReduce + norm" : "fused kernel", T, exact ? "exact" : "WRONG", err);
            }
            CUDA_CHECK(cudaGraphExecDestroy(exec));
            CUDA_CHECK(cudaGraphDestroy(graph));
        }
    }
    symmetric_window_free(b->comm, &sw);
    CUDA_CHECK(cudaFree(res));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(red));
    CUDA_CHECK(cudaFree(w));
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    CUDA_CHECK(cudaStreamDestroy(st));
}

extern "C" int cuda_bench_allreduce(int n, int hidden) {
    if (hidden > NORM_PER * NORM_THREADS) { fprintf(stderr, "nemoh: --hidden %d: at most %d\n", hidden, NORM_PER * NORM_THREADS); return 1; }
    ncclComm_t comm[64];
    int devs[64] = {0};
    for (int i = 0; i < n; i++) devs[i] = i;
    NCCL_CHECK(ncclCommInitAll(comm, n, devs));
    std::vector<ArBench> b(n);
    std::vector<std::thread> th;
    for (int i = 0; i < n; i++) {
        b[i] = ArBench{i, n, hidden, comm[i], {0}, {0}, {0}};
        th.emplace_back(ar_rank, &b[i]);
    }
    int failed = 0;
    for (int i = 0; i < n; i++) th[i].join();
    printf("# --bench-allreduce: %d x %s, hidden %d, fp32; latency per call (max over ranks of the median of %d\n"
           "# graph replays of %d calls); busbw = bytes * 2(n-1)/n / time, as nccl-tests reports it\n",
           n, cuda_device_name(), hidden, AR_REPS, AR_ITERS);
    printf("%8s %12s %12s %14s %9s %14s %14s %6s\n", "tokens", "bytes", "fused us", "allreduce+norm", "speedup",
           "fused busbw", "nccl busbw", "check");
    for (int si = 0; si < AR_SIZES; si++) {
        float f = 0, c = 0;
        int bad = 0;
        for (int i = 0; i < n; i++) { f = fmaxf(f, b[i].fused_us[si]); c = fmaxf(c, b[i].nccl_us[si]); bad += b[i].bad[si]; }
        failed += bad;
        double bytes = (double)ar_tokens[si] * hidden * 4, factor = n > 1 ? 2.0 * (n - 1) / n : 0;
        printf("%8d %12.0f %12.2f %14.2f %8.2fx %11.1f GB/s %9.1f GB/s %6s\n", ar_tokens[si], bytes, f, c, c / f,
               bytes * factor / (f * 1e3), bytes * factor / (c * 1e3), bad ? "FAIL" : "ok");
    }
    for (int i = 0; i < n; i++) NCCL_CHECK(ncclCommDestroy(comm[i]));
    return failed;
}

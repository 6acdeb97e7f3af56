/* test_matmul: nemoh's CPU matrix product (matmul: dot_rows, and bf16 on Intel's tile unit where the
 * build has it) against a float64 reference written apart from it, for every stored format, at
 * awkward sizes: rows not a multiple of 16, columns not a multiple of 32, row strides past the
 * columns, 1 to 13 tokens, and a product long enough that its tokens are packed in several chunks.
 * Three checks a case:
 *   - each sum within 4 K 2^-24 sum_k |w x| of float64's (fp32 summation's bound, with room);
 *   - T tokens at once give each token, bit for bit, what it gets alone (a drafting step's verify
 *     forward relies on it);
 *   - with one weight of 1 a row, every output equals its x exactly (x with all 24 mantissa bits:
 *     a product that drops any part of x fails).
 * Where the build decodes FP8 and NVFP4 in AVX-512 or AVX2 lanes, every code against mat_at, bit for
 * bit.
 * An FP8 NaN code anywhere in a row makes that row's sums NaN, and only that row's.
 * Then matmul_n, several matrices of one input in one pass (Mamba's in_proj segments, attention's q, k,
 * v): each matrix's outputs equal, bit for bit, what its own matmul gives, with formats and sizes mixed
 * so that some rows go to the tile unit and some to dot_rows in the same pass. And the host's fast_exp
 * (branch-free, so loops over it run in lanes) against float64's exp: within 3 ulp at every 997th float
 * in [-87.3, 88.3], 0 below, infinity above, NaN kept; silu and softplus through it.
 * Runs on two threads. Prints which paths the products took (the last three shapes
 * are large enough for the tile unit), then "N passed, M failed". */
#define NEMOH_NO_MAIN
#include "../nemoh.c"

static uint64_t seed = 1;
static double uni(void) { seed++; return coin(seed, seed * 7919u); }   /* [0, 1) */

/* A rows x cols matrix of format dtype with row stride ld (elements); onehot: w[i][i % cols] = 1, else 0. */
static Mat make(int dtype, int rows, int cols, size_t ld, int onehot, void **buf, uint8_t **bs) {
    size_t n = (size_t)rows * ld, bytes = dtype == DT_F32 ? 4 * n : dtype == DT_NVFP4 ? n / 2 : dtype == DT_FP8 ? n : 2 * n;
    uint8_t *p = xcalloc(bytes + 1, 1);
    Mat W = {.data = p, .dtype = dtype, .rows = rows, .cols = cols, .ld = ld, .scale = 1};
    *bs = NULL;
    if (dtype == DT_NVFP4) {
        W.bld = ld / 16;
        *bs = xmalloc((size_t)rows * W.bld);
        for (size_t i = 0; i < (size_t)rows * W.bld; i++) (*bs)[i] = onehot ? 0x38 : (uint8_t)(0x30 + uni() * 16);   /* e4m3 1.0; 0.5 .. 1.9 */
        W.bs = *bs;
    }
    if (!onehot && (dtype == DT_FP8 || dtype == DT_NVFP4)) W.scale = 0.37f;
    for (int i = 0; i < rows; i++)
        for (int k = 0; k < cols; k++) {
            size_t e = (size_t)i * ld + k;
            int one = onehot && k == i % cols, zero = onehot && !one;
            float f = zero ? 0 : one ? 1 : (float)(uni() * 2 - 1);
            uint32_t u;
            memcpy(&u, &f, 4);
            if (dtype == DT_F32) memcpy(p + 4 * e, &f, 4);
            else if (dtype == DT_BF16) { uint16_t h = (uint16_t)(u >> 16); memcpy(p + 2 * e, &h, 2); }
            else if (dtype == DT_F16) { uint16_t h = zero ? 0 : one ? 0x3C00 : (uint16_t)(uni() * 0x7800) | (uni() < 0.5 ? 0x8000 : 0); memcpy(p + 2 * e, &h, 2); }
            else if (dtype == DT_FP8) p[e] = zero ? 0 : one ? 0x38 : (uint8_t)(uni() * 0x7E) | (uni() < 0.5 ? 0x80 : 0);
            else p[e / 2] |= (uint8_t)((zero ? 0 : one ? 2 : (int)(uni() * 16)) << 4 * (e & 1));
        }
    *buf = p;
    return W;
}

int main(void) {
    static const char *fmt[] = {"f32", "bf16", "f16", "fp8", "", "nvfp4"};
    const int dtypes[] = {DT_F32, DT_BF16, DT_F16, DT_FP8, DT_NVFP4};
    const int shapes[][2] = {{1, 48}, {16, 32}, {37, 33}, {33, 96}, {37, 1000}, {300, 130}, {33, 20000}};
    const int Ts[] = {1, 4, 5, 6, 11, 13};
    int pass = 0, fail = 0;
    cpu_threads = 2;
#ifdef NEMOH_AMX
    printf("bf16: %s\n", amx_fits(&(Mat){.dtype = DT_BF16, .rows = 16, .cols = 4096}) ? "the tile unit (AMX)" : "dot_rows (the tile unit refused)");
#else
    printf("bf16: dot_rows (a build without AMX)\n");
#endif
#ifdef NEMOH_LANES
    /* FP8 and NVFP4 in V16 lanes (AVX-512 or AVX2): every FP8 code (NaN included) under tensor scales
       from subnormal to the largest nemoh takes (products that round to subnormals and past the fp32
       range among them), and every NVFP4 byte under every block scale that is not NaN, against
       mat_at, bit for bit */
    uint8_t codes[256], scale = 0;
    for (int b = 0; b < 256; b++) codes[b] = (uint8_t)b;
    long lane_bad = 0;
    float got[16];
    const float tensor_scales[] = {0.37f, 1.0f, 3.1e-3f, 7.7e-41f, 1.3e-38f, 2.9e34f, 0x1.fffffep119f};
    for (size_t si = 0; si < sizeof tensor_scales / sizeof *tensor_scales; si++) {
        Mat q8 = {.data = codes, .dtype = DT_FP8, .rows = 1, .cols = 256, .ld = 256, .scale = tensor_scales[si]};
        for (int g = 0; g < 16; g++) {
            v_store(got, fp8_bytes(_mm_loadu_si128((const __m128i *)(codes + 16 * g)), q8.scale));
            for (int j = 0; j < 16; j++) { float want = mat_at(&q8, 0, (size_t)(16 * g + j)); lane_bad += memcmp(&got[j], &want, 4) != 0; }
        }
    }
    for (; scale < 127; scale++)
        for (int g = 0; g < 32; g++) {   /* 8 bytes, 16 elements, a group */
            Mat q4 = {.data = codes + 8 * g, .dtype = DT_NVFP4, .rows = 1, .cols = 16, .ld = 16, .bs = &scale, .bld = 1, .scale = 0.37f};
            v_store(got, nvfp4_lanes(codes + 8 * g, nvfp4_block_scale(&q4, 0, 0)));
            for (int j = 0; j < 16; j++) { float want = mat_at(&q4, 0, (size_t)j); lane_bad += memcmp(&got[j], &want, 4) != 0; }
        }
#ifdef NEMOH_AVX512
    printf("dot_rows: AVX-512 registers (bf16, FP8, NVFP4)\n");
#else
    printf("dot_rows: AVX2 registers (bf16, FP8, NVFP4)\n");
#endif
    if (lane_bad) fail++, printf("FAILED FP8 and NVFP4 in V16 lanes: %ld values differ from mat_at\n", lane_bad);
    else pass++;
#else
    printf("dot_rows: arrays of lanes (a build with neither AVX-512 nor AVX2)\n");
#endif
    for (size_t d = 0; d < sizeof dtypes / sizeof *dtypes; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (int onehot = 0; onehot < 2; onehot++) {
                int dt = dtypes[d], R = shapes[s][0], K = shapes[s][1];
                if (dt == DT_NVFP4 && K % 16) continue;
                if (K > 1000 && dt != DT_BF16) continue;   /* the long product is there for bf16's chunks of 5 tokens */
                size_t ld = (size_t)K + 16, ldx = (size_t)K + 5, ldo = (size_t)R + 3;
                void *buf;
                uint8_t *bs;
                Mat W = make(dt, R, K, ld, onehot, &buf, &bs);
                int Tmax = 13;
                float *x = xmalloc(Tmax * ldx * sizeof *x), *out = xmalloc(Tmax * ldo * sizeof *out), *one = xmalloc(ldo * sizeof *one);
                for (size_t i = 0; i < Tmax * ldx; i++) {
                    float f = (float)((uni() * 2 - 1) * exp2(uni() * 8 - 4));
                    uint32_t u;
                    memcpy(&u, &f, 4);
                    u |= (0x7FFFFF & (uint32_t)(uni() * 0x800000)) | 1;   /* all 24 mantissa bits in play */
                    memcpy(&x[i], &u, 4);
                }
                for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++) {
                    int T = Ts[ti];
                    long bad_ref = 0, bad_alone = 0;
                    double worst = 0;
                    matmul(out, (int)ldo, x, (int)ldx, T, &W);
                    for (int t = 0; t < T; t++) {
                        matmul(one, (int)ldo, x + t * ldx, (int)ldx, 1, &W);
                        for (int i = 0; i < R; i++) {
                            double ref = 0, mag = 0;
                            for (int k = 0; k < K; k++) {
                                double p = (double)mat_at(&W, (size_t)i, (size_t)k) * x[t * ldx + k];
                                ref += p, mag += fabs(p);
                            }
                            float got = out[t * ldo + i];
                            double err = fabs(got - ref), tol = onehot ? 0 : 4.0 * K * 0x1p-24 * mag;
                            if (!(err <= tol)) bad_ref++;
                            if (mag > 0 && err / mag > worst) worst = err / mag;
                            if (memcmp(&got, &one[i], 4)) bad_alone++;
                        }
                    }
                    char name[160];
                    snprintf(name, sizeof name, "%s %d x %d (ld %zu)%s, %d token%s", fmt[dt], R, K, ld, onehot ? " one-hot" : "", T, T > 1 ? "s" : "");
                    if (bad_ref || bad_alone) {
                        fail++;
                        printf("FAILED %s: %ld sums off float64 (worst %.3g of sum |w x|), %ld differ from the token alone\n", name, bad_ref, worst, bad_alone);
                    } else pass++;
                }
                free(buf), free(bs), free(x), free(out), free(one);
            }

    /* an FP8 NaN code (0x7F, 0xFF) in a group of 16, an odd group or the columns past them: its row's
       sums NaN for every token, the others (its pair among them) what the matrix without it gives */
    for (int code = 0x7F; code <= 0xFF; code += 0x80)
        for (int col = 5; col < 100; col += 45)
            for (int T = 1; T <= 5; T += 2) {
                void *buf;
                uint8_t *bs;
                Mat W = make(DT_FP8, 5, 100, 100, 0, &buf, &bs);
                float x[5 * 100], clean[5 * 5], got[5 * 5];
                for (int i = 0; i < 5 * 100; i++) x[i] = (float)(uni() * 2 - 1);
                matmul(clean, 5, x, 100, T, &W);
                ((uint8_t *)buf)[2 * 100 + col] = (uint8_t)code;
                matmul(got, 5, x, 100, T, &W);
                long bad = 0;
                for (int t = 0; t < T; t++)
                    for (int i = 0; i < 5; i++) bad += i == 2 ? !isnan(got[t * 5 + i]) : memcmp(&got[t * 5 + i], &clean[t * 5 + i], 4) != 0;
                if (bad) fail++, printf("FAILED fp8 NaN code 0x%02X at column %d, %d tokens: %ld sums wrong\n", code, col, T, bad);
                else pass++;
                free(buf), free(bs);
            }

    /* matmul_n: matrices of one input side by side, each as it is alone */
    const int sets[][MATMUL_MAX][2] = {{{DT_BF16, 300}, {DT_BF16, 37}, {DT_BF16, 12}, {DT_BF16, 256}, {DT_BF16, 16}},
                                       {{DT_FP8, 37}, {DT_BF16, 400}, {DT_NVFP4, 33}, {DT_BF16, 1}, {DT_F32, 20}}};
    for (size_t si = 0; si < sizeof sets / sizeof *sets; si++)
        for (int n = 1; n <= MATMUL_MAX; n += MATMUL_MAX - 1) {
            int K = 128, ldo = 0;
            Mat W[MATMUL_MAX];
            void *buf[MATMUL_MAX];
            uint8_t *bs[MATMUL_MAX];
            for (int m = 0; m < n; m++) W[m] = make(sets[si][m][0], sets[si][m][1], K, K + 16, 0, &buf[m], &bs[m]), ldo += W[m].rows;
            for (int T = 1; T <= 7; T += 6) {
                float *x = xmalloc((size_t)T * K * sizeof *x), *out = xmalloc((size_t)T * ldo * sizeof *out);
                float *alone = xmalloc((size_t)T * ldo * sizeof *alone);
                for (int i = 0; i < T * K; i++) x[i] = (float)(uni() * 2 - 1);
                matmul_n(out, ldo, x, K, T, W, n);
                for (int m = 0, off = 0; m < n; off += W[m].rows, m++) matmul(alone + off, ldo, x, K, T, &W[m]);
                long bad = 0;
                for (int i = 0; i < T * ldo; i++) bad += memcmp(&out[i], &alone[i], 4) != 0;
                if (bad) fail++, printf("FAILED matmul_n of %d matrices (set %zu), %d tokens: %ld outputs differ from each matrix's own matmul\n", n, si, T, bad);
                else pass++;
                free(x), free(out), free(alone);
            }
            for (int m = 0; m < n; m++) free(buf[m]), free(bs[m]);
        }

    /* fast_exp against exp in float64 */
    double worst = 0;
    long bad = 0;
    for (uint32_t u = 0; u < 0x42B0999Au; u += 997)   /* |x| from 0 to 88.3, both signs */
        for (uint32_t sign = 0; sign < 2; sign++) {
            uint32_t v = u | sign << 31;
            float x;
            memcpy(&x, &v, 4);
            if (x < -87.3f) continue;
            double e = exp((double)x), rel = fabs(fast_exp(x) - e) / e;
            worst = rel > worst ? rel : worst;
            bad += !(rel <= 3 * 0x1p-24);
        }
    float under = fast_exp(-1000.0f), nan = fast_exp(NAN), big = fast_exp(1000.0f);
    bad += !(under == 0) + !isnan(nan) + !isinf(big) + !(silu(-1e38f) == 0) + !isnan(silu(-INFINITY));
    for (float x = -30.0f; x <= 30.0f; x += 0.001f) {
        double sl = x / (1 + exp(-(double)x)), sp = log1p(exp((double)x));
        bad += !(fabs(silu(x) - sl) <= 4 * 0x1p-24 * fabs(sl) + 1e-30) + !(fabs(softplus(x) - sp) <= 4 * 0x1p-24 * sp + 1e-30);
    }
    if (bad) fail++, printf("FAILED fast_exp against float64: %ld values out of bounds (worst relative error %.3g)\n", bad, worst);
    else pass++;
    printf("%d passed, %d failed\n", pass, fail);
    return fail != 0;
}

/* bench/cpu_matmul: one CPU matrix product, of the default model's lm_head shape (8192 x 384) unless
 * ROWS and COLS are given, in bf16, FP8 and NVFP4, for 1 and 4 tokens: the best of 200 calls of
 * nemoh.c's matmul, on one core (cpu_threads stays 1).
 *
 *   cc -std=c11 -O3 -march=native -ffp-contract=fast -fopenmp -o build/bench_cpu_matmul bench/cpu_matmul.c -lm -lpthread
 *   build/bench_cpu_matmul [ROWS COLS] */
#define NEMOH_NO_MAIN
#include "../nemoh.c"

int main(int argc, char **argv) {
    int R = argc > 2 ? atoi(argv[1]) : 8192, C = argc > 2 ? atoi(argv[2]) : 384;
    if (R < 1 || C < 16 || C % 16) die("usage: bench_cpu_matmul [ROWS COLS], COLS a multiple of 16");
    uint16_t *w16 = xmalloc((size_t)R * C * sizeof *w16);
    uint8_t *w8 = xmalloc((size_t)R * C), *bs = xmalloc((size_t)R * C / 16);
    for (size_t i = 0; i < (size_t)R * C; i++) {
        uint32_t h = (uint32_t)(i * 2654435761u);
        w16[i] = 0x3f80 ^ (uint16_t)(h >> 20 & 0x7f);   /* bf16 in [1, 2) */
        w8[i] = (uint8_t)(h >> 21) % 0x7F | (uint8_t)(h >> 13 & 0x80);   /* any E4M3 code but NaN; NVFP4: two codes */
    }
    for (size_t i = 0; i < (size_t)R * C / 16; i++) bs[i] = (uint8_t)(0x30 + i % 13);   /* E4M3 0.5 .. 1.4 */
    const Mat W[] = {{.data = w16, .dtype = DT_BF16, .rows = R, .cols = C, .ld = C, .scale = 1},
                     {.data = w8, .dtype = DT_FP8, .rows = R, .cols = C, .ld = C, .scale = 0.37f},
                     {.data = w8, .dtype = DT_NVFP4, .rows = R, .cols = C, .ld = C, .bs = bs, .bld = C / 16, .scale = 0.37f}};
    const char *name[] = {"bf16", "FP8", "NVFP4"};
    float *x = xmalloc(4 * (size_t)C * sizeof *x), *out = xmalloc(4 * (size_t)R * sizeof *out);
    for (int i = 0; i < 4 * C; i++) x[i] = (i % 7) * 0.1f - 0.3f;
    for (int f = 0; f < 3; f++)
        for (int T = 1; T <= 4; T += 3) {
            double best = 1e9;
            for (int rep = 0; rep < 200; rep++) {
                double t0 = now_s();
                matmul(out, R, x, C, T, &W[f]);
                best = fmin(best, now_s() - t0);
            }
            printf("%-5s %d x %d, %d token%s: %7.1f us, %.1f GFLOP/s\n", name[f], R, C, T, T > 1 ? "s" : "", best * 1e6,
                   2.0 * R * C * T / best / 1e9);
        }
    free(w16), free(w8), free(bs), free(x), free(out);
    return 0;
}

/* bench/cpu_matmul: one CPU matrix product of the default model's lm_head shape (8192 x 384, bf16)
 * for 1 and 4 tokens, the best of 200 calls of nemoh.c's matmul, on one core.
 *
 *   cc -std=c11 -O3 -march=native -ffp-contract=fast -fopenmp -o build/bench_cpu_matmul bench/cpu_matmul.c -lm -lpthread
 *   OMP_NUM_THREADS=1 build/bench_cpu_matmul */
#define NEMOH_NO_MAIN
#include "../nemoh.c"

int main(void) {
    int R = 8192, C = 384;
    uint16_t *w = xmalloc((size_t)R * C * sizeof *w);
    for (size_t i = 0; i < (size_t)R * C; i++) w[i] = 0x3f80 ^ (uint16_t)(i * 2654435761u >> 20 & 0x7f);   /* bf16 in [1, 2) */
    Mat W = {.data = w, .dtype = DT_BF16, .rows = R, .cols = C, .ld = C, .scale = 1};
    float *x = xmalloc(4 * (size_t)C * sizeof *x), *out = xmalloc(4 * (size_t)R * sizeof *out);
    for (int i = 0; i < 4 * C; i++) x[i] = (i % 7) * 0.1f - 0.3f;
    for (int T = 1; T <= 4; T += 3) {
        double best = 1e9;
        for (int rep = 0; rep < 200; rep++) {
            double t0 = now_s();
            matmul(out, R, x, C, T, &W);
            best = fmin(best, now_s() - t0);
        }
        printf("%d token%s: %.1f us, %.1f GFLOP/s\n", T, T > 1 ? "s" : "", best * 1e6, 2.0 * R * C * T / best / 1e9);
    }
    free(w), free(x), free(out);
    return 0;
}

/* compare_logits: max |a - b| over two float32 logit files of the same size, against a tolerance.
 *   compare_logits A B TOL      exit 0 if every element agrees within TOL (and none is NaN), else 1
 *   compare_logits A B TOL N W  the same, A's rows N floats long against the first N of B's rows of W
 *                               (logits of the first N token ids only) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static float *load(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "compare_logits: %s: cannot open\n", path); exit(2); }
    fseek(f, 0, SEEK_END);
    *n = ftell(f) / 4;
    rewind(f);
    float *p = malloc((size_t)*n * 4 + 4);
    if (!p || fread(p, 4, (size_t)*n, f) != (size_t)*n) { fprintf(stderr, "compare_logits: %s: read failed\n", path); exit(2); }
    fclose(f);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 6) { fprintf(stderr, "usage: compare_logits A B TOL [N W]\n"); return 2; }
    long na, nb, N = argc == 6 ? atol(argv[4]) : 0, W = argc == 6 ? atol(argv[5]) : 0;
    float *a = load(argv[1], &na), *b = load(argv[2], &nb);
    if (N > 0 && W >= N && nb % W == 0) {   /* B's rows cut to their first N floats, in place */
        for (long r = 0; r < nb / W; r++)
            for (long k = 0; k < N; k++) b[r * N + k] = b[r * W + k];
        nb = nb / W * N;
    } else if (argc == 6) { printf("N %ld, W %ld: expected 0 < N <= W, W dividing B's %ld floats\n", N, W, nb); return 1; }
    double tol = atof(argv[3]), worst = 0;
    long at = 0;
    if (na != nb || na == 0) { printf("size mismatch: %ld vs %ld floats\n", na, nb); return 1; }
    for (long i = 0; i < na; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (isnan(d)) { worst = d; at = i; break; }   /* a NaN fails, wherever it stands */
        if (d > worst) { worst = d; at = i; }
    }
    printf("max |diff| %.3g at element %ld of %ld (tolerance %.3g)\n", worst, at, na, tol);
    free(a);
    free(b);
    return worst <= tol ? 0 : 1;
}

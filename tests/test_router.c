/* test_router: nemoh's MoE router (moe_route) against a float64 reference written apart from it.
 *
 * The rule is transformers' (NemotronH, DeepSeek-V3): s = sigmoid(W x); experts are chosen by s + bias:
 * groups scored by the sum of their two best, the topk_group best groups kept, then the top_k best
 * experts among them; weights s (no bias), / (sum + 1e-20) if norm_topk_prob, * routed_scaling_factor.
 * Equal candidates go to the lower index (the GPU router must choose the same). Cases: random shapes
 * (the published 128 top-6 and 512 top-22 among them), grouped rules, and exact ties made from equal
 * gate rows. A random draw whose float64 choice is within 1e-5 of a different one is drawn again:
 * there fp32 rounding may choose either. Prints one line per failure, then "N passed, M failed". */
#define NEMOH_NO_MAIN
#include "../nemoh.c"

enum { MAXE = 512, MAXG = 64, MAXK = 32 };

/* position of the best not-yet-taken value (ties: lower index); -1 if none is left */
static int best_of(const double *v, const int *taken, int n) {
    int b = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && v[i] > -INFINITY && (b < 0 || v[i] > v[b])) b = i;
    return b;
}

/* The float64 reference; returns the smallest gap between a chosen candidate and the best unchosen
 * one that differs from it (0-gaps between equal values are ties, decided by index in both). */
static double ref_route(int E, int G, int KG, int K, int norm, double scale, int H, const float *W, const float *bias,
                        const float *x, int *idx, double *w) {
    double s[MAXE], c[MAXE], gs[MAXG], gap = INFINITY, sum = 0;
    int taken[MAXE] = {0}, gtaken[MAXG] = {0}, per = E / G;
    for (int e = 0; e < E; e++) {
        double d = 0;
        for (int i = 0; i < H; i++) d += (double)W[(size_t)e * H + i] * x[i];
        s[e] = 1 / (1 + exp(-d));
        c[e] = s[e] + bias[e];
    }
    if (G > 1) {
        for (int g = 0; g < G; g++) {
            int t[MAXE] = {0}, a = best_of(c + g * per, t, per);
            t[a] = 1;
            gs[g] = c[g * per + a] + c[g * per + best_of(c + g * per, t, per)];
        }
        double last = 0;
        for (int k = 0; k < KG; k++) { int g = best_of(gs, gtaken, G); gtaken[g] = 1; last = gs[g]; }
        int next = best_of(gs, gtaken, G);
        if (next >= 0 && gs[next] != last) gap = fmin(gap, last - gs[next]);
        for (int e = 0; e < E; e++) if (!gtaken[e / per]) c[e] = -INFINITY;
    }
    double last = 0;
    for (int k = 0; k < K; k++) {
        idx[k] = best_of(c, taken, E);
        taken[idx[k]] = 1;
        last = c[idx[k]];
        sum += w[k] = s[idx[k]];
    }
    int next = best_of(c, taken, E);
    if (next >= 0 && c[next] != last) gap = fmin(gap, last - c[next]);
    for (int k = 0; k < K; k++) w[k] = (norm ? w[k] / (sum + 1e-20) : w[k]) * scale;
    return gap;
}

static int passed, failed;

/* One router case: nemoh's choice and weights against the reference. ties 1 pairs up gate rows and
 * biases (expert 2j+1 equals 2j), so that every choice meets exact ties; ties 2 makes every expert
 * equal to expert 0. Returns 0 if the draw was too close to call. */
static int run_case(int E, int G, int KG, int K, int norm, float scale, int H, int ties, uint64_t seed) {
    static float W[MAXE * 256], bias[MAXE], x[256], scratch[2 * MAXE + MAXG], w[MAXK];
    int idx[MAXK], ridx[MAXK];
    double rw[MAXK];
    uint64_t n = 0;
    for (int e = 0; e < E; e++) {
        int src = ties == 2 ? 0 : ties && (e & 1) ? e - 1 : e;
        for (int i = 0; i < H; i++) W[(size_t)e * H + i] = src == e ? 2 * coin(seed, n++) - 1 : W[(size_t)src * H + i];
        bias[e] = src == e ? 0.3f * coin(seed, n++) : bias[src];
    }
    for (int i = 0; i < H; i++) x[i] = 2 * coin(seed, n++) - 1;
    double gap = ref_route(E, G, KG, K, norm, scale, H, W, bias, x, ridx, rw);
    if (gap < 1e-5) return 0;
    Config c = {0};
    c.hidden = H; c.n_experts = E; c.n_group = G; c.topk_group = KG; c.top_k = K; c.norm_topk = norm; c.routed_scale = scale;
    Layer L = {0};
    L.gate = W;
    L.gate_bias = bias;
    moe_route(&c, &L, x, scratch, idx, w);
    int ok = 1;
    for (int k = 0; k < K; k++) ok &= idx[k] == ridx[k] && fabs(w[k] - rw[k]) <= 1e-6 * (1 + fabs(rw[k]));
    if (ok) { passed++; return 1; }
    failed++;
    printf("FAIL router E %d n_group %d topk_group %d top_k %d norm %d ties %d seed %llu:", E, G, KG, K, norm, ties,
           (unsigned long long)seed);
    for (int k = 0; k < K; k++) printf(" %d/%d (%.7f/%.7f)", idx[k], ridx[k], w[k], rw[k]);
    printf("\n");
    return 1;
}

int main(void) {
    /* E, n_group, topk_group, top_k, norm, scale: the published routers, then awkward grouped ones */
    static const int shape[][5] = {{128, 1, 1, 6, 1}, {512, 1, 1, 22, 1}, {12, 2, 1, 3, 1}, {16, 4, 2, 5, 1},
                                   {10, 1, 1, 4, 0}, {64, 8, 3, 7, 0}, {256, 8, 4, 8, 1}, {6, 3, 3, 6, 1}, {2, 1, 1, 1, 1}};
    static const float scale[] = {2.5f, 5.0f, 2.5f, 5.0f, 1.5f, 1.0f, 2.5f, 1.0f, 1.0f};
    for (size_t i = 0; i < sizeof shape / sizeof shape[0]; i++)
        for (int ties = 0; ties < 2; ties++)
            for (uint64_t seed = 1, done = 0; done < 20 && seed < 200; seed++)
                done += (uint64_t)run_case(shape[i][0], shape[i][1], shape[i][2], shape[i][3], shape[i][4], scale[i], 48,
                                           ties, seed * 1000 + i);
    /* every expert equal: groups 0 and 1, then experts 0, 1, 2, each weighing 1/3 */
    run_case(16, 4, 2, 3, 1, 1.0f, 48, 2, 7);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}

/* test_kernels: every CUDA kernel of nemoh.cu against a float64 host reference, on fresh random
 * inputs (a new seed each run, printed) at sizes that are not multiples of 32, of 8 or of the
 * attention split. Tolerances are relative to the largest reference value: fp32 arithmetic lands
 * near 1e-6; products with bf16 operands are compared against a reference on the same rounded
 * operands, so they too are fp32-accurate. Last line: "N passed, M failed". */
#include "../nemoh.cu"

#include <random>

static int n_pass, n_fail;
static std::mt19937_64 rng;

static float uni() { return std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng); }
static float bf16_round(float v) { return __bfloat162float(__float2bfloat16(v)); }
static double bf16r(double v, int round) { return round ? (double)bf16_round((float)v) : v; }

static std::vector<float> rand_vec(size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto &x : v) x = uni() * scale;
    return v;
}

/* cudaMemcpy from pageable memory may return before the bytes land, and the engine's streams do not
 * wait for the default stream: the device is synchronized before any kernel may read them. */
static void upload(void *d, const void *h, size_t bytes) {
    CUDA_CHECK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
}

static float *dev_copy(const std::vector<float> &h) {
    float *d;
    CUDA_CHECK(cudaMalloc(&d, (h.size() ? h.size() : 1) * sizeof(float)));
    upload(d, h.data(), h.size() * sizeof(float));
    return d;
}

static std::vector<float> host_copy(const float *d, size_t n) {
    std::vector<float> h(n);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

/* The same in a KV cache's dtype (float or bf16, rounded to nearest even), and back as float. */
template <typename KT> static KT *dev_copy_as(const std::vector<float> &h) {
    std::vector<KT> v(h.begin(), h.end());
    KT *d;
    CUDA_CHECK(cudaMalloc(&d, (v.size() ? v.size() : 1) * sizeof(KT)));
    upload(d, v.data(), v.size() * sizeof(KT));
    return d;
}

template <typename KT> static std::vector<float> host_copy_as(const KT *d, size_t n) {
    std::vector<KT> v(n);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(KT), cudaMemcpyDeviceToHost));
    return std::vector<float>(v.begin(), v.end());
}

/* max |got - ref| / max |ref|, NaN counting as a failure */
static void expect(const char *what, const std::vector<float> &got, const std::vector<double> &ref, double tol, double floor = 0) {
    double worst = 0, scale = fmax(floor, 1e-30);
    for (double r : ref) scale = fmax(scale, fabs(r));
    for (size_t i = 0; i < ref.size() && i < got.size(); i++) {
        double d = fabs(got[i] - ref[i]) / scale;
        if (isnan(d)) { worst = d; break; }   /* a NaN fails the check, wherever it stands */
        if (d > worst) worst = d;
    }
    int ok = got.size() >= ref.size() && worst <= tol;
    printf("%-7s %-62s rel err %.2e (tol %.0e)\n", ok ? "ok" : "FAILED", what, worst, tol);
    ok ? n_pass++ : n_fail++;
}

/* got == want bit for bit (the same computation reached by another path): the count of elements that
 * differ, and the largest difference among them */
static void expect_same(const char *what, const std::vector<float> &got, const std::vector<float> &want) {
    size_t bad = got.size() != want.size() ? 1 : 0;
    double worst = 0;
    for (size_t i = 0; i < got.size() && i < want.size(); i++)
        if (memcmp(&got[i], &want[i], sizeof(float))) {
            bad++;
            worst = fmax(worst, fabs((double)got[i] - want[i]));
        }
    printf("%-7s %-62s %zu of %zu differ (max %.2e)\n", bad ? "FAILED" : "ok", what, bad, want.size(), worst);
    bad ? n_fail++ : n_pass++;
}

static void expect_int(const char *what, int got, int want) {
    int ok = got == want;
    printf("%-7s %-62s got %d, want %d\n", ok ? "ok" : "FAILED", what, got, want);
    ok ? n_pass++ : n_fail++;
}

/* ---- matrices stored in each format (Mat in nemoh.h), with the values nemoh.h's mat_at gives them ---- */
static const char *fmt_name(int fmt) { return fmt == DT_F32 ? "fp32" : fmt == DT_BF16 ? "bf16" : fmt == DT_FP8 ? "fp8" : "nvfp4"; }

/* A random [rows, ld] matrix stored in format fmt as a checkpoint holds it, elements of about
 * uniform(-sd, sd): fp32, bf16 (rounded), FP8 (random codes, not NaN, times a scale), NVFP4 (random
 * codes in blocks of random scales 2^-3 .. 2^3, times a scale); v: its values, as mat_at reads them. */
typedef struct {
    std::vector<uint8_t> b;     /* storage: [rows, ld] elements of fmt */
    std::vector<uint8_t> bs;    /* NVFP4: [rows, ld / 16] E4M3 block scales */
    std::vector<float> v;       /* [rows, ld] the values */
    int fmt, rows, ld;
    float scale;
} HostMat;

/* The view [r0, r0 + rows) x [c0, c0 + cols) of h (an NVFP4 c0 a multiple of 16). */
static Mat view(const HostMat &h, int r0, int rows, int c0, int cols) {
    size_t at = (size_t)r0 * h.ld + c0, es = h.fmt == DT_F32 ? 4 : h.fmt == DT_BF16 ? 2 : 1;
    Mat m = {h.b.data() + (h.fmt == DT_NVFP4 ? at / 2 : at * es), h.fmt, rows, cols, (size_t)h.ld, NULL, 0, h.scale};
    if (h.fmt == DT_NVFP4) { m.bld = (size_t)h.ld / 16; m.bs = h.bs.data() + (size_t)r0 * m.bld + c0 / 16; }
    return m;
}

static HostMat host_mat(int fmt, int rows, int ld, float sd) {
    HostMat h = {std::vector<uint8_t>((size_t)rows * ld * (fmt == DT_F32 ? 4 : fmt == DT_BF16 ? 2 : 1)),
                 std::vector<uint8_t>((size_t)rows * ld / 16), std::vector<float>((size_t)rows * ld), fmt, rows, ld, 1.0f};
    for (size_t i = 0; i < h.v.size(); i++) {
        float v = uni() * sd;
        __nv_bfloat16 b = __float2bfloat16(v);
        if (fmt == DT_F32) memcpy(&h.b[4 * i], &v, 4);
        if (fmt == DT_BF16) memcpy(&h.b[2 * i], &b, 2);
        if (fmt == DT_FP8) { h.b[i] = (uint8_t)(rng() & 0xFF); if ((h.b[i] & 0x7F) == 0x7F) h.b[i] ^= 1; }
    }
    if (fmt == DT_NVFP4) {
        for (size_t i = 0; i < h.b.size() / 2; i++) h.b[i] = (uint8_t)(rng() & 0xFF);
        for (auto &s : h.bs)   /* e4m3 2^-3 .. 2^3, an eighth of them 256 .. 448 (the top of the range) */
            s = (uint8_t)(rng() % 8 ? 0x20 + rng() % 0x31 : 0x78 + rng() % 7);
    }
    if (fmt == DT_FP8) h.scale = sd / 60.0f;      /* random codes reach 448 */
    if (fmt == DT_NVFP4) h.scale = sd / 6.0f;
    Mat m = view(h, 0, rows, 0, ld);
    for (int i = 0; i < rows; i++)
        for (int k = 0; k < ld; k++) h.v[(size_t)i * ld + k] = mat_at(&m, (size_t)i, (size_t)k);
    return h;
}

static GpuRank make_rank(size_t act) {
    GpuRank g;
    memset(&g, 0, sizeof g);
    CUDA_CHECK(cudaStreamCreate(&g.stream));
    g.gemv_slots = gemv_slots(0);
    CUBLAS_CHECK(cublasCreate(&g.blas));
    CUBLAS_CHECK(cublasSetStream(g.blas, g.stream));
    CUDA_CHECK(cudaMalloc(&g.act16, act * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&g.deq, DEQ_BYTES));
    return g;
}

static void free_rank(GpuRank *g) {
    CUDA_CHECK(cudaFree(g->act16));
    CUDA_CHECK(cudaFree(g->deq));
    CUBLAS_CHECK(cublasDestroy(g->blas));
    CUDA_CHECK(cudaStreamDestroy(g->stream));
}

/* ---- matrix products: GEMV (one token) and cuBLAS (a chunk; a quantized matrix dequantized first),
 * in every format, stacked uploads ---- */
static void test_matmul(int fmt, int rows, int cols, int T, int epi) {
    /* two stacked parts, as q, k and v are uploaded, each a strided view of a wider tensor, the second
       with a scale of its own */
    int r1 = rows / 3 + 1, r2 = rows - r1, ld = cols + (fmt == DT_NVFP4 ? 16 : 5);
    HostMat h = host_mat(fmt, rows, ld, 1.0f / sqrtf((float)cols));
    Mat parts[2] = {view(h, 0, r1, 0, cols), view(h, r1, r2, 0, cols)};
    parts[1].scale *= 1.5f;
    GMat W = upload_mat(parts, 2);
    std::vector<float> x = rand_vec((size_t)T * cols);
    GpuRank g = make_rank((size_t)T * pad8(cols));
    g.act_w = pad8(cols);
    float *dx = dev_copy(x), *dout;
    CUDA_CHECK(cudaMalloc(&dout, (size_t)T * rows * sizeof(float)));
    matmul(&g, dout, rows, dx, cols, T, &W, epi, &W, nullptr);   /* warms its own rows again: harmless, and run */
    std::vector<double> ref((size_t)T * rows);
    double mag = 0;   /* the largest sum of |w x| over a row */
    for (int t = 0; t < T; t++)
        for (int i = 0; i < rows; i++) {
            double s = 0, a = 0;
            for (int k = 0; k < cols; k++) {
                float xv = x[(size_t)t * cols + k], wv = mat_at(&parts[i >= r1], (size_t)(i - (i >= r1) * r1), (size_t)k);
                if (fmt != DT_F32 && T > 1) { xv = bf16_round(xv); wv = bf16_round(wv); }  /* cuBLAS path: bf16 operands */
                else if (fmt == DT_NVFP4) xv = bf16_round(xv);   /* the tensor-core decode: x in bf16 */
                s += (double)wv * xv;
                a += fabs((double)wv * xv);
            }
            if (epi) s = s > 0 ? s * s : 0;
            ref[(size_t)t * rows + i] = s;
            mag = fmax(mag, a);
        }
    char what[128];
    snprintf(what, sizeof what, "%s %s %dx%d, %d token%s%s", T == 1 ? "gemv" : "cuBLAS", fmt_name(fmt), rows, cols, T,
             T > 1 ? "s" : "", epi ? ", relu^2" : "");
    /* relative to the largest output, and at least to the size a sum of cols terms of random sign has,
       sum |w x| / sqrt(cols): a single row may nearly cancel (one row of 16 NVFP4 values: 6.05e-5 of its
       output, seed 1480456781 on an H200) */
    double typical = mag / sqrt((double)cols);
    expect(what, host_copy(dout, ref.size()), ref, 2e-5, epi ? typical * typical : typical);
    free_mat(&W);
    CUDA_CHECK(cudaFree(dx));
    CUDA_CHECK(cudaFree(dout));
    free_rank(&g);
}

/* ---- a few tokens' product as a decoded step runs it (a verify step), in every format and epilogue:
 * one launch of the several-token kernel against T launches of the one-token kernel, bit for bit, and
 * against float64; x and out with row strides of their own (x's padding NaN: a read past a row
 * shows); EPI_GNORM with each token's own partial sums of u^2 ---- */
static void test_gemv_tokens(int fmt, int rows, int cols, int T, int epi, int groups = 1) {
    HostMat h = host_mat(fmt, rows, cols, 1.0f / sqrtf((float)cols));
    Mat m = view(h, 0, rows, 0, cols);
    GMat W = upload_mat(&m, 1);
    int ldx = (cols + 3) / 4 * 4 + 4, ldo = rows + 3, gsize = cols / groups, parts = 3;
    std::vector<float> x((size_t)T * ldx, NAN), ss((size_t)T * groups * parts);
    for (int t = 0; t < T; t++) for (int k = 0; k < cols; k++) x[(size_t)t * ldx + k] = uni();
    for (auto &v : ss) v = 0.5f + (uni() + 1) * gsize;
    GpuRank g = make_rank(8);
    g.dec_t = g.dec_now = T;
    float *dx = dev_copy(x), *dss = dev_copy(ss), *many = dev_copy(std::vector<float>((size_t)T * ldo, NAN));
    float *one = dev_copy(std::vector<float>((size_t)T * ldo, NAN));
    GroupScale gs = {dss, parts, gsize, 1e-5f, (size_t)groups * parts};
    matmul(&g, many, ldo, dx, ldx, T, &W, epi, &W, epi == EPI_GNORM ? &gs : nullptr);
    for (int t = 0; t < T; t++) {
        GroupScale g1 = gs;
        g1.ss += (size_t)t * gs.step;
        matmul(&g, one + (size_t)t * ldo, ldo, dx + (size_t)t * ldx, ldx, 1, &W, epi, &W, epi == EPI_GNORM ? &g1 : nullptr);
    }
    std::vector<float> got_many = host_copy(many, (size_t)T * ldo), got_one = host_copy(one, (size_t)T * ldo), a, b;
    std::vector<double> ref;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < rows; i++) {
            double acc = 0;
            for (int k = 0; k < cols; k++) {
                double sc = 1;
                if (epi == EPI_GNORM) {
                    double sum = 0;
                    for (int j = 0; j < parts; j++) sum += ss[((size_t)t * groups + k / gsize) * parts + j];
                    sc = 1 / sqrt(sum / gsize + 1e-5);
                }
                float xv = x[(size_t)t * ldx + k];
                acc += (double)h.v[(size_t)i * cols + k] * (fmt == DT_NVFP4 ? bf16_round(xv) : xv) * sc;   /* NVFP4: x in bf16 */
            }
            if (epi == EPI_RELU2) acc = acc > 0 ? acc * acc : 0;
            ref.push_back(acc);
            a.push_back(got_many[(size_t)t * ldo + i]);
            b.push_back(got_one[(size_t)t * ldo + i]);
        }
    char what[160];
    snprintf(what, sizeof what, "gemv %s %dx%d, %d tokens in one launch%s = one by one", fmt_name(fmt), rows, cols, T,
             epi == EPI_RELU2 ? ", relu^2" : epi == EPI_GNORM ? ", group scales" : "");
    expect_same(what, a, b);
    expect("... against float64", a, ref, 2e-5);
    free_mat(&W);
    for (float *p : {dx, dss, many, one}) CUDA_CHECK(cudaFree(p));
    free_rank(&g);
}

/* ---- embedding gather, RMSNorm with and without the residual add ---- */
static void test_norms(int hidden, int T) {
    std::vector<float> res = rand_vec((size_t)T * hidden, 3.0f), add = rand_vec((size_t)T * hidden), w = rand_vec(hidden);
    for (int with_add = 0; with_add < 2; with_add++) {
        float *dres = dev_copy(res), *dadd = dev_copy(add), *dw = dev_copy(w), *dx = dev_copy(std::vector<float>((size_t)T * hidden));
        bf16 *dx16 = dev_copy_as<bf16>(std::vector<float>((size_t)T * hidden, NAN));   /* the bf16 copy, with the add only */
        LAUNCH(T, NORM_THREADS, 0, 0, rmsnorm_kernel, dx, with_add ? dx16 : NULL, dres, with_add ? dadd : NULL, dw, hidden, 1e-5f);
        std::vector<double> rx((size_t)T * hidden), rr((size_t)T * hidden);
        for (int t = 0; t < T; t++) {
            double ss = 0;
            for (int i = 0; i < hidden; i++) {
                size_t k = (size_t)t * hidden + i;
                rr[k] = (double)res[k] + (with_add ? add[k] : 0);
                ss += rr[k] * rr[k];
            }
            for (int i = 0; i < hidden; i++) rx[(size_t)t * hidden + i] = rr[(size_t)t * hidden + i] / sqrt(ss / hidden + 1e-5) * w[i];
        }
        char what[128];
        snprintf(what, sizeof what, "rmsnorm%s hidden=%d T=%d: normed", with_add ? " + residual add" : "", hidden, T);
        expect(what, host_copy(dx, rx.size()), rx, 1e-5);
        snprintf(what, sizeof what, "rmsnorm%s hidden=%d T=%d: residual", with_add ? " + residual add" : "", hidden, T);
        expect(what, host_copy(dres, rr.size()), rr, 1e-6);
        if (with_add) {
            snprintf(what, sizeof what, "rmsnorm + residual add hidden=%d T=%d: normed, in bf16 too", hidden, T);
            expect(what, host_copy_as(dx16, rx.size()), rx, 4e-3);
        }
        CUDA_CHECK(cudaFree(dx16));
        for (float *p : {dres, dadd, dw, dx}) CUDA_CHECK(cudaFree(p));
    }
    int V = 37, cols = hidden / 16 * 16;
    std::vector<int> tok(T);
    for (auto &t : tok) t = (int)(rng() % V);
    int *dtok;
    CUDA_CHECK(cudaMalloc(&dtok, T * sizeof(int)));
    upload(dtok, tok.data(), T * sizeof(int));
    for (int fmt : {DT_F32, DT_BF16, DT_FP8, DT_NVFP4}) {
        HostMat table = host_mat(fmt, V, cols, 1.0f);
        Mat m = view(table, 0, V, 0, cols);
        GMat E = upload_mat(&m, 1);
        float *dres = dev_copy(std::vector<float>((size_t)T * cols));
        LAUNCH(dim3(cdiv(cols, 256), T), 256, 0, 0, embed_kernel, dres, (const GMat)E, (const int *)dtok, cols);
        std::vector<double> ref((size_t)T * cols);
        for (int t = 0; t < T; t++) for (int i = 0; i < cols; i++) ref[(size_t)t * cols + i] = table.v[(size_t)tok[t] * cols + i];
        char what[96];
        snprintf(what, sizeof what, "embedding gather, %s, %d wide", fmt_name(fmt), cols);
        expect(what, host_copy(dres, ref.size()), ref, 0);
        free_mat(&E);
        CUDA_CHECK(cudaFree(dres));
    }
    CUDA_CHECK(cudaFree(dtok));
}

/* ---- the MTP block's input (be->mtp_in): res[t] = eh_proj [enorm(embed[tok[t]]) ; hnorm(x[row + t])], the
 * embedding table in fe, eh_proj in fw; x rows other than row .. row + T - 1 are NaN, so a wrong row
 * shows. The two norms against float64; the product against float64 on the GPU's own eh (rounded to
 * bf16 where cuBLAS takes a prompt's bf16 operands: W's values too) ---- */
static void test_mtp_in(int fe, int fw, int H, int T, int row, int dec_t) {
    int V = 41, t_max = row + T + 2;
    float eps = 1e-5f;
    HostMat emb = host_mat(fe, V, H, 1.0f), W = host_mat(fw, H, 2 * H, 1.0f / sqrtf(2.0f * H));
    std::vector<float> x((size_t)t_max * H, NAN), en = rand_vec(H), hn = rand_vec(H);
    for (size_t i = (size_t)row * H; i < (size_t)(row + T) * H; i++) x[i] = 3 * uni();
    std::vector<int> tok(T);
    for (auto &t : tok) t = (int)(rng() % V);
    Config c;
    memset(&c, 0, sizeof c);
    c.hidden = H;
    c.eps = eps;
    c.n_mtp = 1;
    GpuRank g = make_rank((size_t)T * pad8(2 * H));
    g.act_w = pad8(2 * H);
    g.dec_t = g.dec_now = dec_t;
    Mat ev = view(emb, 0, V, 0, H), wv = view(W, 0, H, 0, 2 * H);
    g.embed = upload_mat(&ev, 1);
    g.eh_proj = upload_mat(&wv, 1);
    g.enorm = dev_copy(en);
    g.hnorm = dev_copy(hn);
    g.x = dev_copy(x);
    g.eh = dev_copy(std::vector<float>((size_t)T * 2 * H, NAN));
    g.res = dev_copy(std::vector<float>((size_t)T * H, NAN));
    CUDA_CHECK(cudaMalloc(&g.tok, T * sizeof(int)));
    upload(g.tok, tok.data(), T * sizeof(int));
    int pos_row[2] = {0, row};   /* (position, x row) as step_start puts them on the device */
    CUDA_CHECK(cudaMalloc(&g.pos, sizeof pos_row));
    upload(g.pos, pos_row, sizeof pos_row);
    Rank r;
    memset(&r, 0, sizeof r);
    r.c = &c;
    r.st = &g;
    r.t_max = t_max;
    gpu_mtp_in(&r, tok.data(), T, row);
    std::vector<float> eh = host_copy(g.eh, (size_t)T * 2 * H);
    std::vector<double> ref_eh((size_t)T * 2 * H), ref((size_t)T * H);
    int rb = T > dec_t && fw != DT_F32;   /* cuBLAS on bf16 operands */
    for (int t = 0; t < T; t++) {
        for (int half = 0; half < 2; half++) {
            double ss = 0;
            for (int i = 0; i < H; i++) {
                double v = half ? x[(size_t)(row + t) * H + i] : emb.v[(size_t)tok[t] * H + i];
                ss += v * v;
            }
            for (int i = 0; i < H; i++) {
                double v = half ? x[(size_t)(row + t) * H + i] : emb.v[(size_t)tok[t] * H + i];
                ref_eh[((size_t)t * 2 + half) * H + i] = v / sqrt(ss / H + eps) * (half ? hn[i] : en[i]);
            }
        }
        for (int i = 0; i < H; i++) {
            double a = 0;
            for (int k = 0; k < 2 * H; k++) a += bf16r(W.v[(size_t)i * 2 * H + k], rb) * bf16r(eh[(size_t)t * 2 * H + k], rb);
            ref[(size_t)t * H + i] = a;
        }
    }
    char what[160];
    snprintf(what, sizeof what, "mtp_in %s embedding, hidden %d, %d token%s from row %d: [enorm(e) ; hnorm(h)]", fmt_name(fe), H, T,
             T > 1 ? "s" : "", row);
    expect(what, eh, ref_eh, 1e-5);
    snprintf(what, sizeof what, "... eh_proj %s (%s)", fmt_name(fw), T > dec_t ? "cuBLAS" : T > 1 ? "multi-token gemv" : "gemv");
    expect(what, host_copy(g.res, ref.size()), ref, 2e-5);
    free_mat(&g.embed);
    free_mat(&g.eh_proj);
    for (void *p : {(void *)g.enorm, (void *)g.hnorm, (void *)g.x, (void *)g.eh, (void *)g.res, (void *)g.tok, (void *)g.pos}) CUDA_CHECK(cudaFree(p));
    free_rank(&g);
}

/* ---- host, float64: the selective scan of T steps, the same steps as nemoh.c's cpu_mamba:
 * dt = softplus(dt_raw + dt_bias), S = exp(dt A) S + dt x B^T, y = S C + D x. proj rows are
 * z | xBC | dt (width in), xbc rows x | B | C; ssm (heads*hdim x N) carries the state over. ---- */
static std::vector<double> ref_scan(const std::vector<float> &proj, int in, const std::vector<double> &xbc, std::vector<double> &ssm,
                                    const std::vector<float> &A, const std::vector<float> &D, const std::vector<float> &dtb,
                                    int T, int heads, int hdim, int groups, int N) {
    int di = heads * hdim, cv = di + 2 * groups * N;
    std::vector<double> y((size_t)T * di);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            int g = h / (heads / groups);
            double raw = proj[(size_t)t * in + di + cv + h] + dtb[h], dt = raw > 20 ? raw : log1p(exp(raw)), dA = exp(dt * A[h]);
            for (int p = 0; p < hdim; p++) {
                double xv = xbc[(size_t)t * cv + h * hdim + p], acc = 0;
                for (int n = 0; n < N; n++) {
                    double &S = ssm[((size_t)h * hdim + p) * N + n];
                    S = dA * S + dt * xv * xbc[(size_t)t * cv + di + g * N + n];
                    acc += S * xbc[(size_t)t * cv + di + groups * N + g * N + n];
                }
                y[(size_t)t * di + h * hdim + p] = acc + D[h] * xv;
            }
        }
    return y;
}

/* A scan's inputs as gpu_mamba lays them out: proj rows z | xBC | dt (width in), xbc rows x | B | C. */
static ScanArgs scan_args(float *y, float *ssm, const float *xbc, const float *proj, int in, const float *A, const float *D,
                          const float *dtb, int T, int heads, int hdim, int groups, int N) {
    int di = heads * hdim, cv = di + 2 * groups * N;
    return ScanArgs{.y = y, .ssm = ssm, .xbc = xbc, .proj = proj, .ld_proj = in, .dt_off = di + cv, .A = A, .D = D, .dt_bias = dtb,
                    .T = T, .heads = heads, .hdim = hdim, .groups = groups, .d_inner = di, .chunk = 0, .warm = nullptr, .warm_n = 0,
                    .gw = nullptr, .gss = nullptr};
}

/* ---- Mamba2: conv + state, the selective scan + state, the gated group norm, over several calls; at a
 * single step whose groups are whole 16-byte pieces, the gated norm as decode folds it: the scan gates
 * and out_proj (a random one here, 37 x di) scales the groups (EPI_GNORM) ---- */
static void test_mamba(int heads, int hdim, int groups, int N, std::vector<int> steps, int fmt = DT_BF16, int pad = 3) {
    int di = heads * hdim, cv = di + 2 * groups * N, in = di + cv + heads + pad;   /* proj rows: z | xBC | dt, then padding */
    std::vector<float> cw = rand_vec((size_t)cv * 4, 0.5f), cb = rand_vec(cv, 0.2f), A(heads), D = rand_vec(heads), dtb(heads),
        gw = rand_vec(di);
    for (int h = 0; h < heads; h++) { A[h] = -(1.0f + 15.0f * (uni() + 1) / 2); dtb[h] = h % 3 ? -3.0f + uni() : -12.0f; }
    std::vector<double> conv_st((size_t)cv * 3, 0.0), ssm((size_t)di * N, 0.0);
    float *d_cw = dev_copy(cw), *d_cb = dev_copy(cb), *d_A = dev_copy(A), *d_D = dev_copy(D), *d_dtb = dev_copy(dtb);
    float *d_gw = dev_copy(gw), *d_cst = dev_copy(std::vector<float>((size_t)cv * 3)), *d_ssm = dev_copy(std::vector<float>((size_t)di * N));
    int LR = scan_lanes(N), gs = di / groups, rows = 37;
    HostMat hwo = host_mat(fmt, rows, di, 1.0f / sqrtf((float)di));
    const std::vector<float> &wo = hwo.v;
    Mat wm = view(hwo, 0, rows, 0, di);
    GMat Wo = upload_mat(&wm, 1);
    GpuRank gr = make_rank(1);
    float *d_gss = dev_copy(std::vector<float>((size_t)heads * scan_blocks(hdim, N))), *d_out = dev_copy(std::vector<float>(rows));
    for (int T : steps) {
        int fold = gnorm_folds(T == 1, heads, hdim, N, gs, gnorm_unit(fmt));
        std::vector<float> proj = rand_vec((size_t)T * in);
        float *d_proj = dev_copy(proj), *d_xbc = dev_copy(std::vector<float>((size_t)T * cv)), *d_y = dev_copy(std::vector<float>((size_t)T * di));
        LAUNCH(dim3(cdiv(cv, 128), cdiv(T, CONV_STEPS)), 128, 0, 0, conv_kernel, d_xbc, d_proj + di, in, d_cst, d_cw, d_cb, T, cv,
               (float *)nullptr, (size_t)0);
        if (T > CONV_STEPS) {
            LAUNCH(cdiv(cv, 128), 128, 0, 0, conv_state_kernel, d_cst, d_proj + di, in, T, cv);
        }
        ScanArgs sa = scan_args(d_y, d_ssm, d_xbc, d_proj, in, d_A, d_D, d_dtb, T, heads, hdim, groups, N);
        sa.warm = d_proj;
        sa.warm_n = (size_t)T * in * sizeof(float);
        sa.gw = fold ? d_gw : nullptr;
        sa.gss = fold ? d_gss : nullptr;
        ssm_scan(0, sa, N);
        std::vector<float> y_scan = host_copy(d_y, (size_t)T * di);
        GroupScale gsc = {d_gss, heads / groups * scan_blocks(hdim, N), gs, 1e-5f};
        bf16 *d_u16 = dev_copy_as<bf16>(std::vector<float>((size_t)T * di, NAN));
        if (fold) {
            matmul(&gr, d_out, rows, d_y, di, 1, &Wo, EPI_GNORM, nullptr, &gsc);
        } else {   /* into bf16 (a bf16 model's prompt), then in place in fp32 */
            gated_norm(0, d_u16, di, d_y, d_proj, in, d_gw, T, di, gs, 1e-5f);
            gated_norm(0, d_y, di, d_y, d_proj, in, d_gw, T, di, gs, 1e-5f);
        }
        /* host, float64: the same steps as nemoh.c's cpu_mamba */
        std::vector<double> xbc((size_t)T * cv), u((size_t)T * di);
        for (int c = 0; c < cv; c++) {
            std::vector<double> hist(3 + T);
            for (int k = 0; k < 3; k++) hist[k] = conv_st[(size_t)c * 3 + k];
            for (int t = 0; t < T; t++) hist[3 + t] = proj[(size_t)t * in + di + c];
            for (int t = 0; t < T; t++) {
                double a = cb[c];
                for (int k = 0; k < 4; k++) a += cw[(size_t)c * 4 + k] * hist[t + k];
                xbc[(size_t)t * cv + c] = a / (1 + exp(-a));
            }
            for (int k = 0; k < 3; k++) conv_st[(size_t)c * 3 + k] = hist[T + k];
        }
        std::vector<double> y = ref_scan(proj, in, xbc, ssm, A, D, dtb, T, heads, hdim, groups, N);
        std::vector<double> yg = y;   /* what the scan writes: y, or at a folded step u * gw */
        for (int t = 0; t < T; t++)
            for (int g = 0; g < groups; g++) {
                double ss = 0;
                for (int i = 0; i < gs; i++) {
                    size_t k = (size_t)t * di + g * gs + i;
                    double z = proj[(size_t)t * in + g * gs + i];
                    u[k] = y[k] * z / (1 + exp(-z));
                    ss += u[k] * u[k];
                    if (fold) yg[k] = u[k] * gw[g * gs + i];
                }
                for (int i = 0; i < gs; i++) u[(size_t)t * di + g * gs + i] *= gw[g * gs + i] / sqrt(ss / gs + 1e-5);
                /* NVFP4's tensor-core decode rounds its input, the scan's u * gw, to bf16 before the group's scale */
                for (int i = 0; fold && fmt == DT_NVFP4 && i < gs; i++)
                    u[(size_t)t * di + g * gs + i] = bf16_round(y_scan[(size_t)t * di + g * gs + i]) / sqrt(ss / gs + 1e-5);
            }
        std::vector<double> st_ref(ssm.begin(), ssm.end()), cst_ref(conv_st.begin(), conv_st.end());
        char what[128];
        snprintf(what, sizeof what, "conv1d+SiLU heads %d x %d, groups %d, N %d, %d step%s", heads, hdim, groups, N, T, T > 1 ? "s" : "");
        expect(what, host_copy(d_xbc, xbc.size()), xbc, 2e-6);
        snprintf(what, sizeof what, "conv1d state after those steps");
        expect(what, host_copy(d_cst, cst_ref.size()), cst_ref, 0);
        snprintf(what, sizeof what, "selective scan output (N %d, %d lanes per 4 rows%s)", N, LR, fold ? ", gated" : "");
        expect(what, y_scan, yg, 2e-5);
        snprintf(what, sizeof what, "selective scan state after those steps");
        expect(what, host_copy(d_ssm, st_ref.size()), st_ref, 2e-5);
        if (fold) {
            std::vector<double> ref(rows, 0.0);
            for (int i = 0; i < rows; i++) for (int k = 0; k < di; k++) ref[i] += wo[(size_t)i * di + k] * u[k];
            snprintf(what, sizeof what, "gated group RMSNorm folded into out_proj (%d groups of %d)", groups, gs);
            expect(what, host_copy(d_out, rows), ref, 2e-5);
        } else {
            snprintf(what, sizeof what, "gated group RMSNorm (%d groups of %d)", groups, gs);
            expect(what, host_copy(d_y, u.size()), u, 2e-5);
            snprintf(what, sizeof what, "gated group RMSNorm into bf16 (%d groups of %d)", groups, gs);
            expect(what, host_copy_as(d_u16, u.size()), u, 4e-3);
        }
        CUDA_CHECK(cudaFree(d_u16));
        for (float *p : {d_proj, d_xbc, d_y}) CUDA_CHECK(cudaFree(p));
    }
    for (float *p : {d_cw, d_cb, d_A, d_D, d_dtb, d_gw, d_cst, d_ssm, d_gss, d_out}) CUDA_CHECK(cudaFree(p));
    free_mat(&Wo);
    free_rank(&gr);
}

/* ---- keep + rewind: a step of T tokens whose recurrent states are kept (gpu_begin with r->keep, then
 * conv + scan as gpu_mamba launches them, gated where one token's decode is) against T one-token
 * steps from the same random state: outputs and the scan's sums of u^2 bit for bit; then rewind(t)
 * in a shuffled order (the last token's among them, not first): every state bit for bit the one
 * after token t ---- */
static void test_keep(int heads, int hdim, int groups, int N, int T) {
    int di = heads * hdim, cv = di + 2 * groups * N, in = di + cv + heads + 3, gs = di / groups;
    std::vector<float> cw = rand_vec((size_t)cv * 4, 0.5f), cb = rand_vec(cv, 0.2f), A(heads), D = rand_vec(heads), dtb(heads),
        gw = rand_vec(di), proj = rand_vec((size_t)T * in);
    for (int h = 0; h < heads; h++) { A[h] = -(1.0f + 15.0f * (uni() + 1) / 2); dtb[h] = -3.0f + uni(); }
    Config c;
    memset(&c, 0, sizeof c);
    c.d_state = N;
    Rank r;
    memset(&r, 0, sizeof r);
    r.c = &c;
    r.s.conv = cv;
    r.s.d_inner = di;
    r.spec = T + 1;   /* more slots than this step uses */
    r.keep = 1;
    r.pass = PASS_MAIN;
    GpuRank g = make_rank(8);
    r.st = &g;
    g.snap_bytes = mamba_state_bytes(&r);
    std::vector<float> st0 = rand_vec(g.snap_bytes / sizeof(float));
    g.state = (char *)dev_copy(st0);
    g.kept = (char *)dev_copy(std::vector<float>((r.spec + 1) * g.snap_bytes / sizeof(float), NAN));
    build_io(&g, T, 0);
    float *conv_st = (float *)g.state, *ssm = (float *)(g.state + conv_state_bytes(&r));
    int fold = gnorm_folds(1, heads, hdim, N, gs, fmt_per(DT_BF16)), nss = heads * scan_blocks(hdim, N);
    float *d_cw = dev_copy(cw), *d_cb = dev_copy(cb), *d_A = dev_copy(A), *d_D = dev_copy(D), *d_dtb = dev_copy(dtb), *d_gw = dev_copy(gw);
    float *d_proj = dev_copy(proj), *d_xbc = dev_copy(std::vector<float>((size_t)T * cv)), *d_y = dev_copy(std::vector<float>((size_t)T * di));
    float *d_gss = dev_copy(std::vector<float>((size_t)T * nss));
    auto step = [&](int t0, int n, int keep) {   /* tokens t0 .. t0 + n - 1, as gpu_mamba runs them */
        size_t slot = g.snap_bytes / sizeof(float);
        LAUNCH(dim3(cdiv(cv, 128), cdiv(n, CONV_STEPS)), 128, 0, 0, conv_kernel, d_xbc + (size_t)t0 * cv, (const float *)d_proj + (size_t)t0 * in + di,
               in, conv_st, (const float *)d_cw, (const float *)d_cb, n, cv, keep ? kept_at(&g, conv_st) : (float *)nullptr, slot);
        if (n > CONV_STEPS) LAUNCH(cdiv(cv, 128), 128, 0, 0, conv_state_kernel, conv_st, (const float *)d_proj + (size_t)t0 * in + di, in, n, cv);
        ScanArgs sa = scan_args(d_y + (size_t)t0 * di, ssm, d_xbc + (size_t)t0 * cv, d_proj + (size_t)t0 * in, in, d_A, d_D, d_dtb, n, heads,
                                hdim, groups, N);
        sa.gw = fold ? d_gw : nullptr;
        sa.gss = fold ? d_gss + (size_t)t0 * nss : nullptr;
        sa.keep = keep ? kept_at(&g, ssm) : nullptr;
        sa.keep_step = slot;
        ssm_scan(0, sa, N);
    };
    auto state = [&]() {   /* the conv window and the SSM state, without the padding between them */
        std::vector<float> v = host_copy((float *)g.state, st0.size());
        v.erase(v.begin() + (size_t)cv * 3, v.begin() + conv_state_bytes(&r) / sizeof(float));
        v.resize((size_t)cv * 3 + (size_t)di * N);
        return v;
    };
    std::vector<std::vector<float>> after(T);   /* the state after each token, one token at a time */
    for (int t = 0; t < T; t++) {
        step(t, 1, 0);
        after[t] = state();
    }
    std::vector<float> y1 = host_copy(d_y, (size_t)T * di), gss1 = host_copy(d_gss, (size_t)T * nss);
    upload(g.state, st0.data(), g.snap_bytes);
    std::vector<int> tok(T, 0);
    gpu_begin(&r, tok.data(), T, 0);
    step(0, T, 1);
    char what[160];
    snprintf(what, sizeof what, "keep: %d tokens, heads %d x %d, N %d%s: outputs = one token at a time", T, heads, hdim, N,
             fold ? ", gated" : "");
    expect_same(what, host_copy(d_y, (size_t)T * di), y1);
    if (fold) expect_same("... the scan's sums of u^2, token by token", host_copy(d_gss, (size_t)T * nss), gss1);
    expect_same("... the live state after the step = after its last token", state(), after[T - 1]);
    std::vector<int> order(T);
    for (int t = 0; t < T; t++) order[t] = t;   /* T - 1 last: after others, it must copy */
    std::shuffle(order.begin(), order.end() - 1, rng);
    int bad = 0;
    for (int t : order) {
        gpu_rewind(&r, t);
        std::vector<float> got = state();
        bad += memcmp(got.data(), after[t].data(), got.size() * sizeof(float)) != 0;
    }
    snprintf(what, sizeof what, "... rewind(t), t in a shuffled order: states unlike token t's (of %d)", T);
    expect_int(what, bad, 0);
    for (void *p : {(void *)d_cw, (void *)d_cb, (void *)d_A, (void *)d_D, (void *)d_dtb, (void *)d_gw, (void *)d_proj, (void *)d_xbc,
                    (void *)d_y, (void *)d_gss, (void *)g.state, (void *)g.kept})
        CUDA_CHECK(cudaFree(p));
    free_io(&g);
    free_rank(&g);
}

/* ---- the chunked SSD scan (prompts of bf16 models) over several calls from a random state, then a
 * decode step by the step-by-step scan from the state it left: outputs and state against float64,
 * and against the step-by-step scan run beside it on the same inputs. TF32 operands: 5e-3. ---- */
static void test_ssd(int heads, int hdim, int groups, int N, std::vector<int> steps) {
    int di = heads * hdim, cv = di + 2 * groups * N, in = di + cv + heads + 3;
    std::vector<float> A(heads), D = rand_vec(heads), dtb(heads), st0 = rand_vec((size_t)di * N);
    for (int h = 0; h < heads; h++) { A[h] = -(1.0f + 15.0f * (uni() + 1) / 2); dtb[h] = h % 3 ? -3.0f + uni() : -12.0f; }
    std::vector<double> ssm(st0.begin(), st0.end());
    float *d_A = dev_copy(A), *d_D = dev_copy(D), *d_dtb = dev_copy(dtb), *d_ssd = dev_copy(st0), *d_ssm = dev_copy(st0);
    int done = 0;
    for (int T : steps) {
        std::vector<float> proj = rand_vec((size_t)T * in), xbc = rand_vec((size_t)T * cv);
        float *d_proj = dev_copy(proj), *d_xbc = dev_copy(xbc), *d_y = dev_copy(std::vector<float>((size_t)T * di, NAN));
        float *d_y2 = dev_copy(std::vector<float>((size_t)T * di, NAN));
        ScanArgs sa = scan_args(d_y, d_ssd, d_xbc, d_proj, in, d_A, d_D, d_dtb, T, heads, hdim, groups, N);
        if (T > 1) ssd_scan(0, sa, N);
        else ssm_scan(0, sa, N);
        ssm_scan(0, scan_args(d_y2, d_ssm, d_xbc, d_proj, in, d_A, d_D, d_dtb, T, heads, hdim, groups, N), N);
        std::vector<double> y = ref_scan(proj, in, std::vector<double>(xbc.begin(), xbc.end()), ssm, A, D, dtb, T, heads, hdim, groups, N);
        std::vector<float> got = host_copy(d_y, y.size()), got_st = host_copy(d_ssd, ssm.size());
        std::vector<float> scan = host_copy(d_y2, y.size()), scan_st = host_copy(d_ssm, ssm.size());
        char what[160];
        const char *how = T > 1 ? "SSD" : "step scan after SSD";
        snprintf(what, sizeof what, "%s heads %d x %d, groups %d, N %d, steps %d..%d: output", how, heads, hdim, groups, N, done, done + T - 1);
        expect(what, got, y, 5e-3);
        snprintf(what, sizeof what, "%s ... state after them", how);
        expect(what, got_st, ssm, 5e-3);
        snprintf(what, sizeof what, "%s ... output = the step-by-step scan's", how);
        expect(what, got, std::vector<double>(scan.begin(), scan.end()), 5e-3);
        snprintf(what, sizeof what, "%s ... state = the step-by-step scan's", how);
        expect(what, got_st, std::vector<double>(scan_st.begin(), scan_st.end()), 5e-3);
        for (float *p : {d_proj, d_xbc, d_y, d_y2}) CUDA_CHECK(cudaFree(p));
        done += T;
    }
    for (float *p : {d_A, d_D, d_dtb, d_ssd, d_ssm}) CUDA_CHECK(cudaFree(p));
}

/* float64 causal attention: query head h of token t (row t of qkv, w floats, the query heads first)
 * at position pos + t against keys 0 .. pos + t of the cache rows kc, vc (kw floats: kv heads of hd;
 * head h reads kv head h / group), every operand through op (the bf16 rounding a kernel applies):
 * ref[t][h][i] = sum_j softmax_j(q . k_j scale) v_j[i]. */
template <typename Op>
static std::vector<double> ref_attention(const std::vector<float> &qkv, int w, const std::vector<float> &kc, const std::vector<float> &vc,
                                         int kw, int q, int group, int hd, int pos, int T, float scale, Op op) {
    std::vector<double> ref((size_t)T * q * hd);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < q; h++) {
            int g = h / group, n = pos + t + 1;
            std::vector<double> s(n);
            double m = -1e300, sum = 0;
            for (int j = 0; j < n; j++) {
                double d = 0;
                for (int i = 0; i < hd; i++) d += (double)op(qkv[(size_t)t * w + h * hd + i]) * op(kc[(size_t)j * kw + g * hd + i]);
                s[j] = d * scale;
                m = fmax(m, s[j]);
            }
            for (int j = 0; j < n; j++) sum += s[j] = exp(s[j] - m);
            for (int i = 0; i < hd; i++) {
                double a = 0;
                for (int j = 0; j < n; j++) a += s[j] * op(vc[(size_t)j * kw + g * hd + i]);
                ref[((size_t)t * q + h) * hd + i] = a / sum;
            }
        }
    return ref;
}

/* ---- attention: append to the cache (fp32 or bf16: KT), decode split along the sequence ---- */
template <typename KT> static void test_attention(int q, int kv, int hd, int pos, int ctx) {
    int group = q / kv, kw = kv * hd, w = q * hd + 2 * kw, splits = attn_splits(ctx), bf = sizeof(KT) == 2;
    auto op = [&](float v) { return bf ? bf16_round(v) : v; };   /* what the cache holds */
    std::vector<float> kc = rand_vec((size_t)ctx * kw), vc = rand_vec((size_t)ctx * kw), qkv = rand_vec(w);
    for (auto *c : {&kc, &vc}) for (auto &x : *c) x = op(x);
    for (size_t i = (size_t)(pos + 1) * kw; i < kc.size(); i++) kc[i] = vc[i] = NAN;   /* a read past the last key shows */
    KT *d_k = dev_copy_as<KT>(kc), *d_v = dev_copy_as<KT>(vc);
    float *d_qkv = dev_copy(qkv), *d_y = dev_copy(std::vector<float>((size_t)q * hd, NAN));
    float *d_part = dev_copy(std::vector<float>((size_t)q * splits * (hd + 2)));
    int *d_pos;
    CUDA_CHECK(cudaMalloc(&d_pos, sizeof(int)));
    upload(d_pos, &pos, sizeof(int));
    float scale = 1.0f / sqrtf((float)hd);
    LAUNCH(1, 256, 0, 0, kv_append_kernel<KT>, d_k, d_v, d_qkv, w, q * hd, kw, d_pos);
    AttnArgs<KT> a = {.part = d_part, .q = d_qkv, .kc = d_k, .vc = d_v, .pos = d_pos, .kw = kw, .hd = hd, .group = group,
                      .q0 = 0, .kv0 = 0, .scale = scale, .splits = splits, .warm = d_k, .warm_n = (size_t)ctx * kw * sizeof(KT)};
    attn_decode(0, a, q, 1);
    LAUNCH(q, 128, 0, 0, attn_combine_kernel, d_y, d_part, d_pos, hd, splits);
    for (int i = 0; i < kw; i++) { kc[(size_t)pos * kw + i] = op(qkv[q * hd + i]); vc[(size_t)pos * kw + i] = op(qkv[q * hd + kw + i]); }
    std::vector<double> ref = ref_attention(qkv, w, kc, vc, kw, q, group, hd, pos, 1, scale, op);   /* bf16: the queries too */
    char what[128];
    snprintf(what, sizeof what, "attention decode %s cache q %d / kv %d, head %d, position %d (%d splits of %d keys)",
             bf ? "bf16" : "fp32", q, kv, hd, pos, splits, (pos + splits) / splits);
    expect(what, host_copy(d_y, ref.size()), ref, bf ? 1e-2 : 1e-5);   /* bf16: P meets V in bf16, as in the flash kernel */
    size_t rows = (size_t)(pos + 1) * kw;   /* the rows past the appended one stay NaN */
    std::vector<double> kref(kc.begin(), kc.begin() + rows), vref(vc.begin(), vc.begin() + rows);
    expect(bf ? "kv cache append (bf16): keys" : "kv cache append (fp32): keys", host_copy_as(d_k, rows), kref, 0);
    expect(bf ? "kv cache append (bf16): values" : "kv cache append (fp32): values", host_copy_as(d_v, rows), vref, 0);
    for (void *p : {(void *)d_k, (void *)d_v, (void *)d_qkv, (void *)d_y, (void *)d_part}) CUDA_CHECK(cudaFree(p));
    CUDA_CHECK(cudaFree(d_pos));
}

/* ---- a few tokens' decode attention (a verify step): T queries from position pos appended to the
 * cache, then each token's query against keys 0..pos + t in one launch, against T one-token steps at
 * positions pos .. pos + T - 1, bit for bit, and against float64 (cache rows past the step NaN) ---- */
template <typename KT> static void test_attention_tokens(int q, int kv, int hd, int pos, int T, int ctx) {
    int group = q / kv, kw = kv * hd, w = q * hd + 2 * kw, splits = attn_splits(ctx), bf = sizeof(KT) == 2;
    auto op = [&](float v) { return bf ? bf16_round(v) : v; };
    std::vector<float> kc = rand_vec((size_t)ctx * kw), vc = rand_vec((size_t)ctx * kw), qkv = rand_vec((size_t)T * w);
    for (size_t i = (size_t)(pos + T) * kw; i < kc.size(); i++) kc[i] = vc[i] = NAN;
    for (int t = 0; t < T; t++) for (int i = 0; i < q * hd; i++) qkv[(size_t)t * w + i] *= 4.0f;   /* peaked: a key too many shows */
    KT *d_k = dev_copy_as<KT>(kc), *d_v = dev_copy_as<KT>(vc);
    float *d_qkv = dev_copy(qkv), *many = dev_copy(std::vector<float>((size_t)T * q * hd, NAN));
    float *one = dev_copy(std::vector<float>((size_t)T * q * hd, NAN));
    float *d_part = dev_copy(std::vector<float>((size_t)T * q * splits * (hd + 2)));
    int *d_pos;
    CUDA_CHECK(cudaMalloc(&d_pos, (T + 1) * sizeof(int)));
    std::vector<int> ps(T + 1);
    for (int t = 0; t <= T; t++) ps[t] = pos + (t ? t - 1 : 0);   /* the step's first position, then each token's */
    upload(d_pos, ps.data(), (T + 1) * sizeof(int));
    float scale = 1.0f / sqrtf((float)hd);
    LAUNCH(T, 256, 0, 0, kv_append_kernel<KT>, d_k, d_v, d_qkv, w, q * hd, kw, d_pos);
    AttnArgs<KT> a = {.part = d_part, .q = d_qkv, .ldq = w, .kc = d_k, .vc = d_v, .pos = d_pos, .kw = kw, .hd = hd, .group = group,
                      .q0 = 0, .kv0 = 0, .scale = scale, .splits = splits, .warm = nullptr, .warm_n = 0};
    attn_decode(0, a, q, T);
    LAUNCH(dim3(q, T), 128, 0, 0, attn_combine_kernel, many, d_part, d_pos, hd, splits);
    for (int t = 0; t < T; t++) {
        AttnArgs<KT> a1 = a;
        a1.q = d_qkv + (size_t)t * w;
        a1.pos = d_pos + 1 + t;
        attn_decode(0, a1, q, 1);
        LAUNCH(q, 128, 0, 0, attn_combine_kernel, one + (size_t)t * q * hd, d_part, (const int *)d_pos + 1 + t, hd, splits);
    }
    for (int t = 0; t < T; t++)
        for (int i = 0; i < kw; i++) {
            kc[(size_t)(pos + t) * kw + i] = op(qkv[(size_t)t * w + q * hd + i]);
            vc[(size_t)(pos + t) * kw + i] = op(qkv[(size_t)t * w + q * hd + kw + i]);
        }
    std::vector<double> ref = ref_attention(qkv, w, kc, vc, kw, q, group, hd, pos, T, scale, op);
    std::vector<float> got = host_copy(many, ref.size());
    char what[160];
    snprintf(what, sizeof what, "attention decode %s cache q %d / kv %d, head %d, %d queries from %d = one by one", bf ? "bf16" : "fp32",
             q, kv, hd, T, pos);
    expect_same(what, got, host_copy(one, ref.size()));
    expect("... against float64", got, ref, bf ? 1e-2 : 1e-5);
    for (void *p : {(void *)d_k, (void *)d_v, (void *)d_qkv, (void *)many, (void *)one, (void *)d_part, (void *)d_pos}) CUDA_CHECK(cudaFree(p));
}

/* ---- prompt attention: a chunk of T tokens from position pos (the cache holds pos keys before it)
 * appended, then attending causally; the flash kernel on a bf16 cache (against a reference on the
 * same bf16 operands; P also meets V in bf16, hence its looser tolerance) or the fp32 one on an fp32
 * cache. Queries are scaled
 * up so that each row's softmax is peaked: a key masked wrongly, or a row mixed with another, moves
 * the output by far more than the tolerance. Cache rows past the chunk and the output are NaN
 * before the run: a read past the last key or a row not written shows. ---- */
template <typename KT> static void test_prompt_attention(int q, int kv, int hd, int pos, int T) {
    int gl = q / kv, kw = kv * hd, w = q * hd + 2 * kw, ctx = pos + T + 70, bf = sizeof(KT) == 2;
    std::vector<float> kc = rand_vec((size_t)ctx * kw), vc = rand_vec((size_t)ctx * kw), qkv = rand_vec((size_t)T * w);
    for (size_t i = (size_t)(pos + T) * kw; i < kc.size(); i++) kc[i] = vc[i] = NAN;
    for (int t = 0; t < T; t++) for (int i = 0; i < q * hd; i++) qkv[(size_t)t * w + i] *= 6.0f;
    KT *d_k = dev_copy_as<KT>(kc), *d_v = dev_copy_as<KT>(vc);
    float *d_qkv = dev_copy(qkv);
    float *d_y = dev_copy(std::vector<float>((size_t)T * q * hd, NAN));
    int *d_pos;
    CUDA_CHECK(cudaMalloc(&d_pos, sizeof(int)));
    upload(d_pos, &pos, sizeof(int));
    float scale = 1.0f / sqrtf((float)hd);
    LAUNCH(T, 256, 0, 0, kv_append_kernel<KT>, d_k, d_v, d_qkv, w, q * hd, kw, d_pos);
    PromptAttnArgs<KT> a = {.y = d_y, .q = d_qkv, .kc = d_k, .vc = d_v, .ldy = q * hd, .ldq = w, .kw = kw, .hd = hd, .gl = gl,
                            .T = T, .pos = pos, .scale = scale};
    attn_prompt(0, a, kv);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < kw; i++) {
            kc[(size_t)(pos + t) * kw + i] = qkv[(size_t)t * w + q * hd + i];
            vc[(size_t)(pos + t) * kw + i] = qkv[(size_t)t * w + q * hd + kw + i];
        }
    auto op = [&](float v) { return bf ? bf16_round(v) : v; };
    std::vector<double> ref = ref_attention(qkv, w, kc, vc, kw, q, gl, hd, pos, T, scale, op);
    char what[128];
    snprintf(what, sizeof what, "prompt attention %s q %d / kv %d, head %d, %d tokens from %d", bf ? "bf16 flash" : "fp32", q, kv,
             hd, T, pos);
    expect(what, host_copy(d_y, ref.size()), ref, bf ? 1e-2 : 1e-5);
    for (void *p : {(void *)d_k, (void *)d_v, (void *)d_qkv, (void *)d_y}) CUDA_CHECK(cudaFree(p));
    CUDA_CHECK(cudaFree(d_pos));
}

/* ---- mixture of experts: the router's rule, and the experts' products for one token and a prompt ---- */

/* The router's rule in float64 (transformers' route_tokens_to_experts; ties to the lower index). */
static void ref_route(const double *l, const std::vector<float> &bias, MoeRoute rt, int *idx, double *w, std::vector<double> &cm) {
    int E = rt.E, per = E / rt.n_group;
    std::vector<double> s(E), c(E), gs(rt.n_group);
    for (int e = 0; e < E; e++) { s[e] = 1 / (1 + exp(-l[e])); c[e] = s[e] + bias[e]; }
    for (int g = 0; g < rt.n_group; g++) {
        std::vector<double> v(c.begin() + g * per, c.begin() + (g + 1) * per);
        std::sort(v.begin(), v.end(), std::greater<double>());
        gs[g] = v[0] + (per > 1 ? v[1] : 0);
    }
    std::vector<int> go(rt.n_group), eo(E);
    for (int g = 0; g < rt.n_group; g++) go[g] = g;
    std::stable_sort(go.begin(), go.end(), [&](int a, int b) { return gs[a] > gs[b]; });
    cm.assign(E, -INFINITY);
    for (int k = 0; k < rt.topk_group; k++)
        for (int e = go[k] * per; e < (go[k] + 1) * per; e++) cm[e] = c[e];
    for (int e = 0; e < E; e++) eo[e] = e;
    std::stable_sort(eo.begin(), eo.end(), [&](int a, int b) { return cm[a] > cm[b]; });
    double sum = 0;
    for (int k = 0; k < rt.K; k++) sum += s[eo[k]];
    for (int k = 0; k < rt.K; k++) {
        idx[k] = eo[k];
        w[k] = (rt.norm ? s[eo[k]] / (sum + 1e-20) : s[eo[k]]) * rt.scale;
    }
}

/* The router for T tokens (T = 1: decode's one launch, run twice to see its counter reset; else
 * cuBLAS logits + a block a token) against ref_route. ties 1: experts 2 and 3 have the same gate row
 * and bias, raised so they are chosen: 2 must come first. ties 2: the last group copies group 1
 * (rows and biases), both raised above the rest, so with topk_group 1 only group 1 may be chosen.
 * ties 3: every gate row is row 0 and every bias equal but the last K - 1 experts', raised: they
 * come first, and slot K - 1 goes to expert 0 of the E - K + 1 tied. */
static void test_moe_router(int E, int K, int n_group, int topk_group, int norm, float scale, int hidden, int T, int ties) {
    MoeRoute rt = {E, K, n_group, topk_group, norm, scale};
    int per = E / n_group;
    std::vector<float> gate = rand_vec((size_t)E * hidden, 3.0f / sqrtf((float)hidden)), bias = rand_vec(E, 0.05f);
    if (ties == 1) {
        for (int i = 0; i < hidden; i++) gate[(size_t)3 * hidden + i] = gate[(size_t)2 * hidden + i];
        bias[2] = bias[3] = 2.0f;
    }
    if (ties == 2) {
        for (int e = 0; e < per; e++) {
            bias[per + e] += 1.0f;
            bias[(n_group - 1) * per + e] = bias[per + e];
            for (int i = 0; i < hidden; i++) gate[((size_t)(n_group - 1) * per + e) * hidden + i] = gate[((size_t)per + e) * hidden + i];
        }
    }
    if (ties == 3)
        for (int e = 0; e < E; e++) {
            for (int i = 0; i < hidden; i++) gate[(size_t)e * hidden + i] = gate[i];
            bias[e] = e >= E - K + 1 ? 1.0f + 0.01f * e : 0.01f;
        }
    GLayer L;
    memset(&L, 0, sizeof L);
    L.gate = dev_copy(gate);
    L.gate_bias = dev_copy(bias);
    MoeShape ms = {E, K, 8, 8, hidden, 0, hidden};
    GpuRank g = make_rank(8);
    moe_alloc(&g, &ms, T);
    for (int run = 0; run < (T == 1 ? 2 : 1); run++) {
        std::vector<float> x = rand_vec((size_t)T * hidden);
        g.x = dev_copy(x);
        CUDA_CHECK(cudaMemset(g.moe_idx, 0xff, (size_t)T * K * sizeof(int)));
        CUDA_CHECK(cudaMemset(g.moe_w, 0xff, (size_t)T * K * sizeof(float)));   /* NaN */
        CUDA_CHECK(cudaMemset(g.moe_logits, 0xff, (size_t)T * E * sizeof(float)));
        moe_choose(&g, &L, &ms, rt, T);
        std::vector<double> l((size_t)T * E), w((size_t)T * K);
        std::vector<int> idx((size_t)T * K), got((size_t)T * K);
        std::vector<std::vector<double>> cm(T);   /* each token's choice scores, -inf in dropped groups */
        for (int t = 0; t < T; t++) {
            for (int e = 0; e < E; e++) {
                double a = 0;
                for (int i = 0; i < hidden; i++) a += (double)gate[(size_t)e * hidden + i] * x[(size_t)t * hidden + i];
                l[(size_t)t * E + e] = a;
            }
            ref_route(&l[(size_t)t * E], bias, rt, &idx[(size_t)t * K], &w[(size_t)t * K], cm[t]);
        }
        CUDA_CHECK(cudaMemcpy(got.data(), g.moe_idx, got.size() * sizeof(int), cudaMemcpyDeviceToHost));
        int wrong = 0;
        for (size_t i = 0; i < got.size(); i++) {   /* fp32 may order two scores within 1e-5 of each other either way */
            const std::vector<double> &c = cm[i / K];
            wrong += got[i] != idx[i] && !(got[i] >= 0 && got[i] < E && fabs(c[got[i]] - c[idx[i]]) < 1e-5);
        }
        if (ties == 1) for (int t = 0; t < T; t++) wrong += got[(size_t)t * K] != 2 || got[(size_t)t * K + 1] != 3;
        if (ties == 2) for (size_t i = 0; i < got.size(); i++) wrong += got[i] / per != 1;
        if (ties == 3)
            for (int t = 0; t < T; t++)
                for (int k = 0; k < K; k++) wrong += got[(size_t)t * K + k] != (k < K - 1 ? E - 1 - k : 0);
        char what[160];
        snprintf(what, sizeof what, "router %s: %d experts top %d, groups %d keep %d, norm %d%s: logits", T == 1 ? "decode" : "prompt", E,
                 K, n_group, topk_group, norm, ties == 1 ? ", tied experts" : ties == 2 ? ", tied groups" : ties == 3 ? ", the K-th of many tied" : "");
        expect(what, host_copy(g.moe_logits, l.size()), l, 1e-5, ties == 3 ? 1.0 : 0.0);   /* ties 3: one logit, maybe near 0 */
        snprintf(what, sizeof what, "... %d token%s: chosen experts, in order, unlike float64's", T, T > 1 ? "s" : "");
        expect_int(what, wrong, 0);
        snprintf(what, sizeof what, "... their weights (scale %.2f)", scale);
        expect(what, host_copy(g.moe_w, w.size()), w, 5e-5);
        CUDA_CHECK(cudaFree(g.x));
    }
    unsigned done;
    CUDA_CHECK(cudaMemcpy(&done, g.moe_done, sizeof done, cudaMemcpyDeviceToHost));
    expect_int("... the decode router's block counter is back to 0", (int)done, 0);
    moe_free(&g);
    free_rank(&g);
    CUDA_CHECK(cudaFree(L.gate));
    CUDA_CHECK(cudaFree(L.gate_bias));
}

/* The experts' products for T tokens (T = 1: decode's kernels; else the grouped cuBLAS path) on a
 * random choice, against float64: routed experts in format fe, the shared expert and the latent
 * projections in fs (NVFP4 experts beside FP8 shared ones, as Super's release mixes them). Expert e's
 * up is rows [r m, (r + 1) m) of a [2m, d] tensor and its down the same columns of a [d, 2m] one
 * (rank r = 1 of 2), uploaded as gpu_init does. Where the prompt path feeds cuBLAS bf16 operands
 * (activations, and a quantized matrix's dequantized values), the reference rounds them too. */
static void test_moe_products(int fe, int fs, int E, int K, int m, int S, int hidden, int lat, int T, int skew = 0) {
    int d = lat ? lat : hidden, rb = fe != DT_F32 && T > 1, qe = rb && fe >= DT_FP8, qs = rb && fs >= DT_FP8;
    /* one token's NVFP4 products on the tensor cores round their inputs to bf16: the experts' up product
       (tcu; the shared expert's too where it is NVFP4, tcx), each down product where all of its matrices are */
    int tcu = T == 1 && fe == DT_NVFP4, tcx = tcu && fs == DT_NVFP4, tcr = tcu && (lat || fs == DT_NVFP4),
        tcs = T == 1 && fs == DT_NVFP4 && (lat || fe == DT_NVFP4);
    MoeShape ms = {E, K, m, S, hidden, lat, d};
    std::vector<HostMat> up, down;
    std::vector<Mat> upv(E), downv(E);
    for (int e = 0; e < E; e++) {
        up.push_back(host_mat(fe, 2 * m, d, 2.0f / sqrtf((float)d)));
        down.push_back(host_mat(fe, d, 2 * m, 2.0f / sqrtf((float)m)));
    }
    for (int e = 0; e < E; e++) { upv[e] = view(up[e], m, m, 0, d); downv[e] = view(down[e], 0, d, m, m); }
    HostMat su = host_mat(fs, S, hidden, 2.0f / sqrtf((float)hidden)), sd = host_mat(fs, hidden, S, 2.0f / sqrtf((float)S));
    HostMat li = host_mat(fs, lat ? lat : 16, hidden, 1.0f / sqrtf((float)hidden)), lo = host_mat(fs, hidden, lat ? lat : 16, 1.0f / sqrtf((float)d));
    /* what a prompt's cuBLAS products multiply: a quantized matrix's values in bf16 */
    for (HostMat *h : {&su, &sd, &li, &lo}) for (auto &v : h->v) v = (float)bf16r(v, qs);
    for (int e = 0; e < E; e++) for (HostMat *h : {&up[e], &down[e]}) for (auto &v : h->v) v = (float)bf16r(v, qe);
    GLayer L;
    memset(&L, 0, sizeof L);
    L.eup = upload_mat(upv.data(), E);
    L.edown = upload_mat(downv.data(), E);
    Mat v = view(su, 0, S, 0, hidden);
    L.sup = upload_mat(&v, 1);
    v = view(sd, 0, hidden, 0, S);
    L.sdown = upload_mat(&v, 1);
    if (lat) {
        v = view(li, 0, lat, 0, hidden);
        L.lat_in = upload_mat(&v, 1);
        v = view(lo, 0, hidden, 0, lat);
        L.lat_out = upload_mat(&v, 1);
    }
    /* a random choice: K distinct experts a token, weights in (0, 2); skew: expert 0 in 9 of 10 tokens */
    std::vector<int> idx((size_t)T * K);
    std::vector<float> w((size_t)T * K), x = rand_vec((size_t)T * hidden);
    for (int t = 0; t < T; t++) {
        std::vector<int> perm(E);
        for (int e = 0; e < E; e++) perm[e] = e;
        std::shuffle(perm.begin(), perm.end(), rng);
        if (skew && t % 10 != 9) std::iter_swap(perm.begin(), std::find(perm.begin(), perm.end(), 0));
        for (int k = 0; k < K; k++) { idx[(size_t)t * K + k] = perm[k]; w[(size_t)t * K + k] = 1.0f + uni(); }
    }
    GpuRank g = make_rank((size_t)T * pad8(std::max({hidden, S, lat})));
    g.act_w = pad8(std::max({hidden, S, lat}));   /* as gpu_init: the widest input of a product */
    g.proj = dev_copy(std::vector<float>((size_t)T * S));
    g.x = dev_copy(x);
    g.x16 = dev_copy_as<bf16>(x);   /* as the norm writes it for a prompt */
    moe_alloc(&g, &ms, T);
    /* NaN in every buffer the products write: a read of something not written shows */
    CUDA_CHECK(cudaMemset(g.moe_h, 0xff, std::max((size_t)T * K * pad8(m), (size_t)K * pad8(m) + S) * sizeof(float)));
    CUDA_CHECK(cudaMemset(g.moe_y, 0xff, (size_t)T * K * d * sizeof(float)));
    CUDA_CHECK(cudaMemset(g.act16, 0xff, (size_t)T * g.act_w * sizeof(bf16)));
    if (lat) {   /* without a latent size these two are not allocated */
        CUDA_CHECK(cudaMemset(g.moe_z, 0xff, (size_t)T * lat * sizeof(float)));
        CUDA_CHECK(cudaMemset(g.moe_ylat, 0xff, (size_t)T * lat * sizeof(float)));
    }
    CUDA_CHECK(cudaMemset(g.proj, 0xff, (size_t)T * S * sizeof(float)));
    upload(g.moe_idx, idx.data(), idx.size() * sizeof(int));
    upload(g.moe_w, w.data(), w.size() * sizeof(float));
    float *out = dev_copy(std::vector<float>((size_t)T * hidden, NAN));
    moe_experts(&g, &L, &ms, out, T, &L.sup);   /* warms the shared up rows again: harmless, and run */
    /* float64 reference */
    std::vector<double> ref((size_t)T * hidden);
    for (int t = 0; t < T; t++) {
        std::vector<double> xi(hidden), z(d), routed(d, 0.0);
        for (int i = 0; i < hidden; i++) xi[i] = bf16r(x[(size_t)t * hidden + i], rb || tcx);
        for (int j = 0; j < d; j++) {
            double a = 0;
            /* fc1's input: bf16 in a prompt, and in NVFP4's tensor-core decode */
            if (lat) for (int i = 0; i < hidden; i++) a += (double)li.v[(size_t)j * hidden + i] * bf16r(x[(size_t)t * hidden + i], rb || fs == DT_NVFP4);
            else a = x[(size_t)t * hidden + j];
            z[j] = bf16r(a, rb || tcu);
        }
        for (int k = 0; k < K; k++) {
            int e = idx[(size_t)t * K + k];
            double wk = w[(size_t)t * K + k];
            std::vector<double> h(m);
            for (int i = 0; i < m; i++) {
                double a = 0;
                for (int j = 0; j < d; j++) a += (double)up[e].v[(size_t)(m + i) * d + j] * z[j];
                h[i] = bf16r(a > 0 ? a * a : 0, rb);
                if (tcr) h[i] = bf16r(wk * h[i], 1);   /* one token's up applies the weight, the down rounds */
            }
            if (tcr) wk = 1;
            for (int j = 0; j < d; j++) {
                double a = 0;
                for (int i = 0; i < m; i++) a += (double)down[e].v[(size_t)j * 2 * m + m + i] * h[i];
                routed[j] += wk * bf16r(a, rb);   /* a bf16 prompt's down writes bf16 */
            }
        }
        std::vector<double> hs(S);
        for (int i = 0; i < S; i++) {
            double a = 0;
            for (int j = 0; j < hidden; j++) a += (double)su.v[(size_t)i * hidden + j] * xi[j];
            hs[i] = bf16r(a > 0 ? a * a : 0, rb || tcs);
        }
        for (int i = 0; i < hidden; i++) {
            double a = 0, b = 0;
            for (int j = 0; j < S; j++) a += (double)sd.v[(size_t)i * S + j] * hs[j];
            if (lat) for (int j = 0; j < lat; j++) b += (double)lo.v[(size_t)i * lat + j] * bf16r(routed[j], rb || tcs); else b = routed[i];
            ref[(size_t)t * hidden + i] = a + b;
        }
    }
    char what[160];
    snprintf(what, sizeof what, "moe %s %s/%s: %d experts top %d, %d / shared %d rows, hidden %d, latent %d, %d token%s%s",
             T == 1 ? "decode" : "prompt", fmt_name(fe), fmt_name(fs), E, K, m, S, hidden, lat, T, T > 1 ? "s" : "",
             skew ? ", skewed" : "");
    /* bf16 prompt: the reference rounds where the GPU does, but a value that fp32 and float64 sums put on
       either side of a bf16 rounding boundary moves by an ulp (2^-8): with a latent sum rounded before
       fc2 that reached 1.2e-3 of the largest output on one seed; without, on a skewed NVFP4 prompt of
       300 tokens, where most of the 250k rounded h values meet one expert, 1.02e-3 (seed 2475793712)
       and 2.40e-3 (seed 1480456781). A decoded token's NVFP4 inputs, rounded to bf16, meet the same
       boundaries, rarely (a flip moves one of an output's terms by a bf16 ulp): 3.4e-7 without one on
       an H100, 1.61e-3 with one where an output has only 192 terms (8 experts top 2, 64 rows, shared 64) */
    expect(what, host_copy(out, ref.size()), ref, rb || tcu || tcr || tcs ? 4e-3 : 2e-5);
    if (T > 1) {   /* the grouping: each expert's rows contiguous, in (token, slot) order within it; its row tiles */
        std::vector<int> off(E + 1), tile(E + 1), tok((size_t)T * K), row((size_t)T * K), cnt(E, 0), seen(E, -1);
        CUDA_CHECK(cudaMemcpy(off.data(), g.moe_off, off.size() * sizeof(int), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(tile.data(), g.moe_tile, tile.size() * sizeof(int), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(tok.data(), g.moe_tok, tok.size() * sizeof(int), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(row.data(), g.moe_row, row.size() * sizeof(int), cudaMemcpyDeviceToHost));
        for (int p = 0; p < T * K; p++) cnt[idx[p]]++;
        int bad = off[0] != 0 || tile[0] != 0;
        for (int e = 0; e < E; e++) bad += off[e + 1] - off[e] != cnt[e] || tile[e + 1] - tile[e] != (cnt[e] + MG_BM - 1) / MG_BM;
        for (int p = 0; p < T * K; p++) {
            int e = idx[p], r = row[p];
            bad += r < off[e] || r >= off[e + 1] || tok[r] != p / K || r <= seen[e];
            seen[e] = r;
        }
        expect_int("... pairs grouped by expert: misplaced", bad, 0);
    }
    for (GMat *p : {&L.eup, &L.edown, &L.sup, &L.sdown, &L.lat_in, &L.lat_out}) free_mat(p);
    for (void *p : {(void *)out, (void *)g.proj, (void *)g.x, (void *)g.x16}) CUDA_CHECK(cudaFree(p));
    moe_free(&g);
    free_rank(&g);
}

/* A MoE layer with synthetic weights drawn on the device (experts in fe; shared expert and latent
 * projections in fs), each matrix's values times scale(fmt, cols), and a random router gate and bias;
 * free_synth_moe_layer frees it. */
static GLayer synth_moe_layer(int fe, int fs, int E, int m, int S, int hidden, int lat, float (*scale)(int fmt, int cols)) {
    int d = lat ? lat : hidden;
    Mat eu = {NULL, fe, E * m, d, (size_t)d, NULL, 0, scale(fe, d)}, ed = {NULL, fe, E * d, m, (size_t)m, NULL, 0, scale(fe, m)},
        su = {NULL, fs, S, hidden, (size_t)hidden, NULL, 0, scale(fs, hidden)}, sd = {NULL, fs, hidden, S, (size_t)S, NULL, 0, scale(fs, S)},
        li = {NULL, fs, lat, hidden, (size_t)hidden, NULL, 0, scale(fs, hidden)},
        lo = {NULL, fs, hidden, lat, (size_t)lat, NULL, 0, scale(fs, lat)};
    GLayer L;
    memset(&L, 0, sizeof L);
    L.eup = upload_mat(&eu, 1);
    L.edown = upload_mat(&ed, 1);
    L.sup = upload_mat(&su, 1);
    L.sdown = upload_mat(&sd, 1);
    if (lat) { L.lat_in = upload_mat(&li, 1); L.lat_out = upload_mat(&lo, 1); }
    L.gate = dev_copy(rand_vec((size_t)E * hidden, 3.0f / sqrtf((float)hidden)));
    L.gate_bias = dev_copy(rand_vec(E, 0.05f));
    return L;
}

static void free_synth_moe_layer(GLayer *L) {
    for (GMat *p : {&L->eup, &L->edown, &L->sup, &L->sdown, &L->lat_in, &L->lat_out}) free_mat(p);
    for (float *p : {L->gate, L->gate_bias}) CUDA_CHECK(cudaFree(p));
}

/* ---- a MoE layer's decode for a few tokens (a verify step): the router and the experts' kernels over
 * T tokens in one launch each, against T one-token steps, bit for bit: choices, weights, outputs.
 * Experts in fe, shared expert and latent projections in fs (synthetic weights drawn on the device). ---- */
static void test_moe_tokens(int fe, int fs, int E, int K, int m, int S, int hidden, int lat, int T) {
    int d = lat ? lat : hidden;
    MoeShape ms = {E, K, m, S, hidden, lat, d};
    MoeRoute rt = {E, K, 1, 1, 1, 2.5f};
    GLayer L = synth_moe_layer(fe, fs, E, m, S, hidden, lat, [](int fmt, int cols) {
        return fmt == DT_FP8 ? 0.05f / sqrtf((float)cols) : fmt == DT_NVFP4 ? 0.5f / sqrtf((float)cols) : 1.0f;
    });
    GpuRank g = make_rank(8);
    g.dec_t = g.dec_now = T;
    moe_alloc(&g, &ms, T);
    float *x = dev_copy(rand_vec((size_t)T * hidden)), *many = dev_copy(std::vector<float>((size_t)T * hidden, NAN));
    float *one = dev_copy(std::vector<float>((size_t)T * hidden, NAN));
    g.x = x;
    moe_choose(&g, &L, &ms, rt, T);
    moe_experts(&g, &L, &ms, many, T, nullptr);
    std::vector<int> idx_many((size_t)T * K), idx_one((size_t)T * K);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(idx_many.data(), g.moe_idx, idx_many.size() * sizeof(int), cudaMemcpyDeviceToHost));
    std::vector<float> w_many = host_copy(g.moe_w, (size_t)T * K), w_one;
    for (int t = 0; t < T; t++) {
        g.x = x + (size_t)t * hidden;
        moe_choose(&g, &L, &ms, rt, 1);
        moe_experts(&g, &L, &ms, one + (size_t)t * hidden, 1, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        CUDA_CHECK(cudaMemcpy(idx_one.data() + (size_t)t * K, g.moe_idx, K * sizeof(int), cudaMemcpyDeviceToHost));
        std::vector<float> w1 = host_copy(g.moe_w, K);
        w_one.insert(w_one.end(), w1.begin(), w1.end());
    }
    std::vector<float> out_many = host_copy(many, (size_t)T * hidden);
    int finite = 1;
    for (float v : out_many) finite &= std::isfinite(v);
    char what[160];
    snprintf(what, sizeof what, "moe decode %s/%s: %d experts top %d, %d / shared %d rows, hidden %d, latent %d, %d tokens: choices",
             fmt_name(fe), fmt_name(fs), E, K, m, S, hidden, lat, T);
    expect_int(what, idx_many == idx_one ? 0 : 1, 0);
    expect_same("... their weights = one token at a time", w_many, w_one);
    expect_same("... the layer's output = one token at a time", out_many, host_copy(one, (size_t)T * hidden));
    expect_int("... the output is finite", finite, 1);
    free_synth_moe_layer(&L);
    for (void *p : {(void *)x, (void *)many, (void *)one}) CUDA_CHECK(cudaFree(p));
    moe_free(&g);
    free_rank(&g);
}

/* ---- sampling: argmax (first of tied maxima), and the top-p draw against the host rule ---- */
static int host_pick(const std::vector<float> &p, float topp, uint64_t seed, uint64_t step) {
    double total = 0;
    for (float v : p) total += v;
    float lo = 0, hi = 1;
    if (topp < 1)
        for (int it = 0; it < 40; it++) {
            float mid = 0.5f * (lo + hi);
            double mass = 0;
            for (float v : p) mass += v >= mid ? v : 0;
            if (mass >= topp * total) lo = mid; else hi = mid;
        }
    double kept = 0;
    for (float v : p) kept += v >= lo ? v : 0;
    double target = coin(seed, step) * kept, cum = 0;
    for (size_t i = 0; i < p.size(); i++) {
        if (p[i] < lo) continue;
        cum += p[i];
        if (cum > target) return (int)i;
    }
    return -1;
}

/* V logits in (-5, 5); peaked: all but every 64th 30 lower, so the top-p candidates fit in shared
 * memory; flat, they do not (at most temperatures), and the bisection reads the whole vocabulary */
static std::vector<float> sampling_logits(int V, int peaked) {
    std::vector<float> l = rand_vec(V, 5.0f);
    if (peaked)
        for (int i = 0; i < V; i++) l[i] -= i % 64 ? 30.0f : 0.0f;
    return l;
}

static void test_sampling(int V, int peaked) {
    std::vector<float> l = sampling_logits(V, peaked);
    int a = (int)(rng() % V), b = (int)(rng() % V), lo = a < b ? a : b, hi = a < b ? b : a;
    if (lo == hi) hi = (lo + 1) % V, lo = lo < hi ? lo : hi;
    l[lo] = l[hi] = 9.0f;  /* two tied maxima: the first wins */
    float *dl = dev_copy(l), *dp = dev_copy(std::vector<float>(V));
    int *dout, got;
    CUDA_CHECK(cudaMalloc(&dout, sizeof(int)));
    LAUNCH(1, 1024, SAMPLE_CAND * sizeof(float), 0, sample_kernel, dout, dl, dp, V, 0.0f, 1.0f, 1, 0);
    CUDA_CHECK(cudaMemcpy(&got, dout, sizeof(int), cudaMemcpyDeviceToHost));
    char what[128];
    snprintf(what, sizeof what, "greedy: argmax over %d logits, first of two tied maxima", V);
    expect_int(what, got, lo);
    int agree = 0, trials = 40, gathered = 0, whole = 0;
    double perr = 0;
    for (int k = 0; k < trials; k++) {
        float temp = 0.3f + 1.5f * (uni() + 1) / 2, topp = k % 4 == 0 ? 1.0f : 0.2f + 0.75f * (uni() + 1) / 2;
        uint64_t seed = rng(), step = rng() % 1000;
        LAUNCH(1, 1024, SAMPLE_CAND * sizeof(float), 0, sample_kernel, dout, dl, dp, V, temp, topp, seed, step);
        CUDA_CHECK(cudaMemcpy(&got, dout, sizeof(int), cudaMemcpyDeviceToHost));
        std::vector<float> p = host_copy(dp, V);
        for (int i = 0; i < V; i++) {
            double e = fabs(p[i] - exp((l[i] - 9.0) / temp));
            if (isnan(e) || e > perr) perr = e;   /* fmax would skip a NaN; here it stays and fails */
        }
        agree += got == host_pick(p, topp, seed, step);
        double total = 0;
        int cand = 0;
        for (float v : p) total += v;
        for (float v : p) cand += v >= (float)((1 - topp) * total / V / 4);
        gathered += topp < 1 && cand <= SAMPLE_CAND;
        whole += topp < 1 && cand > SAMPLE_CAND;
    }
    snprintf(what, sizeof what, "top-p draws over %d %s logits = the host rule (of %d)", V, peaked ? "peaked" : "flat", trials);
    expect_int(what, agree, trials);
    snprintf(what, sizeof what, "... of them, bisections over gathered candidates (%d) / all %d (%d)", gathered, V, whole);
    expect_int(what, (peaked || V <= SAMPLE_CAND ? gathered : whole) > 0, 1);
    printf("%-7s %-62s max abs err %.2e (tol 1e-6)\n", perr <= 1e-6 ? "ok" : "FAILED", "sampling probabilities exp((l - max) / temp)", perr);
    perr <= 1e-6 ? n_pass++ : n_fail++;
    CUDA_CHECK(cudaFree(dl));
    CUDA_CHECK(cudaFree(dp));
    CUDA_CHECK(cudaFree(dout));
}

/* ---- be->sample over n rows at once (gpu_sample: a block a row, one copy back): row j of the last n
 * logits rows is drawn with coin(seed, step + j), the same token as the one-row kernel gives on that
 * row alone and as the host rule on its probabilities; a row with a NaN gives -1 and leaves the
 * others alone. Rows alternate peaked and flat; at temp 0 each row's maximum is tied twice. ---- */
static void test_sample_rows(int V, int rows, int n, float temp, float topp) {
    std::vector<float> l((size_t)rows * V);
    for (int j = 0; j < rows; j++) {
        std::vector<float> row = sampling_logits(V, j & 1);
        int a = (int)(rng() % V), b = (int)(rng() % V);
        row[a] = row[b] = 9.0f;
        std::copy(row.begin(), row.end(), l.begin() + (size_t)j * V);
    }
    int nan_row = n > 2 ? rows - n + 1 : -1;   /* the second of the n rows */
    if (nan_row >= 0) l[(size_t)nan_row * V + rng() % V] = NAN;
    Config c;
    memset(&c, 0, sizeof c);
    c.vocab = V;
    GpuRank g = make_rank(8);
    g.logits = dev_copy(l);
    g.rows = rows;
    g.sample_rows = n;
    g.probs = dev_copy(std::vector<float>((size_t)n * V));
    CUDA_CHECK(cudaMalloc(&g.sampled, n * sizeof(int)));
    CUDA_CHECK(cudaMallocHost(&g.host_io, (n + 2) * sizeof(int)));
    Rank r;
    memset(&r, 0, sizeof r);
    r.c = &c;
    r.st = &g;
    uint64_t seed = rng(), step = rng() % 1000;
    std::vector<int> got(n, -2);
    gpu_sample(&r, n, temp, topp, seed, step, got.data());
    std::vector<float> p = host_copy(g.probs, (size_t)n * V);
    float *one = dev_copy(std::vector<float>(V));
    int *dout, wrong_host = 0, wrong_one = 0;
    CUDA_CHECK(cudaMalloc(&dout, sizeof(int)));
    for (int j = 0; j < n; j++) {
        int row = rows - n + j, want = -1, alone;
        const float *lr = &l[(size_t)row * V];
        if (row != nan_row && temp <= 0) want = (int)(std::max_element(lr, lr + V) - lr);   /* the first maximum */
        if (row != nan_row && temp > 0) want = host_pick(std::vector<float>(p.begin() + (size_t)j * V, p.begin() + (size_t)(j + 1) * V), topp, seed, step + j);
        LAUNCH(1, 1024, SAMPLE_CAND * sizeof(float), 0, sample_kernel, dout, (const float *)g.logits + (size_t)row * V, one, V, temp, topp,
               seed, step + j);
        CUDA_CHECK(cudaMemcpy(&alone, dout, sizeof(int), cudaMemcpyDeviceToHost));
        wrong_host += got[j] != want;
        wrong_one += got[j] != alone;
    }
    char what[160];
    snprintf(what, sizeof what, "sample %d of %d rows of %d logits, temp %.2f top-p %.2f%s: rows unlike the host rule", n, rows, V, temp,
             topp, nan_row >= 0 ? ", a NaN row" : "");
    expect_int(what, wrong_host, 0);
    expect_int("... rows unlike the one-row kernel on that row, step + j", wrong_one, 0);
    for (void *q : {(void *)g.logits, (void *)g.probs, (void *)g.sampled, (void *)one, (void *)dout}) CUDA_CHECK(cudaFree(q));
    CUDA_CHECK(cudaFreeHost(g.host_io));
    free_rank(&g);
}

/* ---- the backend end to end (gpu_setup, gpu_init: the real buffers, one rank) on a tiny hybrid model
 * with an MTP block: blocks "M*-E", MTP sublayers "*E", the big matrices in fmt (drawn on the device),
 * the embedding and lm_head bf16, driven as nemoh.c's layer loop drives a backend (tiny_forward,
 * tiny_mtp). A speculative step of T tokens (r->keep) against T one-token steps: every logits row, x
 * row and the Mamba state bit for bit; greedy be->sample of the T rows = each row's argmax;
 * rewind(t) = the state after token t; accept (its tokens 1..acc the greedy choices): [acc, argmaxes]
 * and token acc's state, the MTP pass and the draft pass after it fed no tokens = fed from the host;
 * the MTP pass over T tokens = T one-token MTP passes reading x rows 0 .. T - 1; and the captured
 * graphs (r->graph): a replay = the eager step, a graph for each kind of pass, the MTP step from row
 * R in the same graph as from row 0. ---- */
typedef struct {
    Config c;
    Shard s;
    Weights w;
    std::vector<std::vector<float>> host;   /* the fp32 vectors the weights point at */
    std::vector<std::vector<Mat>> experts;  /* the expert matrices' views */
} Tiny;

static float *tiny_vec(Tiny &m, size_t n, float base, float spread) {
    std::vector<float> v = rand_vec(n, spread);
    for (auto &x : v) x += base;
    m.host.push_back(std::move(v));
    return m.host.back().data();
}

/* A synthetic [rows, cols] matrix in fmt, elements of about 1 / sqrt(cols) (upload_mat draws it). */
static Mat tiny_mat(int fmt, int rows, int cols) {
    float sc = fmt == DT_FP8 ? 0.05f / sqrtf((float)cols) : fmt == DT_NVFP4 ? 0.5f / sqrtf((float)cols) : 1.0f;
    return Mat{NULL, fmt, rows, cols, (size_t)cols, NULL, 0, sc};
}

static void tiny_model(Tiny &m, int fmt, int hidden = 320) {
    Config &c = m.c;
    memset(&c, 0, sizeof c);
    c.vocab = 1000, c.hidden = hidden, c.n_layers = 4, c.n_mtp = 2, c.eps = 1e-5f;
    memcpy(c.kind, "M*-E*E", 6);
    c.n_heads = 4, c.n_kv = 2, c.head_dim = 32, c.mlp = 400;
    c.m_heads = 8, c.m_hdim = 16, c.n_groups = 2, c.d_state = 16, c.d_conv = 4, c.conv_bias = 1, c.ctx = 64;
    c.n_experts = 8, c.top_k = 2, c.n_group = 1, c.topk_group = 1, c.moe = 96, c.shared = 128, c.latent = 64, c.norm_topk = 1;
    c.routed_scale = 2.5f;
    int H = c.hidden, di = c.m_heads * c.m_hdim, gN = c.n_groups * c.d_state, conv = di + 2 * gN;
    m.s = Shard{0, 1, c.m_heads, c.n_groups, di, conv, di + conv + c.m_heads, c.n_heads, c.n_kv, 0, 0, c.mlp, c.moe, c.shared, c.vocab};
    Weights &w = m.w;
    memset(&w, 0, sizeof w);
    w.embed = tiny_mat(DT_BF16, c.vocab, H);
    w.lm_head = tiny_mat(DT_BF16, c.vocab, H);
    w.norm_f = tiny_vec(m, H, 1.0f, 0.1f);
    w.enorm = tiny_vec(m, H, 1.0f, 0.1f);
    w.hnorm = tiny_vec(m, H, 1.0f, 0.1f);
    w.mtp_norm = tiny_vec(m, H, 1.0f, 0.1f);
    w.eh_proj = tiny_mat(fmt, H, 2 * H);
    for (int l = 0; l < n_all(&c); l++) {
        Layer &L = w.layer[l];
        L.kind = c.kind[l];
        L.norm = tiny_vec(m, H, 1.0f, 0.1f);
        if (L.kind == K_MAMBA) {
            int rows[5] = {di, di, gN, gN, c.m_heads};
            for (int k = 0; k < 5; k++) L.in_proj[k] = tiny_mat(fmt, rows[k], H);
            L.conv_w = tiny_vec(m, (size_t)conv * 4, 0.0f, 0.5f);
            L.conv_b = tiny_vec(m, conv, 0.0f, 0.2f);
            L.A = tiny_vec(m, c.m_heads, -4.5f, 3.5f);
            L.D = tiny_vec(m, c.m_heads, 0.0f, 1.0f);
            L.dt_bias = tiny_vec(m, c.m_heads, -2.0f, 1.0f);
            L.gnorm = tiny_vec(m, di, 1.0f, 0.1f);
            L.out = tiny_mat(fmt, H, di);
        } else if (L.kind == K_ATTN) {
            L.wq = tiny_mat(fmt, c.n_heads * c.head_dim, H);
            L.wk = tiny_mat(fmt, c.n_kv * c.head_dim, H);
            L.wv = tiny_mat(fmt, c.n_kv * c.head_dim, H);
            L.wo = tiny_mat(fmt, H, c.n_heads * c.head_dim);
        } else if (L.kind == K_MLP) {
            L.up = tiny_mat(fmt, c.mlp, H);
            L.down = tiny_mat(fmt, H, c.mlp);
        } else {
            L.gate = tiny_vec(m, (size_t)c.n_experts * H, 0.0f, 3.0f / sqrtf((float)H));
            L.gate_bias = tiny_vec(m, c.n_experts, 0.0f, 0.05f);
            m.experts.push_back(std::vector<Mat>(c.n_experts, tiny_mat(fmt, c.moe, c.latent)));
            L.eup = m.experts.back().data();
            m.experts.push_back(std::vector<Mat>(c.n_experts, tiny_mat(fmt, c.latent, c.moe)));
            L.edown = m.experts.back().data();
            L.sup = tiny_mat(fmt, c.shared, H);
            L.sdown = tiny_mat(fmt, H, c.shared);
            L.lat_in = tiny_mat(fmt, c.latent, H);
            L.lat_out = tiny_mat(fmt, H, c.latent);
        }
    }
}

/* Layer l's entry norm and mixer, as nemoh.c's layer loop runs them (fused all-reduce at the entry). */
static void tiny_layer(Rank *r, int l, int first, int T, int pos) {
    const Backend *be = &cuda_backend;
    be->norm(r, l, first ? NORM_PLAIN : NORM_FUSED, T);
    char k = r->c->kind[l];
    if (k == K_MAMBA) be->mamba(r, l, T, pos);
    else if (k == K_ATTN) be->attention(r, l, T, pos);
    else if (k == K_MLP) be->mlp(r, l, T);
    else be->moe(r, l, T);
}

static void tiny_forward(Rank *r, const int *tok, int T, int pos, int all) {
    const Backend *be = &cuda_backend;
    r->pass = PASS_MAIN, r->all = all, r->row = 0;
    if (be->replay(r, tok, T, pos)) return;
    be->begin(r, tok, T, pos);
    be->embed(r, tok, T);
    for (int l = 0; l < r->c->n_layers; l++) tiny_layer(r, l, l == 0, T, pos);
    be->allreduce(r, T);
    be->norm(r, NORM_F, NORM_ADD, T);
    be->logits(r, T, all);
    be->end(r, T);
}

/* The MTP block over T tokens at pos, its hidden states x rows row .. row + T - 1 (tok NULL: the device's
 * tokens, position and row: accept's or the last draft's). */
static void tiny_mtp(Rank *r, const int *tok, int T, int row, int pos, int all) {
    const Backend *be = &cuda_backend;
    r->pass = PASS_MTP, r->all = all, r->row = row;
    if (!be->replay(r, tok, T, pos)) {
        be->begin(r, tok, T, pos);
        be->mtp_in(r, tok, T, row);
        for (int l = r->c->n_layers; l < n_all(r->c); l++) tiny_layer(r, l, l == r->c->n_layers, T, pos);
        be->allreduce(r, T);
        be->norm(r, NORM_MTP_F, NORM_ADD, T);
        be->logits(r, T, all);
        be->end(r, T);
    }
    r->pass = PASS_MAIN;
}

/* One rank of the CUDA engine over m, up to t_max tokens a step (free: be->free, be->teardown). */
static void tiny_rank(Rank &r, Tiny &m, int t_max, int spec) {
    memset(&r, 0, sizeof r);
    r.c = &m.c;
    r.s = m.s;
    r.w = m.w;
    r.be = &cuda_backend;
    r.sh = cuda_backend.setup(&m.c, 1, t_max, t_max);
    r.t_max = t_max;
    r.ctx = m.c.ctx;
    r.fuse = 1;
    r.spec = spec;
    r.draft_vocab = m.c.vocab;
    cuda_backend.init(&r);
}

/* ---- a layer's entry norm (NORM_FUSED: the fused all-reduce + residual add + RMSNorm, one rank)
 * against float64: res += pend; x = rmsnorm(res) * w, x16 its bf16 copy at a prompt ---- */
static void test_fused_norm(int hidden, int T) {
    Tiny m;
    tiny_model(m, DT_BF16, hidden);
    Rank r;
    tiny_rank(r, m, T, 0);
    GpuRank *g = gpu_rank(&r);
    size_t n = (size_t)T * hidden;
    std::vector<float> res = rand_vec(n, 3.0f), pend = rand_vec(n), w = host_copy(g->L[1].norm, hidden);
    upload(g->res, res.data(), n * sizeof(float));
    upload(pend_out(&r), pend.data(), n * sizeof(float));
    cuda_backend.norm(&r, 1, NORM_FUSED, T);
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    std::vector<double> rr(n), rx(n);
    for (int t = 0; t < T; t++) {
        double ss = 0;
        for (int i = 0; i < hidden; i++) {
            size_t k = (size_t)t * hidden + i;
            rr[k] = (double)res[k] + pend[k];
            ss += rr[k] * rr[k];
        }
        for (int i = 0; i < hidden; i++) rx[(size_t)t * hidden + i] = rr[(size_t)t * hidden + i] / sqrt(ss / hidden + 1e-5) * w[i];
    }
    char what[128];
    snprintf(what, sizeof what, "fused all-reduce + add + rmsnorm (%s) hidden=%d T=%d: normed", g->pend.devapi ? "device API" : "NCCL",
             hidden, T);
    expect(what, host_copy(g->x, n), rx, 1e-5);
    expect("... residual", host_copy(g->res, n), rr, 1e-6);
    if (!decoded(g, T)) expect("... normed, in bf16 too", host_copy_as(g->x16, n), rx, 4e-3);
    cuda_backend.free(&r);
    cuda_backend.teardown(r.sh);
}

static void test_engine(int fmt, int spec, int T) {
    Tiny m;
    tiny_model(m, fmt);
    const Backend *be = &cuda_backend;
    int t_max = 16, V = m.c.vocab, H = m.c.hidden, P = 13;
    Rank r;
    tiny_rank(r, m, t_max, spec);
    GpuRank *g = gpu_rank(&r);
    std::vector<int> prompt(P), step(T), drafts(T), pm(P);
    for (auto *v : {&prompt, &step, &drafts, &pm}) for (auto &t : *v) t = (int)(rng() % V);
    auto logits = [&](int rows) { const float *l = be->host_logits(&r, rows); return std::vector<float>(l, l + (size_t)rows * V); };
    auto xrows = [&](int rows) { return host_copy(g->x, (size_t)rows * H); };
    auto state = [&]() {   /* the Mamba layers' conv windows and SSM states, without padding */
        std::vector<float> all = host_copy((float *)g->state, g->snap_bytes / sizeof(float)), v;
        size_t nc = (size_t)r.s.conv * 3, ns = (size_t)r.s.d_inner * m.c.d_state, cb = conv_state_bytes(&r) / 4, mb = mamba_state_bytes(&r) / 4;
        for (size_t at = 0; at < all.size(); at += mb) {
            v.insert(v.end(), all.begin() + at, all.begin() + at + nc);
            v.insert(v.end(), all.begin() + at + cb, all.begin() + at + cb + ns);
        }
        return v;
    };
    auto cat = [](const std::vector<std::vector<float>> &v) {
        std::vector<float> o;
        for (auto &x : v) o.insert(o.end(), x.begin(), x.end());
        return o;
    };
    int finite = 1;
    auto fin = [&](const std::vector<float> &v) { for (float x : v) finite &= std::isfinite(x); return v; };
    /* the prompt (as a prompt runs: more tokens than a decoded step), and the MTP block over it */
    tiny_forward(&r, prompt.data(), P, 0, 0);
    std::vector<float> l_prompt = fin(logits(1));
    tiny_mtp(&r, pm.data(), P, 0, 0, 0);
    fin(logits(1));
    be->snapshot(&r, 0, 1);
    /* the step's tokens 1..acc are the model's greedy choices and token acc + 1 is not: acc drafts accepted */
    int acc = (int)(rng() % T);
    auto argmax = [](const std::vector<float> &v, size_t at, size_t n) {
        return (int)(std::max_element(v.begin() + at, v.begin() + at + n) - v.begin() - at);
    };
    std::vector<std::vector<float>> l1(T), x1(T), s1(T);
    for (int t = 0; t < T; t++) {
        tiny_forward(&r, &step[t], 1, P + t, 1);
        l1[t] = fin(logits(1));
        x1[t] = xrows(1);
        s1[t] = state();
        int best = argmax(l1[t], 0, V);
        if (t + 1 < T) step[t + 1] = t < acc ? best : step[t + 1] == best ? (best + 1) % V : step[t + 1];
    }
    be->snapshot(&r, 0, 0);
    r.keep = 1;
    tiny_forward(&r, step.data(), T, P, 1);
    r.keep = 0;
    char what[160];
    snprintf(what, sizeof what, "engine %s, spec %d: a step of %d tokens with keep: logits = %d one-token steps'", fmt_name(fmt), spec, T, T);
    expect_same(what, logits(T), cat(l1));
    std::vector<float> x_step = xrows(T);
    expect_same("... final-norm rows (the MTP block's h) = the one-token steps'", x_step, cat(x1));
    expect_same("... Mamba state after it = after the last one-token step", state(), s1[T - 1]);
    std::vector<int> got(T);
    be->sample(&r, T, 0.0f, 1.0f, 7, 0, got.data());
    int bad = 0;
    for (int t = 0; t < T; t++) bad += got[t] != (int)(std::max_element(l1[t].begin(), l1[t].end()) - l1[t].begin());
    expect_int("... greedy sample of its rows: rows unlike their argmax", bad, 0);
    std::vector<int> order(T);
    for (int t = 0; t < T; t++) order[t] = t;   /* T - 1 last: after others, it must copy */
    std::shuffle(order.begin(), order.end() - 1, rng);
    bad = 0;
    for (int t : order) {
        be->rewind(&r, t);
        std::vector<float> st = state();
        bad += memcmp(st.data(), s1[t].data(), st.size() * sizeof(float)) != 0;
    }
    snprintf(what, sizeof what, "... rewind(t), t shuffled, then %d: states unlike token t's", T - 1);
    expect_int(what, bad, 0);
    /* the step on the device: accept, the MTP pass fed no tokens over its T rows, draft 0 from row acc,
       the pass after it; against the same passes fed from the host */
    std::vector<int> out(T + 1), want(T + 1);
    expect_int("... accept leaves n on the device", be->accept(&r, step.data(), T, 0.0f, 1.0f, 7, 0), -1);
    be->outcome(&r, T, 0, out.data());
    want[0] = acc;
    for (int t = 0; t < T; t++) want[1 + t] = argmax(l1[t], 0, V);
    bad = 0;
    for (int t = 0; t <= T; t++) bad += out[t] != want[t];
    snprintf(what, sizeof what, "... accept: [n, t_0..t_%d] unlike [%d, the rows' argmax]", T - 1, acc);
    expect_int(what, bad, 0);
    expect_same("... accept: the state after token n", state(), s1[acc]);
    tiny_mtp(&r, NULL, T, -1, -1, 1);
    std::vector<float> la = fin(logits(T));
    int d0 = -2;
    be->draft(&r, 0);
    be->outcome(&r, 0, 1, &d0);
    expect_int("... draft 0 = the argmax of the pass's row n", d0, argmax(la, (size_t)acc * V, V));
    tiny_mtp(&r, NULL, 1, -1, -1, 1);
    std::vector<float> la1 = fin(logits(1));
    upload(g->x, x_step.data(), x_step.size() * sizeof(float));
    tiny_mtp(&r, &want[1], T, 0, P, 1);
    expect_same("... the MTP pass fed no tokens after accept = fed t_0.. from the host", la, logits(T));
    tiny_mtp(&r, &d0, 1, acc, P + acc + 1, 1);
    expect_same("... the pass after draft 0, fed no tokens = fed it at position P + n + 1, row n", la1, logits(1));
    upload(g->x, x_step.data(), x_step.size() * sizeof(float));
    /* the MTP block over the step's T positions from x rows 0.., and one position at a time from row t */
    tiny_mtp(&r, drafts.data(), T, 0, P, 1);
    std::vector<float> lm = fin(logits(T));
    std::vector<std::vector<float>> lm1(T);
    for (int t = 0; t < T; t++) {
        upload(g->x, x_step.data(), x_step.size() * sizeof(float));
        tiny_mtp(&r, &drafts[t], 1, t, P + t, 1);
        lm1[t] = logits(1);
    }
    expect_same("... the MTP block over T tokens = one token at a time, row t", lm, cat(lm1));
    /* graphs, each kind captured at its first run and replayed after: the main step; the MTP step from
       rows 0 and R (one graph: it reads the row on the device); the step of T tokens with keep */
    int next = (int)(rng() % V), nd = (int)(rng() % V), R = T > 2 ? 2 : T - 1;
    auto graphs = [&]() { int n = 0; for (cudaGraphExec_t e : g->graph) n += e != NULL; return n; };
    be->snapshot(&r, 1, 1);
    auto main_step = [&](int graph) {
        r.graph = graph;
        be->snapshot(&r, 1, 0);
        tiny_forward(&r, &next, 1, P + T, 1);
        return fin(logits(1));
    };
    auto mtp_step = [&](int graph, int row, const int *tok) {
        r.graph = graph;
        upload(g->x, x_step.data(), x_step.size() * sizeof(float));
        tiny_mtp(&r, tok, 1, row, P + T, 1);
        return fin(logits(1));
    };
    std::vector<float> e0 = main_step(0), e1 = main_step(1);
    expect_int("... graphs: the main step captured", graphs(), 1);
    std::vector<float> e2 = main_step(1);
    expect_same("... the captured main step = the eager one", e1, e0);
    expect_same("... its replay = the eager one", e2, e0);
    std::vector<float> m0 = mtp_step(0, 0, &nd), mr = mtp_step(0, R, &nd), m1 = mtp_step(1, R, &nd);
    expect_int("... the MTP step from row R captured: one graph more", graphs(), 2);
    expect_same("... the captured MTP step from row R = the eager one", m1, mr);
    expect_same("... its replay from row 0 = the eager one from row 0", mtp_step(1, 0, &nd), m0);
    expect_same("... and from row R again = the eager one", mtp_step(1, R, &nd), mr);
    expect_same("... the main step's replay after it = the eager one", main_step(1), e0);
    /* a draft made on the device, then the pass after it fed no tokens from the host (a graph as well) */
    mtp_step(1, R, &nd);
    be->draft(&r, 0);
    be->outcome(&r, 0, 1, &d0);
    expect_int("... draft 0 = the argmax of the MTP step's logits", d0, argmax(mr, 0, V));
    tiny_mtp(&r, NULL, 1, -1, -1, 1);
    std::vector<float> fed = fin(logits(1));
    mtp_step(0, R, &nd);
    tiny_mtp(&r, &d0, 1, 0, P + T + 1, 1);
    expect_same("... the MTP step fed draft 0 on the device = fed it from the host", fed, logits(1));
    /* the step of T tokens with keep, captured, then replayed: logits and states as the one-token steps' */
    auto keep_step = [&]() {
        r.graph = 1;
        be->snapshot(&r, 0, 0);
        r.keep = 1;
        tiny_forward(&r, step.data(), T, P, 1);
        r.keep = 0;
        return fin(logits(T));
    };
    int had = graphs();
    expect_same("... the captured step of T tokens with keep = the one-token steps", keep_step(), cat(l1));
    expect_int("... captured: one graph more", graphs(), had + 1);
    expect_same("... its replay = the one-token steps", keep_step(), cat(l1));
    expect_same("... Mamba state after the replay = after the last one-token step", state(), s1[T - 1]);
    be->rewind(&r, 0);
    expect_same("... rewind(0) after the replay: token 0's state", state(), s1[0]);
    expect_int("... every logit finite", finite, 1);
    be->free(&r);
    be->teardown(r.sh);
}

/* Microseconds per call of run() on stream s: three calls to warm up, then the mean of reps. */
template <typename F> static float time_us(cudaStream_t s, int reps, F run) {
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) run();
    CUDA_CHECK(cudaEventRecord(e0, s));
    for (int i = 0; i < reps; i++) run();
    CUDA_CHECK(cudaEventRecord(e1, s));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    return ms * 1e3f / reps;
}

/* Not a check: the selective scan's time at one layer of a model's shape, for T steps. (Back to back,
 * each scan reads the state before its wait while the one before still writes it: the engine never
 * runs two scans in a row, see LAUNCH; the time holds, the values are not looked at.) */
static void time_scan(int heads, int hdim, int groups, int N, int T) {
    int di = heads * hdim, cv = di + 2 * groups * N, in = di + cv + heads;
    std::vector<float> A(heads, -1.0f), D(heads, 1.0f), dtb(heads, -3.0f);
    float *d_proj = dev_copy(rand_vec((size_t)T * in, 0.5f)), *d_xbc = dev_copy(rand_vec((size_t)T * cv, 0.5f));
    float *d_y = dev_copy(std::vector<float>((size_t)T * di)), *d_ssm = dev_copy(std::vector<float>((size_t)di * N));
    float *d_A = dev_copy(A), *d_D = dev_copy(D), *d_dtb = dev_copy(dtb);
    ScanArgs sa = scan_args(d_y, d_ssm, d_xbc, d_proj, in, d_A, d_D, d_dtb, T, heads, hdim, groups, N);
    float us = time_us(0, T > 1 ? 5 : 200, [&] { ssm_scan(0, sa, N); });
    printf("# selective scan %d heads x %d, N %d, groups %d, %d step%s: %.1f us", heads, hdim, N, groups, T, T > 1 ? "s" : "", us);
    if (T > 1) printf(", chunked SSD %.1f us", time_us(0, 5, [&] { ssd_scan(0, sa, N); }));
    float *d_gw = dev_copy(rand_vec(di)), *d_gss = dev_copy(std::vector<float>((size_t)T * heads * scan_blocks(hdim, N)));
    sa.gw = d_gw;
    sa.gss = d_gss;   /* gated: as decode (SCAN_GATE) and a decoded step of a few tokens (SCAN_EACH) run it */
    if (T <= DECODE_T) printf(", gated %.1f us", time_us(0, 200, [&] { ssm_scan(0, sa, N); }));
    CUDA_CHECK(cudaFree(d_gw));
    CUDA_CHECK(cudaFree(d_gss));
    printf("\n");
    for (float *p : {d_proj, d_xbc, d_y, d_ssm, d_A, d_D, d_dtb}) CUDA_CHECK(cudaFree(p));
}

/* Not a check: prompt attention's time for T tokens from position pos (a bf16 cache of pos + T keys),
 * and the rate that makes of its useful products (4 hd flops a visible query-key pair). */
static void time_prompt_attention(int q, int kv, int hd, int pos, int T) {
    int kw = kv * hd, w = q * hd + 2 * kw;
    bf16 *d_k = dev_copy_as<bf16>(rand_vec((size_t)(pos + T) * kw)), *d_v = dev_copy_as<bf16>(rand_vec((size_t)(pos + T) * kw));
    float *d_qkv = dev_copy(rand_vec((size_t)T * w)), *d_y = dev_copy(std::vector<float>((size_t)T * q * hd));
    PromptAttnArgs<bf16> a = {.y = d_y, .q = d_qkv, .kc = d_k, .vc = d_v, .ldy = q * hd, .ldq = w, .kw = kw, .hd = hd, .gl = q / kv,
                              .T = T, .pos = pos, .scale = 0.088f};
    float us = time_us(0, 5, [&] { attn_prompt(0, a, kv); });
    double pairs = (double)q * T * (pos + (T + 1) / 2.0);
    printf("# prompt attention q %d / kv %d, head %d, %d tokens from %d: %.1f us, %.0f TFLOP/s\n", q, kv, hd, T, pos, us,
           pairs * 4 * hd / (us * 1e6));
    for (void *p : {(void *)d_k, (void *)d_v, (void *)d_qkv, (void *)d_y}) CUDA_CHECK(cudaFree(p));
}

/* Not a check: the sampler's time over V logits (peaked or flat, as above), greedy and top-p. */
/* Not a check: the floor under every decode step, an empty kernel (its wait only) launched n times in a
 * row by LAUNCH and replayed as a captured graph, as the engine's step is: what a kernel boundary costs
 * with no work, at a grid of one block, one a SM, and one wave of the products' two-warp blocks. */
__global__ void empty_kernel() { pdl_wait(); }

static void time_chain() {
    const int n = 256;
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("# empty kernels chained in a graph, a kernel:");
    for (int blocks : {1, sms, gemv_slots(0)}) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < n; i++) LAUNCH(blocks, 32 * GEMV_WARPS, 0, s, empty_kernel);
        CUDA_CHECK(cudaStreamEndCapture(s, &graph));
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        float us = time_us(s, 20, [&] { CUDA_CHECK(cudaGraphLaunch(exec, s)); });
        printf(" %d blocks %.2f us%s", blocks, us / n, blocks == gemv_slots(0) ? "\n" : ",");
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(graph));
    }
    CUDA_CHECK(cudaStreamDestroy(s));
}

static void time_sample(int V, int peaked) {
    float *dl = dev_copy(sampling_logits(V, peaked)), *dp = dev_copy(std::vector<float>(V));
    int *dout;
    CUDA_CHECK(cudaMalloc(&dout, sizeof(int)));
    printf("# sampling over %d %s logits:", V, peaked ? "peaked" : "flat");
    for (float topp : {0.0f, 1.0f, 0.95f})
        printf(" %s %.1f us%s", topp == 0 ? "greedy" : topp == 1 ? "temp 0.8" : "top-p 0.95", time_us(0, 20, [&] {
            LAUNCH(1, 1024, SAMPLE_CAND * sizeof(float), 0, sample_kernel, dout, dl, dp, V, topp == 0 ? 0.0f : 0.8f, topp, 1, 2);
        }), topp == 0.95f ? "\n" : ",");
    CUDA_CHECK(cudaFree(dl));
    CUDA_CHECK(cudaFree(dp));
    CUDA_CHECK(cudaFree(dout));
}

/* Not a check: the bandwidth the one-token product reaches at a model's shape: as matmul launches it,
 * and with 1 and 2 warps a row (NVFP4: 4 and 8 warps a block of E2M1_ROWS rows). */
static void time_gemv(int rows, int cols, int fmt = DT_BF16) {
    Mat m = {NULL, fmt, rows, cols, (size_t)cols, NULL, 0, 1e-3f};
    GMat W = upload_mat(&m, 1);
    GpuRank g = make_rank(8);
    float *dx = dev_copy(rand_vec(cols)), *dout = dev_copy(std::vector<float>(rows));
    float us = time_us(g.stream, 50, [&] { matmul(&g, dout, rows, dx, cols, 1, &W, 0, nullptr, nullptr); });
    double bytes = (double)rows * cols * 16 / fmt_per(fmt) + (fmt == DT_NVFP4 ? rows * cols / 16.0 : 0);
    int e2m1 = fmt == DT_NVFP4;
    printf("# gemv %s %dx%d: %.1f us (%d warps a %s), %.0f GB/s of weights; at %s:", fmt_name(fmt), rows, cols, us,
           e2m1 ? e2m1_gemv_warps(&g, W.rows, cdiv(W.cols, E2M1_SPAN)) : gemv_wpr(&g, &W), e2m1 ? "block" : "row", bytes / (us * 1e3), e2m1 ? "2, 4, 8" : "1, 2");
    for (int w = e2m1 ? 0 : 1; w <= (fmt == DT_F32 ? 0 : 2); w++)
        printf(" %.1f", time_us(g.stream, 50, [&] {
            int wpr = e2m1 ? 1 : w, warps = e2m1 ? 2 << w : GEMV_WARPS, slots;
            GemvArgs a = {.out = dout, .W = W, .x = dx, .T = 1, .wpr = wpr, .warm = nullptr, .warm_n = 0, .warm_from = 0, .gs = GroupScale{}};
            int blocks = e2m1 ? cdiv(rows, E2M1_ROWS) : gemv_blocks(&g, rows, quantized(fmt), wpr, &slots);
            LAUNCH(blocks, 32 * warps, 0, g.stream, e2m1 ? e2m1_for(EPI_NONE, warps) : gemv_for(fmt, EPI_NONE, 0), a);
        }));
    printf(" us\n");
    free_mat(&W);
    CUDA_CHECK(cudaFree(dx));
    CUDA_CHECK(cudaFree(dout));
    free_rank(&g);
}

/* Not a check: a few tokens' product at a model's shape, T = 2, 4, 8, 9: decoded (the several-token
 * kernel, one launch; what a verify step runs), T one-token launches, and the prompt path (cuBLAS
 * on bf16 activations; what such a step would run without drafting). */
static void time_gemv_tokens(int rows, int cols, int fmt = DT_BF16) {
    Mat m = {NULL, fmt, rows, cols, (size_t)cols, NULL, 0, 1e-3f};
    GMat W = upload_mat(&m, 1);
    GpuRank g = make_rank((size_t)DECODE_T * pad8(cols));
    g.act_w = pad8(cols);
    float *dx = dev_copy(rand_vec((size_t)DECODE_T * cols)), *dout = dev_copy(std::vector<float>((size_t)DECODE_T * rows));
    printf("# gemv %s %dx%d, T tokens: decoded / one by one / cuBLAS, us:", fmt_name(fmt), rows, cols);
    for (int T : {2, 4, 8, 9}) {
        g.dec_t = g.dec_now = T;
        float dec = time_us(g.stream, 50, [&] { matmul(&g, dout, rows, dx, cols, T, &W, 0, nullptr, nullptr); });
        float one = time_us(g.stream, 20, [&] {
            for (int t = 0; t < T; t++) matmul(&g, dout + (size_t)t * rows, rows, dx + (size_t)t * cols, cols, 1, &W, 0, nullptr, nullptr);
        });
        g.dec_t = g.dec_now = 1;
        float blas = time_us(g.stream, 50, [&] { matmul(&g, dout, rows, dx, cols, T, &W, 0, nullptr, nullptr); });
        printf("  T=%d %.1f / %.1f / %.1f", T, dec, one, blas);
    }
    printf("\n");
    free_mat(&W);
    CUDA_CHECK(cudaFree(dx));
    CUDA_CHECK(cudaFree(dout));
    free_rank(&g);
}

/* Not a check: one decode step of a MoE layer at a model's shape (router, up, down; random weights
 * drawn on the device), and the bandwidth over the bytes it must read: the router, the chosen
 * experts' rows, the shared expert, the latent projections. With T > 1: a verify step's T tokens
 * decoded in one step, and T one-token steps. */
static void time_moe(const char *name, int E, int K, int m, int S, int hidden, int lat, int fe = DT_BF16, int fs = DT_BF16, int T = 1) {
    int d = lat ? lat : hidden;
    MoeShape ms = {E, K, m, S, hidden, lat, d};
    MoeRoute rt = {E, K, 1, 1, 1, 2.5f};
    GLayer L = synth_moe_layer(fe, fs, E, m, S, hidden, lat, [](int, int) { return 1e-3f; });
    GpuRank g = make_rank((size_t)T * pad8(std::max({hidden, S, lat})));
    g.act_w = pad8(std::max({hidden, S, lat}));
    std::vector<float> x = rand_vec((size_t)T * hidden);
    g.x = dev_copy(x);
    g.x16 = dev_copy_as<bf16>(x);
    g.proj = dev_copy(std::vector<float>((size_t)T * S));   /* a prompt's shared expert: its up rows */
    g.dec_t = g.dec_now = T <= DECODE_T ? T : 1;   /* more tokens: a prompt */
    moe_alloc(&g, &ms, T);
    float *out = dev_copy(std::vector<float>((size_t)T * hidden));
    float us = time_us(g.stream, 50, [&] {
        moe_choose(&g, &L, &ms, rt, T);
        moe_experts(&g, &L, &ms, out, T, NULL);
    });
    if (T > DECODE_T)   /* the multiply-adds of the routed and shared experts (and fc1, fc2) */
        printf("# moe prompt layer %s %s/%s, %d tokens: %.1f us, %.0f TFLOP/s\n", name, fmt_name(fe), fmt_name(fs), T, us,
               2.0 * T * (2.0 * K * m * d + 2.0 * S * hidden + 2.0 * lat * hidden) / (us * 1e6));
    else if (T > 1) {
        float *x0 = g.x;
        float one = time_us(g.stream, 20, [&] {
            for (int t = 0; t < T; t++) {
                g.x = x0 + (size_t)t * hidden;
                moe_choose(&g, &L, &ms, rt, 1);
                moe_experts(&g, &L, &ms, out + (size_t)t * hidden, 1, NULL);
            }
        });
        g.x = x0;
        printf("# moe decode layer %s %s/%s, %d tokens: %.1f us in one step, %.1f us one by one\n", name, fmt_name(fe), fmt_name(fs),
               T, us, one);
    }
    auto eb = [](int fmt) { return 16.0 / fmt_per(fmt) + (fmt == DT_NVFP4 ? 1.0 / 16 : 0); };   /* bytes an element */
    double bytes = (double)E * hidden * 4 + 2.0 * K * m * d * eb(fe) + 2.0 * S * hidden * eb(fs) + 2.0 * lat * hidden * eb(fs);
    if (T == 1)
        printf("# moe decode layer %s %s/%s (%d experts top %d, %d rows, shared %d, hidden %d, latent %d): %.1f us, %.0f GB/s of %.1f MB\n",
               name, fmt_name(fe), fmt_name(fs), E, K, m, S, hidden, lat, us, bytes / (us * 1e3), bytes / 1e6);
    free_synth_moe_layer(&L);
    for (void *p : {(void *)out, (void *)g.x, (void *)g.x16, (void *)g.proj}) CUDA_CHECK(cudaFree(p));
    moe_free(&g);
    free_rank(&g);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);   /* a CUDA error on stderr lands after the line it follows */
    uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 10) : std::random_device{}();
    rng.seed(seed);
    printf("# seed %llu (run with it as the argument to repeat)\n", (unsigned long long)seed);
    /* the sampler's candidate buffer, as gpu_init sets it up */
    CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SAMPLE_CAND * sizeof(float)));
    for (int fmt : {DT_F32, DT_BF16, DT_FP8, DT_NVFP4}) {
        /* NVFP4 rows are whole 16-element blocks (1008, 4112: a last half piece of 32; 16: none whole) */
        auto k = [&](int cols) { return fmt == DT_NVFP4 ? (cols + 15) / 16 * 16 : cols; };
        test_matmul(fmt, 37, k(1000), 1, 0);
        test_matmul(fmt, 300, k(4099), 1, 0);
        test_matmul(fmt, 129, k(60), 1, 1);
        test_matmul(fmt, 1, k(8), 1, 0);
        test_matmul(fmt, 37, k(16395), 1, 0);   /* two warps a row (bf16) */
        test_matmul(fmt, 130, k(1000), 7, 0);
        test_matmul(fmt, 77, k(515), 130, 1);
        test_gemv_tokens(fmt, 37, k(1000), 2, EPI_NONE);     /* a verify step of 1 .. 8 drafts: rounds of GEMV_TOKENS */
        test_gemv_tokens(fmt, 300, k(4099), 4, EPI_NONE);
        test_gemv_tokens(fmt, 129, k(60), 5, EPI_RELU2);
        test_gemv_tokens(fmt, 37, k(16395), 3, EPI_NONE);    /* two warps a row (bf16) */
        test_gemv_tokens(fmt, 77, k(515), 9, EPI_RELU2);
        test_gemv_tokens(fmt, 9001, k(304), 7, EPI_NONE);     /* more rows than a wave of blocks holds */
        test_gemv_tokens(fmt, 37, 256, 6, EPI_GNORM, fmt == DT_NVFP4 ? 2 : 4);   /* out_proj with the gated norm folded: groups of 64 (NVFP4: whole spans, 128) */
        test_gemv_tokens(fmt, 1000, 2048, 9, EPI_GNORM, 8);
    }
    test_matmul(DT_FP8, 40000, 900, 3, 0);    /* more rows than deq holds at once: a prompt's product in two passes */
    test_matmul(DT_FP8, 9001, 304, 1, 0);     /* more rows than a wave of blocks holds, not a multiple of QROWS */
    test_matmul(DT_NVFP4, 9001, 304, 1, 1);    /* rows of 3 spans filling the GPU: blocks of 4 warps, one idle */
    test_matmul(DT_NVFP4, 9001, 4112, 1, 1);   /* rows of 33 spans filling the GPU: blocks of 4 warps */
    test_gemv_tokens(DT_NVFP4, 9001, 2048, 1, EPI_GNORM, 8);   /* the gated norm's scale in blocks of 4 warps */
    test_norms(1000, 3);
    test_norms(6008, 1);   /* the engine's hidden sizes are multiples of 8 */
    test_mtp_in(DT_BF16, DT_BF16, 1000, 1, 0, 1);
    test_mtp_in(DT_BF16, DT_BF16, 1000, 1, 3, 1);       /* a draft from the last row of a longer step */
    test_mtp_in(DT_F32, DT_F32, 520, 5, 2, 1);
    test_mtp_in(DT_F32, DT_F32, 520, 5, 2, 9);          /* decoded: the several-token product */
    test_mtp_in(DT_NVFP4, DT_FP8, 1024, 7, 0, 9);
    test_mtp_in(DT_FP8, DT_BF16, 4096, 3, 1, 1);
    test_mtp_in(DT_BF16, DT_NVFP4, 2048, 130, 4, 9);    /* a prompt's MTP pass */
    test_mamba(6, 10, 2, 16, {5, 1, 37});
    test_mamba(4, 6, 1, 8, {1, 2, 1, 8, 9, 1});
    test_mamba(8, 64, 4, 128, {3, 1});
    test_mamba(8, 64, 4, 128, {3}, DT_BF16, 8);   /* proj rows 16-byte aligned: the gated norm's 16-byte loads */
    test_mamba(24, 64, 1, 64, {2}, DT_BF16, 8);   /* a group of 1536 channels */
    test_mamba(80, 64, 1, 16, {2}, DT_BF16, 8);   /* 5120: eight channels a thread */
    test_mamba(4, 12, 2, 256, {20, 1});
    test_mamba(2, 80, 1, 128, {40, 1});   /* P = 80: rows of one head across blocks */
    test_mamba(32, 64, 1, 64, {2, 1});    /* one group of 2048 channels for the gated norm */
    test_mamba(8, 64, 4, 128, {1}, DT_FP8);     /* the gated norm folded into a quantized out_proj */
    test_mamba(8, 64, 4, 128, {1}, DT_NVFP4);
    test_mamba(6, 10, 2, 16, {1}, DT_NVFP4);    /* groups of 30 channels: no fold with NVFP4's 32-element pieces */
    test_keep(6, 10, 2, 16, 4);     /* groups of 30: no fold */
    test_keep(8, 64, 4, 128, 9);    /* gated, as nemotron-h-8b's heads decode */
    test_keep(4, 12, 2, 256, 3);
    test_keep(2, 80, 1, 128, 2);    /* rows of one head across blocks */
    test_keep(32, 64, 1, 64, 1);    /* one token */
    test_keep(16, 64, 8, 8, 17);    /* more tokens than a stage of the scan holds */
    test_ssd(6, 10, 2, 8, {37, 1, 64, 1});          /* the tiny-bf16 fixture's shape: one partial chunk, one whole */
    test_ssd(8, 64, 2, 128, {130, 1, 200, 1});      /* nemotron-h-8b's head and state: chunks across calls */
    test_ssd(4, 80, 1, 64, {65, 1});                /* P = 80: channels over two blocks, a chunk of one step at the end */
    test_ssd(4, 12, 2, 256, {100, 1});              /* N = 256: 32 channels a block */
    test_ssd(3, 10, 1, 8, {37, 1});                 /* d_inner 30: B and C rows not 16-byte aligned */
    test_ssd(16, 64, 8, 32, {2, 1, 3});             /* two-step prompts */
    test_attention<float>(4, 2, 20, 0, 8);
    test_attention<float>(6, 3, 8, 7, 15);
    test_attention<float>(8, 2, 128, 300, 308);
    test_attention<float>(4, 1, 64, 777, 785);
    test_attention<float>(4, 2, 20, 5, 8192);      /* more splits than keys */
    test_attention<float>(8, 2, 128, 2046, 8192);
    test_attention<float>(2, 1, 256, 1000, 3001);
    test_attention<bf16>(4, 1, 20, 6, 8);
    test_attention<bf16>(4, 2, 12, 40, 256);        /* the tiny-moe fixtures' head 12: element loads, padded to 32 */
    test_attention<bf16>(8, 2, 128, 2046, 8192);
    test_attention<bf16>(5, 1, 80, 999, 1500);
    test_attention<bf16>(2, 1, 256, 1000, 3001);
    test_attention<bf16>(16, 1, 128, 63, 64);       /* a group of 16: one full tile of heads; keys end a tile */
    test_attention<bf16>(20, 1, 96, 64, 2112);      /* a group of 20: a second tile of 4 heads; a key past a tile */
    test_attention<bf16>(40, 8, 128, 100000, 100032);   /* nemotron-nano-9b-v2's heads, deep in a long context */
    test_attention_tokens<float>(4, 2, 20, 0, 3, 8);       /* a verify step from position 0 */
    test_attention_tokens<float>(8, 2, 128, 300, 5, 308);
    test_attention_tokens<float>(4, 1, 64, 2040, 9, 4096);
    test_attention_tokens<bf16>(4, 1, 20, 6, 2, 16);
    test_attention_tokens<bf16>(8, 2, 128, 2046, 4, 8192);
    test_attention_tokens<bf16>(20, 1, 96, 60, 9, 2112);    /* a second tile of heads; keys across a tile */
    test_attention_tokens<bf16>(40, 8, 128, 5000, 7, 8192);
    test_attention_tokens<bf16>(2, 1, 256, 1000, 3, 3001);
    test_prompt_attention<bf16>(4, 1, 20, 0, 37);      /* the tiny-bf16 fixture's shape: head 20 padded to 32 */
    test_prompt_attention<bf16>(8, 8, 64, 0, 130);     /* GQA group 1: 64-row tiles of tokens, a partial last one */
    test_prompt_attention<bf16>(8, 2, 80, 100, 77);    /* group 4, head 80, a chunk starting mid-cache inside a key tile */
    test_prompt_attention<bf16>(16, 2, 128, 1000, 300);  /* group 8: 8 tokens a row tile */
    test_prompt_attention<bf16>(5, 1, 128, 64, 200);   /* group 5 (nemotron-nano-9b-v2): tokens straddle row tiles */
    test_prompt_attention<bf16>(4, 1, 256, 65, 64);    /* head 256 */
    test_prompt_attention<bf16>(32, 8, 128, 0, 1);     /* a single token through the prompt path */
    test_prompt_attention<float>(8, 2, 8, 3, 20);      /* fp32: the tiny-f32 fixture's shape */
    test_prompt_attention<float>(4, 1, 80, 100, 77);
    test_prompt_attention<float>(2, 2, 256, 500, 40);
    test_moe_router(12, 3, 2, 1, 1, 2.5f, 40, 1, 0);
    test_moe_router(12, 3, 2, 1, 0, 1.0f, 40, 37, 0);
    test_moe_router(12, 3, 1, 1, 1, 2.5f, 1000, 1, 1);     /* tied experts */
    test_moe_router(12, 3, 1, 1, 1, 2.5f, 1000, 9, 1);
    test_moe_router(64, 8, 8, 3, 0, 1.5f, 1064, 1, 0);
    test_moe_router(64, 4, 8, 1, 1, 1.0f, 1064, 1, 2);     /* tied groups */
    test_moe_router(64, 4, 8, 1, 1, 1.0f, 1064, 20, 2);
    test_moe_router(20, 20, 4, 4, 1, 1.0f, 64, 1, 0);      /* every expert chosen */
    test_moe_router(128, 6, 1, 1, 1, 2.5f, 2688, 1, 0);    /* nemotron-3-nano-30b-a3b */
    test_moe_router(128, 6, 1, 1, 1, 2.5f, 2688, 20, 0);
    test_moe_router(512, 22, 1, 1, 1, 5.0f, 4096, 1, 0);   /* nemotron-3-super-120b-a12b */
    test_moe_router(512, 22, 1, 1, 1, 5.0f, 4096, 3, 1);
    test_moe_router(512, 22, 1, 1, 1, 5.0f, 200, 1, 3);
    test_moe_router(128, 6, 1, 1, 1, 2.5f, 200, 2, 3);
    test_moe_router(1000, 32, 8, 3, 1, 1.0f, 72, 4, 0);    /* the most experts and slots */
    test_moe_router(1000, 1, 1, 1, 0, 1.0f, 72, 1, 3);
    for (int fmt : {DT_F32, DT_BF16, DT_FP8}) {
        test_moe_products(fmt, fmt, 12, 3, 20, 36, 40, 0, 1);
        test_moe_products(fmt, fmt, 10, 4, 27, 19, 56, 24, 1);   /* latent */
        test_moe_products(fmt, fmt, 7, 2, 13, 9, 32, 0, 1);
        test_moe_products(fmt, fmt, 12, 3, 20, 36, 44, 0, 37);   /* bf16 rows of x not 16-byte aligned: copied */
        test_moe_products(fmt, fmt, 10, 4, 27, 19, 56, 24, 50);
        test_moe_products(fmt, fmt, 10, 4, 27, 19, 40, 48, 37);   /* latent wider than hidden */
        test_moe_products(fmt, fmt, 64, 2, 24, 40, 64, 0, 3);    /* most experts without tokens */
        test_moe_products(fmt, fmt, 8, 6, 1302, 600, 520, 0, 1);   /* two warps a row in the down product */
        test_moe_products(fmt, fmt, 8, 6, 1302, 600, 520, 72, 1);
        test_moe_products(fmt, fmt, 8, 6, 1302, 600, 520, 72, 130);
        test_moe_products(fmt, fmt, 12, 3, 20, 36, 40, 0, 2);      /* prompts of 2 and 3 tokens */
        test_moe_products(fmt, fmt, 10, 4, 27, 19, 56, 24, 3);
        test_moe_products(fmt, fmt, 16, 4, 200, 64, 136, 0, 300, 1);   /* one expert with most pairs: several row tiles */
        test_moe_products(fmt, fmt, 128, 6, 129, 72, 264, 0, 201, 1);  /* many experts without pairs; n one past a tile */
        test_moe_products(fmt, fmt, 8, 2, 64, 64, 4800, 0, 1);      /* the down product's rows in one range each (132 SMs) */
    }
    /* NVFP4 experts (sizes whole 16-element blocks), alone and beside FP8 or bf16 shared experts */
    for (int fs : {DT_NVFP4, DT_FP8, DT_BF16}) {
        test_moe_products(DT_NVFP4, fs, 12, 3, 32, 48, 64, 0, 1);
        test_moe_products(DT_NVFP4, fs, 10, 4, 32, 16, 64, 32, 1);   /* latent */
        test_moe_products(DT_NVFP4, fs, 12, 3, 32, 48, 64, 0, 37);
        test_moe_products(DT_NVFP4, fs, 10, 4, 32, 16, 48, 80, 37);  /* latent wider than hidden */
        test_moe_products(DT_NVFP4, fs, 8, 6, 1296, 592, 528, 80, 1);   /* two warps a row in the down product */
        test_moe_products(DT_NVFP4, fs, 8, 6, 1296, 592, 528, 80, 130);
        test_moe_products(DT_NVFP4, fs, 16, 4, 208, 64, 144, 0, 300, 1);
        test_moe_products(DT_NVFP4, fs, 12, 3, 32, 48, 64, 0, 2);
        test_moe_products(DT_NVFP4, fs, 8, 2, 64, 64, 4800, 0, 1);  /* the down product's rows in one range each (132 SMs) */
    }
    test_moe_products(DT_NVFP4, DT_NVFP4, 8, 6, 4224, 64, 4800, 0, 1);   /* 199 spans a row, no cut in one wave (132 SMs): two ranges */
    for (int fmt : {DT_F32, DT_BF16, DT_FP8}) {
        test_moe_tokens(fmt, fmt, 12, 3, 20, 36, 40, 0, 4);
        test_moe_tokens(fmt, fmt, 10, 4, 27, 19, 56, 24, 9);     /* latent; rounds of GEMV_TOKENS */
        test_moe_tokens(fmt, fmt, 8, 6, 1302, 600, 520, 72, 3);  /* two warps a row in the down product */
    }
    test_moe_tokens(DT_NVFP4, DT_FP8, 12, 3, 32, 48, 64, 0, 5);
    test_moe_tokens(DT_NVFP4, DT_BF16, 10, 4, 32, 16, 64, 32, 9);
    test_moe_tokens(DT_NVFP4, DT_NVFP4, 8, 6, 1296, 592, 528, 80, 2);
    test_moe_tokens(DT_NVFP4, DT_FP8, 512, 22, 1344, 2688, 4096, 1024, 4);   /* a rank of 2 of nemotron-3-super-120b-a12b */
    test_fused_norm(320, 7);      /* four elements a thread at most: two blocks an SM */
    test_fused_norm(4104, 3);     /* eight */
    test_fused_norm(4096, 1);
    test_fused_norm(2696, 100);   /* a prompt's rows: blocks of 256 threads, twelve elements a thread */
    test_fused_norm(4000, 70);    /* sixteen */
    test_fused_norm(4104, 65);    /* past 4096: 1024 threads */
    for (int fmt : {DT_BF16, DT_F32, DT_FP8, DT_NVFP4}) test_engine(fmt, 4, 5);
    test_engine(DT_BF16, 8, 9);     /* rounds of GEMV_TOKENS */
    test_engine(DT_BF16, 3, 2);     /* fewer tokens than the step may verify */
    test_engine(DT_NVFP4, 1, 2);
    test_sampling(1000, 0);
    test_sampling(131072, 0);
    test_sampling(131072, 1);
    test_sample_rows(1000, 5, 4, 0.0f, 1.0f);        /* greedy, the last 4 of 5 rows */
    test_sample_rows(131072, 9, 9, 0.8f, 0.95f);     /* a verify step of 8 drafts */
    test_sample_rows(50000, 12, 7, 1.3f, 1.0f);
    test_sample_rows(131072, 1, 1, 0.7f, 0.9f);
    time_gemv(18560, 4096);    /* nemotron-h-8b: in_proj */
    time_gemv(21504, 4096);    /* up */
    time_gemv(4096, 21504);    /* down */
    time_gemv(4096, 8192);     /* out_proj */
    time_gemv(6144, 4096);     /* qkv */
    time_gemv(4480, 15680);    /* nemotron-nano-9b-v2: down (at one warp a row, a second wave of 128 blocks) */
    time_gemv(131072, 4096);   /* lm_head */
    for (int fmt : {DT_FP8, DT_NVFP4}) {
        time_gemv(18560, 4096, fmt);   /* nemotron-h-8b: in_proj */
        time_gemv(4096, 21504, fmt);   /* down */
        time_gemv(10304, 2688, fmt);   /* nemotron-3-nano-30b-a3b: in_proj */
    }
    time_moe("nemotron-3-nano-30b-a3b", 128, 6, 1856, 3712, 2688, 0);
    time_moe("nemotron-3-nano-30b-a3b", 128, 6, 1856, 3712, 2688, 0, DT_BF16, DT_BF16, 4);
    time_moe("nemotron-3-super-120b-a12b", 512, 22, 2688, 5376, 4096, 1024, DT_NVFP4, DT_FP8, 4);
    time_moe("nemotron-3-super-120b-a12b", 512, 22, 2688, 5376, 4096, 1024, DT_NVFP4, DT_FP8, 8);
    for (int fmt : {DT_BF16, DT_FP8, DT_NVFP4}) {
        time_gemv_tokens(18560, 4096, fmt);   /* nemotron-h-8b: in_proj */
        time_gemv_tokens(4096, 21504, fmt);   /* down */
    }
    time_gemv_tokens(131072, 4096);           /* lm_head */
    time_gemv_tokens(4096, 8192);             /* nemotron-3-super's MTP eh_proj */
    time_moe("nemotron-3-nano-30b-a3b, a rank of 2", 128, 6, 928, 1856, 2688, 0);
    time_moe("nemotron-3-super-120b-a12b, a rank of 2", 512, 22, 1344, 2688, 4096, 1024);
    time_moe("nemotron-3-nano-30b-a3b", 128, 6, 1856, 3712, 2688, 0, DT_FP8, DT_FP8);
    time_moe("nemotron-3-nano-30b-a3b", 128, 6, 1856, 3712, 2688, 0, DT_NVFP4, DT_NVFP4);
    time_moe("nemotron-3-super-120b-a12b", 512, 22, 2688, 5376, 4096, 1024, DT_NVFP4, DT_FP8);
    time_moe("nemotron-3-super-120b-a12b", 512, 22, 2688, 5376, 4096, 1024, DT_FP8, DT_FP8);
    for (int fmt : {DT_BF16, DT_FP8, DT_NVFP4}) time_moe("nemotron-3-nano-30b-a3b", 128, 6, 1856, 3712, 2688, 0, fmt, fmt, 2048);
    time_moe("nemotron-3-super-120b-a12b", 512, 22, 2688, 5376, 4096, 1024, DT_NVFP4, DT_FP8, 2048);
    time_chain();
    time_sample(131072, 1);
    time_sample(131072, 0);
    time_scan(128, 64, 8, 128, 2048);   /* nemotron-h-8b */
    time_scan(64, 64, 8, 128, 2048);    /* nemotron-3-nano-30b-a3b: a block an SM */
    time_scan(128, 80, 8, 128, 2048);   /* nemotron-nano-9b-v2 */
    time_prompt_attention(32, 8, 128, 0, 2048);       /* nemotron-h-8b, a 2048-token prompt */
    time_prompt_attention(40, 8, 128, 30720, 2048);   /* nemotron-nano-9b-v2, the last chunk of 32768 */
    time_scan(128, 64, 8, 128, 1);
    time_scan(128, 64, 8, 128, 4);      /* a verify step of 3 drafts */
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

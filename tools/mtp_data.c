/* tools/mtp_data: the default model's hidden states for training its MTP block (tools/distill_mtp.py),
 * computed by nemoh's CPU engine over the Brown corpus (data/brown.json, tools/prep_brown.py).
 *
 *   cc -std=c11 -O3 -march=native -ffp-contract=fast -fopenmp -o build/mtp_data tools/mtp_data.c -lm -lpthread
 *   build/mtp_data weights data/brown.json train|held text OUT.bin
 *   build/mtp_data weights data/brown.json train|held greedy:P:COUNT OUT.bin
 *
 * The documents are split as tools/train_default.py splits them (held-out: index % 20 == 7), each
 * encoded by the model's tokenizer and followed by EOS (2), concatenated, and cut into windows of 512
 * tokens. `text`: every window of the split, each a forward from an empty state. `greedy:P:COUNT`:
 * COUNT windows spread over the split, each BOS and the window's first P - 1 tokens as a prompt and the
 * model's greedy continuation up to 512 tokens (what a drafting step is verified against).
 * OUT.bin: int32 [windows, 512, hidden], then per window int32 ids[512] and bf16 h[512][hidden], h_t the
 * model's output after norm_f at t (what feeds lm_head and the MTP block's hnorm). */
#define NEMOH_NO_MAIN
#include "../nemoh.c"

enum { W = 512 };

static uint16_t to_bf16(float f) {   /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + (u >> 16 & 1)) >> 16);
}

/* h rows 0..T-1 of the last forward, after norm_f, appended as bf16 */
static void take_h(Engine *e, int T, uint16_t *out) {
    const float *x = ((CpuState *)e->rank[0].st)->x;
    for (size_t i = 0; i < (size_t)T * (size_t)e->c.hidden; i++) out[i] = to_bf16(x[i]);
}

int main(int argc, char **argv) {
    if (argc != 6) die("usage: mtp_data WEIGHTS BROWN.json train|held text|greedy:P:COUNT OUT.bin");
    const char *dir = argv[1], *split = argv[3], *mode = argv[4];
    int held = !strcmp(split, "held");
    if (!held && strcmp(split, "train")) die("%s: expected train or held", split);
    int P = 0, count = 0;
    if (strcmp(mode, "text") && (sscanf(mode, "greedy:%d:%d", &P, &count) != 2 || P < 1 || P >= W || count < 1))
        die("%s: expected text or greedy:P:COUNT (0 < P < %d)", mode, W);

    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    Tokenizer *tok = tok_load(path);
    size_t len;
    char *text = read_file(argv[2], &len, (size_t)1 << 30);
    if (!text) die("%s: cannot open: %s", argv[2], strerror(errno));
    JsonDoc doc = json_parse(text, len, argv[2]);
    if (doc.nodes[0].type != J_ARR) die("%s: expected a list of documents", argv[2]);
    int *ids = NULL, n = 0;
    size_t cap = 0;
    int d = 0;
    for (const Json *j = doc.nodes[0].child; j; j = j->next, d++) {
        if ((d % 20 == 7) != held) continue;
        const Json *t = json_get(j, "text");
        if (!t || t->type != J_STR) die("%s: document %d has no text", argv[2], d);
        int m, *di = tok_encode(tok, t->str, (size_t)t->len, 0, &m);
        ids = tok_grow(ids, &cap, (size_t)n + (size_t)m + 1, sizeof *ids);
        memcpy(ids + n, di, (size_t)m * sizeof *ids);
        n += m;
        ids[n++] = 2;
        free(di);
    }
    fprintf(stderr, "%s: %s split, %d tokens, %d windows of %d\n", argv[2], split, n, n / W, W);

    Engine e = {0};
    config_load(&e.c, dir);
    Checkpoint ck;
    build_checkpoint(&ck, dir);
    cpu_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    build_engine(&e, &ck, &cpu_backend, 1, W, W, 1, 1, 0, 0);
    engine_snapshot(&e, 0, 1);   /* slot 0: the empty state, each window's start */
    int H = e.c.hidden, nw = P ? count : n / W;
    if (nw > n / W) die("greedy: %d windows asked, the split has %d", nw, n / W);
    FILE *f = fopen(argv[5], "wb");
    if (!f) die("%s: cannot open for writing", argv[5]);
    int32_t head[3] = {nw, W, H};
    int32_t *win = xmalloc(W * sizeof *win);
    uint16_t *h = xmalloc((size_t)W * (size_t)H * sizeof *h);
    double t0 = now_s();
    for (int i = 0; i < nw; i++) {
        engine_snapshot(&e, 0, 0);
        const int *src = ids + (size_t)(P ? (long)i * (n / W) / nw : i) * W;
        if (!P) {   /* the window's text in one forward */
            memcpy(win, src, W * sizeof *win);
            engine_forward(&e, win, W, 0, 0, 0);
            take_h(&e, W, h);
        } else {    /* BOS + P - 1 tokens, then the greedy continuation, a token a forward */
            win[0] = 1;
            memcpy(win + 1, src, (size_t)(P - 1) * sizeof *win);
            engine_forward(&e, win, P, 0, 0, 0);
            take_h(&e, P, h);
            for (int t = P; t < W; t++) {
                win[t] = engine_sample(&e, 0, 1, 0, 0);
                engine_forward(&e, win + t, 1, t, 0, 0);
                take_h(&e, 1, h + (size_t)t * H);
            }
        }
        if (i == 0 && fwrite(head, sizeof head, 1, f) != 1) die("%s: write failed", argv[5]);
        if (fwrite(win, sizeof *win, W, f) != W || fwrite(h, sizeof *h, (size_t)W * H, f) != (size_t)W * H)
            die("%s: write failed", argv[5]);
        if (i % 50 == 49) fprintf(stderr, "%d/%d windows, %.0f s\n", i + 1, nw, now_s() - t0);
    }
    if (fclose(f) != 0) die("%s: write failed", argv[5]);
    fprintf(stderr, "%s: %d windows in %.0f s\n", argv[5], nw, now_s() - t0);
    free(win), free(h), free(ids), free(text);
    json_free(&doc);
    free_engine(&e);
    free_checkpoint(&ck);
    tok_free(tok);
    return 0;
}

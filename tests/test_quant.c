/* test_quant: nemoh's dequantization of ModelOpt FP8 and NVFP4 matrices against the fixture
 * generator's own (tools/make_fixtures.py writes dequant.safetensors: every quantized weight as F32,
 * dequantized in Python from the bytes it stored). For each fixture directory given, each of those
 * matrices is loaded as nemoh loads it (load_mat: format from its tensors, scales checked, the
 * quantization config cross-checked) and every element of mat_at() must equal the generator's,
 * bit for bit (signed zeros included). Prints one line a fixture, then "N passed, M failed". */
#define NEMOH_NO_MAIN
#include "../nemoh.c"

int main(int argc, char **argv) {
    int pass = 0, fail = 0;
    for (int a = 1; a < argc; a++) {
        Checkpoint ck, ref;
        char path[4096];
        build_checkpoint(&ck, argv[a]);
        memset(&ref, 0, sizeof ref);
        ref.dir = argv[a];
        snprintf(path, sizeof path, "%s/dequant.safetensors", argv[a]);
        st_open(&ref, path);
        long mats = 0, elems = 0, bad = 0;
        int fmts = 0;
        for (int i = 0; i < ref.n; i++) {
            const Tensor *t = &ref.t[i];
            if (t->dtype != DT_F32 || t->ndim != 2) die("%s: tensor %s is not a 2-D F32 matrix", path, t->name);
            char mod[512];
            snprintf(mod, sizeof mod, "%.*s", (int)strlen(t->name) - 7, t->name);   /* less ".weight" */
            long rows = t->shape[0], cols = t->shape[1];
            Mat m = load_mat(&ck, mod, rows, cols, 0, rows, 0, cols, strcmp(mod, "backbone.embeddings") != 0);
            fmts |= 1 << m.dtype;
            for (long r = 0; r < rows; r++)
                for (long k = 0; k < cols; k++) {
                    float want, got = mat_at(&m, (size_t)r, (size_t)k);
                    memcpy(&want, (const char *)t->data + 4 * ((size_t)r * cols + k), 4);
                    if (memcmp(&got, &want, 4) && bad++ < 5)
                        printf("  %s[%ld][%ld]: nemoh %.9g, generator %.9g\n", t->name, r, k, got, want);
                    elems++;
                }
            mats++;
        }
        int ok = !bad && mats > 0 && (fmts & ~(1 << DT_FP8 | 1 << DT_NVFP4)) == 0;
        printf("%-7s %s: %ld quantized matrices (%s%s%s), %ld elements, %ld differ\n", ok ? "ok" : "FAILED", argv[a], mats,
               fmts & 1 << DT_FP8 ? "FP8" : "", fmts == (1 << DT_FP8 | 1 << DT_NVFP4) ? " + " : "", fmts & 1 << DT_NVFP4 ? "NVFP4" : "",
               elems, bad);
        ok ? pass++ : fail++;
        free_checkpoint(&ck);
        free_checkpoint(&ref);
    }
    printf("%d passed, %d failed\n", pass, fail);
    return fail != 0;
}

/* fuzz_safetensors: the safetensors header and tensor table. The input is the JSON header of a
 * file whose data section is 1 MiB of one byte; when its table is accepted, the tensors the model
 * does not read are checked and one rank's weight views are built from it (the shape checks
 * against the config). The input's size in 8-byte units, u = size / 8 (F32 data stays aligned when the
 * size is a multiple of 4), picks what it meets: u % 3 the config,
 *   0  tiny-bf16's (no quantization config: a quantized tensor is refused by the cross-check)
 *   1  tiny-q-nvfp4-moe's (NVFP4: U8 weights, F8_E4M3 block scales, per-expert tensors)
 *   2  tiny-q-fp8's (FP8: F8_E4M3 weights, F32 scales, k_scale / v_scale)
 * and the bits of u / 3:
 *   bit 0  the ranks: 1 (rank 0), or 2 (rank 1: views that start inside the tensors, the TP column
 *          check of NVFP4 blocks)
 *   bit 1  the quantized configs' quantization config: none, so that every format is taken from the
 *          tensors (Q_ANY); or the fixture's own (exclude lists), checked against the tensors
 *   bit 2  the data bytes: 0x00, or 0x7F (every NVFP4 block scale a NaN; F32 scales 3.4e38)
 * tests/fuzz/run.sh seeds each fixture header padded with 0, 8, .. 184 spaces: every one of these. */
#include "fuzz.h"

enum { DATA = 1 << 20, MAX = 32768 };
static Config cfg[3];
static QuantCfg quant[3];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    static const char *dir[3] = {"tests/fixtures/tiny-bf16", "tests/fixtures/tiny-q-nvfp4-moe", "tests/fixtures/tiny-q-fp8"};
    for (int k = 0; k < 3; k++) {
        char path[256];
        size_t n;
        snprintf(path, sizeof path, "%s/config.json", dir[k]);
        char *text = fuzz_fixture(path, &n);
        config_parse(&cfg[k], text, n, "config.json");
        free(text);
        quant_load(&quant[k], dir[k]);
        if ((quant[k].algo != 0) != (k > 0)) { fprintf(stderr, "%s: quantization config not as expected\n", dir[k]); exit(2); }
    }
    fuzz_keep();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char file[8 + MAX + DATA];
    if (size > MAX) return 0;
    int k = (int)(size / 8 % 3), f = (int)(size / 24), n = f & 1 ? 2 : 1;
    uint64_t hlen = size;
    memcpy(file, &hlen, 8);
    memcpy(file + 8, data, size);
    memset(file + 8 + size, f & 4 ? 0x7F : 0, DATA);
    static Checkpoint ck;
    static Weights w;
    FUZZ_BEGIN();
    memset(&ck, 0, sizeof ck);
    ck.dir = "model";
    if (k) {
        if (f & 2) ck.q = quant[k];   /* the harness's own: not freed with the checkpoint */
        else ck.q.algo = Q_ANY;
    }
    st_parse(&ck, "model.safetensors", file, 8 + size + DATA);
    st_sort(&ck);
    st_check_extra(&ck, &cfg[k]);
    Shard s;
    if (shard_sizes(&s, &cfg[k], n - 1, n)) abort();   /* every config splits in 2 */
    build_weights(&w, &ck, &cfg[k], &s);
    free_weights(&w, &cfg[k]);
    memset(&ck.q, 0, sizeof ck.q);
    free_checkpoint(&ck);
    return 0;
}

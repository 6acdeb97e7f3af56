/* fuzz_safetensors: the safetensors header and tensor table. The input is the JSON header of a
 * file whose data section is 1 MiB of zeros; when its table is accepted, the tensors the model does
 * not read are checked and rank 0's weight views of the tiny-bf16 fixture's config are built from it
 * (the shape checks against the config). */
#include "fuzz.h"

enum { DATA = 1 << 20 };
static Config cfg;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    size_t n;
    char *text = fuzz_fixture("tests/fixtures/tiny-bf16/config.json", &n);
    config_parse(&cfg, text, n, "config.json");
    free(text);
    fuzz_keep();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char file[8 + 16384 + DATA];
    if (size > 16384) return 0;
    uint64_t hlen = size;
    memcpy(file, &hlen, 8);
    memcpy(file + 8, data, size);
    memset(file + 8 + size, 0, DATA);
    static Checkpoint ck;
    static Weights w;
    FUZZ_BEGIN();
    memset(&ck, 0, sizeof ck);
    ck.dir = "model";
    st_parse(&ck, "model.safetensors", file, 8 + size + DATA);
    st_sort(&ck);
    st_check_extra(&ck, &cfg);
    Shard s;
    shard_sizes(&s, &cfg, 0, 1);
    build_weights(&w, &ck, &cfg, &s);
    free_weights(&w, &cfg);
    free_checkpoint(&ck);
    return 0;
}

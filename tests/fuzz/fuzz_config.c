/* fuzz_config: the JSON reader and config.json. The input is a config.json: parsed, validated,
 * and when accepted split over 1 to 8 ranks; every number in it read as an integer too. */
#include "fuzz.h"

static void ints(const Json *j) {
    int64_t v;
    for (; j; j = j->next) {
        if (json_int(j, -((int64_t)1 << 53), (int64_t)1 << 53, &v)) FUZZ_ASSERT(j->num == (double)v, "json_int changed the value");
        ints(j->child);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FUZZ_BEGIN();
    JsonDoc doc = json_parse((const char *)data, size, "input.json");
    ints(doc.nodes);
    json_free(&doc);
    Config c;
    config_parse(&c, (const char *)data, size, "config.json");
    for (int n = 1; n <= 8; n++) {
        Shard s;
        if (shard_sizes(&s, &c, n - 1, n)) continue;
        FUZZ_ASSERT(s.in_proj >= 0 && s.conv >= 0 && s.vocab > 0, "negative shard size");
    }
    return 0;
}

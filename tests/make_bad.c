/* make_bad: writes broken variants of a good single-file checkpoint, one directory per case, for the
 * bad-input tests in test.sh. Each directory gets a file `expect` holding a phrase nemoh's one-line
 * error must contain (and a file `at-run` when the error comes while generating, after nemoh's
 * "loaded" line). Every case differs from the good model in one thing only. A good model with
 * mixture-of-experts layers (n_routed_experts in its config) gets the MoE cases instead, and a
 * quantized one (ModelOpt: hf_quant_config.json or config.json's quantization_config) the quantized
 * cases: scales, block scales, the config's algorithm and exclude list against the tensors; one with
 * a multi-token prediction block (num_nextn_predict_layers 1), its tensors' and keys' cases.
 *   make_bad GOOD_DIR OUT_DIR        (GOOD_DIR: config.json + model.safetensors [+ hf_quant_config.json]) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "make_bad: %s: cannot open\n", path); exit(2); }
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    rewind(f);
    char *p = malloc(*n + 1);
    if (!p || fread(p, 1, *n, f) != *n) { fprintf(stderr, "make_bad: %s: read failed\n", path); exit(2); }
    p[*n] = 0;
    fclose(f);
    return p;
}

static void spit(const char *dir, const char *name, const void *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) { fprintf(stderr, "make_bad: %s: write failed\n", path); exit(2); }
}

/* text with the first occurrence of `from` replaced by `to` (which must exist) */
static char *replace(const char *text, const char *from, const char *to) {
    const char *at = strstr(text, from);
    if (!at) { fprintf(stderr, "make_bad: \"%s\" not found\n", from); exit(2); }
    char *out = malloc(strlen(text) + strlen(to) + 1);
    sprintf(out, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    return out;
}

static const char *out_root, *good_config;
static const char *header, *data;    /* the good safetensors header text and its data section */
static size_t data_len;

/* One case: a directory with a config, a safetensors file [u64 hlen][header][data] cut to `keep`
 * bytes (0: whole), and the phrase the error must contain. hdr == NULL: no safetensors file. */
static void emit_data(const char *name, const char *expect, const char *config, const char *hdr, uint64_t hlen_field,
                      size_t keep, const char *data, size_t data_len) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", out_root, name);
    mkdir(dir, 0755);
    spit(dir, "expect", expect, strlen(expect));
    if (config) spit(dir, "config.json", config, strlen(config));
    if (!hdr) return;
    size_t hl = (strlen(hdr) + 7) / 8 * 8, total = 8 + hl + data_len;  /* padded with spaces, as safetensors does */
    char *file = malloc(total);
    uint64_t h = hlen_field ? hlen_field : hl;
    memcpy(file, &h, 8);
    memset(file + 8, ' ', hl);
    memcpy(file + 8, hdr, strlen(hdr));
    memcpy(file + 8 + hl, data, data_len);
    spit(dir, "model.safetensors", file, keep ? keep : total);
    free(file);
}

static void emit(const char *name, const char *expect, const char *config, const char *hdr, uint64_t hlen_field, size_t keep) {
    emit_data(name, expect, config, hdr, hlen_field, keep, data, data_len);
}

/* The good model with element i of tensor `tensor` set to the float f (stored in its dtype), refused
 * while generating (at_run), or a model that runs. */
static void emit_value(const char *name, const char *expect, const char *tensor, size_t i, float f, int at_run) {
    char key[256];
    snprintf(key, sizeof key, "\"%s\":", tensor);
    const char *at = strstr(header, key), *dt = at ? strstr(at, "\"dtype\":\"") : NULL, *off = at ? strstr(at, "\"data_offsets\":[") : NULL;
    if (!at || !dt || !off) { fprintf(stderr, "make_bad: no tensor %s\n", tensor); exit(2); }
    unsigned long long b = strtoull(off + 16, NULL, 10);
    char *d = malloc(data_len);
    memcpy(d, data, data_len);
    uint32_t u;
    memcpy(&u, &f, 4);
    if (!strncmp(dt + 9, "F32", 3)) memcpy(d + b + 4 * i, &f, 4);
    else { uint16_t h = (uint16_t)(u >> 16); memcpy(d + b + 2 * i, &h, 2); }   /* BF16: NaN and Inf keep their kind */
    emit_data(name, expect, good_config, header, 0, 0, d, data_len);
    free(d);
    snprintf(key, sizeof key, "%s/%s", out_root, name);
    if (at_run) spit(key, "at-run", "", 0);   /* refused while generating: after the "loaded" line */
}

/* A file in a case's directory that is a link to `target` (/dev/zero: endless; ".": a directory). */
static void link_file(const char *name, const char *file, const char *target) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/%s", out_root, name, file);
    unlink(path);
    if (symlink(target, path) != 0) { fprintf(stderr, "make_bad: %s: symlink failed\n", path); exit(2); }
}

/* The good header with `extra` entries added before its first one. */
static char *with_entries(const char *extra) {
    char *h = malloc(strlen(header) + strlen(extra) + 1);
    sprintf(h, "{%s%s", extra, header + 1);
    return h;
}

/* The integer value of `"key": N` in the good config. */
static long config_int(const char *key) {
    char pat[128];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *at = strstr(good_config, pat);
    if (!at) { fprintf(stderr, "make_bad: %s not in the config\n", key); exit(2); }
    return strtol(at + strlen(pat), NULL, 10);
}

/* The good config with `"key": N` set to v. */
static char *config_set(const char *key, long v) {
    char from[128], to[128];
    snprintf(from, sizeof from, "\"%s\": %ld", key, config_int(key));
    snprintf(to, sizeof to, "\"%s\": %ld", key, v);
    return replace(good_config, from, to);
}

/* The header with the first tensor whose name ends in `suffix` one element shorter (shape and bytes). */
static char *shorten(const char *suffix) {
    char key[128];
    snprintf(key, sizeof key, "%s\":{\"dtype\":\"", suffix);
    const char *at = strstr(header, key);
    if (!at) { fprintf(stderr, "make_bad: no tensor ending in %s\n", suffix); exit(2); }
    int size = at[strlen(key)] == 'F' && at[strlen(key) + 1] == '3' ? 4 : 2;
    const char *sh = strstr(at, "\"shape\":["), *off = strstr(at, "\"data_offsets\":[");
    long n = strtol(sh + 9, NULL, 10);
    unsigned long long b = strtoull(off + 16, NULL, 10), e = strtoull(strchr(off + 16, ',') + 1, NULL, 10);
    char *out = malloc(strlen(header) + 64);
    snprintf(out, strlen(header) + 64, "%.*s\"shape\":[%ld],\"data_offsets\":[%llu,%llu]%s", (int)(sh - header), header, n - 1,
             b, e - size, strchr(off, ']') + 1);
    return out;
}

/* Broken variants of a good MoE model: the router, the experts, their count and shapes, the latent
 * projections. Written for one file of transformers' stacked experts or NVIDIA's one per expert. */
static void moe_cases(void) {
    long E = config_int("n_routed_experts");
    int stacked = strstr(header, "mixer.experts.up_proj\"") != NULL;
    char to[160];
    emit("good", "", good_config, header, 0, 0);  /* the control: must load */
    emit("moe-no-gate", "mixer.gate.weight not found", good_config, replace(header, "mixer.gate.weight\"", "mixer.gatf.weight\""), 0, 0);
    emit("moe-no-experts", "mixer.experts.0.up_proj.weight not found", good_config,
         replace(header, stacked ? "mixer.experts.up_proj\"" : "mixer.experts.0.up_proj.weight\"",
                 stacked ? "mixer.expertz.up_proj\"" : "mixer.expertz.0.up_proj.weight\""), 0, 0);
    snprintf(to, sizeof to, "mixer.experts.%ld.up_proj.weight\"", E);  /* the same bytes, named as one expert too many */
    emit("moe-extra-expert", "but n_routed_experts is", good_config,
         replace(header, stacked ? "mixer.experts.up_proj\"" : "mixer.experts.0.up_proj.weight\"", to), 0, 0);
    emit("moe-expert-shape", "config implies", config_set("moe_intermediate_size", config_int("moe_intermediate_size") + 4), header, 0, 0);
    emit("moe-top-k", "num_experts_per_tok", config_set("num_experts_per_tok", E + 1), header, 0, 0);
    emit("moe-n-group", "must divide n_routed_experts", config_set("n_group", E + 1), header, 0, 0);
    emit("moe-experts-limit", "more than nemoh's limit", config_set("n_routed_experts", 1L << 20), header, 0, 0);
    emit("moe-bias-length", "e_score_correction_bias has shape", good_config, shorten("mixer.gate.e_score_correction_bias"), 0, 0);
    if (strstr(header, "fc1_latent_proj.weight\""))
        emit("moe-no-latent-proj", "fc1_latent_proj.weight not found", good_config,
             replace(header, "fc1_latent_proj.weight\"", "fc1_latent_prox.weight\""), 0, 0);
}

/* Broken variants of a good model with a multi-token prediction block: its tensors (which --mtp 0
 * does not read) and its config keys. */
static void mtp_cases(void) {
    int list = strstr(good_config, "\"mtp_layers_block_type\": [") != NULL;
    emit("good", "", good_config, header, 0, 0);  /* the control: must load */
    /* a block whose logits are NaN (its final norm's weight) runs: it drafts nothing */
    emit_value("good-nan-mtp", "", "mtp.layers.1.final_layernorm.weight", 0, NAN, 0);
    emit("mtp-no-eh-proj", "mtp.layers.0.eh_proj.weight not found", good_config,
         replace(header, "mtp.layers.0.eh_proj.weight\"", "mtp.layers.0.eh_prox.weight\""), 0, 0);
    emit("mtp-no-final-norm", "final_layernorm.weight not found", good_config, replace(header, "final_layernorm.weight\"", "final_layernorx.weight\""), 0, 0);
    emit("mtp-enorm-length", "mtp.layers.0.enorm.weight has shape", good_config, shorten("mtp.layers.0.enorm.weight"), 0, 0);
    emit("mtp-no-attention", "mtp.layers.0.mixer.q_proj.weight not found", good_config,
         replace(header, "mtp.layers.0.mixer.q_proj.weight\"", "mtp.layers.0.mixer.q_prox.weight\""), 0, 0);
    emit("mtp-mamba", "the MTP block has a Mamba sublayer", list ? replace(good_config, "\"mtp_layers_block_type\": [", "\"mtp_layers_block_type\": [\"mamba\",")
                                                                   : replace(good_config, "\"mtp_hybrid_override_pattern\": \"", "\"mtp_hybrid_override_pattern\": \"M"), header, 0, 0);
    emit("mtp-two-blocks", "nemoh runs one MTP block", config_set("num_nextn_predict_layers", 2), header, 0, 0);
    emit("mtp-unknown-kind", "unknown block type", list ? replace(good_config, "\"mtp_layers_block_type\": [", "\"mtp_layers_block_type\": [\"ssm\",")
                                                        : replace(good_config, "\"mtp_hybrid_override_pattern\": \"", "\"mtp_hybrid_override_pattern\": \"X"), header, 0, 0);
}

/* ---- Quantized checkpoints (ModelOpt FP8 and NVFP4): a good model with hf_quant_config.json or a
 * quantization_config in config.json gets these cases instead. Each names one projection's tensors. */

static const char *good_hq;   /* the good model's hf_quant_config.json, or NULL */
static char *qdata;           /* a case's data section: the good one, with tensors appended */
static size_t qlen;

/* A quantized case: config.json, hf_quant_config.json (NULL: none), the header and qdata. */
static void emit_q(const char *name, const char *expect, const char *config, const char *hq, const char *hdr) {
    char dir[4096];
    emit_data(name, expect, config, hdr, 0, 0, qdata, qlen);
    snprintf(dir, sizeof dir, "%s/%s", out_root, name);
    if (hq) spit(dir, "hf_quant_config.json", hq, strlen(hq));
}

/* qdata back to the good data section. */
static void qreset(void) {
    free(qdata);
    qdata = malloc(data_len);
    memcpy(qdata, data, data_len);
    qlen = data_len;
}

/* n bytes of `fill` appended to qdata, 8-aligned; their offset. */
static size_t qappend(size_t n, int fill) {
    size_t at = (qlen + 7) / 8 * 8;
    qdata = realloc(qdata, at + n);
    memset(qdata + qlen, 0, at - qlen);
    memset(qdata + at, fill, n);
    qlen = at + n;
    return at;
}

/* The header entry {...} of tensor `name` in hdr: its start and end (the '{' and past the '}'). */
static const char *entry(const char *hdr, const char *name, const char **end) {
    char key[512];
    snprintf(key, sizeof key, "\"%s\":{", name);
    const char *at = strstr(hdr, key);
    if (!at) { fprintf(stderr, "make_bad: no tensor %s\n", name); exit(2); }
    at += strlen(key) - 1;
    *end = strchr(at, '}') + 1;
    return at;
}

/* The data offset of tensor `name` in the good header. */
static size_t tensor_offset(const char *name) {
    const char *end, *at = entry(header, name, &end);
    return (size_t)strtoull(strstr(at, "\"data_offsets\":[") + 16, NULL, 10);
}

/* hdr with tensor `name` given a new dtype, shape ("8,48") and bytes [b, e) of the data section. */
static char *retensor(const char *hdr, const char *name, const char *dtype, const char *shape, size_t b, size_t e) {
    const char *end, *at = entry(hdr, name, &end);
    char *out = malloc(strlen(hdr) + 256);
    sprintf(out, "%.*s{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[%zu,%zu]}%s", (int)(at - hdr), hdr, dtype, shape, b, e, end);
    return out;
}

/* hdr with one more tensor entry (appended data of n bytes of `fill`, in qdata). */
static char *add_tensor(const char *hdr, const char *name, const char *dtype, const char *shape, size_t n, int fill) {
    size_t b = qappend(n, fill);
    char *e = malloc(strlen(name) + 256);
    sprintf(e, "\"%s\":{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[%zu,%zu]},", name, dtype, shape, b, b + n);
    char *out = malloc(strlen(hdr) + strlen(e) + 1);
    sprintf(out, "{%s%s", e, hdr + 1);
    free(e);
    return out;
}

/* The good model with the F32 scale `tensor` set to f. */
static void emit_scale(const char *name, const char *expect, const char *tensor, float f) {
    qreset();
    memcpy(qdata + tensor_offset(tensor), &f, 4);
    emit_q(name, expect, good_config, good_hq, header);
}

/* The good model with byte i of tensor `tensor` set to v. */
static void emit_byte(const char *name, const char *expect, const char *tensor, size_t i, int v) {
    qreset();
    qdata[tensor_offset(tensor) + i] = (char)v;
    emit_q(name, expect, good_config, good_hq, header);
}

static void quant_cases(void) {
    const char *M = "backbone.layers.0.mixer.in_proj";   /* a quantized Mamba in_proj in both fixtures */
    char t[256], t2[256], msg[1024];
    int nvfp4 = strstr(header, "\"backbone.layers.0.mixer.in_proj.weight\":{\"dtype\":\"U8\"") != NULL;
    qreset();
    emit_q("good", "", good_config, good_hq, header);   /* the control: must load */
    if (nvfp4) {   /* in_proj: U8 [200, 24], weight_scale F8_E4M3 [200, 3], weight_scale_2 F32 [] */
        snprintf(t, sizeof t, "%s.weight_scale", M);
        snprintf(msg, sizeof msg, "%s: block scale [5, 1] is 0x7F, a NaN", t);
        emit_byte("q-block-scale-7f", msg, t, 5 * 3 + 1, 0x7F);
        snprintf(msg, sizeof msg, "%s: block scale [199, 2] is 0xFF, a NaN", t);
        emit_byte("q-block-scale-ff", msg, t, 199 * 3 + 2, 0xFF);
        size_t b = tensor_offset(t);
        qreset();
        snprintf(msg, sizeof msg, "%s has shape [3,200], config implies [200,3]", t);
        emit_q("q-block-scale-shape", msg, good_config, good_hq, retensor(header, t, "F8_E4M3", "3,200", b, b + 600));
        snprintf(msg, sizeof msg, "%s has dtype U8; NVFP4 block scales are F8_E4M3", t);   /* MXFP8-like: E8M0 bytes */
        emit_q("q-block-scale-u8", msg, good_config, good_hq, retensor(header, t, "U8", "200,3", b, b + 600));
        snprintf(msg, sizeof msg, "%s.weight is U8 but %s.weight_scale is missing", M, M);
        emit_q("q-no-block-scale", msg, good_config, good_hq, replace(header, "in_proj.weight_scale\"", "in_proj.weight_scalx\""));
        snprintf(msg, sizeof msg, "%s.weight is U8 (NVFP4) but %s.weight_scale_2 is missing", M, M);
        emit_q("q-no-scale-2", msg, good_config, good_hq, replace(header, "in_proj.weight_scale_2\"", "in_proj.weight_scale_x\""));
        snprintf(t2, sizeof t2, "%s.weight_scale_2", M);
        snprintf(msg, sizeof msg, "%s is nan, not a finite scale >= 0", t2);
        emit_scale("q-scale-2-nan", msg, t2, NAN);
        snprintf(msg, sizeof msg, "%s is -0.5, not a finite scale >= 0", t2);
        emit_scale("q-scale-2-negative", msg, t2, -0.5f);
        qreset();
        b = qappend(200 * 4, 0x3F);   /* one scale per row (about 0.75 each) */
        snprintf(msg, sizeof msg, "%s must be one F32 value (shape [] or [1])", t2);
        emit_q("q-scale-2-per-channel", msg, good_config, good_hq, retensor(header, t2, "F32", "200", b, b + 800));
        qreset();
        snprintf(t, sizeof t, "%s.pre_quant_scale", M);   /* AWQ: a per-input-channel scale beside the weight */
        snprintf(msg, sizeof msg, "%s: AWQ's pre-quantization scales are not supported", t);
        emit_q("q-pre-quant-scale", msg, good_config, good_hq, add_tensor(header, t, "F32", "48", 48 * 4, 0x3F));
        /* a router stored F8_E4M3 (the BF16 bytes' first half): routers are never quantized */
        const char *g = "backbone.layers.1.mixer.gate.weight";
        qreset();
        b = tensor_offset(g);
        snprintf(msg, sizeof msg, "%s has dtype F8_E4M3; nemoh reads it as F32, BF16 or F16", g);
        emit_q("q-router-fp8", msg, good_config, good_hq, retensor(header, g, "F8_E4M3", "8,48", b, b + 8 * 48));
        /* the shared experts 40 wide (layer 1's up_proj rewritten [40, 48] NVFP4): down_proj's rows
           of 40 elements cannot be cut into blocks of 16 */
        qreset();
        const char *su = "backbone.layers.1.mixer.shared_experts.up_proj";
        snprintf(t, sizeof t, "%s.weight", su);
        size_t wb = qappend(40 * 24, 0x22);
        char *h = retensor(header, t, "U8", "40,24", wb, wb + 40 * 24);
        snprintf(t, sizeof t, "%s.weight_scale", su);
        size_t sb = qappend(40 * 3, 0x38);   /* e4m3 1.0 */
        h = retensor(h, t, "F8_E4M3", "40,3", sb, sb + 40 * 3);
        emit_q("q-k-not-16", "backbone.layers.1.mixer.shared_experts.down_proj.weight is NVFP4, in blocks of 16, but its rows have 40 elements",
               config_set("moe_shared_expert_intermediate_size", 40), good_hq, h);
    } else {   /* FP8 in_proj: F8_E4M3 [200, 64], weight_scale F32 [], input_scale F32 [] */
        snprintf(t, sizeof t, "%s.weight_scale", M);
        snprintf(msg, sizeof msg, "%s.weight is F8_E4M3 but %s.weight_scale is missing", M, M);
        qreset();
        emit_q("q-no-weight-scale", msg, good_config, good_hq, replace(header, "in_proj.weight_scale\"", "in_proj.weight_scalx\""));
        size_t b = qappend(200 * 4, 0x3C);   /* one scale per output channel: FP8_PER_CHANNEL_PER_TOKEN's */
        snprintf(msg, sizeof msg, "%s must be one F32 value (shape [] or [1])", t);
        emit_q("q-per-channel-scale", msg, good_config, good_hq, retensor(header, t, "F32", "200", b, b + 800));
        snprintf(msg, sizeof msg, "%s is nan, not a finite scale >= 0", t);
        emit_scale("q-scale-nan", msg, t, NAN);
        snprintf(msg, sizeof msg, "%s is -0.25, not a finite scale >= 0", t);
        emit_scale("q-scale-negative", msg, t, -0.25f);
        snprintf(msg, sizeof msg, "%s is 1e+38, past the largest scale nemoh takes (below 2^120)", t);
        emit_scale("q-scale-huge", msg, t, 1e38f);
        snprintf(t, sizeof t, "%s.input_scale", M);
        snprintf(msg, sizeof msg, "%s is inf, not a finite scale >= 0", t);
        emit_scale("q-input-scale-inf", msg, t, INFINITY);
        snprintf(t, sizeof t, "backbone.layers.3.mixer.k_proj.k_scale");
        snprintf(msg, sizeof msg, "%s is -1, not a finite scale >= 0", t);
        emit_scale("q-k-scale-negative", msg, t, -1.0f);
        qreset();
        snprintf(t, sizeof t, "%s.weight_scale_2", M);
        snprintf(msg, sizeof msg, "%s: an FP8 weight with a weight_scale_2 is not per-tensor FP8", t);
        emit_q("q-fp8-scale-2", msg, good_config, good_hq, add_tensor(header, t, "F32", "", 4, 0x3F));
    }

    /* the quantization config: hf_quant_config.json's "quantization" object, config.json's quantization_config */
    const char *algo = nvfp4 ? "\"quant_algo\": \"NVFP4\"" : "\"quant_algo\": \"FP8\"";
    qreset();
    if (good_hq) {
        const char *other = nvfp4 ? "NVFP4_AWQ" : "FP8_PER_CHANNEL_PER_TOKEN";
        char to[96];
        snprintf(to, sizeof to, "\"quant_algo\": \"%s\"", other);
        snprintf(msg, sizeof msg, "hf_quant_config.json: quant_algo \"%s\" is not supported", other);
        emit_q("q-hf-algo-unknown", msg, good_config, replace(good_hq, algo, to), header);
        emit_q("q-hf-mixed-no-layers", "hf_quant_config.json: MIXED_PRECISION needs a quantized_layers object", good_config,
               replace(good_hq, algo, "\"quant_algo\": \"MIXED_PRECISION\""), header);
        if (!strstr(good_config, "\"quantization_config\"")) {   /* then the tensors stand without any config */
            snprintf(msg, sizeof msg, "%s.weight is %s but the checkpoint has no quantization config", M, nvfp4 ? "U8" : "F8_E4M3");
            emit_q("q-no-quant-config", msg, good_config, NULL, header);
        } else   /* config.json's quantization_config alone: accepted */
            emit_q("good-config-json-only", "", good_config, NULL, header);
        /* the exclude list: lm_head (BF16) quantized by omission; a quantized module excluded */
        char *hq = replace(good_hq, strstr(good_hq, ",\n      \"lm_head\"") ? ",\n      \"lm_head\"" : "\n      \"lm_head\",", "");
        char *cfg = strstr(good_config, "\"ignore\"") ? replace(good_config, "\n      \"lm_head\",", "") : (char *)good_config;
        snprintf(msg, sizeof msg, "hf_quant_config.json makes lm_head %s", nvfp4 ? "NVFP4" : "FP8");
        emit_q("q-bf16-called-quantized", msg, cfg, hq, header);
        snprintf(t, sizeof t, "\"exclude_modules\": [\n      \"%s\",", M);
        snprintf(msg, sizeof msg, "hf_quant_config.json makes %s unquantized", M);
        emit_q("q-quantized-excluded", msg, good_config, replace(good_hq, "\"exclude_modules\": [", t), header);
        if (nvfp4) emit_q("q-group-32", "hf_quant_config.json: group_size must be 16 for NVFP4", good_config,
                          replace(good_hq, "\"group_size\": 16", "\"group_size\": 32"), header);
    }
    if (strstr(good_config, "\"quantization_config\"")) {
        emit_q("q-config-algo-unknown", "config.json: quant_algo \"W8A8_SQ_PER_CHANNEL\" is not supported",
               replace(good_config, algo, "\"quant_algo\": \"W8A8_SQ_PER_CHANNEL\""), good_hq, header);
        emit_q("q-method-compressed-tensors", "quantization_config's quant_method \"compressed-tensors\" is not supported",
               replace(good_config, "\"quant_method\": \"modelopt\"", "\"quant_method\": \"compressed-tensors\""), good_hq, header);
        emit_q("q-method-gptq", "quantization_config's quant_method \"gptq\" is not supported",
               replace(good_config, "\"quant_method\": \"modelopt\"", "\"quant_method\": \"gptq\""), good_hq, header);
        if (good_hq)
            emit_q("q-configs-disagree", "config.json: quantization_config's quant_algo disagrees with",
                   replace(good_config, algo, nvfp4 ? "\"quant_algo\": \"FP8\"" : "\"quant_algo\": \"NVFP4\""), good_hq, header);
    }
}

/* The data_offsets numbers of the k-th tensor in the header. */
static void offsets(int k, unsigned long long *b, unsigned long long *e) {
    const char *p = header;
    for (int i = 0; i <= k; i++) {
        p = strstr(p, "\"data_offsets\":[");
        if (!p) { fprintf(stderr, "make_bad: no tensor %d\n", k); exit(2); }
        p += 16;
    }
    *b = strtoull(p, (char **)&p, 10);
    *e = strtoull(p + 1, NULL, 10);
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: make_bad GOOD_DIR OUT_DIR\n"); return 2; }
    char path[4096];
    size_t n;
    out_root = argv[2];
    mkdir(out_root, 0755);
    snprintf(path, sizeof path, "%s/config.json", argv[1]);
    good_config = slurp(path, &n);
    snprintf(path, sizeof path, "%s/model.safetensors", argv[1]);
    char *st = slurp(path, &n);
    uint64_t hl;
    memcpy(&hl, st, 8);
    char *h = malloc(hl + 1);
    memcpy(h, st + 8, hl);
    h[hl] = 0;
    header = h;
    data = st + 8 + hl;
    data_len = n - 8 - hl;

    snprintf(path, sizeof path, "%s/hf_quant_config.json", argv[1]);
    if (access(path, R_OK) == 0) good_hq = slurp(path, &n);
    if (good_hq || strstr(good_config, "\"quantization_config\"")) {
        quant_cases();
        return 0;
    }
    if (strstr(good_config, "\"num_nextn_predict_layers\": 1")) {
        mtp_cases();
        return 0;
    }
    if (strstr(good_config, "\"n_routed_experts\"")) {
        moe_cases();
        return 0;
    }
    emit("good", "", good_config, header, 0, 0);  /* the control: must load */
    /* accepted too: older NVIDIA checkpoints name the embedding backbone.embedding.weight */
    emit("good-embedding-name", "", good_config, replace(header, "\"backbone.embeddings.weight\"", "\"backbone.embedding.weight\""), 0, 0);
    emit("no-safetensors", "no model.safetensors", good_config, NULL, 0, 0);
    emit("no-config", "config.json: cannot open", NULL, header, 0, 0);
    emit("missing-key", "missing key hidden_size", replace(good_config, "\"hidden_size\"", "\"hidden_size_x\""), header, 0, 0);
    emit("unknown-block", "unknown block type", replace(good_config, "\"-M-M*", "\"-M-X*"), header, 0, 0);
    emit("moe-keys", "missing key n_routed_experts", replace(good_config, "\"-M-M*", "\"-M-E*"), header, 0, 0);
    emit("bad-config-json", "malformed JSON", replace(good_config, "\"hidden_size\":", "\"hidden_size\" "), header, 0, 0);
    emit("shape", "config implies", replace(good_config, "\"hidden_size\": 80", "\"hidden_size\": 88"), header, 0, 0);
    emit("truncated", "outside the file", good_config, header, 0, 8 + strlen(header) + data_len / 2);
    emit("short-file", "shorter than the 8-byte header length", good_config, header, 0, 5);
    emit("header-length", "exceeds the file size", good_config, header, 1ull << 40, 0);
    emit("bad-header-json", "malformed JSON", good_config, replace(header, "\"dtype\":", "\"dtype\" "), 0, 0);
    emit("unknown-dtype", "has dtype F8_E5M2", good_config, replace(header, "\"dtype\":\"BF16\"", "\"dtype\":\"F8_E5M2\""), 0, 0);
    emit("dtype-size", "bytes for", good_config, replace(header, "\"dtype\":\"BF16\"", "\"dtype\":\"F32\""), 0, 0);

    unsigned long long b0, e0, b1, e1;
    offsets(0, &b0, &e0);
    offsets(1, &b1, &e1);
    char from[96], to[96];
    snprintf(from, sizeof from, "\"data_offsets\":[%llu,%llu]", b0, e0);
    snprintf(to, sizeof to, "\"data_offsets\":[%llu,%llu]", b0 + (unsigned long long)data_len, e0 + (unsigned long long)data_len);
    emit("offsets-outside", "outside the file", good_config, replace(header, from, to), 0, 0);
    /* the second tensor moved onto the first: same size, overlapping bytes */
    snprintf(from, sizeof from, "\"data_offsets\":[%llu,%llu]", b1, e1);
    snprintf(to, sizeof to, "\"data_offsets\":[%llu,%llu]", b0, b0 + (e1 - b1));
    emit("overlap", "overlap", good_config, replace(header, from, to), 0, 0);

    /* config values that are not what they claim: sizes whose products wrap an int, ids and
     * booleans of the wrong type or out of range, numbers JSON does not have */
    emit("head-dim-wrap", "more than nemoh's limit", replace(good_config, "\"attention_head_dim\": 20", "\"attention_head_dim\": 536870913"), header, 0, 0);
    emit("mamba-size-wrap", "more than nemoh's limit", replace(replace(good_config, "\"mamba_num_heads\": 6", "\"mamba_num_heads\": 65536"),
                                                              "\"mamba_head_dim\": 10", "\"mamba_head_dim\": 65536"), header, 0, 0);
    emit("eos-1e122", "eos_token_id must be a token id", replace(good_config, "\"eos_token_id\": 2", "\"eos_token_id\": 1e122"), header, 0, 0);
    emit("eos-1e309", "eos_token_id must be a token id", replace(good_config, "\"eos_token_id\": 2", "\"eos_token_id\": 1e309"), header, 0, 0);
    emit("eos-fraction", "eos_token_id must be a token id", replace(good_config, "\"eos_token_id\": 2", "\"eos_token_id\": 2.9"), header, 0, 0);
    emit("eos-string", "eos_token_id must be a token id", replace(good_config, "\"eos_token_id\": 2", "\"eos_token_id\": \"2\""), header, 0, 0);
    emit("eos-negative-in-list", "eos_token_id must be a token id", replace(good_config, "\"eos_token_id\": 2", "\"eos_token_id\": [2, -1]"), header, 0, 0);
    emit("conv-bias-string", "use_conv_bias must be true or false", replace(good_config, "\"use_conv_bias\": true", "\"use_conv_bias\": \"true\""), header, 0, 0);
    emit("bias-string", "attention_bias must be true or false", replace(good_config, "\"attention_bias\": false", "\"attention_bias\": \"false\""), header, 0, 0);
    emit("hex-number", "malformed JSON", replace(good_config, "\"hidden_size\": 80", "\"hidden_size\": 0x50"), header, 0, 0);
    emit("minus-nan", "malformed JSON", replace(good_config, "\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": -nan"), header, 0, 0);
    emit("minus-inf", "malformed JSON", replace(good_config, "\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": -inf"), header, 0, 0);
    emit("eps-underflow", "norm epsilon must be a number", replace(good_config, "\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": 1e-50"), header, 0, 0);
    emit("config-endless", "config.json: larger than", NULL, header, 0, 0);
    link_file("config-endless", "config.json", "/dev/zero");
    emit("config-directory", "config.json: is a directory", NULL, header, 0, 0);
    link_file("config-directory", "config.json", ".");
    emit("index-endless", "model.safetensors.index.json: larger than", good_config, header, 0, 0);
    link_file("index-endless", "model.safetensors.index.json", "/dev/zero");

    /* the header: a value count that would cost gigabytes, a forged line in a tensor name, a
     * name given twice, a header length past the format's limit */
    size_t nz = 4300000;
    char *zeros = malloc(2 * nz + 64), *z = zeros + sprintf(zeros, "\"__metadata__\":{\"x\":[");
    for (size_t i = 0; i < nz; i++) *z++ = '0', *z++ = ',';
    strcpy(z - 1, "]},");
    emit("many-values", "more than 4194304 values", good_config, with_entries(zeros), 0, 0);
    free(zeros);
    emit("forged-line", "has dtype F8_E5M2", good_config,
         with_entries("\"evil\\nnemoh: all good, loaded\\u001b[2J\":{\"dtype\":\"F8_E5M2\",\"shape\":[0],\"data_offsets\":[0,0]},"), 0, 0);
    emit("duplicate-name", "appears twice", good_config,
         with_entries("\"backbone.norm_f.weight\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"), 0, 0);
    emit("no-tensors", "tensor embeddings.weight not found", good_config, "{\"__metadata__\":{\"format\":\"pt\"}}", 0, 0);
    emit("header-over-100mb", "more than the format's 100 MB", good_config, header, 150000000, 0);
    snprintf(path, sizeof path, "%s/header-over-100mb/model.safetensors", out_root);
    if (truncate(path, 8 + 150000000 + 16) != 0) { fprintf(stderr, "make_bad: truncate failed\n"); exit(2); }

    /* accepted: 100000 empty tensors at offset [0, 0] besides the model's, all named in an index */
    size_t ne = 100000;
    char *many = malloc(ne * 80), *m = many, *idx = malloc(ne * 60 + strlen(header) * 2), *x = idx;
    x += sprintf(x, "{\"weight_map\":{");
    for (size_t i = 0; i < ne; i++) {
        m += sprintf(m, "\"empty.%zu\":{\"dtype\":\"F32\",\"shape\":[0,%zu],\"data_offsets\":[0,0]},", i, i);
        x += sprintf(x, "\"empty.%zu\":\"model.safetensors\",", i);
    }
    for (const char *k = strstr(header, "\"backbone."); k; k = strstr(k + 1, "\"backbone."))
        if (k[-1] == '{' || k[-1] == ',') x += sprintf(x, "%.*s\"model.safetensors\",", (int)(strchr(k + 1, '"') - k + 2), k);
    for (const char *k = strstr(header, "\"lm_head."); k; k = NULL) x += sprintf(x, "%.*s\"model.safetensors\",", (int)(strchr(k + 1, '"') - k + 2), k);
    strcpy(x - 1, "}}");
    emit("good-many-empty", "", good_config, with_entries(many), 0, 0);
    snprintf(path, sizeof path, "%s/good-many-empty", out_root);
    spit(path, "model.safetensors.index.json", idx, strlen(idx));
    free(many);
    free(idx);

    /* weights that are not finite: generation stops naming where they first show */
    emit_value("nan-layer-1", "layer 1 (mamba) is the first whose output is not finite", "backbone.layers.1.mixer.out_proj.weight", 0, NAN, 1);
    emit_value("inf-layer-4", "layer 4 (attention) is the first whose output is not finite", "backbone.layers.4.mixer.o_proj.weight", 3, INFINITY, 1);
    emit_value("inf-embedding", "the embedding of a prompt token is not finite", "backbone.embeddings.weight", 80 + 7, -INFINITY, 1);
    emit_value("nan-lm-head", "the final norm or lm_head", "lm_head.weight", 80 * 5, NAN, 1);
    return 0;
}

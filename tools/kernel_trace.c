/* kernel_trace: a CUPTI injection library that writes every kernel and memory copy the process runs on
 * the GPU, with its start and end times, to the file in $KERNEL_TRACE (one line each:
 * "K start_ns end_ns gridX gridY gridZ name" or "C start_ns end_ns kind bytes"). It keeps kernels
 * concurrent (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) and sees kernels inside CUDA graphs, so it shows
 * where a decode step's time goes; tools/kernel_trace.py adds the records up per kernel. Build and use:
 *   cc -shared -fPIC -O2 -I$CUDA/include tools/kernel_trace.c -o kernel_trace.so -L$CUDA/lib64 -lcupti
 *   CUDA_INJECTION64_PATH=$PWD/kernel_trace.so KERNEL_TRACE=trace.txt ./nemoh --random nemotron-h-8b --bench */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;

#define CUPTI_CHECK(call) do { CUptiResult r_ = (call); if (r_ != CUPTI_SUCCESS) { const char *s_; \
    cuptiGetResultString(r_, &s_); fprintf(stderr, "kernel_trace: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, s_); exit(1); } } while (0)

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = 16 << 20;
    *buf = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
    (void)ctx; (void)stream; (void)size;
    CUpti_Activity *rec = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
            fprintf(out, "K %llu %llu %d %d %d %s\n", (unsigned long long)k->start, (unsigned long long)k->end, k->gridX,
                    k->gridY, k->gridZ, k->name);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)rec;
            fprintf(out, "C %llu %llu %d %llu\n", (unsigned long long)m->start, (unsigned long long)m->end, m->copyKind,
                    (unsigned long long)m->bytes);
        }
    }
    free(buf);
}

static void finish(void) {
    cuptiActivityFlushAll(1);
    fclose(out);
}

int InitializeInjection(void) {
    const char *path = getenv("KERNEL_TRACE");
    if (!path || !(out = fopen(path, "w"))) { fprintf(stderr, "kernel_trace: set KERNEL_TRACE to a writable file\n"); exit(1); }
    CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
    CUPTI_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    atexit(finish);
    return 1;
}

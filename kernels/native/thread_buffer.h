/* A buffer per thread that grows and never shrinks: the kernels' scratch (quantized rows of x,
 * unpacked weight panels). Allocated fresh on every call, a prefill chunk's worth would be an
 * mmap that page-faults each time. Each user keeps its own `static __thread thread_buffer`. */
#ifndef PAGEDSERVE_THREAD_BUFFER_H
#define PAGEDSERVE_THREAD_BUFFER_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    void *data;
    int64_t capacity;
} thread_buffer;

/* At least `bytes` of 64-byte aligned memory (its contents not kept), or NULL without memory */
static inline void *thread_buffer_get(thread_buffer *b, int64_t bytes) {
    if (bytes > b->capacity) {
        free(b->data);
        b->data = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        b->capacity = b->data ? bytes : 0;
    }
    return b->data;
}

#endif

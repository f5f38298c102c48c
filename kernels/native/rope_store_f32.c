/* RoPE and the KV cache store of one layer, fused, for fp32 CPU workers.
 *
 * From the fused q|k|v projection [T, (Hq + 2 Hkv) * D] it writes the rotated queries to q_out
 * [T, Hq, D] and, for every token whose slot is >= 0, the rotated key and the value into the
 * cache slot (fp32, or bf16 rounded to nearest even like torch's .to(bfloat16)). Neox-style
 * rotation (halves): out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, with cos/sin rows [T, D/2].
 * It replaces four torch ops for the rotation and the slot scatter (checks, masks, two
 * index_copy_) per layer: the decode step's per-layer overhead, not bandwidth, is what it saves.
 */
#include <stdint.h>
#include <string.h>

#include "paged_attention.h"

typedef struct {
    const float *qkv, *cos, *sin;
    float *q_out;
    char *k_cache, *v_cache;
    const int64_t *slots;
    int64_t ldqkv, ldcs, num_slots, stride_blk, stride_tok, stride_head, tokens_per_task, T;
    int nq, nkv, D, block_size, fmt;
} rope_store_job;

static inline uint16_t to_bf16(float x) {
    union { float f; uint32_t u; } v = {x};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);  /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* dst[0..D) = rope(x) (fp32) */
static inline void rotate(const float *x, const float *c, const float *s, int half, float *dst) {
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        dst[i] = x1 * c[i] - x2 * s[i];
        dst[i + half] = x2 * c[i] + x1 * s[i];
    }
}

static inline void store_row(const float *src, int D, int fmt, char *dst) {
    if (fmt == 0) {
        memcpy(dst, src, sizeof(float) * D);
    } else {
        uint16_t *out = (uint16_t *)dst;
        for (int i = 0; i < D; i++) out[i] = to_bf16(src[i]);
    }
}

static void rope_store_task(void *ctx, int64_t task) {
    rope_store_job *job = ctx;
    const int D = job->D, half = D / 2, esize = job->fmt == 0 ? 4 : 2;
    const int64_t first = task * job->tokens_per_task;
    const int64_t last = first + job->tokens_per_task < job->T ? first + job->tokens_per_task : job->T;
    float krot[MAX_HEAD_DIM];
    for (int64_t t = first; t < last; t++) {
        const float *row = job->qkv + t * job->ldqkv;
        const float *c = job->cos + t * job->ldcs, *s = job->sin + t * job->ldcs;
        for (int h = 0; h < job->nq; h++)
            rotate(row + (int64_t)h * D, c, s, half, job->q_out + (t * job->nq + h) * D);
        const int64_t slot = job->slots[t];
        if (slot < 0) continue;
        const int64_t at = (slot / job->block_size) * job->stride_blk
                           + (slot % job->block_size) * job->stride_tok;
        for (int h = 0; h < job->nkv; h++) {
            const int64_t dst = (at + h * job->stride_head) * esize;
            rotate(row + (int64_t)(job->nq + h) * D, c, s, half, krot);
            store_row(krot, D, job->fmt, job->k_cache + dst);
            store_row(row + (int64_t)(job->nq + job->nkv + h) * D, D, job->fmt, job->v_cache + dst);
        }
    }
}

/* Returns 0; -1 for sizes the wrapper should have rejected; -2 (before writing anything) when
 * a slot is past the cache. */
int rope_store_f32(const float *qkv, int64_t T, int64_t ldqkv, int nq, int nkv, int D,
                   const float *cos, const float *sin, int64_t ldcs, float *q_out,
                   void *k_cache, void *v_cache, int64_t num_slots, int block_size,
                   int64_t stride_blk, int64_t stride_tok, int64_t stride_head,
                   const int64_t *slots, int fmt, int num_threads) {
    if (T < 0 || nq < 1 || nkv < 0 || D < 2 || D % 2 || D > MAX_HEAD_DIM || block_size < 1
        || (fmt != 0 && fmt != 1) || ldqkv < (int64_t)(nq + 2 * nkv) * D || ldcs < D / 2)
        return -1;
    if (T == 0) return 0;
    for (int64_t t = 0; t < T; t++)   /* before any write: a bad step changes nothing */
        if (slots[t] >= num_slots) return -2;
    rope_store_job job = {qkv, cos, sin, q_out, k_cache, v_cache, slots, ldqkv, ldcs, num_slots,
                          stride_blk, stride_tok, stride_head, 1, T, nq, nkv, D, block_size,
                          fmt};
    /* a decode step's 64 tokens are ~0.1 MB: threads only pay off for prefill chunks */
    const int threads = T * (nq + 2 * nkv) * D < (1 << 16) ? 1 : num_threads;
    job.tokens_per_task = threads <= 1 ? T : (T + threads * 4 - 1) / (threads * 4);
    pa_run_tasks(threads, rope_store_task, &job,
                 (T + job.tokens_per_task - 1) / job.tokens_per_task);
    return 0;
}

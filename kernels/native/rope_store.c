/* RoPE and the KV cache store of one layer, fused, for fp32 and bf16 CPU workers.
 *
 * From the fused q|k|v projection [T, (Hq + 2 Hkv) * D] it writes the rotated queries to q_out
 * [T, Hq, D] and, for every token whose slot is >= 0, the rotated key and the value into the
 * cache slot (fp32, or bf16 rounded to nearest even like torch's .to(bfloat16)). Neox-style
 * rotation (halves): out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, with cos/sin rows [T, D/2].
 * It replaces four torch ops for the rotation and the slot scatter (checks, masks, two
 * index_copy_) per layer: the decode step's per-layer overhead, not bandwidth, is what it saves.
 * A bf16 model's qkv, cos/sin and q are bf16: rotated in fp32, rounded once (torch's bf16 ops
 * round the two products' sum twice, so results can differ from them by an ulp).
 */
#include "vec8.h"

typedef struct {
    const void *qkv, *cos, *sin;   /* fp32, or bf16 when bf (q_out too) */
    void *q_out;
    char *k_cache, *v_cache;
    const int64_t *slots;
    int64_t ldqkv, ldcs, num_slots, stride_blk, stride_tok, stride_head, tokens_per_task, T;
    int nq, nkv, D, block_size, fmt;
} rope_store_job;

/* dst[0..D) = rope(x), fp32 */
INLINE void rotate(const void *x, const void *c, const void *s, int half, float *dst, int bf) {
    for (int i = 0; i < half; i++) {
        const float x1 = ld1(x, i, bf), x2 = ld1(x, i + half, bf);
        const float ci = ld1(c, i, bf), si = ld1(s, i, bf);
        dst[i] = x1 * ci - x2 * si;
        dst[i + half] = x2 * ci + x1 * si;
    }
}

/* D values to an fp32 (fmt 0) or bf16 (fmt 1) row */
static inline void store_row(const float *src, int D, int fmt, void *dst) {
    if (fmt == 0) {
        memcpy(dst, src, sizeof(float) * D);
    } else {
        bf16_t *out = (bf16_t *)dst;
        for (int i = 0; i < D; i++) out[i] = bf16_round(src[i]);
    }
}

INLINE void rope_store_rows(rope_store_job *job, int64_t task, int bf) {
    const int D = job->D, half = D / 2, esize = job->fmt == 0 ? 4 : 2;
    const int64_t first = task * job->tokens_per_task;
    const int64_t last = first + job->tokens_per_task < job->T ? first + job->tokens_per_task : job->T;
    float rot[MAX_HEAD_DIM], val[MAX_HEAD_DIM];
    for (int64_t t = first; t < last; t++) {
        const void *row = row_of(job->qkv, t, job->ldqkv, bf);
        const void *c = row_of(job->cos, t, job->ldcs, bf);
        const void *s = row_of(job->sin, t, job->ldcs, bf);
        for (int h = 0; h < job->nq; h++) {
            rotate(row_of(row, h, D, bf), c, s, half, rot, bf);
            store_row(rot, D, bf, (void *)row_of(job->q_out, t * job->nq + h, D, bf));
        }
        const int64_t slot = job->slots[t];
        if (slot < 0) continue;
        const int64_t base = (slot / job->block_size) * job->stride_blk
                             + (slot % job->block_size) * job->stride_tok;
        for (int h = 0; h < job->nkv; h++) {
            const int64_t dst = (base + h * job->stride_head) * esize;
            rotate(row_of(row, job->nq + h, D, bf), c, s, half, rot, bf);
            store_row(rot, D, job->fmt, job->k_cache + dst);
            const void *v = row_of(row, job->nq + job->nkv + h, D, bf);
            if (bf == job->fmt) {
                memcpy(job->v_cache + dst, v, (size_t)D * esize);
            } else {
                for (int i = 0; i < D; i++) val[i] = ld1(v, i, bf);
                store_row(val, D, job->fmt, job->v_cache + dst);
            }
        }
    }
}

static void rope_store_task_f32(void *ctx, int64_t task) { rope_store_rows(ctx, task, 0); }
static void rope_store_task_bf16(void *ctx, int64_t task) { rope_store_rows(ctx, task, 1); }

/* Returns 0; -1 for sizes the wrapper should have rejected; -2 (before writing anything) when
 * a slot is past the cache. bf: qkv, cos, sin and q_out are bf16 (else fp32); fmt: the cache's
 * (0 fp32, 1 bf16). */
int rope_store(const void *qkv, int bf, int64_t T, int64_t ldqkv, int nq, int nkv, int D,
               const void *cos, const void *sin, int64_t ldcs, void *q_out,
               void *k_cache, void *v_cache, int64_t num_slots, int block_size,
               int64_t stride_blk, int64_t stride_tok, int64_t stride_head,
               const int64_t *slots, int fmt, int num_threads) {
    if (T < 0 || nq < 1 || nkv < 0 || D < 2 || D % 2 || D > MAX_HEAD_DIM || block_size < 1
        || (fmt != 0 && fmt != 1) || (bf != 0 && bf != 1)
        || ldqkv < (int64_t)(nq + 2 * nkv) * D || ldcs < D / 2)
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
    pa_run_tasks(threads, bf ? rope_store_task_bf16 : rope_store_task_f32, &job,
                 (T + job.tokens_per_task - 1) / job.tokens_per_task);
    return 0;
}

/* The k largest values of each fp32 row and their indices, for the sampler's candidates (top_k
 * and top_p draw from the few largest logits of a 150K vocabulary) and its greedy argmax (k = 1).
 *
 * One pass per row: a min-heap of the k best so far, whose root is the threshold; the row is read
 * 32 floats at a time and compared with it, and only a block holding a larger value is looked at
 * element by element. For logits a few hundred of the ~150K values ever enter the heap, so a row
 * costs about one read of it (torch.topk on CPU sorts partial blocks: ~0.35 ms a 152K row, ~8 ms
 * for 64 rows on the 2-core EPYC, where reading them takes a fraction of that). A row in rising
 * order enters every value: n log k, still linear in the row.
 *
 * Order: descending by value, the lower index first among equal values (so k = 1 is torch's
 * argmax, the first maximum). NaN ranks as -inf (torch.topk ranks it largest): a row holding NaN
 * has no meaningful draw either way. Rows run on the task pool, one row per task. */
#include <math.h>
#include <stdint.h>

#include "vec8.h"

#define TOPK_MAX 1024
#define BLOCK 32

typedef struct {
    float v;
    int64_t i;
} item;

/* a ranks below b: a smaller value, or an equal value at a later index */
static inline int below(item a, item b) { return a.v < b.v || (a.v == b.v && a.i > b.i); }

static void sift_down(item *h, int64_t size, int64_t pos) {
    const item x = h[pos];
    for (;;) {
        int64_t child = 2 * pos + 1;
        if (child >= size) break;
        if (child + 1 < size && below(h[child + 1], h[child])) child++;
        if (!below(h[child], x)) break;
        h[pos] = h[child];
        pos = child;
    }
    h[pos] = x;
}

static void sift_up(item *h, int64_t pos) {
    const item x = h[pos];
    while (pos > 0) {
        const int64_t parent = (pos - 1) / 2;
        if (!below(x, h[parent])) break;
        h[pos] = h[parent];
        pos = parent;
    }
    h[pos] = x;
}

static inline int any_above(const float *p, float threshold) {
    const v8 t = {threshold, threshold, threshold, threshold,
                  threshold, threshold, threshold, threshold};
    const v8i m = (load8_f32(p) > t) | (load8_f32(p + 8) > t) | (load8_f32(p + 16) > t)
                  | (load8_f32(p + 24) > t);
#ifdef __AVX2__
    return _mm256_movemask_ps((__m256)m) != 0;
#else
    int32_t acc = 0;
    for (int q = 0; q < 8; q++) acc |= m[q];
    return acc != 0;
#endif
}

static void topk_row(const float *x, int64_t n, int64_t k, float *values, int64_t *ids) {
    item heap[TOPK_MAX];
    int64_t j = 0;
    for (; j < k; j++) {   /* the first k fill the heap */
        heap[j] = (item){isnan(x[j]) ? -INFINITY : x[j], j};
        sift_up(heap, j);
    }
    float threshold = heap[0].v;   /* a later value enters only when strictly larger */
    for (; j < n; j++) {
        if ((j & (BLOCK - 1)) == 0) {
            while (j + BLOCK <= n && !any_above(x + j, threshold)) j += BLOCK;
            if (j >= n) break;
        }
        if (x[j] > threshold) {
            heap[0] = (item){x[j], j};
            sift_down(heap, k, 0);
            threshold = heap[0].v;
        }
    }
    for (int64_t end = k - 1; end > 0; end--) {   /* pop the least to the back: descending */
        const item least = heap[0];
        heap[0] = heap[end];
        heap[end] = least;
        sift_down(heap, end, 0);
    }
    for (int64_t q = 0; q < k; q++) {
        values[q] = heap[q].v;
        ids[q] = heap[q].i;
    }
}

typedef struct {
    const float *x;
    int64_t ldx, n, k;
    float *values;
    int64_t *ids;
} topk_job;

static void topk_task(void *ctx, int64_t row) {
    const topk_job *job = ctx;
    topk_row(job->x + row * job->ldx, job->n, job->k, job->values + row * job->k,
             job->ids + row * job->k);
}

/* x [rows, n] (row stride ldx) -> values [rows, k] fp32 and ids [rows, k] int64, each row's k
 * largest in descending order. Returns -1 for bad sizes (k outside 1..min(n, TOPK_MAX)). */
int topk_f32(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t k, float *values,
             int64_t *ids, int num_threads) {
    if (rows < 0 || n < 1 || k < 1 || k > n || k > TOPK_MAX || ldx < n) return -1;
    topk_job job = {x, ldx, n, k, values, ids};
    pa_run_tasks(num_threads, topk_task, &job, rows);   /* serial for one row */
    return 0;
}

int topk_max_k(void) { return TOPK_MAX; }

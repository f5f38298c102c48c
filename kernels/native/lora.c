/* LoRA's two products for a step's rows, grouped by adapter slot (punica's SGMV), fp32:
 *
 *   shrink  y[i, :]           = A[slot] x[rows[i], :]        A: [slots, R, K], y: [len(rows), R]
 *   expand  out[rows[i], :N] += y[i, :] B[slot]              B: [slots, R, N] (rank-major)
 *
 * for i in segment s = seg_starts[s] .. seg_starts[s + 1] - 1, slot = seg_slots[s]. Each
 * segment reads its adapter's weights once per tile of rows, from memory into registers,
 * whatever the rows' places in the batch (rows holds their indices: no gather copy). The
 * scaling is folded into B when the adapter is loaded (workers/lora/).
 *
 * Tiles: shrink takes ROWS rows x NR rank rows over K, expand ROWS rows x NV vectors of output
 * columns over R: 8 accumulators within AVX2's 16 registers (NR = NV = 2, 8-lane vectors), 16
 * within AVX-512's 32 (NR = NV = 4, 16 lanes; GCC vector extensions, as vec8.h). Tasks are
 * (segment, NR rank rows) for shrink and (segment, column panel) for expand, on the shared task
 * pool. A decode step's calls are tens of microseconds: they stay on the calling thread, as
 * waking a helper costs about that much (and far more when the cores are shared). */
#include <stdint.h>
#include <string.h>

#include "paged_attention.h"   /* pa_run_tasks */

#ifdef __AVX512F__
#define VW 16
#define NR 4
#else
#define VW 8
#define NR 2
#endif
#define NV NR
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));

#define ROWS 4
#define PANEL (NV * VW)                 /* expand: output columns of one tile */
#define SINGLE_THREAD_FLOPS (1 << 23)   /* below this a call stays on the calling thread */

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf v) { *(vfu *)p = v; }
static inline float hsum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < VW; l++) s += v[l];
    return s;
}

typedef struct {
    const float *x, *w;         /* shrink: x, A; expand: y, B */
    float *out;                 /* shrink: y; expand: out */
    int64_t ldx, ldo, k, r, n;
    const int64_t *rows, *seg_starts, *seg_slots;
    int64_t units;              /* tasks per segment */
} lora_job;

/* y rows [i0, i0 + m) (m <= ROWS), rank rows r0 .. r0 + NR - 1 (those < R) of one adapter. */
static void shrink_tile(const lora_job *j, const float *a, int64_t i0, int m, int64_t r0) {
    const int64_t k = j->k, kv = k - k % VW;
    const float *ar[NR], *xr[ROWS];
    for (int q = 0; q < NR; q++) ar[q] = a + (r0 + q < j->r ? r0 + q : r0) * k;
    for (int t = 0; t < ROWS; t++) xr[t] = j->x + j->rows[i0 + (t < m ? t : 0)] * j->ldx;
    vf acc[ROWS][NR];
    for (int t = 0; t < ROWS; t++)
        for (int q = 0; q < NR; q++) acc[t][q] = (vf){0};
    for (int64_t c = 0; c < kv; c += VW) {
        vf w[NR];
        for (int q = 0; q < NR; q++) w[q] = loadv(ar[q] + c);
        for (int t = 0; t < ROWS; t++) {
            const vf xv = loadv(xr[t] + c);
            for (int q = 0; q < NR; q++) acc[t][q] += xv * w[q];
        }
    }
    for (int t = 0; t < m; t++) {
        float *y = j->out + (i0 + t) * j->ldo;
        for (int q = 0; q < NR && r0 + q < j->r; q++) {
            float sum = hsum(acc[t][q]);
            for (int64_t c = kv; c < k; c++) sum += xr[t][c] * ar[q][c];
            y[r0 + q] = sum;
        }
    }
}

static void shrink_task(void *ctx, int64_t task) {
    const lora_job *j = ctx;
    const int64_t seg = task / j->units, r0 = (task % j->units) * NR;
    const float *a = j->w + j->seg_slots[seg] * j->r * j->k;
    for (int64_t i = j->seg_starts[seg]; i < j->seg_starts[seg + 1]; i += ROWS) {
        const int64_t left = j->seg_starts[seg + 1] - i;
        shrink_tile(j, a, i, left < ROWS ? (int)left : ROWS, r0);
    }
}

/* out rows of y rows [i0, i0 + m), columns [c0, c0 + PANEL) (all inside N). */
static void expand_tile(const lora_job *j, const float *b, int64_t i0, int m, int64_t c0) {
    const float *yr[ROWS];
    for (int t = 0; t < ROWS; t++) yr[t] = j->x + (i0 + (t < m ? t : 0)) * j->ldx;
    vf acc[ROWS][NV];
    for (int t = 0; t < ROWS; t++)
        for (int v = 0; v < NV; v++) acc[t][v] = (vf){0};
    for (int64_t q = 0; q < j->r; q++) {
        vf w[NV];
        for (int v = 0; v < NV; v++) w[v] = loadv(b + q * j->n + c0 + v * VW);
        for (int t = 0; t < ROWS; t++) {
            const float yv = yr[t][q];
            for (int v = 0; v < NV; v++) acc[t][v] += yv * w[v];
        }
    }
    for (int t = 0; t < m; t++) {
        float *o = j->out + j->rows[i0 + t] * j->ldo + c0;
        for (int v = 0; v < NV; v++) storev(o + v * VW, loadv(o + v * VW) + acc[t][v]);
    }
}

/* The columns past the last whole panel, one scalar at a time. */
static void expand_tail(const lora_job *j, const float *b, int64_t i, int64_t c0) {
    const float *y = j->x + i * j->ldx;
    float *o = j->out + j->rows[i] * j->ldo;
    for (int64_t c = c0; c < j->n; c++) {
        float s = 0.0f;
        for (int64_t q = 0; q < j->r; q++) s += y[q] * b[q * j->n + c];
        o[c] += s;
    }
}

static void expand_task(void *ctx, int64_t task) {
    const lora_job *j = ctx;
    const int64_t seg = task / j->units, c0 = (task % j->units) * PANEL;
    const float *b = j->w + j->seg_slots[seg] * j->r * j->n;
    const int64_t start = j->seg_starts[seg], end = j->seg_starts[seg + 1];
    if (c0 + PANEL > j->n) {
        for (int64_t i = start; i < end; i++) expand_tail(j, b, i, c0);
        return;
    }
    for (int64_t i = start; i < end; i += ROWS)
        expand_tile(j, b, i, end - i < ROWS ? (int)(end - i) : ROWS, c0);
}

static int threads_for(int64_t flops, int threads) {
    return flops < SINGLE_THREAD_FLOPS ? 1 : threads;
}

static int check_segments(const int64_t *seg_starts, const int64_t *seg_slots, int64_t nseg,
                          int64_t num_slots) {
    for (int64_t s = 0; s < nseg; s++)
        if (seg_starts[s] > seg_starts[s + 1] || seg_slots[s] < 0 || seg_slots[s] >= num_slots)
            return -2;
    return 0;
}

/* y [len(rows), R] (row stride ldy) = per row, A[slot] [R, K] times x's row. 0, or < 0 for
 * sizes or segments the wrapper should have refused. */
int lora_shrink_f32(const float *x, int64_t ldx, int64_t k, const int64_t *rows,
                    const int64_t *seg_starts, const int64_t *seg_slots, int64_t nseg,
                    const float *a, int64_t num_slots, int64_t r, float *y, int64_t ldy,
                    int threads) {
    if (k < 1 || r < 1 || nseg < 0 || ldx < k || ldy < r) return -1;
    if (check_segments(seg_starts, seg_slots, nseg, num_slots)) return -2;
    lora_job job = {x, a, y, ldx, ldy, k, r, 0, rows, seg_starts, seg_slots, (r + NR - 1) / NR};
    const int64_t flops = 2 * (seg_starts[nseg] - seg_starts[0]) * r * k;
    pa_run_tasks(threads_for(flops, threads), shrink_task, &job, nseg * job.units);
    return 0;
}

/* out[rows[i], :N] += y's row i times B[slot] [R, N]. 0, or < 0 as lora_shrink_f32. */
int lora_expand_f32(const float *y, int64_t ldy, int64_t r, const int64_t *rows,
                    const int64_t *seg_starts, const int64_t *seg_slots, int64_t nseg,
                    const float *b, int64_t num_slots, int64_t n, float *out, int64_t ldo,
                    int threads) {
    if (n < 1 || r < 1 || nseg < 0 || ldy < r || ldo < n) return -1;
    if (check_segments(seg_starts, seg_slots, nseg, num_slots)) return -2;
    lora_job job = {y, b, out, ldy, ldo, 0, r, n, rows, seg_starts, seg_slots,
                    (n + PANEL - 1) / PANEL};
    const int64_t flops = 2 * (seg_starts[nseg] - seg_starts[0]) * r * n;
    pa_run_tasks(threads_for(flops, threads), expand_task, &job, nseg * job.units);
    return 0;
}

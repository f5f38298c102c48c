/* The panel GEMM shared by the fp32 and bf16 linears (linear_f32.c, linear_bf16.c):
 * y[M, N] = x[M, K] @ W[N, K]^T with x in fp32 and W packed once at load into panels of 16
 * output columns, wp[P][K][16] (P = ceil(N / 16), the last panel zero-padded), so a panel is one
 * sequential stream. Each k step loads the panel's 16 weights once (LOAD turns them into two fp32
 * vectors: columns 0-7 and 8-15) and multiplies them into up to 6 rows of x held as 12 vector
 * accumulators (the AVX2 register file's worth); the next 6 rows re-read the panel from cache,
 * not from memory. A decode step with few rows is bound by reading the weights, and this reads
 * them at memory speed; with many rows it is the FMA loop.
 *
 * GCC vector extensions: -march=native makes them AVX2/AVX-512 FMAs, and a CPU without them gets
 * the same code in narrower vectors. Threads split the panels (pa_run_tasks). */
#ifndef LINEAR_PANELS_H
#define LINEAR_PANELS_H

#include "prefetch.h"
#include "vec8.h"

#define PANEL 16
#define MAX_ROWS 6

typedef struct {
    const float *x;
    const void *wp;
    void *y;
    int64_t m, k, n, ldx, ldy;
    panel_tasks split;   /* the panels each task takes */
} linear_job;

/* Rows [0, ROWS) of x against one panel; ROWS is a constant in each instantiation, so the
 * accumulators stay in registers. LOAD(panel, k, w0, w1) sets the two weight vectors of step k. */
#define DEFINE_PANEL_ROWS(NAME, WTYPE, LOAD, ROWS)                                               \
static inline void NAME##_rows_##ROWS(const float *x, int64_t ldx, const WTYPE *panel,          \
                                      int64_t K, float out[MAX_ROWS][PANEL], int ahead) {        \
    v8 acc[ROWS][2];                                                                             \
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = (v8){0};                              \
    for (int64_t k = 0; k < K; k++) {                                                            \
        v8 w0, w1;                                                                               \
        if (ahead && !(k & 3))                                                                   \
            prefetch_bytes(panel + (k + 64) * PANEL, 4 * PANEL * sizeof(WTYPE));                 \
        LOAD(panel, k, w0, w1);                                                                  \
        for (int r = 0; r < ROWS; r++) {                                                         \
            const float xv = x[r * ldx + k];                                                     \
            acc[r][0] += xv * w0;                                                                \
            acc[r][1] += xv * w1;                                                                \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < ROWS; r++) {                                                             \
        memcpy(out[r], &acc[r][0], sizeof(v8));                                                  \
        memcpy(out[r] + 8, &acc[r][1], sizeof(v8));                                              \
    }                                                                                            \
}

/* NAME_task(ctx, task): the panels of one task against every row of x; STORE(dst, src, cols)
 * writes one row's `cols` fp32 results to y's element type. */
#define DEFINE_PANEL_TASK(NAME, WTYPE, YTYPE, LOAD, STORE)                                       \
DEFINE_PANEL_ROWS(NAME, WTYPE, LOAD, 1)                                                          \
DEFINE_PANEL_ROWS(NAME, WTYPE, LOAD, 2)                                                          \
DEFINE_PANEL_ROWS(NAME, WTYPE, LOAD, 3)                                                          \
DEFINE_PANEL_ROWS(NAME, WTYPE, LOAD, 4)                                                          \
DEFINE_PANEL_ROWS(NAME, WTYPE, LOAD, 5)                                                          \
DEFINE_PANEL_ROWS(NAME, WTYPE, LOAD, 6)                                                          \
static void NAME##_task(void *ctx, int64_t task) {                                               \
    const linear_job *job = ctx;                                                                 \
    int64_t first, last;                                                                         \
    pa_task_panels(&job->split, task, &first, &last);                                            \
    float out[MAX_ROWS][PANEL];                                                                  \
    for (int64_t p = first; p < last; p++) {                                                     \
        const WTYPE *panel = (const WTYPE *)job->wp + p * job->k * PANEL;                        \
        const int64_t n0 = p * PANEL;                                                            \
        const int64_t cols = job->n - n0 < PANEL ? job->n - n0 : PANEL;                          \
        for (int64_t m0 = 0; m0 < job->m; m0 += MAX_ROWS) {                                      \
            const int64_t rows = job->m - m0 < MAX_ROWS ? job->m - m0 : MAX_ROWS;                \
            const float *x = job->x + m0 * job->ldx;                                             \
            switch (rows) {                                                                      \
                case 1: NAME##_rows_1(x, job->ldx, panel, job->k, out, !m0); break;              \
                case 2: NAME##_rows_2(x, job->ldx, panel, job->k, out, !m0); break;              \
                case 3: NAME##_rows_3(x, job->ldx, panel, job->k, out, !m0); break;              \
                case 4: NAME##_rows_4(x, job->ldx, panel, job->k, out, !m0); break;              \
                case 5: NAME##_rows_5(x, job->ldx, panel, job->k, out, !m0); break;              \
                default: NAME##_rows_6(x, job->ldx, panel, job->k, out, !m0); break;             \
            }                                                                                    \
            for (int64_t r = 0; r < rows; r++)                                                   \
                STORE((YTYPE *)job->y + (m0 + r) * job->ldy + n0, out[r], cols);                 \
        }                                                                                        \
    }                                                                                            \
}

/* NAME(w, n, k, ldw, wp): wp[P][K][16] from T w[N][K] (row stride ldw), zero-padding the last
 * panel. */
#define DEFINE_PANEL_PACK(NAME, T)                                                               \
void NAME(const T *w, int64_t n, int64_t k, int64_t ldw, T *wp) {                                \
    const int64_t num_panels = (n + PANEL - 1) / PANEL;                                          \
    for (int64_t p = 0; p < num_panels; p++)                                                     \
        for (int64_t kk = 0; kk < k; kk++)                                                       \
            for (int64_t c = 0; c < PANEL; c++) {                                                \
                const int64_t row = p * PANEL + c;                                               \
                wp[(p * k + kk) * PANEL + c] = row < n ? w[row * ldw + kk] : (T)0;               \
            }                                                                                    \
}

/* Run `task` over the panels of job (m, k, n, strides and pointers set) on `num_threads`. */
static inline void linear_run_panels(linear_job *job, task_fn task, int num_threads) {
    const int64_t threads = num_threads < 1 ? 1 : num_threads;
    job->split = pa_panel_tasks((job->n + PANEL - 1) / PANEL, (int)threads,
                                PANEL * job->k * job->m);
    pa_run_tasks((int)threads, task, job, pa_task_count(&job->split));
}

#endif

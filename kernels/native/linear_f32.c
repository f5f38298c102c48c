/* fp32 linear for CPU workers: y[M, N] = x[M, K] @ W[N, K]^T, W packed once at load into the
 * panels of linear_panels.h (wp[P][K][16], plain fp32).
 *
 * Measured on the 2-core AVX2 EPYC (SmolLM2-135M's matmuls, one forward, distinct weights per
 * layer, 2 threads), against oneDNN's packed product and MKL's sgemm: M=1 20.8 vs 33.2 ms
 * (oneDNN), M=16 49.8 vs 68.8, M=64 119.8 vs 149.2, M=256 477.7-508.9 vs 571.6 (oneDNN) and
 * 644.1 (MKL), M=1024 2,002 vs 2,338 (MKL). */
#include "linear_panels.h"

#define LOAD_F32(panel, k, w0, w1)                                                               \
    do {                                                                                         \
        w0 = *(const v8u *)((panel) + (k) * PANEL);                                              \
        w1 = *(const v8u *)((panel) + (k) * PANEL + 8);                                          \
    } while (0)

static inline void store_row_f32(float *dst, const float *src, int64_t cols) {
    memcpy(dst, src, sizeof(float) * cols);
}

DEFINE_PANEL_TASK(f32, float, float, LOAD_F32, store_row_f32)

DEFINE_PANEL_PACK(linear_pack_f32, float)

/* y[m][0..n) = x[m][0..k) . W[0..n)[0..k) for packed wp; returns 0, or -1 on bad sizes. */
int linear_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *wp,
               int64_t n, float *y, int64_t ldy, int num_threads) {
    if (m < 1 || k < 1 || n < 1 || ldx < k || ldy < n) return -1;
    linear_job job = {x, wp, y, m, k, n, ldx, ldy};
    linear_run_panels(&job, f32_task, num_threads);
    return 0;
}

/* bf16 linear for CPU workers without native bf16 math (AVX2): y[M, N] = x[M, K] @ W[N, K]^T
 * with x, W and y in bf16, summed in fp32 (what a GPU's bf16 tensor cores and oneDNN's AVX-512
 * bf16 product do). A bf16 value is the top half of an fp32 one, so widening is exact and cheap:
 * x is widened once per call into the caller's fp32 scratch; W stays bf16 in memory (half of
 * fp32's bytes to read in a weight-bound decode step), in the panels of linear_panels.h, and is
 * widened in registers inside its panel GEMM. Results are rounded to bf16 half to even, as torch
 * rounds. */
#include "linear_panels.h"

#define LOAD_BF16(panel, k, w0, w1)                                                              \
    do {                                                                                         \
        w0 = load8_bf16((panel) + (k) * PANEL);                                                  \
        w1 = load8_bf16((panel) + (k) * PANEL + 8);                                              \
    } while (0)

/* Not inlined: GCC would hoist this loop's vector constants over the whole task, and the
 * 6-row kernel's accumulators would spill (measured: half the speed). */
__attribute__((noinline)) static void store_row_bf16(bf16_t *dst, const float *src, int64_t cols) {
    if (cols == PANEL) {
        store8_bf16(dst, load8_f32(src));
        store8_bf16(dst + 8, load8_f32(src + 8));
        return;
    }
    for (int64_t c = 0; c < cols; c++) dst[c] = bf16_round(src[c]);
}

DEFINE_PANEL_TASK(bf16, bf16_t, bf16_t, LOAD_BF16, store_row_bf16)

DEFINE_PANEL_PACK(linear_pack_bf16, bf16_t)

/* y[m][0..n) = x[m][0..k) . W[0..n)[0..k) for packed wp, all bf16; xf: m * k fp32 of scratch.
 * Returns 0, or -1 on bad sizes. */
int linear_bf16(const bf16_t *x, int64_t m, int64_t k, int64_t ldx, const bf16_t *wp,
                int64_t n, bf16_t *y, int64_t ldy, float *xf, int num_threads) {
    if (m < 1 || k < 1 || n < 1 || ldx < k || ldy < n) return -1;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < k; c++) xf[r * k + c] = load_bf16(x + r * ldx, c);
    linear_job job = {xf, wp, y, m, k, n, k, ldy};
    linear_run_panels(&job, bf16_task, num_threads);
    return 0;
}

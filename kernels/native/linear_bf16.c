/* bf16 linear for CPU workers without native bf16 math (AVX2): y[M, N] = x[M, K] @ W[N, K]^T
 * with x, W and y in bf16, summed in fp32 (what a GPU's bf16 tensor cores and oneDNN's AVX-512
 * bf16 product do). A bf16 value is the top half of an fp32 one, so widening is exact and cheap:
 * x is widened once per call into the caller's fp32 scratch; W stays bf16 in memory (half of
 * fp32's bytes to read in a weight-bound decode step), in the panels of linear_panels.h, and is
 * widened in registers inside its panel GEMM. Results are rounded to bf16 half to even, as torch
 * rounds. */
#include "linear_panels.h"

/* Widen 8 bf16 to fp32: zero-extend to 32 bits (vpmovzxwd from memory), then shift into the top
 * half. No constant is needed: the 6-row kernel holds 12 accumulators, 2 weight vectors and a
 * broadcast of x, 15 of AVX2's 16 registers. */
#ifdef __AVX2__
#include <immintrin.h>
static inline v8 widen8(const bf16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8i __attribute__((vector_size(32)));
static inline v8 widen8(const bf16_t *p) {
    return (v8)(__builtin_convertvector(*(const v8h *)p, v8i) << 16);
}
#endif

#define LOAD_BF16(panel, k, w0, w1)                                                              \
    do {                                                                                         \
        w0 = widen8((panel) + (k) * PANEL);                                                      \
        w1 = widen8((panel) + (k) * PANEL + 8);                                                  \
    } while (0)

static inline bf16_t bf16_round(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;   /* NaN, as torch writes it */
    return (bf16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Not inlined: GCC would hoist this loop's vector constants over the whole task, and the
 * 6-row kernel's accumulators would spill (measured: half the speed). */
__attribute__((noinline)) static void store_row_bf16(bf16_t *dst, const float *src, int64_t cols) {
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
    linear_job job = {xf, wp, y, m, k, n, k, ldy, 0, 0};
    linear_run_panels(&job, bf16_task, num_threads);
    return 0;
}

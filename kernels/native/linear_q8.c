/* int8 linear for CPU workers (--quantization int8): y[M, N] = x[M, K] @ W[N, K]^T with both
 * operands quantized in blocks of 32 along K, like llama.cpp's Q8_0: a block of 32 values is
 * stored as integers q = round(v / d), d = max|v| / L, plus one fp32 scale d. x is quantized here
 * on every call with L = 127; W once at load (kernels/native_linear_q8.py) with L = 63, stored as
 * q + 64 (unsigned, 1..127). A block's dot product is an exact int32 sum, scaled by d_x * d_w
 * into the fp32 accumulator: y = sum_b d_x[b] d_w[b] (sum_{k in b} q_x[k] q_w[k]).
 *
 * Why blocks, and why 63 levels for W: see the wrapper (perplexity and argmax agreement on
 * SmolLM2). The offset makes W the unsigned operand of vpmaddubsw: (q_w + 64) * q_x summed in
 * pairs is at most 2 * 127 * 127 = 32258, so the int16 sums never saturate, and no per-product
 * sign fix-up is needed; 64 * sum(q_x) per block (kept with x's scales) takes the offset back out.
 *
 * Packed weight: panels of 16 output columns; in a panel, for each group of 4 consecutive k, the
 * 16 columns' 4 bytes side by side (64 bytes: two AVX2 registers of 8 columns x 4 k). Scales:
 * [P][K/32][16] fp32. On AVX2 a 4-byte group of x is broadcast to all 8 lanes; vpmaddubsw and
 * vpmaddwd (by ones) turn it into 8 int32 partial sums: 32 multiply-adds in 3 instructions,
 * against 8 in one fp32 FMA. Elsewhere the same integer sums run in plain C.
 *
 * Measured (2-core AVX2 EPYC, 2 threads, one SmolLM2 forward's matmuls, this file vs
 * linear_f32.c, same run): M=1 6.1 vs 16.5 ms (a quarter of the bytes to read), M=64 93.7 vs
 * 142.3, M=256 255.9 vs 391.6, M=1024 1,183 vs 1,605. Splitting the rows of a prefill chunk into
 * 96-384-row passes over the panels (to keep x in L2) measured no better.
 *
 * Threads quantize x by rows, then split the panels (pa_run_tasks). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"
#include "prefetch.h"
#include "thread_buffer.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QB 32          /* quantization block along K */
#define QPANEL 16      /* output columns per panel */
#define QROWS 3        /* rows of x per pass over a panel's block (see q8_rows_*) */
#define QUANT_ROWS 16  /* rows per quantization task */
#define W_OFFSET 64    /* packed weights are q_w + 64, q_w in [-63, 63] */

typedef struct {
    const float *x;
    int8_t *xq;
    float *xs;
    int32_t *xc;       /* per row and block: 64 * sum of q_x (the weights' offset, see above);
                          NULL when only the quantization is wanted */
    const uint8_t *wq;
    const float *ws;
    float *y;
    int64_t m, k, n, ldx, ldy;
    panel_tasks split;   /* the panels each task takes */
} q8_job;

/* ---- activation quantization ---------------------------------------------------------- */

/* One block of 32: d = max|v| / 127, q = round-half-even(v * (1 / d)). A block with
 * max|v| < 2^-100 counts as zero (d = 0, q = 0; 1 / d would overflow for denormal d); a block
 * holding inf or NaN gets d = NaN (its outputs become NaN, as fp32's would) and q = 0. */
static inline float quantize_block(const float *v, int8_t *q, int32_t *qsum) {
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < QB; i++) {
        const float a = fabsf(v[i]);
        finite &= a <= 3.4028234e38f;   /* false for inf and NaN */
        amax = a > amax ? a : amax;
    }
    *qsum = 0;
    if (!finite) {
        memset(q, 0, QB);
        return NAN;
    }
    if (amax < 0x1p-100f) {
        memset(q, 0, QB);
        return 0.0f;
    }
    const float d = amax / 127.0f;
    const float id = 1.0f / d;
#ifdef __AVX2__
    const __m256 scale = _mm256_set1_ps(id);
    __m256i i32[4];
    for (int j = 0; j < 4; j++)   /* cvtps rounds half to even, like nearbyintf by default */
        i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), scale));
    const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]);   /* lanes interleaved by 128 */
    const __m256i i16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i i8 = _mm256_packs_epi16(i16a, i16b);
    /* packs works per 128-bit lane: restore the order of the 8 groups of 4 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(i8, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                        _mm256_add_epi32(i32[2], i32[3]));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    *qsum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
#else
    for (int i = 0; i < QB; i++) {
        q[i] = (int8_t)nearbyintf(v[i] * id);
        *qsum += q[i];
    }
#endif
    return d;
}

static void quantize_task(void *ctx, int64_t task) {
    const q8_job *job = ctx;
    const int64_t blocks = job->k / QB;
    int64_t last = (task + 1) * QUANT_ROWS;
    if (last > job->m) last = job->m;
    for (int64_t r = task * QUANT_ROWS; r < last; r++)
        for (int64_t b = 0; b < blocks; b++) {
            int32_t qsum;
            job->xs[r * blocks + b] = quantize_block(job->x + r * job->ldx + b * QB,
                                                      job->xq + r * job->k + b * QB, &qsum);
            if (job->xc) job->xc[r * blocks + b] = W_OFFSET * qsum;
        }
}

/* ---- block-scaled int8 panel product -------------------------------------------------- */

#ifdef __AVX2__
/* ROWS rows of quantized x against one panel; ROWS is a constant in each instantiation, so the
 * int32 accumulators stay in registers. 3 rows and the group loop unrolled twice measured best
 * (in one process, alternating builds; GOP/s at M = 16/64/256/1024 over SmolLM2's four layer
 * matmuls): 181/222/223/224, against 147/185/195/196 for 4 rows unrolled once; 4 rows keep one
 * accumulator on the stack. */
#define DEFINE_Q8_ROWS(ROWS)                                                                     \
static inline void q8_rows_##ROWS(const int8_t *xq, const float *xs, const int32_t *xc,      \
                                  int64_t K, const uint8_t *panel, const float *pscale,          \
                                  float out[QROWS][QPANEL], int ahead) {                         \
    const int64_t blocks = K / QB;                                                               \
    const __m256i ones = _mm256_set1_epi16(1);                                                   \
    __m256 acc[ROWS][2];                                                                         \
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                  \
    for (int64_t b = 0; b < blocks; b++) {                                                       \
        __m256i isum[ROWS][2];                                                                   \
        for (int r = 0; r < ROWS; r++) isum[r][0] = isum[r][1] = _mm256_setzero_si256();         \
        const uint8_t *pb = panel + b * QB * QPANEL;                                                \
        if (ahead) prefetch_bytes(pb + 4 * QB * QPANEL, QB * QPANEL);  /* 4 blocks on */        \
        /* unrolled fully, GCC computes all 8 groups' products first and spills them */       \
        _Pragma("GCC unroll 2")                                                                  \
        for (int g = 0; g < QB / 4; g++) {                                                       \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pb + g * 64));              \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pb + g * 64 + 32));         \
            for (int r = 0; r < ROWS; r++) {                                                     \
                int32_t quad;                                                                    \
                memcpy(&quad, xq + r * K + b * QB + g * 4, 4);                                   \
                const __m256i xv = _mm256_set1_epi32(quad);                                      \
                isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_madd_epi16(                     \
                    _mm256_maddubs_epi16(w0, xv), ones));                                        \
                isum[r][1] = _mm256_add_epi32(isum[r][1], _mm256_madd_epi16(                     \
                    _mm256_maddubs_epi16(w1, xv), ones));                                        \
            }                                                                                    \
        }                                                                                        \
        const __m256 s0 = _mm256_loadu_ps(pscale + b * QPANEL);                                  \
        const __m256 s1 = _mm256_loadu_ps(pscale + b * QPANEL + 8);                              \
        for (int r = 0; r < ROWS; r++) {                                                         \
            const __m256 dx = _mm256_set1_ps(xs[r * blocks + b]);                                \
            const __m256i corr = _mm256_set1_epi32(xc[r * blocks + b]);                          \
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r][0], corr)),  \
                                        _mm256_mul_ps(s0, dx), acc[r][0]);                       \
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r][1], corr)),  \
                                        _mm256_mul_ps(s1, dx), acc[r][1]);                       \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < ROWS; r++) {                                                             \
        _mm256_storeu_ps(out[r], acc[r][0]);                                                     \
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);                                                 \
    }                                                                                            \
}
DEFINE_Q8_ROWS(1)
DEFINE_Q8_ROWS(2)
DEFINE_Q8_ROWS(3)

static void q8_panel_rows(const int8_t *xq, const float *xs, const int32_t *xc, int64_t rows,
                          int64_t K, const uint8_t *panel, const float *pscale,
                          float out[QROWS][QPANEL], int ahead) {
    switch (rows) {
        case 1: q8_rows_1(xq, xs, xc, K, panel, pscale, out, ahead); break;
        case 2: q8_rows_2(xq, xs, xc, K, panel, pscale, out, ahead); break;
        default: q8_rows_3(xq, xs, xc, K, panel, pscale, out, ahead); break;
    }
}
#else
static void q8_panel_rows(const int8_t *xq, const float *xs, const int32_t *xc, int64_t rows,
                          int64_t K, const uint8_t *panel, const float *pscale,
                          float out[QROWS][QPANEL], int ahead) {
    (void)ahead;
    const int64_t blocks = K / QB;
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < QPANEL; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t isum = 0;
                for (int i = 0; i < QB; i++)
                    isum += (int32_t)xq[r * K + b * QB + i]
                            * ((int32_t)panel[(b * QB + i) / 4 * 4 * QPANEL + c * 4 + i % 4]
                               - W_OFFSET);
                acc += (float)isum * (pscale[b * QPANEL + c] * xs[r * blocks + b]);
            }
            out[r][c] = acc;
        }
}
#endif

static void q8_task(void *ctx, int64_t task) {
    const q8_job *job = ctx;
    const int64_t K = job->k, blocks = K / QB;
    int64_t first, last;
    pa_task_panels(&job->split, task, &first, &last);
    float out[QROWS][QPANEL];
    for (int64_t p = first; p < last; p++) {
        const uint8_t *panel = job->wq + p * K * QPANEL;
        const float *pscale = job->ws + p * blocks * QPANEL;
        const int64_t n0 = p * QPANEL;
        const int64_t cols = job->n - n0 < QPANEL ? job->n - n0 : QPANEL;
        for (int64_t m0 = 0; m0 < job->m; m0 += QROWS) {
            const int64_t rows = job->m - m0 < QROWS ? job->m - m0 : QROWS;
            q8_panel_rows(job->xq + m0 * K, job->xs + m0 * blocks, job->xc + m0 * blocks, rows, K,
                          panel, pscale, out, m0 == 0);
            for (int64_t r = 0; r < rows; r++)
                memcpy(job->y + (m0 + r) * job->ldy + n0, out[r], sizeof(float) * cols);
        }
    }
}

/* The calling thread's buffer for quantized x (thread_buffer.h) */
static int8_t *q8_scratch(int64_t bytes) {
    static __thread thread_buffer buffer;
    return thread_buffer_get(&buffer, bytes);
}

/* y[m][0..n) = x[m][0..k) . W[0..n)[0..k) for W packed by the wrapper (wq: [P][K/4][16][4]
 * int8, ws: [P][K/32][16] fp32). Returns 0; -1 on bad sizes (k not a multiple of 32 ...); -2 when
 * the scratch buffer cannot be allocated. */
int linear_q8(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *wq,
              const float *ws, int64_t n, float *y, int64_t ldy, int num_threads) {
    if (m < 1 || k < QB || k % QB != 0 || n < 1 || ldx < k || ldy < n) return -1;
    const int64_t blocks = k / QB;
    const int64_t xq_bytes = (m * k + 63) / 64 * 64;   /* keeps the scales aligned */
    int8_t *scratch = q8_scratch(xq_bytes + m * blocks * 8);
    if (scratch == NULL) return -2;
    float *xs = (float *)(scratch + xq_bytes);
    q8_job job = {x, scratch, xs, (int32_t *)(xs + m * blocks), wq, ws, y, m, k, n, ldx, ldy};
    const int threads = num_threads < 1 ? 1 : num_threads;
    pa_run_tasks(threads, quantize_task, &job, (m + QUANT_ROWS - 1) / QUANT_ROWS);
    job.split = pa_panel_tasks((n + QPANEL - 1) / QPANEL, threads, QPANEL * k * m);
    pa_run_tasks(threads, q8_task, &job, pa_task_count(&job.split));
    return 0;
}

/* The activation quantization alone (tests compare it with the torch reference bit for bit):
 * xq [m][k] int8 and xs [m][k/32] from x (row stride ldx). Returns 0, or -1 on bad sizes. */
int quantize_rows_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *xq, float *xs) {
    if (m < 1 || k < QB || k % QB != 0 || ldx < k) return -1;
    q8_job job = {x, xq, xs, NULL, NULL, NULL, NULL, m, k, 0, ldx, 0, 0, 0};
    for (int64_t t = 0; t < (m + QUANT_ROWS - 1) / QUANT_ROWS; t++) quantize_task(&job, t);
    return 0;
}

/* Linear layers on weights kept in their quantized block formats (GGUF's Q4_0, Q4_1, Q5_0, Q8_0,
 * Q4_K, Q5_K, Q6_K and I4G, our AWQ/GPTQ int4; kernels/quant_formats.py): y[M, N] = x[M, K] W^T.
 *
 * x is quantized on every call into int8 blocks (kernels/native_linear_gguf.py quantize_ref is
 * the reference, bit for bit): blocks of 32 for the 32-element weight types (as llama.cpp's Q8_0)
 * and of 256 for the k-quants (as its Q8_K), d = max|v| / 127, q = round-half-even(v / d), with
 * the sum of q over every group of 16 kept beside. Each row of W is unpacked into bytes and
 * per-block scales (gguf_unpack.h: one form for every type), once per call and panel of 4 rows,
 * then multiplied with every row of x: integer dot products, exact in int32, one block at a time,
 * and the fp32 accumulation of the blocks' terms (gguf_unpack.h) in block order. The vector
 * bodies compute the same integer sums and the same fp32 operations in the same order as the
 * portable C (no contraction into FMA, no reassociation: the pragmas below), so every build, and
 * 1 or more threads (threads split the rows of W), gives the same bits.
 *
 * Three paths, all with those sums and terms: up to 3 rows of x, blocks unpacked in registers
 * (gguf_direct.h); from 4 rows on, 16 rows of W unpacked once per call into interleaved panels
 * that meet a broadcast quad of x in two vectors (gguf_wide.h); the row panels below for the
 * k-quant types the direct path lacks (Q5_K) and for the portable build. Vector bodies: AVX2
 * (vpmaddubsw: unsigned weight bytes times signed activations, summed in pairs, then vpmaddwd
 * by ones or by the k-quants' group scales); with AVX-512 VNNI (or AVX-VNNI) the 32-element
 * types use vpdpbusd instead; Q8_0's signed bytes as |w| times sign(w) * a. Elsewhere plain C. */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_unpack.h"
#include "paged_attention.h"
#include "thread_buffer.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define PANEL 4            /* rows of W unpacked together */
#define QUANT_ROWS 16      /* rows of x per quantization task */

/* ---- activation quantization ---------------------------------------------------------- */

/* max |v| over a block; *finite = 0 when it holds inf or NaN (then the max is not used) */
static inline float block_amax(const float *v, int block, int *finite) {
#ifdef __AVX512F__
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 ok = 0xffff;
    for (int i = 0; i < block; i += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(v + i));
        ok &= _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.4028234e38f), _CMP_LE_OQ);
        vmax = _mm512_max_ps(vmax, a);
    }
    *finite = ok == 0xffff;
    return _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.4028234e38f);
    __m256 vmax = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < block; i += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i));
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ));   /* false for inf, NaN */
        vmax = _mm256_max_ps(vmax, a);
    }
    *finite = _mm256_movemask_ps(ok) == 0xff;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float amax = 0.0f;
    *finite = 1;
    for (int i = 0; i < block; i++) {
        const float a = fabsf(v[i]);
        *finite &= a <= 3.4028234e38f;
        amax = a > amax ? a : amax;
    }
    return amax;
#endif
}

/* q = round-half-even(v * id) for 16 values (|q| <= 127); returns their sum */
static inline int16_t round_group(const float *v, float id, int8_t *q) {
#ifdef __AVX512F__
    /* vcvtps2dq rounds half to even, as nearbyintf does in the default rounding mode */
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qi));
    return (int16_t)_mm512_reduce_add_epi32(qi);
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(id);   /* cvtps rounds half to even, as above */
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), scale));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), scale));
    const __m256i i16 = _mm256_packs_epi32(lo, hi);   /* lanes: lo 0-3 hi 0-3, lo 4-7 hi 4-7 */
    const __m128i i8 = _mm_packs_epi16(_mm256_castsi256_si128(i16),
                                       _mm256_extracti128_si256(i16, 1));
    _mm_storeu_si128((__m128i *)q, _mm_shuffle_epi32(i8, 0xd8));   /* back in order */
    const __m256i s8 = _mm256_add_epi32(lo, hi);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    return (int16_t)_mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
#else
    int32_t s = 0;
    for (int i = 0; i < 16; i++) {
        q[i] = (int8_t)nearbyintf(v[i] * id);
        s += q[i];
    }
    return (int16_t)s;
#endif
}

/* One block of `block` values (32 or 256): d = max|v| / 127, q = round-half-even(v * (1 / d)),
 * sums of q per group of 16. max|v| < 2^-100 counts as zero (d = 0, q = 0); inf or NaN gives
 * d = NaN and q = 0. */
static float quantize_block(const float *v, int block, int8_t *q, int16_t *sums) {
    int finite;
    const float amax = block_amax(v, block, &finite);
    if (!finite || amax < 0x1p-100f) {
        memset(q, 0, (size_t)block);
        memset(sums, 0, sizeof(int16_t) * (size_t)(block / 16));
        return finite ? 0.0f : NAN;
    }
    const float d = amax / 127.0f;
    const float id = 1.0f / d;
    for (int g = 0; g < block / 16; g++) sums[g] = round_group(v + 16 * g, id, q + 16 * g);
    return d;
}

typedef struct {
    const float *x;
    int64_t m, k, ldx;
    int block;
    int8_t *xq;        /* [m][k] */
    float *xd;         /* [m][k / block] */
    int16_t *xs;       /* [m][k / 16] */
} quant_job;

static void quantize_task(void *ctx, int64_t task) {
    const quant_job *job = ctx;
    const int64_t blocks = job->k / job->block;
    int64_t last = (task + 1) * QUANT_ROWS;
    if (last > job->m) last = job->m;
    for (int64_t r = task * QUANT_ROWS; r < last; r++)
        for (int64_t b = 0; b < blocks; b++)
            job->xd[r * blocks + b] = quantize_block(
                job->x + r * job->ldx + b * job->block, job->block,
                job->xq + r * job->k + b * job->block, job->xs + r * (job->k / 16) + b * job->block / 16);
}

/* ---- the dot products of a panel of PANEL unpacked rows with one row of x ------------ */

/* PANEL unpacked rows, their block scales side by side: d[PANEL * b + r] */
typedef struct {
    unpacked_row rows[PANEL];
    float *d, *dm;
} panel;

/* The fp32 term of one block (both bodies call this, so the rounding is the same) */
static inline float block_term(float d, float dm, float da, int32_t i1, int32_t i2) {
    const float s1 = d * da, s2 = dm * da;
    return s1 * (float)i1 - s2 * (float)i2;
}

#ifdef __AVX2__
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_U8S8(u, a) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (a))
#elif defined(__AVXVNNI__)
#define DOT_U8S8(u, a) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (a))
#else
#define DOT_U8S8(u, a) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (a)), _mm256_set1_epi16(1))
#endif

/* the four rows' sums of v[0..3], each a vector of 8 int32 */
static inline __m128i hsum4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static inline __m128 terms4(const panel *w, int64_t b, float da, __m128i i1, __m128i i2) {
    const __m128 dav = _mm_set1_ps(da);
    const __m128 d = _mm_loadu_ps(w->d + PANEL * b), dm = _mm_loadu_ps(w->dm + PANEL * b);
    const __m128 s1 = _mm_mul_ps(d, dav), s2 = _mm_mul_ps(dm, dav);
    return _mm_sub_ps(_mm_mul_ps(s1, _mm_cvtepi32_ps(i1)), _mm_mul_ps(s2, _mm_cvtepi32_ps(i2)));
}

static void dot_panel_32(const panel *w, int signed_u, int zero, const int8_t *xq,
                         const float *xd, const int16_t *xs, int64_t K, float out[PANEL]) {
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
        __m256i v[PANEL];
        for (int r = 0; r < PANEL; r++) {
            const __m256i u = _mm256_loadu_si256((const __m256i *)(w->rows[r].u + 32 * b));
            v[r] = signed_u ? DOT_U8S8(_mm256_abs_epi8(u), _mm256_sign_epi8(a, u))
                            : DOT_U8S8(u, a);
        }
        const int32_t s = (int32_t)xs[2 * b] + (int32_t)xs[2 * b + 1];
        const __m128i i1 = _mm_sub_epi32(hsum4(v[0], v[1], v[2], v[3]), _mm_set1_epi32(zero * s));
        acc = _mm_add_ps(acc, terms4(w, b, xd[b], i1, _mm_set1_epi32(s)));
    }
    _mm_storeu_ps(out, acc);
}

static void dot_panel_k(const panel *w, const int8_t *xq, const float *xd,
                        const int16_t *xs, int64_t K, float out[PANEL]) {
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        __m256i v[PANEL], m[PANEL];
        for (int r = 0; r < PANEL; r++) v[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + 256 * b + 32 * j));
            for (int r = 0; r < PANEL; r++) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(w->rows[r].u + 256 * b + 32 * j));
                const __m256i sc = _mm256_loadu_si256(
                    (const __m256i *)(w->rows[r].sc2 + 128 * b + 16 * j));
                v[r] = _mm256_add_epi32(v[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), sc));
            }
        }
        const __m256i s = _mm256_loadu_si256((const __m256i *)(xs + 16 * b));
        for (int r = 0; r < PANEL; r++)
            m[r] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(w->rows[r].mc + 16 * b)), s);
        acc = _mm_add_ps(acc, terms4(w, b, xd[b], hsum4(v[0], v[1], v[2], v[3]),
                                     hsum4(m[0], m[1], m[2], m[3])));
    }
    _mm_storeu_ps(out, acc);
}
#else
static void dot_panel_32(const panel *w, int signed_u, int zero, const int8_t *xq,
                         const float *xd, const int16_t *xs, int64_t K, float out[PANEL]) {
    for (int r = 0; r < PANEL; r++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < K / 32; b++) {
            const int32_t s = (int32_t)xs[2 * b] + (int32_t)xs[2 * b + 1];
            int32_t i1 = -zero * s;
            for (int e = 32 * b; e < 32 * b + 32; e++)
                i1 += (signed_u ? (int32_t)(int8_t)w->rows[r].u[e] : (int32_t)w->rows[r].u[e]) * xq[e];
            acc += block_term(w->d[PANEL * b + r], w->dm[PANEL * b + r], xd[b], i1, s);
        }
        out[r] = acc;
    }
}

static void dot_panel_k(const panel *w, const int8_t *xq, const float *xd,
                        const int16_t *xs, int64_t K, float out[PANEL]) {
    for (int r = 0; r < PANEL; r++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < K / 256; b++) {
            int32_t i1 = 0, i2 = 0;
            for (int g = 0; g < 16; g++) {
                int32_t s = 0;
                for (int e = 256 * b + 16 * g; e < 256 * b + 16 * g + 16; e++)
                    s += (int32_t)w->rows[r].u[e] * xq[e];
                i1 += w->rows[r].sc2[128 * b + 8 * g] * s;
                i2 += w->rows[r].mc[16 * b + g] * (int32_t)xs[16 * b + g];
            }
            acc += block_term(w->d[PANEL * b + r], w->dm[PANEL * b + r], xd[b], i1, i2);
        }
        out[r] = acc;
    }
}
#endif


#include "gguf_direct.h"

/* ---- the linear ------------------------------------------------------------------------ */

typedef struct {
    const qtype_info *info;
    int qtype;
    const uint8_t *w;
    int64_t n, k, w_stride;
    const int8_t *xq;
    const float *xd;
    const int16_t *xs;
    int64_t m;
    float *y;
    int64_t ldy;
    int failed;        /* a task could not allocate its rows */
    const int32_t *xz; /* packed 32-element types: each row's block sums times -offset */
    panel_tasks split; /* the panels each task takes */
} linear_job;

/* The calling thread's panel for K columns (grown, never shrunk); -1 if it cannot be allocated */
static int panel_storage(int64_t K, int block, panel *w) {
    static __thread thread_buffer storage;
    const int64_t scales_at = (2 * K + K / 8 + 63) / 64 * 64;      /* after u, sc2, mc */
    const int64_t per_row = (scales_at + 8 * (K / block) + 63) / 64 * 64;
    uint8_t *buffer = thread_buffer_get(&storage, per_row * PANEL + 2 * 4 * PANEL * (K / block));
    if (buffer == NULL) return -1;
    for (int r = 0; r < PANEL; r++) {
        uint8_t *p = buffer + r * per_row;
        w->rows[r].u = p;
        w->rows[r].sc2 = (int16_t *)(p + K);
        w->rows[r].mc = (int16_t *)(p + 2 * K);
        w->rows[r].d = (float *)(p + scales_at);
        w->rows[r].dm = w->rows[r].d + K / block;
    }
    w->d = (float *)(buffer + per_row * PANEL);
    w->dm = w->d + PANEL * (K / block);
    return 0;
}

/* Unpack rows first.. of W (a short last panel repeats its last row) */
static void unpack_panel(const qtype_info *info, const uint8_t *w, int64_t stride, int live,
                         int64_t K, panel *p) {
    const int64_t blocks = K / info->block;
    for (int r = 0; r < PANEL; r++) {
        info->unpack(w + (r < live ? r : live - 1) * stride, K, &p->rows[r]);
        for (int64_t b = 0; b < blocks; b++) {
            p->d[PANEL * b + r] = p->rows[r].d[b];
            p->dm[PANEL * b + r] = p->rows[r].dm[b];
        }
    }
}

/* The calling thread's buffer for the quantized x (grown, never shrunk: a prefill chunk's
 * worth, allocated fresh, would be an mmap that page-faults on every call) */
static int8_t *x_scratch(int64_t bytes) {
    static __thread thread_buffer buffer;
    return thread_buffer_get(&buffer, bytes);
}

#ifdef __AVX2__
#include "gguf_wide.h"

/* Spreads the weight's panel at `panel` (`live` of its WIDE columns real) into p */
typedef void (*wide_spread_fn)(const linear_job *job, const uint8_t *panel, int live,
                               wide_panel *p);

/* A task's panels of WIDE columns (each `panel_bytes` of the weight's bytes): spread once, then
 * every row of x against it. Raw rows (wide_task) and packed panels (gguf_packed.h) alike. */
static void wide_panels(void *ctx, int64_t task, int64_t panel_bytes, wide_spread_fn spread) {
    const linear_job *job = ctx;
    wide_panel p;
    if (wide_storage(job->k, job->info->block, &p) != 0) {
        __atomic_store_n(&((linear_job *)ctx)->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    int64_t first, last;
    pa_task_panels(&job->split, task, &first, &last);
    for (int64_t panel_index = first; panel_index < last; panel_index++) {
        const int64_t n0 = panel_index * WIDE;
        const int live = job->n - n0 < WIDE ? (int)(job->n - n0) : WIDE;
        const uint8_t *panel = job->w + panel_index * panel_bytes;
        spread(job, panel, live, &p);
        /* the next panel's bytes arrive while this one computes */
        wide_panel_all_rows(&p, job->info, job->xq, job->xd, job->xs, job->xz, job->m, job->k,
                            job->y, job->ldy, n0, live,
                            panel_index + 1 < last ? panel + panel_bytes : NULL, panel_bytes);
    }
}

static void wide_spread_raw(const linear_job *job, const uint8_t *panel, int live,
                            wide_panel *p) {
    wide_unpack(job->info, panel, job->w_stride, live, job->k, p);
}

static void wide_task(void *ctx, int64_t task) {
    const linear_job *job = ctx;
    wide_panels(ctx, task, WIDE * job->w_stride, wide_spread_raw);
}
#define WIDE_MIN_ROWS 4   /* from here on, the wide panels (fewer rows take the row paths) */
#endif

static void linear_task(void *ctx, int64_t task) {
    const linear_job *job = ctx;
    const qtype_info *info = job->info;
    const int64_t K = job->k;
    panel w;
    if (panel_storage(K, info->block, &w) != 0) {
        __atomic_store_n(&((linear_job *)ctx)->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    int64_t first, last;
    pa_task_panels(&job->split, task, &first, &last);
    float out[PANEL];
    const direct_fn direct = job->m <= direct_max_rows(job->qtype) ? direct_for(job->qtype) : NULL;
    for (int64_t p = first; p < last; p++) {
        const int64_t n0 = p * PANEL;
        const int live = job->n - n0 < PANEL ? (int)(job->n - n0) : PANEL;
        if (direct != NULL) {
            for (int64_t t = 0; t < job->m; t++) {
                direct(job->w + n0 * job->w_stride, job->w_stride, live, job->xq + t * K,
                       job->xd + t * (K / info->block), job->xs + t * (K / 16), K, out, t == 0);
                memcpy(job->y + t * job->ldy + n0, out, sizeof(float) * (size_t)live);
            }
            continue;
        }
        unpack_panel(info, job->w + n0 * job->w_stride, job->w_stride, live, K, &w);
        for (int64_t t = 0; t < job->m; t++) {
            const int8_t *xq = job->xq + t * K;
            const float *xd = job->xd + t * (K / info->block);
            const int16_t *xs = job->xs + t * (K / 16);
            if (info->kquant)
                dot_panel_k(&w, xq, xd, xs, K, out);
            else
                dot_panel_32(&w, info->signed_u, info->zero, xq, xd, xs, K, out);
            memcpy(job->y + t * job->ldy + n0, out, sizeof(float) * (size_t)live);
        }
    }
}

static int check_sizes(const qtype_info *info, int64_t n, int64_t k, int64_t w_stride) {
    if (info == NULL) return -3;
    if (n < 1 || k < info->block || k % info->block != 0
        || w_stride < k / info->block * info->bytes)
        return -1;
    return 0;
}

/* x quantized into the calling thread's scratch: xq [m][k], xd [m][k / block], xs [m][k / 16];
 * -2 when the scratch cannot be allocated */
static int quantize_x(int block, const float *x, int64_t m, int64_t k, int64_t ldx, int threads,
                      int8_t **xq, float **xd, int16_t **xs) {
    const int64_t q_bytes = (m * k + 63) / 64 * 64, d_bytes = (m * (k / block) * 4 + 63) / 64 * 64;
    *xq = x_scratch(q_bytes + d_bytes + m * (k / 16) * 2);
    if (*xq == NULL) return -2;
    *xd = (float *)(*xq + q_bytes);
    *xs = (int16_t *)((uint8_t *)*xd + d_bytes);
    quant_job qjob = {x, m, k, ldx, block, *xq, *xd, *xs};
    pa_run_tasks(threads, quantize_task, &qjob, (m + QUANT_ROWS - 1) / QUANT_ROWS);
    return 0;
}

/* y[t][0..n) = x[t][0..k) . W[0..n)[0..k) for t < m, W: n rows of `qtype` blocks, row r at
 * w + r * w_stride (bytes). Returns 0; -1 on bad sizes; -2 when scratch memory cannot be
 * allocated; -3 for a type not run here. */
int gguf_linear(int qtype, const uint8_t *w, int64_t n, int64_t k, int64_t w_stride,
                const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int num_threads) {
    const qtype_info *info = qtype_lookup(qtype);
    const int bad = check_sizes(info, n, k, w_stride);
    if (bad) return bad;
    if (m < 1 || ldx < k || ldy < n) return -1;
    const int threads = num_threads < 1 ? 1 : num_threads;
    int8_t *xq;
    float *xd;
    int16_t *xs;
    if (quantize_x(info->block, x, m, k, ldx, threads, &xq, &xd, &xs) != 0) return -2;
    int64_t cols = PANEL;
    task_fn run = linear_task;
#ifdef __AVX2__
    if (m >= WIDE_MIN_ROWS && (m > direct_max_rows(qtype) || direct_for(qtype) == NULL)) {
        cols = WIDE;
        run = wide_task;
    }
#endif
    linear_job job = {info, qtype, w, n, k, w_stride, xq, xd, xs, m, y, ldy, 0};
    job.split = pa_panel_tasks((n + cols - 1) / cols, threads, cols * k * m);
    pa_run_tasks(threads, run, &job, pa_task_count(&job.split));
    return job.failed ? -2 : 0;
}

/* ---- weights repacked into panels of 16 rows, and their entry points (gguf_packed.h) ----- */

#include "gguf_packed.h"

/* The activation quantization alone (tests hold it to the torch reference bit for bit):
 * xq [m][k], xd [m][k / block], xs [m][k / 16]. Returns 0, or -1 on bad sizes. */
int gguf_quantize_rows(const float *x, int64_t m, int64_t k, int64_t ldx, int block, int8_t *xq,
                       float *xd, int16_t *xs) {
    if (m < 1 || (block != 32 && block != 256) || k < block || k % block != 0 || ldx < k)
        return -1;
    quant_job job = {x, m, k, ldx, block, xq, xd, xs};
    for (int64_t t = 0; t < (m + QUANT_ROWS - 1) / QUANT_ROWS; t++) quantize_task(&job, t);
    return 0;
}

/* Rows idx[0..count) of W dequantized to fp32 [count][k] (embedding lookups, tests), with
 * ggml's arithmetic per type. Returns 0; -1 on bad sizes or an index out of range; -2 when
 * memory cannot be allocated; -3 for a type not run here. */
int gguf_dequantize_rows(int qtype, const uint8_t *w, int64_t n, int64_t k, int64_t w_stride,
                         const int64_t *idx, int64_t count, float *out) {
    const qtype_info *info = qtype_lookup(qtype);
    const int bad = check_sizes(info, n, k, w_stride);
    if (bad) return bad;
    for (int64_t i = 0; i < count; i++)
        if (idx[i] < 0 || idx[i] >= n) return -1;
    panel p;
    if (panel_storage(k, info->block, &p) != 0) return -2;
    const unpacked_row *o = &p.rows[0];
    for (int64_t i = 0; i < count; i++) {
        info->unpack(w + idx[i] * w_stride, k, &p.rows[0]);
        float *y = out + i * k;
        for (int64_t e = 0; e < k; e++) {
            const int64_t b = e / info->block;
            const float d = o->d[b];
            switch (qtype) {
                case T_Q4_0: y[e] = (float)((int)o->u[e] - 8) * d; break;
                case T_Q5_0: y[e] = (float)((int)o->u[e] - 16) * d; break;
                case T_Q8_0: y[e] = (float)(int8_t)o->u[e] * d; break;
                case T_Q4_1: case T_I4G: y[e] = (float)o->u[e] * d - o->dm[b]; break;
                case T_Q6_K: y[e] = d * (float)o->sc2[e / 2] * (float)((int)o->u[e] - 32); break;
                default:     /* Q4_K, Q5_K */
                    y[e] = d * (float)o->sc2[e / 2] * (float)o->u[e] - o->dm[b] * (float)o->mc[e / 16];
            }
        }
    }
    return 0;
}

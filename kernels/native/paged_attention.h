/* Paged decode attention for CPU workers, called through ctypes (kernels/native/__init__.py).
 *
 * This header holds the kernel bodies as macros; decode_<format>.c instantiates them for one
 * cache format each (separate files so the compiler builds them in parallel) and task_pool.c
 * runs the tasks.
 *
 * Same contract as paged_decode_attention_ref (kernels/attention_ref.py): caches are layer views
 * [num_blocks, block_size, Hkv, D] with unit stride on D; q and out are [N, Hq, D] contiguous fp32
 * (the Python wrapper converts a bf16 query and output); query head qh reads kv head qh / (Hq / Hkv).
 * The cache holds fp32, bf16 or fp8 (e4m3fn or e5m2, kernels/kv_format.py): one entry point per
 * format, paged_decode_{f32,bf16,e4m3,e5m2}; every element is widened to fp32 as it is loaded.
 * A sliding window > 0 shows a row of context c only keys [max(0, c - window), c): its tasks'
 * partitions count from the block holding the first of them, so blocks wholly before it (which
 * the scheduler may have freed and reused) are never read.
 *
 * Why a native kernel: on a CPU the torch path gathers every sequence's pages into a scratch
 * buffer and then runs SDPA over it, so the KV cache crosses the memory bus three times and
 * SDPA's q_len=1 path is far from bandwidth-bound. Here each task streams its pages once, straight
 * from the block table: pass 1 computes the scores of all query heads against one token's K row
 * (Hkv * D contiguous values), the softmax runs over the task's scores in a small buffer, and
 * pass 2 accumulates the V rows. Work is split into tasks of (sequence, partition of at most
 * PART tokens); sequences longer than one partition are combined by their log-sum-exp.
 *
 * Threads: torch's OpenMP team (the same libgomp, soname libgomp.so.1) when it is large enough,
 * else a small task pool of its own (pool_run below) whose caller never waits for a thread that
 * has not started, which keeps the kernel fast when the cores are shared (see run_tasks).
 * Compiled with -O3 -march=native and the float flags that allow
 * vectorized reductions; no -ffast-math (it would set FTZ/DAZ for the whole process).
 */
#ifndef PAGEDSERVE_PAGED_ATTENTION_H
#define PAGEDSERVE_PAGED_ATTENTION_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>

typedef uint16_t bf16_t;

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float load_bf16(const bf16_t *p, int64_t i) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)p[i] << 16;
    return v.f;
}
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }

/* IEEE half -> float (subnormals, inf and NaN included), for the portable fp8 loads. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0x1fu) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        v.f = (float)mant * (1.0f / 16777216.0f);   /* mant * 2^-24 */
        v.u |= sign;
    } else {
        v.u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    return v.f;
}
/* fp8 bytes as halves: e5m2 is the top byte of an IEEE half; e4m3fn's exponent and mantissa
 * placed in a half's (bias 15 instead of 7) give the value / 256, subnormals included. The
 * e4m3fn NaN byte (0x7f/0xff) reads as 480: the store side saturates and never writes it. */
static inline uint16_t e5m2_half(uint8_t x) { return (uint16_t)((uint16_t)x << 8); }
static inline uint16_t e4m3_half(uint8_t x) {
    return (uint16_t)(((x & 0x7fu) << 7) | ((x & 0x80u) << 8));
}
static inline float load_e5m2(const uint8_t *p, int64_t i) { return half_to_float(e5m2_half(p[i])); }
static inline float load_e4m3(const uint8_t *p, int64_t i) {
    return half_to_float(e4m3_half(p[i])) * 256.0f;
}

/* 2^f for |f| <= 0.5, degree-6 polynomial (relative error ~2e-7); f a float or a GCC vector
 * (elementwise.c's exp uses it too). */
#define EXP2_POLY(f)                                                                            \
    ((((((1.5403530393381606e-4f * (f) + 1.3333558146428443e-3f) * (f)                          \
         + 9.6181291076284772e-3f) * (f) + 5.5504108664821580e-2f) * (f)                       \
       + 2.4022650695910071e-1f) * (f) + 6.9314718055994531e-1f) * (f) + 1.0f)

/* exp(x) for x <= 0 (scores minus their max), vectorizable: 2^x = 2^i * 2^f, |f| <= 0.5. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.4426950408889634f;
    float i = __builtin_rintf(t);
    float f = t - i;
    float p = EXP2_POLY(f);
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)i + 127) << 23;
    return p * scale.f;
}

#define MAX_HEAD_DIM 256

/* cache element formats */
enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_E4M3 = 2, FMT_E5M2 = 3 };
static inline int fmt_bytes(int fmt) { return fmt == FMT_F32 ? 4 : fmt == FMT_BF16 ? 2 : 1; }

/* Portable decode task: one query row q[Hq, D] against keys [k0, k1) of one sequence. Writes,
 * per query head, the max score m, the sum of exp(s - m) l and the unnormalized accumulator
 * acc[D] (fp32), into part_m / part_l / part_acc. */
#define DEFINE_TASK(SUFFIX, T, LOAD)                                                          \
static inline __attribute__((always_inline)) int attend_##SUFFIX(                          \
        const float *q, const T *k_cache, const T *v_cache, int64_t stride_blk, int64_t stride_tok,      \
        int64_t stride_head, const int32_t *table, int64_t num_blocks, int block_size,     \
        int64_t k0, int64_t k1,                                                              \
        int num_q_heads, int num_kv_heads, int head_dim, float scale,                         \
        float *qf, float *scores, float *part_m, float *part_l, float *part_acc) {           \
    const int group = num_q_heads / num_kv_heads;                                             \
    const int64_t n = k1 - k0;                                                                \
    const int D = head_dim;                                                                   \
    for (int64_t i = 0; i < (int64_t)num_q_heads * D; i++) qf[i] = q[i] * scale;              \
    /* pass 1: scores[qh * n + j] for key k0 + j */                                           \
    const int64_t lines = num_q_heads;                                                        \
    for (int64_t t = k0; t < k1;) {                                                           \
        const int64_t blk = table[t / block_size];                                            \
        if (blk < 0 || blk >= num_blocks) return -6;                                          \
        const int64_t off = t % block_size;                                                   \
        int64_t count = block_size - off;                                                     \
        if (count > k1 - t) count = k1 - t;                                                   \
        for (int h = 0; h < num_kv_heads; h++) {                                              \
            const T *kbase = k_cache + blk * stride_blk + off * stride_tok + h * stride_head; \
            for (int64_t j = 0; j < count; j++) {                                             \
                const T *krow = kbase + j * stride_tok;                                       \
                float kf[MAX_HEAD_DIM];                                                       \
                for (int d = 0; d < D; d++) kf[d] = LOAD(krow, d);                            \
                for (int64_t line = h * group; line < (h + 1) * group; line++) {              \
                    const float *qrow = qf + line * D;                                        \
                    float s = 0.0f;                                                           \
                    for (int d = 0; d < D; d++) s += qrow[d] * kf[d];                         \
                    scores[line * n + (t - k0) + j] = s;                                      \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        t += count;                                                                           \
    }                                                                                         \
    /* softmax numerators per query head */                                                   \
    for (int64_t line = 0; line < lines; line++) {                                            \
        float *s = scores + line * n;                                                         \
        float m = -3.0e38f;                                                                   \
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;                              \
        float l = 0.0f;                                                                       \
        for (int64_t j = 0; j < n; j++) { float e = exp_nonpos(s[j] - m); s[j] = e; l += e; } \
        part_m[line] = m;                                                                     \
        part_l[line] = l;                                                                     \
    }                                                                                         \
    /* pass 2: acc[qh] += p * V row */                                                        \
    memset(part_acc, 0, sizeof(float) * lines * D);                                           \
    for (int64_t t = k0; t < k1;) {                                                           \
        const int64_t blk = table[t / block_size];                                            \
        const int64_t off = t % block_size;                                                   \
        int64_t count = block_size - off;                                                     \
        if (count > k1 - t) count = k1 - t;                                                   \
        for (int h = 0; h < num_kv_heads; h++) {                                              \
            const T *vbase = v_cache + blk * stride_blk + off * stride_tok + h * stride_head; \
            for (int64_t j = 0; j < count; j++) {                                             \
                const T *vrow = vbase + j * stride_tok;                                       \
                float vf[MAX_HEAD_DIM];                                                       \
                for (int d = 0; d < D; d++) vf[d] = LOAD(vrow, d);                            \
                for (int64_t line = h * group; line < (h + 1) * group; line++) {              \
                    const float p = scores[line * n + (t - k0) + j];                          \
                    float *acc = part_acc + line * D;                                         \
                    for (int d = 0; d < D; d++) acc[d] += p * vf[d];                          \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        t += count;                                                                           \
    }                                                                                         \
    return 0;                                                                                 \
}


/* ---- vector path: decode_fixed for head sizes 64, 128 (256: AVX-512) and GQA groups to 8 --
 * One body for two ISAs: AVX-512 (16 lanes) or AVX2 + FMA (8 lanes), chosen at compile time by
 * -march=native; other CPUs and other shapes take the portable attend_* path. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define HAVE_VECTOR 1
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vec;
static inline vec v_set1(float x) { return _mm512_set1_ps(x); }
static inline vec v_zero(void) { return _mm512_setzero_ps(); }
static inline vec v_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec v_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec v_sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec v_max(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec v_fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec v_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_storef(float *p, vec a) { _mm512_storeu_ps(p, a); }
static inline float v_sum(vec a) { return _mm512_reduce_add_ps(a); }
static inline float v_hmax(vec a) { return _mm512_reduce_max_ps(a); }
static inline __attribute__((always_inline)) vec v_load(const void *base, int64_t i, int fmt) {
    if (fmt == FMT_BF16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const bf16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    if (fmt == FMT_E5M2)   /* the byte is a half's top byte */
        return _mm512_cvtph_ps(_mm256_slli_epi16(
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + i))), 8));
    if (fmt == FMT_E4M3) {  /* sign-extend, shift exponent+mantissa into a half's, clear bit 14 */
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + i)));
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(-16385)));
    }
    return _mm512_loadu_ps((const float *)base + i);
}
static inline vec v_round(vec a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec v_pow2i(vec p, vec i) { return _mm512_scalef_ps(p, i); }   /* p * 2^i */
#else
#define VW 8
typedef __m256 vec;
static inline vec v_set1(float x) { return _mm256_set1_ps(x); }
static inline vec v_zero(void) { return _mm256_setzero_ps(); }
static inline vec v_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec v_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec v_sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec v_max(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec v_fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec v_loadf(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_storef(float *p, vec a) { _mm256_storeu_ps(p, a); }
static inline float v_sum(vec a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline float v_hmax(vec a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline __attribute__((always_inline)) vec v_load(const void *base, int64_t i, int fmt) {
    if (fmt == FMT_BF16) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)((const bf16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    if (fmt == FMT_E5M2) {  /* the byte is a half's top byte */
        const __m128i raw = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + i));
        return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), raw));
    }
    if (fmt == FMT_E4M3) {  /* sign-extend, shift exponent+mantissa into a half's, clear bit 14 */
        const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)base + i)));
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(-16385)));
    }
    return _mm256_loadu_ps((const float *)base + i);
}
static inline vec v_round(vec a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec v_pow2i(vec p, vec i) {   /* p * 2^i for integral i in [-126, 0] */
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i),
                                                            _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* Register arrays are sized for the largest case (MAX_VECTOR_D) and indexed by the constants G
 * and NV: arrays sized by NV would be variable-length, which GCC places on the stack (an alloca
 * per token, the rows in memory) before inlining makes NV a constant. Fixed sizes: 5-9% faster
 * (AVX2, 2 threads, SmolLM2 heads, b64/b256 x 512, fp32 and bf16 caches), same results. */
/* The widest head the vector body takes: 256 with AVX-512 (1.2-1.8x the portable body, 1 thread,
 * bf16, b16 x 512, groups 2 and 8); AVX2's 16 registers made 256 slower than portable (groups 4
 * and 8: 1.3-2x), so it stays at 128 there. */
#define MAX_VECTOR_D (VW == 16 ? 256 : 128)
#define MAX_NV (MAX_VECTOR_D / VW)
#define VBUF_ROWS 16   /* AVX2's pass 2: V rows widened at a time (16 x 128 floats: 8 KB) */

/* exp(x) for x <= 0 lanes, the polynomial of exp_nonpos. */
static inline vec v_exp(vec x) {
    x = v_max(x, v_set1(-87.0f));
    const vec t = v_mul(x, v_set1(1.4426950408889634f));
    const vec i = v_round(t);
    const vec f = v_sub(t, i);
    vec p = v_set1(1.5403530393381606e-4f);
    p = v_fmadd(p, f, v_set1(1.3333558146428443e-3f));
    p = v_fmadd(p, f, v_set1(9.6181291076284772e-3f));
    p = v_fmadd(p, f, v_set1(5.5504108664821580e-2f));
    p = v_fmadd(p, f, v_set1(2.4022650695910071e-1f));
    p = v_fmadd(p, f, v_set1(6.9314718055994531e-1f));
    p = v_fmadd(p, f, v_set1(1.0f));
    return v_pow2i(p, i);
}

/* Where the table's block `index` starts (bytes), or NULL past the range: blocks are scattered,
 * so the hardware prefetcher cannot guess where the next one starts. The loops below prefetch
 * the next block's row j while they compute row j of this one, which keeps a steady number of
 * misses in flight instead of stalling on a burst. */
static inline __attribute__((always_inline)) const char *block_start(
        const void *cache, const int32_t *table, int64_t index, int64_t last, int64_t num_blocks,
        int64_t stride_blk, int fmt) {
    if (index > last) return NULL;
    const int64_t blk = table[index];
    if (blk < 0 || blk >= num_blocks) return NULL;
    return (const char *)cache + blk * stride_blk * fmt_bytes(fmt);
}

static inline __attribute__((always_inline)) void prefetch_row(const char *block, int64_t row,
                                                               int64_t row_bytes) {
    if (!block) return;
    const char *start = block + row * row_bytes;
    for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(start + at, _MM_HINT_T0);
}

/* The keys [t, t + *count) that lie in t's block (up to k1), and where they start in the cache
 * (elements); -1 when the table entry is not a valid block id. */
static inline __attribute__((always_inline)) int64_t block_run(
        const int32_t *table, int64_t t, int64_t k1, int block_size, int64_t num_blocks,
        int64_t stride_blk, int64_t stride_tok, int64_t *count) {
    const int64_t blk = table[t / block_size];
    if (blk < 0 || blk >= num_blocks) return -1;
    const int64_t off = t % block_size;
    *count = block_size - off < k1 - t ? block_size - off : k1 - t;
    return blk * stride_blk + off * stride_tok;
}

/* Decode task (one query row) with the group size G and NV = D / VW known at compile time; each
 * K and V row is converted once per (token, kv head). With AVX-512 the group's query rows and
 * accumulators stay in registers across a block's tokens; AVX2 (VW == 8) walks each row once with
 * all its kv heads instead. Same numbers as attend_* up to summation order.
 * Tried on AVX2 and dropped: per kv head, 8 scores per horizontal-add fold and accumulators in
 * registers per column chunk. 25% faster with the cache in L3, but it walks each block once per
 * head, and from memory it was slower (2 threads, b64 x 512: fp32 2.20 -> 3.12 ms, b256 bf16
 * 9.3 -> 10.7 ms): this kernel is bound by how it streams the rows, not by its arithmetic. */
static inline __attribute__((always_inline)) int decode_fixed(
        const float *q, const void *k_cache, const void *v_cache, int64_t stride_blk,
        int64_t stride_tok, int64_t stride_head, const int32_t *table, int64_t num_blocks,
        int block_size, int64_t k0, int64_t k1, int num_kv_heads, const int NV, const int G,
        float scale, float *scores, float *part_m, float *part_l, float *part_acc, int fmt) {
    const int64_t n = k1 - k0;
    const int64_t D = VW * NV;
    const int num_q_heads = num_kv_heads * G;
    const int64_t row_bytes = stride_tok * fmt_bytes(fmt);
    /* v_load gives e4m3 values / 256: K's factor goes into the query's scale, V's into the
     * accumulators as they are stored */
    const float unit = fmt == FMT_E4M3 ? 256.0f : 1.0f;
    /* pass 1: scores[qh * n + j] */
#if VW == 8
    /* AVX2: the query rows do not fit in registers either; walk each K row once with all its
     * kv heads (one sequential stream per block), and scale the scores instead of the query. */
    const float qk_scale = scale * unit;
    for (int64_t t = k0; t < k1;) {
        int64_t count;
        const int64_t row0 = block_run(table, t, k1, block_size, num_blocks, stride_blk,
                                       stride_tok, &count);
        if (row0 < 0) return -6;
        const char *next = block_start(k_cache, table, t / block_size + 1, (k1 - 1) / block_size,
                                       num_blocks, stride_blk, fmt);
        /* this block's V rows too: pass 2 finds them in cache (a partition's V is <= 128 KB
         * at 512 tokens of 2 x 64 bf16) instead of waiting on each block's first rows. AVX2
         * only: with AVX-512 it was slower (24 layers from memory, b54 x 256: 607 -> 672 us) */
        const char *v_rows = (const char *)v_cache + row0 * fmt_bytes(fmt);
        for (int64_t j = 0; j < count; j++) {
            prefetch_row(next, j, row_bytes);
            prefetch_row(v_rows, j, row_bytes);
            for (int h = 0; h < num_kv_heads; h++) {
                const int64_t at = row0 + j * stride_tok + h * stride_head;
                vec k[MAX_NV];
                for (int c = 0; c < NV; c++) k[c] = v_load(k_cache, at + VW * c, fmt);
                for (int g = 0; g < G; g++) {
                    const float *qrow = q + (int64_t)(h * G + g) * D;
                    vec a = v_mul(v_loadf(qrow), k[0]);
                    for (int c = 1; c < NV; c++) a = v_fmadd(v_loadf(qrow + VW * c), k[c], a);
                    scores[(int64_t)(h * G + g) * n + (t - k0) + j] = v_sum(a) * qk_scale;
                }
            }
        }
        t += count;
    }
#else
    const vec vscale = v_set1(scale * unit);
    for (int64_t t = k0; t < k1;) {
        int64_t count;
        const int64_t row0 = block_run(table, t, k1, block_size, num_blocks, stride_blk,
                                       stride_tok, &count);
        if (row0 < 0) return -6;
        const char *next = block_start(k_cache, table, t / block_size + 1, (k1 - 1) / block_size,
                                       num_blocks, stride_blk, fmt);
        for (int h = 0; h < num_kv_heads; h++) {
            vec qv[8][MAX_NV];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < NV; c++)
                    qv[g][c] = v_mul(v_loadf(q + (int64_t)(h * G + g) * D + VW * c), vscale);
            float *srow = scores + (int64_t)h * G * n + (t - k0);
            for (int64_t j = 0; j < count; j++) {
                if (h == 0) prefetch_row(next, j, row_bytes);
                const int64_t at = row0 + j * stride_tok + h * stride_head;
                vec k[MAX_NV];
                for (int c = 0; c < NV; c++) k[c] = v_load(k_cache, at + VW * c, fmt);
                for (int g = 0; g < G; g++) {
                    vec a = v_mul(qv[g][0], k[0]);
                    for (int c = 1; c < NV; c++) a = v_fmadd(qv[g][c], k[c], a);
                    srow[g * n + j] = v_sum(a);
                }
            }
        }
        t += count;
    }
#endif
    /* softmax numerators per query head: whole vectors, then a scalar tail */
    const int64_t whole = n - n % VW;
    for (int qh = 0; qh < num_q_heads; qh++) {
        float *sr = scores + (int64_t)qh * n;
        vec vm = v_set1(-3.0e38f);
        for (int64_t j = 0; j < whole; j += VW) vm = v_max(vm, v_loadf(sr + j));
        float m = v_hmax(vm);
        for (int64_t j = whole; j < n; j++) m = sr[j] > m ? sr[j] : m;
        const vec bm = v_set1(m);
        vec vl = v_zero();
        for (int64_t j = 0; j < whole; j += VW) {
            const vec e = v_exp(v_sub(v_loadf(sr + j), bm));
            v_storef(sr + j, e);
            vl = v_add(vl, e);
        }
        float l = v_sum(vl);
        for (int64_t j = whole; j < n; j++) { const float e = exp_nonpos(sr[j] - m); sr[j] = e; l += e; }
        part_m[qh] = m;
        part_l[qh] = l;
    }
    /* pass 2: part_acc[qh] = sum_j p[qh, j] * V[j] */
#if VW == 8
    /* AVX2 has 16 vector registers, too few for G * NV accumulators (SmolLM2: 3 * 8). So up to
     * VBUF_ROWS V rows of one kv head are widened to fp32 once into vbuf (L1), then each of its
     * query heads walks them with (up to 8 of) its accumulators in registers, read from and
     * written to part_acc once per pass over vbuf instead of once per row. The products are
     * added in row order, as one row at a time would. */
    memset(part_acc, 0, sizeof(float) * num_q_heads * D);
    float vbuf[VBUF_ROWS * MAX_VECTOR_D];
    for (int64_t t = k0; t < k1;) {
        int64_t count;
        const int64_t row0 = block_run(table, t, k1, block_size, num_blocks, stride_blk,
                                       stride_tok, &count);
        if (row0 < 0) return -6;
        const char *next = block_start(v_cache, table, t / block_size + 1, (k1 - 1) / block_size,
                                       num_blocks, stride_blk, fmt);
        for (int64_t j0 = 0; j0 < count; j0 += VBUF_ROWS) {
            const int64_t rows = count - j0 < VBUF_ROWS ? count - j0 : VBUF_ROWS;
            for (int64_t j = 0; j < rows; j++) prefetch_row(next, j0 + j, row_bytes);
            for (int h = 0; h < num_kv_heads; h++) {
                for (int64_t j = 0; j < rows; j++)
                    for (int c = 0; c < NV; c++)
                        v_storef(vbuf + j * D + VW * c, v_load(
                            v_cache, row0 + (j0 + j) * stride_tok + h * stride_head + VW * c, fmt));
                for (int g = 0; g < G; g++) {
                    const float *prow = scores + (int64_t)(h * G + g) * n + (t - k0) + j0;
                    float *acc = part_acc + (int64_t)(h * G + g) * D;
                    for (int c0 = 0; c0 < NV; c0 += 8) {
                        const int nc = NV - c0 < 8 ? NV - c0 : 8;
                        vec a[8];
                        for (int c = 0; c < nc; c++) a[c] = v_loadf(acc + VW * (c0 + c));
                        for (int64_t j = 0; j < rows; j++) {
                            const vec p = v_set1(prow[j]);
                            for (int c = 0; c < nc; c++)
                                a[c] = v_fmadd(p, v_loadf(vbuf + j * D + VW * (c0 + c)), a[c]);
                        }
                        for (int c = 0; c < nc; c++) v_storef(acc + VW * (c0 + c), a[c]);
                    }
                }
            }
        }
        t += count;
    }
    if (unit != 1.0f)
        for (int64_t i = 0; i < (int64_t)num_q_heads * D; i += VW)
            v_storef(part_acc + i, v_mul(v_loadf(part_acc + i), v_set1(unit)));
#else
    for (int h = 0; h < num_kv_heads; h++) {
        vec acc[8][MAX_NV];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < NV; c++) acc[g][c] = v_zero();
        const float *prow = scores + (int64_t)h * G * n;
        for (int64_t t = k0; t < k1;) {
            int64_t count;
            const int64_t row0 = block_run(table, t, k1, block_size, num_blocks, stride_blk,
                                           stride_tok, &count);
            if (row0 < 0) return -6;
            const char *next = h == 0 ? block_start(v_cache, table, t / block_size + 1,
                                                    (k1 - 1) / block_size, num_blocks,
                                                    stride_blk, fmt) : NULL;
            for (int64_t j = 0; j < count; j++) {
                prefetch_row(next, j, row_bytes);
                const int64_t at = row0 + j * stride_tok + h * stride_head;
                vec v[MAX_NV];
                for (int c = 0; c < NV; c++) v[c] = v_load(v_cache, at + VW * c, fmt);
                for (int g = 0; g < G; g++) {
                    const vec p = v_set1(prow[g * n + (t - k0) + j]);
                    for (int c = 0; c < NV; c++) acc[g][c] = v_fmadd(p, v[c], acc[g][c]);
                }
            }
            t += count;
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < NV; c++)
                v_storef(part_acc + (int64_t)(h * G + g) * D + VW * c,
                         unit == 1.0f ? acc[g][c] : v_mul(acc[g][c], v_set1(unit)));
    }
#endif
    return 0;
}

/* Specialized decode tasks for D in {64, 128} (and 256 with AVX-512) and G in 1..8; -100 when
 * none fits. */
#define DECODE_CASE(D_, G_, FMT_)                                                              \
    case (D_) * 16 + (G_):                                                                     \
        return decode_fixed(q, k_cache, v_cache, stride_blk, stride_tok, stride_head,          \
                            table, num_blocks, block_size, k0, k1, num_kv_heads, (D_) / VW,    \
                            G_, scale, scores, part_m, part_l, part_acc, FMT_);
#define DECODE_CASES(D_, FMT_)                                                                 \
    DECODE_CASE(D_, 1, FMT_) DECODE_CASE(D_, 2, FMT_) DECODE_CASE(D_, 3, FMT_)                 \
    DECODE_CASE(D_, 4, FMT_) DECODE_CASE(D_, 5, FMT_) DECODE_CASE(D_, 6, FMT_)                 \
    DECODE_CASE(D_, 7, FMT_) DECODE_CASE(D_, 8, FMT_)
#if VW == 16
#define DECODE_CASES_256(FMT_) DECODE_CASES(256, FMT_)
#else
#define DECODE_CASES_256(FMT_)
#endif
#define DEFINE_DECODE_FIXED(SUFFIX, FMT_)                                                      \
static int decode_fixed_##SUFFIX(                                                             \
        const float *q, const void *k_cache, const void *v_cache, int64_t stride_blk,          \
        int64_t stride_tok, int64_t stride_head, const int32_t *table, int64_t num_blocks,    \
        int block_size, int64_t k0, int64_t k1, int num_kv_heads, int head_dim, int group,    \
        float scale, float *scores, float *part_m, float *part_l, float *part_acc) {           \
    if (group < 1 || group > 8 || head_dim > MAX_VECTOR_D                                     \
        || (head_dim != 64 && head_dim != 128 && head_dim != 256))                           \
        return -100;                                                                          \
    switch (head_dim * 16 + group) {                                                          \
        DECODE_CASES(64, FMT_)                                                                \
        DECODE_CASES(128, FMT_)                                                               \
        DECODE_CASES_256(FMT_)                                                                \
    }                                                                                         \
    return -100;                                                                              \
}
#else
#define HAVE_VECTOR 0
#define DEFINE_DECODE_FIXED(SUFFIX, FMT_)
#endif

/* Merge the partitions of one (row, head) line by log-sum-exp and store it normalized. Partition
 * p's max, sum and accumulator are m[p * stride], l[p * stride] and acc + p * stride. */
#define DEFINE_MERGE(SUFFIX, T, STORE)                                                         \
static __attribute__((unused)) void merge_##SUFFIX(const float *m, const float *l,          \
                           const float *acc, int64_t parts,                                  \
                           int64_t stride, int D, T *out) {                                   \
    float mx = -3.0e38f;                                                                      \
    for (int64_t p = 0; p < parts; p++)                                                       \
        if (l[p * stride] > 0.0f && m[p * stride] > mx) mx = m[p * stride];                   \
    float total = 0.0f;                                                                       \
    float o[MAX_HEAD_DIM];                                                                    \
    for (int d = 0; d < D; d++) o[d] = 0.0f;                                                  \
    for (int64_t p = 0; p < parts; p++) {                                                     \
        const float lp = l[p * stride];                                                       \
        if (lp <= 0.0f) continue;                                                             \
        const float w = exp_nonpos(m[p * stride] - mx);                                       \
        total += lp * w;                                                                      \
        const float *a = acc + p * stride;                                                    \
        for (int d = 0; d < D; d++) o[d] += w * a[d];                                         \
    }                                                                                         \
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;                                     \
    for (int d = 0; d < D; d++) STORE(out, d, o[d] * inv);                                    \
}

DEFINE_MERGE(f32, float, store_f32)

#if HAVE_VECTOR
#define DECODE_FIXED_CALL(SUFFIX, b, k0, k1, scores, pm, pl, pacc)                              \
    decode_fixed_##SUFFIX(q + b * H * D, k_cache, v_cache, stride_blk, stride_tok, stride_head, \
                          block_tables + b * table_stride, num_blocks, block_size, k0, k1,     \
                          num_kv_heads, head_dim, num_q_heads / num_kv_heads, scale, scores,   \
                          pm, pl, pacc)
#else
#define DECODE_FIXED_CALL(SUFFIX, b, k0, k1, scores, pm, pl, pacc) (-100)
#endif

/* task_pool.c: run fn(ctx, 0 .. ntasks - 1) on up to num_threads threads; per-thread scratch.
 * Hidden: every feature's library links a copy of the pool (kernels/native/features.py), and each
 * must call its own copy and export only its kernels (the ctypes tables). */
typedef void (*task_fn)(void *ctx, int64_t task);
__attribute__((visibility("hidden"))) void pa_run_tasks(int num_threads, task_fn fn, void *ctx,
                                                        int64_t ntasks);
__attribute__((visibility("hidden"))) float *pa_thread_scratch(int64_t floats);

/* A linear's panels as tasks: ~8 a thread of `per` panels each (even shares when one thread is
 * slowed, few claims, and a task prefetches its next panel), then the last ~1/8 of the panels in
 * small tasks of about TAIL_MACS multiply-adds (one panel when rows make a panel long). Tasks are
 * claimed in order, so the small ones come last and even out the threads' ends: the thread done
 * first waits about one small task, not one big one (at 54 rows, AVX2, a big task of the LM head
 * was ~4.7 ms). */
#define TAIL_MACS (1 << 18)
typedef struct { int64_t per, tail_per, big_tasks, big_end, num_panels; } panel_tasks;
static inline panel_tasks pa_panel_tasks(int64_t num_panels, int threads, int64_t panel_macs) {
    panel_tasks t = {num_panels / ((int64_t)(threads < 1 ? 1 : threads) * 8), 1, 0, 0, num_panels};
    if (t.per < 1) t.per = 1;
    if (panel_macs > 0 && panel_macs < TAIL_MACS) t.tail_per = TAIL_MACS / panel_macs;
    if (t.tail_per > t.per) t.tail_per = t.per;
    t.big_tasks = (num_panels - num_panels / 8) / t.per;
    t.big_end = t.big_tasks * t.per;
    return t;
}
static inline int64_t pa_task_count(const panel_tasks *t) {
    return t->big_tasks + (t->num_panels - t->big_end + t->tail_per - 1) / t->tail_per;
}
/* task's panels: [*first, *last) */
static inline void pa_task_panels(const panel_tasks *t, int64_t task, int64_t *first,
                                  int64_t *last) {
    const int big = task < t->big_tasks;
    *first = big ? task * t->per : t->big_end + (task - t->big_tasks) * t->tail_per;
    *last = *first + (big ? t->per : t->tail_per);
    if (*last > t->num_panels) *last = t->num_panels;
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    int64_t stride_blk, stride_tok, stride_head, num_blocks, table_stride, table_width;
    const int32_t *block_tables, *context_lens;
    int num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, part_tokens, max_parts;
    int window;
    float scale;
    float *workspace;
    _Atomic int status;
} decode_job;

#define DEFINE_DECODE(SUFFIX, T)                                                               \
static void decode_task_##SUFFIX(void *arg, int64_t task) {                                   \
    decode_job *job = arg;                                                                    \
    const float *q = job->q;                                                                  \
    const T *k_cache = job->k_cache, *v_cache = job->v_cache;                                 \
    const int64_t stride_blk = job->stride_blk, stride_tok = job->stride_tok;                 \
    const int64_t stride_head = job->stride_head, num_blocks = job->num_blocks;               \
    const int32_t *block_tables = job->block_tables;                                          \
    const int64_t table_stride = job->table_stride;                                           \
    const int num_q_heads = job->num_q_heads, num_kv_heads = job->num_kv_heads;               \
    const int head_dim = job->head_dim, block_size = job->block_size;                         \
    const float scale = job->scale;                                                           \
    const int64_t H = num_q_heads, D = head_dim, line_floats = D + 2;                         \
    const int64_t max_parts = job->max_parts, part_tokens = job->part_tokens;                 \
    const int64_t b = task / max_parts, p = task % max_parts;                                 \
    const int64_t ctx = job->context_lens[b];                                                 \
    /* the window's first key, and partitions counted from the start of its block; the      \
     * row's partition size depends on its own context alone (at most max_parts partitions  \
     * of at least part_tokens, whole blocks), so its sums do not depend on the batch */     \
    const int64_t first = job->window > 0 && ctx > job->window ? ctx - job->window : 0;      \
    const int64_t start = first - first % block_size;                                         \
    int64_t part = (ctx - start + max_parts - 1) / max_parts;                                 \
    part = part < part_tokens ? part_tokens : (part + block_size - 1) / block_size * block_size;\
    int64_t k0 = start + p * part;                                                            \
    float *base = job->workspace + task * H * line_floats;                                    \
    float *pm = base, *pl = base + H, *pacc = base + 2 * H;                                   \
    if (ctx < 1 || ctx > job->table_width * block_size) { job->status = -5; return; }        \
    if (k0 >= ctx) { for (int64_t h = 0; h < H; h++) pl[h] = 0.0f; return; }                \
    const int64_t k1 = ctx < k0 + part ? ctx : k0 + part;                                     \
    if (k0 < first) k0 = first;                                                               \
    float *qf = pa_thread_scratch(H * D + H * part);                                          \
    if (!qf) { job->status = -4; return; }                                                    \
    float *scores = qf + H * D;                                                               \
    int rc = DECODE_FIXED_CALL(SUFFIX, b, k0, k1, scores, pm, pl, pacc);                                   \
    if (rc == -100)                                                                           \
        rc = attend_##SUFFIX(q + b * H * D, k_cache, v_cache, stride_blk,                     \
                             stride_tok, stride_head, block_tables + b * table_stride,        \
                             num_blocks, block_size, k0, k1, num_q_heads, num_kv_heads,       \
                             head_dim, scale, qf, scores, pm, pl, pacc);                      \
    if (rc) job->status = rc;                                                                 \
}                                                                                             \
                                                                                              \
/* Merge tasks: MERGE_LINES (sequence, head) lines each. */                                  \
static void merge_task_##SUFFIX(void *arg, int64_t task) {                                    \
    decode_job *job = arg;                                                                    \
    const int64_t H = job->num_q_heads, D = job->head_dim, line_floats = D + 2;              \
    const int64_t lines = (int64_t)job->num_seqs * H;                                         \
    const int64_t end = (task + 1) * MERGE_LINES < lines ? (task + 1) * MERGE_LINES : lines;  \
    for (int64_t line = task * MERGE_LINES; line < end; line++) {                             \
        const int64_t b = line / H, h = line % H;                                             \
        const float *base = job->workspace + b * job->max_parts * H * line_floats;            \
        merge_f32(base + h, base + H + h, base + 2 * H + h * D, job->max_parts,               \
                  H * line_floats, (int)D, (float *)job->out + line * D);                     \
    }                                                                                         \
}                                                                                             \
                                                                                              \
int paged_decode_##SUFFIX(                                                                    \
        const float *q, float *out, const T *k_cache, const T *v_cache, int64_t stride_blk,  \
        int64_t stride_tok, int64_t stride_head, int64_t num_blocks,                        \
        const int32_t *block_tables, int64_t table_stride, int64_t table_width,             \
        const int32_t *context_lens, int num_seqs, int num_q_heads, int num_kv_heads,        \
        int head_dim, int block_size, float scale, int window, int part_tokens,              \
        int max_parts, float *workspace, int num_threads) {                                   \
    if (head_dim > MAX_HEAD_DIM || head_dim <= 0) return -1;                                  \
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads) return -2;                           \
    if (part_tokens <= 0 || part_tokens % block_size) return -3;                              \
    decode_job job = {q, k_cache, v_cache, out, stride_blk, stride_tok, stride_head,          \
                      num_blocks, table_stride, table_width, block_tables, context_lens,       \
                      num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, part_tokens, \
                      max_parts, window, scale, workspace, 0};                                \
    pa_run_tasks(num_threads, decode_task_##SUFFIX, &job, (int64_t)num_seqs * max_parts);        \
    if (job.status) return job.status;                                                        \
    const int64_t lines = (int64_t)num_seqs * num_q_heads;                                    \
    pa_run_tasks(num_threads, merge_task_##SUFFIX, &job, (lines + MERGE_LINES - 1) / MERGE_LINES);\
    return 0;                                                                                 \
}


#define MERGE_LINES 64

/* One cache format's entry point paged_decode_<SUFFIX>: the portable task, the vector tasks
 * (where the ISA has them) and the driver. */
#define DEFINE_FORMAT(SUFFIX, T, LOAD, FMT_)                                                    \
    DEFINE_TASK(SUFFIX, T, LOAD)                                                               \
    DEFINE_DECODE_FIXED(SUFFIX, FMT_)                                                          \
    DEFINE_DECODE(SUFFIX, T)

#endif

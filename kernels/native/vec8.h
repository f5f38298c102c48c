/* 8-lane fp32 vectors (GCC vector extensions: AVX2 with -march=native, narrower elsewhere) and
 * their loads and stores from fp32 and bf16 memory, for the linears and the elementwise kernels.
 * bf16 -> fp32 is exact (a bf16 is the top half of an fp32); fp32 -> bf16 rounds half to even
 * and writes NaN as 0x7fc0, as torch does. */
#ifndef PAGEDSERVE_VEC8_H
#define PAGEDSERVE_VEC8_H

#include <stdint.h>
#include <string.h>

#include "paged_attention.h"   /* bf16_t, load_bf16 */

#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8w __attribute__((vector_size(32)));

static inline v8 load8_f32(const float *p) { return *(const v8u *)p; }
static inline void store8_f32(float *p, v8 v) { *(v8u *)p = v; }

/* Zero-extend 8 bf16 to 32 bits (vpmovzxwd from memory), then shift into the top half. No
 * constant is needed: the linears' 6-row kernel holds 12 accumulators, 2 weight vectors and a
 * broadcast of x, 15 of AVX2's 16 registers. */
static inline v8 load8_bf16(const bf16_t *p) {
#ifdef __AVX2__
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
    return (v8)(__builtin_convertvector(*(const v8h *)p, v8w) << 16);
#endif
}

static inline bf16_t bf16_round(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;   /* NaN */
    return (bf16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* The bf16 rounding of each lane, as fp32 (NaN stays NaN). */
static inline v8 round8_bf16(v8 v) {
    const v8w bits = (v8w)v;
    const v8w nan = (v8w)((bits & 0x7fffffffu) > 0x7f800000u);
    const v8w rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return (v8)((rounded & ~nan) | (bits & nan));
}

static inline void store8_bf16(bf16_t *p, v8 v) {
#ifdef __AVX2__
    const v8w bits = (v8w)v;
    const v8w rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const v8w nan = (v8w)((bits & 0x7fffffffu) > 0x7f800000u);
    const __m256i halves = (__m256i)((rounded & ~nan) | (0x7fc0u & nan));
    /* pack the eight 16-bit values (each lane's low half) into the low 128 bits */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
#else
    for (int lane = 0; lane < 8; lane++) p[lane] = bf16_round(v[lane]);
#endif
}

/* Element access by type, for kernels written once for both: `bf` is a constant in each
 * always-inlined instantiation (0: fp32, 1: bf16), so the branches fold away. */
#define INLINE static inline __attribute__((always_inline))
INLINE float ld1(const void *p, int64_t i, int bf) {
    return bf ? load_bf16((const bf16_t *)p, i) : ((const float *)p)[i];
}
INLINE void st1(void *p, int64_t i, float v, int bf) {
    if (bf) ((bf16_t *)p)[i] = bf16_round(v); else ((float *)p)[i] = v;
}
/* the start of row `row` of a matrix at base whose rows are `ld` elements apart */
INLINE const void *row_of(const void *base, int64_t row, int64_t ld, int bf) {
    return (const char *)base + row * ld * (bf ? 2 : 4);
}

#endif

/* The AVX2 wide passes' inner loops (kernels/native/gguf_wide_avx2.h) on data that stays in L1:
 * what their instruction mix alone reaches on one core, for scripts/bench_isa_limits.py. Each
 * call runs `iters` blocks of 32 k of one half panel (8 columns) against 4 rows of x, as the
 * kernel's passes do (Q8_0: sign, multiply, widen, add a quad; Q5_0: runs of 4 quads in int16
 * lanes; int16: the vpmaddwd form an int16 panel would take), each block's fp32 term included.
 * The inputs cycle through 16 KiB so that no load can be hoisted; returns a checksum. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SPAN 16384   /* bytes of panel and of x the loops cycle through */
static uint8_t panel[2 * SPAN] __attribute__((aligned(64)));
static int8_t xq[SPAN + 4 * 64] __attribute__((aligned(64)));
static float scales[SPAN / 32 + 64] __attribute__((aligned(64)));

void isa_limits_init(void) {
    for (int i = 0; i < 2 * SPAN; i++) panel[i] = (uint8_t)(i * 37 + 11);
    for (int i = 0; i < SPAN + 4 * 64; i++) xq[i] = (int8_t)((i * 53 + 7) % 255 - 127);
    for (int i = 0; i < SPAN / 32 + 64; i++) scales[i] = 1e-3f * (float)(i % 13 + 1);
}

static inline __m256i quad(const int8_t *x) {
    int32_t q;
    memcpy(&q, x, 4);
    return _mm256_set1_epi32(q);
}

/* a block's fp32 terms, as the kernel adds them: acc[r] += (d d_r) I1[r] for each of the 4 rows */
static inline void block_terms(__m256 acc[4], const __m256i i1[4], long it) {
    const __m256 d = _mm256_loadu_ps(scales + (it % 64) * 8);
    for (int r = 0; r < 4; r++)
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(scales[(it + r) % 64])),
                                                     _mm256_cvtepi32_ps(i1[r])));
}

/* every row's sums into one number, so that none of the work can be dropped */
static inline float checksum(const __m256 acc[4]) {
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    return out[0] + out[7];
}

float isa_limits_q8_0(long iters) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long it = 0; it < iters; it++) {
        const long at = (it * 256) % SPAN, xa = (it * 32) % SPAN;
        __m256i i1[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 1
        for (int q = 0; q < 8; q++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(panel + at + 32 * q));
            const __m256i u = _mm256_abs_epi8(w);
            for (int r = 0; r < 4; r++)
                i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                    u, _mm256_sign_epi8(quad(xq + xa + 64 * r + 4 * q), w)), ones));
        }
        block_terms(acc, i1, it);
    }
    return checksum(acc);
}

float isa_limits_q5_0(long iters) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long it = 0; it < iters; it++) {
        const long at = (it * 256) % SPAN, xa = (it * 32) % SPAN;
        __m256i i1[4];
        for (int r = 0; r < 4; r++) i1[r] = _mm256_set1_epi32((int32_t)xq[xa + r]);   /* -z s */
        for (int q0 = 0; q0 < 8; q0 += 4) {
            __m256i w[4];
            for (int q = 0; q < 4; q++)
                w[q] = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(panel + at + 32 * (q0 + q))),
                                        _mm256_set1_epi8(31));
            for (int r = 0; r < 4; r++) {
                __m256i t = _mm256_setzero_si256();
                for (int q = 0; q < 4; q++)
                    t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w[q], quad(xq + xa + 64 * r + 4 * (q0 + q))));
                i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(t, ones));
            }
        }
        block_terms(acc, i1, it);
    }
    return checksum(acc);
}

float isa_limits_int16(long iters) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long it = 0; it < iters; it++) {
        const long at = (it * 512) % (2 * SPAN), xa = (it * 64) % SPAN;
        __m256i i1[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 2
        for (int p = 0; p < 16; p++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(panel + at + 32 * p));
            for (int r = 0; r < 4; r++)
                i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(w, quad(xq + xa + 64 * r + 4 * p)));
        }
        block_terms(acc, i1, it);
    }
    return checksum(acc);
}

/* Q6_K: runs of 2 quads, each run widened by its group's scales; two groups' mins in one
 * vpmaddwd (the fp32 terms come once per 256 k: left out) */
float isa_limits_q6_k(long iters) {
    __m256i i1[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    __m256i i2[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (long it = 0; it < iters; it++) {
        const long at = (it * 256) % SPAN, xa = (it * 32) % SPAN;
        for (int g = 0; g < 2; g++) {
            const __m256i sc = _mm256_loadu_si256((const __m256i *)(panel + SPAN + (at + 32 * g) % SPAN));
            for (int q0 = 4 * g; q0 < 4 * g + 4; q0 += 2) {
                const __m256i w0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(panel + at + 32 * q0)),
                                                    _mm256_set1_epi8(63));
                const __m256i w1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(panel + at + 32 * q0 + 32)),
                                                    _mm256_set1_epi8(63));
                for (int r = 0; r < 4; r++) {
                    const __m256i t = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w0, quad(xq + xa + 64 * r + 4 * q0)),
                        _mm256_maddubs_epi16(w1, quad(xq + xa + 64 * r + 4 * q0 + 4)));
                    i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(t, sc));
                }
            }
        }
        const __m256i mc = _mm256_loadu_si256((const __m256i *)(panel + SPAN + at));
        for (int r = 0; r < 4; r++)
            i2[r] = _mm256_add_epi32(i2[r], _mm256_madd_epi16(mc, quad(xq + xa + 64 * r + 32)));
    }
    int32_t out[8];
    __m256i sum = _mm256_setzero_si256();
    for (int r = 0; r < 4; r++) sum = _mm256_add_epi32(sum, _mm256_sub_epi32(i1[r], i2[r]));
    _mm256_storeu_si256((__m256i *)out, sum);
    return (float)(out[0] + out[7]);
}

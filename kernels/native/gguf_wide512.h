/* gguf_wide.h's panel product with AVX-512 (BW + VNNI): a panel's 16 columns by one quad of k are
 * 64 bytes, one zmm, so a broadcast quad of x meets all 16 columns in one vpdpbusd (the
 * 32-element types) or one vpmaddubsw + vpmaddwd (the k-quants), and 6 rows of x share each
 * weight load. The integer sums are exact and the fp32 terms are gguf_wide.h's, lane by lane,
 * in block order: the same bits as every other path. Included by gguf_wide.h. */
#ifndef PAGEDSERVE_GGUF_WIDE512_H
#define PAGEDSERVE_GGUF_WIDE512_H

static inline __m512i quad512_of(const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, 4);
    return _mm512_set1_epi32(quad);
}

/* acc += the block's terms d da I1 - dm da I2 for the panel's 16 columns */
static inline __m512 wide512_terms(__m512 acc, const wide_panel *p, int64_t b, float da,
                                   __m512i i1, __m512i i2) {
    const __m512 dav = _mm512_set1_ps(da);
    const __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(p->d + b * WIDE), dav);
    const __m512 s2 = _mm512_mul_ps(_mm512_loadu_ps(p->dm + b * WIDE), dav);
    return _mm512_add_ps(acc, _mm512_sub_ps(_mm512_mul_ps(s1, _mm512_cvtepi32_ps(i1)),
                                            _mm512_mul_ps(s2, _mm512_cvtepi32_ps(i2))));
}

/* Q8_0's signed weight bytes: |w| times x with w's sign (vpsignb has no zmm form; x is never
 * -128, so negating it is exact) */
static inline __m512i signed_dot512(__m512i acc, __m512i w, __m512i x) {
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const __m512i sx = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
    return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(w), sx);
}

/* the 32-element types: one block's integer sums for ROWS rows of x */
#define WIDE512_BLOCK_32(ROWS)                                                                   \
    for (int q = 0; q < 8; q++) {                                                                \
        const __m512i wv = _mm512_loadu_si512(p->wq + (b * 8 + q) * WIDE * 4);                   \
        for (int r = 0; r < ROWS; r++) {                                                         \
            const __m512i xv = quad512_of(xq + r * K + 32 * b + 4 * q);                          \
            i1[r] = info->signed_u ? signed_dot512(i1[r], wv, xv)                                \
                                   : _mm512_dpbusd_epi32(i1[r], wv, xv);                         \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < ROWS; r++) {                                                             \
        const int16_t *s = xs + r * (K / 16) + 2 * b;                                            \
        const int32_t sum = (int32_t)s[0] + (int32_t)s[1];                                       \
        i1[r] = _mm512_sub_epi32(i1[r], _mm512_set1_epi32(info->zero * sum));                    \
        i2[r] = _mm512_set1_epi32(sum);                                                          \
    }

/* the k-quants: one super-block's integer sums, group scales by vpmaddwd */
#define WIDE512_BLOCK_K(ROWS)                                                                    \
    for (int64_t g = 16 * b; g < 16 * b + 16; g++) {                                             \
        const __m512i sc = _mm512_loadu_si512(p->sc + g * WIDE * 2);                             \
        const __m512i mc = _mm512_loadu_si512(p->mc + g * WIDE);                                 \
        for (int q = 0; q < 4; q++) {                                                            \
            const __m512i wv = _mm512_loadu_si512(p->wq + (g * 4 + q) * WIDE * 4);               \
            for (int r = 0; r < ROWS; r++)                                                       \
                i1[r] = _mm512_add_epi32(i1[r], _mm512_madd_epi16(                               \
                    _mm512_maddubs_epi16(wv, quad512_of(xq + r * K + 16 * g + 4 * q)), sc));     \
        }                                                                                        \
        for (int r = 0; r < ROWS; r++)                                                           \
            i2[r] = _mm512_add_epi32(i2[r], _mm512_mullo_epi32(                                  \
                mc, _mm512_set1_epi32(xs[r * (K / 16) + g])));                                   \
    }

#define DEFINE_WIDE_ROWS(ROWS)                                                                   \
static void wide_rows_##ROWS(const wide_panel *p, const qtype_info *info, const int8_t *xq,     \
                             const float *xd, const int16_t *xs, const int32_t *xz, int64_t K,   \
                             float out[WIDE_ROWS][WIDE]) {                                       \
    (void)xz;                                  /* only AVX2's packed panels pass offsets */      \
    const int64_t blocks = K / info->block;                                                      \
    __m512 acc[ROWS];                                                                            \
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();                                 \
    for (int64_t b = 0; b < blocks; b++) {                                                       \
        __m512i i1[ROWS], i2[ROWS];                                                              \
        for (int r = 0; r < ROWS; r++) i1[r] = i2[r] = _mm512_setzero_si512();                   \
        if (!info->kquant) {                                                                     \
            WIDE512_BLOCK_32(ROWS)                                                               \
        } else {                                                                                 \
            WIDE512_BLOCK_K(ROWS)                                                                \
        }                                                                                        \
        for (int r = 0; r < ROWS; r++)                                                           \
            acc[r] = wide512_terms(acc[r], p, b, xd[r * blocks + b], i1[r], i2[r]);              \
    }                                                                                            \
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(out[r], acc[r]);                             \
}
DEFINE_WIDE_ROWS(1)
DEFINE_WIDE_ROWS(2)
DEFINE_WIDE_ROWS(3)
DEFINE_WIDE_ROWS(4)
DEFINE_WIDE_ROWS(5)
DEFINE_WIDE_ROWS(6)
typedef void (*wide_rows_t)(const wide_panel *, const qtype_info *, const int8_t *, const float *,
                            const int16_t *, const int32_t *, int64_t, float[WIDE_ROWS][WIDE]);
static const wide_rows_t wide_rows_fn[WIDE_ROWS] = {wide_rows_1, wide_rows_2, wide_rows_3,
                                                    wide_rows_4, wide_rows_5, wide_rows_6};

#endif

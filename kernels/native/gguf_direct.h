/* linear_gguf.c for up to DIRECT_MAX_ROWS rows of x (decode): the weight's blocks unpacked in
 * registers straight from its bytes, 4 rows of W at a time, with the integer sums and fp32 terms
 * of the row paths (gguf_unpack.h), so the same bits. AVX2 (and VNNI where present); elsewhere
 * direct_for() is NULL and the row paths run. Included by linear_gguf.c after DOT_U8S8, hsum4
 * and PANEL. */
#ifndef PAGEDSERVE_GGUF_DIRECT_H
#define PAGEDSERVE_GGUF_DIRECT_H

#ifdef __AVX2__
/* Few rows of x (decode): the 32-element types' blocks unpacked in registers, straight from the
 * weight's bytes, with the same integer sums and fp32 terms as dot_panel_32 (no store of the
 * unpacked rows, no scale transposition). QTYPE is a constant in each instantiation. */
/* The 4 rows' block terms d da I1 - dm da I2 (the row paths' block_term, lane by lane) */
static inline __m128 direct_terms(const float d[4], const float dm[4], float da, __m128i i1,
                                  __m128i i2) {
    const __m128 dav = _mm_set1_ps(da);
    const __m128 s1 = _mm_mul_ps(_mm_loadu_ps(d), dav), s2 = _mm_mul_ps(_mm_loadu_ps(dm), dav);
    return _mm_sub_ps(_mm_mul_ps(s1, _mm_cvtepi32_ps(i1)), _mm_mul_ps(s2, _mm_cvtepi32_ps(i2)));
}

static inline __m256i direct_bytes(int qtype, const uint8_t *blk, float *d, float *dm) {
    switch (qtype) {
        case T_Q4_0: *d = load_half(blk); *dm = 8.0f * *d; return nibbles32_vec(blk + 2);
        case T_Q4_1: *d = load_half(blk); *dm = -load_half(blk + 2); return nibbles32_vec(blk + 4);
        case T_Q5_0: {
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            *d = load_half(blk);
            *dm = 16.0f * *d;
            return _mm256_or_si256(nibbles32_vec(blk + 6), _mm256_and_si256(
                bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
        }
        case T_Q8_0:
            *d = load_half(blk);
            *dm = 0.0f;
            return _mm256_loadu_si256((const __m256i *)(blk + 2));
        default: {   /* I4G */
            float m;
            memcpy(d, blk, 4);
            memcpy(&m, blk + 4, 4);
            *dm = -m;
            return nibbles32_vec(blk + 8);
        }
    }
}

#define DEFINE_DIRECT(NAME, QTYPE, BYTES)                                                       \
static void NAME(const uint8_t *w, int64_t stride, int live, const int8_t *xq, const float *xd, \
                 const int16_t *xs, int64_t K, float out[PANEL]) {                              \
    const uint8_t *rows[PANEL];                                                                 \
    for (int r = 0; r < PANEL; r++) rows[r] = w + (r < live ? r : live - 1) * stride;           \
    __m128 acc = _mm_setzero_ps();                                                              \
    for (int64_t b = 0; b < K / 32; b++) {                                                      \
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));                   \
        __m256i v[PANEL];                                                                       \
        float d[PANEL], dm[PANEL];                                                              \
        for (int r = 0; r < PANEL; r++) {                                                       \
            const __m256i u = direct_bytes(QTYPE, rows[r] + BYTES * b, &d[r], &dm[r]);          \
            v[r] = QTYPE == T_Q8_0 ? DOT_U8S8(_mm256_abs_epi8(u), _mm256_sign_epi8(a, u))      \
                                   : DOT_U8S8(u, a);                                            \
        }                                                                                       \
        acc = _mm_add_ps(acc, direct_terms(d, dm, xd[b], hsum4(v[0], v[1], v[2], v[3]),       \
            _mm_set1_epi32((int32_t)xs[2 * b] + (int32_t)xs[2 * b + 1])));                       \
    }                                                                                           \
    _mm_storeu_ps(out, acc);                                                                    \
}
DEFINE_DIRECT(direct_q4_0, T_Q4_0, 18)
DEFINE_DIRECT(direct_q4_1, T_Q4_1, 20)
DEFINE_DIRECT(direct_q5_0, T_Q5_0, 22)
DEFINE_DIRECT(direct_q8_0, T_Q8_0, 34)
DEFINE_DIRECT(direct_i4g, T_I4G, 24)


/* The same for Q4_K and Q6_K: a super-block of 256, its group scales applied by vpmaddwd */
static void direct_q4_k(const uint8_t *w, int64_t stride, int live, const int8_t *xq,
                        const float *xd, const int16_t *xs, int64_t K, float out[PANEL]) {
    const uint8_t *rows[PANEL];
    for (int r = 0; r < PANEL; r++) rows[r] = w + (r < live ? r : live - 1) * stride;
    __m128 acc = _mm_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < K / 256; b++) {
        __m256i v[PANEL];
        int32_t i2[PANEL];
        int16_t sc[PANEL][16], mc[PANEL][16];
        float d[PANEL], dm[PANEL];
        for (int r = 0; r < PANEL; r++) {
            const uint8_t *blk = rows[r] + 144 * b;
            int16_t sc2[128];
            d[r] = load_half(blk);
            dm[r] = load_half(blk + 2);
            kquant_scales(blk + 4, sc2, mc[r]);
            for (int j = 0; j < 8; j++) sc[r][j] = sc2[16 * j];
            i2[r] = 0;
            for (int g = 0; g < 16; g++) i2[r] += mc[r][g] * (int32_t)xs[16 * b + g];
            v[r] = _mm256_setzero_si256();
        }
        for (int i = 0; i < 4; i++) {
            const __m256i a_lo = _mm256_loadu_si256((const __m256i *)(xq + 256 * b + 64 * i));
            const __m256i a_hi = _mm256_loadu_si256((const __m256i *)(xq + 256 * b + 64 * i + 32));
            for (int r = 0; r < PANEL; r++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(rows[r] + 144 * b + 16 + 32 * i));
                const __m256i lo = _mm256_and_si256(q, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                v[r] = _mm256_add_epi32(v[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a_lo),
                                                                _mm256_set1_epi16(sc[r][2 * i])));
                v[r] = _mm256_add_epi32(v[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a_hi),
                                                                _mm256_set1_epi16(sc[r][2 * i + 1])));
            }
        }
        acc = _mm_add_ps(acc, direct_terms(d, dm, xd[b], hsum4(v[0], v[1], v[2], v[3]),
                                           _mm_loadu_si128((const __m128i *)i2)));
    }
    _mm_storeu_ps(out, acc);
}

static void direct_q6_k(const uint8_t *w, int64_t stride, int live, const int8_t *xq,
                        const float *xd, const int16_t *xs, int64_t K, float out[PANEL]) {
    const uint8_t *rows[PANEL];
    for (int r = 0; r < PANEL; r++) rows[r] = w + (r < live ? r : live - 1) * stride;
    __m128 acc = _mm_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < K / 256; b++) {
        __m256i v[PANEL];
        int32_t i2[PANEL];
        float d[PANEL], dm[PANEL];
        for (int r = 0; r < PANEL; r++) {
            const uint8_t *blk = rows[r] + 210 * b;
            const int8_t *scales = (const int8_t *)(blk + 192);
            d[r] = load_half(blk + 208);
            dm[r] = 32.0f * d[r];
            i2[r] = 0;
            for (int g = 0; g < 16; g++) i2[r] += scales[g] * (int32_t)xs[16 * b + g];
            v[r] = _mm256_setzero_si256();
        }
        for (int h = 0; h < 2; h++) {
            __m256i a[4];
            for (int c = 0; c < 4; c++)
                a[c] = _mm256_loadu_si256((const __m256i *)(xq + 256 * b + 128 * h + 32 * c));
            for (int r = 0; r < PANEL; r++) {
                const uint8_t *blk = rows[r] + 210 * b;
                const int8_t *scales = (const int8_t *)(blk + 192);
                const __m256i q1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                const __m256i q2 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m256i c[4];
                c[0] = _mm256_or_si256(_mm256_and_si256(q1, low4),
                                       _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
                c[1] = _mm256_or_si256(_mm256_and_si256(q2, low4), _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4));
                c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q1, 4), low4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), two), 4));
                c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q2, 4), low4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), two), 4));
                for (int k = 0; k < 4; k++) {
                    const int g = 8 * h + 2 * k;
                    const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(scales[g + 1]),
                                                         _mm_set1_epi16(scales[g]));
                    v[r] = _mm256_add_epi32(v[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(c[k], a[k]), scv));
                }
            }
        }
        acc = _mm_add_ps(acc, direct_terms(d, dm, xd[b], hsum4(v[0], v[1], v[2], v[3]),
                                           _mm_loadu_si128((const __m128i *)i2)));
    }
    _mm_storeu_ps(out, acc);
}

typedef void (*direct_fn)(const uint8_t *, int64_t, int, const int8_t *, const float *,
                          const int16_t *, int64_t, float *);

static direct_fn direct_for(int qtype) {
    switch (qtype) {
        case T_Q4_K: return direct_q4_k;
        case T_Q6_K: return direct_q6_k;
        case T_Q4_0: return direct_q4_0;
        case T_Q4_1: return direct_q4_1;
        case T_Q5_0: return direct_q5_0;
        case T_Q8_0: return direct_q8_0;
        case T_I4G: return direct_i4g;
        default: return NULL;
    }
}
#define DIRECT_MAX_ROWS 3   /* rows of x up to which unpacking in registers beats unpacking once */
#else
typedef void (*direct_fn)(const uint8_t *, int64_t, int, const int8_t *, const float *,
                          const int16_t *, int64_t, float *);
static direct_fn direct_for(int qtype) { (void)qtype; return NULL; }
#define DIRECT_MAX_ROWS 0
#endif

#endif

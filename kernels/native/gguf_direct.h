/* linear_gguf.c for up to direct_max_rows() rows of x (decode): the weight's blocks unpacked in
 * registers straight from its bytes, 4 rows of W at a time, with the integer sums and fp32 terms
 * of the row paths (gguf_unpack.h), so the same bits. AVX2 (and VNNI where present); elsewhere
 * direct_for() is NULL and the row paths run. Included by linear_gguf.c after DOT_U8S8, hsum4
 * and PANEL. */
#ifndef PAGEDSERVE_GGUF_DIRECT_H
#define PAGEDSERVE_GGUF_DIRECT_H

#include "prefetch.h"

/* ahead: prefetch the next panel's weights (the first row of x; the others find them cached) */
typedef void (*direct_fn)(const uint8_t *, int64_t, int, const int8_t *, const float *,
                          const int16_t *, int64_t, float *, int);

#ifdef __AVX2__
/* Few rows of x (decode): the 32-element types' blocks unpacked in registers, straight from the
 * weight's bytes, with the same integer sums and fp32 terms as dot_panel_32 (no store of the
 * unpacked rows, no scale transposition). QTYPE is a constant in each instantiation. */
/* The 4 rows' block terms d da I1 - dm da I2 (the row paths' block_term, lane by lane) */
static inline __m128 direct_terms(__m128 d, __m128 dm, float da, __m128i i1, __m128i i2) {
    const __m128 dav = _mm_set1_ps(da);
    const __m128 s1 = _mm_mul_ps(d, dav), s2 = _mm_mul_ps(dm, dav);
    return _mm_sub_ps(_mm_mul_ps(s1, _mm_cvtepi32_ps(i1)), _mm_mul_ps(s2, _mm_cvtepi32_ps(i2)));
}

/* The 4 rows' fp16 at byte `at` of their block, as fp32 lanes (one conversion, not four) */
static inline __m128 direct_halves(const uint8_t *const p[PANEL], int64_t at) {
    uint16_t h[PANEL];
    for (int r = 0; r < PANEL; r++) memcpy(&h[r], p[r] + at, 2);
#ifdef __F16C__
    return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3],
                                       0, 0, 0, 0));
#else
    return _mm_setr_ps(half_to_float(h[0]), half_to_float(h[1]), half_to_float(h[2]),
                       half_to_float(h[3]));
#endif
}

static inline __m128 direct_floats(const uint8_t *const p[PANEL], int64_t at) {
    float f[PANEL];
    for (int r = 0; r < PANEL; r++) memcpy(&f[r], p[r] + at, 4);
    return _mm_loadu_ps(f);
}

/* The block scales of 4 rows: d and dm (the row paths' d and dm, lane by lane) */
static inline void direct_scales(int qtype, const uint8_t *const blk[PANEL], __m128 *d,
                                 __m128 *dm) {
    const __m128 negate = _mm_set1_ps(-0.0f);
    switch (qtype) {
        case T_Q4_0: case T_Q5_0: case T_Q8_0: *d = direct_halves(blk, 0); *dm = _mm_setzero_ps();
            break;
        case T_Q4_1: *d = direct_halves(blk, 0); *dm = _mm_xor_ps(direct_halves(blk, 2), negate);
            break;
        default: *d = direct_floats(blk, 0); *dm = _mm_xor_ps(direct_floats(blk, 4), negate);
    }
}

/* A block's 32 quants as bytes (u8; Q8_0's are s8) */
static inline __m256i direct_bytes(int qtype, const uint8_t *blk) {
    switch (qtype) {
        case T_Q4_0: return nibbles32_vec(blk + 2);
        case T_Q4_1: return nibbles32_vec(blk + 4);
        case T_Q5_0: {
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            return _mm256_or_si256(nibbles32_vec(blk + 6), _mm256_and_si256(
                bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
        }
        case T_Q8_0: return _mm256_loadu_si256((const __m256i *)(blk + 2));
        default: return nibbles32_vec(blk + 8);   /* I4G */
    }
}

#define DEFINE_DIRECT(NAME, QTYPE, BYTES)                                                       \
static void NAME(const uint8_t *w, int64_t stride, int live, const int8_t *xq, const float *xd, \
                 const int16_t *xs, int64_t K, float out[PANEL], int ahead) {                   \
    const uint8_t *rows[PANEL];                                                                 \
    for (int r = 0; r < PANEL; r++) rows[r] = w + (r < live ? r : live - 1) * stride;           \
    __m128 acc = _mm_setzero_ps();                                                              \
    for (int64_t b = 0; b < K / 32; b++) {                                                      \
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));                   \
        const uint8_t *blk[PANEL];                                                              \
        __m256i v[PANEL];                                                                       \
        for (int r = 0; r < PANEL; r++) {                                                       \
            blk[r] = rows[r] + BYTES * b;                                                       \
            if (ahead && !(b & 1))                                                              \
                prefetch_bytes(blk[r] + PANEL * stride, 2 * BYTES);                             \
            const __m256i u = direct_bytes(QTYPE, blk[r]);                                      \
            v[r] = QTYPE == T_Q8_0 ? DOT_U8S8(_mm256_abs_epi8(u), _mm256_sign_epi8(a, u))      \
                                   : DOT_U8S8(u, a);                                            \
        }                                                                                       \
        __m128 d, dm;                                                                           \
        direct_scales(QTYPE, blk, &d, &dm);                                                     \
        const int32_t s = (int32_t)xs[2 * b] + (int32_t)xs[2 * b + 1];                          \
        const __m128i i1 = _mm_sub_epi32(hsum4(v[0], v[1], v[2], v[3]),                         \
                                         _mm_set1_epi32(qtype_zero(QTYPE) * s));                \
        acc = _mm_add_ps(acc, direct_terms(d, dm, xd[b], i1, _mm_set1_epi32(s)));               \
    }                                                                                           \
    _mm_storeu_ps(out, acc);                                                                    \
}
DEFINE_DIRECT(direct_q4_0, T_Q4_0, 18)
DEFINE_DIRECT(direct_q4_1, T_Q4_1, 20)
DEFINE_DIRECT(direct_q5_0, T_Q5_0, 22)
DEFINE_DIRECT(direct_q8_0, T_Q8_0, 34)
DEFINE_DIRECT(direct_i4g, T_I4G, 24)


/* The same for Q4_K and Q6_K: a super-block of 256, its group scales applied by vpmaddwd. The
 * mins' term I2 (sum over groups of min times the group's activation sum) for 4 rows at once: */
static inline __m128i direct_i2(const __m256i m[PANEL], const int16_t *xs) {
    const __m256i s = _mm256_loadu_si256((const __m256i *)xs);
    return hsum4(_mm256_madd_epi16(m[0], s), _mm256_madd_epi16(m[1], s),
                 _mm256_madd_epi16(m[2], s), _mm256_madd_epi16(m[3], s));
}

/* Q4_K's 8 6-bit scales and mins of a super-block (kquant_scales' values) from its 12 bytes, four
 * at a time in 32-bit words: the scales as int16 0..7 in each 128-bit lane, the mins as 16 int16
 * (each twice: one per group of 16) */
static inline void direct_k_scales(const uint8_t *s, __m256i *scales, __m256i *mins) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    const uint64_t sc = (uint64_t)(u[0] & six)
                        | (uint64_t)((u[2] & four) | ((u[0] >> 6) & two) << 4) << 32;
    const uint64_t mn = (uint64_t)(u[1] & six)
                        | (uint64_t)(((u[2] >> 4) & four) | ((u[1] >> 6) & two) << 4) << 32;
    *scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)sc)));
    const __m128i m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)mn));
    *mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
}

/* pick[j]: the shuffle that broadcasts int16 j of a 128-bit lane (j < 8) */
static inline __m256i int16_pick(int j) {
    return _mm256_set1_epi16((short)((2 * j) | (2 * j + 1) << 8));
}

static void direct_q4_k(const uint8_t *w, int64_t stride, int live, const int8_t *xq,
                        const float *xd, const int16_t *xs, int64_t K, float out[PANEL],
                        int ahead) {
    const uint8_t *rows[PANEL];
    for (int r = 0; r < PANEL; r++) rows[r] = w + (r < live ? r : live - 1) * stride;
    __m128 acc = _mm_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i pick[8];
    for (int j = 0; j < 8; j++) pick[j] = int16_pick(j);
    for (int64_t b = 0; b < K / 256; b++) {
        __m256i v[PANEL], mins[PANEL], sc[PANEL];
        float d[PANEL], dm[PANEL];
        for (int r = 0; r < PANEL; r++) {
            const uint8_t *blk = rows[r] + 144 * b;
            if (ahead) prefetch_bytes(blk + PANEL * stride, 144);  /* the next panel's */
            d[r] = load_half(blk);
            dm[r] = load_half(blk + 2);
            direct_k_scales(blk + 4, &sc[r], &mins[r]);
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
                    _mm256_shuffle_epi8(sc[r], pick[2 * i])));
                v[r] = _mm256_add_epi32(v[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a_hi),
                    _mm256_shuffle_epi8(sc[r], pick[2 * i + 1])));
            }
        }
        acc = _mm_add_ps(acc, direct_terms(_mm_loadu_ps(d), _mm_loadu_ps(dm), xd[b],
                                           hsum4(v[0], v[1], v[2], v[3]), direct_i2(mins, xs + 16 * b)));
    }
    _mm_storeu_ps(out, acc);
}

/* Q6_K: element e of a half h's 128 is 4 bits of ql and 2 of qh; group g's scale applies to 16 */
static inline __m256i q6_k_bits(__m256i q, int shift_q, __m256i hb, int shift_h) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, shift_q), low4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, shift_h), two), 4));
}

static void direct_q6_k(const uint8_t *w, int64_t stride, int live, const int8_t *xq,
                        const float *xd, const int16_t *xs, int64_t K, float out[PANEL],
                        int ahead) {
    const uint8_t *rows[PANEL];
    for (int r = 0; r < PANEL; r++) rows[r] = w + (r < live ? r : live - 1) * stride;
    __m128 acc = _mm_setzero_ps();
    __m256i pick[4];   /* int16 2k of a lane's 8 in the low lane, 2k + 1 in the high one */
    for (int k = 0; k < 4; k++) {
        const char l0 = (char)(4 * k), l1 = (char)(4 * k + 1), h0 = (char)(4 * k + 2),
                   h1 = (char)(4 * k + 3);
        pick[k] = _mm256_setr_epi8(l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1,
                                   h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1);
    }
    for (int64_t b = 0; b < K / 256; b++) {
        __m256i v[PANEL], scales[PANEL];
        float d[PANEL], dm[PANEL];
        for (int r = 0; r < PANEL; r++) {
            const uint8_t *blk = rows[r] + 210 * b;
            if (ahead) prefetch_bytes(blk + PANEL * stride, 210);  /* the next panel's */
            d[r] = load_half(blk + 208);
            dm[r] = 32.0f * d[r];
            scales[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            v[r] = _mm256_setzero_si256();
        }
        for (int h = 0; h < 2; h++) {
            __m256i a[4];
            for (int c = 0; c < 4; c++)
                a[c] = _mm256_loadu_si256((const __m256i *)(xq + 256 * b + 128 * h + 32 * c));
            for (int r = 0; r < PANEL; r++) {
                const uint8_t *blk = rows[r] + 210 * b;
                const __m256i half = _mm256_broadcastsi128_si256(
                    h ? _mm256_extracti128_si256(scales[r], 1) : _mm256_castsi256_si128(scales[r]));
                const __m256i q1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                const __m256i q2 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                const __m256i c[4] = {q6_k_bits(q1, 0, hb, 0), q6_k_bits(q2, 0, hb, 2),
                                      q6_k_bits(q1, 4, hb, 4), q6_k_bits(q2, 4, hb, 6)};
                for (int k = 0; k < 4; k++)
                    v[r] = _mm256_add_epi32(v[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(c[k], a[k]), _mm256_shuffle_epi8(half, pick[k])));
            }
        }
        acc = _mm_add_ps(acc, direct_terms(_mm_loadu_ps(d), _mm_loadu_ps(dm), xd[b],
                                           hsum4(v[0], v[1], v[2], v[3]), direct_i2(scales, xs + 16 * b)));
    }
    _mm_storeu_ps(out, acc);
}


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
/* Rows of x up to which unpacking in registers beats the wide panels' unpacking once (2 threads,
 * 37984x1536, weights from memory). With AVX-512's wide panels: Q6_K at 4 rows 3.3-3.6 ms against
 * 4.3, even at 6; Q4_K at 4 4.4 against 4.2. The AVX2 panels are slower: at 6 rows Q4_K 6.5-7.3
 * against 10.0, Q6_K 6.8-7.3 against 12.2, about even at 8. */
static inline int direct_max_rows(int qtype) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return qtype == T_Q6_K ? 5 : 3;
#else
    return qtype == T_Q6_K || qtype == T_Q4_K ? 6 : 3;
#endif
}
#else
static direct_fn direct_for(int qtype) { (void)qtype; return NULL; }
static inline int direct_max_rows(int qtype) { (void)qtype; return 0; }
#endif

#endif

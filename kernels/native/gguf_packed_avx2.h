/* gguf_packed.h's panels read with AVX2 (+ F16C): a panel's 16 columns are two ymm halves of 8,
 * half h the bytes 32h .. 32h + 31 of each 64-byte quad. The integer sums and fp32 terms are
 * gguf_wide_avx2.h's column by column (wide_half), so the bits are the row paths'. The
 * weights are read once per pass of up to PACKED_ROWS rows of x, unpacked in registers.
 * Included by gguf_packed.h after gguf_wide.h (quad_of, the runs) and gguf_packed_k.h. */
#ifndef PAGEDSERVE_GGUF_PACKED_AVX2_H
#define PAGEDSERVE_GGUF_PACKED_AVX2_H

#define PACKED_ROWS 4

/* what each row's integer sum starts from, times -s: z (its Q8_0 multiplies signed bytes) */
static inline int packed_offset(int qtype) { return qtype_zero(qtype); }
#define PACKED_WIDE_MIN_ROWS 8   /* from here on, packed_to_wide + gguf_wide.h's passes */
/* quads a run adds in int16 lanes (gguf_wide_avx2.h's quad_run; a constant for a constant type) */
#define PACKED_RUN(QTYPE) quad_run(qtype_lookup(QTYPE))

/* d and dm of columns 8h .. 8h + 7, as the unpack_* functions derive them */
static inline void packed_scales8(int qtype, const uint8_t *s, int h, __m256 *d, __m256 *dm) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    if (qtype == T_I4G) {
        *d = _mm256_loadu_ps((const float *)s + 8 * h);
        *dm = _mm256_xor_ps(_mm256_loadu_ps((const float *)(s + 64) + 8 * h), sign);   /* -m */
        return;
    }
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16 * h)));
    switch (qtype) {
        case T_Q4_1:
            *dm = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 32 + 16 * h))),
                                sign);
            break;
        default: *dm = _mm256_setzero_ps();                        /* Q4_0, Q5_0, Q8_0 */
    }
}

/* quad q's 32 bytes for columns 8h .. 8h + 7 of a packed block */
static inline __m256i packed_quad8(int qtype, const uint8_t *blk, int q, int h) {
    if (qtype == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 64 * q + 32 * h));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * (q / 2) + 32 * h));
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i u = q % 2 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)
                            : _mm256_and_si256(v, low4);
    if (qtype != T_Q5_0) return u;
    uint32_t bits;   /* bit 4c + e of quad q's 64: the 5th bit of byte 4c + e */
    memcpy(&bits, blk + 256 + 8 * q + 4 * h, 4);
    return _mm256_or_si256(u, _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(0x10)));
}

#define DEFINE_PACKED8_ROWS(NAME, QTYPE, ROWS)                                                   \
static void NAME(const uint8_t *panel, int64_t K, const int8_t *xq, const float *xd,           \
                 const int16_t *xs, const int32_t *xz, float out[PACKED_ROWS][PACKED_COLS],      \
                 int ahead) {                                                                    \
    const int64_t blocks = K / 32, bytes = packed_block_bytes(QTYPE);                            \
    __m256 acc[ROWS][2];                                                                         \
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                  \
    for (int64_t b = 0; b < blocks; b++) {                                                       \
        const uint8_t *blk = panel + b * bytes;                                                  \
        if (ahead) prefetch_bytes(blk + 4 * bytes, bytes);        /* 4 blocks on */              \
        __m256i i1[ROWS][2];                        /* from -z s: xz */                          \
        for (int r = 0; r < ROWS; r++)                                                           \
            i1[r][0] = i1[r][1] = packed_offset(QTYPE) ? _mm256_set1_epi32(xz[r * blocks + b])    \
                                                    : _mm256_setzero_si256();                    \
        for (int q0 = 0; q0 < 8; q0 += PACKED_RUN(QTYPE))                                        \
            for (int h = 0; h < 2; h++) {                                                        \
                __m256i w[4], u[4];                                                              \
                for (int q = 0; q < PACKED_RUN(QTYPE); q++) {                                    \
                    w[q] = packed_quad8(QTYPE, blk, q0 + q, h);                                  \
                    u[q] = QTYPE == T_Q8_0 ? _mm256_abs_epi8(w[q]) : w[q];                       \
                }                                                                                \
                for (int r = 0; r < ROWS; r++) {                                                 \
                    __m256i t = _mm256_setzero_si256();                                          \
                    for (int q = 0; q < PACKED_RUN(QTYPE); q++) {                                \
                        const __m256i xv = quad_of(xq + r * K + 32 * b + 4 * (q0 + q));          \
                        t = RUN_ADD(t, u[q], QTYPE == T_Q8_0 ? _mm256_sign_epi8(xv, w[q]) : xv); \
                    }                                                                            \
                    i1[r][h] = _mm256_add_epi32(i1[r][h], RUN_WIDEN(t));                         \
                }                                                                                \
            }                                                                                    \
        for (int h = 0; h < 2; h++) {                                                            \
            __m256 d, dm;                                                                        \
            packed_scales8(QTYPE, blk + packed_scales_at(QTYPE), h, &d, &dm);                    \
            for (int r = 0; r < ROWS; r++) {                                                     \
                const __m256 dav = _mm256_set1_ps(xd[r * blocks + b]);                           \
                const __m256 t1 = _mm256_mul_ps(_mm256_mul_ps(d, dav),                           \
                                                _mm256_cvtepi32_ps(i1[r][h]));                   \
                if (QTYPE != T_Q4_1 && QTYPE != T_I4G) {        /* dm = 0: one product */        \
                    acc[r][h] = _mm256_add_ps(acc[r][h], t1);                                    \
                    continue;                                                                    \
                }                                                                                \
                const __m256 s2 = _mm256_mul_ps(dm, dav);                                        \
                const int32_t sum = (int32_t)xs[r * (K / 16) + 2 * b]                            \
                                    + xs[r * (K / 16) + 2 * b + 1];                              \
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_sub_ps(                              \
                    t1, _mm256_mul_ps(s2, _mm256_cvtepi32_ps(_mm256_set1_epi32(sum)))));         \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < ROWS; r++) {                                                             \
        _mm256_storeu_ps(out[r], acc[r][0]);                                                     \
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);                                                 \
    }                                                                                            \
}

/* The k-quants (Q4_K; Q6_K where PACKED_Q6K): group g's (16 elements, 4 quads) scales of columns
 * 8h .. 8h + 7 as int16 pairs and its mins as int32; Q6_K's signed scales are its mins too (its
 * w = d sc (u - 32), dm = 32 d) */
static inline void packed_k_group8(int qtype, const uint8_t *blk, int g, int h, __m256i *sc,
                                   __m256i *mc) {
    if (qtype == T_Q6_K) {
        *mc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + Q6K_SC + 16 * g + 8 * h)));
        *sc = _mm256_or_si256(_mm256_slli_epi32(*mc, 16),
                              _mm256_and_si256(*mc, _mm256_set1_epi32(0xffff)));
        return;
    }
    const __m256i t = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64((const __m128i *)(blk + Q4K_SC + 16 * (g / 2) + 8 * h)));
    *mc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + Q4K_MIN + 16 * (g / 2) + 8 * h)));
    *sc = _mm256_or_si256(t, _mm256_slli_epi32(t, 16));
}

/* quad q's 32 bytes (u: Q4_K's nibbles; Q6_K's with their high 2 bits) of columns 8h .. 8h + 7 */
static inline __m256i packed_k_quad8(int qtype, const uint8_t *blk, int q, int h) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * (q / 2) + 32 * h));
    const __m256i lo = q % 2 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)
                             : _mm256_and_si256(v, low4);
    if (qtype != T_Q6_K) return lo;
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + Q6K_HI + 64 * (q / 4) + 32 * h));
    return _mm256_or_si256(lo, _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srli_epi16(hb, 2 * (q % 4)), _mm256_set1_epi8(3)), 4));
}

/* d and dm of columns 8h .. 8h + 7, as the unpack_* functions derive them */
static inline void packed_k_scales8(int qtype, const uint8_t *blk, int h, __m256 *d, __m256 *dm) {
    if (qtype == T_Q6_K) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q6K_D + 16 * h)));
        *dm = _mm256_mul_ps(_mm256_set1_ps(32.0f), *d);
        return;
    }
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q4K_D + 16 * h)));
    *dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q4K_DMIN + 16 * h)));
}

#define DEFINE_PACKED8_K_ROWS(NAME, QTYPE, ROWS)                                                 \
static void NAME(const uint8_t *panel, int64_t K, const int8_t *xq, const float *xd,           \
                 const int16_t *xs, const int32_t *xz, float out[PACKED_ROWS][PACKED_COLS],      \
                 int ahead) {                                                                    \
    (void)xz;                                       /* no offsets: the mins' term holds s */     \
    const int64_t blocks = K / 256, bytes = packed_block_bytes(QTYPE);                           \
    __m256 acc[ROWS][2];                                                                         \
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                  \
    for (int64_t b = 0; b < blocks; b++) {                                                       \
        const uint8_t *blk = panel + b * bytes;                                                  \
        __m256i i1[ROWS][2], i2[ROWS][2];                                                        \
        for (int r = 0; r < ROWS; r++)                                                           \
            i1[r][0] = i1[r][1] = i2[r][0] = i2[r][1] = _mm256_setzero_si256();                  \
        for (int g = 0; g < 16; g += 2) {                                                        \
            __m256i sc[2][2], mc[2][2];                     /* [group][half] */                  \
            if (ahead) prefetch_bytes(blk + 2 * bytes + bytes / 16 * g, bytes / 8 + 64);         \
            for (int j = 0; j < 2; j++)                                                          \
                for (int h = 0; h < 2; h++) packed_k_group8(QTYPE, blk, g + j, h, &sc[j][h], &mc[j][h]); \
            for (int j = 0; j < 2; j++)                                                          \
                for (int q0 = 4 * (g + j); q0 < 4 * (g + j) + 4; q0 += PACKED_RUN(QTYPE))      \
                    for (int h = 0; h < 2; h++) {                                                \
                        __m256i w[4];                                                            \
                        for (int q = 0; q < PACKED_RUN(QTYPE); q++)                            \
                            w[q] = packed_k_quad8(QTYPE, blk, q0 + q, h);                        \
                        for (int r = 0; r < ROWS; r++) {                                         \
                            __m256i t = _mm256_setzero_si256();                                  \
                            for (int q = 0; q < PACKED_RUN(QTYPE); q++)                        \
                                t = _mm256_add_epi16(t, _mm256_maddubs_epi16(                    \
                                    w[q], quad_of(xq + r * K + 256 * b + 4 * (q0 + q))));        \
                            i1[r][h] = _mm256_add_epi32(i1[r][h], _mm256_madd_epi16(t, sc[j][h])); \
                        }                                                                        \
                    }                                                                            \
            for (int h = 0; h < 2; h++) {                                                        \
                const __m256i pair = mins_pair(mc[0][h], mc[1][h]);                              \
                for (int r = 0; r < ROWS; r++)                                                   \
                    i2[r][h] = _mm256_add_epi32(i2[r][h], _mm256_madd_epi16(                     \
                        pair, xs_pair(xs + r * (K / 16) + 16 * b + g)));                         \
            }                                                                                    \
        }                                                                                        \
        for (int h = 0; h < 2; h++) {                                                            \
            __m256 d, dm;                                                                        \
            packed_k_scales8(QTYPE, blk, h, &d, &dm);                                            \
            for (int r = 0; r < ROWS; r++) {                                                     \
                const __m256 dav = _mm256_set1_ps(xd[r * blocks + b]);                           \
                const __m256 s1 = _mm256_mul_ps(d, dav), s2 = _mm256_mul_ps(dm, dav);            \
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_sub_ps(                              \
                    _mm256_mul_ps(s1, _mm256_cvtepi32_ps(i1[r][h])),                             \
                    _mm256_mul_ps(s2, _mm256_cvtepi32_ps(i2[r][h]))));                           \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < ROWS; r++) {                                                             \
        _mm256_storeu_ps(out[r], acc[r][0]);                                                     \
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);                                                 \
    }                                                                                            \
}

typedef void (*packed_rows_fn)(const uint8_t *, int64_t, const int8_t *, const float *,
                               const int16_t *, const int32_t *, float[PACKED_ROWS][PACKED_COLS],
                               int);

#define DEFINE_PACKED8_TYPE(T, QTYPE)                                                            \
    DEFINE_PACKED8_ROWS(packed_##T##_1, QTYPE, 1)                                                \
    DEFINE_PACKED8_ROWS(packed_##T##_2, QTYPE, 2)                                                \
    DEFINE_PACKED8_ROWS(packed_##T##_3, QTYPE, 3)                                                \
    DEFINE_PACKED8_ROWS(packed_##T##_4, QTYPE, 4)                                                \
    static const packed_rows_fn packed_##T[PACKED_ROWS] = {                                      \
        packed_##T##_1, packed_##T##_2, packed_##T##_3, packed_##T##_4};
DEFINE_PACKED8_TYPE(q4_0, T_Q4_0)
DEFINE_PACKED8_TYPE(q4_1, T_Q4_1)
DEFINE_PACKED8_TYPE(q5_0, T_Q5_0)
DEFINE_PACKED8_TYPE(q8_0, T_Q8_0)
DEFINE_PACKED8_TYPE(i4g, T_I4G)

DEFINE_PACKED8_K_ROWS(packed_q4_k_1, T_Q4_K, 1)
DEFINE_PACKED8_K_ROWS(packed_q4_k_2, T_Q4_K, 2)
DEFINE_PACKED8_K_ROWS(packed_q4_k_3, T_Q4_K, 3)
DEFINE_PACKED8_K_ROWS(packed_q4_k_4, T_Q4_K, 4)
static const packed_rows_fn packed_q4_k[PACKED_ROWS] = {
    packed_q4_k_1, packed_q4_k_2, packed_q4_k_3, packed_q4_k_4};

DEFINE_PACKED8_K_ROWS(packed_q6_k_1, T_Q6_K, 1)
DEFINE_PACKED8_K_ROWS(packed_q6_k_2, T_Q6_K, 2)
DEFINE_PACKED8_K_ROWS(packed_q6_k_3, T_Q6_K, 3)
DEFINE_PACKED8_K_ROWS(packed_q6_k_4, T_Q6_K, 4)
static const packed_rows_fn packed_q6_k[PACKED_ROWS] = {
    packed_q6_k_1, packed_q6_k_2, packed_q6_k_3, packed_q6_k_4};

/* Many rows of x: a packed panel spread once into gguf_wide.h's panel (the same layout: quad q's
 * 16 columns x 4 bytes; scales per block and column; Q4_K's group scales as int16 pairs and
 * mins as int32), then gguf_wide.h's passes of WIDE_ROWS rows read bytes with nothing left to
 * unpack: the same integer sums and terms, so the same bits. */
static void packed_to_wide(int qtype, const uint8_t *panel, int64_t K, wide_panel *p) {
    if (qtype == T_Q4_K || qtype == T_Q6_K) {
        const int64_t bytes = packed_block_bytes(qtype);
        for (int64_t b = 0; b < K / 256; b++) {
            const uint8_t *blk = panel + b * bytes;
            for (int q = 0; q < 64; q++)
                for (int h = 0; h < 2; h++)
                    _mm256_storeu_si256((__m256i *)(p->wq + (b * 64 + q) * WIDE * 4 + 32 * h),
                                        packed_k_quad8(qtype, blk, q, h));
            for (int g = 0; g < 16; g++)
                for (int h = 0; h < 2; h++) {
                    __m256i sc, mc;
                    packed_k_group8(qtype, blk, g, h, &sc, &mc);
                    _mm256_storeu_si256((__m256i *)(p->sc + ((b * 16 + g) * WIDE + 8 * h) * 2), sc);
                    _mm256_storeu_si256((__m256i *)(p->mc + (b * 16 + g) * WIDE + 8 * h), mc);
                }
            for (int h = 0; h < 2; h++) {
                __m256 d, dm;
                packed_k_scales8(qtype, blk, h, &d, &dm);
                _mm256_storeu_ps(p->d + b * WIDE + 8 * h, d);
                _mm256_storeu_ps(p->dm + b * WIDE + 8 * h, dm);
            }
        }
        return;
    }
    const int64_t bytes = packed_block_bytes(qtype);
    for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t *blk = panel + b * bytes;
        for (int q = 0; q < 8; q++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_si256((__m256i *)(p->wq + (b * 8 + q) * WIDE * 4 + 32 * h),
                                    packed_quad8(qtype, blk, q, h));
        for (int h = 0; h < 2; h++) {
            __m256 d, dm;
            packed_scales8(qtype, blk + packed_scales_at(qtype), h, &d, &dm);
            _mm256_storeu_ps(p->d + b * WIDE + 8 * h, d);
            _mm256_storeu_ps(p->dm + b * WIDE + 8 * h, dm);
        }
    }
}

#endif

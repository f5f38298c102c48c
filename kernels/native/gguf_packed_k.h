/* gguf_packed.h's panels for Q4_K (super-blocks of 256). Block b of a panel (16 rows), 2368
 * bytes: nibbles 32 x 64 bytes (chunk j: quads 2j low, 2j + 1 high, as the 32-element types),
 * 8 x 16 sub-block scales, 8 x 16 mins (the 6-bit values as bytes: the raw 12-byte field is
 * encoded back from them on the way back to raw), 16 fp16 d, 16 fp16 dmin. The integer sums and terms are
 * gguf_wide512.h's k-quant body, lane by lane: the same bits. Q6_K's panels below hold its high
 * bits beside the nibbles. Included by gguf_packed.h. */
#ifndef PAGEDSERVE_GGUF_PACKED_K_H
#define PAGEDSERVE_GGUF_PACKED_K_H

enum { Q4K_SC = 2048, Q4K_MIN = 2176, Q4K_D = 2304, Q4K_DMIN = 2336, Q4K_BYTES = 2368 };

/* column c of one packed super-block from the unpacked row (u, sc2, mc of block b) and its raw
 * block rb */
static void pack_k_block(const unpacked_row *row, int64_t b, const uint8_t *rb, int c,
                         uint8_t *blk) {
    const uint8_t *u = row->u + 256 * b;
    for (int q = 0; q < 64; q++)
        for (int e = 0; e < 4; e++)
            blk[64 * (q / 2) + 4 * c + e] |= (uint8_t)((u[4 * q + e] & 0x0f) << (4 * (q % 2)));
    for (int j = 0; j < 8; j++) {
        blk[Q4K_SC + 16 * j + c] = (uint8_t)row->sc2[128 * b + 16 * j];
        blk[Q4K_MIN + 16 * j + c] = (uint8_t)row->mc[16 * b + 2 * j];
    }
    memcpy(blk + Q4K_D + 2 * c, rb, 2);
    memcpy(blk + Q4K_DMIN + 2 * c, rb + 2, 2);
}

/* pack_k_block's inverse: column c's raw super-block */
static void unpack_k_block(const uint8_t *blk, int c, uint8_t *out) {
    memcpy(out, blk + Q4K_D + 2 * c, 2);
    memcpy(out + 2, blk + Q4K_DMIN + 2 * c, 2);
    for (int j = 0; j < 4; j++) {   /* kquant_scales' 6-bit fields, encoded back */
        const uint8_t s0 = blk[Q4K_SC + 16 * j + c], s4 = blk[Q4K_SC + 16 * (j + 4) + c];
        const uint8_t m0 = blk[Q4K_MIN + 16 * j + c], m4 = blk[Q4K_MIN + 16 * (j + 4) + c];
        out[4 + j] = (uint8_t)(s0 | (s4 >> 4) << 6);
        out[8 + j] = (uint8_t)(m0 | (m4 >> 4) << 6);
        out[12 + j] = (uint8_t)((s4 & 0x0f) | (m4 & 0x0f) << 4);
    }
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 32; l++) {
            const int lo = 64 * i + l, hi = lo + 32;   /* elements, each at quad e / 4 */
            const uint8_t a = (blk[64 * (lo / 8) + 4 * c + lo % 4] >> (4 * (lo / 4 % 2))) & 0x0f;
            const uint8_t h = (blk[64 * (hi / 8) + 4 * c + hi % 4] >> (4 * (hi / 4 % 2))) & 0x0f;
            out[16 + 32 * i + l] = (uint8_t)(a | h << 4);
        }
}

/* Q6_K's panels (AVX2 and AVX-512 builds: on one thread at one row the raw row path read Q6_K at
 * 7-14 GB/s on the AVX-512 EPYC, these panels at ~20, and 1.5-3x more at 4-16 rows): block b
 * of a panel, 3360 bytes (16 x 210, the raw bytes rearranged): the low 4 bits as Q4_K's nibbles
 * (32 x 64 bytes), the high 2 bits of each group of 16 elements' 4 quads in 64 bytes (byte 4c + e:
 * quad 4g + k's element e of column c at bits 2k), the 16 group scales as int8 [g][c], 16 fp16 d. */
#if defined(__AVX2__) && defined(__F16C__)
#define PACKED_Q6K 1
#else
#define PACKED_Q6K 0
#endif
enum { Q6K_HI = 2048, Q6K_SC = 3072, Q6K_D = 3328, Q6K_BYTES = 3360 };

/* column c of one packed Q6_K super-block from the unpacked row (u of block b) and its raw
 * block rb */
static void pack_q6k_block(const unpacked_row *row, int64_t b, const uint8_t *rb, int c,
                           uint8_t *blk) {
    const uint8_t *u = row->u + 256 * b;
    for (int q = 0; q < 64; q++)
        for (int e = 0; e < 4; e++) {
            const uint8_t v = u[4 * q + e];
            blk[64 * (q / 2) + 4 * c + e] |= (uint8_t)((v & 0x0f) << (4 * (q % 2)));
            blk[Q6K_HI + 64 * (q / 4) + 4 * c + e] |= (uint8_t)(((v >> 4) & 3) << (2 * (q % 4)));
        }
    for (int g = 0; g < 16; g++) blk[Q6K_SC + 16 * g + c] = rb[192 + g];
    memcpy(blk + Q6K_D + 2 * c, rb + 208, 2);
}

/* pack_q6k_block's inverse: column c's raw super-block (ql, qh, scales, d as unpack_q6_k reads) */
static void unpack_q6k_block(const uint8_t *blk, int c, uint8_t *out) {
    uint8_t u[256];
    for (int q = 0; q < 64; q++)
        for (int e = 0; e < 4; e++)
            u[4 * q + e] = (uint8_t)(((blk[64 * (q / 2) + 4 * c + e] >> (4 * (q % 2))) & 0x0f)
                | ((blk[Q6K_HI + 64 * (q / 4) + 4 * c + e] >> (2 * (q % 4))) & 3) << 4);
    for (int half = 0; half < 2; half++) {
        const uint8_t *h = u + 128 * half;
        uint8_t *ql = out + 64 * half, *qh = out + 128 + 32 * half;
        for (int l = 0; l < 32; l++) {
            ql[l] = (uint8_t)((h[l] & 0x0f) | (h[l + 64] & 0x0f) << 4);
            ql[l + 32] = (uint8_t)((h[l + 32] & 0x0f) | (h[l + 96] & 0x0f) << 4);
            qh[l] = (uint8_t)((h[l] >> 4) | (h[l + 32] >> 4) << 2 | (h[l + 64] >> 4) << 4
                              | (h[l + 96] >> 4) << 6);
        }
    }
    for (int g = 0; g < 16; g++) out[192 + g] = blk[Q6K_SC + 16 * g + c];
    memcpy(out + 208, blk + Q6K_D + 2 * c, 2);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* The columns' scale and min of group g (16 elements) as int32: Q4_K's cover a sub-block of 32
 * (groups 2j and 2j + 1); Q6_K's signed scales are its mins too (its w = d sc (u - 32),
 * dm = 32 d) */
static inline void packed_k_group(int qtype, const uint8_t *blk, int g, __m512i *sc,
                                  __m512i *mc) {
    if (qtype == T_Q6_K) {
        *sc = *mc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + Q6K_SC + 16 * g)));
        return;
    }
    *sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + Q4K_SC + 16 * (g / 2))));
    *mc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + Q4K_MIN + 16 * (g / 2))));
}

/* quad q's 64 bytes (u: Q4_K's nibbles; Q6_K's with their high 2 bits) of the 16 columns */
static inline __m512i packed_k_quad(int qtype, const uint8_t *blk, int q) {
    const __m512i v = _mm512_loadu_si512(blk + 64 * (q / 2)), low4 = _mm512_set1_epi8(0x0f);
    const __m512i lo = q % 2 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)
                             : _mm512_and_si512(v, low4);
    if (qtype != T_Q6_K) return lo;
    const __m512i hb = _mm512_loadu_si512(blk + Q6K_HI + 64 * (q / 4));
    return _mm512_or_si512(lo, _mm512_slli_epi16(
        _mm512_and_si512(_mm512_srli_epi16(hb, 2 * (q % 4)), _mm512_set1_epi8(3)), 4));
}

/* d and dm of the 16 columns, as the unpack_* functions derive them */
static inline void packed_k_scales(int qtype, const uint8_t *blk, __m512 *d, __m512 *dm) {
    if (qtype == T_Q6_K) {
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + Q6K_D)));
        *dm = _mm512_mul_ps(_mm512_set1_ps(32.0f), *d);
        return;
    }
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + Q4K_D)));
    *dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + Q4K_DMIN)));
}

/* A scale's span of groups (SPAN: 2 for Q4_K, 1 for Q6_K) is summed by vpdpbusd (weights
 * unsigned, x signed, exact in int32) and then multiplied by its scale: one multiply-add per
 * quad where vpmaddubsw + vpmaddwd took two (the same integers, so the same bits). */
#define DEFINE_PACKED_K_ROWS(NAME, QTYPE, ROWS)                                                  \
static void NAME(const uint8_t *panel, int64_t K, const int8_t *xq, const float *xd,           \
                 const int16_t *xs, const int32_t *xz, float out[PACKED_ROWS][PACKED_COLS],      \
                 int ahead) {                                                                    \
    (void)xz;                                       /* no offsets: the mins' term holds s */     \
    const int64_t blocks = K / 256, bytes = packed_block_bytes(QTYPE);                           \
    const int SPAN = QTYPE == T_Q6_K ? 1 : 2;                                                    \
    __m512 acc[ROWS];                                                                            \
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();                                 \
    for (int64_t b = 0; b < blocks; b++) {                                                       \
        const uint8_t *blk = panel + b * bytes;                                                  \
        __m512i i1[ROWS], i2[ROWS];                                                              \
        for (int r = 0; r < ROWS; r++) i1[r] = i2[r] = _mm512_setzero_si512();                   \
        for (int g = 0; g < 16; g += SPAN) {                                                     \
            __m512i sc, mc, t[ROWS];                                                             \
            for (int h = g; ahead && h < g + SPAN; h++)                                          \
                prefetch_bytes(blk + 2 * bytes + bytes / 16 * h, bytes / 16 + 64);              \
            packed_k_group(QTYPE, blk, g, &sc, &mc);                                             \
            for (int r = 0; r < ROWS; r++) t[r] = _mm512_setzero_si512();                        \
            for (int q = 4 * g; q < 4 * (g + SPAN); q++) {                                       \
                const __m512i wv = packed_k_quad(QTYPE, blk, q);                                 \
                for (int r = 0; r < ROWS; r++)                                                   \
                    t[r] = _mm512_dpbusd_epi32(t[r], wv, quad512_of(xq + r * K + 256 * b + 4 * q)); \
            }                                                                                    \
            for (int r = 0; r < ROWS; r++) {                                                     \
                const int16_t *s = xs + r * (K / 16) + 16 * b + g;                               \
                const int32_t xsum = SPAN == 2 ? (int32_t)s[0] + s[1] : s[0];                    \
                i1[r] = _mm512_add_epi32(i1[r], _mm512_mullo_epi32(t[r], sc));                   \
                i2[r] = _mm512_add_epi32(i2[r], _mm512_mullo_epi32(mc, _mm512_set1_epi32(xsum))); \
            }                                                                                    \
        }                                                                                        \
        __m512 d, dm;                                                                            \
        packed_k_scales(QTYPE, blk, &d, &dm);                                                    \
        for (int r = 0; r < ROWS; r++) {                                                         \
            const __m512 dav = _mm512_set1_ps(xd[r * blocks + b]);                               \
            const __m512 s1 = _mm512_mul_ps(d, dav), s2 = _mm512_mul_ps(dm, dav);                \
            acc[r] = _mm512_add_ps(acc[r], _mm512_sub_ps(                                        \
                _mm512_mul_ps(s1, _mm512_cvtepi32_ps(i1[r])),                                    \
                _mm512_mul_ps(s2, _mm512_cvtepi32_ps(i2[r]))));                                  \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(out[r], acc[r]);                             \
}
#endif

#endif

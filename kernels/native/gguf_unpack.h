/* Unpacking one row of a quantized weight (GGUF block types, and I4G: AWQ/GPTQ int4 repacked at
 * load, kernels/quant_formats.py) into the one form linear_gguf.c multiplies, for every type:
 *
 *   w[e] = d[b] * sc(g) * u[e]  -  dm[b] * mc(g)        e in block b, in group g of 16 elements
 *
 * u: the element's stored integer as it is (unsigned 4/5/6-bit, or Q8_0's signed int8);
 * d, dm: per block (32 elements; 256 for the k-quants), fp32; sc, mc: small integers per group
 * of 16 (k-quants only; 1 for the 32-element types). A product with an activation block quantized
 * to int8 (da, a[e], group sums s(g) = sum of a over the group) is then
 *
 *   da * (d * sum_g sc(g) sum_{e in g} u[e] a[e]  -  dm * sum_g mc(g) s(g))
 *
 * two exact int32 sums and three fp32 products a block. The symmetric types (w = d (u - z)) fold
 * their zero point into the integer: I1 = sum (u - z) a = sum u a - z s, exact, with dm = 0, so
 * their term is the one product d da I1 (a body may skip the dm term: it adds an exact zero).
 * Per type (ggml's layouts; u, d, dm, z, mc):
 *   Q4_0  nibbles, d, 0, z 8               Q4_1  nibbles, d, -m
 *   Q5_0  nibble | bit of qh << 4, d, 0, z 16   Q8_0  signed bytes, d, 0
 *   Q4_K  nibbles, d, dmin; sc, mc 6-bit   Q5_K  as Q4_K with a 5th bit from qh
 *   Q6_K  4 bits of ql | 2 of qh << 4, d, 32d; sc = mc = the group's int8 scale
 *   I4G   nibbles, fp32 d, -m (fp32)
 * sc is stored once per pair of elements (int16, 8 copies a group: the vector bodies load it
 * beside the pairwise products of vpmaddubsw), mc once per group (int16). */
#ifndef PAGEDSERVE_GGUF_UNPACK_H
#define PAGEDSERVE_GGUF_UNPACK_H

#include <stdint.h>
#include <string.h>

#include "paged_attention.h"   /* half_to_float */

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_I4G = 1000 };

typedef struct {
    uint8_t *u;     /* [K] */
    int16_t *sc2;   /* [K / 2]  (k-quants) */
    int16_t *mc;    /* [K / 16] (k-quants) */
    float *d, *dm;  /* [K / block] */
} unpacked_row;

static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return half_to_float(h);
#endif
}

#ifdef __AVX2__
static inline __m256i nibbles32_vec(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_and_si128(q, low4));
}

/* byte j: 0xff where bit j of x is set, else 0 */
static inline __m256i bits_to_bytes(uint32_t x) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)x), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                     0x0101010101010101, 0x0000000000000000));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);   /* all bits but j % 8 */
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}
#endif

static inline void nibbles32(const uint8_t *qs, uint8_t *u) {
#ifdef __AVX2__
    _mm256_storeu_si256((__m256i *)u, nibbles32_vec(qs));
#else
    for (int j = 0; j < 16; j++) {
        u[j] = qs[j] & 0x0f;
        u[j + 16] = qs[j] >> 4;
    }
#endif
}

static void unpack_q4_0(const uint8_t *row, int64_t K, unpacked_row *o) {
    for (int64_t b = 0; b < K / 32; b++, row += 18) {
        o->d[b] = load_half(row);
        o->dm[b] = 0.0f;                                      /* z = 8 */
        nibbles32(row + 2, o->u + 32 * b);
    }
}

static void unpack_q4_1(const uint8_t *row, int64_t K, unpacked_row *o) {
    for (int64_t b = 0; b < K / 32; b++, row += 20) {
        o->d[b] = load_half(row);
        o->dm[b] = -load_half(row + 2);
        nibbles32(row + 4, o->u + 32 * b);
    }
}

static void unpack_i4g(const uint8_t *row, int64_t K, unpacked_row *o) {
    for (int64_t b = 0; b < K / 32; b++, row += 24) {
        float m;
        memcpy(&o->d[b], row, 4);
        memcpy(&m, row + 4, 4);
        o->dm[b] = -m;
        nibbles32(row + 8, o->u + 32 * b);
    }
}

static void unpack_q5_0(const uint8_t *row, int64_t K, unpacked_row *o) {
    for (int64_t b = 0; b < K / 32; b++, row += 22) {
        uint32_t qh;
        memcpy(&qh, row + 2, 4);
        o->d[b] = load_half(row);
        o->dm[b] = 0.0f;                                      /* z = 16 */
        uint8_t *u = o->u + 32 * b;
#ifdef __AVX2__
        _mm256_storeu_si256((__m256i *)u, _mm256_or_si256(
            nibbles32_vec(row + 6), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10))));
#else
        nibbles32(row + 6, u);
        for (int j = 0; j < 32; j++) u[j] |= (uint8_t)(((qh >> j) & 1u) << 4);
#endif
    }
}

static void unpack_q8_0(const uint8_t *row, int64_t K, unpacked_row *o) {
    for (int64_t b = 0; b < K / 32; b++, row += 34) {
        o->d[b] = load_half(row);
        o->dm[b] = 0.0f;
        memcpy(o->u + 32 * b, row + 2, 32);
    }
}

/* Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes (ggml's get_scale_min_k4) */
static inline void kquant_scales(const uint8_t *s, int16_t *sc2, int16_t *mc) {
    for (int j = 0; j < 8; j++) {
        int sc, m;
        if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        for (int p = 0; p < 16; p++) sc2[16 * j + p] = (int16_t)sc;   /* 32 elements: 16 pairs */
        mc[2 * j] = mc[2 * j + 1] = (int16_t)m;
    }
}

static void unpack_q4_k(const uint8_t *row, int64_t K, unpacked_row *o) {
    for (int64_t b = 0; b < K / 256; b++, row += 144) {
        o->d[b] = load_half(row);
        o->dm[b] = load_half(row + 2);
        kquant_scales(row + 4, o->sc2 + 128 * b, o->mc + 16 * b);
        const uint8_t *qs = row + 16;
        uint8_t *u = o->u + 256 * b;
        for (int i = 0; i < 4; i++)
            for (int l = 0; l < 32; l++) {
                u[64 * i + l] = qs[32 * i + l] & 0x0f;
                u[64 * i + 32 + l] = qs[32 * i + l] >> 4;
            }
    }
}

static void unpack_q5_k(const uint8_t *row, int64_t K, unpacked_row *o) {
    for (int64_t b = 0; b < K / 256; b++, row += 176) {
        o->d[b] = load_half(row);
        o->dm[b] = load_half(row + 2);
        kquant_scales(row + 4, o->sc2 + 128 * b, o->mc + 16 * b);
        const uint8_t *qh = row + 16, *qs = row + 48;
        uint8_t *u = o->u + 256 * b;
        for (int i = 0; i < 4; i++)
            for (int l = 0; l < 32; l++) {
                u[64 * i + l] = (uint8_t)((qs[32 * i + l] & 0x0f) | (((qh[l] >> (2 * i)) & 1) << 4));
                u[64 * i + 32 + l] = (uint8_t)((qs[32 * i + l] >> 4)
                                               | (((qh[l] >> (2 * i + 1)) & 1) << 4));
            }
    }
}

static void unpack_q6_k(const uint8_t *row, int64_t K, unpacked_row *o) {
    for (int64_t b = 0; b < K / 256; b++, row += 210) {
        const uint8_t *ql = row, *qh = row + 128;
        const int8_t *scales = (const int8_t *)(row + 192);
        o->d[b] = load_half(row + 208);
        o->dm[b] = 32.0f * o->d[b];
        uint8_t *u = o->u + 256 * b;
        for (int half = 0; half < 2; half++, ql += 64, qh += 32, u += 128)
            for (int l = 0; l < 32; l++) {
                u[l] = (uint8_t)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4));
                u[l + 32] = (uint8_t)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4));
                u[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                u[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        for (int g = 0; g < 16; g++) {
            for (int p = 0; p < 8; p++) o->sc2[128 * b + 8 * g + p] = scales[g];
            o->mc[16 * b + g] = scales[g];
        }
    }
}

typedef void (*unpack_fn)(const uint8_t *row, int64_t K, unpacked_row *o);

/* z of a 32-element type (qtype_info's zero, as a constant where the type is one) */
enum { Q4_0_ZERO = 8, Q5_0_ZERO = 16 };
static inline int qtype_zero(int qtype) {
    return qtype == T_Q4_0 ? Q4_0_ZERO : qtype == T_Q5_0 ? Q5_0_ZERO : 0;
}

typedef struct {
    int block;        /* elements a block */
    int bytes;        /* bytes a block */
    int kquant;       /* groups of 16 with their own sc / mc */
    int signed_u;     /* u is a signed byte (Q8_0) */
    int zero;         /* z, subtracted from u inside the integer sum (0: none) */
    int sums16;       /* vpmaddubsw results (each 2 u a, |a| <= 127) an int16 lane holds exactly:
                         32767 / (2 * 127 * max u); 1 for Q8_0, whose sign moves onto a */
    unpack_fn unpack;
} qtype_info;

/* NULL for a type we do not run */
static inline const qtype_info *qtype_lookup(int qtype) {
    static const qtype_info q4_0 = {32, 18, 0, 0, Q4_0_ZERO, 8, unpack_q4_0},
        q4_1 = {32, 20, 0, 0, 0, 8, unpack_q4_1}, q5_0 = {32, 22, 0, 0, Q5_0_ZERO, 4, unpack_q5_0},
        q8_0 = {32, 34, 0, 1, 0, 1, unpack_q8_0}, q4_k = {256, 144, 1, 0, 0, 8, unpack_q4_k},
        q5_k = {256, 176, 1, 0, 0, 4, unpack_q5_k}, q6_k = {256, 210, 1, 0, 0, 2, unpack_q6_k},
        i4g = {32, 24, 0, 0, 0, 8, unpack_i4g};
    switch (qtype) {
        case T_Q4_0: return &q4_0;
        case T_Q4_1: return &q4_1;
        case T_Q5_0: return &q5_0;
        case T_Q8_0: return &q8_0;
        case T_Q4_K: return &q4_k;
        case T_Q5_K: return &q5_k;
        case T_Q6_K: return &q6_k;
        case T_I4G: return &i4g;
        default: return NULL;
    }
}

#endif

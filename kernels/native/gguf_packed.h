/* Quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, I4G; Q4_K in gguf_packed_k.h) repacked
 * once, at load, into panels of 16
 * rows: a broadcast quad of x meets a panel's 16 columns in one zmm, for every row count, with
 * nothing unpacked per call and no horizontal sums (decode reads each weight byte once, as the
 * panel's integers are laid out). The bytes per block are the raw format's, rearranged:
 *
 *   block b of panel p at packed + (p * blocks + b) * 16 * bytes_per_block:
 *     u:      4-bit types: 4 x 64 bytes, chunk j: quad 2j in the low nibbles, 2j + 1 in the high,
 *             byte 4c + e = element 4q + e of column c; Q5_0 adds 8 x 8 bytes, bit 4c + e of
 *             quad q's word the element's 5th bit; Q8_0: 8 x 64 signed bytes, one quad each
 *     scales: GGUF types: 16 fp16 d (and Q4_1's 16 fp16 m); I4G: 16 fp32 d, 16 fp32 m
 *
 * Rows past n in the last panel repeat row n - 1. Each column's integer sums and fp32 terms are
 * gguf_unpack.h's (d and dm derived as unpack_* derives them), so the bits are the row paths'.
 * AVX-512 (BW + VNNI) here, AVX2 + F16C in gguf_packed_avx2.h: elsewhere gguf_packed_supported()
 * is 0 and weights stay raw.
 * Included by linear_gguf.c after its job types: the entry points for packed weights are here. */

#ifndef PAGEDSERVE_GGUF_PACKED_H
#define PAGEDSERVE_GGUF_PACKED_H

#include "prefetch.h"

#define PACKED_COLS 16

#include "gguf_packed_k.h"

static inline int packed_type(int qtype) {
    return qtype == T_Q4_0 || qtype == T_Q4_1 || qtype == T_Q5_0 || qtype == T_Q8_0
        || qtype == T_I4G || qtype == T_Q4_K || (PACKED_Q6K && qtype == T_Q6_K);
}

/* bytes of one packed block (16 rows) */
static inline int64_t packed_block_bytes(int qtype) {
    return qtype == T_Q4_K ? Q4K_BYTES : qtype == T_Q6_K ? Q6K_BYTES
                                        : (int64_t)PACKED_COLS * qtype_lookup(qtype)->bytes;
}


/* Offsets within a packed block: where the scales start, where Q5_0's bit planes start */
static inline int packed_scales_at(int qtype) {
    return qtype == T_Q8_0 ? 512 : qtype == T_Q5_0 ? 320 : 256;
}

/* column c of one packed block of a 32-element type, from its unpacked u and raw block rb */
static void pack_32_block(int qtype, const uint8_t *u, const uint8_t *rb, int c, uint8_t *blk) {
    const int scales_at = packed_scales_at(qtype);
    for (int q = 0; q < 8; q++)
        for (int e = 0; e < 4; e++) {
            const uint8_t v = u[4 * q + e];
            if (qtype == T_Q8_0) {
                blk[64 * q + 4 * c + e] = v;
                continue;
            }
            blk[64 * (q / 2) + 4 * c + e] |= (uint8_t)((v & 0x0f) << (4 * (q % 2)));
            if (qtype == T_Q5_0 && (v & 0x10))
                blk[256 + 8 * q + (4 * c + e) / 8] |= (uint8_t)(1u << ((4 * c + e) % 8));
        }
    if (qtype == T_I4G) {
        memcpy(blk + scales_at + 4 * c, rb, 4);
        memcpy(blk + scales_at + 64 + 4 * c, rb + 4, 4);
    } else {
        memcpy(blk + scales_at + 2 * c, rb, 2);
        if (qtype == T_Q4_1) memcpy(blk + scales_at + 32 + 2 * c, rb + 2, 2);
    }
}

/* Packs rows [16 p, 16 p + 16) of the raw weight: every block of the panel */
static void pack_panel(const qtype_info *info, int qtype, const uint8_t *w, int64_t stride,
                       int64_t n, int64_t K, int64_t p, uint8_t *out, unpacked_row *row) {
    const int64_t blocks = K / info->block, bytes = packed_block_bytes(qtype);
    memset(out, 0, (size_t)(blocks * bytes));
    for (int c = 0; c < PACKED_COLS; c++) {
        const uint8_t *raw = w + (16 * p + c < n ? 16 * p + c : n - 1) * stride;
        info->unpack(raw, K, row);
        for (int64_t b = 0; b < blocks; b++) {
            if (qtype == T_Q6_K) pack_q6k_block(row, b, raw + b * info->bytes, c, out + b * bytes);
            else if (info->kquant) pack_k_block(row, b, raw + b * info->bytes, c, out + b * bytes);
            else pack_32_block(qtype, row->u + 32 * b, raw + b * info->bytes, c, out + b * bytes);
        }
    }
}

/* The inverse of pack_panel for column c of a panel: its raw row of `qtype` blocks back */
static void unpack_packed_column(const qtype_info *info, int qtype, const uint8_t *panel,
                                 int64_t K, int c, uint8_t *raw) {
    const int64_t blocks = K / info->block, bytes = packed_block_bytes(qtype);
    const int scales_at = packed_scales_at(qtype);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * bytes;
        uint8_t u[32], *out = raw + b * info->bytes;
        if (info->kquant) {
            if (qtype == T_Q6_K) unpack_q6k_block(blk, c, out);
            else unpack_k_block(blk, c, out);
            continue;
        }
        for (int q = 0; q < 8; q++)
            for (int e = 0; e < 4; e++) {
                const int i = 4 * c + e;
                if (qtype == T_Q8_0) {
                    u[4 * q + e] = blk[64 * q + i];
                    continue;
                }
                u[4 * q + e] = (uint8_t)((blk[64 * (q / 2) + i] >> (4 * (q % 2))) & 0x0f);
                if (qtype == T_Q5_0 && (blk[256 + 8 * q + i / 8] >> (i % 8) & 1))
                    u[4 * q + e] |= 0x10;
            }
        int at = 2;                                           /* where the integers start */
        if (qtype == T_I4G) {
            memcpy(out, blk + scales_at + 4 * c, 4);
            memcpy(out + 4, blk + scales_at + 64 + 4 * c, 4);
            at = 8;
        } else {
            memcpy(out, blk + scales_at + 2 * c, 2);
            if (qtype == T_Q4_1) {
                memcpy(out + 2, blk + scales_at + 32 + 2 * c, 2);
                at = 4;
            }
        }
        if (qtype == T_Q8_0) {
            memcpy(out + 2, u, 32);
            continue;
        }
        if (qtype == T_Q5_0) {
            uint32_t qh = 0;
            for (int j = 0; j < 32; j++) qh |= (uint32_t)(u[j] >> 4) << j;
            memcpy(out + 2, &qh, 4);
            at = 6;
        }
        for (int j = 0; j < 16; j++)
            out[at + j] = (uint8_t)((u[j] & 0x0f) | (u[j + 16] & 0x0f) << 4);
    }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PACKED_SUPPORTED 1
#define PACKED_ROWS 6

/* d and dm of the panel's 16 columns, as the unpack_* functions derive them */
static inline void packed_scales(int qtype, const uint8_t *s, __m512 *d, __m512 *dm) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    if (qtype == T_I4G) {
        *d = _mm512_loadu_ps(s);
        *dm = _mm512_xor_ps(_mm512_loadu_ps(s + 64), sign);          /* -m */
        return;
    }
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
    switch (qtype) {
        case T_Q4_1:
            *dm = _mm512_xor_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32))),
                                sign);
            break;
        default: *dm = _mm512_setzero_ps();                           /* Q4_0, Q5_0, Q8_0 */
    }
}

/* What each row's block sum starts from, times -s (xz): z, or Q8_0's 128 as its quads are read
 * as w + 128 (gguf_packed_avx2.h: z alone, its Q8_0 multiplies signed bytes) */
static inline int packed_offset(int qtype) { return qtype == T_Q8_0 ? 128 : qtype_zero(qtype); }

/* quad q's 64 bytes (16 columns x 4 elements) of a packed block, unsigned: Q8_0's w + 128 (its
 * sums are corrected by 128 times x's block sum, so that each row's product is one vpdpbusd) */
static inline __m512i packed_quad(int qtype, const uint8_t *blk, int q) {
    if (qtype == T_Q8_0)
        return _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * q), _mm512_set1_epi8((char)0x80));
    const __m512i v = _mm512_loadu_si512(blk + 64 * (q / 2)), low4 = _mm512_set1_epi8(0x0f);
    __m512i u = q % 2 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low4) : _mm512_and_si512(v, low4);
    if (qtype == T_Q5_0) {
        uint64_t bits;
        memcpy(&bits, blk + 256 + 8 * q, 8);
        u = _mm512_mask_add_epi8(u, (__mmask64)bits, u, _mm512_set1_epi8(0x10));
    }
    return u;
}

#define DEFINE_PACKED_ROWS(NAME, QTYPE, ROWS)                                                    \
static void NAME(const uint8_t *panel, int64_t K, const int8_t *xq, const float *xd,           \
                 const int16_t *xs, const int32_t *xz, float out[PACKED_ROWS][PACKED_COLS],      \
                 int ahead) {                                                                    \
    const qtype_info *info = qtype_lookup(QTYPE);                                                \
    const int64_t blocks = K / 32, bytes = packed_block_bytes(QTYPE);                            \
    __m512 acc[ROWS];                                                                            \
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();                                 \
    for (int64_t b = 0; b < blocks; b++) {                                                       \
        const uint8_t *blk = panel + b * bytes;                                                  \
        if (ahead) prefetch_bytes(blk + 4 * bytes, bytes);        /* 4 blocks on */              \
        __m512i i1[ROWS];                           /* from -offset s: xz */                     \
        for (int r = 0; r < ROWS; r++)                                                           \
            i1[r] = packed_offset(QTYPE) ? _mm512_set1_epi32(xz[r * blocks + b])                 \
                                         : _mm512_setzero_si512();                               \
        for (int q = 0; q < 8; q++) {                                                            \
            const __m512i wv = packed_quad(QTYPE, blk, q);                                       \
            for (int r = 0; r < ROWS; r++)                                                       \
                i1[r] = _mm512_dpbusd_epi32(i1[r], wv, quad512_of(xq + r * K + 32 * b + 4 * q)); \
        }                                                                                        \
        __m512 d, dm;                                                                            \
        packed_scales(QTYPE, blk + packed_scales_at(QTYPE), &d, &dm);                            \
        for (int r = 0; r < ROWS; r++) {                                                         \
            const __m512 s1 = _mm512_mul_ps(d, _mm512_set1_ps(xd[r * blocks + b]));              \
            const __m512 t1 = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(i1[r]));                      \
            if (QTYPE != T_Q4_1 && QTYPE != T_I4G) {            /* dm = 0: one product */        \
                acc[r] = _mm512_add_ps(acc[r], t1);                                              \
                continue;                                                                        \
            }                                                                                    \
            const __m512 s2 = _mm512_mul_ps(dm, _mm512_set1_ps(xd[r * blocks + b]));             \
            const int32_t sum = (int32_t)xs[r * (K / 16) + 2 * b] + xs[r * (K / 16) + 2 * b + 1]; \
            acc[r] = _mm512_add_ps(acc[r], _mm512_sub_ps(                                        \
                t1, _mm512_mul_ps(s2, _mm512_cvtepi32_ps(_mm512_set1_epi32(sum)))));             \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(out[r], acc[r]);                             \
}

/* ahead: prefetch the weights (the first pass of rows over a panel; the others find them cached) */
typedef void (*packed_rows_fn)(const uint8_t *, int64_t, const int8_t *, const float *,
                               const int16_t *, const int32_t *, float[PACKED_ROWS][PACKED_COLS],
                               int);

#define DEFINE_PACKED_TYPE(T, QTYPE)                                                             \
    DEFINE_PACKED_ROWS(packed_##T##_1, QTYPE, 1)                                                 \
    DEFINE_PACKED_ROWS(packed_##T##_2, QTYPE, 2)                                                 \
    DEFINE_PACKED_ROWS(packed_##T##_3, QTYPE, 3)                                                 \
    DEFINE_PACKED_ROWS(packed_##T##_4, QTYPE, 4)                                                 \
    DEFINE_PACKED_ROWS(packed_##T##_5, QTYPE, 5)                                                 \
    DEFINE_PACKED_ROWS(packed_##T##_6, QTYPE, 6)                                                 \
    static const packed_rows_fn packed_##T[PACKED_ROWS] = {                                      \
        packed_##T##_1, packed_##T##_2, packed_##T##_3, packed_##T##_4, packed_##T##_5,          \
        packed_##T##_6};
DEFINE_PACKED_TYPE(q4_0, T_Q4_0)
DEFINE_PACKED_TYPE(q4_1, T_Q4_1)
DEFINE_PACKED_TYPE(q5_0, T_Q5_0)
DEFINE_PACKED_TYPE(q8_0, T_Q8_0)
DEFINE_PACKED_TYPE(i4g, T_I4G)

#define DEFINE_PACKED_K_TYPE(T, QTYPE)                                                           \
    DEFINE_PACKED_K_ROWS(packed_##T##_1, QTYPE, 1)                                               \
    DEFINE_PACKED_K_ROWS(packed_##T##_2, QTYPE, 2)                                               \
    DEFINE_PACKED_K_ROWS(packed_##T##_3, QTYPE, 3)                                               \
    DEFINE_PACKED_K_ROWS(packed_##T##_4, QTYPE, 4)                                               \
    DEFINE_PACKED_K_ROWS(packed_##T##_5, QTYPE, 5)                                               \
    DEFINE_PACKED_K_ROWS(packed_##T##_6, QTYPE, 6)                                               \
    static const packed_rows_fn packed_##T[PACKED_ROWS] = {                                      \
        packed_##T##_1, packed_##T##_2, packed_##T##_3, packed_##T##_4, packed_##T##_5,          \
        packed_##T##_6};
DEFINE_PACKED_K_TYPE(q4_k, T_Q4_K)
DEFINE_PACKED_K_TYPE(q6_k, T_Q6_K)

#elif defined(__AVX2__) && defined(__F16C__)
#define PACKED_SUPPORTED 1
#include "gguf_packed_avx2.h"
#else
#define PACKED_SUPPORTED 0
#endif

#if PACKED_SUPPORTED
/* xz[t][b] = -offset * (row t's sum over block b), what each row's integer sum starts from: read
 * from memory, a broadcast costs a packed body less than one from a computed scalar. For the
 * types with an offset (Q4_0, Q5_0, Q8_0); NULL without memory. */
static const int32_t *packed_offsets(int qtype, const int16_t *xs, int64_t m, int64_t k) {
    static __thread thread_buffer storage;
    const int offset = packed_offset(qtype);
    int32_t *xz = thread_buffer_get(&storage, m * (k / 32) * 4);
    if (xz == NULL) return NULL;
    for (int64_t i = 0; i < m * (k / 32); i++)
        xz[i] = -offset * ((int32_t)xs[2 * i] + xs[2 * i + 1]);
    return xz;
}

static const packed_rows_fn *packed_rows_for(int qtype) {
    switch (qtype) {
        case T_Q4_K: return packed_q4_k;
#if PACKED_Q6K
        case T_Q6_K: return packed_q6_k;
#endif
        case T_Q4_0: return packed_q4_0;
        case T_Q4_1: return packed_q4_1;
        case T_Q5_0: return packed_q5_0;
        case T_Q8_0: return packed_q8_0;
        default: return packed_i4g;
    }
}

/* linear_gguf.c's job over packed panels: w the packed bytes, w_stride a panel's bytes */
static void packed_task(void *ctx, int64_t task) {
    const linear_job *job = ctx;
    const packed_rows_fn *rows_fn = packed_rows_for(job->qtype);
    const int64_t K = job->k, blocks = K / qtype_lookup(job->qtype)->block;
    float out[PACKED_ROWS][PACKED_COLS];
    int64_t first, last;
    pa_task_panels(&job->split, task, &first, &last);
    for (int64_t p = first; p < last; p++) {
        const int64_t n0 = p * PACKED_COLS;
        const int live = job->n - n0 < PACKED_COLS ? (int)(job->n - n0) : PACKED_COLS;
        for (int64_t t = 0; t < job->m; t += PACKED_ROWS) {
            const int64_t rows = job->m - t < PACKED_ROWS ? job->m - t : PACKED_ROWS;
            rows_fn[rows - 1](job->w + p * job->w_stride, K, job->xq + t * K,
                              job->xd + t * blocks, job->xs + t * (K / 16),
                              job->xz ? job->xz + t * blocks : NULL, out, t == 0);
            for (int64_t r = 0; r < rows; r++)
                memcpy(job->y + (t + r) * job->ldy + n0, out[r], sizeof(float) * (size_t)live);
        }
    }
}

#ifdef PACKED_WIDE_MIN_ROWS
/* packed_task for many rows (AVX2): each panel spread once into a wide panel, then its passes */
static void packed_spread(const linear_job *job, const uint8_t *panel, int live, wide_panel *p) {
    (void)live;   /* a packed panel's short tail repeats its last row already */
    packed_to_wide(job->qtype, panel, job->k, p);
}

static void packed_wide_task(void *ctx, int64_t task) {
    wide_panels(ctx, task, ((const linear_job *)ctx)->w_stride, packed_spread);
}
#endif
#endif

/* ---- the library's entry points for packed weights (after linear_gguf.c's job types) ---- */

/* 1 where gguf_packed_linear runs (this build has its AVX-512 or AVX2 body), else 0 */
int gguf_packed_supported(void) { return PACKED_SUPPORTED; }

/* Bytes gguf_pack writes for n x k of `qtype`; -1 for bad sizes or a type that is not packed */
int64_t gguf_packed_bytes(int qtype, int64_t n, int64_t k) {
    const qtype_info *info = qtype_lookup(qtype);
    if (info == NULL || !packed_type(qtype) || n < 1 || k < info->block || k % info->block)
        return -1;
    return (n + PACKED_COLS - 1) / PACKED_COLS * (k / info->block) * packed_block_bytes(qtype);
}

/* The raw weight (n rows of `qtype` blocks, row r at w + r * w_stride) repacked into out:
 * gguf_packed_bytes(qtype, n, k) bytes. Returns 0; -1 on bad sizes; -2 without
 * memory; -3 for a type that is not packed. */
int gguf_pack(int qtype, const uint8_t *w, int64_t n, int64_t k, int64_t w_stride, uint8_t *out) {
    const qtype_info *info = qtype_lookup(qtype);
    if (info == NULL || !packed_type(qtype)) return -3;
    if (check_sizes(info, n, k, w_stride)) return -1;
    uint8_t *u = malloc((size_t)k);
    int16_t *sc = malloc(sizeof(int16_t) * (size_t)(k / 2 + k / 16));
    float *d = malloc(sizeof(float) * 2 * (size_t)(k / 32));
    if (u == NULL || sc == NULL || d == NULL) {
        free(u);
        free(sc);
        free(d);
        return -2;
    }
    unpacked_row row = {u, sc, sc + k / 2, d, d + k / info->block};
    const int64_t panel_bytes = k / info->block * packed_block_bytes(qtype);
    for (int64_t p = 0; p < (n + PACKED_COLS - 1) / PACKED_COLS; p++)
        pack_panel(info, qtype, w, w_stride, n, k, p, out + p * panel_bytes, &row);
    free(u);
    free(sc);
    free(d);
    return 0;
}

/* Rows idx[0..count) of a packed weight as raw rows of `qtype` blocks (row i at
 * out + i * out_stride); every row when idx is NULL (count = n): gguf_pack's inverse.
 * Returns 0; -1 on bad sizes or an index out of range; -3 for a type that is not packed. */
int gguf_unpack_packed(int qtype, const uint8_t *packed, int64_t n, int64_t k,
                       const int64_t *idx, int64_t count, uint8_t *out, int64_t out_stride) {
    const qtype_info *info = qtype_lookup(qtype);
    if (info == NULL || !packed_type(qtype)) return -3;
    if (check_sizes(info, n, k, out_stride)) return -1;
    const int64_t panel_bytes = k / info->block * packed_block_bytes(qtype);
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = idx == NULL ? i : idx[i];
        if (r < 0 || r >= n) return -1;
        unpack_packed_column(info, qtype, packed + r / PACKED_COLS * panel_bytes, k,
                             (int)(r % PACKED_COLS), out + i * out_stride);
    }
    return 0;
}

/* y = x W^T for a weight packed by gguf_pack, as gguf_linear computes it (the same bits).
 * Returns 0; -1 on bad sizes; -2 without memory; -3 where this build does not run it. */
int gguf_packed_linear(int qtype, const uint8_t *packed, int64_t n, int64_t k, const float *x,
                       int64_t m, int64_t ldx, float *y, int64_t ldy, int num_threads) {
    const qtype_info *info = qtype_lookup(qtype);
    if (info == NULL || !packed_type(qtype) || !PACKED_SUPPORTED) return -3;
    if (n < 1 || k < info->block || k % info->block != 0 || m < 1 || ldx < k || ldy < n)
        return -1;
#if PACKED_SUPPORTED
    const int threads = num_threads < 1 ? 1 : num_threads;
    int8_t *xq;
    float *xd;
    int16_t *xs;
    if (quantize_x(info->block, x, m, k, ldx, threads, &xq, &xd, &xs) != 0) return -2;
    linear_job job = {info, qtype, packed, n, k, k / info->block * packed_block_bytes(qtype), xq,
                      xd, xs, m, y, ldy, 0, NULL};
    job.split = pa_panel_tasks((n + PACKED_COLS - 1) / PACKED_COLS, threads, PACKED_COLS * k * m);
    task_fn run = packed_task;
#ifdef PACKED_WIDE_MIN_ROWS
    if (m >= PACKED_WIDE_MIN_ROWS) run = packed_wide_task;
#endif
    if (packed_offset(qtype)) {   /* AVX2's wide passes too: its offsets are the zero points */
        job.xz = packed_offsets(qtype, xs, m, k);
        if (job.xz == NULL) return -2;
    }
    pa_run_tasks(threads, run, &job, pa_task_count(&job.split));
    return job.failed ? -2 : 0;
#else
    return 0;
#endif
}

#endif

/* gguf_wide.h's panel product with AVX2: one half of a panel (8 columns, one ymm) at a time,
 * so that a pass of WIDE_ROWS rows holds each row's float sums, int32 sums and int16 runs in
 * the 16 ymm registers. A quad's vpmaddubsw results add up in int16 lanes for a run of quads
 * (qtype_info's sums16: exact, no lane can overflow), then widen once: one vpmaddwd for every
 * run, not one for every quad. The integer sums are exact and the fp32 terms are the row
 * paths' (d da I1 - dm da I2, in block order), so the bits are the same. With AVX-VNNI, vpdpbusd
 * widens as it adds: the 32-element types' quads go straight into int32 lanes.
 * Included by gguf_wide.h. */
#ifndef PAGEDSERVE_GGUF_WIDE_AVX2_H
#define PAGEDSERVE_GGUF_WIDE_AVX2_H

static inline __m256i quad_of(const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, 4);
    return _mm256_set1_epi32(quad);
}

/* A run: quads whose vpmaddubsw results add up in int16 lanes, widened once. Shared with
 * gguf_packed_avx2.h. */
#define RUN_QUADS 4   /* a run's weights stay in registers (Q4's sums16 would allow 8) */
#if defined(__AVXVNNI__)
#define RUN_ADD(t, u, a) _mm256_dpbusd_avx_epi32((t), (u), (a))
#define RUN_WIDEN(t) (t)
#else
#define RUN_ADD(t, u, a) _mm256_add_epi16((t), _mm256_maddubs_epi16((u), (a)))
#define RUN_WIDEN(t) _mm256_madd_epi16((t), _mm256_set1_epi16(1))
#endif

/* quads a run of `info`'s type adds: its sums16 (what an int16 lane holds exactly), at most
 * RUN_QUADS; with AVX-VNNI one for the 32-element types (RUN_ADD's vpdpbusd widens as it adds;
 * the k-quants' group scales still take vpmaddubsw + vpmaddwd) */
static inline int quad_run(const qtype_info *info) {
#if defined(__AVXVNNI__)
    if (!info->kquant) return 1;
#endif
    return info->sums16 < RUN_QUADS ? info->sums16 : RUN_QUADS;
}

/* two k-quant groups' mins (int32 per column) as int16 pairs, for one vpmaddwd with two x sums */
static inline __m256i mins_pair(__m256i mc0, __m256i mc1) {
    return _mm256_or_si256(_mm256_and_si256(mc0, _mm256_set1_epi32(0xffff)),
                           _mm256_slli_epi32(mc1, 16));
}

/* the int16 pair xs[0], xs[1] in every int32 lane */
static inline __m256i xs_pair(const int16_t *xs) {
    int32_t pair;
    memcpy(&pair, xs, 4);
    return _mm256_set1_epi32(pair);
}

/* The type whose pass runs `info`'s: the same run (the smallest sums16 of its kind), signed
 * bytes or not, dm term or not. Passes are specialised for these six. */
static inline int wide_kind(const qtype_info *info) {
    if (info->kquant) return info->sums16 >= 4 ? T_Q5_K : T_Q6_K;     /* Q4_K runs as Q5_K */
    if (info->signed_u) return T_Q8_0;
    if (info->sums16 >= 8) return info->zero ? T_Q4_0 : T_Q4_1;      /* I4G runs as Q4_1 */
    return T_Q5_0;
}

/* a type's dm term is nonzero: the k-quants', and the 32-element types' without a zero point */
static inline int has_dm(const qtype_info *info) {
    return info->kquant || (!info->signed_u && !info->zero);
}

/* one block of a 32-element type: i1[r] for half h's 8 columns (from zero, before z s). A run's
 * weights are loaded once, then each row adds its quads in turn: the registers hold the run, one
 * row's int16 sums and every row's int32 sums. */
static inline __attribute__((always_inline)) void wide_block32(
        const wide_panel *p, int kind, int rows, int h, int64_t b, const int8_t *xq, int64_t K,
        __m256i i1[WIDE_ROWS]) {
    const qtype_info *k = qtype_lookup(kind);
    const int run = quad_run(k);
    for (int r = 0; r < rows; r++) i1[r] = _mm256_setzero_si256();
#pragma GCC unroll 1   /* Q8_0: 8 runs of one quad, unrolled with 4 rows, spill */
    for (int q0 = 0; q0 < 8; q0 += run) {
        __m256i w[4], u[4];
        for (int q = 0; q < run; q++) {
            w[q] = _mm256_loadu_si256((const __m256i *)(p->wq + (b * 8 + q0 + q) * WIDE * 4 + 32 * h));
            u[q] = k->signed_u ? _mm256_abs_epi8(w[q]) : w[q];
        }
        for (int r = 0; r < rows; r++) {
            __m256i t = _mm256_setzero_si256();
            for (int q = 0; q < run; q++) {
                const __m256i xv = quad_of(xq + r * K + 32 * b + 4 * (q0 + q));
                t = RUN_ADD(t, u[q], k->signed_u ? _mm256_sign_epi8(xv, w[q]) : xv);
            }
            i1[r] = _mm256_add_epi32(i1[r], RUN_WIDEN(t));
        }
    }
}

/* one block of a k-quant: i1[r] = sum over its 16 groups of sc times the group's sum, and
 * i2[r] = sum of mc times the group's x sum, for half h's 8 columns */
static inline __attribute__((always_inline)) void wide_block_k(
        const wide_panel *p, int kind, int rows, int h, int64_t b, const int8_t *xq,
        const int16_t *xs, int64_t K, __m256i i1[WIDE_ROWS], __m256i i2[WIDE_ROWS]) {
    const int run = quad_run(qtype_lookup(kind));
    for (int r = 0; r < rows; r++) i1[r] = i2[r] = _mm256_setzero_si256();
    for (int64_t g = 16 * b; g < 16 * b + 16; g++) {
        const __m256i sc = _mm256_loadu_si256((const __m256i *)(p->sc + g * WIDE * 2 + 16 * h));
        for (int q0 = 0; q0 < 4; q0 += run) {
            __m256i w[4];
            for (int q = 0; q < run; q++)
                w[q] = _mm256_loadu_si256(
                    (const __m256i *)(p->wq + (g * 4 + q0 + q) * WIDE * 4 + 32 * h));
            for (int r = 0; r < rows; r++) {
                __m256i t = _mm256_setzero_si256();   /* int16 lanes, before the group's scale */
                for (int q = 0; q < run; q++)
                    t = _mm256_add_epi16(t, _mm256_maddubs_epi16(
                        w[q], quad_of(xq + r * K + 16 * g + 4 * (q0 + q))));
                i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(t, sc));
            }
        }
    }
    /* the mins after the scales, so that their sums are not live beside the runs: two groups'
     * mc as int16 pairs meet the rows' two x sums (adjacent int16s) in one vpmaddwd */
    for (int64_t g = 16 * b; g < 16 * b + 16; g += 2) {
        const __m256i mc = mins_pair(
            _mm256_loadu_si256((const __m256i *)(p->mc + g * WIDE + 8 * h)),
            _mm256_loadu_si256((const __m256i *)(p->mc + (g + 1) * WIDE + 8 * h)));
        for (int r = 0; r < rows; r++)
            i2[r] = _mm256_add_epi32(i2[r], _mm256_madd_epi16(mc, xs_pair(xs + r * (K / 16) + g)));
    }
}

/* out[r][8h .. 8h + 7] for `rows` rows of x: half h of the panel, every block */
static inline __attribute__((always_inline)) void wide_half(
        const wide_panel *p, const qtype_info *info, int kind, int rows, int h,
        const int8_t *xq, const float *xd, const int16_t *xs, const int32_t *xz, int64_t K,
        float out[WIDE_ROWS][WIDE]) {
    const int64_t blocks = K / info->block;
    const qtype_info *k = qtype_lookup(kind);
    const int dm_term = has_dm(k);
    __m256 acc[WIDE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i i1[WIDE_ROWS], i2[WIDE_ROWS];
        if (k->kquant) {
            wide_block_k(p, kind, rows, h, b, xq, xs, K, i1, i2);
        } else {
            wide_block32(p, kind, rows, h, b, xq, K, i1);
            for (int r = 0; r < rows; r++) {
                if (dm_term || (info->zero && xz == NULL)) {
                    const int32_t sum = (int32_t)xs[r * (K / 16) + 2 * b] + xs[r * (K / 16) + 2 * b + 1];
                    if (info->zero) i1[r] = _mm256_sub_epi32(i1[r], _mm256_set1_epi32(info->zero * sum));
                    i2[r] = _mm256_set1_epi32(sum);
                } else if (info->zero) {
                    i1[r] = _mm256_add_epi32(i1[r], _mm256_set1_epi32(xz[r * blocks + b]));
                }
            }
        }
        const __m256 d = _mm256_loadu_ps(p->d + b * WIDE + 8 * h);
        const __m256 dm = _mm256_loadu_ps(p->dm + b * WIDE + 8 * h);
        for (int r = 0; r < rows; r++) {
            const __m256 dav = _mm256_set1_ps(xd[r * blocks + b]);
            const __m256 t1 = _mm256_mul_ps(_mm256_mul_ps(d, dav), _mm256_cvtepi32_ps(i1[r]));
            acc[r] = _mm256_add_ps(acc[r], dm_term ? _mm256_sub_ps(t1, _mm256_mul_ps(
                _mm256_mul_ps(dm, dav), _mm256_cvtepi32_ps(i2[r]))) : t1);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
}

#define WIDE_KIND_CASE(KIND, ROWS)                                                               \
    case KIND:                                                                                   \
        for (int h = 0; h < 2; h++) wide_half(p, info, KIND, ROWS, h, xq, xd, xs, xz, K, out);   \
        return;

#define DEFINE_WIDE_ROWS(ROWS)                                                                   \
static void wide_rows_##ROWS(const wide_panel *p, const qtype_info *info, const int8_t *xq,     \
                             const float *xd, const int16_t *xs, const int32_t *xz, int64_t K,   \
                             float out[WIDE_ROWS][WIDE]) {                                       \
    switch (wide_kind(info)) {                                                                   \
        WIDE_KIND_CASE(T_Q8_0, ROWS)                                                             \
        WIDE_KIND_CASE(T_Q4_0, ROWS)                                                             \
        WIDE_KIND_CASE(T_Q4_1, ROWS)                                                             \
        WIDE_KIND_CASE(T_Q5_0, ROWS)                                                             \
        WIDE_KIND_CASE(T_Q5_K, ROWS)                                                             \
        default: WIDE_KIND_CASE(T_Q6_K, ROWS)                                                    \
    }                                                                                            \
}
DEFINE_WIDE_ROWS(1)
DEFINE_WIDE_ROWS(2)
DEFINE_WIDE_ROWS(3)
DEFINE_WIDE_ROWS(4)
typedef void (*wide_rows_t)(const wide_panel *, const qtype_info *, const int8_t *, const float *,
                            const int16_t *, const int32_t *, int64_t, float[WIDE_ROWS][WIDE]);
static const wide_rows_t wide_rows_fn[WIDE_ROWS] = {wide_rows_1, wide_rows_2, wide_rows_3,
                                                    wide_rows_4};

#endif

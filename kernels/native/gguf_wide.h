/* linear_gguf.c for many rows of x (batched decode, prefill): 16 rows of W unpacked once per
 * call into the layout of linear_q8.c's panels (for each 4 consecutive k, the 16 rows' 4 bytes
 * side by side), so that a broadcast quad of x meets 16 output columns in two vectors and no
 * horizontal sum is needed; block scales per column, [block][16]. Each column's integer sums
 * and fp32 terms are those of the row paths (gguf_unpack.h), so the bits are the same. AVX2. */
#ifndef PAGEDSERVE_GGUF_WIDE_H
#define PAGEDSERVE_GGUF_WIDE_H

#define WIDE 16        /* columns of y a panel */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE_ROWS 6    /* rows of x a pass: a panel's 16 columns are one zmm */
#else
#define WIDE_ROWS 4    /* rows of x a pass: one half of a panel (8 columns) at a time */
#endif

typedef struct {
    uint8_t *wq;       /* [K / 4][WIDE][4] */
    float *d, *dm;     /* [K / block][WIDE] */
    int16_t *sc;       /* [K / 16][WIDE][2] (k-quants) */
    int32_t *mc;       /* [K / 16][WIDE] (k-quants) */
    uint8_t *rows_u;   /* [WIDE][K]: the rows' u, before they are spread into the panel */
    unpacked_row row;  /* one row's other parts (its u is in rows_u) */
} wide_panel;

/* The calling thread's wide panel for K columns (grown, never shrunk); -1 without memory */
static int wide_storage(int64_t K, int block, wide_panel *p) {
    static __thread thread_buffer storage;
    const int64_t blocks = K / block, groups = K / 16;
    const int64_t sizes[] = {WIDE * K, 4 * WIDE * blocks, 4 * WIDE * blocks, 4 * WIDE * groups,
                             4 * WIDE * groups, WIDE * K, K, 2 * groups, 4 * blocks, 4 * blocks};
    int64_t offsets[10], total = 0;
    for (int i = 0; i < 10; i++) {
        offsets[i] = total;
        total += (sizes[i] + 63) / 64 * 64;
    }
    uint8_t *buffer = thread_buffer_get(&storage, total);
    if (buffer == NULL) return -1;
    p->wq = buffer + offsets[0];
    p->d = (float *)(buffer + offsets[1]);
    p->dm = (float *)(buffer + offsets[2]);
    p->sc = (int16_t *)(buffer + offsets[3]);
    p->mc = (int32_t *)(buffer + offsets[4]);
    p->rows_u = buffer + offsets[5];
    p->row.u = NULL;
    p->row.sc2 = (int16_t *)(buffer + offsets[6]);
    p->row.mc = (int16_t *)(buffer + offsets[7]);
    p->row.d = (float *)(buffer + offsets[8]);
    p->row.dm = (float *)(buffer + offsets[9]);
    return 0;
}

#if defined(__AVX512F__)
/* The 16 rows' quads q0 .. q0+16 (64 bytes of each row from u + c * ldu) into the panel's
 * layout: out quad q holds column c's 4 bytes at 4c. A 16 x 16 transpose of 32-bit words. */
static inline void wide_transpose16(const uint8_t *u, int64_t ldu, uint8_t *out) {
    __m512i r[16], t[16];
    for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_si512(u + c * ldu);
    for (int c = 0; c < 16; c += 2) {
        t[c] = _mm512_unpacklo_epi32(r[c], r[c + 1]);
        t[c + 1] = _mm512_unpackhi_epi32(r[c], r[c + 1]);
    }
    for (int c = 0; c < 16; c += 4)
        for (int h = 0; h < 2; h++) {
            r[c + h] = _mm512_unpacklo_epi64(t[c + h], t[c + 2 + h]);
            r[c + 2 + h] = _mm512_unpackhi_epi64(t[c + h], t[c + 2 + h]);
        }
    /* r[4i + j] holds, in 128-bit lane l, quad 4l + (0, 2, 1, 3)[j] of rows 4i .. 4i+3 */
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[j + 8 * i], r[j + 8 * i + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[j + 8 * i], r[j + 8 * i + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
    /* r[k] holds quad order[k] of all 16 rows */
    static const int order[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
    for (int k = 0; k < 16; k++) _mm512_storeu_si512(out + order[k] * WIDE * 4, r[k]);
}
#endif

static void wide_unpack(const qtype_info *info, const uint8_t *w, int64_t stride, int live,
                        int64_t K, wide_panel *p) {
    const int64_t blocks = K / info->block;
    int64_t done = 0;   /* quads already in the panel */
    for (int c = 0; c < WIDE; c++) {
        unpacked_row row = p->row;
        row.u = p->rows_u + c * K;
        info->unpack(w + (c < live ? c : live - 1) * stride, K, &row);
        for (int64_t b = 0; b < blocks; b++) {
            p->d[b * WIDE + c] = row.d[b];
            p->dm[b * WIDE + c] = row.dm[b];
        }
        if (info->kquant)
            for (int64_t g = 0; g < K / 16; g++) {
                p->sc[(g * WIDE + c) * 2] = p->sc[(g * WIDE + c) * 2 + 1] = row.sc2[8 * g];
                p->mc[g * WIDE + c] = row.mc[g];
            }
    }
#if defined(__AVX512F__)
    for (; done + 16 <= K / 4; done += 16)
        wide_transpose16(p->rows_u + 4 * done, K, p->wq + done * WIDE * 4);
#endif
    for (int c = 0; c < WIDE; c++)
        for (int64_t q = done; q < K / 4; q++)
            memcpy(p->wq + (q * WIDE + c) * 4, p->rows_u + c * K + 4 * q, 4);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "gguf_wide512.h"
#else
#include "gguf_wide_avx2.h"
#endif

/* y[t][n0 .. n0 + live) for every row t of x, one wide panel; xz: each row's block sums times
 * -z where the caller has them (NULL: the passes derive them from xs). The next panel's
 * next_bytes (next: NULL for none) are prefetched a slice a pass, so that the requests are
 * spread over the panel's time rather than a burst that stalls on full miss buffers. */
static void wide_panel_all_rows(const wide_panel *p, const qtype_info *info, const int8_t *xq,
                                const float *xd, const int16_t *xs, const int32_t *xz, int64_t m,
                                int64_t K, float *y, int64_t ldy, int64_t n0, int live,
                                const uint8_t *next, int64_t next_bytes) {
    float out[WIDE_ROWS][WIDE];
    const int64_t blocks = K / info->block;
    const int64_t passes = (m + WIDE_ROWS - 1) / WIDE_ROWS;
    const int64_t slice = (next_bytes / passes + 64) / 64 * 64;
    for (int64_t t = 0; t < m; t += WIDE_ROWS) {
        const int64_t rows = m - t < WIDE_ROWS ? m - t : WIDE_ROWS;
        if (next != NULL) {
            const int64_t at = t / WIDE_ROWS * slice;
            if (at < next_bytes)
                prefetch_bytes(next + at, at + slice < next_bytes ? slice : next_bytes - at);
        }
        const int8_t *x = xq + t * K;
        const float *d = xd + t * blocks;
        const int16_t *s = xs + t * (K / 16);
        wide_rows_fn[rows - 1](p, info, x, d, s, xz ? xz + t * blocks : NULL, K, out);
        for (int64_t r = 0; r < rows; r++)
            memcpy(y + (t + r) * ldy + n0, out[r], sizeof(float) * (size_t)live);
    }
}

#endif

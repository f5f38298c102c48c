/* Paged attention for CPU workers, called through ctypes (kernels/native/__init__.py).
 *
 * Same contracts as paged_decode_attention_ref / paged_prefill_attention_ref
 * (kernels/paged_decode_attention.py, kernels/paged_prefill_attention.py): caches are layer views
 * [num_blocks, block_size, Hkv, D] with unit stride on D; q and out are [N, Hq, D] contiguous;
 * query head qh reads kv head qh / (Hq / Hkv).
 *
 * Why a native kernel: on a CPU the torch path gathers every sequence's pages into a scratch
 * buffer and then runs SDPA over it, so the KV cache crosses the memory bus three times and
 * SDPA's q_len=1 path is far from bandwidth-bound. Here each task streams its pages once, straight
 * from the block table: pass 1 computes the scores of all query heads against one token's K row
 * (Hkv * D contiguous values), the softmax runs over the task's scores in a small buffer, and
 * pass 2 accumulates the V rows. Work is split into tasks of (sequence, partition of at most
 * PART tokens); sequences longer than one partition are combined by their log-sum-exp.
 *
 * Threads: OpenMP, the same libgomp (soname libgomp.so.1) torch has loaded. num_threads > 0
 * sets the team size, else torch's set_num_threads governs. Tasks are handed out dynamically, so
 * a thread that the OS deschedules (other processes on the cores) delays the call by at most
 * one task, unlike a statically split torch op that waits for the thread's whole share. Compiled with -O3 -march=native and the float flags that allow
 * vectorized reductions; no -ffast-math (it would set FTZ/DAZ for the whole process).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef uint16_t bf16_t;

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float load_bf16(const bf16_t *p, int64_t i) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)p[i] << 16;
    return v.f;
}
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }
static inline void store_bf16(bf16_t *p, int64_t i, float x) {
    union { uint32_t u; float f; } v;
    v.f = x;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) { p[i] = (bf16_t)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    p[i] = (bf16_t)(u >> 16);
}

/* exp(x) for x <= 0 (scores minus their max), vectorizable: 2^x = 2^i * 2^f, |f| <= 0.5,
 * degree-6 polynomial for 2^f (relative error ~2e-7). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.4426950408889634f;
    float i = __builtin_rintf(t);
    float f = t - i;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)i + 127) << 23;
    return p * scale.f;
}

#define MAX_HEAD_DIM 256

/* One task: query rows q[0..rows) (row r at position pos0 + r, or all at pos0 for decode), heads
 * Hq, against keys [k0, k1) of one sequence. Causal: key t is visible to row r iff
 * t <= pos0 + r. Writes, per (row, head), the max score m, the sum of exp(s - m) l and the
 * unnormalized accumulator acc[D] (fp32), into part_m / part_l / part_acc. */
#define DEFINE_TASK(SUFFIX, T, LOAD)                                                          \
static inline __attribute__((always_inline)) int attend_##SUFFIX(                                                                  \
        const T *q, int64_t q_stride_row, int rows, int64_t pos0, int causal,                \
        const T *k_cache, const T *v_cache, int64_t stride_blk, int64_t stride_tok,          \
        int64_t stride_head, const int32_t *table, int64_t num_blocks, int block_size,     \
        int64_t k0, int64_t k1,                                                              \
        int num_q_heads, int num_kv_heads, int head_dim, float scale,                         \
        float *qf, float *scores, float *part_m, float *part_l, float *part_acc) {           \
    const int group = num_q_heads / num_kv_heads;                                             \
    const int64_t n = k1 - k0;                                                                \
    const int D = head_dim;                                                                   \
    for (int r = 0; r < rows; r++)                                                            \
        for (int qh = 0; qh < num_q_heads; qh++)                                              \
            for (int d = 0; d < D; d++)                                                       \
                qf[((int64_t)r * num_q_heads + qh) * D + d] =                                 \
                    LOAD(q, r * q_stride_row + (int64_t)qh * D + d) * scale;                  \
    /* pass 1: scores[(r, qh), j] for key k0 + j */                                           \
    const int64_t lines = (int64_t)rows * num_q_heads;                                        \
    for (int64_t t = k0; t < k1;) {                                                           \
        const int64_t blk = table[t / block_size];                                            \
        if (blk < 0 || blk >= num_blocks) return -6;                                          \
        const int64_t off = t % block_size;                                                   \
        int64_t count = block_size - off;                                                     \
        if (count > k1 - t) count = k1 - t;                                                   \
        for (int h = 0; h < num_kv_heads; h++) {                                              \
            const T *kbase = k_cache + blk * stride_blk + off * stride_tok + h * stride_head; \
            for (int64_t j = 0; j < count; j++) {                                             \
                const T *krow = kbase + j * stride_tok;                                       \
                float kf[MAX_HEAD_DIM];                                                       \
                for (int d = 0; d < D; d++) kf[d] = LOAD(krow, d);                            \
                for (int r = 0; r < rows; r++)                                                \
                    for (int g = 0; g < group; g++) {                                         \
                        const int64_t line = (int64_t)r * num_q_heads + h * group + g;        \
                        const float *qrow = qf + line * D;                                    \
                        float s = 0.0f;                                                       \
                        for (int d = 0; d < D; d++) s += qrow[d] * kf[d];                     \
                        scores[line * n + (t - k0) + j] = s;                                  \
                    }                                                                         \
            }                                                                                 \
        }                                                                                     \
        t += count;                                                                           \
    }                                                                                         \
    /* softmax numerators per line, over its visible keys */                                  \
    for (int64_t line = 0; line < lines; line++) {                                            \
        const int64_t r = line / num_q_heads;                                                 \
        int64_t visible = n;                                                                  \
        if (causal) {                                                                         \
            visible = pos0 + r + 1 - k0;                                                      \
            if (visible > n) visible = n;                                                     \
            if (visible < 0) visible = 0;                                                     \
        }                                                                                     \
        float *s = scores + line * n;                                                         \
        float m = -3.0e38f;                                                                   \
        for (int64_t j = 0; j < visible; j++) m = s[j] > m ? s[j] : m;                        \
        float l = 0.0f;                                                                       \
        for (int64_t j = 0; j < visible; j++) { float e = exp_nonpos(s[j] - m); s[j] = e; l += e; } \
        for (int64_t j = visible; j < n; j++) s[j] = 0.0f;                                    \
        part_m[line] = m;                                                                     \
        part_l[line] = l;                                                                     \
    }                                                                                         \
    /* pass 2: acc[(r, qh)] += p * V row */                                                   \
    memset(part_acc, 0, sizeof(float) * lines * D);                                           \
    for (int64_t t = k0; t < k1;) {                                                           \
        const int64_t blk = table[t / block_size];                                            \
        const int64_t off = t % block_size;                                                   \
        int64_t count = block_size - off;                                                     \
        if (count > k1 - t) count = k1 - t;                                                   \
        for (int h = 0; h < num_kv_heads; h++) {                                              \
            const T *vbase = v_cache + blk * stride_blk + off * stride_tok + h * stride_head; \
            for (int64_t j = 0; j < count; j++) {                                             \
                const T *vrow = vbase + j * stride_tok;                                       \
                float vf[MAX_HEAD_DIM];                                                       \
                for (int d = 0; d < D; d++) vf[d] = LOAD(vrow, d);                            \
                for (int r = 0; r < rows; r++)                                                \
                    for (int g = 0; g < group; g++) {                                         \
                        const int64_t line = (int64_t)r * num_q_heads + h * group + g;        \
                        const float p = scores[line * n + (t - k0) + j];                      \
                        float *acc = part_acc + line * D;                                     \
                        for (int d = 0; d < D; d++) acc[d] += p * vf[d];                      \
                    }                                                                         \
            }                                                                                 \
        }                                                                                     \
        t += count;                                                                           \
    }                                                                                         \
    return 0;                                                                                 \
}

DEFINE_TASK(f32, float, load_f32)
DEFINE_TASK(bf16, bf16_t, load_bf16)

#if defined(__AVX512F__)
#include <immintrin.h>

/* AVX-512 path for head_dim a multiple of 16: the same task as attend_*, with the K/V rows
 * converted once per (token, kv head) and shared by the group's query heads, and a vector exp. */

static inline __attribute__((always_inline)) __m512 loadv(const void *base, int64_t i, int is_bf16) {
    if (is_bf16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const bf16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

/* exp(x) for x <= 0 lanes, same polynomial as exp_nonpos; 2^i applied by vscalefps. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, i);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, i);
}

/* Where the table's block `index` starts (bytes), or NULL past the range: blocks are scattered,
 * so the hardware prefetcher cannot guess where the next one starts. The loops below prefetch
 * the next block's row j while they compute row j of this one, which keeps a steady number of
 * misses in flight instead of stalling on a burst. */
static inline __attribute__((always_inline)) const char *block_start(
        const void *cache, const int32_t *table, int64_t index, int64_t last, int64_t num_blocks,
        int64_t stride_blk, int is_bf16) {
    if (index > last) return NULL;
    const int64_t blk = table[index];
    if (blk < 0 || blk >= num_blocks) return NULL;
    return (const char *)cache + blk * stride_blk * (is_bf16 ? 2 : 4);
}

static inline __attribute__((always_inline)) void prefetch_row(const char *block, int64_t row,
                                                               int64_t row_bytes) {
    if (!block) return;
    const char *start = block + row * row_bytes;
    for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(start + at, _MM_HINT_T0);
}

static inline __attribute__((always_inline)) int attend512(
        const void *q, int64_t q_stride_row, int rows, int64_t pos0, int causal,
        const void *k_cache, const void *v_cache, int64_t stride_blk, int64_t stride_tok,
        int64_t stride_head, const int32_t *table, int64_t num_blocks, int block_size,
        int64_t k0, int64_t k1, int num_q_heads, int num_kv_heads, const int NV, float scale,
        float *qf, float *scores, float *part_m, float *part_l, float *part_acc, int is_bf16) {
    const int group = num_q_heads / num_kv_heads;
    const int64_t n = k1 - k0;
    const int64_t D = 16 * NV;
    const int64_t lines = (int64_t)rows * num_q_heads;
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t row_bytes = stride_tok * (is_bf16 ? 2 : 4);
    for (int64_t line = 0; line < lines; line++) {
        const int64_t r = line / num_q_heads, qh = line % num_q_heads;
        for (int c = 0; c < NV; c++)
            _mm512_storeu_ps(qf + line * D + 16 * c,
                             _mm512_mul_ps(loadv(q, r * q_stride_row + qh * D + 16 * c, is_bf16),
                                           vscale));
    }
    /* pass 1: scores */
    for (int64_t t = k0; t < k1;) {
        const int64_t blk = table[t / block_size];
        if (blk < 0 || blk >= num_blocks) return -6;
        const int64_t off = t % block_size;
        int64_t count = block_size - off;
        if (count > k1 - t) count = k1 - t;
        const int64_t row0 = blk * stride_blk + off * stride_tok;
        const char *next = block_start(k_cache, table, t / block_size + 1, (k1 - 1) / block_size,
                                       num_blocks, stride_blk, is_bf16);
        for (int64_t j = 0; j < count; j++) {
            prefetch_row(next, j, row_bytes);
            for (int h = 0; h < num_kv_heads; h++) {
                const int64_t at = row0 + j * stride_tok + h * stride_head;
                __m512 k[16];
                for (int c = 0; c < NV; c++) k[c] = loadv(k_cache, at + 16 * c, is_bf16);
                for (int r = 0; r < rows; r++)
                    for (int g = 0; g < group; g++) {
                        const int64_t line = (int64_t)r * num_q_heads + h * group + g;
                        const float *qrow = qf + line * D;
                        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qrow), k[0]);
                        for (int c = 1; c < NV; c++)
                            a = _mm512_fmadd_ps(_mm512_loadu_ps(qrow + 16 * c), k[c], a);
                        scores[line * n + (t - k0) + j] = _mm512_reduce_add_ps(a);
                    }
            }
        }
        t += count;
    }
    /* softmax numerators */
    for (int64_t line = 0; line < lines; line++) {
        const int64_t r = line / num_q_heads;
        int64_t visible = n;
        if (causal) {
            visible = pos0 + r + 1 - k0;
            if (visible > n) visible = n;
            if (visible < 0) visible = 0;
        }
        float *s = scores + line * n;
        __m512 vm = _mm512_set1_ps(-3.0e38f);
        for (int64_t j = 0; j < visible; j += 16) {
            const __mmask16 mask = visible - j >= 16 ? 0xffff : (__mmask16)((1u << (visible - j)) - 1);
            vm = _mm512_mask_max_ps(vm, mask, vm, _mm512_maskz_loadu_ps(mask, s + j));
        }
        const float m = _mm512_reduce_max_ps(vm);
        const __m512 bm = _mm512_set1_ps(m);
        __m512 vl = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const int64_t left = n - j;
            const __mmask16 inside = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const int64_t vis = visible - j;
            const __mmask16 seen = vis >= 16 ? 0xffff : vis <= 0 ? 0 : (__mmask16)((1u << vis) - 1);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(seen, s + j), bm));
            e = _mm512_maskz_mov_ps(seen, e);
            _mm512_mask_storeu_ps(s + j, inside, e);
            vl = _mm512_add_ps(vl, e);
        }
        part_m[line] = m;
        part_l[line] = _mm512_reduce_add_ps(vl);
    }
    /* pass 2: acc += p * V row */
    memset(part_acc, 0, sizeof(float) * lines * D);
    for (int64_t t = k0; t < k1;) {
        const int64_t blk = table[t / block_size];
        const int64_t off = t % block_size;
        int64_t count = block_size - off;
        if (count > k1 - t) count = k1 - t;
        const int64_t row0 = blk * stride_blk + off * stride_tok;
        const char *next = block_start(v_cache, table, t / block_size + 1, (k1 - 1) / block_size,
                                       num_blocks, stride_blk, is_bf16);
        for (int64_t j = 0; j < count; j++) {
            prefetch_row(next, j, row_bytes);
            for (int h = 0; h < num_kv_heads; h++) {
                const int64_t at = row0 + j * stride_tok + h * stride_head;
                __m512 v[16];
                for (int c = 0; c < NV; c++) v[c] = loadv(v_cache, at + 16 * c, is_bf16);
                for (int r = 0; r < rows; r++)
                    for (int g = 0; g < group; g++) {
                        const int64_t line = (int64_t)r * num_q_heads + h * group + g;
                        const __m512 p = _mm512_set1_ps(scores[line * n + (t - k0) + j]);
                        float *acc = part_acc + line * D;
                        for (int c = 0; c < NV; c++)
                            _mm512_storeu_ps(acc + 16 * c,
                                             _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(acc + 16 * c)));
                    }
            }
        }
        t += count;
    }
    return 0;
}
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* Merge the partitions of one (row, head) line by log-sum-exp and store it normalized. Partition
 * p's max, sum and accumulator are m[p * stride], l[p * stride] and acc + p * stride. */
#define DEFINE_MERGE(SUFFIX, T, STORE)                                                         \
static void merge_##SUFFIX(const float *m, const float *l, const float *acc, int64_t parts,  \
                           int64_t stride, int D, T *out) {                                   \
    float mx = -3.0e38f;                                                                      \
    for (int64_t p = 0; p < parts; p++)                                                       \
        if (l[p * stride] > 0.0f && m[p * stride] > mx) mx = m[p * stride];                   \
    float total = 0.0f;                                                                       \
    float o[MAX_HEAD_DIM];                                                                    \
    for (int d = 0; d < D; d++) o[d] = 0.0f;                                                  \
    for (int64_t p = 0; p < parts; p++) {                                                     \
        const float lp = l[p * stride];                                                       \
        if (lp <= 0.0f) continue;                                                             \
        const float w = exp_nonpos(m[p * stride] - mx);                                       \
        total += lp * w;                                                                      \
        const float *a = acc + p * stride;                                                    \
        for (int d = 0; d < D; d++) o[d] += w * a[d];                                         \
    }                                                                                         \
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;                                     \
    for (int d = 0; d < D; d++) STORE(out, d, o[d] * inv);                                    \
}

DEFINE_MERGE(f32, float, store_f32)
DEFINE_MERGE(bf16, bf16_t, store_bf16)

#if HAVE_AVX512
#define ATTEND512_CALL(NV, IS_BF16)                                                            \
    attend512(q + b * H * D, 0, 1, ctx - 1, 0, k_cache, v_cache, stride_blk, stride_tok,      \
              stride_head, block_tables + b * table_stride, num_blocks, block_size, k0, k1,  \
              num_q_heads, num_kv_heads, NV, scale, qf, scores, pm, pl, pacc, IS_BF16)
#else
#define ATTEND512_CALL(NV, IS_BF16) (-7)
#endif

/* Decode: one query row per sequence at position context_lens[b] - 1.
 * workspace: num_seqs * max_parts * Hq * (D + 2) floats, max_parts = ceil(max ctx / part).
 * Returns 0, or a negative code for arguments the wrapper should have rejected. */
#define DEFINE_DECODE(SUFFIX, T)                                                               \
int paged_decode_##SUFFIX(                                                                    \
        const T *q, T *out, const T *k_cache, const T *v_cache, int64_t stride_blk,          \
        int64_t stride_tok, int64_t stride_head, int64_t num_blocks,                        \
        const int32_t *block_tables, int64_t table_stride, int64_t table_width,             \
        const int32_t *context_lens, int num_seqs, int num_q_heads,    \
        int num_kv_heads, int head_dim, int block_size, float scale, int part_tokens,        \
        int max_parts, float *workspace, int num_threads) {                                   \
    if (head_dim > MAX_HEAD_DIM || head_dim <= 0) return -1;                                  \
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads) return -2;                           \
    if (part_tokens <= 0 || part_tokens % block_size) return -3;                              \
    const int64_t H = num_q_heads, D = head_dim;                                              \
    const int64_t line_floats = D + 2;                                                        \
    const int64_t tasks = (int64_t)num_seqs * max_parts;                                      \
    int status = 0;                                                                           \
    if (num_threads <= 0) num_threads = omp_get_max_threads();                                \
    _Pragma("omp parallel num_threads(num_threads)")                                          \
    {                                                                                         \
        float *qf = malloc(sizeof(float) * H * D);                                            \
        float *scores = malloc(sizeof(float) * H * part_tokens);                              \
        if (!qf || !scores) { _Pragma("omp atomic write") status = -4; }                      \
        _Pragma("omp for schedule(dynamic, 1)")                                               \
        for (int64_t task = 0; task < tasks; task++) {                                        \
            if (!qf || !scores) continue;                                                     \
            const int64_t b = task / max_parts, p = task % max_parts;                         \
            const int64_t ctx = context_lens[b];                                              \
            const int64_t k0 = p * part_tokens;                                               \
            float *base = workspace + task * H * line_floats;                                 \
            float *pm = base, *pl = base + H, *pacc = base + 2 * H;                           \
            if (ctx < 1 || ctx > table_width * block_size) {                                  \
                _Pragma("omp atomic write") status = -5;                                      \
                continue;                                                                     \
            }                                                                                 \
            if (k0 >= ctx) { for (int64_t h = 0; h < H; h++) pl[h] = 0.0f; continue; }       \
            const int64_t k1 = ctx < k0 + part_tokens ? ctx : k0 + part_tokens;               \
            int rc;                                                                           \
            /* constant head sizes let the compiler unroll and vectorize the row loops */     \
            if (HAVE_AVX512 && head_dim == 64)                                                \
                rc = ATTEND512(4);                                                            \
            else if (HAVE_AVX512 && head_dim == 128)                                          \
                rc = ATTEND512(8);                                                            \
            else if (HAVE_AVX512 && head_dim % 16 == 0)                                       \
                rc = ATTEND512(head_dim / 16);                                                \
            else if (head_dim == 64)                                                          \
                rc = attend_##SUFFIX(q + b * H * D, 0, 1, ctx - 1, 0, k_cache, v_cache,       \
                            stride_blk, stride_tok, stride_head,                              \
                            block_tables + b * table_stride, num_blocks, block_size, k0, k1, \
                            num_q_heads, num_kv_heads, 64, scale, qf, scores, pm, pl, pacc); \
            else if (head_dim == 128)                                                         \
                rc = attend_##SUFFIX(q + b * H * D, 0, 1, ctx - 1, 0, k_cache, v_cache,       \
                            stride_blk, stride_tok, stride_head,                              \
                            block_tables + b * table_stride, num_blocks, block_size, k0, k1, \
                            num_q_heads, num_kv_heads, 128, scale, qf, scores, pm, pl, pacc);\
            else                                                                              \
                rc = attend_##SUFFIX(q + b * H * D, 0, 1, ctx - 1, 0, k_cache, v_cache,       \
                            stride_blk, stride_tok, stride_head,                              \
                            block_tables + b * table_stride, num_blocks, block_size, k0, k1, \
                            num_q_heads, num_kv_heads, head_dim, scale, qf, scores, pm, pl,  \
                            pacc);                                                            \
            if (rc) { _Pragma("omp atomic write") status = rc; }                              \
        }                                                                                     \
        free(qf);                                                                             \
        free(scores);                                                                         \
        _Pragma("omp for schedule(static)")                                                   \
        for (int64_t line = 0; line < (int64_t)num_seqs * H; line++) {                        \
            const int64_t b = line / H, h = line % H;                                         \
            const float *base = workspace + b * max_parts * H * line_floats;                  \
            merge_##SUFFIX(base + h, base + H + h, base + 2 * H + h * D, max_parts,           \
                           H * line_floats, head_dim, out + line * D);                       \
        }                                                                                     \
    }                                                                                         \
    return status;                                                                            \
}

#define ATTEND512(NV) ATTEND512_CALL(NV, 0)
DEFINE_DECODE(f32, float)
#undef ATTEND512
#define ATTEND512(NV) ATTEND512_CALL(NV, 1)
DEFINE_DECODE(bf16, bf16_t)
#undef ATTEND512

/* Elementwise kernels for the CPU decode step, in fp32 and bf16: RMSNorm (optionally fused with
 * the residual add before it) and SiLU(gate) * up. Each replaces a chain of aten ops (F.rms_norm
 * is pow, mean, add, rsqrt and two muls, each a pass over memory and a temporary) with one pass
 * per row. bf16 rows are widened to fp32, computed as fp32 rows are, and rounded once (the
 * residual sum is rounded when it is stored, as torch's bf16 add rounds it).
 *
 * Rows are independent: threads split them (pa_run_tasks). Inputs under SINGLE_THREAD_ELEMENTS
 * run on the calling thread (a guess at where waking a helper stops paying, not tuned). GCC
 * vector extensions (vec8.h): -march=native makes them AVX2 (or narrower) instructions.
 *
 * Measured on the 2-core AVX2 EPYC (2 threads, median ms per call from Python, output
 * allocation included, two runs on the shared box; H = 576, I = 1536), torch vs these, fp32:
 * T=64 rms_norm 0.037 vs 0.012-0.021, add + rms_norm 0.041-0.058 vs 0.016-0.030, silu * up
 * 0.092-0.099 vs 0.049-0.055; T=256 rms_norm 0.071-0.086 vs 0.030-0.032, add + rms_norm
 * 0.076-0.094 vs 0.044, silu * up 0.24-0.30 vs 0.18. */
#include "vec8.h"

#define W 8
#define ROWS_PER_TASK_MIN 4
#define SINGLE_THREAD_ELEMENTS 16384

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 select8(v8i mask, v8 a, v8 b) {   /* mask lanes are all ones or all zeros */
    return (v8)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* 8 lanes by type (ld1 / st1 / row_of for single elements: vec8.h) */
INLINE v8 ld8(const void *p, int64_t i, int bf) {
    return bf ? load8_bf16((const bf16_t *)p + i) : load8_f32((const float *)p + i);
}
INLINE void st8(void *p, int64_t i, v8 v, int bf) {
    if (bf) store8_bf16((bf16_t *)p + i, v); else store8_f32((float *)p + i, v);
}

/* Tasks of at least ROWS_PER_TASK_MIN rows, about 4 per thread; 1 thread for small inputs. */
static void run_rows(task_fn fn, void *ctx, int64_t rows, int64_t elements, int num_threads,
                     int64_t *rows_per_task) {
    const int threads = elements < SINGLE_THREAD_ELEMENTS || num_threads < 1 ? 1 : num_threads;
    int64_t per = threads == 1 ? rows : (rows + threads * 4 - 1) / (threads * 4);
    if (per < ROWS_PER_TASK_MIN) per = ROWS_PER_TASK_MIN;
    *rows_per_task = per;
    pa_run_tasks(threads, fn, ctx, (rows + per - 1) / per);
}

/* ---- RMSNorm ---------------------------------------------------------------------------
 * out = r * (1 / sqrt(mean(r^2) + eps)) * w, where r = x + residual (written back to residual)
 * or r = x; the formula of F.rms_norm and HF's LlamaRMSNorm, statistics in fp32. The
 * sum of squares runs in four vector accumulators, so it rounds differently from torch's
 * reduction (results agree to a few fp32 ulps). */
typedef struct {
    const void *x, *weight;
    void *residual, *out;
    int64_t rows, hidden, ldx, ldr, ldo, rows_per_task;
    float eps;
} rms_job;

INLINE void rms_row(const rms_job *job, int64_t row, int bf) {
    const int64_t h = job->hidden;
    const void *x = row_of(job->x, row, job->ldx, bf);
    const void *r = x;
    if (job->residual) {   /* residual += x, then normalize the sum as stored */
        void *res = (void *)row_of(job->residual, row, job->ldr, bf);
        for (int64_t i = 0; i + W <= h; i += W) st8(res, i, ld8(res, i, bf) + ld8(x, i, bf), bf);
        for (int64_t i = h - h % W; i < h; i++) st1(res, i, ld1(res, i, bf) + ld1(x, i, bf), bf);
        r = res;
    }
    v8 acc[4] = {0};
    int64_t i = 0;
    for (; i + 4 * W <= h; i += 4 * W)
        for (int a = 0; a < 4; a++) {
            const v8 v = ld8(r, i + a * W, bf);
            acc[a] += v * v;
        }
    for (; i + W <= h; i += W) {
        const v8 v = ld8(r, i, bf);
        acc[0] += v * v;
    }
    const v8 sum8 = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    float sum = 0.0f;
    for (int lane = 0; lane < W; lane++) sum += sum8[lane];
    for (; i < h; i++) sum += ld1(r, i, bf) * ld1(r, i, bf);
    const float scale = 1.0f / __builtin_sqrtf(sum / (float)h + job->eps);
    void *out = (void *)row_of(job->out, row, job->ldo, bf);
    const v8 scale8 = splat(scale);
    for (i = 0; i + W <= h; i += W)
        st8(out, i, (ld8(r, i, bf) * scale8) * ld8(job->weight, i, bf), bf);
    for (; i < h; i++) st1(out, i, (ld1(r, i, bf) * scale) * ld1(job->weight, i, bf), bf);
}

#define DEFINE_RMS(SUFFIX, T, BF)                                                                \
static void rms_task_##SUFFIX(void *ctx, int64_t task) {                                         \
    const rms_job *job = ctx;                                                                    \
    const int64_t first = task * job->rows_per_task;                                             \
    const int64_t last = first + job->rows_per_task < job->rows ? first + job->rows_per_task     \
                                                                 : job->rows;                    \
    for (int64_t row = first; row < last; row++) rms_row(job, row, BF);                          \
}                                                                                                \
/* out[rows][hidden] = rmsnorm(x (+ residual)) * weight; residual (may be NULL) is updated in    \
 * place to x + residual. Row strides in elements. Returns 0, or -1 on bad sizes. */            \
int rms_norm_##SUFFIX(const T *x, int64_t ldx, T *residual, int64_t ldr, const T *weight,        \
                      float eps, int64_t rows, int64_t hidden, T *out, int64_t ldo,              \
                      int num_threads) {                                                         \
    if (rows < 0 || hidden < 1 || ldx < hidden || ldo < hidden || (residual && ldr < hidden))    \
        return -1;                                                                               \
    if (rows == 0) return 0;                                                                     \
    rms_job job = {x, weight, residual, out, rows, hidden, ldx, ldr, ldo, rows, eps};            \
    run_rows(rms_task_##SUFFIX, &job, rows, rows * hidden, num_threads, &job.rows_per_task);     \
    return 0;                                                                                    \
}
DEFINE_RMS(f32, float, 0)
DEFINE_RMS(bf16, bf16_t, 1)

/* ---- SiLU(gate) * up -------------------------------------------------------------------
 * silu(x) = x * sigmoid(x) with e = exp(-|x|) in (0, 1]: sigmoid = 1 / (1 + e) for x >= 0 and
 * e / (1 + e) for x < 0, so nothing overflows for any x. exp(x) = 2^i * 2^f: i = round(x / ln 2),
 * r = x - i ln 2 in two steps (Cody-Waite: i * LN2_HI is exact, so r keeps its low bits), f = r /
 * ln 2 in [-0.5, 0.5], and the degree-6 polynomial of exp_nonpos in paged_attention.h for 2^f.
 * Reducing through x / ln 2 in one fp32 product instead loses up to 1.4e-6 relative near
 * x = -87 (measured); this way silu stays within ~5e-7 of a float64 silu. e is 0 below -87.3
 * (where exp leaves the normal range), so silu(x) there is -0 where the exact value is under
 * 1.1e-36 in magnitude. */
#define LN2_HI 0.693359375f          /* 9 significant bits: i * LN2_HI is exact for |i| <= 2^15 */
#define LN2_LO -2.12194440e-4f       /* ln 2 - LN2_HI */
#define LOG2E 1.4426950408889634f

/* Keeps the compiler from reassociating across v (the build allows -fassociative-math, which
 * could fold the two reduction steps back into one rounded product). In a register where v fits
 * one (AVX); through memory elsewhere (SSE-only x86, other architectures). */
#if defined(__AVX__)
#define OPAQUE(v) __asm__("" : "+x"(v))
#else
#define OPAQUE(v) __asm__("" : "+m"(v))
#endif

static inline v8 exp_nonpos8(v8 x) {
    const v8i underflow = x < splat(-87.3f);
    x = select8(underflow, splat(-87.3f), x);
    /* x <= 0: truncating x / ln 2 - 0.5 toward zero rounds to nearest */
    const v8i i = __builtin_convertvector(x * LOG2E - 0.5f, v8i);
    const v8 fi = __builtin_convertvector(i, v8);
    v8 r = x - fi * LN2_HI;
    OPAQUE(r);
    r = r - fi * LN2_LO;
    const v8 f = r * LOG2E;
    const v8 p = EXP2_POLY(f);
    const v8 scale = (v8)((i + 127) << 23);
    return (v8)((v8i)(p * scale) & ~underflow);
}

/* silu(gate) * up; bf16 rows round silu to bf16 before the product, as torch's bf16
 * F.silu(gate) * up does, so that the result is torch's to within the exp's rounding. */
INLINE v8 silu_mul8(v8 gate, v8 up, int bf) {
    const v8i nonneg = gate >= splat(0.0f);
    const v8i sign = {INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                      INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
    const v8 e = exp_nonpos8((v8)((v8i)gate | sign));   /* -|gate| */
    const v8 silu = gate * select8(nonneg, splat(1.0f), e) / (1.0f + e);
    return (bf ? round8_bf16(silu) : silu) * up;
}

typedef struct {
    const void *gate_up;
    void *out;
    int64_t rows, inter, ldg, ldo, rows_per_task;
} silu_job;

INLINE void silu_rows(const silu_job *job, int64_t task, int bf) {
    const int64_t n = job->inter, first = task * job->rows_per_task;
    const int64_t last = first + job->rows_per_task < job->rows ? first + job->rows_per_task
                                                                 : job->rows;
    for (int64_t row = first; row < last; row++) {
        const void *gate = row_of(job->gate_up, row, job->ldg, bf);
        const void *up = row_of(gate, n, 1, bf);
        void *out = (void *)row_of(job->out, row, job->ldo, bf);
        int64_t i = 0;
        for (; i + W <= n; i += W)
            st8(out, i, silu_mul8(ld8(gate, i, bf), ld8(up, i, bf), bf), bf);
        if (i < n) {   /* the tail through the same vector code, so every lane rounds alike */
            float g[W] = {0}, u[W] = {0}, o[W];
            for (int64_t j = i; j < n; j++) g[j - i] = ld1(gate, j, bf), u[j - i] = ld1(up, j, bf);
            store8_f32(o, silu_mul8(load8_f32(g), load8_f32(u), bf));
            for (int64_t j = i; j < n; j++) st1(out, j, o[j - i], bf);
        }
    }
}

#define DEFINE_SILU(SUFFIX, T, BF)                                                               \
static void silu_task_##SUFFIX(void *ctx, int64_t task) { silu_rows(ctx, task, BF); }            \
/* out[rows][inter] = silu(gate_up[:, :inter]) * gate_up[:, inter:]. Returns 0, or -1 on bad     \
 * sizes. */                                                                                     \
int silu_mul_##SUFFIX(const T *gate_up, int64_t ldg, int64_t rows, int64_t inter, T *out,        \
                      int64_t ldo, int num_threads) {                                            \
    if (rows < 0 || inter < 1 || ldg < 2 * inter || ldo < inter) return -1;                      \
    if (rows == 0) return 0;                                                                     \
    silu_job job = {gate_up, out, rows, inter, ldg, ldo, rows};                                  \
    run_rows(silu_task_##SUFFIX, &job, rows, rows * inter, num_threads, &job.rows_per_task);     \
    return 0;                                                                                    \
}
DEFINE_SILU(f32, float, 0)
DEFINE_SILU(bf16, bf16_t, 1)

/* Replay of a recorded list of native kernel calls (kernels/native_replay.py): a CPU decode step
 * whose every call was worked out once, run in one ctypes call instead of ~300 Python ones.
 *
 * A program is `count` ops of OP_WORDS int64 words each: the op's kind, the kernel's address (a
 * function of another feature's library, taken from its ctypes handle), then its arguments in
 * the kernel's order. Pointers and integers are stored as int64; a float argument as the bits
 * of its fp32 value in the low 32 bits. Each kind casts the address to the kernel's exact
 * prototype (features.py lists them; tests/kernels/test_native_signatures.py holds them to the
 * C definitions), so every argument travels as the kernel declares it. The first op that
 * returns nonzero stops the replay: its index goes to *failed and its status is returned.
 * With `seconds` (else NULL) each op's wall time is added to seconds[kind] (step traces). */
#include <stdint.h>
#include <string.h>
#include <time.h>

enum {
    OP_RMS_NORM = 1,          /* elementwise.c rms_norm_f32 */
    OP_SILU_MUL = 2,          /* elementwise.c silu_mul_f32 */
    OP_GGUF_LINEAR = 3,       /* linear_gguf.c gguf_linear */
    OP_GGUF_PACKED = 4,       /* linear_gguf.c gguf_packed_linear */
    OP_LINEAR_F32 = 5,        /* linear_f32.c linear_f32 */
    OP_LINEAR_Q8 = 6,         /* linear_q8.c linear_q8 */
    OP_ROPE_STORE = 7,        /* rope_store.c rope_store */
    OP_DECODE = 8,            /* decode_<format>.c paged_decode_<format> */
    OP_ADD_ROWS = 9           /* here: x[r][c] += bias[c] (fp32) */
};
#define OP_WORDS 32
#define OP_KINDS 16
#define UNKNOWN_OP (-1000)

typedef int (*norm_fn)(const void *, int64_t, void *, int64_t, const void *, float, int64_t,
                       int64_t, void *, int64_t, int);
typedef int (*silu_fn)(const void *, int64_t, int64_t, int64_t, void *, int64_t, int);
typedef int (*gguf_fn)(int, const void *, int64_t, int64_t, int64_t, const void *, int64_t,
                       int64_t, void *, int64_t, int);
typedef int (*gguf_packed_fn)(int, const void *, int64_t, int64_t, const void *, int64_t,
                              int64_t, void *, int64_t, int);
typedef int (*linear_f32_fn)(const void *, int64_t, int64_t, int64_t, const void *, int64_t,
                             void *, int64_t, int);
typedef int (*linear_q8_fn)(const void *, int64_t, int64_t, int64_t, const void *, const void *,
                            int64_t, void *, int64_t, int);
typedef int (*rope_store_fn)(const void *, int, int64_t, int64_t, int, int, int, const void *,
                             const void *, int64_t, void *, void *, void *, int64_t, int,
                             int64_t, int64_t, int64_t, const void *, int, int);
typedef int (*decode_fn)(const void *, void *, const void *, const void *, int64_t, int64_t,
                         int64_t, int64_t, const void *, int64_t, int64_t, const void *, int,
                         int, int, int, int, float, int, int, int, void *, int);

static float word_f32(int64_t word) {
    const uint32_t bits = (uint32_t)(uint64_t)word;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#define P(i) ((void *)(intptr_t)a[i])
#define I(i) ((int)a[i])

static int add_rows(float *x, int64_t rows, int64_t cols, int64_t ldx, const float *bias) {
    if (rows < 0 || cols < 1 || ldx < cols) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) x[r * ldx + c] += bias[c];
    return 0;
}

static int run_op(const int64_t *op) {
    const void *fn = (const void *)(intptr_t)op[1];
    const int64_t *a = op + 2;
    switch (op[0]) {
    case OP_RMS_NORM:
        return ((norm_fn)fn)(P(0), a[1], P(2), a[3], P(4), word_f32(a[5]), a[6], a[7], P(8),
                             a[9], I(10));
    case OP_SILU_MUL:
        return ((silu_fn)fn)(P(0), a[1], a[2], a[3], P(4), a[5], I(6));
    case OP_GGUF_LINEAR:
        return ((gguf_fn)fn)(I(0), P(1), a[2], a[3], a[4], P(5), a[6], a[7], P(8), a[9], I(10));
    case OP_GGUF_PACKED:
        return ((gguf_packed_fn)fn)(I(0), P(1), a[2], a[3], P(4), a[5], a[6], P(7), a[8], I(9));
    case OP_LINEAR_F32:
        return ((linear_f32_fn)fn)(P(0), a[1], a[2], a[3], P(4), a[5], P(6), a[7], I(8));
    case OP_LINEAR_Q8:
        return ((linear_q8_fn)fn)(P(0), a[1], a[2], a[3], P(4), P(5), a[6], P(7), a[8], I(9));
    case OP_ROPE_STORE:
        return ((rope_store_fn)fn)(P(0), I(1), a[2], a[3], I(4), I(5), I(6), P(7), P(8), a[9],
                                   P(10), P(11), P(12), a[13], I(14), a[15], a[16], a[17],
                                   P(18), I(19), I(20));
    case OP_DECODE:
        return ((decode_fn)fn)(P(0), P(1), P(2), P(3), a[4], a[5], a[6], a[7], P(8), a[9], a[10],
                               P(11), I(12), I(13), I(14), I(15), I(16), word_f32(a[17]), I(18),
                               I(19), I(20), P(21), I(22));
    case OP_ADD_ROWS:
        return add_rows(P(0), a[1], a[2], a[3], P(4));
    default:
        return UNKNOWN_OP;
    }
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Run ops[0 .. count - 1] in order; 0, or the first failing op's status (its index in
 * *failed). seconds: NULL, or OP_KINDS sums that each op's time is added to by kind. */
int replay_ops(const int64_t *ops, int64_t count, int64_t *failed, double *seconds) {
    for (int64_t i = 0; i < count; i++) {
        const int64_t *op = ops + i * OP_WORDS;
        const double started = seconds ? now_s() : 0.0;
        const int status = run_op(op);
        if (seconds && op[0] > 0 && op[0] < OP_KINDS) seconds[op[0]] += now_s() - started;
        if (status != 0) {
            *failed = i;
            return status;
        }
    }
    *failed = -1;
    return 0;
}

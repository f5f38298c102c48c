/* paged_decode_f32: decode attention over a fp32 KV cache (paged_attention.h). */
#include "paged_attention.h"

DEFINE_FORMAT(f32, float, load_f32, FMT_F32)

/* The vector body this build compiled (the worker's start-up line names it): 16 lanes (AVX-512),
 * 8 (AVX2 + FMA), or 0 when only the portable body exists. */
int paged_decode_vector_lanes(void) {
#if HAVE_VECTOR
    return VW;
#else
    return 0;
#endif
}

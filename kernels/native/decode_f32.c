/* paged_decode_f32: decode attention over a fp32 KV cache (paged_attention.h). */
#include "paged_attention.h"

DEFINE_FORMAT(f32, float, load_f32, FMT_F32)

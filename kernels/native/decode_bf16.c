/* paged_decode_bf16: decode attention over a bf16 KV cache (paged_attention.h). */
#include "paged_attention.h"

DEFINE_FORMAT(bf16, bf16_t, load_bf16, FMT_BF16)

/* paged_decode_e5m2: decode attention over a fp8 e5m2 KV cache (paged_attention.h). */
#include "paged_attention.h"

DEFINE_FORMAT(e5m2, uint8_t, load_e5m2, FMT_E5M2)

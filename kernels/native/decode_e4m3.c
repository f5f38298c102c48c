/* paged_decode_e4m3: decode attention over a fp8 e4m3fn KV cache (paged_attention.h). */
#include "paged_attention.h"

DEFINE_FORMAT(e4m3, uint8_t, load_e4m3, FMT_E4M3)

/* Software prefetch of the weights a decode streams from memory. A step of few rows reads every
 * weight once, so the linears run at the speed memory delivers it; on some hosts the hardware
 * prefetchers leave most of that bandwidth unused (they do not follow PANEL interleaved row
 * streams, or are held back in a virtual machine), and asking for the bytes a little ahead of
 * their use doubles the 1.5B model's decode there. Prefetches never fault, so an address past
 * the end of a weight is harmless. */
#ifndef PAGEDSERVE_PREFETCH_H
#define PAGEDSERVE_PREFETCH_H

#include <stdint.h>

static inline void prefetch_bytes(const void *at, int64_t bytes) {
    const char *p = (const char *)at;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

#endif

/* The xxHash library's XXH3 streaming update with its AVX512 kernels (see _xxh3_wide.h). */
#include "_xxh3_wide.h"

#ifdef PAGEIO_WIDE
#pragma GCC target("avx512f,avx2,tune=skylake-avx512")
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX512
#include <xxhash.h>

int pageio_update_avx512(void *state, const void *in, size_t len) {
    return XXH3_64bits_update((XXH3_state_t *)state, in, len) == XXH_OK ? 0 : -1;
}
#else
typedef int pageio_no_avx512; /* (an empty unit is not ISO C) */
#endif

/* The xxHash library's XXH3 streaming update compiled for wider vector units than the build's
 * baseline (_xxh3_avx2.c, _xxh3_avx512.c), which _pageio.c picks from at module init by what
 * the CPU has. Each takes an XXH3_state_t of _pageio.c's (the state's layout is the same
 * whatever unit updates it, and so is the hash) and answers 0, or -1 on the library's error.
 * Each unit is tuned for the first cores that had it: with GCC's generic tuning the AVX-512
 * kernel ran slower than the hand-written XXH3 it replaced (benchmarks/bench_checksum.py;
 * docs/performance.md). GCC only (its `#pragma GCC target`); elsewhere the baseline update is
 * the only one. */
#ifndef PAGEIO_XXH3_WIDE_H
#define PAGEIO_XXH3_WIDE_H

#include <stddef.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGEIO_WIDE 1
int pageio_update_avx2(void *state, const void *in, size_t len);
int pageio_update_avx512(void *state, const void *in, size_t len);
#endif

#endif

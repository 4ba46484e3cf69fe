// The AMX-INT8 products of q8_amx.cpp, for q8_kernels.cpp (both built where the compiler has
// -mamx-tile -mamx-int8 and AVX-512: SPECSERVE_AMX).
#pragma once
#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && !defined(SPECSERVE_EMULATE_AVX512)
#define SPECSERVE_AMX 1
namespace amx {

enum Kind { kInt4, kInt8Channel, kInt8Group };  // as q8_kernels.cpp's

// Whether passes of enough rows take AMX: the kernel asked Linux for the tile state (once a
// process) and got it, and AMX is not off.
int ready();
// Passes of at least `rows` rows take AMX, 0 none; returns `ready()`.
int set_min_rows(int rows);
// The channel pairs 0..pairs-1 (16 channels each, two of int4_pack's / int8_pack's tiles) of
// y [rows, out] from the rows' 8-bit codes xq [rows, k], block scales xd and d * sum(codes) xs
// [rows, k / 32], the packed weights w and scales as q8_kernels.cpp's `linear` takes them.
// False, computing nothing, where AMX is off, not permitted, or the pass too short.
bool linear(Kind kind, const int8_t* xq, const float* xd, const float* xs, int64_t rows, int64_t k, const uint8_t* w,
            const float* scales, int64_t out, int64_t pairs, float* y);

}  // namespace amx
#endif

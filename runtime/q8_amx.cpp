// The 8-bit-activation products of q8_kernels.cpp on Intel AMX (AMX-INT8's tile multiply),
// built into the same library where the CPU and the compiler have AMX (runtime/cpu_kernels.py
// adds -mamx-tile -mamx-int8 then; without them this file compiles to nothing).
//
// Why: with VNNI a pass of 17 rows does 17 times the dot products of one row, and the verify
// pass of speculative decoding is compute-bound there. One TDPBSSD multiplies 16 rows by 16
// channels over a block of 32 inputs (8,192 products) in the time of a few VNNI instructions.
//
// What is exact: per block of 32 inputs, C[row][channel] = sum_i xq[row, i] * wq[channel, i],
// signed 8-bit times signed 8-bit (int4 codes 0..15 are signed bytes too), summed in int32:
// the same integer VNNI's dpbusd (with its +128 offset for int8) or AVX2's maddubs give, as no
// sum can overflow. Each block's C is stored and then the float32 epilogue of q8_kernels.cpp
// runs per (row, channel) in the same order, with the same operations (no fused multiply-add:
// -ffp-contract=off): the result is bit for bit the VNNI path's, and a row's result depends on
// that row alone (the tile's other rows only share the instruction).
//
// Layout: A = 16 (or fewer) rows' activation codes of one block, a row per tile row (32 bytes,
// read in place at a stride of k). B = 16 channels' codes of the block in VNNI layout: tile
// row j holds inputs 4j..4j+3 of each channel, 64 bytes, i.e. two of q8_kernels.cpp's 8-channel
// tiles' code vectors side by side (int4's nibbles unpacked: low ones inputs 8j..8j+3, high
// ones 8j+4..8j+7), copied to a 512-byte buffer a block. C = rows x 16 channels int32.
#include "q8_amx.h"
#if defined(SPECSERVE_AMX)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <vector>

namespace {

constexpr int64_t kGroup = 32, kLanes = 8, kChannels = 16;  // a block's inputs, a tile's, a pair's channels
constexpr int64_t kInt4Record = kGroup * kLanes / 2 + 2 * kLanes * 4, kInt8Record = kGroup * kLanes;
constexpr int kMaxTileRows = 16;
constexpr int kChunkGroups = 4;  // row groups a pass over a pair's blocks takes (64 rows at most)
constexpr int kBatch = 4;        // blocks whose tile products go before their epilogues
constexpr int64_t kBTile = kGroup / 4 * kChannels * 4;  // a block's B tile: 8 rows of 64 bytes

// Tile registers: C 0-3, A 4-5, B 6-7 (`product`).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig config_for(int tile_rows) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = tile_rows, c.colsb[t] = kChannels * 4;          // C
  for (int t = 4; t < 6; ++t) c.rows[t] = tile_rows, c.colsb[t] = kGroup;                 // A
  for (int t = 6; t < 8; ++t) c.rows[t] = kGroup / 4, c.colsb[t] = kChannels * 4;         // B
  return c;
}

// Linux lends AMX's tile state to a process that asks (once; arch_prctl, XFEATURE_XTILEDATA).
int permitted() {
  static const int ok = [] {
    constexpr long kReqPerm = 0x1023, kGetPerm = 0x1022, kXTileData = 18;
    if (syscall(SYS_arch_prctl, kReqPerm, kXTileData)) return 0;
    unsigned long mask = 0;
    return syscall(SYS_arch_prctl, kGetPerm, &mask) == 0 && (mask >> kXTileData & 1) ? 1 : 0;
  }();
  return ok;
}

std::atomic<int> min_rows{2};  // passes of fewer rows take VNNI (0: AMX off)

// 8 floats at p and 8 at p + next, side by side (V512::floats)
inline __m512 floats(const float* p, int64_t next) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + next), 1);
}

// B for block g of the pair of 8-channel tiles at w (the second `next` bytes on), into b [8][64].
template <int kKind>
inline void weights_tile(const uint8_t* w, int64_t next, int64_t g, uint8_t* b) {
  auto pair = [&](const uint8_t* p) {  // a code vector of the two tiles side by side
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + next)), 1);
  };
  if constexpr (kKind == amx::kInt4) {
    const uint8_t* block = w + g * kInt4Record;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = pair(block + 32 * j);
      _mm512_store_si512(b + 128 * j, _mm512_and_si512(v, low4));
      _mm512_store_si512(b + 128 * j + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
    }
  } else {
    const uint8_t* block = w + g * kInt8Record;
    for (int j = 0; j < 8; ++j) _mm512_store_si512(b + 64 * j, pair(block + 32 * j));
  }
}

// C = A x B into `to` (a row of 64 bytes per C row), the rows' codes a (a row per k bytes).
// gcc's tile intrinsics name their registers by a literal: a macro, not a template. Each
// product takes C `turn` (0-3) and A turn % 2, so that a product need not wait for the store
// of the one before, and B 6 or 7 (`odd`).
#define SPECSERVE_PRODUCT(kC, kA, kB) \
  do {                                \
    _tile_zero(kC);                   \
    _tile_loadd(kA, a, k);            \
    _tile_dpbssd(kC, kA, kB);         \
    _tile_stored(kC, to, 64);         \
  } while (0)

inline void product(int turn, int odd, const int8_t* a, int64_t k, int32_t* to) {
  switch (turn + 4 * odd) {
    case 0: SPECSERVE_PRODUCT(0, 4, 6); break;
    case 1: SPECSERVE_PRODUCT(1, 5, 6); break;
    case 2: SPECSERVE_PRODUCT(2, 4, 6); break;
    case 3: SPECSERVE_PRODUCT(3, 5, 6); break;
    case 4: SPECSERVE_PRODUCT(0, 4, 7); break;
    case 5: SPECSERVE_PRODUCT(1, 5, 7); break;
    case 6: SPECSERVE_PRODUCT(2, 4, 7); break;
    default: SPECSERVE_PRODUCT(3, 5, 7); break;
  }
}
#undef SPECSERVE_PRODUCT

// Two 8-channel tiles (channels n..n+15), their B tiles unpacked in b [blocks][8][64], against
// rows [r0, r0 + groups * tile_rows) of the padded codes xq: the float32 epilogue of
// q8_kernels.cpp's `tile`, into y (its real rows). The blocks go kBatch at a time: their tile
// products first, their epilogues after, so that no vector load waits on the tile store just
// made, nor a tile multiply on the one before.
template <int kKind>
void pair_rows(const uint8_t* b, const uint8_t* w, int64_t next, const float* st, int64_t next_scales,
               const float* channel_scales, const int8_t* xq, const float* xd, const float* xs, int64_t rows,
               int64_t k, int64_t r0, int groups, int tile_rows, int64_t out, int64_t n, float* y) {
  const int64_t blocks = k / kGroup;
  alignas(64) int32_t c[kBatch][kChunkGroups * kMaxTileRows][kChannels];
  const int count = static_cast<int>(rows - r0 < groups * tile_rows ? rows - r0 : groups * tile_rows);  // real rows
  __m512 acc[kChunkGroups * kMaxTileRows];
  for (int r = 0; r < count; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < blocks; g0 += kBatch) {
    const int batch = static_cast<int>(blocks - g0 < kBatch ? blocks - g0 : kBatch);
    for (int i = 0; i < batch; ++i) {
      const int64_t g = g0 + i;
      if (i % 2 == 0) _tile_loadd(6, b + g * kBTile, 64);
      else _tile_loadd(7, b + g * kBTile, 64);
      for (int p = 0; p < groups; ++p)
        product((i * groups + p) % 4, i % 2, xq + (r0 + p * tile_rows) * k + g * kGroup, k, c[i][p * tile_rows]);
    }
    // q8_kernels.cpp's epilogue, operation for operation (V512), row by row, block by block in
    // order: first the batch's block scales (int4's d and m, or Q8_0's scales in d)
    __m512 d[kBatch], m[kBatch];
    for (int i = 0; i < batch; ++i) {
      const int64_t g = g0 + i;
      if constexpr (kKind == amx::kInt4) {
        const float* f = reinterpret_cast<const float*>(w + g * kInt4Record + kGroup * kLanes / 2);
        d[i] = floats(f, next / 4), m[i] = floats(f + kLanes, next / 4);
      } else if constexpr (kKind == amx::kInt8Group) {
        d[i] = floats(st + g * kLanes, next_scales);
      }
    }
    for (int r = 0; r < count; ++r) {
      const int64_t row = r0 + r;
      __m512 sum = acc[r];
      for (int i = 0; i < batch; ++i) {
        const int64_t g = g0 + i;
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(c[i][r]));
        const __m512 x_scale = _mm512_set1_ps(xd[row * blocks + g]);
        if constexpr (kKind == amx::kInt4) {
          sum = _mm512_add_ps(sum, _mm512_mul_ps(dot, _mm512_mul_ps(d[i], x_scale)));
          sum = _mm512_add_ps(sum, _mm512_mul_ps(m[i], _mm512_set1_ps(xs[row * blocks + g])));
        } else if constexpr (kKind == amx::kInt8Group) {
          sum = _mm512_add_ps(sum, _mm512_mul_ps(dot, _mm512_mul_ps(d[i], x_scale)));
        } else {
          sum = _mm512_add_ps(sum, _mm512_mul_ps(dot, x_scale));
        }
      }
      acc[r] = sum;
    }
  }
  const int64_t valid = out - n < kChannels ? out - n : kChannels;
  for (int r = 0; r < count; ++r) {
    __m512 v = acc[r];
    if constexpr (kKind == amx::kInt8Channel) v = _mm512_mul_ps(v, _mm512_loadu_ps(channel_scales + n));
    alignas(64) float lanes[kChannels];
    _mm512_store_ps(lanes, v);
    for (int64_t i = 0; i < valid; ++i) y[(r0 + r) * out + n + i] = lanes[i];
  }
}

template <int kKind>
void pairs_amx(const int8_t* xq, const float* xd, const float* xs, int64_t rows, int64_t k, const uint8_t* w,
               const float* scales, int64_t out, int64_t pairs, float* y) {
  const int64_t blocks = k / kGroup, record = kKind == amx::kInt4 ? kInt4Record : kInt8Record;
  const int64_t next = blocks * record, next_scales = blocks * kLanes;
  // rows in tiles of as even a size as can be (17: 9 + 9, the last padded with a zero row)
  const int64_t tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
  const int tile_rows = static_cast<int>((rows + tiles - 1) / tiles);
  std::vector<int8_t> padded;
  if (tiles * tile_rows > rows) {  // a tile load reads whole tile rows: zero rows past the last
    padded.assign(tiles * tile_rows * k, 0);
    memcpy(padded.data(), xq, rows * k);
    xq = padded.data();
  }
  const TileConfig config = config_for(tile_rows);
#pragma omp parallel
  {
    _tile_loadconfig(&config);  // per thread
    thread_local std::vector<uint8_t> unpacked;  // the pair's B tiles
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i) {
      const uint8_t* wt = w + 2 * i * next;
      unpacked.resize(blocks * kBTile + 64);  // each thread's, reused; 64-byte aligned below
      uint8_t* b = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(unpacked.data()) + 63) & ~uintptr_t{63});
      for (int64_t g = 0; g < blocks; ++g) weights_tile<kKind>(wt, next, g, b + g * kBTile);
      const float* st = kKind == amx::kInt8Group ? scales + 2 * i * next_scales : nullptr;
      for (int64_t t = 0; t < tiles; t += kChunkGroups) {
        const int groups = static_cast<int>(tiles - t < kChunkGroups ? tiles - t : kChunkGroups);
        pair_rows<kKind>(b, wt, next, st, next_scales, scales, xq, xd, xs, rows, k, t * tile_rows, groups, tile_rows,
                         out, 2 * i * kLanes, y);
      }
    }
    _tile_release();
  }
}

}  // namespace

namespace amx {

int ready() { return min_rows.load() > 0 && permitted(); }

int set_min_rows(int rows) {
  min_rows.store(rows < 0 ? 0 : rows);
  return ready();
}

bool linear(Kind kind, const int8_t* xq, const float* xd, const float* xs, int64_t rows, int64_t k, const uint8_t* w,
            const float* scales, int64_t out, int64_t pairs, float* y) {
  const int least = min_rows.load();
  if (least <= 0 || rows < least || !permitted()) return false;
  switch (kind) {
    case kInt4: pairs_amx<kInt4>(xq, xd, xs, rows, k, w, scales, out, pairs, y); break;
    case kInt8Group: pairs_amx<kInt8Group>(xq, xd, xs, rows, k, w, scales, out, pairs, y); break;
    default: pairs_amx<kInt8Channel>(xq, xd, xs, rows, k, w, scales, out, pairs, y); break;
  }
  return true;
}

}  // namespace amx
#endif

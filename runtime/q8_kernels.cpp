// int4 and int8 weight products on 8-bit activations, for x86 CPUs with AVX2 (built with
// cpu_kernels.cpp into one library, runtime/cpu_kernels.py). The model is llama.cpp's
// (ggml-cpu's q4_1 x q8_1 and q8_0 x q8_0 dot products, and its repacked 8-channel tiles):
// each row of the input is quantised per block of 32 inputs as a Q8_0 block (a float32 scale
// d = max|x| / 127 and 32 int8 codes), and the weight codes are multiplied by the activation
// codes with integer dot products: `_mm256_maddubs_epi16` and `_mm256_madd_epi16` with AVX2,
// `vpdpbusd` where the CPU has AVX512-VNNI or AVX-VNNI (256 bits in every build, so that every
// build computes the same bits: below).
//
// The weights are packed in tiles of kLanes = 8 output channels (`int4_pack`, `int8_pack` in
// cpu_kernels.py): a vector holds four consecutive inputs of each of the 8 channels, so one
// broadcast of four activation codes meets eight channels and every lane is one channel's
// sum, never added across lanes. A tile's blocks are read from memory once a pass and then
// from the L1 cache by each group of up to kRowGroup rows: a pass of 17 rows reads the weights
// as one row does.
//
// What an output y[r, n] is, exactly (tests/test_cpu_kernels.py computes it so in numpy):
// per block b of row r, xd = max|x| / 127, xq = rint(x / xd) (round half to even; 0 for a
// block of zeros), xs = xd * sum(xq); the block's integer dot product
// dot = sum_i wq[n, i] * xq[i] (exact in int32); then in float32, block by block in order,
//   int4 (w = d * q + m):   acc = (acc + float(dot) * (d * xd)) + m * xs
//   int8, Q8_0 (w = d * q): acc = acc + float(dot) * (d * xd)
//   int8, a scale a channel (w = scale * q): acc = acc + float(dot) * xd, y = acc * scale,
// each product and sum rounded on its own (no fused multiply-add). Every term depends on row r
// and channel n alone, and every lane computes it in the same order: a row's result is the
// same whatever the rows beside it, however the pass is tiled, and in every build (AVX2,
// AVX-VNNI, AVX-512).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

namespace {

constexpr int64_t kGroup = 32;    // inputs a block
constexpr int64_t kLanes = 8;     // output channels a packed tile
constexpr int kRowGroup = 4;      // rows that take a tile's block at once, at most
constexpr int64_t kInt4Record = kGroup * kLanes / 2 + 2 * kLanes * 4;  // a tile's block: codes, d, m
constexpr int64_t kInt8Record = kGroup * kLanes;                        // a tile's block of int8 codes

// Integer dot products of unsigned bytes u and signed bytes s, four bytes a lane, added to acc.
#if defined(SPECSERVE_EMULATE_VNNI)  // the VNNI path's arithmetic on AVX2, to test it where no CPU has VNNI
#define SPECSERVE_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF)), u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECSERVE_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define SPECSERVE_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

inline __m256i broadcast4(const int8_t* p) {  // four activation codes in every lane
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Row r's activations, quantised: codes [rows, k], and per block d, d * sum(codes) and sum(codes).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
};

void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s, int32_t* sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float top = 0.0f;
    for (int i = 0; i < kGroup; ++i) top = fmaxf(top, fabsf(xg[i]));
    const float scale = top / 127.0f;
    int32_t total = 0;
    for (int i = 0; i < kGroup; ++i) {
      // x / scale is within 127 (a NaN input gives the low end, not undefined behaviour)
      const float v = scale != 0.0f ? fminf(fmaxf(xg[i] / scale, -127.0f), 127.0f) : 0.0f;
      const int32_t code = static_cast<int32_t>(nearbyintf(v));  // half to even
      q[g * kGroup + i] = static_cast<int8_t>(code);
      total += code;
    }
    d[g] = scale, sum[g] = total, s[g] = scale * static_cast<float>(total);
  }
}

void quantize_rows(const float* x, int64_t rows, int64_t k, Q8Rows& a) {
  const int64_t groups = k / kGroup;
  a.q.resize(rows * k), a.d.resize(rows * groups), a.s.resize(rows * groups), a.sum.resize(rows * groups);
#pragma omp parallel for schedule(static) if (rows * k >= 16384)
  for (int64_t r = 0; r < rows; ++r)
    quantize_row(x + r * k, k, a.q.data() + r * k, a.d.data() + r * groups, a.s.data() + r * groups,
                 a.sum.data() + r * groups);
}

enum Kind { kInt4, kInt8Channel, kInt8Group };

// R rows (codes xq [R, k], block scales xd and xs [R, groups]) against one tile of 8 channels:
// acc[r] lane c is y[r, c], before an int8 channel scale.
template <int R, Kind kKind>
void tile(const uint8_t* w, const float* block_scales, int64_t k, const int8_t* xq, const float* xd,
          const float* xs, const int32_t* xsum, __m256* acc) {
  const int64_t groups = k / kGroup;
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    if (kKind == kInt4) {
      // vector j's bytes: four inputs 8j..8j+3 of each channel low, 8j+4..8j+7 high
      const uint8_t* block = w + g * kInt4Record;
      const __m256i nibble = _mm256_set1_epi8(0x0F);
#if defined(SPECSERVE_VNNI)
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j));
        const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xq + r * k + g * kGroup + 8 * j;
          dot[r] = dpbusd(dpbusd(dot[r], low, broadcast4(x)), high, broadcast4(x + 4));
        }
      }
#else
      // 16-bit sums of two products of at most 15 * 127, eight of them: at most 30,480, exact
      __m256i pairs[R];
      for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j));
        const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xq + r * k + g * kGroup + 8 * j;
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast4(x)),
                                                                 _mm256_maddubs_epi16(high, broadcast4(x + 4))));
        }
      }
      for (int r = 0; r < R; ++r) dot[r] = _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1));
#endif
      const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(block + kGroup * kLanes / 2));
      const __m256 m = _mm256_loadu_ps(reinterpret_cast<const float*>(block + kGroup * kLanes / 2 + 4 * kLanes));
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[r * groups + g]));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), scale));
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(m, _mm256_set1_ps(xs[r * groups + g])));
      }
    } else {
      // vector j's bytes: inputs 4j..4j+3 of each channel, signed
      const uint8_t* block = w + g * kInt8Record;
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j));
#if defined(SPECSERVE_VNNI)
        const __m256i offset = _mm256_xor_si256(v, _mm256_set1_epi8(-128));  // q + 128, unsigned
        for (int r = 0; r < R; ++r) dot[r] = dpbusd(dot[r], offset, broadcast4(xq + r * k + g * kGroup + 4 * j));
#else
        // |q| times x with q's sign: 16-bit sums of two products of at most 128 * 127, exact
        const __m256i magnitude = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_sign_epi8(broadcast4(xq + r * k + g * kGroup + 4 * j), v);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), _mm256_set1_epi16(1)));
        }
#endif
      }
#if defined(SPECSERVE_VNNI)
      for (int r = 0; r < R; ++r) dot[r] = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(128 * xsum[r * groups + g]));
#endif
      const __m256 d = kKind == kInt8Group ? _mm256_loadu_ps(block_scales + g * kLanes) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m256 xscale = _mm256_set1_ps(xd[r * groups + g]);
        const __m256 scale = kKind == kInt8Group ? _mm256_mul_ps(d, xscale) : xscale;
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), scale));
      }
    }
  }
}

// y [rows, out] from the packed weights w ([tiles][groups] records) and, for int8, scales:
// a channel's [tiles * 8], or Q8_0's [tiles][groups][8].
template <Kind kKind>
void linear(const float* x, int64_t rows, int64_t k, const uint8_t* w, const float* scales, int64_t out, float* y) {
  if (rows <= 0) return;
  Q8Rows a;
  quantize_rows(x, rows, k, a);
  const int64_t groups = k / kGroup, tiles = (out + kLanes - 1) / kLanes;
  const int64_t record = kKind == kInt4 ? kInt4Record : kInt8Record;
  // rows in groups as even as can be (17: 4, 4, 3, 3, 3)
  const int64_t row_groups = (rows + kRowGroup - 1) / kRowGroup, small = rows / row_groups, large = rows % row_groups;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* wt = w + t * groups * record;
    const float* st = kKind == kInt8Group ? scales + t * groups * kLanes : nullptr;
    const int64_t n = t * kLanes, valid = out - n < kLanes ? out - n : kLanes;
    for (int64_t part = 0, r = 0, count = 0; part < row_groups; ++part, r += count) {
      count = small + (part < large);
      const int8_t* xq = a.q.data() + r * k;
      const float *xd = a.d.data() + r * groups, *xs = a.s.data() + r * groups;
      const int32_t* xsum = a.sum.data() + r * groups;
      __m256 acc[kRowGroup];
      switch (count) {
        case 4: tile<4, kKind>(wt, st, k, xq, xd, xs, xsum, acc); break;
        case 3: tile<3, kKind>(wt, st, k, xq, xd, xs, xsum, acc); break;
        case 2: tile<2, kKind>(wt, st, k, xq, xd, xs, xsum, acc); break;
        default: tile<1, kKind>(wt, st, k, xq, xd, xs, xsum, acc); break;
      }
      for (int64_t i = 0; i < count; ++i) {
        __m256 v = acc[i];
        if (kKind == kInt8Channel) v = _mm256_mul_ps(v, _mm256_loadu_ps(scales + n));
        float lanes[kLanes];
        _mm256_storeu_ps(lanes, v);
        for (int64_t c = 0; c < valid; ++c) y[(r + i) * out + n + c] = lanes[c];
      }
    }
  }
}

}  // namespace

extern "C" {

// Whether the products below take VNNI's dot product (else AVX2's maddubs and madd).
int q8_vnni() {
#if defined(SPECSERVE_VNNI)
  return 1;
#else
  return 0;
#endif
}

// The activations' quantisation the products below make of x [rows, k] (k a multiple of 32):
// codes q [rows, k], per block d, d * sum(codes) (s) and sum(codes) [rows, k / 32].
void q8_quantize(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s, int32_t* sum) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < rows; ++r)
    quantize_row(x + r * k, k, q + r * k, d + r * groups, s + r * groups, sum + r * groups);
}

// y [rows, out] = x [rows, k] @ W.T, W = d * q + m in 4-bit blocks of 32, packed by int4_pack
// (cpu_kernels.py): x quantised to 8 bits per block of 32.
void int4_linear_q8(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t out, float* y) {
  linear<kInt4>(x, rows, k, packed, nullptr, out, y);
}

// y [rows, out] = x [rows, k] @ W.T, W = int8 codes packed by int8_pack times scales, a channel's
// ([tiles * 8]) or, `grouped`, a block's ([tiles][k / 32][8], GGUF's Q8_0): x quantised likewise.
void int8_linear_q8(const float* x, int64_t rows, int64_t k, const uint8_t* packed, const float* scales, int grouped,
                    int64_t out, float* y) {
  if (grouped) linear<kInt8Group>(x, rows, k, packed, scales, out, y);
  else linear<kInt8Channel>(x, rows, k, packed, scales, out, y);
}

}  // extern "C"

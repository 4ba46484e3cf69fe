// Weight-only int4 and int8 matrix products, and float32 ones on prepacked weights, for x86
// CPUs with AVX2 and FMA, on float32 activations (runtime/cpu_kernels.py builds and loads
// this file). Built with AVX-512 (F, BW, VL, DQ) the products take 16 inputs a vector and
// decode int4 by table lookup.
//
// Every output y[m, n] is computed by one thread with one fixed sequence of operations,
// whatever the number of rows m beside it and however the work is split: a row scores the
// same alone or in a verification pass (the lossless contract, docs/DESIGN-NOTES.md).
//
// int4: GGUF's Q4_1 blocks of 32 inputs, their float16 scales widened to float32. int8:
// w = scale * q, one scale per output channel, or one per group of 32 inputs (GGUF's Q8_0).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int kGroup = 32;

inline float hsum(__m256 v) {  // a fixed order: (0+4, 1+5, 2+6, 3+7), then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A GGUF Q4_1 block, d and m widened to float32 (exact): 32 weights w = d * q + m, q in
// 0..15; byte i of `q` holds q[i] in its low nibble and q[i + 16] in its high one.
struct Q4Block {
  float d, m;
  uint8_t q[16];
};
static_assert(sizeof(Q4Block) == 24, "a block is 24 bytes");

// Weight vector j (inputs 8j..8j+7) of an int4 block.
inline __m256 int4_weights(const Q4Block& block, __m256 d, __m256 m, int j) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.q));
  if (j >= 2) b = _mm_srli_epi16(b, 4);
  if (j % 2) b = _mm_srli_si128(b, 8);
  b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), m);
}

enum Kind { kInt4, kInt8Channel, kInt8Group };

// Weight vector j of an int8 group (scale left out).
inline __m256 int8_weights(const int8_t* q, int j) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j))));
}

#if defined(__AVX512F__)

inline float hsum(__m512 v) {  // the halves added, then as hsum(__m256)
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

// R rows against output channel n, 16 inputs a vector. Each row sums with two accumulators,
// one for inputs 0-15 of every group, one for 16-31, over the groups in order, added at the
// end: the operations a row gets do not depend on R, so every tiling gives it the same result.
// An int4 block's 16 possible weights d * q + m are computed once (exactly as the AVX2 build
// computes each) and its codes index them: a lookup a vector instead of a conversion and an FMA.
template <int R, Kind kKind>
void channel(const float* x, int64_t k, const void* weight, const float* scale, int64_t n, int64_t out, float* y) {
  const int64_t groups = k / kGroup;
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    __m512 w[2];
    if (kKind == kInt4) {
      const Q4Block& block = static_cast<const Q4Block*>(weight)[n * groups + g];
      const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(block.d), codes, _mm512_set1_ps(block.m));
      // The lookup reads an index's low four bits: byte i's low nibble, then (shifted) its high one.
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block.q)));
      w[0] = _mm512_permutexvar_ps(q, table);
      w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    } else {
      const int8_t* q = static_cast<const int8_t*>(weight) + n * k + g * kGroup;
      for (int j = 0; j < 2; ++j)
        w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j))));
      if (kKind == kInt8Group) {  // w = d * q, exact in float32 for a float16 d
        const __m512 d = _mm512_set1_ps(scale[n * groups + g]);
        for (int j = 0; j < 2; ++j) w[j] = _mm512_mul_ps(d, w[j]);
      }
    }
    for (int j = 0; j < 2; ++j)
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(xg + r * k + 16 * j), acc[r][j]);
  }
  for (int r = 0; r < R; ++r) {
    const float total = hsum(_mm512_add_ps(acc[r][0], acc[r][1]));
    y[r * out + n] = kKind == kInt8Channel ? scale[n] * total : total;
  }
}

// Rows a channel's weights are decoded for at once, at most: 32 vector registers hold eight
// rows' sixteen accumulators beside the table and the weights.
constexpr int kRows = 8;

#else

// R rows against output channel n. Each row sums with two accumulators, one for inputs 0-7
// and 16-23 of every group, one for 8-15 and 24-31, over the groups in order, added at the
// end: the operations a row gets do not depend on R, so every tiling gives it the same result.
template <int R, Kind kKind>
void channel(const float* x, int64_t k, const void* weight, const float* scale, int64_t n, int64_t out, float* y) {
  const int64_t groups = k / kGroup;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    __m256 w[4];
    if (kKind == kInt4) {
      const Q4Block& block = static_cast<const Q4Block*>(weight)[n * groups + g];
      const __m256 d = _mm256_set1_ps(block.d), m = _mm256_set1_ps(block.m);
      for (int j = 0; j < 4; ++j) w[j] = int4_weights(block, d, m, j);
    } else {
      const int8_t* q = static_cast<const int8_t*>(weight) + n * k + g * kGroup;
      for (int j = 0; j < 4; ++j) w[j] = int8_weights(q, j);
      if (kKind == kInt8Group) {  // w = d * q, exact in float32 for a float16 d
        const __m256 d = _mm256_set1_ps(scale[n * groups + g]);
        for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(d, w[j]);
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r)
        acc[r][j % 2] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + r * k + 8 * j), acc[r][j % 2]);
  }
  for (int r = 0; r < R; ++r) {
    const float total = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    y[r * out + n] = kKind == kInt8Channel ? scale[n] * total : total;
  }
}

// Rows a channel's weights are decoded for at once, at most: five rows' ten accumulators and a
// group's four weight vectors nearly fill the 16 vector registers (six rows spill, measured
// slower). A pass's rows go in tiles as even as can be (6 rows: 3 and 3).
constexpr int kRows = 5;

#endif

template <Kind kKind>
void linear(const float* x, int64_t rows, int64_t k, const void* weight, const float* scale, int64_t out, float* y) {
  if (rows <= 0) return;  // the tiling below divides by the number of tiles
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < out; ++n) {
    const int64_t tiles = (rows + kRows - 1) / kRows, tile = (rows + tiles - 1) / tiles;
    for (int64_t r = 0; r < rows; r += tile) {
      const float* xr = x + r * k;
      float* yr = y + r * out;
      switch (rows - r < tile ? rows - r : tile) {
#if defined(__AVX512F__)
        case 8: channel<8, kKind>(xr, k, weight, scale, n, out, yr); break;
        case 7: channel<7, kKind>(xr, k, weight, scale, n, out, yr); break;
        case 6: channel<6, kKind>(xr, k, weight, scale, n, out, yr); break;
#endif
        case 5: channel<5, kKind>(xr, k, weight, scale, n, out, yr); break;
        case 4: channel<4, kKind>(xr, k, weight, scale, n, out, yr); break;
        case 3: channel<3, kKind>(xr, k, weight, scale, n, out, yr); break;
        case 2: channel<2, kKind>(xr, k, weight, scale, n, out, yr); break;
        default: channel<1, kKind>(xr, k, weight, scale, n, out, yr); break;
      }
    }
  }
}

// float32: C output channels against R rows at once, so that each input vector loaded meets C
// weight vectors and each weight vector R inputs. Every output sums with one accumulator over
// its inputs in order, then hsum: the operations an output gets depend neither on C nor on R.
// The weights are packed [out / C][k / 16][C][16] (`float32_pack`), so that a tile's weights
// are one stream, read once a pass: a tile's rows take turns over weights the cache holds.
#if defined(__AVX512F__)
using F32Vec = __m512;
constexpr int kF32Lanes = 16, kF32Rows = 4;  // 16 accumulators, 4 weights and an input in 32 registers
inline F32Vec f32_load(const float* p) { return _mm512_loadu_ps(p); }
inline F32Vec f32_fma(F32Vec a, F32Vec b, F32Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline F32Vec f32_zero() { return _mm512_setzero_ps(); }
#else
using F32Vec = __m256;
constexpr int kF32Lanes = 8, kF32Rows = 2;  // 8 accumulators, 4 weights and an input in 16 registers
inline F32Vec f32_load(const float* p) { return _mm256_loadu_ps(p); }
inline F32Vec f32_fma(F32Vec a, F32Vec b, F32Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline F32Vec f32_zero() { return _mm256_setzero_ps(); }
#endif
constexpr int kF32Channels = 4, kF32Chunk = 16;
// How far ahead of its reads a tile asks for its weights, into L2 (floats): without it the
// arithmetic of a pass of several rows and the stream from memory took turns instead of
// overlapping (docs/DESIGN-NOTES.md, CPU cost model).
constexpr int64_t kF32Prefetch = 4096;

template <int R>
void f32_tile(const float* x, int64_t k, const float* w, int64_t n, int64_t out, float* y) {
  constexpr int C = kF32Channels;
  F32Vec acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = f32_zero();
  const float* tile = w + n * k;
  for (int64_t i = 0; i < k; i += kF32Lanes) {
    const float* wi = tile + (i / kF32Chunk) * kF32Chunk * C + i % kF32Chunk;
    for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(wi + kF32Prefetch + c * kF32Chunk),
                                             _MM_HINT_T1);
    F32Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = f32_load(wi + c * kF32Chunk);
    for (int r = 0; r < R; ++r) {
      const F32Vec xv = f32_load(x + r * k + i);
      for (int c = 0; c < C; ++c) acc[c][r] = f32_fma(wv[c], xv, acc[c][r]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[r * out + n + c] = hsum(acc[c][r]);
}

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxQueries = 1024;  // of one row and kv head in a pass: heads per kv head x tokens

// float64 vectors: 8 lanes with AVX-512, 4 with AVX2 (the int models' attention).
#if defined(__AVX512F__)
using F64Vec = __m512d;
constexpr int64_t kF64Lanes = 8;
inline F64Vec f64_load(const double* p) { return _mm512_loadu_pd(p); }
// the first n <= 8 lanes of p, the rest 0
inline F64Vec f64_load_first(const double* p, int64_t n) { return _mm512_maskz_loadu_pd((1u << n) - 1, p); }
// 8 floats of a cache, widened (exactly)
inline F64Vec f64_load(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
inline F64Vec f64_load_first(const float* p, int64_t n) {
  return _mm512_cvtps_pd(_mm256_maskz_loadu_ps((1u << n) - 1, p));
}
inline void f64_store(double* p, F64Vec v) { _mm512_storeu_pd(p, v); }
inline F64Vec f64_set1(double v) { return _mm512_set1_pd(v); }
inline F64Vec f64_zero() { return _mm512_setzero_pd(); }
inline F64Vec f64_add(F64Vec a, F64Vec b) { return _mm512_add_pd(a, b); }
inline F64Vec f64_sub(F64Vec a, F64Vec b) { return _mm512_sub_pd(a, b); }
inline F64Vec f64_mul(F64Vec a, F64Vec b) { return _mm512_mul_pd(a, b); }
inline F64Vec f64_div(F64Vec a, F64Vec b) { return _mm512_div_pd(a, b); }
inline F64Vec f64_max(F64Vec a, F64Vec b) { return _mm512_max_pd(a, b); }
inline F64Vec f64_fma(F64Vec a, F64Vec b, F64Vec c) { return _mm512_fmadd_pd(a, b, c); }
inline F64Vec f64_fnma(F64Vec a, F64Vec b, F64Vec c) { return _mm512_fnmadd_pd(a, b, c); }  // c - a * b
inline F64Vec f64_round(F64Vec x) { return _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F64Vec f64_scaled_above(F64Vec p, F64Vec n, F64Vec x, F64Vec low) {
  return _mm512_maskz_mov_pd(_mm512_cmp_pd_mask(x, low, _CMP_GE_OQ), _mm512_scalef_pd(p, n));
}
inline __m256d f64_halves(F64Vec v) {
  return _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
}
#else
using F64Vec = __m256d;
constexpr int64_t kF64Lanes = 4;
inline F64Vec f64_load(const double* p) { return _mm256_loadu_pd(p); }
inline F64Vec f64_load_first(const double* p, int64_t n) {
  return _mm256_maskload_pd(p, _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3)));
}
inline F64Vec f64_load(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
inline F64Vec f64_load_first(const float* p, int64_t n) {
  const __m128i first = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(n)), _mm_setr_epi32(0, 1, 2, 3));
  return _mm256_cvtps_pd(_mm_maskload_ps(p, first));
}
inline void f64_store(double* p, F64Vec v) { _mm256_storeu_pd(p, v); }
inline F64Vec f64_set1(double v) { return _mm256_set1_pd(v); }
inline F64Vec f64_zero() { return _mm256_setzero_pd(); }
inline F64Vec f64_add(F64Vec a, F64Vec b) { return _mm256_add_pd(a, b); }
inline F64Vec f64_sub(F64Vec a, F64Vec b) { return _mm256_sub_pd(a, b); }
inline F64Vec f64_mul(F64Vec a, F64Vec b) { return _mm256_mul_pd(a, b); }
inline F64Vec f64_div(F64Vec a, F64Vec b) { return _mm256_div_pd(a, b); }
inline F64Vec f64_max(F64Vec a, F64Vec b) { return _mm256_max_pd(a, b); }
inline F64Vec f64_fma(F64Vec a, F64Vec b, F64Vec c) { return _mm256_fmadd_pd(a, b, c); }
inline F64Vec f64_fnma(F64Vec a, F64Vec b, F64Vec c) { return _mm256_fnmadd_pd(a, b, c); }  // c - a * b
inline F64Vec f64_round(F64Vec x) { return _mm256_round_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F64Vec f64_scaled_above(F64Vec p, F64Vec n, F64Vec x, F64Vec low) {  // n in [-1022, 0]
  const __m256i power = _mm256_slli_epi64(
      _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)), _mm256_set1_epi64x(1023)), 52);
  return _mm256_and_pd(_mm256_cmp_pd(x, low, _CMP_GE_OQ), _mm256_mul_pd(p, _mm256_castsi256_pd(power)));
}
inline __m256d f64_halves(F64Vec v) { return v; }
#endif

inline double hsum(F64Vec v) {  // a fixed order: to 4 lanes (AVX-512), then (0+2, 1+3), then the pair
  const __m256d h = f64_halves(v);
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

// q . k over d doubles (d a multiple of 4), k a float32 cache's key widened: four accumulators
// of vectors taking turns, added in a fixed order; named, not indexed, so that they stay in
// registers.
inline double dot(const double* q, const float* k, int64_t d) {
  constexpr int64_t L = kF64Lanes;
  F64Vec a0 = f64_zero(), a1 = f64_zero(), a2 = f64_zero(), a3 = f64_zero();
  int64_t j = 0;
  for (; j + 4 * L <= d; j += 4 * L) {
    a0 = f64_fma(f64_load(q + j), f64_load(k + j), a0);
    a1 = f64_fma(f64_load(q + j + L), f64_load(k + j + L), a1);
    a2 = f64_fma(f64_load(q + j + 2 * L), f64_load(k + j + 2 * L), a2);
    a3 = f64_fma(f64_load(q + j + 3 * L), f64_load(k + j + 3 * L), a3);
  }
  const int64_t rest = d - j;  // at most 4 vectors: each its turn, the last maybe in part
  const auto turn = [&](int64_t i, F64Vec acc) {  // vector i of the rest, its lanes past d 0
    const int64_t n = std::min(rest - i * L, L);
    return f64_fma(f64_load_first(q + j + i * L, n), f64_load_first(k + j + i * L, n), acc);
  };
  if (rest > 0) a0 = turn(0, a0);
  if (rest > L) a1 = turn(1, a1);
  if (rest > 2 * L) a2 = turn(2, a2);
  if (rest > 3 * L) a3 = turn(3, a3);
  return hsum(f64_add(f64_add(a0, a1), f64_add(a2, a3)));
}

// e^x of a vector (x <= 0 here: scores less the top one), Cephes' exp: x = n ln2 + r, e^r
// = 1 + 2 r P(r^2) / (Q(r^2) - r P(r^2)), 2^n into the exponent; below -708.39 (under
// double's normal range) 0.
inline F64Vec f64_exp(F64Vec x) {
  const F64Vec low = f64_set1(-708.39641853226408), kept = f64_max(x, low);
  const F64Vec n = f64_round(f64_mul(kept, f64_set1(1.4426950408889634074)));
  const F64Vec r = f64_fnma(n, f64_set1(1.42860682030941723212e-6), f64_fnma(n, f64_set1(6.93145751953125e-1), kept));
  const F64Vec rr = f64_mul(r, r);
  F64Vec p = f64_set1(1.26177193074810590878e-4);
  p = f64_fma(p, rr, f64_set1(3.02994407707441961300e-2));
  p = f64_mul(f64_fma(p, rr, f64_set1(9.99999999999999999910e-1)), r);
  F64Vec q = f64_set1(3.00198505138664455042e-6);
  q = f64_fma(q, rr, f64_set1(2.52448340349684104192e-3));
  q = f64_fma(q, rr, f64_set1(2.27265548208155028766e-1));
  q = f64_fma(q, rr, f64_set1(2.00000000000000000009e0));
  const F64Vec e = f64_fma(f64_set1(2.0), f64_div(p, f64_sub(q, p)), f64_set1(1.0));
  return f64_scaled_above(e, n, x, low);
}

constexpr float kExpPolynomial[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                                     5.0000001201e-1f};  // after 1.9875691500e-4, highest power first

#if defined(__AVX512F__)
inline F32Vec f32_set1(float v) { return _mm512_set1_ps(v); }
inline F32Vec f32_add(F32Vec a, F32Vec b) { return _mm512_add_ps(a, b); }
inline F32Vec f32_sub(F32Vec a, F32Vec b) { return _mm512_sub_ps(a, b); }
inline F32Vec f32_mul(F32Vec a, F32Vec b) { return _mm512_mul_ps(a, b); }
inline F32Vec f32_div(F32Vec a, F32Vec b) { return _mm512_div_ps(a, b); }
inline F32Vec f32_max(F32Vec a, F32Vec b) { return _mm512_max_ps(a, b); }
inline F32Vec f32_fnma(F32Vec a, F32Vec b, F32Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline F32Vec f32_round(F32Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void f32_store(float* p, F32Vec v) { _mm512_storeu_ps(p, v); }
// p * 2^n (n whole) where x >= low, else 0
inline F32Vec f32_scaled_above(F32Vec p, F32Vec n, F32Vec x, F32Vec low) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), _mm512_scalef_ps(p, n));
}
#else
inline F32Vec f32_set1(float v) { return _mm256_set1_ps(v); }
inline F32Vec f32_add(F32Vec a, F32Vec b) { return _mm256_add_ps(a, b); }
inline F32Vec f32_sub(F32Vec a, F32Vec b) { return _mm256_sub_ps(a, b); }
inline F32Vec f32_mul(F32Vec a, F32Vec b) { return _mm256_mul_ps(a, b); }
inline F32Vec f32_div(F32Vec a, F32Vec b) { return _mm256_div_ps(a, b); }
inline F32Vec f32_max(F32Vec a, F32Vec b) { return _mm256_max_ps(a, b); }
inline F32Vec f32_fnma(F32Vec a, F32Vec b, F32Vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
inline F32Vec f32_round(F32Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void f32_store(float* p, F32Vec v) { _mm256_storeu_ps(p, v); }
inline F32Vec f32_scaled_above(F32Vec p, F32Vec n, F32Vec x, F32Vec low) {
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_cmp_ps(x, low, _CMP_GE_OQ), _mm256_mul_ps(p, _mm256_castsi256_ps(power)));
}
#endif

// e^x of a vector (x <= 0 here: scores less the top one), Cephes' expf: x = n ln2 + r, e^r by a
// degree-6 polynomial, 2^n into the exponent; below -87.3 (under float's normal range) 0.
inline F32Vec f32_exp(F32Vec x) {
  const F32Vec low = f32_set1(-87.33654f), kept = f32_max(x, low);
  const F32Vec n = f32_round(f32_mul(kept, f32_set1(1.44269504088896341f)));
  const F32Vec r = f32_fnma(n, f32_set1(-2.12194440e-4f), f32_fnma(n, f32_set1(0.693359375f), kept));
  F32Vec p = f32_set1(1.9875691500e-4f);
  for (float c : kExpPolynomial) p = f32_fma(p, r, f32_set1(c));
  p = f32_fma(p, f32_mul(r, r), f32_add(r, f32_set1(1.0f)));
  return f32_scaled_above(p, n, x, low);
}

// One query's score of one slot: q . k * scale + its additive mask. float64: four accumulators
// taking turns (`dot`); float32: one accumulator of vectors, then hsum.
inline double score(const double* q, const float* k, int64_t d, double scale, double allowed) {
  return dot(q, k, d) * scale + allowed;
}
inline float score(const float* q, const float* k, int64_t d, float scale, float allowed) {
  F32Vec acc = f32_zero();
  for (int64_t c = 0; c < d; c += kF32Lanes) acc = f32_fma(f32_load(q + c), f32_load(k + c), acc);
  return hsum(acc) * scale + allowed;
}

// The weights e^(score - top) of one query's n scores, in place, and their total: a vector at a
// time (scores has room for n rounded up to a vector), summed into one accumulator of vectors,
// then hsum.
inline double weigh(double* scores, int64_t n, double top) {
  const int64_t padded = (n + kF64Lanes - 1) / kF64Lanes * kF64Lanes;
  for (int64_t j = n; j < padded; ++j) scores[j] = -INFINITY;  // weigh 0
  const F64Vec top_v = f64_set1(top);
  F64Vec totals = f64_zero();
  for (int64_t j = 0; j < padded; j += kF64Lanes) {
    const F64Vec p = f64_exp(f64_sub(f64_load(scores + j), top_v));
    f64_store(scores + j, p);
    totals = f64_add(totals, p);
  }
  return hsum(totals);
}
inline float weigh(float* scores, int64_t n, float top) {
  const int64_t padded = (n + kF32Lanes - 1) / kF32Lanes * kF32Lanes;
  for (int64_t j = n; j < padded; ++j) scores[j] = -INFINITY;  // weigh 0
  const F32Vec top_v = f32_set1(top);
  F32Vec totals = f32_zero();
  for (int64_t j = 0; j < padded; j += kF32Lanes) {
    const F32Vec p = f32_exp(f32_sub(f32_load(scores + j), top_v));
    f32_store(scores + j, p);
    totals = f32_add(totals, p);
  }
  return hsum(totals);
}

// acc [d] += p[j] * values[slots[j]] [d] for each of n slots in turn, lane by lane, the head
// dimension in chunks of at most 8 vectors, whose sums stay in registers over the slots.
template <int V>
void accumulate_chunk(double* acc, const double* ps, const int32_t* slots, int64_t n, const float* values,
                      int64_t d) {
  F64Vec a[V];
  for (int c = 0; c < V; ++c) a[c] = f64_load(acc + c * kF64Lanes);
  for (int64_t j = 0; j < n; ++j) {
    const F64Vec p = f64_set1(ps[j]);
    const float* v = values + slots[j] * d;
    for (int c = 0; c < V; ++c) a[c] = f64_fma(p, f64_load(v + c * kF64Lanes), a[c]);
  }
  for (int c = 0; c < V; ++c) f64_store(acc + c * kF64Lanes, a[c]);
}
// the last lanes < kF64Lanes entries of the head dimension (AVX-512, d not a multiple of 8)
inline void accumulate_rest(double* acc, const double* ps, const int32_t* slots, int64_t n, const float* values,
                            int64_t d, int64_t lanes) {
  F64Vec a = f64_load_first(acc, lanes);
  for (int64_t j = 0; j < n; ++j) a = f64_fma(f64_set1(ps[j]), f64_load_first(values + slots[j] * d, lanes), a);
  double out[kF64Lanes];
  f64_store(out, a);
  for (int64_t i = 0; i < lanes; ++i) acc[i] = out[i];
}
template <int V>
void accumulate_chunk(float* acc, const float* ps, const int32_t* slots, int64_t n, const float* values, int64_t d) {
  F32Vec a[V];
  for (int c = 0; c < V; ++c) a[c] = f32_load(acc + c * kF32Lanes);
  for (int64_t j = 0; j < n; ++j) {
    const F32Vec p = f32_set1(ps[j]);
    const float* v = values + slots[j] * d;
    for (int c = 0; c < V; ++c) a[c] = f32_fma(p, f32_load(v + c * kF32Lanes), a[c]);
  }
  for (int c = 0; c < V; ++c) f32_store(acc + c * kF32Lanes, a[c]);
}
template <typename T>
void accumulate(T* acc, const T* ps, const int32_t* slots, int64_t n, const float* values, int64_t d) {
  constexpr int64_t lanes = sizeof(T) == sizeof(double) ? kF64Lanes : kF32Lanes;
  int64_t i = 0;
  for (; i + 8 * lanes <= d; i += 8 * lanes) accumulate_chunk<8>(acc + i, ps, slots, n, values + i, d);
  for (; i + 4 * lanes <= d; i += 4 * lanes) accumulate_chunk<4>(acc + i, ps, slots, n, values + i, d);
  for (; i + lanes <= d; i += lanes) accumulate_chunk<1>(acc + i, ps, slots, n, values + i, d);
  if constexpr (sizeof(T) == sizeof(double))
    if (i < d) accumulate_rest(acc + i, ps, slots, n, values + i, d, d - i);
}

// A thread's scratch for attend_queries, kept between calls: the passes are many and alike.
template <typename T>
struct Scratch {
  std::vector<T> scores, acc, top, total;
  std::vector<int32_t> slots, places;
  std::vector<int64_t> count, cursor;
  void fit(int64_t m, int64_t stride, int64_t d) {
    if (static_cast<int64_t>(scores.size()) < m * stride)
      scores.resize(m * stride), slots.resize(m * stride), places.resize(m * stride);
    if (static_cast<int64_t>(acc.size()) < m * d) acc.resize(m * d);
    if (static_cast<int64_t>(top.size()) < m) top.resize(m), total.resize(m), count.resize(m), cursor.resize(m);
  }
};

// Whether any of n mask entries (n a multiple of 8) lets a query see its slot: the padding of a
// pass's narrower rows sees one slot each, and skips the rest of its row a block at a time.
inline bool any_allowed(const float* mask, int64_t n) {
  const __m256 hidden = _mm256_set1_ps(-INFINITY);
  for (int64_t s = 0; s < n; s += 8)
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(mask + s), hidden, _CMP_NEQ_OQ))) return true;
  return false;
}
inline bool any_allowed(const double* mask, int64_t n) {
  const __m256d hidden = _mm256_set1_pd(-INFINITY);
  for (int64_t s = 0; s < n; s += 4)
    if (_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(mask + s), hidden, _CMP_NEQ_OQ))) return true;
  return false;
}

// Slots whose keys, then values, every query of an attend_queries call reads in turn while the
// cache holds them: 16 KB of keys of d = 64 floats.
constexpr int64_t kSlotBlock = 64;

// The attention of m queries that share one kv head (of one row): query q's scores go over the
// slots below `limit` where its additive mask row masks[q] is not -inf, in slot order, then
// softmax, then the values likewise; out[q] [d] float32. Slot s's key is at keys + place(s) * d,
// its value likewise: place(s) = s, or `map`[s] where a paged cache's block table places it
// (runtime/paged_kv.py; the same operations on the same values wherever they lie). The keys and
// values are float32 in either dtype: float64 attention widens them as it reads them (they are float32 values). The
// queries take turns at each block of slots, so its keys and values are read from memory once
// for all of them, and each query's own operations are those it gets alone: a token attends the
// same in any batch, beside any rows and queries, whatever the batch's span or width (the
// lossless contract).
template <typename T>
void attend_queries(const T* const* qs, const T* const* masks, int64_t m, int64_t limit, const float* keys,
                    const float* values, int64_t d, T scale, float* const* outs, const int32_t* map) {
  static thread_local Scratch<T> scratch;
  const int64_t stride = limit + kF32Lanes;
  scratch.fit(m, stride, d);
  T *scores = scratch.scores.data(), *acc = scratch.acc.data(), *top = scratch.top.data();
  int32_t *slots = scratch.slots.data(), *places = scratch.places.data();
  int64_t *count = scratch.count.data(), *cursor = scratch.cursor.data();
  for (int64_t q = 0; q < m; ++q) count[q] = 0, cursor[q] = 0, top[q] = -INFINITY;
  for (int64_t first = 0; first < limit; first += kSlotBlock) {
    const int64_t last = first + kSlotBlock < limit ? first + kSlotBlock : limit;
    for (int64_t q = 0; q < m; ++q) {
      const T *query = qs[q], *allowed = masks[q];
      if (last - first == kSlotBlock && !any_allowed(allowed + first, kSlotBlock)) continue;
      T* sc = scores + q * stride;
      int32_t *seen = slots + q * stride, *at = places + q * stride;
      int64_t n = count[q];  // in registers over the block, not through memory slot by slot
      T highest = top[q];
      for (int64_t s = first; s < last; ++s) {
        if (allowed[s] == -INFINITY) continue;
        const int32_t place = map ? map[s] : static_cast<int32_t>(s);
        const T x = score(query, keys + static_cast<int64_t>(place) * d, d, scale, allowed[s]);
        sc[n] = x;
        at[n] = place;
        seen[n++] = static_cast<int32_t>(s);
        highest = x > highest ? x : highest;
      }
      count[q] = n, top[q] = highest;
    }
  }
  for (int64_t q = 0; q < m; ++q) scratch.total[q] = weigh(scores + q * stride, count[q], top[q]);
  for (int64_t i = 0; i < m * d; ++i) acc[i] = 0;
  for (int64_t first = 0; first < limit; first += kSlotBlock) {
    const int64_t last = first + kSlotBlock;
    for (int64_t q = 0; q < m; ++q) {
      const int32_t* seen = slots + q * stride;
      int64_t end = cursor[q];
      while (end < count[q] && seen[end] < last) ++end;
      accumulate(acc + q * d, scores + q * stride + cursor[q], places + q * stride + cursor[q], end - cursor[q],
                 values, d);
      cursor[q] = end;
    }
  }
  for (int64_t q = 0; q < m; ++q)
    for (int64_t i = 0; i < d; ++i) outs[q][i] = static_cast<float>(acc[q * d + i] / scratch.total[q]);
}

// The attention of b rows of t queries each, n_heads a row (`attend_queries` for each row and
// kv head); the layout of `attend_rows_float32` below. A row and kv head's queries are split
// into parts of about an equal share of the pass's work (queries x slots) for each thread to
// take several of, the largest first: a batch's contexts differ by tens of times, and one long
// row's heads whole would keep one thread busy while the others wait.
template <typename T>
void attend_rows(const T* q, int64_t b, int64_t t, int64_t n_heads, int64_t n_kv, int64_t d, const float* k,
                 const float* v, int64_t row_stride, int64_t head_stride, const T* mask, int64_t span,
                 const int64_t* limits, float* out, const int32_t* map = nullptr, int64_t map_stride = 0) {
  const int64_t group = n_heads / n_kv, m = group * t;
  const T scale = static_cast<T>(1.0 / sqrt(static_cast<double>(d)));
  struct Part {
    int64_t row, kv_head, first, last, limit;  // queries first..last-1 over slots below limit
    int64_t work() const { return (last - first) * limit; }
  };
  std::vector<Part> parts;
  int64_t work = 0;
  for (int64_t r = 0; r < b; ++r) work += n_kv * m * std::min(limits[r], span);
  const int64_t share = std::max<int64_t>(1, work / (4 * omp_get_max_threads()));
  for (int64_t r = 0; r < b; ++r) {
    const int64_t limit = std::min(limits[r], span);
    const int64_t pieces = std::min(m, std::max<int64_t>(1, m * limit / share));
    const int64_t per_piece = (m + pieces - 1) / pieces;
    for (int64_t g = 0; g < n_kv; ++g)
      for (int64_t first = 0; first < m; first += per_piece)
        parts.push_back({r, g, first, std::min(m, first + per_piece), limit});
  }
  std::stable_sort(parts.begin(), parts.end(), [](const Part& x, const Part& y) { return x.work() > y.work(); });
  const int64_t n_parts = static_cast<int64_t>(parts.size());
#pragma omp parallel for schedule(dynamic) if (b * t * n_heads * span > 1024)
  for (int64_t i = 0; i < n_parts; ++i) {
    const Part& part = parts[i];
    const int64_t r = part.row, g = part.kv_head;
    const T* qs[kMaxQueries];
    const T* masks[kMaxQueries];
    float* outs[kMaxQueries];
    int64_t n = 0;
    for (int64_t j = part.first; j < part.last; ++j, ++n) {
      const int64_t h = g * group + j / t, at = j % t;
      qs[n] = q + ((r * n_heads + h) * t + at) * d, outs[n] = out + ((r * t + at) * n_heads + h) * d;
      masks[n] = mask + (r * t + at) * span;
    }
    attend_queries(qs, masks, n, part.limit, k + r * row_stride + g * head_stride, v + r * row_stride + g * head_stride,
                   d, scale, outs, map ? map + r * map_stride : nullptr);
  }
}

}  // namespace

extern "C" {

// y [rows, out] = x [rows, k] @ W.T, W given as Q4_1 blocks [out, k/32]. k a multiple of 32.
void int4_linear(const float* x, int64_t rows, int64_t k, const Q4Block* blocks, int64_t out, float* y) {
  linear<kInt4>(x, rows, k, blocks, nullptr, out, y);
}

// y [rows, out] = x [rows, k] @ W.T, W = q [out, k] int8 times `scale`: [out] one per channel,
// or `grouped`, [out, k/32] one per group of 32 inputs. k a multiple of 32.
void int8_linear(const float* x, int64_t rows, int64_t k, const int8_t* q, const float* scale, int grouped,
                 int64_t out, float* y) {
  if (grouped) linear<kInt8Group>(x, rows, k, q, scale, out, y);
  else linear<kInt8Channel>(x, rows, k, q, scale, out, y);
}

// packed [out / 4][k / 16][4][16] = w [out, k] float32, for float32_linear. out a multiple of 4, k of 16.
void float32_pack(const float* w, int64_t out, int64_t k, float* packed) {
  for (int64_t n = 0; n < out; ++n)
    for (int64_t i = 0; i < k; ++i)
      packed[(n / kF32Channels) * kF32Channels * k + (i / kF32Chunk) * kF32Chunk * kF32Channels +
             (n % kF32Channels) * kF32Chunk + i % kF32Chunk] = w[n * k + i];
}

// y [rows, out] = x [rows, k] @ W.T, W as float32_pack packed it. Rows go in tiles as even as can be.
void float32_linear(const float* x, int64_t rows, int64_t k, const float* packed, int64_t out, float* y) {
  if (rows <= 0) return;  // the tiling below divides by the number of tiles
  const int64_t tiles = (rows + kF32Rows - 1) / kF32Rows, tile = (rows + tiles - 1) / tiles;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < out; n += kF32Channels) {
    for (int64_t r = 0; r < rows; r += tile) {
      const float* xr = x + r * k;
      float* yr = y + r * out;
      switch (rows - r < tile ? rows - r : tile) {
#if defined(__AVX512F__)
        case 4: f32_tile<4>(xr, k, packed, n, out, yr); break;
        case 3: f32_tile<3>(xr, k, packed, n, out, yr); break;
#endif
        case 2: f32_tile<2>(xr, k, packed, n, out, yr); break;
        default: f32_tile<1>(xr, k, packed, n, out, yr); break;
      }
    }
  }
}

// y [rows, k] = weight * x / sqrt(mean(x^2) + eps), row by row (RMSNorm); k a multiple of 8.
void rms_norm(const float* x, int64_t rows, int64_t k, const float* weight, float eps, float* y) {
#pragma omp parallel for schedule(static) if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    __m256 squares = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum(squares) / k + eps));
    for (int64_t i = 0; i < k; i += 8)
      _mm256_storeu_ps(y + r * k + i,
                       _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), scale)));
  }
}

// Attention of t new tokens of one sequence in float64, the int models' attention dtype.
// qkv [t, (n_heads + 2 n_kv) * d] float32 holds each token's query, key and value heads; cos
// and sin [t, d] are RoPE's at its position, sin's first half negated (model.py): queries and
// keys are rotated in float32 as Attention.forward rotates them, x * cos + roll(x, d/2) * sin,
// the queries then widened. The keys and values go as they are to slots start..start+t-1 of
// the float32 caches [n_kv, max_len, d] (d a multiple of 4, at most kMaxHeadDim), which the
// attention widens as it reads them; each query then attends to the slots
// 0..span-1 where the additive mask [t, span] is not -inf. out [t, n_heads * d] float32.
// The attention is attend_rows' for one row: a token verified beside others attends as it
// does alone. With a `map` (a paged cache's row, runtime/paged_kv.py) slot s is at map[s] of
// each head's max_len slots instead, for the writes and the reads.
void attend(const float* qkv, int64_t t, int64_t n_heads, int64_t n_kv, int64_t d, const float* cos,
            const float* sin, float* k_cache, float* v_cache, int64_t max_len, int64_t start, const double* mask,
            int64_t span, float* out, const int32_t* map) {
  const int64_t width = (n_heads + 2 * n_kv) * d, half = d / 2;
  std::vector<double> queries(n_heads * t * d);  // [n_heads, t, d], as attend_rows takes them
  for (int64_t i = 0; i < t; ++i) {
    const float *row = qkv + i * width, *c = cos + i * d, *sn = sin + i * d;
    for (int64_t h = 0; h < n_heads + 2 * n_kv; ++h) {
      const float* x = row + h * d;
      const int64_t place = map ? map[start + i] : start + i;
      if (h >= n_heads + n_kv) {
        std::copy(x, x + d, v_cache + ((h - n_heads - n_kv) * max_len + place) * d);
        continue;
      }
      double* query = h < n_heads ? queries.data() + (h * t + i) * d : nullptr;
      float* key = h < n_heads ? nullptr : k_cache + ((h - n_heads) * max_len + place) * d;
      for (int64_t j = 0; j < d; ++j) {
        const float rotated_in = x[j < half ? j + half : j - half];
        const float a = x[j] * c[j], b = rotated_in * sn[j];
        if (query) query[j] = static_cast<double>(a + b);
        else key[j] = a + b;
      }
    }
  }
  const int64_t limit = start + t;
  attend_rows(queries.data(), 1, t, n_heads, n_kv, d, k_cache, v_cache, 0, max_len * d, mask, span, &limit, out, map);
}

// Attention of b rows of t new queries each after their keys and values went to the caches:
// q [b, n_heads, t, d]; row r's kv head g's slot s at k + r * row_stride + g * head_stride + s * d,
// likewise v, or, with a `map` [b, map_stride] (paged rows: row_stride 0), at map[r][s] instead
// of s; the additive mask [b, t, span] (0 or -inf); row r's queries see slots below
// limits[r] at most. out [b, t, n_heads * d] float32. Each query's output is the one it gets
// alone (attend_queries). float32 attention: d a multiple of 16, at most kMaxHeadDim.
void attend_rows_float32(const float* q, int64_t b, int64_t t, int64_t n_heads, int64_t n_kv, int64_t d,
                         const float* k, const float* v, int64_t row_stride, int64_t head_stride, const float* mask,
                         int64_t span, const int64_t* limits, float* out, const int32_t* map, int64_t map_stride) {
  attend_rows(q, b, t, n_heads, n_kv, d, k, v, row_stride, head_stride, mask, span, limits, out, map, map_stride);
}

// ... float64 attention (the int models') over float32 caches, d a multiple of 4: each query's
// output the one `attend` gives it alone.
void attend_rows_float64(const double* q, int64_t b, int64_t t, int64_t n_heads, int64_t n_kv, int64_t d,
                         const float* k, const float* v, int64_t row_stride, int64_t head_stride,
                         const double* mask, int64_t span, const int64_t* limits, float* out, const int32_t* map,
                         int64_t map_stride) {
  attend_rows(q, b, t, n_heads, n_kv, d, k, v, row_stride, head_stride, mask, span, limits, out, map, map_stride);
}

// w [out, k] = the Q4_1 blocks' weights in float32, each d * q + m as the products compute it.
void int4_dequantize(int64_t k, const Q4Block* blocks, int64_t out, float* w) {
  const int64_t groups = k / kGroup;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < out; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      const Q4Block& block = blocks[n * groups + g];
      const __m256 d = _mm256_set1_ps(block.d), m = _mm256_set1_ps(block.m);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(w + n * k + g * kGroup + 8 * j, int4_weights(block, d, m, j));
    }
  }
}

}  // extern "C"

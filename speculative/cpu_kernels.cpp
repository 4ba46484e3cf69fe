// Weight-only int4 and int8 matrix products, and float32 ones on prepacked weights, for x86
// CPUs with AVX2 and FMA, on float32 activations (speculative/cpu_kernels.py builds and loads
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
#include <stdint.h>

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

// q . k over d doubles (d a multiple of 4): four accumulators taking turns, added in a fixed order.
inline double dot(const double* q, const double* k, int64_t d) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (int64_t j = 0; j < d; j += 4)
    acc[(j / 4) % 4] = _mm256_fmadd_pd(_mm256_loadu_pd(q + j), _mm256_loadu_pd(k + j), acc[(j / 4) % 4]);
  const __m256d v = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
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
// then widened. The keys and values go to slots start..start+t-1 of the caches [n_kv,
// max_len, d] (d a multiple of 4, at most kMaxHeadDim); each query then attends to the slots
// 0..span-1 where the additive mask [t, span] is not -inf. out [t, n_heads * d] float32.
// A query's output is one thread's fixed sequence of operations over the slots it may see,
// in slot order, whatever t: a token verified beside others attends as it does alone.
void attend(const float* qkv, int64_t t, int64_t n_heads, int64_t n_kv, int64_t d, const float* cos,
            const float* sin, double* k_cache, double* v_cache, int64_t max_len, int64_t start, const double* mask,
            int64_t span, float* out) {
  const int64_t width = (n_heads + 2 * n_kv) * d, half = d / 2, group = n_heads / n_kv;
  const double scale = 1.0 / sqrt(static_cast<double>(d));
  double* queries = new double[t * n_heads * d];
  for (int64_t i = 0; i < t; ++i) {
    const float *row = qkv + i * width, *c = cos + i * d, *sn = sin + i * d;
    for (int64_t h = 0; h < n_heads + 2 * n_kv; ++h) {
      const float* x = row + h * d;
      double* to = h < n_heads ? queries + (i * n_heads + h) * d
                   : h < n_heads + n_kv ? k_cache + ((h - n_heads) * max_len + start + i) * d
                                        : v_cache + ((h - n_heads - n_kv) * max_len + start + i) * d;
      for (int64_t j = 0; j < d; ++j) {
        if (h >= n_heads + n_kv) {
          to[j] = x[j];
          continue;
        }
        const float rotated_in = x[j < half ? j + half : j - half];
        const float a = x[j] * c[j], b = rotated_in * sn[j];
        to[j] = static_cast<double>(a + b);
      }
    }
  }
  double* scores = new double[t * n_heads * span];
#pragma omp parallel for schedule(static) collapse(2) if (t * n_heads * span > 4096)
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t h = 0; h < n_heads; ++h) {
      const double* q = queries + (i * n_heads + h) * d;
      const double *keys = k_cache + (h / group) * max_len * d, *values = v_cache + (h / group) * max_len * d;
      const double* allowed = mask + i * span;
      double* score = scores + (i * n_heads + h) * span;
      double top = -INFINITY;
      for (int64_t s = 0; s < span; ++s) {
        if (allowed[s] == -INFINITY) continue;
        score[s] = dot(q, keys + s * d, d) * scale + allowed[s];
        top = fmax(top, score[s]);
      }
      double total = 0;
      float* o = out + (i * n_heads + h) * d;
      double acc[kMaxHeadDim] = {0};
      for (int64_t s = 0; s < span; ++s) {
        if (allowed[s] == -INFINITY) continue;
        const double p = exp(score[s] - top);
        total += p;
        const __m256d pv = _mm256_set1_pd(p);
        for (int64_t j = 0; j < d; j += 4)
          _mm256_storeu_pd(acc + j, _mm256_fmadd_pd(pv, _mm256_loadu_pd(values + s * d + j), _mm256_loadu_pd(acc + j)));
      }
      for (int64_t j = 0; j < d; ++j) o[j] = static_cast<float>(acc[j] / total);
    }
  }
  delete[] scores;
  delete[] queries;
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

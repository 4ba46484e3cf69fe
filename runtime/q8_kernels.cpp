// int4 and int8 weight products on 8-bit activations, for x86 CPUs with AVX2 (built with
// cpu_kernels.cpp into one library, runtime/cpu_kernels.py). The model is llama.cpp's
// (ggml-cpu's q4_1 x q8_1 and q8_0 x q8_0 dot products, and its repacked 8-channel tiles):
// each row of the input is quantised per block of 32 inputs as a Q8_0 block (a float32 scale
// d = max|x| / 127 and 32 int8 codes), and the weight codes are multiplied by the activation
// codes with integer dot products: `_mm256_maddubs_epi16` and `_mm256_madd_epi16` with AVX2,
// `vpdpbusd` where the CPU has AVX512-VNNI (`_mm512_dpbusd_epi32`) or AVX-VNNI.
//
// The weights are packed in tiles of kLanes = 8 output channels (`int4_pack`, `int8_pack` in
// cpu_kernels.py): a 256-bit vector holds four consecutive inputs of each of the 8 channels, so
// one broadcast of four activation codes meets eight channels and every lane is one channel's
// sum, never added across lanes; an AVX-512 build takes two tiles a 512-bit vector (16
// channels), the last odd tile as the AVX2 build does. A tile's blocks are read from memory
// once a pass and then from the L1 cache by each group of up to kRowGroup rows: a pass of 17
// rows reads the weights as one row does.
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
// AVX-VNNI, AVX-512, and AMX: q8_amx.cpp takes passes of several rows there, with the same
// integer dot products and this epilogue).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

#include "q8_amx.h"

namespace {

constexpr int64_t kGroup = 32;    // inputs a block
constexpr int64_t kLanes = 8;     // output channels a packed tile
constexpr int kRowGroup = 4;      // rows that take a tile's block at once, at most
constexpr int64_t kInt4Record = kGroup * kLanes / 2 + 2 * kLanes * 4;  // a tile's block: codes, d, m
constexpr int64_t kInt8Record = kGroup * kLanes;                        // a tile's block of int8 codes

// The vector operations the products take, on 256 bits (one tile: V256) or 512 (two tiles,
// their lanes side by side: V512). `codes`/`floats` load a tile's 32 bytes / 8 floats at p and,
// for V512, the next tile's at p + next.
struct V256 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kTiles = 1;
  static I codes(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F floats(const float* p, int64_t) { return _mm256_loadu_ps(p); }
  static I broadcast4(const int8_t* p) {  // four activation codes in every lane
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I nibble(I v, int high) {  // the low or high 4 bits of each byte
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
  }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }  // u8 x s8 pairs, to int16
  static I pairs(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }  // int16 pairs to int32
  static I magnitude(I v) { return _mm256_abs_epi8(v); }
  static I signed_as(I x, I w) { return _mm256_sign_epi8(x, w); }  // x negated where w < 0 (0 where w is)
  static I offset(I v) { return _mm256_xor_si256(v, _mm256_set1_epi8(-128)); }  // q + 128, unsigned
  static I less(I a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
  static F number(I a) { return _mm256_cvtepi32_ps(a); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F set(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
#if defined(SPECSERVE_EMULATE_VNNI)  // the VNNI path's arithmetic on AVX2, to test it where no CPU has VNNI
#define SPECSERVE_VNNI 1
  static I dpbusd(I acc, I u, I s) {  // u8 x s8, four bytes a lane, added to acc
    const I u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF)), u_odd = _mm256_srli_epi16(u, 8);
    const I s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
  }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECSERVE_VNNI 1
  static I dpbusd(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define SPECSERVE_VNNI 1
  static I dpbusd(I acc, I u, I s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && !defined(SPECSERVE_EMULATE_AVX512)
#define SPECSERVE_V512 1
struct V512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kTiles = 2;
  static I codes(const uint8_t* p, int64_t next) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(V256::codes(p, 0)), V256::codes(p + next, 0), 1);
  }
  static F floats(const float* p, int64_t next) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + next), 1);
  }
  static I broadcast4(const int8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I nibble(I v, int high) { return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F)); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I maddubs(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I pairs(I a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
  static I magnitude(I v) { return _mm512_abs_epi8(v); }
  static I signed_as(I x, I w) {  // AVX-512 has no sign_epi8: 0 - x where w < 0 (w = 0 meets |w| = 0)
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  }
  static I offset(I v) { return _mm512_xor_si512(v, _mm512_set1_epi8(-128)); }
  static I less(I a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
  static F number(I a) { return _mm512_cvtepi32_ps(a); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F set(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
#if defined(__AVX512VNNI__)
  static I dpbusd(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
#endif
};
#elif defined(SPECSERVE_EMULATE_AVX512)
// The AVX-512 build's two-tile arithmetic as two AVX2 halves, to test where no CPU has AVX-512.
#define SPECSERVE_V512 1
struct V512 {
  struct I { __m256i lo, hi; };
  struct F { __m256 lo, hi; };
  static constexpr int kTiles = 2;
  static I codes(const uint8_t* p, int64_t next) { return {V256::codes(p, 0), V256::codes(p + next, 0)}; }
  static F floats(const float* p, int64_t next) { return {V256::floats(p, 0), V256::floats(p + next, 0)}; }
  static I broadcast4(const int8_t* p) { return {V256::broadcast4(p), V256::broadcast4(p)}; }
  static I zero() { return {V256::zero(), V256::zero()}; }
  static I nibble(I v, int high) { return {V256::nibble(v.lo, high), V256::nibble(v.hi, high)}; }
  static I add16(I a, I b) { return {V256::add16(a.lo, b.lo), V256::add16(a.hi, b.hi)}; }
  static I add32(I a, I b) { return {V256::add32(a.lo, b.lo), V256::add32(a.hi, b.hi)}; }
  static I maddubs(I u, I s) { return {V256::maddubs(u.lo, s.lo), V256::maddubs(u.hi, s.hi)}; }
  static I pairs(I a) { return {V256::pairs(a.lo), V256::pairs(a.hi)}; }
  static I magnitude(I v) { return {V256::magnitude(v.lo), V256::magnitude(v.hi)}; }
  static I signed_as(I x, I w) { return {V256::signed_as(x.lo, w.lo), V256::signed_as(x.hi, w.hi)}; }
  static I offset(I v) { return {V256::offset(v.lo), V256::offset(v.hi)}; }
  static I less(I a, int32_t b) { return {V256::less(a.lo, b), V256::less(a.hi, b)}; }
  static F number(I a) { return {V256::number(a.lo), V256::number(a.hi)}; }
  static F fzero() { return {V256::fzero(), V256::fzero()}; }
  static F set(float v) { return {V256::set(v), V256::set(v)}; }
  static F mul(F a, F b) { return {V256::mul(a.lo, b.lo), V256::mul(a.hi, b.hi)}; }
  static F add(F a, F b) { return {V256::add(a.lo, b.lo), V256::add(a.hi, b.hi)}; }
  static void store(float* p, F v) { V256::store(p, v.lo), V256::store(p + 8, v.hi); }
#if defined(SPECSERVE_VNNI)
  static I dpbusd(I acc, I u, I s) { return {V256::dpbusd(acc.lo, u.lo, s.lo), V256::dpbusd(acc.hi, u.hi, s.hi)}; }
#endif
};
#endif

// Row r's activations, quantised: codes [rows, k], and per block d, d * sum(codes) and sum(codes).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
};

// Eight floats at a time (AVX2; every build has it), each operation the scalar one's: the block's
// max|x| (a NaN dropped, as fmaxf drops it: max_ps returns its second operand then), x / scale
// (IEEE division), clamped to +-127 (a NaN to -127, as fmaxf gives), rounded half to even
// (nearbyintf in the default rounding mode); the codes' sum is exact.
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s, int32_t* sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xg + 8 * i);
      top = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), top);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    float most = 0.0f;
    for (int i = 0; i < 8; ++i) most = fmaxf(most, lanes[i]);
    const float scale = most / 127.0f;
    int32_t total = 0;
    if (scale != 0.0f) {
      const __m256 divisor = _mm256_set1_ps(scale), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
      __m256i codes[4], sums = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256 ratio = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[i], divisor), low), high);
        codes[i] = _mm256_cvtps_epi32(_mm256_round_ps(ratio, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        sums = _mm256_add_epi32(sums, codes[i]);
      }
      // int32 to int8 (within +-127: no saturation), back in order across the 128-bit lanes
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                               _mm256_packs_epi32(codes[2], codes[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sums);
      for (int i = 0; i < 8; ++i) total += parts[i];
    } else {
      for (int i = 0; i < kGroup; ++i) q[g * kGroup + i] = 0;
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

enum Kind { kInt4, kInt8Channel, kInt8Group };  // as q8_amx.h's

// Whether V multiplies bytes by VNNI's dot product (else maddubs and madd).
template <typename V>
constexpr bool vnni() {
#if defined(SPECSERVE_VNNI)
#if defined(SPECSERVE_V512) && !defined(SPECSERVE_EMULATE_AVX512)
  if constexpr (V::kTiles == 2) {
#if defined(__AVX512VNNI__)
    return true;
#else
    return false;
#endif
  }
#endif
  return true;
#else
  return false;
#endif
}

// R rows (codes xq [R, k], block scales xd and xs and code sums [R, groups]) against V::kTiles
// tiles of 8 channels (the next tile `next` bytes on, its block scales `next_scales` floats on):
// acc[r] lane c is y[r, c] of the tiles' channels, before an int8 channel scale.
template <typename V, int R, Kind kKind>
void tile(const uint8_t* w, int64_t next, const float* block_scales, int64_t next_scales, int64_t k,
          const int8_t* xq, const float* xd, const float* xs, const int32_t* xsum, typename V::F* acc) {
  using I = typename V::I;
  const int64_t groups = k / kGroup;
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  for (int64_t g = 0; g < groups; ++g) {
    I dot[R];
    for (int r = 0; r < R; ++r) dot[r] = V::zero();
    if constexpr (kKind == kInt4) {
      // code vector j's bytes: four inputs 8j..8j+3 of each channel low, 8j+4..8j+7 high
      const uint8_t* block = w + g * kInt4Record;
      if constexpr (vnni<V>()) {
        for (int j = 0; j < 4; ++j) {
          const I v = V::codes(block + 32 * j, next), low = V::nibble(v, 0), high = V::nibble(v, 1);
          for (int r = 0; r < R; ++r) {
            const int8_t* x = xq + r * k + g * kGroup + 8 * j;
            dot[r] = V::dpbusd(V::dpbusd(dot[r], low, V::broadcast4(x)), high, V::broadcast4(x + 4));
          }
        }
      } else {
        // 16-bit sums of two products of at most 15 * 127, eight of them: at most 30,480, exact
        I sums[R];
        for (int r = 0; r < R; ++r) sums[r] = V::zero();
        for (int j = 0; j < 4; ++j) {
          const I v = V::codes(block + 32 * j, next), low = V::nibble(v, 0), high = V::nibble(v, 1);
          for (int r = 0; r < R; ++r) {
            const int8_t* x = xq + r * k + g * kGroup + 8 * j;
            sums[r] = V::add16(sums[r], V::add16(V::maddubs(low, V::broadcast4(x)), V::maddubs(high, V::broadcast4(x + 4))));
          }
        }
        for (int r = 0; r < R; ++r) dot[r] = V::pairs(sums[r]);
      }
      const auto d = V::floats(reinterpret_cast<const float*>(block + kGroup * kLanes / 2), next / 4);
      const auto m = V::floats(reinterpret_cast<const float*>(block + kGroup * kLanes / 2 + 4 * kLanes), next / 4);
      for (int r = 0; r < R; ++r) {
        const auto scale = V::mul(d, V::set(xd[r * groups + g]));
        acc[r] = V::add(acc[r], V::mul(V::number(dot[r]), scale));
        acc[r] = V::add(acc[r], V::mul(m, V::set(xs[r * groups + g])));
      }
    } else {
      // code vector j's bytes: inputs 4j..4j+3 of each channel, signed
      const uint8_t* block = w + g * kInt8Record;
      for (int j = 0; j < 8; ++j) {
        const I v = V::codes(block + 32 * j, next);
        if constexpr (vnni<V>()) {  // (q + 128) x, less 128 * sum(x) below
          const I shifted = V::offset(v);
          for (int r = 0; r < R; ++r) dot[r] = V::dpbusd(dot[r], shifted, V::broadcast4(xq + r * k + g * kGroup + 4 * j));
        } else {  // |q| times x with q's sign: 16-bit sums of two products of at most 128 * 127, exact
          const I magnitude = V::magnitude(v);
          for (int r = 0; r < R; ++r) {
            const I x = V::signed_as(V::broadcast4(xq + r * k + g * kGroup + 4 * j), v);
            dot[r] = V::add32(dot[r], V::pairs(V::maddubs(magnitude, x)));
          }
        }
      }
      if constexpr (vnni<V>())
        for (int r = 0; r < R; ++r) dot[r] = V::less(dot[r], 128 * xsum[r * groups + g]);
      for (int r = 0; r < R; ++r) {
        const auto x_scale = V::set(xd[r * groups + g]);
        if constexpr (kKind == kInt8Group) {
          const auto scale = V::mul(V::floats(block_scales + g * kLanes, next_scales), x_scale);
          acc[r] = V::add(acc[r], V::mul(V::number(dot[r]), scale));
        } else {
          acc[r] = V::add(acc[r], V::mul(V::number(dot[r]), x_scale));
        }
      }
    }
  }
}

// Tiles t..t + V::kTiles - 1 against every row, in groups of up to kRowGroup rows as even as can
// be (17: 4, 4, 3, 3, 3), into y.
template <typename V, Kind kKind>
void tiles(int64_t t, const Q8Rows& a, int64_t rows, int64_t k, const uint8_t* w, const float* scales, int64_t out,
           float* y) {
  const int64_t groups = k / kGroup, record = kKind == kInt4 ? kInt4Record : kInt8Record;
  const int64_t next = groups * record, next_scales = groups * kLanes;
  const uint8_t* wt = w + t * next;
  const float* st = kKind == kInt8Group ? scales + t * next_scales : nullptr;
  const int64_t n = t * kLanes, width = V::kTiles * kLanes, valid = out - n < width ? out - n : width;
  const int64_t row_groups = (rows + kRowGroup - 1) / kRowGroup, small = rows / row_groups, large = rows % row_groups;
  for (int64_t part = 0, r = 0, count = 0; part < row_groups; ++part, r += count) {
    count = small + (part < large);
    const int8_t* xq = a.q.data() + r * k;
    const float *xd = a.d.data() + r * groups, *xs = a.s.data() + r * groups;
    const int32_t* xsum = a.sum.data() + r * groups;
    typename V::F acc[kRowGroup];
    switch (count) {
      case 4: tile<V, 4, kKind>(wt, next, st, next_scales, k, xq, xd, xs, xsum, acc); break;
      case 3: tile<V, 3, kKind>(wt, next, st, next_scales, k, xq, xd, xs, xsum, acc); break;
      case 2: tile<V, 2, kKind>(wt, next, st, next_scales, k, xq, xd, xs, xsum, acc); break;
      default: tile<V, 1, kKind>(wt, next, st, next_scales, k, xq, xd, xs, xsum, acc); break;
    }
    for (int64_t i = 0; i < count; ++i) {
      auto v = acc[i];
      if constexpr (kKind == kInt8Channel) v = V::mul(v, V::floats(scales + n, kLanes));
      float lanes[V::kTiles * kLanes];
      V::store(lanes, v);
      for (int64_t c = 0; c < valid; ++c) y[(r + i) * out + n + c] = lanes[c];
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
  const int64_t count = (out + kLanes - 1) / kLanes;
#if defined(SPECSERVE_AMX)  // the tile pairs on AMX where it runs (q8_amx.cpp), the last odd tile here
  if (amx::linear(static_cast<amx::Kind>(kKind), a.q.data(), a.d.data(), a.s.data(), rows, k, w, scales, out,
                     count / 2, y)) {
    if (count % 2) tiles<V256, kKind>(count - 1, a, rows, k, w, scales, out, y);
    return;
  }
#endif
#if defined(SPECSERVE_V512)
  const int64_t pairs = count / 2;  // two tiles at once, then the last odd one alone
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < pairs + count % 2; ++i) {
    if (i < pairs) tiles<V512, kKind>(2 * i, a, rows, k, w, scales, out, y);
    else tiles<V256, kKind>(count - 1, a, rows, k, w, scales, out, y);
  }
#else
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < count; ++t) tiles<V256, kKind>(t, a, rows, k, w, scales, out, y);
#endif
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

// Whether passes of at least `q8_amx_min_rows` rows take AMX's tile multiply (q8_amx.cpp):
// built with it, and Linux lent this process the tile state.
int q8_amx() {
#if defined(SPECSERVE_AMX)
  return amx::ready();
#else
  return 0;
#endif
}

// Passes of at least `rows` rows take AMX where it runs (0: none, VNNI's products for all);
// returns `q8_amx()`.
int q8_amx_min_rows(int rows) {
#if defined(SPECSERVE_AMX)
  return amx::set_min_rows(rows);
#else
  return 0 * rows;
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

// 8-lane float32 vectors for the C++ CPU kernels (AVX2 + FMA + F16C): loads that widen bf16 and
// fp16, stores that round to them, horizontal sums, and a vector exp. BATCHPAGE_AVX2 is defined
// where they exist; kernels keep a plain-loop path for other CPUs. With AVX-512F, 16-lane loads,
// a transposing sum and the same exp (BATCHPAGE_AVX512). Also the packed linears' work split.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

// The packed linears' work over torch's threads: run(row0, rows, block) for each column block
// and group of rows. Column blocks alone feed every thread when there are several per thread;
// with fewer, the rows are split too, into groups of whole 8-row tiles, so that each thread
// gets some 4 items.
template <typename Run>
inline void for_blocks_and_row_groups(int64_t m, int64_t blocks, const Run& run) {
  const int64_t tiles = (m + 7) / 8, want = 4 * at::get_num_threads();
  const int64_t groups = blocks >= want ? 1 : std::min(tiles, (want + blocks - 1) / blocks);
  const int64_t group_rows = (tiles + groups - 1) / groups * 8;
  at::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row0 = item / blocks * group_rows;
      if (row0 < m) run(row0, std::min(group_rows, m - row0), item % blocks);
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BATCHPAGE_AVX2 1
#include <immintrin.h>

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {
  // bf16 is the top half of a float32: widen to 32 bits and shift into place.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
static inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// float32 -> bf16, rounded to nearest even as c10::BFloat16 rounds (a NaN becomes 0x7FC0): the
// 32-bit patterns of the rounded values, in the low 16 bits of each lane.
static inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}
static inline void store8(c10::BFloat16* p, __m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh(v));
#else
  const __m256i r = bf16_bits8(v);  // each lane < 2^16, so packus (saturating) is exact
  const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
#endif
}
static inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// float32 -> T -> float32: the rounding a torch op in dtype T applies to its result.
template <typename T>
static inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    const __m256i r = _mm256_cvtepu16_epi32((__m128i)_mm256_cvtneps_pbh(v));
#else
    const __m256i r = bf16_bits8(v);
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
  }
  else if constexpr (std::is_same_v<T, c10::Half>)
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  else
    return v;
}

// a[0..7], each 8 partial sums of one dot product -> [sum(a[0]), ..., sum(a[7])].
static inline __m256 sum8(const __m256* a) {
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]: two rounds leave
  // each 128-bit lane holding four quarter sums of four dot products; adding the lanes ends it.
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x to about 1 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
// times 2^n built in the exponent bits). x is clamped to [-87, 88] so 2^n stays a normal float:
// below -87 the result is ~1e-38 instead of 0, nothing next to a softmax's largest weight of 1.
// NaN passes through: min/max return their second operand when either is NaN.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), _mm256_min_ps(_mm256_set1_ps(88.f), x));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 in two parts, so that n * ln2_hi is exact and r keeps its low bits
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256i e = _mm256_slli_epi32(biased, 23);  // 2^n: the exponent field alone
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#endif  // BATCHPAGE_AVX2

// 16-lane float32 vectors (AVX-512F): the same widening loads, and a transposing sum.
#if defined(BATCHPAGE_AVX2) && defined(__AVX512F__)
#define BATCHPAGE_AVX512 1

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// a[0..15], each 16 partial sums of one dot product -> [sum(a[0]), ..., sum(a[15])], in three
// rounds that halve the partial sums (46 shuffles and adds, against 16 separate reductions of
// about 8 each). Lanes are named by 128-bit quarter: a.0 .. a.3.
static inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  // b[i] = [a_i.0 + a_i.2, a_i.1 + a_i.3, a_{i+8}.0 + a_{i+8}.2, a_{i+8}.1 + a_{i+8}.3]
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44),
                         _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  // c[i]'s quarters: four partial sums each of a_i, a_{i+8}, a_{i+4}, a_{i+12}
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88),
                         _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  // within each quarter, [c0, c1, c2, c3]'s four sums: quarters hold tokens 0-3, 8-11, 4-7,
  // 12-15
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_shuffle_f32x4(r, r, 0xD8);  // quarters 0, 2, 1, 3: tokens in order
}

// exp8 in 16 lanes: the same polynomial, clamp and NaN behaviour.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), _mm512_min_ps(_mm512_set1_ps(88.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23)));
}

#endif  // BATCHPAGE_AVX512

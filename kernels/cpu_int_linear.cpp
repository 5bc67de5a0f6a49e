// y = x @ W.T (+ b) with x bfloat16 and W an integer weight (W4A16, W8A16): W[n, k] =
// s[n, g] * q[n, k] + o[n, g], g = k / group_size. Built and launched by cpu_int_linear.py, which
// repacks batchpage.quant's IntWeight into the layout below and says why.
//
// The integers become bf16 without a conversion: the bf16 with bits 0x4300 | q is 128 + q
// exactly for 0 <= q < 128 (exponent 2^7, q in the 7 mantissa bits), so vdpbf16ps of such pairs
// against pairs of x sums (q + 128) * x in float32. Per group, acc_g = sum (q + C) * x, and
//     y += s * acc_g + (o - C * s) * xsum_g,    xsum_g = the sum of the row's x over the group,
// two FMAs per group and column; cpu_int_linear.py stores o' = o - C * s. C, by kind:
//   4: 4-bit q, C = 128, one vdpbf16ps per pair.
//   7: q < 128 in bytes (5- to 7-bit), C = 128, the same.
//   8: 8-bit q in bytes: q = lo7 + 128 * b7, where (w & 0x7F) | 0x4300 is 128 + lo7 and
//      (w & 0x80) | 0x4300 is 128 or 256 (bit 7 is the exponent's lowest bit): two vdpbf16ps
//      into one accumulator give (q + 256) * x, C = 256. (Two nibble planes, 0x4300 | lo and
//      0x4500 | hi, would take the same two vdpbf16ps and a shift more; converting q through
//      float32 takes one vdpbf16ps but four conversions, slower for few rows.)
//   9: FP8 e4m3 codes in bytes (W = s * fp8(q), o = 0), C = 0. A code is not an integer: in the
//      vdpbf16ps tiles it becomes the float16 with bits (q & 0x80) << 8 | (q & 0x7F) << 7,
//      exactly fp8(q) / 256 subnormals included, widened by vcvtph2ps and rounded to bf16
//      (exact: four significant bits), the 256 folded into the group's scale (a 128-entry
//      table through two vpermi2w measured slower on Zen 4); in the float32 tiles, the float32
//      with bits (q & 0x80) << 24 | (q & 0x7F) << 20 (fp8(q) * 2^-120, a denormal for small
//      codes) times 2^120, exact. The NaN code is read as 480.
//
// Layout, uint8 [NB][KQ][B] with NB = ceil(N / 32), KQ = ceil(K / 4) k-quads of one 32-column
// block, B = 64 (kind 4) or 128 bytes (kinds 7, 8, 9). In one quad t, for pair p (k = 4t + 2p, 4t + 2p + 1),
// half h (columns 16h .. 16h + 15) and lane l < 32, column 16h + l / 2 and k = 4t + 2p + l % 2:
//   kind 4: byte 32h + l, pair 0 in the low nibble, pair 1 in the high;
//   kind 7, 8, 9: byte 64p + 32h + l.
// So _mm512_cvtepu8_epi16 of 32 bytes puts (k even, k odd) of 16 columns in the 16-bit halves
// of 16 lanes: one vdpbf16ps operand against one 32-bit broadcast of x. Zero past N and K (x
// is read as zero past K, so a padded q's 128 * x is 0). Scales and offsets: [NB][G][32], float32
// (the offsets o - C * s), or float16 where every s and o is exact in it (a GGUF file's are),
// which halves their share of the bytes a step reads; then the offsets are o itself (o - C * s
// seldom is exact in float16) and the kernel takes C * s off once per group and column, in
// float32, the same value as the float32 layout's (C * s is exact).
// A group is `group_quads` quads (group_size / 4, or all KQ for one group).
//
// Work as in cpu_bf16_linear.cpp: column blocks split over torch's threads, rows too where
// blocks are few; MR-row tiles against one block. The sum is rounded once to y's dtype.
//
// x and y are bf16 (a bf16 engine) or float32 (a float32 engine, which keeps its weights packed
// too). bf16 x on AVX512-BF16: the vdpbf16ps tiles above. Otherwise the "wide" tiles: with AVX2
// + FMA the same sums in float32 (the 0x4300 | q pairs are float32 128 + q once shifted into the
// top half), 8 columns per FMA, x read widened to float32 (`xf`); without AVX2 a plain loop over
// the same layout. float32 x always takes the wide tiles (vdpbf16ps would round it to bf16).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(BATCHPAGE_AVX512)
#define BATCHPAGE_BF16_DOT 1
#endif

namespace {

constexpr int64_t kCols = 32;  // columns per packed block

struct Problem {
  const uint16_t* x;     // bf16 bits [M, K], rows `x_stride` apart (the vdpbf16ps tiles)
  int64_t x_stride;
  const uint8_t* q;      // packed [NB][KQ][bytes]
  const void* scales;    // [NB][G][32], float32, or float16 where `half_params`
  const void* offsets;   // [NB][G][32]: float32 o - C * s, or float16 o where `half_params`
  bool half_params;
  const float* xsum;     // [M][G]: each row's x summed over each group, float32
  const float* xf;       // the wide tiles: [M][4 * KQ], x as float32, zero past K
  const float* bias;     // [N] or nullptr
  void* y;               // [M, N], bf16 bits or float32 (y_f32), rows `y_stride` apart
  bool y_f32;
  int64_t y_stride;
  int64_t m, n, k;
  int64_t groups, group_quads;
};

inline int64_t quad_bytes(int kind) { return kind == 4 ? 64 : 128; }

template <int KIND>
constexpr float kAdded = KIND == 8 ? 256.f : KIND == 9 ? 0.f : 128.f;  // C

// Scale and offset (o - C * s) of column `c` of group `g` of `block`, in float32.
template <int KIND>
inline void group_param(const Problem& pr, int64_t block, int64_t g, int64_t c, float& s,
                        float& o) {
  const int64_t i = (block * pr.groups + g) * kCols + c;
  if (!pr.half_params) {
    s = static_cast<const float*>(pr.scales)[i];
    o = static_cast<const float*>(pr.offsets)[i];
    return;
  }
  const auto widen16 = [](const void* base, int64_t at) {
    const uint16_t bits = static_cast<const uint16_t*>(base)[at];
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  };
  s = widen16(pr.scales, i);
  o = std::fma(-kAdded<KIND>, s, widen16(pr.offsets, i));
}

inline float widen(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t round_bf16(float f) {
  return c10::BFloat16(f).x;  // nearest even, NaN kept
}

inline float as_float(uint16_t bits) { return widen(bits); }
inline float as_float(float f) { return f; }

// An FP8 e4m3 code's value (kind 9): its bits placed in a float32's sign, exponent and top
// mantissa bits give fp8 * 2^-120 (denormal below 2^-6), and the product with 2^120 is exact.
constexpr float kFp8Rebias = 1.329227995784916e36f;  // 2^120
inline float fp8_value(uint32_t q) {
  const uint32_t bits = (q & 0x80u) << 24 | (q & 0x7Fu) << 20;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f * kFp8Rebias;
}

// y[r, c] = v, rounded once to y's dtype.
inline void store(const Problem& pr, int64_t r, int64_t c, float v) {
  if (pr.y_f32)
    static_cast<float*>(pr.y)[r * pr.y_stride + c] = v;
  else
    static_cast<uint16_t*>(pr.y)[r * pr.y_stride + c] = round_bf16(v);
}

// Each row's x summed over each group in float32, k in order: the same for a row whatever the
// batch, so a row's result does not depend on M. With `xf`, x as float32 too, [M][4 KQ].
template <typename T>
void prepare_rows(const Problem& pr, const T* x, int64_t x_stride, float* xsum, float* xf) {
  const int64_t group = pr.group_quads * 4, width = (pr.k + 3) / 4 * 4;
  at::parallel_for(0, pr.m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * x_stride;
      for (int64_t g = 0; g < pr.groups; ++g) {
        float s = 0.f;
        for (int64_t k = g * group; k < std::min(pr.k, (g + 1) * group); ++k) {
          s += as_float(row[k]);
        }
        xsum[r * pr.groups + g] = s;
      }
      if (xf != nullptr)
        for (int64_t k = 0; k < width; ++k) xf[r * width + k] = k < pr.k ? as_float(row[k]) : 0.f;
    }
  });
}

#if defined(BATCHPAGE_AVX512)
// 16 columns' scales and offsets (o - C * s) from column `c` of group `g` of `block`.
template <int KIND>
inline void group_params16(const Problem& pr, int64_t block, int64_t g, int64_t c, __m512& s,
                           __m512& o) {
  const int64_t i = (block * pr.groups + g) * kCols + c;
  if (!pr.half_params) {
    s = _mm512_loadu_ps(static_cast<const float*>(pr.scales) + i);
    o = _mm512_loadu_ps(static_cast<const float*>(pr.offsets) + i);
    return;
  }
  const auto widen16 = [i](const void* base) {
    const uint16_t* at = static_cast<const uint16_t*>(base) + i;
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  };
  s = widen16(pr.scales);
  o = _mm512_fnmadd_ps(_mm512_set1_ps(kAdded<KIND>), s, widen16(pr.offsets));
}
#endif

#ifdef BATCHPAGE_BF16_DOT
// The two (or, kind 8, four) vdpbf16ps operands of one quad's half h: pair 0's into w[0] (and
// w[2]), pair 1's into w[1] (and w[3]).
template <int KIND>
inline void unpack(const uint8_t* quad, int h, __m512i* w) {
  const __m512i bf = _mm512_set1_epi16(0x4300);
  if constexpr (KIND == 4) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(quad + 32 * h)));
    w[0] = _mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x000F), bf, 0xEA);  // (v & F) | bf
    w[1] = _mm512_or_si512(_mm512_srli_epi16(v, 4), bf);
  } else {
    for (int p = 0; p < 2; ++p) {
      const __m512i v =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(quad + 64 * p + 32 * h)));
      if constexpr (KIND == 9) {  // float16 fp8 / 256, widened, then bf16 in the same lanes
        const __m512i half = _mm512_or_si512(
            _mm512_and_si512(_mm512_slli_epi16(v, 8), _mm512_set1_epi16(int16_t(0x8000))),
            _mm512_and_si512(_mm512_slli_epi16(v, 7), _mm512_set1_epi16(0x3F80)));
        const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
        const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
        w[p] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      } else if constexpr (KIND == 7) {
        w[p] = _mm512_or_si512(v, bf);
      } else {
        w[p] = _mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x007F), bf, 0xEA);
        w[2 + p] = _mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x0080), bf, 0xEA);
      }
    }
  }
}

// MR rows of bf16 x against one 32-column block, the whole K, into bf16 y.
template <int KIND, int MR>
void tile_dot(const Problem& pr, int64_t row0, int64_t block) {
  constexpr int kOps = KIND == 8 ? 4 : 2;  // operands per half and quad
  const int64_t kq = (pr.k + 3) / 4, full = pr.k / 4, bytes = quad_bytes(KIND);
  const uint8_t* wb = pr.q + block * kq * bytes;
  const uint16_t* rows[MR];
  uint16_t last[MR][4] = {};
  for (int i = 0; i < MR; ++i) {
    rows[i] = pr.x + (row0 + i) * pr.x_stride;
    for (int64_t k = 4 * full; k < pr.k; ++k) last[i][k - 4 * full] = rows[i][k];
  }
  __m512 total[MR][2];
  for (int i = 0; i < MR; ++i) total[i][0] = total[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pr.groups; ++g) {
    const int64_t t0 = g * pr.group_quads, t1 = std::min(kq, t0 + pr.group_quads);
    // Pair 0 and pair 1 of each quad into separate accumulators, summed per group: chains of
    // dependent vdpbf16ps short enough to keep the unit busy with one row. Every tile size sums
    // alike, so that a row's result does not depend on M.
    __m512 acc[MR][2][2];
    for (int i = 0; i < MR; ++i)
      for (int h = 0; h < 2; ++h) acc[i][h][0] = acc[i][h][1] = _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      // x[4t .. 4t + 3] of each row: in place, or for the last quad of a K that is not a
      // multiple of 4 from `last`, zero past K, so that nothing past a row is read (the next
      // row's Inf or NaN times a padded q's 128 would be NaN)
      const uint16_t* xq[MR];
      for (int i = 0; i < MR; ++i) xq[i] = t < full ? rows[i] + 4 * t : last[i];
      // unrolled outright, so that the accumulators are registers, not an array in memory
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512i w[kOps];
        unpack<KIND>(wb + t * bytes, h, w);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 2
          for (int p = 0; p < 2; ++p) {
            uint32_t v;  // a 32-bit load the compiler folds into vdpbf16ps's broadcast
            std::memcpy(&v, xq[i] + 2 * p, sizeof(v));
            const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
            __m512& c = acc[i][h][p];
            c = _mm512_dpbf16_ps(c, a, (__m512bh)w[p]);
            if constexpr (KIND == 8) c = _mm512_dpbf16_ps(c, a, (__m512bh)w[2 + p]);
          }
        }
      }
    }
    // kind 9's operands are fp8 / 256
    const __m512 up = _mm512_set1_ps(KIND == 9 ? 256.f : 1.f);
    __m512 s[2], o[2];
    for (int h = 0; h < 2; ++h) {
      group_params16<KIND>(pr, block, g, 16 * h, s[h], o[h]);
      s[h] = _mm512_mul_ps(up, s[h]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 xs = _mm512_set1_ps(pr.xsum[(row0 + i) * pr.groups + g]);
      for (int h = 0; h < 2; ++h) {
        const __m512 sum = _mm512_add_ps(acc[i][h][0], acc[i][h][1]);
        total[i][h] = _mm512_fmadd_ps(o[h], xs, _mm512_fmadd_ps(s[h], sum, total[i][h]));
      }
    }
  }
  const int64_t col0 = block * kCols, cols = std::min<int64_t>(kCols, pr.n - col0);
  const __mmask32 keep = cols == kCols ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (pr.bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep), pr.bias + col0);
    b1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep >> 16), pr.bias + col0 + 16);
  }
  for (int i = 0; i < MR; ++i) {
    // cvtne2ps: the second operand fills the low 16 lanes; rounds to nearest even.
    const __m512bh out =
        _mm512_cvtne2ps_pbh(_mm512_add_ps(total[i][1], b1), _mm512_add_ps(total[i][0], b0));
    uint16_t* y = static_cast<uint16_t*>(pr.y) + (row0 + i) * pr.y_stride + col0;
    _mm512_mask_storeu_epi16(y, keep, (__m512i)out);
  }
}

// MR: 4 * MR accumulators, 2 * MR running totals, the operands and two constants of 32 zmm.
#ifndef BATCHPAGE_INT_ROWS
#define BATCHPAGE_INT_ROWS 4
#endif
constexpr int kDotRows = BATCHPAGE_INT_ROWS;
const char* const kPath = "avx512_bf16";
#endif  // BATCHPAGE_BF16_DOT

#if defined(BATCHPAGE_AVX512)
// AVX-512F: pair p of one quad's half h (columns 16h .. 16h + 15) as 32-bit lanes holding the
// 0x4300 | q pairs of (k even, k odd), as float32: w[0] (k even) = lane << 16, w[1] (k odd) =
// lane & 0xFFFF0000; kind 8 adds the bit-7 terms in w[2], w[3]. The AVX2 tiles' sums, 16
// columns an FMA.
template <int KIND>
inline void unpack16(const uint8_t* quad, int h, int p, __m512* w) {
  const __m512i bf = _mm512_set1_epi16(0x4300), high = _mm512_set1_epi32(int(0xFFFF0000u));
  auto split = [&](__m512i v, __m512* out) {
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    out[1] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
  };
  const int64_t at = (KIND == 4 ? 0 : 64 * p) + 32 * h;
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(quad + at)));
  if constexpr (KIND == 9) {  // the even code in bits 0-7 of a lane, the odd one in 16-23
    const __m512i sign = _mm512_set1_epi32(int(0x80000000u)), mag = _mm512_set1_epi32(0x07F00000);
    const __m512 up = _mm512_set1_ps(kFp8Rebias);
    auto value = [&](__m512i s_bits, __m512i m_bits) {
      const __m512i bits =
          _mm512_or_si512(_mm512_and_si512(s_bits, sign), _mm512_and_si512(m_bits, mag));
      return _mm512_mul_ps(up, _mm512_castsi512_ps(bits));
    };
    w[0] = value(_mm512_slli_epi32(v, 24), _mm512_slli_epi32(v, 20));
    w[1] = value(_mm512_slli_epi32(v, 8), _mm512_slli_epi32(v, 4));
  } else if constexpr (KIND == 4) {
    const __m512i nibble = p == 0 ? _mm512_and_si512(v, _mm512_set1_epi16(0x000F))
                                  : _mm512_srli_epi16(v, 4);
    split(_mm512_or_si512(nibble, bf), w);
  } else if constexpr (KIND == 7) {
    split(_mm512_or_si512(v, bf), w);
  } else {
    split(_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0x007F)), bf), w);
    split(_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0x0080)), bf), w + 2);
  }
}

// MR rows against one block, from x as float32 (`xf`, zero past K): per quad and half, the two
// pairs' FMAs into one accumulator a row and half; the running totals stay in registers.
template <int KIND, int MR>
void tile_wide(const Problem& pr, int64_t row0, int64_t block) {
  const int64_t kq = (pr.k + 3) / 4, bytes = quad_bytes(KIND);
  const uint8_t* wb = pr.q + block * kq * bytes;
  const float* rows[MR];
  for (int i = 0; i < MR; ++i) rows[i] = pr.xf + (row0 + i) * 4 * kq;
  __m512 total[MR][2];
  for (int i = 0; i < MR; ++i) total[i][0] = total[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pr.groups; ++g) {
    const int64_t t0 = g * pr.group_quads, t1 = std::min(kq, t0 + pr.group_quads);
    __m512 acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p) {
          __m512 w[KIND == 8 ? 4 : 2];
          unpack16<KIND>(wb + t * bytes, h, p, w);
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const __m512 lo = _mm512_set1_ps(rows[i][4 * t + 2 * p]);
            const __m512 hi = _mm512_set1_ps(rows[i][4 * t + 2 * p + 1]);
            acc[i][h] = _mm512_fmadd_ps(lo, w[0], acc[i][h]);
            acc[i][h] = _mm512_fmadd_ps(hi, w[1], acc[i][h]);
            if constexpr (KIND == 8) {
              acc[i][h] = _mm512_fmadd_ps(lo, w[2], acc[i][h]);
              acc[i][h] = _mm512_fmadd_ps(hi, w[3], acc[i][h]);
            }
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m512 s, o;
      group_params16<KIND>(pr, block, g, 16 * h, s, o);
      for (int i = 0; i < MR; ++i) {
        const __m512 xs = _mm512_set1_ps(pr.xsum[(row0 + i) * pr.groups + g]);
        total[i][h] = _mm512_fmadd_ps(o, xs, _mm512_fmadd_ps(s, acc[i][h], total[i][h]));
      }
    }
  }
  const int64_t col0 = block * kCols, cols = std::min<int64_t>(kCols, pr.n - col0);
  for (int i = 0; i < MR; ++i) {
    alignas(64) float out[kCols];
    _mm512_store_ps(out, total[i][0]);
    _mm512_store_ps(out + 16, total[i][1]);
    for (int64_t c = 0; c < cols; ++c) {
      const float b = pr.bias == nullptr ? 0.f : pr.bias[col0 + c];
      store(pr, row0 + i, col0 + c, out[c] + b);
    }
  }
}

constexpr int kWideRows = 4;
const char* const kWidePath = "avx512";

#elif defined(BATCHPAGE_AVX2)
// AVX2 + FMA: pair p of one quad's half h, columns 8c .. 8c + 7 (c < 2), as 32-bit lanes holding
// the 0x4300 | q pairs of (k even, k odd), as float32: w[0] (k even) = lane << 16, w[1] (k odd)
// = lane & 0xFFFF0000; kind 8 adds the bit-7 terms in w[2], w[3].
template <int KIND>
inline void unpack8(const uint8_t* quad, int h, int c, int p, __m256* w) {
  const __m256i bf = _mm256_set1_epi16(0x4300), high = _mm256_set1_epi32(int(0xFFFF0000u));
  auto split = [&](__m256i v, __m256* out) {
    out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    out[1] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
  };
  const int64_t at = (KIND == 4 ? 0 : 64 * p) + 32 * h + 16 * c;
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(quad + at)));
  if constexpr (KIND == 9) {  // the even code in bits 0-7 of a lane, the odd one in 16-23
    const __m256i sign = _mm256_set1_epi32(int(0x80000000u)), mag = _mm256_set1_epi32(0x07F00000);
    const __m256 up = _mm256_set1_ps(kFp8Rebias);
    auto value = [&](__m256i s_bits, __m256i m_bits) {
      const __m256i bits =
          _mm256_or_si256(_mm256_and_si256(s_bits, sign), _mm256_and_si256(m_bits, mag));
      return _mm256_mul_ps(up, _mm256_castsi256_ps(bits));
    };
    w[0] = value(_mm256_slli_epi32(v, 24), _mm256_slli_epi32(v, 20));
    w[1] = value(_mm256_slli_epi32(v, 8), _mm256_slli_epi32(v, 4));
  } else if constexpr (KIND == 4) {
    const __m256i nibble = p == 0 ? _mm256_and_si256(v, _mm256_set1_epi16(0x000F))
                                  : _mm256_srli_epi16(v, 4);
    split(_mm256_or_si256(nibble, bf), w);
  } else if constexpr (KIND == 7) {
    split(_mm256_or_si256(v, bf), w);
  } else {
    split(_mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x007F)), bf), w);
    split(_mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x0080)), bf), w + 2);
  }
}

// 8 columns' scales and offsets (o - C * s) from column `c` of group `g` of `block`.
template <int KIND>
inline void group_params8(const Problem& pr, int64_t block, int64_t g, int64_t c, __m256& s,
                          __m256& o) {
  const int64_t i = (block * pr.groups + g) * kCols + c;
  if (!pr.half_params) {
    s = _mm256_loadu_ps(static_cast<const float*>(pr.scales) + i);
    o = _mm256_loadu_ps(static_cast<const float*>(pr.offsets) + i);
    return;
  }
  const auto widen16 = [i](const void* base) {
    const uint16_t* at = static_cast<const uint16_t*>(base) + i;
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  };
  s = widen16(pr.scales);
  o = _mm256_fnmadd_ps(_mm256_set1_ps(kAdded<KIND>), s, widen16(pr.offsets));
}

// MR rows against one block, from x as float32 (`xf`, zero past K): per quad, four 8-column
// slices, MR * 4 accumulators of 16 ymm; the running totals live in memory, touched once per
// group.
template <int KIND, int MR>
void tile_wide(const Problem& pr, int64_t row0, int64_t block) {
  const int64_t kq = (pr.k + 3) / 4, bytes = quad_bytes(KIND);
  const uint8_t* wb = pr.q + block * kq * bytes;
  const float* rows[MR];
  for (int i = 0; i < MR; ++i) rows[i] = pr.xf + (row0 + i) * 4 * kq;
  alignas(32) float total[MR][kCols] = {};
  for (int64_t g = 0; g < pr.groups; ++g) {
    const int64_t t0 = g * pr.group_quads, t1 = std::min(kq, t0 + pr.group_quads);
    __m256 acc[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int c8 = 0; c8 < 4; ++c8) acc[i][c8] = _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
#pragma GCC unroll 4
      for (int c8 = 0; c8 < 4; ++c8) {  // 8-column slice: half c8 / 2, within it c8 % 2
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p) {
          __m256 w[KIND == 8 ? 4 : 2];
          unpack8<KIND>(wb + t * bytes, c8 / 2, c8 % 2, p, w);
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const __m256 lo = _mm256_broadcast_ss(rows[i] + 4 * t + 2 * p);
            const __m256 hi = _mm256_broadcast_ss(rows[i] + 4 * t + 2 * p + 1);
            acc[i][c8] = _mm256_fmadd_ps(lo, w[0], acc[i][c8]);
            acc[i][c8] = _mm256_fmadd_ps(hi, w[1], acc[i][c8]);
            if constexpr (KIND == 8) {
              acc[i][c8] = _mm256_fmadd_ps(lo, w[2], acc[i][c8]);
              acc[i][c8] = _mm256_fmadd_ps(hi, w[3], acc[i][c8]);
            }
          }
        }
      }
    }
    for (int c8 = 0; c8 < 4; ++c8) {
      __m256 s, o;
      group_params8<KIND>(pr, block, g, 8 * c8, s, o);
      for (int i = 0; i < MR; ++i) {
        const __m256 xs = _mm256_set1_ps(pr.xsum[(row0 + i) * pr.groups + g]);
        float* tp = total[i] + 8 * c8;
        const __m256 sum = _mm256_fmadd_ps(s, acc[i][c8], _mm256_load_ps(tp));
        _mm256_store_ps(tp, _mm256_fmadd_ps(o, xs, sum));
      }
    }
  }
  const int64_t col0 = block * kCols, cols = std::min<int64_t>(kCols, pr.n - col0);
  for (int i = 0; i < MR; ++i)
    for (int64_t c = 0; c < cols; ++c) {
      const float b = pr.bias == nullptr ? 0.f : pr.bias[col0 + c];
      store(pr, row0 + i, col0 + c, total[i][c] + b);
    }
}

constexpr int kWideRows = 2;
const char* const kWidePath = "avx2";

#else
// Without AVX2 (never chosen by the engine; it keeps the packed layout testable on any CPU):
// the same sums in plain float32, one row and column at a time.
template <int KIND>
inline uint32_t stored(const uint8_t* quad, int64_t c, int64_t kk) {  // q of column c, k = 4t + kk
  const int64_t h = c / 16, lane = 2 * (c % 16) + kk % 2, p = kk / 2;
  if constexpr (KIND == 4) return (quad[32 * h + lane] >> (4 * p)) & 0xF;
  return quad[64 * p + 32 * h + lane];
}

template <int KIND>
inline float weight(uint32_t q, float bias) {  // q + C, or kind 9's fp8 value
  if constexpr (KIND == 9) return fp8_value(q);
  return static_cast<float>(q) + bias;
}

template <int KIND, int MR>
void tile_wide(const Problem& pr, int64_t row0, int64_t block) {
  constexpr float kBias = kAdded<KIND>;
  const int64_t kq = (pr.k + 3) / 4, bytes = quad_bytes(KIND), col0 = block * kCols;
  const uint8_t* wb = pr.q + block * kq * bytes;
  for (int i = 0; i < MR; ++i) {
    const int64_t r = row0 + i;
    const float* row = pr.xf + r * kq * 4;
    float total[kCols] = {};
    for (int64_t g = 0; g < pr.groups; ++g) {
      const int64_t t0 = g * pr.group_quads, t1 = std::min(kq, t0 + pr.group_quads);
      float acc[kCols] = {};
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t kk = 0; kk < 4 && 4 * t + kk < pr.k; ++kk) {
          const float x = row[4 * t + kk];
          for (int64_t c = 0; c < kCols; ++c)
            acc[c] += weight<KIND>(stored<KIND>(wb + t * bytes, c, kk), kBias) * x;
        }
      const float xs = pr.xsum[r * pr.groups + g];
      for (int64_t c = 0; c < kCols; ++c) {
        float s, o;
        group_param<KIND>(pr, block, g, c, s, o);
        total[c] = std::fma(o, xs, std::fma(s, acc[c], total[c]));
      }
    }
    for (int64_t c = 0; c < std::min<int64_t>(kCols, pr.n - col0); ++c) {
      const float b = pr.bias == nullptr ? 0.f : pr.bias[col0 + c];
      store(pr, r, col0 + c, total[c] + b);
    }
  }
}

constexpr int kWideRows = 1;
const char* const kWidePath = "plain";
#endif

#ifndef BATCHPAGE_BF16_DOT
const char* const kPath = kWidePath;  // bf16 x takes the wide tiles too
#endif

template <int KIND, int MR, bool DOT>
void tile(const Problem& pr, int64_t row0, int64_t block) {
#ifdef BATCHPAGE_BF16_DOT
  if constexpr (DOT) return tile_dot<KIND, MR>(pr, row0, block);
#endif
  if constexpr (!DOT) tile_wide<KIND, MR>(pr, row0, block);
}

template <int KIND, int MR, bool DOT>
void tail_tiles(const Problem& pr, int64_t r, int64_t block) {
  if constexpr (MR > 0) {
    if (pr.m - r == MR) return tile<KIND, MR, DOT>(pr, r, block);
    tail_tiles<KIND, MR - 1, DOT>(pr, r, block);
  }
}

template <int KIND, bool DOT, int ROWS>
void run_block(const Problem& pr, int64_t block) {
  int64_t r = 0;
  for (; r + ROWS <= pr.m; r += ROWS) tile<KIND, ROWS, DOT>(pr, r, block);
  tail_tiles<KIND, ROWS - 1, DOT>(pr, r, block);
}

template <bool DOT, int ROWS>
void run_kind(const Problem& pr, int64_t kind, int64_t block) {
  if (kind == 4) run_block<4, DOT, ROWS>(pr, block);
  else if (kind == 7) run_block<7, DOT, ROWS>(pr, block);
  else if (kind == 9) run_block<9, DOT, ROWS>(pr, block);
  else run_block<8, DOT, ROWS>(pr, block);
}

}  // namespace

const char* path() { return kPath; }
const char* wide_path() { return kWidePath; }

// out [M, N] = x [M, K] @ W.T + bias for W packed as `kind` (4, 7, 8 or 9); x and out both bf16 or
// both float32; shapes and strides checked by the launcher.
void linear(torch::Tensor out,                    // bf16 or float32 [M, N], dense
            torch::Tensor x,                      // out's dtype [M, K], rows dense
            torch::Tensor q,                      // uint8 [NB, ceil(K / 4), 64 or 128]
            torch::Tensor scales,                 // float32 or float16 [NB, G, 32]
            torch::Tensor offsets,                // scales' dtype [NB, G, 32]: o - C * s, or o
            c10::optional<torch::Tensor> bias,    // float32 [N]
            int64_t kind, int64_t group_quads) {
  const int64_t m = x.size(0), groups = scales.size(1);
  if (m == 0) return;
  const bool f32 = x.scalar_type() == at::kFloat;
#ifdef BATCHPAGE_BF16_DOT
  const bool dot = !f32;
#else
  const bool dot = false;
#endif
  std::vector<float> xsum(static_cast<size_t>(m * groups));
  std::vector<float> xf(dot ? 0 : static_cast<size_t>(m * ((x.size(1) + 3) / 4 * 4)));
  const uint16_t* x16 = f32 ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const Problem pr{x16,
                   x.stride(0),
                   q.data_ptr<uint8_t>(),
                   scales.data_ptr(),
                   offsets.data_ptr(),
                   scales.scalar_type() == at::kHalf,
                   xsum.data(),
                   xf.empty() ? nullptr : xf.data(),
                   bias.has_value() ? bias->data_ptr<float>() : nullptr,
                   out.data_ptr(),
                   f32,
                   out.stride(0),
                   m,
                   out.size(1),
                   x.size(1),
                   groups,
                   group_quads};
  float* xf_out = xf.empty() ? nullptr : xf.data();
  if (f32) prepare_rows(pr, x.data_ptr<float>(), x.stride(0), xsum.data(), xf_out);
  else prepare_rows(pr, x16, x.stride(0), xsum.data(), xf_out);
  const int64_t blocks = q.size(0);
#ifdef BATCHPAGE_BF16_DOT
  const int64_t rows_per_tile = dot ? kDotRows : kWideRows;
#else
  const int64_t rows_per_tile = kWideRows;
#endif
  // As in cpu_bf16_linear.cpp: blocks alone where there are several per thread, else the rows
  // split too, into groups of whole tiles, some 4 items per thread.
  const int64_t tiles = (m + rows_per_tile - 1) / rows_per_tile, want = 4 * at::get_num_threads();
  const int64_t parts = blocks >= want ? 1 : std::min(tiles, (want + blocks - 1) / blocks);
  const int64_t part_rows = (tiles + parts - 1) / parts * rows_per_tile;
  const int64_t y_item = f32 ? 4 : 2;  // bytes of one y element
  at::parallel_for(0, blocks * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      Problem part = pr;
      const int64_t row0 = item / blocks * part_rows;
      if (row0 >= m) continue;
      if (pr.x != nullptr) part.x = pr.x + row0 * pr.x_stride;
      part.y = static_cast<char*>(pr.y) + row0 * pr.y_stride * y_item;
      part.xsum = pr.xsum + row0 * groups;
      if (pr.xf != nullptr) part.xf = pr.xf + row0 * ((pr.k + 3) / 4 * 4);
      part.m = std::min(part_rows, m - row0);
      const int64_t block = item % blocks;
#ifdef BATCHPAGE_BF16_DOT
      if (dot) {
        run_kind<true, kDotRows>(part, kind, block);
        continue;
      }
#endif
      run_kind<false, kWideRows>(part, kind, block);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("path", &path, "the build's instruction path for bf16 x: avx512_bf16, avx2 or plain");
  m.def("wide_path", &wide_path, "the build's path for float32 x: avx2 or plain");
  m.def("linear", &linear, "bf16 x @ W.T (+ b) against an integer weight packed in k-quads");
}

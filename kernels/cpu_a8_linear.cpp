// y = x @ W.T (+ b) with x (float32 or bfloat16) quantized here, row by row, to int8 (dynamic
// per-token activations: W8A8, W4A8) and W an integer weight, W[n, k] = s[n, g] * q[n, k] +
// o[n, g] with g = k / group_size. Three paths over one layout, each a build may hold (paths()):
// AVX512-VNNI's vpdpbusd (unsigned bytes times signed bytes, four products summed into each
// 32-bit lane, 64 multiply-adds an instruction), AVX2's vpmaddubsw / vpmaddwd for CPUs without
// VNNI (below), and a plain loop (the reference, on any CPU). Built and launched by
// cpu_a8_linear.py, which repacks batchpage.quant's IntWeight into the layout below.
//
// Row r: a_r = max |x_r| / 127 (at least FLT_MIN / 127), xq = x / a_r rounded half to even and
// clamped to [-128, 127], exactly as batchpage.quant.activations.quantize_rows_int8 (a finite
// row gives |xq| <= 127; the sums below are exact for -128 too). Then
//     y[r, n] = a_r * sum_g (s[n, g] * acc_g + o[n, g] * xqsum_g) + b[n],
//     acc_g = sum_{k in g} q[n, k] * xq[k]  (int32, exact: |acc_g| < 2^31 for K below 2^16),
//     xqsum_g = sum_{k in g} xq[k].
// Every path computes the same int32 sums and then the same float32 operations in the same
// order, so the paths agree bit for bit.
//
// Layout, uint8 [NB][KQ][B], NB = ceil(N / 32) blocks of 32 columns, KQ = ceil(K / 4) k-quads.
// Quad t of block j holds q[32j + c', 4t + kk] for c' < 32, kk < 4:
//   kind 4 (4-bit q), B = 64: byte 4c + kk, c < 16: column 32j + c in the low nibble, column
//       32j + 16 + c in the high;
//   kind 8 (q < 256 in bytes), B = 128: byte 64h + 4c + kk is column 32j + 16h + c.
// So each 32-bit lane of an operand is one column's four k, against a 32-bit broadcast of the
// row's four int8 x: one vpdpbusd per 16 columns and quad. Zero past N and K (xq is zero past K
// too). Scales and offsets: float32 [NB][G][32]; a group is `group_quads` quads.
//
// AVX2 has no vpdpbusd. Its vpmaddubsw multiplies unsigned by signed bytes and sums pairs into
// int16 with saturation, which 8-bit q (up to 255) times xq (down to -128) would reach: 2 * 255 *
// 128 > 2^15. Activations held to 7 bits would avoid it, but the results would then differ from
// the other paths', the other candidates' and quantize_rows_int8's, which a measured choice
// among them must not allow; so the AVX2 path keeps the activations at 8 bits and splits by
// weight width:
//   kind 4: vpmaddubsw on the nibbles as they are (unsigned, < 16) against the row's signed
//       bytes: a pair sums to at most 2 * 15 * 128 = 3840, so up to 8 quads add in int16
//       (30720 < 2^15) before vpmaddwd by ones widens them to int32: 32 multiply-adds an
//       instruction, no saturation possible;
//   kind 8: q zero-extended to int16 (vpmovzxbw, once per quad for MR rows) and xq
//       sign-extended to int16 once per row, multiplied by vpmaddwd into int32 pairs (at most
//       2 * 255 * 128, exact): 16 multiply-adds an instruction. Each column's two lanes are
//       added at the group's end (vphaddd, then vpermq to put the columns in order). Splitting
//       q or xq into nibbles for vpmaddubsw would take as many multiplying instructions (two
//       vpmaddubsw per 32 products, and vpmaddwd to widen them).
// The sum over a quad's four k in one lane is the layout's, so both paths read the VNNI packing.
//
// Work is split as in cpu_int_linear.cpp (column blocks over torch's threads, rows too where
// blocks are few; MR-row tiles against one block, or against 8 or 16 of its columns on AVX2).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(BATCHPAGE_AVX512)
#define BATCHPAGE_VNNI 1
#endif

namespace {

constexpr int64_t kCols = 32;  // columns per packed block
// The paths, by number: PATHS in cpu_a8_linear.py.
enum Path : int64_t { kVnni = 0, kAvx2 = 1, kPlain = 2 };

template <typename T>  // T: the output's element type, float or c10::BFloat16
struct Problem {
  const int32_t* xq;     // [M][KQ]: each row's int8 x, four to a 32-bit word, zero past K
  const int64_t* xq16;   // [M][KQ]: the same as four int16 (AVX2, kind 8), else nullptr
  const float* xqsum;    // [M][G]: each row's int8 x summed over each group
  const float* xscale;   // [M]: a_r
  const uint8_t* q;      // packed [NB][KQ][bytes]
  const float* scales;   // [NB][G][32]
  const float* offsets;  // [NB][G][32]
  const float* bias;     // [N] or nullptr
  T* y;                  // [M, N], rows `y_stride` apart
  int64_t y_stride;
  int64_t m, n, quads;
  int64_t groups, group_quads;
};

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// A row's int8 values summed over each group (exact in float32: |sum| < 2^24).
void sum_groups(const int8_t* row, int64_t quads, int64_t groups, int64_t group_quads,
                float* sums) {
  for (int64_t g = 0; g < groups; ++g) {
    int32_t s = 0;
    for (int64_t i = 4 * g * group_quads; i < std::min(4 * quads, 4 * (g + 1) * group_quads); ++i)
      s += row[i];
    sums[g] = static_cast<float>(s);
  }
}

// Each row of x to int8 with its scale, and its sums per group: the same for a row whatever
// the batch, so a row's result does not depend on M.
template <typename TX>
void quantize_rows(const TX* x, int64_t x_stride, int64_t m, int64_t k, int64_t quads,
                   int64_t groups, int64_t group_quads, int8_t* xq, float* xqsum, float* xscale) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const TX* row = x + r * x_stride;
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(widen(row[i])));
      const float a = std::max(amax, FLT_MIN) / 127.f;
      int8_t* out = xq + r * 4 * quads;
      for (int64_t i = 0; i < 4 * quads; ++i) {
        // nearbyint rounds half to even in the default rounding mode, as torch.round does
        const float v = i < k ? std::nearbyint(widen(row[i]) / a) : 0.f;
        out[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
      }
      sum_groups(out, quads, groups, group_quads, xqsum + r * groups);
      xscale[r] = a;
    }
  });
}

// Rows already int8 (linear_int8): copied into the quads, zero past K, and summed per group.
void copy_rows(const int8_t* x, int64_t x_stride, int64_t m, int64_t k, int64_t quads,
               int64_t groups, int64_t group_quads, int8_t* xq, float* xqsum) {
  for (int64_t r = 0; r < m; ++r) {
    int8_t* out = xq + r * 4 * quads;
    std::memcpy(out, x + r * x_stride, static_cast<size_t>(k));
    std::memset(out + k, 0, static_cast<size_t>(4 * quads - k));
    sum_groups(out, quads, groups, group_quads, xqsum + r * groups);
  }
}

// Columns col .. col + count - 1 of row r: values * a_r + b, rounded once to T.
template <typename T>
void store_cols(const Problem<T>& pr, int64_t r, int64_t col, int64_t count, const float* values) {
  for (int64_t c = 0; c < count; ++c) {
    const float b = pr.bias == nullptr ? 0.f : pr.bias[col + c];
    pr.y[r * pr.y_stride + col + c] = static_cast<T>(std::fma(values[c], pr.xscale[r], b));
  }
}

// ---- AVX512-VNNI ------------------------------------------------------------------------------
#ifdef BATCHPAGE_VNNI
// MR rows against one 32-column block, the whole K, into y.
template <typename T, int KIND, int MR>
void tile_vnni(const Problem<T>& pr, int64_t row0, int64_t block) {
  constexpr int64_t bytes = KIND == 4 ? 64 : 128;
  const uint8_t* wb = pr.q + block * pr.quads * bytes;
  const float* sb = pr.scales + block * pr.groups * kCols;
  const float* ob = pr.offsets + block * pr.groups * kCols;
  const int32_t* rows[MR];
  for (int i = 0; i < MR; ++i) rows[i] = pr.xq + (row0 + i) * pr.quads;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 total[MR][2];
  for (int i = 0; i < MR; ++i) total[i][0] = total[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pr.groups; ++g) {
    const int64_t t0 = g * pr.group_quads, t1 = std::min(pr.quads, t0 + pr.group_quads);
    __m512i acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (int64_t t = t0; t < t1; ++t) {
      __m512i w[2];
      if constexpr (KIND == 4) {
        const __m512i v = _mm512_loadu_si512(wb + t * bytes);
        w[0] = _mm512_and_si512(v, nibble);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      } else {
        w[0] = _mm512_loadu_si512(wb + t * bytes);
        w[1] = _mm512_loadu_si512(wb + t * bytes + 64);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512i a = _mm512_set1_epi32(rows[i][t]);  // folded into a {1to16} broadcast
        acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w[0], a);
        acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], w[1], a);
      }
    }
    const __m512 s[2] = {_mm512_loadu_ps(sb + g * kCols), _mm512_loadu_ps(sb + g * kCols + 16)};
    const __m512 o[2] = {_mm512_loadu_ps(ob + g * kCols), _mm512_loadu_ps(ob + g * kCols + 16)};
    for (int i = 0; i < MR; ++i) {
      const __m512 xs = _mm512_set1_ps(pr.xqsum[(row0 + i) * pr.groups + g]);
      for (int h = 0; h < 2; ++h)
        total[i][h] = _mm512_fmadd_ps(
            o[h], xs, _mm512_fmadd_ps(s[h], _mm512_cvtepi32_ps(acc[i][h]), total[i][h]));
    }
  }
  const int64_t col0 = block * kCols;
  if (pr.n - col0 < kCols) {  // a partial block: rounded one column at a time
    for (int i = 0; i < MR; ++i) {
      alignas(64) float values[kCols];
      _mm512_store_ps(values, total[i][0]);
      _mm512_store_ps(values + 16, total[i][1]);
      store_cols(pr, row0 + i, col0, pr.n - col0, values);
    }
    return;
  }
  __m512 b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  if (pr.bias != nullptr) {
    b[0] = _mm512_loadu_ps(pr.bias + col0);
    b[1] = _mm512_loadu_ps(pr.bias + col0 + 16);
  }
  for (int i = 0; i < MR; ++i) {
    const __m512 a = _mm512_set1_ps(pr.xscale[row0 + i]);
    T* out = pr.y + (row0 + i) * pr.y_stride + col0;
    for (int h = 0; h < 2; ++h) {
      const __m512 v = _mm512_fmadd_ps(total[i][h], a, b[h]);
      store8(out + 16 * h, _mm512_castps512_ps256(v));
      store8(out + 16 * h + 8, _mm512_extractf32x8_ps(v, 1));
    }
  }
}

// MR: 2 * MR int32 accumulators and 2 * MR float32 totals of 32 zmm, beside two operands,
// the nibble mask and the group's scales and offsets.
#ifndef BATCHPAGE_A8_ROWS
#define BATCHPAGE_A8_ROWS 6
#endif
constexpr int kRowsVnni = BATCHPAGE_A8_ROWS;

template <typename T, int KIND, int MR>  // the last m - r < kRowsVnni rows, in one tile
void tail_vnni(const Problem<T>& pr, int64_t r, int64_t block) {
  if constexpr (MR > 0) {
    if (pr.m - r == MR) return tile_vnni<T, KIND, MR>(pr, r, block);
    tail_vnni<T, KIND, MR - 1>(pr, r, block);
  }
}
#endif  // BATCHPAGE_VNNI

// ---- AVX2 -------------------------------------------------------------------------------------
#ifdef BATCHPAGE_AVX2
constexpr int64_t kChunk4 = 8;  // kind 4: quads summed in int16, 8 * 2 * 15 * 128 < 2^15
// MR rows against SUBS parts of a block's columns a tile: kind 4's inner loop holds 2 int16 sums
// a row and part beside two operands a part, the row's broadcast and the mask; kind 8's 2 int32
// sums a row and part beside two operands and the broadcast. Of 16 ymm: MR = 3 against one
// part (the rows' tiles), or one row against every part (a row left over).
// What changes once a chunk or group (kind 4's int32 sums, the float32 totals) lives in memory:
// a spilled accumulator of the inner loop would chain its adds through a store and a load.
constexpr int kRowsAvx2 = 3;

// Row r's 8 columns from col: total * a_r + b, the columns past N left out.
template <typename T>
inline void store_avx2(const Problem<T>& pr, int64_t r, int64_t col, const float* total) {
  const int64_t count = std::min<int64_t>(8, pr.n - col);
  if (count < 8) return store_cols(pr, r, col, count, total);
  const __m256 b = pr.bias == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(pr.bias + col);
  const __m256 v = _mm256_fmadd_ps(_mm256_load_ps(total), _mm256_set1_ps(pr.xscale[r]), b);
  store8(pr.y + r * pr.y_stride + col, v);
}

// total += s * acc + o * xqsum (8 columns), in memory.
inline void add_group(float* total, const int32_t* acc, const float* s, const float* o, float xs) {
  const __m256i sums = _mm256_load_si256(reinterpret_cast<const __m256i*>(acc));
  const __m256 t = _mm256_fmadd_ps(_mm256_loadu_ps(s), _mm256_cvtepi32_ps(sums),
                                   _mm256_load_ps(total));
  _mm256_store_ps(total, _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(xs), t));
}

// kind 4: MR rows against halves h0 .. h0 + SUBS - 1 of one block; half h is columns 8h .. 8h + 7
// (the low nibbles of quad bytes 32h .. 32h + 31) and 16 + 8h .. 16 + 8h + 7 (their high ones).
template <typename T, int MR, int SUBS>
void tile4_avx2(const Problem<T>& pr, int64_t row0, int64_t block, int64_t h0) {
  const uint8_t* wb = pr.q + block * pr.quads * 64 + 32 * h0;
  const float* sb = pr.scales + block * pr.groups * kCols;
  const float* ob = pr.offsets + block * pr.groups * kCols;
  int64_t cols[SUBS][2];
  for (int u = 0; u < SUBS; ++u) cols[u][0] = 8 * (h0 + u), cols[u][1] = 16 + 8 * (h0 + u);
  const int32_t* rows[MR];
  for (int i = 0; i < MR; ++i) rows[i] = pr.xq + (row0 + i) * pr.quads;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) float total[MR][SUBS][2][8] = {};
  for (int64_t g = 0; g < pr.groups; ++g) {
    const int64_t t0 = g * pr.group_quads, t1 = std::min(pr.quads, t0 + pr.group_quads);
    alignas(32) int32_t acc[MR][SUBS][2][8] = {};
    for (int64_t c0 = t0; c0 < t1; c0 += kChunk4) {
      __m256i part[MR][SUBS][2];  // int16: each column's pairs of k over the chunk's quads
      for (int i = 0; i < MR; ++i)
        for (int u = 0; u < SUBS; ++u) part[i][u][0] = part[i][u][1] = _mm256_setzero_si256();
      for (int64_t t = c0; t < std::min(t1, c0 + kChunk4); ++t) {
        for (int u = 0; u < SUBS; ++u) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 64 + 32 * u));
          const __m256i w[2] = {_mm256_and_si256(v, nibble),
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)};
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const __m256i a = _mm256_set1_epi32(rows[i][t]);
            part[i][u][0] = _mm256_add_epi16(part[i][u][0], _mm256_maddubs_epi16(w[0], a));
            part[i][u][1] = _mm256_add_epi16(part[i][u][1], _mm256_maddubs_epi16(w[1], a));
          }
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int u = 0; u < SUBS; ++u)
          for (int j = 0; j < 2; ++j) {
            __m256i* sum = reinterpret_cast<__m256i*>(acc[i][u][j]);
            _mm256_store_si256(sum, _mm256_add_epi32(_mm256_load_si256(sum),
                                                     _mm256_madd_epi16(part[i][u][j], ones)));
          }
    }
    for (int i = 0; i < MR; ++i)
      for (int u = 0; u < SUBS; ++u)
        for (int j = 0; j < 2; ++j)
          add_group(total[i][u][j], acc[i][u][j], sb + g * kCols + cols[u][j],
                    ob + g * kCols + cols[u][j], pr.xqsum[(row0 + i) * pr.groups + g]);
  }
  for (int i = 0; i < MR; ++i)
    for (int u = 0; u < SUBS; ++u)
      for (int j = 0; j < 2; ++j)
        store_avx2(pr, row0 + i, block * kCols + cols[u][j], total[i][u][j]);
}

// kind 8: MR rows against octets o0 .. o0 + SUBS - 1 of one block; octet o is columns 8o ..
// 8o + 7 (quad bytes 32o .. 32o + 31).
template <typename T, int MR, int SUBS>
void tile8_avx2(const Problem<T>& pr, int64_t row0, int64_t block, int64_t o0) {
  const uint8_t* wb = pr.q + block * pr.quads * 128 + 32 * o0;
  const float* sb = pr.scales + block * pr.groups * kCols + 8 * o0;
  const float* ob = pr.offsets + block * pr.groups * kCols + 8 * o0;
  const int64_t* rows[MR];
  for (int i = 0; i < MR; ++i) rows[i] = pr.xq16 + (row0 + i) * pr.quads;
  alignas(32) float total[MR][SUBS][8] = {};
  for (int64_t g = 0; g < pr.groups; ++g) {
    const int64_t t0 = g * pr.group_quads, t1 = std::min(pr.quads, t0 + pr.group_quads);
    // int32: [c0 k01, c0 k23, c1 k01, c1 k23 | c2 .., c3 ..], and c4 .. c7 likewise
    __m256i acc[MR][SUBS][2];
    for (int i = 0; i < MR; ++i)
      for (int u = 0; u < SUBS; ++u) acc[i][u][0] = acc[i][u][1] = _mm256_setzero_si256();
    for (int64_t t = t0; t < t1; ++t) {
      for (int u = 0; u < SUBS; ++u) {
        const __m128i* wq = reinterpret_cast<const __m128i*>(wb + t * 128 + 32 * u);
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(wq));
        const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(wq + 1));
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m256i a = _mm256_set1_epi64x(rows[i][t]);  // the quad's four int16 x
          acc[i][u][0] = _mm256_add_epi32(acc[i][u][0], _mm256_madd_epi16(w0, a));
          acc[i][u][1] = _mm256_add_epi32(acc[i][u][1], _mm256_madd_epi16(w1, a));
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int u = 0; u < SUBS; ++u) {
        // hadd: [c0, c1, c4, c5 | c2, c3, c6, c7]; qwords 0, 2, 1, 3: c0 .. c7 in order
        alignas(32) int32_t sums[8];
        const __m256i pairs = _mm256_hadd_epi32(acc[i][u][0], acc[i][u][1]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums),
                           _mm256_permute4x64_epi64(pairs, 0xD8));
        add_group(total[i][u], sums, sb + g * kCols + 8 * u, ob + g * kCols + 8 * u,
                  pr.xqsum[(row0 + i) * pr.groups + g]);
      }
  }
  for (int i = 0; i < MR; ++i)
    for (int u = 0; u < SUBS; ++u)
      store_avx2(pr, row0 + i, block * kCols + 8 * (o0 + u), total[i][u]);
}

template <typename T, int KIND, int MR, int SUBS>
inline void tile_avx2(const Problem<T>& pr, int64_t row0, int64_t block, int64_t sub0) {
  if constexpr (KIND == 4) tile4_avx2<T, MR, SUBS>(pr, row0, block, sub0);
  else tile8_avx2<T, MR, SUBS>(pr, row0, block, sub0);
}

// A block's rows in tiles of kRowsAvx2, each part of its columns (kind 4: two halves of 16,
// kind 8: four octets) against every tile before the next part, so that the part's slice of the
// weight stays in L1; then each row left over against the whole block, which it reads once
// (a decode step's one row is bound by reading the weight, not by kind 8's spilled sums).
template <typename T, int KIND>
void run_block_avx2(const Problem<T>& pr, int64_t block) {
  constexpr int subs = KIND == 4 ? 2 : 4;
  const int64_t full = pr.m - pr.m % kRowsAvx2;
  for (int64_t sub = 0; sub < subs && 8 * sub < pr.n - block * kCols; ++sub)
    for (int64_t r = 0; r < full; r += kRowsAvx2)
      tile_avx2<T, KIND, kRowsAvx2, 1>(pr, r, block, sub);
  for (int64_t r = full; r < pr.m; ++r) tile_avx2<T, KIND, 1, subs>(pr, r, block, 0);
}

// Four int8 of each quad as four int16 (kind 8's operand).
void widen_quads(const int32_t* xq, int64_t count, int64_t* xq16) {
  for (int64_t i = 0; i < count; ++i) {
    int8_t b[4];
    std::memcpy(b, xq + i, 4);
    const int16_t w[4] = {b[0], b[1], b[2], b[3]};
    std::memcpy(xq16 + i, w, 8);
  }
}
#endif  // BATCHPAGE_AVX2

// ---- plain loop -------------------------------------------------------------------------------
template <int KIND>
inline int32_t stored(const uint8_t* quad, int64_t c, int64_t kk) {  // q of column c, k = 4t + kk
  if constexpr (KIND == 4) return (quad[4 * (c % 16) + kk] >> (4 * (c / 16))) & 0xF;
  return quad[64 * (c / 16) + 4 * (c % 16) + kk];
}

// One row against one block: the reference the vector paths must equal, on any CPU.
template <typename T, int KIND>
void row_plain(const Problem<T>& pr, int64_t r, int64_t block) {
  const int64_t bytes = KIND == 4 ? 64 : 128, col0 = block * kCols;
  const uint8_t* wb = pr.q + block * pr.quads * bytes;
  const int8_t* row = reinterpret_cast<const int8_t*>(pr.xq + r * pr.quads);
  float total[kCols] = {};
  for (int64_t g = 0; g < pr.groups; ++g) {
    const int64_t t0 = g * pr.group_quads, t1 = std::min(pr.quads, t0 + pr.group_quads);
    int32_t acc[kCols] = {};
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t kk = 0; kk < 4; ++kk)
        for (int64_t c = 0; c < kCols; ++c)
          acc[c] += stored<KIND>(wb + t * bytes, c, kk) * row[4 * t + kk];
    const float* s = pr.scales + (block * pr.groups + g) * kCols;
    const float* o = pr.offsets + (block * pr.groups + g) * kCols;
    const float xs = pr.xqsum[r * pr.groups + g];
    for (int64_t c = 0; c < kCols; ++c)
      total[c] = std::fma(o[c], xs, std::fma(s[c], static_cast<float>(acc[c]), total[c]));
  }
  store_cols(pr, r, col0, std::min(kCols, pr.n - col0), total);
}

// ---- dispatch ---------------------------------------------------------------------------------
bool compiled(int64_t path) {
#ifdef BATCHPAGE_VNNI
  if (path == kVnni) return true;
#endif
#ifdef BATCHPAGE_AVX2
  if (path == kAvx2) return true;
#endif
  return path == kPlain;
}

int64_t row_tile(int64_t path) {  // rows a tile takes: the work split's unit
#ifdef BATCHPAGE_VNNI
  if (path == kVnni) return kRowsVnni;
#endif
#ifdef BATCHPAGE_AVX2
  if (path == kAvx2) return kRowsAvx2;
#endif
  return 1;
}

template <typename T, int KIND>
void run_block(const Problem<T>& pr, int64_t path, int64_t block) {
#ifdef BATCHPAGE_VNNI
  if (path == kVnni) {
    int64_t r = 0;
    for (; r + kRowsVnni <= pr.m; r += kRowsVnni) tile_vnni<T, KIND, kRowsVnni>(pr, r, block);
    return tail_vnni<T, KIND, kRowsVnni - 1>(pr, r, block);
  }
#endif
#ifdef BATCHPAGE_AVX2
  if (path == kAvx2) return run_block_avx2<T, KIND>(pr, block);
#endif
  for (int64_t r = 0; r < pr.m; ++r) row_plain<T, KIND>(pr, r, block);
}

// The rows prepared (xq, xqsum, xscale: m rows), y = rows @ W.T + b on `path`.
template <typename T>
void run(Problem<T> pr, int64_t path, int64_t kind) {
  std::vector<int64_t> xq16;
#ifdef BATCHPAGE_AVX2
  if (path == kAvx2 && kind == 8) {
    xq16.resize(static_cast<size_t>(pr.m * pr.quads));
    widen_quads(pr.xq, pr.m * pr.quads, xq16.data());
    pr.xq16 = xq16.data();
  }
#endif
  const int64_t blocks = (pr.n + kCols - 1) / kCols, rows = row_tile(path);
  const int64_t tiles = (pr.m + rows - 1) / rows, want = 4 * at::get_num_threads();
  const int64_t parts = blocks >= want ? 1 : std::min(tiles, (want + blocks - 1) / blocks);
  const int64_t part_rows = (tiles + parts - 1) / parts * rows;
  at::parallel_for(0, blocks * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      Problem<T> part = pr;
      const int64_t row0 = item / blocks * part_rows;
      if (row0 >= pr.m) continue;
      part.xq = pr.xq + row0 * pr.quads;
      if (pr.xq16 != nullptr) part.xq16 = pr.xq16 + row0 * pr.quads;
      part.xqsum = pr.xqsum + row0 * pr.groups;
      part.xscale = pr.xscale + row0;
      part.y = pr.y + row0 * pr.y_stride;
      part.m = std::min(part_rows, pr.m - row0);
      if (kind == 4) run_block<T, 4>(part, path, item % blocks);
      else run_block<T, 8>(part, path, item % blocks);
    }
  });
}

template <typename T>
Problem<T> problem(torch::Tensor out, const std::vector<int32_t>& xq,
                   const std::vector<float>& xqsum, const float* xscale, torch::Tensor q,
                   torch::Tensor scales, torch::Tensor offsets,
                   const c10::optional<torch::Tensor>& bias, int64_t group_quads) {
  return Problem<T>{xq.data(),
                    nullptr,
                    xqsum.data(),
                    xscale,
                    q.data_ptr<uint8_t>(),
                    scales.data_ptr<float>(),
                    offsets.data_ptr<float>(),
                    bias.has_value() ? bias->data_ptr<float>() : nullptr,
                    reinterpret_cast<T*>(out.data_ptr()),
                    out.stride(0),
                    out.size(0),
                    out.size(1),
                    q.size(1),
                    scales.size(1),
                    group_quads};
}

template <typename T>
void run_into(int64_t path, torch::Tensor out, const std::vector<int32_t>& xq,
              const std::vector<float>& xqsum, const float* xscale, torch::Tensor q,
              torch::Tensor scales, torch::Tensor offsets,
              const c10::optional<torch::Tensor>& bias, int64_t kind, int64_t group_quads) {
  run(problem<T>(out, xq, xqsum, xscale, q, scales, offsets, bias, group_quads), path, kind);
}

void check_path(int64_t path) {
  TORCH_CHECK(compiled(path), "the int8-activation linear: path ", path, " is not in this build");
}

}  // namespace

// The build's paths, fastest first by design (names as in PATHS).
std::vector<std::string> paths() {
  std::vector<std::string> names;
#ifdef BATCHPAGE_VNNI
  names.push_back("avx512_vnni");
#endif
#ifdef BATCHPAGE_AVX2
  names.push_back("avx2");
#endif
  names.push_back("plain");
  return names;
}

// out [M, N] = quantized x [M, K] @ W.T + bias for W packed as `kind` (4 or 8), on `path`; out
// has x's dtype (float32 or bf16). Shapes and strides checked by the launcher.
void linear(int64_t path,
            torch::Tensor out,                  // x's dtype [M, N], dense
            torch::Tensor x,                    // float32 or bf16 [M, K], rows dense
            torch::Tensor q,                    // uint8 [NB, ceil(K / 4), 64 or 128]
            torch::Tensor scales,               // float32 [NB, G, 32]
            torch::Tensor offsets,              // float32 [NB, G, 32]
            c10::optional<torch::Tensor> bias,  // float32 [N]
            int64_t kind, int64_t group_quads) {
  check_path(path);
  const int64_t m = x.size(0), k = x.size(1), groups = scales.size(1), quads = q.size(1);
  if (m == 0) return;
  std::vector<int32_t> xq(static_cast<size_t>(m * quads));
  std::vector<float> xqsum(static_cast<size_t>(m * groups)), xscale(static_cast<size_t>(m));
  int8_t* bytes = reinterpret_cast<int8_t*>(xq.data());
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, quads, groups, group_quads, bytes,
                  xqsum.data(), xscale.data());
    run_into<float>(path, out, xq, xqsum, xscale.data(), q, scales, offsets, bias, kind,
                    group_quads);
  } else {
    quantize_rows(x.data_ptr<at::BFloat16>(), x.stride(0), m, k, quads, groups, group_quads,
                  bytes, xqsum.data(), xscale.data());
    run_into<c10::BFloat16>(path, out, xq, xqsum, xscale.data(), q, scales, offsets, bias, kind,
                            group_quads);
  }
}

// out [M, N] (float32 or bf16) = (xscale * xq) [M, K] @ W.T + bias for rows already int8, on
// `path`: the same sums and scaling as `linear` after its quantization.
void linear_int8(int64_t path,
                 torch::Tensor out,     // float32 or bf16 [M, N], dense
                 torch::Tensor xq,      // int8 [M, K], rows dense
                 torch::Tensor xscale,  // float32 [M]
                 torch::Tensor q, torch::Tensor scales, torch::Tensor offsets,
                 c10::optional<torch::Tensor> bias, int64_t kind, int64_t group_quads) {
  check_path(path);
  const int64_t m = xq.size(0), k = xq.size(1), groups = scales.size(1), quads = q.size(1);
  if (m == 0) return;
  std::vector<int32_t> rows(static_cast<size_t>(m * quads));
  std::vector<float> xqsum(static_cast<size_t>(m * groups));
  copy_rows(xq.data_ptr<int8_t>(), xq.stride(0), m, k, quads, groups, group_quads,
            reinterpret_cast<int8_t*>(rows.data()), xqsum.data());
  const float* scale = xscale.data_ptr<float>();
  if (out.scalar_type() == at::kFloat)
    run_into<float>(path, out, rows, xqsum, scale, q, scales, offsets, bias, kind, group_quads);
  else
    run_into<c10::BFloat16>(path, out, rows, xqsum, scale, q, scales, offsets, bias, kind,
                            group_quads);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paths", &paths, "the build's paths: avx512_vnni, avx2 (where compiled), plain");
  m.def("linear", &linear, "int8-quantized x @ W.T (+ b) against a packed integer weight");
  m.def("linear_int8", &linear_int8, "int8 rows times their scales @ W.T (+ b)");
}

// y = x @ W.T (+ b) with x bfloat16 quantized here, row by row, to int8 (dynamic per-token
// activations: W8A8, W4A8) and W an integer weight, W[n, k] = s[n, g] * q[n, k] + o[n, g] with
// g = k / group_size, multiplied on AVX512-VNNI's vpdpbusd: unsigned bytes times signed bytes,
// four products summed into each 32-bit lane, 64 multiply-adds an instruction (vdpbf16ps does
// 32). Built and launched by cpu_a8_linear.py, which repacks batchpage.quant's IntWeight into
// the layout below.
//
// Row r: a_r = max |x_r| / 127 (at least FLT_MIN / 127), xq = x / a_r rounded half to even and
// clamped to [-128, 127], exactly as batchpage.quant.activations.quantize_rows_int8. Then
//     y[r, n] = a_r * sum_g (s[n, g] * acc_g + o[n, g] * xqsum_g) + b[n],
//     acc_g = sum_{k in g} q[n, k] * xq[k]  (int32, exact: |acc_g| < 2^31 for K below 2^16),
//     xqsum_g = sum_{k in g} xq[k].
//
// Layout, uint8 [NB][KQ][B], NB = ceil(N / 32) blocks of 32 columns, KQ = ceil(K / 4) k-quads.
// Quad t of block j holds q[32j + c', 4t + kk] for c' < 32, kk < 4:
//   kind 4 (4-bit q), B = 64: byte 4c + kk, c < 16: column 32j + c in the low nibble, column
//       32j + 16 + c in the high;
//   kind 8 (q < 256 in bytes), B = 128: byte 64h + 4c + kk is column 32j + 16h + c.
// So each 32-bit lane of a 64-byte operand is one column's four k, against a 32-bit broadcast
// of the row's four int8 x: one vpdpbusd per 16 columns and quad. Zero past N and K (xq is
// zero past K too). Scales and offsets: float32 [NB][G][32]; a group is `group_quads` quads.
//
// Work is split as in cpu_int_linear.cpp (column blocks over torch's threads, rows too where
// blocks are few; MR-row tiles against one block). Without AVX512-VNNI a plain loop over the
// same layout (never chosen by the engine: it keeps the layout testable on any CPU).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(BATCHPAGE_AVX512)
#define BATCHPAGE_VNNI 1
#endif

namespace {

constexpr int64_t kCols = 32;  // columns per packed block

struct Problem {
  const int32_t* xq;     // [M][KQ]: each row's int8 x, four to a 32-bit word, zero past K
  const float* xqsum;    // [M][G]: each row's int8 x summed over each group
  const float* xscale;   // [M]: a_r
  const uint8_t* q;      // packed [NB][KQ][bytes]
  const float* scales;   // [NB][G][32]
  const float* offsets;  // [NB][G][32]
  const float* bias;     // [N] or nullptr
  uint16_t* y;           // bf16 bits [M, N], rows `y_stride` apart
  int64_t y_stride;
  int64_t m, n, quads;
  int64_t groups, group_quads;
};

inline float widen(uint16_t bits16) {
  const uint32_t u = static_cast<uint32_t>(bits16) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Each row of x to int8 with its scale, and its sums per group: the same for a row whatever
// the batch, so a row's result does not depend on M.
void quantize_rows(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, int64_t quads,
                   int64_t groups, int64_t group_quads, int8_t* xq, float* xqsum, float* xscale) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = x + r * x_stride;
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(widen(row[i])));
      const float a = std::max(amax, FLT_MIN) / 127.f;
      int8_t* out = xq + r * 4 * quads;
      for (int64_t i = 0; i < 4 * quads; ++i) {
        // nearbyint rounds half to even in the default rounding mode, as torch.round does
        const float v = i < k ? std::nearbyint(widen(row[i]) / a) : 0.f;
        out[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
      }
      for (int64_t g = 0; g < groups; ++g) {
        int32_t s = 0;
        for (int64_t i = 4 * g * group_quads; i < std::min(4 * quads, 4 * (g + 1) * group_quads);
             ++i)
          s += out[i];
        xqsum[r * groups + g] = static_cast<float>(s);
      }
      xscale[r] = a;
    }
  });
}

void store_row(const Problem& pr, int64_t r, int64_t col0, const float* values) {
  for (int64_t c = 0; c < std::min<int64_t>(kCols, pr.n - col0); ++c) {
    const float b = pr.bias == nullptr ? 0.f : pr.bias[col0 + c];
    pr.y[r * pr.y_stride + col0 + c] = c10::BFloat16(values[c] * pr.xscale[r] + b).x;
  }
}

#ifdef BATCHPAGE_VNNI
// MR rows against one 32-column block, the whole K, into y.
template <int KIND, int MR>
void tile(const Problem& pr, int64_t row0, int64_t block) {
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
      store_row(pr, row0 + i, col0, values);
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
    uint16_t* out = pr.y + (row0 + i) * pr.y_stride + col0;
    for (int h = 0; h < 2; ++h) {
      const __m512 v = _mm512_fmadd_ps(total[i][h], a, b[h]);
      store8(reinterpret_cast<c10::BFloat16*>(out + 16 * h), _mm512_castps512_ps256(v));
      store8(reinterpret_cast<c10::BFloat16*>(out + 16 * h + 8), _mm512_extractf32x8_ps(v, 1));
    }
  }
}

// MR: 2 * MR int32 accumulators and 2 * MR float32 totals of 32 zmm, beside two operands,
// the nibble mask and the group's scales and offsets.
#ifndef BATCHPAGE_A8_ROWS
#define BATCHPAGE_A8_ROWS 6
#endif
constexpr int kRows = BATCHPAGE_A8_ROWS;
const char* const kPath = "avx512_vnni";

#else
template <int KIND>
inline int32_t stored(const uint8_t* quad, int64_t c, int64_t kk) {  // q of column c, k = 4t + kk
  if constexpr (KIND == 4) return (quad[4 * (c % 16) + kk] >> (4 * (c / 16))) & 0xF;
  return quad[64 * (c / 16) + 4 * (c % 16) + kk];
}

template <int KIND, int MR>
void tile(const Problem& pr, int64_t row0, int64_t block) {
  const int64_t bytes = KIND == 4 ? 64 : 128, col0 = block * kCols;
  const uint8_t* wb = pr.q + block * pr.quads * bytes;
  for (int i = 0; i < MR; ++i) {
    const int64_t r = row0 + i;
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
    store_row(pr, r, col0, total);
  }
}

constexpr int kRows = 1;
const char* const kPath = "plain";
#endif

template <int KIND, int MR>
void tail_tiles(const Problem& pr, int64_t r, int64_t block) {
  if constexpr (MR > 0) {
    if (pr.m - r == MR) return tile<KIND, MR>(pr, r, block);
    tail_tiles<KIND, MR - 1>(pr, r, block);
  }
}

template <int KIND>
void run_block(const Problem& pr, int64_t block) {
  int64_t r = 0;
  for (; r + kRows <= pr.m; r += kRows) tile<KIND, kRows>(pr, r, block);
  tail_tiles<KIND, kRows - 1>(pr, r, block);
}

}  // namespace

const char* path() { return kPath; }

// out [M, N] bf16 = quantized x [M, K] @ W.T + bias for W packed as `kind` (4 or 8); shapes
// and strides checked by the launcher.
void linear(torch::Tensor out,                  // bf16 [M, N], dense
            torch::Tensor x,                    // bf16 [M, K], rows dense
            torch::Tensor q,                    // uint8 [NB, ceil(K / 4), 64 or 128]
            torch::Tensor scales,               // float32 [NB, G, 32]
            torch::Tensor offsets,              // float32 [NB, G, 32]
            c10::optional<torch::Tensor> bias,  // float32 [N]
            int64_t kind, int64_t group_quads) {
  const int64_t m = x.size(0), k = x.size(1), groups = scales.size(1), quads = q.size(1);
  if (m == 0) return;
  std::vector<int32_t> xq(static_cast<size_t>(m * quads));
  std::vector<float> xqsum(static_cast<size_t>(m * groups)), xscale(static_cast<size_t>(m));
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), m, k,
                quads, groups, group_quads, reinterpret_cast<int8_t*>(xq.data()), xqsum.data(),
                xscale.data());
  const Problem pr{xq.data(),
                   xqsum.data(),
                   xscale.data(),
                   q.data_ptr<uint8_t>(),
                   scales.data_ptr<float>(),
                   offsets.data_ptr<float>(),
                   bias.has_value() ? bias->data_ptr<float>() : nullptr,
                   reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                   out.stride(0),
                   m,
                   out.size(1),
                   quads,
                   groups,
                   group_quads};
  const int64_t blocks = q.size(0);
  const int64_t tiles = (m + kRows - 1) / kRows, want = 4 * at::get_num_threads();
  const int64_t parts = blocks >= want ? 1 : std::min(tiles, (want + blocks - 1) / blocks);
  const int64_t part_rows = (tiles + parts - 1) / parts * kRows;
  at::parallel_for(0, blocks * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      Problem part = pr;
      const int64_t row0 = item / blocks * part_rows;
      if (row0 >= m) continue;
      part.xq = pr.xq + row0 * quads;
      part.xqsum = pr.xqsum + row0 * groups;
      part.xscale = pr.xscale + row0;
      part.y = pr.y + row0 * pr.y_stride;
      part.m = std::min(part_rows, m - row0);
      if (kind == 4) run_block<4>(part, item % blocks);
      else run_block<8>(part, item % blocks);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("path", &path, "the build's instruction path: avx512_vnni or plain");
  m.def("linear", &linear, "int8-quantized bf16 x @ W.T (+ b) against a packed integer weight");
}

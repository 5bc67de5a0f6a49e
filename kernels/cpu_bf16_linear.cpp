// y = x @ W.T (+ b) in bfloat16 with W packed for AVX512-BF16's dot-product instruction
// (vdpbf16ps: per float32 lane, acc += a.lo * b.lo + a.hi * b.hi over a pair of bf16). Built and
// launched by cpu_bf16_linear.py, which packs the weight and says why this beats oneDNN.
//
// Packed layout, int32 [NB][KP][32] with NB = ceil(N / 32), KP = ceil(K / 2): element [j][p][c]
// holds W[32j + c][2p] in its low 16 bits and W[32j + c][2p + 1] in its high 16 bits, zero past
// N or K. One k-pair of a 32-column block is one 128-byte row, two zmm loads, so a column block
// streams through memory in order and a row of x pairs with it by one 32-bit broadcast.
//
// Work: the column blocks are split over torch's threads (and the rows too where blocks are
// few for the threads); each thread runs every MR-row tile of its rows against one block (36-98
// KiB for SmolLM2, held in L2 while x's rows pass) before the next.
// Accumulation is float32; the bias is added in float32 and the sum rounded once to bf16 (to
// nearest even), as oneDNN and torch's bf16 linear do.
//
// Gated (a merged [gate | up] weight of 2I rows): each block holds 16 gate columns and the 16 up
// columns of the same indices, and the tile's epilogue writes SiLU(gate) * up, I columns, with
// cpu_layer_ops's silu_mul rounding (gate and up rounded to bf16, SiLU rounded, the product
// rounded) and its exp, so the result is the unfused pair's bit for bit, without the [T, 2I]
// intermediate written and read back.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(BATCHPAGE_AVX512)
#define BATCHPAGE_BF16_DOT 1
#endif

namespace {

constexpr int64_t kCols = 32;  // columns per packed block: two zmm of float32 accumulators

struct Problem {
  const uint16_t* x;  // bf16 bits [M, K], rows `x_stride` apart
  int64_t x_stride;
  const int32_t* w;   // packed [NB][KP][32]
  const float* bias;  // [N] or nullptr
  uint16_t* y;        // bf16 bits [M, N], rows `y_stride` apart
  int64_t y_stride;
  int64_t m, n, k;    // gated: n is I, the output's columns (the weight has 2I rows)
  bool gated;
};

inline uint32_t pair_at(const uint16_t* row, int64_t p, int64_t k) {
  // x[2p] low, x[2p + 1] high; an odd K's last pair gets a zero high half, so nothing past the
  // row is read (it could be Inf or NaN in the next row, and 0 * Inf is NaN).
  if (2 * p + 1 < k) {
    uint32_t v;
    std::memcpy(&v, row + 2 * p, sizeof(v));
    return v;
  }
  return row[2 * p];
}

#ifdef BATCHPAGE_BF16_DOT
// MR rows of x against one 32-column block, the whole K, into y (bias added, rounded, the
// columns past N masked off).
template <int MR>
void tile(const Problem& pr, int64_t row0, int64_t block) {
  const int64_t kp = (pr.k + 1) / 2, full = pr.k / 2;
  const int32_t* wb = pr.w + block * kp * kCols;
  const uint16_t* rows[MR];
  for (int i = 0; i < MR; ++i) rows[i] = pr.x + (row0 + i) * pr.x_stride;
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < full; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + p * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + p * kCols + 16);
    for (int i = 0; i < MR; ++i) {
      uint32_t v;
      std::memcpy(&v, rows[i] + 2 * p, sizeof(v));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
    }
  }
  if (full < kp) {  // odd K
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + full * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + full * kCols + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(rows[i], full, pr.k)));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
    }
  }
  if (pr.gated) {
    const int64_t col0 = block * (kCols / 2), cols = std::min<int64_t>(kCols / 2, pr.n - col0);
    const __mmask16 keep = cols == kCols / 2 ? ~__mmask16(0) : (__mmask16(1) << cols) - 1;
    const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m512 gate = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(acc[i][0]));
      const __m512 up = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(acc[i][1]));
      const __m512 act = _mm512_div_ps(gate, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, gate))));
      const __m512 out = _mm512_mul_ps(_mm512_cvtpbh_ps(_mm512_cvtneps_pbh(act)), up);
      _mm256_mask_storeu_epi16(pr.y + (row0 + i) * pr.y_stride + col0, keep,
                               (__m256i)_mm512_cvtneps_pbh(out));
    }
    return;
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
        _mm512_cvtne2ps_pbh(_mm512_add_ps(acc[i][1], b1), _mm512_add_ps(acc[i][0], b0));
    _mm512_mask_storeu_epi16(pr.y + (row0 + i) * pr.y_stride + col0, keep, (__m512i)out);
  }
}

constexpr int kRows = 8;  // MR: 16 accumulators, 2 weight registers and a broadcast of 32 zmm

void run_block(const Problem& pr, int64_t block) {
  int64_t r = 0;
  for (; r + kRows <= pr.m; r += kRows) tile<kRows>(pr, r, block);
  switch (pr.m - r) {
    case 7: tile<7>(pr, r, block); break;
    case 6: tile<6>(pr, r, block); break;
    case 5: tile<5>(pr, r, block); break;
    case 4: tile<4>(pr, r, block); break;
    case 3: tile<3>(pr, r, block); break;
    case 2: tile<2>(pr, r, block); break;
    case 1: tile<1>(pr, r, block); break;
    default: break;
  }
}
#else
// Without AVX512-BF16 (never chosen by the engine there; it keeps the packed layout testable on
// any CPU): the same sums in plain float32, each pair's two products added in turn.
inline float widen(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t round_bf16(float f) {
  return c10::BFloat16(f).x;  // nearest even, NaN kept
}

void run_block(const Problem& pr, int64_t block) {
  const int64_t kp = (pr.k + 1) / 2, col0 = block * kCols;
  const int64_t cols = std::min<int64_t>(kCols, pr.n - col0);  // when not gated
  const int32_t* wb = pr.w + block * kp * kCols;
  for (int64_t r = 0; r < pr.m; ++r) {
    const uint16_t* row = pr.x + r * pr.x_stride;
    float acc[kCols] = {};
    for (int64_t p = 0; p < kp; ++p) {
      const uint32_t a = pair_at(row, p, pr.k);
      const float lo = widen(a & 0xFFFF), hi = widen(a >> 16);
      for (int64_t c = 0; c < kCols; ++c) {
        const uint32_t w = static_cast<uint32_t>(wb[p * kCols + c]);
        acc[c] += lo * widen(w & 0xFFFF) + hi * widen(w >> 16);
      }
    }
    if (pr.gated) {
      const int64_t half = kCols / 2, col = block * half;
      for (int64_t c = 0; c < std::min(half, pr.n - col); ++c) {
        const float gate = widen(round_bf16(acc[c])), up = widen(round_bf16(acc[half + c]));
        const float act = widen(round_bf16(gate / (1.f + std::exp(-gate))));
        pr.y[r * pr.y_stride + col + c] = round_bf16(act * up);
      }
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) {
      const float b = pr.bias == nullptr ? 0.f : pr.bias[col0 + c];
      pr.y[r * pr.y_stride + col0 + c] = round_bf16(acc[c] + b);
    }
  }
}
#endif

}  // namespace

bool native() {
#ifdef BATCHPAGE_BF16_DOT
  return true;
#else
  return false;
#endif
}

// out [M, N] bf16 = x [M, K] bf16 @ W.T + bias, or gated: out [M, I] = SiLU(x @ G.T) * (x @ U.T)
// with no bias; shapes and strides checked by the launcher.
void linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
            c10::optional<torch::Tensor> bias, bool gated) {
  const Problem pr{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                   x.stride(0),
                   packed.data_ptr<int32_t>(),
                   bias.has_value() ? bias->data_ptr<float>() : nullptr,
                   reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                   out.stride(0),
                   x.size(0),
                   out.size(1),
                   x.size(1),
                   gated};
  if (pr.m == 0) return;
  for_blocks_and_row_groups(pr.m, packed.size(0), [&](int64_t row0, int64_t rows, int64_t block) {
    Problem part = pr;
    part.x = pr.x + row0 * pr.x_stride;
    part.y = pr.y + row0 * pr.y_stride;
    part.m = rows;
    run_block(part, block);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("native", &native, "whether this build multiplies with AVX512-BF16's vdpbf16ps");
  m.def("linear", &linear, "bf16 x @ W.T (+ b) against a weight packed in k-pairs");
}

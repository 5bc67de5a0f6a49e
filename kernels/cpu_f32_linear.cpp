// y = x @ W.T (+ b) in float32 with W packed in 32-column blocks, each output a fixed-order sum:
// acc = fma(x[k], W[n][k], acc) for k = 0, 1, ..., K-1 from zero, then acc + b. Nothing in that
// order depends on how many rows the call has, where a row sits among them, or on the thread
// count, so a row's output is the same bits in any batch (the engine's batch_invariant mode).
// Built and launched by cpu_f32_linear.py.
//
// Packed layout, float [NB][K][32] with NB = ceil(N / 32): element [j][k][c] is W[32j + c][k],
// zero past N. A k of a block is one 128-byte row, so a block streams through memory in order.
//
// Work: the column blocks are split over torch's threads (the rows too where blocks are few for
// the threads). K is walked in slices of kSlice: a block's slice (32 KiB) stays in L1 while
// every row tile passes over it, the tiles' sums parked in y between slices; parking a float32
// and loading it back is exact, so the slicing does not change a single bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int64_t kCols = 32;    // columns per packed block
constexpr int64_t kSlice = 256;  // k per pass over a block's rows

struct Problem {
  const float* x;  // [M, K], rows `x_stride` apart
  int64_t x_stride;
  const float* w;     // packed [NB][K][32]
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N], rows `y_stride` apart
  int64_t y_stride;
  int64_t m, n, k;
};

// The columns of a block that exist (the last block may be partial); a partial block's sums are
// kept in `spill` between slices, since y has no room past N.
struct Sums {
  float* at;       // y's row 0, this block's column 0, or the spill
  int64_t stride;  // between rows
};

#if defined(BATCHPAGE_AVX512)
// MR rows against a block, k in [k0, k1): 2 x MR accumulators of 16 lanes.
template <int MR>
void tile(const Problem& pr, const float* wb, int64_t row0, int64_t k0, int64_t k1, Sums s) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    float* out = s.at + (row0 + i) * s.stride;
    acc[i][0] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out);
    acc[i][1] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + 16);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 w0 = _mm512_loadu_ps(wb + k * kCols), w1 = _mm512_loadu_ps(wb + k * kCols + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(pr.x[(row0 + i) * pr.x_stride + k]);
      acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* out = s.at + (row0 + i) * s.stride;
    _mm512_storeu_ps(out, acc[i][0]);
    _mm512_storeu_ps(out + 16, acc[i][1]);
  }
}
constexpr int kRows = 8;  // 16 accumulators, 2 weight registers, a broadcast
#elif defined(BATCHPAGE_AVX2)
// MR rows against a block, k in [k0, k1): 4 x MR accumulators of 8 lanes, the weight loaded a
// quarter at a time so that 3 rows fit the 16 registers.
template <int MR>
void tile(const Problem& pr, const float* wb, int64_t row0, int64_t k0, int64_t k1, Sums s) {
  __m256 acc[MR][4];
  for (int i = 0; i < MR; ++i) {
    float* out = s.at + (row0 + i) * s.stride;
    for (int j = 0; j < 4; ++j) acc[i][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + 8 * j);
  }
  for (int64_t k = k0; k < k1; ++k) {
    __m256 a[MR];
    for (int i = 0; i < MR; ++i) a[i] = _mm256_broadcast_ss(pr.x + (row0 + i) * pr.x_stride + k);
    for (int j = 0; j < 4; ++j) {
      const __m256 w = _mm256_loadu_ps(wb + k * kCols + 8 * j);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(a[i], w, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* out = s.at + (row0 + i) * s.stride;
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, acc[i][j]);
  }
}
constexpr int kRows = 3;
#else
// Plain loops, one row at a time; std::fma rounds once, as the vector paths' fmadd does.
template <int MR>
void tile(const Problem& pr, const float* wb, int64_t row0, int64_t k0, int64_t k1, Sums s) {
  for (int i = 0; i < MR; ++i) {
    float* out = s.at + (row0 + i) * s.stride;
    float acc[kCols];
    for (int64_t c = 0; c < kCols; ++c) acc[c] = k0 == 0 ? 0.f : out[c];
    const float* row = pr.x + (row0 + i) * pr.x_stride;
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t c = 0; c < kCols; ++c) acc[c] = std::fma(row[k], wb[k * kCols + c], acc[c]);
    for (int64_t c = 0; c < kCols; ++c) out[c] = acc[c];
  }
}
constexpr int kRows = 1;
#endif

void tiles(const Problem& pr, const float* wb, int64_t k0, int64_t k1, Sums s) {
  int64_t r = 0;
  for (; r + kRows <= pr.m; r += kRows) tile<kRows>(pr, wb, r, k0, k1, s);
  for (; r < pr.m; ++r) tile<1>(pr, wb, r, k0, k1, s);
}

void run_block(const Problem& pr, int64_t block) {
  const float* wb = pr.w + block * pr.k * kCols;
  const int64_t col0 = block * kCols, cols = std::min(kCols, pr.n - col0);
  std::vector<float> spill;
  Sums s{pr.y + col0, pr.y_stride};
  if (cols < kCols) {  // the last block: its 32 sums per row do not fit in y
    spill.resize(pr.m * kCols);
    s = Sums{spill.data(), kCols};
  }
  if (pr.k == 0) {
    for (int64_t r = 0; r < pr.m; ++r) std::fill_n(s.at + r * s.stride, kCols, 0.f);
  }
  for (int64_t k0 = 0; k0 < pr.k; k0 += kSlice) tiles(pr, wb, k0, std::min(pr.k, k0 + kSlice), s);
  for (int64_t r = 0; r < pr.m; ++r) {
    const float* sum = s.at + r * s.stride;
    float* out = pr.y + r * pr.y_stride + col0;
    for (int64_t c = 0; c < cols; ++c) out[c] = pr.bias == nullptr ? sum[c] : sum[c] + pr.bias[col0 + c];
  }
}

}  // namespace

// out [M, N] float32 = x [M, K] float32 @ W.T + bias; shapes and strides checked by the launcher.
void linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
            c10::optional<torch::Tensor> bias) {
  const Problem pr{x.data_ptr<float>(),
                   x.stride(0),
                   packed.data_ptr<float>(),
                   bias.has_value() ? bias->data_ptr<float>() : nullptr,
                   out.data_ptr<float>(),
                   out.stride(0),
                   x.size(0),
                   out.size(1),
                   x.size(1)};
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
  m.def("linear", &linear, "float32 x @ W.T (+ b) against a weight packed in 32-column blocks");
}

// LoRA updates of many adapters in one call (batchpage/lora/layers.py): for each group of a
// step's token rows that run one adapter slot, y[rows, target] += (x[rows] @ A_t.T) @ B_t.T for
// each target t (a fused linear's part) the adapter updates. One call per linear a step, so
// the cost is the arithmetic, not a matmul call per adapter and target (torch's small bf16
// matmuls cost tens of microseconds each on a CPU).
//
// Layouts (launcher: kernels/cpu_lora.py, which checks them):
//   y      [T, out]                 the base linear's output, updated in place (T dtype)
//   x      [T, in]                  its input (T dtype)
//   a      [S, targets * r, in]     A of every target, rank r each, zero past an adapter's rank
//   bt[t]  [S, r, size_t]           B_t transposed (so the update is a row axpy), scaled
//   starts [targets]                where target t's columns begin in y
//   rows   int64 [N]                token rows, grouped: group g is rows[begin_g, end_g)
//   groups int64 [G, 3]             (slot, begin, end)
//   active bool [S, targets]        whether slot s updates target t
// Sums are float32; y is read, added to and rounded once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int64_t kTile = 4;     // rows computed together: each weight vector loaded once for them
constexpr int64_t kChunk = 256;  // output columns a phase-2 work item covers

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

// h[r][k] = sum_i x[r][i] * w[k][i] for the n <= kTile rows of xf (float, rows of length d)
// and the n_k rows of w; h rows are `width` apart.
template <int64_t n, typename T>
void shrink_n(const float* xf, const T* w, int64_t d, int64_t n_k, float* h, int64_t width) {
  for (int64_t k = 0; k < n_k; ++k) {
    const T* wk = w + k * d;
    int64_t i = 0;
    float sums[n] = {};
#ifdef BATCHPAGE_AVX2
    __m256 acc[n];
    for (int64_t r = 0; r < n; ++r) acc[r] = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) {
      const __m256 wv = load8(wk + i);
      for (int64_t r = 0; r < n; ++r) acc[r] = _mm256_fmadd_ps(load8(xf + r * d + i), wv, acc[r]);
    }
    for (int64_t r = 0; r < n; ++r) sums[r] = hsum(acc[r]);
#endif
    for (; i < d; ++i) {
      const float wv = f32(wk[i]);
      for (int64_t r = 0; r < n; ++r) sums[r] += xf[r * d + i] * wv;
    }
    for (int64_t r = 0; r < n; ++r) h[r * width + k] = sums[r];
  }
}

// The rows of a tile (n <= kTile) with the row count known at compile time, so that the
// accumulators stay in registers.
template <typename T>
void shrink(const float* xf, int64_t n, const T* w, int64_t d, int64_t n_k, float* h,
            int64_t width) {
  switch (n) {
    case 4: return shrink_n<4>(xf, w, d, n_k, h, width);
    case 3: return shrink_n<3>(xf, w, d, n_k, h, width);
    case 2: return shrink_n<2>(xf, w, d, n_k, h, width);
    default: return shrink_n<1>(xf, w, d, n_k, h, width);
  }
}

// y[r][o] += sum_j h[r][j] * b[j][o] for the n <= kTile rows and o < n_o (b rows `size` apart).
template <int64_t n, typename T>
void expand_n(const float* const* h, const T* b, int64_t size, int64_t rank, int64_t n_o,
              T* const* y) {
  int64_t o = 0;
#ifdef BATCHPAGE_AVX2
  for (; o + 8 <= n_o; o += 8) {
    __m256 acc[n];
    for (int64_t r = 0; r < n; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
      const __m256 bv = load8(b + j * size + o);
      for (int64_t r = 0; r < n; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h[r][j]), bv, acc[r]);
    }
    for (int64_t r = 0; r < n; ++r) store8(y[r] + o, _mm256_add_ps(load8(y[r] + o), acc[r]));
  }
#endif
  for (; o < n_o; ++o) {
    for (int64_t r = 0; r < n; ++r) {
      float acc = 0.f;
      for (int64_t j = 0; j < rank; ++j) acc += h[r][j] * f32(b[j * size + o]);
      y[r][o] = static_cast<T>(f32(y[r][o]) + acc);
    }
  }
}

template <typename T>
void expand(const float* const* h, int64_t n, const T* b, int64_t size, int64_t rank,
            int64_t n_o, T* const* y) {
  switch (n) {
    case 4: return expand_n<4>(h, b, size, rank, n_o, y);
    case 3: return expand_n<3>(h, b, size, rank, n_o, y);
    case 2: return expand_n<2>(h, b, size, rank, n_o, y);
    default: return expand_n<1>(h, b, size, rank, n_o, y);
  }
}

template <typename T>
void lora_apply_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                     const std::vector<at::Tensor>& bt, const std::vector<int64_t>& starts,
                     const at::Tensor& rows, const at::Tensor& groups, const at::Tensor& active) {
  const int64_t d_in = x.size(1), d_out = y.size(1);
  const int64_t n_targets = static_cast<int64_t>(bt.size());
  const int64_t rank = bt[0].size(1);
  const int64_t n_groups = groups.size(0);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t* g = groups.data_ptr<int64_t>();
  const bool* act = active.data_ptr<bool>();
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const int64_t a_slot = a.size(1) * d_in;
  const int64_t width = n_targets * rank;

  // Work items: tiles of up to kTile rows of one group.
  std::vector<int64_t> tile_group, tile_begin;
  for (int64_t gi = 0; gi < n_groups; ++gi) {
    for (int64_t i = g[3 * gi + 1]; i < g[3 * gi + 2]; i += kTile) {
      tile_group.push_back(gi);
      tile_begin.push_back(i);
    }
  }
  const int64_t n_tiles = static_cast<int64_t>(tile_group.size());
  const int64_t n_rows = rows.size(0);

  // Phase 1: h[i] = x[rows[i]] @ A_slot.T over the active targets, a tile at a time.
  std::vector<float> h(n_rows * width, 0.f);
  at::parallel_for(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(kTile * d_in);
    for (int64_t ti = begin; ti < end; ++ti) {
      const int64_t gi = tile_group[ti], i0 = tile_begin[ti], slot = g[3 * gi];
      const int64_t n = std::min(kTile, g[3 * gi + 2] - i0);
      for (int64_t r = 0; r < n; ++r) {
        const T* xr = xp + row_ids[i0 + r] * d_in;
        for (int64_t c = 0; c < d_in; ++c) xf[r * d_in + c] = f32(xr[c]);
      }
      for (int64_t t = 0; t < n_targets; ++t) {
        if (!act[slot * n_targets + t]) continue;
        shrink(xf.data(), n, ap + slot * a_slot + t * rank * d_in, d_in, rank,
               h.data() + i0 * width + t * rank, width);
      }
    }
  });

  // Phase 2, by (target, column chunk): y[row, cols] += h_t[row] @ B_t[slot][:, cols].
  std::vector<int64_t> chunk_target, chunk_col;
  for (int64_t t = 0; t < n_targets; ++t) {
    for (int64_t c = 0; c < bt[t].size(2); c += kChunk) {
      chunk_target.push_back(t);
      chunk_col.push_back(c);
    }
  }
  const int64_t n_chunks = static_cast<int64_t>(chunk_target.size());
  at::parallel_for(0, n_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ci = begin; ci < end; ++ci) {
      const int64_t t = chunk_target[ci], c0 = chunk_col[ci];
      const int64_t size = bt[t].size(2), n_o = std::min(kChunk, size - c0);
      const T* bp = bt[t].data_ptr<T>();
      for (int64_t ti = 0; ti < n_tiles; ++ti) {
        const int64_t gi = tile_group[ti], i0 = tile_begin[ti], slot = g[3 * gi];
        if (!act[slot * n_targets + t]) continue;
        const int64_t n = std::min(kTile, g[3 * gi + 2] - i0);
        const float* hs[kTile];
        T* ys[kTile];
        for (int64_t r = 0; r < n; ++r) {
          hs[r] = h.data() + (i0 + r) * width + t * rank;
          ys[r] = yp + row_ids[i0 + r] * d_out + starts[t] + c0;
        }
        expand(hs, n, bp + slot * rank * size + c0, size, rank, n_o, ys);
      }
    }
  });
}

void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& a,
                const std::vector<at::Tensor>& bt, const std::vector<int64_t>& starts,
                const at::Tensor& rows, const at::Tensor& groups, const at::Tensor& active) {
  if (y.scalar_type() == at::kFloat) {
    lora_apply_impl<float>(y, x, a, bt, starts, rows, groups, active);
  } else if (y.scalar_type() == at::kBFloat16) {
    lora_apply_impl<c10::BFloat16>(y, x, a, bt, starts, rows, groups, active);
  } else {
    TORCH_CHECK(false, "lora_apply: float32 or bfloat16 only");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_apply", &lora_apply, "many adapters' LoRA updates added to y, grouped by slot");
}

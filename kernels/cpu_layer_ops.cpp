// The elementwise parts of a decoder layer for CPUs, each one pass over its rows: RMSNorm (alone
// or after the residual add), SiLU(gate) * up, and rope in place. Built and launched by
// cpu_layer_ops.py (see its docstring for why). Arithmetic is float32 whatever the tensors'
// dtype; results round to that dtype where the torch reference rounds, so bf16 and fp16 match it.
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

// Rows per task: a thread's share should outweigh waking it (about 16k elements).
static int64_t grain(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
}

template <typename T>
static inline float f32(T v) {
  return static_cast<float>(v);
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)): float32 statistics, the normalised row rounded
// to the model dtype before the scale (HF's RMSNorm, and RMSNorm in model/layers.py).
template <typename T>
static void norm_row(T* out, const float* x, const T* w, int64_t dim, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < dim; ++d) ss += x[d] * x[d];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<T>(f32(w[d]) * f32(static_cast<T>(x[d] * r)));
}

void rms_norm(torch::Tensor out,     // [N, D], contiguous
              torch::Tensor x,       // [N, D], row stride x.stride(0)
              torch::Tensor weight,  // [D]
              double eps) {
  const int64_t n = x.size(0), dim = x.size(1), row = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(dim), [&](int64_t begin, int64_t end) {
      std::vector<float> xf(dim);
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* xi = xp + i * row;
        for (int64_t d = 0; d < dim; ++d) xf[d] = f32(xi[d]);
        norm_row(op + i * dim, xf.data(), w, dim, static_cast<float>(eps));
      }
    });
  });
}

// total = T(x + residual), the new residual stream; out = RMSNorm(total).
void add_rms_norm(torch::Tensor out,       // [N, D], contiguous
                  torch::Tensor total,     // [N, D], contiguous
                  torch::Tensor x,         // [N, D], row stride x.stride(0)
                  torch::Tensor residual,  // [N, D], row stride residual.stride(0)
                  torch::Tensor weight,    // [D]
                  double eps) {
  const int64_t n = x.size(0), dim = x.size(1), xrow = x.stride(0), rrow = residual.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* tp = total.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(dim), [&](int64_t begin, int64_t end) {
      std::vector<float> sf(dim);
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t *xi = xp + i * xrow, *ri = rp + i * rrow;
        scalar_t* ti = tp + i * dim;
        for (int64_t d = 0; d < dim; ++d) {
          ti[d] = static_cast<scalar_t>(f32(xi[d]) + f32(ri[d]));
          sf[d] = f32(ti[d]);
        }
        norm_row(op + i * dim, sf.data(), w, dim, static_cast<float>(eps));
      }
    });
  });
}

// out[i] = T(T(silu(gate[i])) * up[i]): torch's F.silu(gate) * up, rounding after each op.
template <typename T>
static void silu_mul_row(T* out, const T* gate, const T* up, int64_t n, float* act) {
  int64_t i = 0;
#ifdef BATCHPAGE_AVX2
  if constexpr (!std::is_same_v<T, double>) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 g = load8(gate + i);
      _mm256_storeu_ps(act + i, _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g)))));
    }
  }
#endif
  for (; i < n; ++i) act[i] = f32(gate[i]) / (1.f + std::exp(-f32(gate[i])));
  for (i = 0; i < n; ++i) out[i] = static_cast<T>(f32(static_cast<T>(act[i])) * f32(up[i]));
}

void silu_mul(torch::Tensor out,       // [N, I], contiguous
              torch::Tensor gate_up) {  // [N, 2I]: gate then up, row stride gate_up.stride(0)
  const int64_t n = out.size(0), inter = out.size(1), row = gate_up.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(inter), [&](int64_t begin, int64_t end) {
      std::vector<float> act(inter);
      for (int64_t i = begin; i < end; ++i)
        silu_mul_row(op + i * inter, gp + i * row, gp + i * row + inter, inter, act.data());
    });
  });
}

// Rotate-half rope on the first 2 * half dimensions of every head of one row, in place:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); the dimensions past 2 * half are left alone.
template <typename T>
static void rope_row(T* x, int64_t heads, int64_t dim, const float* c, const float* s,
                     int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * dim;
    T* x2 = x1 + half;  // x1[0, half) and x2[0, half) never overlap
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float a = f32(x1[j]), b = f32(x2[j]);
      x1[j] = static_cast<T>(a * c[j] - b * s[j]);
      x2[j] = static_cast<T>(b * c[j] + a * s[j]);
    }
  }
}

void rope(torch::Tensor x,      // [N, H, D], row stride x.stride(0), heads dense
          torch::Tensor cos,    // float32 [N, half], contiguous
          torch::Tensor sin) {  // float32 [N, half], contiguous
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2), row = x.stride(0);
  const int64_t half = cos.size(1);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        rope_row(xp + i * row, heads, dim, cp + i * half, sp + i * half, half);
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm of the sum");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("rope", &rope, "rotate-half rope, in place");
}

// The elementwise parts of a decoder layer for CPUs, each one pass over its rows: RMSNorm (alone
// or after the residual add), SiLU(gate) * up, and rope in place. Built and launched by
// cpu_layer_ops.py (see its docstring for why). Arithmetic is float32 whatever the tensors'
// dtype; results round to that dtype where the torch reference rounds, so bf16 and fp16 match it.
// Each has an 8-lane path (cpu_vec.h: load8 widens, store8 and round8 round to nearest even, as
// c10 does) and a plain loop for the tail and for double.
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

// The AVX2 paths take float32, bf16 and fp16 (load8 / store8 / round8 in cpu_vec.h); double
// takes the plain loops.
template <typename T>
constexpr bool kVector =
#ifdef BATCHPAGE_AVX2
    !std::is_same_v<T, double>;
#else
    false;
#endif

// out = weight * T(x * rsqrt(mean(x^2) + eps)): float32 statistics, the normalised row rounded
// to the model dtype before the scale (HF's RMSNorm, and RMSNorm in model/layers.py).
template <typename T>
static void norm_row(T* out, const T* x, const T* w, int64_t dim, float eps) {
  float ss = 0.f;
  int64_t d = 0;
#ifdef BATCHPAGE_AVX2
  if constexpr (kVector<T>) {
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= dim; d += 8) {
      const __m256 v = load8(x + d);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum(acc);
  }
#endif
  for (; d < dim; ++d) ss += f32(x[d]) * f32(x[d]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  d = 0;
#ifdef BATCHPAGE_AVX2
  if constexpr (kVector<T>) {
    const __m256 r8 = _mm256_set1_ps(r);
    for (; d + 8 <= dim; d += 8)
      store8(out + d, _mm256_mul_ps(load8(w + d), round8<T>(_mm256_mul_ps(load8(x + d), r8))));
  }
#endif
  for (; d < dim; ++d) out[d] = static_cast<T>(f32(w[d]) * f32(static_cast<T>(f32(x[d]) * r)));
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
      for (int64_t i = begin; i < end; ++i)
        norm_row(op + i * dim, xp + i * row, w, dim, static_cast<float>(eps));
    });
  });
}

template <typename T>
static void add_row(T* out, const T* x, const T* y, int64_t dim) {
  int64_t d = 0;
#ifdef BATCHPAGE_AVX2
  if constexpr (kVector<T>)
    for (; d + 8 <= dim; d += 8) store8(out + d, _mm256_add_ps(load8(x + d), load8(y + d)));
#endif
  for (; d < dim; ++d) out[d] = static_cast<T>(f32(x[d]) + f32(y[d]));
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
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t *xi = xp + i * xrow, *ri = rp + i * rrow;
        scalar_t* ti = tp + i * dim;
        add_row(ti, xi, ri, dim);
        norm_row(op + i * dim, ti, w, dim, static_cast<float>(eps));  // the rounded sum's norm
      }
    });
  });
}

// out[i] = T(T(silu(gate[i])) * up[i]): torch's F.silu(gate) * up, rounding after each op.
template <typename T>
static void silu_mul_row(T* out, const T* gate, const T* up, int64_t n, float* act) {
  int64_t i = 0;
#ifdef BATCHPAGE_AVX2
  if constexpr (kVector<T>) {
    // Two passes: the exp and the division of a whole row first, with nothing waiting on them
    // (in 16 lanes where AVX-512 has them: exp16 is exp8's polynomial, so the same values).
#ifdef BATCHPAGE_AVX512
    const __m512 one16 = _mm512_set1_ps(1.f), zero16 = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 g = load16(gate + i);
      _mm512_storeu_ps(act + i,
                       _mm512_div_ps(g, _mm512_add_ps(one16, exp16(_mm512_sub_ps(zero16, g)))));
    }
#endif
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 g = load8(gate + i);
      _mm256_storeu_ps(act + i, _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g)))));
    }
    for (int64_t j = 0; j < i; j += 8)
      store8(out + j, _mm256_mul_ps(round8<T>(_mm256_loadu_ps(act + j)), load8(up + j)));
  }
#endif
  for (; i < n; ++i) {
    const float a = f32(gate[i]) / (1.f + std::exp(-f32(gate[i])));
    out[i] = static_cast<T>(f32(static_cast<T>(a)) * f32(up[i]));
  }
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
    int64_t j = 0;
#ifdef BATCHPAGE_AVX2
    if constexpr (kVector<T>)
      for (; j + 8 <= half; j += 8) {
        const __m256 a = load8(x1 + j), b = load8(x2 + j);
        const __m256 cj = _mm256_loadu_ps(c + j), sj = _mm256_loadu_ps(s + j);
        store8(x1 + j, _mm256_sub_ps(_mm256_mul_ps(a, cj), _mm256_mul_ps(b, sj)));
        store8(x2 + j, _mm256_add_ps(_mm256_mul_ps(b, cj), _mm256_mul_ps(a, sj)));
      }
#endif
    for (; j < half; ++j) {
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

// The index of a row's largest value, the first one on ties; a NaN counts as larger than any
// number (torch.argmax's rule). Two passes: the maximum in 8-lane vectors (four accumulators,
// so the max latency does not serialise the loop), then the first index holding it. bf16 and
// fp16 widen exactly to float32, so their argmax is that of the float32 copy, without the copy.
template <typename T>
static int64_t argmax_row(const T* x, int64_t v) {
  float top = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#ifdef BATCHPAGE_AVX2
  if constexpr (kVector<T>) {
    __m256 m[4], bad = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) m[k] = _mm256_set1_ps(-INFINITY);
    for (; i + 32 <= v; i += 32)
      for (int k = 0; k < 4; ++k) {
        const __m256 a = load8(x + i + 8 * k);
        m[k] = _mm256_max_ps(m[k], a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    top = *std::max_element(lanes, lanes + 8);
    nan = _mm256_movemask_ps(bad) != 0;
  }
#endif
  for (; i < v; ++i) {
    const float a = f32(x[i]);
    nan = nan || std::isnan(a);
    top = std::max(top, a);
  }
  if (nan) return std::find_if(x, x + v, [](T a) { return std::isnan(f32(a)); }) - x;
  i = 0;
#ifdef BATCHPAGE_AVX2
  if constexpr (kVector<T>) {
    const __m256 top8 = _mm256_set1_ps(top);
    for (; i + 8 <= v; i += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), top8, _CMP_EQ_OQ));
      if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
    }
  }
#endif
  for (; i < v; ++i)
    if (f32(x[i]) == top) return i;
  return 0;  // every value is -inf: the first, as torch
}

void argmax_rows(torch::Tensor out,  // int64 [N]
                 torch::Tensor x) {  // float32, bf16 or fp16 [N, V], row stride x.stride(0)
  const int64_t n = x.size(0), v = x.size(1), row = x.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) op[i] = argmax_row(xp + i * row, v);
    });
  });
}

// MurmurHash3's 32-bit finaliser: every input bit moves every output bit.
static inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// The exponential race of one row with counter-based noise (batchpage/engine/sampler.py,
// exponential_race, is the reference): the token v maximising p[v] / E[v], E[v] = -log(u),
// u = ((h >> 9) + 0.5) / 2^23, h = fmix32(key ^ v * 0x9E3779B9): the first on ties, tokens of
// zero probability never. One pass, no noise tensor.
static int64_t race_row(const float* p, int64_t v, uint32_t key) {
  float top = 0.0f;
  int64_t best = 0;
  for (int64_t i = 0; i < v; ++i) {
    const float q = p[i];
    if (!(q > 0.0f)) continue;
    const uint32_t h = fmix32(key ^ (static_cast<uint32_t>(i) * 0x9E3779B9u));
    const float u = (static_cast<float>(h >> 9) + 0.5f) * 0x1p-23f;
    const float s = q / -std::log(u);
    if (s > top) {
      top = s;
      best = i;
    }
  }
  return best;
}

void race_rows(torch::Tensor out,     // int64 [N]
               torch::Tensor probs,   // float32 [N, V], row stride probs.stride(0)
               torch::Tensor keys) {  // int64 [N]: 32-bit keys
  const int64_t n = probs.size(0), v = probs.size(1), row = probs.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  const float* pp = probs.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      op[i] = race_row(pp + i * row, v, static_cast<uint32_t>(kp[i]));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm of the sum");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("rope", &rope, "rotate-half rope, in place");
  m.def("argmax_rows", &argmax_rows, "each row's argmax (torch.argmax's ties and NaN)");
  m.def("race_rows", &race_rows, "each row's exponential race with counter-based noise");
}

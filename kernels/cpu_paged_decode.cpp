// Paged decode attention for CPUs; built and launched by cpu_paged_decode.py (see its docstring
// for the design). Torch's JIT extension loader compiles this file as it is.
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// Requests the cache lines of [p, p + bytes). The next block sits at a random place in the
// pool, where the hardware prefetcher cannot guess it: each token of the current block asks for
// the same token of the next block, so the requests are spread evenly over the compute.
static inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// float32 with a head_dim that is a multiple of 16 takes explicit 16-lane vectors: a dot product
// as a few independent FMAs and one shuffle-tree sum, and the PV accumulator of a head held in
// registers across a block. (The plain loops below chain every FMA of a dot product through one
// accumulator and are bound by its latency.) Other dtypes and head_dims use the plain loops.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

static inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline float hsum(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// DIM > 0: head_dim known at compile time, so the d loops unroll into whole vector registers;
// DIM == 0: any head_dim, read from dim_arg.
template <typename scalar_t, int DIM>
static void decode_rows(
    scalar_t* out,                  // [N, H, D], row stride out_row
    const scalar_t* q,              // [N, H, D], row stride q_row
    const scalar_t* k_cache,        // [num_blocks, BS, KVH, D], contiguous
    const scalar_t* v_cache,        // [num_blocks, BS, KVH, D], contiguous
    const int32_t* block_tables,    // [N, max_blocks], contiguous
    const int32_t* seq_lens,        // [N]
    int64_t n_rows, int64_t heads, int64_t kv_heads, int64_t dim_arg, int64_t block_size,
    int64_t max_blocks, int64_t q_row, int64_t out_row, float scale,
    int64_t window,   // > 0: the row sees its last `window` positions only; 0: all of them
    float softcap) {  // > 0: scores become softcap * tanh(score / softcap); 0: none
  const int64_t dim = DIM > 0 ? DIM : dim_arg;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;  // a token holds all kv heads, contiguously
  const int64_t block_stride = block_size * token_stride;
  const int64_t token_bytes = token_stride * static_cast<int64_t>(sizeof(scalar_t));
  constexpr bool kVector = std::is_same_v<scalar_t, float> && DIM > 0 && DIM % 16 == 0;
  constexpr int C = kVector ? DIM / 16 : 1;  // vectors per head
  // One task per sequence: a block is then one contiguous run of memory, read front to back.
  // Contexts differ in length (and the batch lists the oldest, longest ones first), so the
  // threads take sequences one at a time rather than in equal contiguous shares.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qf(heads * dim), acc(heads * dim), inv_sum(heads), scores;
    std::vector<f32x16> qv(kVector ? heads * C : 0), accv(kVector ? heads * C : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < n_rows; ++n) {
      const int64_t seq_len = seq_lens[n];
      // The window is [lo, seq_len): blocks before lo's block are never touched, and lo's own
      // block is read from lo on. Scores are indexed from lo, so `len` is the span's length.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const int64_t len = seq_len - lo;
      const int64_t first_block = lo / block_size;
      const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
      const int32_t* table = block_tables + n * max_blocks;
      const scalar_t* qn = q + n * q_row;
      for (int64_t i = 0; i < heads * dim; ++i) qf[i] = static_cast<float>(qn[i]) * scale;
      if constexpr (kVector)
        for (int64_t i = 0; i < heads * C; ++i) qv[i] = load16(qf.data() + i * 16);
      scores.resize(heads * len);  // [heads, len], position lo + t at t
      prefetch(k_cache + static_cast<int64_t>(table[first_block]) * block_stride, 2 * token_bytes);
      for (int64_t b = first_block; b < num_blocks; ++b) {
        const scalar_t* kb = k_cache + static_cast<int64_t>(table[b]) * block_stride;
        const scalar_t* knext =
            k_cache + static_cast<int64_t>(table[std::min(b + 1, num_blocks - 1)]) * block_stride;
        // t0: the block's first position as a score index (negative in lo's block)
        const int64_t t0 = b * block_size - lo, used = std::min(block_size, len - t0);
        for (int64_t j = std::max<int64_t>(0, -t0); j < used; ++j) {
          const scalar_t* kt = kb + j * token_stride;
          prefetch(knext + j * token_stride, token_bytes);
          if constexpr (kVector) {
            for (int64_t h = 0; h < kv_heads; ++h) {
              f32x16 kc[C];
              for (int c = 0; c < C; ++c) kc[c] = load16(kt + h * DIM + c * 16);
              for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
                const f32x16* qh = qv.data() + hq * C;
                f32x16 a = qh[0] * kc[0];
                for (int c = 1; c < C; ++c) a += qh[c] * kc[c];
                scores[hq * len + t0 + j] = hsum(a);
              }
            }
            continue;
          }
          for (int64_t hq = 0; hq < heads; ++hq) {
            const float* qh = qf.data() + hq * dim;
            const scalar_t* kh = kt + (hq / group) * dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; ++d) s += qh[d] * static_cast<float>(kh[d]);
            scores[hq * len + t0 + j] = s;
          }
        }
      }
      if (softcap > 0.f) {
        const float inv_cap = 1.f / softcap;
        for (int64_t i = 0; i < heads * len; ++i)
          scores[i] = softcap * std::tanh(scores[i] * inv_cap);
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        float* sh = scores.data() + hq * len;
        const float top = *std::max_element(sh, sh + len);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
          sh[t] = std::exp(sh[t] - top);
          total += sh[t];
        }
        inv_sum[hq] = 1.f / total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      if constexpr (kVector) std::fill(accv.begin(), accv.end(), f32x16{});
      prefetch(v_cache + static_cast<int64_t>(table[first_block]) * block_stride, 2 * token_bytes);
      for (int64_t b = first_block; b < num_blocks; ++b) {
        const scalar_t* vb = v_cache + static_cast<int64_t>(table[b]) * block_stride;
        const scalar_t* vnext =
            v_cache + static_cast<int64_t>(table[std::min(b + 1, num_blocks - 1)]) * block_stride;
        const int64_t t0 = b * block_size - lo, used = std::min(block_size, len - t0);
        const int64_t j0 = std::max<int64_t>(0, -t0);  // lo's block: from lo on
        if constexpr (kVector) {
          const int64_t slice = (used * token_bytes + heads - 1) / heads;
          for (int64_t hq = 0; hq < heads; ++hq) {
            prefetch(reinterpret_cast<const char*>(vnext) + hq * slice, slice);
            f32x16 a[C];
            for (int c = 0; c < C; ++c) a[c] = accv[hq * C + c];
            const float* vh = vb + (hq / group) * DIM;
            const float* ph = scores.data() + hq * len + t0 + j0;  // position of token j0
            for (int64_t j = j0; j < used; ++j)
              for (int c = 0; c < C; ++c)
                a[c] += ph[j - j0] * load16(vh + j * token_stride + c * 16);
            for (int c = 0; c < C; ++c) accv[hq * C + c] = a[c];
          }
          continue;
        }
        for (int64_t j = j0; j < used; ++j) {
          const scalar_t* vt = vb + j * token_stride;
          prefetch(vnext + j * token_stride, token_bytes);
          for (int64_t hq = 0; hq < heads; ++hq) {
            const float p = scores[hq * len + t0 + j];
            const scalar_t* vh = vt + (hq / group) * dim;
            float* ah = acc.data() + hq * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ah[d] += p * static_cast<float>(vh[d]);
          }
        }
      }
      if constexpr (kVector)
        for (int64_t i = 0; i < heads * C; ++i) std::memcpy(acc.data() + i * 16, &accv[i], 64);
      scalar_t* on = out + n * out_row;
      for (int64_t hq = 0; hq < heads; ++hq)
        for (int64_t d = 0; d < dim; ++d)
          on[hq * dim + d] = static_cast<scalar_t>(acc[hq * dim + d] * inv_sum[hq]);
    }
  }
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                  double scale, int64_t window, double softcap) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto dim_tag) {
      decode_rows<scalar_t, decltype(dim_tag)::value>(
          out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
          v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
          seq_lens.data_ptr<int32_t>(), q.size(0), q.size(1), k_cache.size(2), q.size(2),
          k_cache.size(1), block_tables.size(1), q.stride(0), out.stride(0),
          static_cast<float>(scale), window, static_cast<float>(softcap));
    };
    switch (q.size(2)) {
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      default: run(std::integral_constant<int, 0>{});
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a block-table KV pool");
}

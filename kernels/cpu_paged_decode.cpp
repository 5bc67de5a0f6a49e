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

#include "cpu_vec.h"

// Requests the cache lines of [p, p + bytes). The next block sits at a random place in the
// pool, where the hardware prefetcher cannot guess it, so the K pass asks for it in slices
// spread over its work on the current block. (A whole block in one burst at each block's start,
// in both passes, measured slower with `python -m jobs.bench.cpu_attention --baseline OLD.cpp`;
// asking for V again in the V pass slowed rows whose context sits in the caches, behind a shared
// prefix, and did not speed up long cold rows.)
static inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// The spread prefetch of a block's K pass: the next `chunk` bytes (at most) of the next K block
// (pk) and of this V block (pv), `issued` of their `bytes` having been asked for already.
static inline void prefetch_next(const char* pk, const char* pv, int64_t bytes, int64_t chunk,
                                 int64_t& issued) {
  if (issued >= bytes) return;
  const int64_t n = std::min(chunk, bytes - issued);
  prefetch(pk + issued, n);
  prefetch(pv + issued, n);
  issued += n;
}

// What one task needs to attend one decode row: its q (scaled, float32), where its context
// lives, and the span [lo, seq_len) that its window leaves.
struct Row {
  const float* q;        // [H, D], already multiplied by the softmax scale
  const int32_t* table;  // [max_blocks]: the row's physical blocks
  int64_t lo, len;       // the span starts at position lo and holds len positions
  int64_t first_block, num_blocks;
};

struct Shape {
  int64_t heads, kv_heads, dim, block_size;
  int64_t token_stride;  // kv_heads * dim: a token holds all kv heads, contiguously
  int64_t block_stride;  // block_size * token_stride
  float softcap;         // > 0: scores become softcap * tanh(score / softcap); 0: none
};

// Block b of a row: where it and the row's next block start in the pool (in elements), and which
// of its tokens the span uses: j0 <= j < used, score index t0 + j.
struct BlockSpan {
  int64_t offset, next_offset;
  int64_t t0;  // the block's first position as a score index (negative in lo's block)
  int64_t j0, used;
};

static inline BlockSpan block_span(const Row& row, const Shape& s, int64_t b) {
  const int64_t next = std::min(b + 1, row.num_blocks - 1);
  const int64_t t0 = b * s.block_size - row.lo;
  return {row.table[b] * s.block_stride, row.table[next] * s.block_stride, t0,
          std::max<int64_t>(0, -t0), std::min(s.block_size, row.len - t0)};
}

static inline void apply_softcap(float* scores, int64_t n, float softcap) {
  if (softcap <= 0.f) return;
  const float inv_cap = 1.f / softcap;
  for (int64_t i = 0; i < n; ++i) scores[i] = softcap * std::tanh(scores[i] * inv_cap);
}

// scores [H, len] -> softmax weights in place (unnormalised); inv_sum[h] = 1 / row sum.
static void softmax_rows(float* scores, float* inv_sum, int64_t heads, int64_t len,
                         float softcap);

// Whether QK multiplies bf16 q and k as stored, and PV the weights rounded to bf16 with v as stored
// (the AVX-512 path on a CPU with AVX512-BF16; every CPU path reads this flag).
#if defined(BATCHPAGE_AVX512) && defined(__AVX512BF16__)
template <typename scalar_t>
constexpr bool kBf16Dot = std::is_same_v<scalar_t, c10::BFloat16>;
#else
template <typename scalar_t>
constexpr bool kBf16Dot = false;
#endif

#ifdef BATCHPAGE_AVX2
// The AVX2 path (float32, bfloat16 and float16 caches; head_dim a multiple of 8 known at
// compile time). Every product and sum is float32, in 8-lane vectors:
// - QK: eight tokens' dot products at a time, each in its own accumulator, then one transposing
//   reduction (sum8) turns the eight accumulators into the eight scores;
// - softmax: a vector exp (exp8);
// - PV: a head's accumulator held in registers across a block.
// (load8, sum8, hsum and exp8 are in cpu_vec.h.)
static void softmax_rows(float* scores, float* inv_sum, int64_t heads, int64_t len,
                         float softcap) {
  apply_softcap(scores, heads * len, softcap);
  const int64_t whole = len / 8 * 8;
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * len;
    __m256 max8 = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < whole; t += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(s + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, max8);
    float top = *std::max_element(lanes, lanes + 8);
    for (int64_t t = whole; t < len; ++t) top = std::max(top, s[t]);
    const __m256 top8 = _mm256_set1_ps(top);
    __m256 total8 = _mm256_setzero_ps();
    for (int64_t t = 0; t < whole; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), top8));
      _mm256_storeu_ps(s + t, e);
      total8 = _mm256_add_ps(total8, e);
    }
    float total = hsum(total8);
    if (whole < len) {  // the tail through the same exp8, padded, so every weight rounds alike
      alignas(32) float tail[8] = {};
      std::copy(s + whole, s + len, tail);
      _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), top8)));
      for (int64_t t = whole; t < len; ++t) total += s[t] = tail[t - whole];
    }
    inv_sum[h] = 1.f / total;
  }
}

// C: 8-float vectors per head (head_dim / 8).
template <typename scalar_t, int C>
static void attend_row_avx2(float* out, const Row& row, const scalar_t* k_cache,
                            const scalar_t* v_cache, const Shape& s, float* scores,
                            float* inv_sum) {
  const int64_t group = s.heads / s.kv_heads, len = row.len;
  const int64_t token_bytes = s.token_stride * static_cast<int64_t>(sizeof(scalar_t));
  prefetch(k_cache + row.table[row.first_block] * s.block_stride, 2 * token_bytes);
  for (int64_t b = row.first_block; b < row.num_blocks; ++b) {
    const scalar_t* kb = k_cache + row.table[b] * s.block_stride;
    const scalar_t* knext =
        k_cache + row.table[std::min(b + 1, row.num_blocks - 1)] * s.block_stride;
    // t0: the block's first position as a score index (negative in lo's block)
    const int64_t t0 = b * s.block_size - row.lo, used = std::min(s.block_size, len - t0);
    int64_t j = std::max<int64_t>(0, -t0);
    // Spread over the block's (8-token group, head) steps: the next K block, and this V block,
    // which then waits in L2 or L3 for the V pass.
    const char* pk = reinterpret_cast<const char*>(knext);
    const char* pv = reinterpret_cast<const char*>(v_cache + row.table[b] * s.block_stride);
    const int64_t bytes = used * token_bytes;
    const int64_t steps = std::max<int64_t>(1, (used / 8) * s.heads);
    const int64_t chunk = ((bytes + steps - 1) / steps + 63) / 64 * 64;
    int64_t issued = 0;
    for (; j + 8 <= used; j += 8) {
      for (int64_t hq = 0; hq < s.heads; ++hq) {
        prefetch_next(pk, pv, bytes, chunk, issued);
        const scalar_t* kh = kb + j * s.token_stride + (hq / group) * C * 8;
        const float* qh = row.q + hq * C * 8;
        __m256 acc[8];
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
        for (int c = 0; c < C; ++c) {
          const __m256 qc = _mm256_loadu_ps(qh + c * 8);
          for (int t = 0; t < 8; ++t)
            acc[t] = _mm256_fmadd_ps(qc, load8(kh + t * s.token_stride + c * 8), acc[t]);
        }
        _mm256_storeu_ps(scores + hq * len + t0 + j, sum8(acc));
      }
    }
    for (; j < used; ++j) {
      prefetch_next(pk, pv, bytes, bytes, issued);  // the rest at once
      for (int64_t hq = 0; hq < s.heads; ++hq) {
        const scalar_t* kh = kb + j * s.token_stride + (hq / group) * C * 8;
        const float* qh = row.q + hq * C * 8;
        __m256 acc = _mm256_setzero_ps();
        for (int c = 0; c < C; ++c)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c * 8), load8(kh + c * 8), acc);
        scores[hq * len + t0 + j] = hsum(acc);
      }
    }
  }
  softmax_rows(scores, inv_sum, s.heads, len, s.softcap);
  // A head's accumulator lives in registers for a whole block, at most 8 vectors at a time
  // (AVX2 has 16 registers).
  constexpr int CH = C < 8 ? C : 8;
  static_assert(C % CH == 0, "head_dim / 8 must split into chunks of CH vectors");
  std::fill(out, out + s.heads * C * 8, 0.f);
  for (int64_t b = row.first_block; b < row.num_blocks; ++b) {
    const scalar_t* vb = v_cache + row.table[b] * s.block_stride;
    const int64_t t0 = b * s.block_size - row.lo, used = std::min(s.block_size, len - t0);
    const int64_t j0 = std::max<int64_t>(0, -t0);  // lo's block: from lo on
    for (int64_t hq = 0; hq < s.heads; ++hq) {
      const scalar_t* vh = vb + (hq / group) * C * 8;
      const float* ph = scores + hq * len + t0;  // ph[j]: the weight of the block's token j
      for (int c0 = 0; c0 < C; c0 += CH) {
        float* oh = out + hq * C * 8 + c0 * 8;
        __m256 a[CH];
        for (int c = 0; c < CH; ++c) a[c] = _mm256_loadu_ps(oh + c * 8);
        for (int64_t j = j0; j < used; ++j) {
          const __m256 p = _mm256_broadcast_ss(ph + j);
          const scalar_t* vt = vh + j * s.token_stride + c0 * 8;
          for (int c = 0; c < CH; ++c) a[c] = _mm256_fmadd_ps(p, load8(vt + c * 8), a[c]);
        }
        for (int c = 0; c < CH; ++c) _mm256_storeu_ps(oh + c * 8, a[c]);
      }
    }
  }
  for (int64_t hq = 0; hq < s.heads; ++hq) {
    const __m256 inv = _mm256_set1_ps(inv_sum[hq]);
    for (int c = 0; c < C; ++c) {
      float* o = out + (hq * C + c) * 8;
      _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), inv));
    }
  }
}

#if defined(BATCHPAGE_AVX512) && defined(__AVX512BF16__)
// PV of NH query heads of one kv head over one block's tokens [j0, used), by vdpbf16ps over
// token pairs (j, j + 1): a lane holds the pair's two values of one head dimension
// (vpunpck{l,h}wd of the two rows, which leaves each 32 dims in the order 0-3, 8-11, 16-19,
// 24-27 | 4-7, 12-15, 20-23, 28-31), the weight register the pair's two bf16 weights (an odd
// last token pairs with a zero weight and a zero value). The pair is unpacked once for the NH
// heads; their NH * C accumulators stay in registers across the block.
template <int C, int NH>
static inline void pv_dot_block(float* out,                 // [NH, C * 16], that order
                                const c10::BFloat16* v,     // token j0's values, this kv head
                                int64_t token_stride,
                                const uint16_t* w,          // [NH, len]: weights from j0 on
                                int64_t len, int64_t count) {
  __m512 acc[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_loadu_ps(out + h * C * 16 + c * 16);
  for (int64_t j = 0; j < count; j += 2) {
    const bool two = j + 1 < count;
    const c10::BFloat16* vt = v + j * token_stride;
    __m512i vp[C];
    for (int c = 0; c < C; c += 2) {
      const __m512i x = _mm512_loadu_si512(vt + c * 16);
      const __m512i y =
          two ? _mm512_loadu_si512(vt + token_stride + c * 16) : _mm512_setzero_si512();
      vp[c] = _mm512_unpacklo_epi16(x, y);
      vp[c + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int h = 0; h < NH; ++h) {
      int32_t pair = w[h * len + j];  // the odd last token: its weight and a zero one
      if (two) std::memcpy(&pair, w + h * len + j, sizeof(pair));
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], (__m512bh)vp[c], p);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + h * C * 16 + c * 16, acc[h][c]);
}

// PV of a bf16 row with its weights rounded to bf16 (as HF's bf16 attention rounds them before
// its PV matmul) and v as stored. out: [H, D] float32 in pv_dot_block's order, unnormalised.
template <int C>
static void pv_dot(float* out, const Row& row, const c10::BFloat16* v_cache, const Shape& s,
                   const float* scores, uint16_t* pw) {
  constexpr int D = C * 16, HB = C <= 4 ? 16 / C : 1;  // at most 16 accumulators
  static_assert(HB <= 4, "the switch below covers batches of 1 to 4 heads");
  const int64_t group = s.heads / s.kv_heads, len = row.len, n = s.heads * len;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + i)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(pw + i, tail,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, scores + i)));
  }
  std::fill(out, out + s.heads * D, 0.f);
  for (int64_t b = row.first_block; b < row.num_blocks; ++b) {
    const BlockSpan sp = block_span(row, s, b);
    // Heads h0 .. h0 + nh - 1, all of one kv head.
    for (int64_t h0 = 0, nh = 0; h0 < s.heads; h0 += nh) {
      const int64_t g = h0 / group;
      nh = std::min<int64_t>(HB, (g + 1) * group - h0);
      const c10::BFloat16* v = v_cache + sp.offset + sp.j0 * s.token_stride + g * D;
      const uint16_t* w = pw + h0 * len + sp.t0 + sp.j0;
      const int64_t count = sp.used - sp.j0;
      float* o = out + h0 * D;
      switch (nh) {
        case 1: pv_dot_block<C, 1>(o, v, s.token_stride, w, len, count); break;
        case 2: pv_dot_block<C, 2>(o, v, s.token_stride, w, len, count); break;
        case 3: pv_dot_block<C, 3>(o, v, s.token_stride, w, len, count); break;
        default: pv_dot_block<C, HB>(o, v, s.token_stride, w, len, count);
      }
    }
  }
}
#endif

#ifdef BATCHPAGE_AVX512
// The AVX-512 path: the AVX2 path's structure in 16-lane vectors, sixteen tokens' scores at a
// time (sum16). With a bf16 cache on a CPU with AVX512-BF16, QK multiplies q and k as they are
// stored (vdpbf16ps: bf16 pairs, products and sums in float32, exact products), so K is never
// widened; the scale then applies to each score. Otherwise q is widened and pre-scaled.
// C: 16-float vectors per head (head_dim / 16). q_raw: the row's q as stored; row.q: it widened
// and scaled.
// pw: with the dot path, room for the row's weights in bf16 ([H, len]).
template <typename scalar_t, int C>
static void attend_row_avx512(float* out, const Row& row, const scalar_t* q_raw, float scale,
                              const scalar_t* k_cache, const scalar_t* v_cache, const Shape& s,
                              float* scores, float* inv_sum, uint16_t* pw) {
  constexpr bool dot = kBf16Dot<scalar_t>;
  constexpr int D = C * 16;
  const int64_t group = s.heads / s.kv_heads, len = row.len;
  const int64_t token_bytes = s.token_stride * static_cast<int64_t>(sizeof(scalar_t));
  const __m512 score_scale = _mm512_set1_ps(dot ? scale : 1.f);
  // The row's blocks into L2 up front, K and V, up to 256 KiB (a quarter of a Zen 4 core's L2):
  // many independent misses in flight at once, where the spread prefetches below keep one or
  // two blocks ahead, which is what rows read from memory wait on.
  const int64_t block_bytes = s.block_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t b = row.first_block, budget = 256 << 10; b < row.num_blocks && budget > 0;
       ++b, budget -= 2 * block_bytes) {
    const char* kp = reinterpret_cast<const char*>(k_cache + row.table[b] * s.block_stride);
    const char* vp = reinterpret_cast<const char*>(v_cache + row.table[b] * s.block_stride);
    for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(kp + off, _MM_HINT_T1);
    for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(vp + off, _MM_HINT_T1);
  }
  prefetch(k_cache + row.table[row.first_block] * s.block_stride, 2 * token_bytes);
  for (int64_t b = row.first_block; b < row.num_blocks; ++b) {
    const BlockSpan sp = block_span(row, s, b);
    const scalar_t* kb = k_cache + sp.offset;
    // Spread over the block's (16-token group, head) steps: the next K block, and this V block,
    // which then waits in L2 or L3 for the V pass.
    const char* pk = reinterpret_cast<const char*>(k_cache + sp.next_offset);
    const char* pv = reinterpret_cast<const char*>(v_cache + sp.offset);
    const int64_t bytes = sp.used * token_bytes;
    const int64_t steps = std::max<int64_t>(1, (sp.used / 16) * s.heads);
    const int64_t chunk = ((bytes + steps - 1) / steps + 63) / 64 * 64;
    int64_t issued = 0, j = sp.j0;
    for (; j + 16 <= sp.used; j += 16) {
      for (int64_t hq = 0; hq < s.heads; ++hq) {
        prefetch_next(pk, pv, bytes, chunk, issued);
        const scalar_t* kh = kb + j * s.token_stride + (hq / group) * D;
        __m512 acc[16];
        for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        if constexpr (dot) {
#if defined(__AVX512BF16__)
          for (int c = 0; c < C / 2; ++c) {  // 32 bf16 (16 pairs) a vector
            const __m512bh qc = (__m512bh)_mm512_loadu_si512(q_raw + hq * D + c * 32);
            for (int t = 0; t < 16; ++t) {
              const __m512i kt = _mm512_loadu_si512(kh + t * s.token_stride + c * 32);
              acc[t] = _mm512_dpbf16_ps(acc[t], qc, (__m512bh)kt);
            }
          }
#endif
        } else {
          for (int c = 0; c < C; ++c) {
            const __m512 qc = _mm512_loadu_ps(row.q + hq * D + c * 16);
            for (int t = 0; t < 16; ++t)
              acc[t] = _mm512_fmadd_ps(qc, load16(kh + t * s.token_stride + c * 16), acc[t]);
          }
        }
        _mm512_storeu_ps(scores + hq * len + sp.t0 + j, _mm512_mul_ps(sum16(acc), score_scale));
      }
    }
    for (; j < sp.used; ++j) {
      prefetch_next(pk, pv, bytes, bytes, issued);  // the rest at once
      for (int64_t hq = 0; hq < s.heads; ++hq) {
        const scalar_t* kh = kb + j * s.token_stride + (hq / group) * D;
        __m512 acc = _mm512_setzero_ps();
        if constexpr (dot) {
#if defined(__AVX512BF16__)
          for (int c = 0; c < C / 2; ++c)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q_raw + hq * D + c * 32),
                                   (__m512bh)_mm512_loadu_si512(kh + c * 32));
#endif
        } else {
          for (int c = 0; c < C; ++c)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(row.q + hq * D + c * 16), load16(kh + c * 16),
                                  acc);
        }
        scores[hq * len + sp.t0 + j] = _mm512_reduce_add_ps(acc) * (dot ? scale : 1.f);
      }
    }
  }
  softmax_rows(scores, inv_sum, s.heads, len, s.softcap);
  constexpr bool split = !dot && std::is_same_v<scalar_t, c10::BFloat16> && C % 2 == 0;
  if constexpr (dot) {
#if defined(__AVX512BF16__)
    pv_dot<C>(out, row, reinterpret_cast<const c10::BFloat16*>(v_cache), s, scores, pw);
#endif
  } else {
    // PV: a head's accumulators live in registers for a whole block, two tokens at a time into
    // two sets (2C independent FMA chains cover the FMA latency). A bf16 V is widened without
    // shuffles: a 32-bit lane holding dims (2i, 2i+1) gives dim 2i as lane << 16 and dim 2i+1 as
    // lane & 0xFFFF0000, so each 32-dim chunk accumulates as [16 even dims | 16 odd dims] and is
    // put back in order at the end (a widening vpmovzxwd per 16 dims was this loop's bottleneck).
    std::fill(out, out + s.heads * D, 0.f);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t b = row.first_block; b < row.num_blocks; ++b) {
      const BlockSpan sp = block_span(row, s, b);
      const scalar_t* vb = v_cache + sp.offset;
      for (int64_t hq = 0; hq < s.heads; ++hq) {
        const scalar_t* vh = vb + (hq / group) * D;
        const float* ph = scores + hq * len + sp.t0;  // ph[j]: the weight of the block's token j
        float* oh = out + hq * D;
        __m512 a[C], a2[C];
        for (int c = 0; c < C; ++c) {
          a[c] = _mm512_loadu_ps(oh + c * 16);
          a2[c] = _mm512_setzero_ps();
        }
        // acc[c] += p * (dims of vector c of token vt), in the layout above when split
        auto add_token = [&](__m512* acc, __m512 p, const scalar_t* vt) {
          if constexpr (split) {
            for (int c = 0; c < C; c += 2) {
              const __m512i raw = _mm512_loadu_si512(vt + c * 16);
              const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
              const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
              acc[c] = _mm512_fmadd_ps(p, even, acc[c]);
              acc[c + 1] = _mm512_fmadd_ps(p, odd, acc[c + 1]);
            }
          } else {
            for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p, load16(vt + c * 16), acc[c]);
          }
        };
        int64_t j = sp.j0;
        for (; j + 2 <= sp.used; j += 2) {
          const scalar_t* vt = vh + j * s.token_stride;
          add_token(a, _mm512_set1_ps(ph[j]), vt);
          add_token(a2, _mm512_set1_ps(ph[j + 1]), vt + s.token_stride);
        }
        if (j < sp.used) add_token(a, _mm512_set1_ps(ph[j]), vh + j * s.token_stride);
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(oh + c * 16, _mm512_add_ps(a[c], a2[c]));
      }
    }
  }
  // Normalise; a split chunk [e0..e15 | o0..o15] goes back to e0, o0, e1, o1, ...; an unpacked
  // one (the dot path: dims 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31) to 0, 1, 2, ...
  const __m512i lo_idx =
      dot ? _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0)
          : _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi_idx =
      dot ? _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8)
          : _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t hq = 0; hq < s.heads; ++hq) {
    const __m512 inv = _mm512_set1_ps(inv_sum[hq]);
    float* oh = out + hq * D;
    if constexpr (split || dot) {
      for (int c = 0; c < C; c += 2) {
        const __m512 even = _mm512_loadu_ps(oh + c * 16), odd = _mm512_loadu_ps(oh + c * 16 + 16);
        _mm512_storeu_ps(oh + c * 16,
                         _mm512_mul_ps(_mm512_permutex2var_ps(even, lo_idx, odd), inv));
        _mm512_storeu_ps(oh + c * 16 + 16,
                         _mm512_mul_ps(_mm512_permutex2var_ps(even, hi_idx, odd), inv));
      }
    } else {
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(oh + c * 16, _mm512_mul_ps(_mm512_loadu_ps(oh + c * 16), inv));
    }
  }
}
#endif  // BATCHPAGE_AVX512
#else
static void softmax_rows(float* scores, float* inv_sum, int64_t heads, int64_t len,
                         float softcap) {
  apply_softcap(scores, heads * len, softcap);
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores + h * len;
    const float top = *std::max_element(sh, sh + len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = std::exp(sh[t] - top);
      total += sh[t];
    }
    inv_sum[h] = 1.f / total;
  }
}
#endif

// Any dtype and head_dim, in plain loops (each dot product chained through one accumulator).
template <typename scalar_t>
static void attend_row_plain(float* out, const Row& row, const scalar_t* k_cache,
                             const scalar_t* v_cache, const Shape& s, float* scores,
                             float* inv_sum) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim, len = row.len;
  const int64_t token_bytes = s.token_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t b = row.first_block; b < row.num_blocks; ++b) {
    const BlockSpan sp = block_span(row, s, b);
    prefetch(k_cache + sp.next_offset, sp.used * token_bytes);
    for (int64_t j = sp.j0; j < sp.used; ++j) {
      const scalar_t* kt = k_cache + sp.offset + j * s.token_stride;
      for (int64_t hq = 0; hq < s.heads; ++hq) {
        const float* qh = row.q + hq * dim;
        const scalar_t* kh = kt + (hq / group) * dim;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < dim; ++d) acc += qh[d] * static_cast<float>(kh[d]);
        scores[hq * len + sp.t0 + j] = acc;
      }
    }
  }
  softmax_rows(scores, inv_sum, s.heads, len, s.softcap);
  std::fill(out, out + s.heads * dim, 0.f);
  for (int64_t b = row.first_block; b < row.num_blocks; ++b) {
    const BlockSpan sp = block_span(row, s, b);
    prefetch(v_cache + sp.next_offset, sp.used * token_bytes);
    for (int64_t j = sp.j0; j < sp.used; ++j) {
      const scalar_t* vt = v_cache + sp.offset + j * s.token_stride;
      for (int64_t hq = 0; hq < s.heads; ++hq) {
        const float p = scores[hq * len + sp.t0 + j];
        const scalar_t* vh = vt + (hq / group) * dim;
        float* oh = out + hq * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) oh[d] += p * static_cast<float>(vh[d]);
      }
    }
  }
  for (int64_t hq = 0; hq < s.heads; ++hq)
    for (int64_t d = 0; d < dim; ++d) out[hq * dim + d] *= inv_sum[hq];
}

// DIM > 0: head_dim known at compile time (the AVX2 path takes it); 0: any, the plain path.
template <typename scalar_t, int DIM>
static void decode_rows(
    scalar_t* out,                  // [N, H, D], row stride out_row
    const scalar_t* q,              // [N, H, D], row stride q_row
    const scalar_t* k_cache,        // [num_blocks, BS, KVH, D], contiguous
    const scalar_t* v_cache,        // [num_blocks, BS, KVH, D], contiguous
    const int32_t* block_tables,    // [N, max_blocks], contiguous
    const int32_t* seq_lens,        // [N]
    int64_t n_rows, const Shape& s, int64_t max_blocks, int64_t q_row, int64_t out_row,
    float scale,
    int64_t window) {  // > 0: the row sees its last `window` positions only; 0: all of them
  const int64_t hd = s.heads * s.dim;
  // One task per sequence: a block is then one contiguous run of memory, read front to back.
  // Contexts differ in length (and the batch lists the oldest, longest ones first), so the
  // threads take sequences one at a time rather than in equal contiguous shares.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qf(hd), acc(hd), inv_sum(s.heads), scores;
    std::vector<uint16_t> weights;  // the AVX-512 bf16 path's weights in bf16
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < n_rows; ++n) {
      const int64_t seq_len = seq_lens[n];
      // The window is [lo, seq_len): blocks before lo's block are never touched, and lo's own
      // block is read from lo on. Scores are indexed from lo, so `len` is the span's length.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const Row row{qf.data(), block_tables + n * max_blocks, lo, seq_len - lo,
                    lo / s.block_size, (seq_len + s.block_size - 1) / s.block_size};
      const scalar_t* qn = q + n * q_row;
      // The AVX-512 bf16 dot path (DIM a multiple of 32) reads q as stored; the others qf.
      if (!(kBf16Dot<scalar_t> && DIM > 0 && DIM % 32 == 0))
        for (int64_t i = 0; i < hd; ++i) qf[i] = static_cast<float>(qn[i]) * scale;
      scores.resize(s.heads * row.len);  // [heads, len], position lo + t at t
      if constexpr (kBf16Dot<scalar_t>) weights.resize(s.heads * row.len);
#ifdef BATCHPAGE_AVX512
      if constexpr (DIM > 0 && DIM % 32 == 0 && !std::is_same_v<scalar_t, double>)
        attend_row_avx512<scalar_t, DIM / 16>(acc.data(), row, qn, static_cast<float>(scale),
                                              k_cache, v_cache, s, scores.data(),
                                              inv_sum.data(), weights.data());
      else
#endif
#ifdef BATCHPAGE_AVX2
      if constexpr (DIM > 0 && DIM % 8 == 0 && !std::is_same_v<scalar_t, double>)
        attend_row_avx2<scalar_t, DIM / 8>(acc.data(), row, k_cache, v_cache, s, scores.data(),
                                           inv_sum.data());
      else
#endif
        attend_row_plain(acc.data(), row, k_cache, v_cache, s, scores.data(), inv_sum.data());
      scalar_t* on = out + n * out_row;
      int64_t i = 0;
#ifdef BATCHPAGE_AVX2
      if constexpr (!std::is_same_v<scalar_t, double>)
        for (; i + 8 <= hd; i += 8) store8(on + i, _mm256_loadu_ps(acc.data() + i));
#endif
      for (; i < hd; ++i) on[i] = static_cast<scalar_t>(acc[i]);
    }
  }
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                  double scale, int64_t window, double softcap) {
  const int64_t kv_heads = k_cache.size(2), dim = q.size(2);
  const Shape shape{q.size(1), kv_heads, dim, k_cache.size(1), kv_heads * dim,
                    k_cache.size(1) * kv_heads * dim, static_cast<float>(softcap)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto dim_tag) {
      decode_rows<scalar_t, decltype(dim_tag)::value>(
          out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
          v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
          seq_lens.data_ptr<int32_t>(), q.size(0), shape, block_tables.size(1), q.stride(0),
          out.stride(0), static_cast<float>(scale), window);
    };
    switch (dim) {
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      default: run(std::integral_constant<int, 0>{});
    }
  });
}

// The step's new K and V rows into their pool slots: a memcpy per token and pool, without the
// dispatch and checks of torch's index_copy_, which would run twice per layer.
void write_kv(torch::Tensor k,        // [T, KVH, D], row stride k.stride(0), heads dense
              torch::Tensor v,        // [T, KVH, D], row stride v.stride(0), heads dense
              torch::Tensor k_cache,  // [num_blocks, BS, KVH, D], contiguous, k's dtype
              torch::Tensor v_cache,  // [num_blocks, BS, KVH, D], contiguous, k's dtype
              torch::Tensor slots) {  // int64 [T]: block * BS + offset, each in the pool
  const int64_t n = k.size(0), token = k.size(1) * k.size(2);
  const int64_t k_row = k.stride(0), v_row = v.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    scalar_t *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    const size_t bytes = token * sizeof(scalar_t);
    at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(kc + sp[i] * token, kp + i * k_row, bytes);
        std::memcpy(vc + sp[i] * token, vp + i * v_row, bytes);
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a block-table KV pool");
  m.def("write_kv", &write_kv, "store new K/V rows at their pool slots");
}

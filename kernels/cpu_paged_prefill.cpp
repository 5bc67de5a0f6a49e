// Paged prefill attention for CPUs: the query rows of prompts and chunks (several new tokens per
// sequence) against their paged context, read in place. Built and launched by
// cpu_paged_prefill.py (see its docstring for the design). Torch's JIT extension loader compiles
// this file as it is.
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

// Keys per chunk: a chunk never crosses a block, so its keys are one contiguous run of the pool.
constexpr int KT = 16;
// Query vectors per tile (rows x the kv head's query heads): a chunk's K/V are read once for
// all of them.
constexpr int kMaxM = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Vector traits: the tile code below runs in 16 lanes (AVX-512), 8 (AVX2) or 1 (any CPU). In the
// score and softmax passes the lanes are query vectors; in the PV pass, head dimensions.
struct Scalar {
  using R = float;
  static constexpr int L = 1;
  static R zero() { return 0.f; }
  static R load(const float* p) { return *p; }
  static void store(float* p, R v) { *p = v; }
  static R set1(float x) { return x; }
  static R fmadd(R a, R b, R c) { return a * b + c; }
  static R mul(R a, R b) { return a * b; }
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R max(R a, R b) { return std::max(a, b); }
  static R exp(R x) { return std::exp(x); }
  // s where lo <= key <= pos, -inf elsewhere.
  static R visible(R s, const int32_t* pos, const int32_t* lo, int32_t key) {
    return key <= *pos && key >= *lo ? s : kNegInf;
  }
};

#ifdef BATCHPAGE_AVX2
struct Avx2 {
  using R = __m256;
  static constexpr int L = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R exp(R x) {  // exp8 clamps at -87: a masked score (-inf) must weigh exactly 0
    return _mm256_and_ps(exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
  }
  static R visible(R s, const int32_t* pos, const int32_t* lo, int32_t key) {
    const __m256i k = _mm256_set1_epi32(key);
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos));
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
    const __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(k, p), _mm256_cmpgt_epi32(l, k));
    return _mm256_blendv_ps(s, _mm256_set1_ps(kNegInf), _mm256_castsi256_ps(hidden));
  }
};
#endif

#ifdef BATCHPAGE_AVX512
struct Avx512 {
  using R = __m512;
  static constexpr int L = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R exp(R x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ),
                               exp16(x));
  }
  static R visible(R s, const int32_t* pos, const int32_t* lo, int32_t key) {
    const __m512i k = _mm512_set1_epi32(key);
    const __mmask16 ok = _mm512_cmp_epi32_mask(k, _mm512_loadu_si512(pos), _MM_CMPINT_LE) &
                         _mm512_cmp_epi32_mask(_mm512_loadu_si512(lo), k, _MM_CMPINT_LE);
    return _mm512_mask_blend_ps(ok, _mm512_set1_ps(kNegInf), s);
  }
};
#endif

// Whether QK multiplies bf16 q and k as stored (vdpbf16ps: exact products, float32 sums), and PV
// the weights rounded to bf16 (as HF's bf16 attention rounds them before its PV matmul) with v
// as stored.
template <typename T, typename V>
constexpr bool kDot = false;
#if defined(BATCHPAGE_AVX512) && defined(__AVX512BF16__)
template <>
constexpr bool kDot<c10::BFloat16, Avx512> = true;
#endif

struct Shape {
  int64_t heads, kv_heads, dim, block_size;
  int64_t token_stride;  // kv_heads * dim: a token holds all kv heads, contiguously
  int64_t max_blocks;    // a block table's length
  int64_t q_row, out_row;
  int64_t window;  // > 0: row at position p sees keys (p - window, p]; 0: all keys <= p
  float scale, softcap;
};

// One task: `rows` consecutive query rows of one sequence, for `heads` of one kv head's query
// heads (all of them unless a kv head has more than kMaxM): M = rows * heads query vectors,
// m = r * heads + i for row r and query head kv_head * group + head0 + i.
struct Tile {
  int64_t seq, first_row, rows, kv_head, head0, heads;
  int64_t first_pos;  // the first row's position in its sequence
  int64_t cost;       // keys the tile reads, for ordering the tasks longest first
};

// Per-thread scratch, float32 unless noted. mp: M rounded up to the lanes (the padding query
// vectors are zeros that see every key: finite, never stored).
struct Scratch {
  std::vector<float> qt;    // [D, mp]: q transposed and scaled; with kDot [D / 2, mp] bf16 pairs
  std::vector<float> o;     // [mp, D]: unnormalised outputs
  std::vector<float> s;     // [KT, mp]: a chunk's scores, then its weights
  std::vector<float> kf;    // [KT, D]: a chunk's keys, widened (not with kDot)
  std::vector<float> vf;    // [KT, D]: a chunk's values, widened (not with kDot)
  std::vector<int32_t> vp;  // with kDot, [KT / 2, D]: token pairs' values as bf16 pairs
  std::vector<int32_t> pp;  // with kDot, [KT / 2, mp]: token pairs' weights as bf16 pairs
  std::vector<float> top, total, fix;  // [mp]: running max, running sum, this chunk's rescale
  std::vector<int32_t> pos, lo;        // [mp]: each query vector's position and window start
  explicit Scratch(int64_t dim)
      : qt(dim * kMaxM), o(kMaxM * dim), s(KT * kMaxM), kf(KT * dim), vf(KT * dim),
        vp(KT / 2 * dim), pp(KT / 2 * kMaxM), top(kMaxM), total(kMaxM), fix(kMaxM), pos(kMaxM),
        lo(kMaxM) {}
};

template <typename T>
static inline void widen(float* dst, const T* src, int64_t n) {
  int64_t i = 0;
#ifdef BATCHPAGE_AVX2
  if constexpr (!std::is_same_v<T, double>)
    for (; i + 8 <= n; i += 8) store8(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Rows [0, n) of `src` (row stride `stride`) as float32 rows: in place for a float32 pool,
// else widened into `buf` (row stride dim). Returns the rows and their stride.
template <typename T>
static inline std::pair<const float*, int64_t> float_rows(float* buf, const T* src, int64_t stride,
                                                          int64_t n, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return {src, stride};
  } else {
    for (int64_t t = 0; t < n; ++t) widen(buf + t * dim, src + t * stride, dim);
    return {buf, dim};
  }
}

// s[t, j..j + NB * L) for keys t..t + KB: KB * NB independent accumulators (a dot product is a
// chain of dependent multiply-adds; several in flight keep the vector units busy), and each
// load of q's columns serves KB keys.
template <typename T, typename V, int D, int KB, int NB>
static inline void scores_block(Scratch& w, const T* k, int64_t stride, const float* kf,
                                int64_t kf_stride, int64_t t, int64_t j, int64_t mp,
                                int64_t dim) {
  constexpr int L = V::L;
  typename V::R acc[KB][NB];
  for (int a = 0; a < KB; ++a)
    for (int b = 0; b < NB; ++b) acc[a][b] = V::zero();
  if constexpr (kDot<T, V>) {
#if defined(BATCHPAGE_AVX512) && defined(__AVX512BF16__)
    const int32_t* qp = reinterpret_cast<const int32_t*>(w.qt.data()) + j;
    const int32_t* kp[KB];  // key t + a as bf16 pairs
    for (int a = 0; a < KB; ++a) kp[a] = reinterpret_cast<const int32_t*>(k + (t + a) * stride);
    for (int p = 0; p < D / 2; ++p) {
      __m512i qv[NB];
      for (int b = 0; b < NB; ++b) qv[b] = _mm512_loadu_si512(qp + p * mp + b * L);
      for (int a = 0; a < KB; ++a) {
        const __m512bh kv = (__m512bh)_mm512_set1_epi32(kp[a][p]);
        for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], kv, (__m512bh)qv[b]);
      }
    }
#endif
  } else {
    const float* k0 = kf + t * kf_stride;
    const float* qt = w.qt.data() + j;
    for (int64_t d = 0; d < dim; ++d) {
      typename V::R qv[NB];
      for (int b = 0; b < NB; ++b) qv[b] = V::load(qt + d * mp + b * L);
      for (int a = 0; a < KB; ++a) {
        const typename V::R kv = V::set1(k0[a * kf_stride + d]);
        for (int b = 0; b < NB; ++b) acc[a][b] = V::fmadd(kv, qv[b], acc[a][b]);
      }
    }
  }
  for (int a = 0; a < KB; ++a)
    for (int b = 0; b < NB; ++b) V::store(w.s.data() + (t + a) * mp + j + b * L, acc[a][b]);
}

// s[t, :] = the scores of key t (K row k + t * stride) against every query vector, t < n.
template <typename T, typename V, int D>
static inline void chunk_scores(Scratch& w, const T* k, int64_t stride, int64_t n, int64_t mp,
                                int64_t dim) {
  constexpr int L = V::L, NB = L == 16 ? 4 : L == 8 ? 2 : 1;  // 16 / 8 / 4 accumulators
  std::pair<const float*, int64_t> kf{nullptr, 0};
  if constexpr (!kDot<T, V>) kf = float_rows(w.kf.data(), k, stride, n, dim);
  const auto [kp, ks] = kf;
  int64_t j = 0;
  for (; j + NB * L <= mp; j += NB * L) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) scores_block<T, V, D, 4, NB>(w, k, stride, kp, ks, t, j, mp, dim);
    for (; t < n; ++t) scores_block<T, V, D, 1, NB>(w, k, stride, kp, ks, t, j, mp, dim);
  }
  for (; j < mp; j += L) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) scores_block<T, V, D, 4, 1>(w, k, stride, kp, ks, t, j, mp, dim);
    for (; t < n; ++t) scores_block<T, V, D, 1, 1>(w, k, stride, kp, ks, t, j, mp, dim);
  }
}

// o[m, :] += sum_t s[t, m] * v[t, :] (row stride vs) for every query vector: MB vectors and CB
// registers of the head dimension at a time, the accumulators in registers across the keys.
template <typename V, int D>
static inline void chunk_values(Scratch& w, const float* v, int64_t vs, int64_t n, int64_t mp,
                                int64_t dim) {
  constexpr int L = V::L;
  if constexpr (L == 1) {
    for (int64_t m = 0; m < mp; ++m)
      for (int64_t t = 0; t < n; ++t) {
        const float p = w.s[t * mp + m];
        for (int64_t d = 0; d < dim; ++d) w.o[m * dim + d] += p * v[t * vs + d];
      }
  } else {
    constexpr int MB = L == 16 ? 4 : 2, CB = 4;  // 16 (AVX-512) or 8 (AVX2) accumulators
    static_assert(D % (L * CB) == 0 && kMaxM % MB == 0);
    for (int64_t m = 0; m < mp; m += MB)
      for (int c0 = 0; c0 < D; c0 += L * CB) {
        typename V::R acc[MB][CB];
        for (int i = 0; i < MB; ++i)
          for (int c = 0; c < CB; ++c) acc[i][c] = V::load(w.o.data() + (m + i) * D + c0 + c * L);
        for (int64_t t = 0; t < n; ++t) {
          typename V::R vr[CB];
          for (int c = 0; c < CB; ++c) vr[c] = V::load(v + t * vs + c0 + c * L);
          for (int i = 0; i < MB; ++i) {
            const typename V::R p = V::set1(w.s[t * mp + m + i]);
            for (int c = 0; c < CB; ++c) acc[i][c] = V::fmadd(p, vr[c], acc[i][c]);
          }
        }
        for (int i = 0; i < MB; ++i)
          for (int c = 0; c < CB; ++c) V::store(w.o.data() + (m + i) * D + c0 + c * L, acc[i][c]);
      }
  }
}

#if defined(BATCHPAGE_AVX512) && defined(__AVX512BF16__)
// With kDot, o's head dimensions are in the order vpunpck{l,h}wd leaves them: in each 32 of
// them, the low half of every 128-bit lane of the two tokens' rows (dims 0-3, 8-11, 16-19,
// 24-27), then the high half (4-7, 12-15, 20-23, 28-31). Where dim d sits in that order:
static inline int64_t unpacked(int64_t d) {
  const int64_t c = d % 32, lane = c / 8, j = c % 8;
  return d - c + (j < 4 ? 4 * lane + j : 16 + 4 * lane + j - 4);
}

// o[m, :] += sum_t bf16(s[t, m]) * v[t, :] by vdpbf16ps over token pairs (2u, 2u + 1): lanes
// over head dimensions, a lane holding the pair's two values of its dimension and the weight
// register the pair's two weights (an odd last key pairs with a zero weight and value). Half the
// instructions of the float32 pass, and v is never widened.
static inline __m512i bf16_lanes(__m512 x) {
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}

template <int D>
// Keys pair at even positions (`lead`: the chunk starts at an odd one, whose pair's first half is
// a zero key of weight 0, never read), so that a key's pair never depends on where its chunk
// starts: a window's first chunk starts anywhere.
static inline void chunk_values_dot(Scratch& w, const c10::BFloat16* v, int64_t stride, int64_t n,
                                    int64_t mp, int64_t lead) {
  constexpr int MB = 4, CB = 4;  // 16 accumulators
  static_assert(D % (16 * CB) == 0 && kMaxM % MB == 0);
  const int64_t pairs = (n + lead + 1) / 2;
  int32_t* vp = w.vp.data();
  int32_t* pp = w.pp.data();
  const __m512i none = _mm512_setzero_si512();
  for (int64_t u = 0; u < pairs; ++u) {
    const int64_t e = 2 * u - lead;  // the pair's first key in the chunk (-1: the zero key)
    const bool one = e >= 0, two = e + 1 < n;
    for (int c = 0; c < D; c += 32) {
      const __m512i x = one ? _mm512_loadu_si512(v + e * stride + c) : none;
      const __m512i y = two ? _mm512_loadu_si512(v + (e + 1) * stride + c) : none;
      _mm512_storeu_si512(vp + u * D + c, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(vp + u * D + c + 16, _mm512_unpackhi_epi16(x, y));
    }
    const float* s1 = w.s.data() + (e + 1) * mp;  // the second key's weights
    for (int64_t j = 0; j < mp; j += 16) {  // bf16 bits, rounded to nearest even, per 32-bit lane
      const __m512i lo = one ? bf16_lanes(_mm512_loadu_ps(s1 - mp + j)) : none;
      const __m512i hi = two ? bf16_lanes(_mm512_loadu_ps(s1 + j)) : none;
      _mm512_storeu_si512(pp + u * mp + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  for (int64_t m = 0; m < mp; m += MB)
    for (int c0 = 0; c0 < D; c0 += 16 * CB) {
      __m512 acc[MB][CB];
      float* o = w.o.data() + m * D + c0;
      for (int i = 0; i < MB; ++i)
        for (int c = 0; c < CB; ++c) acc[i][c] = _mm512_loadu_ps(o + i * D + c * 16);
      for (int64_t u = 0; u < pairs; ++u) {
        __m512i vr[CB];
        for (int c = 0; c < CB; ++c) vr[c] = _mm512_loadu_si512(vp + u * D + c0 + c * 16);
        for (int i = 0; i < MB; ++i) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(pp[u * mp + m + i]);
          for (int c = 0; c < CB; ++c)
            acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)vr[c], p);
        }
      }
      for (int i = 0; i < MB; ++i)
        for (int c = 0; c < CB; ++c) _mm512_storeu_ps(o + i * D + c * 16, acc[i][c]);
    }
}
#endif

template <typename T, typename V, int D>
static void attend_tile(T* out, const T* q, const T* k_cache, const T* v_cache,
                        const int32_t* table, const Tile& tile, const Shape& sh, Scratch& w) {
  constexpr int L = V::L;
  constexpr bool dot = kDot<T, V>;
  const int64_t dim = D > 0 ? D : sh.dim, group = sh.heads / sh.kv_heads, hn = tile.heads;
  const int64_t m_count = tile.rows * hn, mp = (m_count + L - 1) / L * L;
  const int64_t head = tile.kv_head * group + tile.head0;  // the tile's first query head
  std::fill(w.qt.begin(), w.qt.begin() + dim * mp, 0.f);
  for (int64_t m = 0; m < mp; ++m) {
    const int64_t r = m / hn, p = tile.first_pos + std::min(r, tile.rows - 1);
    w.pos[m] = static_cast<int32_t>(m < m_count ? p : INT32_MAX);
    w.lo[m] = static_cast<int32_t>(m < m_count && sh.window > 0
                                       ? std::max<int64_t>(0, p - sh.window + 1) : 0);
    if (m >= m_count) continue;
    const T* qm = q + (tile.first_row + r) * sh.q_row + (head + m % hn) * dim;
    if constexpr (dot) {  // bf16 pairs (q[2i], q[2i+1]) as one 32-bit lane, column m
      int32_t* qp = reinterpret_cast<int32_t*>(w.qt.data());
      for (int64_t i = 0; i < dim / 2; ++i)
        std::memcpy(qp + i * mp + m, qm + 2 * i, sizeof(int32_t));
    } else {
      for (int64_t d = 0; d < dim; ++d) w.qt[d * mp + m] = static_cast<float>(qm[d]) * sh.scale;
    }
  }
  std::fill(w.o.begin(), w.o.begin() + mp * dim, 0.f);
  std::fill(w.top.begin(), w.top.begin() + mp, kNegInf);
  std::fill(w.total.begin(), w.total.begin() + mp, 0.f);
  const int64_t first_key = w.lo[0], last_key = tile.first_pos + tile.rows - 1;
  const int64_t min_pos = tile.first_pos, max_lo = w.lo[m_count - 1];
  const int64_t bs = sh.block_size, kv_off = tile.kv_head * dim;  // within a token
  const typename V::R floor = V::set1(-FLT_MAX);
  for (int64_t k0 = first_key; k0 <= last_key;) {
    // The chunk [k0, k1): within one block and one run of KT keys from a multiple of KT, so
    // that a key's chunk is decided by its position alone, never by where the tile starts (a
    // row's sums are then the same bits in any tile: keys it must not see weigh exactly 0).
    const int64_t block_end = (k0 / bs + 1) * bs;
    const int64_t k1 = std::min({k0 - k0 % KT + KT, block_end, last_key + 1}), n = k1 - k0;
    const int64_t base = (static_cast<int64_t>(table[k0 / bs]) * bs + k0 % bs) * sh.token_stride;
    if (k1 == block_end && k1 <= last_key) {  // the next block sits anywhere in the pool
      const int64_t next = static_cast<int64_t>(table[k1 / bs]) * bs * sh.token_stride;
      const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
      for (int64_t t = 0; t < std::min<int64_t>(bs, KT); ++t) {
        const int64_t at = next + t * sh.token_stride + kv_off;
        const auto* kn = reinterpret_cast<const char*>(k_cache + at);
        const auto* vn = reinterpret_cast<const char*>(v_cache + at);
        for (int64_t off = 0; off < bytes; off += 64) {
          __builtin_prefetch(kn + off);
          __builtin_prefetch(vn + off);
        }
      }
    }
    chunk_scores<T, V, D>(w, k_cache + base + kv_off, sh.token_stride, n, mp, dim);
    float* s = w.s.data();
    if (dot) {
      const typename V::R scale = V::set1(sh.scale);
      for (int64_t i = 0; i < n * mp; i += L) V::store(s + i, V::mul(V::load(s + i), scale));
    }
    if (sh.softcap > 0.f)
      for (int64_t i = 0; i < n * mp; ++i) s[i] = sh.softcap * std::tanh(s[i] / sh.softcap);
    // Keys some query vector must not see: past its position or before its window.
    if (k1 - 1 > min_pos || k0 < max_lo)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < mp; j += L)
          V::store(s + t * mp + j, V::visible(V::load(s + t * mp + j), w.pos.data() + j,
                                              w.lo.data() + j, static_cast<int32_t>(k0 + t)));
    // Online softmax, lanes over query vectors. `safe` is the new maximum, or -FLT_MAX while
    // a vector has seen no key (its window starts later): e^(-inf - safe) is then 0, not NaN.
    for (int64_t j = 0; j < mp; j += L) {
      typename V::R top = V::load(w.top.data() + j);
      const typename V::R old = top;
      for (int64_t t = 0; t < n; ++t) top = V::max(top, V::load(s + t * mp + j));
      const typename V::R safe = V::max(top, floor);
      typename V::R sum = V::zero();
      for (int64_t t = 0; t < n; ++t) {
        const typename V::R p = V::exp(V::sub(V::load(s + t * mp + j), safe));
        V::store(s + t * mp + j, p);
        sum = V::add(sum, p);
      }
      const typename V::R fix = V::exp(V::sub(old, safe));
      V::store(w.top.data() + j, top);
      V::store(w.fix.data() + j, fix);
      V::store(w.total.data() + j, V::fmadd(V::load(w.total.data() + j), fix, sum));
    }
    for (int64_t m = 0; m < mp; ++m) {
      const float f = w.fix[m];
      if (f != 1.f)
        for (int64_t d = 0; d < dim; ++d) w.o[m * dim + d] *= f;
    }
    if constexpr (dot) {
#if defined(BATCHPAGE_AVX512) && defined(__AVX512BF16__)
      chunk_values_dot<D>(w, v_cache + base + kv_off, sh.token_stride, n, mp, k0 % 2);
#endif
    } else {
      const auto [v, vs] =
          float_rows(w.vf.data(), v_cache + base + kv_off, sh.token_stride, n, dim);
      chunk_values<V, D>(w, v, vs, n, mp, dim);
    }
    k0 = k1;
  }
  for (int64_t m = 0; m < m_count; ++m) {
    T* om = out + (tile.first_row + m / hn) * sh.out_row + (head + m % hn) * dim;
    const float inv = 1.f / w.total[m];
    if constexpr (dot) {
#if defined(BATCHPAGE_AVX512) && defined(__AVX512BF16__)
      for (int64_t d = 0; d < dim; ++d) om[d] = static_cast<T>(w.o[m * dim + unpacked(d)] * inv);
#endif
    } else {
      for (int64_t d = 0; d < dim; ++d) om[d] = static_cast<T>(w.o[m * dim + d] * inv);
    }
  }
}

template <typename T, typename V, int D>
static void prefill_tiles(T* out, const T* q, const T* k_cache, const T* v_cache,
                          const int32_t* block_tables, const std::vector<Tile>& tiles,
                          const Shape& sh) {
  // Tiles differ in cost (the context each reads): longest first, handed out one at a time.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch w(sh.dim);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tiles.size(); ++i) {
      const Tile& t = tiles[i];
      attend_tile<T, V, D>(out, q, k_cache, v_cache, block_tables + t.seq * sh.max_blocks, t,
                           sh, w);
    }
  }
}

// The vector path for head_dim D (64 or 128: the PV pass takes whole registers), else scalar.
template <typename T, int D>
static void dispatch_vectors(T* out, const T* q, const T* k_cache, const T* v_cache,
                             const int32_t* block_tables, const std::vector<Tile>& tiles,
                             const Shape& sh) {
  if constexpr (D > 0 && !std::is_same_v<T, double>) {
#if defined(BATCHPAGE_AVX512)
    return prefill_tiles<T, Avx512, D>(out, q, k_cache, v_cache, block_tables, tiles, sh);
#elif defined(BATCHPAGE_AVX2)
    return prefill_tiles<T, Avx2, D>(out, q, k_cache, v_cache, block_tables, tiles, sh);
#endif
  }
  prefill_tiles<T, Scalar, 0>(out, q, k_cache, v_cache, block_tables, tiles, sh);
}

void paged_prefill(torch::Tensor out,           // [T, H, D], row stride out.stride(0)
                   torch::Tensor q,             // [T, H, D], row stride q.stride(0)
                   torch::Tensor k_cache,       // [num_blocks, BS, KVH, D], contiguous
                   torch::Tensor v_cache,       // [num_blocks, BS, KVH, D], contiguous
                   torch::Tensor block_tables,  // int32 [B, max_blocks], contiguous
                   torch::Tensor seq_lens,      // int32 [B]: context after the step
                   torch::Tensor query_start,   // int32 [B + 1]: b owns rows [qs[b], qs[b + 1])
                   torch::Tensor seqs,          // int32 [S]: the sequences to attend
                   double scale, int64_t window, double softcap) {
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t tile_rows = std::max<int64_t>(1, kMaxM / group);
  const int64_t tile_heads = std::min<int64_t>(group, kMaxM);  // a wide group is split
  const Shape sh{heads, kv_heads, dim, k_cache.size(1), kv_heads * dim, block_tables.size(1),
                 q.stride(0), out.stride(0), window, static_cast<float>(scale),
                 static_cast<float>(softcap)};
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* sp = seqs.data_ptr<int32_t>();
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < seqs.size(0); ++i) {
    const int64_t b = sp[i], n = qs[b + 1] - qs[b], first = lens[b] - n;
    for (int64_t r = 0; r < n; r += tile_rows) {
      const int64_t rows = std::min(tile_rows, n - r);
      const int64_t last = first + r + rows - 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, first + r - window + 1) : 0;
      for (int64_t g = 0; g < kv_heads; ++g)
        for (int64_t h0 = 0; h0 < group; h0 += tile_heads)
          tiles.push_back({b, qs[b] + r, rows, g, h0, std::min(tile_heads, group - h0), first + r,
                           last + 1 - lo});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    auto run = [&](auto dim_tag) {
      dispatch_vectors<scalar_t, decltype(dim_tag)::value>(
          out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
          v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(), tiles, sh);
    };
    switch (dim) {
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      default: run(std::integral_constant<int, 0>{});
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", &paged_prefill,
        "causal attention of prompt and chunk rows over a block-table KV pool");
}

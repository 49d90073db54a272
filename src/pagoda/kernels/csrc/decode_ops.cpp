// Small bf16 CPU ops on the decode path (built per variant over vec.h), where torch spends more
// time dispatching a dozen tiny ops than computing: RMSNorm with the residual add fused, rotary
// embedding in place, and paged attention for a few query rows per sequence (decodes and
// speculative verification) that reads K/V straight from the block tables (no gather, no mask
// tensor).
//
// Numerics: RMSNorm rounds exactly where transformers' bf16 RMSNorm rounds (the sum x + residual,
// the normalised value, the product with the weight) and keeps the statistics in fp32, so it
// differs from torch only in the order of the fp32 sum of squares. Attention computes scores,
// softmax and the weighted sum of V in fp32 and rounds the output once. On avx512_bf16, bf16
// tensors go through vdpbf16ps twice: the scores (exact products, fp32 sums in its own order) and
// the weighted sum of V, whose weights are the softmax numerators rounded to bf16 (round to
// nearest even) and divided, at the end, by the fp32 sum of those rounded numerators; so that
// variant's bf16 attention differs from avx2 / avx512 within bf16 tolerance. Attention also takes
// fp32 tensors (fp32 models): fp32 arithmetic on every variant, with nothing rounded.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace pagoda_vec;

const uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>()); }
uint16_t* u16_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); }

void check_bf16_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), name, " must be a bfloat16 CPU tensor");
}

// ---- RMSNorm ---------------------------------------------------------------------------------

// out = weight * bf16(s * rsqrt(mean(s^2) + eps)) with s = bf16(x + residual) (or x); returns
// (out, s). x and residual are [T, H] with contiguous rows.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  check_bf16_cpu(x, "x");
  check_bf16_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), "weight must be contiguous [", H,
              "]");
  if (residual.has_value()) {
    check_bf16_cpu(*residual, "residual");
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == T && residual->size(1) == H && residual->stride(1) == 1,
                "residual must be [", T, ", ", H, "] with contiguous rows");
  }
  at::Tensor out = at::empty({T, H}, x.options());
  at::Tensor summed = residual.has_value() ? at::empty({T, H}, x.options()) : x;
  const uint16_t* w = u16(weight);
  const uint16_t* xp = u16(x);
  const uint16_t* rp = residual.has_value() ? u16(*residual) : nullptr;
  uint16_t* op = u16_mut(out);
  uint16_t* sp = residual.has_value() ? u16_mut(summed) : nullptr;
  const int64_t ldx = x.stride(0), ldr = residual.has_value() ? residual->stride(0) : 0;
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)), [&](int64_t t0, int64_t t1) {
    std::vector<float> s(static_cast<size_t>(H));
    for (int64_t t = t0; t < t1; ++t) {
      VecF sq = zero();
      for (int64_t i = 0; i < H; i += 16) {
        const Mask m = tail_mask(H - i);
        VecF v = load_bf16(xp + t * ldx + i, m);
        if (rp) {
          v = round_bf16(add(v, load_bf16(rp + t * ldr + i, m)));
          store_bf16(sp + t * H + i, v, m);
        }
        store(s.data() + i, v, m);
        sq = fmadd(v, v, sq);
      }
      const float scale = 1.0f / std::sqrt(reduce_add(sq) / static_cast<float>(H) + static_cast<float>(eps));
      const VecF r = set1(scale);
      for (int64_t i = 0; i < H; i += 16) {
        const Mask m = tail_mask(H - i);
        const VecF normed = round_bf16(mul(load(s.data() + i, m), r));
        store_bf16(op + t * H + i, mul(load_bf16(w + i, m), normed), m);
      }
    }
  });
  return {out, summed};
}

// ---- rotary embedding ------------------------------------------------------------------------

// Rotates x [T, heads, D] in place (rotate-half convention) with cos, sin [T, 1, D / 2], rounding
// to bf16 after every multiply and add as torch's bf16 `x1 * cos - x2 * sin` does.
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_bf16_cpu(x, "x");
  check_bf16_cpu(cos, "cos");
  check_bf16_cpu(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [T, heads, D] with contiguous heads");
  const int64_t T = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == 1 && t->size(2) == half && t->stride(2) == 1,
                "cos and sin must be [T, 1, D / 2] with contiguous rows");
  uint16_t* xp = u16_mut(x);
  const uint16_t* cp = u16(cos);
  const uint16_t* sp = u16(sin);
  const int64_t ldt = x.stride(0), ldh = x.stride(1), ldc = cos.stride(0), lds = sin.stride(0);
  at::parallel_for(0, T * heads, std::max<int64_t>(1, 4096 / std::max<int64_t>(half, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      uint16_t* row = xp + t * ldt + h * ldh;
      for (int64_t d = 0; d < half; d += 16) {
        const Mask m = tail_mask(half - d);
        const VecF x1 = load_bf16(row + d, m), x2 = load_bf16(row + half + d, m);
        const VecF c = load_bf16(cp + t * ldc + d, m), s = load_bf16(sp + t * lds + d, m);
        const VecF r1 = sub(round_bf16(mul(x1, c)), round_bf16(mul(x2, s)));
        const VecF r2 = add(round_bf16(mul(x2, c)), round_bf16(mul(x1, s)));
        store_bf16(row + d, r1, m);
        store_bf16(row + half + d, r2, m);
      }
    }
  });
}

// ---- paged attention for a few query rows per sequence --------------------------------------

constexpr int64_t kPrefetchAhead = 16;  // positions ahead whose K/V rows are prefetched
// Score rows (query rows x query heads of one KV head) one task holds at once: a sequence's
// query rows are split into tiles of max(1, kRowTile / G) rows, each reading the K/V of its
// positions once for all its rows. (A verification step of k drafts is k + 1 rows: one tile.)
constexpr int64_t kRowTile = 64;

// Attention's tensors hold E: bf16 bits (uint16_t) or fp32; their rows load as fp32 vectors.
template <typename E>
E* elems(const at::Tensor& t) {
  if constexpr (std::is_same_v<E, float>) {
    return t.data_ptr<float>();
  } else {
    return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>());
  }
}
template <typename E>
void check_elems_cpu(const at::Tensor& t, const char* name) {
  if constexpr (std::is_same_v<E, float>) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, " must be a float32 CPU tensor (as q)");
  } else {
    check_bf16_cpu(t, name);
  }
}
inline VecF load_elems(const uint16_t* p, const Mask& m) { return load_bf16(p, m); }
inline VecF load_elems(const float* p, const Mask& m) { return load(p, m); }
inline VecF load_elems(const uint16_t* p) { return load_bf16(p); }
inline VecF load_elems(const float* p) { return load(p); }
inline void store_elems(uint16_t* p, VecF v, const Mask& m) { store_bf16(p, v, m); }
inline void store_elems(float* p, VecF v, const Mask& m) { store(p, v, m); }

// Into L1 (kHint = _MM_HINT_T0) or L2 (_MM_HINT_T1): the D values of a K or V row.
template <int kHint = _MM_HINT_T0, typename E>
inline void prefetch_row(const E* row, int64_t D) {
  for (int64_t i = 0; i < D; i += 64 / sizeof(E))
    _mm_prefetch(reinterpret_cast<const char*>(row + i), static_cast<_mm_hint>(kHint));
}

// The V rows of one sequence and KV head, read through its block table.
template <typename E>
struct VRows {
  const E* cache;
  const int64_t* offsets;  // element offset of position start + i, for i < len - start
  int64_t D, start, len;
  const E* row(int64_t t) const { return cache + offsets[t - start]; }
};

// Where score row r (query row r / G, query head r % G of the KV head's group) is written.
template <typename E>
struct OutRows {
  E* base;  // row 0
  int64_t G, ld_query, D;
  E* row(int64_t r) const { return base + (r / G) * ld_query + (r % G) * D; }
};

// The V pass takes up to kPassVecs vectors (16 dimensions each) of the head at once, with a tile
// of rows_per_tile(C) score rows x C vectors of fp32 sums in registers beside the C values and
// one weight. More score rows than one tile of kPassVecs holds take passes of kNarrowPass vectors
// (more rows per V load).
#if defined(PAGODA_AVX512)
constexpr int kPassVecs = 8, kNarrowPass = 4;
constexpr int rows_per_tile(int c) { return c == 8 ? 2 : c >= 5 ? 3 : 24 / c; }
#else
// On 16 ymm registers: 6 rows x 2 halves of one vector (15 registers with the V halves and the
// weight), so each V load feeds up to 12 multiply-adds and is widened from bf16 once per tile.
constexpr int kPassVecs = 2, kNarrowPass = 1;
constexpr int rows_per_tile(int c) { return c == 1 ? 6 : 2; }
#endif

// Splits n rows into the fewest tiles of at most `most` rows, of near-equal sizes (7 as 4 + 3,
// not 6 + 1: a one-row tile has too few independent sums to hide the multiply-add latency).
// Calls f(first row, rows) per tile. Tiles never change a row's bits (each row sums alone).
template <typename F>
inline void for_each_tile(int64_t n, int64_t most, F&& f) {
  const int64_t tiles = (n + most - 1) / most;
  for (int64_t i = 0, r0 = 0; i < tiles; ++i) {
    const int64_t rt = n / tiles + (i < n % tiles ? 1 : 0);
    f(r0, static_cast<int>(rt));
    r0 += rt;
  }
}

// out[r][d0, d0 + 16 C) = sum_t p[r][t] * v[t][d0, ...] * inv_sum[r] for the RT score rows r0 ..
// r0 + RT - 1 (p: rows of len - start weights, ldp apart): one load of V per position for all RT
// rows, the sums in registers (RT is a constant so that they stay there).
// kFull: every chunk has 16 dimensions (unmasked loads, no per-load tail test).
template <int C, int RT, bool kFull, typename E>
void v_tile(const VRows<E>& rows, int64_t d0, const Mask* masks, const float* p, int64_t ldp, const float* inv_sum,
            int64_t r0, const OutRows<E>& out) {
  constexpr int K = C * kSplit;
  // One flat array, loops unrolled by pragma and no address taken: so GCC keeps every sum in a
  // register (a 2-D array, or &acc[...], made it store all of them to the stack every position).
  VecN acc[RT * K];
#pragma GCC unroll 64
  for (int i = 0; i < RT * K; ++i) acc[i] = set1_n(0.0f);
  const float* pr = p + r0 * ldp - rows.start;
  for (int64_t t = rows.start; t < rows.len; ++t) {
    const E* v = rows.row(t) + d0;
    if (t + kPrefetchAhead < rows.len) prefetch_row(rows.row(t + kPrefetchAhead) + d0, 16 * C);
    VecN vv[K];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const VecF x = kFull ? load_elems(v + c * 16) : load_elems(v + c * 16, masks[c]);
#pragma GCC unroll 2
      for (int s = 0; s < kSplit; ++s) vv[c * kSplit + s] = part(x, s);
    }
#pragma GCC unroll 32
    for (int r = 0; r < RT; ++r) {
      const VecN w = set1_n(pr[r * ldp + t]);
#pragma GCC unroll 16
      for (int k = 0; k < K; ++k) acc[r * K + k] = fmadd(w, vv[k], acc[r * K + k]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < RT; ++r) {
    const VecF inv = set1(inv_sum[r0 + r]);
    E* o = out.row(r0 + r) + d0;
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      VecN parts[kSplit];
#pragma GCC unroll 2
      for (int s = 0; s < kSplit; ++s) parts[s] = acc[r * K + c * kSplit + s];
      store_elems(o + c * 16, mul(join(parts), inv), masks[c]);
    }
  }
}

// v_tile<C, rt> for 1 <= rt <= RT.
template <int C, int RT, typename E>
void v_rows(int rt, bool full, const VRows<E>& rows, int64_t d0, const Mask* masks, const float* p, int64_t ldp,
            const float* inv_sum, int64_t r0, const OutRows<E>& out) {
  if constexpr (RT > 1) {
    if (rt < RT) return v_rows<C, RT - 1>(rt, full, rows, d0, masks, p, ldp, inv_sum, r0, out);
  }
  if (full) return v_tile<C, RT, true>(rows, d0, masks, p, ldp, inv_sum, r0, out);
  v_tile<C, RT, false>(rows, d0, masks, p, ldp, inv_sum, r0, out);
}

// out[r][d0, d0 + 16 C) for all R score rows, in near-equal tiles of up to rows_per_tile(C).
template <int C, typename E>
void accumulate_v(const VRows<E>& rows, int64_t d0, const float* p, int64_t ldp, const float* inv_sum, int64_t R,
                  const OutRows<E>& out) {
  Mask masks[C];
  for (int c = 0; c < C; ++c) masks[c] = tail_mask(rows.D - d0 - c * 16);
  const bool full = rows.D - d0 >= 16 * C;
  for_each_tile(R, rows_per_tile(C), [&](int64_t r0, int rt) {
    v_rows<C, rows_per_tile(C)>(rt, full, rows, d0, masks, p, ldp, inv_sum, r0, out);
  });
}

// accumulate_v<c> for 1 <= c <= C.
template <int C, typename E>
void accumulate_pass(int c, const VRows<E>& rows, int64_t d0, const float* p, int64_t ldp, const float* inv_sum,
                     int64_t R, const OutRows<E>& out) {
  if constexpr (C > 1) {
    if (c < C) return accumulate_pass<C - 1>(c, rows, d0, p, ldp, inv_sum, R, out);
  }
  accumulate_v<C>(rows, d0, p, ldp, inv_sum, R, out);
}

#if defined(PAGODA_ISA_AVX512_BF16)
// P·V on vdpbf16ps (bf16 tensors on avx512_bf16). The weights are the softmax numerators rounded
// to bf16, rows of pairs for the positions (pbase + 2j, pbase + 2j + 1); V rows t and t + 1 are
// interleaved on the fly into (V[t][d], V[t + 1][d]) pairs. A pass takes C chunks of 32
// dimensions: the unpacklo / unpackhi halves of chunk c hold d = 8k + i and 8k + 4 + i at lane
// 4k + i, put back in order when the row is stored. poff[2j + u] is the V row offset of position
// pbase + 2j + u (a position outside the task's [start, len) points at a row inside it: its
// weight is zero).
constexpr int kPairChunks = 2;
constexpr int pair_rows_per_tile(int c) { return c == 1 ? 14 : 6; }  // 2C sums a row + 2C V pairs in 32 registers

inline __mmask32 tail_mask32(int64_t left) {
  if (left <= 0) return 0;
  return left >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << left) - 1);
}

template <int C, int RT>
void v_tile_pairs(const uint16_t* vc, const int64_t* poff, int64_t np, int64_t D, int64_t d0, const uint32_t* pb,
                  int64_t ldp, const float* inv_sum, int64_t r0, const OutRows<uint16_t>& out) {
  constexpr int K = 2 * C;
  VecF acc[RT * K];  // flat, unrolled, address never taken: stays in registers (see v_tile)
#pragma GCC unroll 64
  for (int i = 0; i < RT * K; ++i) acc[i] = zero();
  __mmask32 m32[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) m32[c] = tail_mask32(D - d0 - 32 * c);
  const uint32_t* pr = pb + r0 * ldp;
  constexpr int64_t ahead = kPrefetchAhead / 2;  // pairs
  for (int64_t j = 0; j < np; ++j) {
    const uint16_t* a = vc + poff[2 * j] + d0;
    const uint16_t* b = vc + poff[2 * j + 1] + d0;
    if (j + ahead < np) {
      prefetch_row(vc + poff[2 * (j + ahead)] + d0, 32 * C);
      prefetch_row(vc + poff[2 * (j + ahead) + 1] + d0, 32 * C);
    }
    __m512i lo[C], hi[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_maskz_loadu_epi16(m32[c], a + 32 * c), y = _mm512_maskz_loadu_epi16(m32[c], b + 32 * c);
      lo[c] = _mm512_unpacklo_epi16(x, y);
      hi[c] = _mm512_unpackhi_epi16(x, y);
    }
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[r * ldp + j]));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[r * K + 2 * c] = _mm512_dpbf16_ps(acc[r * K + 2 * c], (__m512bh)lo[c], w);
        acc[r * K + 2 * c + 1] = _mm512_dpbf16_ps(acc[r * K + 2 * c + 1], (__m512bh)hi[c], w);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) {
    const VecF inv = set1(inv_sum[r0 + r]);
    uint16_t* o = out.row(r0 + r) + d0;
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const VecF l = acc[r * K + 2 * c], h = acc[r * K + 2 * c + 1];
      store_bf16(o + 32 * c, mul(_mm512_permutex2var_ps(l, first, h), inv), tail_mask(D - d0 - 32 * c));
      store_bf16(o + 32 * c + 16, mul(_mm512_permutex2var_ps(l, second, h), inv), tail_mask(D - d0 - 32 * c - 16));
    }
  }
}

// v_tile_pairs<C, rt> for 1 <= rt <= RT.
template <int C, int RT>
void v_rows_pairs(int rt, const uint16_t* vc, const int64_t* poff, int64_t np, int64_t D, int64_t d0,
                  const uint32_t* pb, int64_t ldp, const float* inv_sum, int64_t r0, const OutRows<uint16_t>& out) {
  if constexpr (RT > 1) {
    if (rt < RT) return v_rows_pairs<C, RT - 1>(rt, vc, poff, np, D, d0, pb, ldp, inv_sum, r0, out);
  }
  v_tile_pairs<C, RT>(vc, poff, np, D, d0, pb, ldp, inv_sum, r0, out);
}

// All R rows: passes of two chunks (the whole of D = 64 per V read) while the rows fit one tile,
// else of one chunk in tiles of up to 14 rows.
inline void accumulate_v_pairs(const uint16_t* vc, const int64_t* poff, int64_t np, int64_t D, const uint32_t* pb,
                               int64_t ldp, const float* inv_sum, int64_t R, const OutRows<uint16_t>& out) {
  const int chunks = R <= pair_rows_per_tile(kPairChunks) ? kPairChunks : 1;
  for (int64_t d0 = 0; d0 < D; d0 += 32 * chunks) {
    const bool two = chunks == 2 && D - d0 > 32;
    const int rt = two ? pair_rows_per_tile(2) : pair_rows_per_tile(1);
    for (int64_t r0 = 0; r0 < R; r0 += rt) {
      const int n = static_cast<int>(std::min<int64_t>(rt, R - r0));
      if (two) {
        v_rows_pairs<2, pair_rows_per_tile(2)>(n, vc, poff, np, D, d0, pb, ldp, inv_sum, r0, out);
      } else {
        v_rows_pairs<1, pair_rows_per_tile(1)>(n, vc, poff, np, D, d0, pb, ldp, inv_sum, r0, out);
      }
    }
  }
}
#endif

#if !defined(PAGODA_AVX512)
// AVX2, bf16 K: rows r[0..15] of 16 bf16 values each -> v[i] = value i of every row as fp32. The
// 16-bit values are transposed first (8 x 8 blocks within each 128-bit lane, three unpack
// stages) and widened after, a third of the shuffles of widening first and transposing fp32
// vectors (`transpose16`). It only moves and widens bits: the same vectors as that.
inline void transpose16_bf16(const __m256i r[16], VecF v[16]) {
  const auto widen8 = [](__m128i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)); };
  for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7: lanes 0..7 (lo) or 8..15 (hi) of each v[i]
    const __m256i* x = r + 8 * h;
    __m256i s[8], u[4], w[4];
    for (int i = 0; i < 4; ++i) {
      s[2 * i] = _mm256_unpacklo_epi16(x[2 * i], x[2 * i + 1]);
      s[2 * i + 1] = _mm256_unpackhi_epi16(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // u: rows 0-3 (of the eight), w: rows 4-7; columns 4i .. 4i + 3
      u[2 * i] = _mm256_unpacklo_epi32(s[i], s[i + 2]);
      u[2 * i + 1] = _mm256_unpackhi_epi32(s[i], s[i + 2]);
      w[2 * i] = _mm256_unpacklo_epi32(s[4 + i], s[6 + i]);
      w[2 * i + 1] = _mm256_unpackhi_epi32(s[4 + i], s[6 + i]);
    }
    for (int i = 0; i < 4; ++i) {
      // Column k = 2i (then 2i + 1) of the eight rows in the low 128 bits, column 8 + k in the high.
      const __m256i col[2] = {_mm256_unpacklo_epi64(u[i], w[i]), _mm256_unpackhi_epi64(u[i], w[i])};
      for (int e = 0; e < 2; ++e) {
        const int k = 2 * i + e;
        const __m256 low = widen8(_mm256_castsi256_si128(col[e])), high = widen8(_mm256_extracti128_si256(col[e], 1));
        (h ? v[k].hi : v[k].lo) = low;
        (h ? v[8 + k].hi : v[8 + k].lo) = high;
      }
    }
  }
}
#endif

// 16 positions' K rows of one group (16 values, or 16 bf16 pairs as 32-bit lanes) on their way
// into kt: loaded row by row (`clear` for positions past the end), then transposed so that
// vector i holds element i of every row. On avx2 a bf16 group stays 16-bit until after the
// transpose (transpose16_bf16); every other case widens as it loads and transposes fp32 lanes
// (transpose16). Both give the same vectors.
template <class E>
struct KBlock {
#if defined(PAGODA_AVX512)
  static constexpr bool kNarrow = false;
#else
  static constexpr bool kNarrow = std::is_same_v<E, uint16_t>;
  __m256i rows[16];
#endif
  VecF v[16];

  __attribute__((always_inline)) void clear(int64_t j) {
#if !defined(PAGODA_AVX512)
    if constexpr (kNarrow) {
      rows[j] = _mm256_setzero_si256();
      return;
    }
#endif
    v[j] = zero();
  }
  // Row j from `krow`: `n` valid lanes (all 16 when `full`; `m` masks them), as bf16 pairs if `pairs`.
  __attribute__((always_inline)) void load_row(int64_t j, const E* krow, bool full, int64_t n, const Mask& m, bool pairs) {
#if !defined(PAGODA_AVX512)
    if constexpr (kNarrow) {
      if (full) {
        rows[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow));
      } else {  // the tail group: its valid values through a zeroed buffer
        alignas(32) uint16_t buf[16] = {};
        std::memcpy(buf, krow, static_cast<size_t>(n) * sizeof(uint16_t));
        rows[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
      }
      return;
    }
#endif
    if (pairs) {
      const float* k2 = reinterpret_cast<const float*>(krow);
      v[j] = full ? load(k2) : load(k2, m);
    } else {
      v[j] = full ? load_elems(krow) : load_elems(krow, m);
    }
  }
  __attribute__((always_inline)) const VecF* transposed() {
#if !defined(PAGODA_AVX512)
    if constexpr (kNarrow) {
      transpose16_bf16(rows, v);
      return v;
    }
#endif
    transpose16(v);
    return v;
  }
};

// The largest score of s[lo, hi), in every lane (a softmax row's shift).
inline VecF row_max(const float* s, int64_t lo, int64_t hi) {
  VecF mx = set1(-INFINITY);
  for (int64_t t = lo; t < hi; t += 16) {
    const Mask m = tail_mask(hi - t);
    mx = select(m, max(mx, load(s + t, m)), mx);
  }
  return set1(reduce_max(mx));
}

// ---- Q·K^T in register tiles ----------------------------------------------------------------
//
// The K rows of kPosBlock positions are transposed once into kt [d][kPosBlock] (positions in
// lanes); then each tile of up to kScoreRows score rows x kPosBlock positions sums over d with one
// broadcast of q per row and d, and kPosVecs loads of kt per d for all the tile's rows. Score
// (r, t) is the sum over d = 0, 1, ... in order of q[r][d] * k[t][d] (fp32 multiply-adds from
// zero), whatever the tile, the row count or the variant: a query row's scores have the same bits
// alone (a decode) or among other rows (verification), and on avx2 and avx512. On avx512_bf16, bf16
// tensors go through vdpbf16ps instead: kt holds bf16 pairs (d, d + 1) of 16 positions per
// vector, q a bf16 pair per broadcast, and the sum (in vdpbf16ps' order) is scaled afterwards.
constexpr int kPosVecs = 2;                             // VecN per score row in a tile
constexpr int64_t kPosBlock = kPosVecs * 16 / kSplit;  // positions per block: 32 (AVX-512), 16 (AVX2)
#if defined(PAGODA_AVX512)
constexpr int kScoreRows = 12;  // 24 sums + 2 kt vectors + a broadcast of 32 registers
#else
constexpr int kScoreRows = 6;  // 12 sums + 2 + 1 of 16
#endif
constexpr int64_t kLaneN = 16 / kSplit;  // lanes of a VecN

// s[r][0, kPosBlock) = sum_d qf[r][d] * kt[d][...] for RT rows (qf rows ldq apart, s rows lds apart).
template <int RT>
void score_tile(const float* kt, const float* qf, int64_t ldq, int64_t D, float* s, int64_t lds) {
  VecN acc[RT][kPosVecs];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kPosVecs; ++v) acc[r][v] = set1_n(0.0f);
  for (int64_t d = 0; d < D; ++d) {
    VecN k[kPosVecs];
    for (int v = 0; v < kPosVecs; ++v) k[v] = load_n(kt + d * kPosBlock + v * kLaneN);
    for (int r = 0; r < RT; ++r) {
      const VecN b = set1_n(qf[r * ldq + d]);
      for (int v = 0; v < kPosVecs; ++v) acc[r][v] = fmadd(b, k[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kPosVecs; ++v) store_n(s + r * lds + v * kLaneN, acc[r][v]);
}

#if defined(PAGODA_ISA_AVX512_BF16)
// The same over bf16 pairs: kt2 [pair][kPosBlock] 32-bit pairs, qb rows of `pairs` bf16 pairs;
// the sums are multiplied by `scale`.
template <int RT>
void score_tile_bf16(const float* kt2, const uint32_t* qb, int64_t ldq, int64_t pairs, float scale, float* s,
                     int64_t lds) {
  VecF acc[RT][kPosVecs];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kPosVecs; ++v) acc[r][v] = zero();
  for (int64_t p = 0; p < pairs; ++p) {
    VecF k[kPosVecs];
    for (int v = 0; v < kPosVecs; ++v) k[v] = load(kt2 + p * kPosBlock + v * 16);
    for (int r = 0; r < RT; ++r) {
      const uint32_t b = qb[r * ldq + p];
      for (int v = 0; v < kPosVecs; ++v) acc[r][v] = dot_bf16_pairs(acc[r][v], k[v], b);
    }
  }
  const VecF sc = set1(scale);
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kPosVecs; ++v) store(s + r * lds + v * 16, mul(acc[r][v], sc));
}
#endif

// score_tile<rt> (or score_tile_bf16<rt>) for 1 <= rt <= RT.
template <int RT, bool kBf16Pairs, typename Q>
void score_rows(int rt, const float* kt, const Q* q, int64_t ldq, int64_t depth, float scale, float* s, int64_t lds) {
  if constexpr (RT > 1) {
    if (rt < RT) return score_rows<RT - 1, kBf16Pairs>(rt, kt, q, ldq, depth, scale, s, lds);
  }
#if defined(PAGODA_ISA_AVX512_BF16)
  if constexpr (kBf16Pairs) {
    score_tile_bf16<RT>(kt, q, ldq, depth, scale, s, lds);
    return;
  }
#endif
  if constexpr (!kBf16Pairs && std::is_same_v<Q, float>) score_tile<RT>(kt, q, ldq, depth, s, lds);
}

// Whether bf16 tensors of head_dim D take the vdpbf16ps scores (pairs need an even D).
template <typename E>
constexpr bool bf16_pair_scores() {
#if defined(PAGODA_ISA_AVX512_BF16)
  return std::is_same_v<E, uint16_t>;
#else
  return false;
#endif
}

// q [T, H, D]: sequence b's query rows are query_start_loc[b] .. query_start_loc[b + 1] at its
// last positions (seq_lens[b] - rows ... seq_lens[b] - 1), so one new token per sequence is a
// decode, and k + 1 rows are a verification step; kv_cache [2, blocks, block_size, Hkv, D]. The
// query at position p attends causally to the positions [lo, p] of its sequence, read through
// block_tables[b], with lo = p - window + 1 when window > 0 (else 0). With k, v [T, Hkv, D] and
// slot_mapping [T] (int64), the new tokens' keys and values are first written to their cache
// slots, which saves the separate copies.
//
// Numerics: scores, softmax and the weighted sum of V in fp32, rounded once (bf16 E; fp32 E is
// not rounded; bf16 E on avx512_bf16 weighs V by bf16-rounded numerators, see the top). A row's masked positions enter the sums as exact zeros, so without a window a
// query row gives the same bits whether it is computed alone (a decode) or among the rows of a
// verification step.
template <typename E>
at::Tensor paged_attention_impl(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale, int64_t window,
                           const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                           const std::optional<at::Tensor>& slot_mapping) {
  check_elems_cpu<E>(q, "q");
  check_elems_cpu<E>(kv_cache, "kv_cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, blocks, block_size, Hkv, D] tensor");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) >= 1 &&
                  query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.device().is_cpu(),
              "query_start_loc must be a contiguous int32 CPU tensor [B + 1]");
  const int64_t B = query_start_loc.size(0) - 1, T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D, "kv_cache head_dim ", kv_cache.size(4), " != q head_dim ", D);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads ", H, " are not a multiple of KV heads ", Hkv);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= B && block_tables.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && block_tables.device().is_cpu(),
              "block_tables must be an int32 CPU tensor [>= B, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) >= B && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && seq_lens.device().is_cpu(),
              "seq_lens must be a contiguous int32 CPU tensor [>= B]");
  const int64_t G = H / Hkv, C = (D + 15) / 16;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t ldt = block_tables.stride(0);
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T, "query_start_loc must run from 0 to the ", T, " query rows");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t rows = qsl[b + 1] - qsl[b];
    TORCH_CHECK(rows >= 1 && rows <= lens[b], "sequence ", b, " has ", rows, " query rows for length ", lens[b]);
    TORCH_CHECK((lens[b] + bs - 1) / bs <= block_tables.size(1), "sequence ", b, " has length ", lens[b],
                " beyond its block table");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tables[b * ldt + j] >= 0 && tables[b * ldt + j] < num_blocks, "sequence ", b, " block ", j,
                  " is out of range");
  }
  const bool write = k_new.has_value();
  TORCH_CHECK(write == v_new.has_value() && write == slot_mapping.has_value(),
              "k, v and slot_mapping come together");
  E* cache_rows = elems<E>(kv_cache);
  if (write) {
    for (const at::Tensor* t : {&*k_new, &*v_new}) {
      check_elems_cpu<E>(*t, "k and v");
      TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1,
                  "k and v must be [", T, ", ", Hkv, ", ", D, "] with contiguous heads");
    }
    TORCH_CHECK(slot_mapping->dim() == 1 && slot_mapping->size(0) == T && slot_mapping->scalar_type() == at::kLong &&
                    slot_mapping->is_contiguous() && slot_mapping->device().is_cpu(),
                "slot_mapping must be a contiguous int64 CPU tensor [", T, "]");
    const int64_t* slots = slot_mapping->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      // The new tokens are the sequence's last positions: their slots must be where the table says.
      for (int64_t i = qsl[b]; i < qsl[b + 1]; ++i) {
        const int64_t pos = lens[b] - (qsl[b + 1] - i);
        TORCH_CHECK(slots[i] == static_cast<int64_t>(tables[b * ldt + pos / bs]) * bs + pos % bs, "sequence ", b,
                    ": slot ", slots[i], " is not the block table's slot of position ", pos);
      }
    }
    // Every row is written before any task reads (a tile may read rows another tile's task owns).
    const E* knp = elems<E>(*k_new);
    const E* vnp = elems<E>(*v_new);
    const int64_t ldk = k_new->stride(0), ldkh = k_new->stride(1), ldv = v_new->stride(0), ldvh = v_new->stride(1);
    const size_t bytes = static_cast<size_t>(D) * sizeof(E);
    for (int64_t i = 0; i < T; ++i)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row = (slots[i] * Hkv + h) * D;  // slot-major rows of [blocks * block_size, Hkv, D]
        std::memcpy(cache_rows + row, knp + i * ldk + h * ldkh, bytes);
        std::memcpy(cache_rows + kv_cache.stride(0) + row, vnp + i * ldv + h * ldvh, bytes);
      }
  }
  // Tasks: (sequence, first query row of a tile) x KV head.
  const int64_t tile_rows = std::max<int64_t>(1, kRowTile / G);
  std::vector<std::pair<int64_t, int64_t>> tiles;
  tiles.reserve(static_cast<size_t>(T / tile_rows + B));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = qsl[b]; i < qsl[b + 1]; i += tile_rows) tiles.emplace_back(b, i);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());

  at::Tensor out = at::empty({T, H, D}, q.options());
  const E* qp = elems<E>(q);
  const E* kc = cache_rows;
  const E* vc = kc + kv_cache.stride(0);
  E* op = elems<E>(out);
  const int64_t ldq = q.stride(0), ldh = q.stride(1);
  const float fscale = static_cast<float>(scale);
  // vdpbf16ps scores for bf16 on avx512_bf16 (an odd head_dim keeps the fp32 ones).
  const bool pairs = bf16_pair_scores<E>() && D % 2 == 0;
  const int64_t P2 = D / 2, CG = (P2 + 15) / 16;  // bf16 pairs of a row, groups of 16 pairs
  at::parallel_for(0, num_tiles * Hkv, 1, [&](int64_t i0, int64_t i1) {
    const int64_t max_rows = tile_rows * G;
    std::vector<float> qf(static_cast<size_t>(pairs ? 0 : max_rows * C * 16));  // scaled query rows, fp32
    std::vector<uint32_t> qb(static_cast<size_t>(pairs ? max_rows * P2 : 0));   // query rows as bf16 pairs
    std::vector<float> kt(static_cast<size_t>(C * 16 * kPosBlock));             // K^T of one block
    std::vector<float> scores;
    std::vector<int64_t> offsets;
    std::vector<uint16_t> weights;     // with pairs: the bf16 softmax numerators, rows of pairs
    std::vector<int64_t> pair_offsets;  // with pairs: V row offsets from pbase on
    std::vector<float> inv_sum(static_cast<size_t>(max_rows));
    // Memory: a task's V rows are prefetched into L2 while its K rows are read, and the K rows of
    // the next task's first two blocks while its softmax and V pass run (a thread's first task's
    // before it starts); each K block prefetches the next into L1, a line at a time between its
    // own loads (a burst of them stalls on the miss buffers), and the V pass runs kPrefetchAhead
    // positions ahead.
    const auto prefetch_first_keys = [&](int64_t item) {
      const auto [b, first] = tiles[static_cast<size_t>(item / Hkv)];
      const int64_t h = item % Hkv;
      const int64_t pos0 = lens[b] - (qsl[b + 1] - first);
      const int64_t len = pos0 + std::min<int64_t>(tile_rows, qsl[b + 1] - first);
      const int64_t start = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
      const int32_t* table = tables + b * ldt;
      for (int64_t t = start; t < std::min(len, start + 2 * kPosBlock); ++t)
        prefetch_row<_MM_HINT_T1>(kc + ((static_cast<int64_t>(table[t / bs]) * bs + t % bs) * Hkv + h) * D, D);
    };
    prefetch_first_keys(i0);
    for (int64_t item = i0; item < i1; ++item) {
      const auto [b, first] = tiles[static_cast<size_t>(item / Hkv)];
      const int64_t h = item % Hkv;
      const int64_t last = std::min<int64_t>(first + tile_rows, qsl[b + 1]);  // query rows [first, last)
      const int64_t Q = last - first, R = Q * G;
      const int64_t pos0 = lens[b] - (qsl[b + 1] - first);  // position of query row `first`
      // Positions [start, len) cover every row's keys; row i sees [lo_i, pos0 + i] of them.
      const int64_t len = pos0 + Q;
      const auto lo = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, pos0 + i - window + 1) : int64_t{0}; };
      const int64_t start = lo(0);
      const int64_t n = len - start;
      const int64_t ns = (n + kPosBlock - 1) / kPosBlock * kPosBlock;  // score row stride
      const int32_t* table = tables + b * ldt;
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const E* qrow = qp + (first + i) * ldq + (h * G + g) * ldh;
          if (pairs) {
            std::memcpy(qb.data() + (i * G + g) * P2, qrow, static_cast<size_t>(P2) * sizeof(uint32_t));
          } else {
            for (int64_t c = 0; c < C; ++c)
              store(qf.data() + ((i * G + g) * C + c) * 16,
                    mul(load_elems(qrow + c * 16, tail_mask(D - c * 16)), set1(fscale)));
          }
        }
      scores.resize(static_cast<size_t>(R * ns));
      offsets.resize(static_cast<size_t>(n));
      for (int64_t t = start, j = start / bs, slot = start % bs; t < len; ++t) {  // no division per position
        offsets[t - start] = ((static_cast<int64_t>(table[j]) * bs + slot) * Hkv + h) * D;
        if (++slot == bs) {
          slot = 0;
          ++j;
        }
      }
      // A group of a row (16 values, or 16 bf16 pairs) is group_elems elements. (Pointers as locals:
      // the vector stores below may alias anything, so fields read through them would be
      // reloaded at every row.)
      const int64_t groups = pairs ? CG : C, group_elems = pairs ? 32 : 16, lanes = pairs ? P2 : D;
      const int64_t* off = offsets.data() - start;  // off[t]: offset of position t's K / V row
      float* const ktp = kt.data();
      for (int64_t t0 = start; t0 < len; t0 += kPosBlock) {
        // kt = K^T of positions [t0, t0 + kPosBlock) (zero rows past len): 16 x 16 blocks of fp32
        // values, or of bf16 pairs as 32-bit lanes. Beside the load of a row's group that starts
        // a cache line: that line of the same position's V row (into L2) and of the K row
        // kPosBlock positions on (into L1).
        for (int64_t half = 0; half < kPosBlock / 16; ++half) {
          const int64_t tb = t0 + half * 16, valid = std::clamp<int64_t>(len - tb, 0, 16);
          for (int64_t c = 0; c < groups; ++c) {
            const int64_t e0 = c * group_elems;
            const bool line = e0 * static_cast<int64_t>(sizeof(E)) % 64 == 0, full = lanes - c * 16 >= 16;
            const Mask m = tail_mask(lanes - c * 16);
            KBlock<E> kb;
            for (int64_t j = 0; j < 16; ++j) {
              if (j >= valid) {
                kb.clear(j);
                continue;
              }
              const int64_t t = tb + j;
              const E* krow = kc + off[t] + e0;
              if (line) {
                _mm_prefetch(reinterpret_cast<const char*>(vc + off[t] + e0), _MM_HINT_T1);
                if (t + kPosBlock < len) _mm_prefetch(reinterpret_cast<const char*>(kc + off[t + kPosBlock] + e0), _MM_HINT_T0);
              }
              kb.load_row(j, krow, full, lanes - c * 16, m, pairs);
            }
            const VecF* v = kb.transposed();
            for (int64_t i = 0; i < 16; ++i) store(ktp + (c * 16 + i) * kPosBlock + half * 16, v[i]);
          }
        }
        float* s = scores.data() + (t0 - start);
        for_each_tile(R, kScoreRows, [&](int64_t r0, int rt) {
          if (pairs) {
            score_rows<kScoreRows, bf16_pair_scores<E>()>(rt, kt.data(), qb.data() + r0 * P2, P2, P2, fscale,
                                                          s + r0 * ns, ns);
          } else {
            score_rows<kScoreRows, false>(rt, kt.data(), qf.data() + r0 * C * 16, C * 16, D, fscale, s + r0 * ns,
                                          ns);
          }
        });
      }
      if (item + 1 < i1) prefetch_first_keys(item + 1);
#if defined(PAGODA_ISA_AVX512_BF16)
      if constexpr (bf16_pair_scores<E>()) {
        if (pairs) {
          // Positions pair up from an even pbase (the same pairs for a row alone or in a
          // verification step); the numerators are rounded to bf16, and their sum is the fp32 sum
          // of the rounded values.
          const int64_t pbase = start & ~int64_t{1}, o = start - pbase, nsp = (o + n + 1) & ~int64_t{1};
          weights.resize(static_cast<size_t>(R * nsp));
          pair_offsets.resize(static_cast<size_t>(nsp));
          for (int64_t j = 0; j < nsp; ++j) pair_offsets[j] = offsets[std::clamp<int64_t>(j - o, 0, n - 1)];
          for (int64_t r = 0; r < R; ++r) {
            const float* s = scores.data() + r * ns;
            uint16_t* w = weights.data() + r * nsp + o;  // w[t - start]
            const int64_t i = r / G, valid_lo = lo(i) - start, valid_hi = i + 1 + (pos0 - start);
            const VecF top = row_max(s, valid_lo, valid_hi);
            std::fill(w - o, w + valid_lo, uint16_t{0});
            std::fill(w + valid_hi, w - o + nsp, uint16_t{0});
            VecF sum = zero();
            for (int64_t t = valid_lo; t < valid_hi; t += 16) {
              const Mask m = tail_mask(valid_hi - t);
              const VecF e = round_bf16(exp(sub(load(s + t, m), top)));
              store_bf16(w + t, e, m);
              sum = add(sum, select(m, e, zero()));
            }
            inv_sum[r] = 1.0f / reduce_add(sum);
          }
          const OutRows<E> out_rows{op + (first * H + h * G) * D, G, H * D, D};
          accumulate_v_pairs(vc, pair_offsets.data(), nsp / 2, D, reinterpret_cast<const uint32_t*>(weights.data()),
                             nsp / 2, inv_sum.data(), R, out_rows);
          continue;
        }
      }
#endif
      // Softmax numerators in place, exact zeros outside the row's [lo, p]; the division by
      // their sum is applied to the output.
      for (int64_t r = 0; r < R; ++r) {
        float* s = scores.data() + r * ns;
        const int64_t i = r / G, valid_lo = lo(i) - start, valid_hi = i + 1 + (pos0 - start);
        const VecF top = row_max(s, valid_lo, valid_hi);
        std::fill(s, s + valid_lo, 0.0f);
        std::fill(s + valid_hi, s + n, 0.0f);
        VecF sum = zero();
        for (int64_t t = valid_lo; t < valid_hi; t += 16) {
          const Mask m = tail_mask(valid_hi - t);
          const VecF e = exp(sub(load(s + t, m), top));
          store(s + t, e, m);
          sum = add(sum, select(m, e, zero()));
        }
        inv_sum[r] = 1.0f / reduce_add(sum);
      }
      const VRows<E> rows{vc, offsets.data(), D, start, len};
      const OutRows<E> out_rows{op + (first * H + h * G) * D, G, H * D, D};
      // Rows that fit one tile of kPassVecs take the widest passes (each V row read fewest times),
      // more take narrow ones (more rows per V load).
      const int pass = R > rows_per_tile(kPassVecs) ? kNarrowPass : kPassVecs;
      for (int64_t d0 = 0; d0 < D; d0 += 16 * pass) {
        const int c = static_cast<int>(std::min<int64_t>(pass, (D - d0 + 15) / 16));
        accumulate_pass<kPassVecs>(c, rows, d0, scores.data(), ns, inv_sum.data(), R, out_rows);
      }
    }
  });
  return out;
}

// bf16 or fp32 (fp32 models), by q's dtype; every other tensor must match it.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale, int64_t window,
                           const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                           const std::optional<at::Tensor>& slot_mapping) {
  if (q.scalar_type() == at::kFloat)
    return paged_attention_impl<float>(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, window, k_new,
                                       v_new, slot_mapping);
  return paged_attention_impl<uint16_t>(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, window, k_new,
                                        v_new, slot_mapping);
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor(a!) kv_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "float scale, int window, Tensor? k=None, Tensor? v=None, Tensor? slot_mapping=None) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}

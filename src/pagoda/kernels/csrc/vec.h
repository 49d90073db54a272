// The vector layer under pagoda's CPU kernels: 16 fp32 lanes (`VecF`) as one AVX-512 register or
// as two AVX2 registers, so that every kernel is written once and built per instruction set.
//
// A build defines exactly one of
//   PAGODA_ISA_AVX2         AVX2 + FMA (two 256-bit halves; bf16 rounding with integer ops)
//   PAGODA_ISA_AVX512       AVX-512 F/BW/VL/DQ (bf16 rounding with integer ops)
//   PAGODA_ISA_AVX512_BF16  AVX-512 plus AVX512-BF16 (native `vcvtneps2bf16` rounding)
// (`pagoda/kernels/build.py` does, one extension per variant). Everything here lives in a
// namespace named after the variant, so that several variants loaded into one process never
// share a symbol, and each variant registers its ops in its own torch library
// (`PAGODA_LIBRARY_FRAGMENT`, namespace `pagoda_<variant>`).
//
// Bit-equality across variants: every operation below gives the same bits on every variant
// (the AVX2 halves do exactly what the AVX-512 register does lane by lane; horizontal sums and
// the transposing sum use one fixed tree), with one exception, the bf16 rounding store:
//   - integer variants (avx2, avx512) round to nearest even and turn every NaN into 0xFFFF,
//     bit for bit what torch's CPU conversion (`tensor.to(torch.bfloat16)`) does;
//   - avx512_bf16 uses the native instruction: the same for every finite normal value and
//     infinity, but it flushes fp32 denormals to (signed) zero and keeps a NaN's sign and
//     payload (quietened), e.g. 0x7FC00000 -> 0x7FC0 where torch gives 0xFFFF.
// So a kernel written only with these operations gives equal bits on every variant, except where
// an output rounds a denormal or a NaN. (The GEMM on avx512_bf16 also multiplies bf16 pairs with
// vdpbf16ps, `dot_bf16_pairs`, which sums in its own order: see gemm_bf16.cpp.)
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(PAGODA_ISA_AVX512_BF16)
#define PAGODA_AVX512 1
#define PAGODA_VARIANT_NS avx512_bf16
#define PAGODA_OPS_NAMESPACE pagoda_avx512_bf16
#elif defined(PAGODA_ISA_AVX512)
#define PAGODA_AVX512 1
#define PAGODA_VARIANT_NS avx512
#define PAGODA_OPS_NAMESPACE pagoda_avx512
#elif defined(PAGODA_ISA_AVX2)
#define PAGODA_VARIANT_NS avx2
#define PAGODA_OPS_NAMESPACE pagoda_avx2
#else
#error "define one of PAGODA_ISA_AVX2, PAGODA_ISA_AVX512, PAGODA_ISA_AVX512_BF16 (see pagoda/kernels/build.py)"
#endif

// `PAGODA_LIBRARY_FRAGMENT(m) { m.def(...); m.impl(...); }` registers ops in this variant's torch
// library; every source file adds its own fragment (include <torch/library.h> first).
#define PAGODA_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define PAGODA_LIBRARY_FRAGMENT(m) PAGODA_LIBRARY_FRAGMENT_(PAGODA_OPS_NAMESPACE, m)

namespace pagoda_vec {
inline namespace PAGODA_VARIANT_NS {

#if defined(PAGODA_AVX512)

// ---- AVX-512: one register --------------------------------------------------------------------

using VecF = __m512;
using Mask = __mmask16;  // lanes [0, count) set
// fp32 vectors that fit in the register file beside a few temporaries (tile sizes derive from it).
constexpr int kVecRegs = 32;

inline Mask tail_mask(int64_t left) {
  if (left <= 0) return 0;
  return left >= 16 ? static_cast<Mask>(0xFFFF) : static_cast<Mask>((1u << left) - 1);
}

inline VecF zero() { return _mm512_setzero_ps(); }
inline VecF set1(float v) { return _mm512_set1_ps(v); }
inline VecF add(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF sub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF mul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF div(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline VecF max(VecF a, VecF b) { return _mm512_max_ps(a, b); }
inline VecF min(VecF a, VecF b) { return _mm512_min_ps(a, b); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline VecF fnmadd(VecF a, VecF b, VecF c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline VecF round_nearest(VecF v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for integral n in [-126, 127].
inline VecF pow2(VecF n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline VecF select(Mask m, VecF if_true, VecF if_false) { return _mm512_mask_blend_ps(m, if_false, if_true); }
// counts + 1 in the lanes where a > b (ordered: never where either is NaN).
inline VecF count_greater(VecF counts, VecF a, VecF b) {
  return _mm512_mask_add_ps(counts, _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), counts, _mm512_set1_ps(1.0f));
}

inline VecF load(const float* p) { return _mm512_loadu_ps(p); }
inline VecF load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }  // other lanes 0
inline void store(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, VecF v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }

// Each 32-bit lane's low bf16 (`widen_low`) or high bf16 (`widen_high`) as fp32.
inline VecF widen_low(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline VecF widen_high(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 bf16 values as fp32 (masked: other lanes read as 0 and their memory is not touched).
inline VecF load_bf16(const uint16_t* p) { return widen_low(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p))); }
inline VecF load_bf16(const uint16_t* p, Mask m) { return widen_low(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p))); }

// The first (`load_bf16_firsts`) or second (`load_bf16_seconds`) values of 16 bf16 pairs (32-bit
// lane i holds pair i) as fp32: one row of a GEMM weight panel holds column i at k and k + 1.
inline VecF load_bf16_firsts(const uint16_t* p) { return widen_low(_mm512_loadu_si512(p)); }
inline VecF load_bf16_seconds(const uint16_t* p) { return widen_high(_mm512_loadu_si512(p)); }

// The register a VecF is made of (kSplit of them, lanes in order), for register-tiled loops:
// arrays of VecN stay in registers where arrays of two-register VecF may not.
using VecN = __m512;
constexpr int kSplit = 1;
inline VecN set1_n(float v) { return _mm512_set1_ps(v); }
inline VecN load_n(const float* p) { return _mm512_loadu_ps(p); }
inline void store_n(float* p, VecN v) { _mm512_storeu_ps(p, v); }
// Part s of load_bf16_firsts / load_bf16_seconds.
inline VecN load_bf16_firsts_n(const uint16_t* p, int) { return load_bf16_firsts(p); }
inline VecN load_bf16_seconds_n(const uint16_t* p, int) { return load_bf16_seconds(p); }
// Register s of a VecF, and a VecF from its kSplit registers.
inline VecN part(VecF v, int) { return v; }
inline VecF join(const VecN* parts) { return parts[0]; }

#if defined(PAGODA_ISA_AVX512_BF16)
// acc[i] += a[2i + 1] * b[1] + a[2i] * b[0] for the 16 bf16 pairs at `a` and one bf16 pair `b`
// (vdpbf16ps: products exact in fp32, sums in fp32 with denormals flushed; its own summation
// order, so results differ from the fp32 multiply-adds in the last bits).
inline VecF dot_bf16_pairs(VecF acc, const uint16_t* a, uint32_t b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_set1_epi32(static_cast<int>(b)));
}
// The same with the 16 pairs already in a register (as the bit pattern of a VecF).
inline VecF dot_bf16_pairs(VecF acc, VecF a, uint32_t b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_set1_epi32(static_cast<int>(b)));
}
#endif

// 16 fp32 -> 16 bf16 bits, rounded to nearest even (see the header comment for NaN and denormals).
inline __m256i to_bf16_bits(VecF v) {
#if defined(PAGODA_ISA_AVX512_BF16)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), r);
  return _mm512_cvtepi32_epi16(r);
#endif
}
inline void store_bf16(uint16_t* p, VecF v) { _mm256_storeu_si256((__m256i*)p, to_bf16_bits(v)); }
inline void store_bf16(uint16_t* p, VecF v, Mask m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }
// The value torch would hold after storing each lane in a bf16 tensor.
inline VecF round_bf16(VecF v) { return widen_low(_mm512_cvtepu16_epi32(to_bf16_bits(v))); }

// The fixed reduction tree starts from the sum of the two 256-bit halves (lanes i and i + 8).
inline __m256 fold_halves(VecF v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline __m256 fold_halves_max(VecF v) {
  return _mm256_max_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Building blocks of `transpose_sum16` (semantics of the AVX-512 instructions of the same name:
// unpacks work within each 128-bit block; blocks are numbered 0..3).
inline VecF unpacklo(VecF a, VecF b) { return _mm512_unpacklo_ps(a, b); }
inline VecF unpackhi(VecF a, VecF b) { return _mm512_unpackhi_ps(a, b); }
inline VecF unpacklo64(VecF a, VecF b) {
  return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
inline VecF unpackhi64(VecF a, VecF b) {
  return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
inline VecF even_blocks(VecF a, VecF b) { return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)); }  // a0 a2 b0 b2
inline VecF odd_blocks(VecF a, VecF b) { return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)); }   // a1 a3 b1 b3

#else

// ---- AVX2: two registers, lanes 0..7 in `lo`, 8..15 in `hi` -----------------------------------

struct VecF {
  __m256 lo, hi;
};
struct Mask {
  __m256i lo, hi;  // all-ones lanes where set
  int count;       // lanes [0, count) are set
};
constexpr int kVecRegs = 8;

inline Mask tail_mask(int64_t left) {
  alignas(64) static const int32_t table[32] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0};
  const int count = left <= 0 ? 0 : left >= 16 ? 16 : static_cast<int>(left);
  const int32_t* p = table + 16 - count;
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 8)), count};
}

inline VecF zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VecF set1(float v) {
  const __m256 b = _mm256_set1_ps(v);
  return {b, b};
}
inline VecF add(VecF a, VecF b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline VecF sub(VecF a, VecF b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline VecF mul(VecF a, VecF b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline VecF div(VecF a, VecF b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline VecF min(VecF a, VecF b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline VecF fmadd(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline VecF fnmadd(VecF a, VecF b, VecF c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline VecF round_nearest(VecF v) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, mode), _mm256_round_ps(v.hi, mode)};
}
inline __m256 pow2_half(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline VecF pow2(VecF n) { return {pow2_half(n.lo), pow2_half(n.hi)}; }
inline VecF select(const Mask& m, VecF if_true, VecF if_false) {
  return {_mm256_blendv_ps(if_false.lo, if_true.lo, _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(if_false.hi, if_true.hi, _mm256_castsi256_ps(m.hi))};
}
inline VecF count_greater(VecF counts, VecF a, VecF b) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return {_mm256_add_ps(counts.lo, _mm256_and_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), one)),
          _mm256_add_ps(counts.hi, _mm256_and_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ), one))};
}

inline VecF load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline VecF load(const float* p, const Mask& m) { return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)}; }
inline void store(float* p, VecF v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store(float* p, VecF v, const Mask& m) {
  _mm256_maskstore_ps(p, m.lo, v.lo);
  _mm256_maskstore_ps(p + 8, m.hi, v.hi);
}

inline __m256 widen_low_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 widen_high_half(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline VecF widen_bits(__m256i bits16) {  // 16 bf16 bits in order -> fp32
  return {widen_low_half(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(bits16))),
          widen_low_half(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(bits16, 1)))};
}

inline VecF load_bf16(const uint16_t* p) { return widen_bits(_mm256_loadu_si256((const __m256i*)p)); }
// AVX2 has no 16-bit masked load: the valid lanes go through a zeroed buffer.
inline VecF load_bf16(const uint16_t* p, const Mask& m) {
  if (m.count == 16) return load_bf16(p);
  alignas(32) uint16_t buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(m.count) * sizeof(uint16_t));
  return load_bf16(buf);
}

using VecN = __m256;
constexpr int kSplit = 2;
inline VecN set1_n(float v) { return _mm256_set1_ps(v); }
inline VecN load_n(const float* p) { return _mm256_loadu_ps(p); }
inline VecN fmadd(VecN a, VecN b, VecN c) { return _mm256_fmadd_ps(a, b, c); }
inline void store_n(float* p, VecN v) { _mm256_storeu_ps(p, v); }
inline VecN part(VecF v, int s) { return s ? v.hi : v.lo; }
inline VecF join(const VecN* parts) { return {parts[0], parts[1]}; }
inline VecN load_bf16_firsts_n(const uint16_t* p, int s) {
  return widen_low_half(_mm256_loadu_si256((const __m256i*)(p + 16 * s)));
}
inline VecN load_bf16_seconds_n(const uint16_t* p, int s) {
  return widen_high_half(_mm256_loadu_si256((const __m256i*)(p + 16 * s)));
}

inline VecF load_bf16_firsts(const uint16_t* p) {
  return {widen_low_half(_mm256_loadu_si256((const __m256i*)p)), widen_low_half(_mm256_loadu_si256((const __m256i*)(p + 16)))};
}
inline VecF load_bf16_seconds(const uint16_t* p) {
  return {widen_high_half(_mm256_loadu_si256((const __m256i*)p)),
          widen_high_half(_mm256_loadu_si256((const __m256i*)(p + 16)))};
}

inline __m256i round_bits_half(__m256 v) {  // fp32 -> bf16 bits in the low 16 bits of each lane
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), r, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
}
inline __m256i to_bf16_bits(VecF v) {
  // packus interleaves the 128-bit lanes (lo0-3 hi0-3 lo4-7 hi4-7); the permute restores the order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bits_half(v.lo), round_bits_half(v.hi)), 0xD8);
}
inline void store_bf16(uint16_t* p, VecF v) { _mm256_storeu_si256((__m256i*)p, to_bf16_bits(v)); }
inline void store_bf16(uint16_t* p, VecF v, const Mask& m) {
  if (m.count == 16) return store_bf16(p, v);
  alignas(32) uint16_t buf[16];
  _mm256_store_si256((__m256i*)buf, to_bf16_bits(v));
  std::memcpy(p, buf, static_cast<size_t>(m.count) * sizeof(uint16_t));
}
inline VecF round_bf16(VecF v) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(round_bits_half(v.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(round_bits_half(v.hi), 16))};
}

inline __m256 fold_halves(VecF v) { return _mm256_add_ps(v.lo, v.hi); }
inline __m256 fold_halves_max(VecF v) { return _mm256_max_ps(v.lo, v.hi); }

inline VecF unpacklo(VecF a, VecF b) { return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)}; }
inline VecF unpackhi(VecF a, VecF b) { return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)}; }
inline __m256 unpack64_half(__m256 a, __m256 b, bool high) {
  const __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);
  return _mm256_castpd_ps(high ? _mm256_unpackhi_pd(x, y) : _mm256_unpacklo_pd(x, y));
}
inline VecF unpacklo64(VecF a, VecF b) { return {unpack64_half(a.lo, b.lo, false), unpack64_half(a.hi, b.hi, false)}; }
inline VecF unpackhi64(VecF a, VecF b) { return {unpack64_half(a.lo, b.lo, true), unpack64_half(a.hi, b.hi, true)}; }
// Blocks 0, 1 are a.lo's halves and 2, 3 a.hi's.
inline VecF even_blocks(VecF a, VecF b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(b.lo, b.hi, 0x20)};
}
inline VecF odd_blocks(VecF a, VecF b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, 0x31), _mm256_permute2f128_ps(b.lo, b.hi, 0x31)};
}

#endif

// ---- common to every variant ------------------------------------------------------------------

// Sum (max) of the 16 lanes, always in the same order: ((i, i + 8) pairs, then (i, i + 4), ...).
inline float reduce_add(VecF v) {
  const __m256 a = fold_halves(v);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
inline float reduce_max(VecF v) {
  const __m256 a = fold_halves_max(v);
  const __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(c, _mm_movehdup_ps(c)));
}

// Lane i of the result is op over the 16 lanes of v[i] (a transpose-and-reduce tree: one vector
// of 16 reductions without a horizontal one each). op is add or max.
template <typename Op>
inline VecF transpose_reduce16(const VecF v[16], Op op) {
  VecF a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = op(unpacklo(v[2 * i], v[2 * i + 1]), unpackhi(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) b[i] = op(unpacklo64(a[2 * i], a[2 * i + 1]), unpackhi64(a[2 * i], a[2 * i + 1]));
  // Block k of b[i] now holds, at position j, block k's partial result of v[4i + j]; reduce the
  // four blocks of each b[i] together and place them as lanes 4i .. 4i + 3.
  const VecF s01 = op(even_blocks(b[0], b[1]), odd_blocks(b[0], b[1]));
  const VecF s23 = op(even_blocks(b[2], b[3]), odd_blocks(b[2], b[3]));
  return op(even_blocks(s01, s23), odd_blocks(s01, s23));
}

// Lane i of the result is the sum of the 16 lanes of v[i].
inline VecF transpose_sum16(const VecF v[16]) {
  return transpose_reduce16(v, [](VecF x, VecF y) { return add(x, y); });
}

// Transposes the 16 x 16 block whose row j is v[j] in place (lane i of v[j] moves to lane j of
// v[i]); it only moves 32-bit lanes, so it also transposes bf16 pairs held as fp32 bit patterns.
inline void transpose16(VecF v[16]) {
  VecF t[16];
  for (int i = 0; i < 8; ++i) {  // t[2i], t[2i + 1]: rows 2i, 2i + 1 interleaved
    t[2 * i] = unpacklo(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = unpackhi(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // v[4i + c]: block k holds rows 4i .. 4i + 3 at column 4k + c
    v[4 * i] = unpacklo64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 1] = unpackhi64(t[4 * i], t[4 * i + 2]);
    v[4 * i + 2] = unpacklo64(t[4 * i + 1], t[4 * i + 3]);
    v[4 * i + 3] = unpackhi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather block k of v[c], v[4 + c], v[8 + c], v[12 + c] as row 4k + c
    const VecF p0 = even_blocks(v[c], v[4 + c]), p1 = odd_blocks(v[c], v[4 + c]);
    const VecF q0 = even_blocks(v[8 + c], v[12 + c]), q1 = odd_blocks(v[8 + c], v[12 + c]);
    t[c] = even_blocks(p0, q0);
    t[8 + c] = odd_blocks(p0, q0);
    t[4 + c] = even_blocks(p1, q1);
    t[12 + c] = odd_blocks(p1, q1);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

// exp by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (relative error ~2e-7, far
// below bf16 rounding); inputs are clamped to [-87, 88].
inline VecF exp(VecF x) {
  x = max(min(x, set1(88.0f)), set1(-87.0f));
  const VecF n = round_nearest(mul(x, set1(1.44269504088896341f)));
  VecF r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  VecF p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return mul(p, pow2(n));
}

// silu(g) * u = g / (1 + exp(-g)) * u.
inline VecF silu_mul(VecF gate, VecF up) {
  return mul(div(gate, add(set1(1.0f), exp(sub(zero(), gate)))), up);
}

}  // namespace PAGODA_VARIANT_NS
}  // namespace pagoda_vec

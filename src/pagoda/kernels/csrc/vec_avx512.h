// AVX-512 helpers shared by pagoda's CPU kernels: bf16 <-> fp32 vectors, masks, exp.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pagoda_vec {

// Lanes [0, left) set, for loads and stores of a row's last partial vector.
inline __mmask16 tail_mask(int64_t left) {
  if (left <= 0) return 0;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// The low and high bf16 halves of each 32-bit lane, as fp32.
inline __m512 widen_low(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 widen_high(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 bf16 values (lanes outside `mask` read as 0) as fp32.
inline __m512 load_bf16(const uint16_t* p, __mmask16 mask = 0xFFFF) {
  return widen_low(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)));
}

// Rounds to nearest even, like torch's fp32 -> bf16 conversion.
inline void store_bf16(uint16_t* p, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// exp by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (relative error ~2e-7,
// far below bf16 rounding); inputs are clamped to [-87, 88].
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace pagoda_vec

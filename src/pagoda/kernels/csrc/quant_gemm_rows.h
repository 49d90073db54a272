// The hot loops of quant_gemm.cpp, included once per integer dot product (inside a namespace that
// defines `Dot`, under a `#pragma GCC target` for its instruction set), so that everything they
// call compiles with that instruction set. Not a standalone header.

// One output row n against `Rows` activation rows: out[r] = sum_b d_w[b] * d_x[r][b] * dot_b.
template <int QType, int Rows>
PAGODA_INLINE void row_dot(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* wq = a.wq + n * a.row_bytes;
  const uint16_t* wd = a.wd + n * a.nb;
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const float dw = half_to_float(wd[b]);
    __m256i w;
    if constexpr (QType == kQ8_0) {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * kBlock));
    } else {
      w = load_nibbles(wq + b * (kBlock / 2));
    }
    for (int r = 0; r < Rows; ++r) {
      const int64_t row = m0 + r;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + row * a.K + b * kBlock));
      __m256 f;
      if constexpr (QType == kQ8_0) {
        f = _mm256_cvtepi32_ps(Dot::q8(w, x));
      } else {
        // (q - 8) . x = q . x - 8 * sum(x): each of the 8 lanes takes one eighth of the
        // correction (exact in float: |sum| < 2^12).
        f = _mm256_sub_ps(_mm256_cvtepi32_ps(Dot::u8(w, x)), _mm256_set1_ps(static_cast<float>(a.xs[row * a.nb + b])));
      }
      acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw * a.xd[row * a.nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) a.y[(m0 + r) * a.N + n] = hsum(acc[r]);
}

template <int QType>
PAGODA_INLINE void rows_range(const Args& a, int64_t begin, int64_t end) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, a.M - m0);
    for (int64_t n = begin; n < end; ++n) {
      switch (rows) {
        case 1: row_dot<QType, 1>(a, n, m0); break;
        case 2: row_dot<QType, 2>(a, n, m0); break;
        case 3: row_dot<QType, 3>(a, n, m0); break;
        case 4: row_dot<QType, 4>(a, n, m0); break;
        case 5: row_dot<QType, 5>(a, n, m0); break;
        case 6: row_dot<QType, 6>(a, n, m0); break;
        case 7: row_dot<QType, 7>(a, n, m0); break;
        default: row_dot<QType, 8>(a, n, m0); break;
      }
    }
  }
}


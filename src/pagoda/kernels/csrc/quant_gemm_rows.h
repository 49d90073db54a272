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

// Q5_0 from its raw 22-byte blocks (d, qh, qs[16]): values 0..31 (nibble | 5th bit << 4), minus 16.
template <int Rows>
PAGODA_INLINE void row_dot_q5_0(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.wq + n * a.row_bytes;
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* block = row + b * 22;
    uint16_t dbits;
    uint32_t qh;
    std::memcpy(&dbits, block, 2);
    std::memcpy(&qh, block + 2, 4);
    const float dw = half_to_float(dbits);
    const __m256i w = _mm256_or_si256(load_nibbles(block + 6), high_bits_16(qh));
    for (int r = 0; r < Rows; ++r) {
      const int64_t row_m = m0 + r;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + row_m * a.K + b * kBlock));
      // (q - 16) . x = q . x - 16 * sum(x): each of the 8 lanes takes one eighth.
      const __m256 f = _mm256_sub_ps(_mm256_cvtepi32_ps(Dot::u8(w, x)),
                                     _mm256_set1_ps(2.0f * static_cast<float>(a.xs[row_m * a.nb + b])));
      acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw * a.xd[row_m * a.nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) a.y[(m0 + r) * a.N + n] = hsum(acc[r]);
}

// Q6_K from its raw 210-byte super-blocks (ql[128], qh[64], int8 scales[16], d): per run of 32
// values (one activation block), 6-bit values minus 32 as int8, two 16-value sub-block scales.
template <int Rows>
PAGODA_INLINE void row_dot_q6_k(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.wq + n * a.row_bytes;
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t supers = a.K / 256;
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* block = row + sb * 210;
    uint16_t dbits;
    std::memcpy(&dbits, block + 208, 2);
    const float d = half_to_float(dbits);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = block + half * 64;
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + half * 32));
      for (int run = 0; run < 4; ++run) {
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * (run & 1)));
        const __m256i lo = run < 2 ? _mm256_and_si256(l, low4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * run), two);
        const __m256i w = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), off);
        const int sub = half * 8 + run * 2;  // scale index of the run's first 16 values
        const __m256 scale = _mm256_setr_m128(_mm_set1_ps(d * sc[sub]), _mm_set1_ps(d * sc[sub + 1]));
        const int64_t b = sb * 8 + half * 4 + run;  // activation block
        for (int r = 0; r < Rows; ++r) {
          const int64_t row_m = m0 + r;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + row_m * a.K + b * kBlock));
          const __m256 f = _mm256_cvtepi32_ps(Dot::q8(w, x));
          acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(scale, _mm256_set1_ps(a.xd[row_m * a.nb + b])), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r) a.y[(m0 + r) * a.N + n] = hsum(acc[r]);
}

// Q4_K from its raw 144-byte super-blocks (d, dmin, 12 bytes of 6-bit scales and mins, qs[128]):
// per sub-block j of 32 (one activation block) d * sc_j * (q . x) - dmin * m_j * sum(x).
template <int Rows>
PAGODA_INLINE void row_dot_q4_k(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.wq + n * a.row_bytes;
  __m256 acc[Rows];
  float mins[Rows];
  for (int r = 0; r < Rows; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = 0.0f;
  }
  const int64_t supers = a.K / 256;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* block = row + sb * 144;
    uint16_t dbits, mbits;
    std::memcpy(&dbits, block, 2);
    std::memcpy(&mbits, block + 2, 2);
    const float d = half_to_float(dbits), dmin = half_to_float(mbits);
    const uint8_t* q = block + 4;
    float sc[8], mn[8];
    for (int j = 0; j < 8; ++j) {
      const int s6 = j < 4 ? (q[j] & 63) : ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
      const int m6 = j < 4 ? (q[j + 4] & 63) : ((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
      sc[j] = d * static_cast<float>(s6);
      mn[j] = dmin * static_cast<float>(m6);
    }
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        const __m256i w = h == 0 ? _mm256_and_si256(bytes, low4) : _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        const int64_t b = sb * 8 + j;
        for (int r = 0; r < Rows; ++r) {
          const int64_t row_m = m0 + r;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + row_m * a.K + b * kBlock));
          const float dx = a.xd[row_m * a.nb + b];
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Dot::u8(w, x)), _mm256_set1_ps(sc[j] * dx), acc[r]);
          mins[r] += mn[j] * dx * static_cast<float>(a.xs[row_m * a.nb + b]);
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r) a.y[(m0 + r) * a.N + n] = hsum(acc[r]) - mins[r];
}

template <int QType, int Rows>
PAGODA_INLINE void any_row_dot(const Args& a, int64_t n, int64_t m0) {
  if constexpr (QType == kQ5_0) {
    row_dot_q5_0<Rows>(a, n, m0);
  } else if constexpr (QType == kQ6_K) {
    row_dot_q6_k<Rows>(a, n, m0);
  } else if constexpr (QType == kQ4_K) {
    row_dot_q4_k<Rows>(a, n, m0);
  } else {
    row_dot<QType, Rows>(a, n, m0);
  }
}

template <int QType>
PAGODA_INLINE void rows_range(const Args& a, int64_t begin, int64_t end) {
  // Output rows in groups small enough that their weights stay in L1/L2 while every tile of
  // activation rows passes over them: a batch reads each weight from memory once.
  for (int64_t n0 = begin; n0 < end; n0 += kRowsPerGroup) {
    const int64_t n1 = std::min(end, n0 + kRowsPerGroup);
    for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, a.M - m0);
      for (int64_t n = n0; n < n1; ++n) {
        switch (rows) {
          case 1: any_row_dot<QType, 1>(a, n, m0); break;
          case 2: any_row_dot<QType, 2>(a, n, m0); break;
          case 3: any_row_dot<QType, 3>(a, n, m0); break;
          case 4: any_row_dot<QType, 4>(a, n, m0); break;
          case 5: any_row_dot<QType, 5>(a, n, m0); break;
          case 6: any_row_dot<QType, 6>(a, n, m0); break;
          case 7: any_row_dot<QType, 7>(a, n, m0); break;
          default: any_row_dot<QType, 8>(a, n, m0); break;
        }
      }
    }
  }
}

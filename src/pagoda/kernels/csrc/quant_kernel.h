// The micro-kernels of quant_gemm.cpp, included once per integer dot product inside a namespace
// that defines `Dot` (under a `#pragma GCC target` for its instructions), so that everything
// they call compiles with it. Not a standalone header.
//
// `Dot` provides, on 64-byte vectors (IVec: 16 int32 lanes of 4 bytes each):
//   kQ8Bias:         128 if Q8_0 tiles enter the products as stored (q + 128, corrected through
//                    the block sum of x), 0 if Q8_0's products take the signed values themselves;
//   kPairs16:        false: dot(acc, w, x) (and dot_q8 for Q8_0) adds per lane the sum of 4
//                    products of unsigned w bytes and signed x bytes to acc (vpdpbusd);
//                    true: pairs(w, x) (pairs_q8) gives the 32 int16 sums of 2 products
//                    (vpmaddubsw), add16 adds such sums, widen(acc, p) adds a lane's two int16
//                    sums to its int32 (vpmaddwd by 1 + vpaddd). Up to `chunk` groups' pair sums
//                    add in int16 before one widen: exact, as no sum can leave int16 (see Traits).
//
// micro<QT, MR, NT>: MR activation rows x NT tiles (16 output rows each) over all of K, written
// as fp32 to out[r * ldo + 16 * t + lane]. For every block of 32 values each (row, tile) sums 8
// dot products in int32 (an accumulator started at the block's offset correction), then adds
// cvt(sum) * (weight scale x activation scale) to its fp32 sums, block after block in order:
// every output's arithmetic is the same whatever MR, NT, the thread split or the variant.

template <int QT>
struct Traits {
  static constexpr Layout lay = layout(QT);
  static constexpr int offset = QT == kQ8_0 ? Dot::kQ8Bias : lay.offset;
  static constexpr bool two_scales = QT == kQ6_K;  // Q6_K: a scale per 16 values
  static constexpr bool k_quant = lay.group_blocks == 8;
  // Groups whose int16 pair sums add before a widen: 2 * chunk products of at most (2^bits - 1)
  // x 127 each stay within 32,767 (Q8_0: |q| <= 128, one group). A power of two dividing 4, so
  // that Q6_K's two halves (groups 0-3, 4-7) never share a chunk.
  static constexpr int chunk = !Dot::kPairs16 ? 1 : lay.bits == 4 ? 8 : lay.bits == 5 ? 4 : lay.bits == 6 ? 2 : 1;
  static_assert(!Dot::kPairs16 || 2 * chunk * (QT == kQ8_0 ? 128 : (1 << lay.bits) - 1) * 127 <= 32767);
};

// The u8 values of group G (0..7) of a tile block (see quant_layout.h).
template <int Bits, int G>
PAGODA_INLINE IVec weight_group(const uint8_t* block) {
  if constexpr (Bits == 8) {
    return iload(block + 64 * G);
  } else {
    const IVec v = iload(block + 64 * (G & 3));
    const IVec nib = G < 4 ? iand(v, ibyte(0x0F)) : iand(isrl16<4>(v), ibyte(0x0F));
    if constexpr (Bits == 5) {
      const IVec plane = iload(block + 256);
      const IVec high = G <= 4 ? isll16<4 - G>(plane) : isrl16<G - 4>(plane);
      return ior_and(nib, high, ibyte(0x10));
    } else if constexpr (Bits == 6) {
      constexpr int i = G % 4;
      const IVec plane = iload(block + 256 + 64 * (G / 4));
      const IVec high = i <= 2 ? isll16<4 - 2 * i>(plane) : isrl16<2>(plane);
      return ior_and(nib, high, ibyte(0x30));
    } else {
      return nib;
    }
  }
}

// Adds group G's products of w and x to `sum` (kPairs16: through the chunk's int16 sums `p16`,
// widened at the chunk's last group).
template <class D, int QT, int G>
PAGODA_INLINE void group_step(IVec& sum, IVec& p16, IVec w, IVec x) {
  if constexpr (D::kPairs16) {
    constexpr int chunk = Traits<QT>::chunk;
    const IVec p = QT == kQ8_0 ? D::pairs_q8(w, x) : D::pairs(w, x);
    // (GCC reassociates these adds into trees over the block's products and spills some of them
    // at 2-3 rows; an asm barrier keeping the chains linear ran Q4_0 at 32 rows 1.5x slower and
    // Q8_0 1.4x slower: AMD EPYC Zen 3, avx2, 1 thread.)
    if constexpr (chunk == 1) {
      sum = D::widen(sum, p);
    } else {
      p16 = G % chunk == 0 ? p : D::add16(p16, p);
      if constexpr (G % chunk == chunk - 1) sum = D::widen(sum, p16);
    }
  } else {
    sum = QT == kQ8_0 ? D::dot_q8(sum, w, x) : D::dot(sum, w, x);
  }
}

template <int QT, int MR, int NT>
void micro(const TileArgs& w, const Acts& x, int64_t row0, float* out, int64_t ldo) {
  using T = Traits<QT>;
  constexpr Layout lay = T::lay;
  VecF acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = zero();
  const int8_t* xq = x.q + row0 * x.K;
  const int64_t groups = x.nb / lay.group_blocks;
  for (int64_t G = 0; G < groups; ++G) {
    // Per tile: the scale group's fp16 d (and dmin) as fp32.
    VecF d[NT], dmin[NT];
    const uint8_t* sg[NT];
    for (int t = 0; t < NT; ++t) {
      sg[t] = w.scales + t * w.scale_stride + G * w.scale_group;
      d[t] = load_f16(sg[t]);
      if constexpr (lay.affine) dmin[t] = load_f16(sg[t] + 32);
    }
#pragma GCC unroll 1
    for (int j = 0; j < lay.group_blocks; ++j) {
      const int64_t b = G * lay.group_blocks + j;
      IVec ia[MR][NT], ib[MR][NT];
      for (int r = 0; r < MR; ++r) {
        const int32_t* s = x.s16 + (row0 + r) * 2 * x.nb + 2 * b;
        if constexpr (T::two_scales) {
          const IVec a = ibcast(-T::offset * s[0]), c = ibcast(-T::offset * s[1]);
          for (int t = 0; t < NT; ++t) {
            ia[r][t] = a;
            ib[r][t] = c;
          }
        } else {
          const IVec a = ibcast(-T::offset * (s[0] + s[1]));
          for (int t = 0; t < NT; ++t) ia[r][t] = a;
        }
      }
      const uint8_t* vb[NT];
      for (int t = 0; t < NT; ++t) vb[t] = w.values + t * w.value_stride + G * w.value_group + j * lay.block_value_bytes;
      if (w.next != nullptr) {
        // A later row block: this pair is in cache; fetch this block's lines of the slice of the
        // next pair the driver gave it, into L2.
        const int64_t l0 = b * w.next_per_block, l1 = std::min(l0 + w.next_per_block, w.next_lines);
        for (int64_t l = l0; l < l1; ++l) _mm_prefetch(reinterpret_cast<const char*>(w.next + 64 * l), _MM_HINT_T1);
      } else if (w.inline_scales) {
        // One sequential stream (the pair's scales and values, pairs one after another). More
        // rows, whose compute runs longer per byte, fetch this block's share kPrefetchBytes ahead
        // into L2; one row does only where kPrefetchOneRow says so.
        if ((MR > 1 || kPrefetchOneRow) && w.stream != nullptr) {
          constexpr int64_t share = 2 * (lay.group_scale_bytes + lay.group_blocks * lay.block_value_bytes) / lay.group_blocks;
          const uint8_t* p = w.stream + G * w.scale_group + j * share + kPrefetchBytes;
          for (int l = 0; l < share; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T1);
        }
      } else {
        // Fetch the values kPrefetchBytes ahead into L2, in the order the driver reads them: past
        // a tile's end, the same place of the tile NT further on (the next call's; tiles lie one
        // after another), so each stream stays ahead across calls. (With several row blocks per
        // tile pair only the first reads from memory: the later ones fetch the next pair, above.)
        const int64_t skip = b * lay.block_value_bytes + kPrefetchBytes < w.value_stride ? 0 : (NT - 1) * w.value_stride;
        for (int t = 0; t < NT; ++t) {
          const uint8_t* p = vb[t] + skip + kPrefetchBytes;
          // One base register and the lines at immediate offsets: else the compiler keeps the 16
          // offsets in vector registers and moves them back per block (Q8_0 at 16-64 rows, AMD EPYC
          // Zen 4, avx512_vnni: 1.01-1.035x).
          asm("" : "+r"(p));
          for (int l = 0; l < lay.block_value_bytes; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T1);
        }
      }
      IVec p16[MR][NT];  // kPairs16: the int16 pair sums of the chunk so far
      [&]<int... Gs>(std::integer_sequence<int, Gs...>) {
        (
            [&] {
              IVec wv[NT];
              for (int t = 0; t < NT; ++t) wv[t] = weight_group<lay.bits, Gs>(vb[t]);
              for (int r = 0; r < MR; ++r) {
                const IVec xb = ibcast(load32(xq + r * x.K + b * kBlock + 4 * Gs));
                for (int t = 0; t < NT; ++t) {
                  group_step<Dot, QT, Gs>(T::two_scales && Gs >= 4 ? ib[r][t] : ia[r][t], p16[r][t], wv[t], xb);
                }
              }
            }(),
            ...);
      }(std::make_integer_sequence<int, 8>{});
      // fp32: sums x (weight scale x activation scale), minus the minimum terms.
      VecF scale[NT], scale_b[NT], minimum[NT];
      for (int t = 0; t < NT; ++t) {
        if constexpr (T::two_scales) {
          scale[t] = mul(d[t], load_i8(sg[t] + 32 + 16 * (2 * j)));
          scale_b[t] = mul(d[t], load_i8(sg[t] + 32 + 16 * (2 * j + 1)));
        } else if constexpr (T::k_quant) {
          scale[t] = mul(d[t], load_u8(sg[t] + 64 + 16 * j));
          minimum[t] = mul(dmin[t], load_u8(sg[t] + 192 + 16 * j));
        } else {
          scale[t] = d[t];
          if constexpr (lay.affine) minimum[t] = dmin[t];
        }
      }
      for (int r = 0; r < MR; ++r) {
        const VecF dx = set1(x.d[(row0 + r) * x.nb + b]);
        for (int t = 0; t < NT; ++t) {
          acc[r][t] = fmadd(icvt(ia[r][t]), mul(scale[t], dx), acc[r][t]);
          if constexpr (T::two_scales) acc[r][t] = fmadd(icvt(ib[r][t]), mul(scale_b[t], dx), acc[r][t]);
          if constexpr (lay.affine) {
            const VecF ds = set1(x.dsum[(row0 + r) * x.nb + b]);
            // Q4_1 / Q5_1 add their minimum m; the K-quants subtract dmin * mn.
            acc[r][t] = T::k_quant ? fnmadd(minimum[t], ds, acc[r][t]) : fmadd(minimum[t], ds, acc[r][t]);
          }
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NT; ++t) store(out + r * ldo + kTileRows * t, acc[r][t]);
}

template <int QT, int... MRs>
constexpr std::array<MicroFn, sizeof...(MRs)> micro_row(std::integer_sequence<int, MRs...>) {
  return {&micro<QT, MRs + 1, tiles_per_call(layout(QT), MRs + 1)>...};
}

// table[type_index(qtype)][MR - 1]
inline const MicroTable& micro_table() {
  static const MicroTable table = {
      micro_row<kQ8_0>(std::make_integer_sequence<int, kMaxMR>{}),
      micro_row<kQ4_0>(std::make_integer_sequence<int, kMaxMR>{}),
      micro_row<kQ4_1>(std::make_integer_sequence<int, kMaxMR>{}),
      micro_row<kQ5_0>(std::make_integer_sequence<int, kMaxMR>{}),
      micro_row<kQ5_1>(std::make_integer_sequence<int, kMaxMR>{}),
      micro_row<kQ4_K>(std::make_integer_sequence<int, kMaxMR>{}),
      micro_row<kQ5_K>(std::make_integer_sequence<int, kMaxMR>{}),
      micro_row<kQ6_K>(std::make_integer_sequence<int, kMaxMR>{}),
  };
  return table;
}

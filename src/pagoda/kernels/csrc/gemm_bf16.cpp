// bf16-weight linear for x86-64 CPUs: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), built once per
// instruction-set variant over the vector layer in vec.h.
//
// The weight is repacked once into panels of 32 output columns, [ceil(N / 32)][K][32] bf16, with
// the two halves of a panel interleaved: 32-bit lane i of a panel row holds column i in its low
// 16 bits and column 16 + i in its high 16 bits. One 64-byte load (one AVX-512 register or two
// AVX2 registers) then widens to two fp32 vectors with one shift and one mask, and every
// multiply-add runs in fp32 (vfmadd231ps), the fastest arithmetic these CPUs have for bf16 data
// (vdpbf16ps runs at half its rate; without AMX nothing is faster). The layout is the same for
// every variant, so a weight packed by one runs on any other.
//
// The micro-kernel keeps an MR x (NP * 32) tile of fp32 sums in registers for the whole K
// loop and broadcasts one fp32 value of x per row and k (bf16 rows are widened once per task
// into a thread-local buffer). Few rows (decode) stream NP panels at once, bound by memory
// bandwidth; many rows (prefill) are bound by the multiply-adds, and work is split into
// (group of rows that fits in L2) x (chunk of panels) tasks so that each panel, once read, is
// reused from cache by every block of MR rows in the group. Every output is summed over k in
// order, whatever the tile, the thread count or the variant: results are equal bit for bit
// across all of them (up to the bf16 store, see vec.h).
//
// Epilogues: plain (+ bias), or SwiGLU, for a gate/up weight packed with `swiglu`: panel j then
// holds gate columns 16j..16j+15 in its low halves and the matching up columns in its high
// halves, and the kernel writes silu(gate) * up (16 outputs per panel) without a round trip
// through memory.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace pagoda_vec;

constexpr int kPanel = 32;  // output columns per panel
// Rows per micro-tile and panels streamed at once for MR rows: 2 * MR * NP accumulators plus
// the widened weights fit in the register file (32 vectors of 16 lanes on AVX-512, 8 on AVX2).
// Up to kAheadRows rows prefetch the panel rows they are about to read into L1; more rows reuse
// each panel from cache and prefetch the next panels into L2 instead.
#if defined(PAGODA_AVX512)
constexpr int kMaxMR = 14;
constexpr int np_for(int mr) { return mr <= 2 ? 4 : mr <= 4 ? 3 : mr <= 6 ? 2 : 1; }
constexpr int kAheadRows = 4;
#else
constexpr int kMaxMR = 3;
constexpr int np_for(int mr) { return mr == 1 ? 3 : 1; }
constexpr int kAheadRows = 1;
#endif
// Rows of x whose fp32 copy share one pass over the weight: all rows of a decode batch (the
// weight is then read from memory once); otherwise as many as fit in 128 KB, which measured
// fastest for prefill (2048 rows: 7% faster than 1 MB groups).
constexpr int64_t kSingleGroupRows = 64;
constexpr int64_t kGroupBytes = 128 << 10;
constexpr int64_t kChunkBytes = 256 << 10;  // weight bytes per task
constexpr int kPrefetchRows = 16;           // panel rows ahead to prefetch when few rows stream

enum Epilogue : int64_t { kPlain = 0, kSwiGLU = 1 };

// ---- packing ---------------------------------------------------------------------------------

// w [N, K] -> [ceil(N / 32)][K][32] interleaved; with swiglu, w is [gate; up] with N = 2 * I and
// panel j takes gate rows 16j.. and up rows I + 16j.. .
at::Tensor pack_weight(const at::Tensor& w, bool swiglu) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "weight must be a 2-D bfloat16 CPU tensor");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  TORCH_CHECK(!swiglu || N % 2 == 0, "a SwiGLU weight needs an even number of rows, got ", N);
  const int64_t half = swiglu ? N / 2 : 0;
  const int64_t panels = swiglu ? (half + 15) / 16 : (N + kPanel - 1) / kPanel;
  at::Tensor out = at::empty({panels, K, kPanel}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint16_t* panel = dst + p * K * kPanel;
      for (int i = 0; i < 16; ++i) {
        for (int h = 0; h < 2; ++h) {
          // Source row of lane i, half h (h = 0: low 16 bits, h = 1: high 16 bits).
          int64_t row;
          bool valid;
          if (swiglu) {
            const int64_t col = p * 16 + i;
            valid = col < half;
            row = h == 0 ? col : half + col;
          } else {
            row = p * kPanel + h * 16 + i;
            valid = row < N;
          }
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + 2 * i + h] = valid ? src[row * K + k] : 0;
        }
      }
    }
  });
  return out;
}

// ---- micro-kernel ----------------------------------------------------------------------------

struct Out {
  void* y;             // [M, ldy] bf16 or fp32
  int64_t ldy;
  bool fp32;
  int64_t n_valid;     // output columns
  const float* bias;   // [n_valid] (plain) or [2 * n_valid] gate then up (SwiGLU), or nullptr
  Epilogue epilogue;
};

// Columns col .. col + 15 of `row` (those below n_valid), already biased.
inline void store16(const Out& o, int64_t row, int64_t col, VecF v) {
  const int64_t left = o.n_valid - col;
  if (left <= 0) return;
  if (o.fp32) {
    float* dst = static_cast<float*>(o.y) + row * o.ldy + col;
    left >= 16 ? store(dst, v) : store(dst, v, tail_mask(left));
  } else {
    uint16_t* dst = static_cast<uint16_t*>(o.y) + row * o.ldy + col;
    left >= 16 ? store_bf16(dst, v) : store_bf16(dst, v, tail_mask(left));
  }
}

inline VecF load_bias(const float* b, int64_t left) { return left >= 16 ? load(b) : load(b, tail_mask(left)); }

// Rows [0, MR) of x (fp32, row stride ldx) times panels panel0 .. panel0 + NP of w (panel
// stride K * 32); `next` is where the following panels start, prefetched into L2 on the way.
template <int MR, int NP>
void micro(const float* x, int64_t ldx, const uint16_t* w, int64_t K, const Out& o, int64_t row0, int64_t panel0,
           const uint16_t* next) {
  VecF acc[MR][2 * NP];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NP; ++j) acc[m][j] = zero();
  const int64_t pstride = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    VecF wv[2 * NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const uint16_t* src = w + p * pstride + k * kPanel;
      if (MR <= kAheadRows) {
        _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchRows * kPanel), _MM_HINT_T0);
      } else if (next) {
        _mm_prefetch(reinterpret_cast<const char*>(next + p * pstride + k * kPanel), _MM_HINT_T1);
      }
      load_bf16_pairs(src, wv[2 * p], wv[2 * p + 1]);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const VecF a = set1(x[m * ldx + k]);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NP; ++j) acc[m][j] = fmadd(a, wv[j], acc[m][j]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      VecF lo = acc[m][2 * p], hi = acc[m][2 * p + 1];
      if (o.epilogue == kSwiGLU) {
        const int64_t col = (panel0 + p) * 16;
        if (o.bias) {
          lo = add(lo, load_bias(o.bias + col, o.n_valid - col));
          hi = add(hi, load_bias(o.bias + o.n_valid + col, o.n_valid - col));
        }
        store16(o, row0 + m, col, silu_mul(lo, hi));
      } else {
        const int64_t col = (panel0 + p) * kPanel;
        if (o.bias) {
          lo = add(lo, load_bias(o.bias + col, o.n_valid - col));
          hi = add(hi, load_bias(o.bias + col + 16, o.n_valid - col - 16));
        }
        store16(o, row0 + m, col, lo);
        store16(o, row0 + m, col + 16, hi);
      }
    }
  }
}

// One block of MR rows times panels [p0, p1); panels up to `last` may be prefetched.
template <int MR>
void block_panels(const float* x, int64_t ldx, const uint16_t* w, int64_t K, const Out& o, int64_t row0, int64_t p0,
                  int64_t p1, int64_t last) {
  // Few rows are bound by reading the weight: stream several panels at once.
  constexpr int NP = np_for(MR);
  const int64_t pstride = K * kPanel;
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) {
    const uint16_t* next = p + 2 * NP <= last ? w + (p + NP) * pstride : nullptr;
    micro<MR, NP>(x, ldx, w + p * pstride, K, o, row0, p, next);
  }
  for (; p < p1; ++p) micro<MR, 1>(x, ldx, w + p * pstride, K, o, row0, p, p + 2 <= last ? w + (p + 1) * pstride : nullptr);
}

using BlockFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, const Out&, int64_t, int64_t, int64_t,
                         int64_t);

template <int... Is>
constexpr auto make_table(std::integer_sequence<int, Is...>) {
  return std::array<BlockFn, sizeof...(Is)>{&block_panels<Is + 1>...};
}
constexpr auto kBlockFns = make_table(std::make_integer_sequence<int, kMaxMR>{});

// M rows split into ceil(M / kMaxMR) blocks of near-equal size: (first row, rows).
std::vector<std::pair<int64_t, int>> row_blocks(int64_t M) {
  const int64_t n = (M + kMaxMR - 1) / kMaxMR;
  std::vector<std::pair<int64_t, int>> blocks;
  int64_t row = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int rows = static_cast<int>((M - row) / (n - b));
    blocks.emplace_back(row, rows);
    row += rows;
  }
  return blocks;
}

// One bf16 row of x widened to fp32.
inline void widen_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store(dst + i, load_bf16(s + i));
  if (i < n) {
    const Mask m = tail_mask(n - i);
    store(dst + i, load_bf16(s + i, m), m);
  }
}

// Work is split into tasks of (a group of row blocks) x (a chunk of panels). Within a task each
// panel is reused from cache by every row block of the group; bf16 rows of x are widened to fp32
// once per group and thread.
template <typename T>
void run(const T* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t panels, const Out& o) {
  const auto blocks = row_blocks(M);
  const int64_t row_bytes = std::max<int64_t>(K, 1) * static_cast<int64_t>(sizeof(float));
  std::vector<std::pair<size_t, size_t>> groups;  // [first block, end block)
  for (size_t b = 0; b < blocks.size();) {
    size_t e = b + 1;
    int64_t rows = blocks[b].second;
    while (e < blocks.size() && (M <= kSingleGroupRows || (rows + blocks[e].second) * row_bytes <= kGroupBytes))
      rows += blocks[e++].second;
    groups.emplace_back(b, e);
    b = e;
  }
  const int64_t chunk = std::max<int64_t>(4, kChunkBytes / (std::max<int64_t>(K, 1) * kPanel * 2)) / 4 * 4;
  int64_t chunks = (panels + chunk - 1) / chunk;
  if (groups.size() == 1) {
    // One group (decode): a multiple of the thread count of near-equal chunks, so that every
    // thread streams the same number of panels.
    const int64_t threads = std::min<int64_t>(panels, at::get_num_threads());
    chunks = threads * ((chunks + threads - 1) / threads);
  }
  chunks = std::min(chunks, panels);
  const int64_t tasks = static_cast<int64_t>(groups.size()) * chunks;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> buffer;
    int64_t converted = -1;  // the group whose rows `buffer` holds
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / chunks, c = t % chunks;
      const auto [b0, b1] = groups[g];
      const int64_t row0 = blocks[b0].first;
      const float* xg;
      int64_t ldg;
      if constexpr (std::is_same_v<T, float>) {
        xg = x + row0 * ldx;
        ldg = ldx;
      } else {
        const int64_t rows = blocks[b1 - 1].first + blocks[b1 - 1].second - row0;
        if (converted != g) {
          buffer.resize(static_cast<size_t>(rows * K));
          for (int64_t r = 0; r < rows; ++r) widen_row(x + (row0 + r) * ldx, buffer.data() + r * K, K);
          converted = g;
        }
        xg = buffer.data();
        ldg = K;
      }
      const int64_t p_begin = c * panels / chunks, p_end = (c + 1) * panels / chunks;
      // Panels outer, row blocks inner; a single block streams the whole chunk at once.
      const int64_t step = b1 - b0 == 1 ? p_end - p_begin : 1;
      for (int64_t p = p_begin; p < p_end; p += step) {
        for (size_t b = b0; b < b1; ++b) {
          const auto [row, rows] = blocks[b];
          kBlockFns[rows - 1](xg + (row - row0) * ldg, ldg, w, K, o, row, p, std::min(p + step, p_end), panels);
        }
      }
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                         int64_t epilogue, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              "packed must be a contiguous bfloat16 CPU tensor of shape [panels, K, 32]");
  TORCH_CHECK(epilogue == kPlain || epilogue == kSwiGLU, "unknown epilogue ", epilogue);
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed weight has K=", packed.size(1), ", x has ", K);
  const int64_t cols_per_panel = epilogue == kSwiGLU ? 16 : kPanel;
  TORCH_CHECK(n >= 1 && (n + cols_per_panel - 1) / cols_per_panel == panels, "n=", n, " does not match ", panels,
              " panels");
  const float* b = nullptr;
  if (bias.has_value()) {
    const int64_t bias_len = epilogue == kSwiGLU ? 2 * n : n;
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == bias_len && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous() && bias->device().is_cpu(),
                "bias must be a contiguous float32 CPU tensor of shape [", bias_len, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, n}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const Out o{y.data_ptr(), n, out_fp32, n, b, static_cast<Epilogue>(epilogue)};
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  if (xc.scalar_type() == at::kFloat) {
    run(xc.data_ptr<float>(), xc.stride(0), M, K, w, panels, o);
  } else {
    run(xc.data_ptr<c10::BFloat16>(), xc.stride(0), M, K, w, panels, o);
  }
  return y;
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def("pack_weight(Tensor w, bool swiglu) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias, int epilogue, bool out_fp32) -> Tensor");
  m.impl("pack_weight", c10::DispatchKey::CPU, TORCH_FN(pack_weight));
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}

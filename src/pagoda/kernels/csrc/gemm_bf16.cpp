// bf16- and fp32-weight linear for x86-64 CPUs: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), built
// once per instruction-set variant over the vector layer in vec.h.
//
// The weight is repacked once into panels of 16 output columns holding pairs of consecutive k:
// [ceil(N / 16)][ceil(K / 2)][16][2] bf16, so that 32-bit lane i of a 64-byte panel row holds
// column i at k (low 16 bits) and k + 1 (high 16 bits); an odd K is padded with a zero. The
// layout is the same for every variant (a weight packed by one runs on any other) and serves
// two kinds of arithmetic:
//   - fp32 multiply-adds (avx2, avx512, and fp32 inputs everywhere): one shift and one mask
//     widen a panel row into the fp32 weights of k and k + 1, each output is summed over k in
//     order; results are equal bit for bit whatever the variant, tile or thread count;
//   - vdpbf16ps (avx512_bf16 with bf16 inputs): one instruction multiplies a panel row by a
//     broadcast pair of x values and adds both products, twice the multiply-add rate of fp32
//     FMAs on CPUs that run it at full width (AMD Zen 4), with nothing to widen. Its sums run
//     in the instruction's own order (pair by pair, denormals flushed), so they differ from the
//     fp32 path in the last bits; results are still independent of tiles and threads.
// An fp32 weight (fp32 models) is packed the same way with one k per 64-byte panel row,
// [ceil(N / 16)][K][16] fp32, and always takes fp32 multiply-adds: each output summed over k in
// order, equal bit for bit on every variant, tile and thread count.
//
// The micro-kernel keeps an MR x (NP * 16) tile of fp32 sums in registers for the whole K loop
// and broadcasts x per row and k (bf16 rows are copied once per task into a thread-local
// buffer: widened to fp32, or padded to an even length for vdpbf16ps). Few rows (decode) stream
// NP panels at once, bound by memory bandwidth; many rows (prefill) are bound by arithmetic, and
// work is split into (group of rows that fits in L2) x (chunk of panels) tasks so that each
// panel, once read, is reused from cache by every block of MR rows in the group.
//
// Epilogues: plain (+ bias), or SwiGLU for a gate/up weight packed with `swiglu`: panels 2j and
// 2j + 1 then hold gate and up columns 16j..16j+15, and the kernel writes silu(gate) * up without
// a round trip through memory.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace pagoda_vec;

constexpr int kCols = 16;       // output columns per panel
constexpr int kRowElems = 32;   // bf16 values per panel row: 16 columns x 2 k

// Panel geometry per weight element type: a 64-byte panel row holds 2 k of bf16 (uint16_t bits)
// or 1 k of fp32.
template <typename Wt>
constexpr int kPerRow = std::is_same_v<Wt, float> ? 1 : 2;
template <typename Wt>
constexpr int kElems = kCols * kPerRow<Wt>;  // elements per panel row
template <typename Wt>
constexpr int64_t panel_rows(int64_t K) { return (K + kPerRow<Wt> - 1) / kPerRow<Wt>; }
template <typename Wt>
constexpr int64_t panel_stride(int64_t K) { return panel_rows<Wt>(K) * kElems<Wt>; }  // elements per panel
// Rows per micro-tile, and panels streamed at once for MR rows: MR * NP fp32 sums plus the
// panel rows being widened fit in the register file (32 vectors of 16 lanes on AVX-512, 8 on
// AVX2). Up to kAheadRows rows prefetch the panel rows they are about to read, `prefetch_rows`
// ahead with hint kAheadHint; more rows reuse each panel from cache and prefetch the next panels
// into L2 instead.
//   - AVX-512 prefetches into L1 as non-temporal (each weight is read once per step: it should
//     not push the rest of the step's data, Python's included, out of L2 and L3).
//   - AVX2 streams 4 panels at one row (8 sums: an 8-panel task runs as two full tiles, and a
//     SwiGLU tile holds two gate/up pairs; 3 panels left 3 + 3 + 1 + 1 and SwiGLU tiles of 2)
//     and prefetches into L2. AMD Zen 4, one thread, process CPU time, 24 distinct layers of
//     Qwen2.5-0.5B's shape streamed from memory at M = 1 (two runs): 3 panels + non-temporal
//     78-80% of a read probe in the same process, 4 panels + non-temporal 74%, 4 panels + no
//     prefetch 86-91%, 4 panels + L2 (T1) 16 rows ahead 91-94% (12 rows 89%, 24 rows 81%).
// (Checked in the generated code: these tiles keep every sum in a register; one row or panel
// more and GCC spills sums to the stack in the K loop.)
#if defined(PAGODA_AVX512)
constexpr int kMaxMR = 13;
constexpr int np_for(int mr) { return mr <= 2 ? 8 : mr <= 3 ? 6 : mr <= 5 ? 4 : 2; }
constexpr int kAheadRows = 4;
constexpr auto kAheadHint = _MM_HINT_NTA;
#else
constexpr int kMaxMR = 4;
constexpr int np_for(int mr) { return mr == 1 ? 4 : mr == 2 ? 2 : 1; }
constexpr int kAheadRows = 1;
constexpr auto kAheadHint = _MM_HINT_T1;
#endif
// Rows of x whose copy share one pass over the weight: all rows of a decode batch (the weight
// is then read from memory once); otherwise as many as fit in 128 KB, which measured fastest
// for prefill (2048 rows: 7% faster than 1 MB groups).
constexpr int64_t kSingleGroupRows = 64;
constexpr int64_t kGroupBytes = 128 << 10;
constexpr int64_t kChunkBytes = 256 << 10;  // weight bytes per task
// Panel rows ahead to prefetch when few rows stream NP panels: about 4 KB in flight over all
// streams. (AMD Zen 4, one thread, decode GEMMs of Qwen2.5-0.5B's shape with 8 streams: 8 rows
// ahead read 15% faster than 16 and 30% faster than 32; AVX2's 4 streams: see kAheadHint. The
// non-temporal hint on AVX-512: a decode step of that shape 8-15% faster than with T0, in four
// alternating pairs of runs: the GEMMs and the Python around them both faster.)
constexpr int prefetch_rows(int np) { return np >= 6 ? 8 : 16; }

enum Epilogue : int64_t { kPlain = 0, kSwiGLU = 1 };

// ---- packing ---------------------------------------------------------------------------------

// w [N, K] -> [panels][ceil(K / 2)][32] (bf16) or [panels][K][16] (fp32); with swiglu, w is
// [gate; up] with N = 2 * I, and panels 2j and 2j + 1 take gate rows 16j.. and up rows I + 16j.. .
template <typename Wt>
void pack_panels(const Wt* src, Wt* dst, int64_t N, int64_t K, int64_t panels, bool swiglu) {
  constexpr int per = kPerRow<Wt>;
  const int64_t rows_k = panel_rows<Wt>(K), half = N / 2;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      Wt* panel = dst + p * panel_stride<Wt>(K);
      for (int i = 0; i < kCols; ++i) {
        int64_t row;  // source row of lane i
        bool valid;
        if (swiglu) {
          const int64_t col = (p / 2) * kCols + i;
          valid = col < half;
          row = p % 2 == 0 ? col : half + col;
        } else {
          row = p * kCols + i;
          valid = row < N;
        }
        for (int64_t k = 0; k < per * rows_k; ++k)
          panel[(k / per) * kElems<Wt> + per * i + k % per] = valid && k < K ? src[row * K + k] : Wt(0);
      }
    }
  });
}

at::Tensor pack_weight(const at::Tensor& w, bool swiglu) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat) &&
                  w.device().is_cpu(),
              "weight must be a 2-D bfloat16 or float32 CPU tensor");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  TORCH_CHECK(!swiglu || N % 2 == 0, "a SwiGLU weight needs an even number of rows, got ", N);
  const int64_t panels = swiglu ? 2 * ((N / 2 + kCols - 1) / kCols) : (N + kCols - 1) / kCols;
  if (wc.scalar_type() == at::kFloat) {
    at::Tensor out = at::empty({panels, K, kCols}, wc.options());
    pack_panels<float>(wc.data_ptr<float>(), out.data_ptr<float>(), N, K, panels, swiglu);
    return out;
  }
  at::Tensor out = at::empty({panels, (K + 1) / 2, kRowElems}, wc.options());
  pack_panels<uint16_t>(reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>()),
                        reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), N, K, panels, swiglu);
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

// Columns col .. col + 15 of `row` (those below n_valid).
[[gnu::always_inline]] inline void store16(const Out& o, int64_t row, int64_t col, VecF v) {
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

[[gnu::always_inline]] inline VecF load_bias(const float* b, int64_t left) { return left >= 16 ? load(b) : load(b, tail_mask(left)); }

// The MR x (NP * 16) sums of rows [0, MR) of x times panels 0 .. NP of w (panel stride
// panel_stride<Wt>(K)) into `tile`; `next` is where the following panels start, prefetched into
// L2 on the way. X is float (x in fp32, row stride ldx >= K: fp32 multiply-adds) or uint16_t
// (bf16 rows padded to 2 * K2: vdpbf16ps, bf16 weights only); Wt is uint16_t (bf16 weight bits)
// or float. Kept apart from the epilogue (noinline, no calls), which lets the register allocator
// keep the whole tile in registers.
template <int MR, int NP, typename X, typename Wt>
[[gnu::noinline]] void tile_sums(const X* x, int64_t ldx, const Wt* w, int64_t K, const Wt* next,
                                 float (*tile)[NP * kCols]) {
  [[maybe_unused]] const int64_t K2 = (K + 1) / 2;
  const int64_t pstride = panel_stride<Wt>(K);
  constexpr int NV = NP * kSplit;  // registers of sums per row
  constexpr int RE = kElems<Wt>;   // elements per 64-byte panel row
  VecN acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[m][j] = set1_n(0.0f);
  const auto prefetch = [&](int p, int64_t kp) {
    const Wt* src = w + p * pstride + kp * RE;
    if (MR <= kAheadRows) {
      _mm_prefetch(reinterpret_cast<const char*>(src + prefetch_rows(NP) * RE), kAheadHint);
    } else if (next) {
      _mm_prefetch(reinterpret_cast<const char*>(next + p * pstride + kp * RE), _MM_HINT_T1);
    }
  };
  if constexpr (std::is_same_v<Wt, float>) {
    // fp32 weights: one panel row per k, NV weight registers live beside the sums.
    static_assert(std::is_same_v<X, float>, "fp32 weights take fp32 inputs");
    for (int64_t k = 0; k < K; ++k) {
      VecN wv[NV];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        prefetch(p, k);
#pragma GCC unroll 2
        for (int s = 0; s < kSplit; ++s) wv[p * kSplit + s] = load_n(w + p * pstride + k * RE + s * (kCols / kSplit));
      }
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const VecN a = set1_n(x[m * ldx + k]);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[m][j] = fmadd(a, wv[j], acc[m][j]);
      }
    }
  } else if constexpr (std::is_same_v<X, uint16_t>) {
#if defined(PAGODA_ISA_AVX512_BF16)
    for (int64_t kp = 0; kp < K2; ++kp) {
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) prefetch(p, kp);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) acc[m][p] = dot_bf16_pairs(acc[m][p], w + p * pstride + kp * RE, pair);  // NV == NP
      }
    }
#endif
  } else {
    // k, then k + 1: each widens its half of the panel rows (read twice from L1) so that only
    // NV widened weights are live beside the sums. An odd K ends with a single k.
    const auto step = [&](int64_t kp, int half) {
      VecN wv[NV];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const uint16_t* row = w + p * pstride + kp * RE;
        if (half == 0) prefetch(p, kp);
#pragma GCC unroll 2
        for (int s = 0; s < kSplit; ++s)
          wv[p * kSplit + s] = half == 0 ? load_bf16_firsts_n(row, s) : load_bf16_seconds_n(row, s);
      }
      const float* xk = x + 2 * kp + half;
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const VecN a = set1_n(xk[m * ldx]);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[m][j] = fmadd(a, wv[j], acc[m][j]);
      }
    };
    const int64_t full = K / 2;
    for (int64_t kp = 0; kp < full; ++kp) {
      step(kp, 0);
      step(kp, 1);
    }
    if (K % 2) step(full, 0);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) store_n(&tile[m][j * (kCols / kSplit)], acc[m][j]);
}

// Rows [0, MR) of x times panels panel0 .. panel0 + NP of w, through the epilogue into y.
// `stash` keeps a gate panel's sums [MR][16] for its up panel when the two are not in one tile.
template <int MR, int NP, typename X, typename Wt>
void micro(const X* x, int64_t ldx, const Wt* w, int64_t K, const Out& o, int64_t row0, int64_t panel0,
           const Wt* next, float* stash) {
  alignas(64) float tile[MR][NP * kCols];
  tile_sums<MR, NP>(x, ldx, w, K, next, tile);
  const auto sums = [&](int m, int p) { return load(&tile[m][p * kCols]); };
  if (o.epilogue == kSwiGLU) {
    // Panel 2j holds gate columns 16j.., panel 2j + 1 the matching up columns.
    const auto finish = [&](int64_t row, int64_t gate_panel, VecF gate, VecF up) {
      const int64_t col = gate_panel / 2 * kCols;
      if (o.bias) {
        gate = add(gate, load_bias(o.bias + col, o.n_valid - col));
        up = add(up, load_bias(o.bias + o.n_valid + col, o.n_valid - col));
      }
      store16(o, row, col, silu_mul(gate, up));
    };
    if constexpr (NP % 2 == 0) {
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p += 2)
          finish(row0 + m, panel0 + p, sums(m, p), sums(m, p + 1));
    } else if constexpr (NP == 1) {
      // Gate and up panels run one after the other for the same rows (see block_panels).
      if (panel0 % 2 == 0) {
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) store(stash + m * kCols, sums(m, 0));
      } else {
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) finish(row0 + m, panel0 - 1, load(stash + m * kCols), sums(m, 0));
      }
    }  // other odd widths never run SwiGLU (block_panels)
  } else {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        VecF v = sums(m, p);
        const int64_t col = (panel0 + p) * kCols;
        if (o.bias) v = add(v, load_bias(o.bias + col, o.n_valid - col));
        store16(o, row0 + m, col, v);
      }
    }
  }
}

// One block of MR rows times panels [p0, p1); panels up to `last` may be prefetched.
template <int MR, typename X, typename Wt>
void block_panels(const X* x, int64_t ldx, const Wt* w, int64_t K, const Out& o, int64_t row0, int64_t p0,
                  int64_t p1, int64_t last) {
  // Few rows are bound by reading the weight: stream several panels at once. SwiGLU tiles hold
  // whole gate/up pairs, or one panel at a time (gate, then its up).
  constexpr int NP = np_for(MR);
  constexpr int NP_SWIGLU = NP % 2 == 0 || NP == 1 ? NP : NP - 1;
  const int64_t pstride = panel_stride<Wt>(K);
  alignas(64) float stash[MR * kCols];
  int64_t p = p0;
  const auto tiles = [&]<int W>() {
    for (; p + W <= p1; p += W) {
      const Wt* next = p + 2 * W <= last ? w + (p + W) * pstride : nullptr;
      micro<MR, W>(x, ldx, w + p * pstride, K, o, row0, p, next, stash);
    }
  };
  if (o.epilogue == kSwiGLU) {
    tiles.template operator()<NP_SWIGLU>();
  } else {
    tiles.template operator()<NP>();
  }
  for (; p < p1; ++p)
    micro<MR, 1>(x, ldx, w + p * pstride, K, o, row0, p, p + 2 <= last ? w + (p + 1) * pstride : nullptr, stash);
}

template <typename X, typename Wt>
using BlockFn = void (*)(const X*, int64_t, const Wt*, int64_t, const Out&, int64_t, int64_t, int64_t, int64_t);

template <typename X, typename Wt, int... Is>
constexpr auto make_table(std::integer_sequence<int, Is...>) {
  return std::array<BlockFn<X, Wt>, sizeof...(Is)>{&block_panels<Is + 1, X, Wt>...};
}
template <typename X, typename Wt>
constexpr auto kBlockFns = make_table<X, Wt>(std::make_integer_sequence<int, kMaxMR>{});

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
// panel is reused from cache by every row block of the group; bf16 rows of x are copied (widened
// to fp32 for multiply-adds, padded to an even length for vdpbf16ps) once per group and thread.
template <typename T, typename X, typename Wt>
void run(const T* x, int64_t ldx, int64_t M, int64_t K, const Wt* w, int64_t panels, const Out& o) {
  const auto blocks = row_blocks(M);
  const int64_t K2 = (K + 1) / 2;
  const int64_t panel_bytes = std::max<int64_t>(panel_stride<Wt>(K), 1) * static_cast<int64_t>(sizeof(Wt));
  const int64_t row_bytes = std::max<int64_t>(K, 1) * static_cast<int64_t>(sizeof(X));
  // Groups of near-equal block counts, each within kGroupBytes of rows (at least one block):
  // tasks go to threads in contiguous ranges, so equal groups give the threads equal rows.
  // (Filling each group to the limit left a short last group: 128 rows of K = 896 ran as
  // 36 + 36 + 36 + 20, and two threads took 72 and 56 rows; now 32 + 32 + 32 + 32.)
  const auto nblocks = static_cast<int64_t>(blocks.size());
  const int64_t block_bytes = kMaxMR * row_bytes;  // the largest block's rows
  const int64_t per_group = M <= kSingleGroupRows ? nblocks : std::max<int64_t>(1, kGroupBytes / block_bytes);
  const int64_t ngroups = (nblocks + per_group - 1) / per_group;
  std::vector<std::pair<size_t, size_t>> groups;  // [first block, end block)
  for (int64_t g = 0; g < ngroups; ++g)
    groups.emplace_back(static_cast<size_t>(g * nblocks / ngroups), static_cast<size_t>((g + 1) * nblocks / ngroups));
  // Panels go to tasks in units of one (plain) or a gate/up pair (SwiGLU).
  const int64_t unit = o.epilogue == kSwiGLU ? 2 : 1;
  const int64_t units = panels / unit;
  const int64_t chunk = std::max<int64_t>(8, kChunkBytes / panel_bytes) / 8 * 8 / unit;
  int64_t chunks = (units + chunk - 1) / chunk;
  if (groups.size() == 1) {
    // One group (decode): a multiple of the thread count of near-equal chunks, so that every
    // thread streams the same number of panels.
    const int64_t threads = std::min<int64_t>(units, at::get_num_threads());
    chunks = threads * ((chunks + threads - 1) / threads);
  }
  chunks = std::min(chunks, units);
  const int64_t tasks = static_cast<int64_t>(groups.size()) * chunks;
  // parallel.h: a thread done with its share helps the others. A thread's `buffer` holds the rows
  // of group `held.second` of call `held.first` (calls numbered, so no other call's rows count).
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = calls.fetch_add(1, std::memory_order_relaxed);
  run_shares(even_shares(tasks), [&](size_t task) {
    thread_local std::vector<X> buffer;
    thread_local std::pair<uint64_t, int64_t> held{~uint64_t{0}, -1};
    const auto t = static_cast<int64_t>(task);
    const int64_t g = t / chunks, c = t % chunks;
    const auto [b0, b1] = groups[g];
    const int64_t row0 = blocks[b0].first;
    const X* xg;
    int64_t ldg;
    // x is read in place when it already has the kernel's type (and, for bf16 pairs, even K).
    if (std::is_same_v<T, X> && (std::is_same_v<X, float> || K % 2 == 0)) {
      xg = reinterpret_cast<const X*>(x) + row0 * ldx;
      ldg = ldx;
    } else {
      const int64_t rows = blocks[b1 - 1].first + blocks[b1 - 1].second - row0;
      ldg = std::is_same_v<X, float> ? K : 2 * K2;
      if (held != std::pair{call, g}) {
        buffer.resize(static_cast<size_t>(rows * ldg));
        for (int64_t r = 0; r < rows; ++r) {
          if constexpr (std::is_same_v<X, float>) {
            if constexpr (!std::is_same_v<T, float>) widen_row(x + (row0 + r) * ldx, buffer.data() + r * ldg, K);
          } else {
            std::memcpy(buffer.data() + r * ldg, x + (row0 + r) * ldx, static_cast<size_t>(K) * sizeof(uint16_t));
            if (K % 2) buffer[r * ldg + K] = 0;  // the zero partner of the last k
          }
        }
        held = {call, g};
      }
      xg = buffer.data();
    }
    const int64_t p_begin = c * units / chunks * unit, p_end = (c + 1) * units / chunks * unit;
    // Panels outer, row blocks inner; a single block streams the whole chunk at once. Several
    // blocks take two panels (32 columns) at a time: their full-height tiles are two panels
    // wide, and the pair is reused from L1/L2 by every block.
    const int64_t step = b1 - b0 == 1 ? p_end - p_begin : 2;
    for (int64_t p = p_begin; p < p_end; p += step) {
      for (size_t b = b0; b < b1; ++b) {
        const auto [row, rows] = blocks[b];
        kBlockFns<X, Wt>[rows - 1](xg + (row - row0) * ldg, ldg, w, K, o, row, p, std::min(p + step, p_end), panels);
      }
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                         int64_t epilogue, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  const bool fp32_weight = packed.scalar_type() == at::kFloat;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == (fp32_weight ? kCols : kRowElems) &&
                  (fp32_weight || packed.scalar_type() == at::kBFloat16) && packed.is_contiguous() &&
                  packed.device().is_cpu(),
              "packed must be a contiguous CPU tensor of shape [panels, (K + 1) / 2, 32] (bfloat16) or "
              "[panels, K, 16] (float32)");
  TORCH_CHECK(epilogue == kPlain || epilogue == kSwiGLU, "unknown epilogue ", epilogue);
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  const int64_t rows_k = fp32_weight ? K : (K + 1) / 2;
  TORCH_CHECK(packed.size(1) == rows_k, "packed weight has ", packed.size(1), " panel rows, x has K=", K);
  const int64_t expected = epilogue == kSwiGLU ? 2 * ((n + kCols - 1) / kCols) : (n + kCols - 1) / kCols;
  TORCH_CHECK(n >= 1 && expected == panels, "n=", n, " does not match ", panels, " panels");
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
  if (fp32_weight) {
    const float* w = packed.data_ptr<float>();
    if (xc.scalar_type() == at::kFloat) {
      run<float, float>(xc.data_ptr<float>(), xc.stride(0), M, K, w, panels, o);
    } else {
      run<c10::BFloat16, float>(xc.data_ptr<c10::BFloat16>(), xc.stride(0), M, K, w, panels, o);
    }
    return y;
  }
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  if (xc.scalar_type() == at::kFloat) {
    run<float, float>(xc.data_ptr<float>(), xc.stride(0), M, K, w, panels, o);
  } else {
#if defined(PAGODA_ISA_AVX512_BF16)
    run<uint16_t, uint16_t>(reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()), xc.stride(0), M, K, w,
                            panels, o);
#else
    run<c10::BFloat16, float>(xc.data_ptr<c10::BFloat16>(), xc.stride(0), M, K, w, panels, o);
#endif
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

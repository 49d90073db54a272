// Integer GEMM over GGML block weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias, or SwiGLU), for
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights in the tiled layout of
// quant_layout.h (written once at load by quant_pack.cpp).
//
// As llama.cpp does, each activation row is first quantized to 8 bits per block of 32 values
// (d = max|x| / 127, q = round(x / d), plus the sums of q per 16 values), so that a block's dot
// product is exact integer arithmetic. One vpdpbusd (AVX512-VNNI; AVX-VNNI on 256-bit halves;
// vpmaddubsw + vpmaddwd without VNNI) multiplies 4 broadcast activation bytes with 4 values of
// each of a tile's 16 rows, summing into 16 int32 lanes: no horizontal sums. A format's offset
// enters through the activation block sums (the accumulator starts at -offset * sum), its
// minimum (Q4_1, Q5_1, Q4_K, Q5_K) as an fp32 term, and per block the scales as vectors:
// acc += cvt(int sum) * (weight scales x activation scale).
//
// Work: MR activation rows x one tile or both tiles of a pair (16 or 32 output rows,
// `tiles_per_call`) per micro-kernel call, all of K in registers. Few rows (decode) stream every
// weight byte once, split evenly over the threads;
// many rows (prefill, batches) are split into (row group whose activations fit in L2) x (chunk
// of tile pairs) tasks, each pair reused from L1 by every row block of the group (the later
// blocks' calls fetching the next pair into L2 meanwhile); each thread
// takes one contiguous run of tasks of near-equal cost (`plan`), then helps finish the others'
// runs (parallel.h; a thread woken late is caught up: 3-10% at 1-256 rows, 2 cores of a Zen 3). The result of
// an output never depends on M, the split or the variant (see quant_kernel.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "parallel.h"
#include "quant_layout.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#pragma GCC target("f16c")  // every AVX2 CPU has F16C (the fp16 scale conversion)

namespace {

using namespace pagoda_quant;
using namespace pagoda_vec;

#define PAGODA_INLINE __attribute__((always_inline)) inline

// ---- 64-byte integer vectors --------------------------------------------------------------------
#if defined(PAGODA_AVX512)
using IVec = __m512i;
PAGODA_INLINE IVec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
PAGODA_INLINE IVec iand(IVec a, IVec b) { return _mm512_and_si512(a, b); }
PAGODA_INLINE IVec ibyte(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
PAGODA_INLINE IVec ibcast(int32_t v) { return _mm512_set1_epi32(v); }
template <int S>
PAGODA_INLINE IVec isrl16(IVec v) {
  return _mm512_srli_epi16(v, S);
}
template <int S>
PAGODA_INLINE IVec isll16(IVec v) {
  if constexpr (S == 0) return v;
  else return _mm512_slli_epi16(v, S);
}
PAGODA_INLINE IVec ior_and(IVec a, IVec b, IVec m) { return _mm512_ternarylogic_epi32(a, b, m, 0xF8); }  // a | (b & m)
PAGODA_INLINE VecF icvt(IVec v) { return _mm512_cvtepi32_ps(v); }
PAGODA_INLINE VecF load_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
PAGODA_INLINE VecF load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
PAGODA_INLINE VecF load_i8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 integral fp32 values in [-127, 127] -> 16 int8.
PAGODA_INLINE void store_i8(int8_t* p, VecF v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
}
// Tiles per micro-kernel call (1 or 2) of a block of `mr` rows.
constexpr int tiles_per_call(const Layout&, int) { return 2; }
constexpr int kMaxMR = 6;  // 2 * MR * 2 accumulators in 32 registers
// One row's inline stream left to the hardware prefetcher (software prefetches slowed it: AMD
// EPYC Zen 4, 1 thread, Q4_0 gate_up 20.6 GB/s without, 17.2 with 4 KB ahead).
constexpr bool kPrefetchOneRow = false;
#else
struct IVec {
  __m256i lo, hi;  // rows 0..7, 8..15
};
PAGODA_INLINE IVec iload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
PAGODA_INLINE IVec iand(IVec a, IVec b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
PAGODA_INLINE IVec ibyte(int v) {
  const __m256i b = _mm256_set1_epi8(static_cast<char>(v));
  return {b, b};
}
PAGODA_INLINE IVec ibcast(int32_t v) {
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
template <int S>
PAGODA_INLINE IVec isrl16(IVec v) {
  return {_mm256_srli_epi16(v.lo, S), _mm256_srli_epi16(v.hi, S)};
}
template <int S>
PAGODA_INLINE IVec isll16(IVec v) {
  if constexpr (S == 0) return v;
  else return {_mm256_slli_epi16(v.lo, S), _mm256_slli_epi16(v.hi, S)};
}
PAGODA_INLINE IVec ior_and(IVec a, IVec b, IVec m) {
  return {_mm256_or_si256(a.lo, _mm256_and_si256(b.lo, m.lo)), _mm256_or_si256(a.hi, _mm256_and_si256(b.hi, m.hi))};
}
PAGODA_INLINE VecF icvt(IVec v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
PAGODA_INLINE VecF load_f16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
PAGODA_INLINE VecF load_u8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
PAGODA_INLINE VecF load_i8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
PAGODA_INLINE void store_i8(int8_t* p, VecF v) {
  const __m256i w = _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi));  // lanes interleaved
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  // b holds values 0-3, 8-11, 4-7, 12-15 (as 32-bit groups): restore the order.
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_shuffle_epi32(b, _MM_SHUFFLE(3, 1, 2, 0)));
}
// One row of an inline layout takes the whole tile pair per call: one sequential stream of the
// pair's bytes (one tile a call read 4 of every 9 lines of Q4_0's, the next call the other 5;
// AMD EPYC Zen 3, 1 thread: Q4_0 / Q5_0 at one row 1.1-2.8x faster per layer shape). Other
// layouts keep a tile's values in one run, and stream them a tile at a time.
constexpr int tiles_per_call(const Layout& lay, int mr) { return mr == 1 && lay.inline_scales ? 2 : 1; }
constexpr int kMaxMR = 3;  // 16 registers: 4 * MR accumulators plus the weights
// One row's inline stream prefetched too: AMD EPYC Zen 3 (avx2, 1 thread, CPU time, 24 distinct
// layers from memory) ran Q4_0 1.10-1.28x faster per layer shape with it than without.
constexpr bool kPrefetchOneRow = true;
#endif

// Software prefetch runs this far ahead of the values, into L2 (_MM_HINT_T1). Into L1 (T0,
// 2,048 bytes ahead, before) the prefetches held the L1 miss buffers the loads need: measured
// on an AMD EPYC (Zen 4, 1 thread, CPU time, 24 distinct layers streamed from memory), a Q4_0 /
// Q8_0 / Q4_K_M decode step took 1.27-1.33x less time with T1 at 4,096 (6,144 the same); at 4
// rows Q4_0 streamed 1.65x faster with the prefetch than without it, and at 16-32 rows (where
// a tile pair's later row blocks read it from cache) it costs nothing measurable.
constexpr int kPrefetchBytes = 4096;

PAGODA_INLINE int32_t load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- what the micro-kernels read -----------------------------------------------------------------
struct Acts {
  const int8_t* q;     // [M, K] values
  const float* d;      // [M, nb] scales
  const float* dsum;   // [M, nb] scale x block sum of q (the minimum terms)
  const int32_t* s16;  // [M, 2 nb] sums of q per 16 values
  int64_t K, nb;
};

// NT consecutive tiles of one pair (quant_layout.h's Placement): tile t's block j of scale group
// G at values + t * value_stride + G * value_group + j * VB, its scales at scales + t *
// scale_stride + G * scale_group.
struct TileArgs {
  const uint8_t* values;  // the first tile's values
  const uint8_t* scales;  // its scales (inline layouts: the start of the pair's stream)
  int64_t value_stride, scale_stride, value_group, scale_group;
  bool inline_scales;
  const uint8_t* stream;  // inline layouts: the pair's first byte, for the call that prefetches it (else null)
  // A later row block's call (the pair already in cache): its slice of the next pair's values,
  // to fetch into L2 instead, next_per_block lines a block (null: none).
  const uint8_t* next;
  int64_t next_lines, next_per_block;
};

using MicroFn = void (*)(const TileArgs&, const Acts&, int64_t row0, float* out, int64_t ldo);
using MicroTable = std::array<std::array<MicroFn, kMaxMR>, 8>;

constexpr int type_index(int qtype) {
  return qtype == kQ8_0 ? 0 : qtype == kQ4_0 ? 1 : qtype == kQ4_1 ? 2 : qtype == kQ5_0 ? 3 : qtype == kQ5_1 ? 4
       : qtype == kQ4_K ? 5 : qtype == kQ5_K ? 6 : 7;
}

// ---- the integer dot products, one namespace (and instruction set) each -------------------------
#if defined(PAGODA_AVX512)
namespace madd512 {  // AVX512-BW: vpmaddubsw + vpmaddwd
struct Dot {
  static constexpr int kQ8Bias = 0;
  static constexpr bool kPairs16 = true;
  static PAGODA_INLINE IVec pairs(IVec w, IVec x) { return _mm512_maddubs_epi16(w, x); }
  // Signed Q8_0 values: |w| (as unsigned, so -128 stays exact) times x with w's sign.
  static PAGODA_INLINE IVec pairs_q8(IVec w, IVec x) {
    const IVec ws = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
    const IVec sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(ws), _mm512_setzero_si512(), x);
    return pairs(_mm512_abs_epi8(ws), sx);
  }
  static PAGODA_INLINE IVec add16(IVec a, IVec b) { return _mm512_add_epi16(a, b); }
  static PAGODA_INLINE IVec widen(IVec acc, IVec p) { return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1))); }
};
constexpr const char* kName = "avx512_maddubs";
#include "quant_kernel.h"
}  // namespace madd512

#pragma GCC push_options
#pragma GCC target("avx512vnni")
namespace vnni512 {  // AVX512-VNNI: vpdpbusd
struct Dot {
  static constexpr int kQ8Bias = 128;
  static constexpr bool kPairs16 = false;
  static PAGODA_INLINE IVec dot(IVec acc, IVec w, IVec x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static PAGODA_INLINE IVec dot_q8(IVec acc, IVec w, IVec x) { return _mm512_dpbusd_epi32(acc, w, x); }
};
constexpr const char* kName = "avx512_vnni";
#include "quant_kernel.h"
}  // namespace vnni512
#pragma GCC pop_options

#else
namespace madd256 {  // AVX2: vpmaddubsw + vpmaddwd on two halves
struct Dot {
  static constexpr int kQ8Bias = 0;
  static constexpr bool kPairs16 = true;
  static PAGODA_INLINE IVec pairs(IVec w, IVec x) { return {_mm256_maddubs_epi16(w.lo, x.lo), _mm256_maddubs_epi16(w.hi, x.hi)}; }
  static PAGODA_INLINE __m256i half_q8(__m256i w, __m256i x) {
    const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws));
  }
  static PAGODA_INLINE IVec pairs_q8(IVec w, IVec x) { return {half_q8(w.lo, x.lo), half_q8(w.hi, x.hi)}; }
  static PAGODA_INLINE IVec add16(IVec a, IVec b) { return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
  static PAGODA_INLINE __m256i widen_half(__m256i acc, __m256i p) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  static PAGODA_INLINE IVec widen(IVec acc, IVec p) { return {widen_half(acc.lo, p.lo), widen_half(acc.hi, p.hi)}; }
};
constexpr const char* kName = "avx2_maddubs";
#include "quant_kernel.h"
}  // namespace madd256

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace vnni256 {  // AVX-VNNI: vpdpbusd (VEX) on two halves
struct Dot {
  static constexpr int kQ8Bias = 128;
  static constexpr bool kPairs16 = false;
  static PAGODA_INLINE IVec dot(IVec acc, IVec w, IVec x) {
    return {_mm256_dpbusd_avx_epi32(acc.lo, w.lo, x.lo), _mm256_dpbusd_avx_epi32(acc.hi, w.hi, x.hi)};
  }
  static PAGODA_INLINE IVec dot_q8(IVec acc, IVec w, IVec x) { return dot(acc, w, x); }
};
constexpr const char* kName = "avx_vnni";
#include "quant_kernel.h"
}  // namespace vnni256
#pragma GCC pop_options
#endif

// ---- which dot product -------------------------------------------------------------------------
struct DotImpl {
  const char* name;
  const MicroTable& (*table)();
};

// The dot products this CPU runs in this variant, fastest first.
std::vector<DotImpl> dot_impls() {
  std::vector<DotImpl> impls;
#if defined(PAGODA_AVX512)
  if (__builtin_cpu_supports("avx512vnni")) impls.push_back({vnni512::kName, &vnni512::micro_table});
  impls.push_back({madd512::kName, &madd512::micro_table});
#else
  if (__builtin_cpu_supports("avxvnni")) impls.push_back({vnni256::kName, &vnni256::micro_table});
  impls.push_back({madd256::kName, &madd256::micro_table});
#endif
  return impls;
}

// The one in use: the fastest, unless a test chose another (`quant_use_dot`).
std::atomic<int> g_dot{0};

const DotImpl& current_dot() {
  static const std::vector<DotImpl> impls = dot_impls();
  return impls[static_cast<size_t>(g_dot.load(std::memory_order_relaxed))];
}

// ---- activations: 8 bits per block of 32 ---------------------------------------------------------
struct ActBuffers {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<int32_t> s16;
};

template <class T>
PAGODA_INLINE VecF load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load(p);
  } else {
    return load_bf16(reinterpret_cast<const uint16_t*>(p));
  }
}

// Lane i of the result is the largest of the 16 lanes of v[i].
PAGODA_INLINE VecF transpose_max16(const VecF v[16]) {
  return transpose_reduce16(v, [](VecF x, VecF y) { return max(x, y); });
}

constexpr int kQuantBlocks = 16;  // blocks of a row quantized together (one lane each)

// Blocks [b0, b0 + count) (count <= 16) of one row of x -> q, d, dsum, s16 at block i = row *
// nb + b0. The block maxima and the sums come out of transpose trees, one lane per block,
// instead of two horizontal reductions per block (AMD EPYC Zen 4, 1 thread, CPU time, under load:
// quant_act_q8 at K = 896, its copies included, 16.7 -> 11.5 us at 32 rows, 0.90-1.20 -> 0.57-0.60 ms
// at 2,048). Every
// lane operation is IEEE and the same on every variant: d = max|x| / 127, q =
// round-half-even(x * (1 / d)) (0 where d is 0), sums exact.
template <class T>
PAGODA_INLINE void quantize_blocks(const T* src, int count, int8_t* q, int64_t i, ActBuffers& a) {
  VecF amax[kQuantBlocks], s0[kQuantBlocks], s1[kQuantBlocks];
  for (int j = 0; j < kQuantBlocks; ++j) {
    if (j < count) {
      const VecF v0 = load16(src + j * kBlock), v1 = load16(src + j * kBlock + 16);
      amax[j] = max(max(v0, sub(zero(), v0)), max(v1, sub(zero(), v1)));
    } else {
      amax[j] = zero();
    }
  }
  alignas(64) float d[kQuantBlocks];
  store(d, div(transpose_max16(amax), set1(127.0f)));
  for (int j = 0; j < kQuantBlocks; ++j) {
    if (j < count) {
      const VecF inv = set1(d[j] != 0.0f ? 1.0f / d[j] : 0.0f);
      s0[j] = round_nearest(mul(load16(src + j * kBlock), inv));
      s1[j] = round_nearest(mul(load16(src + j * kBlock + 16), inv));
      store_i8(q + j * kBlock, s0[j]);
      store_i8(q + j * kBlock + 16, s1[j]);
    } else {
      s0[j] = s1[j] = zero();
    }
  }
  // Sums of up to 16 integers of magnitude <= 127 (and their sum): exact in fp32.
  const VecF sum0 = transpose_sum16(s0), sum1 = transpose_sum16(s1);
  alignas(64) float h0[kQuantBlocks], h1[kQuantBlocks], ds[kQuantBlocks];
  store(h0, sum0);
  store(h1, sum1);
  store(ds, mul(load(d), add(sum0, sum1)));
  for (int j = 0; j < count; ++j) {
    a.s16[2 * (i + j)] = static_cast<int32_t>(h0[j]);
    a.s16[2 * (i + j) + 1] = static_cast<int32_t>(h1[j]);
    a.d[i + j] = d[j];
    a.dsum[i + j] = ds[j];
  }
}

// Rows of x [M, K] (row stride ldx) -> q, d, dsum, s16, 16 blocks of a row at a time.
template <class T>
void quantize_acts(const T* x, int64_t ldx, int64_t M, int64_t K, ActBuffers& a) {
  const int64_t nb = K / kBlock, per_row = (nb + kQuantBlocks - 1) / kQuantBlocks;
  a.q.resize(static_cast<size_t>(M * K));
  a.d.resize(static_cast<size_t>(M * nb));
  a.dsum.resize(static_cast<size_t>(M * nb));
  a.s16.resize(static_cast<size_t>(M * 2 * nb));
  at::parallel_for(0, M * per_row, 512 / kQuantBlocks, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t row = u / per_row, b0 = u % per_row * kQuantBlocks;
      const int count = static_cast<int>(std::min<int64_t>(kQuantBlocks, nb - b0));
      quantize_blocks(x + row * ldx + b0 * kBlock, count, a.q.data() + row * K + b0 * kBlock, row * nb + b0, a);
    }
  });
}

void quantize_acts(const at::Tensor& x, ActBuffers& a) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    quantize_acts(x.data_ptr<float>(), x.stride(0), M, K, a);
  } else {
    quantize_acts(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), x.stride(0), M, K, a);
  }
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.stride(1) == 1, op, ": x must be a 2-D CPU tensor with unit column stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) % kBlock == 0, op, ": K must be a multiple of 32, got ", x.size(1));
}

// (int8 values [M, K], fp32 scales [M, K / 32], int32 block sums [M, K / 32]): what the kernels use.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_act_q8(const at::Tensor& x) {
  check_x(x, "quant_act_q8");
  ActBuffers a;
  quantize_acts(x, a);
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, nb}, x.options().dtype(at::kFloat));
  auto s = at::empty({M, nb}, x.options().dtype(at::kInt));
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * sizeof(float));
  int32_t* sp = s.data_ptr<int32_t>();
  for (int64_t i = 0; i < M * nb; ++i) sp[i] = a.s16[2 * i] + a.s16[2 * i + 1];
  return {q, d, s};
}

// ---- the driver ----------------------------------------------------------------------------------
struct Segment {
  const uint8_t* values;
  const uint8_t* scales;  // inline layouts: the values
  Placement at;
  bool inline_scales;
  int qtype;
  int64_t pairs;  // tile pairs (32 packed rows each)
  int64_t rows;   // logical rows
  int64_t col0;   // first output column
};

struct Output {
  void* y;
  int64_t ldy;
  bool fp32;
  const float* bias;  // [N] (plain) or [2 * I] gate then up (SwiGLU), or nullptr
  bool swiglu;
  int64_t n;  // output columns
};

struct Task {
  int64_t group;         // row group
  int seg;
  int64_t pair0, pair1;  // tile pairs [pair0, pair1) of segment `seg`
};

// Up to this many rows, one group of rows streams the weight once, a tile pair per task; the
// rows of larger groups take at most kGroupBytes of activations, and tasks at most kChunkBytes
// of weights.
constexpr int64_t kSingleGroupRows = 32;
constexpr int64_t kGroupBytes = 192 << 10;
constexpr int64_t kChunkBytes = 384 << 10;

inline void store_cols(const Output& o, int64_t row, int64_t col, VecF v) {
  const int64_t left = o.n - col;
  if (left <= 0) return;
  if (o.fp32) {
    float* dst = static_cast<float*>(o.y) + row * o.ldy + col;
    left >= 16 ? store(dst, v) : store(dst, v, tail_mask(left));
  } else {
    uint16_t* dst = static_cast<uint16_t*>(o.y) + row * o.ldy + col;
    left >= 16 ? store_bf16(dst, v) : store_bf16(dst, v, tail_mask(left));
  }
}

inline VecF bias16(const float* b, int64_t left) { return left >= 16 ? load(b) : load(b, tail_mask(left)); }

// scratch [rows][32] of one tile pair -> y (bias, SwiGLU, bf16).
void finish(const Output& o, const Segment& s, int64_t pair, int64_t row0, int64_t rows, const float* scratch) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = scratch + r * 2 * kTileRows;
    if (o.swiglu) {
      const int64_t col = pair * kTileRows, left = o.n - col;
      VecF g = load(src), u = load(src + kTileRows);
      if (o.bias && left > 0) {
        g = add(g, bias16(o.bias + col, left));
        u = add(u, bias16(o.bias + o.n + col, left));
      }
      store_cols(o, row0 + r, col, silu_mul(g, u));
    } else {
      for (int h = 0; h < 2; ++h) {
        const int64_t local = pair * 2 * kTileRows + h * kTileRows;  // column within the segment
        const int64_t left = s.rows - local;
        if (left <= 0) break;
        VecF v = load(src + h * kTileRows);
        const int64_t col = s.col0 + local;
        if (o.bias) v = add(v, bias16(o.bias + col, left));
        // A segment's last columns: only those it has (the next segment's start after them).
        Output clipped = o;
        clipped.n = std::min(o.n, s.col0 + s.rows);
        store_cols(clipped, row0 + r, col, v);
      }
    }
  }
}

// M rows split into near-equal blocks of at most kMaxMR: (first row, rows).
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

// The work of one call, split over the threads by cost: (row group) x (chunk of tile pairs)
// tasks, group-major, and each thread one contiguous run of them of near-equal rows x bytes.
// (Tasks shared out by count split unevenly: at 2 threads the 36 pairs of qkv's q / k / v went
// as 9 chunks, 20 pairs against 16, and 2,048 rows as groups of 216 with a last of 104, 1,080
// rows against 968.) Every output's sums are the same whatever the split (quant_kernel.h).
struct Plan {
  std::vector<std::pair<int64_t, int>> blocks;  // row blocks
  std::vector<std::pair<size_t, size_t>> groups;  // [first block, end block) per row group
  std::vector<Task> tasks;
  std::vector<size_t> bounds;  // thread i runs tasks [bounds[i], bounds[i + 1])
};

Plan plan(int64_t M, int64_t K, const std::vector<Segment>& segs, int64_t threads) {
  Plan p;
  p.blocks = row_blocks(M);
  const auto nblocks = static_cast<int64_t>(p.blocks.size());
  // Groups of near-equal block counts, each within kGroupBytes of activations.
  const int64_t per_group = M <= kSingleGroupRows ? nblocks : std::max<int64_t>(1, kGroupBytes / (kMaxMR * K));
  const int64_t ngroups = (nblocks + per_group - 1) / per_group;
  for (int64_t g = 0; g < ngroups; ++g)
    p.groups.emplace_back(static_cast<size_t>(g * nblocks / ngroups), static_cast<size_t>((g + 1) * nblocks / ngroups));
  std::vector<double> cost;
  for (int64_t g = 0; g < ngroups; ++g) {
    const auto [b0, b1] = p.groups[static_cast<size_t>(g)];
    const int64_t rows = p.blocks[b1 - 1].first + p.blocks[b1 - 1].second - p.blocks[b0].first;
    for (size_t i = 0; i < segs.size(); ++i) {
      const int64_t pair_bytes = segs[i].at.value_pair + (segs[i].inline_scales ? 0 : segs[i].at.scale_pair);
      const int64_t per = ngroups == 1 ? 1 : std::max<int64_t>(1, kChunkBytes / pair_bytes);
      const int64_t chunks = (segs[i].pairs + per - 1) / per;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t pair0 = c * segs[i].pairs / chunks, pair1 = (c + 1) * segs[i].pairs / chunks;
        p.tasks.push_back({g, static_cast<int>(i), pair0, pair1});
        cost.push_back(static_cast<double>(rows) * static_cast<double>((pair1 - pair0) * pair_bytes));
      }
    }
  }
  // A task goes to the thread whose share of the total cost holds its middle.
  double total = 0;
  for (double c : cost) total += c;
  p.bounds.assign(static_cast<size_t>(threads) + 1, p.tasks.size());
  p.bounds[0] = 0;
  double before = 0;
  int64_t thread = 0;
  for (size_t t = 0; t < p.tasks.size(); ++t) {
    const int64_t owner = std::min<int64_t>(threads - 1, static_cast<int64_t>((before + cost[t] / 2) * threads / total));
    while (thread < owner) p.bounds[static_cast<size_t>(++thread)] = t;
    before += cost[t];
  }
  return p;
}

void run(const ActBuffers& act, int64_t M, int64_t K, const std::vector<Segment>& segs, const Output& o) {
  const Acts x{act.q.data(), act.d.data(), act.dsum.data(), act.s16.data(), K, K / kBlock};
  const MicroTable& table = current_dot().table();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const Plan work = plan(M, K, segs, threads);
  run_shares(work.bounds, [&](size_t t) {  // parallel.h: a thread done with its share helps the others
    thread_local std::vector<float> scratch;
    const Task& task = work.tasks[t];
    const Segment& s = segs[static_cast<size_t>(task.seg)];
    const auto [b0, b1] = work.groups[static_cast<size_t>(task.group)];
    const int64_t row0 = work.blocks[b0].first, rows = work.blocks[b1 - 1].first + work.blocks[b1 - 1].second - row0;
    scratch.resize(static_cast<size_t>(rows * 2 * kTileRows));
    const auto& fns = table[type_index(s.qtype)];
    for (int64_t p = task.pair0; p < task.pair1; ++p) {
      for (int half = 0; half < 2; ++half) {
        const int64_t tile = 2 * p + half;
        TileArgs w{s.values + s.at.value_at(tile), s.scales + s.at.scale_at(tile), s.at.value_tile,
                   s.at.scale_tile, s.at.value_group, s.at.scale_group, s.inline_scales,
                   s.inline_scales && half == 0 ? s.scales + s.at.scale_at(tile) : nullptr, nullptr, 0, 0};
        // The first row block's call reads the pair from memory (with its prefetch ahead); the
        // later ones, which find it in cache, each fetch a slice of the next pair's values into
        // L2 instead, so that its first call finds them there. (AMD EPYC Zen 4, 2 threads, in-process
        // A/B, 24 distinct weights streamed: Q8_0 at 16-32 rows 1.02-1.06x, 2,048 rows 1.02x; Q4_0
        // 1.02-1.04x; at 1 thread Q8_0 1.05-1.17x; the avx2 variant 1.03-1.09x.)
        const int64_t later = static_cast<int64_t>(b1 - b0) - 1, lines = s.at.value_pair / 64;
        for (size_t b = b0; b < b1; ++b) {
          const auto [row, n] = work.blocks[b];
          if (half % tiles_per_call(layout(s.qtype), n) != 0) continue;  // the first call took both tiles
          w.next = nullptr;
          if (b > b0 && half == 0 && p + 1 < s.pairs) {
            const int64_t i = static_cast<int64_t>(b - b0) - 1, l0 = i * lines / later, l1 = (i + 1) * lines / later;
            w.next = s.values + (p + 1) * s.at.value_pair + l0 * 64;
            w.next_lines = l1 - l0;
            w.next_per_block = (l1 - l0 + x.nb - 1) / x.nb;
          }
          fns[n - 1](w, x, row, scratch.data() + (row - row0) * 2 * kTileRows + half * kTileRows, 2 * kTileRows);
        }
      }
      finish(o, s, p, row0, rows, scratch.data());
    }
  });
}

at::Tensor quant_linear(const at::Tensor& x, at::TensorList values, at::TensorList scales, at::IntArrayRef qtypes,
                        at::IntArrayRef rows, const std::optional<at::Tensor>& bias, bool swiglu, bool out_fp32) {
  check_x(x, "quant_linear");
  const int64_t M = x.size(0), K = x.size(1);
  const size_t n_seg = values.size();
  TORCH_CHECK(n_seg >= 1 && scales.size() == n_seg && qtypes.size() == n_seg && rows.size() == n_seg,
              "quant_linear: one values, scales, qtype and row count per segment");
  TORCH_CHECK(!swiglu || n_seg == 1, "quant_linear: a SwiGLU weight is one segment");
  std::vector<Segment> segs;
  int64_t col = 0;
  for (size_t i = 0; i < n_seg; ++i) {
    const int qt = static_cast<int>(qtypes[i]);
    TORCH_CHECK(known(qt), "quant_linear: no integer kernel for GGML type ", qt);
    const Layout lay = layout(qt);
    TORCH_CHECK(K % (kBlock * lay.group_blocks) == 0, "quant_linear: this type needs K a multiple of ",
                kBlock * lay.group_blocks, ", got ", K);
    const int64_t n = rows[i];
    const int64_t tiles = swiglu ? 2 * ((n / 2 + kTileRows - 1) / kTileRows) : tiles_for(n);
    const Placement at = placement(lay, K / kBlock / lay.group_blocks, tiles);
    const at::Tensor& v = values[i];
    const at::Tensor& s = scales[i];
    TORCH_CHECK(n >= 1 && (!swiglu || n % 2 == 0), "quant_linear: bad row count ", n);
    TORCH_CHECK(v.scalar_type() == at::kByte && v.is_contiguous() && v.dim() == 2 && v.size(0) == at.shape[0] &&
                    v.size(1) == at.shape[1] && s.scalar_type() == at::kByte && s.is_contiguous() && s.dim() == 2 &&
                    s.size(0) == at.shape[2] && s.size(1) == at.shape[3],
                "quant_linear: segment ", i, " does not match the tiled layout of ", n, " rows x ", K);
    const uint8_t* vp = v.data_ptr<uint8_t>();
    segs.push_back({vp, lay.inline_scales ? vp : s.data_ptr<uint8_t>(), at, lay.inline_scales, qt, tiles / 2, n, col});
    col += n;
  }
  const int64_t N = swiglu ? col / 2 : col;
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == col && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "quant_linear: bias must be contiguous float32 of shape [", col, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  if (M == 0) return y;
  thread_local ActBuffers act;
  quantize_acts(x, act);
  const Output o{y.data_ptr(), N, out_fp32 || x.scalar_type() == at::kFloat, b, swiglu, N};
  run(act, M, K, segs, o);
  return y;
}

std::string quant_dot_kind() { return current_dot().name; }

std::vector<std::string> quant_dot_kinds() {
  std::vector<std::string> names;
  for (const DotImpl& d : dot_impls()) names.emplace_back(d.name);
  return names;
}

// Tests: run the kernels on another dot product this CPU has (one of quant_dot_kinds()).
void quant_use_dot(const std::string& name) {
  const std::vector<DotImpl> impls = dot_impls();
  for (size_t i = 0; i < impls.size(); ++i)
    if (name == impls[i].name) {
      g_dot.store(static_cast<int>(i));
      return;
    }
  TORCH_CHECK(false, "quant_use_dot: ", name, " is not one of this CPU's dot products");
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def("quant_act_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def(
      "quant_linear(Tensor x, Tensor[] values, Tensor[] scales, int[] qtypes, int[] rows, Tensor? bias, bool swiglu, "
      "bool out_fp32) -> Tensor");
  m.def("quant_dot_kind() -> str");
  m.def("quant_dot_kinds() -> str[]");
  m.def("quant_use_dot(str name) -> ()");
  m.impl("quant_act_q8", c10::DispatchKey::CPU, TORCH_FN(quant_act_q8));
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
  m.impl("quant_dot_kind", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(quant_dot_kind));
  m.impl("quant_dot_kinds", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(quant_dot_kinds));
  m.impl("quant_use_dot", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(quant_use_dot));
}

// Small-M bf16 linear for CPU decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), fp32 accumulation.
//
// With few input rows the product is bound by reading the weight, so each weight row is read
// once and dotted with all M input rows (vdpbf16ps, 32 bf16 pairs per instruction). R weight
// rows are processed together to keep R memory streams in flight, and the next R rows are
// software-prefetched; R shrinks as M grows so that the R*M accumulators stay in registers.
// Like vdpbf16ps itself, bf16 subnormal inputs count as zero.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kMaxM = 8;
// A parallel task smaller than this many weight elements is not worth a thread hand-off.
constexpr int64_t kMinElemsPerTask = 64 * 1024;

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh load_bf16_masked(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Dots weight rows w[0..R) with input rows x[0..M); writes sums[r * M + m].
template <int M, int R>
inline void dot_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, float* sums) {
  __m512 acc[R][M];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();

  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wv[r] = load_bf16(w + r * ldw + k);
      // Prefetching past the end of the weight is harmless: prefetches never fault.
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * ldw + k), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bf16(x + m * ldx + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
    }
  }
  if (k < K) {
    // Masked-off lanes load as zero in both operands, so they add nothing.
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = load_bf16_masked(w + r * ldw + k, mask);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bf16_masked(x + m * ldx + k, mask);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) sums[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}

// Weight rows per block: R*M accumulators + R weight registers + 1 input register <= 32 zmm.
template <int M>
constexpr int rows_per_block() {
  return M <= 2 ? 8 : M <= 5 ? 4 : 3;
}

struct Problem {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t ldw;
  const c10::BFloat16* bias;  // nullptr when there is no bias
  c10::BFloat16* y;           // [M, N], contiguous
  int64_t N;
  int64_t K;
};

template <int M>
void gemv_rows(const Problem& p, int64_t n_begin, int64_t n_end) {
  constexpr int R = rows_per_block<M>();
  float sums[R * M];
  auto store = [&](int64_t n, int rows) {
    for (int r = 0; r < rows; ++r) {
      const float b = p.bias ? static_cast<float>(p.bias[n + r]) : 0.0f;
      for (int m = 0; m < M; ++m) p.y[m * p.N + n + r] = c10::BFloat16(sums[r * M + m] + b);
    }
  };
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) {
    dot_rows<M, R>(p.x, p.ldx, p.w + n * p.ldw, p.ldw, p.K, sums);
    store(n, R);
  }
  for (; n < n_end; ++n) {
    dot_rows<M, 1>(p.x, p.ldx, p.w + n * p.ldw, p.ldw, p.K, sums);
    store(n, 1);
  }
}

template <int M>
void gemv(const Problem& p) {
  constexpr int64_t R = rows_per_block<M>();
  const int64_t blocks = (p.N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerTask / (R * std::max<int64_t>(p.K, 1)));
  at::parallel_for(0, blocks, grain,
                   [&](int64_t b0, int64_t b1) { gemv_rows<M>(p, b0 * R, std::min(b1 * R, p.N)); });
}

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x and weight must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "x and weight must be bfloat16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "x and weight must be on the CPU");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "rows of x and weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight has ", weight.size(1), " columns, x has ", K);
  TORCH_CHECK(M >= 1 && M <= kMaxM, "x must have 1 to ", kMaxM, " rows, got ", M);
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kBFloat16 &&
                    bias->is_contiguous() && bias->device().is_cpu(),
                "bias must be a contiguous bfloat16 CPU tensor of shape [N]");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                  x.stride(0),
                  reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()),
                  weight.stride(0),
                  b,
                  y.data_ptr<c10::BFloat16>(),
                  N,
                  K};
  switch (M) {
    case 1: gemv<1>(p); break;
    case 2: gemv<2>(p); break;
    case 3: gemv<3>(p); break;
    case 4: gemv<4>(p); break;
    case 5: gemv<5>(p); break;
    case 6: gemv<6>(p); break;
    case 7: gemv<7>(p); break;
    default: gemv<8>(p); break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("linear_small_m(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("linear_small_m", c10::DispatchKey::CPU, TORCH_FN(linear_small_m));
}

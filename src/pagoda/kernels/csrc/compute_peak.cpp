// Arithmetic peak probe: every torch thread runs 12 independent accumulator chains of one
// multiply-accumulate instruction (no loads, nothing but the instruction's throughput to wait
// on), so that a kernel's multiply-accumulates per second can be stated as a share of what the
// core can issue: the compute roofline of batches and prefill, as memory_read is the bandwidth
// roofline of single-stream decode.
//
// Kinds (dot_peak_kinds(): the ones this variant runs on this CPU):
//   "fp32_fma"   vfmadd231ps, one multiply-accumulate per fp32 lane (the bf16 kernel's dot
//                product without AVX512-BF16, the weights widened to fp32);
//   "bf16_dot"   vdpbf16ps, two per fp32 lane (avx512_bf16 variant);
//   "int8_dot"   the integer dot product the quantized kernels use fastest: vpdpbusd, four per
//                int32 lane (AVX512-VNNI / AVX-VNNI), else vpmaddubsw, two per int16 lane (an
//                upper bound: the kernels also widen its sums with vpmaddwd).

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "vec.h"

#include <immintrin.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int kChains = 12;

#if defined(PAGODA_AVX512)
using IReg = __m512i;
using FReg = __m512;
constexpr int64_t kLanes = 16;  // 32-bit lanes per register
#else
using IReg = __m256i;
using FReg = __m256;
constexpr int64_t kLanes = 8;
#endif

// `steps` rounds of STEP (an expression of the chain `a`) on each of the 12 chains, in the calling
// function (a macro, so that the instruction compiles under that function's target); the empty
// asm keeps every chain live and in a register (without it the compiler may spill the array or
// drop the work).
#define PAGODA_RUN_CHAINS(R, INIT, STEPS, STEP)                                                            \
  do {                                                                                                     \
    R c0 = INIT, c1 = INIT, c2 = INIT, c3 = INIT, c4 = INIT, c5 = INIT, c6 = INIT, c7 = INIT, c8 = INIT,  \
      c9 = INIT, c10 = INIT, c11 = INIT;                                                                   \
    for (int64_t i = 0; i < (STEPS); ++i) {                                                                \
      R* chain[kChains] = {&c0, &c1, &c2, &c3, &c4, &c5, &c6, &c7, &c8, &c9, &c10, &c11};                  \
      _Pragma("GCC unroll 12") for (int c = 0; c < kChains; ++c) {                                         \
        R& a = *chain[c];                                                                                  \
        a = (STEP);                                                                                        \
      }                                                                                                    \
      asm volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7), \
                   "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));                                              \
    }                                                                                                      \
  } while (0)

// Each *_chains runs the chains and returns the multiply-accumulates of one step per 32-bit lane.
int64_t fma_chains(int64_t steps) {
#if defined(PAGODA_AVX512)
  const FReg m = _mm512_set1_ps(1.0f);
  PAGODA_RUN_CHAINS(FReg, _mm512_set1_ps(0.0f), steps, _mm512_fmadd_ps(a, m, m));
#else
  const FReg m = _mm256_set1_ps(1.0f);
  PAGODA_RUN_CHAINS(FReg, _mm256_set1_ps(0.0f), steps, _mm256_fmadd_ps(a, m, m));
#endif
  return 1;
}

#if defined(PAGODA_ISA_AVX512_BF16)
int64_t bf16_chains(int64_t steps) {
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3F80);
  PAGODA_RUN_CHAINS(FReg, _mm512_set1_ps(0.0f), steps, _mm512_dpbf16_ps(a, b, b));
  return 2;
}
#endif

#pragma GCC push_options
#if defined(PAGODA_AVX512)
#pragma GCC target("avx512vnni")
#else
#pragma GCC target("avxvnni")
#endif
int64_t vnni_chains(int64_t steps) {
#if defined(PAGODA_AVX512)
  const IReg w = _mm512_set1_epi8(1);
  PAGODA_RUN_CHAINS(IReg, _mm512_setzero_si512(), steps, _mm512_dpbusd_epi32(a, w, w));
#else
  const IReg w = _mm256_set1_epi8(1);
  PAGODA_RUN_CHAINS(IReg, _mm256_setzero_si256(), steps, _mm256_dpbusd_avx_epi32(a, w, w));
#endif
  return 4;
}
#pragma GCC pop_options

int64_t maddubs_chains(int64_t steps) {
#if defined(PAGODA_AVX512)
  const IReg w = _mm512_set1_epi8(1);
  PAGODA_RUN_CHAINS(IReg, _mm512_setzero_si512(), steps, _mm512_maddubs_epi16(a, w));
#else
  const IReg w = _mm256_set1_epi8(1);
  PAGODA_RUN_CHAINS(IReg, _mm256_setzero_si256(), steps, _mm256_maddubs_epi16(a, w));
#endif
  return 2;
}

bool has_vnni() {
#if defined(PAGODA_AVX512)
  return __builtin_cpu_supports("avx512vnni");
#else
  return __builtin_cpu_supports("avxvnni");
#endif
}

struct Kind {
  const char* name;
  int64_t (*chains)(int64_t steps);
};

// The kinds this variant runs on this CPU (dot_peak_kinds() lists their names).
std::vector<Kind> peak_kinds() {
  std::vector<Kind> kinds{{"fp32_fma", &fma_chains}};
#if defined(PAGODA_ISA_AVX512_BF16)
  kinds.push_back({"bf16_dot", &bf16_chains});
#endif
  kinds.push_back({"int8_dot", has_vnni() ? &vnni_chains : &maddubs_chains});
  return kinds;
}

std::vector<std::string> dot_peak_kinds() {
  std::vector<std::string> names;
  for (const Kind& k : peak_kinds()) names.emplace_back(k.name);
  return names;
}

// Runs `steps` rounds of 12 chains of `kind` on every torch thread; returns the
// multiply-accumulates done (all threads), for the caller to time.
double dot_peak(const std::string& kind, int64_t steps) {
  TORCH_CHECK(steps >= 1 && steps <= (int64_t{1} << 40), "dot_peak: steps must be in [1, 2^40], got ", steps);
  int64_t (*chains)(int64_t) = nullptr;
  for (const Kind& k : peak_kinds())
    if (kind == k.name) chains = k.chains;
  TORCH_CHECK(chains != nullptr, "dot_peak: unknown kind '", kind, "' for this variant (one of dot_peak_kinds())");
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<int64_t> per(static_cast<size_t>(threads), 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) per[static_cast<size_t>(t)] = chains(steps);
  });
  double macs = 0;
  for (int64_t p : per) macs += static_cast<double>(p) * static_cast<double>(steps) * kChains * kLanes;
  return macs;
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def("dot_peak(str kind, int steps) -> float");
  m.def("dot_peak_kinds() -> str[]");
  m.impl("dot_peak", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(dot_peak));
  m.impl("dot_peak_kinds", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(dot_peak_kinds));
}

// Integer GEMM over GGML block weights (Q8_0, Q4_0) for few rows of activations (decode):
// y[M, N] = x[M, K] @ W[N, K]^T, W dequantized from its blocks.
//
// As llama.cpp does, each activation row is first quantized to 8 bits per block of 32 values
// (`quant_act_q8`: d = max|x| / 127, q = round(x / d), and the block's sum of q), so that a
// block's dot product is exact integer arithmetic: 32 int8 x int8 (Q8_0) or uint8 nibble x int8
// (Q4_0, whose value q - 8 is folded in as `- 8 * sum(x_q)`) products summed into int32, then one
// float multiply-add by the two scales. With AVX512-VNNI / AVX-VNNI (checked at run time) the
// products and their sum are one `vpdpbusd`; otherwise `vpmaddubsw` + `vpmaddwd`. For Q8_0's
// signed x signed product the sign of x moves onto w (`vpsignb`), as vpmaddubsw / vpdpbusd
// take one unsigned operand.
//
// The weight is repacked at load (`quant_pack`) from GGUF's interleaved 34- / 18-byte blocks
// into two arrays the kernel streams with aligned 32- / 16-byte loads: the values [N, K] (int8)
// or [N, K / 2] (nibbles, in GGML's order within each block) and the fp16 scales [N, K / 32].
// Same bytes as the file, nothing widened.
//
// Work is split over output rows (OpenMP through at::parallel_for); every row sums its blocks in
// order, so results do not depend on the thread count or on how many rows M has.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC target("f16c")  // every AVX2 CPU has F16C (the fp16 scale conversion)

namespace {

constexpr int kBlock = 32;
constexpr int kQ8_0 = 8;  // GGML type ids
constexpr int kQ4_0 = 2;
constexpr int kQ5_0 = 6;
constexpr int kQ6_K = 14;
constexpr int kQ4_K = 12;
constexpr int kMaxRows = 8;  // activation rows sharing one pass over the weight
constexpr int64_t kRowsPerGroup = 32;  // weight rows kept in cache while all activation tiles pass

__attribute__((always_inline)) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((always_inline)) inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// ---- block dot products: 32 weights x 32 activation bytes -> int32 x 8 lanes ------------------
// The loops (quant_gemm_rows.h) are compiled once per dot product, each under its own target.
#define PAGODA_INLINE __attribute__((always_inline)) inline

PAGODA_INLINE __m256i load_nibbles(const uint8_t* p) {  // 16 bytes -> 32 values: low nibbles, then high
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// The 32 bits of a Q5_0 block's qh as 32 bytes of 0 or 16 (byte j: bit j).
PAGODA_INLINE __m256i high_bits_16(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

struct Args {
  const int8_t* xq;   // [M, K] activation values
  const float* xd;    // [M, nb] activation scales
  const int32_t* xs;  // [M, nb] activation block sums
  const uint8_t* wq;  // [N, row_bytes] weight values
  const uint16_t* wd; // [N, nb] weight scales (fp16 bits)
  float* y;           // [M, N]
  int64_t M, K, N, nb, row_bytes;
};

using RowsFn = void (*)(const Args&, int64_t, int64_t);

namespace madd {  // AVX2: vpmaddubsw + vpmaddwd
struct Dot {
  static PAGODA_INLINE __m256i q8(__m256i w, __m256i x) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  }
  static PAGODA_INLINE __m256i u8(__m256i w_unsigned, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w_unsigned, x), _mm256_set1_epi16(1));
  }
};
#include "quant_gemm_rows.h"
void q8(const Args& a, int64_t b, int64_t e) { rows_range<kQ8_0>(a, b, e); }
void q4(const Args& a, int64_t b, int64_t e) { rows_range<kQ4_0>(a, b, e); }
void q5(const Args& a, int64_t b, int64_t e) { rows_range<kQ5_0>(a, b, e); }
void q6k(const Args& a, int64_t b, int64_t e) { rows_range<kQ6_K>(a, b, e); }
void q4k(const Args& a, int64_t b, int64_t e) { rows_range<kQ4_K>(a, b, e); }
}  // namespace madd

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace avxvnni {  // AVX-VNNI: vpdpbusd on 256 bits (VEX)
struct Dot {
  static PAGODA_INLINE __m256i q8(__m256i w, __m256i x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
  }
  static PAGODA_INLINE __m256i u8(__m256i w_unsigned, __m256i x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w_unsigned, x);
  }
};
#include "quant_gemm_rows.h"
void q8(const Args& a, int64_t b, int64_t e) { rows_range<kQ8_0>(a, b, e); }
void q4(const Args& a, int64_t b, int64_t e) { rows_range<kQ4_0>(a, b, e); }
void q5(const Args& a, int64_t b, int64_t e) { rows_range<kQ5_0>(a, b, e); }
void q6k(const Args& a, int64_t b, int64_t e) { rows_range<kQ6_K>(a, b, e); }
void q4k(const Args& a, int64_t b, int64_t e) { rows_range<kQ4_K>(a, b, e); }
}  // namespace avxvnni
#pragma GCC pop_options

#if defined(PAGODA_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl")
namespace vnni512 {  // AVX512-VNNI: vpdpbusd (EVEX, 256-bit form)
struct Dot {
  static PAGODA_INLINE __m256i q8(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
  }
  static PAGODA_INLINE __m256i u8(__m256i w_unsigned, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_unsigned, x);
  }
};
#include "quant_gemm_rows.h"
void q8(const Args& a, int64_t b, int64_t e) { rows_range<kQ8_0>(a, b, e); }
void q4(const Args& a, int64_t b, int64_t e) { rows_range<kQ4_0>(a, b, e); }
void q5(const Args& a, int64_t b, int64_t e) { rows_range<kQ5_0>(a, b, e); }
void q6k(const Args& a, int64_t b, int64_t e) { rows_range<kQ6_K>(a, b, e); }
void q4k(const Args& a, int64_t b, int64_t e) { rows_range<kQ4_K>(a, b, e); }
}  // namespace vnni512
#pragma GCC pop_options
#endif

enum class DotKind { madd, avx512vnni, avxvnni };

DotKind dot_kind() {
  static const DotKind kind = [] {
#if defined(PAGODA_AVX512)
    if (__builtin_cpu_supports("avx512vnni")) return DotKind::avx512vnni;
#endif
    if (__builtin_cpu_supports("avxvnni")) return DotKind::avxvnni;
    return DotKind::madd;
  }();
  return kind;
}

#define PAGODA_PICK(ns) \
  (qtype == kQ8_0   ? ns::q8  \
   : qtype == kQ4_0 ? ns::q4  \
   : qtype == kQ5_0 ? ns::q5  \
   : qtype == kQ4_K ? ns::q4k \
                    : ns::q6k)

RowsFn rows_fn(int qtype) {
  switch (dot_kind()) {
#if defined(PAGODA_AVX512)
    case DotKind::avx512vnni:
      return PAGODA_PICK(vnni512);
#endif
    case DotKind::avxvnni:
      return PAGODA_PICK(avxvnni);
    default:
      return PAGODA_PICK(madd);
  }
}
#undef PAGODA_PICK

// ---- ops --------------------------------------------------------------------------------------
template <class T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* s) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + (i / nb) * K + (i % nb) * kBlock;
      float v[kBlock];
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) {
        v[j] = static_cast<float>(src[j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      const float scale = amax / 127.0f;
      const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
      int32_t sum = 0;
      int8_t* dst = q + (i / nb) * K + (i % nb) * kBlock;
      for (int j = 0; j < kBlock; ++j) {
        const int value = static_cast<int>(std::nearbyint(v[j] * inv));
        dst[j] = static_cast<int8_t>(value);
        sum += value;
      }
      d[i] = scale;
      s[i] = sum;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_act_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kBlock == 0,
              "quant_act_q8: x must be a contiguous [M, K] tensor with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / kBlock}, x.options().dtype(at::kFloat));
  auto s = at::empty({M, K / kBlock}, x.options().dtype(at::kInt));
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant_act_q8: x must be float32 or bfloat16");
    quantize_rows(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), M, K, q.data_ptr<int8_t>(),
                  d.data_ptr<float>(), s.data_ptr<int32_t>());
  }
  return {q, d, s};
}

// GGUF rows [N, row_bytes] of `qtype` -> (values [N, K] int8 or [N, K / 2] uint8, scales [N, nb] fp16 bits).
std::tuple<at::Tensor, at::Tensor> quant_pack(const at::Tensor& raw, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype == kQ8_0 || qtype == kQ4_0, "quant_pack: only Q8_0 and Q4_0");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(), "quant_pack: raw uint8 rows");
  const int64_t N = raw.size(0), nb = K / kBlock;
  const int64_t value_bytes = qtype == kQ8_0 ? kBlock : kBlock / 2;
  TORCH_CHECK(K % kBlock == 0 && raw.size(1) == nb * (2 + value_bytes), "quant_pack: row size does not match K");
  auto values = at::empty({N, nb * value_bytes}, raw.options());
  auto scales = at::empty({N, nb}, raw.options().dtype(at::kShort));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dv = values.data_ptr<uint8_t>();
  int16_t* ds = scales.data_ptr<int16_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = src + (n * nb + b) * (2 + value_bytes);
        std::memcpy(ds + n * nb + b, block, 2);
        std::memcpy(dv + (n * nb + b) * value_bytes, block + 2, value_bytes);
      }
    }
  });
  return {values, scales};
}

at::Tensor quant_linear(const at::Tensor& xq, const at::Tensor& xd, const at::Tensor& xs, const at::Tensor& wq,
                        const at::Tensor& wd, int64_t qtype) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(), "quant_linear: xq");
  TORCH_CHECK(qtype == kQ8_0 || qtype == kQ4_0 || qtype == kQ5_0 || qtype == kQ6_K || qtype == kQ4_K,
              "quant_linear: only Q8_0, Q4_0, Q5_0, Q4_K and Q6_K");
  const int64_t M = xq.size(0), K = xq.size(1), N = wq.size(0), nb = K / kBlock;
  // Q8_0 / Q4_0 come repacked (values, scales); Q5_0 / Q6_K as the file's raw blocks.
  const int64_t row_bytes = qtype == kQ8_0   ? K
                            : qtype == kQ4_0 ? K / 2
                            : qtype == kQ5_0 ? nb * 22
                            : qtype == kQ4_K ? K / 256 * 144
                                             : K / 256 * 210;
  TORCH_CHECK((qtype != kQ6_K && qtype != kQ4_K) || K % 256 == 0, "quant_linear: K-quant rows need a multiple of 256");
  TORCH_CHECK(wq.size(1) == row_bytes && xd.size(0) == M && xs.size(0) == M, "quant_linear: shapes do not match");
  TORCH_CHECK(qtype == kQ5_0 || qtype == kQ6_K || qtype == kQ4_K || (wd.size(0) == N && wd.size(1) == nb),
              "quant_linear: scales");
  auto y = at::empty({M, N}, xd.options().dtype(at::kFloat));
  const Args a{xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<int32_t>(), wq.data_ptr<uint8_t>(),
               wd.numel() ? reinterpret_cast<const uint16_t*>(wd.data_ptr<int16_t>()) : nullptr, y.data_ptr<float>(), M, K, N, nb,
               row_bytes};
  const RowsFn fn = rows_fn(static_cast<int>(qtype));
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
  return y;
}

std::string quant_dot_kind() {
  switch (dot_kind()) {
    case DotKind::avx512vnni:
      return "avx512_vnni";
    case DotKind::avxvnni:
      return "avx_vnni";
    default:
      return "avx2_maddubs";
  }
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def("quant_act_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_pack(Tensor raw, int qtype, int k) -> (Tensor, Tensor)");
  m.def("quant_linear(Tensor xq, Tensor xd, Tensor xs, Tensor wq, Tensor wd, int qtype) -> Tensor");
  m.def("quant_dot_kind() -> str");
  m.impl("quant_act_q8", c10::DispatchKey::CPU, TORCH_FN(quant_act_q8));
  m.impl("quant_pack", c10::DispatchKey::CPU, TORCH_FN(quant_pack));
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
  m.impl("quant_dot_kind", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(quant_dot_kind));
}

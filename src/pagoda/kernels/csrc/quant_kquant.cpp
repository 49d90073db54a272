// Q4_K, Q5_K and Q6_K quantization: float32 super-blocks of 256 values -> GGML blocks, the same
// bytes as pagoda.quant.quantize's PyTorch quantizer (llama.cpp's reference search without an
// importance matrix), operation for operation.
//
// Bit-equality with the PyTorch version rests on doing the same IEEE float32 operations in the
// same order: every product, sum and quotient rounded on its own (no contraction into FMA, see
// the pragma), sums over a sub-block's values in index order (the PyTorch code's `_seq_sum`),
// `a / tensor` as `reciprocal(tensor) * a` (what torch's `__rtruediv__` computes), round half to
// even, fp16 rounded to nearest even. The sub-blocks of a super-block are the lanes of each loop
// (value-major arrays [value][sub-block]), so loops vectorize without reordering any sum.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kSuper = 256;

inline int32_t nearest(float v) { return static_cast<int32_t>(std::nearbyint(v)); }  // half to even
inline int32_t clampi(int32_t v, int32_t lo, int32_t hi) { return std::min(std::max(v, lo), hi); }
inline uint16_t f16_bits(float v) { return c10::Half(v).x; }
inline float f16_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// ---- Q4_K / Q5_K: 8 sub-blocks (lanes) of 32 values -----------------------------------------------
constexpr int kSubK = 8, kValK = 32;
using LanesK = float[kValK][kSubK];

// `_fit_scale_min` (llama.cpp's make_qkx2_quants) for the 8 sub-blocks of x at once.
void fit_scale_min(const LanesK& x, const LanesK& w, int nmax, float rmin, float rdelta, int nstep, float* scale_out,
                   float* min_out, int32_t (&levels)[kValK][kSubK]) {
  float lo[kSubK], hi[kSubK], sum_w[kSubK], sum_x[kSubK], scale[kSubK], best[kSubK], best_min[kSubK];
  bool flat[kSubK];
  for (int j = 0; j < kSubK; ++j) {
    float mn = x[0][j], mx = x[0][j];
    for (int i = 1; i < kValK; ++i) {
      mn = std::min(mn, x[i][j]);
      mx = std::max(mx, x[i][j]);
    }
    lo[j] = std::min(mn, 0.0f);
    hi[j] = mx;
    flat[j] = hi[j] == lo[j];
    sum_w[j] = w[0][j];
    sum_x[j] = w[0][j] * x[0][j];
  }
  for (int i = 1; i < kValK; ++i)
    for (int j = 0; j < kSubK; ++j) {
      sum_w[j] += w[i][j];
      sum_x[j] += w[i][j] * x[i][j];
    }
  const float fmax = static_cast<float>(nmax);
  float iscale[kSubK];
  for (int j = 0; j < kSubK; ++j) {
    const float span = flat[j] ? 1.0f : hi[j] - lo[j];
    iscale[j] = (1.0f / span) * fmax;
    scale[j] = 1.0f / iscale[j];
    best[j] = 0.0f;
    best_min[j] = lo[j];
  }
  for (int i = 0; i < kValK; ++i)
    for (int j = 0; j < kSubK; ++j) {
      const int32_t l = clampi(nearest(iscale[j] * (x[i][j] - lo[j])), 0, nmax);
      levels[i][j] = l;
      const float diff = ((scale[j] * static_cast<float>(l)) + lo[j]) - x[i][j];
      const float e = w[i][j] * (diff * diff);
      best[j] = i == 0 ? e : best[j] + e;
    }
  for (int step = 0; step <= nstep; ++step) {
    const float k = (rmin + rdelta * static_cast<float>(step)) + fmax;
    float ratio[kSubK], sum_l[kSubK], sum_l2[kSubK], sum_xl[kSubK];
    int32_t cand[kValK][kSubK];
    for (int j = 0; j < kSubK; ++j) ratio[j] = k / (flat[j] ? 1.0f : hi[j] - best_min[j]);
    for (int i = 0; i < kValK; ++i)
      for (int j = 0; j < kSubK; ++j) {
        const int32_t l = clampi(nearest(ratio[j] * (x[i][j] - best_min[j])), 0, nmax);
        cand[i][j] = l;
        const float lf = static_cast<float>(l), wl = w[i][j] * lf;
        if (i == 0) {
          sum_l[j] = wl;
          sum_l2[j] = wl * lf;
          sum_xl[j] = wl * x[i][j];
        } else {
          sum_l[j] += wl;
          sum_l2[j] += wl * lf;
          sum_xl[j] += wl * x[i][j];
        }
      }
    float this_scale[kSubK], this_min[kSubK], err[kSubK];
    bool valid[kSubK];
    for (int j = 0; j < kSubK; ++j) {
      const float det = (sum_w[j] * sum_l2[j]) - (sum_l[j] * sum_l[j]);
      valid[j] = det > 0.0f;
      const float safe_det = valid[j] ? det : 1.0f;
      float s = ((sum_w[j] * sum_xl[j]) - (sum_x[j] * sum_l[j])) / safe_det;
      float m = ((sum_l2[j] * sum_x[j]) - (sum_l[j] * sum_xl[j])) / safe_det;
      if (m > 0.0f) {
        s = sum_xl[j] / (sum_l2[j] > 0.0f ? sum_l2[j] : 1.0f);
        m = 0.0f;
      }
      this_scale[j] = s;
      this_min[j] = m;
    }
    for (int i = 0; i < kValK; ++i)
      for (int j = 0; j < kSubK; ++j) {
        const float diff = ((this_scale[j] * static_cast<float>(cand[i][j])) + this_min[j]) - x[i][j];
        const float e = w[i][j] * (diff * diff);
        err[j] = i == 0 ? e : err[j] + e;
      }
    for (int j = 0; j < kSubK; ++j) {
      if (!(valid[j] && err[j] < best[j] && !flat[j])) continue;
      for (int i = 0; i < kValK; ++i) levels[i][j] = cand[i][j];
      best[j] = err[j];
      scale[j] = this_scale[j];
      best_min[j] = this_min[j];
    }
  }
  for (int j = 0; j < kSubK; ++j) {
    if (flat[j]) {
      scale[j] = 0.0f;
      for (int i = 0; i < kValK; ++i) levels[i][j] = 0;
      best_min[j] = lo[j];
    }
    scale_out[j] = scale[j];
    min_out[j] = -best_min[j];
  }
}

// `_quantize_6bit`: 8 non-negative scales or mins -> 6-bit levels and the super-block step.
float quantize_6bit(const float* v, uint8_t* levels) {
  float top = v[0];
  for (int j = 1; j < kSubK; ++j) top = std::max(top, v[j]);
  top = std::max(top, 0.0f);
  const float inv = top > 0.0f ? (1.0f / top) * 63.0f : 0.0f;
  for (int j = 0; j < kSubK; ++j) levels[j] = static_cast<uint8_t>(std::min(nearest(inv * v[j]) & 0xFF, 63));
  return top / 63.0f;
}

// One Q4_K (nmax 15) or Q5_K (nmax 31) super-block.
void k_block(const float* src, int qtype, uint8_t* dst) {
  const bool five = qtype == kQ5_K;
  const int nmax = five ? 31 : 15;
  LanesK x, w;
  for (int j = 0; j < kSubK; ++j)
    for (int i = 0; i < kValK; ++i) x[i][j] = src[kValK * j + i];
  // Importance without an imatrix: rms of the sub-block + |x|.
  float rms[kSubK];
  for (int j = 0; j < kSubK; ++j) rms[j] = x[0][j] * x[0][j];
  for (int i = 1; i < kValK; ++i)
    for (int j = 0; j < kSubK; ++j) rms[j] += x[i][j] * x[i][j];
  for (int j = 0; j < kSubK; ++j) rms[j] = std::sqrt(rms[j] / 32.0f);
  for (int i = 0; i < kValK; ++i)
    for (int j = 0; j < kSubK; ++j) w[i][j] = rms[j] + std::fabs(x[i][j]);
  float scale[kSubK], mins[kSubK];
  int32_t levels[kValK][kSubK];
  fit_scale_min(x, w, nmax, five ? -0.5f : -1.0f, 0.1f, five ? 15 : 20, scale, mins, levels);
  uint8_t ls[kSubK], lm[kSubK];
  const uint16_t d = f16_bits(quantize_6bit(scale, ls)), dmin = f16_bits(quantize_6bit(mins, lm));
  // Re-round every value against the scales as stored, except where a sub-block's scale is 0.
  uint8_t q[kSuper];
  for (int j = 0; j < kSubK; ++j) {
    const float d_sub = f16_value(d) * static_cast<float>(ls[j]);
    const float m_sub = f16_value(dmin) * static_cast<float>(lm[j]);
    for (int i = 0; i < kValK; ++i) {
      const int32_t l = d_sub == 0.0f ? levels[i][j] : clampi(nearest((x[i][j] + m_sub) / d_sub), 0, nmax);
      q[kValK * j + i] = static_cast<uint8_t>(l);
    }
  }
  std::memcpy(dst, &d, 2);
  std::memcpy(dst + 2, &dmin, 2);
  for (int j = 0; j < 4; ++j) {
    dst[4 + j] = static_cast<uint8_t>(ls[j] | ((ls[j + 4] >> 4) << 6));
    dst[8 + j] = static_cast<uint8_t>(lm[j] | ((lm[j + 4] >> 4) << 6));
    dst[12 + j] = static_cast<uint8_t>((ls[j + 4] & 0x0F) | ((lm[j + 4] & 0x0F) << 4));
  }
  uint8_t* qs = dst + 16;
  if (five) {
    uint8_t* qh = dst + 16;  // byte l, bit j: the 5th bit of value l of sub-block j
    for (int l = 0; l < kValK; ++l) {
      uint8_t b = 0;
      for (int j = 0; j < kSubK; ++j) b |= static_cast<uint8_t>(((q[kValK * j + l] >> 4) & 1) << j);
      qh[l] = b;
    }
    qs = dst + 48;
  }
  for (int c = 0; c < 4; ++c)  // chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high
    for (int l = 0; l < kValK; ++l)
      qs[kValK * c + l] = static_cast<uint8_t>((q[64 * c + l] & 0x0F) | ((q[64 * c + 32 + l] & 0x0F) << 4));
}

// ---- Q6_K: 16 sub-blocks (lanes) of 16 values -----------------------------------------------------
constexpr int kSub6 = 16, kVal6 = 16;
using Lanes6 = float[kVal6][kSub6];

// The value of largest magnitude (the first on ties).
inline float abs_max_signed(const float* v, int n, int stride) {
  float best = v[0];
  for (int i = 1; i < n; ++i)
    if (std::fabs(v[i * stride]) > std::fabs(best)) best = v[i * stride];
  return best;
}

// `_fit_symmetric` (llama.cpp's make_qx_quants, rmse_type 1, nmax 32) for 16 sub-blocks at once.
void fit_symmetric(const Lanes6& x, float* scale_out, int32_t (&levels)[kVal6][kSub6]) {
  constexpr int nmax = 32;
  float safe_top[kSub6], scale[kSub6], best[kSub6];
  bool zero[kSub6];
  Lanes6 w, wx;
  for (int j = 0; j < kSub6; ++j) {
    const float top = abs_max_signed(&x[0][j], kVal6, kSub6);
    zero[j] = std::fabs(top) < 1e-15f;
    safe_top[j] = zero[j] ? 1.0f : top;
  }
  for (int i = 0; i < kVal6; ++i)
    for (int j = 0; j < kSub6; ++j) {
      w[i][j] = x[i][j] * x[i][j];
      wx[i][j] = w[i][j] * x[i][j];
    }
  int32_t cand[kVal6][kSub6];
  float lx[kSub6], l2[kSub6];
  auto fit = [&](const float* iscale) {
    for (int i = 0; i < kVal6; ++i)
      for (int j = 0; j < kSub6; ++j) {
        const int32_t l = clampi(nearest(iscale[j] * x[i][j]), -nmax, nmax - 1);
        cand[i][j] = l;
        const float lf = static_cast<float>(l);
        const float a = wx[i][j] * lf, b = (w[i][j] * lf) * lf;
        lx[j] = i == 0 ? a : lx[j] + a;
        l2[j] = i == 0 ? b : l2[j] + b;
      }
  };
  float iscale[kSub6];
  for (int j = 0; j < kSub6; ++j) iscale[j] = (1.0f / safe_top[j]) * static_cast<float>(-nmax);
  fit(iscale);
  for (int j = 0; j < kSub6; ++j) {
    scale[j] = l2[j] != 0.0f ? lx[j] / l2[j] : 0.0f;
    best[j] = scale[j] * lx[j];
    for (int i = 0; i < kVal6; ++i) levels[i][j] = cand[i][j];
  }
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) continue;
    const float k = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(step));
    for (int j = 0; j < kSub6; ++j) iscale[j] = k / safe_top[j];
    fit(iscale);
    for (int j = 0; j < kSub6; ++j) {
      if (!(l2[j] > 0.0f && lx[j] * lx[j] > best[j] * l2[j])) continue;
      for (int i = 0; i < kVal6; ++i) levels[i][j] = cand[i][j];
      scale[j] = lx[j] / l2[j];
      best[j] = scale[j] * lx[j];
    }
  }
  for (int j = 0; j < kSub6; ++j) {
    if (zero[j]) {
      scale[j] = 0.0f;
      for (int i = 0; i < kVal6; ++i) levels[i][j] = -nmax;
    }
    scale_out[j] = scale[j];
    for (int i = 0; i < kVal6; ++i) levels[i][j] += nmax;
  }
}

void q6_block(const float* src, uint8_t* dst) {
  Lanes6 x;
  for (int j = 0; j < kSub6; ++j)
    for (int i = 0; i < kVal6; ++i) x[i][j] = src[kVal6 * j + i];
  float scales[kSub6];
  int32_t levels[kVal6][kSub6];
  fit_symmetric(x, scales, levels);
  const float top = abs_max_signed(scales, kSub6, 1);
  if (std::fabs(top) < 1e-15f) {
    std::memset(dst, 0, 210);
    return;
  }
  const float iscale = (1.0f / top) * -128.0f;
  const uint16_t d = f16_bits(1.0f / iscale);
  uint8_t q[kSuper];
  int8_t sc[kSub6];
  for (int j = 0; j < kSub6; ++j) {
    sc[j] = static_cast<int8_t>(std::min(nearest(iscale * scales[j]), 127));
    const float d_sub = f16_value(d) * static_cast<float>(sc[j]);
    for (int i = 0; i < kVal6; ++i) {
      const int32_t l = d_sub == 0.0f ? levels[i][j] : clampi(nearest(x[i][j] / d_sub), -32, 31) + 32;
      q[kVal6 * j + i] = static_cast<uint8_t>(l);
    }
  }
  // Per half of 128 values (4 runs of 32): ql = run 0 | run 2 << 4, run 1 | run 3 << 4; qh = the
  // 2 high bits of each run.
  for (int h = 0; h < 2; ++h) {
    const uint8_t* r = q + 128 * h;
    uint8_t* ql = dst + 64 * h;
    uint8_t* qh = dst + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((r[l] & 0x0F) | ((r[64 + l] & 0x0F) << 4));
      ql[32 + l] = static_cast<uint8_t>((r[32 + l] & 0x0F) | ((r[96 + l] & 0x0F) << 4));
      qh[l] = static_cast<uint8_t>((r[l] >> 4) | ((r[32 + l] >> 4) << 2) | ((r[64 + l] >> 4) << 4) | ((r[96 + l] >> 4) << 6));
    }
  }
  std::memcpy(dst + 192, sc, 16);
  std::memcpy(dst + 208, &d, 2);
}

// x: float32 [n, 256] super-blocks -> uint8 [n, block bytes].
at::Tensor quant_quantize_k(const at::Tensor& x, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K, "quant_quantize_k: qtype must be Q4_K, Q5_K or Q6_K, got ",
              qtype);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == kSuper && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "quant_quantize_k: x must be contiguous float32 [n, 256] on the CPU");
  const int64_t n = x.size(0);
  const int64_t bytes = qtype == kQ4_K ? 144 : qtype == kQ5_K ? 176 : 210;
  at::Tensor out = at::empty({n, bytes}, x.options().dtype(at::kByte));
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (qtype == kQ6_K) {
        q6_block(src + b * kSuper, dst + b * bytes);
      } else {
        k_block(src + b * kSuper, static_cast<int>(qtype), dst + b * bytes);
      }
    }
  });
  return out;
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def("quant_quantize_k(Tensor x, int qtype) -> Tensor");
  m.impl("quant_quantize_k", c10::DispatchKey::CPU, TORCH_FN(quant_quantize_k));
}

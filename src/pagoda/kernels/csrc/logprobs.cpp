// Logprobs and ranks of chosen tokens in rows of raw logits (`token_logprobs`), the scoring a
// select and every prompt_logprobs=0 request asks for: per row two passes over the vocabulary
// (the max, then the sum of exp(x - max) together with the counts of larger logits) where torch
// runs a log-sum-exp of several passes and a [rows, ids, vocabulary] comparison.
//
// Numerics: fp32 logits; the max is exact, the sum of exp(x - max) is fp32 in 4 x 16 lanes in a
// fixed order (vec.h's exp, relative error ~2e-7), the log-sum-exp max + log(sum) in double; so a
// logprob is within ~1e-6 of log_softmax's and the same on every variant. A rank is exact:
// 1 + the number of logits strictly greater than the token's, as torch counts them. Logits are
// the LM head's, finite: a NaN in a row gives unspecified values for that row (no crash).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

using namespace pagoda_vec;

constexpr int kLanes = 16;
constexpr int kAcc = 4;           // independent accumulators per pass
constexpr int kIdsPerPass = 4;    // ranks counted beside the exp sum; more ids take more passes
constexpr int64_t kGrainRows = 4; // rows per parallel chunk at least

float row_max(const float* x, int64_t n) {
  const VecF lowest = set1(-std::numeric_limits<float>::infinity());
  VecF m[kAcc] = {lowest, lowest, lowest, lowest};
  int64_t i = 0;
  for (; i + kAcc * kLanes <= n; i += kAcc * kLanes)
    for (int a = 0; a < kAcc; ++a) m[a] = max(m[a], load(x + i + a * kLanes));
  for (; i < n; i += kLanes) {
    const Mask mask = tail_mask(n - i);
    m[0] = max(m[0], select(mask, load(x + i, mask), lowest));
  }
  return reduce_max(max(max(m[0], m[1]), max(m[2], m[3])));
}

// Sum of exp(x - shift) over the row (with `sum`; nullptr: not computed), and for each of
// `k` <= kIdsPerPass thresholds the number of entries greater than it, into counts[]. The counts
// are held in fp32 lanes: exact, as a row has fewer than 2^24 entries.
void row_pass(const float* x, int64_t n, float shift, const float* thresholds, int k, int64_t* counts,
              float* sum) {
  const VecF s = set1(shift), lowest = set1(-std::numeric_limits<float>::infinity());
  VecF acc[kAcc] = {zero(), zero(), zero(), zero()};
  VecF t[kIdsPerPass], c[kIdsPerPass];
  for (int j = 0; j < k; ++j) t[j] = set1(thresholds[j]), c[j] = zero();
  int64_t i = 0;
  for (; i + kAcc * kLanes <= n; i += kAcc * kLanes) {
    for (int a = 0; a < kAcc; ++a) {
      const VecF v = load(x + i + a * kLanes);
      if (sum != nullptr) acc[a] = add(acc[a], exp(sub(v, s)));
      for (int j = 0; j < k; ++j) c[j] = count_greater(c[j], v, t[j]);
    }
  }
  for (; i < n; i += kLanes) {
    const Mask mask = tail_mask(n - i);
    const VecF v = select(mask, load(x + i, mask), lowest);
    if (sum != nullptr) acc[0] = add(acc[0], select(mask, exp(sub(v, s)), zero()));
    for (int j = 0; j < k; ++j) c[j] = count_greater(c[j], v, t[j]);
  }
  for (int j = 0; j < k; ++j) counts[j] = static_cast<int64_t>(reduce_add(c[j]));
  if (sum != nullptr) *sum = reduce_add(add(add(acc[0], acc[1]), add(acc[2], acc[3])));
}

// logits: [L, V] float32 with contiguous rows; ids: [L, W] int64 in [0, V). Returns
// (logprobs [L, W] float32, ranks [L, W] int64).
std::tuple<at::Tensor, at::Tensor> token_logprobs(const at::Tensor& logits, const at::Tensor& ids) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.device().is_cpu(), "logits must be a float32 CPU tensor");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be 2-D with contiguous rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu() && ids.dim() == 2 && ids.is_contiguous(),
              "ids must be a contiguous 2-D int64 CPU tensor");
  const int64_t L = logits.size(0), V = logits.size(1), W = ids.size(1);
  TORCH_CHECK(ids.size(0) == L, "ids must have one row per logits row, got ", ids.size(0), " for ", L);
  TORCH_CHECK(V > 0 && W > 0, "logits and ids must not be empty");
  TORCH_CHECK(V < (int64_t{1} << 24), "a row of ", V, " logits is too long (fp32 counts)");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < L * W; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < V, "token id ", id[i], " is not in [0, ", V, ")");
  at::Tensor values = at::empty({L, W}, logits.options());
  at::Tensor ranks = at::empty({L, W}, ids.options());
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  float* out = values.data_ptr<float>();
  int64_t* rank = ranks.data_ptr<int64_t>();
  at::parallel_for(0, L, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = base + r * stride;
      const int64_t* row_ids = id + r * W;
      float targets[kIdsPerPass];
      const float m = row_max(x, V);
      float sum = 0.0f;
      for (int64_t j0 = 0; j0 < W; j0 += kIdsPerPass) {
        const int k = static_cast<int>(std::min<int64_t>(kIdsPerPass, W - j0));
        int64_t counts[kIdsPerPass] = {0, 0, 0, 0};
        for (int j = 0; j < k; ++j) targets[j] = x[row_ids[j0 + j]];
        row_pass(x, V, m, targets, k, counts, j0 == 0 ? &sum : nullptr);
        for (int j = 0; j < k; ++j) rank[r * W + j0 + j] = counts[j] + 1;
      }
      const double lse = static_cast<double>(m) + std::log(static_cast<double>(sum));
      for (int64_t j = 0; j < W; ++j) out[r * W + j] = static_cast<float>(x[row_ids[j]] - lse);
    }
  });
  return {values, ranks};
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def("token_logprobs(Tensor logits, Tensor ids) -> (Tensor, Tensor)");
  m.impl("token_logprobs", c10::DispatchKey::CPU, TORCH_FN(token_logprobs));
}

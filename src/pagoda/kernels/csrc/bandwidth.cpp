// Memory read bandwidth probe: every thread streams one contiguous share of a buffer through
// vector loads into four independent sums (no stores, nothing but the reads to wait on), the
// access pattern of single-stream decode, which reads each weight once per token.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "vec.h"

#include <vector>

namespace {

using namespace pagoda_vec;

// The sum of a float32 buffer's elements (its numel a multiple of 64); the value only keeps the
// reads from being optimised away.
double memory_read(const at::Tensor& buf) {
  TORCH_CHECK(buf.scalar_type() == at::kFloat && buf.is_contiguous() && buf.device().is_cpu() && buf.numel() % 64 == 0,
              "buf must be a contiguous float32 CPU tensor whose size is a multiple of 64");
  const float* data = buf.data_ptr<float>();
  const int64_t blocks = buf.numel() / 64;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  std::vector<double> partial(static_cast<size_t>(threads), 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      VecF s0 = zero(), s1 = zero(), s2 = zero(), s3 = zero();
      for (int64_t b = t * blocks / threads, end = (t + 1) * blocks / threads; b < end; ++b) {
        const float* p = data + b * 64;
        s0 = add(s0, load(p));
        s1 = add(s1, load(p + 16));
        s2 = add(s2, load(p + 32));
        s3 = add(s3, load(p + 48));
      }
      partial[static_cast<size_t>(t)] = reduce_add(add(add(s0, s1), add(s2, s3)));
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace

PAGODA_LIBRARY_FRAGMENT(m) {
  m.def("memory_read(Tensor buf) -> float");
  m.impl("memory_read", c10::DispatchKey::CPU, TORCH_FN(memory_read));
}

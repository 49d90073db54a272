// Tasks over the torch threads with catch-up: thread i runs its share of tasks front to back,
// then takes what is left of the others' shares (from their fronts), so a thread woken late by
// the thread pool, or slowed by the other core's load, is caught up by the rest. A task is
// claimed once through an atomic cursor per share; which thread runs a task must not change its
// result (every kernel here computes an output the same way whoever computes it).
#pragma once

#include <ATen/Parallel.h>

#include "vec.h"  // the variant's namespace

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pagoda_vec {
inline namespace PAGODA_VARIANT_NS {  // per variant, as everything built with its flags

// bounds[i] .. bounds[i + 1]: share i's tasks (bounds.size() - 1 shares, one per thread).
// body(task) runs once per task, on some thread.
template <typename Body>
void run_shares(const std::vector<size_t>& bounds, const Body& body) {
  struct alignas(64) Cursor {
    std::atomic<size_t> next;
  };
  const int64_t shares = static_cast<int64_t>(bounds.size()) - 1;
  if (shares <= 0) return;
  std::vector<Cursor> cursor(static_cast<size_t>(shares));
  for (size_t i = 0; i < cursor.size(); ++i) cursor[i].next.store(bounds[i], std::memory_order_relaxed);
  at::parallel_for(0, shares, 1, [&](int64_t i0, int64_t i1) {
    const auto drain = [&](int64_t share) {
      const auto s = static_cast<size_t>(share);
      for (size_t t; (t = cursor[s].next.fetch_add(1, std::memory_order_relaxed)) < bounds[s + 1];) body(t);
    };
    for (int64_t i = i0; i < i1; ++i) drain(i);
    for (int64_t j = 1; j < shares; ++j) drain((i1 - 1 + j) % shares);
  });
}

// `tasks` tasks in near-equal contiguous shares, one per torch thread.
inline std::vector<size_t> even_shares(int64_t tasks) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(tasks, at::get_num_threads()));
  std::vector<size_t> bounds;
  for (int64_t i = 0; i <= n; ++i) bounds.push_back(static_cast<size_t>(i * tasks / n));
  return bounds;
}

}  // namespace PAGODA_VARIANT_NS
}  // namespace pagoda_vec

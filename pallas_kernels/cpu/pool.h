// Work shared between the calling thread and XLA's intra-op thread pool (spec_jax's CPU kernels).
//
// Items are claimed from a counter; the caller runs items too and then waits only for items
// already claimed, so a helper that starts late (or never, when the pool is busy) cannot stall
// the call, and a helper that starts after the work is done finds nothing and returns.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace spec_jax {

struct Claims {
  int64_t total = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Runs body(item) for claimed items until none is left.
  template <typename F>
  void drain(F&& body) {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= total) return;
      body(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline int64_t pool_threads(xla::ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 16));
}

// job->claims.total items, run by job->drain() on this thread and on pool helpers.
template <typename Job>
void run_shared(xla::ffi::ThreadPool& pool, const std::shared_ptr<Job>& job) {
  const int64_t total = job->claims.total;
  const int64_t helpers = std::min<int64_t>(pool_threads(pool) - 1, total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->drain(); });
  job->drain();
  while (job->claims.done.load(std::memory_order_acquire) < total) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace spec_jax

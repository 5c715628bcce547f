// A minimal parallel-for for the CPU handlers: dynamic chunks over [0, n) on the machine's cores.
// Each index must write disjoint outputs, which keeps results deterministic whatever the schedule.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace jax_msa::cpu {

template <typename Fn>
void parallel_for(int64_t n, int64_t chunk, Fn&& fn) {
  if (n <= 0) return;
  const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
  const int workers = int(std::min<int64_t>(hw, (n + chunk - 1) / chunk));
  std::atomic<int64_t> next{0};
  auto run = [&]() {
    for (;;) {
      const int64_t begin = next.fetch_add(chunk);
      if (begin >= n) return;
      const int64_t end = std::min(n, begin + chunk);
      for (int64_t i = begin; i < end; ++i) fn(i);
    }
  };
  if (workers <= 1) {
    run();
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(size_t(workers - 1));
  for (int i = 0; i < workers - 1; ++i) pool.emplace_back(run);
  run();
  for (auto& th : pool) th.join();
}

}  // namespace jax_msa::cpu

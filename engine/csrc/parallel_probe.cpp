// How many threads ATen's parallel_for, inlined into this library, runs on:
// with OpenMP in the build it takes the engine's intra-op threads; without
// it every operator here would run serially whatever torch.set_num_threads
// says (engine/cpp_ops.py builds with -fopenmp for that).  For tests.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <set>

namespace {

int64_t parallel_threads(int64_t items) {
  std::mutex m;
  std::set<int> seen;
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(m);
    seen.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(preempt_serve, m) {
  m.def("parallel_threads(int items) -> int", &parallel_threads);
}

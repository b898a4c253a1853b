// How a batch-1 product's output rows are shared among the threads.
//
// Each row's dot is the same computation whichever thread takes it, so the split changes no
// bit: it sets how long the threads wait for one another at the product's end. Split evenly
// (at::parallel_for), two threads streaming weights from memory do not keep pace: in a 1B
// model's batch-1 decode each spent 10-13% of its samples in libgomp's spin-wait (perf, Zen
// 3), the first waiting for the second about as often as the reverse. So the threads take
// runs of rows that shrink as the rows run out, OpenMP's "guided" schedule: each take is the
// rows left over 2 * threads, and at least kMinRunBytes of weights. The first runs are long
// streams that the prefetchers settle into; the last are short, and the threads end close
// together. The main thread's spin-wait fell from 9.7% of its samples to 1.7-2.0%, the
// worker's from 12.9% to 9.2-9.7% (it also waits out the main thread's serial work), and a
// 1B-shaped stack of Q4_K and Q6_K matrices from DRAM streamed 6% faster (medians of 40
// alternating steps, twice).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace nanoserve {

// At least this many bytes of weights a run, so that a product restarts few streams: runs
// of 16 KB to 256 KB decoded a 1B model at the same speed within the host's noise.
constexpr int64_t kMinRunBytes = 64 << 10;

// fn(begin, end) over runs of the rows [0, N), `row_bytes` each, on the threads; on the
// calling thread alone where there is one thread, one run, or an enclosing parallel region.
template <class Fn>
void guided_rows(int64_t N, int64_t row_bytes, const Fn& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t min_rows = std::max<int64_t>(1, kMinRunBytes / std::max<int64_t>(row_bytes, 1));
  if (threads <= 1 || N <= min_rows || at::in_parallel_region()) {
    fn(0, N);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < N) {  // a failed exchange reloads begin: another thread took that run
      const int64_t left = N - begin;
      const int64_t end = begin + std::min(left, std::max(min_rows, left / (2 * threads)));
      if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {
        fn(begin, end);
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

}  // namespace nanoserve

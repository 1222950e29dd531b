// A small thread pool that shares the machine: workers sleep on a condition
// variable (no spinning); the calling thread works too and claims chunks from
// an atomic counter, so a worker that is slow to wake (another process holds
// its core) costs at most the chunk it already claimed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tsq {

class Pool {
 public:
  // spin_us: how long a worker polls for the next job before it sleeps (0: sleep at once)
  explicit Pool(int threads, int spin_us = 0);
  ~Pool();
  int threads() const { return (int)workers_.size() + 1; }
  // Run body(chunk) for chunk in [0, chunks), spread over the pool.
  void run(int64_t chunks, const std::function<void(int64_t)>& body);

 private:
  struct Job {
    const std::function<void(int64_t)>* body;
    int64_t chunks;
    std::atomic<int64_t> next{0};
  };
  void work(Job& job);
  void loop();

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  Job* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  int spin_us_ = 0;
  int busy_ = 0;
  bool stop_ = false;
};

}  // namespace tsq

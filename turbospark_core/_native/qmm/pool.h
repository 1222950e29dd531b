// A small thread pool that shares the machine. The calling thread works too and
// claims chunks from an atomic counter, so a worker that is slow to wake (another
// process holds its core) costs at most the chunk it already claimed.
//
// A decode step runs a few hundred small jobs back to back (tens of microseconds
// each), where a futex wake-up of a halted virtual CPU costs as much as the job.
// So both sides poll briefly before they sleep: a worker for the next job, the
// caller for the workers to finish theirs; a poll yields the core to any other
// runnable thread (sched_yield), and after spin_us without work everyone sleeps
// (no core is held by an idle pool).
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
  // spin_us: how long a worker polls for the next job, and the caller for the
  // workers, before sleeping (0: sleep at once)
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
  static void work(Job& job);
  void loop();

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;      // guards sleeping and waking (not the hand-off itself)
  std::condition_variable wake_, done_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> busy_{0};          // workers inside a job
  std::atomic<int> sleepers_{0};      // workers asleep on wake_
  std::atomic<bool> caller_asleep_{false};
  int spin_us_ = 0;
  std::atomic<bool> stop_{false};
};

}  // namespace tsq

#include "pool.h"

#include <chrono>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tsq {

namespace {
inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}
}  // namespace

Pool::Pool(int threads, int spin_us) : spin_us_(spin_us) {
  for (int i = 1; i < threads; i++) workers_.emplace_back([this] { loop(); });
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void Pool::work(Job& job) {
  for (int64_t c = job.next.fetch_add(1); c < job.chunks; c = job.next.fetch_add(1)) (*job.body)(c);
}

void Pool::loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (spin_us_ > 0 && generation_.load(std::memory_order_acquire) == seen) {
      // decode steps run many small jobs back to back: poll briefly before sleeping, so the next
      // one starts here at once instead of after a wake-up
      lock.unlock();
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
        for (int i = 0; i < 64; i++) relax();
      }
      lock.lock();
    }
    wake_.wait(lock, [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen; });
    if (stop_) return;
    seen = generation_.load(std::memory_order_relaxed);
    Job* job = job_;
    if (job == nullptr) continue;  // woke after the job ended
    busy_++;
    lock.unlock();
    work(*job);
    lock.lock();
    if (--busy_ == 0) done_.notify_all();
  }
}

void Pool::run(int64_t chunks, const std::function<void(int64_t)>& body) {
  if (workers_.empty() || chunks <= 1) {
    for (int64_t c = 0; c < chunks; c++) body(c);
    return;
  }
  std::lock_guard<std::mutex> guard(run_mu_);
  Job job;
  job.body = &body;
  job.chunks = chunks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &job;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  work(job);
  std::unique_lock<std::mutex> lock(mu_);
  job_ = nullptr;  // workers that wake from now on find nothing to do
  done_.wait(lock, [&] { return busy_ == 0; });
}

}  // namespace tsq

#include "pool.h"

#include <chrono>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sched.h>

namespace tsq {

namespace {
inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// Poll done() for up to us microseconds; true when it came true.
template <class F>
bool poll(int us, F done) {
  if (us <= 0) return done();
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (int round = 0;; round++) {
    for (int i = 0; i < 32; i++) {
      if (done()) return true;
      relax();
    }
    if (std::chrono::steady_clock::now() >= until) return done();
    if (round % 8 == 7) sched_yield();  // a runnable thread of this or another process gets the core
  }
}
}  // namespace

Pool::Pool(int threads, int spin_us) : spin_us_(spin_us) {
  for (int i = 1; i < threads; i++) workers_.emplace_back([this] { loop(); });
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void Pool::work(Job& job) {
  for (int64_t c = job.next.fetch_add(1); c < job.chunks; c = job.next.fetch_add(1)) (*job.body)(c);
}

void Pool::loop() {
  uint64_t seen = 0;
  for (;;) {
    if (!poll(spin_us_, [&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1);  // seq_cst: run() reads it after publishing a generation
      wake_.wait(lock, [&] { return stop_ || generation_.load() != seen; });
      sleepers_.fetch_sub(1);
    }
    if (stop_.load()) return;
    seen = generation_.load();
    // announce first, then look: run() clears job_ before it waits for busy_ to drain, so a worker
    // either sees the job while run() still waits for it, or sees nothing
    busy_.fetch_add(1);
    if (Job* job = job_.load()) work(*job);
    if (busy_.fetch_sub(1) == 1 && caller_asleep_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      done_.notify_all();
    }
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
  job_.store(&job);
  generation_.fetch_add(1);
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(mu_);  // a worker between its check and its wait holds mu_
    wake_.notify_all();
  }
  work(job);
  job_.store(nullptr);  // workers that look from now on find nothing to do
  if (!poll(spin_us_, [&] { return busy_.load() == 0; })) {
    std::unique_lock<std::mutex> lock(mu_);
    caller_asleep_.store(true);
    done_.wait(lock, [&] { return busy_.load() == 0; });
    caller_asleep_.store(false);
  }
}

}  // namespace tsq

#include "pool.h"

namespace tsq {

Pool::Pool(int threads) {
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
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
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
    generation_++;
  }
  wake_.notify_all();
  work(job);
  std::unique_lock<std::mutex> lock(mu_);
  job_ = nullptr;  // workers that wake from now on find nothing to do
  done_.wait(lock, [&] { return busy_ == 0; });
}

}  // namespace tsq

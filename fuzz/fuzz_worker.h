// One long-lived thread that runs a job at a time, for the gRPC fuzz targets' stream readers (a
// thread per input would grow the sanitizer's thread registry by a million entries over a run).
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace kvt_fuzz {

class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}
  void Run(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !job_; });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return static_cast<bool>(job_); });
      lock.unlock();
      job_();
      lock.lock();
      job_ = nullptr;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  std::thread thread_;  // runs until the process exits
};

}  // namespace kvt_fuzz

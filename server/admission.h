// Admission control: bounds the translations in flight and the cache bytes they hold, so
// overload becomes RESOURCE_EXHAUSTED with a retry hint instead of an out-of-memory crash.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"

namespace kvt {

class AdmissionController {
 public:
  AdmissionController(int64_t max_requests, int64_t max_bytes);

  // Releases its share when destroyed.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept;
    Ticket& operator=(Ticket&& other) noexcept;
    ~Ticket();

   private:
    friend class AdmissionController;
    Ticket(AdmissionController* owner, int64_t bytes) : owner_(owner), bytes_(bytes) {}
    AdmissionController* owner_ = nullptr;
    int64_t bytes_ = 0;
  };

  // RESOURCE_EXHAUSTED (saying which limit, and to retry) when admitting would exceed a limit.
  absl::StatusOr<Ticket> TryAdmit(int64_t bytes) ABSL_LOCKS_EXCLUDED(mutex_);

  int64_t inflight_requests() const ABSL_LOCKS_EXCLUDED(mutex_);
  int64_t inflight_bytes() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  void Release(int64_t bytes) ABSL_LOCKS_EXCLUDED(mutex_);

  const int64_t max_requests_;
  const int64_t max_bytes_;
  // kvt::Mutex rather than absl::Mutex: Debian's absl is not TSan-instrumented, std::mutex is
  // (through pthread), so TSan can check this state (common/mutex.h).
  mutable Mutex mutex_;
  int64_t requests_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace kvt

#include "server/admission.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvt {

AdmissionController::AdmissionController(int64_t max_requests, int64_t max_bytes)
    : max_requests_(max_requests), max_bytes_(max_bytes) {}

AdmissionController::Ticket::Ticket(Ticket&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

AdmissionController::Ticket& AdmissionController::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    if (owner_ != nullptr) owner_->Release(bytes_);
    owner_ = std::exchange(other.owner_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

AdmissionController::Ticket::~Ticket() {
  if (owner_ != nullptr) owner_->Release(bytes_);
}

absl::StatusOr<AdmissionController::Ticket> AdmissionController::TryAdmit(int64_t bytes) {
  MutexLock lock(&mutex_);
  if (requests_ + 1 > max_requests_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("server busy: ", requests_, " translations in flight (limit "
                     "limits.max_inflight_requests=", max_requests_, "); retry with backoff"));
  }
  if (bytes_ + bytes > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "server busy: admitting ", bytes, " cache bytes would exceed limits.max_inflight_bytes=",
        max_bytes_, " (", bytes_, " held by requests in flight); retry with backoff"));
  }
  ++requests_;
  bytes_ += bytes;
  return Ticket(this, bytes);
}

void AdmissionController::Release(int64_t bytes) {
  MutexLock lock(&mutex_);
  --requests_;
  bytes_ -= bytes;
}

int64_t AdmissionController::inflight_requests() const {
  MutexLock lock(&mutex_);
  return requests_;
}

int64_t AdmissionController::inflight_bytes() const {
  MutexLock lock(&mutex_);
  return bytes_;
}

}  // namespace kvt

#include "server/admission.h"

#include <utility>

#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(AdmissionTest, LimitsRequestsAndBytesAndReleasesOnDestruction) {
  AdmissionController admission(2, 100);
  absl::StatusOr<AdmissionController::Ticket> a = admission.TryAdmit(60);
  ASSERT_TRUE(a.ok());
  absl::StatusOr<AdmissionController::Ticket> too_big = admission.TryAdmit(41);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("limits.max_inflight_bytes"), std::string::npos);
  {
    absl::StatusOr<AdmissionController::Ticket> b = admission.TryAdmit(40);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(admission.inflight_requests(), 2);
    absl::StatusOr<AdmissionController::Ticket> third = admission.TryAdmit(0);
    EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(third.status().message().find("limits.max_inflight_requests"), std::string::npos);
  }
  EXPECT_EQ(admission.inflight_requests(), 1);
  EXPECT_EQ(admission.inflight_bytes(), 60);
  AdmissionController::Ticket moved = std::move(*a);
  EXPECT_EQ(admission.inflight_bytes(), 60);  // a move transfers, never double-releases
  moved = AdmissionController::Ticket();
  EXPECT_EQ(admission.inflight_requests(), 0);
  EXPECT_EQ(admission.inflight_bytes(), 0);
}

}  // namespace
}  // namespace kvt

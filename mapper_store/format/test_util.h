// Test helpers shared by the mapper store tests: status assertions and fresh temp directories.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

#define KVT_ASSERT_OK(expr)                   \
  do {                                        \
    const ::absl::Status kvt_status_ = (expr); \
    ASSERT_TRUE(kvt_status_.ok()) << kvt_status_; \
  } while (0)

#define KVT_EXPECT_OK(expr)                   \
  do {                                        \
    const ::absl::Status kvt_status_ = (expr); \
    EXPECT_TRUE(kvt_status_.ok()) << kvt_status_; \
  } while (0)

namespace kvt {
namespace testing {

inline absl::Status StatusOf(const absl::Status& status) { return status; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& value) {
  return value.status();
}

// A new, empty directory under $TEST_TMPDIR (or /tmp), unique per call.
std::string MakeTempDir(const std::string& label);

}  // namespace testing
}  // namespace kvt

// Asserts `expr` (Status or StatusOr) failed with `code` and a message containing `substring`.
#define KVT_EXPECT_ERROR(expr, expected_code, substring)                                           \
  do {                                                                                    \
    const ::absl::Status kvt_status_ = ::kvt::testing::StatusOf(expr);                    \
    EXPECT_EQ(kvt_status_.code(), (expected_code)) << kvt_status_;                                 \
    EXPECT_NE(std::string(kvt_status_.message()).find(substring), std::string::npos)      \
        << "message '" << kvt_status_.message() << "' lacks '" << (substring) << "'";      \
  } while (0)

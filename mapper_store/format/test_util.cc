#include "mapper_store/format/test_util.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"

namespace kvt {
namespace testing {

std::string MakeTempDir(const std::string& label) {
  static std::atomic<int> counter{0};
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = JoinPath(root != nullptr ? root : "/tmp",
                                   absl::StrCat("kvt_", label, "_", ::getpid(), "_", counter++));
  EXPECT_TRUE(RemoveTree(dir).ok());
  EXPECT_TRUE(MakeDirs(dir).ok());
  return dir;
}

}  // namespace testing
}  // namespace kvt

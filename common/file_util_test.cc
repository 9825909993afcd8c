#include "common/file_util.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace kvt {
namespace {

std::string TempRoot() {
  const char* root = std::getenv("TEST_TMPDIR");
  return JoinPath(root != nullptr ? root : "/tmp", "file_util_test");
}

TEST(FileUtilTest, PathPieces) {
  EXPECT_EQ(JoinPath("a", "b"), "a/b");
  EXPECT_EQ(JoinPath("a/", "b"), "a/b");
  EXPECT_EQ(JoinPath("a", "/b"), "/b");
  EXPECT_EQ(JoinPath("", "b"), "b");
  EXPECT_EQ(Basename("/x/y/"), "y");
  EXPECT_EQ(Basename("y"), "y");
  EXPECT_EQ(Dirname("/x/y"), "/x");
  EXPECT_EQ(Dirname("/y"), "/");
  EXPECT_EQ(Dirname("y"), ".");
  EXPECT_EQ(Dirname("a/b/"), "a");
}

TEST(FileUtilTest, WriteReadListRemove) {
  const std::string root = TempRoot();
  ASSERT_TRUE(RemoveTree(root).ok());
  ASSERT_TRUE(MakeDirs(JoinPath(root, "b/deep")).ok());
  ASSERT_TRUE(MakeDirs(JoinPath(root, "a")).ok());
  ASSERT_TRUE(WriteStringToFile(JoinPath(root, "file.txt"), "hello").ok());
  absl::StatusOr<std::string> text = ReadFileToString(JoinPath(root, "file.txt"));
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "hello");
  EXPECT_EQ(*FileSize(JoinPath(root, "file.txt")), 5u);
  absl::StatusOr<std::vector<std::string>> dirs = ListSubdirectories(root);
  ASSERT_TRUE(dirs.ok());
  EXPECT_EQ(*dirs, (std::vector<std::string>{"a", "b"}));
  absl::StatusOr<std::vector<std::string>> all = ListDirectory(root);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, (std::vector<std::string>{"a", "b", "file.txt"}));
  EXPECT_EQ(ListDirectory(JoinPath(root, "missing")).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(SyncDirectory(root).ok());
  ASSERT_TRUE(RemoveTree(root).ok());
  EXPECT_FALSE(PathExists(root));
  EXPECT_TRUE(RemoveTree(root).ok());  // already gone is fine
}

TEST(FileUtilTest, MissingFileIsNotFoundAndNamesThePath) {
  absl::StatusOr<std::string> text = ReadFileToString("/nonexistent/kvt/file");
  EXPECT_EQ(text.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(text.status().message().find("/nonexistent/kvt/file"), absl::string_view::npos);
}

}  // namespace
}  // namespace kvt

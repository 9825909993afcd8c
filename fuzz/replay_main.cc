// gtest main for the fuzz targets built with gcc under Bazel: every file of the directories given
// as arguments (seed corpus, crash regressions; relative to the runfiles root) becomes one test
// case that feeds the file to LLVMFuzzerTestOneInput. A target aborts (FUZZ_CHECK) or crashes
// on a regression, which fails that case; under --config=asan the sanitizers check it too.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> files;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return files;  // e.g. no regressions yet
  while (dirent* entry = readdir(d)) {
    const std::string path = dir + "/" + entry->d_name;
    struct stat st;
    if (entry->d_name[0] != '.' && stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      files.push_back(path);
    }
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  return files;
}

std::string TestName(const std::string& path) {
  std::string name = path;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

class ReplayTest : public ::testing::Test {
 public:
  explicit ReplayTest(std::string path) : path_(std::move(path)) {}
  void TestBody() override {
    std::ifstream in(path_, std::ios::binary);
    ASSERT_TRUE(in) << "cannot read " << path_;
    std::stringstream bytes;
    bytes << in.rdbuf();
    const std::string data = bytes.str();
    EXPECT_EQ(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(data.data()), data.size()),
              0);
  }

 private:
  std::string path_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  size_t registered = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string dir = argv[i];
    const std::string suite = TestName(dir.substr(0, dir.find_last_of('/')));
    for (const std::string& path : FilesIn(dir)) {
      ::testing::RegisterTest(suite.c_str(), TestName(path.substr(dir.size() + 1)).c_str(),
                              nullptr, nullptr, __FILE__, __LINE__,
                              [path]() -> ::testing::Test* { return new ReplayTest(path); });
      ++registered;
    }
  }
  if (registered == 0) {
    std::fprintf(stderr, "no input files in the given directories\n");
    return 1;
  }
  return RUN_ALL_TESTS();
}

#include "fit/progress.h"

#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace fit {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Capture(bool tty) {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&buffer, &size);
  {
    Progress progress("probe", 4, "sequences", out, tty ? 1 : 0, std::chrono::seconds(3600));
    for (int i = 0; i < 4; ++i) progress.Advance(1, 100);
  }
  std::fclose(out);
  std::string text(buffer, size);
  free(buffer);
  return text;
}

TEST(ProgressTest, PlainLinesWhenNotATerminal) {
  const std::string text = Capture(false);
  // The interval is an hour: only the line at completion and the final one.
  EXPECT_THAT(text, HasSubstr("kvt fit: probe 100%: 4/4 sequences, 400 tokens"));
  EXPECT_THAT(text, HasSubstr("kvt fit: probe done: 4/4 sequences"));
  EXPECT_THAT(text, Not(HasSubstr("\r")));
  EXPECT_THAT(text, Not(HasSubstr("\033")));
}

TEST(ProgressTest, BarWithEtaOnATerminal) {
  const std::string text = Capture(true);
  EXPECT_THAT(text, HasSubstr("\r\033[K"));
  EXPECT_THAT(text, HasSubstr("[##############################] 100%"));
  EXPECT_THAT(text, HasSubstr(" in "));
}

TEST(ProgressTest, FormatDuration) {
  EXPECT_EQ(Progress::FormatDuration(45), "45s");
  EXPECT_EQ(Progress::FormatDuration(83), "1m23s");
  EXPECT_EQ(Progress::FormatDuration(7500), "2h05m");
  EXPECT_EQ(Progress::FormatDuration(-1), "?");
}

}  // namespace
}  // namespace fit
}  // namespace kvt

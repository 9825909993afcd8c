// The command table against the flags the binary registers: every flag a command lists exists,
// its --help shows each with its default, and the global usage and each command's usage text
// name only (and, for usage texts, all of) that command's flags.
#include "cli/command_table.h"

#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace cli {
namespace {

using ::testing::HasSubstr;

// Every `--name` in `text`.
std::set<std::string> FlagsNamed(const std::string& text) {
  std::set<std::string> names;
  const std::regex flag("--([a-z0-9_]+)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), flag);
       it != std::sregex_iterator(); ++it) {
    names.insert((*it)[1]);
  }
  return names;
}

std::set<std::string> TableFlags(const CommandSpec& command) {
  return std::set<std::string>(command.flags.begin(), command.flags.end());
}

TEST(CommandTableTest, EveryListedFlagIsRegisteredOnce) {
  for (const CommandSpec& command : Commands()) {
    EXPECT_EQ(TableFlags(command).size(), command.flags.size()) << command.name;
    for (const char* name : command.flags) {
      EXPECT_NE(absl::FindCommandLineFlag(name), nullptr) << command.name << " --" << name;
    }
  }
}

TEST(CommandTableTest, HelpListsEveryFlagWithItsDefault) {
  for (const CommandSpec& command : Commands()) {
    const std::string help = CommandHelp(command);
    EXPECT_THAT(help, HasSubstr(std::string("usage: kvt ") + command.name)) << help;
    EXPECT_THAT(help, ::testing::Not(HasSubstr("not a registered flag"))) << help;
    for (const char* name : command.flags) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      ASSERT_NE(flag, nullptr) << name;
      const std::string value = flag->DefaultValue().empty() ? "\"\"" : flag->DefaultValue();
      EXPECT_THAT(help, HasSubstr("\n  --" + std::string(name) + "=" + value + "\n      " +
                                  flag->Help() + "\n"))
          << command.name;
    }
    if (command.flags.empty()) {
      EXPECT_THAT(help, HasSubstr("no flags"));
    }
  }
}

TEST(CommandTableTest, UsageTextNamesExactlyTheCommandsFlags) {
  for (const CommandSpec& command : Commands()) {
    EXPECT_EQ(FlagsNamed(command.usage), TableFlags(command)) << command.name;
  }
}

TEST(CommandTableTest, GlobalUsageNamesEveryCommandAndOnlyItsRealFlags) {
  std::istringstream lines(GlobalUsage());
  std::string line;
  bool in_commands = false;
  std::set<std::string> listed;
  while (std::getline(lines, line)) {
    if (line == "commands:") {
      in_commands = true;
      continue;
    }
    if (!in_commands) continue;
    if (line.empty()) break;
    std::smatch match;
    ASSERT_TRUE(std::regex_match(line, match, std::regex("  ([a-z][a-z-]*) +(.*)"))) << line;
    const CommandSpec* command = FindCommand(match[1].str());
    ASSERT_NE(command, nullptr) << line;
    listed.insert(command->name);
    const std::set<std::string> table = TableFlags(*command);
    for (const std::string& flag : FlagsNamed(match[2].str())) {
      EXPECT_EQ(table.count(flag), 1u) << "kvt help names --" << flag << " for "
                                       << command->name << ", which does not read it";
    }
  }
  EXPECT_EQ(listed.size(), Commands().size());
}

TEST(CommandTableTest, TranslateWritesWithResultNotOut) {
  const CommandSpec* translate = FindCommand("translate");
  ASSERT_NE(translate, nullptr);
  EXPECT_THAT(translate->summary, HasSubstr("--result"));
  EXPECT_EQ(TableFlags(*translate).count("out"), 0u);
}

}  // namespace
}  // namespace cli
}  // namespace kvt

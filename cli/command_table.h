// The table of `kvt` commands: each command's summary (the global usage), usage text and the
// flags it reads, from which `kvt <command> --help` prints its usage and flags with defaults.
// One table for every command, so that help, the global usage and the code cannot drift apart
// without cli/command_table_test failing.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvt {
namespace cli {

struct CommandSpec {
  const char* name;
  int (*run)(const std::vector<std::string>& args);
  // One line of `kvt help`; every --flag it names is in `flags`.
  const char* summary;
  // "usage: kvt NAME ..." and a description; every --flag it names is in `flags`.
  const char* usage;
  // Every flag the command reads, in the order --help lists them.
  std::vector<const char*> flags;
};

// Every command, in the order `kvt help` lists them.
const std::vector<CommandSpec>& Commands();
// nullptr when there is no such command.
const CommandSpec* FindCommand(absl::string_view name);

// `kvt help`: the commands and their summaries.
std::string GlobalUsage();
// A command's usage text (what its errors print).
std::string CommandUsage(absl::string_view name);
// `kvt NAME --help`: the usage, then every flag as `  --flag=DEFAULT` and its help text.
std::string CommandHelp(const CommandSpec& command);

}  // namespace cli
}  // namespace kvt

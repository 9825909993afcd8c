// kvt: the command-line tool of the kvt service. `kvt help` lists the commands; `kvt <command>
// --help` prints one command's usage and flags (cli/command_table.h).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "cli/command_table.h"
#include "kernels/blas_core.h"

namespace {

bool IsHelpFlag(const std::string& arg) {
  return arg == "--help" || arg == "-help" || arg == "-h" || arg == "--h";
}

}  // namespace

int main(int argc, char** argv) {
  // First, before anything starts threads: `kvt fit`'s float64 statistics run on OpenBLAS, whose
  // kernels are fixed when it loads; restart once with better ones if it picked weak ones
  // (kernels/blas_core.h). Returns only when no restart happened or it failed.
  if (const absl::Status restarted = kvt::RestartWithBestBlasCore(argv); !restarted.ok()) {
    std::fprintf(stderr, "kvt: warning: keeping OpenBLAS core %s: %s\n",
                 kvt::OpenblasCoreName().c_str(), std::string(restarted.message()).c_str());
  } else if (const kvt::BlasCoreState blas = kvt::CurrentBlasCore(); blas.restarted()) {
    std::fprintf(stderr, "kvt: %s\n", blas.Summary().c_str());
  }
  using kvt::cli::CommandSpec;
  using kvt::cli::FindCommand;
  absl::SetProgramUsageMessage(kvt::cli::GlobalUsage());
  // Help is answered before absl parses the command line: absl's own --help lists only the
  // flags of this file. The command is the first argument that is not a flag; `kvt help CMD`
  // and `kvt CMD --help` (anywhere on the line) print the same.
  std::string name;  // the command named on the line, if any
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (IsHelpFlag(arg)) {
      help = true;
    } else if (name.empty() && !arg.empty() && arg[0] != '-') {
      if (arg == "help" && !help) {
        help = true;
      } else {
        name = arg;
      }
    }
  }
  if (help) {
    if (name.empty()) {
      std::printf("kvt: %s\n", kvt::cli::GlobalUsage().c_str());
      return 0;
    }
    const CommandSpec* command = FindCommand(name);
    if (command == nullptr) {
      std::fprintf(stderr, "kvt: unknown command '%s'\n\n%s\n", name.c_str(),
                   kvt::cli::GlobalUsage().c_str());
      return 1;
    }
    std::printf("%s", kvt::cli::CommandHelp(*command).c_str());
    return 0;
  }
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2) {
    std::printf("kvt: %s\n", kvt::cli::GlobalUsage().c_str());
    return 1;
  }
  name = positional[1];
  const CommandSpec* command = FindCommand(name);
  if (command == nullptr) {
    std::fprintf(stderr, "kvt: unknown command '%s'\n\n%s\n", name.c_str(),
                 kvt::cli::GlobalUsage().c_str());
    return 1;
  }
  std::vector<std::string> args(positional.begin() + 2, positional.end());
  return command->run(args);
}

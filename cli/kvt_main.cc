// kvt: the command-line tool of the kvt service. `kvt help` lists the commands.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"

namespace {

struct Command {
  int (*run)(const std::vector<std::string>& args);
  const char* summary;
  // `kvt <command> --help`; absl's own --help only lists the flags of this file.
  const char* (*help)() = nullptr;
};

const std::map<std::string, Command>& Commands() {
  static const auto* commands = new std::map<std::string, Command>{
      {"health", {kvt::cli::RunHealth, "check a kvtd's gRPC health (--server)"}},
      {"mappers", {kvt::cli::RunMappers, "list the mappers a kvtd serves, or `mappers ID`"}},
      {"synth", {kvt::cli::RunSynth,
                 "write a deterministic random mapper (--preset or shapes; --kind=mlp)"}},
      {"inspect", {kvt::cli::RunInspect, "summarise a mapper directory: `inspect DIR`"}},
      {"translate",
       {kvt::cli::RunTranslate, "translate a safetensors cache through a kvtd (--in, --out)"}},
      {"demo", {kvt::cli::RunDemo, "one real handoff through a kvtd, checked in float64"}},
      {"fit", {kvt::cli::RunFit, "fit a mapper from KV dumps of two models (docs/FIT.md)"}},
      {"import",
       {kvt::cli::RunImport, "convert a semantic-router kv_mapper into a kvt mapper (--help)",
        kvt::cli::ImportHelp}},
  };
  return *commands;
}

std::string Usage() {
  std::string usage =
      "client and tools of kvt, the cross-model KV cache translation service.\n\n"
      "usage: kvt <command> [--flags] [args]\n\ncommands:\n";
  for (const auto& [name, command] : Commands()) {
    absl::StrAppend(&usage, "  ", name, std::string(12 - name.size(), ' '), command.summary,
                    "\n");
  }
  absl::StrAppend(&usage, "\nkvt --helpfull lists every flag.");
  return usage;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(Usage());
  if (argc >= 3) {
    auto it = Commands().find(argv[1]);
    if (it != Commands().end() && it->second.help != nullptr) {
      for (int i = 2; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--help" || arg == "-help" || arg == "-h" || arg == "help") {
          std::printf("%s", it->second.help());
          return 0;
        }
      }
    }
  }
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2 || std::string(positional[1]) == "help") {
    std::printf("kvt: %s\n", Usage().c_str());
    return positional.size() < 2 ? 1 : 0;
  }
  const std::string name = positional[1];
  auto it = Commands().find(name);
  if (it == Commands().end()) {
    std::fprintf(stderr, "kvt: unknown command '%s'\n\n%s\n", name.c_str(), Usage().c_str());
    return 1;
  }
  std::vector<std::string> args(positional.begin() + 2, positional.end());
  return it->second.run(args);
}

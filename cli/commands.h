// The `kvt` subcommands; each returns the process exit code (0 ok, 1 usage, 2 failure).
#pragma once

#include <string>
#include <vector>

namespace kvt {
namespace cli {

int RunHealth(const std::vector<std::string>& args);
int RunServerInfo(const std::vector<std::string>& args);
int RunMappers(const std::vector<std::string>& args);
int RunSynth(const std::vector<std::string>& args);
int RunInspect(const std::vector<std::string>& args);
int RunRecordBenefit(const std::vector<std::string>& args);
int RunTranslate(const std::vector<std::string>& args);
int RunDemo(const std::vector<std::string>& args);
int RunFit(const std::vector<std::string>& args);
int RunImport(const std::vector<std::string>& args);

}  // namespace cli
}  // namespace kvt

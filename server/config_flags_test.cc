#include "server/config_flags.h"

#include <cstdint>
#include <set>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/config.h"

ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(int64_t, max_tokens);
ABSL_DECLARE_FLAG(int64_t, cpu_threads);
ABSL_DECLARE_FLAG(bool, allow_non_finite);
ABSL_DECLARE_FLAG(double, shutdown_deadline_seconds);
ABSL_DECLARE_FLAG(std::string, log_level);

namespace kvt {
namespace {

using ::testing::HasSubstr;

// The flags defined in config_flags.cc and the schema's flags are the same set, with the
// schema's help.
TEST(ConfigFlagsTest, EverySchemaFlagIsDefinedAndNoOther) {
  std::set<std::string> schema_flags;
  for (const KvtdConfigKey& key : KvtdConfigKeys()) {
    if (key.flag.empty()) continue;
    schema_flags.insert(key.flag);
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(key.flag);
    ASSERT_NE(flag, nullptr) << key.path << " names --" << key.flag
                             << ": add it to server/config_flags.cc";
    EXPECT_EQ(flag->Help(), key.flag_help) << key.flag;
  }
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->Filename().find("server/config_flags.cc") == std::string::npos) continue;
    EXPECT_TRUE(schema_flags.count(std::string(name)))
        << "--" << name << " is defined in server/config_flags.cc but no key names it";
  }
  EXPECT_FALSE(schema_flags.empty());
}

TEST(ConfigFlagsTest, FlagsNotGivenChangeNothing) {
  absl::FlagSaver saver;
  KvtdConfig config;
  config.limits.max_tokens = 77;  // as if read from a file
  ASSERT_TRUE(ApplyKvtdFlagOverrides(&config).ok());
  EXPECT_EQ(config.limits.max_tokens, 77);
  KvtdConfig expected;
  expected.limits.max_tokens = 77;
  EXPECT_EQ(KvtdConfigToJson(config), KvtdConfigToJson(expected));
  // The "not given" value given explicitly is still not given.
  absl::SetFlag(&FLAGS_cpu_threads, -1);
  ASSERT_TRUE(ApplyKvtdFlagOverrides(&config).ok());
  EXPECT_EQ(config.backend.cpu_threads, 0);
}

TEST(ConfigFlagsTest, GivenFlagsOverrideTheirKeys) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_backend, "cpu");
  absl::SetFlag(&FLAGS_max_tokens, 4096);
  absl::SetFlag(&FLAGS_cpu_threads, 0);
  absl::SetFlag(&FLAGS_allow_non_finite, true);
  absl::SetFlag(&FLAGS_shutdown_deadline_seconds, 2.5);
  absl::SetFlag(&FLAGS_log_level, "debug");
  KvtdConfig config;
  config.backend.cpu_threads = 3;
  ASSERT_TRUE(ApplyKvtdFlagOverrides(&config).ok());
  EXPECT_EQ(config.backend.type, "cpu");
  EXPECT_EQ(config.limits.max_tokens, 4096);
  EXPECT_EQ(config.backend.cpu_threads, 0);
  EXPECT_TRUE(config.limits.allow_non_finite);
  EXPECT_EQ(config.shutdown.deadline_seconds, 2.5);
  EXPECT_EQ(config.logging.level, LogLevel::kDebug);
}

TEST(ConfigFlagsTest, BadOverridesNameTheFlagAndTheKey) {
  {
    absl::FlagSaver saver;
    absl::SetFlag(&FLAGS_max_tokens, 0);
    KvtdConfig config;
    absl::Status status = ApplyKvtdFlagOverrides(&config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("after flag overrides"));
    EXPECT_THAT(std::string(status.message()), HasSubstr("limits.max_tokens"));
  }
  {
    absl::FlagSaver saver;
    absl::SetFlag(&FLAGS_log_level, "loud");
    KvtdConfig config;
    absl::Status status = ApplyKvtdFlagOverrides(&config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("--log_level=loud"));
    EXPECT_THAT(std::string(status.message()), HasSubstr("logging.level"));
  }
  {
    absl::FlagSaver saver;
    absl::SetFlag(&FLAGS_backend, "tpu");
    KvtdConfig config;
    absl::Status status = ApplyKvtdFlagOverrides(&config);
    EXPECT_THAT(std::string(status.message()), HasSubstr("backend.type"));
  }
}

}  // namespace
}  // namespace kvt

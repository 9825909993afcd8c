// The `kvt` command as a user runs it: synth and inspect a mapper directory, then translate a
// safetensors KV dump through a real kvtd (in process) and check the written result against the
// float64 reference.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "host_cache/cache_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/testing/reference.h"
#include "mapper_store/mapper.h"
#include "mapper_store/store.h"
#include "server/kvtd_server.h"
#include "tests/in_process_kvtd.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

struct CommandResult {
  int exit_code;
  std::string output;
};

CommandResult RunKvt(const std::string& arguments) {
  const std::string binary = absl::StrCat(std::getenv("TEST_SRCDIR"), "/kvt/cli/kvt");
  const std::string command = absl::StrCat(binary, " ", arguments, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  CommandResult result{-1, ""};
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t read;
  while ((read = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, read);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir ? dir : "/tmp";
}

TEST(KvtCliTest, SynthInspectAndTranslateThroughARealServer) {
  const std::string store = TempDir() + "/store";
  ASSERT_EQ(std::system(("rm -rf " + store + " && mkdir -p " + store).c_str()), 0);
  CommandResult synth = RunKvt(absl::StrCat(
      "synth --out=", store, "/pair --source_model=cli/a --target_model=cli/b --source_layers=3 "
      "--source_heads=2 --source_head_dim=16 --target_layers=2 --target_heads=4 "
      "--target_head_dim=8 --k=2 --weight_dtype=fp32 --seed=11"));
  ASSERT_EQ(synth.exit_code, 0) << synth.output;
  EXPECT_THAT(synth.output, HasSubstr("SYNTHETIC"));

  CommandResult inspect = RunKvt(absl::StrCat("inspect ", store, "/pair"));
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_THAT(inspect.output, HasSubstr("cli/a: 3 layers, 2 KV heads x 16"));
  EXPECT_THAT(inspect.output, HasSubstr("sigma_k"));

  CommandResult missing = RunKvt(absl::StrCat("inspect ", store, "/nope"));
  EXPECT_NE(missing.exit_code, 0);

  std::unique_ptr<InProcessKvtd> kvtd = StartKvtdForTest(store);
  ASSERT_NE(kvtd, nullptr);
  const std::string address = kvtd->address();

  CommandResult health = RunKvt("health --server=" + address);
  EXPECT_EQ(health.exit_code, 0) << health.output;
  EXPECT_THAT(health.output, HasSubstr("SERVING"));
  CommandResult info = RunKvt("server-info --server=" + address);
  EXPECT_EQ(info.exit_code, 0) << info.output;
  EXPECT_THAT(info.output, HasSubstr("kvtd "));
  EXPECT_THAT(info.output, HasSubstr("  paged_engine_order\n"));
  CommandResult mappers = RunKvt("mappers --server=" + address);
  EXPECT_EQ(mappers.exit_code, 0) << mappers.output;
  EXPECT_THAT(mappers.output, HasSubstr("cli/a -> cli/b"));
  // `mappers restore` reaches KvPrefixCache.RestoreMapper: this kvtd has no prefix cache, so
  // live verification is off and the error says so.
  CommandResult restore = RunKvt("mappers --server=" + address + " restore pair");
  EXPECT_EQ(restore.exit_code, 2) << restore.output;
  EXPECT_THAT(restore.output, HasSubstr("live verification is off on this server"));
  CommandResult restore_two = RunKvt("mappers --server=" + address + " restore a b");
  EXPECT_EQ(restore_two.exit_code, 2) << restore_two.output;
  EXPECT_THAT(restore_two.output, HasSubstr("expected exactly one MAPPER_ID"));

  // A source dump with unit-variance entries.
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(store + "/pair");
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  HostCache source;
  source.dtype = DType::kBF16;
  source.num_layers = 3;
  source.num_kv_heads = 2;
  source.head_dim = 16;
  source.num_tokens = 40;
  source.Allocate();
  std::mt19937_64 rng(testing::FreshSeed("kvt cli"));
  std::normal_distribution<double> normal;
  for (int layer = 0; layer < 3; ++layer) {
    for (int64_t i = 0; i < 2 * 40 * 16; ++i) {
      StoreFromDouble(DType::kBF16, source.k[layer].data(), i, normal(rng));
      StoreFromDouble(DType::kBF16, source.v[layer].data(), i, normal(rng));
    }
  }
  const std::string in = TempDir() + "/source.safetensors";
  const std::string out = TempDir() + "/target.safetensors";
  ASSERT_TRUE(WriteCacheFile(in, source).ok());
  CommandResult translate =
      RunKvt(absl::StrCat("translate --server=", address, " --in=", in, " --result=", out,
                       " --source_model=cli/a --target_model=cli/b --wire_layout=NHD "
                       "--position_offset=77 --output_dtype=fp32"));
  ASSERT_EQ(translate.exit_code, 0) << translate.output;
  EXPECT_THAT(translate.output, HasSubstr("translated 40 tokens cli/a -> cli/b"));

  absl::StatusOr<HostCache> target = ReadCacheFile(out);
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(target->dtype, DType::kFP32);
  EXPECT_EQ(target->num_layers, 2);
  EXPECT_EQ(target->num_kv_heads, 4);
  Positions positions;
  positions.offset = 77;
  for (int layer = 0; layer < 2; ++layer) {
    for (testing::Kind kind : {testing::Kind::kK, testing::Kind::kV}) {
      EXPECT_LE(testing::MaxRelError(
                    testing::ReadLayer(target->view(), layer, kind),
                    testing::ReferenceTranslate((*mapper)->view(), layer, kind, source.view(),
                                                positions)),
                1e-5);
    }
  }

  CommandResult wrong_pair = RunKvt(absl::StrCat("translate --server=", address, " --in=", in,
                                              " --result=", out,
                                              " --source_model=cli/b --target_model=cli/a"));
  EXPECT_NE(wrong_pair.exit_code, 0);
  EXPECT_THAT(wrong_pair.output, HasSubstr("NOT_FOUND"));
  EXPECT_THAT(wrong_pair.output, HasSubstr("cli/b -> cli/a"));
  kvtd->server().Shutdown();
}

TEST(KvtCliTest, SynthKindMlpWritesAnMlpMapperThatInspectDescribes) {
  const std::string store = TempDir() + "/mlp_store";
  ASSERT_EQ(std::system(("rm -rf " + store + " && mkdir -p " + store).c_str()), 0);
  CommandResult synth = RunKvt(absl::StrCat("synth --preset=demo-tiny --kind=mlp --mlp_hidden=24 "
                                            "--mlp_granularity=per_head --out=",
                                            store, "/mlp"));
  ASSERT_EQ(synth.exit_code, 0) << synth.output;
  EXPECT_THAT(synth.output, HasSubstr("kind          mlp (SYNTHETIC"));
  CommandResult inspect = RunKvt(absl::StrCat("inspect ", store, "/mlp"));
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_THAT(inspect.output, HasSubstr("mlp           hidden 24, per_head (2 chains"));
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(store + "/mlp");
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  EXPECT_EQ((*mapper)->view().kind, MapKind::kMlp);
  EXPECT_EQ((*mapper)->view().layers[0].mlp_k.hidden, 24);
  EXPECT_THAT(inspect.output, HasSubstr(absl::StrCat("(", (*mapper)->num_params(), ")")));

  CommandResult bad = RunKvt(absl::StrCat("synth --preset=demo-tiny --kind=mlp --mlp_hidden=0 --out=",
                                          store, "/bad"));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("--mlp_hidden=0 must be >= 1"));
  bad = RunKvt(absl::StrCat("synth --preset=demo-tiny --kind=mlp --mlp_granularity=per_token "
                            "--out=", store, "/bad"));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("--mlp_granularity='per_token' must be per_layer or per_head"));
  bad = RunKvt(absl::StrCat("synth --preset=demo-tiny --kind=lasso --out=", store, "/bad"));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("--kind='lasso' must be ridge or mlp"));
}

TEST(KvtCliTest, SynthRidgePerHeadWritesAHeadLocalMapperThatInspectDescribes) {
  const std::string store = TempDir() + "/per_head_store";
  ASSERT_EQ(std::system(("rm -rf " + store + " && mkdir -p " + store).c_str()), 0);
  CommandResult synth = RunKvt(absl::StrCat(
      "synth --preset=demo-tiny --ridge_granularity=per_head --out=", store, "/ph"));
  ASSERT_EQ(synth.exit_code, 0) << synth.output;
  EXPECT_THAT(synth.output, HasSubstr("ridge         per_head: target head h maps only"));
  CommandResult inspect = RunKvt(absl::StrCat("inspect ", store, "/ph"));
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_THAT(inspect.output, HasSubstr("W_K, W_V [2, len(sigma) x 32, 32], b_K, b_V [2, 32]"));
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(store + "/ph");
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  EXPECT_TRUE((*mapper)->view().head_local);

  CommandResult bad = RunKvt(absl::StrCat(
      "synth --preset=demo-tiny --ridge_granularity=per_token --out=", store, "/bad"));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output,
              HasSubstr("--ridge_granularity='per_token' must be per_layer or per_head"));
  bad = RunKvt(absl::StrCat("synth --preset=demo-tiny --kind=mlp --ridge_granularity=per_head "
                            "--out=", store, "/bad"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr("ridge.granularity per_head is only valid with kind: ridge"));
}

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

std::string ReadOrEmpty(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  return text.ok() ? *text : std::string();
}

// `kvt record-benefit` on a mapper `kvt synth` wrote: the mapper then loads with its checksums
// verified and carries the entries, `kvt inspect` shows them; a bad file or a missing mapper
// exits non-zero naming the problem and leaves the files byte-identical.
TEST(KvtCliTest, RecordBenefitRewritesTheManifestAndChecksumsOnly) {
  const std::string store = TempDir() + "/benefit_store";
  ASSERT_EQ(std::system(("rm -rf " + store + " && mkdir -p " + store).c_str()), 0);
  const std::string dir = store + "/pair";
  CommandResult synth = RunKvt(absl::StrCat("synth --out=", dir, " --preset=demo-tiny --seed=3"));
  ASSERT_EQ(synth.exit_code, 0) << synth.output;
  const std::string weights = ReadOrEmpty(dir + "/weights.safetensors");
  ASSERT_FALSE(weights.empty());
  auto write = [&](const std::string& name, const std::string& text) {
    const std::string path = store + "/" + name;
    EXPECT_TRUE(WriteStringToFile(path, text).ok());
    return path;
  };
  const std::string good = write(
      "good.json",
      R"({"benefit": [{"text": "python-docs-heldout", "windows": 64, "context_tokens": 384,
                       "continuation_tokens": 96, "recovered": 0.64, "lower95": 0.5,
                       "upper95": 0.86, "kl": 0.12}]})");
  CommandResult recorded =
      RunKvt(absl::StrCat("record-benefit --mapper=", dir, " --benefit=", good));
  ASSERT_EQ(recorded.exit_code, 0) << recorded.output;
  EXPECT_THAT(recorded.output, HasSubstr("quality.benefit now records 1 text\n"));
  EXPECT_THAT(recorded.output,
              HasSubstr("  python-docs-heldout: recovered 0.64 [0.5, 0.86], KL 0.12 nats/token"));

  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE((*loaded)->checksums_verified());
  ASSERT_EQ((*loaded)->manifest().quality.benefit.size(), 1u);
  EXPECT_EQ((*loaded)->manifest().quality.benefit[0].lower95, 0.5);
  EXPECT_TRUE(ReadOrEmpty(dir + "/weights.safetensors") == weights);
  CommandResult inspect = RunKvt("inspect " + dir);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_THAT(inspect.output, HasSubstr("checksums verified"));
  EXPECT_THAT(inspect.output, HasSubstr("  python-docs-heldout: recovered 0.64 [0.5, 0.86]"));

  const std::string manifest = ReadOrEmpty(dir + "/manifest.yaml");
  const std::string sums = ReadOrEmpty(dir + "/SHA256SUMS");
  const std::pair<std::string, std::string> bad[] = {
      {"{\"benefit\": [", "not valid JSON"},
      {R"({"benefit": [{"text": "a", "windows": 8, "context_tokens": 1, "continuation_tokens": 1,
                        "recovered": 0.5, "lower95": 0.6, "upper95": 0.7, "kl": 0}]})",
       "benefit[0].lower95 = 0.6 exceeds recovered 0.5"},
      {R"({"benefit": [{"text": "a", "windows": 8, "context_tokens": 1, "continuation_tokens": 1,
                        "recovered": 0.5, "lower95": 0.4, "upper95": 0.7, "kl": 0},
                       {"text": "a", "windows": 8, "context_tokens": 1, "continuation_tokens": 1,
                        "recovered": 0.5, "lower95": 0.4, "upper95": 0.7, "kl": 0}]})",
       "benefit[1].text 'a' is already benefit[0]"},
  };
  int n = 0;
  for (const auto& [json, message] : bad) {
    const std::string path = write(absl::StrCat("bad", n++, ".json"), json);
    CommandResult refused =
        RunKvt(absl::StrCat("record-benefit --mapper=", dir, " --benefit=", path));
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_THAT(refused.output, HasSubstr(message));
    EXPECT_THAT(refused.output, HasSubstr("the mapper is unchanged"));
    EXPECT_EQ(ReadOrEmpty(dir + "/manifest.yaml"), manifest);
    EXPECT_EQ(ReadOrEmpty(dir + "/SHA256SUMS"), sums);
    EXPECT_TRUE(ReadOrEmpty(dir + "/weights.safetensors") == weights);
  }
  CommandResult missing =
      RunKvt(absl::StrCat("record-benefit --mapper=", store, "/nope --benefit=", good));
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_THAT(missing.output, HasSubstr("not a mapper directory"));
  CommandResult usage = RunKvt(absl::StrCat("record-benefit --mapper=", dir));
  EXPECT_EQ(usage.exit_code, 1) << usage.output;
  EXPECT_THAT(usage.output, HasSubstr("usage: kvt record-benefit --mapper=DIR --benefit=FILE.json"));
}

// `kvt help`'s command lines: name -> summary.
std::map<std::string, std::string> GlobalCommands(const std::string& usage) {
  std::map<std::string, std::string> commands;
  std::istringstream lines(usage);
  std::string line;
  bool in_commands = false;
  while (std::getline(lines, line)) {
    if (line == "commands:") {
      in_commands = true;
    } else if (in_commands && line.empty()) {
      break;
    } else if (in_commands) {
      std::smatch match;
      if (std::regex_match(line, match, std::regex("  ([a-z][a-z-]*) +(.*)"))) {
        commands[match[1]] = match[2];
      } else {
        ADD_FAILURE() << "not a command line: " << line;
      }
    }
  }
  return commands;
}

// The flags `kvt CMD --help` lists with a default ("  --name=DEFAULT" lines).
std::set<std::string> HelpFlags(const std::string& help) {
  std::set<std::string> names;
  std::istringstream lines(help);
  std::string line;
  std::smatch match;
  while (std::getline(lines, line)) {
    if (std::regex_match(line, match, std::regex("  --([a-z0-9_]+)=.*"))) names.insert(match[1]);
  }
  return names;
}

TEST(KvtCliTest, EveryCommandHasItsOwnHelpAndTheGlobalUsageNamesOnlyRealFlags) {
  CommandResult global = RunKvt("help");
  ASSERT_EQ(global.exit_code, 0) << global.output;
  const std::map<std::string, std::string> commands = GlobalCommands(global.output);
  for (const char* expected :
       {"health", "server-info", "mappers", "synth", "inspect", "record-benefit", "translate",
        "demo", "fit", "import"}) {
    EXPECT_EQ(commands.count(expected), 1u) << expected << " missing from:\n" << global.output;
  }
  EXPECT_EQ(RunKvt("--help").output, global.output);
  for (const auto& [name, summary] : commands) {
    CommandResult help = RunKvt(name + " --help");
    ASSERT_EQ(help.exit_code, 0) << name << ": " << help.output;
    EXPECT_THAT(help.output, HasSubstr("usage: kvt " + name)) << help.output;
    EXPECT_THAT(help.output, ::testing::Not(HasSubstr("commands:"))) << help.output;
    EXPECT_THAT(help.output, ::testing::Not(HasSubstr("not a registered flag"))) << help.output;
    const size_t flags_at = help.output.find("\nflags (--flag=DEFAULT):\n");
    const std::set<std::string> listed = HelpFlags(help.output);
    if (flags_at == std::string::npos) {
      EXPECT_THAT(help.output, HasSubstr("no flags")) << help.output;
      EXPECT_TRUE(listed.empty()) << help.output;
    }
    // The usage text above the flag list names exactly the flags listed with defaults.
    EXPECT_EQ(FlagsNamed(help.output.substr(0, flags_at)), listed) << help.output;
    // The global usage's line for the command names only flags that command has.
    for (const std::string& flag : FlagsNamed(summary)) {
      EXPECT_EQ(listed.count(flag), 1u)
          << "`kvt help` names --" << flag << " for " << name << ", whose --help lacks it";
    }
    // The same text through the other spellings.
    EXPECT_EQ(RunKvt("help " + name).output, help.output);
    EXPECT_EQ(RunKvt(name + " -h").output, help.output);
    EXPECT_EQ(RunKvt("--server=127.0.0.1:1 " + name + " --help").output, help.output);
  }
  CommandResult fit = RunKvt("fit --help");
  EXPECT_THAT(fit.output, HasSubstr("\n  --stride=4\n"));
  EXPECT_THAT(fit.output, HasSubstr("\n  --top_k=8\n"));
  EXPECT_THAT(fit.output, HasSubstr("\n  --lambda=0.01\n"));
  EXPECT_EQ(RunKvt("fit merge --help").output, fit.output);
  CommandResult translate = RunKvt("translate --help");
  EXPECT_THAT(translate.output, HasSubstr("\n  --result=\"\"\n"));
  EXPECT_THAT(translate.output, HasSubstr("\n  --server=127.0.0.1:50051\n"));
  EXPECT_EQ(FlagsNamed(translate.output).count("out"), 0u) << translate.output;
  CommandResult unknown = RunKvt("frobnicate --help");
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.output, HasSubstr("unknown command 'frobnicate'"));
}

TEST(KvtCliTest, UnknownCommandAndMissingFlagsAreUsageErrors) {
  CommandResult unknown = RunKvt("frobnicate");
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.output, HasSubstr("unknown command 'frobnicate'"));
  CommandResult synth = RunKvt("synth");
  EXPECT_EQ(synth.exit_code, 1);
  EXPECT_THAT(synth.output, HasSubstr("--out"));
  CommandResult preset = RunKvt("synth --preset=gpt5 --out=/tmp/never");
  EXPECT_NE(preset.exit_code, 0);
  EXPECT_THAT(preset.output, HasSubstr("demo-tiny"));
  CommandResult translate = RunKvt("translate --in=x.safetensors");
  EXPECT_EQ(translate.exit_code, 1);
  EXPECT_THAT(translate.output, HasSubstr("--in and --result are required"));
  EXPECT_THAT(translate.output, HasSubstr("usage: kvt translate"));
  // Bad refinement settings are refused by name before any file is read.
  const std::string fit = "fit --source_config=/nonexistent --target_config=/nonexistent "
                          "--out=/tmp/never --refine=attention ";
  CommandResult queries_from = RunKvt(fit + "--refine_queries_from=sideways");
  EXPECT_EQ(queries_from.exit_code, 1);
  EXPECT_THAT(queries_from.output, HasSubstr("--refine_queries_from must be handoff or prefix"));
  CommandResult cache = RunKvt(fit + "--refine_cache_mb=-1");
  EXPECT_EQ(cache.exit_code, 1);
  EXPECT_THAT(cache.output, HasSubstr("--refine_cache_mb must be in [0, 2^40], got -1"));
  // The ridge's granularity likewise, and it is not the MLP's.
  const std::string plain = "fit --source_config=/nonexistent --target_config=/nonexistent "
                            "--out=/tmp/never ";
  CommandResult granularity = RunKvt(plain + "--granularity=per_token");
  EXPECT_EQ(granularity.exit_code, 1);
  EXPECT_THAT(granularity.output,
              HasSubstr("--granularity must be per_layer or per_head or both, got 'per_token'"));
  CommandResult mlp = RunKvt(plain + "--granularity=per_head --kind=mlp");
  EXPECT_EQ(mlp.exit_code, 1);
  EXPECT_THAT(mlp.output, HasSubstr("--kind mlp has --mlp_granularity"));
  CommandResult both = RunKvt(plain + "--granularity=both --kind=both");
  EXPECT_EQ(both.exit_code, 1);
  EXPECT_THAT(both.output, HasSubstr("--granularity both compares the ridge's granularities"));
}

}  // namespace
}  // namespace kvt

#include "cli/command_table.h"

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"

namespace kvt {
namespace cli {
namespace {

constexpr char kHealthUsage[] =
    "usage: kvt health [--server=HOST:PORT] [--timeout_ms=MS] [SERVICE]\n"
    "\n"
    "Asks a kvtd's gRPC health service about SERVICE (default: the server as a whole) and\n"
    "prints the answer; exits 0 only when it is SERVING.\n";

constexpr char kServerInfoUsage[] =
    "usage: kvt server-info [--server=HOST:PORT] [--timeout_ms=MS]\n"
    "\n"
    "Prints a kvtd's release and the protocol extensions it understands (ServerMetadata), one\n"
    "per line; a kvtd older than that RPC is named as such and has none.\n";

constexpr char kMappersUsage[] =
    "usage: kvt mappers [--server=HOST:PORT] [--timeout_ms=MS] [MAPPER_ID]\n"
    "       kvt mappers [--server=HOST:PORT] restore MAPPER_ID\n"
    "\n"
    "Lists the mappers a kvtd serves (id, models, kind, k, state, size, weight dtype), or\n"
    "prints one mapper's whole MapperInfo. `restore` puts a mapper that live verification took\n"
    "out of service back in service (admin role; docs/OPERATIONS.md).\n";

constexpr char kSynthUsage[] =
    "usage: kvt synth --out=DIR (--preset=NAME | custom shapes) [--k=N] [--window=1]\n"
    "                 [--weight_dtype=bf16|fp16|fp32] [--seed=1]\n"
    "                 [--kind=ridge [--ridge_granularity=per_layer|per_head]\n"
    "                  | --kind=mlp [--mlp_hidden=1024] [--mlp_granularity=per_layer|per_head]]\n"
    "custom shapes:   [--source_model=NAME] [--target_model=NAME] [--rope_theta=10000]\n"
    "                 [--source_layers=4] [--source_heads=2] [--source_head_dim=32]\n"
    "                 [--target_layers=6] [--target_heads=2] [--target_head_dim=32]\n"
    "\n"
    "Writes a deterministic random mapper directory (same seed, same bytes; marked synthetic)\n"
    "and prints its summary. --k defaults to the preset's (custom shapes: 2; 0 = all).\n";

constexpr char kInspectUsage[] =
    "usage: kvt inspect DIR\n"
    "\n"
    "Summarises a mapper directory on local disk (models, shapes, kind, weights, fit quality);\n"
    "no server involved.\n";

constexpr char kRecordBenefitUsage[] =
    "usage: kvt record-benefit --mapper=DIR --benefit=FILE.json\n"
    "\n"
    "Records the context benefit `python -m kvt.qualify` measured (FILE.json: {\"benefit\":\n"
    "[{\"text\", \"windows\", \"context_tokens\", \"continuation_tokens\", \"recovered\",\n"
    "\"lower95\", \"upper95\", \"kl\"}, ...]}) in the mapper's manifest (quality.benefit), which\n"
    "kvtd's prefix-cache gate reads (prefix_cache.min_benefit_recovered). The mapper is loaded\n"
    "with its checksums verified; an entry replaces the one of the same text, others are kept.\n"
    "Only manifest.yaml and SHA256SUMS are rewritten (the weights are kept, not copied); on any\n"
    "error the mapper is unchanged.\n";

constexpr char kTranslateUsage[] =
    "usage: kvt translate [--server=HOST:PORT] --in=SRC.safetensors --result=OUT.safetensors\n"
    "                     (--source_model=A --target_model=B | --mapper_id=ID)\n"
    "                     [--wire_layout=HND|NHD] [--output_dtype=bf16|fp16|fp32]\n"
    "                     [--position_offset=N] [--timeout_ms=MS]\n"
    "\n"
    "Sends a safetensors KV dump (layers.{j}.k / layers.{j}.v) through a kvtd and writes the\n"
    "translated target cache to --result; prints the server's stage timings.\n";

constexpr char kDemoUsage[] =
    "usage: kvt demo --mapper_store=DIR [--server=HOST:PORT] [--mapper_id=ID] [--tokens=512]\n"
    "                [--dtype=bf16] [--wire_layout=HND|NHD] [--output_dtype=bf16|fp16|fp32]\n"
    "                [--position_offset=N] [--seed=1] [--timeout_ms=MS]\n"
    "                [--source_model=A --target_model=B]\n"
    "\n"
    "One real handoff: a random source cache through the kvtd (with --mapper_id, or the first\n"
    "servable mapper), the result checked against a float64 reference computed here from the\n"
    "same mapper read from DIR (the server's store). Exits 0 on PASS. The model names, if given,\n"
    "go into the request header as in `kvt translate`.\n";

constexpr char kFitUsage[] =
    "usage: kvt fit --source_config=CFG --target_config=CFG\n"
    "               (--source_dumps=DIR --target_dumps=DIR | --pairs=LIST) --out=MAPPER_DIR\n"
    "               [--top_k=8|all] [--stride=4] [--window=1] [--lambda=0.01]\n"
    "               [--lambda_scale=covariance|sum] [--heldout_fraction=0.1] [--heldout_split=hash|tail]\n"
    "               [--seed=1] [--weight_dtype=bf16] [--corpus=TEXT]\n"
    "               [--source_model=NAME] [--target_model=NAME] [--threads=0] [--chunk_mb=256]\n"
    "               [--overwrite] [--granularity=per_layer|per_head|both\n"
    "                [--per_head_objective=auto|mse|attention_weighted]\n"
    "                [--per_head_probe=full|head_local]]\n"
    "               [--partial [--shard=i/n] [--plan=PLAN] --out=SHARD_FILE]\n"
    "               [--kind=ridge|mlp|both [--mlp_hidden=1024] [--mlp_epochs=20]\n"
    "                [--mlp_batch=4096] [--mlp_lr=1e-3] [--mlp_granularity=per_layer|per_head]\n"
    "                [--mlp_max_observations=200000] [--mlp_keep_best_epoch]]\n"
    "               [--refine=none|attention [--refine_steps=100] [--refine_batch=2]\n"
    "                [--refine_queries=16] [--refine_lr=0.003] [--refine_mlp_steps=300]\n"
    "                [--refine_mlp_batch=4] [--refine_mlp_queries=64] [--refine_mlp_lr=0.001]\n"
    "                [--refine_queries_from=handoff|prefix] [--refine_cache_mb=1024]\n"
    "                [--unrefined_mlp_out=DIR]]\n"
    "       kvt fit merge --out=PLAN_FILE|MAPPER_DIR [--lambda=0.01] [--lambda_scale=...]\n"
    "                     [--weight_dtype=...] [--threads=0] [--overwrite]\n"
    "                     [--granularity=per_layer|per_head [--per_head_probe=full|head_local]]\n"
    "                     SHARD_FILE...\n"
    "\n"
    "Fits a mapper from KV dumps of two models on the same text (docs/FIT.md); `fit merge`\n"
    "merges --partial shards into a plan (probe shards) or a mapper (final shards).\n";

constexpr char kImportUsage[] =
    "usage: kvt import --format=semantic-router --in=DIR --out=MAPPER_DIR\n"
    "                  [--source_config=CONFIG] [--target_config=CONFIG]\n"
    "                  [--source_num_layers=N --source_rope_theta=THETA]\n"
    "                  [--target_num_layers=N --target_rope_theta=THETA]\n"
    "                  [--source_model=NAME] [--target_model=NAME]\n"
    "                  [--weight_dtype=fp32|bf16|fp16] [--overwrite]\n"
    "\n"
    "Converts a vllm-project/semantic-router kv_mapper directory (manifest.json,\n"
    "weights.safetensors, SHA256SUMS; tensors target.{L}.{k,v}.{W,b} applied as x W + b) into a\n"
    "kvt mapper directory (docs/MAPPER_FORMAT.md). SHA256SUMS is verified, and every tensor's\n"
    "name, dtype, shape and values are checked before anything is written.\n"
    "\n"
    "The artifact stores neither layer counts nor RoPE (its keys are pre-RoPE), so kvt takes them\n"
    "from each model's Hugging Face config.json (--source_config / --target_config: the file or\n"
    "the model directory). Without a config a model gets the manifest's KV shape and plain neox\n"
    "RoPE over the whole head with --source_rope_theta / --target_rope_theta (then required);\n"
    "the source also needs --source_num_layers, and the target's layer count defaults to the\n"
    "manifest's. Partial rotary and RoPE scaling need the config.json.\n"
    "Model names default to the manifest's compatibility.source_model / target_model.\n"
    "compatibility.variant full_head is copied as it is; per_head (target head h reads source\n"
    "head h only; W dense with zeros off the head blocks, or [n_kv, k*head_dim, head_dim]) is\n"
    "expanded to the equivalent dense matrix. Weights are written as fp32 (exact) unless\n"
    "--weight_dtype says otherwise.\n";

}  // namespace

const std::vector<CommandSpec>& Commands() {
  static const auto* commands = new std::vector<CommandSpec>{
      {"health", RunHealth, "check a kvtd's gRPC health (--server)", kHealthUsage,
       {"server", "timeout_ms"}},
      {"server-info", RunServerInfo, "a kvtd's release and protocol extensions (--server)",
       kServerInfoUsage, {"server", "timeout_ms"}},
      {"mappers", RunMappers, "list the mappers a kvtd serves, or `mappers ID` (--server)",
       kMappersUsage, {"server", "timeout_ms"}},
      {"synth", RunSynth,
       "write a deterministic random mapper (--out; --preset or shapes; --kind=mlp)", kSynthUsage,
       {"out", "preset", "k", "window", "weight_dtype", "seed", "kind", "ridge_granularity",
        "mlp_hidden", "mlp_granularity",
        "source_model", "target_model", "rope_theta", "source_layers", "source_heads",
        "source_head_dim", "target_layers", "target_heads", "target_head_dim"}},
      {"inspect", RunInspect, "summarise a mapper directory: `inspect DIR`", kInspectUsage, {}},
      {"record-benefit", RunRecordBenefit,
       "record a measured context benefit in a mapper's manifest (--mapper, --benefit)",
       kRecordBenefitUsage, {"mapper", "benefit"}},
      {"translate", RunTranslate,
       "translate a safetensors cache through a kvtd (--in, --result)", kTranslateUsage,
       {"server", "timeout_ms", "in", "result", "source_model", "target_model", "mapper_id",
        "wire_layout", "output_dtype", "position_offset"}},
      {"demo", RunDemo, "one real handoff through a kvtd, checked in float64 (--mapper_store)",
       kDemoUsage,
       {"server", "timeout_ms", "mapper_store", "mapper_id", "source_model", "target_model",
        "tokens", "dtype", "wire_layout", "output_dtype", "position_offset", "seed"}},
      {"fit", RunFit, "fit a mapper from KV dumps of two models (docs/FIT.md)", kFitUsage,
       {"source_config", "target_config", "source_dumps", "target_dumps", "pairs", "out",
        "source_model", "target_model", "top_k", "stride", "window", "lambda", "lambda_scale",
        "heldout_fraction", "heldout_split", "seed", "weight_dtype", "corpus", "threads", "chunk_mb", "overwrite", "granularity", "per_head_objective", "per_head_probe",
        "partial", "shard", "plan", "kind", "mlp_hidden", "mlp_epochs", "mlp_batch", "mlp_lr",
        "mlp_granularity", "mlp_max_observations", "mlp_keep_best_epoch", "refine", "refine_steps", "refine_batch",
        "refine_queries", "refine_lr", "refine_mlp_steps", "refine_mlp_batch",
        "refine_mlp_queries", "refine_mlp_lr", "refine_queries_from", "refine_cache_mb",
        "unrefined_mlp_out"}},
      {"import", RunImport,
       "convert a semantic-router kv_mapper into a kvt mapper (--format, --in, --out)",
       kImportUsage,
       {"format", "in", "out", "source_config", "target_config", "source_num_layers",
        "source_rope_theta", "target_num_layers", "target_rope_theta", "source_model",
        "target_model", "weight_dtype", "overwrite"}},
  };
  return *commands;
}

const CommandSpec* FindCommand(absl::string_view name) {
  for (const CommandSpec& command : Commands()) {
    if (name == command.name) return &command;
  }
  return nullptr;
}

std::string GlobalUsage() {
  std::string usage =
      "client and tools of kvt, the cross-model KV cache translation service.\n\n"
      "usage: kvt <command> [--flags] [args]\n\ncommands:\n";
  for (const CommandSpec& command : Commands()) {
    const std::string name = command.name;
    const size_t pad = name.size() < 16 ? 16 - name.size() : 1;  // record-benefit + 2
    absl::StrAppend(&usage, "  ", name, std::string(pad, ' '), command.summary, "\n");
  }
  absl::StrAppend(&usage,
                  "\nkvt <command> --help (or kvt help <command>) prints a command's usage and "
                  "flags;\nkvt --helpfull lists every flag.");
  return usage;
}

std::string CommandUsage(absl::string_view name) {
  const CommandSpec* command = FindCommand(name);
  return command == nullptr ? GlobalUsage() : command->usage;
}

std::string CommandHelp(const CommandSpec& command) {
  std::string help = command.usage;
  if (command.flags.empty()) {
    absl::StrAppend(&help, "\nno flags.\n");
    return help;
  }
  absl::StrAppend(&help, "\nflags (--flag=DEFAULT):\n");
  for (const char* name : command.flags) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) {  // a mistake in the table; cli/command_table_test catches it
      absl::StrAppend(&help, "  --", name, "  (not a registered flag)\n");
      continue;
    }
    std::string value = flag->DefaultValue();
    if (value.empty()) value = "\"\"";
    absl::StrAppend(&help, "  --", name, "=", value, "\n      ", flag->Help(), "\n");
  }
  return help;
}

}  // namespace cli
}  // namespace kvt

// `kvt translate` (a safetensors KV dump through a kvtd) and `kvt demo` (one real handoff,
// checked against the float64 reference).
#include <cmath>
#include <cstdio>
#include <random>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "cli/command_table.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "host_cache/cache_file.h"
#include "client/client.h"
#include "kernels/dtype.h"
#include "kernels/reference.h"
#include "mapper_store/mapper.h"
#include "transport/proto_convert.h"

ABSL_DECLARE_FLAG(std::string, source_model);
ABSL_DECLARE_FLAG(std::string, target_model);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_FLAG(std::string, in, "",
          "kvt translate: source KV dump (safetensors, layers.{j}.k/.v); kvt import: the input.");
ABSL_FLAG(std::string, result, "", "kvt translate: where to write the target KV dump.");
ABSL_FLAG(std::string, mapper_id, "", "translate / demo: the mapper to use (default: by pair).");
ABSL_FLAG(std::string, wire_layout, "HND", "translate / demo: layout on the wire, HND | NHD.");
ABSL_FLAG(std::string, output_dtype, "", "translate / demo: dtype of the result (default: input's).");
ABSL_FLAG(uint64_t, position_offset, 0, "translate / demo: absolute position of token 0.");
ABSL_FLAG(std::string, mapper_store, "",
          "kvt demo: local path of the server's mapper store, to compute the reference.");
ABSL_FLAG(int64_t, tokens, 512, "kvt demo: tokens in the handoff.");
ABSL_FLAG(std::string, dtype, "bf16", "kvt demo: dtype of the source cache.");

namespace kvt {
namespace cli {
namespace {

absl::Status FillCommonHeader(v1::TranslateHeader* header) {
  header->set_source_model(absl::GetFlag(FLAGS_source_model));
  header->set_target_model(absl::GetFlag(FLAGS_target_model));
  header->set_mapper_id(absl::GetFlag(FLAGS_mapper_id));
  header->set_position_offset(absl::GetFlag(FLAGS_position_offset));
  if (!absl::GetFlag(FLAGS_output_dtype).empty()) {
    absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_output_dtype));
    if (!dtype.ok()) return dtype.status();
    header->set_output_dtype(DTypeToProto(*dtype));
  }
  return absl::OkStatus();
}

void PrintTimings(const TranslateResult& result) {
  const v1::StageTimings& t = result.trailer.timings();
  std::printf("  %-12s %10.2f ms\n  %-12s %10.2f ms\n  %-12s %10.2f ms\n  %-12s %10.2f ms\n"
              "  %-12s %10.2f ms\n",
              "queue", t.queue_ms(), "stage_in", t.stage_in_ms(), "compute", t.compute_ms(),
              "stage_out", t.stage_out_ms(), "total", t.total_ms());
}

int Fail(const char* command, const absl::Status& status) {
  std::fprintf(stderr, "kvt %s: %s\n", command, status.ToString().c_str());
  return 2;
}

}  // namespace

int RunTranslate(const std::vector<std::string>& args) {
  if (absl::GetFlag(FLAGS_in).empty() || absl::GetFlag(FLAGS_result).empty()) {
    std::fprintf(stderr, "kvt translate: --in and --result are required\n%s",
                 CommandUsage("translate").c_str());
    return 1;
  }
  absl::StatusOr<HostCache> source = ReadCacheFile(absl::GetFlag(FLAGS_in));
  if (!source.ok()) return Fail("translate", source.status());
  absl::StatusOr<Layout> layout = ParseLayout(absl::GetFlag(FLAGS_wire_layout));
  if (!layout.ok()) return Fail("translate", layout.status());
  v1::TranslateHeader header;
  if (absl::Status s = FillCommonHeader(&header); !s.ok()) return Fail("translate", s);
  absl::StatusOr<TranslateResult> result =
      ConnectFromFlags()->Translate(header, ToLayout(*source, *layout));
  if (!result.ok()) return Fail("translate", result.status());
  if (absl::Status s = WriteCacheFile(absl::GetFlag(FLAGS_result), result->target); !s.ok()) {
    return Fail("translate", s);
  }
  std::printf("translated %lld tokens %s -> %s with %s on %s; wrote %s\n",
              static_cast<long long>(result->target.num_tokens),
              result->header.source_model().c_str(), result->header.target_model().c_str(),
              result->header.mapper_id().c_str(), result->header.device().c_str(),
              absl::GetFlag(FLAGS_result).c_str());
  PrintTimings(*result);
  return 0;
}

int RunDemo(const std::vector<std::string>& args) {
  std::unique_ptr<Client> client = ConnectFromFlags();
  std::string mapper_id = absl::GetFlag(FLAGS_mapper_id);
  if (mapper_id.empty()) {
    absl::StatusOr<v1::ListMappersResponse> list = client->ListMappers();
    if (!list.ok()) return Fail("demo", list.status());
    for (const v1::MapperInfo& info : list->mappers()) {
      if (info.state() == v1::MAPPER_STATE_HOST_RESIDENT ||
          info.state() == v1::MAPPER_STATE_DEVICE_RESIDENT) {
        mapper_id = info.mapper_id();
        break;
      }
    }
    if (mapper_id.empty()) {
      return Fail("demo", absl::NotFoundError("the server has no servable mapper"));
    }
  }
  if (absl::GetFlag(FLAGS_mapper_store).empty()) {
    std::fprintf(stderr, "kvt demo: --mapper_store=DIR (the server's store) is required\n");
    return 1;
  }
  // The same mapper read locally: the float64 reference is computed from it here.
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper =
      LoadMapperDir(absl::StrCat(absl::GetFlag(FLAGS_mapper_store), "/", mapper_id));
  if (!mapper.ok()) return Fail("demo", mapper.status());
  const MapperView& view = (*mapper)->view();

  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail("demo", dtype.status());
  absl::StatusOr<Layout> layout = ParseLayout(absl::GetFlag(FLAGS_wire_layout));
  if (!layout.ok()) return Fail("demo", layout.status());
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  if (tokens <= 0) return Fail("demo", absl::InvalidArgumentError("--tokens must be > 0"));

  // A source cache of unit-variance entries: the scale of real keys and values.
  HostCache source = HostCache::Zeros(*dtype, *layout, view.source.num_layers,
                                      view.source.num_kv_heads, view.source.head_dim, tokens);
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t elements = source.layer_bytes() / static_cast<int64_t>(DTypeSize(*dtype));
  for (int layer = 0; layer < source.num_layers; ++layer) {
    for (int64_t i = 0; i < elements; ++i) {
      StoreFromDouble(*dtype, source.k[layer].data(), i, normal(rng));
      StoreFromDouble(*dtype, source.v[layer].data(), i, normal(rng));
    }
  }

  v1::TranslateHeader header;
  if (absl::Status s = FillCommonHeader(&header); !s.ok()) return Fail("demo", s);
  header.set_mapper_id(mapper_id);
  header.set_request_id("kvt-demo");
  absl::StatusOr<TranslateResult> result = client->Translate(header, source);
  if (!result.ok()) return Fail("demo", result.status());

  // Float64 reference over every target layer, K and V.
  const CacheView source_view = source.view();
  const HostCache& target = result->target;
  const CacheView target_view = target.view();
  Positions positions;
  positions.offset = absl::GetFlag(FLAGS_position_offset);
  double max_error = 0;
  for (int layer = 0; layer < view.target.num_layers; ++layer) {
    for (reference::Kind kind : {reference::Kind::kK, reference::Kind::kV}) {
      const std::vector<double> expected =
          reference::ReferenceTranslate(view, layer, kind, source_view, positions);
      const std::vector<double> actual = reference::ReadLayer(target_view, layer, kind);
      max_error = std::max(max_error, reference::MaxRelError(actual, expected));
    }
  }
  const double tolerance = target.dtype == DType::kFP32 ? 1e-5 : 1e-2;
  const bool pass = max_error <= tolerance;

  std::printf("\nkvt demo: handoff %s -> %s through %s (mapper %s, %s backend on %s)\n",
              result->header.source_model().c_str(), result->header.target_model().c_str(),
              absl::GetFlag(FLAGS_server).c_str(), mapper_id.c_str(),
              result->header.backend().c_str(), result->header.device().c_str());
  std::printf("  tokens       %lld (positions %llu..%llu)\n", static_cast<long long>(tokens),
              static_cast<unsigned long long>(positions.offset),
              static_cast<unsigned long long>(positions.offset + tokens - 1));
  std::printf("  source       %d layers x %d heads x %d dims, %s %s, %.2f MiB\n",
              source.num_layers, source.num_kv_heads, source.head_dim, DTypeName(source.dtype),
              LayoutName(source.layout), result->trailer.input_bytes() / 1048576.0);
  std::printf("  target       %d layers x %d heads x %d dims, %s %s, %.2f MiB\n",
              target.num_layers, target.num_kv_heads, target.head_dim, DTypeName(target.dtype),
              LayoutName(target.layout), result->trailer.output_bytes() / 1048576.0);
  PrintTimings(*result);
  std::printf("  max error vs float64 reference: %.3g (max|diff| / max|ref|; tolerance %.0e "
              "for %s) %s\n",
              max_error, tolerance, DTypeName(target.dtype), pass ? "PASS" : "FAIL");
  return pass ? 0 : 2;
}

}  // namespace cli
}  // namespace kvt

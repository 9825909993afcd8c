#include "quality/stats_testing.h"

#include <cstdint>
#include <vector>

#include "kernels/dtype.h"
#include "mapper_store/mapper.h"
#include "quality/input_shift.h"

namespace kvt {
namespace testing {

absl::Status WriteSynthMapperWithStats(const std::string& dir, const SynthOptions& options,
                                       const StatsValue& value, DType stats_dtype) {
  absl::StatusOr<Manifest> manifest = SynthManifest(options);
  if (!manifest.ok()) return manifest.status();
  std::vector<TensorSpec> specs = MapperTensorSpecs(*manifest);
  std::vector<std::vector<uint8_t>> bytes(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    bytes[i].resize(specs[i].num_bytes());
    absl::Status filled = FillSynthTensor(options, *manifest, i, absl::MakeSpan(bytes[i]));
    if (!filled.ok()) return filled;
  }
  const int width = options.source.num_kv_heads * options.source.head_dim;
  for (int layer = 0; layer < options.source.num_layers; ++layer) {
    for (char kv : {'k', 'v'}) {
      for (bool variance : {false, true}) {
        specs.push_back({SourceStatsTensorName(layer, kv, variance), stats_dtype, {width}});
        std::vector<uint8_t> data(specs.back().num_bytes());
        for (int i = 0; i < width; ++i) {
          StoreFromDouble(stats_dtype, data.data(), i, value(layer, kv == 'k', i, variance));
        }
        bytes.push_back(std::move(data));
      }
    }
  }
  std::vector<TensorRef> tensors;
  for (size_t i = 0; i < specs.size(); ++i) tensors.push_back({specs[i], absl::MakeSpan(bytes[i])});
  return WriteMapperDir(dir, *manifest, tensors);
}

}  // namespace testing
}  // namespace kvt

#include "quality/input_shift.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace kvt {
namespace {

// Variance floor relative to the tensor's mean variance: a feature that never moved during
// calibration must not turn a rounding difference into an enormous score.
constexpr double kRelativeVarianceFloor = 1e-6;

}  // namespace

std::string SourceStatsTensorName(int source_layer, char kv, bool variance) {
  return absl::StrCat(kStatsTensorPrefix, "source.", source_layer, ".", std::string(1, kv), ".",
                      variance ? "var" : "mean");
}

absl::StatusOr<std::optional<InputShiftStats>> InputShiftStats::FromMapper(
    const LoadedMapper& mapper) {
  const MapperView& view = mapper.view();
  const int64_t width = static_cast<int64_t>(view.source.num_kv_heads) * view.source.head_dim;
  std::set<int> k_layers, v_layers;
  for (const LayerMapView& layer : view.layers) {
    k_layers.insert(layer.sigma_k.begin(), layer.sigma_k.end());
    v_layers.insert(layer.sigma_v.begin(), layer.sigma_v.end());
  }
  absl::StatusOr<Rope> rope = Rope::Create(view.source.rope, view.source.head_dim);
  if (!rope.ok()) return rope.status();
  InputShiftStats stats(*rope, view.source.num_kv_heads, view.source.head_dim);

  // Reads one stats vector; false if the tensor is absent.
  auto read = [&](const std::string& name, std::vector<float>* out) -> absl::StatusOr<bool> {
    const TensorInfo* tensor = mapper.weights().Find(name);
    if (tensor == nullptr) return false;
    if (tensor->spec.dtype != DType::kFP32 || tensor->spec.num_elements() != width) {
      return absl::InvalidArgumentError(absl::StrCat(
          mapper.id(), ": tensor '", name, "' must be F32 with ", width,
          " elements (n_s * d_s), has ", SafetensorsDTypeName(tensor->spec.dtype), " ",
          FormatShape(tensor->spec.shape)));
    }
    out->resize(width);
    // Copied, not aliased: a tensor's offset in the file need not be 4-byte aligned.
    std::memcpy(out->data(), mapper.weights().data(*tensor).data(), width * sizeof(float));
    return true;
  };
  for (int pass = 0; pass < 2; ++pass) {
    const bool keys = pass == 0;
    for (int layer : keys ? k_layers : v_layers) {
      Feature feature{layer, keys, {}, {}};
      std::vector<float> var;
      for (bool variance : {false, true}) {
        absl::StatusOr<bool> found = read(SourceStatsTensorName(layer, keys ? 'k' : 'v', variance),
                                          variance ? &var : &feature.mean);
        if (!found.ok()) return found.status();
        if (!*found) return std::optional<InputShiftStats>();
      }
      double mean_var = 0;
      for (float v : var) mean_var += std::max(0.0f, v) / static_cast<double>(width);
      const double floor = std::max(kRelativeVarianceFloor * mean_var, 1e-30);
      feature.inv_var.resize(width);
      for (int64_t i = 0; i < width; ++i) {
        feature.inv_var[i] = static_cast<float>(1.0 / std::max<double>(var[i], floor));
      }
      stats.features_.push_back(std::move(feature));
    }
  }
  return std::optional<InputShiftStats>(std::move(stats));
}

double InputShiftStats::Score(const CacheView& source, const Positions& positions) const {
  const int64_t T = source.num_tokens;
  const int64_t stride = (T + kInputShiftMaxTokens - 1) / kInputShiftMaxTokens;
  const size_t element = DTypeSize(source.dtype);
  const int half = rope_.rotary_dim() / 2;
  std::vector<float> cos(half), sin(half), x(head_dim_);
  double sum = 0;
  int64_t terms = 0;
  for (int64_t t = 0; t < T; t += stride) {
    rope_.CosSin(positions.at(t), cos.data(), sin.data());
    for (const Feature& feature : features_) {
      const void* layer = (feature.keys ? source.k : source.v)[feature.layer];
      for (int h = 0; h < heads_; ++h) {
        const int64_t offset = CacheOffset(source.layout, heads_, T, head_dim_, h, t, 0);
        ToFloat(source.dtype, static_cast<const char*>(layer) + offset * element, x.data(),
                head_dim_);
        if (feature.keys) rope_.StripHead(cos.data(), sin.data(), x.data());
        const float* mean = feature.mean.data() + h * head_dim_;
        const float* inv_var = feature.inv_var.data() + h * head_dim_;
        double head_sum = 0;
        for (int i = 0; i < head_dim_; ++i) {
          const double dev = static_cast<double>(x[i]) - mean[i];
          head_sum += dev * dev * inv_var[i];
        }
        sum += head_sum;
        terms += head_dim_;
      }
    }
  }
  return terms > 0 ? sum / static_cast<double>(terms) : 0.0;
}

}  // namespace kvt

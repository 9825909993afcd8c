#include "mapper_store/synth.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/dtype.h"

namespace kvt {
namespace {

// SplitMix64's finaliser: a strong 64-bit mix. The generator is counter-based (value = mix of
// seed, stream and index), so any tensor or element can be produced independently and the
// result never depends on generation order or threading.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t StreamKey(uint64_t seed, uint64_t stream) { return Mix(seed ^ Mix(stream)); }

uint64_t Bits(uint64_t key, uint64_t counter) { return Mix(key ^ Mix(counter + 0x5851F42D4C957F2Dull)); }

// Uniform in (0, 1): never 0, so log() below is finite.
double Uniform(uint64_t key, uint64_t counter) {
  return (static_cast<double>(Bits(key, counter) >> 11) + 0.5) * 0x1.0p-53;
}

// Streams: one per tensor (its index in MapperTensorSpecs) and one per sigma list.
constexpr uint64_t kSigmaStreamBase = uint64_t{1} << 40;

// k distinct source layers in a seeded random order (partial Fisher-Yates).
std::vector<int> DrawSigma(uint64_t seed, uint64_t stream, int num_source_layers, int k) {
  std::vector<int> pool(num_source_layers);
  std::iota(pool.begin(), pool.end(), 0);
  const uint64_t key = StreamKey(seed, stream);
  for (int i = 0; i < k; ++i) {
    const uint64_t remaining = static_cast<uint64_t>(num_source_layers - i);
    const int j = i + static_cast<int>(Bits(key, i) % remaining);
    std::swap(pool[i], pool[j]);
  }
  pool.resize(k);
  return pool;
}

ModelSpec Llama31(const char* name, int layers) {
  // Llama 3.1 config.json: rope_theta 500000, rope_scaling {rope_type: llama3, factor: 8,
  // low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192}.
  ModelSpec m = NeoxModelSpec(name, layers, 8, 128, 500000.0);
  m.rope.scaling.type = RopeScalingType::kLlama3;
  m.rope.scaling.factor = 8;
  m.rope.scaling.low_freq_factor = 1;
  m.rope.scaling.high_freq_factor = 4;
  m.rope.scaling.original_max_position_embeddings = 8192;
  return m;
}

ModelSpec Ministral3(const char* name, int layers) {
  // ASSUMPTION (from the published Ministral 3 (2512) configs as best known; check against the
  // checkpoint's config.json before relying on it): 8 KV heads x head_dim 128, rope_theta 1e6,
  // yarn scaling with factor 16, original_max_position_embeddings 16384, beta_fast 32,
  // beta_slow 1, mscale = mscale_all_dim = 1 -> attention factor exactly 1 (Hugging Face
  // computes get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) in that case).
  ModelSpec m = NeoxModelSpec(name, layers, 8, 128, 1e6);
  m.rope.scaling.type = RopeScalingType::kYarn;
  m.rope.scaling.factor = 16;
  m.rope.scaling.original_max_position_embeddings = 16384;
  m.rope.scaling.beta_fast = 32;
  m.rope.scaling.beta_slow = 1;
  m.rope.scaling.has_attention_factor = true;
  m.rope.scaling.attention_factor = 1.0;
  return m;
}

const std::map<std::string, ModelSpec>& KnownModels() {
  static const std::map<std::string, ModelSpec>* const models = [] {
    auto* m = new std::map<std::string, ModelSpec>;
    // Qwen3 config.json: num_key_value_heads 8, head_dim 128, rope_theta 1e6, no rope_scaling.
    for (const ModelSpec& spec : {NeoxModelSpec("Qwen/Qwen3-8B", 36, 8, 128, 1e6),
                                  NeoxModelSpec("Qwen/Qwen3-14B", 40, 8, 128, 1e6),
                                  NeoxModelSpec("Qwen/Qwen3-32B", 64, 8, 128, 1e6),
                                  Llama31("meta-llama/Llama-3.1-8B", 32),
                                  Llama31("meta-llama/Llama-3.1-70B", 80),
                                  // ASSUMPTION: 26 layers (3B) and 34 layers (8B).
                                  Ministral3("mistralai/Ministral-3-3B-Instruct-2512", 26),
                                  Ministral3("mistralai/Ministral-3-8B-Instruct-2512", 34)}) {
      (*m)[spec.name] = spec;
    }
    return m;
  }();
  return *models;
}

struct Preset {
  const char* source;
  const char* target;
  int k;  // 0 = all
};

const std::map<std::string, Preset>& Presets() {
  // The pairs and k values the paper reports retention for (SPEC section 6).
  static const std::map<std::string, Preset>* const presets = new std::map<std::string, Preset>{
      {"qwen3-14b-to-32b", {"Qwen/Qwen3-14B", "Qwen/Qwen3-32B", 8}},
      {"qwen3-8b-to-32b", {"Qwen/Qwen3-8B", "Qwen/Qwen3-32B", 12}},
      {"qwen3-32b-to-14b", {"Qwen/Qwen3-32B", "Qwen/Qwen3-14B", 8}},
      {"llama3.1-8b-to-70b", {"meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", 20}},
      {"ministral-3b-to-8b",
       {"mistralai/Ministral-3-3B-Instruct-2512", "mistralai/Ministral-3-8B-Instruct-2512", 0}},
  };
  return *presets;
}

}  // namespace

absl::StatusOr<ModelSpec> KnownModelSpec(absl::string_view model_name) {
  auto it = KnownModels().find(std::string(model_name));
  if (it == KnownModels().end()) {
    return absl::NotFoundError(absl::StrCat("unknown model '", model_name, "' (known: ",
                                            absl::StrJoin(KnownModelNames(), ", "), ")"));
  }
  return it->second;
}

std::vector<std::string> KnownModelNames() {
  std::vector<std::string> names;
  for (const auto& [name, spec] : KnownModels()) names.push_back(name);
  return names;
}

std::vector<std::string> SynthPresetNames() {
  std::vector<std::string> names = {"demo-tiny"};
  for (const auto& [name, preset] : Presets()) names.push_back(name);
  return names;
}

absl::StatusOr<SynthOptions> SynthPreset(absl::string_view preset) {
  SynthOptions options;
  if (preset == "demo-tiny") {
    options.source = NeoxModelSpec("kvt-demo/tiny-4l", 4, 2, 32, 10000.0);
    options.target = NeoxModelSpec("kvt-demo/tiny-6l", 6, 2, 32, 10000.0);
    options.k = 2;
    options.dtype = DType::kFP32;
    return options;
  }
  auto it = Presets().find(std::string(preset));
  if (it == Presets().end()) {
    return absl::NotFoundError(absl::StrCat("unknown synth preset '", preset, "' (known: ",
                                            absl::StrJoin(SynthPresetNames(), ", "), ")"));
  }
  options.source = *KnownModelSpec(it->second.source);
  options.target = *KnownModelSpec(it->second.target);
  options.k = it->second.k;
  options.dtype = DType::kBF16;
  return options;
}

absl::StatusOr<Manifest> SynthManifest(const SynthOptions& options) {
  if (!std::isfinite(options.weight_scale) || options.weight_scale <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight_scale must be > 0, got ", FormatDouble(options.weight_scale)));
  }
  if (!std::isfinite(options.bias_scale) || options.bias_scale < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bias_scale must be >= 0, got ", FormatDouble(options.bias_scale)));
  }
  if (options.source.num_layers < 1 || options.target.num_layers < 1) {
    return absl::InvalidArgumentError("source and target need at least one layer");
  }
  if (options.k < 0 || options.k > options.source.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("k = ", options.k,
                                                   " must be between 1 and source.num_layers (",
                                                   options.source.num_layers, "), or 0 for all"));
  }
  if (options.mlp.has_value() && options.mlp->hidden < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp hidden must be >= 1, got ", options.mlp->hidden));
  }
  Manifest m;
  m.kind = options.mlp.has_value() ? MapperKind::kMlp : MapperKind::kRidge;
  m.mlp = options.mlp;
  m.ridge_granularity = options.ridge_granularity;  // ValidateManifest refuses it with mlp
  m.synthetic = true;
  m.lambda = 0;  // nothing was fitted, so no regularisation to report
  m.source = options.source;
  m.target = options.target;
  m.k = options.k == 0 ? options.source.num_layers : options.k;
  m.window = options.window;
  m.weights_dtype = options.dtype;
  m.created_by = options.created_by;
  for (int l = 0; l < options.target.num_layers; ++l) {
    LayerEntry entry;
    entry.target_layer = l;
    entry.sigma_k = DrawSigma(options.seed, kSigmaStreamBase + 2 * l, m.source.num_layers, m.k);
    entry.sigma_v = options.shared_sigma ? entry.sigma_k
                                         : DrawSigma(options.seed, kSigmaStreamBase + 2 * l + 1,
                                                     m.source.num_layers, m.k);
    m.layers.push_back(std::move(entry));
  }
  // Not a calibration: the generator settings, so `kvt inspect` shows how to reproduce it.
  m.calibration_yaml =
      absl::StrCat("generator: random normal", options.mlp ? " (He-scaled MLP)" : "",
                   "\nseed: ", options.seed, "\nweight_scale: ", FormatDouble(options.weight_scale),
                   "\nbias_scale: ", FormatDouble(options.bias_scale), "\n");
  if (absl::Status s = ValidateManifest(m); !s.ok()) return s;
  return m;
}

absl::Status FillSynthTensor(const SynthOptions& options, const Manifest& manifest, size_t index,
                             absl::Span<uint8_t> dst) {
  const std::vector<TensorSpec> specs = MapperTensorSpecs(manifest);
  if (index >= specs.size()) {
    return absl::OutOfRangeError(absl::StrCat("tensor index ", index, " >= ", specs.size()));
  }
  const TensorSpec& spec = specs[index];
  if (dst.size() != spec.num_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "' needs ",
                                                   spec.num_bytes(), " bytes, got ", dst.size()));
  }
  // Ridge: W [in, out], b [out]; per_head [heads, in, d_t], [heads, d_t]. MLP: the last dimension is the output, the one before it the
  // fan-in, a leading one (per_head) counts heads; a bias has no fan-in dimension.
  const bool mlp = manifest.kind == MapperKind::kMlp;
  const bool bias = absl::EndsWith(spec.name, ".bias");
  const double fan_in =
      bias ? 1.0 : static_cast<double>(spec.shape[spec.shape.size() - 2]);
  // Behind a ReLU only half the second moment survives: sqrt(2) restores it (He init).
  const double relu_gain = mlp && !absl::StrContains(spec.name, ".fc1.") ? std::sqrt(2.0) : 1.0;
  const double stddev =
      bias ? options.bias_scale : options.weight_scale * relu_gain / std::sqrt(fan_in);
  const uint64_t key = StreamKey(options.seed, index);
  const int64_t count = spec.num_elements();
  const size_t element_size = DTypeSize(spec.dtype);
  // Box-Muller: pair p gives elements 2p (cos) and 2p+1 (sin). Generated in float chunks and
  // converted, so one tensor never needs a full float copy.
  constexpr int64_t kChunk = 1 << 16;  // even, so pairs never straddle chunks
  auto generate = [&](int64_t first_chunk, int64_t end_chunk) {
    std::vector<float> values(static_cast<size_t>(std::min(count, kChunk)));
    for (int64_t c = first_chunk; c < end_chunk; ++c) {
      const int64_t start = c * kChunk;
      const int64_t n = std::min(kChunk, count - start);
      for (int64_t i = 0; i < n; i += 2) {
        const uint64_t pair = static_cast<uint64_t>(start + i) / 2;
        const double radius = std::sqrt(-2.0 * std::log(Uniform(key, 2 * pair)));
        const double angle = 2.0 * M_PI * Uniform(key, 2 * pair + 1);
        values[i] = static_cast<float>(stddev * radius * std::cos(angle));
        if (i + 1 < n) values[i + 1] = static_cast<float>(stddev * radius * std::sin(angle));
      }
      FromFloat(spec.dtype, values.data(), dst.data() + start * element_size, n);
    }
  };
  // The generator is counter-based, so chunks are independent: a multi-GB preset uses every
  // core and the bytes do not depend on the thread count.
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  const int64_t threads = std::clamp<int64_t>(
      chunks / 16, 1, std::max<int64_t>(1, std::thread::hardware_concurrency()));
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    workers.emplace_back(generate, chunks * t / threads, chunks * (t + 1) / threads);
  }
  generate(0, chunks / threads);
  for (std::thread& worker : workers) worker.join();
  return absl::OkStatus();
}

absl::Status WriteSynthMapper(const std::string& dir, const SynthOptions& options,
                              const WriteOptions& write_options) {
  absl::StatusOr<Manifest> manifest = SynthManifest(options);
  if (!manifest.ok()) return manifest.status();
  return WriteMapperDir(
      dir, *manifest, MapperTensorSpecs(*manifest),
      [&](size_t index, absl::Span<uint8_t> dst) {
        return FillSynthTensor(options, *manifest, index, dst);
      },
      write_options);
}

absl::StatusOr<std::unique_ptr<InMemoryMapper>> MakeSynthMapperInMemory(
    const SynthOptions& options) {
  absl::StatusOr<Manifest> manifest = SynthManifest(options);
  if (!manifest.ok()) return manifest.status();
  auto mapper = std::make_unique<InMemoryMapper>();
  mapper->manifest = *std::move(manifest);
  const std::vector<TensorSpec> specs = MapperTensorSpecs(mapper->manifest);
  std::map<std::string, WeightView> by_name;
  mapper->tensors.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    mapper->tensors[i].resize(specs[i].num_bytes());
    absl::Status filled =
        FillSynthTensor(options, mapper->manifest, i, absl::MakeSpan(mapper->tensors[i]));
    if (!filled.ok()) return filled;
    by_name[specs[i].name] = TensorWeightView(specs[i], mapper->tensors[i].data());
  }
  mapper->view = BuildMapperView(mapper->manifest, [&by_name](const std::string& name) {
    return by_name.at(name);
  });
  return mapper;
}

}  // namespace kvt
